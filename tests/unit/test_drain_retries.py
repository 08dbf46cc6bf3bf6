"""We test how the agent retries a drain that fails, with the in-memory fakes of
tests/unit/test_agent.py: as an operator (or `kubectl drain` in a loop) would, the node stays
cordoned between tries, so no new pod lands on it only to be evicted at the next try; after
``drain_give_up_s`` from the first failed try the agent gives up: uncordoned (the pod a budget
keeps was never evicted), `failed`, no new drain while the pod it gave up on is still there (the
pass only looks, before anything is touched), and a new label value starts again. The window is
kept on the node (mig-agent.dev/guard): a restarted agent does not start it over."""

from __future__ import annotations

from dataclasses import replace

from mig_agent.agent import Agent, Outcome

from .fake_cluster import FakeCluster
from .test_agent import CONFIG, DP_LABEL, NODE, REASON, STATE, assert_clean, label, make
from .test_agent import record_patches as record_node_patches

CORDONED = "mig-agent.dev/cordoned"


def test_a_drain_retried_keeps_the_node_cordoned_between_tries_without_re_cordoning() -> None:
    agent, cluster, gpus = make(drain_timeout_s=30.0)
    pod = cluster.add_pod("work", "guarded", NODE, gpu={"nvidia.com/gpu": 1})
    cluster.blocked[pod] = "keep-one"
    label(cluster, "all-balanced")
    first = agent.reconcile_once()
    node = cluster.nodes[NODE]
    assert first.outcome is Outcome.FAILED and first.retry_after_s
    assert node.unschedulable and node.annotations[CORDONED] == "true"
    assert node.labels[DP_LABEL] == "true"  # operands resumed meanwhile
    assert "stays cordoned between tries" in node.annotations[REASON]
    patches = record_node_patches(cluster)
    assert agent.reconcile_once().outcome is Outcome.FAILED
    assert cluster.nodes[NODE].unschedulable
    # the retry cordons nothing again: no patch set spec.unschedulable, none uncordoned
    assert all(p.get("unschedulable") is None for p in patches), patches
    del cluster.blocked[pod]
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert not gpus.calls or cluster.nodes[NODE].labels[STATE] == "success"
    assert_clean(cluster)


def _until_given_up(agent: Agent, cluster: FakeCluster) -> list[float]:
    tries = []
    while "given up" not in cluster.nodes[NODE].annotations.get(REASON, ""):
        result = agent.reconcile_once()
        tries.append(agent.clock.now())
        assert result.outcome is Outcome.FAILED and result.retry_after_s
        assert len(tries) < 10, tries
        if "given up" not in cluster.nodes[NODE].annotations[REASON]:
            assert cluster.nodes[NODE].unschedulable
    return tries


def test_the_drain_is_given_up_after_the_setting_and_a_new_label_starts_again() -> None:
    agent, cluster, gpus = make(drain_timeout_s=30.0, drain_give_up_s=100.0)
    pod = cluster.add_pod("work", "guarded", NODE, gpu={"nvidia.com/gpu": 1})
    cluster.blocked[pod] = "keep-one"
    label(cluster, "all-balanced")
    tries = _until_given_up(agent, cluster)
    node = cluster.nodes[NODE]
    # 30 s a try: the first failed at 30 s, the fifth (at 150 s) is past 100 s from it
    assert len(tries) == 5, tries
    reason = node.annotations[REASON]
    assert "PodDisruptionBudget work/keep-one" in reason and "given up after 12" in reason
    assert "(drain_give_up_s 100 s)" in reason
    assert "no new try until work/guarded are gone or the layout label" in reason
    assert "uncordoned" not in reason
    assert "device plugin" not in reason  # no GPU changed: nothing to advertise again
    assert not gpus.calls and node.labels[STATE] == "failed"
    assert_clean(cluster)
    # looked at again now and then, but no new drain while the pod is there
    evictions = len(cluster.evicted)
    again = agent.reconcile_once()
    assert again.outcome is Outcome.FAILED and again.retry_after_s == agent.settings.backoff_max_s
    assert len(cluster.evicted) == evictions and not cluster.nodes[NODE].unschedulable
    # the later refusals still say what the drain failed on (found by the guard model): the
    # budget the operator must relax, not only the pod
    again_reason = cluster.nodes[NODE].annotations[REASON]
    assert "PodDisruptionBudget work/keep-one" in again_reason, again_reason
    assert "no new try until they are gone" in again_reason
    # a new layout asked for: tried again from the start, with the node cordoned again
    del cluster.blocked[pod]
    cluster.patch_node(NODE, labels={CONFIG: "all-1g.10gb"})
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert_clean(cluster)


def test_the_give_up_window_starts_again_for_another_layout() -> None:
    agent, cluster, gpus = make(drain_timeout_s=30.0, drain_give_up_s=50.0)
    pod = cluster.add_pod("work", "guarded", NODE, gpu={"nvidia.com/gpu": 1})
    cluster.blocked[pod] = "keep-one"
    label(cluster, "all-balanced")
    assert agent.reconcile_once().retry_after_s  # first failed try of all-balanced
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().retry_after_s  # the first of all-1g.10gb: not given up
    assert "given up" not in cluster.nodes[NODE].annotations[REASON]
    assert agent.reconcile_once().retry_after_s  # 30 s after it
    assert "given up" not in cluster.nodes[NODE].annotations[REASON]
    agent.reconcile_once()  # 60 s after it: given up
    assert "given up" in cluster.nodes[NODE].annotations[REASON]
    assert_clean(cluster)


def test_the_window_survives_a_restart_and_the_give_up_ends_when_the_pod_goes() -> None:
    """Issue 42 path 4: the window lived in the agent's memory, so a restarted agent (a new pod
    of the DaemonSet) started it over and retried for ever; and the give-up said "the node is
    uncordoned". Now the node keeps when the drain first failed; once the pod it gave up on is
    gone, the next look drains and applies."""
    agent, cluster, gpus = make(drain_timeout_s=30.0, drain_give_up_s=100.0)
    pod = cluster.add_pod("work", "guarded", NODE, gpu={"nvidia.com/gpu": 1})
    cluster.blocked[pod] = "keep-one"
    label(cluster, "all-balanced")
    agent.reconcile_once()
    agent.reconcile_once()  # 60 s in
    # a new agent over the same node and GPUs: only what the node holds survives
    restarted = Agent(agent.settings, cluster, gpus, agent.load_catalog, clock=agent.clock)
    restarted.reload_config()
    tries = _until_given_up(restarted, cluster)
    assert len(tries) <= 3, tries  # before: 5 more, the window begun again
    cluster.pods.pop(pod)
    cluster.blocked.clear()
    assert restarted.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert_clean(cluster)


def test_a_drain_given_up_on_a_pod_that_then_completes_goes_on() -> None:
    # found by the guard model: a pod given up on that completes (its object stays, phase
    # Succeeded) holds no device, yet was taken for one still on the node, the pass refused
    # for good and never looked at again
    agent, cluster, gpus = make(drain_timeout_s=30.0, drain_give_up_s=50.0)
    pod = cluster.add_pod("work", "guarded", NODE, gpu={"nvidia.com/gpu": 1})
    cluster.blocked[pod] = "keep-one"
    label(cluster, "all-balanced")
    _until_given_up(agent, cluster)
    cluster.pods[pod] = replace(cluster.pods[pod], phase="Succeeded")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.APPLIED, result
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert_clean(cluster)
