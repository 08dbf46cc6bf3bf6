"""The first phase of a pass: the plan against the GPUs as they are, and what the change must
know from the cluster before it starts (the node's pods, whether it is a DRA node). A layout
NVIDIA's plugin would refuse to advertise, or a DRA node that must not or cannot be changed, is
refused here, before anything is touched."""

from __future__ import annotations

from dataclasses import dataclass

from mig_agent.agent import marks
from mig_agent.agent.advertisers import device_plugin, dra
from mig_agent.agent.change import Change, Memory, Tools
from mig_agent.core import planner
from mig_agent.core.advertised import Devices, planned_devices, strategy_problem
from mig_agent.core.dra_devices import split_problem
from mig_agent.core.errors import PlanError
from mig_agent.core.labels import State
from mig_agent.core.layout import Layout
from mig_agent.kube.cluster import NodeView, PodView


@dataclass(frozen=True)
class Planning:
    tools: Tools
    memory: Memory

    def plan(self, node: NodeView, desired: str, layout: Layout) -> Change:
        """The change from the GPUs as they are to ``layout``; PlanError for one that must not
        start (read only: observe mode plans so too)."""
        t, memory = self.tools, self.memory
        with t.metrics.phase("plan"):
            models = t.gpus.models()
            # destroy_in_use: GPU pods still run now; what they hold is checked after the drain
            observed = t.gpus.observe()
            memory.gpu_status = ""
            the_plan = planner.plan(layout, observed, models, destroy_in_use=True)
            strategy, sharing = device_plugin.plugin_rules(t.settings, node)
            pods, dra_node = self._cluster_look(node, the_plan)
            if dra_node and (refused := dra.refusal(t.settings, dra_node, pods or [])):
                raise PlanError(f"layout {desired}: {refused}", layout=desired)
            if dra_node and not dra_node.pods and not the_plan.is_empty:
                raise dra.plugin_missing(t.settings, dra_node, desired)
            if not dra_node and not the_plan.is_empty:
                device_plugin.refuse_if_missing(t.settings, node, pods, desired)
            planned: Devices = planned_devices(the_plan, observed, models)
            problem = (
                split_problem(planned)
                if memory.dra_seen
                else strategy_problem(planned, strategy, sharing)
            )
            if problem:
                raise PlanError(f"layout {desired}: {problem}", layout=desired)
        return Change(
            node,
            desired,
            layout,
            models,
            observed,
            the_plan,
            strategy,
            sharing,
            bool(memory.dra_seen),
            pods,
            dra_node.slices if dra_node else None,
        )

    def _cluster_look(
        self, node: NodeView, the_plan: planner.Plan
    ) -> tuple[list[PodView] | None, dra.DraNode | None]:
        """Every pod of the node (one list serves the device plugin's, the DRA plugin's and
        the drain's lookups) and, on a DRA node, its plugin pods and slices. Not asked when the
        GPUs hold the layout and the node says so with nothing left to finish: a resync with
        nothing to do asks the API server nothing, and goes by what the last look found."""
        t = self.tools
        s = t.settings
        settled = (
            the_plan.is_empty
            and node.labels.get(s.state_label) == State.SUCCESS
            and s.reason_annotation not in node.annotations
            and not marks.interrupted(s, node)
        )
        if settled and self.memory.dra_seen is not None:
            return None, None
        pods = t.cluster.list_pods(node=s.node_name)
        found = dra.find(t.cluster, s, pods)
        self.memory.dra_seen = found is not None
        return pods, found
