"""We test mig-agent against the real node: it reads the real kubelet's PodResources socket to find
the pods on the GPUs that change, drains a GPU pod whose SIGTERM handler takes its time (the
kubelet, not kwok, decides when it is gone), restarts NVIDIA's plugin by deleting its DaemonSet's
pod, and reports `success` only once the real kubelet advertises the new layout -- so a pod that
waited, Pending, for a MIG device only the new layout has starts and is never refused with
UnexpectedAdmissionError.

The agent runs on the host here (test_chart.py runs it as the chart's pod), with a token bound to
a pod of its ServiceAccount on the real node, so that its RBAC and own-node admission policies
apply as on a production node."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from migsim.cluster import Cluster, agents, real_node, wait_until
from migsim.cluster.processes import Proc, free_ports, spawn, stop

from tests.node_watch import node_versions

from .conftest import REAL_NODE, busybox_pod, gone, gpu_resources, pod_log, wait_phase

CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
REPO = Path(__file__).resolve().parents[2]
# GPU 1 only: the pod on GPU 0 must stay, which only the kubelet's PodResources can tell
HALF = """version: v1
mig-configs:
  gpu1-all-1g.10gb:
    - devices: [0]
      mig-enabled: false
    - devices: [1]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
"""
TRAP = "trap 'echo got TERM; sleep 6; exit 0' TERM; while true; do sleep 0.2; done"


def _log(cluster: Cluster) -> Path:
    return cluster.dir / "logs" / f"agent-{REAL_NODE}.log"


@pytest.fixture(scope="module")
def agent(
    kubelet_node: real_node.RealNode, cluster: Cluster, core: client.CoreV1Api
) -> Iterator[Proc]:
    """mig-agent for the real node, acting as its DaemonSet's ServiceAccount."""
    agents.install(cluster)
    holder = busybox_pod("mig-agent-on-host", "sleep 86400", grace_s=1)
    holder["spec"]["serviceAccountName"] = agents.AGENT_SA
    core.create_namespaced_pod(agents.AGENT_NS, holder)
    pod = wait_phase(core, agents.AGENT_NS, "mig-agent-on-host", "Running")
    kubeconfig = cluster.kubeconfig_for(
        agents.AGENT_NS,
        agents.AGENT_SA,
        Path(kubelet_node.dir) / "agent.kubeconfig",
        bound_pod=(pod.metadata.name, pod.metadata.uid),
    )
    profiles = Path(kubelet_node.dir) / "profiles"
    shutil.copytree(REPO / "profiles", profiles, dirs_exist_ok=True)
    (profiles / "real-node.yaml").write_text(HALF)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("MIG_AGENT_")},
        "MIG_AGENT_LOG_FORMAT": "json",
        "MIG_AGENT_POLL_S": "0.2",
        "MIG_AGENT_EVICTION_RETRY_S": "1",
        "MIG_AGENT_EVICT_UNMANAGED_PODS": "true",  # the tests' pods are bare
        "MIG_AGENT_POD_RESOURCES_SOCKET": str(kubelet_node.pod_resources_socket),
    }
    proc = spawn(
        f"mig-agent@{REAL_NODE}",
        [
            sys.executable,
            "-m",
            "mig_agent",
            "run",
            "--node",
            REAL_NODE,
            "--kubeconfig",
            str(kubeconfig),
            "--backend",
            "simulated",
            "--sim-state",
            str(kubelet_node.sim_state),
            "-f",
            str(profiles),
            "--metrics-port",
            str(free_ports(1)[0]),
        ],
        _log(cluster),
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        while "mig-agent.dev/gpu-state" not in (
            core.read_node(REAL_NODE).metadata.annotations or {}
        ):
            assert proc.alive() and time.monotonic() < deadline, _log(cluster).read_text()[-3000:]
            time.sleep(0.2)
        yield proc
    finally:
        stop([proc])
        core.delete_namespaced_pod("mig-agent-on-host", agents.AGENT_NS, grace_period_seconds=0)


def _events(log: Path, event: str) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        if f'"{event}"' in line:
            out.append(json.loads(line))
    return out


def gpu_index(node: real_node.RealNode, uuid: str) -> int:
    state = json.loads(node.sim_state.read_text())
    [index] = [g["index"] for g in state["gpus"] if g["uuid"] == uuid]
    return int(index)


def _holders_published(
    node: real_node.RealNode, core: client.CoreV1Api, namespace: str, on_gpu: dict[int, str]
) -> None:
    """The agent publishes, beside its GPU state, which pod (by UID) holds which GPU, from the
    real kubelet's PodResources and the pods' start times (what advise judges evictions by)."""
    uuids = {g["index"]: g["uuid"] for g in json.loads(node.sim_state.read_text())["gpus"]}
    want = {
        core.read_namespaced_pod(name, namespace).metadata.uid: [uuids[index]]
        for index, name in on_gpu.items()
    }

    def published() -> Any:
        notes = core.read_node(REAL_NODE).metadata.annotations or {}
        holders = json.loads(notes["mig-agent.dev/gpu-state"]).get("holders", {})
        return holders if set(want) <= set(holders) else None

    holders = wait_until(published, timeout=30, what="the agent to publish the pods' devices")
    assert {uid: holders[uid] for uid in want} == want


def test_a_repartition_drains_the_slow_pod_on_its_gpu_keeps_the_other_and_starts_a_waiting_one(
    agent: Proc,
    kubelet_node: real_node.RealNode,
    cluster: Cluster,
    core: client.CoreV1Api,
    namespace: str,
) -> None:
    deadline = time.monotonic() + 60
    while gpu_resources(core) != {"nvidia.com/gpu": "2"}:
        assert time.monotonic() < deadline, gpu_resources(core)
        time.sleep(0.5)
    # one pod on each GPU (the kubelet picks which), each slow to stop
    on_gpu: dict[int, str] = {}
    for name in ("a", "b"):
        pod = busybox_pod(name, f"echo devices=$NVIDIA_VISIBLE_DEVICES; {TRAP}", grace_s=60)
        pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 1}}
        core.create_namespaced_pod(namespace, pod)
        wait_phase(core, namespace, name, "Running")
        deadline = time.monotonic() + 30
        while not (line := pod_log(core, namespace, name).strip()):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        on_gpu[gpu_index(kubelet_node, line.removeprefix("devices="))] = name
    assert sorted(on_gpu) == [0, 1], on_gpu
    _holders_published(kubelet_node, core, namespace, on_gpu)
    waiting = busybox_pod("waits-for-a-slice", "echo devices=$NVIDIA_VISIBLE_DEVICES")
    waiting["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/mig-1g.10gb": 1}}
    del waiting["spec"]["nodeName"]  # the scheduler places it once the node has the resource
    waiting["spec"]["nodeSelector"] = {"kubernetes.io/hostname": REAL_NODE}
    core.create_namespaced_pod(namespace, waiting)

    def unschedulable() -> Any:  # the scheduler has tried it: no node has the resource yet
        pod = core.read_namespaced_pod("waits-for-a-slice", namespace)
        said = {(c.type, c.status, c.reason) for c in pod.status.conditions or ()}
        return pod if ("PodScheduled", "False", "Unschedulable") in said else None

    pending = wait_until(unschedulable, timeout=30, what="the scheduler to try the waiting pod")
    assert pending.status.phase == "Pending" and not pending.spec.node_name

    started = time.monotonic()
    core.patch_node(REAL_NODE, {"metadata": {"labels": {CONFIG: "gpu1-all-1g.10gb"}}})
    seen: list[str] = []  # every state on the way (a watch on the node: none is missed)
    for n in node_versions(core, REAL_NODE, timeout=180):
        state = (n.metadata.labels or {}).get(STATE, "")
        if not seen or seen[-1] != state:
            seen.append(state)
        if state in ("success", "failed"):
            break
    else:
        raise AssertionError((seen, _log(cluster).read_text()[-4000:]))
    took = time.monotonic() - started
    # `success` only once the real kubelet advertises the layout
    assert state == "success", _log(cluster).read_text()[-4000:]
    assert gpu_resources(core) == {"nvidia.com/gpu": "1", "nvidia.com/mig-1g.10gb": "7"}
    assert "pending" in seen

    # the pod on GPU 1 was evicted and its handler ran to its end (the drain waited for the
    # kubelet: 6 s and more); the pod on GPU 0, found there through the real kubelet's
    # PodResources, was left running
    assert gone(core, namespace, on_gpu[1])
    assert took > 6, took
    evicted = [e["pod"] for e in _events(_log(cluster), "drain.pod_evicted")]
    assert evicted == [on_gpu[1]], evicted
    kept = core.read_namespaced_pod(on_gpu[0], namespace)
    assert kept.status.phase == "Running" and kept.metadata.deletion_timestamp is None

    pod = wait_phase(core, namespace, "waits-for-a-slice", "Succeeded", "Failed", timeout=60)
    assert pod.status.phase == "Succeeded", (pod.status.reason, pod.status.message)
    assert pod_log(core, namespace, "waits-for-a-slice").strip().startswith("devices=MIG-")
