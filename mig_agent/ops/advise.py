"""``advise``: the relabels among the approved layouts that serve the pending pods with the
least disruption (the search is mig_agent.core.advise), as a table or JSON, and with
``apply`` through the rollout, followed by which of the served pods got scheduled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mig_agent.config.settings import Settings
from mig_agent.core.advise import Advice, Proposal, advise
from mig_agent.core.advise_assign import Want
from mig_agent.core.errors import ConfigError
from mig_agent.core.layout import LayoutCatalog
from mig_agent.kube.cluster import Cluster, PodRef
from mig_agent.node.waits import Clock
from mig_agent.ops.advise_read import Pool, read_pool
from mig_agent.ops.rollout import repartition
from mig_agent.ops.values import DEFAULT_SETTINGS, EXIT_FAILED, EXIT_OK, REAL_CLOCK, Writer, table
from mig_agent.ops.verify import NodeVerdict


@dataclass(frozen=True, slots=True)
class Report:
    proposals: tuple[Proposal, ...]
    unserved: tuple[tuple[str, str], ...]  # (pod, why)
    left_alone: Mapping[str, str]  # node -> why
    optimal: bool


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
        cluster, catalog, settings, selector=selector, allow_evict=allow_evict, generated=generated
    )
    advice = advise(pool.wants, pool.supplies)
    proposals, beyond = _at_most(advice, max_nodes)
    unserved = [(w.pod, _why(w, pool, allow_evict)) for w in advice.unserved]
    unserved += [
        (pod, f"served only by a proposal beyond --max-nodes {max_nodes}") for pod in beyond
    ]
    unserved += list(pool.not_understood.items())
    return Report(
        proposals, tuple(sorted(unserved)), dict(sorted(pool.left_alone.items())), advice.optimal
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
    }


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
) -> int:
    """Relabel the proposed nodes through the rollout (one rollout per layout, K nodes at a
    time; with ``verify``, each node checked after its success as ``repartition --verify``
    does), then follow the served pods until each is scheduled or ``schedule_timeout_s``
    passes. EXIT_OK when every node succeeded and every served pod got a node."""
    by_layout: dict[str, list[str]] = {}
    for p in report.proposals:
        by_layout.setdefault(p.option.layout, []).append(p.node)
    for layout, nodes in by_layout.items():
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
        )
        if not summary.ok:
            out(f"rollout of {layout} did not succeed everywhere; stopping")
            return summary.exit_code
    served = [pod for p in report.proposals for pod in p.serves]
    placed = _scheduled(cluster, served, schedule_timeout_s, poll_s, clock)
    for pod in served:
        where = placed.get(pod)
        out(f"  {pod}: {'scheduled on ' + where if where else 'still pending'}")
    return EXIT_OK if len(placed) == len(served) else EXIT_FAILED


def _scheduled(
    cluster: Cluster, pods: Sequence[str], timeout_s: float, poll_s: float, clock: Clock
) -> dict[str, str]:
    deadline = clock.now() + timeout_s
    placed: dict[str, str] = {}
    while True:
        for pod in pods:
            if pod not in placed:
                namespace, name = pod.split("/", 1)
                view = cluster.get_pod(PodRef(namespace, name))
                if view is not None and view.node:
                    placed[pod] = view.node
        if len(placed) == len(pods) or clock.now() >= deadline:
            return placed
        clock.sleep(poll_s)
