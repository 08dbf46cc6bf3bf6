"""We test end to end, on the local cluster, NVIDIA's own nvidia-device-plugin and
gpu-feature-discovery running per simulated node under the node runtime (migsim.node_runtime:
the kubelet's device manager and PodResources API, NFD's labelling), with real agents:

* the node advertises what NVIDIA's plugin lists (capacity and allocatable as a kubelet writes
  them), before and after the agent repartitions it, under the mixed and the single strategy and
  with a time-slicing config; GFD's labels land on the Node and follow the layout;
* the plugin runs only while its DaemonSet pod runs: pausing the operand stops it (allocatable
  drops to 0, capacity stays, as on a kubelet), resuming or restarting the pod starts it anew;
* a GPU pod kwok runs gets free devices through the plugin's Allocate (NVIDIA_VISIBLE_DEVICES
  names them), holds a simulated GPU process on each while it runs, and the PodResources API
  reports them; the agent's drain of a busy node evicts it and the processes end.

Needs root (private mount namespaces): skips loudly otherwise.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from migsim.cluster import agents
from migsim.gpus import parse_gpu_spec  # the simulated GPUs GFD reads
from migsim.nvml import state as simstate

from mig_agent.kube.podresources import list_pod_devices

from .conftest import CONFIG, REASON, STATE, AgentNode, NodeFactory, wait_running
from .test_device_plugin_facts import TIME_SLICING

DP_LABEL = "nvidia.com/gpu.deploy.device-plugin"
H100 = parse_gpu_spec("H100-80GB")[0]
B200 = parse_gpu_spec("B200")[0]


def nvidia_node(agent_node: NodeFactory, gpus: str = "2xH100-80GB", **kw: Any) -> AgentNode:
    return agent_node(gpus, device_plugin="nvidia", **kw)


def wait_for(check: Callable[[], bool], what: str, node: AgentNode, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{node.name}: no {what} after {timeout} s\n"
                f"node runtime:\n{runtime_log(node)}\nagent:\n{node.log_tail()}"
            )
        time.sleep(0.2)


def logs(node: AgentNode) -> Path:
    return node.cluster.dir / "logs"


def runtime_log(node: AgentNode, lines: int = 25) -> str:
    path = logs(node) / f"node-runtime-{node.name}.log"
    return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else ""


def plugin_log(node: AgentNode) -> str:
    path = logs(node) / f"nvidia-device-plugin-{node.name}.log"
    return path.read_text() if path.exists() else ""


def registrations(node: AgentNode) -> list[str]:
    """The resources NVIDIA's plugin registered with the kubelet, in order, from its own log."""
    return [
        line.split("'")[1]
        for line in plugin_log(node).splitlines()
        if "Registered device plugin for '" in line
    ]


def status(node: AgentNode) -> tuple[dict[str, str], dict[str, str]]:
    """(capacity, allocatable) of the node's nvidia.com resources."""
    s = node.node().status
    return (
        {k: v for k, v in (s.capacity or {}).items() if k.startswith("nvidia.com/")},
        {k: v for k, v in (s.allocatable or {}).items() if k.startswith("nvidia.com/")},
    )


def allocations(node: AgentNode) -> dict[str, Any]:
    path = node.cluster.node_dir(node.name) / "allocations.json"
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, ValueError):
        return {}


def relabel(node: AgentNode, layout: str) -> None:
    """A new layout with the state label cleared, as `repartition` does: the last pass's
    success cannot answer for this one."""
    node.core.patch_node(node.name, {"metadata": {"labels": {CONFIG: layout, STATE: None}}})


def mig_uuids(node: AgentNode) -> set[str]:
    sim = simstate.load_node(node.sim_state)
    return {ci.uuid for g in sim.gpus for gi in g.gpu_instances for ci in gi.compute_instances}


def test_a_mixed_node_advertises_what_nvidias_plugin_lists_before_and_after_a_repartition(
    agent_node: NodeFactory,
) -> None:
    node = nvidia_node(agent_node)
    assert node.procs.device_plugin_kind == "nvidia"
    wait_for(lambda: registrations(node) == ["nvidia.com/gpu"], "a registration", node)
    wait_for(lambda: node.gpu_resources() == {"nvidia.com/gpu": 2}, "whole GPUs", node)
    # GFD's labels, published as NFD would (the strategy label the agent reads among them)
    wait_for(lambda: node.labels().get("nvidia.com/mig.strategy") == "mixed", "GFD labels", node)
    labels = node.labels()
    assert labels["nvidia.com/gpu.memory"] == str(H100.memory_total_mib)
    assert labels["nvidia.com/gpu.product"] == H100.product
    assert labels["nvidia.com/gpu.count"] == "2"
    assert "nvidia.com/gpu.memory" in node.node().metadata.annotations[
        "nfd.node.kubernetes.io/feature-labels"
    ].split(",")

    node.label("all-balanced")
    assert node.wait_state("success", "failed", timeout=120) == "success", runtime_log(node)
    want = {"nvidia.com/mig-1g.10gb": 4, "nvidia.com/mig-2g.20gb": 2, "nvidia.com/mig-3g.40gb": 2}
    assert node.gpu_resources() == want
    # the plugin was restarted by the agent and registered exactly these resources
    assert sorted(registrations(node)[1:]) == sorted(want), plugin_log(node)[-3000:]
    capacity, allocatable = status(node)
    # the whole GPUs' resource is stale: capacity stays, nothing allocatable (the kubelet's
    # stop grace period)
    assert capacity == {**{k: str(v) for k, v in want.items()}, "nvidia.com/gpu": "2"}
    assert allocatable == {**{k: str(v) for k, v in want.items()}, "nvidia.com/gpu": "0"}
    wait_for(
        lambda: node.labels().get("nvidia.com/mig-1g.10gb.count") == "4",
        "GFD's MIG labels",
        node,
        timeout=30,
    )
    assert node.labels()["nvidia.com/mig-3g.40gb.product"] == f"{H100.product}-MIG-3g.40gb"


def test_a_b200_node_is_labelled_repartitioned_and_advertised(agent_node: NodeFactory) -> None:
    """Blackwell end to end: GFD labels the simulated B200s from NVML (compute capability 10.0),
    the agent applies NVIDIA's default B200 layouts and NVIDIA's plugin advertises them."""
    node = nvidia_node(agent_node, "2xB200")
    wait_for(lambda: node.gpu_resources() == {"nvidia.com/gpu": 2}, "whole GPUs", node)
    wait_for(lambda: node.labels().get("nvidia.com/mig.strategy") == "mixed", "GFD labels", node)
    labels = node.labels()
    assert labels["nvidia.com/gpu.product"] == B200.product
    assert labels["nvidia.com/gpu.memory"] == str(B200.memory_total_mib)
    assert (labels["nvidia.com/gpu.compute.major"], labels["nvidia.com/gpu.compute.minor"]) == (
        "10",
        "0",
    )
    assert labels["nvidia.com/mig.capable"] == "true"

    node.label("all-balanced")
    assert node.wait_state("success", "failed", timeout=120) == "success", runtime_log(node)
    # per B200: 1g.23gb x2, 2g.45gb x1, 3g.90gb x1 (NVIDIA's default config)
    want = {"nvidia.com/mig-1g.23gb": 4, "nvidia.com/mig-2g.45gb": 2, "nvidia.com/mig-3g.90gb": 2}
    assert node.gpu_resources() == want
    assert sorted(registrations(node)[1:]) == sorted(want), plugin_log(node)[-3000:]

    node.core.patch_node(node.name, {"metadata": {"labels": {CONFIG: "all-1g.23gb", STATE: None}}})
    assert node.wait_state("success", "failed", timeout=120) == "success", runtime_log(node)
    assert node.gpu_resources() == {"nvidia.com/mig-1g.23gb": 14}
    wait_for(
        lambda: node.labels().get("nvidia.com/mig-1g.23gb.count") == "14",
        "GFD's MIG labels",
        node,
        timeout=30,
    )
    assert node.labels()["nvidia.com/mig-1g.23gb.product"] == f"{B200.product}-MIG-1g.23gb"
    assert len(mig_uuids(node)) == 14


def test_single_strategy_advertises_and_labels_mig_devices_as_gpus(agent_node: NodeFactory) -> None:
    node = nvidia_node(
        agent_node,
        settings={"MIG_AGENT_MIG_STRATEGY": "single"},
        plugin_args=["--mig-strategy", "single"],
    )
    wait_for(lambda: node.labels().get("nvidia.com/mig.strategy") == "single", "GFD labels", node)
    node.label("all-1g.10gb")
    assert node.wait_state("success", "failed", timeout=120) == "success", runtime_log(node)
    assert node.gpu_resources() == {"nvidia.com/gpu": 14}
    # GFD labels the MIG device, not the GPU, under single
    wait_for(
        lambda: node.labels().get("nvidia.com/gpu.count") == "14", "GFD's count", node, timeout=30
    )
    assert node.labels()["nvidia.com/gpu.product"] == f"{H100.product}-MIG-1g.10gb"


def test_a_time_sliced_node_advertises_replicas(agent_node: NodeFactory, tmp_path: Path) -> None:
    configs = tmp_path / "device-plugin-configs"
    configs.mkdir()
    (configs / "ts-1g").write_text(TIME_SLICING)
    node = nvidia_node(
        agent_node,
        settings={"MIG_AGENT_DEVICE_PLUGIN_CONFIG": str(configs)},
        plugin_args=["--config-file", str(configs / "ts-1g")],
    )
    node.core.patch_node(
        node.name,
        {
            "metadata": {
                "labels": {
                    "nvidia.com/device-plugin.config": "ts-1g",
                    "nvidia.com/mig.config": "all-1g.10gb",
                }
            }
        },
    )
    assert node.wait_state("success", "failed", timeout=120) == "success", runtime_log(node)
    assert node.gpu_resources() == {"nvidia.com/mig-1g.10gb.shared": 56}
    assert "nvidia.com/mig-1g.10gb.shared" in registrations(node)


def test_the_plugin_runs_only_while_its_pod_runs(
    agent_node: NodeFactory, core: client.CoreV1Api
) -> None:
    node = nvidia_node(agent_node)
    wait_for(lambda: registrations(node) == ["nvidia.com/gpu"], "a registration", node)
    wait_for(lambda: node.gpu_resources() == {"nvidia.com/gpu": 2}, "whole GPUs", node)
    t0 = time.monotonic()
    core.patch_node(node.name, {"metadata": {"labels": {DP_LABEL: "paused-for-mig-change"}}})
    wait_for(
        lambda: status(node) == ({"nvidia.com/gpu": "2"}, {"nvidia.com/gpu": "0"}),
        "capacity kept with nothing allocatable",
        node,
    )
    paused_s = time.monotonic() - t0
    assert "Received signal" in plugin_log(node)  # stopped, not crashed
    starts = len(registrations(node))
    core.patch_node(node.name, {"metadata": {"labels": {DP_LABEL: "true"}}})
    t0 = time.monotonic()
    wait_for(lambda: node.gpu_resources() == {"nvidia.com/gpu": 2}, "the plugin back", node)
    resumed_s = time.monotonic() - t0
    assert len(registrations(node)) == starts + 1
    # restarting the plugin pod (what the agent does after a repartition) restarts the plugin
    (pod,) = [
        p
        for p in core.list_namespaced_pod(
            agents.PLUGIN_NS, field_selector=f"spec.nodeName={node.name}"
        ).items
        if not p.metadata.deletion_timestamp
    ]
    core.delete_namespaced_pod(pod.metadata.name, agents.PLUGIN_NS)
    wait_for(lambda: len(registrations(node)) == starts + 2, "a new registration", node)
    wait_for(lambda: node.gpu_resources() == {"nvidia.com/gpu": 2}, "the plugin back", node)
    print(f"pause to allocatable 0: {paused_s:.1f} s; resume to advertised: {resumed_s:.1f} s")


def test_a_gpu_pod_gets_devices_through_allocate_and_holds_processes(
    agent_node: NodeFactory, namespace: str, gpu_pod: Any, core: client.CoreV1Api
) -> None:
    node = nvidia_node(agent_node)
    node.label("all-1g.10gb")
    assert node.wait_state("success", "failed", timeout=120) == "success", runtime_log(node)
    pod = gpu_pod(
        namespace, "cuda", node=node.name, grace_period=1, resources={"nvidia.com/mig-1g.10gb": 2}
    )
    wait_running(core, namespace, "cuda")
    key = f"{namespace}/cuda"
    wait_for(lambda: key in allocations(node), "an allocation", node, timeout=30)
    held = allocations(node)[key]
    ids = held["devices"]["nvidia.com/mig-1g.10gb"]
    assert len(ids) == 2 and set(ids) <= mig_uuids(node)
    # NVIDIA's plugin answered Allocate for exactly those devices
    assert held["env"]["NVIDIA_VISIBLE_DEVICES"].split(",") == ids
    sock = str(node.cluster.node_dir(node.name) / "pod-resources.sock")
    assert list_pod_devices(sock)[(namespace, "cuda")] == frozenset(ids)
    owner = f"pod/{pod.metadata.uid}"
    procs = simstate.processes_by_owner(node.sim_state)[owner]
    assert len(procs) == 2
    # the node is busy now: a layout without 1g devices drains the pod, its processes end and
    # the layout applies
    relabel(node, "all-3g.40gb")
    assert node.wait_state("success", "failed", timeout=120) == "success", node.log_tail()
    assert not [
        p for p in core.list_namespaced_pod(namespace).items if p.metadata.uid == pod.metadata.uid
    ]
    assert owner not in simstate.processes_by_owner(node.sim_state)
    assert node.gpu_resources() == {"nvidia.com/mig-3g.40gb": 4}
    assert key not in allocations(node)
    assert REASON not in (node.node().metadata.annotations or {})


@pytest.mark.parametrize("kind", ["bogus"])
def test_an_unknown_device_plugin_kind_is_refused(kind: str, installed: Any) -> None:
    with pytest.raises(agents.DevClusterError, match="expected one of nvidia, simulated"):
        agents.start_node(installed, "no-such-node", device_plugin=kind)
