"""We test these aspects of the MIG layout AdmissionCheck's decisions
(mig_agent.core.admission_check), on supplies built by hand (one H100 per node: all-1g.10gb
makes seven 1g.10gb devices, all-3g two 3g.40gb):

* a workload whose pods fit the free devices now is Ready, placed where they fit;
* one that needs a relabel gets the least-disruptive one serving all its pods (a gang: one
  node of two 3g.40gb, not two nodes), no option that evicts unless the check allows it;
* while its nodes change it waits, and a ``success`` left from before (the old devices still
  published) is not taken for done; once done, Ready; a failed relabel is Retry;
* two workloads never get the same devices or nodes: the second waits, saying why;
* ``max_nodes`` caps the nodes changing at once; a workload no approved layout serves waits
  (or is Rejected where the check says so) with a message naming what it asks;
* property (hypothesis): over random pools and queues, the Ready workloads' pods are placed
  within each node's free devices, summed over workloads, and no node is relabelled for two
  workloads nor relabelled where another workload was promised devices; one workload is
  served (Ready or relabelled) exactly when a brute force over every node's layouts finds a
  choice that places all its pods.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping

from hypothesis import given, settings
from hypothesis import strategies as st

from mig_agent.core.admission_check import Params, Target, Verdict, Waiting, decide
from mig_agent.core.advise import Option, Supply
from mig_agent.core.advise_assign import Want, assign

MIG_1G, MIG_3G = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"
ALL_1G = {MIG_1G: 7}
ALL_3G = {MIG_3G: 2}


def _node(name: str, layout: str = "all-1g.10gb", *, evicts: tuple[str, ...] = ()) -> Supply:
    """One H100 at ``layout``; ``evicts``: the pods holding its devices (all would be lost)."""
    now = ALL_1G if layout == "all-1g.10gb" else ALL_3G
    held = len(evicts) if layout == "all-1g.10gb" else 0
    free = {k: n - held for k, n in now.items()}
    other = ("all-3g", ALL_3G) if layout == "all-1g.10gb" else ("all-1g.10gb", ALL_1G)
    option = Option(other[0], (0,), dict(other[1]), dict(other[1]), evicts)
    return Supply(name, layout, free, (option,), dict(now))


def _wants(
    workload: str, n: int, kind: str = MIG_3G, nodes: frozenset[str] | None = None
) -> tuple[Want, ...]:
    where = nodes if nodes is not None else frozenset({"a", "b", "c"})
    return tuple(Want(f"{workload}[main/{i}]", kind, 1, where) for i in range(n))


def test_pods_that_fit_the_free_devices_now_are_ready() -> None:
    [d] = decide([Waiting("ns/w", _wants("ns/w", 3, MIG_1G))], [_node("a")])
    assert d.verdict is Verdict.READY
    assert set(d.placed.values()) == {"a"} and len(d.placed) == 3


def test_a_gang_gets_one_relabel_serving_all_its_pods() -> None:
    [d] = decide([Waiting("ns/w", _wants("ns/w", 2))], [_node("a"), _node("b")])
    assert d.verdict is Verdict.RELABEL, d
    assert dict(d.relabels) == {"a": Target("all-3g", ALL_3G)}


def test_no_relabel_that_evicts_unless_the_check_allows_it() -> None:
    busy = [_node("a", evicts=("ns/running",))]
    [d] = decide([Waiting("ns/w", _wants("ns/w", 2))], busy)
    assert d.verdict is Verdict.WAIT and not d.relabels
    assert "evict" in d.message and "does not allow" in d.message, d.message
    [d] = decide([Waiting("ns/w", _wants("ns/w", 2), Params(allow_evict=True))], busy)
    assert d.verdict is Verdict.RELABEL and set(d.relabels) == {"a"}


def test_waits_while_its_node_changes_then_ready_once_done() -> None:
    target = {"a": Target("all-3g", ALL_3G)}
    w = Waiting("ns/w", _wants("ns/w", 2), relabelled=target)
    [d] = decide([w], [], {"a": "a change is under way (state pending)"})
    assert d.verdict is Verdict.WAIT and "waiting for a (to all-3g)" in d.message
    stale = Supply("a", "all-3g", ALL_1G, (), dict(ALL_1G))  # old success, old devices
    [d] = decide([w], [stale])
    assert d.verdict is Verdict.WAIT
    [d] = decide([w], [_node("a", "all-3g")])
    assert d.verdict is Verdict.READY and set(d.placed.values()) == {"a"}


def test_a_failed_relabel_is_retry() -> None:
    w = Waiting("ns/w", _wants("ns/w", 2), relabelled={"a": Target("all-3g", ALL_3G)})
    [d] = decide([w], [], {"a": "its last change failed (state failed)"})
    assert d.verdict is Verdict.RETRY and "failed" in d.message


def test_two_workloads_never_claim_the_same_node() -> None:
    first = Waiting("ns/first", _wants("ns/first", 2))
    second = Waiting("ns/second", _wants("ns/second", 2))
    d1, d2 = decide([first, second], [_node("a")])
    assert d1.verdict is Verdict.RELABEL and set(d1.relabels) == {"a"}
    assert d2.verdict is Verdict.WAIT and "workloads before it" in d2.message
    d1, d2 = decide([first, second], [_node("a"), _node("b")])
    assert {*d1.relabels} | {*d2.relabels} == {"a", "b"} and not {*d1.relabels} & {*d2.relabels}


def test_devices_of_a_ready_workload_stay_promised() -> None:
    # the ready one (listed last) is taken first: its devices are not the other's
    ready = Waiting("ns/ready", _wants("ns/ready", 2), ready=True)
    later = Waiting("ns/later", _wants("ns/later", 1))
    d_later, d_ready = decide([later, ready], [_node("a", "all-3g")])
    assert d_ready.verdict is Verdict.READY
    assert d_later.verdict is Verdict.WAIT, d_later


def test_max_nodes_caps_the_nodes_changing_at_once() -> None:
    changing = Waiting("ns/c", _wants("ns/c", 2), relabelled={"a": Target("all-3g", ALL_3G)})
    w = Waiting("ns/w", _wants("ns/w", 2), Params(max_nodes=1))
    _, d = decide([changing, w], [_node("b")], {"a": "a change is under way (state pending)"})
    assert d.verdict is Verdict.WAIT and "at most 1 at once" in d.message
    big = Waiting("ns/big", _wants("ns/big", 4), Params(max_nodes=1))
    [d] = decide([big], [_node("a"), _node("b")])
    assert d.verdict is Verdict.WAIT and "more than 1" in d.message


def test_unservable_waits_or_is_rejected_saying_why() -> None:
    w = Waiting("ns/w", _wants("ns/w", 3, "nvidia.com/mig-7g.80gb"))
    [d] = decide([w], [_node("a")])
    assert d.verdict is Verdict.WAIT
    assert d.message == "3 pod(s) asking mig-7g.80gb: no approved layout can serve all of its pods"
    [d] = decide([Waiting("ns/w", w.wants, Params(reject_unservable=True))], [_node("a")])
    assert d.verdict is Verdict.REJECTED


_nodes = st.lists(
    st.tuples(st.sampled_from(["all-1g.10gb", "all-3g"]), st.integers(0, 2)),
    min_size=1,
    max_size=4,
)
_queue = st.lists(
    st.tuples(st.sampled_from([MIG_1G, MIG_3G]), st.integers(1, 4), st.booleans()),
    min_size=1,
    max_size=5,
)


@settings(max_examples=60, deadline=None)
@given(_nodes, _queue)
def test_property_no_two_workloads_share_devices_or_nodes(
    nodes: list[tuple[str, int]], queue: list[tuple[str, int, bool]]
) -> None:
    names = [f"n{i}" for i in range(len(nodes))]
    supplies = [
        _node(n, layout, evicts=tuple(f"x/{n}-{j}" for j in range(held)))
        for n, (layout, held) in zip(names, nodes, strict=True)
    ]
    waiting = [
        Waiting(f"ns/w{i}", _wants(f"ns/w{i}", count, kind, frozenset(names)), Params(evict))
        for i, (kind, count, evict) in enumerate(queue)
    ]
    decisions = decide(waiting, supplies)
    used: dict[str, Counter[str]] = {n: Counter() for n in names}
    relabelled: list[str] = []
    by_pod = {want.pod: want for w in waiting for want in w.wants}
    for d in decisions:
        for pod, node in d.placed.items():
            used[node][by_pod[pod].kind] += by_pod[pod].count
        if d.verdict is Verdict.RELABEL:
            relabelled += list(d.relabels)
            assert d.relabels and all(n in names for n in d.relabels)
    free: Mapping[str, Mapping[str, int]] = {s.node: s.free for s in supplies}
    for n in names:
        assert all(c <= free[n].get(k, 0) for k, c in used[n].items()), (n, used[n])
    assert len(relabelled) == len(set(relabelled))
    assert not set(relabelled) & {n for n, c in used.items() if c}
    for w, d in zip(waiting, decisions, strict=True):
        if d.verdict is Verdict.RELABEL and not w.params.allow_evict:
            assert all(not s.options[0].evicts for s in supplies if s.node in d.relabels)


@settings(max_examples=60, deadline=None)
@given(_nodes, st.sampled_from([MIG_1G, MIG_3G]), st.integers(1, 8), st.booleans())
def test_property_one_workload_is_served_exactly_when_some_choice_of_layouts_serves_it(
    nodes: list[tuple[str, int]], kind: str, count: int, evict: bool
) -> None:
    """Against brute force: every node at its layout or another approved one (those that
    evict only where allowed); the workload is Ready or relabelled exactly when one of those
    choices places all its pods, and a relabel's choice does."""
    names = [f"n{i}" for i in range(len(nodes))]
    supplies = [
        _node(n, layout, evicts=tuple(f"x/{n}-{j}" for j in range(held)))
        for n, (layout, held) in zip(names, nodes, strict=True)
    ]
    wants = _wants("ns/w", count, kind, frozenset(names))
    per_node = [
        [dict(s.free), *(dict(o.free) for o in s.options if evict or not o.evicts)]
        for s in supplies
    ]
    servable = any(
        len(assign(wants, dict(zip(names, choice, strict=True)))) == len(wants)
        for choice in itertools.product(*per_node)
    )
    [d] = decide([Waiting("ns/w", wants, Params(allow_evict=evict))], supplies)
    assert (d.verdict in (Verdict.READY, Verdict.RELABEL)) == servable, d
    if d.verdict is Verdict.RELABEL:
        by = {s.node: s for s in supplies}
        capacity = {
            n: dict(by[n].options[0].free) if n in d.relabels else dict(by[n].free) for n in names
        }
        assert len(assign(wants, capacity)) == len(wants)
