"""The agent: from the node's layout label to a repartitioned node, and back to a clean node.

One reconcile pass: read the node, plan against the GPUs as they are (nothing to do: ``success``,
nothing touched), else ``pending``, cordon, pause GPU operands, drain GPU pods, apply, restart the
device plugin (or NVIDIA's DRA plugin) and wait for the node to advertise the layout, then
resume, uncordon, ``success``. Every failure restores operands and uncordons (in ``finally``),
writes the reason (label, annotation, condition, event, log) and, when the cause can pass,
retries with capped backoff.

All progress lives on the Node (labels and annotations), so a restarted agent finishes or undoes
what an interrupted one started. The pass's phases are modules of their own, ordered by
change_pass; this module holds the agent between passes: its configuration, its health, what
it remembers (change.Memory), and what a pass's outcome means for the node (failed, superseded,
stopped). loop holds the run loop and the node watch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from mig_agent.agent import guard, host_clients, loop, observe, reporting
from mig_agent.agent.advertisers import device_plugin
from mig_agent.agent.change import NOTE, Memory, Tools
from mig_agent.agent.change_pass import ChangePass, crashed
from mig_agent.agent.marks import NodeRebooting
from mig_agent.agent.outcome import Outcome, PassResult
from mig_agent.agent.phases.drain import pod_names
from mig_agent.agent.phases.finish import Finish
from mig_agent.agent.phases.holders import Holders
from mig_agent.agent.phases.planning import Planning
from mig_agent.config.settings import Settings
from mig_agent.core.errors import (
    ConfigError,
    DevicePluginMissing,
    DevicePluginTimeout,
    DrainGivenUp,
    DraPluginMissing,
    GpuUnavailable,
    LabelsChanged,
    MigAgentError,
    Stopping,
)
from mig_agent.core.generated_layouts import with_generated
from mig_agent.core.guard import Owed
from mig_agent.core.labels import paused_during_change
from mig_agent.core.layout import Layout, LayoutCatalog
from mig_agent.core.observe_report import ObserveReport
from mig_agent.gpu.backend import GpuBackend
from mig_agent.host import commands
from mig_agent.kube.cluster import Cluster, NodeCondition, NodeView, PodRef
from mig_agent.node.drain import is_paused_operand
from mig_agent.node.waits import Clock
from mig_agent.observability.metrics import Metrics

log = structlog.get_logger(__name__)

UNTOUCHED = "nothing was touched"
TOUCHED_BEFORE = "this pass touched nothing (the GPUs changed in an earlier one)"


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
    # the id of the node's boot; None: the kernel's (tests give their own)
    boot_id: Callable[[], str] | None = None
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
    _fingerprint: tuple[tuple[str, float, int], ...] = ()
    # the labels that choose how the device plugin advertises, as the last pass read them
    seen_plugin_labels: tuple[str | None, ...] = ()
    wake_event: threading.Event = field(default_factory=threading.Event)
    # set when the agent is told to stop (SIGTERM): every wait inside a pass ends at once
    stopping: threading.Event = field(default_factory=threading.Event)
    # what the agent keeps from one pass to the next (the state it last wrote, failures in a
    # row, devices last said unhealthy, ...): the phases are handed it
    memory: Memory = field(default_factory=Memory)

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
        return self.memory.gpu_status

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
            if not self.memory.gpu_status.startswith(head):  # the hint's pod list: once per outage
                self.memory.gpu_status = f"{head}; {self._runtime_hint()}"
        except MigAgentError as exc:
            self.memory.gpu_status = f"NVML unreachable: {exc}"
        else:
            self.memory.gpu_status = ""
        return self.memory.gpu_status

    def refresh_holders(self) -> None:
        """Between passes: which pod holds which device published anew once the kubelet's
        PodResources listing differs from the one last published in full (a pod came or went,
        or one was too new to tell); the node's pods listed only then."""
        if self.pod_devices is None:
            return
        try:
            listed = self.pod_devices()
        except MigAgentError as exc:
            log.debug("gpu_state.holders_unknown", error=str(exc))
            return
        if listed == self.memory.held.listed:
            return
        self.tools.record_devices(self.memory.held)

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

    # -- what the agent remembers, as the loop and the health checks read it ---------------

    @property
    def seen(self) -> tuple[str | None, str | None]:
        """(layout label, state label) as the agent last read or wrote them."""
        return self.memory.seen

    @seen.setter
    def seen(self, value: tuple[str | None, str | None]) -> None:
        self.memory.seen = value

    @property
    def failures(self) -> int:
        return self.memory.failures

    @failures.setter
    def failures(self, value: int) -> None:
        self.memory.failures = value

    @property
    def gpu_status(self) -> str:
        return self.memory.gpu_status

    @property
    def tools(self) -> Tools:
        """What the phases work with, as the agent holds it now (tests swap its parts)."""
        return Tools(
            self.settings,
            self.cluster,
            self.gpus,
            self.clock,
            self.metrics,
            self.run_command,
            self.pod_devices,
            self.allocatable_devices,
            self.reboot,
            self.boot_id,
        )

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
            return self._idle(node)
        structlog.contextvars.bind_contextvars(layout=desired)
        start = self.clock.now()
        try:
            result = self._reconcile(node, desired)
        except NodeRebooting:
            # Still alive after the reboot command: look again soon (the guard stops a loop).
            return PassResult(Outcome.REBOOTING, retry_after_s=self.settings.backoff_s)
        except LabelsChanged as exc:
            return self._superseded(exc)
        except Stopping as exc:
            return self._stopped(exc)
        except MigAgentError as exc:
            return self._failed_and_tidied(desired, exc)
        except Exception as exc:  # noqa: BLE001 (a bug must not end the agent: it reports it)
            return self._failed_and_tidied(desired, crashed(exc))
        self.memory.failures = 0
        if result is Outcome.APPLIED:
            self.metrics.reconfigurations.labels(result="success", layout=desired).inc()
            log.info(
                "reconcile.finished",
                outcome=str(result),
                duration_s=round(self.clock.now() - start, 3),
            )
        return PassResult(result)

    def _idle(self, node: NodeView) -> PassResult:
        """No layout asked for: the node clean, no state to report (an old "failed" would
        mislead), services an earlier pass stopped started again."""
        s = self.settings
        # a change given up half-way owes the node its listing: the advertiser restarted
        try:
            settled = guard.settle(
                self.tools, None, node=node, readvertise=True, dra_node=self.memory.dra_seen
            )
        except Stopping as stop:  # told to stop while the advertiser restarts
            return self._stopped(stop)
        try:
            host_clients.start_leftover(self.cluster, s, self.run_command, node.annotations)
        except MigAgentError as exc:
            log.error("host_clients.start_failed", error=str(exc))
        ours = (s.reason_annotation, s.post_apply_annotation, s.observe_annotation)
        annotations: dict[str, str | None] = dict.fromkeys(ours)
        # a cordon kept says why on the node, though no layout is asked for
        kept = [settled.note, settled.verdict.why] if not settled.verdict.schedulable else []
        if any(kept):
            annotations[s.reason_annotation] = "; ".join(p for p in kept if p)[:4096]
        if s.state_label in node.labels or any(a in node.annotations for a in ours) or any(kept):
            node = self.cluster.patch_node(
                s.node_name,
                labels={s.state_label: None},
                annotations=annotations,
            )
            self.seen = (None, None)
        self.metrics.set_state("")
        self.tools.record_devices(self.memory.held, node)
        return PassResult(Outcome.IDLE)

    def _reconcile(self, node: NodeView, desired: str) -> Outcome:
        """The pass's phases (change_pass); any failure leaves by an exception."""
        layout = self._layout(desired)
        return ChangePass(self.tools, self.memory, self._still_wanted).run(node, desired, layout)

    def _layout(self, desired: str) -> Layout:
        """The layout the label names; ConfigError for none (an unknown layout starts
        nothing)."""
        if self.catalog is None:
            raise ConfigError(f"profile configs not loaded: {self.catalog_error}")
        return self.catalog.get(desired)

    def _observe(self, node: NodeView, desired: str | None) -> PassResult:
        """Observe mode: the plan and the pods its drain would evict, said on the node
        (mig_agent.agent.observe); no other write, no hook, no GPU change."""
        if not desired:
            observe.clear(self.cluster, self.settings, node)
            return PassResult(Outcome.IDLE)
        structlog.contextvars.bind_contextvars(layout=desired)
        retry = None
        t = self.tools
        try:
            change = Planning(t, self.memory).plan(node, desired, self._layout(desired))
            pods, refusals = Holders(t, self.memory).drain_plan(change)
            paused = paused_during_change(node.labels, self.settings.operand_labels)
            evict = tuple(str(p.ref) for p in pods if not is_paused_operand(p, paused))
            report = ObserveReport(desired, change.plan, evict, tuple(refusals))
        except MigAgentError as exc:
            report = ObserveReport(desired, error=str(exc))
            retry = self.settings.backoff_s if exc.retryable else None
        if not observe.publish(self.cluster, self.settings, node, report):
            retry = self.settings.backoff_s
        return PassResult(Outcome.OBSERVED, retry, report.error)

    def _stopped(self, exc: Stopping) -> PassResult:
        """Told to stop inside a wait: the guard settles the node (a successor starts the pass
        over; the state label still says pending), keeping the cordon while pods the drain
        evicted still terminate, or the GPUs changed and are not advertised yet."""
        going = tuple(str(r) for r in exc.refs if isinstance(r, PodRef))
        desired, _ = self.seen
        with contextlib.suppress(MigAgentError, Stopping):  # best effort: the agent is going
            guard.settle(
                self.tools, desired, owed=Owed(evicted=going), dra_node=self.memory.dra_seen
            )
        log.info("reconcile.stopped", reason="the agent is stopping")  # once the node is settled
        return PassResult(Outcome.STOPPED)

    def _failed_and_tidied(self, desired: str, exc: MigAgentError) -> PassResult:
        """The guard settles the node first (the advertiser restarted where the GPUs changed
        and it did not just fail itself); its verdict goes into the reason."""
        again = not isinstance(exc, DevicePluginTimeout | DevicePluginMissing | DraPluginMissing)
        try:
            settled = guard.settle(
                self.tools,
                desired,
                owed=owed_by(exc),
                readvertise=again,
                dra_node=self.memory.dra_seen,
            )
        except Stopping as stop:  # told to stop while the advertiser restarts: a stop
            going = exc.context.get("refs", ())
            return self._stopped(
                Stopping((*stop.refs, *(going if isinstance(going, tuple) else ())))
            )
        except MigAgentError as err:
            log.error("node.settle_failed", error=str(err))
            settled = None
        if settled is not None:
            said = [str(exc.context.get(NOTE, "")), settled.note, settled.verdict.why]
            exc.context[NOTE] = "; ".join(p for p in said if p)
            if settled.verdict.record is not None and settled.verdict.record.gpus:
                # this pass touched nothing, but the GPUs are not as the node lists them
                exc.args = (str(exc).replace(UNTOUCHED, TOUCHED_BEFORE),)
        try:
            failed = Finish(self.tools, self.memory).failed(desired, exc)
        except LabelsChanged as changed:
            return self._superseded(changed)
        verdict = settled.verdict if settled is not None else None
        if failed.retry_after_s is not None:
            return failed
        if verdict is None or not verdict.schedulable:  # the cordon stays: looked at again
            return replace(failed, retry_after_s=self.settings.backoff_s)
        if verdict.drain_given_up:  # no new drain before its pods go: looked at now and then
            return replace(failed, retry_after_s=self.settings.backoff_max_s)
        return failed

    def _superseded(self, exc: LabelsChanged) -> PassResult:
        """The label asks for another layout now: report nothing for the one asked before,
        settle the node for the layout asked now, and start over at once."""
        log.info("reconcile.superseded", error=str(exc))
        asked = exc.context.get("labels", {})
        now = asked.get(self.settings.config_label) if isinstance(asked, dict) else None
        # pods the drain evicted still terminate on the GPUs: the cordon stays while they run
        going = Owed(evicted=tuple(sorted(pod_names(exc.context.get("refs", ())))))
        try:
            guard.settle(self.tools, now, owed=going, dra_node=self.memory.dra_seen)
        except MigAgentError as err:
            log.error("node.settle_failed", error=str(err))
        self.memory.failures = 0
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

    # -- the loop (mig_agent.agent.loop) --------------------------------------------------------

    def wake(self) -> None:
        self.wake_event.set()

    def watch_forever(self, stop: threading.Event) -> None:
        loop.watch_forever(self, stop)

    def run(self, stop: threading.Event, *, config_poll_s: float = 5.0) -> None:
        self.stopping = stop  # the waits inside a pass look at it
        loop.run(self, stop, config_poll_s=config_poll_s)


def owed_by(exc: MigAgentError) -> Owed:
    """What a failed pass adds to the node's record: the pods its drain evicted that may still
    run, when a failed drain's window began, the pods a drain gave up on."""
    evicted = tuple(sorted(pod_names(exc.context.get("refs", ()))))
    began = exc.context.get("drain_failed_at")
    given_up = exc.context.get("given_up", ()) if isinstance(exc, DrainGivenUp) else ()
    cause = exc.context.get("cause", "") if isinstance(exc, DrainGivenUp) else ""
    return Owed(
        evicted=evicted,
        drain_failed_at=float(began) if isinstance(began, int | float) else None,
        given_up=tuple(str(p) for p in given_up) if isinstance(given_up, tuple) else (),
        given_up_why=cause if isinstance(cause, str) else "",
    )
