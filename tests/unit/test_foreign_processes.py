"""A process the plan would end on a device no pod holds: no drain ends it, so the pass fails
before the cordon, with no pod evicted and nothing paused (before: cordon, pause the device
plugin, evict every GPU pod of the changed GPUs, wait gpu_release_timeout_s, then fail)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mig_agent.agent import Outcome
from mig_agent.core import planner

from .fake_gpus import FakeGpus
from .test_agent import NODE, STATE, assert_clean, end_processes_on_eviction, label, make

REASON = "mig-agent.dev/reason"


def _record_writes(cluster: Any) -> list[dict[str, Any]]:
    """Every node patch the agent sends, to show what it never did."""
    writes: list[dict[str, Any]] = []
    original = cluster.patch_node

    def patch_node(name: str, **kwargs: Any) -> Any:
        writes.append(kwargs)
        return original(name, **kwargs)

    cluster.patch_node = patch_node
    return writes


def _ci(gpus: FakeGpus, gpu: int, n: int = 0) -> tuple[int, str]:
    gi = gpus.observe().gpu(gpu).gpu_instances[n]
    return gi.id, gi.compute_instances[0].uuid


def _on_all_1g(**settings: object) -> tuple[Any, Any, FakeGpus]:
    agent, cluster, gpus = make(**settings)
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    return agent, cluster, gpus


def test_a_process_no_pod_holds_fails_the_pass_before_the_cordon() -> None:
    agent, cluster, gpus = _on_all_1g(gpu_release_timeout_s=2.0)
    gi_id, uuid = _ci(gpus, 3)
    gpus.add_process(3, 777, gi_id)  # a process outside Kubernetes
    mine = cluster.add_pod("work", "mine", NODE, gpu={"nvidia.com/mig-1g.10gb": 1})
    other_gi, other_uuid = _ci(gpus, 4)
    gpus.add_process(4, 778, other_gi)  # the pod's own process, on a device it holds
    agent.pod_devices = lambda: {("work", "mine"): frozenset({other_uuid})}
    writes = _record_writes(cluster)
    gpus.calls.clear()
    label(cluster, "all-7g.80gb")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s is not None
    reason = cluster.nodes[NODE].annotations[REASON]
    gi = gpus.observe().gpu(3).gpu_instances[0]
    assert reason == (
        f"GPU 3 (H100-80GB): 1g.10gb at {gi.placement} (GPU instance {gi.id}) must be destroyed "
        "but is in use by process(es) 777, which no pod holds: no drain would end them, so "
        "nothing was touched (stop them, and the agent retries)"
    )
    assert "778" not in reason  # the pod's process would go with the pod
    assert not cluster.evicted and mine in cluster.pods
    assert not any(w.get("unschedulable") for w in writes)
    assert not any((w.get("labels") or {}).get(STATE) == "pending" for w in writes)
    assert not gpus.calls
    assert_clean(cluster)


def test_a_process_its_pod_holds_is_drained_as_before() -> None:
    agent, cluster, gpus = _on_all_1g()
    gi_id, uuid = _ci(gpus, 3)
    gpus.add_process(3, 777, gi_id)
    pod = cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/mig-1g.10gb": 1})
    agent.pod_devices = lambda: {("work", "train"): frozenset({uuid})}
    end_processes_on_eviction(cluster, gpus, 3)
    label(cluster, "all-7g.80gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.evicted == [pod]


def test_a_process_that_leaves_meanwhile_is_waited_for_uncordoned() -> None:
    """A pod deleted just before the relabel: its process lingers a moment, held by no pod."""
    agent, cluster, gpus = _on_all_1g(gpu_release_timeout_s=30.0)
    gi_id, _ = _ci(gpus, 3)
    gpus.add_process(3, 777, gi_id)
    agent.pod_devices = dict
    writes = _record_writes(cluster)
    looks = [0]
    sleep = agent.clock.sleep

    def look(seconds: float) -> None:
        looks[0] += 1
        if looks[0] == 3:  # the container's teardown ends
            gpus.gpus[3] = dataclasses.replace(gpus.gpus[3], processes=())
        assert not cluster.nodes[NODE].unschedulable  # waited for before the cordon
        sleep(seconds)

    agent.clock = dataclasses.replace(agent.clock, sleep=look)
    label(cluster, "all-7g.80gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert looks[0] >= 3 and any(w.get("unschedulable") for w in writes)


def test_without_pod_resources_the_drain_and_re_plan_decide_as_before() -> None:
    agent, cluster, gpus = _on_all_1g(gpu_release_timeout_s=1.0)
    gi_id, _ = _ci(gpus, 3)
    gpus.add_process(3, 777, gi_id)
    pod = cluster.add_pod("work", "elsewhere", NODE, gpu={"nvidia.com/mig-1g.10gb": 1})
    label(cluster, "all-7g.80gb")  # make() gives no PodResources: who holds what is unknown
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED
    assert "777" in cluster.nodes[NODE].annotations[REASON]
    assert cluster.evicted == [pod]  # every GPU pod goes when the kubelet cannot tell
    assert_clean(cluster)


def test_ended_processes_are_those_on_what_the_plan_destroys() -> None:
    agent, cluster, gpus = make()
    catalog = agent.catalog
    assert catalog is not None

    def ended(layout: str) -> tuple[set[tuple[int, int, str, frozenset[str]]], str]:
        the_plan = planner.plan(
            catalog.get(layout), gpus.observe(), gpus.models(), destroy_in_use=True
        )
        found = planner.ended_processes(the_plan, gpus.observe())
        return (
            {(p.gpu, p.pid, p.destroyed, p.devices) for p in found},
            planner.describe_in_use(found),
        )

    gpus.add_process(0, 11, None)  # on the whole GPU
    whole = frozenset({gpus.observe().gpu(0).info.uuid})
    assert ended("all-1g.10gb") == (
        {(0, 11, "", whole)},
        "GPU 0 (H100-80GB): MIG mode change is in use by process(es) 11",
    )
    assert ended("all-disabled") == (set(), "")
    gpus.gpus[0] = dataclasses.replace(gpus.gpus[0], processes=())
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    gis = gpus.observe().gpu(0).gpu_instances
    for n, pid in ((2, 10), (3, 12)):
        gpus.add_process(0, pid, gis[n].id)
    gpus.add_process(1, 13, gpus.observe().gpu(1).gpu_instances[0].id)
    assert ended("all-1g.10gb") == (set(), "")  # nothing changes
    names = [f"1g.10gb at {gi.placement} (GPU instance {gi.id})" for gi in gis[2:4]]
    found, text = ended("all-7g.80gb")
    assert {(g, pid, d) for g, pid, d, _ in found if g == 0} == {
        (0, 10, names[0]),
        (0, 12, names[1]),
    }
    assert {pid for g, pid, _, _ in found if g == 1} == {13}
    assert (0, 10, names[0], frozenset({gis[2].compute_instances[0].uuid})) in found
    assert text.startswith(
        f"GPU 0 (H100-80GB): {names[0]}, {names[1]} must be destroyed but is "
        "in use by process(es) 10, 12; GPU 1 (H100-80GB): 1g.10gb at "
    )
    found, text = ended("all-disabled")
    assert {(g, pid, d) for g, pid, d, _ in found} == {(0, 10, ""), (0, 12, ""), (1, 13, "")}
    assert text == (
        "GPU 0 (H100-80GB): MIG mode change is in use by process(es) 10, 12; "
        "GPU 1 (H100-80GB): MIG mode change is in use by process(es) 13"
    )
