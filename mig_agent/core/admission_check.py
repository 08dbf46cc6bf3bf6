"""The decisions of mig-agent's MIG layout AdmissionCheck (Kueue): for each Workload that
reserved quota and waits on the check, whether its devices exist now (Ready), which nodes to
relabel so that they will (the least-disruptive relabels advise's search finds for the whole
workload as one gang, approved layouts only, no eviction unless the check allows it, at most
``max_nodes`` nodes changing at once), whether it waits (nodes changing for it, or its devices
promised to workloads before it), or why no approved layout can serve it.

Two workloads never claim the same devices. Workloads are taken in this order: those holding a
promise (marked Ready, or admitted with pods still to bind: mig_agent.core.admission_ledger),
those whose nodes change for them, then the others in queue order; each takes its devices off
the pool before the next is looked at. A promise is kept where it was made, never placed again;
only a Ready workload not yet admitted whose promised devices are gone is placed afresh. A node
that changes for a workload is wholly its own until the change is done, and a node some of
whose free devices are promised is not relabelled.

A relabel is done when the node is no longer left alone (its state is ``success``, not
``pending``), its layout label is the target, and the devices its agent publishes are those
the target makes (a ``success`` left from before the relabel shows the old devices). A relabel
that failed (state ``failed``) makes the check Retry; one whose write never landed is written
again; one whose node went to another layout or left the pool is dropped and the workload
searched again, its message saying so.

Pure module: no I/O.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from mig_agent.core.advise import Budgets, Option, Supply, advise
from mig_agent.core.advise_assign import Want, assign


class Verdict(enum.StrEnum):
    """What the controller does for a workload."""

    READY = "Ready"  # its devices exist: mark the check Ready
    RELABEL = "Relabel"  # relabel ``relabels``; the check stays Pending
    WAIT = "Wait"  # the check stays Pending, the message says why
    RETRY = "Retry"  # a relabel for it failed: Kueue releases its quota and tries again
    REJECTED = "Rejected"  # no approved layout can serve it (only where the check says so)


@dataclass(frozen=True, slots=True)
class Params:
    """The check's parameters."""

    allow_evict: bool = False
    max_nodes: int | None = None  # nodes changing at once, over all workloads; None: any
    reject_unservable: bool = False  # Rejected (not Pending) when no layout can serve it
    verify: bool = False  # verify's checks of the nodes relabelled for it before Ready


@dataclass(frozen=True, slots=True)
class Target:
    """The layout a node was relabelled to for a workload, and the devices it makes there."""

    layout: str
    resources: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class Waiting:
    """A workload that reserved quota and waits on the check (or was admitted and holds the
    devices of pods still to bind: ``admitted``): its pods as wants (one gang), the nodes
    relabelled for it (``unwritten``: those whose write is to be made again; ``lost``: those
    dropped since, -> why), where its pods were promised (pod -> node), the nodes it is kept
    off (-> why), whether the check is Ready already."""

    workload: str  # namespace/name
    wants: tuple[Want, ...]
    params: Params = Params()
    relabelled: Mapping[str, Target] = field(default_factory=dict)
    ready: bool = False
    promised: Mapping[str, str] = field(default_factory=dict)
    unwritten: frozenset[str] = frozenset()
    lost: Mapping[str, str] = field(default_factory=dict)
    avoid: Mapping[str, str] = field(default_factory=dict)
    admitted: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    workload: str
    verdict: Verdict
    message: str
    # RELABEL, WAIT: its nodes changing for it (the relabels recorded on it)
    relabels: Mapping[str, Target] = field(default_factory=dict)
    placed: Mapping[str, str] = field(default_factory=dict)  # READY: pod -> node
    avoid: Mapping[str, str] = field(default_factory=dict)  # RETRY: nodes to keep it off


class _Pool:
    """The supply as the workloads decided so far left it."""

    def __init__(self, supplies: Sequence[Supply], left_alone: Mapping[str, str]) -> None:
        self.supplies = {s.node: s for s in supplies}
        self.left_alone = left_alone
        self.free = {s.node: Counter(s.free) for s in supplies}
        self.claimed: set[str] = set()  # changing for a workload
        self.touched: set[str] = set()  # some of its free devices promised

    def capacity(self, avoid: Mapping[str, str]) -> dict[str, Mapping[str, int]]:
        return {n: c for n, c in self.free.items() if n not in self.claimed and n not in avoid}

    def take(self, wants: Sequence[Want], placed: Mapping[str, str]) -> None:
        for w in wants:
            node = placed.get(w.pod)
            if node in self.free:
                self.free[node][w.kind] -= w.count
                self.touched.add(node)

    def holds(self, wants: Sequence[Want], placed: Mapping[str, str]) -> bool:
        """Whether the devices ``placed`` names are free still (each on its node)."""
        need = Counter((placed[w.pod], w.kind) for w in wants for _ in range(w.count))
        return all(
            node not in self.claimed and self.free.get(node, Counter())[kind] >= n
            for (node, kind), n in need.items()
        )

    def searchable(self, w: Waiting, *, fresh: bool = False) -> list[Supply]:
        """The nodes a relabel for ``w`` may use, each with staying as an option (its free
        devices now); ``fresh``: as if no workload had claimed anything."""
        out = []
        for s in self.supplies.values():
            if s.node in w.avoid or (not fresh and s.node in self.claimed):
                continue
            free = dict(s.free) if fresh else _positive(self.free[s.node])
            options: tuple[Option, ...] = ()
            if fresh or s.node not in self.touched:
                options = tuple(o for o in s.options if w.params.allow_evict or not o.evicts)
            stay = Option(s.layout or "", (), free, s.resources)
            out.append(Supply(s.node, s.layout, {}, (stay, *options), s.resources))
        return out


def decide(
    waiting: Sequence[Waiting],
    supplies: Sequence[Supply],
    left_alone: Mapping[str, str] | None = None,
    budgets: Budgets | None = None,
) -> list[Decision]:
    """A decision per workload, in the order of ``waiting`` (see the module for the order
    they are taken in). ``supplies``: the nodes as advise reads them, every option included
    (those that evict too, within the PodDisruptionBudgets); ``left_alone``: the other GPU
    nodes, with why (a change under way, failed, cordoned...); ``budgets``: the evictions each
    PodDisruptionBudget allows now."""
    pool = _Pool(supplies, left_alone or {})
    changing = sum(len(w.relabelled) for w in waiting if not _relabels_done(w, pool))
    order = sorted(
        range(len(waiting)),
        key=lambda i: (not waiting[i].promised, not waiting[i].ready, not waiting[i].relabelled),
    )
    out: dict[int, Decision] = {}
    for i in order:  # every promise that holds first: one broken is placed afresh after them
        kept = _kept(waiting[i], pool) if waiting[i].promised else None
        if kept is not None:
            out[i] = kept
    for i in order:
        if i in out:
            continue
        w = replace(waiting[i], promised={})
        d = _one(w, pool, changing, budgets or {})
        if d.verdict is Verdict.RELABEL:
            changing += len(set(d.relabels) - set(w.relabelled))
        out[i] = d
    return [out[i] for i in range(len(waiting))]


def _one(w: Waiting, pool: _Pool, changing: int, budgets: Budgets) -> Decision:
    if w.relabelled:
        d = _relabelled(w, pool)
        if d is not None:
            return d
    placed = assign(w.wants, pool.capacity(w.avoid))
    if len(placed) == len(w.wants):
        pool.take(w.wants, placed)
        nodes = ", ".join(sorted(set(placed.values())))
        return _noted(
            w,
            Decision(
                w.workload,
                Verdict.READY,
                f"its {len(w.wants)} pod(s) fit on {nodes}",
                placed=placed,
            ),
        )
    if w.admitted:  # admitted without a promise kept: it holds whatever it can
        pool.take(w.wants, placed)
        return Decision(w.workload, Verdict.READY, "admitted already")
    return _noted(w, _search(w, pool, changing, budgets))


def _kept(w: Waiting, pool: _Pool) -> Decision | None:
    """The promise of ``w`` kept where it was made (None: its devices are gone, and it is
    not admitted yet: placed afresh)."""
    promised = [x for x in w.wants if x.pod in w.promised]
    if pool.holds(promised, w.promised):
        pool.take(promised, w.promised)
        nodes = ", ".join(sorted(set(w.promised.values())))
        return Decision(w.workload, Verdict.READY, f"promised on {nodes}", placed=w.promised)
    if not w.admitted:
        return None
    # admitted, its pods to come pinned where their devices are gone: only Kueue's requeue
    # (Retry evicts it) can place them again
    gone = sorted(
        f"{n} ({pool.left_alone.get(n, 'not in the pool')})"
        for n in set(w.promised.values())
        if not pool.holds([x for x in promised if w.promised[x.pod] == n], w.promised)
    )
    message = f"the devices promised to its pods still to start are gone: {', '.join(gone)}"
    return Decision(w.workload, Verdict.RETRY, message)


def _relabelled(w: Waiting, pool: _Pool) -> Decision | None:
    """The decision while nodes change for ``w`` (None: they are done)."""
    failed = [n for n in w.relabelled if "failed" in pool.left_alone.get(n, "")]
    if failed:
        why = "; ".join(f"{n}: {pool.left_alone[n]}" for n in failed)
        return Decision(w.workload, Verdict.RETRY, f"the relabel for it failed ({why})")
    if w.unwritten:
        pool.claimed.update(w.relabelled)
        nodes = ", ".join(f"{n} to {w.relabelled[n].layout}" for n in sorted(w.unwritten))
        message = f"relabelling {nodes} again for it (the last write did not land)"
        return Decision(w.workload, Verdict.RELABEL, message, w.relabelled)
    if not _relabels_done(w, pool):
        pool.claimed.update(w.relabelled)
        nodes = ", ".join(f"{n} (to {t.layout})" for n, t in sorted(w.relabelled.items()))
        message = f"waiting for {nodes} to reach success"
        return Decision(w.workload, Verdict.WAIT, message, w.relabelled)
    return None


def _noted(w: Waiting, d: Decision) -> Decision:
    """``d`` with what became of the relabels dropped for ``w`` said first."""
    if not w.lost:
        return d
    lost = "; ".join(f"{n} {why}" for n, why in sorted(w.lost.items()))
    message = f"{lost}: searched again; {d.message}"
    return replace(d, message=message, avoid={**w.lost, **d.avoid})


def _search(w: Waiting, pool: _Pool, changing: int, budgets: Budgets) -> Decision:
    gang = [replace(want, gang=f"check:{w.workload}") for want in w.wants]
    advice = advise(gang, pool.searchable(w), budgets)
    if not advice.unserved:
        relabels = {
            p.node: Target(p.option.layout, dict(p.option.resources))
            for p in advice.proposals
            if p.option.layout != (p.from_layout or "")
        }
        cap = w.params.max_nodes
        if cap is not None and len(relabels) > cap:
            return Decision(
                w.workload,
                Verdict.WAIT,
                f"it needs {len(relabels)} nodes changed, more than {cap} "
                "(the check's mig-agent.dev/max-nodes)",
            )
        if cap is not None and changing + len(relabels) > cap:
            return Decision(
                w.workload,
                Verdict.WAIT,
                f"it needs {len(relabels)} node(s) changed and {changing} are changing "
                f"already (at most {cap} at once)",
            )
        pool.claimed.update(relabels)
        by_pod = {want.pod: want for want in w.wants}
        for p in advice.proposals:  # devices of nodes that stay, promised to it meanwhile
            if p.node not in relabels:
                pool.take([by_pod[pod] for pod in p.serves], dict.fromkeys(p.serves, p.node))
        nodes = ", ".join(f"{n} to {t.layout}" for n, t in sorted(relabels.items()))
        return Decision(w.workload, Verdict.RELABEL, f"relabelling {nodes} for it", relabels)
    return _unserved(w, pool, budgets)


def _unserved(w: Waiting, pool: _Pool, budgets: Budgets) -> Decision:
    """Why no relabel serves ``w`` now: only Rejected (where the check asks it) when no
    approved layout anywhere in the pool could serve it, evictions allowed or not."""
    gang = [replace(want, gang=f"check:{w.workload}") for want in w.wants]
    if not advise(gang, pool.searchable(w, fresh=True), budgets).unserved:
        return Decision(
            w.workload,
            Verdict.WAIT,
            f"{_asks(w.wants)}: the devices approved layouts can offer go to workloads before "
            "it, or change for them",
        )
    evicting = replace(w, params=replace(w.params, allow_evict=True))
    if not advise(gang, pool.searchable(evicting, fresh=True), budgets).unserved:
        if w.params.allow_evict:
            why = "only layouts that evict pods serve it, and PodDisruptionBudgets allow none now"
        else:
            why = (
                "only layouts that evict running pods serve it, and the check does not allow "
                "evictions"
            )
        return Decision(w.workload, Verdict.WAIT, f"{_asks(w.wants)}: {why}")
    message = f"{_asks(w.wants)}: no approved layout can serve all of its pods"
    if w.avoid:
        kept_off = "; ".join(f"{n}: {y}" for n, y in sorted(w.avoid.items()))
        message += f" on the nodes it is not kept off for now ({kept_off})"
        return Decision(w.workload, Verdict.WAIT, message)
    verdict = Verdict.REJECTED if w.params.reject_unservable else Verdict.WAIT
    return Decision(w.workload, verdict, message)


def _relabels_done(w: Waiting, pool: _Pool) -> bool:
    for node, t in w.relabelled.items():
        s = pool.supplies.get(node)
        if s is None or s.layout != t.layout or dict(s.resources) != dict(t.resources):
            return False
    return True


def _asks(wants: Sequence[Want]) -> str:
    counts = Counter((w.kind.removeprefix("nvidia.com/"), w.count) for w in wants)
    parts = [f"{n} pod(s) asking {k}" + (f" x{c}" if c > 1 else "") for (k, c), n in counts.items()]
    return ", ".join(sorted(parts)) or "no pods"


def _positive(counts: Counter[str]) -> dict[str, int]:
    return {k: n for k, n in counts.items() if n > 0}
