"""On a device-plugin node only the kubelet knows which of a kind's devices a pod was given. The
agent reads its PodResources and publishes, beside the GPU state, which pod (by UID) holds
which devices (mig_agent.core.pod_devices); advise and the AdmissionCheck then count a pod
evicted only where one of its devices does not outlive the plan, as on a DRA node. A pod not
published (started after the read, devices named by index, nothing read) is judged by kind.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from mig_agent.core import pod_devices, snapshot
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.planner import plan
from mig_agent.node.apply import execute
from mig_agent.ops import advise as ops_advise
from tests.unit.fake_cluster import FakeCluster
from tests.unit.fake_gpus import FakeGpus
from tests.unit.test_advise_ops import S
from tests.unit.test_advise_ops import catalog as catalog  # the fixture
from tests.unit.test_agent import NODE, label, make

__all__ = ["catalog"]

MIG_1G = "nvidia.com/mig-1g.10gb"
EPOCH_STAMP = "2026-12-07T06:00:00Z"
EPOCH = 1796623200.0  # EPOCH_STAMP in epoch seconds


def _first_mig(gpus: FakeGpus, gpu: int) -> str:
    return gpus.observe().gpu(gpu).gpu_instances[0].compute_instances[0].uuid


def test_only_pods_taken_before_the_read_with_uuid_devices_are_published() -> None:
    listed = {
        ("team", "old"): frozenset({"MIG-a"}),
        ("team", "new"): frozenset({"MIG-b"}),
        ("team", "pending"): frozenset({"MIG-c"}),
        ("team", "by-index"): frozenset({"0"}),
        ("team", "whole"): frozenset({"GPU-d"}),
    }
    pods = [
        ("team", "old", "u-old", 100.0),
        ("team", "new", "u-new", 101.0),  # within the margin of the read: maybe a namesake's
        ("team", "pending", "u-pending", None),
        ("team", "by-index", "u-index", 10.0),
        ("team", "whole", "u-whole", 10.0),
        ("team", "none-listed", "u-none", 10.0),
    ]
    read_at = 100.0 + pod_devices.MARGIN_S + 0.5
    got = pod_devices.held_by_uid(listed, pods, read_at)
    assert got == {"u-old": frozenset({"MIG-a"}), "u-whole": frozenset({"GPU-d"})}
    # "new" and "pending" may be told by a later read; the others never will be
    assert pod_devices.unsettled(listed, pods, read_at)
    told = [p for p in pods if p[2] not in ("u-new", "u-pending")]
    assert not pod_devices.unsettled(listed, told, read_at)


def test_holders_round_trip_through_the_gpu_state_and_none_leaves_it_as_before() -> None:
    gpus = FakeGpus([MODELS["H100-80GB"]])
    bare = snapshot.compact(gpus.observe(), gpus.models())
    assert "holders" not in json.loads(bare)
    assert snapshot.compact(gpus.observe(), gpus.models(), {}) == bare
    held = {"u1": frozenset({"MIG-b", "MIG-a"})}
    text = snapshot.compact(gpus.observe(), gpus.models(), held)
    raw = json.loads(text)
    assert raw["holders"] == {"u1": ["MIG-a", "MIG-b"]}
    assert snapshot.holders_of(raw) == held
    assert snapshot.from_json(raw)[0] == snapshot.from_json(json.loads(bare))[0]
    assert snapshot.holders_of({"gpus": [], "holders": {"u1": "MIG-a"}}) == {}


def test_the_agent_publishes_who_holds_what_on_a_pass_that_changes_nothing() -> None:
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    agent.reconcile_once()
    uuid = _first_mig(gpus, 0)
    ref = cluster.add_pod("work", "train", NODE, gpu={MIG_1G: 1}, started=EPOCH_STAMP)
    late = cluster.add_pod("work", "late", NODE, gpu={MIG_1G: 1}, started=EPOCH_STAMP)
    agent.pod_devices = lambda: {
        ("work", "train"): frozenset({uuid}),
        ("work", "late"): frozenset({_first_mig(gpus, 1)}),
    }
    agent.clock = dataclasses.replace(agent.clock, wall=lambda: EPOCH + 60)
    cluster.pods[late] = dataclasses.replace(cluster.pods[late], started="2026-12-07T06:01:00Z")
    agent.reconcile_once()
    raw = json.loads(cluster.nodes[NODE].annotations[S.gpu_state_annotation])
    assert snapshot.holders_of(raw) == {ref.uid: frozenset({uuid})}


def _device_plugin_node(catalog: Any, *, published: bool) -> FakeCluster:
    """One node of 2 H100s at all-1g.10gb served by the device plugin; a pod on it holding one
    1g.10gb of GPU 0 (published by UID, or not); one pending asking 3g.40gb."""
    gpus = FakeGpus([MODELS["H100-80GB"]] * 2)
    execute(plan(catalog.get("all-1g.10gb"), gpus.observe(), gpus.models()), gpus)
    c = FakeCluster()
    c.add_node(NODE, {S.config_label: "all-1g.10gb", S.state_label: "success"}, {MIG_1G: "14"})
    busy = c.add_pod("team", "busy", NODE, gpu={MIG_1G: 1})
    held = {busy.uid: frozenset({_first_mig(gpus, 0)})} if published else None
    state = snapshot.compact(gpus.observe(), gpus.models(), held)
    c.nodes[NODE] = dataclasses.replace(c.nodes[NODE], annotations={S.gpu_state_annotation: state})
    ref = c.add_pod("team", "wants-3g", "", gpu={"nvidia.com/mig-3g.40gb": 1})
    c.pods[ref] = dataclasses.replace(c.pods[ref], phase="Pending")
    return c


def test_a_published_pod_on_a_gpu_that_stays_is_not_evicted(catalog: Any) -> None:
    report = ops_advise.run(_device_plugin_node(catalog, published=True), catalog)
    [proposal] = report.proposals
    # one-3g changes GPU 1 only (destroying its 1g.10gb): the pod on GPU 0 keeps its device
    assert (proposal.node, proposal.option.layout, proposal.option.evicts) == (
        NODE,
        "one-3g",
        (),
    )
    assert proposal.serves == ("team/wants-3g",)


def test_a_pod_not_published_is_judged_by_kind(catalog: Any) -> None:
    c = _device_plugin_node(catalog, published=False)
    assert ops_advise.run(c, catalog).proposals == ()  # every layout destroys a 1g.10gb
    report = ops_advise.run(c, catalog, allow_evict=True)
    assert [p.option.evicts for p in report.proposals] == [("team/busy",)]


def test_the_agent_publishes_who_holds_what_with_no_layout_asked() -> None:
    agent, cluster, gpus = make()
    whole = gpus.observe().gpu(3).info.uuid
    ref = cluster.add_pod("work", "whole", NODE, gpu={"nvidia.com/gpu": 1}, started=EPOCH_STAMP)
    agent.pod_devices = lambda: {("work", "whole"): frozenset({whole})}
    agent.clock = dataclasses.replace(agent.clock, wall=lambda: EPOCH + 60)
    agent.reconcile_once()
    raw = json.loads(cluster.nodes[NODE].annotations[S.gpu_state_annotation])
    assert snapshot.holders_of(raw) == {ref.uid: frozenset({whole})}


def test_a_pods_start_time_is_read_and_turned_to_epoch_seconds() -> None:
    from mig_agent.agent.reporting import _seconds
    from mig_agent.kube.client import _pod

    status = {"phase": "Running", "startTime": EPOCH_STAMP}
    pod = _pod({"metadata": {"name": "p", "namespace": "team", "uid": "u"}, "status": status})
    assert pod.started == EPOCH_STAMP
    assert _seconds(pod.started) == EPOCH
    assert _seconds("") is None


def test_between_passes_holders_are_published_as_the_kubelets_listing_changes() -> None:
    agent, cluster, gpus = make()
    agent.reconcile_once()
    now = [EPOCH + 1]  # the pod started a second ago: too near to tell from a namesake
    agent.clock = dataclasses.replace(agent.clock, wall=lambda: now[0])
    whole = gpus.observe().gpu(0).info.uuid
    listing = {("work", "whole"): frozenset({whole})}
    agent.pod_devices = lambda: listing
    ref = cluster.add_pod("work", "whole", NODE, gpu={"nvidia.com/gpu": 1}, started=EPOCH_STAMP)

    def published() -> dict[str, frozenset[str]]:
        return snapshot.holders_of(
            json.loads(cluster.nodes[NODE].annotations[S.gpu_state_annotation])
        )

    agent.refresh_holders()
    assert published() == {}
    lists = cluster.requests["list_pods"]
    now[0] = EPOCH + 10
    agent.refresh_holders()  # the same listing, but one it could not tell in full: read again
    assert published() == {ref.uid: frozenset({whole})}
    assert cluster.requests["list_pods"] == lists + 1
    agent.refresh_holders()  # nothing new: the node's pods are not listed
    assert cluster.requests["list_pods"] == lists + 1
    del cluster.pods[ref]
    listing = {}
    agent.refresh_holders()
    assert published() == {}


def test_an_idle_pass_reading_the_same_listing_lists_no_pods() -> None:
    agent, cluster, gpus = make()
    agent.clock = dataclasses.replace(agent.clock, wall=lambda: EPOCH + 60)
    whole = gpus.observe().gpu(0).info.uuid
    agent.pod_devices = lambda: {("work", "whole"): frozenset({whole})}
    ref = cluster.add_pod("work", "whole", NODE, gpu={"nvidia.com/gpu": 1}, started=EPOCH_STAMP)
    agent.reconcile_once()
    lists = cluster.requests["list_pods"]
    agent.reconcile_once()  # a resync of an idle agent
    agent.refresh_holders()
    assert cluster.requests["list_pods"] == lists
    raw = json.loads(cluster.nodes[NODE].annotations[S.gpu_state_annotation])
    assert snapshot.holders_of(raw) == {ref.uid: frozenset({whole})}
