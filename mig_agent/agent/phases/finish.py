"""How a pass ends on the node: ``success`` for a layout already in place (nothing touched) or
just applied, ``failed`` with a reason that says what went wrong, what the agent did about it
and why the node stays cordoned if it does; and the devices the plugin lists unhealthy, said
whenever they change."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from mig_agent.agent import marks, reporting
from mig_agent.agent.advertisers.advertiser import Advertiser
from mig_agent.agent.advertisers.device_plugin import listing
from mig_agent.agent.change import NOTE, Change, Memory, Tools
from mig_agent.agent.outcome import Outcome, PassResult
from mig_agent.agent.phases import validators
from mig_agent.core.advertised import expected_resources
from mig_agent.core.errors import GpuUnavailable, LabelsChanged, MigAgentError
from mig_agent.core.labels import State
from mig_agent.kube.cluster import NodeCondition, NodeView

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Finish:
    tools: Tools
    memory: Memory

    def in_place(self, change: Change, advertiser: Advertiser) -> bool:
        """True when the layout and its devices are in place and no interrupted pass is left
        to finish: the state is made to say so, nothing is touched."""
        t = self.tools
        s, node = t.settings, change.node
        empty = change.plan.is_empty
        # a pod list and an NVML read: asked once, by whichever check needs it first
        looked: list[bool] = []

        def advertised() -> bool:
            if not looked:
                looked.append(advertiser.advertises(change, as_listed=True))
            return looked[0]

        interrupted = marks.interrupted(s, node) or (
            empty and node.labels.get(s.state_label) == State.FAILED and not advertised()
        )
        if interrupted and empty and not marks.marked(s, node) and advertised():
            # only the last write was lost (an API server gone just before "success"): the
            # layout and its devices are in place, nothing to pause or restart
            interrupted = False
        change.interrupted = interrupted
        if not empty or interrupted:
            return False
        self._in_place_said(change)
        return True

    def _in_place_said(self, change: Change) -> None:
        t = self.tools
        s, node = t.settings, change.node
        t.record_devices(self.memory.held, node)
        want = expected_resources(change.observed, change.models, change.strategy, change.sharing)
        changed_health = self.note_unhealthy(node, want)
        message = self._with_health(f"layout {change.desired} is applied; nothing to change")
        if (
            node.labels.get(s.state_label) != State.SUCCESS
            or s.reason_annotation in node.annotations
            or s.observe_annotation in node.annotations  # observe mode's, before a hand-over
        ):
            self.succeed(node, change.desired, message)
        elif changed_health:
            reporting.condition(
                t.cluster, s, NodeCondition(s.condition_type, "True", "Applied", message)
            )
        t.metrics.set_state(State.SUCCESS)
        t.metrics.last_success.set(time.time())

    def applied(self, change: Change, advertised: Mapping[str, int]) -> None:
        """The validators rerun, the GPUs published, ``success``."""
        t = self.tools
        s = t.settings
        if change.plan.is_empty:  # no verify ran: publish the GPU state (it may have been forged)
            t.record_devices(self.memory.held)
        try:  # the operator validates the new devices; the layout is applied either way
            validators.delete(t.cluster, s, validators.AFTER)
        except MigAgentError as exc:
            log.warning("validators.delete_failed", error=str(exc))
        node = t.cluster.get_node(s.node_name)
        self.note_unhealthy(node, advertised)
        self.succeed(
            node,
            change.desired,
            self._with_health(
                f"layout {change.desired} applied to GPU(s) {list(change.plan.changed_gpus)}"
            ),
        )

    def succeed(self, node: NodeView, desired: str, message: str) -> None:
        t = self.tools
        s = t.settings
        self.memory.seen = (desired, State.SUCCESS)
        # only while the label still asks for this layout: a relabel during the pass must not
        # read as success of the new one
        t.cluster.patch_node(
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
        t.metrics.set_state(State.SUCCESS)
        t.metrics.last_success.set(time.time())
        reporting.condition(
            t.cluster, s, NodeCondition(s.condition_type, "True", "Applied", message)
        )
        reporting.event(t.cluster, node, "MIGConfigApplied", message)
        log.info("reconcile.succeeded", message=message)

    def failed(self, desired: str, exc: MigAgentError) -> PassResult:
        """``failed`` and the reason on the node; when to try again (None: not before a new
        label or config). LabelsChanged when the label asks for another layout by now."""
        t, memory = self.tools, self.memory
        s = t.settings
        reason = failure_reason(exc)
        retry = None
        if exc.retryable:
            memory.failures += 1
            # the exponent capped: a budget that never allows the eviction fails for a week
            retry = min(s.backoff_s * 2 ** min(memory.failures - 1, 32), s.backoff_max_s)
        log.error(
            "reconcile.failed",
            error=reason,
            error_type=type(exc).__name__,
            retryable=exc.retryable,
            retry_in_s=retry,
            **{
                k: v
                for k, v in exc.context.items()
                if k not in ("node", "layout", "refs", NOTE, "drain_failed_at", "given_up", "cause")
            },
        )
        t.metrics.reconfigurations.labels(result="failed", layout=desired).inc()
        t.metrics.set_state(State.FAILED)
        if isinstance(exc, GpuUnavailable):
            memory.gpu_status = f"NVML unreachable: {exc}"
        try:
            self._failed_said(desired, exc, reason, retry)
        except LabelsChanged:
            raise
        except MigAgentError as report_exc:  # API down: retry the whole pass later
            log.error("reconcile.report_failed", error=str(report_exc))
            retry = retry or s.backoff_s
        return PassResult(Outcome.FAILED, retry, reason)

    def _failed_said(
        self, desired: str, exc: MigAgentError, reason: str, retry: float | None
    ) -> None:
        t = self.tools
        s = t.settings
        # before the patch: the watch must not take our own "failed" for someone's change
        self.memory.seen = (desired, State.FAILED)
        node = t.cluster.patch_node(
            s.node_name,
            labels={s.state_label: State.FAILED},
            annotations={s.reason_annotation: reason[:4096]},
            expect_labels={s.config_label: desired},
        )
        reporting.condition(
            t.cluster, s, NodeCondition(s.condition_type, "False", type(exc).__name__, reason)
        )
        then = f"retrying in {retry:.0f} s" if retry else "waiting for a label or config change"
        reporting.event(t.cluster, node, "MIGConfigFailed", f"{reason} ({then})", warning=True)

    def note_unhealthy(self, node: NodeView, want: Mapping[str, int]) -> bool:
        """Report the devices the plugin lists unhealthy: the metric always, an Event when they
        change; True when they did. Never a reason to cordon, pause or restart anything: the
        layout is in place whatever an Xid did to a device."""
        t, memory = self.tools, self.memory
        unhealthy = listing(node, want).unhealthy
        t.metrics.set_unhealthy(unhealthy)
        if unhealthy == memory.unhealthy:
            return False
        memory.unhealthy = dict(unhealthy)
        if unhealthy:
            log.warning("devices.unhealthy", devices=unhealthy)
            note = reporting.unhealthy_note(unhealthy)
            reporting.event(t.cluster, node, "MIGUnhealthyDevices", note, warning=True)
        else:
            log.info("devices.healthy")
            reporting.event(
                t.cluster,
                node,
                "MIGDevicesHealthy",
                "every device the device plugin lists is healthy again",
            )
        return True

    def _with_health(self, message: str) -> str:
        note = reporting.unhealthy_note(self.memory.unhealthy)
        return f"{message}; {note}" if note else message


def failure_reason(exc: MigAgentError) -> str:
    """The failure as the node reports it: the error, then what was done about it and why the
    node stays cordoned, if it does (the guard's verdict, mig_agent.agent.guard)."""
    parts = [str(exc), str(exc.context.get(NOTE, ""))]
    return "; ".join(p for p in parts if p)
