"""Cordon and operand pausing around a change: marks on the Node (annotations) say what this
agent did, so that it, or a restarted agent, can always undo exactly that."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator

import structlog

from mig_agent.config.settings import Settings
from mig_agent.core import labels
from mig_agent.core.errors import (
    DrainGivenUp,
    DrainTimeout,
    EvictionBlocked,
    MigAgentError,
    Stopping,
)
from mig_agent.core.labels import State
from mig_agent.kube.cluster import Cluster, NodeView, PodRef
from mig_agent.node.drain import still_present

log = structlog.get_logger(__name__)


class NodeRebooting(Exception):
    """Raised past the clean-up: the node is about to reboot and stays cordoned and paused."""


_LAYOUT = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_SERVICES = re.compile(r"^[A-Za-z0-9@._:-]+(,[A-Za-z0-9@._:-]+)*$")


def foreign_marks(s: Settings, node: NodeView) -> dict[str, str]:
    """The agent's own annotations on ``node`` holding what the agent never writes there:
    someone else wrote them (a pass rewrites or clears them). Pure."""
    prefix = s.annotation_prefix + "/"
    ours = {k: v for k, v in node.annotations.items() if k.startswith(prefix)}
    odd = {}
    for key, value in ours.items():
        if key == s.cordon_annotation:
            ok = value == "true"
        elif key == s.paused_annotation:
            ok = bool(value) and set(value.split(",")) <= set(s.operand_labels)
        elif key == s.reason_annotation:  # written only with the failed state
            ok = node.labels.get(s.state_label) == State.FAILED
        elif key == s.gpu_state_annotation:
            ok = _is_gpu_state(value)
        elif key in (s.reboot_annotation, s.post_apply_annotation):
            ok = bool(_LAYOUT.match(value))
        elif key == s.host_services_annotation:
            ok = bool(_SERVICES.match(value))
        elif key == s.observe_annotation:
            ok = _is_observe_report(value)
        else:
            ok = False
        if not ok:
            odd[key] = value
    return odd


def _is_gpu_state(text: str) -> bool:
    try:
        data = json.loads(text)
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("gpus"), list)


def _is_observe_report(text: str) -> bool:
    try:
        data = json.loads(text)
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("layout"), str)


def interrupted(s: Settings, node: NodeView) -> bool:
    return node.labels.get(s.state_label) in (State.PENDING, State.REBOOTING) or marked(s, node)


def marked(s: Settings, node: NodeView) -> bool:
    """A pass left its marks: cordon, paused operands or post-apply hooks still to run."""
    return (
        s.cordon_annotation in node.annotations
        or s.paused_annotation in node.annotations
        or s.post_apply_annotation in node.annotations
    )


@contextlib.contextmanager
def gpu_clients_paused(cluster: Cluster, s: Settings, node: NodeView) -> Iterator[list[str]]:
    """Cordon (unless already cordoned by someone else) and pause operands; always undo."""
    annotations: dict[str, str | None] = {}
    if not node.unschedulable:
        annotations[s.cordon_annotation] = "true"
    pause = labels.pause_patch(node.labels, s.operand_labels)
    paused = labels.paused_during_change(node.labels, s.operand_labels)
    if paused:
        annotations[s.paused_annotation] = ",".join(paused)
    if annotations or pause:
        # Annotations first in the same patch: a crash right after leaves a trail to undo.
        cluster.patch_node(
            s.node_name,
            labels=pause,
            annotations=annotations,
            unschedulable=True if not node.unschedulable else None,
        )
        log.info("node.paused", cordoned=not node.unschedulable, operands=paused)
    try:
        yield paused
    except NodeRebooting:
        raise
    except Exception as exc:  # a kill (not an exception) leaves the trail for the next agent
        with contextlib.suppress(MigAgentError):  # the pass's own clean-up logs a failure
            finish(
                cluster,
                s,
                cluster.get_node(s.node_name),
                terminating=still_terminating(exc),
                keep_for=cordon_kept_for(exc),
            )
        raise
    finish(cluster, s, cluster.get_node(s.node_name))


def still_terminating(exc: BaseException) -> tuple[PodRef, ...]:
    """The evicted pods a failed or stopped drain left terminating (none for any other
    failure)."""
    if isinstance(exc, Stopping):
        return tuple(r for r in exc.refs if isinstance(r, PodRef))
    if isinstance(exc, DrainTimeout | EvictionBlocked | DrainGivenUp):
        refs = exc.context.get("refs", ())
        return tuple(r for r in refs if isinstance(r, PodRef)) if isinstance(refs, tuple) else ()
    return ()


KEEP_CORDON = "keep_cordon"  # a failure's context key: why the clean-up keeps the cordon


def keep_cordon_for(exc: MigAgentError, why: str) -> MigAgentError:
    """Mark ``exc``: the clean-up after it keeps the agent's cordon, for ``why`` (the node lists
    devices NVML no longer holds; a drain is retried)."""
    exc.context[KEEP_CORDON] = why
    return exc


def cordon_kept_for(exc: BaseException) -> str:
    """Why the clean-up after ``exc`` keeps the cordon ("" when it does not)."""
    why = exc.context.get(KEEP_CORDON, "") if isinstance(exc, MigAgentError) else ""
    return why if isinstance(why, str) else ""


def finish(
    cluster: Cluster,
    s: Settings,
    node: NodeView,
    terminating: tuple[PodRef, ...] = (),
    keep_for: str = "",
) -> bool:
    """Resume paused operands and uncordon if this agent cordoned; idempotent. False when the
    cordon stays on purpose, with its mark: pods the drain evicted (``terminating``) still
    run on devices about to change, or the failure asked for it (``keep_for``: why).
    A cordon someone else set since the agent's (managedFields name another manager of
    spec.unschedulable) stays too, without the agent's mark."""
    resume = labels.resume_patch(node.labels, s.operand_labels)
    annotations: dict[str, str | None] = {}
    uncordon = None
    kept = False
    if s.cordon_annotation in node.annotations:
        left = still_present(cluster, s.node_name, terminating) if terminating else set()
        if keep_for:
            kept = True
            log.warning("node.cordon_kept", reason=keep_for)
        elif left:
            kept = True
            log.warning(
                "node.cordon_kept",
                reason="evicted pods still terminating",
                pods=sorted(str(r) for r in left),
            )
        elif node.unschedulable and not node.cordoned_by_agent:
            annotations[s.cordon_annotation] = None
            log.info(
                "node.cordon_kept",
                reason="cordoned again by someone else",
                managers=list(node.unschedulable_by),
            )
        else:
            annotations[s.cordon_annotation] = None
            uncordon = False
    if s.paused_annotation in node.annotations:
        annotations[s.paused_annotation] = None
    if resume or annotations:
        cluster.patch_node(
            s.node_name, labels=resume, annotations=annotations, unschedulable=uncordon
        )
        log.info("node.resumed", uncordoned=uncordon is False, operands=sorted(resume))
    return not kept


def tidy_up(
    cluster: Cluster, s: Settings, terminating: tuple[PodRef, ...] = (), keep_for: str = ""
) -> bool:
    """Resume operands and uncordon if our marks are on the node (no pass runs now);
    False when that failed (logged) or the cordon stays (``terminating`` pods, ``keep_for``):
    the node may still be cordoned by us."""
    try:
        return finish(cluster, s, cluster.get_node(s.node_name), terminating, keep_for)
    except MigAgentError as exc:
        log.error("node.resume_failed", error=str(exc))
        return False
