"""We test observe mode (``mig-agent run --observe``) with the in-memory fakes of our Cluster
and GpuBackend (the real API server, admission policy and simulated NVML: tests/e2e/
test_observe.py):

* a label that asks for a change is planned and said (an Event MIGObserved in the words of
  ``mig-agent plan``, and the annotation's JSON: GPUs that would change, instances destroyed and
  created, pods the drain would evict) and nothing else happens: no GPU call, no cordon, no
  eviction, no pause, no plugin restart, no state label, no condition;
* the pods said are the drain's own choice (only those on changing devices when the kubelet
  tells who holds what; the paused operands' left out), and a drain that would be refused says
  why;
* a state label someone else writes (MIG Manager) is left as it is, and an applied layout is
  said to need nothing without a ``success`` of ours;
* a layout that would fail says why, in a Warning Event; the same report is not said twice; no
  label takes the report away;
* the cluster the agent is given refuses every write but the Event and its annotation, so that a
  normal pass run by mistake changes nothing;
* without NVML at start, no condition is written; the setting comes from MIG_AGENT_OBSERVE and
  ``run --observe``;
* the annotation's JSON and the Event's words stay within the API's sizes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from mig_agent.agent import Agent, Outcome
from mig_agent.agent.marks import foreign_marks
from mig_agent.agent.observe import ObserveOnlyCluster
from mig_agent.config.profiles import load_catalog
from mig_agent.config.settings import Settings
from mig_agent.core import observe_report, planner
from mig_agent.core.errors import GpuUnavailable, ObserveOnlyRefused
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.labels import PAUSED
from mig_agent.core.observed import NodeState
from mig_agent.kube.cluster import NodeCondition, PodRef

from .fake_cluster import FakeCluster
from .fake_gpus import FakeGpus
from .test_agent import (
    CONFIG,
    DP_LABEL,
    DP_NS,
    NODE,
    STATE,
    _holding,
    _two_changed,
    label,
    make,
)

PLAN = "mig-agent.dev/observed-plan"


def observer(agent: Agent) -> Agent:
    """An agent in observe mode on the same node and GPUs as ``agent``."""
    watcher = Agent(
        agent.settings.replace(observe=True),
        agent.cluster,
        agent.gpus,
        lambda p: load_catalog([p]),
        clock=agent.clock,
    )
    watcher.reload_config()
    watcher.catalog = agent.catalog
    return watcher


def snapshot(cluster: FakeCluster, gpus: FakeGpus) -> tuple[Any, ...]:
    """Everything observe mode must leave as it is: the node but its observe annotation, the
    pods, and the GPUs as NVML would read them."""
    node = cluster.nodes[NODE]
    annotations = {k: v for k, v in node.annotations.items() if k != PLAN}
    return (
        dict(node.labels),
        annotations,
        node.unschedulable,
        node.conditions,
        dict(node.allocatable),
        set(cluster.pods),
        gpus.observe(),
    )


def report(cluster: FakeCluster) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(cluster.nodes[NODE].annotations[PLAN])
    return data


def observed_events(cluster: FakeCluster) -> list[tuple[str, str, str, bool]]:
    return [e for e in cluster.events if e[1] == "MIGObserved"]


def test_a_change_is_said_and_nothing_is_done() -> None:
    agent, cluster, gpus = make(observe=True)
    train = cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1})
    cluster.add_pod("work", "web", NODE)
    label(cluster, "all-1g.10gb")
    before = snapshot(cluster, gpus)
    assert agent.reconcile_once().outcome is Outcome.OBSERVED
    assert snapshot(cluster, gpus) == before
    assert not gpus.calls and not cluster.evicted
    assert STATE not in cluster.nodes[NODE].labels
    assert cluster.nodes[NODE].labels[DP_LABEL] == "true"  # not paused
    ((_, _, message, warning),) = cluster.events
    assert not warning
    assert message.startswith(
        "observe mode, nothing changed: would apply layout all-1g.10gb: 8 of 8 GPU(s) change: "
        "GPU 0 (H100-80GB): 1g.10gb x7 -- 15 step(s), 0 GPU instance(s) destroyed, 7 created; "
        "GPU 1 (H100-80GB)"
    )
    assert "would evict 1 GPU pod(s): work/train" in message
    data = report(cluster)
    assert data["layout"] == "all-1g.10gb" and data["changes"] is True
    assert data["summary"] == "layout all-1g.10gb: 8 of 8 GPU(s) change"
    assert [g["gpu"] for g in data["gpus"]] == list(range(8))
    gpu0 = data["gpus"][0]
    assert gpu0["mig_mode"] == "enabled" and gpu0["destroyed"] == []
    assert gpu0["created"] == [f"1g.10gb@{i}:1" for i in range(7)]
    assert data["evict"] == [str(train)]


def test_the_pods_said_are_the_drains_own_choice() -> None:
    """With the kubelet's PodResources, only the pods on devices that change, as the drain
    chooses them (tests/unit/test_agent.py's with_pod_resources test, the same pods)."""
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    cluster.add_pod("work", "on-gpu0", NODE, gpu={"nvidia.com/mig-1g.10gb": 1})
    on_gpu5 = cluster.add_pod("work", "on-gpu5", NODE, gpu={"nvidia.com/mig-1g.10gb": 7})
    unknown = cluster.add_pod("work", "unknown", NODE, gpu={"nvidia.com/mig-1g.10gb": 1})
    holds = {("work", "on-gpu0"): _holding(gpus, 0), ("work", "on-gpu5"): _holding(gpus, 5, 7)}
    _two_changed(agent)
    watcher = observer(agent)
    watcher.pod_devices = lambda: holds
    gpus.calls.clear()
    label(cluster, "two-changed")
    before = snapshot(cluster, gpus)
    assert watcher.reconcile_once().outcome is Outcome.OBSERVED
    assert snapshot(cluster, gpus) == before and not gpus.calls and not cluster.evicted
    data = report(cluster)
    assert sorted(data["evict"]) == sorted([str(on_gpu5), str(unknown)])
    assert [g["gpu"] for g in data["gpus"]] == [2, 5]
    gpu5 = data["gpus"][1]
    assert "mig_mode" not in gpu5 and len(gpu5["destroyed"]) == 2
    assert gpu5["created"] == ["2g.20gb@4:2"]
    assert cluster.nodes[NODE].labels[STATE] == "success"  # the earlier agent's, untouched


def test_a_paused_operand_is_no_eviction_and_a_refused_drain_says_why() -> None:
    agent, cluster, gpus = make(observe=True, evict_unmanaged_pods=False)
    cluster.add_pod(
        "gpu-operator", "dcgm", NODE, gpu={"nvidia.com/gpu": 1}, owner="DaemonSet",
        node_selector={"nvidia.com/gpu.deploy.dcgm": "true"},
    )  # fmt: skip
    cluster.patch_node(NODE, labels={"nvidia.com/gpu.deploy.dcgm": "true"})
    bare = cluster.add_pod("work", "bare", NODE, gpu={"nvidia.com/gpu": 1}, owner="")
    label(cluster, "all-1g.10gb")
    before = snapshot(cluster, gpus)
    assert agent.reconcile_once().outcome is Outcome.OBSERVED
    assert snapshot(cluster, gpus) == before
    data = report(cluster)
    assert data["evict"] == [str(bare)]
    (refused,) = data["refused"]
    assert str(bare) in refused
    ((_, _, message, warning),) = observed_events(cluster)
    assert warning and "but the drain would refuse to start" in message


def test_mig_managers_state_label_is_left_alone() -> None:
    """MIG Manager writes the state label: observe mode reads past it and never writes one,
    also not ``success`` for a layout that is in place."""
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    cluster.patch_node(NODE, labels={STATE: None})
    watcher = observer(agent)
    gpus.calls.clear()
    before = snapshot(cluster, gpus)
    assert watcher.reconcile_once().outcome is Outcome.OBSERVED
    assert snapshot(cluster, gpus) == before and STATE not in cluster.nodes[NODE].labels
    assert report(cluster) == {
        "layout": "all-1g.10gb",
        "changes": False,
        "summary": "layout all-1g.10gb: 0 of 8 GPU(s) change",
        "gpus": [],
    }
    assert observed_events(cluster)[-1][2] == (
        "observe mode, nothing changed: layout all-1g.10gb is applied; nothing to change"
    )
    for state in ("pending", "failed", "success"):  # MIG Manager's, as it goes
        cluster.patch_node(NODE, labels={CONFIG: "all-balanced", STATE: state})
        before = snapshot(cluster, gpus)
        assert watcher.reconcile_once().outcome is Outcome.OBSERVED
        assert snapshot(cluster, gpus) == before and not gpus.calls
        assert cluster.nodes[NODE].labels[STATE] == state


def test_a_layout_that_would_fail_says_why_and_writes_no_failure() -> None:
    agent, cluster, gpus = make(observe=True)
    label(cluster, "all-1g.10gbb")
    before = snapshot(cluster, gpus)
    result = agent.reconcile_once()
    assert result.outcome is Outcome.OBSERVED and result.retry_after_s is None
    assert snapshot(cluster, gpus) == before
    data = report(cluster)
    assert data["changes"] is False and "unknown layout 'all-1g.10gbb'" in data["error"]
    ((_, _, message, warning),) = observed_events(cluster)
    assert warning and "layout all-1g.10gbb would fail: unknown layout" in message


def test_the_same_report_is_said_once_and_no_label_takes_it_away() -> None:
    agent, cluster, gpus = make(observe=True)
    label(cluster, "all-1g.10gb")
    agent.reconcile_once()
    agent.reconcile_once()  # a resync: nothing new to say
    assert len(observed_events(cluster)) == 1
    cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1})
    agent.reconcile_once()
    assert len(observed_events(cluster)) == 2 and report(cluster)["evict"] == ["work/train"]
    cluster.patch_node(NODE, labels={CONFIG: None})
    assert agent.reconcile_once().outcome is Outcome.IDLE
    assert PLAN not in cluster.nodes[NODE].annotations
    assert STATE not in cluster.nodes[NODE].labels and not gpus.calls


def test_a_normal_pass_run_by_mistake_is_refused_by_the_cluster_it_was_given() -> None:
    """The observe agent's cluster refuses the first write of a normal pass (``pending``):
    a bug that ran one would change nothing."""
    agent, cluster, gpus = make(observe=True)
    cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1})
    label(cluster, "all-1g.10gb")
    assert isinstance(agent.cluster, ObserveOnlyCluster)
    before = snapshot(cluster, gpus)
    with pytest.raises(ObserveOnlyRefused, match="nvidia.com/mig.config.state"):
        agent._reconcile(cluster.nodes[NODE], "all-1g.10gb")
    assert snapshot(cluster, gpus) == before and not gpus.calls and not cluster.evicted


def test_the_observe_cluster_passes_only_the_event_and_its_annotation() -> None:
    agent, cluster, _ = make(observe=True)
    pod = cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1})
    guard = agent.cluster
    s = agent.settings
    node = cluster.nodes[NODE]
    refused = {
        "state label": lambda: guard.patch_node(NODE, labels={STATE: "success"}),
        "operand label": lambda: guard.patch_node(NODE, labels={DP_LABEL: PAUSED}),
        "cordon": lambda: guard.patch_node(NODE, unschedulable=True),
        "another annotation": lambda: guard.patch_node(
            NODE, annotations={PLAN: "{}", s.cordon_annotation: "true"}
        ),
        "another node": lambda: guard.patch_node("other", annotations={PLAN: "{}"}),
        "condition": lambda: guard.set_node_condition(
            NODE, NodeCondition(s.condition_type, "True", "Applied", "")
        ),
        "resources": lambda: guard.patch_node_resources(NODE, {"nvidia.com/gpu": 0}),
        "eviction": lambda: guard.evict(pod),
        "deletion": lambda: guard.delete_pod(PodRef(DP_NS, "dp")),
    }
    for what, write in refused.items():
        with pytest.raises(ObserveOnlyRefused):
            write()
        assert cluster.nodes[NODE] == node and pod in cluster.pods, what
    guard.patch_node(NODE, annotations={PLAN: '{"layout":"x"}'})
    guard.emit_event(node, reason="MIGObserved", message="m")
    assert cluster.nodes[NODE].annotations[PLAN] == '{"layout":"x"}'
    assert cluster.events[-1][1] == "MIGObserved"


def test_no_nvml_at_start_writes_no_condition() -> None:
    agent, cluster, gpus = make(observe=True)

    def gone() -> NodeState:
        raise GpuUnavailable("no NVML")

    gpus.observe = gone  # type: ignore[method-assign]
    agent.report_gpu_problem()
    assert agent.gpu_status.startswith("NVML unreachable") and not cluster.nodes[NODE].conditions


def test_a_normal_success_takes_a_stale_report_away() -> None:
    """Handed over, the agent's first pass removes observe mode's report: after a change, and
    where the layout is in place already (MIG Manager's ``success`` on the node)."""
    agent, cluster, gpus = make()
    cluster.patch_node(NODE, annotations={PLAN: '{"layout":"all-1g.10gb","changes":true}'})
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert PLAN not in cluster.nodes[NODE].annotations
    cluster.patch_node(NODE, annotations={PLAN: '{"layout":"all-1g.10gb","changes":false}'})
    calls = sum(gpus.calls.values())
    assert agent.reconcile_once().outcome is Outcome.NOOP
    assert PLAN not in cluster.nodes[NODE].annotations and sum(gpus.calls.values()) == calls
    assert cluster.nodes[NODE].labels[STATE] == "success"


def test_the_report_is_ours_for_the_watch_and_garbage_is_not() -> None:
    agent, cluster, _ = make(observe=True)
    label(cluster, "all-1g.10gb")
    agent.reconcile_once()
    s = agent.settings
    assert not foreign_marks(s, cluster.nodes[NODE])
    cluster.patch_node(NODE, annotations={PLAN: "{not json"})
    assert foreign_marks(s, cluster.nodes[NODE]) == {PLAN: "{not json"}


def test_the_setting_comes_from_the_environment_and_the_flag() -> None:
    from mig_agent import cli

    assert Settings.from_env({"MIG_AGENT_OBSERVE": "true"}).observe
    assert not Settings.from_env({}).observe
    args = cli.build_parser().parse_args(["run", "--observe"])
    assert args.observe
    assert Settings.from_env({}, observe=args.observe or None).observe
    plain = cli.build_parser().parse_args(["run"])
    assert Settings.from_env({"MIG_AGENT_OBSERVE": "true"}, observe=plain.observe or None).observe


def _big_plan() -> planner.Plan:
    gpus = FakeGpus([MODELS["H100-80GB"]] * 16)
    layout = load_catalog([Path(__file__).resolve().parents[2] / "profiles"]).get("all-1g.10gb")
    return planner.plan(layout, gpus.observe(), gpus.models())


def test_the_annotation_and_the_message_stay_within_the_apis_sizes() -> None:
    many = tuple(f"namespace-{i:03d}/a-rather-long-pod-name-{i:03d}" for i in range(200))
    r = observe_report.ObserveReport("all-1g.10gb", _big_plan(), many, ("x" * 5000,))
    text = observe_report.annotation(r)
    assert len(text) <= observe_report.ANNOTATION_CAP
    data = json.loads(text)
    assert data["changes"] and len(data["gpus"]) == 16 and data["evict_count"] == 200
    assert len(observe_report.message(r)) <= observe_report.MESSAGE_CAP
    small = dataclasses.replace(r, evict=many[:3], refused=())
    full = json.loads(observe_report.annotation(small))
    assert full["gpus"][0]["created"][0] == "1g.10gb@0:1"  # listed where the lists fit
    assert len(full["evict"]) == 3 and "evict_count" not in full
