"""advise benchmarks: what layouts from demand buy on a pool under a changing load, and how long
the search takes on a large pool.

* pool: 20 nodes of 8xH100-80GB, started at mixed layouts (all-1g.10gb, all-2g.20gb,
  all-3g.40gb, all-7g.80gb in turn), approved layouts the packaged all-* and h100-80gb-* ones;
  a seeded stream of pods (1g.10gb 45%, 2g.20gb 25%, 3g.40gb 20%, 7g.80gb 10%) arriving and
  finishing, the load shifting from small to large profiles over the run; one step a minute,
  each Pending pod placed first-fit, oldest first. Compared: the layouts left as they are;
  advise (no eviction) applied every few minutes, a relabelled node taking no pod for two
  minutes, once knowing running pods by kind only and once knowing which device each holds
  (each pod given the first free device of its kind in GPU order, as the agents publish it);
  and the best fixed assignment of approved layouts to nodes by exhaustive search over every
  multiset of layouts (the nodes are alike; with fixed layouts each profile is its own
  queue, so each multiset is scored exactly; a layout offering no more of any profile asked
  than another is left out, as it can never do better). Figures: pending pod-minutes,
  device-minutes idle while some pod waits, pods evicted, relabels (GPUs changed).
* large pool: 1,000 nodes of 8xH100-80GB at mixed layouts, half their devices held by running
  pods, 10,000 pending pods (a tenth pinned to one node by nodeSelector): time to build every
  node's options and to search; once with pods of one device, once mixed (a fifth asking two
  devices, a tenth in gangs of four).
* greedy against exact: seeded pools small enough for the exact search (4 to 12 nodes of
  8xH100-80GB, mixed demand as above): pods served and disruption of the greedy answer (what
  larger pools get) against the exact one, and the time per decision of each.

* by seed (``--seeds 1,2,7``): the pool's every-5-min rows, by kind and each pod's device known,
  for each seed of the pod stream, and their sums.

Run: python benchmarks/advise_bench.py [--quick] [--seeds 1,2,7]   (prints tables; no cluster
needed)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mig_agent.config.profiles import load_catalog  # noqa: E402
from mig_agent.core import advise as search  # noqa: E402
from mig_agent.core.advertised import plugin_devices  # noqa: E402
from mig_agent.core.advise import Supply, advise  # noqa: E402
from mig_agent.core.advise_assign import Want  # noqa: E402
from mig_agent.core.advise_options import Holder, Memo, node_supply, resources  # noqa: E402
from mig_agent.core.device_listing import published_devices  # noqa: E402
from mig_agent.core.gpu_models import MODELS  # noqa: E402
from mig_agent.core.layout import Layout  # noqa: E402
from mig_agent.core.planner import plan  # noqa: E402
from mig_agent.node.apply import execute  # noqa: E402
from tests.unit.fake_gpus import FakeGpus  # noqa: E402

H100 = MODELS["H100-80GB"]
CATALOG = load_catalog([Path(__file__).resolve().parents[1] / "profiles"])
PROFILES = {"1g.10gb": 0.45, "2g.20gb": 0.25, "3g.40gb": 0.2, "7g.80gb": 0.1}
START = ("all-1g.10gb", "all-2g.20gb", "all-3g.40gb", "all-7g.80gb")
GANG_DRAW = 0.1 / 3.7  # a gang of four this often of the draws: a tenth of the pods in gangs


def approved() -> list[Layout]:
    """The packaged layouts that partition an H100 (all-* and h100-80gb-*)."""
    out = []
    for layout in CATALOG.layouts.values():
        if layout.name.startswith(("all-", "h100-80gb-")) and layout.name != "all-disabled":
            gpus = FakeGpus([H100] * 8)
            try:
                the_plan = plan(layout, gpus.observe(), gpus.models())
            except Exception:  # noqa: BLE001 -- not for this model
                continue
            if the_plan.gpus and all(g.desired.mig_enabled and g.devices for g in the_plan.gpus):
                out.append(layout)
    return sorted(out, key=lambda la: la.name)


@dataclass
class Pod:
    name: str
    kind: str
    arrive: int
    duration: int
    node: str = ""
    start: int = -1


def stream(seed: int, minutes: int, per_min: float) -> list[Pod]:
    """Pods arriving at ``per_min`` a minute; the mix moves towards large profiles."""
    rng = random.Random(seed)
    pods: list[Pod] = []
    names = list(PROFILES)
    for t in range(minutes):
        shift = t / minutes  # 0 -> 1: small profiles give way to large ones
        weights = [
            PROFILES[n] * (1.6 - 1.2 * shift if i < 2 else 0.4 + 1.2 * shift)
            for i, n in enumerate(names)
        ]
        for _ in range(_poisson(rng, per_min)):
            kind = "nvidia.com/mig-" + rng.choices(names, weights)[0]
            pods.append(Pod(f"bench/p{len(pods)}", kind, t, max(1, int(rng.expovariate(1 / 40)))))
    return pods


def _poisson(rng: random.Random, mean: float) -> int:
    n, p, limit = 0, 1.0, pow(2.718281828, -mean)
    while True:
        p *= rng.random()
        if p <= limit:
            return n
        n += 1


@dataclass
class Node:
    name: str
    layout: str
    gpus: FakeGpus
    capacity: Counter[str] = field(default_factory=Counter)
    running: Counter[str] = field(default_factory=Counter)
    holders: dict[str, str] = field(default_factory=dict)  # pod -> kind
    devices: dict[str, str] = field(default_factory=dict)  # pod -> the device UUID it was given
    busy_until: int = 0

    def give(self, pod: str, kind: str) -> None:
        """``pod`` started here: the first free device of its kind, in GPU order, is its own."""
        taken = set(self.devices.values())
        self.devices[pod] = next(u for k, u in self.uuids() if k == kind and u not in taken)
        self.running[kind] += 1
        self.holders[pod] = kind

    def take_back(self, pod: str) -> None:
        self.running[self.holders.pop(pod)] -= 1
        del self.devices[pod]

    def uuids(self) -> list[tuple[str, str]]:
        """(resource, UUID) of every MIG device, in GPU order."""
        published = published_devices(self.gpus.observe(), self.gpus.models())
        return [(f"nvidia.com/mig-{d.profile}", u) for u, d in published.items() if d.profile]

    def set_layout(self, layout: Layout) -> int:
        the_plan = plan(layout, self.gpus.observe(), self.gpus.models(), destroy_in_use=True)
        execute(the_plan, self.gpus)
        present = {u for _, u in self.uuids()}
        # advise ran without --allow-evict: every running pod's device outlives its proposal
        assert set(self.devices.values()) <= present, "a relabel destroyed a pod's device"
        self.layout = layout.name
        devices = plugin_devices(self.gpus.observe(), self.gpus.models())
        self.capacity = Counter(resources(devices, "mixed"))
        return len(the_plan.changed_gpus)


@dataclass
class Figures:
    pending_pod_min: int = 0
    idle_dev_min: int = 0
    evicted: int = 0
    relabels: int = 0
    gpus_changed: int = 0
    advise_max_s: float = 0.0


def simulate(
    pods: Sequence[Pod], minutes: int, nodes_n: int, every: int | None, *, known: bool = False
) -> Figures:
    """Layouts as they are (``every`` None) or advise applied every ``every`` minutes; with
    ``known``, advise knows which device each running pod holds (the holders the agents
    publish), else only their kinds."""
    layouts = {la.name: la for la in approved()}
    nodes = [Node(f"gpu-{i:02}", "", FakeGpus([H100] * 8)) for i in range(nodes_n)]
    for i, n in enumerate(nodes):
        n.set_layout(layouts[START[i % len(START)]])
    fig = Figures()
    todo = sorted((Pod(p.name, p.kind, p.arrive, p.duration) for p in pods), key=lambda p: p.arrive)
    pending: list[Pod] = []
    running: list[Pod] = []
    by_name = {n.name: n for n in nodes}
    for t in range(minutes):
        for p in [p for p in running if p.start + p.duration <= t]:
            running.remove(p)
            by_name[p.node].take_back(p.name)
        while todo and todo[0].arrive <= t:
            pending.append(todo.pop(0))
        if every and t % every == 0 and pending:
            wants = [Want(p.name, p.kind, 1, frozenset(by_name)) for p in pending]
            advise_and_apply(nodes, layouts, wants, t, fig, known=known)
        for p in list(pending):
            for n in nodes:
                if n.busy_until <= t and n.capacity[p.kind] > n.running[p.kind]:
                    p.node, p.start = n.name, t
                    n.give(p.name, p.kind)
                    pending.remove(p)
                    running.append(p)
                    break
        fig.pending_pod_min += len(pending)
        if pending:
            fig.idle_dev_min += sum(
                (n.capacity - n.running).total() for n in nodes if n.busy_until <= t
            )
    return fig


def node_supplies(
    nodes: Sequence[Node],
    layouts: dict[str, Layout],
    t: int,
    memo: Memo | None = None,
    *,
    known: bool = False,
) -> list[Supply]:
    """What advise reads of the nodes not changing at minute ``t``: their options, every one
    (those that evict too), their running pods holding devices (by UUID too with ``known``)."""
    return [
        node_supply(
            n.name,
            n.layout,
            layouts.values(),
            n.gpus.observe(),
            n.gpus.models(),
            strategy="mixed",
            holders=[
                Holder(pod, {kind: 1}, frozenset({n.devices[pod]}) if known else frozenset())
                for pod, kind in sorted(n.holders.items())
            ],
            memo=memo,
        )
        for n in nodes
        if n.busy_until <= t
    ]


def advise_and_apply(
    nodes: Sequence[Node],
    layouts: dict[str, Layout],
    wants: Sequence[Want],
    t: int,
    fig: Figures,
    memo: Memo | None = None,
    *,
    known: bool = False,
) -> None:
    """advise without --allow-evict for ``wants`` at minute ``t``, its relabels applied."""
    t0 = time.perf_counter()
    supplies = [_no_eviction(s) for s in node_supplies(nodes, layouts, t, memo, known=known)]
    advice = advise(wants, supplies)
    fig.advise_max_s = max(fig.advise_max_s, time.perf_counter() - t0)
    assert not any(p.option.evicts for p in advice.proposals)  # no --allow-evict: nobody
    relabel(nodes, layouts, {p.node: p.option.layout for p in advice.proposals}, t, fig)


def relabel(
    nodes: Sequence[Node], layouts: dict[str, Layout], to: dict[str, str], t: int, fig: Figures
) -> None:
    """Each node of ``to`` relabelled to its layout at minute ``t``: it takes no pod for two
    minutes (the agent's pass)."""
    for node in nodes:
        if node.name in to:
            fig.gpus_changed += node.set_layout(layouts[to[node.name]])
            fig.relabels += 1
            node.busy_until = t + 2


def _no_eviction(supply: Supply) -> Supply:
    """As advise runs without --allow-evict: only the options that evict nobody."""
    return dataclasses.replace(supply, options=tuple(o for o in supply.options if not o.evicts))


def best_fixed(pods: Sequence[Pod], minutes: int, nodes_n: int) -> tuple[Figures, str]:
    """The best fixed assignment of approved layouts to the (alike) nodes, by exhaustive search
    over every multiset of layouts: with fixed layouts each profile queues for its own devices,
    so a multiset's pending pod-minutes are the sum of one queue per profile."""
    by_kind: dict[str, list[Pod]] = {}
    for p in pods:
        by_kind.setdefault(p.kind, []).append(p)

    @cache
    def wait(kind: str, servers: int) -> int:
        """Pending pod-minutes of one profile's FIFO queue."""
        queue = sorted(by_kind.get(kind, []), key=lambda p: p.arrive)
        ends: list[int] = []
        pending_min = 0
        waiting: list[Pod] = []
        i = 0
        for t in range(minutes):
            ends = [e for e in ends if e > t]
            while i < len(queue) and queue[i].arrive <= t:
                waiting.append(queue[i])
                i += 1
            while waiting and len(ends) < servers:
                ends.append(t + waiting.pop(0).duration)
            pending_min += len(waiting)
        return pending_min

    score, mix = best_multiset(sorted(by_kind), nodes_n, wait)
    return Figures(pending_pod_min=score), mix


def offers(kinds: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """What a node offers of ``kinds`` at each approved layout, by layout name."""
    out: dict[str, tuple[int, ...]] = {}
    for la in approved():
        n = Node("x", "", FakeGpus([H100] * 8))
        n.set_layout(la)
        out[la.name] = tuple(n.capacity[k] for k in kinds)
    return out


def best_multiset(
    kinds: Sequence[str],
    nodes_n: int,
    pending: Callable[[str, int], int],
    also: Sequence[Sequence[str]] = (),
) -> tuple[int, str]:
    """The least pending pod-minutes over every multiset of ``nodes_n`` approved layouts (and
    the multisets of layout names ``also``), ``pending(kind, devices)`` scoring each profile's
    queue; and which layouts it took, in words."""
    named = offers(kinds)
    by_offer: dict[tuple[int, ...], str] = {}  # the first layout offering each
    for name, v in named.items():
        by_offer.setdefault(v, name)
    # pending pod-minutes only fall as devices are added: a layout offering no more of any
    # kind than another is never the better choice
    useful = [
        v
        for v in by_offer
        if not any(w != v and all(a >= b for a, b in zip(w, v, strict=True)) for w in by_offer)
    ]
    combos = itertools.chain(
        itertools.combinations_with_replacement(useful, nodes_n),
        ([named[name] for name in combo] for combo in also),
    )
    best: tuple[int, Sequence[tuple[int, ...]]] | None = None
    for combo in combos:
        total = [sum(v[i] for v in combo) for i in range(len(kinds))]
        score = sum(pending(k, total[i]) for i, k in enumerate(kinds))
        if best is None or score < best[0]:
            best = (score, combo)
    assert best is not None
    names = Counter(by_offer[v] for v in best[1])
    mix = ", ".join(f"{c}x{n}" for n, c in sorted(names.items()))
    return best[0], f"{len(useful)} layouts, best {mix}"


def pool_supplies(nodes_n: int, layouts: Sequence[Layout]) -> tuple[list[Supply], float]:
    """The options of ``nodes_n`` nodes at mixed layouts, half their devices held; and the
    seconds it took to build them."""
    states = {}
    for name in START:
        n = Node("x", "", FakeGpus([H100] * 8))
        n.set_layout(CATALOG.get(name))
        states[name] = (n.gpus.observe(), n.gpus.models(), n.capacity)
    t0 = time.perf_counter()
    supplies: list[Supply] = []
    memo: Memo = {}
    for i in range(nodes_n):
        name = f"gpu-{i:04}"
        layout = START[i % len(START)]
        state, models, capacity = states[layout]
        held = [k for k, c in capacity.items() for _ in range(c // 2)]
        holders = [Holder(f"run/{name}-{j}", {k: 1}) for j, k in enumerate(held)]
        supplies.append(
            node_supply(
                name, layout, layouts, state, models, strategy="mixed", holders=holders, memo=memo
            )
        )
    return supplies, time.perf_counter() - t0


def demand(rng: random.Random, names: Sequence[str], pods_n: int, mixed: bool) -> list[Want]:
    """Pending pods, a tenth pinned to one node; ``mixed``: a fifth asking two devices and a
    tenth in gangs of four (pods of one kind each)."""
    every = frozenset(names)
    kinds = ["nvidia.com/mig-" + k for k in PROFILES]
    wants: list[Want] = []
    while len(wants) < pods_n:
        kind = rng.choices(kinds, list(PROFILES.values()))[0]
        nodes = every if rng.random() >= 0.1 else frozenset({rng.choice(names)})
        i = len(wants)
        if mixed and rng.random() < GANG_DRAW:
            wants += [Want(f"bench/g{i}-{j}", kind, 1, every, gang=f"bench/g{i}") for j in range(4)]
            continue
        count = 2 if mixed and rng.random() < 0.2 else 1
        wants.append(Want(f"bench/p{i}", kind, count, nodes))
    return wants[:pods_n]


def large_pool(
    nodes_n: int, pods_n: int, *, mixed: bool = False, seed: int = 1
) -> tuple[float, float, int, int]:
    """(seconds to build the options, seconds to search, pods served, proposals)."""
    supplies, build_s = pool_supplies(nodes_n, approved())
    wants = demand(random.Random(seed), [s.node for s in supplies], pods_n, mixed)
    t0 = time.perf_counter()
    advice = advise(wants, supplies)
    return build_s, time.perf_counter() - t0, advice.served, len(advice.proposals)


@dataclass
class Gap:
    pools: int = 0
    fewer: int = 0  # pools where the greedy answer served fewer pods
    lost: int = 0  # pods the greedy answer served fewer, in all
    served: int = 0  # pods the exact answers served, in all
    dearer: int = 0  # pools served alike where the greedy answer disrupted more
    proven: int = 0  # exact answers proven optimal
    greedy_s: list[float] = field(default_factory=list)
    exact_s: list[float] = field(default_factory=list)


def greedy_gap(pools: int, seed: int = 3) -> Gap:
    """The greedy answer against the exact one on ``pools`` seeded pools where both run."""
    rng = random.Random(seed)
    layouts = approved()
    g = Gap()
    for _ in range(pools):
        nodes_n = rng.randint(4, search.EXACT_NODES)
        supplies, _ = pool_supplies(nodes_n, layouts)
        wants = demand(rng, [s.node for s in supplies], rng.randint(nodes_n, nodes_n * 8), True)
        t0 = time.perf_counter()
        ordered = sorted(supplies, key=lambda s: s.node)
        useful = search._useful_options(wants, ordered)
        choice = search._trimmed(wants, useful, search._greedy(wants, useful, {}), {})
        greedy = search._advice(wants, ordered, choice, False)
        t1 = time.perf_counter()
        exact = advise(wants, supplies)
        t2 = time.perf_counter()
        g.pools += 1
        g.greedy_s.append(t1 - t0)
        g.exact_s.append(t2 - t1)
        g.proven += exact.optimal
        g.served += exact.served
        g.fewer += greedy.served < exact.served
        g.lost += exact.served - greedy.served
        g.dearer += greedy.served == exact.served and greedy.cost > exact.cost
    return g


def _ms(times: Sequence[float]) -> str:
    ordered = sorted(times)
    return f"{ordered[len(ordered) // 2] * 1000:.0f} ms median, {ordered[-1] * 1000:.0f} ms max"


def report_large(nodes_n: int, pods_n: int, pools: int) -> None:
    print(f"\n## Large pool: {nodes_n} nodes, {pods_n} pending pods\n")
    print("| demand | options for every node | search | decision | pods served | proposals |")
    print("|---|---:|---:|---:|---:|---:|")
    for mixed in (False, True):
        build_s, search_s, served, proposals = large_pool(nodes_n, pods_n, mixed=mixed)
        what = "mixed (2 devices, gangs of 4)" if mixed else "one device each"
        print(
            f"| {what} | {build_s:.2f} s | {search_s:.2f} s | {build_s + search_s:.2f} s | "
            f"{served} | {proposals} |"
        )
    g = greedy_gap(pools)
    print(f"\n## Greedy against exact: {g.pools} pools of 4-{search.EXACT_NODES} nodes\n")
    print(
        f"exact proven optimal on {g.proven} of {g.pools}; greedy served fewer on {g.fewer} "
        f"({g.lost} pods of {g.served}, {100 * g.lost / max(g.served, 1):.2f}%), served alike "
        f"but disrupted more on {g.dearer}; per decision: greedy {_ms(g.greedy_s)}, exact "
        f"{_ms(g.exact_s)}"
    )


def seed_table(seeds: Sequence[int], minutes: int, nodes_n: int, per_min: float) -> None:
    """Pending pod-minutes of advise every 5 minutes on the pool, running pods known by kind
    against each one's device known, for each seed of the pod stream: one seed's difference
    between two policies is mostly that seed's."""
    print(f"\n## advise every 5 min on {nodes_n} nodes over {minutes} min, by seed\n")
    print("| seed | pods | pending pod-min, by kind | pending pod-min, each pod's device known |")
    print("|---:|---:|---:|---:|")
    total = Counter[bool]()
    for seed in seeds:
        pods = stream(seed, minutes, per_min)
        row = {
            k: simulate(pods, minutes, nodes_n, 5, known=k).pending_pod_min for k in (False, True)
        }
        total.update(row)
        print(f"| {seed} | {len(pods):,} | {row[False]:,} | {row[True]:,} |")
    print(f"| all | | {total[False]:,} | {total[True]:,} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="CI: a short run, a smaller large pool")
    p.add_argument(
        "--seeds", help="only the pool's every-5-min rows for these seeds of the pod stream: 1,2,7"
    )
    args = p.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    minutes, nodes_n, per_min = (120, 6, 2.0) if args.quick else (480, 20, 8.0)
    if args.seeds:
        seed_table([int(x) for x in args.seeds.split(",")], minutes, nodes_n, per_min)
        return
    pods = stream(7, minutes, per_min)
    print(
        f"\n## advise on a pool: {nodes_n} nodes of 8xH100-80GB, {len(pods)} pods over "
        f"{minutes} min (seed 7)\n"
    )
    print(
        "| policy | pending pod-min | idle device-min while pods wait | evicted | relabels "
        "(GPUs changed) |"
    )
    print("|---|---:|---:|---:|---:|")
    static = simulate(pods, minutes, nodes_n, None)
    print(f"| layouts as they are | {static.pending_pod_min} | {static.idle_dev_min} | 0 | 0 |")
    longest = 0.0
    for every, known in itertools.product((5, 15), (False, True)):
        f = simulate(pods, minutes, nodes_n, every, known=known)
        longest = max(longest, f.advise_max_s)
        how = ", each pod's device known" if known else ""
        print(
            f"| advise + apply every {every} min{how} | {f.pending_pod_min} | {f.idle_dev_min} | "
            f"{f.evicted} | {f.relabels} ({f.gpus_changed}) |"
        )
    best, layout_mix = best_fixed(pods, minutes, nodes_n)
    print(
        f"| best fixed layouts (exhaustive over {layout_mix}) | {best.pending_pod_min} | - | 0 "
        "| - |"
    )
    print(f"\nlongest advise (options + search) in the runs: {longest * 1000:.0f} ms")

    big_nodes, big_pods = (200, 2000) if args.quick else (1000, 10000)
    report_large(big_nodes, big_pods, 20 if args.quick else 200)


if __name__ == "__main__":
    main()
