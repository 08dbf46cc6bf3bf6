"""``advise``: the relabels among the approved layouts that serve the pending pods with the
least disruption (the search is mig_agent.core.advise), as a table or JSON, and with
``apply`` through the rollout, followed by which of the served pods got scheduled.

Minutes can pass between the read and a node's relabel (K nodes at a time, one layout after
another), so ``apply`` looks at each node again just before its patch: the labels still as
read, no eviction the proposal did not show (none without --allow-evict), every pod it serves
still waiting (the same pod: matched by UID) and still fitting; the patch itself is written only
while the labels hold. A node that fails any of it is skipped with the reason, and the summary
says what was done and what was not. The pods of a Kueue workload's demand do not exist before
Kueue admits it: their workload is read again instead (the same one, by UID, still waiting on
its admission checks), and they are not followed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mig_agent.config.settings import Settings
from mig_agent.core.advise import Advice, Proposal, advise
from mig_agent.core.advise_assign import Want, assign
from mig_agent.core.errors import ConfigError
from mig_agent.core.layout import LayoutCatalog
from mig_agent.kube.cluster import Cluster, PodRef
from mig_agent.node.waits import Clock
from mig_agent.ops.advise_read import (
    Pool,
    read_node,
    read_pool,
    within_budgets,
    workloads_not_waiting,
)
from mig_agent.ops.rollout import Precondition, repartition
from mig_agent.ops.values import (
    _GOOD,
    DEFAULT_SETTINGS,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    REAL_CLOCK,
    NodeResult,
    Result,
    Writer,
    table,
)
from mig_agent.ops.verify import NodeVerdict


@dataclass(frozen=True, slots=True)
class Report:
    proposals: tuple[Proposal, ...]
    unserved: tuple[tuple[str, str], ...]  # (pod, why)
    left_alone: Mapping[str, str]  # node -> why
    optimal: bool
    # what ``apply`` checks again before each relabel: the proposed nodes' layout and state
    # labels as read, the UIDs of the pods served and evicted, what each served pod asks, the
    # layouts searched (generated ones included), whether evictions were allowed
    seen: Mapping[str, Mapping[str, str | None]] = field(default_factory=dict)
    uids: Mapping[str, str] = field(default_factory=dict)
    wants: Mapping[str, Want] = field(default_factory=dict)
    catalog: LayoutCatalog | None = None
    allow_evict: bool = False
    # Kueue: the workloads read as demand, those left out because quota holds them (-> why),
    # and the wants that stand for their pods (none exists yet: not looked up, not followed)
    workloads: tuple[str, ...] = ()
    workloads_for_quota: Mapping[str, str] = field(default_factory=dict)
    workload_pods: frozenset[str] = frozenset()


def run(
    cluster: Cluster,
    catalog: LayoutCatalog,
    *,
    settings: Settings = DEFAULT_SETTINGS,
    selector: str = "",
    allow_evict: bool = False,
    max_nodes: int | None = None,
    generated: bool = False,
) -> Report:
    """The proposals for the pool ``selector`` picks; reads only."""
    if max_nodes is not None and max_nodes < 1:
        raise ConfigError(f"--max-nodes must be at least 1, got {max_nodes}")
    pool = read_pool(
        cluster,
        catalog,
        settings,
        selector=selector,
        allow_evict=allow_evict,
        generated=generated,
        keep_promises=True,
    )
    advice = advise(pool.wants, pool.supplies, pool.budgets)
    proposals, beyond = _at_most(advice, max_nodes)
    unserved = [(w.pod, _why(w, pool, allow_evict)) for w in advice.unserved]
    unserved += [
        (pod, f"served only by a proposal beyond --max-nodes {max_nodes}") for pod in beyond
    ]
    unserved += list(pool.not_understood.items())
    pods = {pod for p in proposals for pod in (*p.serves, *p.option.evicts)}
    return Report(
        proposals,
        tuple(sorted(unserved)),
        dict(sorted(pool.left_alone.items())),
        advice.optimal,
        seen={p.node: pool.seen[p.node] for p in proposals},
        uids={pod: pool.uids.get(pod, "") for pod in sorted(pods)},
        wants={w.pod: w for w in pool.wants if w.pod in pods},
        catalog=pool.catalog,
        allow_evict=allow_evict,
        workloads=tuple(pool.workloads),
        workloads_for_quota=dict(sorted(pool.workloads_for_quota.items())),
        workload_pods=frozenset(pool.workload_pods),
    )


def _at_most(advice: Advice, n: int | None) -> tuple[tuple[Proposal, ...], list[str]]:
    """The ``n`` proposals serving the most (then the cheapest), in node order; the pods the
    others would have served."""
    if n is None or len(advice.proposals) <= n:
        return advice.proposals, []
    ranked = sorted(advice.proposals, key=lambda p: (-len(p.serves), p.option.cost, p.node))
    keep = {p.node for p in ranked[:n]}
    beyond = [pod for p in advice.proposals if p.node not in keep for pod in p.serves]
    return tuple(p for p in advice.proposals if p.node in keep), beyond


def _short(kind: str) -> str:
    return kind.removeprefix("nvidia.com/")


def _why(want: Want, pool: Pool, allow_evict: bool) -> str:
    """Why the search left ``want`` unserved, naming the constraint that narrowed its nodes."""
    allowed = pool.allowed.get(want.pod, [])
    kind = _short(want.kind) + (f" x{want.count}" if want.count > 1 else "")
    where = f"the node(s) its {want.constraint} allows" if want.constraint else "any GPU node"
    if not allowed:
        if want.constraint:
            return f"its {want.constraint} allows no GPU node"
        return "every GPU node has a taint it does not tolerate"
    if not want.nodes:
        alone = ", ".join(f"{n} ({pool.left_alone[n]})" for n in allowed if n in pool.left_alone)
        return f"every node it may use is left alone: {alone}"
    supplies = {s.node: s for s in pool.supplies}
    offering = [
        n
        for n in sorted(want.nodes)
        if any(o.free.get(want.kind, 0) >= want.count for o in supplies[n].options)
    ]
    if not offering:
        if any(want.kind in pool.evicting_only.get(n, set()) for n in want.nodes):
            if allow_evict:
                return (
                    f"only layouts that evict running pods offer {kind} on {where}, and "
                    "PodDisruptionBudgets forbid those evictions"
                )
            return f"only layouts that evict running pods offer {kind} on {where} (--allow-evict)"
        nodes = f" ({', '.join(allowed)})" if want.constraint else ""
        return f"no approved layout offers {kind} on {where}{nodes}"
    offers = [
        o for n in offering for o in supplies[n].options if o.free.get(want.kind, 0) >= want.count
    ]
    if all(o.budgets for o in offers):
        budgets = ", ".join(sorted({b for o in offers for b in o.budgets}))
        return (
            f"the layouts that offer {kind} on {where} evict pods of PodDisruptionBudgets "
            f"({budgets}) whose disruptions the proposals' evictions already take"
        )
    if want.gang:
        return (
            f"its gang {want.gang} is served all or none, and the approved layouts cannot "
            "serve all of its pods"
        )
    return f"the {kind} devices approved layouts can offer on {where} go to other pending pods"


def _resources(r: Mapping[str, int]) -> str:
    return ",".join(f"{_short(k)}={n}" for k, n in sorted(r.items())) or "-"


def report_lines(report: Report) -> list[str]:
    """The table of proposals, then the pods left unserved with why."""
    out: list[str] = []
    if report.proposals:
        rows = [
            (
                p.node,
                f"{p.from_layout or '-'} -> {p.option.layout}",
                ",".join(map(str, p.option.gpus_changed)),
                " ".join(p.serves),
                " ".join(p.option.evicts) or "-",
                _resources(p.resources_before),
                _resources(p.option.resources),
            )
            for p in report.proposals
        ]
        out += table(("NODE", "LAYOUT", "GPUS", "SERVES", "EVICTS", "BEFORE", "AFTER"), rows)
    else:
        out.append("no relabel proposed")
    if report.unserved:
        out.append("")
        out.append(f"unserved ({len(report.unserved)}):")
        out += [f"  {pod}: {why}" for pod, why in report.unserved]
    if report.left_alone:
        out.append("")
        out.append(
            "nodes left alone: " + "; ".join(f"{n} ({w})" for n, w in report.left_alone.items())
        )
    if report.proposals and not report.optimal:
        out.append("(large pool: the greedy answer, not proven the best)")
    return out + _workload_lines(report)


def _workload_lines(report: Report) -> list[str]:
    """What advise read of Kueue's workloads; nothing where it found none asking for GPUs."""
    if not report.workloads and not report.workloads_for_quota:
        return []
    out = ["", f"Kueue workloads read as demand: {len(report.workloads)}"]
    out += [f"  {w}" for w in report.workloads]
    if report.workloads_for_quota:
        n = len(report.workloads_for_quota)
        out.append(f"left out: {n} workload(s) wait for quota, not devices")
        out += [f"  {w}: {why}" for w, why in report.workloads_for_quota.items()]
    return out


def report_json(report: Report) -> dict[str, Any]:
    return {
        "proposals": [
            {
                "node": p.node,
                "from": p.from_layout,
                "to": p.option.layout,
                "gpus_changed": list(p.option.gpus_changed),
                "serves": list(p.serves),
                "evicts": list(p.option.evicts),
                "resources_before": dict(sorted(p.resources_before.items())),
                "resources_after": dict(sorted(p.option.resources.items())),
            }
            for p in report.proposals
        ],
        "unserved": [{"pod": pod, "reason": why} for pod, why in report.unserved],
        "left_alone": dict(report.left_alone),
        "optimal": report.optimal,
        "workloads": {
            "read": list(report.workloads),
            "left_out_for_quota": [
                {"workload": w, "reason": why} for w, why in report.workloads_for_quota.items()
            ],
        },
    }


@dataclass(frozen=True, slots=True)
class PodOutcome:
    pod: str  # namespace/name
    uid: str
    node: str  # where it was scheduled; "" when it was not
    result: str  # "scheduled on <node>", "still pending", "gone (...)", "not followed: ..."


@dataclass(frozen=True, slots=True)
class Applied:
    """What ``apply`` did: per proposal (in the report's order) its layout and result, and
    what became of each pod it was to serve."""

    nodes: tuple[tuple[str, NodeResult], ...]  # (layout, result)
    pods: tuple[PodOutcome, ...]
    interrupted: bool = False

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        done = all(r.result in _GOOD for _, r in self.nodes)
        return EXIT_OK if done and all(p.node for p in self.pods) else EXIT_FAILED


def apply(
    cluster: Cluster,
    catalog: LayoutCatalog,
    report: Report,
    *,
    max_parallel: int = 1,
    settings: Settings = DEFAULT_SETTINGS,
    schedule_timeout_s: float = 120.0,
    poll_s: float = 1.0,
    clock: Clock = REAL_CLOCK,
    out: Writer = print,
    verify: Callable[[str], NodeVerdict] | None = None,
) -> Applied:
    """Relabel the proposed nodes through the rollout (one rollout per layout, K nodes at a
    time; with ``verify``, each node checked after its success as ``repartition --verify``
    does), each looked at again just before its patch (see the module): one that changed is
    skipped, the others go on; a node that fails stops the layouts not yet started. Then follow
    the served pods of the nodes relabelled (by UID) until each is scheduled, gone, or
    ``schedule_timeout_s`` passes; last, the summary of what was done and what was not."""
    catalog = report.catalog or catalog
    by_layout: dict[str, list[str]] = {}
    for p in report.proposals:
        by_layout.setdefault(p.option.layout, []).append(p.node)
    results: dict[str, NodeResult] = {}
    stopped, interrupted = "", False
    for layout, nodes in by_layout.items():
        if stopped:
            results.update({n: NodeResult(n, Result.NOT_STARTED, reason=stopped) for n in nodes})
            continue
        summary = repartition(
            cluster,
            catalog,
            layout,
            nodes,
            max_parallel=max_parallel,
            settings=settings,
            clock=clock,
            out=out,
            verify=verify,
            gate=lambda node: _look_again(cluster, catalog, report, node, settings),
        )
        results.update({r.node: r for r in summary.results})
        interrupted = summary.interrupted
        if interrupted or any(r.result in (Result.FAILED, Result.TIMEOUT) for r in summary.results):
            out(f"rollout of {layout} did not succeed everywhere; stopping")
            stopped = f"not started: the rollout of {layout} did not succeed everywhere"
    # interrupted: one look at the pods, no wait
    wait_s = 0.0 if interrupted else schedule_timeout_s
    pods = _follow(cluster, report, results, wait_s, poll_s, clock)
    applied = Applied(
        tuple((p.option.layout, results[p.node]) for p in report.proposals), pods, interrupted
    )
    for line in applied_lines(applied):
        out(line)
    return applied


def _look_again(
    cluster: Cluster, catalog: LayoutCatalog, report: Report, node: str, settings: Settings
) -> Precondition | str:
    """The precondition of ``node``'s relabel, or why it is skipped: see the module."""
    proposal = next(p for p in report.proposals if p.node == node)
    seen = report.seen.get(node, {})
    now = read_node(cluster, catalog, settings, node, seen)
    if isinstance(now, str):
        return now
    layout = proposal.option.layout
    option = next((o for o in now.supply.options if o.layout == layout), None)
    if option is None:
        return f"{layout} no longer fits or changes a GPU here"
    shown = {report.uids.get(pod) for pod in proposal.option.evicts}
    uid_of = {str(p.ref): p.ref.uid for p in now.running}
    new = [pod for pod in option.evicts if uid_of.get(pod) not in shown]
    if new:
        bound = f"bound since advise read, on a device {layout} destroys"
        if report.allow_evict:
            return f"would now also evict {', '.join(new)}, not in the proposal: {bound}"
        return f"would now evict {', '.join(new)}: {bound} (--allow-evict)"
    if option.evicts and not within_budgets(cluster, option, now.running):
        return "PodDisruptionBudgets now forbid its evictions"
    gone = _not_waiting(cluster, report, proposal.serves)
    if gone:
        return "the pods it serves do not all wait any more: " + "; ".join(gone)
    asks = [
        dataclasses.replace(report.wants[pod], nodes=frozenset({node})) for pod in proposal.serves
    ]
    fits = len(assign(asks, {node: option.free}))
    if fits < len(asks):
        return f"{layout} now has room here for {fits} of the {len(asks)} pods it serves"
    return Precondition(seen, known=now.node)


def _not_waiting(cluster: Cluster, report: Report, pods: Sequence[str]) -> list[str]:
    """Of ``pods``, those that no longer wait unscheduled (the same pod: by UID), with why; a
    Kueue workload's pods (none exists before Kueue admits it) by their workload, read again."""
    out: list[str] = []
    workloads = {
        report.wants[pod].gang.removeprefix("workload:"): report.uids.get(pod, "")
        for pod in pods
        if pod in report.workload_pods
    }
    if workloads:
        out += workloads_not_waiting(cluster, workloads)
    for pod in pods:
        if pod in report.workload_pods:
            continue
        namespace, name = pod.split("/", 1)
        view = cluster.get_pod(PodRef(namespace, name, report.uids.get(pod, "")))
        if view is None:
            out.append(f"{pod} is gone (deleted, or made again under another UID)")
        elif view.node:
            out.append(f"{pod} is scheduled on {view.node}")
        elif view.terminating or view.phase != "Pending":
            out.append(f"{pod} is {'terminating' if view.terminating else view.phase}")
    return out


def _follow(
    cluster: Cluster,
    report: Report,
    results: Mapping[str, NodeResult],
    timeout_s: float,
    poll_s: float,
    clock: Clock,
) -> tuple[PodOutcome, ...]:
    """What became of each served pod: followed by UID where its node was relabelled."""
    refs: dict[str, PodRef] = {}
    outcomes: dict[str, PodOutcome] = {}
    for p in report.proposals:
        result = results[p.node]
        for pod in p.serves:
            if pod in report.workload_pods:
                continue  # no pod until Kueue admits its workload: not followed
            uid = report.uids.get(pod, "")
            if result.result in _GOOD:
                namespace, name = pod.split("/", 1)
                refs[pod] = PodRef(namespace, name, uid)
            else:
                why = f"not followed: {p.node} {result.result}"
                outcomes[pod] = PodOutcome(pod, uid, "", why)
    outcomes.update(_scheduled(cluster, refs, timeout_s, poll_s, clock))
    return tuple(outcomes[pod] for p in report.proposals for pod in p.serves if pod in outcomes)


def _scheduled(
    cluster: Cluster, refs: Mapping[str, PodRef], timeout_s: float, poll_s: float, clock: Clock
) -> dict[str, PodOutcome]:
    deadline = clock.now() + timeout_s
    done: dict[str, PodOutcome] = {}
    while True:
        for pod, ref in refs.items():
            if pod in done:
                continue
            view = cluster.get_pod(ref)  # by UID: one made again under its name is another
            if view is None:
                done[pod] = PodOutcome(pod, ref.uid, "", "gone (deleted, or made again)")
            elif view.node:
                done[pod] = PodOutcome(pod, ref.uid, view.node, f"scheduled on {view.node}")
        if len(done) == len(refs) or clock.now() >= deadline:
            left = {p: PodOutcome(p, r.uid, "", "still pending") for p, r in refs.items()}
            return {**left, **done}
        clock.sleep(poll_s)


def applied_lines(applied: Applied) -> list[str]:
    """The summary of an apply: each proposal's result, then each served pod's."""
    done = sum(1 for _, r in applied.nodes if r.result in _GOOD)
    out = ["", f"advise --apply: {done} of {len(applied.nodes)} relabel(s) done"]
    out += table(
        ("NODE", "LAYOUT", "RESULT", "REASON"),
        [(r.node, layout, str(r.result), r.reason) for layout, r in applied.nodes],
    )
    out += [f"  {p.pod}: {p.result}" for p in applied.pods]
    return out


def applied_json(applied: Applied) -> dict[str, Any]:
    return {
        "nodes": [
            {
                "node": r.node,
                "layout": layout,
                "result": str(r.result),
                "reason": r.reason,
                "elapsed_s": r.elapsed_s,
            }
            for layout, r in applied.nodes
        ],
        "pods": [
            {"pod": p.pod, "uid": p.uid, "node": p.node or None, "result": p.result}
            for p in applied.pods
        ],
        "done": sum(1 for _, r in applied.nodes if r.result in _GOOD),
        "interrupted": applied.interrupted,
        "ok": applied.exit_code == EXIT_OK,
    }
