"""We test the node guard's promise on the paths issue 42 found out of it, with the in-memory
fakes of tests/unit/test_agent.py: never schedulable while the node advertises devices NVML no
longer holds, nor while a pod the agent evicted still runs on a GPU that changes, nor between
the tries of a drain; and never saying what is not so. Each test failed before the guard
(mig_agent.agent.guard) kept what the node is owed as a record on the node."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from mig_agent.agent import Agent, Outcome
from mig_agent.core.errors import (
    EvictionUnsupported,
    GpuResetRequired,
    KubeForbidden,
    LabelsChanged,
    Stopping,
)
from mig_agent.core.gpu_models import MODELS
from tests.unit.fake_cluster import FakeCluster

from .fake_gpus import FakeGpus
from .test_agent import CONFIG, NODE, STATE, assert_clean, label, make
from .test_agent_after_gpus_changed import advertises_what_nvml_holds

REASON = "mig-agent.dev/reason"
GUARD = "mig-agent.dev/guard"


def _plugin_failing_after_the_change(agent: Agent, cluster: FakeCluster) -> Any:
    """A first pass changes the GPUs and its plugin never comes back: the node stays cordoned
    over a stale listing. Returns the plugin's player, to bring it back."""
    plugin = cluster.on_change
    cluster.on_change = None
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    node = cluster.nodes[NODE]
    assert node.unschedulable and not advertises_what_nvml_holds(cluster, _gpus(agent))
    return plugin


def _gpus(agent: Agent) -> FakeGpus:
    assert isinstance(agent.gpus, FakeGpus)
    return agent.gpus


def test_a_typo_in_the_next_layout_keeps_the_cordon_over_a_stale_listing_path_1() -> None:
    agent, cluster, gpus = make(operands=False, device_plugin_timeout_s=5.0)
    _plugin_failing_after_the_change(agent, cluster)
    label(cluster, "all-1g.10gbb")  # misspelt: fails before any phase
    result = agent.reconcile_once()
    node = cluster.nodes[NODE]
    assert result.outcome is Outcome.FAILED
    assert node.unschedulable, "uncordoned over a listing of devices that are gone"
    assert "stays cordoned until the device plugin advertises" in node.annotations[REASON]
    assert result.retry_after_s is not None


def test_a_drain_refused_after_the_gpus_changed_keeps_the_cordon_and_says_so_path_1() -> None:
    agent, cluster, gpus = make(operands=False, device_plugin_timeout_s=5.0)
    plugin = _plugin_failing_after_the_change(agent, cluster)

    def stale(c: FakeCluster) -> None:  # back, but listing the GPUs as they were
        plugin(c)
        c.patch_node_resources(NODE, {"nvidia.com/gpu": 8, "nvidia.com/mig-1g.10gb": 0})

    cluster.on_change = stale
    stale(cluster)
    cluster.add_pod("work", "bare", NODE, gpu={"nvidia.com/mig-1g.10gb": 1}, owner="")
    label(cluster, "all-balanced")
    result = agent.reconcile_once()
    node = cluster.nodes[NODE]
    assert result.outcome is Outcome.FAILED and "bare" in node.annotations[REASON]
    assert node.unschedulable
    reason = node.annotations[REASON]
    assert "nothing was touched" not in reason, reason
    assert "stays cordoned until the device plugin advertises" in reason, reason


def test_the_label_removed_after_the_gpus_changed_readvertises_before_uncordoning_path_1() -> None:
    agent, cluster, gpus = make(operands=False, device_plugin_timeout_s=5.0)
    plugin = _plugin_failing_after_the_change(agent, cluster)
    cluster.patch_node(NODE, labels={CONFIG: None})
    assert agent.reconcile_once().outcome is Outcome.IDLE
    assert cluster.nodes[NODE].unschedulable  # no plugin to prove the listing yet
    cluster.on_change = plugin
    plugin(cluster)
    assert agent.reconcile_once().outcome is Outcome.IDLE
    assert advertises_what_nvml_holds(cluster, gpus)
    assert_clean(cluster)


def _mode_change_stuck(gpus: FakeGpus, then: BaseException) -> None:
    """GPU 1's MIG mode change is where the pass ends (``then``), GPU 0 changed before it."""
    set_mode = gpus.set_mig_mode

    def stuck_on_gpu_1(gpu: int, *, enabled: bool) -> None:
        if gpu == 1:
            raise then
        set_mode(gpu, enabled=enabled)

    gpus.set_mig_mode = stuck_on_gpu_1  # type: ignore[method-assign]


def test_a_stop_mid_apply_keeps_the_cordon_for_the_next_agent_path_2() -> None:
    agent, cluster, gpus = make(FakeGpus([MODELS["A100-40GB"]] * 2), operands=False)
    _mode_change_stuck(gpus, Stopping())
    label(cluster, "all-1g.5gb")
    assert agent.reconcile_once().outcome is Outcome.STOPPED
    node = cluster.nodes[NODE]
    assert gpus.observe().gpus[0].mig_current  # GPU 0 changed
    assert not advertises_what_nvml_holds(cluster, gpus)
    assert node.unschedulable, "uncordoned advertising the GPUs as they were"
    assert json.loads(node.annotations[GUARD])["gpus"]
    # the next agent (a new pod of the DaemonSet) reads the record and keeps the promise
    _mode_change_stuck(gpus, GpuResetRequired("GPU 1: MIG mode change pending", gpu=1))
    restarted = Agent(agent.settings, cluster, gpus, agent.load_catalog, clock=agent.clock)
    restarted.reload_config()
    assert restarted.reconcile_once().outcome is Outcome.FAILED
    assert advertises_what_nvml_holds(cluster, gpus)
    assert_clean(cluster)


def test_a_relabel_mid_apply_keeps_the_cordon_until_the_listing_is_proven_path_2() -> None:
    agent, cluster, gpus = make(FakeGpus([MODELS["A100-40GB"]] * 2), operands=False)
    relabel = LabelsChanged("layout label changed", labels={CONFIG: None})
    _mode_change_stuck(gpus, relabel)
    label(cluster, "all-1g.5gb")
    assert agent.reconcile_once().outcome is Outcome.SUPERSEDED
    assert cluster.nodes[NODE].unschedulable, "uncordoned advertising the GPUs as they were"
    cluster.patch_node(NODE, labels={CONFIG: None})
    assert agent.reconcile_once().outcome is Outcome.IDLE  # readvertised, then uncordoned
    assert advertises_what_nvml_holds(cluster, gpus)
    assert_clean(cluster)


def _one_goes_slowly_one_is_refused(
    cluster: FakeCluster, refused_name: str, refusal: Callable[[], Exception]
) -> tuple[Any, Any, Any, list[Any]]:
    """Two GPU pods: work/checkpointing, whose eviction is granted and which lingers
    terminating, and ``refused_name``, whose every eviction raises a new ``refusal()``.
    Returns the two, the cluster's own evict (to put back) and the pods each eviction was
    asked for."""
    going = cluster.add_pod("work", "checkpointing", NODE, gpu={"nvidia.com/gpu": 1})
    other = cluster.add_pod("work", refused_name, NODE, gpu={"nvidia.com/gpu": 1})
    cluster.linger.add(going)
    evict = cluster.evict
    tries: list[Any] = []

    def refused_for_one(ref: Any) -> None:
        tries.append(ref)
        if ref == other:
            raise refusal()
        evict(ref)

    cluster.evict = refused_for_one  # type: ignore[method-assign]
    return going, other, evict, tries


def test_an_eviction_error_mid_round_keeps_the_cordon_while_evicted_pods_run_path_5() -> None:
    agent, cluster, gpus = make(drain_timeout_s=30.0, drain_give_up_s=100.0)

    def refused() -> Exception:
        return KubeForbidden("evict pod work/webhooked: 403 denied by a webhook", status=403)

    going, _, evict, _ = _one_goes_slowly_one_is_refused(cluster, "webhooked", refused)
    label(cluster, "all-balanced")
    result = agent.reconcile_once()
    node = cluster.nodes[NODE]
    assert result.outcome is Outcome.FAILED and result.retry_after_s
    assert cluster.pods[going].terminating
    assert node.unschedulable, "uncordoned while an evicted pod still runs"
    assert "work/checkpointing" in node.annotations[REASON]
    assert not gpus.calls
    # the give-up applies: tries end after drain_give_up_s, not for ever
    for _ in range(8):  # each retry after its back-off
        agent.clock.sleep(result.retry_after_s or 0.0)
        result = agent.reconcile_once()
    assert "given up" in cluster.nodes[NODE].annotations[REASON], result
    cluster.pods.pop(going)
    cluster.evict = evict  # type: ignore[method-assign]
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert_clean(cluster)


def test_a_gpu_pod_bound_after_the_drains_look_is_drained_before_the_gpus_change_path_6() -> None:
    agent, cluster, gpus = make()
    first = cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1})
    late: list[Any] = []
    evict = cluster.evict

    def bind_one_more(ref: Any) -> None:
        evict(ref)
        if not late:  # bound by name while the drain evicts: the cordon does not stop it
            late.append(cluster.add_pod("work", "by-name", NODE, gpu={"nvidia.com/gpu": 1}))

    cluster.evict = bind_one_more  # type: ignore[method-assign]
    apply_calls: list[int] = []
    destroy = gpus.set_mig_mode

    def no_pod_on_changing_devices(gpu: int, *, enabled: bool) -> None:
        apply_calls.append(len([p for p in cluster.pods if p.name == "by-name"]))
        destroy(gpu, enabled=enabled)

    gpus.set_mig_mode = no_pod_on_changing_devices  # type: ignore[method-assign]
    label(cluster, "all-balanced")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert first in cluster.evicted and late and late[0] in cluster.evicted
    assert apply_calls and not any(apply_calls), "a GPU changed under a pod never drained"
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert_clean(cluster)


def test_a_pod_under_two_budgets_fails_the_drain_at_once_path_3() -> None:
    agent, cluster, gpus = make(drain_timeout_s=30.0, drain_give_up_s=100.0)

    def refused() -> Exception:  # what the client raises at the API server's first 500
        return EvictionUnsupported(
            "eviction of pod work/doubly-budgeted refused: more than one PodDisruptionBudget "
            "covers it (work/a, work/b)",
            pod="work/doubly-budgeted",
            pdbs=("work/a", "work/b"),
        )

    going, doubly, evict, tries = _one_goes_slowly_one_is_refused(
        cluster, "doubly-budgeted", refused
    )
    label(cluster, "all-balanced")
    result = agent.reconcile_once()
    node = cluster.nodes[NODE]
    assert result.outcome is Outcome.FAILED
    assert tries.count(doubly) == 1, "a refusal no retry ends was tried again"
    assert not gpus.calls
    reason = node.annotations[REASON]
    assert "work/doubly-budgeted" in reason and "work/a, work/b" in reason
    assert "nothing was touched" not in reason  # it evicted work/checkpointing
    assert node.unschedulable, "uncordoned while an evicted pod still runs"
    assert node.labels[STATE] == "failed"
    cluster.pods.pop(going)  # the evicted pod ends; the budgets are still both there
    agent.clock.sleep(result.retry_after_s or 0.0)
    assert agent.reconcile_once().outcome is Outcome.FAILED
    assert not cluster.nodes[NODE].unschedulable  # nothing runs that it evicted, no GPU changed
    assert not gpus.calls
    cluster.evict = evict  # type: ignore[method-assign]  # a budget deleted: the drain goes on
    agent.clock.sleep(3600.0)
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert_clean(cluster)


def _stop_at_the_plugins_restart(agent: Agent, cluster: FakeCluster) -> None:
    """A plugin pod not yet Ready, and SIGTERM as the guard restarts it: the wait for the new
    pod sees the stop."""
    cluster.add_pod(
        "gpu-operator",
        "dp-new",
        NODE,
        labels={"app": "nvidia-device-plugin-daemonset"},
        owner="DaemonSet",
        ready=False,
    )
    delete = cluster.delete_pod

    def stopped_then(ref: Any) -> None:
        agent.stopping.set()
        delete(ref)
        cluster.add_pod(
            "gpu-operator",
            "dp-newer",
            NODE,
            labels={"app": "nvidia-device-plugin-daemonset"},
            owner="DaemonSet",
            ready=False,
        )

    cluster.delete_pod = stopped_then  # type: ignore[method-assign]


def test_a_stop_while_a_failed_pass_readvertises_is_a_stop_with_the_cordon_kept() -> None:
    # found by the guard model: Stopping left the pass from the guard's readvertise
    agent, cluster, gpus = make(operands=False, device_plugin_timeout_s=5.0)
    _plugin_failing_after_the_change(agent, cluster)  # and still not back: the wait sleeps
    _stop_at_the_plugins_restart(agent, cluster)
    label(cluster, "all-1g.10gbb")  # misspelt: the pass fails, then readvertises
    assert agent.reconcile_once().outcome is Outcome.STOPPED
    node = cluster.nodes[NODE]
    assert node.unschedulable, "uncordoned over a listing no one proved"
    assert json.loads(node.annotations[GUARD])["gpus"]


def test_a_stop_while_the_idle_pass_readvertises_is_a_stop_with_the_cordon_kept() -> None:
    agent, cluster, gpus = make(operands=False, device_plugin_timeout_s=5.0)
    _plugin_failing_after_the_change(agent, cluster)  # and still not back: the wait sleeps
    _stop_at_the_plugins_restart(agent, cluster)
    cluster.patch_node(NODE, labels={CONFIG: None})
    assert agent.reconcile_once().outcome is Outcome.STOPPED
    assert cluster.nodes[NODE].unschedulable


def test_a_relabel_mid_drain_keeps_the_cordon_while_the_evicted_pods_run() -> None:
    # found by the guard model: the superseded pass uncordoned with an evicted pod still
    # terminating on a GPU the new layout changes too
    agent, cluster, gpus = make(drain_timeout_s=30.0)
    going = cluster.add_pod("work", "checkpointing", NODE, gpu={"nvidia.com/gpu": 1})
    cluster.linger.add(going)
    evict = cluster.evict

    def relabelled_after(ref: Any) -> None:
        evict(ref)
        cluster.patch_node(NODE, labels={CONFIG: "all-1g.10gb"})

    cluster.evict = relabelled_after  # type: ignore[method-assign]
    label(cluster, "all-balanced")
    assert agent.reconcile_once().outcome is Outcome.SUPERSEDED
    node = cluster.nodes[NODE]
    assert cluster.pods[going].terminating
    assert node.unschedulable, "uncordoned while an evicted pod still runs"
    assert json.loads(node.annotations[GUARD])["evicted"] == ["work/checkpointing"]
    assert not gpus.calls
    cluster.evict = evict  # type: ignore[method-assign]
    cluster.linger.discard(going)
    cluster.pods.pop(going)
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert_clean(cluster)


def test_a_change_after_a_failed_drain_keeps_the_cordon_over_a_stale_listing() -> None:
    # found by the guard model: a record the node kept from a failed drain (its window, pods
    # evicted) held no digest of the GPUs, and the cordon of the next try added none: the GPUs
    # changed, the plugin never listed them, and the node was uncordoned over the old listing
    agent, cluster, gpus = make(
        operands=False, drain_timeout_s=30.0, drain_give_up_s=60.0, device_plugin_timeout_s=5.0
    )
    pod = cluster.add_pod("work", "guarded", NODE, gpu={"nvidia.com/gpu": 1})
    cluster.blocked[pod] = "keep-one"
    label(cluster, "all-1g.10gb")
    first = agent.reconcile_once()
    assert first.outcome is Outcome.FAILED and GUARD in cluster.nodes[NODE].annotations
    del cluster.blocked[pod]
    cluster.on_change = None  # the plugin does not come back after the change
    agent.clock.sleep(60.0)  # the next try ends past the drain's window
    assert agent.reconcile_once().outcome is Outcome.FAILED
    node = cluster.nodes[NODE]
    assert gpus.calls, "the GPUs did not change"
    assert not advertises_what_nvml_holds(cluster, gpus)
    assert node.unschedulable, "uncordoned over a listing of devices that are gone"


def test_the_label_removed_with_the_plugin_gone_keeps_the_cordon_and_says_why() -> None:
    # found by the guard model: the idle pass kept the cordon over a listing no one proved and
    # cleared the reason, so the node said nothing of why it stayed cordoned
    agent, cluster, gpus = make(operands=False, device_plugin_timeout_s=5.0)
    _plugin_failing_after_the_change(agent, cluster)
    cluster.patch_node(NODE, labels={CONFIG: None})
    assert agent.reconcile_once().outcome is Outcome.IDLE
    node = cluster.nodes[NODE]
    assert node.unschedulable
    reason = node.annotations[REASON]
    assert "stays cordoned until the device plugin advertises" in reason, reason
    assert "app=nvidia-device-plugin-daemonset" in reason, reason


def test_a_readvertise_counts_every_plugin_pod_there_as_an_old_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 54, item 3: the guard's re-advertise (the failure, idle and stop exits) passed no
    old plugin pods, so one that outlived a short pause of its operand passed for the
    restarted one and the node could be uncordoned over the old registration."""
    from mig_agent.agent.advertisers import advertiser as advertisers

    agent, cluster, gpus = make(operands=False, device_plugin_timeout_s=5.0)
    plugin = _plugin_failing_after_the_change(agent, cluster)
    cluster.on_change = plugin
    plugin(cluster)  # a plugin pod there before the re-advertise
    there = {p.ref.uid for p in advertisers.DevicePlugin(agent.tools).find()}
    assert there, "the fake's plugin pod"
    asked: list[set[str]] = []
    real = advertisers.DevicePlugin.advertise

    def advertise(self: Any, node: Any, models: Any, paused: Any, old: set[str]) -> Any:
        asked.append(set(old))
        return real(self, node, models, paused, old)

    monkeypatch.setattr(advertisers.DevicePlugin, "advertise", advertise)
    cluster.patch_node(NODE, labels={CONFIG: None})
    assert agent.reconcile_once().outcome is Outcome.IDLE
    assert asked and there <= asked[0], (there, asked)
    assert_clean(cluster)
