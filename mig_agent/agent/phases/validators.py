"""The GPU Operator's validators around a change, as MIG Manager deletes them: the CUDA and
device plugin validation pods before (they hold results for devices about to go), the operator
validator after, so that the operator validates the new devices (its DaemonSet brings a new pod,
which runs the validations again and recreates the others)."""

from __future__ import annotations

import structlog

from mig_agent.config.settings import Settings
from mig_agent.kube.cluster import Cluster, PodRef, PodView

log = structlog.get_logger(__name__)

BEFORE = ("nvidia-cuda-validator", "nvidia-device-plugin-validator")
AFTER = ("nvidia-operator-validator",)
APPS = (*BEFORE, *AFTER)
"""The values of the ``app`` label of the validator pods (the GPU Operator's names)."""


def delete(
    cluster: Cluster, s: Settings, apps: tuple[str, ...], pods: list[PodView] | None = None
) -> list[PodRef]:
    """Delete the pods of these validator ``apps`` on this node, in the GPU Operator's
    namespace (device_plugin_namespace), picked out of ``pods`` (the node's, as just listed)
    where given, else from one list; nothing when restart_validators is off."""
    if not s.restart_validators:
        return []
    if pods is None:
        pods = cluster.list_pods(
            node=s.node_name,
            namespace=s.device_plugin_namespace,
            label_selector=f"app in ({','.join(apps)})",
        )
    deleted: list[PodRef] = []
    for pod in pods:
        if (
            pod.terminating
            or pod.ref.namespace != s.device_plugin_namespace
            or pod.labels.get("app") not in apps
        ):
            continue
        cluster.delete_pod(pod.ref)
        deleted.append(pod.ref)
    if deleted:
        log.info("validators.deleted", pods=[str(p) for p in deleted])
    return deleted
