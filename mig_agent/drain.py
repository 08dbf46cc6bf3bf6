"""Draining GPU clients from this node: evict the pods that use GPUs and wait until they are gone.

Evictions go through the Eviction API, so PodDisruptionBudgets are honoured; a refused eviction
is retried until the deadline. Pods are waited for by UID, so a replacement pod with the same name
does not count as the old one still running. Knows no GPUs; time is injected.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog

from mig_agent.errors import DrainTimeout, EvictionBlocked, KubeError
from mig_agent.kube.cluster import Cluster, PodRef, PodView

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Clock:
    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    # wait until the event is set or the timeout passes (True if set): the agent loop's wait
    wait: Callable[[threading.Event, float], bool] = threading.Event.wait


def gpu_pods(cluster: Cluster, node: str, *, exclude: Iterable[PodRef] = ()) -> list[PodView]:
    """Pods on ``node`` that request GPU resources and have not finished."""
    skip = {(r.namespace, r.name) for r in exclude}
    return [
        p
        for p in cluster.list_pods(node=node)
        if p.uses_gpu and not p.finished and (p.ref.namespace, p.ref.name) not in skip
    ]


def drain_gpu_pods(
    cluster: Cluster,
    node: str,
    *,
    timeout_s: float,
    retry_s: float,
    poll_s: float,
    clock: Clock = Clock(),
    exclude: Iterable[PodRef] = (),
    may_stay: Callable[[PodView], bool] | None = None,
) -> list[PodRef]:
    """Evict every GPU pod on ``node`` (but those ``may_stay`` spares) and wait until all are
    gone; returns the evicted pods.

    Raises EvictionBlocked (naming the pod and its PodDisruptionBudget) when a budget still
    refuses at the deadline, DrainTimeout when evicted pods are still terminating then, and
    KubeError for a static (mirror) pod, which cannot be evicted.
    """
    pods = gpu_pods(cluster, node, exclude=exclude)
    if may_stay is not None:
        staying = [p for p in pods if may_stay(p)]
        if staying:
            log.info("drain.pods_kept", pods=len(staying))
        pods = [p for p in pods if p not in staying]
    for p in pods:
        if p.is_mirror:
            raise KubeError(
                f"static pod {p.ref} uses GPUs and cannot be evicted; remove it from "
                "the node's static pod manifests",
                pod=str(p.ref),
            )
    if not pods:
        return []
    log.info("drain.started", pods=len(pods), timeout_s=timeout_s)
    deadline = clock.now() + timeout_s
    to_evict = {p.ref: p for p in pods if not p.terminating}
    waiting = {p.ref for p in pods}
    blocked: dict[PodRef, EvictionBlocked] = {}
    next_try = clock.now()
    while True:
        if to_evict and clock.now() >= next_try:
            for ref in list(to_evict):
                try:
                    cluster.evict(ref)
                except EvictionBlocked as exc:
                    if ref not in blocked:
                        log.warning(
                            "drain.blocked",
                            pod=ref.name,
                            namespace=ref.namespace,
                            pdb=exc.context.get("pdb", ""),
                            error=str(exc),
                        )
                    blocked[ref] = exc
                    continue
                blocked.pop(ref, None)
                del to_evict[ref]
                log.info("drain.pod_evicted", pod=ref.name, namespace=ref.namespace)
            next_try = clock.now() + retry_s
        for ref in list(waiting):
            if ref not in to_evict and cluster.get_pod(ref) is None:
                waiting.discard(ref)
        if not waiting:
            log.info("drain.finished", pods=len(pods))
            return [p.ref for p in pods]
        if clock.now() >= deadline:
            if blocked:
                raise next(iter(blocked.values()))
            names = ", ".join(sorted(str(r) for r in waiting))
            raise DrainTimeout(
                f"GPU pods still terminating after {timeout_s:.0f} s: {names}",
                pods=sorted(str(r) for r in waiting),
            )
        clock.sleep(poll_s)


def wait_pods_gone(
    cluster: Cluster,
    refs: Iterable[PodRef],
    *,
    timeout_s: float,
    poll_s: float,
    what: str,
    clock: Clock = Clock(),
) -> None:
    """Wait until none of ``refs`` exists any more (by UID); DrainTimeout naming the rest."""
    waiting = set(refs)
    deadline = clock.now() + timeout_s
    while waiting:
        waiting = {r for r in waiting if cluster.get_pod(r) is not None}
        if not waiting:
            return
        if clock.now() >= deadline:
            names = ", ".join(sorted(str(r) for r in waiting))
            raise DrainTimeout(
                f"{what} still present after {timeout_s:.0f} s: {names}",
                pods=sorted(str(r) for r in waiting),
            )
        clock.sleep(poll_s)
