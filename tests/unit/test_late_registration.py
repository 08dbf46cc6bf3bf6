"""NVIDIA's device plugin registers each resource with the kubelet on its own, and the kubelet
keeps a stopped plugin's resource (capacity as it was, allocatable 0) for its grace period. So
right after the plugin's restart a resource the old layout also had may still show the old
plugin's count while the new plugin has registered only the others: the counts match, yet no
pod can be given that resource's devices.

Before: one expected resource allocatable was enough, and the agent said ``success`` while the
kubelet offered none of the 2g.20gb devices (seen on the real kubelet, going from a layout with
two 2g.20gb devices to all-balanced on two GPUs)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mig_agent.core.advertised import plugin_listing
from mig_agent.kube.cluster import NodeView
from tests.unit.fake_cluster import FakeCluster
from tests.unit.test_agent import DP_NS, NODE, REASON, STATE, label, make

MIG_1G, MIG_2G, MIG_3G = (f"nvidia.com/mig-{p}" for p in ("1g.10gb", "2g.20gb", "3g.40gb"))
LATE = MIG_2G


def test_a_resource_not_yet_offered_is_not_listed_fresh() -> None:
    want = {MIG_1G: 16, MIG_2G: 8, MIG_3G: 8}
    # the 2g.20gb count is the stopped plugin's: the new one registered 1g and 3g only
    got = plugin_listing(want, {MIG_1G: 16, MIG_2G: 0, MIG_3G: 8}, want)
    assert got.listed == want and not got.fresh
    # every resource offered, one device of them unhealthy: fresh, and told
    got = plugin_listing(want, {MIG_1G: 16, MIG_2G: 7, MIG_3G: 8}, want)
    assert got.fresh and got.unhealthy == {MIG_2G: 1}


def _kubelet_registering_late(cluster: FakeCluster, watches: int | None) -> list[int]:
    """After the plugin's restart, the kubelet as it is for ``LATE``: the old plugin's count
    with allocatable 0, until the new plugin registers it at the ``watches``-th watch of the
    node (never with None). Returns the watch count since the restart."""
    plugin = cluster.on_change
    assert plugin is not None
    first = {p.ref.uid for p in cluster.list_pods(namespace=DP_NS)}
    old = int(cluster.nodes[NODE].capacity.get(LATE, "0"))
    seen = [0]

    def lingering(c: FakeCluster) -> None:
        plugin(c)
        now = {p.ref.uid for p in c.list_pods(namespace=DP_NS)}
        if now == first or (watches is not None and seen[0] >= watches):
            return
        node = c.nodes[NODE]
        c.nodes[NODE] = dataclasses.replace(
            node,
            capacity={**node.capacity, LATE: str(old)},
            allocatable={**node.allocatable, LATE: "0"},
        )

    watch = cluster.watch_node

    def counted(name: str, *, timeout_s: int) -> Any:
        if {p.ref.uid for p in cluster.list_pods(namespace=DP_NS)} - first:
            seen[0] += 1
            if watches is not None and seen[0] == watches:
                lingering_off(cluster)
        return watch(name, timeout_s=timeout_s)

    def lingering_off(c: FakeCluster) -> None:
        node = c.nodes[NODE]
        count = int(node.capacity.get(LATE, "0"))
        c.nodes[NODE] = dataclasses.replace(
            node, allocatable={**node.allocatable, LATE: str(count)}
        )

    cluster.on_change = lingering
    cluster.watch_node = counted  # type: ignore[method-assign]
    return seen


def _success_written_with(cluster: FakeCluster) -> list[dict[str, str]]:
    """The node's allocatable at every patch that writes ``success``."""
    out: list[dict[str, str]] = []
    patch = cluster.patch_node

    def recorded(name: str, **kw: Any) -> NodeView:
        if (kw.get("labels") or {}).get(STATE) == "success":
            out.append(dict(cluster.nodes[name].allocatable))
        return patch(name, **kw)

    cluster.patch_node = recorded  # type: ignore[method-assign]
    return out


def test_success_waits_for_every_resource_of_the_layout_to_be_offered() -> None:
    agent, cluster, _ = make()
    label(cluster, "all-balanced")  # 2g.20gb x 8
    assert agent.reconcile_once().outcome.name == "APPLIED"
    seen = _kubelet_registering_late(cluster, watches=3)
    written = _success_written_with(cluster)
    label(cluster, "h100-80gb-1x4g-1x2g-1x1g")  # 2g.20gb x 8 again
    assert agent.reconcile_once().outcome.name == "APPLIED"
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert seen[0] >= 3, seen
    assert [w[LATE] for w in written] == ["8"], written


def test_a_resource_never_offered_fails_the_change_naming_it() -> None:
    agent, cluster, _ = make(device_plugin_timeout_s=30)
    label(cluster, "all-balanced")
    assert agent.reconcile_once().outcome.name == "APPLIED"
    _kubelet_registering_late(cluster, watches=None)
    label(cluster, "h100-80gb-1x4g-1x2g-1x1g")
    agent.reconcile_once()
    node = cluster.nodes[NODE]
    assert node.labels[STATE] == "failed"
    assert LATE in node.annotations[REASON], node.annotations[REASON]
