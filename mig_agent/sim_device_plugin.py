"""A simulated NVIDIA device plugin for the local cluster: one per simulated node.

Like the real plugin it reads the node's GPUs when its pod starts and advertises their MIG
devices as extended resources (mixed or single strategy); while its pod is gone the resources
drop to zero. Its "pod" is a DaemonSet pod that kwok runs on the node; this process watches for
a Ready pod with a new UID and then re-reads the simulated GPUs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from mig_agent.errors import MigAgentError
from mig_agent.gpu.backend import GpuBackend
from mig_agent.kube.cluster import Cluster, is_gpu_resource
from mig_agent.resources import expected_resources

log = structlog.get_logger(__name__)


def advertise(cluster: Cluster, node: str, gpus: GpuBackend, strategy: str) -> dict[str, int]:
    """Read the GPUs, set the node's GPU resources to them (others to 0); returns what was set."""
    want = expected_resources(gpus.observe(), gpus.models(), strategy)
    current = cluster.get_node(node)
    stale = {
        k: 0
        for k in {*current.capacity, *current.allocatable}
        if is_gpu_resource(k) and k not in want
    }
    cluster.patch_node_resources(node, {**stale, **want})
    return want


def withdraw(cluster: Cluster, node: str) -> None:
    current = cluster.get_node(node)
    cluster.patch_node_resources(
        node, {k: 0 for k in {*current.capacity, *current.allocatable} if is_gpu_resource(k)}
    )


def run(
    cluster: Cluster,
    open_gpus: Callable[[], GpuBackend],
    *,
    node: str,
    namespace: str,
    selector: str,
    strategy: str,
    stop: threading.Event,
    poll_s: float = 0.5,
) -> None:
    """Advertise on every new Ready plugin pod; withdraw while there is none."""
    advertised: str | None = None
    while not stop.is_set():
        try:
            pods = [
                p
                for p in cluster.list_pods(node=node, namespace=namespace, label_selector=selector)
                if p.ready and not p.terminating
            ]
            uid = pods[0].ref.uid if pods else None
            if uid and uid != advertised:
                gpus = open_gpus()
                try:
                    res = advertise(cluster, node, gpus, strategy)
                finally:
                    gpus.close()
                advertised = uid
                log.info("device_plugin.advertised", node=node, pod=pods[0].ref.name, resources=res)
            elif uid is None and advertised is not None:
                withdraw(cluster, node)
                advertised = None
                log.info("device_plugin.withdrawn", node=node)
        except MigAgentError as exc:
            log.warning("device_plugin.error", node=node, error=str(exc))
        stop.wait(poll_s)
