"""The device-plugin step of a change: restart NVIDIA's device plugin (or let resuming its
operand bring a new one), then wait until the node advertises what that plugin would for the
layout, under the node's MIG strategy and the plugin's sharing config."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import structlog

from mig_agent.agent.advertisers import plugin_start
from mig_agent.config.device_plugin import device_plugin_sharing
from mig_agent.config.settings import Settings
from mig_agent.core import labels
from mig_agent.core.advertised import (
    Listing,
    Sharing,
    device_uuids,
    expected_resources,
    format_resources,
    node_mig_strategy,
    plugin_listing,
    stale_devices,
)
from mig_agent.core.errors import (
    ConfigError,
    DevicePluginMissing,
    DevicePluginTimeout,
    MigAgentError,
)
from mig_agent.core.gpu_models import GpuModel
from mig_agent.core.observed import NodeState
from mig_agent.core.plan_text import first_few
from mig_agent.core.scheduling import parse_selector
from mig_agent.gpu.backend import GpuBackend
from mig_agent.kube.cluster import Cluster, NodeView, PodView
from mig_agent.node.waits import Clock, poll_delays, watch_slices

log = structlog.get_logger(__name__)


def plugin_pods(cluster: Cluster, s: Settings, pods: list[PodView] | None = None) -> list[PodView]:
    """The node's device plugin pods, but those already on their way out: a terminating pod is
    no plugin to restart or to wait for (its DaemonSet may no longer want this node). Picked
    out of ``pods`` (every pod of the node, as the pass listed them) where given."""
    if pods is None:
        pods = cluster.list_pods(
            node=s.node_name,
            namespace=s.device_plugin_namespace,
            label_selector=s.device_plugin_selector,
        )
        return [p for p in pods if not p.terminating]
    return plugins_among(s, pods)


def refuse_if_missing(s: Settings, node: NodeView, pods: list[PodView] | None, layout: str) -> None:
    """DevicePluginMissing for a change on a node where no device plugin pod is where the
    settings look, and no operand label brings one: no one would advertise the new layout, so
    the node would take pods over a listing no one proved."""
    if plugins_among(s, pods or []) or _deployed_by_operand(s, node):
        return
    raise DevicePluginMissing(
        f"layout {layout}: no device plugin pod is on the node in namespace "
        f"{s.device_plugin_namespace} with selector {s.device_plugin_selector}: none would "
        "advertise the new layout, and the node would go on listing devices that are gone; "
        "nothing was touched (point the chart's devicePlugin.namespace and "
        "devicePlugin.selector at NVIDIA's device plugin pods)",
        layout=layout,
    )


def _deployed_by_operand(s: Settings, node: NodeView) -> bool:
    """The GPU Operator's label deploys the plugin here (paused by a pass, it comes back)."""
    return any(
        k.endswith(".device-plugin") and node.labels.get(k, "false") != "false"
        for k in s.operand_labels
    )


def plugins_among(s: Settings, pods: list[PodView]) -> list[PodView]:
    """The device plugin pods of ``pods`` (every pod of the node), but those on their way out."""
    mine = select(pods, s.device_plugin_namespace, s.device_plugin_selector)
    return [p for p in mine if not p.terminating]


def select(pods: list[PodView], namespace: str, selector: str) -> list[PodView]:
    """Those of ``pods`` in ``namespace`` that ``selector`` matches, as a list request with them
    would return: one list of the node's pods serves every lookup of a pass."""
    try:
        wanted = parse_selector(selector)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return [p for p in pods if p.ref.namespace == namespace and wanted.matches(p.labels)]


def restart(cluster: Cluster, s: Settings, paused: list[str]) -> set[str]:
    """Delete the device plugin pods (their DaemonSet brings new ones, which read the GPUs
    again), unless resuming the paused operands brings a new one; the UIDs of those deleted."""
    if any(k.endswith(".device-plugin") for k in paused):
        return set()  # resuming the operands brings a new device plugin pod
    pods = plugin_pods(cluster, s)
    if not pods:
        log.warning(
            "device_plugin.not_found",
            namespace=s.device_plugin_namespace,
            selector=s.device_plugin_selector,
        )
        return set()
    for p in pods:
        cluster.delete_pod(p.ref)
    log.info("device_plugin.restarted", pods=[p.ref.name for p in pods])
    return {p.ref.uid for p in pods}


def restart_survivors(cluster: Cluster, s: Settings, old_plugins: set[str]) -> None:
    """Delete the device plugin pods from before the pass that outlived the pause of their
    operand. Pausing restarts the plugin only if the DaemonSet controller sees the paused label
    before it is resumed: a pass with nothing to drain (one that finishes an interrupted pass)
    pauses and resumes within milliseconds, the controller keeps the old pod, and no new one
    would ever come to wait for."""
    survivors = [p for p in plugin_pods(cluster, s) if p.ref.uid in old_plugins]
    for p in survivors:
        cluster.delete_pod(p.ref)
    if survivors:
        log.info(
            "device_plugin.restarted",
            pods=[p.ref.name for p in survivors],
            reason="the pod outlived the pause of its operand",
        )


def plugin_rules(s: Settings, node: NodeView) -> tuple[str, Sharing]:
    """The MIG strategy and sharing config NVIDIA's device plugin runs with on this node.

    The strategy is GFD's node label, else the setting. Sharing comes from the plugin's own
    config (``device_plugin_config``: the file, or the GPU Operator's ConfigMap folder with
    the config the node's ``nvidia.com/device-plugin.config`` label selects): that is what
    the plugin applies, and it is known before the change, where GFD's ``<resource>.replicas``
    labels lag it and exist only for resources already advertised.
    """
    strategy = node_mig_strategy(node.labels, label=s.mig_strategy_label, fallback=s.mig_strategy)
    sharing = device_plugin_sharing(
        s.device_plugin_config,
        node.labels,
        label=s.device_plugin_config_label,
        default=s.device_plugin_config_default,
    )
    return strategy, sharing


def plugin_labels(s: Settings, node: NodeView) -> tuple[str | None, ...]:
    return tuple(
        node.labels.get(k) for k in (s.mig_strategy_label, s.device_plugin_config_label) if k
    )


def listing(node: NodeView, want: Mapping[str, int]) -> Listing:
    """What the plugin lists on ``node``, healthy or not, against what it should (``want``)."""
    return plugin_listing(node.gpu_capacity(), node.gpu_resources(), want)


def expected(
    s: Settings, state: NodeState, node: NodeView, models: Mapping[int, GpuModel]
) -> dict[str, int]:
    """What NVIDIA's plugin advertises on ``node`` for its GPUs as ``state`` reads them."""
    return expected_resources(state, models, *plugin_rules(s, node))


def resources_ok(
    cluster: Cluster,
    s: Settings,
    gpus: GpuBackend,
    node: NodeView,
    models: Mapping[int, GpuModel],
    pods: list[PodView] | None = None,
) -> bool:
    """True unless a device plugin runs here and lists other devices than the GPUs' (an
    unhealthy device is still listed: no reason to repeat a change)."""
    if not plugin_pods(cluster, s, pods):
        return True
    want = expected(s, gpus.observe(), node, models)
    return listing(node, want).listed == want


def wait_resources(
    cluster: Cluster,
    s: Settings,
    gpus: GpuBackend,
    clock: Clock,
    models: Mapping[int, GpuModel],
    old_plugins: set[str],
    allocatable: AllocatableDevices | None = None,
) -> dict[str, int]:
    """Resume operands first if the device plugin is one of them; wait for a new, Ready
    device plugin pod (one not there before the pass: the old one's numbers are stale), then
    for the node to advertise the layout's resources and, with ``allocatable`` (the kubelet's
    device ids per resource), for the kubelet to offer the GPUs' own devices: a registration
    made before the GPUs changed is no proof. Returns those resources."""
    node = cluster.get_node(s.node_name)
    resume = labels.resume_patch(node.labels, s.operand_labels)
    if any(k.endswith(".device-plugin") for k in resume):
        cluster.patch_node(s.node_name, labels=resume)
        restart_survivors(cluster, s, old_plugins)
    has_plugin = (
        any(k.endswith(".device-plugin") for k in resume)
        or bool(old_plugins)
        or bool(plugin_pods(cluster, s))
    )
    # the GPUs do not change while it waits: what they hold is read once
    state = gpus.observe()
    want = expected(s, state, node, models)
    if not has_plugin:  # gone since the pass planned: no one proves the listing
        raise DevicePluginMissing(
            f"no device plugin pod is on the node in namespace {s.device_plugin_namespace} "
            f"with selector {s.device_plugin_selector} to advertise {want}",
            expected=want,
        )
    present = device_uuids(state) if allocatable is not None else frozenset()
    deadline = clock.now() + s.device_plugin_timeout_s
    new_pod = False
    delays = poll_delays(s.poll_s)
    while True:
        # the node is watched until it lists the layout (and, with the new plugin known, some
        # device is allocatable): the plugin's start costs a watch, not a look every poll
        listed = _listing_when(cluster, s, clock, deadline, want, need_fresh=new_pod)
        have = listed.listed
        # the plugin pods are looked at only once the numbers match (then watched until a new
        # one is Ready), or at the deadline, to say which is missing
        if not new_pod and have == want:
            new_pod = plugin_start.new_pod_started(
                cluster, s, clock, deadline, lambda pods: _new_ready(s, pods, old_plugins)
            )
        elif not new_pod and clock.now() >= deadline:
            new_pod = _new_ready(s, plugin_pods(cluster, s), old_plugins)
        # capacity counts a stopped plugin's devices for the kubelet's grace period: the
        # layout is listed once some expected device is allocatable too (a node whose every
        # device is unhealthy cannot be told from one whose plugin has gone, and fails)
        matched = new_pod and have == want and listed.fresh
        stale = _stale(allocatable, want, present) if matched else {}
        if matched and not stale:
            log.info(
                "device_plugin.resources_match",
                resources=want,
                **({"unhealthy": listed.unhealthy} if listed.unhealthy else {}),
            )
            return want
        if clock.now() >= deadline:
            raise _timeout(s, want, listed, new_pod=new_pod, stale=stale)
        if stale:
            # listed, but the kubelet's registration not the GPUs' devices yet: no change of
            # the node, and the kubelet's PodResources has no watch, so it is looked at again
            # soon rather than at the next node event
            clock.sleep(next(delays))


def _new_ready(s: Settings, pods: list[PodView], old_plugins: set[str]) -> bool:
    """A device plugin pod among the node's ``pods`` that is Ready and was not there before."""
    return any(p.ready and p.ref.uid not in old_plugins for p in plugins_among(s, pods))


def _timeout(
    s: Settings,
    want: dict[str, int],
    listed: Listing,
    *,
    new_pod: bool,
    stale: Mapping[str, frozenset[str]],
) -> DevicePluginTimeout:
    """Why the wait for the layout's resources ran out."""
    have, unoffered = listed.listed, listed.unoffered
    if not new_pod:
        return DevicePluginTimeout(
            f"no new device plugin pod ({s.device_plugin_namespace}, "
            f"{s.device_plugin_selector}) became Ready on the node within "
            f"{s.device_plugin_timeout_s:.0f} s",
            expected=want,
            advertised=have,
        )
    if stale:
        return DevicePluginTimeout(
            f"node resources match the layout's counts after "
            f"{s.device_plugin_timeout_s:.0f} s, but the kubelet offers devices the GPUs no "
            f"longer hold ({_named(stale)}): the device plugin's registration is stale",
            expected=want,
            advertised=have,
        )
    if have == want:
        return DevicePluginTimeout(
            f"node resources do not match the layout after "
            f"{s.device_plugin_timeout_s:.0f} s: the node lists {format_resources(have)} "
            f"as expected, but no device of {', '.join(unoffered)} is allocatable: the device "
            "plugin has not registered it since its restart, or every such device is unhealthy",
            expected=want,
            advertised=have,
        )
    return DevicePluginTimeout(
        f"node resources do not match the layout after "
        f"{s.device_plugin_timeout_s:.0f} s: expected {format_resources(want)}, node "
        f"advertises {format_resources(have)}",
        expected=want,
        advertised=have,
    )


AllocatableDevices = Callable[[], Mapping[str, frozenset[str]]]


def _stale(
    allocatable: AllocatableDevices | None, want: Mapping[str, int], present: frozenset[str]
) -> dict[str, frozenset[str]]:
    """The layout's device ids the kubelet offers that name none of the ``present`` devices
    (none where the kubelet cannot be asked: the counts are then all there is)."""
    if allocatable is None:
        return {}
    try:
        offered = allocatable()
    except MigAgentError as exc:
        log.warning("device_plugin.allocatable_unknown", error=str(exc))
        return {}
    stale = stale_devices(offered, want, present)
    if stale:
        log.info("device_plugin.stale_registration", stale=_named(stale))
    return stale


def _named(stale: Mapping[str, frozenset[str]]) -> str:
    return "; ".join(f"{resource}: {first_few(ids)}" for resource, ids in sorted(stale.items()))


def _listing_when(
    cluster: Cluster,
    s: Settings,
    clock: Clock,
    deadline: float,
    want: Mapping[str, int],
    *,
    need_fresh: bool,
) -> Listing:
    """What the node lists once it is ``want`` (and, with ``need_fresh``, some of it is
    allocatable), or at ``deadline``, from a watch of the node."""
    nodes = watch_slices(
        lambda span: cluster.watch_node(s.node_name, timeout_s=math.ceil(span)),
        clock,
        due=lambda: deadline,
        poll_s=s.poll_s,
    )
    try:
        for node in nodes:
            listed = listing(node, want)
            done = listed.listed == want and (listed.fresh or not need_fresh)
            if done or clock.now() >= deadline:
                return listed
    finally:
        nodes.close()
    raise AssertionError("watch_slices never ends")  # pragma: no cover
