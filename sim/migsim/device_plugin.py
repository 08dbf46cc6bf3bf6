"""A simulated NVIDIA device plugin for the local cluster: one per simulated node, where NVIDIA's
own plugin cannot run (not root: it needs a private mount namespace; or MIG_AGENT_DEVICE_PLUGIN=
simulated). Where it can, migsim.node_runtime runs NVIDIA's plugin and reuses this module's device
table (Allocations), GPU processes (PodProcesses) and sync_pods as the kubelet's side.

Like the real plugin it reads the node's GPUs when its pod starts and advertises their MIG
devices as extended resources (mixed or single strategy, multiplied and renamed by the sharing
section of its config file); it skips display GPUs, and advertises nothing where the real one
refuses to start (mig_agent.core.advertised.strategy_problem). While its pod is gone the resources
drop to zero. Its "pod" is a DaemonSet pod that kwok runs on the node; this process watches for
a Ready pod with a new UID and then re-reads the simulated GPUs.

With a pod-resources socket it also plays the kubelet's device manager: it assigns devices (GPU
UUIDs, MIG device UUIDs) to the GPU pods bound to its node and answers the kubelet's PodResources
API from that table, so the agent can tell which pods hold devices of which GPU. Nothing is
persisted: a restarted plugin assigns afresh.

Must not: change GPUs, or touch pods other than reading them.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from mig_agent.config.device_plugin import load_sharing
from mig_agent.core.advertised import (
    NO_SHARING,
    Sharing,
    expected_resources,
    is_skipped,
    plugin_devices,
    shared_as,
    strategy_problem,
)
from mig_agent.core.errors import MigAgentError
from mig_agent.gpu.backend import GpuBackend
from mig_agent.gpu.nvml import NvmlGpuBackend
from mig_agent.kube.cluster import GPU_RESOURCE, Cluster, PodRef, PodView, is_gpu_resource
from migsim import podresources_server
from migsim.nvml import state as simstate

log = structlog.get_logger(__name__)


def advertise(
    cluster: Cluster, node: str, gpus: GpuBackend, strategy: str, sharing: Sharing = NO_SHARING
) -> dict[str, int]:
    """Read the GPUs, set the node's GPU resources to what NVIDIA's plugin would advertise
    (others to 0); returns what was set. Where that plugin would refuse to start, log why and
    advertise nothing."""
    observed = gpus.observe()
    problem = strategy_problem(plugin_devices(observed, gpus.models()), strategy, sharing)
    if problem:
        log.warning("device_plugin.refused", node=node, strategy=strategy, reason=problem)
    want = expected_resources(observed, gpus.models(), strategy, sharing)
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


# -- device assignment --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Device:
    """One device the plugin offers: a whole GPU (gi_id = ci_id = -1) or a MIG device."""

    resource: str  # "nvidia.com/gpu", "nvidia.com/mig-3g.40gb", ...
    id: str  # what the kubelet reports: the GPU UUID or the MIG device UUID
    gpu: int
    gi_id: int = -1
    ci_id: int = -1
    healthy: bool = True  # an unhealthy device is offered (pods keep it) but never given out


def offered_devices(
    gpus: NvmlGpuBackend, strategy: str, sharing: Sharing = NO_SHARING
) -> tuple[Device, ...]:
    """The devices behind advertise()'s counts, in assignment order: GPU index, then GI, CI,
    then replica. A shared device is offered once per replica, as ``<uuid>::<replica>``."""
    observed = gpus.observe()
    if strategy_problem(plugin_devices(observed, gpus.models()), strategy, sharing):
        return ()
    skipped = {g.index for g in observed.gpus if is_skipped(g.info.name)}
    out = [
        Device(GPU_RESOURCE, g.info.uuid, g.index)
        for g in observed.gpus
        if not g.mig_current and g.index not in skipped
    ]
    for d in gpus.mig_devices():
        resource = _resource_of(d.name, strategy)
        if resource and d.gpu not in skipped:
            out.append(Device(resource, d.uuid, d.gpu, d.gi_id, d.ci_id))
    return tuple(
        r
        for d in sorted(out, key=lambda d: (d.gpu, d.gi_id, d.ci_id))
        for r in _replicas(d, sharing)
    )


def _resource_of(device_name: str, strategy: str) -> str | None:
    """The resource NVIDIA's plugin offers a MIG device as (k8s-device-plugin internal/rm):
    single strategy ``nvidia.com/gpu``; mixed ``nvidia.com/mig-<name>`` with "+" as ".", and none
    for a device that splits its GPU instance (``1c.3g.71gb``: no resource pattern matches)."""
    if strategy == "single":
        return GPU_RESOURCE
    if re.match(r"\d+c\.", device_name):
        return None
    return "nvidia.com/mig-" + device_name.replace("+", ".")


def _replicas(device: Device, sharing: Sharing) -> list[Device]:
    name, replicas = shared_as(device.resource, sharing)
    if name == device.resource and replicas == 1:
        return [device]
    return [
        dataclasses.replace(device, resource=name, id=f"{device.id}::{i}") for i in range(replicas)
    ]


@dataclass(frozen=True, slots=True)
class SyncResult:
    """What one Allocations.sync() changed, for the log."""

    allocated: dict[PodRef, tuple[Device, ...]] = field(default_factory=dict)
    released: list[PodRef] = field(default_factory=list)
    waiting: list[PodRef] = field(default_factory=list)  # newly found short of free devices


class Allocations:
    """Which devices each GPU pod of the node holds, kept as the kubelet's device manager does.

    A pod is given all the devices it requests when first seen with enough free devices (never
    a part), and keeps them until it is gone, finished or replaced by a pod with another UID.
    Thread-safe: the PodResources server reads it from its own threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offered: tuple[Device, ...] = ()
        self._pods: dict[PodRef, tuple[Device, ...]] = {}
        self._waiting: set[PodRef] = set()

    def offer(self, devices: Sequence[Device]) -> list[tuple[PodRef, Device]]:
        """The plugin (re-)advertised ``devices``; returns the assignments dropped because their
        device is gone. Such a pod keeps the rest and gets no replacement, as on a kubelet."""
        ids = {d.id for d in devices}
        dropped: list[tuple[PodRef, Device]] = []
        with self._lock:
            self._offered = tuple(devices)
            for ref, held in self._pods.items():
                dropped += [(ref, d) for d in held if d.id not in ids]
                self._pods[ref] = tuple(d for d in held if d.id in ids)
        return dropped

    def withdraw(self) -> None:
        """The plugin is gone: nothing more is given out; running pods keep their devices."""
        with self._lock:
            self._offered = ()

    def sync(self, pods: Iterable[PodView]) -> SyncResult:
        """Release what pods no longer on the node hold; give devices to new GPU pods."""
        result = SyncResult()
        live = {p.ref: p for p in pods if not p.finished}
        with self._lock:
            for ref in [r for r in self._pods if r not in live]:
                del self._pods[ref]
                result.released.append(ref)
            self._waiting &= live.keys()
            taken = {d.id for held in self._pods.values() for d in held}
            for ref, pod in sorted(live.items(), key=lambda kv: (kv[0].namespace, kv[0].name)):
                if ref in self._pods or not pod.uses_gpu or pod.terminating:
                    continue
                got = self._pick(pod.gpu_requests, taken)
                if got is None:
                    if ref not in self._waiting:
                        self._waiting.add(ref)
                        result.waiting.append(ref)
                    continue
                self._waiting.discard(ref)
                self._pods[ref] = got
                taken |= {d.id for d in got}
                result.allocated[ref] = got
        return result

    def adopt(self, held: Mapping[PodRef, Sequence[tuple[int, int, int]]]) -> list[PodRef]:
        """Give pods not in the table again the offered devices they are known to hold, by
        (GPU, GI, CI) (a restarted plugin's recovery, as a kubelet's from its checkpoint);
        returns the pods adopted. A pod one of whose devices is not offered is left out."""
        adopted = []
        with self._lock:
            taken = {d.id for got in self._pods.values() for d in got}
            for ref, keys in held.items():
                if ref in self._pods or not keys:
                    continue
                devices: list[Device] = []
                for key in keys:  # time-sliced replicas share a key: take a free one
                    free = next(
                        (
                            d
                            for d in self._offered
                            if (d.gpu, d.gi_id, d.ci_id) == key
                            and d.id not in taken
                            and d not in devices
                        ),
                        None,
                    )
                    if free is None:
                        break
                    devices.append(free)
                else:
                    self._pods[ref] = tuple(devices)
                    taken |= {d.id for d in devices}
                    self._waiting.discard(ref)
                    adopted.append(ref)
        return adopted

    def _pick(self, requests: Mapping[str, int], taken: set[str]) -> tuple[Device, ...] | None:
        """The first free devices of each requested resource, or None when one is short."""
        got: list[Device] = []
        for resource, count in sorted(requests.items()):
            free = [
                d
                for d in self._offered
                if d.resource == resource and d.healthy and d.id not in taken
            ]
            if len(free) < count:
                return None
            got += free[:count]
        return tuple(got)

    def pods(self) -> set[PodRef]:
        with self._lock:
            return set(self._pods)

    def release(self, ref: PodRef) -> None:
        """Take back what ``ref`` holds (its allocation failed); it is tried again at the next
        sync."""
        with self._lock:
            self._pods.pop(ref, None)

    def held(self) -> dict[PodRef, tuple[Device, ...]]:
        with self._lock:
            return dict(self._pods)

    def by_pod(self) -> dict[tuple[str, str], dict[str, list[str]]]:
        """(namespace, pod) -> {resource: device ids}: the PodResources List answer."""
        with self._lock:
            out: dict[tuple[str, str], dict[str, list[str]]] = {}
            for ref, held in self._pods.items():
                resources = out.setdefault((ref.namespace, ref.name), {})
                for d in held:
                    resources.setdefault(d.resource, []).append(d.id)
            return out

    def allocatable(self) -> dict[str, list[str]]:
        """resource -> every offered device id: the GetAllocatableResources answer."""
        with self._lock:
            out: dict[str, list[str]] = {}
            for d in self._offered:
                out.setdefault(d.resource, []).append(d.id)
            return out


class PodProcesses:
    """The simulated GPU processes of the node's GPU pods: one on each device a pod holds, as a
    container keeps a CUDA context on every device it was given, so that NVML shows a node with
    running GPU pods as busy. A process ends when its pod is gone or finished (not when it
    starts terminating: it runs through its grace period). Processes are owned by the pod's UID,
    so a restarted plugin finds those of pods still running and gives the pods the same devices.
    """

    PREFIX = "pod/"

    def __init__(self, sim_state: str) -> None:
        self.sim_state = sim_state

    def held(self, pods: Iterable[PodView]) -> dict[PodRef, list[tuple[int, int, int]]]:
        """(GPU, GI, CI) of the devices each of ``pods`` holds a process on (-1: whole GPU)."""
        owned = simstate.processes_by_owner(self.sim_state)
        out: dict[PodRef, list[tuple[int, int, int]]] = {}
        for pod in pods:
            for gpu, p in owned.get(self.PREFIX + pod.ref.uid, []):
                gi = -1 if p.gi is None else p.gi
                ci = -1 if p.ci is None else p.ci
                out.setdefault(pod.ref, []).append((gpu, gi, ci))
        return out

    def start(self, ref: PodRef, devices: Iterable[Device]) -> list[int]:
        return [
            simstate.start_process(
                self.sim_state,
                d.gpu,
                gi=None if d.gi_id < 0 else d.gi_id,
                ci=None if d.ci_id < 0 else d.ci_id,
                owner=self.PREFIX + ref.uid,
            )
            for d in devices
        ]

    def end_all_but(self, live: Iterable[PodView]) -> int:
        """End the processes of every pod not in ``live``; returns how many ended."""
        keep = {self.PREFIX + p.ref.uid for p in live}
        gone = [
            o
            for o in simstate.processes_by_owner(self.sim_state)
            if o.startswith(self.PREFIX) and o not in keep
        ]
        return simstate.end_processes(self.sim_state, gone)


# -- the loop -----------------------------------------------------------------------------------


def run(
    cluster: Cluster,
    open_gpus: Callable[[], NvmlGpuBackend],
    *,
    node: str,
    namespace: str,
    selector: str,
    strategy: str,
    stop: threading.Event,
    poll_s: float = 0.5,
    pod_resources_socket: str | None = None,
    processes: PodProcesses | None = None,
    config_file: str = "",
) -> None:
    """Advertise on every new Ready plugin pod; withdraw while there is none.

    With ``pod_resources_socket``, also assign devices to the node's GPU pods and serve the
    kubelet's PodResources API there until ``stop`` is set; with ``processes`` as well, each GPU
    pod holds a simulated process on each of its devices while it runs. ``config_file``: the
    device plugin's config (NVIDIA's format), whose sharing section applies.
    """
    table: Allocations | None = None
    server: podresources_server.Server | None = None
    if pod_resources_socket:
        table = Allocations()
        try:
            server = podresources_server.serve(
                pod_resources_socket, table.by_pod, allocatable=table.allocatable
            )
        except MigAgentError as exc:
            # Advertising still works without it; the agent then drains every GPU pod.
            log.warning("device_plugin.pod_resources_error", node=node, error=str(exc))
            table = None
        else:
            log.info("device_plugin.pod_resources_serving", node=node, socket=server.socket_path)
    advertised: str | None = None
    try:
        while not stop.is_set():
            try:
                pods = [
                    p
                    for p in cluster.list_pods(
                        node=node, namespace=namespace, label_selector=selector
                    )
                    if p.ready and not p.terminating
                ]
                uid = pods[0].ref.uid if pods else None
                if uid and uid != advertised:
                    # read at every start, as the real plugin reads its config file
                    sharing = load_sharing(config_file) if config_file else NO_SHARING
                    gpus = open_gpus()
                    try:
                        res = advertise(cluster, node, gpus, strategy, sharing)
                        devices = offered_devices(gpus, strategy, sharing) if table else ()
                    finally:
                        gpus.close()
                    advertised = uid
                    log.info(
                        "device_plugin.advertised", node=node, pod=pods[0].ref.name, resources=res
                    )
                    for ref, device in table.offer(devices) if table else ():
                        log.info(
                            "device_plugin.device_gone",
                            node=node,
                            pod=str(ref),
                            device=device.id,
                            resource=device.resource,
                        )
                elif uid is None and advertised is not None:
                    withdraw(cluster, node)
                    if table:
                        table.withdraw()
                    advertised = None
                    log.info("device_plugin.withdrawn", node=node)
                if table:
                    sync_pods(node, table, processes, cluster.list_pods(node=node))
            except MigAgentError as exc:
                log.warning("device_plugin.error", node=node, error=str(exc))
            stop.wait(poll_s)
    finally:
        if server:
            server.stop()


def sync_pods(
    node: str,
    table: Allocations,
    processes: PodProcesses | None,
    pods: list[PodView],
    *,
    admit: Callable[[PodRef, tuple[Device, ...]], bool] | None = None,
) -> SyncResult:
    """Release the devices of pods gone, give devices to new GPU pods (and start their
    processes), end the processes of pods gone; returns what changed.

    ``admit(pod, devices)``, when given, is called for each new allocation before its processes
    start (the kubelet's Allocate call to the plugin); False takes the devices back, and the pod
    is tried again at the next sync."""
    live = [p for p in pods if not p.finished]
    if processes:
        held = processes.held(live)
        adopted = table.adopt(held)
        for ref in adopted:
            log.info("device_plugin.adopted", node=node, pod=str(ref))
        # a pod whose processes hold devices not offered now must not be given others as well
        unadopted = held.keys() - set(adopted) - table.pods()
        pods = [p for p in pods if p.ref not in unadopted]
    result = table.sync(pods)
    _log_sync(node, result)
    if admit is not None:
        for ref, devices in list(result.allocated.items()):
            if not admit(ref, devices):
                table.release(ref)
                del result.allocated[ref]
    if processes:
        for ref, devices in result.allocated.items():
            pids = processes.start(ref, devices)
            log.info("device_plugin.processes_started", node=node, pod=str(ref), pids=pids)
        if ended := processes.end_all_but(live):
            log.info("device_plugin.processes_ended", node=node, processes=ended)
    return result


def _log_sync(node: str, result: SyncResult) -> None:
    for ref, devices in result.allocated.items():
        log.info(
            "device_plugin.allocated", node=node, pod=str(ref), devices=[d.id for d in devices]
        )
    for ref in result.released:
        log.info("device_plugin.released", node=node, pod=str(ref))
    for ref in result.waiting:
        log.info(
            "device_plugin.unallocatable", node=node, pod=str(ref), reason="not enough free devices"
        )
