"""What the phases of a pass share: the tools they work with (``Tools``), what the agent
remembers from one pass to the next (``Memory``), and the change one pass works on
(``Change``). Plain values: the phases (mig_agent.agent.phases: planning, drain, apply, advertise,
finish) take them as arguments, none reaches back into the agent."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from mig_agent.agent import reporting
from mig_agent.config.settings import Settings
from mig_agent.core import planner
from mig_agent.core.advertised import Sharing
from mig_agent.core.gpu_models import GpuModel
from mig_agent.core.layout import Layout
from mig_agent.core.observed import NodeState
from mig_agent.gpu.backend import GpuBackend
from mig_agent.host import commands
from mig_agent.kube.cluster import Cluster, NodeView, PodView
from mig_agent.node import hooks
from mig_agent.node.waits import Clock
from mig_agent.observability.metrics import Metrics

# (namespace, pod) -> the device ids it holds
Holds = dict[tuple[str, str], frozenset[str]]


@dataclass(frozen=True, slots=True)
class Tools:
    """What a phase works with: the agent's settings and its ways to the outside."""

    settings: Settings
    cluster: Cluster
    gpus: GpuBackend
    clock: Clock
    metrics: Metrics
    run_command: commands.Runner
    # (namespace, pod) -> GPU device ids it holds (kubelet PodResources); None: not known
    pod_devices: Callable[[], Mapping[tuple[str, str], frozenset[str]]] | None = None
    # resource -> device ids the kubelet offers (PodResources); None: not known
    allocatable_devices: Callable[[], Mapping[str, frozenset[str]]] | None = None
    # runs the reboot command; None: run_reboot with the reboot_timeout_s setting
    reboot: Callable[[str], None] | None = None
    # the id of the node's boot; None: the kernel's (phases.reboot.current_boot_id)
    boot_id: Callable[[], str] | None = None

    def phase(
        self, node: NodeView, name: str, reason: str, message: str
    ) -> contextlib.AbstractContextManager[None]:
        """One phase of a change, timed and told (reporting.phase): a log line, an Event of
        ``reason`` on ``node``, a duration metric."""
        return reporting.phase(self.cluster, self.metrics, self.clock, node, name, reason, message)

    def record_devices(self, held: reporting.HeldCache, node: NodeView | None = None) -> None:
        """The device metrics and the GPU state published, with who holds which device where
        PodResources tells (reporting.record_devices; ``held``: the agent's memory of it)."""
        reporting.record_devices(
            self.cluster,
            self.settings,
            self.gpus,
            self.metrics,
            node,
            pod_devices=self.pod_devices,
            wall=self.clock.wall,
            cache=held,
        )


@dataclass(slots=True)
class Memory:
    """What the agent keeps from one pass to the next. ``seen`` is read by the node watch's
    thread too: a phase sets it before its own write of the state label."""

    # (layout label, state label) as the agent last read or wrote them
    seen: tuple[str | None, str | None] = (None, None)
    failures: int = 0  # failed passes in a row: the backoff's exponent
    # the device ids that were no UUIDs when last reported (an Event when they change)
    odd_device_ids: list[str] = field(default_factory=list)
    # whether the last pass that looked found a DRA node (None: none looked): a pass with
    # nothing to do or to write goes by it, asking the API server nothing
    dra_seen: bool | None = None
    # devices the plugin lists unhealthy, as last reported (Event and condition on a change)
    unhealthy: dict[str, int] = field(default_factory=dict)
    # what the last look at NVML found ("" fine): /readyz answers from it, never calling NVML
    # itself (a reset holds the NVML lock for minutes)
    gpu_status: str = "GPUs not read yet"
    # the layout this agent ran the reboot command for (none: None): its one reboot
    rebooted_for: str | None = None
    # which pod holds which device, as last published, and the kubelet's listing it came from
    held: reporting.HeldCache = field(default_factory=reporting.HeldCache)


@dataclass(slots=True)
class Change:
    """What one pass works on: the node as last read or written, the layout asked for, the GPUs
    as observed and the plan between them, and how NVIDIA's plugin will advertise the result."""

    node: NodeView
    desired: str
    layout: Layout
    models: Mapping[int, GpuModel]
    observed: NodeState
    plan: planner.Plan
    strategy: str
    sharing: Sharing
    # a DRA node: NVIDIA's DRA kubelet plugin publishes the GPUs, claims hold them
    dra: bool = False
    # every pod of the node and its ResourceSlices, read once when the pass plans a change (or
    # has a state to write): None when the GPUs hold the layout and the node says so
    pods: list[PodView] | None = None
    slices: list[dict[str, Any]] | None = None
    interrupted: bool = False  # a pass before this one left its marks: it is finished now
    tainted: bool = False  # held back by its changing GPUs' device taints, not a cordon

    def node_pods(self, cluster: Cluster, node_name: str) -> list[PodView]:
        """Every pod of the node, as the pass listed them (listed now if it did not)."""
        if self.pods is None:
            self.pods = cluster.list_pods(node=node_name)
        return self.pods


class Prepared(NamedTuple):
    """What the pass takes from ``prepare`` on to the drain and the apply."""

    hook_run: hooks.HookRunner
    reset_gpus: list[int]
    old_plugins: set[str]  # the plugin pods before the change (a new one must come)
    paused: list[str] | None  # the operands paused; None: the GPUs stay, only the listing


def mig_layout(state: NodeState) -> tuple[object, ...]:
    """What of the GPUs a plugin advertises: MIG modes and instances, not processes."""
    return tuple((g.mig_current, g.mig_pending, g.gpu_instances) for g in state.gpus)


NOTE = "note"  # a failure's context key: what the agent did about it, for the reason
