"""The DRA step of a change, on a node where NVIDIA's DRA kubelet plugin publishes the GPUs
(driver gpu.nvidia.com) instead of a device plugin: what refuses such a node, who holds which
device (ResourceClaims allocated from the node's pool), and the plugin's restart and the wait
until the node's ResourceSlice lists the layout's devices (the plugin reads the GPUs only when
it starts)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from mig_agent.agent.advertisers import device_plugin, plugin_start
from mig_agent.config.settings import Settings
from mig_agent.core import dra_devices
from mig_agent.core.advertised import Devices, plugin_devices
from mig_agent.core.dra_devices import Kind
from mig_agent.core.errors import DraPluginMissing, DraPluginTimeout, KubeError
from mig_agent.core.gpu_models import GpuModel
from mig_agent.core.observed import NodeState
from mig_agent.core.plan_text import first_few
from mig_agent.gpu.backend import GpuBackend
from mig_agent.kube.cluster import Cluster, PodView
from mig_agent.node.waits import Clock, watch_slices

log = structlog.get_logger(__name__)


def plugin_pods(cluster: Cluster, s: Settings, pods: list[PodView] | None = None) -> list[PodView]:
    """The node's DRA kubelet plugin pods, but those on their way out ([] with ``dra`` off);
    picked out of ``pods`` (every pod of the node) where given."""
    return [p for p in _all_plugin_pods(cluster, s, pods) if not p.terminating] if s.dra else []


def _all_plugin_pods(cluster: Cluster, s: Settings, pods: list[PodView] | None) -> list[PodView]:
    if pods is not None:
        return device_plugin.select(pods, s.dra_plugin_namespace, s.dra_plugin_selector)
    return cluster.list_pods(
        node=s.node_name, namespace=s.dra_plugin_namespace, label_selector=s.dra_plugin_selector
    )


@dataclass(frozen=True)
class DraNode:
    pods: list[PodView]  # the DRA plugin's pods on the node, but those on their way out
    slices: list[dict[str, Any]]  # the node's ResourceSlices


def find(cluster: Cluster, s: Settings, node_pods: list[PodView]) -> DraNode | None:
    """The node's DRA plugin pods (out of ``node_pods``, every pod of the node) and slices;
    None when it is no DRA node: no pod of the DRA plugin there (in any phase: one going, one
    coming), and no slice of the driver for it. A running pod alone would not do: between a
    plugin pod's deletion and its replacement a DRA node would pass for a node of no plugin,
    its slice stale, its claims not drained."""
    if not s.dra:
        return None
    pods = _all_plugin_pods(cluster, s, node_pods)
    try:
        slices = cluster.list_resource_slices(s.node_name)
    except KubeError as exc:
        if exc.context.get("status") != 404:
            raise
        # an API server before Kubernetes 1.34 serves no resource.k8s.io/v1: said plainly, and
        # the node is known by its plugin pods alone
        log.info(
            "dra.api_missing",
            reason="the API server serves no resource.k8s.io/v1 (Kubernetes before 1.34): "
            "no ResourceSlices to read; the node counts as a DRA node only where a pod of "
            f"NVIDIA's DRA kubelet plugin runs ({s.dra_plugin_namespace}, "
            f"{s.dra_plugin_selector})",
        )
        slices = []
    if not pods and not dra_devices.publishes(slices, s.node_name):
        return None
    return DraNode([p for p in pods if not p.terminating], slices)


def refusal(s: Settings, found: DraNode, node_pods: list[PodView]) -> str:
    """Why the agent must not change this DRA node's GPUs, or "": a driver running DynamicMIG
    (it makes and destroys the MIG devices itself: said by its pod's feature gates, or by the
    shared counters of its slices), or NVIDIA's device plugin beside it (two owners of the same
    devices: NVIDIA's DRA chart refuses to deploy so)."""
    where = f"{s.dra_plugin_namespace}, {s.dra_plugin_selector}"
    dynamic = [str(p.ref) for p in found.pods if dra_devices.dynamic_mig(p.feature_gates)]
    if dynamic or dra_devices.partitionable(found.slices, s.node_name):
        which = ", ".join(dynamic) or "its ResourceSlices share counters between devices"
        return (
            f"NVIDIA's DRA driver runs with DynamicMIG on this node ({which}): it "
            "creates a MIG device per claim and destroys at start every MIG device it did not "
            "create, so a static layout would not survive it; nothing was touched (remove the "
            "mig.config label, or turn DynamicMIG off)"
        )
    both = device_plugin.plugins_among(s, node_pods)
    if both:
        return (
            f"both NVIDIA's device plugin ({', '.join(str(p.ref) for p in both)}) and its DRA "
            f"kubelet plugin ({where}) run on this node, which NVIDIA does not support (each "
            "would hand out the same devices); nothing was touched"
        )
    return ""


def plugin_missing(s: Settings, found: DraNode, layout: str) -> DraPluginMissing:
    """The refusal of a change on a DRA node known only by its slices: no plugin pod where the
    settings look (the chart's defaults name the GPUCluster's pods, not those of NVIDIA's DRA
    chart), so none could be restarted after it, and the slice would go on listing devices that
    are gone."""
    return DraPluginMissing(
        f"layout {layout}: NVIDIA's DRA driver publishes this node's GPUs (ResourceSlices of "
        f"{dra_devices.DRIVER}), but no pod of its kubelet plugin is on the node in namespace "
        f"{s.dra_plugin_namespace} with selector {s.dra_plugin_selector}: it could not be "
        "restarted after a change, and its slice would go on listing devices that are gone; "
        "nothing was touched (point the chart's dra.namespace and dra.selector at the plugin's "
        "pods; NVIDIA's DRA chart runs them in dra-driver-nvidia-gpu, labelled "
        "dra-driver-nvidia-gpu-component=kubelet-plugin)",
        layout=layout,
        slices=len(found.slices),
    )


def holders(
    cluster: Cluster, s: Settings, node_pods: list[PodView], slices: list[dict[str, Any]]
) -> dict[tuple[str, str], frozenset[str]]:
    """(namespace, pod) -> the UUIDs of this node's devices its ResourceClaims were allocated.
    Only the claims the node's pods name (their spec and ``status.resourceClaimStatuses``) are
    read, one list per namespace of theirs: none for a node whose pods hold no claim, never
    every claim of the cluster."""
    named = {(p.ref.namespace, c) for p in node_pods for c in p.claims}
    claims = [
        c
        for namespace in sorted({ns for ns, _ in named})
        for c in cluster.list_resource_claims(namespace)
        if (namespace, (c.get("metadata") or {}).get("name", "")) in named
    ]
    return dra_devices.claim_holders(claims, slices, s.node_name)


def expected(state: NodeState, models: Mapping[int, GpuModel]) -> Counter[Kind]:
    """What the plugin publishes for the GPUs as ``state`` reads them."""
    devices: Devices = plugin_devices(state, models)
    return dra_devices.expected_devices(devices)


def published(cluster: Cluster, s: Settings) -> Counter[Kind]:
    return dra_devices.published_devices(cluster.list_resource_slices(s.node_name), s.node_name)


def devices_ok(
    cluster: Cluster,
    s: Settings,
    gpus: GpuBackend,
    models: Mapping[int, GpuModel],
    slices: list[dict[str, Any]] | None = None,
) -> bool:
    """True when the node's slice lists the devices of the GPUs as they are, by kind and, where
    the slice names them, by UUID (``slices``: the node's, as the pass read them)."""
    if slices is None:
        slices = cluster.list_resource_slices(s.node_name)
    state = gpus.observe()
    want = expected(state, models)
    return dra_devices.published_devices(slices, s.node_name) == want and not (
        dra_devices.stale_uuids(slices, s.node_name, dra_devices.held_uuids(state))
    )


def restart(cluster: Cluster, s: Settings) -> set[str]:
    """Delete the DRA plugin pods (their DaemonSet brings new ones, which re-read the GPUs);
    the UIDs of those deleted."""
    pods = plugin_pods(cluster, s)
    for p in pods:
        cluster.delete_pod(p.ref)
    log.info("dra_plugin.restarted", pods=[p.ref.name for p in pods])
    return {p.ref.uid for p in pods}


def wait_devices(
    cluster: Cluster,
    s: Settings,
    gpus: GpuBackend,
    clock: Clock,
    models: Mapping[int, GpuModel],
    old_plugins: set[str],
) -> dict[str, int]:
    """Wait for a new DRA plugin pod (one not there before: the slice it left is stale) to run
    and for the node's slice to list the devices of the GPUs as they are; DraPluginTimeout
    naming what is missing or extra. Returns the devices, named by kind. Both from watches
    (the node's pods, then its slices): the plugin's start costs a list and a watch of each,
    not two lists every poll."""
    state = gpus.observe()  # the GPUs do not change while it waits: read once
    want, held = expected(state, models), dra_devices.held_uuids(state)
    deadline = clock.now() + s.device_plugin_timeout_s
    new_pod = _new_plugin_runs(cluster, s, clock, deadline, old_plugins)

    def stale(slices: list[dict[str, Any]]) -> frozenset[str]:
        return dra_devices.stale_uuids(slices, s.node_name, held)

    def done(slices: list[dict[str, Any]]) -> bool:
        have = dra_devices.published_devices(slices, s.node_name)
        return new_pod and have == want and not stale(slices)

    slices = _slices_when(cluster, s, clock, deadline, done)
    have = dra_devices.published_devices(slices, s.node_name)
    if done(slices):
        log.info("dra_plugin.devices_match", devices=dra_devices.named(want))
        return dra_devices.named(want)
    differ = stale(slices) if have == want else frozenset()
    raise DraPluginTimeout(
        _timeout_problem(s, new_pod=new_pod, stale=differ, want=want, have=have),
        expected=dra_devices.named(want),
        advertised=dra_devices.named(have),
    )


def _timeout_problem(
    s: Settings, *, new_pod: bool, stale: frozenset[str], want: Counter[Kind], have: Counter[Kind]
) -> str:
    if not new_pod:
        return (
            f"no new DRA kubelet plugin pod ({s.dra_plugin_namespace}, "
            f"{s.dra_plugin_selector}) ran on the node within "
            f"{s.device_plugin_timeout_s:.0f} s"
        )
    if stale:
        return (
            f"the node's ResourceSlice (driver {dra_devices.DRIVER}) lists the layout's "
            f"kinds after {s.device_plugin_timeout_s:.0f} s, but not the devices the "
            f"GPUs hold: {len(stale)} UUID(s) differ ({first_few(stale)}): a stale slice"
        )
    return (
        f"the node's ResourceSlice (driver {dra_devices.DRIVER}) does not list the "
        f"layout's devices after {s.device_plugin_timeout_s:.0f} s: "
        f"{dra_devices.difference(want, have)}"
    )


def _new_plugin_runs(
    cluster: Cluster, s: Settings, clock: Clock, deadline: float, old_plugins: set[str]
) -> bool:
    """Whether a plugin pod not among ``old_plugins`` runs on the node by ``deadline``."""

    def runs(pods: list[PodView]) -> bool:
        return any(
            p.phase == "Running" and p.ref.uid not in old_plugins
            for p in plugin_pods(cluster, s, pods)
        )

    return plugin_start.new_pod_started(cluster, s, clock, deadline, runs)


def _slices_when(
    cluster: Cluster,
    s: Settings,
    clock: Clock,
    deadline: float,
    done: Callable[[list[dict[str, Any]]], bool],
) -> list[dict[str, Any]]:
    """The node's slices once ``done`` says so, or at ``deadline``, from a watch of them."""
    looks = watch_slices(
        lambda span: cluster.watch_resource_slices(s.node_name, timeout_s=span),
        clock,
        due=lambda: deadline,
        poll_s=s.poll_s,
    )
    try:
        for slices in looks:
            if done(slices) or clock.now() >= deadline:
                return slices
    finally:
        looks.close()
    raise AssertionError("watch_slices never ends")  # pragma: no cover
