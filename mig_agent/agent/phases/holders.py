"""Who holds which GPU device, and so which pods a change must drain: the kubelet's
PodResources and, on a DRA node, the ResourceClaims allocated from the node's pool. A pod whose
devices all outlive the plan stays; one holding nothing known goes; when nobody can tell, every
GPU pod goes (and the node says why)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from mig_agent.agent import reporting
from mig_agent.agent.advertisers import dra
from mig_agent.agent.change import Change, Holds, Memory, Tools
from mig_agent.core import planner
from mig_agent.core.errors import MigAgentError
from mig_agent.core.labels import paused_during_change
from mig_agent.core.plan_text import first_few
from mig_agent.core.pod_devices import UUID_PREFIXES
from mig_agent.kube.cluster import PodView
from mig_agent.node.drain import drain_refusals, to_drain

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Holders:
    tools: Tools
    memory: Memory

    def holds(self, change: Change, pods: list[PodView] | None = None) -> Holds | None:
        """(namespace, pod) -> the device ids (GPU and MIG UUIDs) it holds: from the kubelet's
        PodResources and, on a DRA node, from the ResourceClaims of the node's ``pods``
        (default: as the pass listed them) allocated from the node's pool. None when neither
        can tell."""
        t = self.tools
        holds: Holds = {}
        known = change.dra
        if t.pod_devices is not None:
            try:
                listed = t.pod_devices()
            except MigAgentError as exc:
                log.warning("drain.pod_resources_unavailable", error=str(exc))
                listed = None
            if listed is not None and not self.ids_unknown(listed):
                holds.update(listed)
                known = True
        if change.dra:
            s = t.settings
            pods = pods if pods is not None else change.node_pods(t.cluster, s.node_name)
            if change.slices is None:
                change.slices = t.cluster.list_resource_slices(s.node_name)
            for key, devices in dra.holders(t.cluster, s, pods, change.slices).items():
                holds[key] = holds.get(key, frozenset()) | devices
        return holds if known else None

    def ids_unknown(self, listed: Mapping[tuple[str, str], frozenset[str]]) -> bool:
        """True (and said: log, and an Event when they change) when the kubelet names GPU
        devices by ids that are no UUIDs: who holds which device is then unknown, and every GPU
        pod is drained. NVIDIA's plugin registers UUIDs whatever its DEVICE_ID_STRATEGY (that
        changes only what a container is given); another plugin may not."""
        odd = sorted({i for ids in listed.values() for i in ids if not i.startswith(UUID_PREFIXES)})
        if not odd:
            return False
        message = (
            f"the kubelet names GPU devices by ids that are no UUIDs ({first_few(odd, 4)}; "
            "not NVIDIA's device plugin?): which pod holds which device is unknown, so every "
            "GPU pod is drained"
        )
        log.warning("drain.device_ids_unknown", ids=odd[:8], reason=message)
        if odd != self.memory.odd_device_ids:
            self.memory.odd_device_ids = odd
            reporting.event_on_node(
                self.tools.cluster,
                self.tools.settings,
                "MIGDeviceOwnershipUnknown",
                message,
                warning=True,
            )
        return True

    def staying_devices(self, the_plan: planner.Plan) -> frozenset[str]:
        """Device ids (GPU and MIG UUIDs) that outlive ``the_plan`` (planner.staying_uuids)."""
        return planner.staying_uuids(the_plan, self.tools.gpus.observe())

    def may_stay(
        self, the_plan: planner.Plan, holds: Holds | None
    ) -> Callable[[PodView], bool] | None:
        """Whether a GPU pod may stay through ``the_plan``: every device it holds outlives it.
        None when who holds what is unknown: every GPU pod goes."""
        if holds is None:
            return None
        staying = self.staying_devices(the_plan)

        def may_stay(pod: PodView) -> bool:
            devices = holds.get((pod.ref.namespace, pod.ref.name), frozenset())
            return bool(devices) and devices <= staying  # pods holding nothing known are drained

        return may_stay

    def drain_plan(self, change: Change) -> tuple[list[PodView], list[str]]:
        """The GPU pods the drain would evict for ``change`` (the paused operands' among them)
        and why it must not start (drain_refusals; empty: it may); none for an empty plan."""
        t, the_plan = self.tools, change.plan
        s = t.settings
        if the_plan.is_empty:
            return [], []
        paused = paused_during_change(change.node.labels, s.operand_labels)
        # the drain asks the kubelet again after the cordon: a pod placed meanwhile is then known
        holds = self.holds(change)
        pods = to_drain(
            change.node_pods(t.cluster, s.node_name),
            self.may_stay(the_plan, holds),
            claimed=claimed(change, holds),
        )
        refusals = drain_refusals(
            pods,
            operand_labels=paused,
            evict_unmanaged=s.evict_unmanaged_pods,
            delete_emptydir_data=s.delete_emptydir_data,
            advise=s.operand_labels,
        )
        return pods, refusals


def claimed(change: Change, holds: Holds | None) -> frozenset[tuple[str, str]]:
    """On a DRA node, the pods that hold the node's devices by claim: GPU pods, though they
    request no GPU resource."""
    return frozenset(holds or {}) if change.dra else frozenset()
