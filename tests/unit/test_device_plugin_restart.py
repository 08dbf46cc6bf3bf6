"""The device plugin is really restarted by a pass that finishes an interrupted one.

Issue 15's fault matrix: the API server restarted just after the agent resumed the node (or just
after the device plugin's resources matched) left the node `pending` for the whole
device_plugin_timeout_s. The pass lost the API server before it could write `success`, and its
failure report was lost too, so the node stayed `pending`; the next pass, with nothing left to
change on the GPUs, paused the device plugin's operand and resumed it within milliseconds (there
was nothing to drain in between). The DaemonSet controller never saw the pause, kept the old
plugin pod, and the agent waited for a new one that never came.

Here the DaemonSet controller lags as a real one does: it acts only when time passes (the agent
sleeps), not on every patch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mig_agent.agent import Outcome
from mig_agent.kube.cluster import NodeView
from mig_agent.node.waits import Clock
from tests.unit.fake_cluster import FakeCluster
from tests.unit.test_agent import CONFIG, DP_NS, NODE, STATE, assert_clean, make


def _plugin_uids(cluster: FakeCluster) -> set[str]:
    return {p.ref.uid for p in cluster.pods.values() if p.ref.namespace == DP_NS}


def _lagging_daemonset(agent: Any, cluster: FakeCluster) -> None:
    """The fake's DaemonSet controller and device plugin act only when the agent sleeps."""
    controller: Callable[[FakeCluster], None] | None = cluster.on_change
    assert controller is not None
    cluster.on_change = None
    clock: Clock = agent.clock

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if not cluster.down:
            controller(cluster)

    agent.clock = Clock(clock.now, sleep, clock.wait)


def _api_lost_after_the_resume(cluster: FakeCluster) -> None:
    """The API server goes away just after the patch that resumes the node (the uncordon)."""
    patch = cluster.patch_node

    def patch_then_lose(name: str, **kwargs: Any) -> NodeView:
        node = patch(name, **kwargs)
        annotations: Mapping[str, str | None] = kwargs.get("annotations") or {}
        if kwargs.get("unschedulable") is False and "mig-agent.dev/cordoned" in annotations:
            cluster.down = True
            cluster.patch_node = patch  # type: ignore[method-assign]
        return node

    cluster.patch_node = patch_then_lose  # type: ignore[method-assign]


def test_a_lost_success_is_written_and_the_plugin_left_alone() -> None:
    agent, cluster, gpus = make()
    _lagging_daemonset(agent, cluster)
    cluster.patch_node(NODE, labels={CONFIG: "all-balanced"})
    _api_lost_after_the_resume(cluster)
    first = agent.reconcile_once()
    # the GPUs hold the layout and the node is resumed, but neither success nor the failure
    # reached the API server: the node says `pending`
    assert first.outcome is Outcome.FAILED and first.retry_after_s is not None
    cluster.down = False
    assert cluster.nodes[NODE].labels[STATE] == "pending"
    before = _plugin_uids(cluster)
    calls = sum(gpus.calls.values())

    second = agent.reconcile_once()

    assert second.outcome is Outcome.NOOP, cluster.nodes[NODE].annotations
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert sum(gpus.calls.values()) == calls
    assert _plugin_uids(cluster) == before  # the plugin advertising the layout stays
    assert_clean(cluster)


def test_a_pass_finishing_an_interrupted_one_restarts_the_plugin_the_pause_left() -> None:
    """A pass killed while it waited for the device plugin leaves its marks (cordon, paused
    operands) with the plugin's operand already resumed; the next pass, with nothing to change
    on the GPUs, pauses and resumes the operand within milliseconds."""
    agent, cluster, gpus = make()
    _lagging_daemonset(agent, cluster)
    cluster.patch_node(NODE, labels={CONFIG: "all-balanced"})
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    cluster.patch_node(
        NODE,
        labels={STATE: "pending"},
        annotations={
            "mig-agent.dev/cordoned": "true",
            "mig-agent.dev/paused-operands": "nvidia.com/gpu.deploy.device-plugin",
        },
        unschedulable=True,
    )
    before = _plugin_uids(cluster)
    assert len(before) == 1
    calls = sum(gpus.calls.values())
    started = agent.clock.now()

    second = agent.reconcile_once()

    assert second.outcome is Outcome.APPLIED, cluster.nodes[NODE].annotations
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert sum(gpus.calls.values()) == calls  # nothing on the GPUs: the plugin step only
    after = _plugin_uids(cluster)
    assert len(after) == 1 and not after & before  # a new plugin pod advertises the layout
    # within moments, not device_plugin_timeout_s (300 s) later
    assert agent.clock.now() - started < 10
    assert_clean(cluster)
