"""The drain's waits and evictions: how soon it notices, how many requests it makes, and that
the operands and the GPU pods terminate side by side (tests/unit/test_agent.py has the pass)."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import Counter
from collections.abc import Iterator

import pytest

from mig_agent.core.errors import DrainTimeout
from mig_agent.kube.cluster import PodRef, PodsSeen, PodView
from mig_agent.node.drain import drain_gpu_pods, wait_pods_gone
from mig_agent.node.waits import WATCH_SLICE_S, Clock, poll_delays
from tests.unit.fake_cluster import FakeCluster

from .test_agent import DP_LABEL, DP_NS, DP_SEL, NODE, FakeTime, label, make


def test_poll_delays_look_often_at_first_then_back_off_to_the_poll_interval() -> None:
    first = list(itertools.islice(poll_delays(1.0), 36))
    assert first[:30] == [0.1] * 30  # three seconds at 0.1 s: most waits end in that time
    assert first[30:] == [0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert list(itertools.islice(poll_delays(0.05), 3)) == [0.05] * 3  # never above poll_s


class LingeringPods(FakeCluster):
    """Evicted pods terminate for a few looks, as a kubelet stops containers; counts calls."""

    def __init__(self, looks: int) -> None:
        super().__init__()
        self.looks, self.terminating = looks, dict[PodRef, int]()
        self.calls: Counter[str] = Counter()

    def evict(self, ref: PodRef) -> None:
        self.calls["evict"] += 1
        self.terminating[ref] = self.looks
        self.evicted.append(ref)

    def list_pods(self, **kw: object) -> list:  # type: ignore[override]
        self.calls["list_pods"] += 1
        for ref, left in list(self.terminating.items()):
            if left <= 0:
                self.pods.pop(ref, None)
                del self.terminating[ref]
            else:
                self.terminating[ref] = left - 1
        return super().list_pods(**kw)  # type: ignore[arg-type]

    def get_pod(self, ref: PodRef) -> None:  # type: ignore[override]
        raise AssertionError("the drain reads the node's pods in one list, not pod by pod")


def test_drain_waits_with_one_list_of_the_nodes_pods_per_look() -> None:
    cluster = LingeringPods(looks=3)
    for i in range(20):
        cluster.add_pod("work", f"p{i}", NODE, gpu={"nvidia.com/mig-1g.10gb": 1})
    t = FakeTime()
    evicted = drain_gpu_pods(
        cluster, NODE, timeout_s=60, retry_s=5, poll_s=1.0, clock=Clock(t.now, t.sleep)
    )
    assert len(evicted) == 20 and not cluster.pods
    assert cluster.calls["evict"] == 20
    # one list to find the pods, then one per look until the last is gone: not 20 per look
    assert cluster.calls["list_pods"] <= 6
    assert t.t == pytest.approx(0.3)  # noticed at the first look after they went, 0.1 s apart


class WatchedPods(FakeCluster):
    """A pod watch as the API server's: the pods now, then each change as it happens. Evicted
    pods go ``after`` seconds (fake time) after their eviction; counts lists and watches."""

    def __init__(self, t: FakeTime, after: float) -> None:
        super().__init__()
        self.t, self.after = t, after
        self.going: dict[PodRef, float] = {}
        self.calls: Counter[str] = Counter()

    def evict(self, ref: PodRef) -> None:
        self.going[ref] = self.t.t + self.after
        self.evicted.append(ref)

    def list_pods(self, **kw: object) -> list:  # type: ignore[override]
        self.calls["list_pods"] += 1
        return super().list_pods(**kw)  # type: ignore[arg-type]

    def watch_pods(
        self, node: str, *, timeout_s: float, seen: PodsSeen | None = None
    ) -> Iterator[list[PodView]]:
        if seen is not None and seen.resource_version:  # goes on where the last one ended
            yield super().list_pods(node=node)  # what the last watch saw: no request
        else:
            yield self.list_pods(node=node)
            if seen is not None:
                seen.resource_version = "1"
        self.calls["watch"] += 1
        end = self.t.t + timeout_s
        while self.going and min(self.going.values()) <= end:  # the next deletion, then
            when = min(self.going.values())
            self.t.t = max(self.t.t, when)
            for ref in [r for r, w in self.going.items() if w == when]:
                del self.going[ref]
                self.pods.pop(ref, None)
            yield super().list_pods(node=node)  # an event, not a request
        self.t.t = max(self.t.t, end)  # nothing more before the watch's end


def test_the_drain_waits_on_a_watch_and_sees_each_pod_go_when_it_goes() -> None:
    """Before: a list of the node's pods every 0.1 s, then up to every poll_s; an evicted pod's
    going was seen at the next look. Now one list and one watch per slice of the wait."""
    t = FakeTime()
    cluster = WatchedPods(t, after=3.7)
    for i in range(20):
        cluster.add_pod("work", f"p{i}", NODE, gpu={"nvidia.com/mig-1g.10gb": 1})
    evicted = drain_gpu_pods(
        cluster, NODE, timeout_s=60, retry_s=5, poll_s=1.0, clock=Clock(t.now, t.sleep)
    )
    assert len(evicted) == 20 and not cluster.pods
    assert t.t == pytest.approx(3.7)  # when they went, not at a poll's tick
    # the pods to drain, then the wait's one list and one watch (the polling made 37 lists)
    assert cluster.calls == Counter({"list_pods": 2, "watch": 1})


def test_a_long_wait_costs_one_list_and_a_watch_per_slice() -> None:
    t = FakeTime()
    cluster = WatchedPods(t, after=100.0)  # a pod that checkpoints for 100 s (grace 120)
    cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1}, grace_period_s=120)
    drain_gpu_pods(cluster, NODE, timeout_s=60, retry_s=5, poll_s=1.0, clock=Clock(t.now, t.sleep))
    assert t.t == pytest.approx(100.0)
    slices = cluster.calls["watch"]
    assert slices == pytest.approx(100 / WATCH_SLICE_S, abs=2)  # a stop is seen between two
    # the pods to drain, and the first watch's list: each watch goes on where the last ended
    # (polling: 30 + 97 lists; a list per slice: 22)
    assert cluster.calls["list_pods"] == 2


def test_wait_pods_gone_names_what_stays() -> None:
    cluster = FakeCluster()
    ref = cluster.add_pod(DP_NS, "dp", NODE, labels=DP_SEL, owner="DaemonSet")
    t = FakeTime()
    with pytest.raises(
        DrainTimeout, match="paused operand pods still present after 10 s: gpu-operator/dp"
    ):
        wait_pods_gone(
            cluster,
            NODE,
            [ref],
            timeout_s=10,
            poll_s=1.0,
            what="paused operand pods",
            clock=Clock(t.now, t.sleep),
        )
    replaced = PodRef(ref.namespace, ref.name, "another-uid")
    wait_pods_gone(
        cluster, NODE, [replaced], timeout_s=10, poll_s=1.0, what="x", clock=Clock(t.now, t.sleep)
    )  # a pod of the same name but another UID: gone


class TogetherOnly(FakeCluster):
    """Each eviction returns only once four are in flight: evictions one after another never
    get there (the barrier breaks after 5 s)."""

    def __init__(self) -> None:
        super().__init__()
        self.barrier = threading.Barrier(4, timeout=5)

    def evict(self, ref: PodRef) -> None:
        self.barrier.wait()
        super().evict(ref)


def test_evictions_go_side_by_side() -> None:
    cluster = TogetherOnly()
    for i in range(8):
        cluster.add_pod("work", f"p{i}", NODE, gpu={"nvidia.com/mig-1g.10gb": 1})
    evicted = drain_gpu_pods(cluster, NODE, timeout_s=60, retry_s=5, poll_s=0.01)
    assert len(evicted) == 8 and not cluster.pods


def test_gpu_pods_are_evicted_while_the_paused_operands_terminate() -> None:
    """The device plugin's pod (paused operand) goes only after the GPU pods were asked to go:
    waiting for it first, as the drain once did, would wait out the operand timeout."""
    agent, cluster, _ = make(operand_timeout_s=30.0)
    gpu_pod = cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1})
    plugin_play = cluster.on_change
    assert plugin_play is not None

    def operands_go_after_an_eviction(c: FakeCluster) -> None:
        dp = c.list_pods(
            node=NODE, namespace=DP_NS, label_selector="app=nvidia-device-plugin-daemonset"
        )
        if dp and c.nodes[NODE].labels.get(DP_LABEL) != "true" and not c.evicted:
            return  # the DaemonSet's pod is still terminating
        plugin_play(c)

    cluster.on_change = operands_go_after_an_eviction
    label(cluster, "all-1g.10gb")
    result = agent.reconcile_once()
    assert result.outcome.name == "APPLIED", result
    assert cluster.evicted == [gpu_pod]


def test_waiting_for_the_device_plugin_costs_one_read_per_look() -> None:
    """While the new plugin starts, each look reads the node only; its pods are listed once
    the numbers match (before: a list of pods and a read of the node at every look)."""
    from mig_agent.agent.advertisers import device_plugin
    from mig_agent.config.settings import Settings

    agent, cluster, gpus = make()
    (old,) = cluster.list_pods(namespace=DP_NS)
    cluster.pods.pop(old.ref)  # the old plugin is gone; its successor comes after 20 looks
    cluster.on_change = None
    cluster.patch_node_resources(NODE, {"nvidia.com/gpu": 0})  # its devices unhealthy meanwhile
    looks = {"n": 0, "lists": 0}
    list_pods, sleep = cluster.list_pods, agent.clock.sleep

    def counted_list(**kw: object) -> list:  # type: ignore[type-arg]
        looks["lists"] += 1
        return list_pods(**kw)  # type: ignore[arg-type]

    def look(seconds: float) -> None:
        looks["n"] += 1
        if looks["n"] == 20:
            from mig_agent.core.advertised import expected_resources

            cluster.add_pod(DP_NS, "dp-new", NODE, labels=DP_SEL, owner="DaemonSet")
            cluster.patch_node_resources(
                NODE, expected_resources(gpus.observe(), gpus.models(), "mixed")
            )
        sleep(seconds)

    cluster.list_pods = counted_list  # type: ignore[method-assign]
    s = Settings(node_name=NODE, config=agent.settings.config)
    clock = Clock(agent.clock.now, look)
    device_plugin.wait_resources(cluster, s, gpus, clock, gpus.models(), {old.ref.uid})
    assert looks["n"] == 20
    assert looks["lists"] <= 3, looks  # not one per look


class ReplacedAtEviction(FakeCluster):
    """A StatefulSet's pod deleted and made again under its name (with its requests and claims),
    on this node, between the drain's look and its eviction (the API server then answers the
    eviction 409)."""

    def __init__(self) -> None:
        super().__init__()
        self.replaced: list[PodRef] = []

    def evict(self, ref: PodRef) -> None:
        if not self.replaced:
            old = self.pods.pop(ref)
            self.replaced.append(
                self.add_pod(
                    ref.namespace, ref.name, old.node, gpu=old.gpu_requests, claims=old.claims
                )
            )
        super().evict(ref)


def test_a_pod_replaced_before_its_eviction_is_decided_afresh_and_evicted() -> None:
    """Before: the eviction's 409 (the UID precondition of a pod made again under its name)
    failed the change for good."""
    cluster = ReplacedAtEviction()
    first = cluster.add_pod(
        "work", "db-0", NODE, gpu={"nvidia.com/mig-1g.10gb": 1}, owner="StatefulSet"
    )
    t = FakeTime()
    evicted = drain_gpu_pods(
        cluster, NODE, timeout_s=60, retry_s=5, poll_s=1.0, clock=Clock(t.now, t.sleep)
    )
    [second] = cluster.replaced
    assert second.uid != first.uid
    assert cluster.evicted == [second]  # the pod of that name now, not the one looked at
    assert not cluster.pods
    assert evicted == [first, second]


def test_a_claim_holding_pod_replaced_before_its_eviction_is_evicted_too() -> None:
    """As above, on a DRA node: the pod holds its device by ResourceClaim, requesting no GPU
    resource. Before: the drain's look for the pod now of that name kept only pods requesting
    GPU resources, found none, and took the replacement (its device about to go) for gone."""
    cluster = ReplacedAtEviction()
    first = cluster.add_pod("work", "db-0", NODE, owner="StatefulSet", claims=("db-0-gpu",))
    t = FakeTime()
    evicted = drain_gpu_pods(
        cluster,
        NODE,
        timeout_s=60,
        retry_s=5,
        poll_s=1.0,
        clock=Clock(t.now, t.sleep),
        claimed={("work", "db-0")},
    )
    [second] = cluster.replaced
    assert cluster.evicted == [second]
    assert not cluster.pods
    assert evicted == [first, second]


class KeptByAFinalizer(FakeCluster):
    """An evicted pod's containers exit (phase Succeeded) but a finalizer keeps its object."""

    def evict(self, ref: PodRef) -> None:
        self.pods[ref] = dataclasses.replace(self.pods[ref], phase="Succeeded", terminating=True)
        self.evicted.append(ref)


def test_a_finished_pod_a_finalizer_keeps_is_not_waited_for() -> None:
    """Before: the drain waited for it until its grace and margin ran out, then failed the
    change naming a pod that held no device."""
    cluster = KeptByAFinalizer()
    ref = cluster.add_pod("work", "job-0", NODE, gpu={"nvidia.com/mig-1g.10gb": 1})
    t = FakeTime()
    evicted = drain_gpu_pods(
        cluster, NODE, timeout_s=60, retry_s=5, poll_s=1.0, clock=Clock(t.now, t.sleep)
    )
    assert evicted == [ref] and ref in cluster.pods  # still there, finished
    assert t.t < 1.0  # seen at the first look, not after 30 s of grace and margin
