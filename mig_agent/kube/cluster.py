"""Cluster: what the agent, the drain and the ops commands need from the Kubernetes API.

Plain values in and out, so the reconcile logic is tested against an in-memory fake and runs
against the real API server through mig_agent.kube.client. No kubernetes import here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"


def is_gpu_resource(name: str) -> bool:
    # ".shared": what the device plugin calls shared (time-sliced, MPS) GPUs with renameByDefault
    return name in (GPU_RESOURCE, GPU_RESOURCE + ".shared") or name.startswith(MIG_RESOURCE_PREFIX)


@dataclass(frozen=True, slots=True)
class NodeCondition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    uid: str
    resource_version: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    unschedulable: bool
    allocatable: Mapping[str, str]
    capacity: Mapping[str, str] = field(default_factory=dict)
    conditions: tuple[NodeCondition, ...] = ()

    def gpu_resources(self) -> dict[str, int]:
        """The node's allocatable nvidia.com/gpu and nvidia.com/mig-* counts (zeros dropped)."""
        out: dict[str, int] = {}
        for k, v in self.allocatable.items():
            if is_gpu_resource(k) and str(v).isdigit() and int(v) > 0:
                out[k] = int(v)
        return out


@dataclass(frozen=True, slots=True)
class PodRef:
    namespace: str
    name: str
    uid: str = ""

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class PodView:
    ref: PodRef
    node: str
    phase: str
    ready: bool
    terminating: bool
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    owner_kinds: tuple[str, ...]
    node_selector: Mapping[str, str]
    gpu_requests: Mapping[str, int]  # GPU resources requested by any container or init container
    runtime_class: str = ""  # spec.runtimeClassName ("" for the cluster's default runtime)

    @property
    def uses_gpu(self) -> bool:
        return bool(self.gpu_requests)

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def is_mirror(self) -> bool:
        return "kubernetes.io/config.mirror" in self.annotations


class Cluster(Protocol):
    """Errors: KubeUnavailable (retryable), EvictionBlocked, KubeError."""

    def get_node(self, name: str) -> NodeView: ...

    def list_nodes(self, label_selector: str = "") -> list[NodeView]: ...

    def patch_node(
        self,
        name: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
        unschedulable: bool | None = None,
        expect_labels: Mapping[str, str | None] | None = None,
    ) -> NodeView:
        """Merge-patch the node. With ``expect_labels``, only while those labels have those
        values (None: absent), checked and written atomically; LabelsChanged otherwise."""
        ...

    def set_node_condition(self, name: str, condition: NodeCondition) -> None: ...

    def patch_node_resources(self, name: str, resources: Mapping[str, int]) -> None:
        """Set capacity and allocatable of these extended resources (device plugin's job)."""
        ...

    def watch_node(self, name: str, *, timeout_s: int) -> Iterator[NodeView]:
        """Yield the node on every change until the server closes the watch."""
        ...

    def list_pods(
        self, *, node: str | None = None, namespace: str | None = None, label_selector: str = ""
    ) -> list[PodView]: ...

    def get_pod(self, ref: PodRef) -> PodView | None:
        """The pod, or None when it is gone (or replaced by one with another UID)."""
        ...

    def evict(self, ref: PodRef) -> None:
        """Evict through the Eviction API; EvictionBlocked when a PDB forbids it."""
        ...

    def delete_pod(self, ref: PodRef) -> None: ...

    def emit_event(
        self, node: NodeView, *, reason: str, message: str, warning: bool = False
    ) -> None: ...
