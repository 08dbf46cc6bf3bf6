"""The search behind ``mig-agent advise``: which approved layout each node should take so that
the pending pods are served with the least disruption.

Each node offers options: stay as it is, or one of the approved layouts (its free devices once
applied, the GPUs that change, the running pods it would evict). A choice is one option per
node. The best choice serves the most pending pods; among those it evicts the fewest pods, then
changes the fewest GPUs, then the fewest nodes; ties go to the first in node and layout order.
Pods of a gang are served all or none (advise_assign). The options of a choice evict, in sum,
no more pods of a PodDisruptionBudget than it allows (``budgets``; each option says how many of
each budget's pods it evicts).

Pools of up to EXACT_NODES nodes with a useful option are searched exactly: branch and bound
over the nodes, bounded by a relaxed flow (every undecided node at the most it could offer of
each kind), seeded with the greedy answer, within a budget of bound evaluations (``optimal``
says whether it ran to its end and every placement it scored was proven the most, see
advise_assign; tests/unit/test_advise.py proves it against brute force, pods of several devices
included).
Larger pools take the greedy answer: nodes in order of the pending pods their option would
serve (lazily re-rated as pods get places), then every proposal that serves nobody is dropped,
every node moved to its cheapest option that holds the pods placed on it, and, up to TRIM_NODES
proposals, each tried at every cheaper option of its node.

Pure module: no I/O.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from mig_agent.core.advise_assign import (
    Want,
    assign,
    assign_proven,
    relaxed,
    served_upper_bound,
)

# exact search up to this many nodes with useful options, with this many bound evaluations
# (the first up to 8 nodes, the second beyond: a few seconds at most)
EXACT_NODES = 12
EXACT_BUDGET = (10_000, 2_000)
# proposals each tried at every cheaper option of their node, with the pool's pods placed again
TRIM_NODES = 48


@dataclass(frozen=True, slots=True)
class Option:
    """One approved layout for a node: what it would do there."""

    layout: str
    gpus_changed: tuple[int, ...]
    free: Mapping[str, int]  # devices free for pending pods once applied, by kind
    resources: Mapping[str, int] = field(default_factory=dict)  # all its devices, by kind
    evicts: tuple[str, ...] = ()  # running pods that would lose their device
    # PodDisruptionBudget -> how many of the pods it covers ``evicts`` holds
    budgets: Mapping[str, int] = field(default_factory=dict)

    @property
    def cost(self) -> tuple[int, int, int]:
        return (len(self.evicts), len(self.gpus_changed), 1)


STAY_COST = (0, 0, 0)


@dataclass(frozen=True, slots=True)
class Supply:
    """A node advise may change, with its options (the current layout is none of them)."""

    node: str
    layout: str | None
    free: Mapping[str, int]  # free devices now, by kind
    options: tuple[Option, ...]
    resources: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Proposal:
    node: str
    from_layout: str | None
    option: Option
    serves: tuple[str, ...]  # pods (namespace/name)
    resources_before: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Advice:
    proposals: tuple[Proposal, ...]
    unserved: tuple[Want, ...]
    optimal: bool  # proven best (the exact search ran to its end)

    @property
    def served(self) -> int:
        return sum(len(p.serves) for p in self.proposals)

    @property
    def cost(self) -> tuple[int, int, int]:
        return _total(p.option.cost for p in self.proposals)


Choice = dict[str, Option]  # node -> the option taken; absent: stays
Budgets = Mapping[str, int]  # PodDisruptionBudget -> evictions it allows now


def advise(
    wants: Sequence[Want], supplies: Sequence[Supply], budgets: Budgets | None = None
) -> Advice:
    """The best choice of options for ``supplies`` serving ``wants`` within ``budgets`` (see
    the module; a budget not named allows any number)."""
    budgets = budgets or {}
    supplies = sorted(supplies, key=lambda s: s.node)
    useful = _useful_options(wants, supplies)
    choice = _greedy(wants, useful, budgets)
    choice = _trimmed(wants, useful, choice, budgets)
    optimal = False
    if len(useful) <= EXACT_NODES:
        choice, optimal = _exact(wants, useful, choice, budgets)
    return _advice(wants, supplies, choice, optimal)


def _within(options: Iterable[Option], budgets: Budgets) -> bool:
    """Whether ``options`` evict, in sum, no more of any budget's pods than it allows."""
    used: Counter[str] = Counter()
    for o in options:
        used.update(o.budgets)
    return all(n <= budgets.get(b, n) for b, n in used.items())


def _total(costs: Iterable[tuple[int, int, int]]) -> tuple[int, int, int]:
    e = g = n = 0
    for c in costs:
        e, g, n = e + c[0], g + c[1], n + c[2]
    return (e, g, n)


def _useful_options(wants: Sequence[Want], supplies: Sequence[Supply]) -> dict[str, list[Option]]:
    """Per node, the options that offer some pod that may use the node a device kind it asks
    for, less those another option of the node beats (at least as much of every such kind, at
    no more cost). Nodes without any are left out."""
    kinds: dict[str, set[str]] = defaultdict(set)
    names = {s.node for s in supplies}
    asked: dict[frozenset[str], set[str]] = defaultdict(set)
    for w in wants:
        asked[w.nodes].add(w.kind)
    for nodes, asked_kinds in asked.items():
        for n in nodes & names:
            kinds[n] |= asked_kinds
    out: dict[str, list[Option]] = {}
    for s in supplies:
        wanted = sorted(kinds.get(s.node, ()))
        ranked = sorted(
            (o for o in s.options if any(o.free.get(k, 0) > s.free.get(k, 0) for k in wanted)),
            key=lambda o: (o.cost, o.layout),
        )
        kept: list[Option] = []
        for o in ranked:
            if not any(
                all(b.free.get(k, 0) >= o.free.get(k, 0) for k in wanted)
                and all(n <= o.budgets.get(d, 0) for d, n in b.budgets.items())
                for b in kept
            ):  # ``kept`` are no dearer (ranked by cost), and draw on no budget more
                kept.append(o)
        if kept:
            out[s.node] = kept
    return out


def _capacity(choice: Choice, useful: Mapping[str, list[Option]]) -> dict[str, Mapping[str, int]]:
    # a node that stays serves no pending pod: each asks more than any node it may use has free
    return {n: o.free for n, o in choice.items() if n in useful}


def _value(wants: Sequence[Want], choice: Choice) -> tuple[int, tuple[int, int, int]]:
    served = len(assign(wants, {n: o.free for n, o in choice.items()}))
    return served, _total(o.cost for o in choice.values())


def _better(a: tuple[int, tuple[int, int, int]], b: tuple[int, tuple[int, int, int]]) -> bool:
    return a[0] > b[0] or (a[0] == b[0] and a[1] < b[1])


def _greedy(wants: Sequence[Want], useful: Mapping[str, list[Option]], budgets: Budgets) -> Choice:
    """Options taken one node at a time, the one placing the most pods first, each within
    what the budgets still allow. Pods alike (kind, devices, nodes they may use) are counted
    together."""
    left: Counter[tuple[str, int, frozenset[str]]] = Counter(
        (w.kind, w.count, w.nodes) for w in wants
    )
    at: dict[str, list[tuple[str, int, frozenset[str]]]] = defaultdict(list)
    for key in sorted(left, key=lambda k: (len(k[2]), -k[1], k[0], sorted(k[2]))):
        for n in key[2]:
            if n in useful:
                at[n].append(key)  # the most constrained first

    def rate(node: str, o: Option) -> tuple[int, Counter[tuple[str, int, frozenset[str]]]]:
        free = Counter(o.free)
        took: Counter[tuple[str, int, frozenset[str]]] = Counter()
        for key in at[node]:
            kind, count, _ = key
            n = min(left[key], free[kind] // count)
            if n > 0:
                free[kind] -= n * count
                took[key] = n
        return took.total(), took

    heap = [
        (-rate(n, o)[0], o.cost, n, i, o.layout)
        for n, opts in useful.items()
        for i, o in enumerate(opts)
    ]
    heapq.heapify(heap)
    choice: Choice = {}
    while heap:
        neg, cost, node, i, layout = heapq.heappop(heap)
        if node in choice or neg == 0:
            continue
        if not _within((*choice.values(), useful[node][i]), budgets):
            continue
        now, took = rate(node, useful[node][i])
        if now == 0:
            continue
        if -now != neg:  # others took its pods since it was rated
            heapq.heappush(heap, (-now, cost, node, i, layout))
            continue
        choice[node] = useful[node][i]
        left -= took
    return choice


def _trimmed(
    wants: Sequence[Want], useful: Mapping[str, list[Option]], choice: Choice, budgets: Budgets
) -> Choice:
    """``choice`` without proposals that serve nobody, each node at its cheapest option that
    holds the pods placed on it; on pools of up to TRIM_NODES proposals, each also at the
    cheapest option of its node (staying first) that serves no fewer pods overall."""
    choice = _cheapest_holding(wants, useful, choice, budgets)
    if len(choice) > TRIM_NODES:
        return choice
    best = _value(wants, choice)
    for node in sorted(choice, key=lambda n: (tuple(-c for c in choice[n].cost), n)):
        for o in [None, *useful[node]]:
            if o is choice[node]:
                break
            trial = dict(choice)
            if o is None:
                del trial[node]
            else:
                trial[node] = o
            if not _within(trial.values(), budgets):
                continue
            value = _value(wants, trial)
            if _better(value, best):
                choice, best = trial, value
                break
    return _cheapest_holding(wants, useful, choice, budgets)


def _cheapest_holding(
    wants: Sequence[Want], useful: Mapping[str, list[Option]], choice: Choice, budgets: Budgets
) -> Choice:
    """``choice`` without nodes that serve nobody, each node in turn at its cheapest option
    that holds its pods and keeps the choice within the budgets (its own one does)."""
    served = assign(wants, {n: o.free for n, o in choice.items()})
    need: dict[str, Counter[str]] = defaultdict(Counter)
    by_pod = {w.pod: w for w in wants}
    for pod, node in served.items():
        need[node][by_pod[pod].kind] += by_pod[pod].count
    out = {n: o for n, o in choice.items() if n in need}
    for n in sorted(out):
        out[n] = next(
            o
            for o in useful[n]
            if all(o.free.get(k, 0) >= c for k, c in need[n].items())
            and _within({**out, n: o}.values(), budgets)
        )
    return out


def _exact(
    wants: Sequence[Want], useful: Mapping[str, list[Option]], seed: Choice, budgets: Budgets
) -> tuple[Choice, bool]:
    """Branch and bound over the nodes, options beyond the budgets left out; (the best choice,
    whether the search ran to its end)."""
    nodes = sorted(useful)
    most = {
        n: {k: max(o.free.get(k, 0) for o in useful[n]) for o in useful[n] for k in o.free}
        for n in nodes
    }
    demand = relaxed(wants)
    unit = not any(w.branches for w in wants)
    proven = True  # every placement of pods of several devices it scored was proven the most

    def value(choice: Choice) -> tuple[int, tuple[int, int, int]]:
        nonlocal proven
        capacity = {n: o.free for n, o in choice.items()}
        if unit:
            served = served_upper_bound(demand, capacity)
        else:
            placed, exact = assign_proven(wants, capacity)
            served, proven = len(placed), proven and exact
        return served, _total(o.cost for o in choice.values())

    best_choice, best = dict(seed), value(seed)
    budget = [EXACT_BUDGET[0] if len(nodes) <= 8 else EXACT_BUDGET[1]]

    def go(depth: int, choice: Choice, cost: tuple[int, int, int]) -> None:
        nonlocal best_choice, best
        if budget[0] <= 0:
            return
        budget[0] -= 1
        if depth == len(nodes):
            leaf = value(choice)
            if _better(leaf, best):
                best_choice, best = dict(choice), leaf
            return
        cap: dict[str, Mapping[str, int]] = {n: o.free for n, o in choice.items()}
        cap.update({n: most[n] for n in nodes[depth:]})
        upper = served_upper_bound(demand, cap)
        if upper < best[0] or (upper == best[0] and cost >= best[1]):
            return
        node = nodes[depth]
        for o in useful[node]:
            choice[node] = o
            if not o.budgets or _within(choice.values(), budgets):
                go(depth + 1, choice, _total((cost, o.cost)))
            del choice[node]
        go(depth + 1, choice, cost)

    go(0, {}, STAY_COST)
    return best_choice, budget[0] > 0 and proven


def _advice(
    wants: Sequence[Want], supplies: Sequence[Supply], choice: Choice, optimal: bool
) -> Advice:
    served = assign(wants, {n: o.free for n, o in choice.items()})
    serves: dict[str, list[str]] = defaultdict(list)
    for pod, node in served.items():
        serves[node].append(pod)
    proposals = tuple(
        Proposal(s.node, s.layout, choice[s.node], tuple(sorted(serves[s.node])), s.resources)
        for s in supplies
        if s.node in choice and serves[s.node]
    )
    unserved = tuple(w for w in sorted(wants, key=lambda w: w.pod) if w.pod not in served)
    return Advice(proposals, unserved, optimal)
