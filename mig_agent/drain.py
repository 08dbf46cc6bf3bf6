"""Draining GPU clients from this node: evict the pods that use GPUs and wait until they are gone.

Evictions go through the Eviction API, so PodDisruptionBudgets are honoured; a refused eviction
is retried until the deadline. Pods are waited for by UID, so a replacement pod with the same name
does not count as the old one still running. Knows no GPUs; time is injected.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog

from mig_agent.errors import DrainTimeout, EvictionBlocked, KubeError
from mig_agent.kube.cluster import Cluster, PodRef, PodView

log = structlog.get_logger(__name__)

# evictions in flight at once, as kubectl drain runs them side by side (the API client keeps
# as many connections open: kube.client.CONNECTIONS)
EVICTION_WORKERS = 16


@dataclass(frozen=True, slots=True)
class Clock:
    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    # wait until the event is set or the timeout passes (True if set): the agent loop's wait
    wait: Callable[[threading.Event, float], bool] = threading.Event.wait


def poll_delays(poll_s: float, fast_s: float = 0.1, fast_for_s: float = 3.0) -> Iterator[float]:
    """Delays between looks at something about to happen. Every ``fast_s`` for the first
    ``fast_for_s``: a pod's termination or a device plugin's start mostly ends within that, and
    each look that comes late adds to the pass. Then doubling up to ``poll_s``, so that a long
    wait (a PodDisruptionBudget, a slow plugin) costs few requests."""
    delay, spent = min(fast_s, poll_s), 0.0
    while True:
        yield delay
        spent += delay
        if spent >= fast_for_s:
            delay = min(delay * 2, poll_s)


def still_present(cluster: Cluster, node: str, refs: Iterable[PodRef]) -> set[PodRef]:
    """Those of ``refs`` (pods on ``node``) that still exist, by UID where known: one list of
    the node's pods rather than a read per pod."""
    refs = set(refs)
    if not refs:
        return set()
    here = {(p.ref.namespace, p.ref.name): p.ref.uid for p in cluster.list_pods(node=node)}
    out: set[PodRef] = set()
    for ref in refs:
        uid = here.get((ref.namespace, ref.name))
        if uid is not None and (not ref.uid or not uid or uid == ref.uid):
            out.add(ref)
    return out


def evict_all(cluster: Cluster, refs: list[PodRef]) -> dict[PodRef, EvictionBlocked | None]:
    """Evict ``refs`` side by side (an eviction is a round trip of its own, ~0.1 s: 56 pods one
    after another would add seconds to the pass); per pod None or the budget that refused it.
    Any other error is raised once every eviction has been tried."""
    if not refs:
        return {}

    def one(ref: PodRef) -> EvictionBlocked | None:
        try:
            cluster.evict(ref)
        except EvictionBlocked as exc:
            return exc
        return None

    workers = min(EVICTION_WORKERS, len(refs))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="evict") as pool:
        # each in a copy of this context: the log lines keep the node and layout bound to it
        futures = {ref: pool.submit(contextvars.copy_context().run, one, ref) for ref in refs}
    results: dict[PodRef, EvictionBlocked | None] = {}
    failure: BaseException | None = None
    for ref, future in futures.items():
        exc = future.exception()
        if exc is not None:
            failure = failure or exc
            continue
        results[ref] = future.result()
    if failure is not None:
        raise failure
    return results


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
    on_blocked: Callable[[PodRef, EvictionBlocked], None] | None = None,
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
    delays = poll_delays(poll_s)
    while True:
        if to_evict and clock.now() >= next_try:
            for ref, exc in evict_all(cluster, list(to_evict)).items():
                if exc is not None:
                    if ref not in blocked:
                        log.warning(
                            "drain.blocked",
                            pod=ref.name,
                            namespace=ref.namespace,
                            pdb=exc.context.get("pdb", ""),
                            error=str(exc),
                        )
                        if on_blocked is not None:  # tell the operator now, not at the deadline
                            on_blocked(ref, exc)
                    blocked[ref] = exc
                    continue
                blocked.pop(ref, None)
                del to_evict[ref]
                log.info("drain.pod_evicted", pod=ref.name, namespace=ref.namespace)
            next_try = clock.now() + retry_s
        waiting = still_present(cluster, node, waiting - to_evict.keys()) | (
            waiting & to_evict.keys()
        )
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
        clock.sleep(next(delays))


def wait_pods_gone(
    cluster: Cluster,
    node: str,
    refs: Iterable[PodRef],
    *,
    timeout_s: float,
    poll_s: float,
    what: str,
    clock: Clock = Clock(),
) -> None:
    """Wait until none of ``refs`` (pods on ``node``) exists any more (by UID); DrainTimeout
    naming the rest."""
    waiting = set(refs)
    deadline = clock.now() + timeout_s
    delays = poll_delays(poll_s)
    while waiting:
        waiting = still_present(cluster, node, waiting)
        if not waiting:
            return
        if clock.now() >= deadline:
            names = ", ".join(sorted(str(r) for r in waiting))
            raise DrainTimeout(
                f"{what} still present after {timeout_s:.0f} s: {names}",
                pods=sorted(str(r) for r in waiting),
            )
        clock.sleep(next(delays))
