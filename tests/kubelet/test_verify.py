"""We test ``mig-agent verify`` and ``repartition --verify`` on the real node, with the chart's
agent in the node's pod network (no hostNetwork):

* after the agent applied ``all-1g.10gb``, the seed's tiny pod as written (no hostNetwork) runs in
  the pod network and lists its one MIG device; ``verify`` passes every check, its pods deleted;
* with the node's CDI spec gone (its runtime cannot give a pod its device), ``repartition
  --verify`` applies the next layout, fails the node on ``verify``'s pod check, naming the
  runtime's words and the CDI spec, and starts no further node;
* with the device plugin gone (allocatable lacks the layout's resource), ``verify`` fails the
  ``allocatable`` check naming the resource.

The module runs in this order: each test leaves the node as the next one expects it.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from migsim.cluster import images, real_node, seed_checks
from migsim.cluster.processes import stop
from migsim.cluster.waiting import wait_until

from .conftest import NodeCluster, agent_log, helm_install, kube, wait_ready_agent

MIG = "nvidia.com/mig-1g.10gb"
SPARE = "verify-spare"  # a Node object without a kubelet: the rollout's next node


@pytest.fixture(scope="module")
def applied(node_cluster: NodeCluster) -> Iterator[NodeCluster]:
    """The chart's agent on the real node, in its pod network, having applied all-1g.10gb."""
    c = node_cluster.cluster
    helm_install(c, node_cluster.helm)
    wait_ready_agent(c)
    state = seed_checks.apply_layout(c, "all-1g.10gb", timeout=180)
    assert state == "success", agent_log(c)
    yield node_cluster
    c.kubectl("delete", "node", SPARE, "--ignore-not-found", check=False)


def mig_agent(
    nc: NodeCluster, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """The ops CLI from the operator's side, its pods of the busybox image built here (it has the
    runtime's nvidia-smi injected, as a CUDA image would)."""
    argv = [sys.executable, "-m", "mig_agent", *args, "--kubeconfig", str(nc.cluster.kubeconfig)]
    argv += ["--image", images.BUSYBOX, "--pod-timeout", "60"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def verify_pods(nc: NodeCluster) -> list[Any]:
    pods = kube(nc.cluster, "get", "pods", "-A", "-l", "app.kubernetes.io/name=mig-agent-verify")
    return [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]


def test_the_seeds_tiny_pod_runs_in_the_pod_network_and_lists_its_mig_device(
    applied: NodeCluster,
) -> None:
    c = applied.cluster
    agent = wait_ready_agent(c)
    # the chart's agent reaches the API server from the pod network
    assert not agent["spec"].get("hostNetwork"), agent["spec"]
    subnet = ipaddress.ip_network(real_node.POD_SUBNET)
    assert ipaddress.ip_address(agent["status"]["podIP"]) in subnet, agent["status"]
    pod = seed_checks.gpu_pod("seed-mig", MIG)
    assert "hostNetwork" not in pod["spec"]
    log = seed_checks.run_pod(c, pod)
    migs = [ln for ln in log.splitlines() if ln.startswith("  MIG 1g.10gb")]
    assert len(migs) == 1 and "(UUID: MIG-" in migs[0], log


def test_verify_passes_on_the_node_after_the_layout(applied: NodeCluster) -> None:
    done = mig_agent(applied, "verify", real_node.NAME, "-o", "json")
    print(done.stdout)  # shown with -rP: what an operator reads
    assert done.returncode == 0, (done.stdout, done.stderr)
    [verdict] = json.loads(done.stdout)
    assert verdict["ok"], verdict
    checks = {c["name"]: c for c in verdict["checks"]}
    assert list(checks) == ["gpu-state", "allocatable", f"pod {MIG}"]
    assert "2x H100-80GB; MIG on GPU 0,1: 14x 1g.10gb" in checks["gpu-state"]["detail"]
    assert f"{MIG}: 14" in checks["allocatable"]["detail"]
    assert "MIG 1g.10gb" in checks[f"pod {MIG}"]["detail"]
    assert verify_pods(applied) == []


def test_repartition_verify_stops_at_a_node_whose_runtime_cannot_give_the_device(
    applied: NodeCluster,
) -> None:
    c, node = applied.cluster, applied.node
    # the node's runtime loses its CDI spec, and nothing writes it again
    assert node.cdi_writer is not None
    stop([node.cdi_writer])
    node.cdi_spec.unlink()
    spare = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": SPARE}}
    c.kubectl("create", "-f", "-", input=json.dumps(spare))
    done = mig_agent(applied, "repartition", "all-2g.20gb", real_node.NAME, SPARE, "--verify")
    out = done.stdout
    print(out)
    assert done.returncode == 1, (out, done.stderr)
    assert "success; verifying" in out, out
    assert "FAIL  pod nvidia.com/mig-2g.20gb" in out, out
    assert "CDI spec" in out, out  # where to look
    assert "verify: pod nvidia.com/mig-2g.20gb" in out, out  # the node's reason in the summary
    assert f"{SPARE}" in out and "not started" in out, out
    labels = kube(c, "get", "node", SPARE)["metadata"].get("labels") or {}
    assert seed_checks.CONFIG not in labels, labels
    assert verify_pods(applied) == []


def test_verify_fails_naming_the_resource_allocatable_lacks(applied: NodeCluster) -> None:
    c = applied.cluster
    # the device plugin's pod goes: the kubelet keeps its devices out of allocatable
    c.kubectl(
        "label", "node", real_node.NAME, "--overwrite", "nvidia.com/gpu.deploy.device-plugin=false"
    )
    wait_until(
        lambda: not seed_checks.gpu_resources(c),
        timeout=60,
        what="allocatable without the plugin's devices",
        interval=0.5,
    )
    done = mig_agent(applied, "verify", real_node.NAME)
    print(done.stdout)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "FAIL  allocatable: allocatable lacks nvidia.com/mig-2g.20gb: 0 of 6" in done.stdout
    assert "look at: the device plugin's pod" in done.stdout, done.stdout
    assert "pod nvidia.com" not in done.stdout  # no pod where nothing is advertised
