"""The agent: from the node's layout label to a repartitioned node, and back to a clean node.

One reconcile pass: read the node, plan against the GPUs as they are (nothing to do: ``success``,
nothing touched), else ``pending``, cordon, pause GPU operands, drain GPU pods, apply, restart the
device plugin and wait for the node to advertise the layout, then resume, uncordon, ``success``.
Every failure restores operands and uncordons (in ``finally``), writes the reason (label,
annotation, condition, event, log) and, when the cause can pass, retries with capped backoff.

All progress lives on the Node (labels and annotations), so a restarted agent finishes or undoes
what an interrupted one started. This module sequences the pass; its steps live beside it:
node_guard (cordon, operands), device_plugin (restart, wait for resources), reporting
(condition, events, metrics), reboot, loop (the run loop and the node watch).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from mig_agent.agent import (
    device_plugin,
    dra,
    host_clients,
    loop,
    node_guard,
    observe,
    reporting,
    validators,
)
from mig_agent.agent.node_guard import NodeRebooting
from mig_agent.agent.outcome import Outcome, PassResult
from mig_agent.agent.reboot import run_reboot
from mig_agent.config.settings import Settings
from mig_agent.core import planner
from mig_agent.core.advertised import (
    Devices,
    Sharing,
    expected_resources,
    planned_devices,
    strategy_problem,
)
from mig_agent.core.dra_devices import split_problem
from mig_agent.core.errors import (
    ConfigError,
    DrainGivenUp,
    DrainRefused,
    DrainTimeout,
    EvictionBlocked,
    GpuBusy,
    GpuResetRequired,
    GpuUnavailable,
    InternalError,
    LabelsChanged,
    MigAgentError,
    PlanError,
    RebootFailed,
    Stopping,
)
from mig_agent.core.generated_layouts import with_generated
from mig_agent.core.gpu_models import GpuModel
from mig_agent.core.labels import State, paused_during_change
from mig_agent.core.layout import Layout, LayoutCatalog
from mig_agent.core.observe_report import ObserveReport
from mig_agent.core.observed import NodeState
from mig_agent.gpu.backend import GpuBackend
from mig_agent.host import commands
from mig_agent.kube.cluster import Cluster, NodeCondition, NodeView, PodRef, PodsSeen, PodView
from mig_agent.node import hooks
from mig_agent.node.apply import apply_plan, verify
from mig_agent.node.drain import (
    drain_gpu_pods,
    drain_refusals,
    is_paused_operand,
    look,
    to_drain,
    wait_pods_gone,
)
from mig_agent.node.waits import Clock, poll_delays
from mig_agent.observability.metrics import Metrics

log = structlog.get_logger(__name__)


def config_fingerprint(path: str) -> tuple[tuple[str, float, int], ...]:
    """Modification times and sizes of the config files, to notice a changed ConfigMap."""
    p = Path(path)
    files = sorted(p.glob("*.y*ml")) if p.is_dir() else [p]
    out = []
    for f in files:
        with contextlib.suppress(OSError):
            st = f.stat()
            out.append((str(f), st.st_mtime, st.st_size))
    return tuple(out)


@dataclass(slots=True)
class _Change:
    """What one pass works on: the node as last read or written, the layout asked for, the GPUs
    as observed and the plan between them, and how NVIDIA's plugin will advertise the result."""

    node: NodeView
    desired: str
    layout: Layout
    models: Mapping[int, GpuModel]
    observed: NodeState
    plan: planner.Plan
    strategy: str
    sharing: Sharing
    # a DRA node: NVIDIA's DRA kubelet plugin publishes the GPUs, claims hold them
    dra: bool = False
    # every pod of the node and its ResourceSlices, read once when the pass plans a change (or
    # has a state to write): None when the GPUs hold the layout and the node says so
    pods: list[PodView] | None = None
    slices: list[dict[str, Any]] | None = None
    interrupted: bool = False  # a pass before this one left its marks: it is finished now
    apply_started: bool = False  # the first GPU step may have run
    gpus_changed: bool = False  # the GPUs hold the layout: the plugin's listing is stale


class _Prepared(NamedTuple):
    """What the pass takes from ``prepare`` on to the drain and the apply."""

    hook_run: hooks.HookRunner
    reset_gpus: list[int]
    old_plugins: set[str]  # the plugin pods before the change (a new one must come)
    paused: list[str] | None  # the operands paused; None: the GPUs stay, only the listing


@dataclass
class Agent:
    settings: Settings
    cluster: Cluster
    gpus: GpuBackend
    load_catalog: Callable[[str], LayoutCatalog]
    clock: Clock = field(default_factory=Clock)
    metrics: Metrics = field(default_factory=Metrics)
    # runs the reboot command; None: run_reboot with the reboot_timeout_s setting
    reboot: Callable[[str], None] | None = None
    # runs hook and host service commands (mig_agent.host.commands.run_command)
    run_command: commands.Runner = commands.run_command
    # (namespace, pod) -> GPU device ids it holds (kubelet PodResources); None: not known
    pod_devices: Callable[[], Mapping[tuple[str, str], frozenset[str]]] | None = None
    # resource -> device ids the kubelet offers (PodResources); None: not known
    allocatable_devices: Callable[[], Mapping[str, frozenset[str]]] | None = None

    catalog: LayoutCatalog | None = None
    catalog_error: str = ""
    last_pass_at: float = 0.0
    watch_alive_at: float = 0.0
    watched_node: NodeView | None = None  # the node as the open watch last delivered it
    pass_running: bool = False  # the watch tells our own writes from someone else's by it
    # time.monotonic() of the loop's last sign of life: each turn between passes, and every
    # wait inside a pass (drain, device plugin); /healthz fails only when this stops
    loop_alive_at: float = 0.0  # set from the clock when the agent is made
    failures: int = 0
    # the device ids that were no UUIDs when last reported (an Event when they change)
    odd_device_ids: list[str] = field(default_factory=list)
    # a drain failing for a layout: (layout, when its first try failed), for drain_give_up_s
    drain_failing: tuple[str, float] | None = None
    _fingerprint: tuple[tuple[str, float, int], ...] = ()
    seen: tuple[str | None, str | None] = (None, None)
    # the labels that choose how the device plugin advertises, as the last pass read them
    seen_plugin_labels: tuple[str | None, ...] = ()
    # whether the last pass that looked found a DRA node (None: none looked): a pass with
    # nothing to do or to write goes by it, asking the API server nothing
    dra_seen: bool | None = None
    wake_event: threading.Event = field(default_factory=threading.Event)
    # set when the agent is told to stop (SIGTERM): every wait inside a pass ends at once
    stopping: threading.Event = field(default_factory=threading.Event)
    # devices the plugin lists unhealthy, as last reported (Event and condition on a change)
    unhealthy: dict[str, int] = field(default_factory=dict)
    # what the last look at NVML found ("" fine): /readyz answers from it, never calling NVML
    # itself (a reset holds the NVML lock for minutes)
    gpu_status: str = "GPUs not read yet"

    def __post_init__(self) -> None:
        self.loop_alive_at = self.clock.now()
        sleep = self.clock.sleep

        def sleep_alive(seconds: float) -> None:
            # the waits of a pass sleep at most poll_s at a time: a stop is seen within it
            self.loop_alive_at = self.clock.now()
            if self.stopping.is_set():
                raise Stopping()
            sleep(seconds)
            if self.stopping.is_set():
                raise Stopping()

        self.clock = replace(self.clock, sleep=sleep_alive)
        if self.settings.observe:  # every write but its Event and annotation refused there
            self.cluster = observe.ObserveOnlyCluster(self.cluster, self.settings)

    def readiness_problem(self) -> str:
        """Why the agent is not ready, or "": from what the loop last saw, without a call."""
        if self.catalog is None:
            return f"profile configs not loaded: {self.catalog_error}"
        return self.gpu_status

    def liveness_problem(self, now: float | None = None) -> str:
        """Why the agent should be restarted, or "": a loop or node watch that stopped moving.
        Never "no pass lately": a node waiting for a fixed label runs no pass for days."""
        now = self.clock.now() if now is None else now
        s = self.settings
        if now - self.loop_alive_at > s.stall_s:
            return f"reconcile loop stalled: no progress for {now - self.loop_alive_at:.0f} s"
        if (
            now - self.watch_alive_at > max(s.stall_s, s.watch_timeout_s * 2.0)
            and self.watch_alive_at
        ):
            return f"node watch stalled: no progress for {now - self.watch_alive_at:.0f} s"
        return ""

    # -- configuration ------------------------------------------------------------------------

    def reload_config(self) -> bool:
        """Load the profile configs if they changed; True when they did (or on first load)."""
        fp = config_fingerprint(self.settings.config)
        if self.catalog is not None and fp == self._fingerprint:
            return False
        self._fingerprint = fp
        try:
            self.catalog = self.load_catalog(self.settings.config)
            self.catalog_error = ""
            if self.settings.generate_config:
                self.catalog = self._with_generated(self.catalog)
            log.info(
                "config.loaded", layouts=len(self.catalog.layouts), config=self.settings.config
            )
        except ConfigError as exc:
            self.catalog_error = str(exc)
            log.error("config.invalid", error=str(exc), config=self.settings.config)
            self._report_invalid_config(str(exc))
        return True

    def _report_invalid_config(self, error: str) -> None:
        """An operator who edits the profile ConfigMap sees the mistake on the node (kubectl
        describe node), not only in the agent's log, and what the agent goes on with."""
        kept = (
            f"the agent goes on with the last good config ({len(self.catalog.layouts)} layouts)"
            if self.catalog is not None
            else "no layout can be applied until it is fixed"
        )
        reporting.event_on_node(
            self.cluster,
            self.settings,
            "MIGConfigInvalid",
            f"profile config invalid: {error}; {kept}",
            warning=True,
        )

    def gpu_problem(self) -> str:
        """Why the GPUs cannot be read now, or "" (kept for /readyz). Without NVML, it names the
        RuntimeClass the agent's pod runs under: with the wrong runtime no libnvidia-ml.so.1 is
        mounted."""
        try:
            self.gpus.observe()
        except GpuUnavailable as exc:
            head = f"NVML unreachable: {exc}"
            if not self.gpu_status.startswith(head):  # the hint's pod list: once per outage
                self.gpu_status = f"{head}; {self._runtime_hint()}"
        except MigAgentError as exc:
            self.gpu_status = f"NVML unreachable: {exc}"
        else:
            self.gpu_status = ""
        return self.gpu_status

    def report_gpu_problem(self) -> None:
        """On start: a node without NVML says so in the log and the node condition."""
        problem = self.gpu_problem()
        if problem:
            log.error("gpu.unavailable", error=problem)
            if self.settings.observe:  # the condition is MIG Manager's node's, not ours
                return
            reporting.condition(
                self.cluster,
                self.settings,
                NodeCondition(self.settings.condition_type, "False", "GpuUnavailable", problem),
            )

    def _runtime_hint(self) -> str:
        s = self.settings
        try:
            mine = [
                p
                for p in self.cluster.list_pods(node=s.node_name, label_selector=s.agent_selector)
                if not p.terminating
            ]
        except MigAgentError:
            mine = []
        if not mine:
            return "the agent's own pod was not found, so its runtime is unknown"
        rc = mine[0].runtime_class
        if rc:
            return (
                f"the agent's pod runs under RuntimeClass {rc!r}; that runtime did not "
                "provide libnvidia-ml.so.1"
            )
        return (
            "the agent's pod runs under the node's default runtime (no runtimeClassName); "
            "set runtimeClassName: nvidia (the GPU Operator's RuntimeClass) so that the "
            "NVIDIA runtime mounts libnvidia-ml.so.1"
        )

    def _with_generated(self, catalog: LayoutCatalog) -> LayoutCatalog:
        """``catalog`` plus generated layouts for the GPU models it does not cover."""
        try:
            models = list(self.gpus.models().values())
        except MigAgentError as exc:  # no GPUs to read now: the configs as they are
            log.warning("config.generate_skipped", error=str(exc))
            return catalog
        catalog, generated = with_generated(catalog, models)
        if generated:
            log.info("config.generated", models=sorted({m.key for m in generated}))
        return catalog

    # -- one pass -----------------------------------------------------------------------------

    def reconcile_once(self, *, node: NodeView | None = None) -> PassResult:
        """One pass; ``node`` is the node as the open watch delivered it (a resync), else it is
        read."""
        self.pass_running = True
        try:
            return self._pass(node)
        finally:
            self.pass_running = False

    def _pass(self, node: NodeView | None) -> PassResult:
        s = self.settings
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(node=s.node_name)
        self.last_pass_at = time.time()
        node = node or self.cluster.get_node(s.node_name)
        desired = node.labels.get(s.config_label)
        self.seen = (desired, node.labels.get(s.state_label))
        self.seen_plugin_labels = device_plugin.plugin_labels(self.settings, node)
        if s.observe:
            return self._observe(node, desired)
        if not desired:
            node_guard.finish(self.cluster, self.settings, node)
            try:
                host_clients.start_leftover(self.cluster, s, self.run_command, node.annotations)
            except MigAgentError as exc:
                log.error("host_clients.start_failed", error=str(exc))
            if (
                s.state_label in node.labels
                or s.reason_annotation in node.annotations
                or s.post_apply_annotation in node.annotations
                or s.observe_annotation in node.annotations
            ):
                # no layout asked for: no state to report (an old "failed" would mislead)
                node = self.cluster.patch_node(
                    s.node_name,
                    labels={s.state_label: None},
                    annotations={
                        s.reason_annotation: None,
                        s.post_apply_annotation: None,
                        s.observe_annotation: None,
                    },
                )
                self.seen = (None, None)
            self.metrics.set_state("")
            reporting.record_devices(self.cluster, self.settings, self.gpus, self.metrics, node)
            return PassResult(Outcome.IDLE)
        structlog.contextvars.bind_contextvars(layout=desired)
        start = self.clock.now()
        try:
            result = self._reconcile(node, desired)
        except NodeRebooting:
            # Still alive after the reboot command: look again soon (the guard stops a loop).
            return PassResult(Outcome.REBOOTING, retry_after_s=self.settings.backoff_s)
        except LabelsChanged as exc:
            return self._superseded(desired, exc)
        except Stopping as exc:
            # told to stop inside a wait: undo the marks (a successor starts the pass over;
            # the state label still says pending) and end the loop; but the cordon stays
            # while pods the drain evicted still terminate on devices about to change
            log.info("reconcile.stopped", reason="the agent is stopping")
            going = node_guard.still_terminating(exc)
            if not node_guard.tidy_up(self.cluster, self.settings, going) and going:
                self._stopped_mid_drain(going)
            return PassResult(Outcome.STOPPED)
        except MigAgentError as exc:
            return self._failed_and_tidied(desired, exc)
        except Exception as exc:  # noqa: BLE001 (a bug must not end the agent: it reports it)
            return self._failed_and_tidied(desired, _crashed(exc))
        self.failures = 0
        self.drain_failing = None
        if result is Outcome.APPLIED:
            self.metrics.reconfigurations.labels(result="success", layout=desired).inc()
            log.info(
                "reconcile.finished",
                outcome=str(result),
                duration_s=round(self.clock.now() - start, 3),
            )
        return PassResult(result)

    def _observe(self, node: NodeView, desired: str | None) -> PassResult:
        """Observe mode: the plan and the pods its drain would evict, said on the node
        (mig_agent.agent.observe); no other write, no hook, no GPU change."""
        if not desired:
            observe.clear(self.cluster, self.settings, node)
            return PassResult(Outcome.IDLE)
        structlog.contextvars.bind_contextvars(layout=desired)
        retry = None
        try:
            change = self._planned(node, desired)
            pods, refusals = self._drain_plan(change)
            paused = paused_during_change(node.labels, self.settings.operand_labels)
            evict = tuple(str(p.ref) for p in pods if not is_paused_operand(p, paused))
            report = ObserveReport(desired, change.plan, evict, tuple(refusals))
        except MigAgentError as exc:
            report = ObserveReport(desired, error=str(exc))
            retry = self.settings.backoff_s if exc.retryable else None
        if not observe.publish(self.cluster, self.settings, node, report):
            retry = self.settings.backoff_s
        return PassResult(Outcome.OBSERVED, retry, report.error)

    def _stopped_mid_drain(self, going: tuple[PodRef, ...]) -> None:
        """Say on the node why it stays cordoned in `pending` (best effort: the agent is
        going)."""
        reason = (
            "the agent stopped mid-change while pods it evicted still terminated ("
            + ", ".join(map(str, going))
            + "): the node stays cordoned until the agent's next start finishes the change"
        )
        try:
            self.cluster.patch_node(
                self.settings.node_name, annotations={self.settings.reason_annotation: reason}
            )
        except MigAgentError as err:
            log.warning("reason.not_written", error=str(err))

    def _failed_and_tidied(self, desired: str, exc: MigAgentError) -> PassResult:
        tidy = node_guard.tidy_up(
            self.cluster,
            self.settings,
            node_guard.still_terminating(exc),
            node_guard.cordon_kept_for(exc),
        )
        failed = self._failed(desired, exc)
        if not tidy and failed.retry_after_s is None:  # our marks are still on the node
            return replace(failed, retry_after_s=self.settings.backoff_s)
        return failed

    def _superseded(self, desired: str, exc: LabelsChanged) -> PassResult:
        """The label asks for another layout now: report nothing for ``desired``, undo our
        marks, and start over at once."""
        log.info("reconcile.superseded", error=str(exc))
        node_guard.tidy_up(self.cluster, self.settings)
        self.failures = 0
        return PassResult(Outcome.SUPERSEDED, retry_after_s=0.0)

    def _still_wanted(self, desired: str) -> None:
        """LabelsChanged if the layout label no longer names ``desired``."""
        s = self.settings
        # the open watch delivers every change of the node: asked only while it is closed
        node = self.watched_node or self.cluster.get_node(s.node_name)
        now = node.labels.get(s.config_label)
        if now != desired:
            raise LabelsChanged(
                f"layout label changed from {desired} to {now} during the pass",
                labels={s.config_label: now},
            )

    def _reconcile(self, node: NodeView, desired: str) -> Outcome:
        """The pass's phases, in order; any failure leaves by an exception (``_pass`` reports it
        and tidies up)."""
        change = self._plan_phase(node, desired)
        if self._in_place(change):
            return Outcome.NOOP
        with contextlib.ExitStack() as marks:  # the cordon and the paused operands, undone
            ready = self._prepare_phase(change, marks)
            if ready.paused is None:
                advertised = self._advertise_only(change, ready.old_plugins)
            else:
                advertised = self._change_gpus(
                    change, ready.hook_run, ready.reset_gpus, ready.paused, ready.old_plugins
                )
        self._applied(change, advertised)
        return Outcome.APPLIED

    def _prepare_phase(self, change: _Change, marks: contextlib.ExitStack) -> _Prepared:
        """What comes between the plan and the drain, timed as the phase ``prepare``: the
        refusals before anything changes, ``pending`` announced, the plugin's pods noted and,
        unless only its listing is wrong (``paused`` None), the node cordoned and its operands
        paused, undone when ``marks`` closes."""
        with self.metrics.phase("prepare"):
            hook_run, reset_gpus = self._refuse_before_touching(change)
            self._announce(change, hook_run)
            advertiser = dra if change.dra else device_plugin
            plugins = advertiser.plugin_pods(self.cluster, self.settings, change.pods)
            old_plugins = {p.ref.uid for p in plugins}
            paused = None
            if not change.plan.is_empty or hook_run.hooks.of(hooks.POST_APPLY):
                paused = marks.enter_context(
                    node_guard.gpu_clients_paused(self.cluster, self.settings, change.node)
                )
            return _Prepared(hook_run, reset_gpus, old_plugins, paused)

    def _change_gpus(
        self,
        change: _Change,
        hook_run: hooks.HookRunner,
        reset_gpus: list[int],
        paused: list[str],
        old_plugins: set[str],
    ) -> dict[str, int]:
        """Drain, apply, verify, post-apply hooks, then the plugin restart: the resources the
        node then advertises. A failure once the GPUs changed restarts the plugin first
        (``_readvertise``): the node must not take pods over devices that are gone."""
        try:
            if not change.plan.is_empty:
                self._drain_phase(change, paused)
                with host_clients.stopped(
                    self.cluster, self.settings, self.run_command, reset_gpus, change.node
                ):
                    change.apply_started = True
                    self._apply_phase(change, hook_run, reset_gpus)
                    self._verify_phase(change)
            change.gpus_changed = True  # or a pass before this one changed them
            self._post_apply_phase(change, hook_run)
        except (LabelsChanged, Stopping, NodeRebooting):
            raise  # a successor, the next pass or the rebooted node finishes the change
        except Exception as exc:  # noqa: BLE001 (a bug past the first GPU step too)
            err = exc if isinstance(exc, MigAgentError) else _crashed(exc)
            if self._gpus_touched(change):
                self._readvertise(change, paused, old_plugins, err)
            if err is exc:
                raise
            raise err from exc
        try:
            return self._device_plugin_phase(change, paused, old_plugins)
        except MigAgentError as exc:
            raise node_guard.keep_cordon_for(exc, self._stays_cordoned(change)) from None

    def _advertise_only(self, change: _Change, old_plugins: set[str]) -> dict[str, int]:
        """Nothing to change on the GPUs, only the plugin's listing: no cordon and no pause,
        the plugin restarted and waited for. A cordon that an earlier pass left over GPUs it
        changed but never saw advertised stays until they are."""
        s = self.settings
        log.info("reconcile.advertise_only", reason="the GPUs hold the layout already")
        try:
            advertised = self._device_plugin_phase(change, [], old_plugins)
        except MigAgentError as exc:
            if s.cordon_annotation in change.node.annotations:
                raise node_guard.keep_cordon_for(exc, self._stays_cordoned(change)) from None
            raise
        node_guard.finish(self.cluster, s, self.cluster.get_node(s.node_name))
        return advertised

    def _gpus_touched(self, change: _Change) -> bool:
        """True when the plugin's listing may not be what the GPUs hold: past the apply, or an
        apply that got some way (NVML says so; unreadable, assume it did), or a pass finishing
        an interrupted one whose listing is wrong now."""
        if change.gpus_changed:
            return True
        try:
            if change.apply_started:
                return _mig_layout(self.gpus.observe()) != _mig_layout(change.observed)
            if change.interrupted:
                return not self._listing_ok(change)
        except MigAgentError:
            return True
        return False

    def _listing_ok(self, change: _Change) -> bool:
        s = self.settings
        if change.dra:
            return dra.devices_ok(self.cluster, s, self.gpus, change.models)
        node = self.cluster.get_node(s.node_name)
        return device_plugin.resources_ok(self.cluster, s, self.gpus, node, change.models)

    def _readvertise(
        self, change: _Change, paused: list[str], old_plugins: set[str], exc: MigAgentError
    ) -> None:
        """After ``exc`` the GPUs differ from what the plugin read: restart it and wait for the
        listing (best effort); if it does not come, the cordon stays. Either way the reason
        says so."""
        log.warning("reconcile.readvertising", error=str(exc))
        plugin = _advertiser(change)
        try:
            self._device_plugin_phase(change, paused, old_plugins)
        except MigAgentError as err:
            node_guard.keep_cordon_for(exc, self._stays_cordoned(change))
            exc.context[_NOTE] = (
                f"the GPUs had changed and {plugin} does not advertise them as they are now "
                f"({err}): the node stays cordoned until it does"
            )
            return
        exc.context[_NOTE] = (
            f"the GPUs had changed: {plugin} was restarted and advertises them as they are now"
        )

    def _stays_cordoned(self, change: _Change) -> str:
        return (
            f"the node stays cordoned until {_advertiser(change)} advertises the GPUs as they "
            "are now"
        )

    def _phase(
        self, change: _Change, name: str, reason: str, message: str
    ) -> contextlib.AbstractContextManager[None]:
        return reporting.phase(
            self.cluster, self.metrics, self.clock, change.node, name, reason, message
        )

    def _plan_phase(self, node: NodeView, desired: str) -> _Change:
        """The plan against the GPUs as they are; PlanError for a layout NVIDIA's plugin would
        refuse to advertise, before anything changes."""
        if self.catalog is None:
            raise ConfigError(f"profile configs not loaded: {self.catalog_error}")
        self.catalog.get(desired)  # an unknown layout starts nothing
        # services an earlier pass stopped for a reset run again before anything else
        host_clients.start_leftover(self.cluster, self.settings, self.run_command, node.annotations)
        return self._planned(node, desired)

    def _planned(self, node: NodeView, desired: str) -> _Change:
        """``_plan_phase`` but the leftover host services: the plan, reading only (observe)."""
        if self.catalog is None:
            raise ConfigError(f"profile configs not loaded: {self.catalog_error}")
        layout = self.catalog.get(desired)
        with self.metrics.phase("plan"):
            models = self.gpus.models()
            # destroy_in_use: GPU pods still run now; what they hold is checked after the drain
            observed = self.gpus.observe()
            self.gpu_status = ""
            the_plan = planner.plan(layout, observed, models, destroy_in_use=True)
            strategy, sharing = device_plugin.plugin_rules(self.settings, node)
            pods, dra_node = self._dra_lookup(node, the_plan)
            if dra_node and (refused := dra.refusal(self.settings, dra_node, pods or [])):
                raise PlanError(f"layout {desired}: {refused}", layout=desired)
            if dra_node and not dra_node.pods and not the_plan.is_empty:
                raise dra.plugin_missing(self.settings, dra_node, desired)
            planned: Devices = planned_devices(the_plan, observed, models)
            problem = (
                split_problem(planned)
                if self.dra_seen
                else strategy_problem(planned, strategy, sharing)
            )
            if problem:
                raise PlanError(f"layout {desired}: {problem}", layout=desired)
        return _Change(
            node,
            desired,
            layout,
            models,
            observed,
            the_plan,
            strategy,
            sharing,
            bool(self.dra_seen),
            pods,
            dra_node.slices if dra_node else None,
        )

    def _dra_lookup(
        self, node: NodeView, the_plan: planner.Plan
    ) -> tuple[list[PodView] | None, dra.DraNode | None]:
        """Every pod of the node (one list serves the device plugin's, the DRA plugin's and
        the drain's lookups) and, on a DRA node, its plugin pods and slices. Not asked when the
        GPUs hold the layout and the node says so with nothing left to finish: a resync with
        nothing to do asks the API server nothing, and goes by what the last look found."""
        s = self.settings
        settled = (
            the_plan.is_empty
            and node.labels.get(s.state_label) == State.SUCCESS
            and s.reason_annotation not in node.annotations
            and not node_guard.interrupted(s, node)
        )
        if settled and self.dra_seen is not None:
            return None, None
        pods = self.cluster.list_pods(node=s.node_name)
        found = dra.find(self.cluster, s, pods)
        self.dra_seen = found is not None
        return pods, found

    def _in_place(self, change: _Change) -> bool:
        """True when the layout and its devices are in place and no interrupted pass is left
        to finish: the state is made to say so, nothing is touched."""
        s, node, desired = self.settings, change.node, change.desired
        # a pod list and an NVML read: asked once, by whichever check needs it first
        advertised = functools.cache(
            lambda: (
                dra.devices_ok(self.cluster, s, self.gpus, change.models, change.slices)
                if change.dra
                else device_plugin.resources_ok(
                    self.cluster, s, self.gpus, node, change.models, change.pods
                )
            )
        )
        empty = change.plan.is_empty
        interrupted = node_guard.interrupted(s, node) or (
            empty and node.labels.get(s.state_label) == State.FAILED and not advertised()
        )
        if interrupted and empty and not node_guard.marked(s, node) and advertised():
            # only the last write was lost (an API server gone just before "success"): the
            # layout and its devices are in place, nothing to pause or restart
            interrupted = False
        change.interrupted = interrupted
        if not empty or interrupted:
            return False
        reporting.record_devices(self.cluster, s, self.gpus, self.metrics, node)
        want = expected_resources(change.observed, change.models, change.strategy, change.sharing)
        changed_health = self._note_unhealthy(node, want)
        message = self._with_health(f"layout {desired} is applied; nothing to change")
        if (
            node.labels.get(s.state_label) != State.SUCCESS
            or s.reason_annotation in node.annotations
            or s.observe_annotation in node.annotations  # observe mode's, before a hand-over
        ):
            self._succeed(node, desired, message)
        elif changed_health:
            reporting.condition(
                self.cluster, s, NodeCondition(s.condition_type, "True", "Applied", message)
            )
        self.metrics.set_state(State.SUCCESS)
        self.metrics.last_success.set(time.time())
        return True

    def _refuse_before_touching(self, change: _Change) -> tuple[hooks.HookRunner, list[int]]:
        """The hooks to run and the GPUs to reset; refused before anything changes: malformed
        hook or GPU client files, processes no drain ends, pods the drain must not evict."""
        s = self.settings
        # the files of the hooks and host GPU clients, read before anything changes
        hook_run = hooks.HookRunner(
            hooks.load(s),
            self.run_command,
            s.command_timeout_s,
            hooks.context(s, change.desired, change.plan, change.observed),
        )
        reset_gpus = host_clients.reset_gpus(change.plan, change.models)
        if reset_gpus and s.stop_host_gpu_clients:
            host_clients.services(s)
        self._refuse_what_no_drain_ends(change, reset_gpus, hook_run)
        self._refuse_what_the_drain_must_not_evict(change)
        return hook_run, reset_gpus

    def _announce(self, change: _Change, hook_run: hooks.HookRunner) -> None:
        """``pending`` (and the post-apply mark), the condition and the Event: the change starts."""
        s, desired = self.settings, change.desired
        changed = list(change.plan.changed_gpus)
        log.info("reconcile.started", changed_gpus=changed, interrupted=change.interrupted)
        change.node = self._set_state(change.node, State.PENDING, desired)
        if hook_run.hooks.of(hooks.POST_APPLY):
            # until the post-apply hooks succeed, a pass has work left (crash, failure)
            change.node = self.cluster.patch_node(
                s.node_name, annotations={s.post_apply_annotation: desired}
            )
        reporting.condition(
            self.cluster,
            s,
            NodeCondition(
                s.condition_type,
                "False",
                "Reconfiguring",
                f"applying layout {desired} to GPU(s) {changed}",
            ),
        )
        reporting.event(
            self.cluster,
            change.node,
            "MIGReconfiguring",
            f"applying layout {desired}: GPU(s) {changed} change"
            if changed
            else f"finishing layout {desired} after an interrupted pass",
        )

    def _drain_phase(self, change: _Change, paused: list[str]) -> None:
        with self._phase(
            change, "drain", "MIGDraining", "evicting the pods that use the GPUs that change"
        ):
            self._drain(paused, change)
            self._still_wanted(change.desired)  # not worth applying a layout no longer asked for

    def _apply_phase(
        self, change: _Change, hook_run: hooks.HookRunner, reset_gpus: list[int]
    ) -> None:
        with self._phase(
            change,
            "apply",
            "MIGApplying",
            f"applying {len(change.plan.steps)} GPU step(s) to GPU(s) "
            f"{list(change.plan.changed_gpus)}",
        ):
            self._apply(change.desired, change.models, hook_run, reset_gpus, change.plan)

    def _verify_phase(self, change: _Change) -> None:
        with self._phase(
            change, "verify", "MIGVerifying", "re-reading the GPUs to check the layout is in place"
        ):
            self._verify(change.desired, change.models, change.node)

    def _post_apply_phase(self, change: _Change, hook_run: hooks.HookRunner) -> None:
        if not hook_run.hooks.of(hooks.POST_APPLY):
            return
        with self._phase(
            change,
            "post_apply",
            "MIGPostApply",
            f"running the post-apply hooks ({hook_run.hooks.source})",
        ):
            hook_run.run(hooks.POST_APPLY)
            self.cluster.patch_node(
                self.settings.node_name, annotations={self.settings.post_apply_annotation: None}
            )

    def _device_plugin_phase(
        self, change: _Change, paused: list[str], old_plugins: set[str]
    ) -> dict[str, int]:
        """Restart the device plugin; the resources the node then advertises."""
        if change.dra:
            return self._dra_phase(change, old_plugins)
        with self._phase(
            change,
            "device_plugin",
            "MIGDevicePluginRestart",
            "restarting the device plugin and waiting for the node to "
            "advertise the layout's resources",
        ):
            device_plugin.restart(self.cluster, self.settings, paused)
            return device_plugin.wait_resources(
                self.cluster,
                self.settings,
                self.gpus,
                self.clock,
                change.models,
                old_plugins,
                self.allocatable_devices,
            )

    def _dra_phase(self, change: _Change, old_plugins: set[str]) -> dict[str, int]:
        """Restart NVIDIA's DRA kubelet plugin (it reads the GPUs only when it starts); the
        devices the node's ResourceSlice then lists."""
        with self._phase(
            change,
            "device_plugin",
            "MIGDevicePluginRestart",
            "restarting NVIDIA's DRA kubelet plugin and waiting for the node's ResourceSlice to "
            "list the layout's devices",
        ):
            old_plugins |= dra.restart(self.cluster, self.settings)
            dra.wait_devices(
                self.cluster, self.settings, self.gpus, self.clock, change.models, old_plugins
            )
            return {}  # no extended resources to watch the health of

    def _applied(self, change: _Change, advertised: Mapping[str, int]) -> None:
        """The validators rerun, the GPUs published, ``success``."""
        s = self.settings
        if change.plan.is_empty:  # no verify ran: publish the GPU state (it may have been forged)
            reporting.record_devices(self.cluster, s, self.gpus, self.metrics)
        try:  # the operator validates the new devices; the layout is applied either way
            validators.delete(self.cluster, s, validators.AFTER)
        except MigAgentError as exc:
            log.warning("validators.delete_failed", error=str(exc))
        node = self.cluster.get_node(s.node_name)
        self._note_unhealthy(node, advertised)
        self._succeed(
            node,
            change.desired,
            self._with_health(
                f"layout {change.desired} applied to GPU(s) {list(change.plan.changed_gpus)}"
            ),
        )

    def _holds(
        self, change: _Change, pods: list[PodView] | None = None
    ) -> dict[tuple[str, str], frozenset[str]] | None:
        """(namespace, pod) -> the device ids (GPU and MIG UUIDs) it holds: from the kubelet's
        PodResources and, on a DRA node, from the ResourceClaims of the node's ``pods``
        (default: as the pass listed them) allocated from the node's pool. None when neither
        can tell."""
        holds: dict[tuple[str, str], frozenset[str]] = {}
        dra_node = known = change.dra
        if self.pod_devices is not None:
            try:
                listed = self.pod_devices()
            except MigAgentError as exc:
                log.warning("drain.pod_resources_unavailable", error=str(exc))
                listed = None
            if listed is not None and not self._ids_unknown(listed):
                holds.update(listed)
                known = True
        if dra_node:
            s = self.settings
            pods = pods if pods is not None else self._node_pods(change)
            if change.slices is None:
                change.slices = self.cluster.list_resource_slices(s.node_name)
            for key, devices in dra.holders(self.cluster, s, pods, change.slices).items():
                holds[key] = holds.get(key, frozenset()) | devices
        return holds if known else None

    def _fresh_pods(self, change: _Change) -> list[PodView]:
        change.pods = self.cluster.list_pods(node=self.settings.node_name)
        return change.pods

    def _node_pods(self, change: _Change) -> list[PodView]:
        """Every pod of the node, as the pass listed them (listed now if it did not)."""
        if change.pods is None:
            change.pods = self.cluster.list_pods(node=self.settings.node_name)
        return change.pods

    def _ids_unknown(self, listed: Mapping[tuple[str, str], frozenset[str]]) -> bool:
        """True (and said: log, and an Event when they change) when the kubelet names GPU
        devices by ids that are no UUIDs: who holds which device is then unknown, and every GPU
        pod is drained. NVIDIA's plugin registers UUIDs whatever its DEVICE_ID_STRATEGY (that
        changes only what a container is given); another plugin may not."""
        odd = sorted({i for ids in listed.values() for i in ids if not i.startswith(_UUIDS)})
        if not odd:
            return False
        message = (
            f"the kubelet names GPU devices by ids that are no UUIDs ({', '.join(odd[:4])}"
            f"{', ...' if len(odd) > 4 else ''}; not NVIDIA's device plugin?): "
            "which pod holds which device is unknown, so every GPU pod is drained"
        )
        log.warning("drain.device_ids_unknown", ids=odd[:8], reason=message)
        if odd != self.odd_device_ids:
            self.odd_device_ids = odd
            reporting.event_on_node(
                self.cluster, self.settings, "MIGDeviceOwnershipUnknown", message, warning=True
            )
        return True

    def _staying_devices(self, the_plan: planner.Plan) -> frozenset[str]:
        """Device ids (GPU and MIG UUIDs) that outlive ``the_plan``: every device of an unchanged
        GPU and the compute instances of kept GPU instances."""
        changed = {g.gpu: g for g in the_plan.gpus if not g.is_empty}
        staying: set[str] = set()
        for gpu in self.gpus.observe().gpus:
            gp = changed.get(gpu.index)
            if gp is None and not gpu.mig_current:
                staying.add(gpu.info.uuid)
            kept = None if gp is None else {d.gi_placement for d in gp.devices if d.kept}
            for gi in gpu.gpu_instances:
                if kept is None or gi.placement in kept:
                    staying.update(ci.uuid for ci in gi.compute_instances if ci.uuid)
        return frozenset(staying)

    def _pods_that_may_stay(
        self, the_plan: planner.Plan, holds: Mapping[tuple[str, str], frozenset[str]] | None
    ) -> Callable[[PodView], bool] | None:
        if holds is None:
            return None  # cannot tell: every GPU pod goes
        staying = self._staying_devices(the_plan)

        def may_stay(pod: PodView) -> bool:
            devices = holds.get((pod.ref.namespace, pod.ref.name), frozenset())
            return bool(devices) and devices <= staying  # pods holding nothing known are drained

        return may_stay

    def _refuse_what_no_drain_ends(
        self, change: _Change, reset_gpus: list[int], hook_run: hooks.HookRunner
    ) -> None:
        """GpuBusy, before anything is touched, when the plan would end processes on devices no
        pod holds (a host process, a container outside Kubernetes): the drain cannot end them,
        so cordoning and evicting would only cost the pods and the wait. Those of a pod just
        deleted may linger a moment (container teardown): looked at again until
        ``gpu_release_timeout_s``. Left to the re-plan after the drain when the kubelet cannot
        tell who holds what, or when something the agent runs may end them (the host GPU
        clients it stops for a reset, the site's hooks before the apply)."""
        s, the_plan, observed = self.settings, change.plan, change.observed
        if (self.pod_devices is None and not change.dra) or any(
            hook_run.hooks.of(h)
            for h in (hooks.APPLY_START, hooks.PRE_APPLY_MODE, hooks.PRE_APPLY_CONFIG)
        ):
            return
        stopped = set(reset_gpus) if s.stop_host_gpu_clients else set()
        deadline = self.clock.now() + s.gpu_release_timeout_s
        delays = poll_delays(s.poll_s)
        holds: dict[tuple[str, str], frozenset[str]] | None = None
        asked_for: frozenset[int] | None = None  # the pids when who holds what was asked
        while True:
            ended = [
                p
                for p in planner.ended_processes(the_plan, observed)
                if p.devices and p.gpu not in stopped
            ]
            if not ended:
                return
            pids_now = frozenset(p.pid for p in ended)
            if asked_for is None or not pids_now <= asked_for:
                # asked again only for processes not there before (a pod that started since):
                # the processes of pods just deleted linger on devices their pods no longer hold
                try:
                    holds = self._holds(
                        change, None if asked_for is None else self._fresh_pods(change)
                    )
                except MigAgentError:
                    holds = None
                asked_for = pids_now
            if holds is None:
                return  # cannot tell: the drain and the re-plan after it decide
            held = frozenset().union(*holds.values())
            foreign = [p for p in ended if not p.devices & held]
            if not foreign:
                return
            pids = sorted({p.pid for p in foreign})
            if self.clock.now() >= deadline:
                busy = GpuBusy(
                    f"{planner.describe_in_use(foreign)}, which no pod holds: no drain would "
                    "end them, so nothing was touched (stop them, and the agent retries)",
                    pids=pids,
                )
                # where a reset waits on them: name the host GPU clients that may be theirs
                self._blocked(busy, sorted({p.gpu for p in foreign} & set(reset_gpus)))
                raise busy
            log.info("gpu.waiting_for_processes", pids=pids, held_by="no pod")
            self.clock.sleep(next(delays))
            observed = self.gpus.observe()

    def _drain_blocked(self, pod: PodRef, exc: EvictionBlocked) -> None:
        """A PodDisruptionBudget refuses an eviction: say so while the drain keeps trying
        (state stays pending; the pass fails at the drain timeout as before)."""
        s = self.settings
        message = (
            f"{exc}; retrying every {s.eviction_retry_s:g} s for up to {s.drain_timeout_s:g} s"
        )
        reporting.condition(
            self.cluster, s, NodeCondition(s.condition_type, "False", "DrainBlocked", message)
        )
        reporting.event_on_node(self.cluster, s, "MIGDrainBlocked", message, warning=True)

    def _drain_waiting(self, slowest: PodView, left: int, up_to_s: float) -> None:
        """Evicted pods take their time (a checkpoint, a long grace period): say what the drain
        waits for, so that a long drain does not look like a hung agent."""
        s = self.settings
        message = (
            f"waiting for {left} evicted GPU pod(s) to stop; the slowest, {slowest.ref}, has a "
            f"grace period of {slowest.grace_period_s:g} s: the drain waits up to "
            f"{up_to_s:.0f} s, and the node stays cordoned while they run"
        )
        reporting.condition(
            self.cluster, s, NodeCondition(s.condition_type, "False", "DrainWaiting", message)
        )
        reporting.event_on_node(self.cluster, s, "MIGDrainWaiting", message)

    def _refuse_what_the_drain_must_not_evict(self, change: _Change) -> None:
        """DrainRefused, before the cordon, for GPU pods the drain would evict but must not: a
        DaemonSet's that no paused operand label stops (it would come back at once and take
        its device again: GpuBusy at every retry), a static pod, or one no controller owns
        (gone for good: kubectl drain's default), naming each."""
        if change.plan.is_empty:
            return
        # the drain asks the kubelet again after the cordon: a pod placed meanwhile is then known
        _, refusals = self._drain_plan(change)
        if refusals:
            raise DrainRefused("; ".join(refusals) + "; nothing was touched")

    def _drain_plan(self, change: _Change) -> tuple[list[PodView], list[str]]:
        """The GPU pods the drain would evict for ``change`` (the paused operands' among them)
        and why it must not start (drain_refusals; empty: it may); none for an empty plan."""
        s, the_plan = self.settings, change.plan
        if the_plan.is_empty:
            return [], []
        paused = paused_during_change(change.node.labels, s.operand_labels)
        # the drain asks the kubelet again after the cordon: a pod placed meanwhile is then known
        holds = self._holds(change)
        pods = to_drain(
            self._node_pods(change),
            self._pods_that_may_stay(the_plan, holds),
            claimed=_claimed(change, holds),
        )
        refusals = drain_refusals(
            pods,
            operand_labels=paused,
            evict_unmanaged=s.evict_unmanaged_pods,
            delete_emptydir_data=s.delete_emptydir_data,
            advise=s.operand_labels,
        )
        return pods, refusals

    def _drain(self, paused: list[str], change: _Change) -> None:
        s = self.settings
        # the node's pods now, after the cordon: a pod placed since the pass looked is known;
        # the drain's and the operands' waits watch on from this look
        seen = PodsSeen()
        pods = change.pods = look(self.cluster, s.node_name, seen)
        holds = self._holds(change, pods)
        operand_pods = [p.ref for p in pods if is_paused_operand(p, paused)]
        # their results are of devices about to go; the operator reruns them after the change
        validators.delete(self.cluster, s, validators.BEFORE, pods)
        # the paused operands terminate while the GPU pods do: one termination to wait for,
        # not two in a row
        try:
            evicted = self._drain_gpu_pods(change, operand_pods, holds, pods, seen)
        except (EvictionBlocked, DrainTimeout) as exc:
            raise self._drain_retried(exc, change.desired) from None
        self.metrics.evictions.inc(len(evicted))
        if operand_pods:
            log.info("operands.waiting", pods=len(operand_pods))
            wait_pods_gone(
                self.cluster,
                s.node_name,
                operand_pods,
                timeout_s=s.operand_timeout_s,
                poll_s=s.poll_s,
                what="paused operand pods",
                clock=self.clock,
                seen=seen,
            )

    def _drain_gpu_pods(
        self,
        change: _Change,
        operand_pods: list[PodRef],
        holds: dict[tuple[str, str], frozenset[str]] | None,
        pods: list[PodView],
        seen: PodsSeen,
    ) -> list[PodRef]:
        s, the_plan = self.settings, change.plan
        return drain_gpu_pods(
            self.cluster,
            s.node_name,
            timeout_s=s.drain_timeout_s,
            retry_s=s.eviction_retry_s,
            poll_s=s.poll_s,
            clock=self.clock,
            exclude=operand_pods,
            may_stay=self._pods_that_may_stay(the_plan, holds),
            claimed=_claimed(change, holds),
            on_blocked=self._drain_blocked,
            on_waiting=self._drain_waiting,
            still_wanted=lambda: self._still_wanted(change.desired),
            pods=pods,
            seen=seen,
        )

    def _drain_retried(self, exc: MigAgentError, desired: str) -> MigAgentError:
        """A failed drain is retried with the node kept cordoned between tries (no pods land
        on it to be evicted again), until ``drain_give_up_s`` after its first failed try for
        this layout; then DrainGivenUp: uncordoned, failed until a new label or config."""
        s, now = self.settings, self.clock.now()
        if self.drain_failing is None or self.drain_failing[0] != desired:
            self.drain_failing = (desired, now)
        elapsed = now - self.drain_failing[1]
        if elapsed < s.drain_give_up_s:
            return node_guard.keep_cordon_for(
                exc,
                f"the drain is retried for up to {s.drain_give_up_s:g} s "
                "(drain_give_up_s): the node stays cordoned between tries",
            )
        self.drain_failing = None
        return DrainGivenUp(
            f"{exc}; given up after {elapsed:.0f} s of retries (drain_give_up_s "
            f"{s.drain_give_up_s:g} s): the node is uncordoned; change the layout label or the "
            "config to try again",
            **exc.context,
        )

    def _apply(
        self,
        desired: str,
        models: Mapping[int, GpuModel],
        hook_run: hooks.HookRunner,
        reset_gpus: list[int],
        drained_for: planner.Plan,
    ) -> None:
        """Re-plan now that the pods are gone, and apply (mig_agent.node.apply.apply_plan: the
        hooks around the steps); a mode change left pending needs a reboot."""
        assert self.catalog is not None
        try:
            the_plan = self._plan_after_drain(self.catalog.get(desired), models, drained_for)
        except GpuBusy as exc:
            self._blocked(exc, reset_gpus)
            raise
        try:
            pending = apply_plan(the_plan, self.gpus, hook_run)
        except GpuBusy as exc:
            self._blocked(exc, reset_gpus)
            raise
        if pending is not None:
            self._reboot_or_fail(desired, pending)

    def _blocked(self, exc: GpuBusy, reset_gpus: list[int]) -> None:
        """A busy GPU that a reset needs: raise it with what of the host may hold it added
        to the reason; any other busy GPU is left to raise as it is."""
        if reset_gpus:
            hint = host_clients.blocking(self.settings, self.run_command, reset_gpus)
            raise GpuBusy(f"{exc}; {hint}", **exc.context) from exc

    def _plan_after_drain(
        self, layout: Layout, models: Mapping[int, GpuModel], drained_for: planner.Plan
    ) -> planner.Plan:
        """Re-plan, now refusing what is in use. An evicted pod's processes can outlive its Pod
        object for a moment (container teardown), so a busy GPU is looked at again until
        ``gpu_release_timeout_s``; then it is a real busy GPU (GpuBusy, naming the pids)."""
        deadline = self.clock.now() + self.settings.gpu_release_timeout_s
        delays = poll_delays(self.settings.poll_s)
        while True:
            try:
                # the drain spared the pods on what the first plan keeps and evicted the
                # rest: keep the same instances, so no pod went for a device that stays
                return planner.plan(layout, self.gpus.observe(), models, prefer=drained_for)
            except GpuBusy as exc:
                if self.clock.now() >= deadline:
                    raise
                log.info("gpu.waiting_for_processes", error=str(exc))
                self.clock.sleep(next(delays))

    def _verify(self, desired: str, models: Mapping[int, GpuModel], node: NodeView) -> None:
        assert self.catalog is not None
        verify(self.catalog.get(desired), self.gpus.observe(), models)
        # the GPU state published as the pass last had the node: new devices, a new text
        reporting.record_devices(self.cluster, self.settings, self.gpus, self.metrics, node)

    def _reboot_or_fail(self, desired: str, exc: GpuResetRequired) -> None:
        s = self.settings
        node = self.cluster.get_node(s.node_name)
        if not s.reboot_command:
            raise GpuResetRequired(
                f"{exc}; no reboot command is configured, reboot the node to finish", **exc.context
            ) from exc
        if node.annotations.get(s.reboot_annotation) == desired:
            raise GpuResetRequired(
                f"{exc}; MIG mode change did not take effect after "
                "rebooting once, not rebooting again",
                **exc.context,
            ) from exc
        self.seen = (desired, State.REBOOTING)  # our own label: no wake-up for it
        self.cluster.patch_node(
            s.node_name,
            labels={s.state_label: State.REBOOTING},
            annotations={s.reboot_annotation: desired},
            expect_labels={s.config_label: desired},
        )
        self.metrics.set_state(State.REBOOTING)
        reporting.event(
            self.cluster, node, "MIGRebooting", f"{exc}; rebooting the node", warning=True
        )
        log.warning("node.rebooting", error=str(exc))
        try:
            if self.reboot is not None:
                self.reboot(s.reboot_command)
            else:
                run_reboot(s.reboot_command, s.reboot_timeout_s)
        except RebootFailed:
            # No reboot happened: disarm the guard, so that a fixed command gets its one reboot.
            with contextlib.suppress(MigAgentError):
                self.cluster.patch_node(s.node_name, annotations={s.reboot_annotation: None})
            raise
        raise NodeRebooting()

    # -- cordon and operands ------------------------------------------------------------------

    # -- reporting ----------------------------------------------------------------------------

    def _set_state(self, node: NodeView, state: State, desired: str) -> NodeView:
        s = self.settings
        self.metrics.set_state(state)
        if node.labels.get(s.state_label) == state:
            return node
        log.info("labels.patched", state=str(state))
        # before the patch: the watch must not take our own label for someone else's change
        self.seen = (desired, str(state))
        return self.cluster.patch_node(
            s.node_name,
            labels={s.state_label: str(state)},
            expect_labels={s.config_label: desired},
            known=node,
        )

    def _note_unhealthy(self, node: NodeView, want: Mapping[str, int]) -> bool:
        """Report the devices the plugin lists unhealthy: the metric always, an Event when they
        change; True when they did. Never a reason to cordon, pause or restart anything: the
        layout is in place whatever an Xid did to a device."""
        unhealthy = device_plugin.listing(node, want).unhealthy
        self.metrics.set_unhealthy(unhealthy)
        if unhealthy == self.unhealthy:
            return False
        self.unhealthy = dict(unhealthy)
        if unhealthy:
            log.warning("devices.unhealthy", devices=unhealthy)
            reporting.event(
                self.cluster,
                node,
                "MIGUnhealthyDevices",
                reporting.unhealthy_note(unhealthy),
                warning=True,
            )
        else:
            log.info("devices.healthy")
            reporting.event(
                self.cluster,
                node,
                "MIGDevicesHealthy",
                "every device the device plugin lists is healthy again",
            )
        return True

    def _with_health(self, message: str) -> str:
        note = reporting.unhealthy_note(self.unhealthy)
        return f"{message}; {note}" if note else message

    def _succeed(self, node: NodeView, desired: str, message: str) -> None:
        s = self.settings
        self.seen = (desired, State.SUCCESS)
        # only while the label still asks for this layout: a relabel during the pass must not
        # read as success of the new one
        self.cluster.patch_node(
            s.node_name,
            labels={s.state_label: State.SUCCESS},
            annotations={
                s.reason_annotation: None,
                s.reboot_annotation: None,
                s.post_apply_annotation: None,
                s.observe_annotation: None,  # an observe mode's report, stale now
            },
            expect_labels={s.config_label: desired},
            known=node,
        )
        self.metrics.set_state(State.SUCCESS)
        self.metrics.last_success.set(time.time())
        reporting.condition(
            self.cluster, self.settings, NodeCondition(s.condition_type, "True", "Applied", message)
        )
        reporting.event(self.cluster, node, "MIGConfigApplied", message)
        log.info("reconcile.succeeded", message=message)

    def _failed(self, desired: str, exc: MigAgentError) -> PassResult:
        s = self.settings
        reason = _reason(exc)
        retry = None
        if exc.retryable:
            self.failures += 1
            # the exponent capped: a budget that never allows the eviction fails for a week
            retry = min(s.backoff_s * 2 ** min(self.failures - 1, 32), s.backoff_max_s)
        log.error(
            "reconcile.failed",
            error=reason,
            error_type=type(exc).__name__,
            retryable=exc.retryable,
            retry_in_s=retry,
            **{
                k: v
                for k, v in exc.context.items()
                if k not in ("node", "layout", "refs", _NOTE, node_guard.KEEP_CORDON)
            },
        )
        self.metrics.reconfigurations.labels(result="failed", layout=desired).inc()
        self.metrics.set_state(State.FAILED)
        if isinstance(exc, GpuUnavailable):
            self.gpu_status = f"NVML unreachable: {exc}"
        try:
            # before the patch: the watch must not take our own "failed" for someone's change
            self.seen = (desired, State.FAILED)
            node = self.cluster.patch_node(
                s.node_name,
                labels={s.state_label: State.FAILED},
                annotations={s.reason_annotation: reason[:4096]},
                expect_labels={s.config_label: desired},
            )
            reporting.condition(
                self.cluster,
                self.settings,
                NodeCondition(s.condition_type, "False", type(exc).__name__, reason),
            )
            reporting.event(
                self.cluster,
                node,
                "MIGConfigFailed",
                reason
                + (
                    f" (retrying in {retry:.0f} s)"
                    if retry
                    else " (waiting for a label or config change)"
                ),
                warning=True,
            )
        except LabelsChanged as changed:
            return self._superseded(desired, changed)
        except MigAgentError as report_exc:  # API down: retry the whole pass later
            log.error("reconcile.report_failed", error=str(report_exc))
            retry = retry or s.backoff_s
        return PassResult(Outcome.FAILED, retry, reason)

    # -- the loop (mig_agent.agent.loop) --------------------------------------------------------

    def wake(self) -> None:
        self.wake_event.set()

    def watch_forever(self, stop: threading.Event) -> None:
        loop.watch_forever(self, stop)

    def run(self, stop: threading.Event, *, config_poll_s: float = 5.0) -> None:
        self.stopping = stop  # the waits inside a pass look at it
        loop.run(self, stop, config_poll_s=config_poll_s)


def _claimed(
    change: _Change, holds: Mapping[tuple[str, str], frozenset[str]] | None
) -> frozenset[tuple[str, str]]:
    """On a DRA node, the pods that hold the node's devices by claim: GPU pods, though they
    request no GPU resource."""
    return frozenset(holds or {}) if change.dra else frozenset()


def _crashed(exc: Exception) -> InternalError:
    """A bug, logged with its traceback, as the failure the node reports."""
    log.exception("reconcile.crashed", error_type=type(exc).__name__)
    return InternalError(
        f"unexpected {type(exc).__name__}: {exc} (a bug in "
        "mig-agent; the pass was undone and is retried)"
    )


_UUIDS = ("GPU-", "MIG-")  # how NVIDIA's plugin names devices by default (uuid strategy)
_NOTE = "note"  # a failure's context key: what the agent did about it, for the reason


def _reason(exc: MigAgentError) -> str:
    """The failure as the node reports it: the error, what was done about it, and why the node
    stays cordoned, if it does."""
    parts = [str(exc), str(exc.context.get(_NOTE, ""))]
    kept = node_guard.cordon_kept_for(exc)
    if kept and kept not in parts[1]:
        parts.append(kept)
    return "; ".join(p for p in parts if p)


def _advertiser(change: _Change) -> str:
    return "NVIDIA's DRA plugin" if change.dra else "the device plugin"


def _mig_layout(state: NodeState) -> tuple[object, ...]:
    """What of the GPUs a plugin advertises: MIG modes and instances, not processes."""
    return tuple((g.mig_current, g.mig_pending, g.gpu_instances) for g in state.gpus)
