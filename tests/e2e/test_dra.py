"""We test end to end, on the local cluster, nodes that run NVIDIA's DRA kubelet plugin instead of
a device plugin, as on a GPUCluster (agent_node(device_plugin="dra"): the node labelled for the
DRA driver's DaemonSet, a follower running gpu-kubelet-plugin while the node's pod runs), with
real agents:

* such a node publishes one ResourceSlice of the driver gpu.nvidia.com listing its whole GPUs
  (MIG off), and neither runs a pod of the device plugin's DaemonSet nor advertises a
  `nvidia.com/` extended resource.

Needs root (private mount namespaces): skips loudly otherwise.
"""

from __future__ import annotations

import pytest
from kubernetes import client
from migsim.cluster import agents, dra_plugin
from migsim.nvml import state as simstate

from .conftest import AgentNode, NodeFactory


@pytest.fixture
def dra_node(agent_node: NodeFactory) -> AgentNode:
    """A DRA node of 2 H100 80GB (MIG off), its slice published."""
    return agent_node("2xH100-80GB", device_plugin="dra")


def test_a_dra_node_publishes_its_whole_gpus_and_runs_no_device_plugin(
    dra_node: AgentNode, core: client.CoreV1Api
) -> None:
    gpus = simstate.load_node(dra_node.sim_state).gpus
    devices = dra_node.dra_devices()
    assert set(devices) == {f"gpu-{g.index}" for g in gpus} and len(devices) == 2
    assert {d["uuid"] for d in devices.values()} == {g.uuid for g in gpus}
    assert all(d["type"] == "gpu" for d in devices.values())
    (piece,) = dra_plugin.resource_slices(dra_node.cluster, dra_node.name)
    assert piece["spec"]["pool"]["name"] == dra_node.name

    on_node = core.list_namespaced_pod(
        agents.PLUGIN_NS, field_selector=f"spec.nodeName={dra_node.name}"
    ).items
    apps = {(p.metadata.labels or {}).get("app") for p in on_node}
    assert dra_plugin.APP in apps
    assert "nvidia-device-plugin-daemonset" not in apps
    assert agents.DEVICE_PLUGIN_NODE_LABEL not in dra_node.labels()
    assert dra_node.labels()[dra_plugin.NODE_LABEL] == "true"
    assert dra_node.gpu_resources() == {}
