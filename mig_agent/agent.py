"""The agent: from the node's layout label to a repartitioned node, and back to a clean node.

One reconcile pass: read the node, plan against the GPUs as they are (nothing to do: ``success``,
nothing touched), else ``pending``, cordon, pause GPU operands, drain GPU pods, apply, restart the
device plugin and wait for the node to advertise the layout, then resume, uncordon, ``success``.
Every failure restores operands and uncordons (in ``finally``), writes the reason (label,
annotation, condition, event, log) and, when the cause can pass, retries with capped backoff.

All progress lives on the Node (labels and annotations), so a restarted agent finishes or undoes
what an interrupted one started. This is the only module that sequences Kubernetes and GPU I/O.
"""

from __future__ import annotations

import contextlib
import enum
import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from mig_agent import labels, planner, snapshot
from mig_agent.catalog import device_plugin_sharing
from mig_agent.drain import Clock, drain_gpu_pods, wait_pods_gone
from mig_agent.errors import (
    ConfigError,
    DevicePluginTimeout,
    GpuBusy,
    GpuResetRequired,
    LabelsChanged,
    MigAgentError,
    PlanError,
    RebootFailed,
)
from mig_agent.executor import execute, verify
from mig_agent.gpu.backend import GpuBackend
from mig_agent.kube.cluster import Cluster, NodeCondition, NodeView, PodView
from mig_agent.labels import State
from mig_agent.layout import Layout, LayoutCatalog
from mig_agent.metrics import Metrics
from mig_agent.models import GpuModel
from mig_agent.resources import (
    Sharing,
    expected_resources,
    format_resources,
    node_mig_strategy,
    planned_devices,
    strategy_problem,
)
from mig_agent.settings import Settings

log = structlog.get_logger(__name__)


class Outcome(enum.StrEnum):
    IDLE = "idle"  # no layout label
    NOOP = "noop"  # already applied
    APPLIED = "applied"
    FAILED = "failed"
    REBOOTING = "rebooting"
    SUPERSEDED = "superseded"  # the layout label changed during the pass: start over


@dataclass(frozen=True, slots=True)
class PassResult:
    outcome: Outcome
    retry_after_s: float | None = None  # set for retryable failures
    error: str = ""


class _Rebooting(Exception):
    """Raised past the clean-up: the node is about to reboot and stays cordoned and paused."""


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


REBOOT_TIMEOUT_S = 120.0


def run_reboot(command: str) -> None:
    """Run the reboot command; RebootFailed naming the command and how it failed."""
    try:
        subprocess.run(shlex.split(command), check=True, timeout=REBOOT_TIMEOUT_S,  # noqa: S603
                       capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        said = (exc.stderr or exc.stdout or "").strip().splitlines()[-1:]
        raise RebootFailed(f"reboot command {command!r} failed with exit status "
                           f"{exc.returncode}" + (f": {said[0][:300]}" if said else ""),
                           command=command) from exc
    except subprocess.TimeoutExpired as exc:
        raise RebootFailed(f"reboot command {command!r} did not return within "
                           f"{REBOOT_TIMEOUT_S:.0f} s", command=command) from exc
    except (OSError, ValueError) as exc:  # not found, not executable, unbalanced quotes
        raise RebootFailed(f"reboot command {command!r} could not run: {exc}",
                           command=command) from exc


@dataclass
class Agent:
    settings: Settings
    cluster: Cluster
    gpus: GpuBackend
    load_catalog: Callable[[str], LayoutCatalog]
    clock: Clock = field(default_factory=Clock)
    metrics: Metrics = field(default_factory=Metrics)
    reboot: Callable[[str], None] = run_reboot
    # (namespace, pod) -> GPU device ids it holds (kubelet PodResources); None: not known
    pod_devices: Callable[[], Mapping[tuple[str, str], frozenset[str]]] | None = None

    catalog: LayoutCatalog | None = None
    catalog_error: str = ""
    last_pass_at: float = 0.0
    watch_alive_at: float = 0.0
    # time.monotonic() of the loop's last sign of life: each turn between passes, and every
    # wait inside a pass (drain, device plugin); /healthz fails only when this stops
    loop_alive_at: float = field(default_factory=time.monotonic)
    _failures: int = 0
    _fingerprint: tuple[tuple[str, float, int], ...] = ()
    _seen: tuple[str | None, str | None] = (None, None)
    # the labels that choose how the device plugin advertises, as the last pass read them
    _seen_plugin_labels: tuple[str | None, ...] = ()
    _wake: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        sleep = self.clock.sleep

        def sleep_alive(seconds: float) -> None:
            self.loop_alive_at = time.monotonic()
            sleep(seconds)

        self.clock = Clock(self.clock.now, sleep_alive)

    def liveness_problem(self, now: float | None = None) -> str:
        """Why the agent should be restarted, or "": a loop or node watch that stopped moving.
        Never "no pass lately": a node waiting for a fixed label runs no pass for days."""
        now = time.monotonic() if now is None else now
        s = self.settings
        if now - self.loop_alive_at > s.stall_s:
            return f"reconcile loop stalled: no progress for {now - self.loop_alive_at:.0f} s"
        if now - self.watch_alive_at > max(s.stall_s, s.watch_timeout_s * 2.0) and \
                self.watch_alive_at:
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
            log.info(
                "config.loaded", layouts=len(self.catalog.layouts), config=self.settings.config
            )
        except ConfigError as exc:
            self.catalog_error = str(exc)
            log.error("config.invalid", error=str(exc), config=self.settings.config)
        return True

    # -- one pass -----------------------------------------------------------------------------

    def reconcile_once(self) -> PassResult:
        s = self.settings
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(node=s.node_name)
        self.last_pass_at = time.time()
        node = self.cluster.get_node(s.node_name)
        desired = node.labels.get(s.config_label)
        self._seen = (desired, node.labels.get(s.state_label))
        self._seen_plugin_labels = self._plugin_labels(node)
        if not desired:
            self._finish(node)
            if s.state_label in node.labels or s.reason_annotation in node.annotations:
                # no layout asked for: no state to report (an old "failed" would mislead)
                node = self.cluster.patch_node(s.node_name, labels={s.state_label: None},
                                               annotations={s.reason_annotation: None})
                self._seen = (None, None)
            self.metrics.set_state("")
            self._record_devices(node)
            return PassResult(Outcome.IDLE)
        structlog.contextvars.bind_contextvars(layout=desired)
        start = self.clock.now()
        try:
            result = self._reconcile(node, desired)
        except _Rebooting:
            # Still alive after the reboot command: look again soon (the guard stops a loop).
            return PassResult(Outcome.REBOOTING, retry_after_s=self.settings.backoff_s)
        except LabelsChanged as exc:
            return self._superseded(desired, exc)
        except MigAgentError as exc:
            tidy = self._tidy_up()
            failed = self._failed(desired, exc)
            if not tidy and failed.retry_after_s is None:  # our marks are still on the node
                return replace(failed, retry_after_s=self.settings.backoff_s)
            return failed
        self._failures = 0
        if result is Outcome.APPLIED:
            self.metrics.reconfigurations.labels(result="success", layout=desired).inc()
            log.info(
                "reconcile.finished",
                outcome=str(result),
                duration_s=round(self.clock.now() - start, 3),
            )
        return PassResult(result)

    def _superseded(self, desired: str, exc: LabelsChanged) -> PassResult:
        """The label asks for another layout now: report nothing for ``desired``, undo our
        marks, and start over at once."""
        log.info("reconcile.superseded", error=str(exc))
        self._tidy_up()
        self._failures = 0
        return PassResult(Outcome.SUPERSEDED, retry_after_s=0.0)

    def _tidy_up(self) -> bool:
        """Resume operands and uncordon if our marks are on the node (no pass runs now);
        False when that failed (logged): the node may still be cordoned by us."""
        try:
            self._finish(self.cluster.get_node(self.settings.node_name))
        except MigAgentError as exc:
            log.error("node.resume_failed", error=str(exc))
            return False
        return True

    def _still_wanted(self, desired: str) -> None:
        """LabelsChanged if the layout label no longer names ``desired``."""
        s = self.settings
        now = self.cluster.get_node(s.node_name).labels.get(s.config_label)
        if now != desired:
            raise LabelsChanged(f"layout label changed from {desired} to {now} during the pass",
                                labels={s.config_label: now})

    def _reconcile(self, node: NodeView, desired: str) -> Outcome:
        s = self.settings
        if self.catalog is None:
            raise ConfigError(f"profile configs not loaded: {self.catalog_error}")
        layout = self.catalog.get(desired)
        with self.metrics.phase("plan"):
            models = self.gpus.models()
            # destroy_in_use: GPU pods still run now; what they hold is checked after the drain
            observed = self.gpus.observe()
            the_plan = planner.plan(layout, observed, models, destroy_in_use=True)
            # what NVIDIA's plugin would refuse to advertise is refused before anything changes
            strategy, sharing = self._device_plugin_rules(node)
            problem = strategy_problem(planned_devices(the_plan, observed, models), strategy,
                                       sharing)
            if problem:
                raise PlanError(f"layout {desired}: {problem}", layout=desired)
        interrupted = self._interrupted(node) or (
            the_plan.is_empty
            and node.labels.get(s.state_label) == State.FAILED
            and not self._resources_ok(node, models)
        )
        if the_plan.is_empty and not interrupted:
            self._record_devices(node)
            if (
                node.labels.get(s.state_label) != State.SUCCESS
                or s.reason_annotation in node.annotations
            ):
                self._succeed(node, desired, f"layout {desired} is applied; nothing to change")
            self.metrics.set_state(State.SUCCESS)
            self.metrics.last_success.set(time.time())
            return Outcome.NOOP

        changed = list(the_plan.changed_gpus)
        log.info("reconcile.started", changed_gpus=changed, interrupted=interrupted)
        node = self._set_state(node, State.PENDING, desired)
        self._condition(
            NodeCondition(
                s.condition_type,
                "False",
                "Reconfiguring",
                f"applying layout {desired} to GPU(s) {changed}",
            )
        )
        self._event(
            node,
            "MIGReconfiguring",
            f"applying layout {desired}: GPU(s) {changed} change"
            if changed
            else f"finishing layout {desired} after an interrupted pass",
        )
        # a plugin pod already on its way out is no sign that a device plugin runs here
        old_plugins = {p.ref.uid for p in self._plugin_pods() if not p.terminating}
        with self._gpu_clients_paused(node) as paused:
            if not the_plan.is_empty:
                with self._phase(node, "drain", "MIGDraining",
                                 "evicting the pods that use the GPUs that change"):
                    self._drain(paused, the_plan)
                self._still_wanted(desired)  # not worth applying a layout no longer asked for
                with self._phase(node, "apply", "MIGApplying",
                                 f"applying {len(the_plan.steps)} GPU step(s) to GPU(s) "
                                 f"{changed}"):
                    self._apply(desired, models)
                with self._phase(node, "verify", "MIGVerifying",
                                 "re-reading the GPUs to check the layout is in place"):
                    self._verify(desired, models)
            with self._phase(node, "device_plugin", "MIGDevicePluginRestart",
                             "restarting the device plugin and waiting for the node to "
                             "advertise the layout's resources"):
                self._restart_device_plugin(paused)
                self._wait_resources(models, old_plugins)
        node = self.cluster.get_node(s.node_name)
        self._succeed(node, desired, f"layout {desired} applied to GPU(s) {changed}")
        return Outcome.APPLIED

    def _staying_devices(self, the_plan: planner.Plan) -> frozenset[str] | None:
        """Device ids (GPU and MIG UUIDs) that outlive ``the_plan``: every device of an unchanged
        GPU and the compute instances of kept GPU instances. None when the kubelet cannot tell
        which pod holds which device."""
        if self.pod_devices is None:
            return None
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

    def _pods_that_may_stay(self, the_plan: planner.Plan) -> Callable[[PodView], bool] | None:
        staying = self._staying_devices(the_plan)
        if staying is None or self.pod_devices is None:  # (the second check narrows the type)
            return None
        try:
            holds = self.pod_devices()
        except MigAgentError as exc:
            log.warning("drain.pod_resources_unavailable", error=str(exc))
            return None  # cannot tell: every GPU pod goes

        def may_stay(pod: PodView) -> bool:
            devices = holds.get((pod.ref.namespace, pod.ref.name), frozenset())
            return bool(devices) and devices <= staying  # pods holding nothing known are drained

        return may_stay

    def _drain(self, paused: list[str], the_plan: planner.Plan) -> None:
        s = self.settings
        operand_pods = [
            p.ref
            for p in self.cluster.list_pods(node=s.node_name)
            if "DaemonSet" in p.owner_kinds and set(p.node_selector) & set(paused)
        ]
        if operand_pods:
            log.info("operands.waiting", pods=len(operand_pods))
            wait_pods_gone(
                self.cluster,
                operand_pods,
                timeout_s=s.operand_timeout_s,
                poll_s=s.poll_s,
                what="paused operand pods",
                clock=self.clock,
            )
        evicted = drain_gpu_pods(
            self.cluster,
            s.node_name,
            timeout_s=s.drain_timeout_s,
            retry_s=s.eviction_retry_s,
            poll_s=s.poll_s,
            clock=self.clock,
            exclude=operand_pods,
            may_stay=self._pods_that_may_stay(the_plan),
        )
        self.metrics.evictions.inc(len(evicted))

    def _apply(self, desired: str, models: Mapping[int, GpuModel]) -> None:
        assert self.catalog is not None
        the_plan = self._plan_after_drain(self.catalog.get(desired), models)
        try:
            execute(the_plan, self.gpus)
        except GpuResetRequired as exc:
            self._reboot_or_fail(desired, exc)

    def _plan_after_drain(self, layout: Layout, models: Mapping[int, GpuModel]) -> planner.Plan:
        """Re-plan, now refusing what is in use. An evicted pod's processes can outlive its Pod
        object for a moment (container teardown), so a busy GPU is looked at again until
        ``gpu_release_timeout_s``; then it is a real busy GPU (GpuBusy, naming the pids)."""
        deadline = self.clock.now() + self.settings.gpu_release_timeout_s
        while True:
            try:
                return planner.plan(layout, self.gpus.observe(), models)
            except GpuBusy as exc:
                if self.clock.now() >= deadline:
                    raise
                log.info("gpu.waiting_for_processes", error=str(exc))
                self.clock.sleep(self.settings.poll_s)

    def _verify(self, desired: str, models: Mapping[int, GpuModel]) -> None:
        assert self.catalog is not None
        verify(self.catalog.get(desired), self.gpus.observe(), models)
        self._record_devices()

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
        self._seen = (desired, State.REBOOTING)  # our own label: no wake-up for it
        self.cluster.patch_node(
            s.node_name,
            labels={s.state_label: State.REBOOTING},
            annotations={s.reboot_annotation: desired},
            expect_labels={s.config_label: desired},
        )
        self.metrics.set_state(State.REBOOTING)
        self._event(node, "MIGRebooting", f"{exc}; rebooting the node", warning=True)
        log.warning("node.rebooting", error=str(exc))
        try:
            self.reboot(s.reboot_command)
        except RebootFailed:
            # No reboot happened: disarm the guard, so that a fixed command gets its one reboot.
            with contextlib.suppress(MigAgentError):
                self.cluster.patch_node(s.node_name, annotations={s.reboot_annotation: None})
            raise
        raise _Rebooting()

    def _restart_device_plugin(self, paused: list[str]) -> None:
        s = self.settings
        if any(k.endswith(".device-plugin") for k in paused):
            return  # resuming the operands brings a new device plugin pod
        pods = self._plugin_pods()
        if not pods:
            log.warning(
                "device_plugin.not_found",
                namespace=s.device_plugin_namespace,
                selector=s.device_plugin_selector,
            )
            return
        for p in pods:
            self.cluster.delete_pod(p.ref)
        log.info("device_plugin.restarted", pods=[p.ref.name for p in pods])

    def _plugin_pods(self) -> list[PodView]:
        s = self.settings
        return self.cluster.list_pods(node=s.node_name, namespace=s.device_plugin_namespace,
                                      label_selector=s.device_plugin_selector)

    def _resources_ok(self, node: NodeView, models: Mapping[int, GpuModel]) -> bool:
        """True unless a device plugin runs here and advertises other resources than the GPUs'."""
        s = self.settings
        if not self.cluster.list_pods(
            node=s.node_name,
            namespace=s.device_plugin_namespace,
            label_selector=s.device_plugin_selector,
        ):
            return True
        strategy, sharing = self._device_plugin_rules(node)
        return node.gpu_resources() == expected_resources(
            self.gpus.observe(), models, strategy, sharing
        )

    def _device_plugin_rules(self, node: NodeView) -> tuple[str, Sharing]:
        """The MIG strategy and sharing config NVIDIA's device plugin runs with on this node.

        The strategy is GFD's node label, else the setting. Sharing comes from the plugin's own
        config (``device_plugin_config``: the file, or the GPU Operator's ConfigMap folder with
        the config the node's ``nvidia.com/device-plugin.config`` label selects): that is what
        the plugin applies, and it is known before the change, where GFD's ``<resource>.replicas``
        labels lag it and exist only for resources already advertised.
        """
        s = self.settings
        strategy = node_mig_strategy(node.labels, label=s.mig_strategy_label,
                                     fallback=s.mig_strategy)
        sharing = device_plugin_sharing(s.device_plugin_config, node.labels,
                                        label=s.device_plugin_config_label,
                                        default=s.device_plugin_config_default)
        return strategy, sharing

    def _wait_resources(self, models: Mapping[int, GpuModel], old_plugins: set[str]) -> None:
        """Resume operands first if the device plugin is one of them; wait for a new, Ready
        device plugin pod (one not there before the pass: the old one's numbers are stale), then
        for the node to advertise the layout's resources."""
        s = self.settings
        node = self.cluster.get_node(s.node_name)
        resume = labels.resume_patch(node.labels, s.operand_labels)
        if any(k.endswith(".device-plugin") for k in resume):
            self.cluster.patch_node(s.node_name, labels=resume)
        has_plugin = (any(k.endswith(".device-plugin") for k in resume) or bool(old_plugins)
                      or bool(self._plugin_pods()))
        want = expected_resources(self.gpus.observe(), models, *self._device_plugin_rules(node))
        if not has_plugin:
            log.warning("device_plugin.skipped_wait", expected=want)
            return
        deadline = self.clock.now() + s.device_plugin_timeout_s
        new_pod = False
        while True:
            new_pod = new_pod or any(p.ready and not p.terminating and p.ref.uid not in old_plugins
                                     for p in self._plugin_pods())
            have = self.cluster.get_node(s.node_name).gpu_resources()
            if new_pod and have == want:
                log.info("device_plugin.resources_match", resources=want)
                return
            if self.clock.now() >= deadline and not new_pod:
                raise DevicePluginTimeout(
                    f"no new device plugin pod ({s.device_plugin_namespace}, "
                    f"{s.device_plugin_selector}) became Ready on the node within "
                    f"{s.device_plugin_timeout_s:.0f} s", expected=want, advertised=have)
            if self.clock.now() >= deadline:
                raise DevicePluginTimeout(
                    f"node resources do not match the layout after "
                    f"{s.device_plugin_timeout_s:.0f} s: expected {format_resources(want)}, node "
                    f"advertises {format_resources(have)}",
                    expected=want,
                    advertised=have,
                )
            self.clock.sleep(s.poll_s)

    # -- cordon and operands ------------------------------------------------------------------

    def _interrupted(self, node: NodeView) -> bool:
        s = self.settings
        return (
            node.labels.get(s.state_label) in (State.PENDING, State.REBOOTING)
            or s.cordon_annotation in node.annotations
            or s.paused_annotation in node.annotations
        )

    @contextlib.contextmanager
    def _gpu_clients_paused(self, node: NodeView) -> Iterator[list[str]]:
        """Cordon (unless already cordoned by someone else) and pause operands; always undo."""
        s = self.settings
        annotations: dict[str, str | None] = {}
        if not node.unschedulable:
            annotations[s.cordon_annotation] = "true"
        pause = labels.pause_patch(node.labels, s.operand_labels)
        already = [k for k in s.operand_labels if node.labels.get(k) == labels.PAUSED]
        paused = sorted({*pause, *already})
        if paused:
            annotations[s.paused_annotation] = ",".join(paused)
        if annotations or pause:
            # Annotations first in the same patch: a crash right after leaves a trail to undo.
            self.cluster.patch_node(
                s.node_name,
                labels=pause,
                annotations=annotations,
                unschedulable=True if not node.unschedulable else None,
            )
            log.info("node.paused", cordoned=not node.unschedulable, operands=paused)
        try:
            yield paused
        except _Rebooting:
            raise
        except Exception:  # a kill (not an exception) leaves the trail for the next agent
            with contextlib.suppress(MigAgentError):
                self._finish(self.cluster.get_node(s.node_name))
            raise
        self._finish(self.cluster.get_node(s.node_name))

    def _finish(self, node: NodeView) -> None:
        """Resume paused operands and uncordon if this agent cordoned; idempotent."""
        s = self.settings
        resume = labels.resume_patch(node.labels, s.operand_labels)
        annotations: dict[str, str | None] = {}
        uncordon = None
        if s.cordon_annotation in node.annotations:
            annotations[s.cordon_annotation] = None
            uncordon = False
        if s.paused_annotation in node.annotations:
            annotations[s.paused_annotation] = None
        if resume or annotations:
            self.cluster.patch_node(
                s.node_name, labels=resume, annotations=annotations, unschedulable=uncordon
            )
            log.info("node.resumed", uncordoned=uncordon is False, operands=sorted(resume))

    # -- reporting ----------------------------------------------------------------------------

    def _set_state(self, node: NodeView, state: State, desired: str) -> NodeView:
        s = self.settings
        self.metrics.set_state(state)
        if node.labels.get(s.state_label) == state:
            return node
        log.info("labels.patched", state=str(state))
        # before the patch: the watch must not take our own label for someone else's change
        self._seen = (desired, str(state))
        return self.cluster.patch_node(s.node_name, labels={s.state_label: str(state)},
                                       expect_labels={s.config_label: desired})

    def _succeed(self, node: NodeView, desired: str, message: str) -> None:
        s = self.settings
        self._seen = (desired, State.SUCCESS)
        # only while the label still asks for this layout: a relabel during the pass must not
        # read as success of the new one
        self.cluster.patch_node(
            s.node_name,
            labels={s.state_label: State.SUCCESS},
            annotations={s.reason_annotation: None, s.reboot_annotation: None},
            expect_labels={s.config_label: desired},
        )
        self.metrics.set_state(State.SUCCESS)
        self.metrics.last_success.set(time.time())
        self._condition(NodeCondition(s.condition_type, "True", "Applied", message))
        self._event(node, "MIGConfigApplied", message)
        log.info("reconcile.succeeded", message=message)

    def _failed(self, desired: str, exc: MigAgentError) -> PassResult:
        s = self.settings
        reason = str(exc)
        retry = None
        if exc.retryable:
            self._failures += 1
            retry = min(s.backoff_s * 2 ** (self._failures - 1), s.backoff_max_s)
        log.error(
            "reconcile.failed",
            error=reason,
            error_type=type(exc).__name__,
            retryable=exc.retryable,
            retry_in_s=retry,
            **{k: v for k, v in exc.context.items() if k not in ("node", "layout")},
        )
        self.metrics.reconfigurations.labels(result="failed", layout=desired).inc()
        self.metrics.set_state(State.FAILED)
        try:
            # before the patch: the watch must not take our own "failed" for someone's change
            self._seen = (desired, State.FAILED)
            node = self.cluster.patch_node(
                s.node_name,
                labels={s.state_label: State.FAILED},
                annotations={s.reason_annotation: reason[:4096]},
                expect_labels={s.config_label: desired},
            )
            self._condition(NodeCondition(s.condition_type, "False", type(exc).__name__, reason))
            self._event(
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

    def _condition(self, condition: NodeCondition) -> None:
        with contextlib.suppress(MigAgentError):
            self.cluster.set_node_condition(self.settings.node_name, condition)

    def _event(self, node: NodeView, reason: str, message: str, *, warning: bool = False) -> None:
        with contextlib.suppress(MigAgentError):  # events are best effort
            self.cluster.emit_event(node, reason=reason, message=message, warning=warning)

    @contextlib.contextmanager
    def _phase(self, node: NodeView, phase: str, reason: str, message: str) -> Iterator[None]:
        """One phase of a reconfiguration: a log line, a Node event, a duration metric."""
        log.info("phase.started", phase=phase)
        self._event(node, reason, message)
        start = self.clock.now()
        with self.metrics.phase(phase):
            yield
        log.info("phase.finished", phase=phase, duration_s=round(self.clock.now() - start, 3))

    def _record_devices(self, node_view: NodeView | None = None) -> None:
        """Update the device metrics and publish the GPU state on the node (for ``repartition
        --dry-run`` and ``status``, which run far from NVML) when it changed."""
        with contextlib.suppress(MigAgentError):
            node, models = self.gpus.observe(), self.gpus.models()
            self.metrics.set_devices(
                {g.index: planner.observed_devices(models[g.index], g) for g in node.gpus}
            )
            text = snapshot.compact(node, models)
            s = self.settings
            current = node_view or self.cluster.get_node(s.node_name)
            if current.annotations.get(s.gpu_state_annotation) != text:
                self.cluster.patch_node(s.node_name, annotations={s.gpu_state_annotation: text})

    # -- the loop -----------------------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    def _plugin_labels(self, node: NodeView) -> tuple[str | None, ...]:
        s = self.settings
        return tuple(node.labels.get(k) for k in (s.mig_strategy_label,
                                                  s.device_plugin_config_label) if k)

    def watch_forever(self, stop: threading.Event) -> None:
        """Wake the loop when someone else changes the layout or state label; reconnects."""
        s = self.settings
        delay = 1.0
        while not stop.is_set():
            try:
                for node in self.cluster.watch_node(s.node_name, timeout_s=s.watch_timeout_s):
                    self.watch_alive_at = time.monotonic()
                    delay = 1.0
                    seen = (node.labels.get(s.config_label), node.labels.get(s.state_label))
                    # a fixed strategy or plugin-config label is worth a pass as a layout is
                    if seen != self._seen or self._plugin_labels(node) != self._seen_plugin_labels:
                        self._wake.set()
                    if stop.is_set():
                        return
                self.watch_alive_at = time.monotonic()
            except MigAgentError as exc:
                self.watch_alive_at = time.monotonic()  # alive, retrying: a restart won't help
                log.warning("watch.failed", error=str(exc), retry_in_s=delay)
                stop.wait(delay)
                delay = min(delay * 2, 30.0)

    def run(self, stop: threading.Event, *, config_poll_s: float = 5.0) -> None:
        """Reconcile on start, on label and config changes, after backoff, and every resync."""
        watcher = threading.Thread(
            target=self.watch_forever, args=(stop,), daemon=True, name="node-watch"
        )
        watcher.start()
        self.reload_config()
        next_due = 0.0
        while not stop.is_set():
            now = self.loop_alive_at = time.monotonic()
            if self._wake.is_set() or now >= next_due:
                self._wake.clear()
                try:
                    result = self.reconcile_once()
                except MigAgentError as exc:  # could not even read the node
                    log.error("reconcile.failed", error=str(exc), error_type=type(exc).__name__)
                    result = PassResult(Outcome.FAILED, self.settings.backoff_s, str(exc))
                if result.outcome is Outcome.FAILED and result.retry_after_s is None:
                    next_due = float("inf")  # wait for a label or config change
                else:
                    next_due = time.monotonic() + (result.retry_after_s or self.settings.resync_s)
            timeout = max(0.05, min(config_poll_s, next_due - time.monotonic()))
            self._wake.wait(timeout)
            if self.reload_config():
                self._failures = 0
                self._wake.set()
        log.info("agent.stopping")
