"""Draining GPU clients from this node: evict the pods that use GPUs and wait until they are gone.

Evictions go through the Eviction API, so PodDisruptionBudgets are honoured; a refused eviction
is retried until the deadline. Pods are waited for by UID, so a replacement pod with the same name
does not count as the old one still running. Knows no GPUs; time is injected.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Collection, Generator, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import structlog

from mig_agent.core.errors import (
    DrainTimeout,
    EvictionBlocked,
    KubeError,
    MigAgentError,
    PodReplaced,
    Stopping,
)
from mig_agent.kube.cluster import Cluster, PodRef, PodsSeen, PodView
from mig_agent.node.waits import Clock, watch_slices

log = structlog.get_logger(__name__)

# evictions in flight at once, as kubectl drain runs them side by side (the API client keeps
# as many connections open: kube.client.CONNECTIONS)
EVICTION_WORKERS = 16
# an evicted pod is waited for at least its own grace period and this much more (the kubelet
# kills it at the end of its grace; the container's teardown and the API's update follow)
GRACE_MARGIN_S = 30.0
# a wait for evicted pods that lasts this long is told on the node (Event, condition): a pod
# that checkpoints for minutes must not look like a hung agent
WAIT_NOTICE_S = 10.0


def present(pods: Iterable[PodView], refs: Iterable[PodRef]) -> set[PodRef]:
    """Those of ``refs`` that are among ``pods``, by UID where known, and not finished: a pod
    whose containers have all exited holds no device, though a finalizer may keep its object
    for long. Pure."""
    here = {(p.ref.namespace, p.ref.name): p.ref.uid for p in pods if not p.finished}
    out: set[PodRef] = set()
    for ref in refs:
        uid = here.get((ref.namespace, ref.name))
        if uid is not None and (not ref.uid or not uid or uid == ref.uid):
            out.add(ref)
    return out


def look(cluster: Cluster, node: str, seen: PodsSeen) -> list[PodView]:
    """The node's pods now (one list, no watch), with ``seen`` (a fresh one) set for the waits
    that follow to watch on from there without a list of their own."""
    watch = cluster.watch_pods(node, timeout_s=1, seen=seen)
    try:
        return next(iter(watch))
    finally:
        if isinstance(watch, Generator):
            watch.close()


def still_present(cluster: Cluster, node: str, refs: Iterable[PodRef]) -> set[PodRef]:
    """Those of ``refs`` (pods on ``node``) that still exist, by UID where known: one list of
    the node's pods rather than a read per pod."""
    refs = set(refs)
    return present(cluster.list_pods(node=node), refs) if refs else set()


Evicted = EvictionBlocked | PodReplaced | None


def evict_all(cluster: Cluster, refs: list[PodRef]) -> dict[PodRef, Evicted]:
    """Evict ``refs`` side by side (an eviction is a round trip of its own, ~0.1 s: 56 pods one
    after another would add seconds to the pass); per pod None, the budget that refused it, or
    PodReplaced. Any other error (EvictionUnsupported: a pod several budgets cover) is raised
    once every eviction has been tried, naming in ``evicted`` the pods this round evicted."""
    if not refs:
        return {}

    def one(ref: PodRef) -> Evicted:
        try:
            cluster.evict(ref)
        except (EvictionBlocked, PodReplaced) as exc:
            return exc
        return None

    workers = min(EVICTION_WORKERS, len(refs))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="evict") as pool:
        # each in a copy of this context: the log lines keep the node and layout bound to it
        futures = {ref: pool.submit(contextvars.copy_context().run, one, ref) for ref in refs}
    results: dict[PodRef, Evicted] = {}
    failure: BaseException | None = None
    for ref, future in futures.items():
        exc = future.exception()
        if exc is not None:
            failure = failure or exc
            continue
        results[ref] = future.result()
    if failure is not None:
        if isinstance(failure, MigAgentError):  # they terminate on: whoever undoes must know
            gone = sorted((r for r, v in results.items() if v is None), key=str)
            failure.context["evicted"] = tuple(gone)
        raise failure
    return results


def gpu_pods(
    cluster: Cluster,
    node: str,
    *,
    exclude: Iterable[PodRef] = (),
    claimed: Collection[tuple[str, str]] = (),
    pods: Iterable[PodView] | None = None,
    may_stay: Callable[[PodView], bool] | None = None,
) -> list[PodView]:
    """Pods on ``node`` that request GPU resources (or are ``claimed``) and have not finished,
    out of ``pods`` (the node's, as just listed) where given; those ``may_stay`` spares left
    out (to_drain)."""
    skip = {(r.namespace, r.name) for r in exclude}
    listed = cluster.list_pods(node=node) if pods is None else pods
    return to_drain(
        (p for p in listed if (p.ref.namespace, p.ref.name) not in skip),
        may_stay,
        claimed=claimed,
    )


def to_drain(
    pods: Iterable[PodView],
    may_stay: Callable[[PodView], bool] | None = None,
    *,
    claimed: Collection[tuple[str, str]],
) -> list[PodView]:
    """The GPU pods the drain evicts of ``pods``: those that have not finished, but the ones
    ``may_stay`` spares. ``claimed`` (namespace, name) are GPU pods too: they hold devices by
    ResourceClaim, requesting no GPU resource (asked of every caller: left out, a DRA node's
    pods would be no GPU pods)."""
    gpu = [
        p
        for p in pods
        if (p.uses_gpu or (p.ref.namespace, p.ref.name) in claimed) and not p.finished
    ]
    return [p for p in gpu if may_stay is None or not may_stay(p)]


def is_paused_operand(pod: PodView, paused: Iterable[str]) -> bool:
    """A GPU Operator operand's pod that pausing its ``paused`` labels stops (the drain waits
    for it rather than evicting it): a DaemonSet's whose nodeSelector names one of them."""
    return "DaemonSet" in pod.owner_kinds and bool(set(pod.node_selector) & set(paused))


def drain_refusals(
    pods: Iterable[PodView],
    *,
    operand_labels: Iterable[str],
    evict_unmanaged: bool,
    delete_emptydir_data: bool = False,
    advise: Iterable[str] = (),
) -> list[str]:
    """Why the drain must not start, one line per kind of pod (empty: it may), as ``kubectl
    drain`` refuses before it cordons. ``pods`` are those it would evict:

    * a static (mirror) pod cannot be evicted;
    * a DaemonSet's pod comes straight back (DaemonSets tolerate the cordon) and takes its
      device again, unless its nodeSelector names an operand label the agent pauses;
    * a pod no controller owns is gone for good once evicted (unless ``evict_unmanaged``);
    * a pod's emptyDir data goes with it (unless ``delete_emptydir_data``).
    ``operand_labels`` are those the change pauses; ``advise``, those to suggest. Pure."""
    paused = set(operand_labels)
    mirror, daemons, bare, local = [], [], [], []
    for p in pods:
        if p.is_mirror:
            mirror.append(str(p.ref))
        elif p.controller_kind == "DaemonSet":
            if not set(p.node_selector) & paused:
                owner = p.controller.split("/", 1)[1]
                daemons.append(f"{p.ref} (DaemonSet {p.ref.namespace}/{owner})")
        elif not p.controller and not evict_unmanaged:
            bare.append(str(p.ref))
        if p.empty_dirs and not delete_emptydir_data and not p.is_mirror:
            local.append(f"{p.ref} ({', '.join(p.empty_dirs)})")
    out = []
    if mirror:
        out.append(
            f"static pod(s) {', '.join(mirror)} use GPUs and cannot be evicted; remove "
            "them from the node's static pod manifests"
        )
    if daemons:
        out.append(
            f"GPU pod(s) {', '.join(daemons)} belong to a DaemonSet, which tolerates the cordon "
            "and would take the GPU again at once; give the DaemonSet a nodeSelector on an "
            "operand label the agent pauses during a change (e.g. "
            f"{_client_label(set(advise) or paused)}: "
            '"true", with that label on the node)'
        )
    if bare:
        out.append(
            f"GPU pod(s) {', '.join(bare)} have no controller: evicted, they would be gone for "
            "good; delete them, or let the drain evict such pods (chart value "
            "drain.evictUnmanagedPods, MIG_AGENT_EVICT_UNMANAGED_PODS=true)"
        )
    if local:
        out.append(
            f"GPU pod(s) {', '.join(local)} keep data in emptyDir volumes, lost once evicted; "
            "let the drain evict them anyway, as kubectl drain --delete-emptydir-data does "
            "(chart value drain.deleteEmptyDirData, MIG_AGENT_DELETE_EMPTYDIR_DATA=true)"
        )
    return out


def _client_label(operand_labels: set[str]) -> str:
    client = sorted(k for k in operand_labels if k.endswith(".client"))
    return (client or sorted(operand_labels) or ["nvidia.com/gpu.deploy.client"])[0]


@dataclass(frozen=True)
class DrainRules:
    """How long and how often the drain tries (see drain_gpu_pods), and whom it tells."""

    timeout_s: float
    retry_s: float
    poll_s: float
    on_blocked: Callable[[PodRef, EvictionBlocked], None] | None = None
    on_waiting: Callable[[PodView, int, float], None] | None = None
    still_wanted: Callable[[], None] | None = None


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
    claimed: Collection[tuple[str, str]] = (),
    on_blocked: Callable[[PodRef, EvictionBlocked], None] | None = None,
    on_waiting: Callable[[PodView, int, float], None] | None = None,
    still_wanted: Callable[[], None] | None = None,
    pods: Iterable[PodView] | None = None,
    seen: PodsSeen | None = None,
) -> list[PodRef]:
    """Evict every GPU pod on ``node`` (but those ``may_stay`` spares) and wait until all are
    gone; returns the evicted pods (and those that took a replaced pod's name).

    ``timeout_s`` bounds the evictions a PodDisruptionBudget refuses; an evicted pod is waited
    for at least its own grace period plus GRACE_MARGIN_S. A wait that lasts WAIT_NOTICE_S is
    told once to ``on_waiting`` (the slowest pod, how many are left, the wait's deadline in
    seconds from the drain's start).

    ``pods`` are the node's pods as the caller just listed them (default: listed here); the
    wait's watches go on from ``seen`` (``look``) where given.

    ``still_wanted`` is asked at most every ``retry_s`` while the drain lasts and raises when
    the change is no longer wanted (a relabel): a budget that blocks for minutes must not keep
    a cancelled change's cordon.

    Raises EvictionBlocked (naming the pod and its PodDisruptionBudget) when a budget still
    refuses at the deadline, DrainTimeout when evicted pods are still terminating then, and
    KubeError for a static (mirror) pod, which cannot be evicted.
    """
    candidates = gpu_pods(cluster, node, exclude=exclude, claimed=claimed, pods=pods)
    pods = to_drain(candidates, may_stay, claimed=claimed)
    if len(pods) < len(candidates):
        log.info("drain.pods_kept", pods=len(candidates) - len(pods))
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
    rules = DrainRules(timeout_s, retry_s, poll_s, on_blocked, on_waiting, still_wanted)

    def successor(ref: PodRef) -> PodView | None:  # the pod now of a replaced one's name
        fresh = gpu_pods(cluster, node, exclude=exclude, claimed=claimed, may_stay=may_stay)
        named = [p for p in fresh if (p.ref.namespace, p.ref.name) == (ref.namespace, ref.name)]
        return next((p for p in named if p.ref.uid != ref.uid), None)

    return _Drain(cluster, node, clock, rules, pods, successor, seen or PodsSeen()).run()


class _Drain:
    """One drain's state: the pods to evict, those evicted and still going, the budgets that
    refuse, and when each wait ends."""

    def __init__(
        self,
        cluster: Cluster,
        node: str,
        clock: Clock,
        rules: DrainRules,
        pods: list[PodView],
        successor: Callable[[PodRef], PodView | None],
        seen: PodsSeen,
    ) -> None:
        self.cluster, self.node, self.rules, self.successor = cluster, node, rules, successor
        self.pods = pods
        self.start = clock.now()
        self.deadline = self.start + rules.timeout_s
        self.views = {p.ref: p for p in pods}
        self.to_evict = {p.ref: p for p in pods if not p.terminating}
        self.waiting = {p.ref for p in pods}
        # when each pod's wait ends: its grace from its eviction (or from now, if it was
        # already terminating), plus the margin
        self.gone_by = {
            p.ref: self.start + p.grace_period_s + GRACE_MARGIN_S for p in pods if p.terminating
        }
        self.blocked: dict[PodRef, EvictionBlocked] = {}
        self.successors: list[PodRef] = []  # pods of a replaced one's name, drained instead
        self.next_try = self.asked_at = self.start  # the pass has just looked
        self.told = False
        # where the last watch ended: the next goes on from there, without a list (an
        # eviction retry costs the eviction and a watch, not a list more)
        self.seen = seen
        self.clock = _naming_on_stop(clock, lambda: tuple(sorted(self.going(), key=str)))

    def going(self) -> set[PodRef]:
        """Evicted (or terminating before) and still there."""
        return self.waiting - self.to_evict.keys()

    def end(self) -> float:
        """When the evicted pods still here have had their time."""
        return max([self.deadline, *(self.gone_by.get(r, self.deadline) for r in self.going())])

    def due(self) -> float:
        """When the drain must look, whatever the watch brings."""
        times = [self.end(), self.deadline] if self.blocked else [self.end()]
        if self.to_evict:
            times.append(self.next_try)
        if not self.told and self.rules.on_waiting is not None and self.going():
            times.append(self.start + WAIT_NOTICE_S)
        return min(times)

    def run(self) -> list[PodRef]:
        clock, rules = self.clock, self.rules
        while True:
            if rules.still_wanted is not None and clock.now() - self.asked_at >= rules.retry_s:
                self.asked_at = clock.now()
                rules.still_wanted()
            if self.to_evict and clock.now() >= self.next_try:
                self.evict_round()
                self.next_try = clock.now() + rules.retry_s
            self.watch_until_due()
            if not self.waiting:
                log.info("drain.finished", pods=len(self.pods) + len(self.successors))
                return [p.ref for p in self.pods] + self.successors
            self.tell_or_give_up()

    def evict_round(self) -> None:
        try:
            results = evict_all(self.cluster, list(self.to_evict))
        except MigAgentError as failure:  # the drain stops; the pods evicted so far still go
            evicted = failure.context.get("evicted", ())
            going = self.going() | set(evicted if isinstance(evicted, tuple) else ())
            failure.context["refs"] = tuple(sorted(going, key=str))
            raise
        for ref, exc in results.items():
            if isinstance(exc, PodReplaced):  # gone; the one of its name decided afresh
                self.replaced(ref)
            elif exc is not None:
                self.refused(ref, exc)
            else:
                self.blocked.pop(ref, None)
                del self.to_evict[ref]
                self.gone_by[ref] = self.clock.now() + self.views[ref].grace_period_s
                self.gone_by[ref] += GRACE_MARGIN_S
                log.info("drain.pod_evicted", pod=ref.name, namespace=ref.namespace)

    def replaced(self, ref: PodRef) -> None:
        del self.to_evict[ref]
        self.waiting.discard(ref)
        self.blocked.pop(ref, None)
        new = self.successor(ref)
        # the pod now of its name was listed after the watch's look: the next watch lists
        # again, or a pod it never saw would pass for one gone
        self.seen.resource_version = ""
        log.info(
            "drain.pod_replaced", pod=ref.name, namespace=ref.namespace, drained=new is not None
        )
        if new is None:
            return
        self.successors.append(new.ref)
        self.views[new.ref] = new
        self.waiting.add(new.ref)
        if new.terminating:
            self.gone_by[new.ref] = self.clock.now() + new.grace_period_s + GRACE_MARGIN_S
        else:
            self.to_evict[new.ref] = new

    def refused(self, ref: PodRef, exc: EvictionBlocked) -> None:
        if ref not in self.blocked:
            log.warning(
                "drain.blocked",
                pod=ref.name,
                namespace=ref.namespace,
                pdb=exc.context.get("pdb", ""),
                error=str(exc),
            )
            if self.rules.on_blocked is not None:  # tell the operator now, not at the deadline
                self.rules.on_blocked(ref, exc)
        self.blocked[ref] = exc

    def watch_until_due(self) -> None:
        """The evicted pods' going, from a watch of the node's pods, until the next thing due."""
        watch = watch_slices(
            lambda span: self.cluster.watch_pods(self.node, timeout_s=span, seen=self.seen),
            self.clock,
            due=self.due,
            poll_s=self.rules.poll_s,
        )
        for pods_now in watch:
            evicting = self.waiting & self.to_evict.keys()
            self.waiting = present(pods_now, self.going()) | evicting
            if not self.waiting or self.clock.now() >= self.due():
                break
        watch.close()

    def tell_or_give_up(self) -> None:
        """Tell a long wait once; raise at the deadlines."""
        going, now, on_waiting = self.going(), self.clock.now(), self.rules.on_waiting
        long = now - self.start >= WAIT_NOTICE_S
        if not self.told and on_waiting is not None and going and long:
            self.told = True
            slowest = max(going, key=lambda r: self.gone_by.get(r, self.deadline))
            on_waiting(self.views[slowest], len(going), self.end() - self.start)
        if self.blocked and now >= self.deadline:
            refused = next(iter(self.blocked.values()))
            refused.context["refs"] = tuple(sorted(going, key=str))  # evicted, still going
            raise refused
        if now >= self.end():
            names = ", ".join(sorted(str(r) for r in self.waiting))
            raise DrainTimeout(
                f"GPU pods still terminating {now - self.start:.0f} s after the drain began "
                f"(each waited for its grace period and {GRACE_MARGIN_S:.0f} s more): {names}",
                pods=sorted(str(r) for r in self.waiting),
                refs=tuple(sorted(self.waiting, key=str)),
            )


def _naming_on_stop(clock: Clock, going: Callable[[], tuple[PodRef, ...]]) -> Clock:
    """``clock``, whose sleep, when the agent is told to stop, says which evicted pods are
    still terminating (Stopping.refs): their cordon stays for the agent's successor."""
    sleep = clock.sleep

    def sleep_or_say(seconds: float) -> None:
        try:
            sleep(seconds)
        except Stopping as exc:
            raise Stopping(exc.refs or going()) from exc

    return replace(clock, sleep=sleep_or_say)


def wait_pods_gone(
    cluster: Cluster,
    node: str,
    refs: Iterable[PodRef],
    *,
    timeout_s: float,
    poll_s: float,
    what: str,
    clock: Clock = Clock(),
    seen: PodsSeen | None = None,
) -> None:
    """Wait until none of ``refs`` (pods on ``node``) exists any more (by UID); DrainTimeout
    naming the rest. ``seen``: where an earlier watch of the same wait ended (``refs`` known
    from before it), else one list first."""
    waiting = set(refs)
    if not waiting:
        return
    deadline = clock.now() + timeout_s
    # one list for the whole wait at most; each slice's watch goes on from the last
    seen = seen if seen is not None else PodsSeen()
    watch = watch_slices(
        lambda span: cluster.watch_pods(node, timeout_s=span, seen=seen),
        clock,
        due=lambda: deadline,
        poll_s=poll_s,
    )
    for pods_now in watch:
        waiting = present(pods_now, waiting)
        if not waiting:
            watch.close()
            return
        if clock.now() >= deadline:
            watch.close()
            names = ", ".join(sorted(str(r) for r in waiting))
            raise DrainTimeout(
                f"{what} still present after {timeout_s:.0f} s: {names}",
                pods=sorted(str(r) for r in waiting),
            )
