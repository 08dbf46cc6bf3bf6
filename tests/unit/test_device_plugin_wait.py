"""We test how the device plugin's wait sees its new pod become Ready: on a watch of the node's
pods, as the DRA plugin's wait does (plugin_start), not by a list of the pods at every poll.

The case: the new plugin registers the layout's devices (the node lists them) seconds before its
pod turns Ready (8 s). Before: a list of the plugin pods (and a node watch) every 0.1 s, then up
to every poll_s: 38 of each, the Ready pod seen at 8.4 s; now one list and two watch slices, the
pod seen when it turns Ready.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator

import pytest

from mig_agent.agent.advertisers import device_plugin
from mig_agent.config.settings import Settings
from mig_agent.core.gpu_models import MODELS
from mig_agent.kube.cluster import PodsSeen, PodView
from mig_agent.node.waits import Clock
from tests.unit.fake_cluster import FakeCluster

from .fake_gpus import FakeGpus
from .test_agent import DP_NS, DP_SEL, NODE, PROFILES, FakeTime

READY_AT = 8.0  # when the new plugin pod turns Ready, seconds into the wait


class ReadyLater(FakeCluster):
    """The node's plugin pod turns Ready at ``ready_at``; a watch of the node's pods sees it
    then (an event, not a request)."""

    def __init__(self, t: FakeTime, ready_at: float) -> None:
        super().__init__()
        self.t, self.ready_at = t, ready_at
        self.calls: Counter[str] = Counter()

    def _turn_ready(self) -> None:
        if self.t.t >= self.ready_at:
            for ref, pod in list(self.pods.items()):
                self.pods[ref] = dataclasses.replace(pod, ready=True)

    def list_pods(self, **kw: object) -> list[PodView]:  # type: ignore[override]
        self.calls["list_pods"] += 1
        self._turn_ready()
        return super().list_pods(**kw)  # type: ignore[arg-type]

    def watch_pods(
        self, node: str, *, timeout_s: float, seen: PodsSeen | None = None
    ) -> Iterator[list[PodView]]:
        if seen is not None and seen.resource_version:  # goes on where the last one ended
            yield FakeCluster.list_pods(self, node=node)  # what the last watch saw: no request
        else:
            yield self.list_pods(node=node)
            if seen is not None:
                seen.resource_version = "1"
        self.calls["watch"] += 1
        end = self.t.t + timeout_s
        if self.t.t < self.ready_at <= end:
            self.t.t = self.ready_at
            self._turn_ready()
            yield FakeCluster.list_pods(self, node=node)  # an event, not a request
        self.t.t = max(self.t.t, end)


def test_a_plugin_pod_ready_after_its_registration_is_seen_on_a_watch() -> None:
    t = FakeTime()
    cluster = ReadyLater(t, READY_AT)
    gpus = FakeGpus([MODELS["H100-80GB"]] * 2)
    cluster.add_node(NODE, {}, {"nvidia.com/gpu": "2"})  # listed and allocatable already
    cluster.add_pod(DP_NS, "dp-new", NODE, labels=DP_SEL, owner="DaemonSet", ready=False)
    s = Settings(node_name=NODE, config=PROFILES, poll_s=1.0, device_plugin_timeout_s=60.0)
    clock = Clock(t.now, t.sleep)
    got = device_plugin.wait_resources(cluster, s, gpus, clock, gpus.models(), {"pod-old"})
    assert got == {"nvidia.com/gpu": 2}
    assert t.t == pytest.approx(READY_AT)  # when it turned Ready, not at a poll's tick
    # the wait's plugin lookups: one list and the watch's slices (polling: 38 lists)
    assert cluster.calls["list_pods"] <= 2, cluster.calls
    assert cluster.calls["watch"] <= 2, cluster.calls
