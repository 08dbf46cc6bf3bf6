"""Which pending pods a pool serves once every node has its devices: the assignment behind
``advise``. Given the free devices per node, it places pods on nodes they may use.

Pods that need one device are placed by a maximum flow per device kind, over nodes grouped by the
pods that may use them. Pods that need several devices of a kind on one node make it bin
packing, and pods of a gang (served all or none) a choice per gang: ``assign_proven`` searches
their places by branch and bound (each such pod on a node it fits or unplaced, a gang's pods
all placed or none, bounded by the flow of what is left), seeded with first fit (largest first,
onto the node with the most free devices of the kind; gangs not placed whole dropped), within
EXACT_STEPS steps; it says whether it proved its answer the most pods. Serving a big pod first
is not always best: two pods of one device may fit where one of two does.

Pure module: no I/O.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Want:
    """A pending pod: ``count`` devices of ``kind`` on one of ``nodes``.

    ``kind`` is an extended resource (``nvidia.com/mig-3g.40gb``, ``nvidia.com/gpu``) or a DRA
    device kind (``dra:3g.40gb``, ``dra:gpu``). ``constraint`` says which of the pod's
    scheduling constraints narrowed ``nodes`` ("" when none did), for the reason it is unserved.
    Pods of one ``gang`` ("": none) are served all or none.
    """

    pod: str  # namespace/name
    kind: str
    count: int
    nodes: frozenset[str]
    constraint: str = ""
    gang: str = ""

    @property
    def branches(self) -> bool:
        """Placed by the search, not the flow: several devices, or one of a gang."""
        return self.count > 1 or bool(self.gang)


Capacity = Mapping[str, Mapping[str, int]]  # node -> kind -> free devices

# steps of the search placing pods of several devices (each a bound evaluated): milliseconds
EXACT_STEPS = 5_000


def assign(wants: Sequence[Want], capacity: Capacity) -> dict[str, str]:
    """pod -> node for the pods served: within ``capacity`` and each pod's ``nodes``."""
    return assign_proven(wants, capacity)[0]


def assign_proven(
    wants: Sequence[Want], capacity: Capacity, steps: int = EXACT_STEPS
) -> tuple[dict[str, str], bool]:
    """``assign``'s answer, and whether it is proven to serve the most pods."""
    capacity = _wanted(wants, capacity)
    seed = _first_fit(wants, capacity)
    big, gang_end = _searched(wants)
    if not big:
        return seed, True
    demand = relaxed([w for w in wants if not w.branches])
    best: int = len(seed)
    best_big: dict[str, str] | None = None
    left = steps
    nodes = [sorted(w.nodes) for w in big]
    free = {n: Counter(c) for n, c in capacity.items()}
    placed: dict[str, str] = {}

    def go(i: int) -> Iterator[int]:
        """The search from the ``i``-th big pod on, ``free`` and ``placed`` as the pods before
        it left them: yields each next ``i`` to search from, its state set."""
        nonlocal best, best_big, left
        if left <= 0:
            return
        left -= 1
        units = served_upper_bound(demand, free)
        if len(placed) + len(big) - i + units <= best:
            return
        if i == len(big):
            best, best_big = len(placed) + units, dict(placed)
            return
        w = big[i]
        first = 0
        if _twins(big, i, gang_end):  # alike pods of a gang: places in node order only
            first = nodes[i].index(placed[big[i - 1].pod])
        for n in nodes[i][first:]:
            if n in free and free[n][w.kind] >= w.count:
                free[n][w.kind] -= w.count
                placed[w.pod] = n
                yield i + 1
                del placed[w.pod]
                free[n][w.kind] += w.count
        if not w.gang:
            yield i + 1
        elif i in gang_end:  # its first pod: the gang left out
            yield gang_end[i]

    # depth first with a stack, not recursion: the search goes one level deeper per big pod,
    # and a pool's pending pods outnumber Python's recursion limit
    stack = [go(0)]
    while stack:
        deeper = next(stack[-1], None)
        if deeper is None:
            stack.pop()
        else:
            stack.append(go(deeper))
    if best_big is None:
        return seed, left > 0
    return _placed_then_units(wants, capacity, best_big), left > 0


def _wanted(wants: Sequence[Want], capacity: Capacity) -> dict[str, dict[str, int]]:
    """``capacity`` cut to what ``wants`` may use: the nodes some pod may go to that have a
    free device of a kind asked, each with the kinds asked only (in ``capacity``'s order, so
    the placements are those of the whole). A check decides one workload at a time over a
    pool of thousands of nodes: copying every node's free devices cost most of its time."""
    kinds = {w.kind for w in wants}
    allowed = frozenset().union(*(w.nodes for w in wants))
    out: dict[str, dict[str, int]] = {}
    if len(kinds) == 1:  # most workloads: one kind, no inner loop
        (kind,) = kinds
        for node, free in capacity.items():
            if node in allowed and (n := free.get(kind, 0)) > 0:
                out[node] = {kind: n}
        return out
    for node, free in capacity.items():
        if node in allowed:
            mine = {k: n for k in kinds if (n := free.get(k, 0)) > 0}
            if mine:
                out[node] = mine
    return out


def _searched(wants: Sequence[Want]) -> tuple[list[Want], dict[int, int]]:
    """The pods the search places, largest first, a gang's together; and, for the first pod of
    each gang, where the pods after its gang begin."""
    blocks: dict[str, list[Want]] = defaultdict(list)
    for w in wants:
        if w.branches:
            blocks[w.gang or "\0" + w.pod].append(w)
    ordered = sorted(
        (sorted(b, key=lambda w: (-w.count, len(w.nodes), w.pod)) for b in blocks.values()),
        key=lambda b: (-b[0].count, -len(b), len(b[0].nodes), b[0].pod),
    )
    big: list[Want] = []
    gang_end: dict[int, int] = {}
    for block in ordered:
        if block[0].gang:
            gang_end[len(big)] = len(big) + len(block)
        big += block
    return big, gang_end


def _twins(big: Sequence[Want], i: int, gang_end: Mapping[int, int]) -> bool:
    if i == 0 or i in gang_end or not big[i].gang:
        return False
    a, b = big[i - 1], big[i]
    return (a.gang, a.kind, a.count, a.nodes) == (b.gang, b.kind, b.count, b.nodes)


def _whole_gangs(wants: Sequence[Want], placed: dict[str, str]) -> dict[str, str]:
    """``placed`` without the pods of gangs it does not place whole."""
    broken = {w.gang for w in wants if w.gang and w.pod not in placed}
    if not broken:
        return placed
    dropped = {w.pod for w in wants if w.gang in broken}
    return {p: n for p, n in placed.items() if p not in dropped}


def _placed_then_units(
    wants: Sequence[Want], capacity: Capacity, placed: Mapping[str, str]
) -> dict[str, str]:
    """The big pods where ``placed`` puts them, the pods of one device by flow in what is left."""
    free = {n: Counter(c) for n, c in capacity.items()}
    by_pod = {w.pod: w for w in wants}
    for pod, node in placed.items():
        free[node][by_pod[pod].kind] -= by_pod[pod].count
    return {**placed, **_units([w for w in wants if not w.branches], free)}


def _units(wants: Sequence[Want], free: Mapping[str, Counter[str]]) -> dict[str, str]:
    """The pods of one device among ``wants`` by flow, kind by kind."""
    by_kind: dict[str, list[Want]] = defaultdict(list)
    for w in wants:
        if w.count == 1:
            by_kind[w.kind].append(w)
    out: dict[str, str] = {}
    for kind in sorted(by_kind):
        out.update(_unit_flow(by_kind[kind], {n: c[kind] for n, c in free.items() if c[kind]}))
    return out


def _first_fit(wants: Sequence[Want], capacity: Capacity) -> dict[str, str]:
    """The big pods first, largest first, each on the fullest node; then the rest by flow;
    then the gangs it did not place whole taken out."""
    free = {n: Counter(c) for n, c in capacity.items()}
    out: dict[str, str] = {}
    big: dict[tuple[str, int, frozenset[str]], list[str]] = defaultdict(list)
    for w in wants:
        if w.count > 1:
            big[(w.kind, w.count, w.nodes)].append(w.pod)
    for (kind, count, nodes), pods in sorted(
        big.items(), key=lambda kv: (-kv[0][1], len(kv[0][2]), kv[0][0], sorted(kv[1]))
    ):
        # the fullest node first, the first by name among equals
        heap = [(-free[n][kind], n) for n in nodes if n in free and free[n][kind] >= count]
        heapq.heapify(heap)
        for pod in sorted(pods):
            if not heap:
                break
            _, node = heapq.heappop(heap)
            free[node][kind] -= count
            out[pod] = node
            if free[node][kind] >= count:
                heapq.heappush(heap, (-free[node][kind], node))
    out.update(_units(wants, free))
    return _whole_gangs(wants, out)


Demand = dict[str, list[tuple[frozenset[str], int]]]  # kind -> (nodes, pods), one device each


def relaxed(wants: Sequence[Want]) -> Demand:
    """The pods by kind and nodes, each as if it asked one device: whatever serves a pod of
    several devices serves it with one, so this demand serves at least as many."""
    counts: Counter[tuple[str, frozenset[str]]] = Counter((w.kind, w.nodes) for w in wants)
    out: Demand = defaultdict(list)
    for (kind, nodes), n in counts.items():
        out[kind].append((nodes, n))
    return out


def served_upper_bound(demand: Demand, capacity: Capacity) -> int:
    """The pods ``demand`` (see ``relaxed``) can have served with ``capacity``: a maximum flow
    per kind. Exact when every pod asks one device."""
    total = 0
    for kind, classes in demand.items():
        free = {n: c.get(kind, 0) for n, c in capacity.items() if c.get(kind, 0)}
        keys = [nodes for nodes, _ in classes]
        groups = _groups(keys, free)
        sized = [(g, sum(free[n] for n in nodes)) for g, nodes in groups.items()]
        total += sum(_max_flow([n for _, n in classes], sized).values())
    return total


def _classes(wants: Sequence[Want]) -> dict[frozenset[str], list[Want]]:
    out: dict[frozenset[str], list[Want]] = defaultdict(list)
    for w in wants:
        out[w.nodes].append(w)
    return out


def _groups(
    classes: Sequence[frozenset[str]], free: Mapping[str, int]
) -> dict[tuple[int, ...], list[str]]:
    """Nodes with free devices, grouped by which pod classes may use them: interchangeable."""
    member: dict[str, list[int]] = defaultdict(list)
    for i, nodes in enumerate(classes):
        small, large = (nodes, free) if len(nodes) < len(free) else (free, nodes)
        for n in small:
            if n in large:
                member[n].append(i)
    groups: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for n in sorted(member):
        groups[tuple(member[n])].append(n)
    return groups


def _max_flow(
    demand: Sequence[int], groups: Sequence[tuple[tuple[int, ...], int]]
) -> dict[tuple[int, int], int]:
    """Flow (class, group) -> pods: classes with ``demand`` pods, groups with (classes that
    may use them, free devices). Augmenting paths, each pushing its bottleneck."""
    flow: dict[tuple[int, int], int] = defaultdict(int)
    left = list(demand)  # pods of each class not yet placed
    room = [cap for _, cap in groups]
    users: dict[int, list[int]] = defaultdict(list)
    for g, (classes, _) in enumerate(groups):
        for c in classes:
            users[c].append(g)
    # first the direct pushes, the most constrained classes first; paths then correct them
    for c in sorted(users, key=lambda c: (len(users[c]), c)):
        for g in users[c]:
            push = min(left[c], room[g])
            if push > 0:
                flow[(c, g)] += push
                left[c] -= push
                room[g] -= push
    while True:
        path = _augmenting_path(left, room, users, flow)
        if path is None:
            return flow
        # path: c0 g0 c1 g1 ... ck gk; c_i -> g_i gains flow, c_i+1 -> g_i gives it back
        back = [flow[(path[i + 1], path[i])] for i in range(1, len(path) - 1, 2)]
        push = min(left[path[0]], room[path[-1]], *back)
        for i in range(0, len(path), 2):
            flow[(path[i], path[i + 1])] += push
            if i + 2 < len(path):
                flow[(path[i + 2], path[i + 1])] -= push
        left[path[0]] -= push
        room[path[-1]] -= push


def _augmenting_path(
    left: Sequence[int],
    room: Sequence[int],
    users: Mapping[int, Sequence[int]],
    flow: Mapping[tuple[int, int], int],
) -> list[int] | None:
    """class, group, class, group, ... from a class with pods left to a group with room, by
    breadth-first search; None when there is none."""
    starts = [c for c, n in enumerate(left) if n > 0]
    parent: dict[tuple[str, int], tuple[str, int] | None] = {("c", c): None for c in starts}
    queue = [("c", c) for c in starts]
    on_group: dict[int, list[int]] = defaultdict(list)  # group -> classes with flow into it
    for (c, g), f in flow.items():
        if f > 0:
            on_group[g].append(c)
    for side, i in queue:
        if side == "c":
            for g in users.get(i, ()):
                if ("g", g) not in parent:
                    parent[("g", g)] = (side, i)
                    if room[g] > 0:
                        return _unwind(parent, ("g", g))
                    queue.append(("g", g))
        else:
            for c in on_group[i]:
                if ("c", c) not in parent:
                    parent[("c", c)] = (side, i)
                    queue.append(("c", c))
    return None


def _unwind(
    parent: Mapping[tuple[str, int], tuple[str, int] | None], end: tuple[str, int]
) -> list[int]:
    path: list[int] = []
    at: tuple[str, int] | None = end
    while at is not None:
        path.append(at[1])
        at = parent[at]
    return path[::-1]


def _unit_flow(wants: Sequence[Want], free: Mapping[str, int]) -> dict[str, str]:
    """pod -> node for pods of one device each of one kind: a maximum flow."""
    classes = _classes(wants)
    keys = list(classes)
    groups = list(_groups(keys, free).items())
    flow = _max_flow(
        [len(classes[k]) for k in keys], [(g, sum(free[n] for n in ns)) for g, ns in groups]
    )
    out: dict[str, str] = {}
    room = {n: free[n] for _, ns in groups for n in ns}
    for (c, g), pods in sorted(flow.items()):
        todo = sorted(w.pod for w in classes[keys[c]] if w.pod not in out)[:pods]
        nodes = iter(groups[g][1])
        node = next(nodes)
        for pod in todo:
            while room[node] == 0:
                node = next(nodes)
            room[node] -= 1
            out[pod] = node
    return out
