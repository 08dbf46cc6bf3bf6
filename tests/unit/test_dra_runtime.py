"""The DRA follower's decisions (migsim.cluster.dra_runtime), without processes or a cluster.

We test these aspects: which pod counts as running (phase Running, not being deleted) and what
feature gates it gives (its `gpus` container's FEATURE_GATES only); the plugin starts with a pod,
starts afresh for a pod with a new UID even without a gap between the two, stops when no pod is
left; one that exits (or cannot start) while its pod runs is restarted after a doubling back-off,
reset by a new pod.
"""

from __future__ import annotations

from typing import Any

import pytest
from migsim.cluster import dra_plugin
from migsim.cluster.dra_runtime import Follower, PluginPod, running_pod
from migsim.cluster.errors import DevClusterError

A, B = PluginPod("dra-a", "uid-a", ""), PluginPod("dra-b", "uid-b", "DynamicMIG=true")


def _pod(
    name: str, *, phase: str = "Running", deleting: bool = False, env: Any = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}", "creationTimestamp": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    containers = [{"name": "other", "env": [{"name": "FEATURE_GATES", "value": "Nope=true"}]}]
    containers.append({"name": dra_plugin.CONTAINER, **({"env": env} if env else {})})
    return {"metadata": meta, "spec": {"containers": containers}, "status": {"phase": phase}}


def test_a_running_pod_is_one_running_and_not_being_deleted() -> None:
    assert running_pod([_pod("a", phase="Pending"), _pod("b", deleting=True)]) is None
    assert running_pod([_pod("b"), _pod("a")]) == PluginPod("a", "uid-a", "")  # the oldest
    gated = _pod("c", env=[{"name": "FEATURE_GATES", "value": "DynamicMIG=true"}])
    assert running_pod([gated]) == PluginPod("c", "uid-c", "DynamicMIG=true")


class FakePlugin:
    def __init__(self, pod: PluginPod) -> None:
        self.pod, self.alive, self.stopped = pod, True, False

    def running(self) -> bool:
        return self.alive and not self.stopped

    def exit_code(self) -> int | None:
        return None if self.running() else 1

    def stop(self) -> None:
        self.stopped = True


class Node:
    """A follower over fake plugins and a fake clock."""

    def __init__(self, *, failing: int = 0) -> None:
        self.now, self.failing = 0.0, failing
        self.started: list[FakePlugin] = []
        self.follower = Follower("node", self.launch, clock=lambda: self.now, backoff=(1.0, 4.0))

    def launch(self, pod: PluginPod) -> FakePlugin:
        if self.failing:
            self.failing -= 1
            raise DevClusterError("no plugin")
        self.started.append(FakePlugin(pod))
        return self.started[-1]

    def at(self, now: float, pod: PluginPod | None) -> None:
        self.now = now
        self.follower.step(pod)


def test_the_plugin_runs_for_each_pod_and_stops_without_one() -> None:
    node = Node()
    node.at(0, None)
    assert node.started == []
    node.at(1, A)
    node.at(2, A)
    assert [p.pod for p in node.started] == [A]
    node.at(3, B)  # replaced in one poll: a new UID is a new container
    assert [p.pod for p in node.started] == [A, B]
    assert node.started[0].stopped and not node.started[1].stopped
    node.at(4, None)
    assert node.started[1].stopped and len(node.started) == 2


def test_an_exited_plugin_is_restarted_after_a_doubling_back_off() -> None:
    node = Node()
    node.at(0, A)
    for exit_at, restart_at in ((10.0, 11.0), (20.0, 22.0), (30.0, 34.0), (40.0, 44.0)):
        node.started[-1].alive = False
        starts = len(node.started)
        node.at(exit_at, A)
        node.at(restart_at - 0.1, A)
        assert len(node.started) == starts, exit_at
        node.at(restart_at, A)
        assert len(node.started) == starts + 1, exit_at
    node.started[-1].alive = False
    node.at(50, A)
    node.at(50.5, B)  # a new pod starts at once, and the back-off starts over
    assert node.started[-1].pod == B
    assert node.follower.backoff == 1.0


@pytest.mark.parametrize("failing", [1, 2])
def test_a_plugin_that_cannot_start_is_tried_again(failing: int) -> None:
    node = Node(failing=failing)
    node.at(0, A)
    assert node.started == []
    now = 0.0
    for _ in range(10):
        now += 0.5
        node.at(now, A)
    assert [p.pod for p in node.started] == [A]
