"""We test mig-agent as an operator runs it: installed with the Helm chart, its DaemonSet's pod
started by the real kubelet from the image built from the Containerfile, under the RuntimeClass
`nvidia` (NVIDIA's container runtime injects NVML from the node's CDI spec), probed by the
kubelet, reaching the API server through the `kubernetes` Service. It repartitions the node's GPUs
through NVML, restarts NVIDIA's plugin pod and reports `success` once the real kubelet advertises
the layout; deleted (SIGTERM from the kubelet), its DaemonSet's next pod finds the node done and
changes nothing. With dra.deviceClasses on an upgrade, the chart's hook Job runs on the real
node and publishes the DeviceClasses; the uninstall's removes them.

On a cluster of its own: the session's may hold daemonset.yaml's objects, which Helm would refuse
to take over."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from typing import Any

import pytest
from migsim.cluster import Cluster, images, real_node
from migsim.cluster.seed_checks import CHART
from migsim.cluster.waiting import wait_until

from mig_agent.config.profiles import load_catalog
from mig_agent.core import device_classes

from .conftest import (
    CONFIG,
    STATE,
    NodeCluster,
    agent_log,
    agent_pods,
    busybox_pod,
    helm_install,
    kube,
    wait_ready_agent,
    wait_state,
)

METRICS_PORT = 9400  # the chart's metrics.port


@pytest.fixture(scope="module")
def chart(node_cluster: NodeCluster) -> Cluster:
    """The chart installed on the node's cluster with the image built here."""
    helm_install(node_cluster.cluster, node_cluster.helm)
    return node_cluster.cluster


def agent_metrics(pod: dict[str, Any]) -> str:
    """The chart's agent's /metrics, at its pod's address in the pod network and the chart's
    port ("" if none)."""
    url = f"http://{pod['status']['podIP']}:{METRICS_PORT}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())
    except OSError:
        return ""


def first_pass_done(metrics: str) -> str:
    return metrics if 'mig_agent_state{state="success"} 1.0' in metrics else ""


def test_the_chart_runs_the_agent_on_the_real_node_and_it_repartitions(chart: Cluster) -> None:
    c = chart
    pod = wait_ready_agent(c)  # the kubelet's readiness probe passed
    assert pod["spec"]["nodeName"] == real_node.NAME
    assert pod["spec"]["runtimeClassName"] == "nvidia"
    (status,) = pod["status"]["containerStatuses"]
    assert status["containerID"].startswith("containerd://"), status
    assert status["image"].endswith(images.AGENT.split("/", 1)[1]), status

    c.kubectl("label", "node", real_node.NAME, f"{CONFIG}=all-1g.10gb")
    state, seen = wait_state(c)
    assert state == "success", (seen, agent_log(c))
    assert "pending" in seen
    allocatable = kube(c, "get", "node", real_node.NAME)["status"]["allocatable"]
    assert allocatable["nvidia.com/mig-1g.10gb"] == "14", allocatable
    annotations = kube(c, "get", "node", real_node.NAME)["metadata"]["annotations"]
    gpu_state = annotations["mig-agent.dev/gpu-state"]

    # the kubelet stops the pod (SIGTERM); the DaemonSet's next one finds the node done
    c.kubectl("delete", "pod", "-n", "mig-agent", pod["metadata"]["name"], "--wait=true")
    new = wait_ready_agent(c)
    assert new["metadata"]["uid"] != pod["metadata"]["uid"]
    # the new pod's first pass is over once its metrics (its pod's address, the chart's port)
    # say success: that pass found the layout in place
    metrics = wait_until(
        lambda: first_pass_done(agent_metrics(new)),
        timeout=60,
        what="the new agent's first pass to end in success",
    )
    assert "mig_agent_reconfigurations_total{" not in metrics, metrics  # no change tried
    labels = kube(c, "get", "node", real_node.NAME)["metadata"]["labels"]
    assert labels[STATE] == "success", agent_log(c)
    after = kube(c, "get", "node", real_node.NAME)["metadata"]["annotations"]
    assert after["mig-agent.dev/gpu-state"] == gpu_state
    assert '"outcome": "applied"' not in agent_log(c)


def test_a_rollout_of_the_agent_mid_drain_is_resumed_by_its_next_pod(chart: Cluster) -> None:
    """The DaemonSet rolled while the agent waits for a pod that takes 20 s to stop: the kubelet
    sends the agent SIGTERM, the next pod picks the change up where the node stands and ends it
    in `success`, the node not left cordoned."""
    c = chart
    state, _ = wait_state(c)
    assert state == "success"
    c.kubectl("create", "namespace", "rollout")
    slow = busybox_pod(
        "slow", "trap 'sleep 20; exit 0' TERM; while true; do sleep 0.2; done", grace_s=60
    )
    slow["metadata"]["namespace"] = "rollout"
    slow["spec"]["restartPolicy"] = "Always"
    slow["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/mig-1g.10gb": 1}}
    c.kubectl("apply", "-f", "-", input=json.dumps(slow))
    deadline = time.monotonic() + 60
    while kube(c, "get", "pod", "-n", "rollout", "slow")["status"].get("phase") != "Running":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    (before,) = agent_pods(c)

    c.kubectl("label", "node", real_node.NAME, "--overwrite", f"{CONFIG}=all-3g.40gb", f"{STATE}-")
    deadline = time.monotonic() + 60
    while not kube(c, "get", "pod", "-n", "rollout", "slow")["metadata"].get("deletionTimestamp"):
        assert time.monotonic() < deadline, agent_log(c)  # the drain evicts it
        time.sleep(0.3)
    c.kubectl("rollout", "restart", "daemonset/mig-agent", "-n", "mig-agent")
    # the old pod's last words, read from the kubelet until the pod is gone
    name, said = before["metadata"]["name"], ""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        got = c.kubectl("logs", "-n", "mig-agent", name, check=False, timeout=10)
        if '"event"' not in got:  # the container is gone
            break
        said = got
        time.sleep(0.3)
    assert '"agent.stopping"' in said, said[-3000:]  # SIGTERM mid-drain
    assert '"reconcile.succeeded"' not in said.split('"layout": "all-3g.40gb"', 1)[-1]

    state, seen = wait_state(c, timeout=180)
    assert state == "success", (seen, agent_log(c))
    (after,) = agent_pods(c)
    assert after["metadata"]["uid"] != before["metadata"]["uid"]
    node = kube(c, "get", "node", real_node.NAME)
    assert node["status"]["allocatable"]["nvidia.com/mig-3g.40gb"] == "4"
    assert not node["spec"].get("unschedulable"), node["spec"]
    assert "mig-agent.dev/cordoned" not in node["metadata"]["annotations"]


def _our_classes(c: Cluster) -> dict[str, str]:
    """mig-agent's DeviceClasses (by its label): name -> the extended resource each serves."""
    got = kube(c, "get", "deviceclasses", "-l", "app.kubernetes.io/managed-by=mig-agent")
    return {d["metadata"]["name"]: d["spec"].get("extendedResourceName", "") for d in got["items"]}


def _helm(node_cluster: NodeCluster, *args: str) -> None:
    argv = [node_cluster.helm, "--kubeconfig", str(node_cluster.cluster.kubeconfig), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr


def test_the_device_class_jobs_run_on_the_real_node_at_upgrade_and_uninstall(
    node_cluster: NodeCluster, chart: Cluster
) -> None:
    """dra.deviceClasses=true on an upgrade: Helm waits for its hook Job, which the real
    kubelet runs from the chart's image under the chart's securityContext and ServiceAccount,
    publishing one class per MIG profile of the packaged layouts; the uninstall's pre-delete
    Job removes every one. Last in the module: it uninstalls the chart."""
    c = chart
    assert _our_classes(c) == {}
    _helm(
        node_cluster,
        *("upgrade", "mig-agent", str(CHART), "-n", "mig-agent", "--reuse-values"),
        *("--set", "dra.deviceClasses=true", "--timeout", "200s"),
    )
    want = device_classes.wanted(load_catalog([CHART / "files" / "profiles"]))
    assert _our_classes(c) == {n: cls["spec"]["extendedResourceName"] for n, cls in want.items()}
    assert len(want) > 10
    _helm(node_cluster, "uninstall", "mig-agent", "-n", "mig-agent", "--timeout", "200s")
    assert _our_classes(c) == {}
