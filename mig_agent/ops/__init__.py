"""Ops commands: repartition nodes or a pool through the layout label, and show the pool's state.

This is the operator's side of the label protocol. It never touches a GPU: per node it sets the
layout label (clearing the state label and the reason in the same patch, so every state seen
afterwards is the agent's answer to this change) and follows the state label to ``success`` or
``failed``. A rollout over a pool runs at most K nodes at a time and stops starting new nodes once
the failures exceed a budget. Dry runs and the up-front fit check plan against the GPU state each
agent publishes on its node, so nothing here needs NVML.

Modules: ``values`` (results, summary, previews, status rows), ``preview`` (node selection, the
up-front check, dry runs), ``rollout``, ``status``. Uses kube.cluster, layout, planner, snapshot
and drain; the command line is mig_agent.cli.ops_commands. Time and output
are injected, so the whole rollout is unit-tested against FakeCluster without sleeping.
"""

from mig_agent.ops.preview import check_layout, dry_run, preview, preview_text, select_nodes
from mig_agent.ops.rollout import repartition, summary_table
from mig_agent.ops.status import resources_text, status, status_json, status_table
from mig_agent.ops.values import (
    DEFAULT_SETTINGS,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    Action,
    GpuSummary,
    NodePreview,
    NodeResult,
    NodeStatus,
    Result,
    RolloutRefused,
    Summary,
    Writer,
)

__all__ = [
    "DEFAULT_SETTINGS",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "Action",
    "GpuSummary",
    "NodePreview",
    "NodeResult",
    "NodeStatus",
    "Result",
    "RolloutRefused",
    "Summary",
    "Writer",
    "check_layout",
    "dry_run",
    "preview",
    "preview_text",
    "repartition",
    "resources_text",
    "select_nodes",
    "status",
    "status_json",
    "status_table",
    "summary_table",
]
