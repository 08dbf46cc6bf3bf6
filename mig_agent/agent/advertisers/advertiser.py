"""Who tells Kubernetes what the GPUs hold, behind one interface: NVIDIA's device plugin (node
resources) or, on a DRA node, NVIDIA's DRA kubelet plugin (a ResourceSlice). Either is found
among the node's pods, restarted after a change (both read the GPUs only when they start), and
waited for until what it advertises names the GPUs' own devices; each is timed as its own
phase, with its own Event and failure. The steps themselves live in device_plugin and dra."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from mig_agent.agent.advertisers import device_plugin, dra
from mig_agent.agent.change import Change, Tools
from mig_agent.core.gpu_models import GpuModel
from mig_agent.kube.cluster import NodeView, PodView


class Advertiser(Protocol):
    @property
    def name(self) -> str:
        """As a reason names it: "the device plugin", "NVIDIA's DRA plugin"."""
        ...

    def find(self, node_pods: list[PodView] | None = None) -> list[PodView]:
        """Its pods on the node, but those on their way out (out of ``node_pods``, every pod
        of the node, where given)."""
        ...

    def advertises(self, change: Change, *, as_listed: bool) -> bool:
        """True when what it advertises is what the GPUs hold now (or it does not run here);
        ``as_listed``: from the node, pods and slices as the pass read them, else read now."""
        ...

    def restart(self, paused: list[str]) -> set[str]:
        """Make it read the GPUs again; the UIDs of the pods deleted for it."""
        ...

    def wait(self, models: Mapping[int, GpuModel], old_plugins: set[str]) -> dict[str, int]:
        """Until a pod not among ``old_plugins`` advertises the GPUs' own devices; what it
        advertises then. A DevicePluginTimeout (DraPluginTimeout) names what is missing."""
        ...

    def advertise(
        self, node: NodeView, models: Mapping[int, GpuModel], paused: list[str], old: set[str]
    ) -> dict[str, int]:
        """``restart`` then ``wait``, timed and told as a phase of the pass."""
        ...


@dataclass(frozen=True)
class DevicePlugin:
    """NVIDIA's device plugin: node resources, and the kubelet's allocatable device ids."""

    tools: Tools
    name: str = "the device plugin"

    def find(self, node_pods: list[PodView] | None = None) -> list[PodView]:
        t = self.tools
        return device_plugin.plugin_pods(t.cluster, t.settings, node_pods)

    def advertises(self, change: Change, *, as_listed: bool) -> bool:
        t = self.tools
        node = change.node if as_listed else t.cluster.get_node(t.settings.node_name)
        pods = change.pods if as_listed else None
        return device_plugin.resources_ok(t.cluster, t.settings, t.gpus, node, change.models, pods)

    def restart(self, paused: list[str]) -> set[str]:
        return device_plugin.restart(self.tools.cluster, self.tools.settings, paused)

    def wait(self, models: Mapping[int, GpuModel], old_plugins: set[str]) -> dict[str, int]:
        t = self.tools
        return device_plugin.wait_resources(
            t.cluster, t.settings, t.gpus, t.clock, models, old_plugins, t.allocatable_devices
        )

    def advertise(
        self, node: NodeView, models: Mapping[int, GpuModel], paused: list[str], old: set[str]
    ) -> dict[str, int]:
        t = self.tools
        with t.phase(
            node,
            "device_plugin",
            "MIGDevicePluginRestart",
            "restarting the device plugin and waiting for the node to advertise the layout's "
            "resources",
        ):
            old = old | self.restart(paused)
            return self.wait(models, old)


@dataclass(frozen=True)
class DraPlugin:
    """NVIDIA's DRA kubelet plugin: the node's ResourceSlice, its devices named by UUID."""

    tools: Tools
    name: str = "NVIDIA's DRA plugin"

    def find(self, node_pods: list[PodView] | None = None) -> list[PodView]:
        return dra.plugin_pods(self.tools.cluster, self.tools.settings, node_pods)

    def advertises(self, change: Change, *, as_listed: bool) -> bool:
        t = self.tools
        slices = change.slices if as_listed else None
        return dra.devices_ok(t.cluster, t.settings, t.gpus, change.models, slices)

    def restart(self, paused: list[str]) -> set[str]:
        del paused  # no operand label brings a new DRA plugin pod: it is always deleted
        return dra.restart(self.tools.cluster, self.tools.settings)

    def wait(self, models: Mapping[int, GpuModel], old_plugins: set[str]) -> dict[str, int]:
        t = self.tools
        return dra.wait_devices(t.cluster, t.settings, t.gpus, t.clock, models, old_plugins)

    def advertise(
        self, node: NodeView, models: Mapping[int, GpuModel], paused: list[str], old: set[str]
    ) -> dict[str, int]:
        t = self.tools
        with t.phase(
            node,
            "dra_plugin",
            "MIGDraPluginRestart",
            "restarting NVIDIA's DRA kubelet plugin and waiting for the node's ResourceSlice to "
            "list the layout's devices",
        ):
            old = old | self.restart(paused)
            self.wait(models, old)
            return {}  # no extended resources to watch the health of


def for_change(tools: Tools, change: Change) -> Advertiser:
    """The plugin that advertises ``change``'s node: the DRA plugin on a DRA node."""
    return DraPlugin(tools) if change.dra else DevicePlugin(tools)
