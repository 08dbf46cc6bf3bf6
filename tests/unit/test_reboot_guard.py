"""We test the reboot guard's one reboot per layout by the boot it was asked in (the guard
model's finding: an agent killed after it wrote ``rebooting`` but before its command ran left a
node that its successor called "did not take effect after rebooting once", with no reboot ever
run):

* an ask of this very boot that the agent now running never ran gets its reboot;
* the agent that ran the command, still alive in the same boot, says the node did not reboot
  and runs it no second time;
* after a real reboot (a new boot id), a mode still pending fails as before, without a second
  reboot; so does an ask that recorded no boot (written by an earlier version).
"""

from __future__ import annotations

from mig_agent.agent import Agent, Outcome
from mig_agent.core.errors import GpuResetRequired
from mig_agent.core.gpu_models import MODELS
from tests.unit.fake_cluster import FakeCluster
from tests.unit.fake_gpus import FakeGpus
from tests.unit.test_agent import CONFIG, NODE, STATE, assert_clean, make

ASKED = "mig-agent.dev/reboot-attempted"
REASON = "mig-agent.dev/reason"


def _stuck_a100s() -> FakeGpus:
    gpus = FakeGpus([MODELS["A100-40GB"]] * 2)

    def stuck(gpu: int, *, enabled: bool) -> None:
        raise GpuResetRequired(f"GPU {gpu}: MIG mode change pending")

    gpus.set_mig_mode = stuck  # type: ignore[method-assign]
    return gpus


def _agent(gpus: FakeGpus, cluster: FakeCluster | None, boot: str, reboots: list[str]) -> Agent:
    agent, own, _ = make(gpus, reboot_command="/sbin/reboot")
    agent.cluster = cluster or own
    agent.reboot, agent.boot_id = reboots.append, lambda: boot
    return agent


def _asked_in(cluster: FakeCluster, boot: str) -> None:
    """The node as an agent killed right after its ``rebooting`` patch left it."""
    cluster.patch_node(NODE, labels={STATE: "rebooting"}, annotations={ASKED: f"all-1g.5gb@{boot}"})


def test_an_ask_of_this_boot_that_no_command_ran_for_gets_its_reboot() -> None:
    gpus, reboots = _stuck_a100s(), []
    first = _agent(gpus, None, "b-1", reboots)
    cluster = first.cluster
    assert isinstance(cluster, FakeCluster)
    cluster.patch_node(NODE, labels={CONFIG: "all-1g.5gb"})
    _asked_in(cluster, "b-1")
    result = _agent(gpus, cluster, "b-1", reboots).reconcile_once()
    assert result.outcome is Outcome.REBOOTING, cluster.nodes[NODE].annotations.get(REASON)
    assert reboots == ["/sbin/reboot"]
    assert cluster.nodes[NODE].annotations[ASKED] == "all-1g.5gb@b-1"


def test_the_agent_whose_command_did_not_reboot_says_so_and_runs_it_once() -> None:
    gpus, reboots = _stuck_a100s(), []
    agent = _agent(gpus, None, "b-1", reboots)
    cluster = agent.cluster
    assert isinstance(cluster, FakeCluster)
    cluster.patch_node(NODE, labels={CONFIG: "all-1g.5gb"})
    assert agent.reconcile_once().outcome is Outcome.REBOOTING
    result = agent.reconcile_once()  # still alive, same boot: the command rebooted nothing
    assert result.outcome is Outcome.FAILED and reboots == ["/sbin/reboot"]
    reason = cluster.nodes[NODE].annotations[REASON]
    assert "the reboot command ran but the node did not reboot" in reason, reason
    assert "after rebooting once" not in reason
    assert_clean(cluster)


def test_after_a_reboot_or_an_ask_of_no_recorded_boot_no_second_reboot() -> None:
    for asked in ("all-1g.5gb@b-1", "all-1g.5gb"):
        gpus, reboots = _stuck_a100s(), []
        agent = _agent(gpus, None, "b-2", reboots)
        cluster = agent.cluster
        assert isinstance(cluster, FakeCluster)
        cluster.patch_node(
            NODE, labels={CONFIG: "all-1g.5gb", STATE: "rebooting"}, annotations={ASKED: asked}
        )
        result = agent.reconcile_once()
        assert result.outcome is Outcome.FAILED and reboots == [], asked
        reason = cluster.nodes[NODE].annotations[REASON]
        assert "did not take effect after rebooting once" in reason, reason
        assert cluster.nodes[NODE].annotations[ASKED] == asked  # kept: no reboot later either
        assert_clean(cluster)


def test_the_ask_with_its_boot_is_the_agents_own_mark_and_an_odd_one_is_not() -> None:
    from mig_agent.agent.marks import foreign_marks
    from mig_agent.config.settings import Settings
    from mig_agent.kube.cluster import NodeView

    def odd(value: str) -> dict[str, str]:
        node = NodeView(NODE, "uid", "1", {}, {ASKED: value}, False, {})
        return foreign_marks(Settings(node_name=NODE), node)

    assert odd("all-1g.5gb@6f1c2a4e-93b0-4c57-9d0e-2f6f7a1b8c3d") == {}
    assert odd("all-1g.5gb") == {}
    assert odd("all-1g.5gb@; rm -rf /") == {ASKED: "all-1g.5gb@; rm -rf /"}
