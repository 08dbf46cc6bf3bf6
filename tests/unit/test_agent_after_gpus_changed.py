"""We test what the agent does when a pass fails after its GPUs changed, and when nothing is left
to change on the GPUs but the device plugin's listing, with the in-memory fakes of
tests/unit/test_agent.py:

* a failure past the first GPU step (a failing post-apply hook, an NVML step failing mid-way,
  a MIG mode change left pending with no reboot command after other GPUs changed, a verify
  that reads the GPUs back other than the layout) restarts the device plugin and uncordons
  only once the node advertises what NVML holds; the reason says both;
* a plugin that cannot advertise the GPUs as they now are keeps the node cordoned (its reason
  says so) and the pass is retried until it does, even for a failure that is not retryable;
* nothing to change on the GPUs: no cordon and no operand pause, only the plugin restarted and
  waited for; a cordon an earlier pass left over unadvertised GPUs stays until they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mig_agent.agent import Agent, Outcome
from mig_agent.core import planner
from mig_agent.core.advertised import expected_resources
from mig_agent.core.errors import GpuResetRequired
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.labels import PAUSED
from mig_agent.core.observed import NodeState
from tests.unit.fake_cluster import FakeCluster

from .fake_gpus import FakeGpus
from .test_agent import (
    DP_LABEL,
    DP_NS,
    NODE,
    STATE,
    assert_clean,
    label,
    make,
    record_patches,
)

REASON = "mig-agent.dev/reason"
CORDONED = "mig-agent.dev/cordoned"
FAILING_HOOK = "sh -c 'echo nvidia-ctk: no such file >&2; exit 3'"


def plugin_uids(cluster: FakeCluster) -> set[str]:
    return {p.ref.uid for p in cluster.list_pods(namespace=DP_NS)}


def advertises_what_nvml_holds(cluster: FakeCluster, gpus: FakeGpus) -> bool:
    want = expected_resources(gpus.observe(), gpus.models(), "mixed")
    listed = {k: int(v) for k, v in cluster.nodes[NODE].gpu_resources().items() if int(v)}
    return listed == want


def test_a_failing_post_apply_hook_restarts_the_plugin_before_the_node_is_schedulable() -> None:
    """No operand labels: only the agent's restart brings a plugin that reads the new layout
    (before: the node was uncordoned with allocatable still naming 8 whole GPUs)."""
    agent, cluster, gpus = make(operands=False, post_apply_command=FAILING_HOOK)
    before = plugin_uids(cluster)
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED
    assert plugin_uids(cluster) and not plugin_uids(cluster) & before
    assert advertises_what_nvml_holds(cluster, gpus), cluster.nodes[NODE].allocatable
    reason = cluster.nodes[NODE].annotations[REASON]
    assert "post-apply hook" in reason and "exited with status 3" in reason
    assert "the GPUs had changed: the device plugin was restarted" in reason, reason
    assert_clean(cluster)


def test_an_nvml_step_failing_mid_way_leaves_the_node_advertising_what_nvml_holds() -> None:
    agent, cluster, gpus = make(operands=False)
    gpus.fail_on = "create_compute_instance"  # GPU 0 in MIG mode with a GPU instance already
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    assert "injected failure" in cluster.nodes[NODE].annotations[REASON]
    assert advertises_what_nvml_holds(cluster, gpus), cluster.nodes[NODE].allocatable
    assert "nvidia.com/gpu" in cluster.nodes[NODE].allocatable  # the 7 GPUs not yet touched
    assert_clean(cluster)


def _plugin_gone_for_good(agent: Agent, cluster: FakeCluster) -> None:
    cluster.on_change = None  # nobody recreates the plugin pod the agent deletes


def test_a_plugin_that_cannot_advertise_the_changed_gpus_keeps_the_node_cordoned() -> None:
    agent, cluster, gpus = make(
        operands=False, post_apply_command=FAILING_HOOK, device_plugin_timeout_s=5.0
    )
    plugin = cluster.on_change
    assert plugin is not None
    _plugin_gone_for_good(agent, cluster)
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    node = cluster.nodes[NODE]
    # a failing hook is no reason to retry; devices gone from under the plugin are
    assert result.outcome is Outcome.FAILED and result.retry_after_s is not None
    assert node.unschedulable and node.annotations[CORDONED] == "true"
    reason = node.annotations[REASON]
    assert "exited with status 3" in reason and "no new device plugin pod" in reason, reason
    assert "the node stays cordoned until" in reason, reason
    # the plugin is back and the hook fixed: the retry uncordons over the right devices
    cluster.on_change = plugin
    plugin(cluster)
    agent.settings = agent.settings.replace(post_apply_command="/bin/true")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert advertises_what_nvml_holds(cluster, gpus)
    assert_clean(cluster)


def test_a_plugin_listing_other_devices_after_the_change_keeps_the_cordon_until_it_lists_them() -> (
    None
):
    agent, cluster, gpus = make(device_plugin_timeout_s=5.0)
    honest = cluster.on_change
    assert honest is not None

    def lying(c: FakeCluster) -> None:  # lists 50 devices where the GPUs hold 56
        honest(c)
        if int(c.nodes[NODE].allocatable.get("nvidia.com/mig-1g.10gb", "0")):
            c.patch_node_resources(NODE, {"nvidia.com/mig-1g.10gb": 50})

    cluster.on_change = lying
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    node = cluster.nodes[NODE]
    assert result.outcome is Outcome.FAILED and result.retry_after_s is not None
    assert node.unschedulable and "the node stays cordoned until" in node.annotations[REASON]
    assert node.labels[DP_LABEL] == "true"  # operands resume: the plugin must run to list them
    # the retry changes no GPU: it pauses nothing and cordons nothing again, it only restarts
    # the plugin and waits; the cordon goes once the listing is right
    cluster.on_change = honest
    patches = record_patches(cluster)
    calls = sum(gpus.calls.values())
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert sum(gpus.calls.values()) == calls
    assert not any((p.get("labels") or {}).get(DP_LABEL) == PAUSED for p in patches), patches
    assert not any(p.get("unschedulable") for p in patches), patches
    assert advertises_what_nvml_holds(cluster, gpus)
    assert_clean(cluster)


def test_nothing_to_change_on_the_gpus_neither_cordons_nor_pauses() -> None:
    """The layout is on the GPUs but the last pass failed while the plugin listed other
    devices (before: every retry cordoned the node and paused its operands for the whole
    plugin timeout)."""
    agent, cluster, gpus = make(operands=False, device_plugin_timeout_s=5.0)
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    stale = plugin_uids(cluster)
    cluster.patch_node_resources(NODE, {"nvidia.com/mig-1g.10gb": 0, "nvidia.com/gpu": 8})
    cluster.patch_node(NODE, labels={STATE: "failed"}, annotations={REASON: "plugin crashed"})
    patches = record_patches(cluster)
    calls = sum(gpus.calls.values())
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert sum(gpus.calls.values()) == calls
    assert not any(p.get("unschedulable") for p in patches), patches
    assert not any(CORDONED in (p.get("annotations") or {}) for p in patches), patches
    assert plugin_uids(cluster) and not plugin_uids(cluster) & stale
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert advertises_what_nvml_holds(cluster, gpus)
    assert_clean(cluster)


def test_a_bug_mid_apply_restarts_the_plugin_too() -> None:
    """An exception that is no MigAgentError after GPU 0 changed: reported as a bug, and the
    node still advertises what NVML holds when it is uncordoned."""
    agent, cluster, gpus = make(operands=False)
    create = gpus.create_gpu_instance

    def bug(gpu: int, profile_id: int, placement: Any) -> int:
        if gpu == 1:
            raise KeyError("a bug")
        return create(gpu, profile_id, placement)

    gpus.create_gpu_instance = bug  # type: ignore[method-assign]
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s
    reason = cluster.nodes[NODE].annotations[REASON]
    assert "unexpected KeyError" in reason and "the device plugin was restarted" in reason
    assert "nvidia.com/mig-1g.10gb" in cluster.nodes[NODE].allocatable
    assert advertises_what_nvml_holds(cluster, gpus), cluster.nodes[NODE].allocatable
    assert_clean(cluster)


def test_a_mode_change_left_pending_without_a_reboot_command_readvertises_the_changed_gpus() -> (
    None
):
    """GPU 1's MIG mode change stays pending and no reboot command is set: the pass fails, but
    GPU 0 was changed first, so the plugin is restarted before the node is schedulable (before:
    uncordoned with allocatable still naming GPU 0 whole)."""
    agent, cluster, gpus = make(FakeGpus([MODELS["A100-40GB"]] * 2), operands=False)
    set_mode = gpus.set_mig_mode

    def stuck_on_gpu_1(gpu: int, *, enabled: bool) -> None:
        if gpu == 1:
            raise GpuResetRequired("GPU 1: MIG mode change pending", gpu=1)
        set_mode(gpu, enabled=enabled)

    gpus.set_mig_mode = stuck_on_gpu_1  # type: ignore[method-assign]
    before = plugin_uids(cluster)
    label(cluster, "all-1g.5gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED
    reason = cluster.nodes[NODE].annotations[REASON]
    assert "no reboot command is configured" in reason, reason
    assert "the GPUs had changed: the device plugin was restarted" in reason, reason
    assert gpus.observe().gpus[0].gpu_instances  # GPU 0 holds the layout
    assert plugin_uids(cluster) and not plugin_uids(cluster) & before
    assert advertises_what_nvml_holds(cluster, gpus), cluster.nodes[NODE].allocatable
    assert_clean(cluster)


def test_a_verify_mismatch_after_the_apply_readvertises_what_nvml_holds() -> None:
    """The GPUs read back other than the layout once every step ran (an instance lost): the
    pass fails at verify, and the plugin is restarted over what NVML holds first (before: the
    node was uncordoned over 8 whole GPUs that were gone)."""
    agent, cluster, gpus = make(operands=False)
    assert agent.catalog is not None
    layout = agent.catalog.get("all-1g.10gb")
    steps = len(planner.plan(layout, gpus.observe(), gpus.models()).steps)
    observe = gpus.observe

    def one_instance_lost_after_the_apply() -> NodeState:
        state = observe()
        if sum(gpus.calls.values()) < steps:
            return state
        last = state.gpus[-1]
        lost = dataclasses.replace(last, gpu_instances=last.gpu_instances[:-1])
        return dataclasses.replace(state, gpus=(*state.gpus[:-1], lost))

    gpus.observe = one_instance_lost_after_the_apply  # type: ignore[method-assign]
    before = plugin_uids(cluster)
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    reason = cluster.nodes[NODE].annotations[REASON]
    assert "not reached after apply" in reason, reason
    assert "the GPUs had changed: the device plugin was restarted" in reason, reason
    assert plugin_uids(cluster) and not plugin_uids(cluster) & before
    assert advertises_what_nvml_holds(cluster, gpus), cluster.nodes[NODE].allocatable
    assert_clean(cluster)
