"""We test the reboot path end to end, on simulated A100s in a pass-through VM (no GPU reset
possible, so enabling MIG stays pending until the node reboots):

* the agent sets ``rebooting``, runs the configured reboot command once, and after the reboot
  (simulated: the pending MIG mode takes effect) finishes the layout: ``success``, node clean;
* when the reboot command returns and the node does not reboot (``/bin/true``), it does not run
  it again: ``failed``, with a reason that says the node did not reboot (its boot id).
"""

from __future__ import annotations

import shlex
import sys
import time

from migsim.cluster import Cluster, agents
from migsim.nvml import state as simstate

from .conftest import REASON, AgentNode, NodeFactory


def _reboot_command(node_state: str) -> str:
    return shlex.join([sys.executable, "-m", "migsim.nvml", "--state", node_state, "reboot"])


def _uncordoned(node: AgentNode) -> None:
    deadline = time.monotonic() + 10
    while node.node().spec.unschedulable:
        assert time.monotonic() < deadline, node.log_tail()
        time.sleep(0.1)


def test_mode_change_needing_a_reboot_reboots_once_and_finishes(
    agent_node: NodeFactory, installed: Cluster
) -> None:
    name = f"e2e-reboot-{int(time.time() * 1000) % 100000}"
    command = _reboot_command(str(agents.sim_state_path(installed, name)))
    node = agent_node(
        "2xA100-40GB",
        name=name,
        sim={"reset_supported": False},
        settings={"MIG_AGENT_REBOOT_COMMAND": command},
    )
    seen: list[str] = []
    node.label("all-1g.5gb")
    assert node.wait_state("success", "failed", timeout=90, seen=seen) == "success", node.log_tail()
    assert "rebooting" in seen, seen
    assert node.log_tail(400).count('"node.rebooting"') == 1
    gpus = simstate.load_node(node.sim_state).gpus
    assert all(g.mig_current and g.mig_pending for g in gpus)
    assert node.gpu_resources() == {"nvidia.com/mig-1g.5gb": 14}
    _uncordoned(node)
    assert "mig-agent.dev/reboot-attempted" not in (node.node().metadata.annotations or {})


def test_a_reboot_that_does_not_help_is_not_repeated(agent_node: NodeFactory) -> None:
    node = agent_node(
        "2xA100-40GB",
        sim={"reset_supported": False},
        settings={"MIG_AGENT_REBOOT_COMMAND": "/bin/true"},
    )
    seen: list[str] = []
    node.label("all-1g.5gb")
    assert node.wait_state("failed", "success", timeout=90, seen=seen) == "failed"
    assert "rebooting" in seen, seen
    reason = node.node().metadata.annotations[REASON]
    assert "the reboot command ran but the node did not reboot" in reason, reason
    assert node.log_tail(400).count('"node.rebooting"') == 1
    assert all(g.mig_pending and not g.mig_current for g in simstate.load_node(node.sim_state).gpus)
    _uncordoned(node)
