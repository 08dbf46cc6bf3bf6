"""We test these aspects of the agent's reconcile pass, with in-memory fakes of our own
Cluster and GpuBackend interfaces (the real API server is in tests/e2e):

* the happy path: pending -> cordon -> pause -> drain GPU pods only -> apply -> device plugin
  restart -> resources match -> resume -> uncordon -> success;
* nothing to do: success without drain or GPU mutation;
* failures: unknown layout, layout that does not fit, PDB, busy GPU, API down: each leaves GPUs
  untouched where it should, the node uncordoned, operands resumed, the reason on the node;
* restart safety: killed at any GPU step, a fresh agent converges and cleans up;
* an admin's cordon and an operand set to false are left alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mig_agent.agent import Agent, Outcome
from mig_agent.config.profiles import load_catalog
from mig_agent.config.settings import Settings
from mig_agent.core.advertised import expected_resources
from mig_agent.core.errors import KubeUnavailable
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.labels import PAUSED
from mig_agent.kube.cluster import NodeView, PodRef
from mig_agent.node.waits import Clock
from tests.unit.fake_cluster import FakeCluster

from .fake_gpus import FakeGpus

PROFILES = str(Path(__file__).resolve().parents[2] / "profiles")
NODE = "gpu-node-0"
DP_NS, DP_SEL = "gpu-operator", {"app": "nvidia-device-plugin-daemonset"}
CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
REASON = "mig-agent.dev/reason"
DP_LABEL = "nvidia.com/gpu.deploy.device-plugin"


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s

    def wait(self, event: threading.Event, timeout: float) -> bool:
        """The loop's wait in fake time: the timeout passes at once (a real moment, so that
        other threads get a turn)."""
        if not event.is_set():
            self.t += timeout
            time.sleep(0.001)
        return event.is_set()


class Crash(BaseException):
    """Stands in for the agent being killed."""


@contextlib.contextmanager
def running(agent: Agent, *, config_poll_s: float) -> Iterator[list[float]]:
    """Runs the agent's loop in a thread and yields the clock's time at each pass it starts; on
    leaving, stops the loop (and an OpenWatch's open watch) and waits for the thread."""
    passes: list[float] = []
    once = agent.reconcile_once

    def counted(**kw: Any) -> Any:
        passes.append(agent.clock.now())
        return once(**kw)

    agent.reconcile_once = counted  # type: ignore[method-assign]
    stop = threading.Event()
    runner = threading.Thread(
        target=agent.run, args=(stop,), kwargs={"config_poll_s": config_poll_s}
    )
    runner.start()
    try:
        yield passes
    finally:
        stop.set()
        agent.wake()
        if isinstance(agent.cluster, OpenWatch):
            agent.cluster.changes.put(None)
        runner.join(5)


def make(
    gpus: FakeGpus | None = None,
    *,
    operands: bool = True,
    cluster: FakeCluster | None = None,
    **settings: object,
) -> tuple[Agent, FakeCluster, FakeGpus]:
    gpus = gpus or FakeGpus([MODELS["H100-80GB"]] * 8)
    cluster = cluster or FakeCluster()
    labels = {DP_LABEL: "true"} if operands else {}
    cluster.add_node(NODE, labels, {"nvidia.com/gpu": "8"})

    def device_plugin(c: FakeCluster) -> None:
        # plays the DaemonSet controller and the device plugin
        node = c.nodes[NODE]
        dp = c.list_pods(
            node=NODE, namespace=DP_NS, label_selector="app=nvidia-device-plugin-daemonset"
        )
        wanted = node.labels.get(DP_LABEL, "true") == "true"
        if dp and operands and not wanted:
            c.pods.pop(dp[0].ref)
            c.patch_node_resources(NODE, {k: 0 for k in node.gpu_resources()})
        elif not dp and wanted:
            c.add_pod(
                DP_NS,
                "dp",
                NODE,
                labels=DP_SEL,
                owner="DaemonSet",
                node_selector={DP_LABEL: "true"} if operands else {},
            )
            res = expected_resources(gpus.observe(), gpus.models(), "mixed")
            c.patch_node_resources(NODE, {**{k: 0 for k in node.gpu_resources()}, **res})

    cluster.on_change = device_plugin
    device_plugin(cluster)
    t = FakeTime()
    s = Settings(node_name=NODE, **{"config": PROFILES, **settings})  # type: ignore[arg-type]
    agent = Agent(
        s, cluster, gpus, lambda p: load_catalog([p]), clock=Clock(t.now, t.sleep, t.wait, t.now)
    )
    agent.reload_config()
    return agent, cluster, gpus


def label(cluster: FakeCluster, layout: str) -> None:
    cluster.patch_node(NODE, labels={CONFIG: layout})


def assert_clean(cluster: FakeCluster) -> None:
    node = cluster.nodes[NODE]
    assert not node.unschedulable
    assert node.labels.get(DP_LABEL, "true") != PAUSED
    assert not any(
        k.startswith("mig-agent.dev/cordoned") or k.endswith("paused-operands")
        for k in node.annotations
    ), node.annotations
    # the guard's record may remember a give-up, but owes no cordon
    owed = json.loads(node.annotations.get("mig-agent.dev/guard", "{}"))
    assert not {"gpus", "evicted", "drainSince"} & set(owed), owed


def test_label_repartitions_node_and_drains_only_gpu_pods() -> None:
    agent, cluster, gpus = make()
    gpu_pod = cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1})
    cpu_pod = cluster.add_pod("work", "web", NODE)
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.APPLIED
    node = cluster.nodes[NODE]
    assert node.labels[STATE] == "success"
    assert node.gpu_resources() == {"nvidia.com/mig-1g.10gb": 56}
    assert cluster.evicted == [gpu_pod] and cpu_pod in cluster.pods
    assert_clean(cluster)
    assert any(c.type == "MIGConfigApplied" and c.status == "True" for c in node.conditions)
    assert [e[1] for e in cluster.events] == [
        "MIGReconfiguring",
        "MIGDraining",
        "MIGApplying",
        "MIGVerifying",
        "MIGDevicePluginRestart",
        "MIGConfigApplied",
    ]


def test_already_applied_is_success_without_drain_or_gpu_calls() -> None:
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    agent.reconcile_once()
    calls = sum(gpus.calls.values())
    pod = cluster.add_pod("work", "infer", NODE, gpu={"nvidia.com/mig-1g.10gb": 1})
    assert agent.reconcile_once().outcome is Outcome.NOOP
    assert sum(gpus.calls.values()) == calls and pod in cluster.pods


def test_mixed_layout_touches_only_the_changed_gpus() -> None:
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    agent.reconcile_once()
    gpus.calls.clear()
    from mig_agent.core.layout import (
        DeviceSelector,
        GpuLayout,
        Layout,
        LayoutCatalog,
        MigProfile,
        Rule,
    )

    base = agent.catalog.get("all-1g.10gb")  # type: ignore[union-attr]
    two = GpuLayout.of(True, {MigProfile.parse("3g.40gb"): 2})
    custom = Layout("two-changed", (*base.rules, Rule(DeviceSelector(frozenset({2, 5})), two)))
    agent.catalog = LayoutCatalog.of([*agent.catalog.layouts.values(), custom])  # type: ignore[union-attr]
    label(cluster, "two-changed")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert set(gpus.calls) == {2, 5}


@pytest.mark.parametrize(
    "layout,fragment",
    [
        ("all-1g.10gbb", "unknown layout 'all-1g.10gbb'; did you mean all-1g.10gb"),
        ("all-1g.18gb", "selects none of this node's GPUs"),
    ],
)
def test_bad_layout_fails_without_drain_or_gpu_mutation(layout: str, fragment: str) -> None:
    agent, cluster, gpus = make()
    pod = cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1})
    label(cluster, layout)
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s is None
    node = cluster.nodes[NODE]
    assert node.labels[STATE] == "failed" and fragment in node.annotations["mig-agent.dev/reason"]
    assert not gpus.calls and pod in cluster.pods and not cluster.evicted
    assert_clean(cluster)


def test_pdb_blocks_then_succeeds_after_it_is_relaxed() -> None:
    agent, cluster, gpus = make(drain_timeout_s=30.0)
    pod = cluster.add_pod("work", "guarded", NODE, gpu={"nvidia.com/gpu": 1})
    cluster.blocked[pod] = "keep-one"
    label(cluster, "all-balanced")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s == 5.0
    node = cluster.nodes[NODE]
    assert "PodDisruptionBudget work/keep-one" in node.annotations["mig-agent.dev/reason"]
    assert not gpus.calls
    # cordoned between tries (test_drain_retries.py), its operands resumed
    assert node.unschedulable and "stays cordoned between tries" in node.annotations[REASON]
    assert node.labels[DP_LABEL] == "true"
    assert agent.reconcile_once().retry_after_s == 10.0  # capped exponential backoff
    del cluster.blocked[pod]
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert "mig-agent.dev/reason" not in cluster.nodes[NODE].annotations
    assert_clean(cluster)


def test_a_blocked_drain_says_so_on_the_node_while_it_keeps_trying() -> None:
    """The operator sees the budget that blocks the drain at once, not at the drain timeout
    (before: only the agent's log said so, for the whole 300 s)."""
    agent, cluster, gpus = make(drain_timeout_s=30.0)
    pod = cluster.add_pod("work", "guarded", NODE, gpu={"nvidia.com/gpu": 1})
    cluster.blocked[pod] = "keep-one"
    seen: list[tuple[list[str], str]] = []
    sleep = agent.clock.sleep

    def look(seconds: float) -> None:  # what the node shows while the drain waits
        node = cluster.nodes[NODE]
        conds = [c.reason for c in node.conditions if c.type == "MIGConfigApplied"]
        seen.append(([e[1] for e in cluster.events], conds[0] if conds else ""))
        sleep(seconds)

    agent.clock = dataclasses.replace(agent.clock, sleep=look)
    label(cluster, "all-balanced")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    events, condition = seen[1]  # early in the drain, long before its 30 s deadline
    assert "MIGDrainBlocked" in events and condition == "DrainBlocked"
    (blocked,) = [e for e in cluster.events if e[1] == "MIGDrainBlocked"]
    assert blocked[3] and "PodDisruptionBudget work/keep-one" in blocked[2]
    assert events.count("MIGDrainBlocked") == 1  # once per pod, not at every retry
    assert cluster.nodes[NODE].unschedulable  # for the retry


def test_a_relabel_while_a_budget_blocks_the_drain_ends_the_pass_at_the_next_try() -> None:
    """Before: the drain kept retrying the blocked eviction, the node cordoned, until its
    deadline (300 s by default) although the layout was no longer asked for."""
    agent, cluster, gpus = make(drain_timeout_s=300.0)
    pod = cluster.add_pod("work", "guarded", NODE, gpu={"nvidia.com/gpu": 1})
    cluster.blocked[pod] = "keep-one"
    sleep = agent.clock.sleep

    def relabel_once_the_drain_waits(seconds: float) -> None:
        if cluster.nodes[NODE].labels.get(CONFIG) == "all-balanced":
            label(cluster, "all-1g.10gb")
        sleep(seconds)

    agent.clock = dataclasses.replace(agent.clock, sleep=relabel_once_the_drain_waits)
    label(cluster, "all-balanced")
    started = agent.clock.now()
    result = agent.reconcile_once()
    assert result.outcome is Outcome.SUPERSEDED and result.retry_after_s == 0.0
    assert agent.clock.now() - started <= 10.0  # the next eviction round, not the deadline
    assert not gpus.calls and pod in cluster.pods
    assert_clean(cluster)


def test_busy_gpu_after_drain_is_refused_and_left_as_it_was() -> None:
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    agent.reconcile_once()
    gi = gpus.observe().gpu(3).gpu_instances[0]
    gpus.add_process(3, 777, gi.id)  # a process outside Kubernetes
    before = gpus.observe()
    gpus.calls.clear()
    label(cluster, "all-7g.80gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s is not None
    assert "777" in cluster.nodes[NODE].annotations["mig-agent.dev/reason"]
    assert gpus.observe() == before and not gpus.calls
    assert_clean(cluster)


def test_admin_cordon_and_false_operand_are_respected() -> None:
    agent, cluster, gpus = make()
    cluster.patch_node(NODE, labels={"nvidia.com/gpu.deploy.dcgm": "false"}, unschedulable=True)
    label(cluster, "all-3g.40gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    node = cluster.nodes[NODE]
    assert node.unschedulable  # the admin's cordon stays
    assert node.labels["nvidia.com/gpu.deploy.dcgm"] == "false"


def test_device_plugin_mismatch_fails_naming_both_sides() -> None:
    agent, cluster, gpus = make(device_plugin_timeout_s=5.0)
    original = cluster.on_change
    assert original is not None

    def lying_plugin(c: FakeCluster) -> None:  # lists 50 devices where the GPUs hold 56
        original(c)
        alloc = dict(c.nodes[NODE].allocatable)
        if "nvidia.com/mig-1g.10gb" in alloc:
            alloc["nvidia.com/mig-1g.10gb"] = "50"
            c.nodes[NODE] = dataclasses.replace(c.nodes[NODE], allocatable=alloc, capacity=alloc)

    cluster.on_change = lying_plugin
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED
    reason = cluster.nodes[NODE].annotations["mig-agent.dev/reason"]
    assert "expected {nvidia.com/mig-1g.10gb: 56}" in reason
    assert "advertises {nvidia.com/mig-1g.10gb: 50}" in reason
    # the GPUs changed: cordoned until the listing is right (test_agent_after_gpus_changed.py)
    assert cluster.nodes[NODE].unschedulable and "the node stays cordoned until" in reason


def test_api_down_during_pass_is_retried() -> None:
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    cluster.fail_patch_after = 1  # the cordon patch fails
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert_clean(cluster)


# all-balanced -> all-1g.10gb on 8 H100s is 112 GPU mutations (16 + 16 destroys, 40 + 40
# creates): the crash points cover the pass from before its first mutation to its creates.
@pytest.mark.parametrize("crash_at", range(0, 112, 7))
def test_killed_during_apply_a_new_agent_converges(crash_at: int) -> None:
    """``crash_at``: how many GPU mutations succeed before the agent is killed."""
    agent, cluster, gpus = make()
    label(cluster, "all-balanced")
    agent.reconcile_once()
    label(cluster, "all-1g.10gb")
    calls = [0]
    original = gpus._mutate

    def crash(gpu: int, op: str) -> None:
        calls[0] += 1
        if calls[0] > crash_at:
            raise Crash()
        original(gpu, op)

    gpus._mutate = crash  # type: ignore[method-assign]
    with pytest.raises(Crash):  # the kill must reach the caller: no agent outlives it
        agent.reconcile_once()
    assert calls[0] == crash_at + 1  # killed at that point, not later
    gpus._mutate = original  # type: ignore[method-assign]
    fresh, _, _ = make(gpus)
    fresh.cluster = cluster
    assert fresh.reconcile_once().outcome in (Outcome.APPLIED, Outcome.NOOP)
    node = cluster.nodes[NODE]
    assert node.labels[STATE] == "success"
    assert node.gpu_resources() == {"nvidia.com/mig-1g.10gb": 56}
    assert_clean(cluster)


def test_killed_during_drain_a_new_agent_converges() -> None:
    agent, cluster, gpus = make()
    pod = cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1})
    label(cluster, "all-1g.10gb")
    original_evict = cluster.evict

    def crash(ref: PodRef) -> None:
        raise Crash()

    cluster.evict = crash  # type: ignore[method-assign]
    with pytest.raises(Crash):
        agent.reconcile_once()
    node = cluster.nodes[NODE]
    assert node.unschedulable and node.labels[STATE] == "pending"  # as the crash left it
    cluster.evict = original_evict  # type: ignore[method-assign]
    fresh, _, _ = make(gpus)
    fresh.cluster = cluster
    assert fresh.reconcile_once().outcome is Outcome.APPLIED
    assert pod not in cluster.pods
    assert_clean(cluster)


def test_mode_change_needing_reboot_reboots_once_then_fails() -> None:
    from mig_agent.core.errors import GpuResetRequired

    reboots: list[str] = []
    boots = ["boot-1"]
    agent, cluster, gpus = make(FakeGpus([MODELS["A100-40GB"]] * 2), reboot_command="/sbin/reboot")
    agent.reboot, agent.boot_id = reboots.append, lambda: boots[-1]

    def stuck(gpu: int, *, enabled: bool) -> None:
        raise GpuResetRequired("GPU 0: MIG mode change pending")

    gpus.set_mig_mode = stuck  # type: ignore[method-assign]
    label(cluster, "all-1g.5gb")
    assert agent.reconcile_once().outcome is Outcome.REBOOTING
    assert reboots == ["/sbin/reboot"]
    assert cluster.nodes[NODE].labels[STATE] == "rebooting"
    # after the reboot (a new boot, a new agent) the mode is still pending: no second reboot,
    # a clear failure
    boots.append("boot-2")
    agent, _, _ = make(gpus, reboot_command="/sbin/reboot")
    agent.cluster, agent.reboot, agent.boot_id = cluster, reboots.append, lambda: boots[-1]
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and reboots == ["/sbin/reboot"]
    assert (
        "did not take effect after rebooting"
        in cluster.nodes[NODE].annotations["mig-agent.dev/reason"]
    )
    assert_clean(cluster)


def test_gpu_state_is_published_on_the_node_and_plans_remotely() -> None:
    import json

    from mig_agent.core import planner, snapshot

    agent, cluster, gpus = make()
    agent.reconcile_once()  # no label yet: the state is published all the same
    assert "mig-agent.dev/gpu-state" in cluster.nodes[NODE].annotations
    label(cluster, "all-balanced")
    agent.reconcile_once()
    text = cluster.nodes[NODE].annotations["mig-agent.dev/gpu-state"]
    node, models = snapshot.from_json(json.loads(text))
    layout = agent.catalog.get("all-balanced")  # type: ignore[union-attr]
    assert planner.plan(layout, node, models).is_empty
    assert not planner.plan(agent.catalog.get("all-7g.80gb"), node, models).is_empty  # type: ignore[union-attr]


def test_removing_the_layout_label_clears_the_reported_state() -> None:
    agent, cluster, gpus = make()
    label(cluster, "no-such-layout")
    agent.reconcile_once()
    assert cluster.nodes[NODE].labels[STATE] == "failed"
    cluster.patch_node(NODE, labels={CONFIG: None})
    assert agent.reconcile_once().outcome is Outcome.IDLE
    node = cluster.nodes[NODE]
    assert STATE not in node.labels and "mig-agent.dev/reason" not in node.annotations


def test_watch_reconnects_after_errors_and_wakes_on_label_change() -> None:

    from mig_agent.core.errors import KubeError

    agent, cluster, gpus = make()
    agent.reconcile_once()
    stop = threading.Event()
    calls = [0]

    def flaky_watch(name: str, *, timeout_s: int) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise KubeUnavailable("connection refused")
        if calls[0] == 2:
            raise KubeError("watch node: 410 too old resource version", status=410)
        cluster.patch_node(NODE, labels={CONFIG: "all-1g.10gb"})
        yield cluster.nodes[NODE]
        stop.set()

    cluster.watch_node = flaky_watch  # type: ignore[method-assign]
    waits: list[float] = []
    original_wait = stop.wait
    stop.wait = lambda t=None: waits.append(t or 0) or original_wait(0)  # type: ignore[method-assign]
    agent.watch_forever(stop)
    assert calls[0] == 3 and waits == [1.0, 2.0]  # backed off, reconnected twice
    assert agent.wake_event.is_set()


def test_a_watch_failing_with_any_error_forgets_the_node_and_is_opened_again() -> None:
    """Before: only a MigAgentError was caught; a line that was no JSON (ValueError) or a cut
    stream (urllib3's ProtocolError) ended the watch's thread with the node left cached, and
    resyncs went on reading that stale node until the liveness probe restarted the pod."""
    import urllib3
    from structlog.testing import capture_logs

    agent, cluster, gpus = make()
    agent.reconcile_once()
    stop = threading.Event()
    calls = [0]
    failures: list[BaseException] = [
        ValueError("Expecting value: line 1 column 1 (char 0)"),
        urllib3.exceptions.ProtocolError("Connection broken: IncompleteRead"),
    ]

    def failing_watch(name: str, *, timeout_s: int) -> Any:
        calls[0] += 1
        yield cluster.nodes[NODE]
        if failures:
            raise failures.pop(0)
        stop.set()

    cluster.watch_node = failing_watch  # type: ignore[method-assign]
    cached_while_waiting: list[Any] = []
    original_wait = stop.wait

    def wait(t: float | None = None) -> bool:
        cached_while_waiting.append(agent.watched_node)
        return original_wait(0)

    stop.wait = wait  # type: ignore[method-assign]
    with capture_logs() as logs:
        agent.watch_forever(stop)
    assert calls[0] == 3  # opened again after each failure
    assert cached_while_waiting == [None, None]  # the node forgotten while the watch was down
    said = [e.get("error_type") for e in logs if e["event"] == "watch.failed"]
    assert said == ["ValueError", "ProtocolError"]


def test_config_change_is_picked_up_and_a_broken_one_keeps_the_last_good(tmp_path: Path) -> None:
    import os
    import shutil

    profiles = tmp_path / "profiles"
    shutil.copytree(PROFILES, profiles)
    agent, cluster, gpus = make(config=str(profiles))
    assert agent.reload_config() is False  # nothing changed since make() loaded it
    (profiles / "extra.yaml").write_text(
        "version: v1\nmig-configs:\n  late-layout:\n    - devices: all\n"
        '      mig-enabled: true\n      mig-devices: {"7g.80gb": 1}\n'
    )
    assert agent.reload_config() is True
    label(cluster, "late-layout")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    (profiles / "extra.yaml").write_text("version: v2\n")
    os.utime(profiles / "extra.yaml", (1, 1))
    assert agent.reload_config() is True
    assert "unknown version" in agent.catalog_error or "v1" in agent.catalog_error
    assert agent.catalog is not None and "late-layout" in agent.catalog
    # the operator sees it on the node, with what the agent goes on with
    (warning,) = [e for e in cluster.events if e[1] == "MIGConfigInvalid"]
    assert warning[3] is True and "extra.yaml" in warning[2]
    assert f"last good config ({len(agent.catalog.layouts)} layouts)" in warning[2]


def _holding(gpus: FakeGpus, gpu: int, n: int = 1) -> frozenset[str]:
    """The UUIDs of the first ``n`` MIG devices of ``gpu``."""
    cis = [ci for gi in gpus.observe().gpu(gpu).gpu_instances for ci in gi.compute_instances]
    return frozenset(ci.uuid for ci in cis[:n])


def _two_changed(agent: Agent) -> None:
    from mig_agent.core.layout import (
        DeviceSelector,
        GpuLayout,
        Layout,
        LayoutCatalog,
        MigProfile,
        Rule,
    )

    base = agent.catalog.get("all-1g.10gb")  # type: ignore[union-attr]
    two = GpuLayout.of(True, {MigProfile.parse("1g.10gb"): 5, MigProfile.parse("2g.20gb"): 1})
    custom = Layout("two-changed", (*base.rules, Rule(DeviceSelector(frozenset({2, 5})), two)))
    agent.catalog = LayoutCatalog.of([*agent.catalog.layouts.values(), custom])  # type: ignore[union-attr]


def test_with_pod_resources_only_pods_on_changing_devices_are_drained() -> None:
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    agent.reconcile_once()
    on_gpu0 = cluster.add_pod("work", "on-gpu0", NODE, gpu={"nvidia.com/mig-1g.10gb": 1})
    on_gpu5 = cluster.add_pod("work", "on-gpu5", NODE, gpu={"nvidia.com/mig-1g.10gb": 7})
    unknown = cluster.add_pod("work", "unknown", NODE, gpu={"nvidia.com/mig-1g.10gb": 1})
    holds = {("work", "on-gpu0"): _holding(gpus, 0), ("work", "on-gpu5"): _holding(gpus, 5, 7)}
    agent.pod_devices = lambda: holds
    _two_changed(agent)
    label(cluster, "two-changed")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    # GPU 5 keeps 5 of its 1g.10gb instances, but the pod holds all 7: it must go
    assert set(cluster.evicted) == {on_gpu5, unknown}
    assert on_gpu0 in cluster.pods


def test_pod_on_kept_instances_of_a_changed_gpu_stays() -> None:
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    agent.reconcile_once()
    from mig_agent.core import planner

    pod = cluster.add_pod("work", "small", NODE, gpu={"nvidia.com/mig-1g.10gb": 1})
    _two_changed(agent)
    the_plan = planner.plan(
        agent.catalog.get("two-changed"),
        gpus.observe(),  # type: ignore[union-attr]
        gpus.models(),
    )
    kept = next(d.gi_placement for d in the_plan.gpus[5].devices if d.kept)
    gi = next(g for g in gpus.observe().gpu(5).gpu_instances if g.placement == kept)
    agent.pod_devices = lambda: {("work", "small"): frozenset({gi.compute_instances[0].uuid})}
    label(cluster, "two-changed")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert pod in cluster.pods and not cluster.evicted


def test_without_pod_resources_every_gpu_pod_is_drained() -> None:
    from mig_agent.core.errors import KubeUnavailable as Down

    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    agent.reconcile_once()
    pod = cluster.add_pod("work", "on-gpu0", NODE, gpu={"nvidia.com/mig-1g.10gb": 1})

    def unreachable() -> dict[tuple[str, str], frozenset[str]]:
        raise Down("kubelet PodResources socket missing")

    agent.pod_devices = unreachable
    _two_changed(agent)
    label(cluster, "two-changed")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.evicted == [pod]


@pytest.mark.parametrize(
    "layout,fragment",
    [
        (
            "all-balanced",
            "needs one MIG profile on the whole node, the layout makes 1g.10gb, 2g.20gb, 3g.40gb",
        ),
        ("all-enabled", "at least one MIG device on every MIG GPU"),
    ],
)
def test_single_strategy_refuses_layouts_its_device_plugin_cannot_advertise(
    layout: str, fragment: str
) -> None:
    agent, cluster, gpus = make(mig_strategy="single")
    label(cluster, layout)
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s is None
    assert fragment in cluster.nodes[NODE].annotations["mig-agent.dev/reason"]
    assert not gpus.calls


def test_single_strategy_waits_for_nvidia_gpu_resources() -> None:
    agent, cluster, gpus = make(mig_strategy="single")
    original = cluster.on_change
    assert original is not None

    def single_plugin(c: FakeCluster) -> None:  # advertises as the plugin does in single mode
        original(c)
        node = c.nodes[NODE]
        if node.gpu_resources().get("nvidia.com/mig-1g.10gb"):
            res = expected_resources(gpus.observe(), gpus.models(), "single")
            listed = {
                **{k: "0" for k in node.allocatable if k.startswith("nvidia.com/")},
                **{k: str(v) for k, v in res.items()},
            }
            c.nodes[NODE] = dataclasses.replace(node, allocatable=listed, capacity=listed)

    cluster.on_change = single_plugin
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.nodes[NODE].gpu_resources() == {"nvidia.com/gpu": 56}


def test_single_strategy_problem_is_pure() -> None:
    from collections import Counter

    from mig_agent.core.advertised import single_strategy_problem

    assert single_strategy_problem({0: Counter({"1g.10gb": 7}), 1: Counter({"1g.10gb": 7})}) == ""
    assert "GPU(s) 1 would have MIG disabled" in single_strategy_problem(
        {0: Counter({"1g.10gb": 7}), 1: None}
    )
    assert single_strategy_problem({0: None, 1: None}) == ""


def test_a_device_plugin_that_never_comes_back_fails_the_pass() -> None:
    agent, cluster, gpus = make(operands=False, device_plugin_timeout_s=5.0)
    cluster.on_change = None  # nobody recreates the plugin pod the agent deletes
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s
    reason = cluster.nodes[NODE].annotations["mig-agent.dev/reason"]
    assert "no new device plugin pod" in reason and "app=nvidia-device-plugin-daemonset" in reason
    assert cluster.nodes[NODE].unschedulable and "the node stays cordoned until" in reason


def test_device_plugin_pod_is_replaced_when_no_operand_labels() -> None:
    agent, cluster, gpus = make(operands=False)
    before = {p.ref.uid for p in cluster.list_pods(namespace=DP_NS)}
    label(cluster, "all-3g.40gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    after = {p.ref.uid for p in cluster.list_pods(namespace=DP_NS)}
    assert before and after and not before & after


# -- the failures a real cluster hits (issue: agent bugs) ------------------------------------


def end_processes_on_eviction(cluster: FakeCluster, gpus: FakeGpus, gpu: int) -> None:
    """An eviction ends the processes on ``gpu``, as the evicted pod's container stops."""
    original_evict = cluster.evict

    def evict_and_end(ref: PodRef) -> None:
        original_evict(ref)
        gpus.gpus[gpu] = dataclasses.replace(gpus.gpus[gpu], processes=())

    cluster.evict = evict_and_end  # type: ignore[method-assign]


def test_mode_change_drains_the_pod_whose_process_holds_the_gpu() -> None:
    """Whole GPUs to MIG with a pod's process on GPU 0: the drain evicts it, its process ends,
    and the layout applies (before: GpuBusy before the drain, nothing ever evicted)."""
    agent, cluster, gpus = make()
    pod = cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1})
    gpus.add_process(0, 4242, None)
    end_processes_on_eviction(cluster, gpus, 0)
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.evicted == [pod]
    assert cluster.nodes[NODE].labels[STATE] == "success"


def test_a_process_that_outlives_the_drain_is_named_and_nothing_is_touched() -> None:
    agent, cluster, gpus = make(gpu_release_timeout_s=3.0)
    gpus.add_process(0, 4242, None)  # not a pod's: the drain cannot end it
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s
    assert "4242" in cluster.nodes[NODE].annotations["mig-agent.dev/reason"]
    assert not gpus.calls
    assert_clean(cluster)


def _as_a_killed_pass_left_it(cluster: FakeCluster) -> None:
    cluster.patch_node(
        NODE,
        labels={STATE: "pending", DP_LABEL: PAUSED},
        annotations={"mig-agent.dev/cordoned": "true", "mig-agent.dev/paused-operands": DP_LABEL},
        unschedulable=True,
    )


def test_marks_of_an_interrupted_pass_are_cleared_when_the_next_pass_fails_early() -> None:
    agent, cluster, gpus = make()
    _as_a_killed_pass_left_it(cluster)
    label(cluster, "all-1g.10gbx")  # a typo: the pass fails before it reaches its clean-up
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s is None
    assert "unknown layout" in cluster.nodes[NODE].annotations["mig-agent.dev/reason"]
    assert_clean(cluster)
    # the same with profile configs that no longer load after a restart
    _as_a_killed_pass_left_it(cluster)
    label(cluster, "all-1g.10gb")
    agent.catalog, agent.catalog_error = None, "profiles.yaml: mapping values are not allowed"
    assert agent.reconcile_once().outcome is Outcome.FAILED
    assert_clean(cluster)


def test_clean_up_that_fails_schedules_a_retry_even_for_a_lasting_failure() -> None:
    agent, cluster, gpus = make()
    _as_a_killed_pass_left_it(cluster)
    label(cluster, "all-1g.10gbx")
    cluster.fail_patch_after = 0  # the resume patch fails
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s
    assert agent.reconcile_once().outcome is Outcome.FAILED
    assert_clean(cluster)


def test_relabel_during_the_drain_never_reports_the_old_layout_as_success() -> None:
    agent, cluster, gpus = make()
    cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1})
    original_evict = cluster.evict

    def relabel_meanwhile(ref: PodRef) -> None:
        original_evict(ref)
        # as `repartition` does: the new layout and no state
        cluster.patch_node(NODE, labels={CONFIG: "all-3g.40gb", STATE: None})

    cluster.evict = relabel_meanwhile  # type: ignore[method-assign]
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.SUPERSEDED and result.retry_after_s == 0
    node = cluster.nodes[NODE]
    assert STATE not in node.labels and not gpus.calls  # nothing applied for the old layout
    assert_clean(cluster)
    cluster.evict = original_evict  # type: ignore[method-assign]
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    node = cluster.nodes[NODE]
    assert node.labels[STATE] == "success"
    assert node.gpu_resources() == {"nvidia.com/mig-3g.40gb": 16}


def test_relabel_after_the_apply_is_not_reported_as_success() -> None:
    agent, cluster, gpus = make()
    original = gpus.create_compute_instance

    def relabel_meanwhile(*args: Any, **kwargs: Any) -> int:
        cluster.patch_node(NODE, labels={CONFIG: "all-7g.80gb", STATE: None})
        return original(*args, **kwargs)

    gpus.create_compute_instance = relabel_meanwhile  # type: ignore[method-assign]
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.SUPERSEDED
    assert STATE not in cluster.nodes[NODE].labels
    assert_clean(cluster)
    gpus.create_compute_instance = original  # type: ignore[method-assign]
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.nodes[NODE].gpu_resources() == {"nvidia.com/mig-7g.80gb": 8}


def test_relabel_before_a_failure_is_written_reports_no_failure() -> None:
    agent, cluster, gpus = make(gpu_release_timeout_s=0.0)
    gpus.add_process(0, 4242, None)
    original = gpus.observe
    calls = [0]

    def relabel_meanwhile() -> Any:  # the label changes while the pass finds the GPU busy
        calls[0] += 1
        if calls[0] == 2:  # the re-plan after the drain
            cluster.patch_node(NODE, labels={CONFIG: "all-disabled", STATE: None})
        return original()

    gpus.observe = relabel_meanwhile  # type: ignore[method-assign]
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.SUPERSEDED
    assert STATE not in cluster.nodes[NODE].labels
    assert "mig-agent.dev/reason" not in cluster.nodes[NODE].annotations


def test_liveness_follows_the_loop_not_the_last_pass() -> None:
    """A loop waiting for a label fix after a lasting failure is alive; only a loop that
    stops moving is not (before: "stalled" 660 s after the last pass, restarted forever)."""

    import time

    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gbx")  # a lasting failure: no pass until the label changes
    with running(agent, config_poll_s=0.05):
        deadline = time.monotonic() + 10
        while cluster.nodes[NODE].labels.get(STATE) != "failed":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        first = agent.loop_alive_at
        time.sleep(0.3)
        assert agent.loop_alive_at > first  # the loop beats while it waits
        # an hour after the last pass, the loop is still alive
        agent.last_pass_at -= 3600
        assert agent.liveness_problem() == ""
        # a loop that stopped moving for longer than stall_s is not
        late = agent.loop_alive_at + agent.settings.stall_s + 1
        assert "reconcile loop stalled" in agent.liveness_problem(now=late)


def test_long_waits_inside_a_pass_keep_the_loop_alive() -> None:
    """A drain blocked by a PDB for its whole timeout (fake time) beats all along."""
    agent, cluster, gpus = make(drain_timeout_s=900.0, stall_s=60.0)
    pod = cluster.add_pod("work", "guarded", NODE, gpu={"nvidia.com/gpu": 1})
    cluster.blocked[pod] = "keep-one"
    beats: list[float] = []
    sleep = agent.clock.sleep

    def watch_beats(seconds: float) -> None:
        before = agent.loop_alive_at
        sleep(seconds)
        beats.append(agent.loop_alive_at - before)

    agent.clock = Clock(agent.clock.now, watch_beats)
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    assert len(beats) > 100 and all(b >= 0 for b in beats)
    assert agent.liveness_problem() == ""


def test_a_failing_reboot_command_is_a_failure_with_its_reason_and_no_guard(tmp_path: Path) -> None:
    from mig_agent.core.errors import GpuResetRequired

    script = tmp_path / "reboot"
    script.write_text("#!/bin/sh\necho 'reboot: permission denied' >&2\nexit 3\n")
    script.chmod(0o755)
    agent, cluster, gpus = make(
        FakeGpus([MODELS["A100-40GB"]] * 2), reboot_command=f"{script} --now"
    )
    assert agent.reboot is None  # the real one: a subprocess

    def stuck(gpu: int, *, enabled: bool) -> None:
        raise GpuResetRequired("GPU 0: MIG mode change pending")

    gpus.set_mig_mode = stuck  # type: ignore[method-assign]
    label(cluster, "all-1g.5gb")
    result = agent.reconcile_once()  # before: CalledProcessError escaped
    assert result.outcome is Outcome.FAILED
    node = cluster.nodes[NODE]
    assert node.labels[STATE] == "failed"
    reason = node.annotations["mig-agent.dev/reason"]
    assert "exit status 3" in reason and "permission denied" in reason and str(script) in reason
    assert "mig-agent.dev/reboot-attempted" not in node.annotations  # the guard is not armed
    assert_clean(cluster)
    # a fixed command gets its one reboot (not "did not take effect after rebooting once")
    reboots: list[str] = []
    agent.reboot = reboots.append
    assert agent.reconcile_once().outcome is Outcome.REBOOTING and len(reboots) == 1


def test_the_reboot_command_is_killed_at_the_reboot_timeout_setting(tmp_path: Path) -> None:
    from mig_agent.core.errors import GpuResetRequired

    agent, cluster, gpus = make(
        FakeGpus([MODELS["A100-40GB"]] * 2), reboot_command="sleep 30", reboot_timeout_s=0.5
    )

    def stuck(gpu: int, *, enabled: bool) -> None:
        raise GpuResetRequired("GPU 0: MIG mode change pending")

    gpus.set_mig_mode = stuck  # type: ignore[method-assign]
    label(cluster, "all-1g.5gb")
    started = time.monotonic()
    assert agent.reconcile_once().outcome is Outcome.FAILED
    assert time.monotonic() - started < 10  # not the 120 s default
    reason = cluster.nodes[NODE].annotations["mig-agent.dev/reason"]
    assert "sleep 30" in reason and "0.5 s" in reason, reason
    assert_clean(cluster)


@pytest.mark.parametrize(
    "command, fragment",
    [
        ("/nonexistent/reboot", "could not run"),
        ("'unbalanced", "could not run"),
    ],
)
def test_reboot_commands_that_cannot_run_say_why(command: str, fragment: str) -> None:
    from mig_agent.agent import run_reboot
    from mig_agent.core.errors import RebootFailed

    with pytest.raises(RebootFailed, match=fragment):
        run_reboot(command)


def test_a_change_without_a_device_plugin_is_refused_issue_42_path_8() -> None:
    """No device plugin pod where the settings look and no operand label bringing one: the
    change is refused before anything is touched, as on a DRA node without its plugin (before:
    applied and reported success over a listing no one proved, logging skipped_wait)."""
    agent, cluster, gpus = make(operands=False, device_plugin_timeout_s=5.0)
    cluster.on_change = None
    for p in cluster.list_pods(namespace=DP_NS):
        cluster.pods.pop(p.ref)
    cluster.patch_node(NODE, labels={"nvidia.com/gpu.deploy.dcgm-exporter": "true"})
    before = gpus.observe()
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED
    assert "no device plugin pod is on the node" in result.error
    assert "devicePlugin.selector" in result.error
    node = cluster.nodes[NODE]
    assert node.labels[STATE] == "failed"
    assert not node.unschedulable
    assert gpus.observe() == before  # nothing touched
    assert node.labels["nvidia.com/gpu.deploy.dcgm-exporter"] == "true"


def test_fixing_the_strategy_label_wakes_the_loop() -> None:
    """A bad strategy label fails the pass for good; fixing only that label is a reason for a
    new pass, as a layout change is (before: nothing until the next resync)."""
    agent, cluster, gpus = make()
    cluster.patch_node(NODE, labels={"nvidia.com/mig.strategy": "mixd"})
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s is None
    cluster.patch_node(NODE, labels={"nvidia.com/mig.strategy": "mixed"})
    stop = threading.Event()

    def one_event(name: str, *, timeout_s: int) -> Any:
        yield cluster.nodes[NODE]
        stop.set()

    cluster.watch_node = one_event  # type: ignore[method-assign]
    agent.wake_event.clear()
    agent.watch_forever(stop)
    assert agent.wake_event.is_set()


def test_the_loop_runs_on_injected_time() -> None:
    """Resync passes every resync_s of the clock's time, with no real sleeping for it (three
    resyncs would take 900 s of real time; the bound is far below, and loose enough for a
    loaded machine, where each config poll's file reads take their time)."""
    agent, cluster, gpus = make(resync_s=300.0)
    label(cluster, "all-1g.10gb")
    started = time.monotonic()
    with running(agent, config_poll_s=60.0) as passes:
        deadline = time.monotonic() + 60
        while len(passes) < 4:
            assert time.monotonic() < deadline, passes
            time.sleep(0.01)
    assert time.monotonic() - started < 60
    gaps = [b - a for a, b in zip(passes[1:], passes[2:], strict=False)]
    assert all(300.0 <= g < 306.0 for g in gaps), passes  # the resync, in the clock's time
    assert cluster.nodes[NODE].labels[STATE] == "success"


class OpenWatch(FakeCluster):
    """A node watch that stays open and delivers every change of the node; counts reads."""

    def __init__(self) -> None:
        super().__init__()
        self.changes: queue.Queue[NodeView | None] = queue.Queue()
        self.reads = 0

    def get_node(self, name: str) -> NodeView:
        self.reads += 1
        return super().get_node(name)

    def patch_node(self, name: str, **kw: Any) -> NodeView:
        node = super().patch_node(name, **kw)
        self.changes.put(node)
        return node

    def watch_node(self, name: str, *, timeout_s: int) -> Iterator[NodeView]:
        yield self.nodes[name]
        while (node := self.changes.get()) is not None:
            yield node


class FirstEventSeen(OpenWatch):
    """An OpenWatch whose first event comes once a pass has started (a real watch takes a
    moment to open), that tells when the loop has taken it, and that starts, as the API
    server's does, from the node as it is then (no change from before)."""

    def __init__(self) -> None:
        super().__init__()
        self.pass_started = threading.Event()
        self.first_taken = threading.Event()

    def watch_node(self, name: str, *, timeout_s: int) -> Iterator[NodeView]:
        self.pass_started.wait(5.0)
        with contextlib.suppress(queue.Empty):
            while True:
                self.changes.get_nowait()
        for node in super().watch_node(name, timeout_s=timeout_s):
            yield node
            self.first_taken.set()


def test_a_failed_first_pass_waits_its_back_off() -> None:
    """Before: the watch opened beside the first pass, and its first event (the node before the
    pass wrote "failed") woke a second failing pass at once, with no back-off."""
    cluster = FirstEventSeen()
    agent, _, gpus = make(cluster=cluster, backoff_s=30.0, gpu_release_timeout_s=0.0)
    gpus.add_process(0, 4242, None)  # no pod's: every pass fails, retried after 30 s
    label(cluster, "all-1g.10gb")
    once = agent.reconcile_once

    def first_event_in_the_pass(**kw: Any) -> Any:
        cluster.pass_started.set()
        cluster.first_taken.wait(1.0)  # where the watch runs beside the pass, it is taken now
        return once(**kw)

    agent.reconcile_once = first_event_in_the_pass  # type: ignore[method-assign]
    with running(agent, config_poll_s=5.0) as passes:
        deadline = time.monotonic() + 10
        while (not passes or agent.clock.now() < passes[0] + 40) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(passes) >= 2, passes
    assert passes[1] - passes[0] >= 30.0, passes  # the second pass is the back-off's retry
    assert cluster.nodes[NODE].labels[STATE] == "failed"


def test_an_idle_agent_reads_nothing_but_its_watch() -> None:
    """Resync passes take the node from the open watch: an idle agent makes no request (before:
    a read of the node every resync)."""
    agent, cluster, gpus = make(cluster=OpenWatch(), resync_s=300.0)
    assert isinstance(cluster, OpenWatch)
    label(cluster, "all-1g.10gb")
    with running(agent, config_poll_s=5.0) as passes:
        deadline = time.monotonic() + 10
        while len(passes) < 2:  # the first pass applies, then the resyncs begin
            assert time.monotonic() < deadline, passes
            time.sleep(0.01)
        reads, writes = cluster.reads, cluster.nodes[NODE].resource_version
        while len(passes) < 6:
            assert time.monotonic() < deadline, passes
            time.sleep(0.01)
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert cluster.reads == reads, "a resync read the node"
    assert cluster.nodes[NODE].resource_version == writes


def test_our_annotations_forged_by_someone_else_wake_a_pass() -> None:
    """Garbage written into the agent's own annotations is corrected at once, not at the next
    resync (before: up to resync_s later)."""
    agent, cluster, gpus = make(cluster=OpenWatch(), resync_s=300.0)
    assert isinstance(cluster, OpenWatch)
    label(cluster, "all-1g.10gb")
    # the loop's waits take 0.05 s of fake time for about 1 ms of real time
    with running(agent, config_poll_s=0.05) as passes:
        deadline = time.monotonic() + 10
        while cluster.nodes[NODE].labels.get(STATE) != "success":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.2)  # the pass has ended and our own writes have come in through the watch
        first = len(passes)
        forged_at = agent.clock.now()
        # a forged cordon mark reads as an interrupted pass: the pass finishes it
        cluster.patch_node(
            NODE,
            annotations={
                "mig-agent.dev/reason": "garbage",
                "mig-agent.dev/cordoned": "garbage",
                "mig-agent.dev/gpu-state": "{not json",
            },
        )
        while {"mig-agent.dev/reason", "mig-agent.dev/cordoned"} & set(
            cluster.nodes[NODE].annotations
        ) or agent.pass_running:
            assert time.monotonic() < deadline, passes
            time.sleep(0.005)
    corrected = [t for t in passes[first:] if t >= forged_at]
    assert corrected and corrected[0] - forged_at < 60, (forged_at, passes)
    assert cluster.nodes[NODE].annotations["mig-agent.dev/gpu-state"].startswith("{")
    assert cluster.nodes[NODE].annotations["mig-agent.dev/gpu-state"] != "{not json"
    assert cluster.nodes[NODE].labels[STATE] == "success"


def test_foreign_marks_are_what_the_agent_never_writes() -> None:
    from mig_agent.agent.marks import foreign_marks

    s = Settings(node_name=NODE, config=PROFILES)
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    ours = {
        "mig-agent.dev/cordoned": "true",
        "mig-agent.dev/paused-operands": DP_LABEL,
        "mig-agent.dev/reboot-attempted": "all-1g.10gb",
        "mig-agent.dev/post-apply-pending": "all-1g.10gb",
        "mig-agent.dev/stopped-host-services": "nvidia-dcgm.service,nvsm",
    }
    node = cluster.patch_node(NODE, annotations=ours)
    assert foreign_marks(s, node) == {}  # the GPU state the pass published is ours too
    forged = {
        "mig-agent.dev/cordoned": "yes",
        "mig-agent.dev/paused-operands": "nvidia.com/gpu.deploy.driver",
        "mig-agent.dev/reboot-attempted": "; rm -rf /",
        "mig-agent.dev/stopped-host-services": "a b",
        "mig-agent.dev/gpu-state": "[]",
        "mig-agent.dev/reason": "not failed",
        "mig-agent.dev/made-up": "x",
    }
    node = cluster.patch_node(NODE, annotations=forged)
    assert foreign_marks(s, node) == {k: v for k, v in forged.items()}
    node = cluster.patch_node(
        NODE,
        labels={STATE: "failed"},
        annotations={**dict.fromkeys(forged), "mig-agent.dev/reason": "why"},
    )
    assert foreign_marks(s, node) == {}  # a reason beside the failed state is ours


def record_patches(cluster: FakeCluster) -> list[dict[str, Any]]:
    """The keyword arguments of every node patch from now on, in order."""
    patches: list[dict[str, Any]] = []
    patch = cluster.patch_node

    def recorded(name: str, **kw: Any) -> NodeView:
        patches.append(kw)
        return patch(name, **kw)

    cluster.patch_node = recorded  # type: ignore[method-assign]
    return patches


def test_a_lost_success_is_written_without_pausing_or_restarting_anything() -> None:
    """The layout was applied and the node resumed, then the API server went away before
    "success": the node says pending with none of our marks. The next pass writes success and
    leaves the device plugin alone (before: it paused the plugin's operand and waited for a
    new plugin pod)."""
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    (plugin,) = cluster.list_pods(namespace=DP_NS)
    cluster.patch_node(NODE, labels={STATE: "pending"})
    patches = record_patches(cluster)
    calls = sum(gpus.calls.values())
    assert agent.reconcile_once().outcome is Outcome.NOOP
    assert sum(gpus.calls.values()) == calls
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert [p.ref.uid for p in cluster.list_pods(namespace=DP_NS)] == [plugin.ref.uid]
    assert not any((p.get("labels") or {}).get(DP_LABEL) == PAUSED for p in patches), patches
    assert not any(p.get("unschedulable") for p in patches)
    assert_clean(cluster)


def test_a_terminating_device_plugin_pod_is_neither_restarted_nor_waited_for() -> None:
    """Its DaemonSet no longer wants the node: no new plugin will come (before: the agent
    deleted it and waited for a successor until DevicePluginTimeout). No plugin to advertise
    the change: refused before anything is touched (issue 42 path 8)."""
    agent, cluster, gpus = make(operands=False, device_plugin_timeout_s=5.0)
    cluster.on_change = None
    (dp,) = cluster.list_pods(namespace=DP_NS)
    cluster.pods[dp.ref] = dataclasses.replace(dp, terminating=True)
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and "no device plugin pod" in result.error
    assert dp.ref in cluster.pods  # not deleted again
    assert not gpus.calls and not cluster.nodes[NODE].unschedulable


@pytest.mark.parametrize(
    "runtime_class, fragment",
    [
        ("", "default runtime (no runtimeClassName); set runtimeClassName: nvidia"),
        ("runc", "RuntimeClass 'runc'"),
        (None, "own pod was not found"),
    ],
)
def test_without_nvml_the_agent_names_its_runtime_class(
    runtime_class: str | None, fragment: str
) -> None:
    from mig_agent.core.errors import GpuUnavailable

    agent, cluster, gpus = make()
    if runtime_class is not None:
        ref = cluster.add_pod(
            "mig-agent", "mig-agent-x", NODE, labels={"app.kubernetes.io/name": "mig-agent"}
        )
        cluster.pods[ref] = dataclasses.replace(cluster.pods[ref], runtime_class=runtime_class)

    def no_library() -> Any:
        raise GpuUnavailable("initialise NVML: Driver Not Loaded")

    gpus.observe = no_library  # type: ignore[method-assign]
    problem = agent.gpu_problem()
    assert "Driver Not Loaded" in problem and fragment in problem
    agent.report_gpu_problem()
    (cond,) = [c for c in cluster.nodes[NODE].conditions if c.type == "MIGConfigApplied"]
    assert (cond.status, cond.reason) == ("False", "GpuUnavailable") and fragment in cond.message


def test_a_forbidden_request_mid_pass_is_retried_with_back_off() -> None:
    """A restarted API server refuses a valid token (403) until its caches fill; a pass that
    meets it fails clean and is tried again, not left `failed` until someone relabels. A refused
    eviction is a failed drain: the node stays cordoned between tries, inside the give-up
    window (issue 42 path 5)."""
    from mig_agent.core.errors import KubeForbidden

    agent, cluster, gpus = make()
    pod = cluster.add_pod("work", "on-gpu", NODE, gpu={"nvidia.com/gpu": 1})
    evict = cluster.evict
    refusals = [KubeForbidden("evict pod work/on-gpu: 403 forbidden", status=403)]

    def evict_once_forbidden(ref: Any) -> None:
        if refusals:
            raise refusals.pop()
        evict(ref)

    cluster.evict = evict_once_forbidden  # type: ignore[method-assign]
    label(cluster, "all-balanced")
    first = agent.reconcile_once()
    assert first.outcome is Outcome.FAILED and first.retry_after_s is not None
    node = cluster.nodes[NODE]
    assert "403" in node.annotations["mig-agent.dev/reason"]
    assert "stays cordoned between tries" in node.annotations["mig-agent.dev/reason"]
    assert node.unschedulable and node.labels[DP_LABEL] == "true"
    assert not gpus.calls
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.evicted == [pod] and cluster.nodes[NODE].labels[STATE] == "success"
    assert_clean(cluster)


def test_device_ids_that_are_no_uuids_drain_every_gpu_pod_and_say_so() -> None:
    """A device plugin that registers devices as "<gpu>:<mig>" (NVIDIA's registers UUIDs with
    either DEVICE_ID_STRATEGY; the index form is what it gives containers): no holder is found
    by UUID (before: the pod's processes on changing devices counted as ones no pod holds, and
    every change was refused as a busy GPU)."""
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    on_gpu2 = cluster.add_pod("work", "on-gpu2", NODE, gpu={"nvidia.com/mig-1g.10gb": 7})
    on_gpu0 = cluster.add_pod("work", "on-gpu0", NODE, gpu={"nvidia.com/mig-1g.10gb": 1})
    # the pod's processes on every device of GPU 2, some of which the change destroys
    for gi in gpus.observe().gpu(2).gpu_instances:
        gpus.add_process(2, 4200 + gi.id, gi.id, gi.compute_instances[0].id)
    end_processes_on_eviction(cluster, gpus, 2)
    agent.pod_devices = lambda: {
        ("work", "on-gpu2"): frozenset(f"2:{i}" for i in range(7)),
        ("work", "on-gpu0"): frozenset({"0:0"}),
    }
    _two_changed(agent)
    label(cluster, "two-changed")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert set(cluster.evicted) == {on_gpu2, on_gpu0}  # ownership unknown: every GPU pod
    (event,) = [e for e in cluster.events if e[1] == "MIGDeviceOwnershipUnknown"]
    assert "2:0" in event[2] and "no UUIDs" in event[2] and event[3] is True
