"""We test what a real node does that the local cluster's kwok nodes never did (issue: what real
nodes do), each against the agent's in-memory fakes:

* a device the kubelet keeps out of allocatable (an Xid) neither fails a change nor makes a
  finished node count as interrupted; it is reported (metric, Event, condition message);
* an exception that is no MigAgentError fails the pass (undone, reported, backed off), and the
  back-off survives a week of failures; a GPU instance destroyed by hand under a plan is a
  failed step, not a StopIteration;
* a superseded pass is followed by the next at once, watch or not;
* a refused report of the agent's own (condition, Event) is logged, once per cause;
* SIGTERM ends the waits of a pass at once, and the pass undoes its marks;
* the drain as kubectl drain: DaemonSet GPU pods and bare pods are refused before the cordon,
  an evicted pod gets its own grace period (told on the node), a node is not uncordoned while
  pods the drain evicted still terminate, and an admin's cordon survives the pass;
* readiness answers from what the loop last saw, with no NVML call of its own.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

import pytest
import structlog

from mig_agent.agent import Outcome, loop, reporting
from mig_agent.agent.outcome import PassResult
from mig_agent.config.profiles import load_catalog
from mig_agent.config.settings import Settings
from mig_agent.core import planner
from mig_agent.core.advertised import plugin_listing
from mig_agent.core.errors import GpuStepFailed, KubeForbidden, Stopping
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.labels import PAUSED
from mig_agent.core.placement import Placement
from mig_agent.core.planner import CreateComputeInstance
from mig_agent.kube.cluster import NodeCondition, NodeView, PodRef
from mig_agent.node.apply import execute
from mig_agent.node.drain import GRACE_MARGIN_S
from mig_agent.node.waits import Clock
from tests.unit.fake_cluster import FakeCluster
from tests.unit.test_agent import (
    CONFIG,
    DP_LABEL,
    DP_NS,
    NODE,
    PROFILES,
    STATE,
    FakeTime,
    assert_clean,
    label,
    make,
    record_patches,
)

from .fake_gpus import FakeGpus

MIG_1G = "nvidia.com/mig-1g.10gb"
CLIENT = "nvidia.com/gpu.deploy.client"


def plugin_pod_uids(cluster: FakeCluster) -> set[str]:
    return {p.ref.uid for p in cluster.list_pods(namespace=DP_NS)}


def with_unhealthy(cluster: FakeCluster, resource: str, n: int) -> None:
    """After every change the plugin makes, ``n`` of ``resource``'s devices are unhealthy:
    still in capacity, out of allocatable (as the kubelet keeps them after an Xid)."""
    original = cluster.on_change
    assert original is not None

    def xid(c: FakeCluster) -> None:
        original(c)
        node = c.nodes[NODE]
        have = int(node.capacity.get(resource, "0"))
        if have:
            alloc = {**node.allocatable, resource: str(max(0, have - n))}
            c.nodes[NODE] = dataclasses.replace(node, allocatable=alloc)

    cluster.on_change = xid


# -- 1. unhealthy devices ----------------------------------------------------------------------


def test_the_plugins_listing_counts_unhealthy_devices_and_not_a_stopped_plugins() -> None:
    want = {MIG_1G: 56}
    # one device unhealthy: listed all the same, and told
    got = plugin_listing({MIG_1G: 56}, {MIG_1G: 55}, want)
    assert got.listed == want and got.unhealthy == {MIG_1G: 1} and got.fresh
    # a resource of the layout before, whose plugin has gone: capacity stays, allocatable 0
    got = plugin_listing({MIG_1G: 56, "nvidia.com/mig-3g.40gb": 16}, {MIG_1G: 56}, want)
    assert got.listed == want and not got.unhealthy
    # every count a stopped plugin's: they match, but nothing says a new plugin listed them
    got = plugin_listing({MIG_1G: 56}, {MIG_1G: 0}, want)
    assert got.listed == want and not got.fresh


def test_a_change_with_an_unhealthy_device_completes_and_says_so() -> None:
    """Before: the kubelet left the device out of allocatable, so the node never 'advertised'
    the layout and the pass failed DevicePluginTimeout after 300 s."""
    agent, cluster, gpus = make()
    with_unhealthy(cluster, MIG_1G, 1)
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    node = cluster.nodes[NODE]
    assert node.labels[STATE] == "success"
    assert_clean(cluster)
    condition = next(c for c in node.conditions if c.type == "MIGConfigApplied")
    assert condition.status == "True" and "1 device(s) unhealthy" in condition.message
    assert [e for e in cluster.events if e[1] == "MIGUnhealthyDevices" and e[3]]
    unhealthy = agent.metrics.registry.get_sample_value(
        "mig_agent_unhealthy_devices", {"resource": MIG_1G}
    )
    assert unhealthy == 1


def test_a_failed_node_with_its_layout_in_place_but_a_device_unhealthy_is_left_alone() -> None:
    """Before: state failed and allocatable short made every pass an interrupted one: pending,
    cordon, operands paused, device plugin restarted, every few minutes, nothing to change."""
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    with_unhealthy(cluster, MIG_1G, 7)  # a GPU fell off the bus: its seven devices
    cluster.patch_node(NODE, labels={STATE: "failed"})  # an earlier pass's verdict
    plugins = plugin_pod_uids(cluster)
    patches = record_patches(cluster)
    assert agent.reconcile_once().outcome is Outcome.NOOP
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert plugin_pod_uids(cluster) == plugins  # no restart
    assert not any(kw.get("unschedulable") for kw in patches)  # no cordon
    assert not any(PAUSED in (kw.get("labels") or {}).values() for kw in patches)  # no pause
    assert "7 device(s) unhealthy" in next(
        c.message for c in cluster.nodes[NODE].conditions if c.type == "MIGConfigApplied"
    )


def test_a_plugin_that_lists_nothing_allocatable_after_the_restart_fails_the_change() -> None:
    """Capacity keeps a stopped plugin's devices for the kubelet's grace period: counts that
    match with nothing allocatable are no proof that the new plugin listed them."""
    agent, cluster, gpus = make(device_plugin_timeout_s=20.0)
    with_unhealthy(cluster, MIG_1G, 56)
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED
    reason = cluster.nodes[NODE].annotations["mig-agent.dev/reason"]
    assert (
        f"no device of {MIG_1G} is allocatable" in reason
        and "{nvidia.com/mig-1g.10gb: 56}" in reason
    )
    # which of the two it is nobody can tell: the node takes no pod until they are allocatable
    assert cluster.nodes[NODE].unschedulable and "the node stays cordoned until" in reason


# -- 2. exceptions that are no MigAgentError ---------------------------------------------------


def test_an_unexpected_exception_fails_the_pass_undone_and_backs_off() -> None:
    """Before: only MigAgentError was caught: the exception ended the agent's loop."""
    agent, cluster, gpus = make()
    create = gpus.create_gpu_instance

    def bug(gpu: int, profile_id: int, placement: Placement) -> int:
        if gpu == 3:
            raise KeyError("a bug")
        return create(gpu, profile_id, placement)

    gpus.create_gpu_instance = bug  # type: ignore[method-assign]
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s
    node = cluster.nodes[NODE]
    assert node.labels[STATE] == "failed"
    assert "unexpected KeyError" in node.annotations["mig-agent.dev/reason"]
    assert_clean(cluster)


def test_the_back_off_survives_a_week_of_failures() -> None:
    """Before: backoff_s * 2 ** (failures - 1) raised OverflowError after 1,025 failures."""
    agent, cluster, gpus = make(backoff_max_s=300.0)
    gpus.add_process(0, 4242, None)  # no pod's: every pass fails
    label(cluster, "all-1g.10gb")
    agent.failures = 2000
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s == 300.0


def test_a_kept_gpu_instance_destroyed_under_the_plan_is_a_failed_step() -> None:
    """Before: next(...) without a default raised StopIteration out of the executor."""
    gpus = FakeGpus([MODELS["H100-80GB"]], mig_enabled=True)
    one = next(p for p in MODELS["H100-80GB"].gi_profiles if p.name == "1g.10gb")
    gi = gpus.create_gpu_instance(0, one.id, Placement(0, 1))  # no compute instance yet
    layout = load_catalog([PROFILES]).get("all-1g.10gb")
    the_plan = planner.plan(layout, gpus.observe(), gpus.models())
    assert any(
        isinstance(s, CreateComputeInstance) and s.gi_placement == Placement(0, 1)
        for s in the_plan.steps
    )
    gpus.destroy_gpu_instance(0, gi)  # by hand, after the plan
    with pytest.raises(GpuStepFailed, match="is gone"):
        execute(the_plan, gpus)


# -- 3. a superseded pass ----------------------------------------------------------------------


@dataclasses.dataclass
class ScriptedAgent:
    """What the loop needs of the agent, with passes that return what a script says."""

    results: list[PassResult]
    settings: Settings = dataclasses.field(
        default_factory=lambda: Settings(node_name=NODE, resync_s=300.0)
    )
    cluster: FakeCluster = dataclasses.field(default_factory=FakeCluster)
    clock: Clock = dataclasses.field(default_factory=Clock)
    wake_event: threading.Event = dataclasses.field(default_factory=threading.Event)
    seen: tuple[str | None, str | None] = (None, None)
    seen_plugin_labels: tuple[str | None, ...] = ()
    failures: int = 0
    loop_alive_at: float = 0.0
    watch_alive_at: float = 0.0
    watched_node: NodeView | None = None
    pass_running: bool = False
    passes: list[float] = dataclasses.field(default_factory=list)
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)

    def reconcile_once(self, *, node: NodeView | None = None) -> PassResult:
        self.passes.append(self.clock.now())
        if len(self.passes) >= len(self.results):
            self.stop.set()
        return self.results[min(len(self.passes), len(self.results)) - 1]

    def reload_config(self) -> bool:
        return False

    def report_gpu_problem(self) -> None:
        pass

    def gpu_problem(self) -> str:
        return ""

    def refresh_holders(self) -> None:
        pass


def test_a_superseded_pass_is_followed_at_once_without_a_watch() -> None:
    """Before: retry_after_s=0.0 read as 'no retry' (0.0 or resync_s): a whole resync."""
    t = FakeTime()
    agent = ScriptedAgent(
        [PassResult(Outcome.SUPERSEDED, retry_after_s=0.0), PassResult(Outcome.APPLIED)],
        clock=Clock(t.now, t.sleep, t.wait),
    )
    agent.cluster.add_node(NODE)
    agent.cluster.down = True  # no watch to wake the loop
    worker = threading.Thread(target=loop.run, args=(agent, agent.stop))
    worker.start()
    worker.join(10)
    assert not worker.is_alive()
    assert len(agent.passes) == 2 and agent.passes[1] - agent.passes[0] < 1.0, agent.passes


# -- 4. refused reports ------------------------------------------------------------------------


def test_a_refused_condition_is_logged_once_per_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: suppressed without a line: an RBAC refusal of the agent's reports was invisible."""
    # a logger of its own: the module's may have been cached by a main() run in this process
    # (logs.configure_logging caches on first use), past capture_logs' reach
    monkeypatch.setattr(reporting, "log", structlog.get_logger(reporting.__name__))
    monkeypatch.setattr(reporting, "unreported", reporting._Once())

    class Refusing(FakeCluster):
        def set_node_condition(self, name: str, condition: NodeCondition) -> None:
            raise KubeForbidden("patch node status: 403 forbidden", status=403)

    cluster = Refusing()
    cluster.add_node(NODE)
    s = Settings(node_name=NODE)
    cond = NodeCondition("MIGConfigApplied", "True", "Applied", "ok")
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            reporting.condition(cluster, s, cond)
    refused = [e for e in logs if e["event"] == "report.failed"]
    assert len(refused) == 1 and "403" in refused[0]["error"]
    assert refused[0]["report"] == "node condition"


# -- 5. SIGTERM --------------------------------------------------------------------------------


def test_a_stop_ends_the_drains_wait_at_once_and_keeps_the_cordon_for_the_evicted_pod() -> None:
    """Before: the drain waited its 300 s whatever the stop event said (the DaemonSet gives the
    agent 60 s: SIGKILL mid-pass); then the stop uncordoned the node while the pod it had
    evicted still terminated on a device about to change, `pending` saying nothing more."""
    agent, cluster, gpus = make()
    stuck = cluster.add_pod(
        "ml", "checkpointing", NODE, gpu={"nvidia.com/gpu": 1}, grace_period_s=600
    )
    cluster.linger.add(stuck)  # evicted, it terminates for as long as the test says
    label(cluster, "all-1g.10gb")
    sleep = agent.clock.sleep
    slept: list[float] = []

    def sigterm_after_a_while(seconds: float) -> None:
        slept.append(seconds)
        if sum(slept) > 5.0:
            agent.stopping.set()
        sleep(seconds)

    agent.clock = dataclasses.replace(agent.clock, sleep=sigterm_after_a_while)
    result = agent.reconcile_once()
    assert result.outcome is Outcome.STOPPED
    assert sum(slept) < 7.0
    assert not gpus.calls
    node = cluster.nodes[NODE]
    assert node.unschedulable and "mig-agent.dev/cordoned" in node.annotations
    assert node.labels[STATE] == "pending" and node.labels[DP_LABEL] == "true"
    why = json.loads(node.annotations["mig-agent.dev/guard"])["why"]
    assert "pods it evicted still run" in why and "ml/checkpointing" in why, why
    # the agent's next start, once the pod is gone, finishes the change and tidies up
    cluster.pods.pop(stuck)
    agent.stopping.clear()
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert_clean(cluster)


def test_the_agents_sleep_raises_stopping_once_told() -> None:
    agent, cluster, gpus = make()
    agent.stopping.set()
    with pytest.raises(Stopping):
        agent.clock.sleep(0.1)


# -- 6. the drain as kubectl drain -------------------------------------------------------------


def test_a_gpu_pod_with_emptydir_data_is_refused_before_the_cordon_unless_allowed() -> None:
    """Before: evicted without a word, its emptyDir data lost (kubectl drain refuses such pods
    without --delete-emptydir-data)."""
    agent, cluster, gpus = make()
    ref = cluster.add_pod("ml", "trainer", NODE, gpu={"nvidia.com/gpu": 1})
    cluster.pods[ref] = dataclasses.replace(cluster.pods[ref], empty_dirs=("scratch",))
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s
    reason = cluster.nodes[NODE].annotations["mig-agent.dev/reason"]
    assert "ml/trainer (scratch)" in reason and "emptyDir" in reason, reason
    assert "drain.deleteEmptyDirData" in reason and "nothing was touched" in reason
    assert cluster.evicted == [] and not gpus.calls
    assert_clean(cluster)
    agent.settings = dataclasses.replace(agent.settings, delete_emptydir_data=True)
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.evicted == [ref]


def test_a_daemonsets_gpu_pod_no_paused_label_stops_is_refused_before_the_cordon() -> None:
    """Before: evicted, re-created at once (DaemonSets tolerate the cordon), the pass failed
    GpuBusy at every retry with the node cordoned each time."""
    agent, cluster, gpus = make()
    cluster.add_pod("monitoring", "gpu-burn-x7", NODE, gpu={"nvidia.com/gpu": 1}, owner="DaemonSet")
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s
    reason = cluster.nodes[NODE].annotations["mig-agent.dev/reason"]
    assert "monitoring/gpu-burn-x7 (DaemonSet monitoring/gpu-burn-x7-owner)" in reason
    assert CLIENT in reason and "nothing was touched" in reason
    assert cluster.evicted == [] and not gpus.calls
    assert_clean(cluster)
    assert not any(e[1] == "MIGReconfiguring" for e in cluster.events)  # never pending


def test_a_daemonsets_gpu_pod_on_a_paused_operand_label_goes_with_the_operands() -> None:
    agent, cluster, gpus = make()
    cluster.patch_node(NODE, labels={CLIENT: "true"})
    ds = cluster.add_pod(
        "monitoring",
        "gpu-burn-x7",
        NODE,
        gpu={"nvidia.com/gpu": 1},
        owner="DaemonSet",
        node_selector={CLIENT: "true"},
    )
    original = cluster.on_change
    assert original is not None

    def daemonset_controller(c: FakeCluster) -> None:
        original(c)
        if c.nodes[NODE].labels.get(CLIENT) == PAUSED:
            c.pods.pop(ds, None)

    cluster.on_change = daemonset_controller
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert ds not in cluster.evicted
    assert cluster.nodes[NODE].labels[CLIENT] == "true"
    assert_clean(cluster)


def test_a_bare_gpu_pod_is_refused_unless_the_setting_allows_its_eviction() -> None:
    agent, cluster, gpus = make()
    bare = cluster.add_pod("ml", "notebook", NODE, gpu={"nvidia.com/gpu": 1}, owner="")
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED
    reason = cluster.nodes[NODE].annotations["mig-agent.dev/reason"]
    assert "ml/notebook have no controller" in reason
    assert "MIG_AGENT_EVICT_UNMANAGED_PODS" in reason
    assert cluster.evicted == [] and not gpus.calls
    assert_clean(cluster)

    agent.settings = agent.settings.replace(evict_unmanaged_pods=True)
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.evicted == [bare]


def lingering(agent: Any, cluster: FakeCluster, ref: PodRef, gone_after_s: float) -> None:
    """``ref``, once evicted, terminates for ``gone_after_s`` of the agent's clock."""
    cluster.linger.add(ref)
    sleep = agent.clock.sleep
    evicted_at: list[float] = []

    def watch(seconds: float) -> None:
        if ref in cluster.evicted and not evicted_at:
            evicted_at.append(agent.clock.now())
        if evicted_at and agent.clock.now() - evicted_at[0] >= gone_after_s:
            cluster.pods.pop(ref, None)
        sleep(seconds)

    agent.clock = dataclasses.replace(agent.clock, sleep=watch)


def test_an_evicted_pod_gets_its_own_grace_period_and_the_wait_is_told() -> None:
    """Before: the drain gave up at a fixed 300 s whatever the pod's grace period (600 s)."""
    agent, cluster, gpus = make()
    ref = cluster.add_pod("ml", "trainer", NODE, gpu={"nvidia.com/gpu": 1}, grace_period_s=600)
    lingering(agent, cluster, ref, gone_after_s=450.0)
    conditions: list[NodeCondition] = []
    set_condition = cluster.set_node_condition

    def recorded(name: str, condition: NodeCondition) -> None:
        conditions.append(condition)
        set_condition(name, condition)

    cluster.set_node_condition = recorded  # type: ignore[method-assign]
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    waiting = [c for c in conditions if c.reason == "DrainWaiting"]
    assert len(waiting) == 1
    assert "ml/trainer" in waiting[0].message and "600 s" in waiting[0].message
    assert waiting[0].message.endswith(", and the node stays cordoned while they run")
    assert [e for e in cluster.events if e[1] == "MIGDrainWaiting"]


def test_the_node_stays_cordoned_while_pods_the_drain_evicted_still_terminate() -> None:
    """Before: at the drain's deadline the node was uncordoned while the evicted pod still ran
    on devices about to change (and new pods could land there)."""
    agent, cluster, gpus = make()
    ref = cluster.add_pod("ml", "stuck", NODE, gpu={"nvidia.com/gpu": 1}, grace_period_s=30)
    lingering(agent, cluster, ref, gone_after_s=10_000.0)
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s
    assert agent.clock.now() >= 300.0  # drain_timeout_s, more than the pod's 30 + margin
    node = cluster.nodes[NODE]
    assert node.unschedulable and "mig-agent.dev/cordoned" in node.annotations
    assert node.labels[DP_LABEL] == "true"  # the operands resumed all the same
    assert "ml/stuck" in node.annotations["mig-agent.dev/reason"]
    assert not gpus.calls
    cluster.pods.pop(ref)  # it is gone at last: the next pass finishes the change
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert_clean(cluster)


def test_the_drain_waits_past_its_timeout_for_a_pod_with_a_longer_grace_period() -> None:
    agent, cluster, gpus = make(drain_timeout_s=60.0)
    ref = cluster.add_pod("ml", "slow", NODE, gpu={"nvidia.com/gpu": 1}, grace_period_s=120)
    lingering(agent, cluster, ref, gone_after_s=10_000.0)
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    assert agent.clock.now() >= 120 + GRACE_MARGIN_S


# -- 7. an admin's cordon ----------------------------------------------------------------------


def test_a_cordon_someone_set_during_the_pass_survives_it() -> None:
    """Before: the agent's own mark said it had cordoned, so it uncordoned at the end."""
    agent, cluster, gpus = make()
    ref = cluster.add_pod("ml", "job", NODE, gpu={"nvidia.com/gpu": 1})
    evict = cluster.evict

    def admin_cordons_meanwhile(pod: PodRef) -> None:
        evict(pod)
        # kubectl uncordon + cordon (maintenance): spec.unschedulable now kubectl's
        cluster.nodes[NODE] = dataclasses.replace(
            cluster.nodes[NODE], unschedulable=True, unschedulable_by=("kubectl-cordon",)
        )

    cluster.evict = admin_cordons_meanwhile  # type: ignore[method-assign]
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert ref in cluster.evicted
    node = cluster.nodes[NODE]
    assert node.unschedulable  # the admin's cordon stays
    assert "mig-agent.dev/cordoned" not in node.annotations  # without the agent's mark


# -- 8. readiness ------------------------------------------------------------------------------


def test_readiness_answers_from_the_last_look_without_calling_nvml() -> None:
    """Before: /readyz read every GPU through NVML per probe, and hung while a reset held the
    NVML lock."""
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    agent.report_gpu_problem()
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    held = threading.Event()

    def blocked() -> Any:  # a reset under way holds NVML
        held.wait(30)
        raise AssertionError("readiness called NVML")

    gpus.observe = blocked  # type: ignore[method-assign]
    assert agent.readiness_problem() == ""
    held.set()
    assert cluster.nodes[NODE].labels[CONFIG] == "all-1g.10gb"
