"""The decisions of mig-agent's MIG layout AdmissionCheck (Kueue): for each Workload that
reserved quota and waits on the check, whether its devices exist now (Ready), which nodes to
relabel so that they will (the least-disruptive relabels advise's search finds for the whole
workload as one gang, approved layouts only, no eviction unless the check allows it, at most
``max_nodes`` nodes changing at once), whether it waits (nodes changing for it, or its devices
promised to workloads before it), or why no approved layout can serve it.

Two workloads never claim the same devices. Workloads are taken in this order: those marked
Ready already (their devices stay promised until Kueue admits them and their pods hold them),
those whose nodes change for them, then the others in queue order; each takes its devices off
the pool before the next is looked at. A node that changes for a workload is wholly its own
until the change is done, and a node some of whose free devices are promised is not relabelled.

A relabel is done when the node is no longer left alone (its state is ``success``, not
``pending``), its layout label is the target, and the devices its agent publishes are those
the target makes (a ``success`` left from before the relabel shows the old devices). A relabel
that failed (state ``failed``) makes the check Retry.

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
    """A workload that reserved quota and waits on the check: its pods as wants (one gang),
    the nodes relabelled for it earlier, whether the check is Ready already."""

    workload: str  # namespace/name
    wants: tuple[Want, ...]
    params: Params = Params()
    relabelled: Mapping[str, Target] = field(default_factory=dict)
    ready: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    workload: str
    verdict: Verdict
    message: str
    # RELABEL, WAIT: its nodes; RETRY: those kept named on it (verify failed there)
    relabels: Mapping[str, Target] = field(default_factory=dict)
    placed: Mapping[str, str] = field(default_factory=dict)  # READY: pod -> node


class _Pool:
    """The supply as the workloads decided so far left it."""

    def __init__(self, supplies: Sequence[Supply], left_alone: Mapping[str, str]) -> None:
        self.supplies = {s.node: s for s in supplies}
        self.left_alone = left_alone
        self.free = {s.node: Counter(s.free) for s in supplies}
        self.claimed: set[str] = set()  # changing for a workload
        self.touched: set[str] = set()  # some of its free devices promised

    def capacity(self) -> dict[str, Mapping[str, int]]:
        return {n: c for n, c in self.free.items() if n not in self.claimed}

    def take(self, wants: Sequence[Want], placed: Mapping[str, str]) -> None:
        for w in wants:
            node = placed[w.pod]
            self.free[node][w.kind] -= w.count
            self.touched.add(node)

    def searchable(self, params: Params, *, fresh: bool = False) -> list[Supply]:
        """The nodes a relabel may use, each with staying as an option (its free devices
        now); ``fresh``: as if no workload had claimed anything."""
        out = []
        for s in self.supplies.values():
            if not fresh and s.node in self.claimed:
                continue
            free = dict(s.free) if fresh else _positive(self.free[s.node])
            options: tuple[Option, ...] = ()
            if fresh or s.node not in self.touched:
                options = tuple(o for o in s.options if params.allow_evict or not o.evicts)
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
        range(len(waiting)), key=lambda i: (not waiting[i].ready, not waiting[i].relabelled)
    )
    out: dict[int, Decision] = {}
    for i in order:
        w = waiting[i]
        d = _one(w, pool, changing, budgets or {})
        if d.verdict is Verdict.RELABEL:
            changing += len(d.relabels)
        out[i] = d
    return [out[i] for i in range(len(waiting))]


def _one(w: Waiting, pool: _Pool, changing: int, budgets: Budgets) -> Decision:
    if w.relabelled:
        failed = [n for n in w.relabelled if "failed" in pool.left_alone.get(n, "")]
        if failed:
            why = "; ".join(f"{n}: {pool.left_alone[n]}" for n in failed)
            return Decision(w.workload, Verdict.RETRY, f"the relabel for it failed ({why})")
        if not _relabels_done(w, pool):
            pool.claimed.update(w.relabelled)
            nodes = ", ".join(f"{n} (to {t.layout})" for n, t in sorted(w.relabelled.items()))
            return Decision(
                w.workload, Verdict.WAIT, f"waiting for {nodes} to reach success", w.relabelled
            )
    placed = assign(w.wants, pool.capacity())
    if len(placed) == len(w.wants):
        pool.take(w.wants, placed)
        nodes = ", ".join(sorted(set(placed.values())))
        return Decision(
            w.workload, Verdict.READY, f"its {len(w.wants)} pod(s) fit on {nodes}", placed=placed
        )
    if w.ready:  # marked Ready, its devices gone meanwhile: Kueue admits it all the same
        return Decision(w.workload, Verdict.READY, "marked Ready already")
    return _search(w, pool, changing, budgets)


def _search(w: Waiting, pool: _Pool, changing: int, budgets: Budgets) -> Decision:
    gang = [replace(want, gang=f"check:{w.workload}") for want in w.wants]
    advice = advise(gang, pool.searchable(w.params), budgets)
    if not advice.unserved:
        relabels = {
            p.node: Target(p.option.layout, dict(p.option.resources))
            for p in advice.proposals
            if p.option.layout != (p.from_layout or "")
        }
        cap = w.params.max_nodes
        if cap is not None and len(relabels) > cap:
            return _unservable(w, f"it needs {len(relabels)} nodes changed, more than {cap}")
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
    if not advise(gang, pool.searchable(w.params, fresh=True), budgets).unserved:
        return Decision(
            w.workload,
            Verdict.WAIT,
            f"{_asks(w.wants)}: the devices approved layouts can offer go to workloads before "
            "it, or change for them",
        )
    evicting = Params(True, w.params.max_nodes)
    if (
        not w.params.allow_evict
        and not advise(gang, pool.searchable(evicting, fresh=True), budgets).unserved
    ):
        return _unservable(
            w,
            f"{_asks(w.wants)}: only layouts that evict running pods serve it, and the "
            "check does not allow evictions",
        )
    return _unservable(w, f"{_asks(w.wants)}: no approved layout can serve all of its pods")


def _unservable(w: Waiting, message: str) -> Decision:
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
