"""Cluster: what the agent, the drain and the ops commands need from the Kubernetes API.

Plain values in and out, so the reconcile logic is tested against an in-memory fake and runs
against the real API server through mig_agent.kube.client. No kubernetes import here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from mig_agent.core.scheduling import NO_CONSTRAINTS, LabelSelector, PodConstraints, Taint

GPU_RESOURCE = "nvidia.com/gpu"
# the field manager of the agent's node patches: who set spec.unschedulable is told by it
AGENT_MANAGER = "mig-agent"
# what the API server names the Python client's patches without a field manager: the agent's
# before it named its own (an upgrade mid-pass must still undo its cordon)
_CLIENT_DEFAULT_MANAGER = "OpenAPI-Generator"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
KUEUE_GROUP = "kueue.x-k8s.io"
# v1beta2 first: Kueue v0.17's storage version (v1beta1 is served beside it, converted by
# Kueue's webhook); v1beta1 alone in older releases
KUEUE_VERSIONS = ("v1beta2", "v1beta1")


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
    # the field managers that own spec.unschedulable (managedFields): who cordoned the node
    unschedulable_by: tuple[str, ...] = ()
    taints: tuple[Taint, ...] = ()
    # per annotation, when the field manager that owns it last changed the node (managedFields'
    # time, RFC 3339): how old the agent's published GPU state is at most
    annotations_written: Mapping[str, str] = field(default_factory=dict)

    def gpu_resources(self) -> dict[str, int]:
        """The node's allocatable nvidia.com/gpu and nvidia.com/mig-* counts (zeros dropped):
        the healthy devices."""
        return _gpu_counts(self.allocatable)

    @property
    def cordoned_by_agent(self) -> bool:
        """Cordoned, and spec.unschedulable last set by the agent's own patch (or nobody is
        known to have set it: an object without managedFields)."""
        return self.unschedulable and all(
            m == AGENT_MANAGER or m.startswith(_CLIENT_DEFAULT_MANAGER)
            for m in self.unschedulable_by
        )

    def gpu_capacity(self) -> dict[str, int]:
        """The node's capacity of the same resources: every device a plugin lists, healthy or
        not (and, for the kubelet's stop grace period, those of a plugin that has gone)."""
        return _gpu_counts(self.capacity)


def _gpu_counts(resources: Mapping[str, str]) -> dict[str, int]:
    return {
        k: int(v)
        for k, v in resources.items()
        if is_gpu_resource(k) and str(v).isdigit() and int(v) > 0
    }


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """An object an Event is about (a Kueue Workload, say)."""

    kind: str
    namespace: str
    name: str
    uid: str = ""
    api_version: str = ""


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
    controller: str = ""  # "Kind/name" of the owner reference marked controller ("" if none)
    # spec.terminationGracePeriodSeconds (the API server's default is 30); for a pod being
    # deleted, metadata.deletionGracePeriodSeconds (what its kubelet gives it)
    grace_period_s: float = 30.0
    # the feature gates its containers run with (FEATURE_GATES env values, --feature-gates
    # flags): how NVIDIA's DRA plugin says it runs DynamicMIG
    feature_gates: tuple[str, ...] = ()
    # names of its emptyDir volumes: data kept on the node, lost when the pod is evicted
    empty_dirs: tuple[str, ...] = ()
    # what limits the nodes the scheduler may put it on (resources aside)
    constraints: PodConstraints = NO_CONSTRAINTS
    # the names of its ResourceClaims (in its namespace; a template's once the claim is made)
    claims: tuple[str, ...] = ()
    # status.startTime: when its kubelet took it, RFC 3339 ("" before)
    started: str = ""

    @property
    def uses_gpu(self) -> bool:
        return bool(self.gpu_requests)

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def is_mirror(self) -> bool:
        return "kubernetes.io/config.mirror" in self.annotations

    @property
    def controller_kind(self) -> str:
        return self.controller.split("/", 1)[0]


@dataclass(slots=True)
class PodsSeen:
    """Where a watch of the node's pods ended, for the next watch of the same wait to go on
    from without a list: the pods as of ``resource_version`` ("": list first). The watch keeps
    it; an expired version (the server's ERROR event, 410) empties it, so the next one lists.
    Only for one wait: the pods it waits for must be known from before the watch began."""

    resource_version: str = ""
    pods: dict[tuple[str, str], PodView] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PdbView:
    """A PodDisruptionBudget: which pods it covers and how many may go now."""

    namespace: str
    name: str
    selector: LabelSelector | None  # None: it covers no pod
    disruptions_allowed: int


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
        known: NodeView | None = None,
    ) -> NodeView:
        """Merge-patch the node. With ``expect_labels``, only while those labels have those
        values (None: absent), checked and written atomically; LabelsChanged otherwise.
        ``known``: the node as the caller last had it, tried first (no read of the node when
        it is still current; it only saves a request)."""
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

    def watch_pods(
        self, node: str, *, timeout_s: float, seen: PodsSeen | None = None
    ) -> Iterator[list[PodView]]:
        """The node's pods now, then again after every change, until ``timeout_s`` has passed
        or the server ends the watch (the caller looks again). With ``seen`` from an earlier
        watch of the same wait, "now" is where that one ended and no list is asked."""
        ...

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

    def list_resource_slices(self, node: str = "") -> list[dict[str, Any]]:
        """The ResourceSlices of ``node`` ("": of every node; resource.k8s.io/v1), as the API
        returns them."""
        ...

    def watch_resource_slices(
        self, node: str, *, timeout_s: float
    ) -> Iterator[list[dict[str, Any]]]:
        """The ResourceSlices of ``node`` now, then again after every change, until
        ``timeout_s`` has passed or the server ends the watch (the caller looks again)."""
        ...

    def list_resource_claims(self, namespace: str = "") -> list[dict[str, Any]]:
        """The ResourceClaims of ``namespace`` ("": of every namespace; resource.k8s.io/v1), as
        the API returns them."""
        ...

    def list_resource_claim_templates(self, namespace: str = "") -> list[dict[str, Any]]:
        """The ResourceClaimTemplates of ``namespace`` ("": of every namespace;
        resource.k8s.io/v1), as the API returns them."""
        ...

    def list_device_classes(self) -> list[dict[str, Any]]:
        """Every DeviceClass of the cluster (resource.k8s.io/v1), as the API returns them."""
        ...

    def list_pod_disruption_budgets(self) -> list[PdbView]:
        """Every PodDisruptionBudget of the cluster."""
        ...

    def device_taints_served(self) -> bool:
        """Whether the API server serves DeviceTaintRules in resource.k8s.io/v1 (Kubernetes
        1.37 on; asked once per client)."""
        ...

    def list_device_taints(self) -> list[dict[str, Any]]:
        """The DeviceTaintRules the agent made (its label), as the API returns them."""
        ...

    def create_device_taint(self, rule: Mapping[str, Any]) -> None:
        """Create the rule; one of that name the agent made, for the same device, is taken
        for it (a repeat after a lost answer)."""
        ...

    def delete_device_taint(self, name: str) -> None:
        """Delete the rule (gone already: done)."""
        ...

    def list_kueue(self, plural: str) -> list[dict[str, Any]]:
        """Kueue's objects of ``plural`` (``workloads``, ``resourceflavors``) in every
        namespace, as the API returns them: in the first of KUEUE_VERSIONS served; [] where
        Kueue is not installed."""
        ...


class KueueCluster(Cluster, Protocol):
    """What the MIG layout AdmissionCheck writes besides nodes: Kueue's objects, and Events
    about them."""

    def patch_kueue(
        self,
        plural: str,
        name: str,
        body: Mapping[str, Any],
        *,
        namespace: str = "",
        status: bool = False,
    ) -> dict[str, Any]:
        """Merge-patch Kueue's object (``status``: its status subresource) in v1beta2; the
        object as written. A body with ``metadata.resourceVersion`` is refused (KubeError,
        status 409) when the object changed since."""
        ...

    def emit_object_event(
        self, obj: ObjectRef, *, reason: str, message: str, warning: bool = False
    ) -> None: ...


class Leases(Protocol):
    """Leader election over a coordination.k8s.io Lease."""

    def hold_lease(self, namespace: str, name: str, holder: str, duration_s: int) -> bool:
        """Take or renew the Lease for ``holder``; False while another replica holds it."""
        ...


class PodRunner(Protocol):
    """What ``verify`` needs beyond Cluster: pods of its own, read as the API returns them, with
    their logs and events. Errors as Cluster's."""

    def create_pod(self, namespace: str, manifest: Mapping[str, Any]) -> PodRef:
        """Create the pod; its reference with the UID the API server gave it."""
        ...

    def read_pod(self, ref: PodRef) -> dict[str, Any] | None:
        """The pod as the API returns it, or None when it is gone."""
        ...

    def pod_log(self, ref: PodRef) -> str:
        """Its (first) container's log."""
        ...

    def pod_events(self, ref: PodRef) -> list[dict[str, Any]]:
        """The Events about the pod (core/v1), as the API returns them."""
        ...


class DeviceClassWriter(Protocol):
    """What ``mig-agent dra-classes`` writes: DeviceClasses (resource.k8s.io/v1), whole objects
    as the API takes them. Errors as Cluster's; a replace of a class changed since it was read
    (its ``metadata.resourceVersion``) is refused (KubeError, status 409)."""

    def create_device_class(self, manifest: Mapping[str, Any]) -> None: ...

    def replace_device_class(self, manifest: Mapping[str, Any]) -> None: ...

    def delete_device_class(self, name: str) -> None:
        """Delete it; one already gone is no error."""
        ...
