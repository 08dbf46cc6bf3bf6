"""Kueue benchmarks: advise_bench's changing load replayed as Kueue Workloads, gangs included, and
how long the MIG layout AdmissionCheck's decisions take on a large pool.

* pool: advise_bench's (20 nodes of 8xH100-80GB started at mixed layouts, the approved layouts,
  its seeded pod stream moving from small to large profiles, one step a minute). Each arrival
  is a Workload (shaped as Kueue v0.17 writes them, kueue.x-k8s.io/v1beta2; its quota reserved
  at once: the ClusterQueue's quota holds the load, only devices hold work back): most of one
  pod, a tenth gangs of 2 to 4 pods (the stream's next pods of the same profile, arriving with
  the first). Where a policy reads demand, it reads the waiting Workload objects through
  mig_agent.core.kueue_demand, as the controller does. A workload starts whole, all its pods
  at once, only when all its devices exist (Kueue admits workloads whole); each pod runs its
  stream duration. Compared: the layouts as they are (waiting workloads placed first fit, oldest
  first, each whole or not at all); advise (no eviction, the workloads' demand) applied every 5
  and 15 minutes, then the same placement; the admission check (mig_agent.core.admission_check)
  deciding every minute for each waiting workload, at most MAX_NODES nodes changing at once, no
  eviction, a workload starting where the check marks it Ready; and the best fixed layouts in
  hindsight (advise_bench's exhaustive search over multisets of layouts, each profile's queue
  scored with its gangs; the layouts as they are among the multisets). A relabelled node takes
  no pod for two minutes. Figures: pending pod-minutes, device-minutes idle while some workload
  waits, relabels (GPUs changed), workloads started (gangs).
* large pool: advise_bench's 1,000 nodes of 8xH100-80GB at mixed layouts, half their devices
  held; 10,000 pending workloads (the stream's, gangs included, the mix moving as it does),
  quota reserved, waiting on the check; evictions allowed (as in advise_bench's large pool:
  every relabel there evicts, its holders named per device kind, not per GPU): the time to
  read them (kueue_demand), advise's decision for all of them (options, then the search), one
  check decision (the queue's first workload, its pods fitting now; a gang of four asking a
  profile no node has free), and a check round deciding for all 10,000 in queue order.

Run: python benchmarks/kueue_bench.py [--quick]   (prints tables; no cluster needed)
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent))  # advise_bench, beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advise_bench import (  # noqa: E402
    H100,
    START,
    Figures,
    Node,
    Pod,
    advise_and_apply,
    approved,
    best_multiset,
    node_supplies,
    offers,
    pool_supplies,
    relabel,
    stream,
)

from mig_agent.core.admission_check import Params, Target, Verdict, Waiting, decide  # noqa: E402
from mig_agent.core.advise import Supply, advise  # noqa: E402
from mig_agent.core.advise_assign import Want  # noqa: E402
from mig_agent.core.advise_options import Memo  # noqa: E402
from mig_agent.core.kueue_demand import workload_demand  # noqa: E402
from tests.unit.fake_gpus import FakeGpus  # noqa: E402

GANGS = 0.1  # of the workloads: gangs of 2 to 4 pods
MAX_NODES = 4  # the check's mig-agent.dev/max-nodes
CHECK = "mig-layout"
CHANGING = "a change is under way (state pending)"


@dataclass(frozen=True)
class Job:
    """A Workload (``obj``, as the API returns it) and the stream's pods it runs."""

    name: str  # namespace/name
    kind: str
    pods: tuple[Pod, ...]
    arrive: int
    obj: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_gang(self) -> bool:
        return len(self.pods) > 1


def workload(name: str, kind: str, pods: int, arrive: int) -> dict[str, Any]:
    """A Workload of one pod set (``pods`` pods asking one ``kind`` device each), its quota
    reserved (the flavor ``default``), waiting on the check."""
    ask = {kind: "1"}
    container = {"name": "main", "image": "bench", "resources": {"requests": ask, "limits": ask}}
    namespace, short = name.split("/")
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {
            "namespace": namespace,
            "name": short,
            "creationTimestamp": f"2026-12-06T{arrive // 60:02}:{arrive % 60:02}:00Z",
        },
        "spec": {
            "queueName": "gpu",
            "podSets": [
                {"name": "main", "count": pods, "template": {"spec": {"containers": [container]}}}
            ],
        },
        "status": {
            "conditions": [
                {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved"},
                {"type": "Admitted", "status": "False", "reason": "NoChecks"},
            ],
            "admission": {
                "clusterQueue": "gpu",
                "podSetAssignments": [
                    {"name": "main", "count": pods, "flavors": {kind: "default"}}
                ],
            },
            "admissionChecks": [{"name": CHECK, "state": "Pending", "message": ""}],
        },
    }


def jobs(pods: Sequence[Pod], seed: int) -> list[Job]:
    """The stream's pods as workloads: most of one pod; ``GANGS`` of them gangs of 2 to 4, the
    next pods of the same profile joining the first and arriving with it."""
    rng = random.Random(seed)
    taken: set[int] = set()
    out: list[Job] = []
    for i, first in enumerate(pods):
        if i in taken:
            continue
        size = rng.randint(2, 4) if rng.random() < GANGS else 1
        members = [first]
        for j in range(i + 1, len(pods)):
            if len(members) == size:
                break
            if j not in taken and pods[j].kind == first.kind:
                members.append(pods[j])
                taken.add(j)
        name = f"bench/w{len(out)}"
        obj = workload(name, first.kind, len(members), first.arrive)
        out.append(Job(name, first.kind, tuple(members), first.arrive, obj))
    return out


def demand_of(waiting: Iterable[Job], nodes: frozenset[str]) -> dict[str, tuple[Want, ...]]:
    """Each waiting workload's pods as wants, one gang, read from its Workload object as the
    controller reads them (mig_agent.ops.advise_read): workload -> its wants."""
    got = workload_demand(j.obj for j in waiting)
    assert not got.waiting_for_quota and not got.not_understood, got
    out: dict[str, tuple[Want, ...]] = {}
    for ps in got.pod_sets:
        gang = f"workload:{ps.workload}"
        wants = tuple(Want(p, ps.ask.kind, ps.ask.count, nodes, gang=gang) for p in ps.pods())
        out[ps.workload] = out.get(ps.workload, ()) + wants
    return out


@dataclass
class KueueFigures(Figures):
    workloads: int = 0  # started
    gangs: int = 0  # gang workloads started
    relabelled_again: int = 0  # check: relabels for a workload whose earlier ones were done


@dataclass(frozen=True)
class Policy:
    name: str
    every: int | None = None  # advise applied every this many minutes
    check: Params | None = None  # the admission check, with its parameters


@dataclass
class _Pool:
    """The simulated pool at one minute."""

    nodes: list[Node]
    waiting: list[Job] = field(default_factory=list)
    running: list[tuple[int, Node, str, str]] = field(default_factory=list)  # end, node, kind, pod
    relabelled: dict[str, Mapping[str, Target]] = field(default_factory=dict)  # by the check
    memo: Memo = field(default_factory=dict)  # each layout's effect, kept between minutes

    @property
    def names(self) -> frozenset[str]:
        return frozenset(n.name for n in self.nodes)

    def start(self, job: Job, where: Mapping[str, Node], t: int, fig: KueueFigures) -> None:
        for pod in job.pods:
            node = where[pod.name]
            node.running[job.kind] += 1
            assert node.running[job.kind] <= node.capacity[job.kind], (job, node.name)
            node.holders[pod.name] = job.kind
            self.running.append((t + pod.duration, node, job.kind, pod.name))
        fig.workloads += 1
        fig.gangs += job.is_gang

    def finish(self, t: int) -> None:
        for end, node, kind, pod in self.running:
            if end <= t:
                node.running[kind] -= 1
                del node.holders[pod]
        self.running = [r for r in self.running if r[0] > t]


def simulate(all_jobs: Sequence[Job], minutes: int, nodes_n: int, policy: Policy) -> KueueFigures:
    """One policy over the workloads (see the module)."""
    layouts = {la.name: la for la in approved()}
    pool = _Pool([Node(f"gpu-{i:02}", "", FakeGpus([H100] * 8)) for i in range(nodes_n)])
    for i, n in enumerate(pool.nodes):
        n.set_layout(layouts[START[i % len(START)]])
    fig = KueueFigures()
    todo = deque(sorted(all_jobs, key=lambda j: j.arrive))
    for t in range(minutes):
        pool.finish(t)
        while todo and todo[0].arrive <= t:
            pool.waiting.append(todo.popleft())
        if policy.check is not None:
            started = _check_round(pool, layouts, policy.check, t, fig)
        else:
            if policy.every and t % policy.every == 0 and pool.waiting:
                wants = [w for ws in demand_of(pool.waiting, pool.names).values() for w in ws]
                advise_and_apply(pool.nodes, layouts, wants, t, fig, pool.memo)
            started = _first_fit(pool, t, fig)
        pool.waiting = [j for j in pool.waiting if j.name not in started]
        fig.pending_pod_min += sum(len(j.pods) for j in pool.waiting)
        if pool.waiting:
            fig.idle_dev_min += sum(
                (n.capacity - n.running).total() for n in pool.nodes if n.busy_until <= t
            )
    return fig


def _first_fit(pool: _Pool, t: int, fig: KueueFigures) -> set[str]:
    """The waiting workloads started, oldest first, each whole where it fits (or it waits)."""
    started = set()
    for job in pool.waiting:
        where = _placed(pool, job, t)
        if where is not None:
            pool.start(job, where, t, fig)
            started.add(job.name)
    return started


def _placed(pool: _Pool, job: Job, t: int) -> dict[str, Node] | None:
    """Where the scheduler puts ``job``'s pods: each on the first node with a free device of
    its kind, the nodes changing aside; None where not all of them fit."""
    free = {n.name: n.capacity[job.kind] - n.running[job.kind] for n in pool.nodes}
    where: dict[str, Node] = {}
    for pod in job.pods:
        node = next((n for n in pool.nodes if n.busy_until <= t and free[n.name] > 0), None)
        if node is None:
            return None
        free[node.name] -= 1
        where[pod.name] = node
    return where


def _check_round(
    pool: _Pool, layouts: Mapping[str, Any], params: Params, t: int, fig: KueueFigures
) -> set[str]:
    """One round of the check: a decision per waiting workload, its relabels applied, then the
    workloads it marks Ready started (Kueue admits them, the scheduler places their pods: first
    fit, as for the other policies); the workloads started."""
    wants = demand_of(pool.waiting, pool.names)
    queue = [
        Waiting(j.name, wants[j.name], params, pool.relabelled.get(j.name, {}))
        for j in pool.waiting
    ]
    left_alone = {n.name: CHANGING for n in pool.nodes if n.busy_until > t}
    t0 = time.perf_counter()
    decisions = decide(queue, node_supplies(pool.nodes, dict(layouts), t, pool.memo), left_alone)
    fig.advise_max_s = max(fig.advise_max_s, time.perf_counter() - t0)
    ready: list[Job] = []
    to: dict[str, str] = {}
    for job, d in zip(pool.waiting, decisions, strict=True):
        if d.verdict is Verdict.READY:
            ready.append(job)
            pool.relabelled.pop(job.name, None)
        elif d.verdict is Verdict.RELABEL:
            fig.relabelled_again += job.name in pool.relabelled
            pool.relabelled[job.name] = d.relabels
            to.update({node: target.layout for node, target in d.relabels.items()})
        else:
            assert d.verdict is Verdict.WAIT, d  # no relabel fails here, none is rejected
    relabel(pool.nodes, dict(layouts), to, t, fig)
    for job in ready:  # the check promised no more devices of a kind than are free
        where = _placed(pool, job, t)
        assert where is not None, job
        pool.start(job, where, t, fig)
    return {j.name for j in ready}


def best_fixed(all_jobs: Sequence[Job], minutes: int, nodes_n: int) -> tuple[int, int, str]:
    """(pending pod-minutes of the layouts as they are, of the best fixed layouts, which those
    are): with fixed layouts each profile's workloads queue for its own devices, all of a pod's
    devices alike, so a multiset of layouts is scored exactly by one queue per profile."""
    by_kind: dict[str, list[Job]] = {}
    for j in sorted(all_jobs, key=lambda j: j.arrive):
        by_kind.setdefault(j.kind, []).append(j)

    @cache
    def pending(kind: str, devices: int) -> int:
        """Pending pod-minutes of one profile's workloads on ``devices`` devices: each minute,
        oldest first, every waiting workload whose pods all fit starts."""
        queue = by_kind.get(kind, [])
        ends: list[int] = []
        waiting: list[Job] = []
        total = i = 0
        for t in range(minutes):
            ends = [e for e in ends if e > t]
            while i < len(queue) and queue[i].arrive <= t:
                waiting.append(queue[i])
                i += 1
            still = []
            for j in waiting:
                if devices - len(ends) >= len(j.pods):
                    ends += [t + p.duration for p in j.pods]
                else:
                    still.append(j)
            waiting = still
            total += sum(len(j.pods) for j in waiting)
        return total

    kinds = sorted(by_kind)
    start = [START[i % len(START)] for i in range(nodes_n)]
    offered = offers(kinds)
    as_they_are = sum(pending(k, sum(offered[la][i] for la in start)) for i, k in enumerate(kinds))
    best, mix = best_multiset(kinds, nodes_n, pending, also=[start])
    return as_they_are, best, mix


@dataclass
class Large:
    """What the large pool's decisions took (seconds) and gave."""

    read_s: float = 0.0  # the Workloads read as demand
    options_s: float = 0.0  # every node's options (advise and the check read the same)
    advise_s: float = 0.0  # advise's search for every workload
    advise_served: int = 0  # pods
    advise_proposals: int = 0
    one_ready_s: float = 0.0  # one check decision: a workload whose pods fit now
    one_relabel_s: float = 0.0  # one that needs a relabel
    relabel_kind: str = ""  # what that one asks
    round_s: float = 0.0  # a check round, every workload in queue order
    verdicts: Counter[str] = field(default_factory=Counter)


def large_pool(nodes_n: int, workloads_n: int, seed: int = 1) -> tuple[Large, int, int]:
    """The large pool's decisions (see the module); and its pods and gangs."""
    per_min = 100.0
    pods = stream(seed, int(workloads_n * 1.4 / per_min) + 1, per_min)
    queue = jobs(pods, seed)[:workloads_n]
    assert len(queue) == workloads_n
    out = Large()
    supplies, out.options_s = pool_supplies(nodes_n, approved())
    names = frozenset(s.node for s in supplies)
    t0 = time.perf_counter()
    wants = demand_of(queue, names)
    out.read_s = time.perf_counter() - t0
    flat = [w for ws in wants.values() for w in ws]
    t0 = time.perf_counter()
    advice = advise(flat, supplies)
    out.advise_s = time.perf_counter() - t0
    out.advise_served, out.advise_proposals = advice.served, len(advice.proposals)
    params = Params(allow_evict=True, max_nodes=MAX_NODES)
    waiting = [Waiting(j.name, wants[j.name], params) for j in queue]
    out.one_ready_s, verdict = _one_decision(waiting[0], supplies)
    assert verdict is Verdict.READY, verdict
    gang = _needing_relabel(waiting[0], supplies)
    out.one_relabel_s, verdict = _one_decision(gang, supplies)
    out.relabel_kind = gang.wants[0].kind.removeprefix("nvidia.com/mig-")
    assert verdict is Verdict.RELABEL, verdict
    t0 = time.perf_counter()
    decisions = decide(waiting, supplies)
    out.round_s = time.perf_counter() - t0
    out.verdicts = Counter(d.verdict.value for d in decisions)
    return out, len(flat), sum(j.is_gang for j in queue)


def _one_decision(w: Waiting, supplies: Sequence[Supply]) -> tuple[float, Verdict]:
    t0 = time.perf_counter()
    [d] = decide([w], supplies)
    return time.perf_counter() - t0, d.verdict


def _needing_relabel(w: Waiting, supplies: Sequence[Supply]) -> Waiting:
    """A gang of four asking a profile the pool offers no device of now, but some approved
    layout does."""
    now = {k for s in supplies for k in s.free}
    kind = min(k for s in supplies for o in s.options for k in o.free if k not in now)
    wants = tuple(
        Want(f"bench/relabel[main/{i}]", kind, 1, w.wants[0].nodes, gang="workload:bench/relabel")
        for i in range(4)
    )
    return replace(w, workload="bench/relabel", wants=wants)


def _n(x: int) -> str:
    return f"{x:,}"


def report_pool(minutes: int, nodes_n: int, per_min: float) -> None:
    pods = stream(7, minutes, per_min)
    queue = jobs(pods, 7)
    gangs = sum(j.is_gang for j in queue)
    print(
        f"\n## Kueue workloads on a pool: {nodes_n} nodes of 8xH100-80GB, {_n(len(queue))} "
        f"workloads ({_n(gangs)} gangs of 2-4 pods, {_n(len(pods))} pods) over {minutes} min "
        "(seed 7)\n"
    )
    print(
        "| policy | pending pod-min | idle device-min while work waits | relabels (GPUs "
        "changed) | workloads started (gangs) |"
    )
    print("|---|---:|---:|---:|---:|")
    policies = [
        Policy("layouts as they are"),
        Policy("advise + apply every 5 min", every=5),
        Policy("advise + apply every 15 min", every=15),
        Policy(f"admission check (max-nodes {MAX_NODES})", check=Params(max_nodes=MAX_NODES)),
    ]
    figures = {policy: simulate(queue, minutes, nodes_n, policy) for policy in policies}
    for policy, f in figures.items():
        print(
            f"| {policy.name} | {_n(f.pending_pod_min)} | {_n(f.idle_dev_min)} | "
            f"{_n(f.relabels)} ({_n(f.gpus_changed)}) | {_n(f.workloads)} ({_n(f.gangs)}) |"
        )
    as_they_are, best, mix = best_fixed(queue, minutes, nodes_n)
    print(f"| best fixed layouts, in hindsight (exhaustive over {mix}) | {_n(best)} | - | - | - |")
    static, check = figures[policies[0]], figures[policies[-1]]
    print(
        f"\nthe per-profile queues at the layouts as they are: {_n(as_they_are)} pending pod-min "
        f"(the simulation: {_n(static.pending_pod_min)})"
    )
    print(
        f"check relabels for a workload whose earlier relabels were done: {check.relabelled_again}"
    )
    print(
        "longest decision (options + search) in the runs: "
        + ", ".join(
            f"{p.name} {f.advise_max_s * 1000:.0f} ms" for p, f in figures.items() if f.advise_max_s
        )
    )


def report_large(nodes_n: int, workloads_n: int) -> None:
    got, pods_n, gangs = large_pool(nodes_n, workloads_n)
    print(
        f"\n## Large pool: {_n(nodes_n)} nodes, {_n(workloads_n)} pending workloads "
        f"({_n(gangs)} gangs, {_n(pods_n)} pods)\n"
    )
    print("| decision | time | result |")
    print("|---|---:|---|")
    print(f"| read the Workloads (kueue_demand) | {got.read_s:.2f} s | {_n(pods_n)} pods |")
    print(f"| every node's options | {got.options_s:.2f} s | |")
    print(
        f"| advise: the search for every workload | {got.advise_s:.2f} s | "
        f"{_n(got.advise_served)} pods served by {_n(got.advise_proposals)} proposals |"
    )
    print(f"| check: one workload that fits now | {got.one_ready_s * 1000:.0f} ms | Ready |")
    print(
        f"| check: one gang of four asking {got.relabel_kind}, none free | "
        f"{got.one_relabel_s * 1000:.0f} ms | Relabel |"
    )
    per = got.round_s / workloads_n * 1000
    counts = ", ".join(f"{v} {_n(n)}" for v, n in sorted(got.verdicts.items()))
    print(
        f"| check: a round over every workload (max-nodes {MAX_NODES}) | {got.round_s:.2f} s "
        f"({per:.1f} ms each) | {counts} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="CI: a short run, a smaller large pool")
    args = p.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    t0 = time.perf_counter()
    report_pool(*((120, 6, 2.0) if args.quick else (480, 20, 8.0)))
    report_large(*((100, 1000) if args.quick else (1000, 10000)))
    print(f"\nbenchmark run time: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
