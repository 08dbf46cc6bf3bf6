"""We test end to end, on the local cluster (Kubernetes 1.37: DeviceTaintRule GA), a change of one
GPU of a DRA node (NVIDIA's DRA kubelet plugin over simulated GPUs, the real scheduler), with
real agents:

* the agent taints the devices of the GPU that changes (one rule a device, in the node's pool)
  and never cordons the node: a new pod whose claim asks a device of the other GPU is Running
  while the change is under way; one whose claim asks a device of the changing GPU is found
  unschedulable meanwhile, then runs on one of the new devices; the rules go with `success`;
* a failure after the GPUs changed (the DRA plugin never republishes) keeps the taints while
  the slice is stale, says so in the reason, and still does not cordon the node.

Needs root (private mount namespaces), as tests/e2e/test_dra.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client
from migsim.cluster.processes import stop
from migsim.nvml import state as simstate

from mig_agent.core import device_taints

from .conftest import REASON, STATE, AgentNode, NodeFactory, wait_running
from .test_agent import wait_unschedulable
from .test_dra import DRA_HALF, allocated_device, claim, claiming_pod, until

LATENCY_S = 0.5  # each mutating NVML call: GPU 1's change (18 calls) takes about 9 s


def rules(node: AgentNode) -> dict[str, str]:
    """The agent's DeviceTaintRules of the node's pool: device -> rule name."""
    got = node.cluster.api.get(f"/apis/resource.k8s.io/v1/{device_taints.PLURAL}")
    return device_taints.rules_of_node(got["items"], node.name)


def on_all_1g(
    agent_node: NodeFactory, extra_profiles: Callable[[str], Path], **settings: str
) -> tuple[AgentNode, list[Any]]:
    node = agent_node(
        "2xH100-80GB", device_plugin="dra", profiles=extra_profiles(DRA_HALF), settings=settings
    )
    node.label("all-1g.10gb")
    assert node.wait_state("success", "failed", timeout=120) == "success", node.log_tail()
    assert not rules(node)
    simstate.set_latency(node.sim_state, LATENCY_S)
    return node, simstate.load_node(node.sim_state).gpus


def test_a_change_of_one_gpu_taints_only_its_devices_and_the_other_gpu_takes_new_work(
    agent_node: NodeFactory,
    namespace: str,
    core: client.CoreV1Api,
    extra_profiles: Callable[[str], Path],
) -> None:
    node, gpus = on_all_1g(agent_node, extra_profiles)
    gpu1 = {n for n, d in node.dra_devices().items() if d.get("parentUUID") == gpus[1].uuid}
    assert len(gpu1) == 7
    node.label("dra-half")
    try:
        until("GPU 1's devices tainted", lambda: set(rules(node)) == gpu1, timeout=60)
    except AssertionError:
        raise AssertionError(f"{rules(node)} {gpu1}\n{node.log_tail()}") from None
    for g in (0, 1):  # during the change: a claim on each GPU
        cel = f"device.attributes['gpu.nvidia.com'].parentUUID == '{gpus[g].uuid}'"
        claim(node, namespace, f"on-gpu-{g}", cel)
        claiming_pod(core, namespace, f"on-gpu-{g}", f"on-gpu-{g}")
    wait_running(core, namespace, "on-gpu-0", timeout=60)
    waiting = wait_unschedulable(core, namespace, "on-gpu-1")
    assert not waiting.spec.node_name and not allocated_device(node, namespace, "on-gpu-1")
    # both seen while the change was still under way, the node never cordoned
    assert node.labels()[STATE] == "pending", node.labels()
    assert not node.node().spec.unschedulable
    assert node.wait_state("success", "failed", timeout=120) == "success", node.log_tail()
    assert not rules(node) and not node.node().spec.unschedulable
    wait_running(core, namespace, "on-gpu-1", timeout=60)
    device = allocated_device(node, namespace, "on-gpu-1")
    assert node.dra_devices()[device]["profile"] == "3g.40gb"


def test_a_plugin_that_never_republishes_keeps_the_taints_and_says_so(
    agent_node: NodeFactory, extra_profiles: Callable[[str], Path]
) -> None:
    node, gpus = on_all_1g(agent_node, extra_profiles, MIG_AGENT_DEVICE_PLUGIN_TIMEOUT_S="10")
    node.label("dra-half")
    until("GPU 1's devices tainted", lambda: len(rules(node)) == 7, timeout=60)
    stop([node.procs.device_plugin])  # the plugin's pod goes on, nothing republishes
    assert node.wait_state("success", "failed", timeout=120) == "failed", node.log_tail()
    reason = node.node().metadata.annotations[REASON]
    assert "the devices of the GPUs that change stay tainted until" in reason, reason
    assert len(rules(node)) == 7 and not node.node().spec.unschedulable
