"""We test the agent end to end: real agent processes on the local cluster (real API server,
controller manager, scheduler, kwok), the DaemonSet's ServiceAccount and admission policy, the
simulated device plugin and simulated GPUs:

* a label change repartitions a node: pending -> success, resources advertised, GPU pods evicted,
  other pods untouched, node uncordoned; a per-GPU layout changes only the GPUs it must;
* a PodDisruptionBudget that forbids eviction fails the pass with its name, GPUs untouched, node
  uncordoned, operands resumed; relaxed, the agent succeeds on its own;
* bad layouts fail with the reason, with no drain and no GPU mutation;
* a pod waiting for a MIG resource is scheduled once the node succeeds;
* an agent killed during the drain or the apply is replaced and the node converges;
* with the kubelet's PodResources answers, only the pods on the GPUs that change are evicted.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kubernetes import client
from migsim.cluster import agents
from migsim.nvml import state as simstate

from mig_agent.config.profiles import load_catalog
from mig_agent.core import planner, snapshot

from .conftest import REASON, STATE, AgentNode, NodeFactory, mig_counts, wait_running

DP_LABEL = "nvidia.com/gpu.deploy.device-plugin"


def pod_exists(core: client.CoreV1Api, namespace: str, name: str, uid: str) -> bool:
    try:
        return bool(core.read_namespaced_pod(name, namespace).metadata.uid == uid)
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise


def assert_clean(node: AgentNode) -> None:
    n = node.node()
    assert not n.spec.unschedulable
    labels = n.metadata.labels or {}
    assert labels.get(DP_LABEL) == "true"
    annotations = n.metadata.annotations or {}
    assert "mig-agent.dev/cordoned" not in annotations
    assert "mig-agent.dev/paused-operands" not in annotations


def wait_clean(node: AgentNode, timeout: float = 15.0) -> None:
    """assert_clean, once the agent's clean-up has had ``timeout`` seconds to land."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            assert_clean(node)
            return
        except AssertionError:
            assert time.monotonic() < deadline, node.log_tail()
            time.sleep(0.1)


def wait_unschedulable(
    core: client.CoreV1Api, namespace: str, name: str, timeout: float = 30.0
) -> Any:
    """The pod once the scheduler has tried it and found no node for it (its PodScheduled
    condition False, reason Unschedulable)."""
    deadline = time.monotonic() + timeout
    while True:
        pod = core.read_namespaced_pod(name, namespace)
        if any(
            c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
            for c in pod.status.conditions or ()
        ):
            return pod
        assert time.monotonic() < deadline, f"{name} not found unschedulable: {pod.status}"
        time.sleep(0.1)


def applied(node: AgentNode, layout: str) -> bool:
    from migsim.nvml import open_node

    catalog = load_catalog([agents.PROFILES])

    backend = open_node(node.sim_state)
    try:
        the_plan = planner.plan(
            catalog.get(layout), backend.observe(), backend.models(), destroy_in_use=True
        )
        stray = [
            gi for g in backend.observe().gpus for gi in g.gpu_instances if not gi.compute_instances
        ]
    finally:
        backend.close()
    return the_plan.is_empty and not stray


def test_label_repartitions_node_and_evicts_only_gpu_pods(
    agent_node: NodeFactory, namespace: str, gpu_pod: Any, core: client.CoreV1Api
) -> None:
    node = agent_node("8xH100-80GB")
    gpu = gpu_pod(
        namespace, "trainer", node=node.name, resources={"nvidia.com/gpu": 1}, grace_period=2
    )
    cpu = core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": "web"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node.name},
                "containers": [{"name": "web", "image": "registry.invalid/web:1"}],
            },
        },
    )
    wait_running(core, namespace, "trainer")
    wait_running(core, namespace, "web")
    seen: list[str] = []
    node.label("all-1g.10gb")
    assert node.wait_state("success", "failed", seen=seen) == "success", node.log_tail()
    assert "pending" in seen
    assert node.gpu_resources() == {"nvidia.com/mig-1g.10gb": 56}
    assert not pod_exists(core, namespace, "trainer", gpu.metadata.uid)
    assert pod_exists(core, namespace, "web", cpu.metadata.uid)
    assert_clean(node)
    assert applied(node, "all-1g.10gb")
    conditions = {c.type: c for c in node.node().status.conditions}
    assert conditions["MIGConfigApplied"].status == "True"
    events = core.list_namespaced_event(
        "default", field_selector=(f"involvedObject.kind=Node,involvedObject.name={node.name}")
    ).items
    assert {"MIGReconfiguring", "MIGConfigApplied"} <= {e.reason for e in events}


def test_per_gpu_layout_mutates_only_the_changed_gpus(
    agent_node: NodeFactory, extra_profiles: Any
) -> None:
    profiles: Path = extra_profiles("""version: v1
mig-configs:
  e2e-two-changed:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
    - devices: [2, 5]
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
""")
    node = agent_node("8xH100-80GB", profiles=profiles)
    node.label("all-1g.10gb")
    assert node.wait_state("success", "failed") == "success", node.log_tail()
    simstate.reset_call_counts(node.sim_state)
    node.label("e2e-two-changed")
    deadline = time.monotonic() + 60
    while (
        node.labels().get("nvidia.com/mig.config.state") != "success"
        or node.gpu_resources().get("nvidia.com/mig-3g.40gb") != 4
    ):
        assert time.monotonic() < deadline, node.log_tail()
        time.sleep(0.1)
    assert mig_counts(node.sim_state).gpus == {2, 5}
    assert node.gpu_resources() == {"nvidia.com/mig-1g.10gb": 42, "nvidia.com/mig-3g.40gb": 4}


def test_pdb_blocks_then_agent_succeeds_on_its_own(
    agent_node: NodeFactory, namespace: str, gpu_pod: Any, core: client.CoreV1Api
) -> None:
    node = agent_node("8xH100-80GB", settings={"MIG_AGENT_DRAIN_TIMEOUT_S": "4"})
    gpu_pod(namespace, "guarded", node=node.name, labels={"app": "guarded"})
    wait_running(core, namespace, "guarded")
    client.PolicyV1Api(core.api_client).create_namespaced_pod_disruption_budget(
        namespace,
        {
            "metadata": {"name": "keep-guarded"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}},
        },
    )
    deadline = time.monotonic() + 20
    policy = client.PolicyV1Api(core.api_client)
    while (
        policy.read_namespaced_pod_disruption_budget(
            "keep-guarded", namespace
        ).status.observed_generation
        is None
    ):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    simstate.reset_call_counts(node.sim_state)
    node.label("all-3g.40gb")
    n = node.wait_settled("failed", "success")
    assert n.metadata.labels[STATE] == "failed", node.log_tail()
    reason = n.metadata.annotations[REASON]
    assert f"{namespace}/keep-guarded" in reason
    assert mig_counts(node.sim_state).total == 0
    # cordoned between tries: no pod lands on the node only to be evicted at the next
    assert n.spec.unschedulable and "stays cordoned between tries" in reason, reason
    assert n.metadata.labels[DP_LABEL] == "true"  # operands resumed (the retry pauses them again)
    policy.patch_namespaced_pod_disruption_budget(
        "keep-guarded", namespace, {"spec": {"minAvailable": 0}}
    )
    assert node.wait_state("success", timeout=90) == "success", node.log_tail()
    assert node.gpu_resources() == {"nvidia.com/mig-3g.40gb": 16}
    assert_clean(node)


def test_unknown_and_misfit_layouts_fail_without_drain_or_gpu_mutation(
    agent_node: NodeFactory,
    namespace: str,
    gpu_pod: Any,
    core: client.CoreV1Api,
    extra_profiles: Any,
) -> None:
    profiles: Path = extra_profiles("""version: v1
mig-configs:
  e2e-too-big:
    - devices: all
      mig-enabled: true
      mig-devices: {"4g.40gb": 1, "3g.40gb": 2}
""")
    node = agent_node("8xH100-80GB", profiles=profiles)
    pod = gpu_pod(namespace, "busy", node=node.name)
    wait_running(core, namespace, "busy")
    simstate.reset_call_counts(node.sim_state)
    for layout, fragment in [
        ("all-1g.10gbx", "unknown layout 'all-1g.10gbx'"),
        ("e2e-too-big", "layout needs 12 memory slices"),
    ]:
        node.label(layout)
        assert node.wait_state("failed", "success") == "failed"
        assert fragment in node.node().metadata.annotations[REASON]
        assert not node.node().spec.unschedulable
        node.label(None)  # the agent then clears the state it reported
        assert node.wait_state("") == ""
        assert REASON not in (node.node().metadata.annotations or {})
    assert mig_counts(node.sim_state).total == 0
    assert pod_exists(core, namespace, "busy", pod.metadata.uid)


def test_pending_mig_pod_is_scheduled_once_the_node_succeeds(
    agent_node: NodeFactory, namespace: str, gpu_pod: Any, core: client.CoreV1Api
) -> None:
    node = agent_node("8xH100-80GB")
    gpu_pod(namespace, "wants-mig", node=node.name, resources={"nvidia.com/mig-1g.10gb": 1})
    pod = wait_unschedulable(core, namespace, "wants-mig")  # the scheduler looked: no node fits
    assert pod.status.phase == "Pending" and not pod.spec.node_name
    node.label("all-1g.10gb")
    assert node.wait_state("success", "failed") == "success", node.log_tail()
    pod = wait_running(core, namespace, "wants-mig", timeout=60)
    assert pod.spec.node_name == node.name


def test_agent_killed_during_drain_is_replaced_and_node_converges(
    agent_node: NodeFactory, namespace: str, gpu_pod: Any, core: client.CoreV1Api
) -> None:
    node = agent_node("8xH100-80GB")
    # a pod whose deletion takes long: the drain is still waiting when the agent dies
    gpu_pod(
        namespace,
        "slow",
        node=node.name,
        grace_period=30,
        annotations={"pod-delete.stage.kwok.x-k8s.io/delay": "6s"},
    )
    wait_running(core, namespace, "slow")
    node.label("all-2g.20gb")
    node.wait_state("pending")
    deadline = time.monotonic() + 10
    while "drain.started" not in node.log_tail(5):
        assert time.monotonic() < deadline, node.log_tail()
        time.sleep(0.05)
    agents.kill_agent(node.cluster.dir, node.name)
    assert node.node().spec.unschedulable  # the crash left the node cordoned ...
    node.restart_agent()
    assert node.wait_state("success", "failed", timeout=90) == "success", node.log_tail()
    assert applied(node, "all-2g.20gb")
    assert_clean(node)  # ... and the new agent finished the job


def test_agent_killed_during_apply_is_replaced_and_node_converges(agent_node: NodeFactory) -> None:
    node = agent_node("8xH100-80GB")
    node.label("all-1g.10gb")
    assert node.wait_state("success", "failed") == "success"
    simstate.set_latency(node.sim_state, 0.05)
    simstate.reset_call_counts(node.sim_state)
    node.label("all-balanced")
    deadline = time.monotonic() + 30
    while mig_counts(node.sim_state).total < 20:  # part-way through the apply
        assert time.monotonic() < deadline, node.log_tail()
        time.sleep(0.02)
    agents.kill_agent(node.cluster.dir, node.name)
    assert not applied(node, "all-balanced")
    simstate.clear_faults(node.sim_state)
    node.restart_agent()
    assert node.wait_state("success", "failed", timeout=90) == "success", node.log_tail()
    assert applied(node, "all-balanced")
    assert node.gpu_resources() == {
        "nvidia.com/mig-1g.10gb": 16,
        "nvidia.com/mig-2g.20gb": 8,
        "nvidia.com/mig-3g.40gb": 8,
    }
    assert_clean(node)
    text = node.node().metadata.annotations["mig-agent.dev/gpu-state"]
    import json

    state, models = snapshot.from_json(json.loads(text))
    assert planner.plan(load_catalog([agents.PROFILES]).get("all-balanced"), state, models).is_empty


def test_only_pods_on_changing_gpus_are_evicted(
    agent_node: NodeFactory,
    namespace: str,
    gpu_pod: Any,
    core: client.CoreV1Api,
    extra_profiles: Any,
) -> None:
    """The simulated device plugin hands out MIG devices lowest GPU first and tells the agent
    through the kubelet's PodResources API which pod holds which: 7 pods land on GPU 0, one on
    GPU 1; a layout that changes only GPU 0 evicts exactly those 7."""
    from mig_agent.kube.podresources import list_pod_devices

    profiles: Path = extra_profiles("""version: v1
mig-configs:
  e2e-gpu0-changes:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
    - devices: [0]
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
""")
    node = agent_node("8xH100-80GB", profiles=profiles)
    node.label("all-1g.10gb")
    assert node.wait_state("success", "failed") == "success", node.log_tail()
    pods = [
        gpu_pod(
            namespace,
            f"infer-{i}",
            node=node.name,
            grace_period=1,
            resources={"nvidia.com/mig-1g.10gb": 1},
        )
        for i in range(8)
    ]
    socket = str(node.cluster.node_dir(node.name) / "pod-resources.sock")
    deadline = time.monotonic() + 30
    while len(held := list_pod_devices(socket)) < 8:
        assert time.monotonic() < deadline, f"only {len(held)} pods hold devices"
        time.sleep(0.2)
    node.label("e2e-gpu0-changes")
    deadline = time.monotonic() + 60
    while (
        node.labels().get("nvidia.com/mig.config.state") != "success"
        or node.gpu_resources().get("nvidia.com/mig-3g.40gb") != 2
    ):
        assert time.monotonic() < deadline, node.log_tail()
        time.sleep(0.1)
    alive = [
        p.metadata.name
        for p in pods
        if pod_exists(core, namespace, p.metadata.name, p.metadata.uid)
    ]
    assert alive == ["infer-7"], alive
    assert node.gpu_resources() == {"nvidia.com/mig-1g.10gb": 49, "nvidia.com/mig-3g.40gb": 2}
