"""We test how the agent retries a drain that fails, with the in-memory fakes of
tests/unit/test_agent.py: as an operator (or `kubectl drain` in a loop) would, the node stays
cordoned between tries, so no new pod lands on it only to be evicted at the next try; after
``drain_give_up_s`` from the first failed try the agent gives up: uncordoned, `failed` until the
label or config changes, and a new label value starts again."""

from __future__ import annotations

from mig_agent.agent import Outcome

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


def test_the_drain_is_given_up_after_the_setting_and_a_new_label_starts_again() -> None:
    agent, cluster, gpus = make(drain_timeout_s=30.0, drain_give_up_s=100.0)
    pod = cluster.add_pod("work", "guarded", NODE, gpu={"nvidia.com/gpu": 1})
    cluster.blocked[pod] = "keep-one"
    label(cluster, "all-balanced")
    tries = []
    while True:
        result = agent.reconcile_once()
        tries.append(agent.clock.now())
        assert result.outcome is Outcome.FAILED
        if result.retry_after_s is None:
            break
        assert cluster.nodes[NODE].unschedulable
        assert len(tries) < 10, tries
    node = cluster.nodes[NODE]
    # 30 s a try: the first failed at 30 s, the fifth (at 150 s) is past 100 s from it
    assert len(tries) == 5, tries
    reason = node.annotations[REASON]
    assert "PodDisruptionBudget work/keep-one" in reason and "given up after 12" in reason
    assert "(drain_give_up_s 100 s)" in reason and "change the layout label or the config" in reason
    assert "device plugin" not in reason  # no GPU changed: nothing to advertise again
    assert not gpus.calls and node.labels[STATE] == "failed"
    assert_clean(cluster)
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
    assert agent.reconcile_once().retry_after_s  # 30 s after it
    last = agent.reconcile_once()  # 60 s after it: given up
    assert last.retry_after_s is None and "given up" in cluster.nodes[NODE].annotations[REASON]
    assert_clean(cluster)
