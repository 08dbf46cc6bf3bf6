"""What the agent tells about a change besides the state label: the node condition, Events,
phase logs and durations, device metrics and the GPU state published on the node. Best effort:
a failure to report never fails the pass."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime

import structlog

from mig_agent.config.settings import Settings
from mig_agent.core import planner, snapshot
from mig_agent.core import pod_devices as pod_devices_core
from mig_agent.core.errors import (
    MigAgentError,
)
from mig_agent.gpu.backend import GpuBackend
from mig_agent.kube.cluster import Cluster, NodeCondition, NodeView
from mig_agent.node.waits import Clock
from mig_agent.observability.metrics import Metrics

log = structlog.get_logger(__name__)


class _Once:
    """Which report failures were logged: an RBAC or admission refusal of the agent's own
    reports is logged once per kind of report and cause, not at every retry; once that kind
    of report is written again, its next failure is logged again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logged: set[tuple[str, str]] = set()

    def failed(self, what: str, exc: MigAgentError) -> None:
        cause = f"{type(exc).__name__} {exc.context.get('status', '')}".strip()
        with self._lock:
            if (what, cause) in self._logged:
                return
            self._logged.add((what, cause))
        log.warning("report.failed", report=what, cause=cause, error=str(exc))

    def written(self, what: str) -> None:
        with self._lock:
            if self._logged:
                self._logged = {k for k in self._logged if k[0] != what}


unreported = _Once()


@contextlib.contextmanager
def best_effort(what: str) -> Iterator[None]:
    """A report that must never fail the pass; its failure is logged (once per cause)."""
    try:
        yield
    except MigAgentError as exc:
        unreported.failed(what, exc)
    else:
        unreported.written(what)


def condition(cluster: Cluster, s: Settings, condition: NodeCondition) -> None:
    with best_effort("node condition"):
        cluster.set_node_condition(s.node_name, condition)


def event(
    cluster: Cluster, node: NodeView, reason: str, message: str, *, warning: bool = False
) -> None:
    with best_effort("event"):
        cluster.emit_event(node, reason=reason, message=message, warning=warning)


def event_on_node(
    cluster: Cluster, s: Settings, reason: str, message: str, *, warning: bool = False
) -> None:
    """An Event about this node when no view of it is at hand (one read, for its uid)."""
    try:
        node = cluster.get_node(s.node_name)
    except MigAgentError as exc:
        log.warning("event.not_reported", reason=reason, error=str(exc))
        return
    event(cluster, node, reason, message, warning=warning)


@contextlib.contextmanager
def phase(
    cluster: Cluster,
    metrics: Metrics,
    clock: Clock,
    node: NodeView,
    phase: str,
    reason: str,
    message: str,
) -> Iterator[None]:
    """One phase of a reconfiguration: a log line, a Node event, a duration metric (the Event's
    request counted in it)."""
    log.info("phase.started", phase=phase)
    start = clock.now()
    with metrics.phase(phase):
        event(cluster, node, reason, message)
        yield
    log.info("phase.finished", phase=phase, duration_s=round(clock.now() - start, 3))


Listed = Mapping[tuple[str, str], frozenset[str]]  # the kubelet's: (namespace, pod) -> ids
PodDevices = Callable[[], Listed]


@dataclass(slots=True)
class HeldCache:
    """The holders last published and the kubelet's listing they came from, once all it could
    tell was (None: to read in full again): a pass or look reading the same listing lists no
    pods (an idle agent asks the API server nothing)."""

    listed: Listed | None = None
    held: dict[str, frozenset[str]] = field(default_factory=dict)


def record_devices(
    cluster: Cluster,
    s: Settings,
    gpus: GpuBackend,
    metrics: Metrics,
    node_view: NodeView | None = None,
    *,
    pod_devices: PodDevices | None = None,
    wall: Callable[[], float] | None = None,
    cache: HeldCache | None = None,
) -> None:
    """Update the device metrics and publish the GPU state on the node (for ``repartition
    --dry-run``, ``status``, ``advise`` and the AdmissionCheck, which run far from NVML) when
    it changed; with ``pod_devices`` (the kubelet's PodResources), which pod holds which
    device beside it (mig_agent.core.pod_devices)."""
    with best_effort("gpu state"):
        node, models = gpus.observe(), gpus.models()
        metrics.set_devices(
            {g.index: planner.observed_devices(models[g.index], g) for g in node.gpus}
        )
        held = (
            _holders(cluster, s, pod_devices, wall, cache or HeldCache())
            if pod_devices and wall
            else None
        )
        text = snapshot.compact(node, models, held)
        current = node_view or cluster.get_node(s.node_name)
        if current.annotations.get(s.gpu_state_annotation) != text:
            cluster.patch_node(s.node_name, annotations={s.gpu_state_annotation: text})


def _holders(
    cluster: Cluster,
    s: Settings,
    pod_devices: PodDevices,
    wall: Callable[[], float],
    cache: HeldCache,
) -> dict[str, frozenset[str]] | None:
    """Pod UID -> the devices the kubelet gave it, for the pods it took before the read; None
    where PodResources or the node's pods cannot be read (nobody is published: judged by
    kind)."""
    read_at = wall()  # before the read: a pod the kubelet took after it is left out
    try:
        listed = pod_devices()
        if listed == cache.listed:
            return cache.held
        pods = cluster.list_pods(node=s.node_name)
    except MigAgentError as exc:
        log.debug("gpu_state.holders_unknown", error=str(exc))
        return None
    facts = [(p.ref.namespace, p.ref.name, p.ref.uid, _seconds(p.started)) for p in pods]
    cache.held = pod_devices_core.held_by_uid(listed, facts, read_at)
    cache.listed = None if pod_devices_core.unsettled(listed, facts, read_at) else listed
    return cache.held


def _seconds(stamp: str) -> float | None:
    """An RFC 3339 time in epoch seconds; None for none."""
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def unhealthy_note(unhealthy: Mapping[str, int]) -> str:
    """The words for devices the plugin lists unhealthy ("" when none is). Pure."""
    if not unhealthy:
        return ""
    total = sum(unhealthy.values())
    each = ", ".join(f"{r}: {n}" for r, n in sorted(unhealthy.items()))
    return (
        f"{total} device(s) unhealthy, listed by the device plugin but kept out of "
        f"allocatable by the kubelet ({each})"
    )
