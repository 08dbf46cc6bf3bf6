"""The wait for a plugin's new pod, the device plugin's or the DRA plugin's: from a watch of
the node's pods (a list, then the changes; listed again when the watch expires), not a list at
every poll. A pod already there costs the one list."""

from __future__ import annotations

from collections.abc import Callable

from mig_agent.config.settings import Settings
from mig_agent.kube.cluster import Cluster, PodsSeen, PodView
from mig_agent.node.waits import Clock, watch_slices


def new_pod_started(
    cluster: Cluster,
    s: Settings,
    clock: Clock,
    deadline: float,
    started: Callable[[list[PodView]], bool],
) -> bool:
    """Whether ``started`` says so of the node's pods by ``deadline`` (clock time)."""
    seen = PodsSeen()
    looks = watch_slices(
        lambda span: cluster.watch_pods(s.node_name, timeout_s=span, seen=seen),
        clock,
        due=lambda: deadline,
        poll_s=s.poll_s,
    )
    try:
        for pods in looks:
            if started(pods):
                return True
            if clock.now() >= deadline:
                return False
    finally:
        looks.close()
    raise AssertionError("watch_slices never ends")  # pragma: no cover
