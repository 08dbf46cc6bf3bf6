"""Hostile inputs on the real cluster (issue 15): a profile config built to crash a parser, a
label naming a layout only another file has, our own annotations forged with garbage. Each is
refused with a reason naming the problem (or, for forged annotations, overwritten), with no
GPU mutated, the node clean and the agent up. The parsing itself is unit-tested in
tests/unit/test_hostile_configs.py."""

from __future__ import annotations

import pytest
from migsim.cluster import Cluster, agents
from migsim.nvml import state as simstate

from . import harness
from .conftest import full_matrix

pytestmark = [pytest.mark.faults, pytest.mark.cluster]
full_only = pytest.mark.skipif(not full_matrix(), reason="with MIG_AGENT_FAULTS=full only")

PREFIX = "mig-agent.dev"


def _node_clean(node: harness.FaultNode) -> None:
    n = node.node()
    annotations = n["metadata"].get("annotations") or {}
    labels = n["metadata"].get("labels") or {}
    assert not n["spec"].get("unschedulable"), "left cordoned"
    assert not [k for k, v in labels.items() if v == harness.PAUSED], "operands left paused"
    for key in ("cordoned", "paused-operands", "post-apply-pending"):
        assert f"{PREFIX}/{key}" not in annotations, key
    assert agents.agent_state(agents.running(node.cluster.dir)[node.name]) == "running"


def _mutations(node: harness.FaultNode) -> int:
    return simstate.call_counts(node.procs.sim_state).total


def test_a_config_built_to_crash_the_parser_is_refused_and_nothing_moves(
    fault_cluster: Cluster,
) -> None:
    node = harness.FaultNode(fault_cluster, own_profiles=True)
    try:
        node.prepare()
        # added while the agent runs, then the agent restarted: it starts with this config
        (node.profiles / "zz-hostile.yaml").write_text(
            "version: v1\nmig-configs:\n  evil: " + "[" * 200_000 + "\n"
        )
        agents.kill_agent(fault_cluster.dir, node.name)
        node.patch_labels({harness.CONFIG: harness.TARGET})
        outcome, detail = harness.settle_and_check(node, "hostile-config", 90)
        assert outcome == "failed", detail
        assert "zz-hostile.yaml:3:" in detail and "nested deeper than 32 levels" in detail
        assert _mutations(node) == 0
        _node_clean(node)
    finally:
        node.close()


@full_only
def test_a_layout_only_in_another_file_is_refused_by_name(fault_cluster: Cluster) -> None:
    node = harness.FaultNode(fault_cluster)
    try:
        node.prepare()
        # mig-parted's example config names it; the agent's mounted profiles do not
        node.patch_labels({harness.CONFIG: "custom-config"})
        outcome, detail = harness.settle_and_check(node, "hostile-label", 90)
        assert outcome == "failed", detail
        assert "unknown layout 'custom-config'" in detail
        assert _mutations(node) == 0
        _node_clean(node)
    finally:
        node.close()


def test_our_annotations_forged_with_garbage_move_no_gpu_and_leave_the_node_clean(
    fault_cluster: Cluster,
) -> None:
    # no resync comes to the rescue within the test: the forged values themselves wake a pass
    node = harness.FaultNode(fault_cluster, settings={"MIG_AGENT_RESYNC_S": "3600"})
    try:
        node.prepare()
        garbage = "\u202e;rm -rf /;" + "x" * 300
        forged = {
            f"{PREFIX}/{k}": garbage
            for k in ("cordoned", "paused-operands", "gpu-state", "reason", "reboot-attempted")
        }
        fault_cluster.api.request(
            "PATCH",
            f"/api/v1/nodes/{node.name}",
            {"metadata": {"annotations": forged}},
            content_type="application/merge-patch+json",
        )
        node.wait(
            "the agent to clear the forged trail",
            lambda: (
                not any(
                    f"{PREFIX}/{k}" in (node.node()["metadata"].get("annotations") or {})
                    for k in ("cordoned", "paused-operands")
                )
            ),
            30,
        )
        outcome, detail = harness.settle_and_check(node, "forged-annotations", 90)
        assert (outcome, detail) == ("converged", f"{harness.START} applied")
        assert _mutations(node) == 0
        node.wait(
            "the GPU state rewritten from NVML",
            lambda: (
                (node.node()["metadata"].get("annotations") or {}).get(f"{PREFIX}/gpu-state")
                not in (None, garbage)
            ),
            30,
        )
        annotations = node.node()["metadata"].get("annotations") or {}
        assert annotations.get(f"{PREFIX}/reason") is None  # success: no stale reason
        _node_clean(node)
    finally:
        node.close()
