"""We test the device taints of a change on a DRA node (DeviceTaintRule, Kubernetes 1.37), with
in-memory fakes of our own Cluster and GpuBackend interfaces; the real API server and scheduler
are in tests/e2e/test_device_taints.py:

* where the API server serves DeviceTaintRules, a change of one GPU taints that GPU's devices
  while its GPU calls run and never cordons the node; the rules go with `success`;
* where it does not (Kubernetes 1.34), or the setting is off, the node is cordoned as before;
* a plugin that never comes back after the GPUs changed keeps the taints, says so and does not
  cordon; the next pass that sees the slice right lifts them;
* a rule deleted by hand while the node is owed is made again, and devices the plugin lists
  since the taint under names of their own are tainted too;
* an install whose RBAC has no devicetaintrules gets the cordon, not a failed change;
* an agent killed mid-change leaves the taints, and what they are for, to the next one, which
  keeps them while the slice is stale and lifts them once it is proven;
* a rule the agent could not make fails the pass before any GPU is touched, and nothing stays;
* the drain's wait for a slow evicted pod says the devices stay tainted, not the node cordoned;
* a change's start lists the rules once and reads the node's record (its annotation) once.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from mig_agent.agent import Agent, Outcome
from mig_agent.agent import guard as agent_guard
from mig_agent.agent.change import Change, Tools
from mig_agent.config.profiles import load_catalog
from mig_agent.core import device_taints
from mig_agent.core import guard as core_guard
from mig_agent.core.errors import KubeError, KubeForbidden
from mig_agent.kube.cluster import NodeCondition
from mig_agent.node.waits import Clock
from tests.unit.fake_cluster import FakeCluster

from .fake_gpus import FakeGpus
from .test_agent import NODE, STATE, FakeTime, assert_clean
from .test_agent_dra import REASON, _claim, _device_on, _with_layout, label, make_dra
from .test_real_node import lingering

GUARD = "mig-agent.dev/guard"


class Taints(FakeCluster):
    """Serves DeviceTaintRules; can refuse to create them."""

    refuse_create: bool = False
    refuse_list: bool = False
    lists: int = 0  # list requests made of DeviceTaintRules

    def list_device_taints(self) -> list[dict[str, Any]]:
        self.lists += 1
        if self.refuse_list:
            raise KubeForbidden("list devicetaintrules: 403 forbidden (fake)", status=403)
        return super().list_device_taints()

    def create_device_taint(self, rule: Any) -> None:
        if self.refuse_create:
            raise KubeError("create devicetaintrule: 403 forbidden (fake)", status=403)
        super().create_device_taint(rule)


def tainted(cluster: FakeCluster) -> set[str]:
    return set(device_taints.rules_of_node(cluster.taint_rules.values(), NODE))


def devices_of(cluster: FakeCluster, gpu: int) -> set[str]:
    return {
        d["name"]
        for piece in cluster.slices
        for d in piece["spec"]["devices"]
        if d["name"] == f"gpu-{gpu}" or d["name"].startswith(f"gpu-{gpu}-")
    }


def watched(agent: Agent, cluster: FakeCluster, gpus: FakeGpus) -> list[tuple[bool, set[str]]]:
    """(cordoned, tainted devices) at each GPU call the agent makes from now."""
    seen: list[tuple[bool, set[str]]] = []
    mutate = gpus._mutate

    def spy(gpu: int, op: str) -> None:
        seen.append((cluster.nodes[NODE].unschedulable, tainted(cluster)))
        mutate(gpu, op)

    gpus._mutate = spy  # type: ignore[method-assign]
    return seen


def on_all_1g(**plugin: Any) -> tuple[Agent, Taints, FakeGpus, Any]:
    agent, cluster, gpus, dra = make_dra(cluster=Taints(taints_served=True), **plugin)
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert not cluster.taint_rules  # from whole GPUs: both change, both tainted, then lifted
    _with_layout(agent, "gpu1-changes", {0: {"1g.10gb": 7}, 1: {"3g.40gb": 2}})
    return agent, cluster, gpus, dra


def test_a_change_of_one_gpu_taints_its_devices_and_never_cordons() -> None:
    agent, cluster, gpus, dra = on_all_1g()
    gpu1 = devices_of(cluster, 1)
    assert len(gpu1) == 7
    seen = watched(agent, cluster, gpus)
    label(cluster, "gpu1-changes")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert seen and all(s == (False, gpu1) for s in seen), seen
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert not cluster.taint_rules and GUARD not in cluster.nodes[NODE].annotations
    assert_clean(cluster)


def test_a_change_lists_the_rules_once_before_its_first_gpu_call() -> None:
    agent, cluster, gpus, dra = on_all_1g()
    mutate, lists = gpus._mutate, []

    def spy(gpu: int, op: str) -> None:
        lists.append(cluster.lists)
        mutate(gpu, op)

    gpus._mutate = spy  # type: ignore[method-assign]
    cluster.lists = 0
    label(cluster, "gpu1-changes")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert lists and lists[0] == 1, lists  # the permission probe's listing is the taint's


def test_the_drain_s_wait_says_the_devices_stay_tainted() -> None:
    agent, cluster, gpus, dra = on_all_1g()
    ref = cluster.add_pod("ml", "trainer", NODE, claims=("trainer",), grace_period_s=600)
    cluster.claims = [_claim("ml", "trainer", _device_on(cluster, 1))]
    lingering(agent, cluster, ref, gone_after_s=450.0)
    conditions: list[NodeCondition] = []
    set_condition = cluster.set_node_condition

    def recorded(name: str, condition: NodeCondition) -> None:
        conditions.append(condition)
        set_condition(name, condition)

    cluster.set_node_condition = recorded  # type: ignore[method-assign]
    label(cluster, "gpu1-changes")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    waiting = [c.message for c in conditions if c.reason == "DrainWaiting"]
    assert len(waiting) == 1 and "ml/trainer" in waiting[0], waiting
    assert waiting[0].endswith(
        ", and the devices of the GPUs that change stay tainted while they run"
    )


def test_without_device_taints_served_the_node_is_cordoned_as_before() -> None:
    agent, cluster, gpus, dra = on_all_1g()
    cluster.taints_served = False
    seen = watched(agent, cluster, gpus)
    label(cluster, "gpu1-changes")
    with capture_logs() as logs:
        assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert seen and all(s == (True, set()) for s in seen), seen
    assert_clean(cluster)
    # the fallback said and counted (issue 54, item 6: it was silent)
    assert any(e["event"] == "devices.taints_not_served" for e in logs), logs
    assert agent.metrics.taint_fallbacks._value.get() == 1


def test_with_the_setting_off_the_node_is_cordoned() -> None:
    agent, cluster, gpus, dra = on_all_1g()
    agent.settings = agent.settings.replace(device_taints=False)
    seen = watched(agent, cluster, gpus)
    label(cluster, "gpu1-changes")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert seen and all(s == (True, set()) for s in seen), seen
    assert not cluster.taint_rules
    assert_clean(cluster)


def test_a_plugin_that_never_comes_back_keeps_the_taints_and_says_so() -> None:
    agent, cluster, gpus, dra = on_all_1g()
    gpu1 = devices_of(cluster, 1)
    dra.comes_back = False
    label(cluster, "gpu1-changes")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    node = cluster.nodes[NODE]
    reason = node.annotations[REASON]
    assert "the devices of the GPUs that change stay tainted until NVIDIA's DRA plugin" in reason
    assert not node.unschedulable and tainted(cluster) == gpu1
    assert json.loads(node.annotations[GUARD])["tainted"] == [gpus.observe().gpus[1].info.uuid]
    dra.comes_back = True  # the plugin returns, listing the GPUs as they are: lifted
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.nodes[NODE].labels[STATE] == "success" and not cluster.taint_rules
    assert_clean(cluster)


def test_a_rule_deleted_while_owed_is_made_again_with_newly_listed_devices() -> None:
    agent, cluster, gpus, dra = on_all_1g()
    dra.comes_back = False
    label(cluster, "gpu1-changes")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    cluster.taint_rules.clear()  # by hand, while the slice is stale
    # a listing since, of another name on the changing GPU (a plugin that came back wrong)
    cluster.slices[0]["spec"]["devices"].append(
        {
            "name": "gpu-1-mig-3g40gb-9-0",
            "attributes": {
                "type": {"string": "mig"},
                "parentUUID": {"string": gpus.observe().gpus[1].info.uuid},
            },
        }
    )
    assert agent.reconcile_once().outcome is Outcome.FAILED
    assert tainted(cluster) == devices_of(cluster, 1) and "gpu-1-mig-3g40gb-9-0" in tainted(cluster)
    assert not cluster.nodes[NODE].unschedulable


def test_a_rule_refused_fails_the_pass_before_any_gpu_call_and_leaves_nothing() -> None:
    agent, cluster, gpus, dra = on_all_1g()
    cluster.refuse_create = True
    gpus.calls.clear()
    label(cluster, "gpu1-changes")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    assert sum(gpus.calls.values()) == 0
    assert "devicetaintrule" in cluster.nodes[NODE].annotations[REASON]
    assert not cluster.taint_rules and GUARD not in cluster.nodes[NODE].annotations
    assert_clean(cluster)


def test_without_the_right_to_list_taints_the_node_is_cordoned_and_the_change_made() -> None:
    agent, cluster, gpus, dra = on_all_1g()
    cluster.refuse_list = True
    seen = watched(agent, cluster, gpus)
    label(cluster, "gpu1-changes")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert seen and all(s == (True, set()) for s in seen), seen
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert_clean(cluster)


def successor_of(agent: Agent, cluster: FakeCluster, gpus: FakeGpus) -> Agent:
    """A new agent (a restarted pod) over the same node and GPUs."""
    t = FakeTime()
    clock = Clock(t.now, t.sleep, t.wait, t.now)
    new = Agent(agent.settings, cluster, gpus, lambda p: load_catalog([p]), clock=clock)
    new.reload_config()
    _with_layout(new, "gpu1-changes", {0: {"1g.10gb": 7}, 1: {"3g.40gb": 2}})
    return new


class Killed(BaseException):
    """The agent's process ends here: nothing after it runs (no settle, no report)."""


def killed_mid_change() -> tuple[Agent, Taints, FakeGpus, Any]:
    """An agent killed at its fourth GPU call of a change of GPU 1: its taints and record left."""
    agent, cluster, gpus, dra = on_all_1g()
    mutate, calls = gpus._mutate, 0

    def killed_after_some(gpu: int, op: str) -> None:
        nonlocal calls
        calls += 1
        if calls == 4:
            raise Killed
        mutate(gpu, op)

    gpus._mutate = killed_after_some  # type: ignore[method-assign]
    label(cluster, "gpu1-changes")
    with pytest.raises(Killed):
        agent.reconcile_once()
    gpus._mutate = mutate  # type: ignore[method-assign]
    return agent, cluster, gpus, dra


def test_an_agent_killed_mid_change_leaves_the_taints_to_the_next_one() -> None:
    agent, cluster, gpus, dra = killed_mid_change()
    gpu1 = devices_of(cluster, 1)
    assert tainted(cluster) == gpu1 and not cluster.nodes[NODE].unschedulable
    dra.comes_back = False  # the next agent finishes the GPUs; the plugin never republishes
    successor = successor_of(agent, cluster, gpus)
    assert successor.reconcile_once().outcome is Outcome.FAILED
    assert tainted(cluster) == gpu1 and not cluster.nodes[NODE].unschedulable
    assert "stay tainted until" in cluster.nodes[NODE].annotations[REASON]
    dra.comes_back = True
    assert successor.reconcile_once().outcome is Outcome.APPLIED
    assert not cluster.taint_rules
    assert_clean(cluster)


def test_the_change_after_a_kill_reads_the_node_s_record_once_as_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent, cluster, gpus, dra = killed_mid_change()
    assert GUARD in cluster.nodes[NODE].annotations
    parses, parse = 0, core_guard.parse

    def counted(text: str) -> core_guard.Record:
        nonlocal parses
        parses += 1
        return parse(text)

    starts, paused = [], agent_guard.paused

    @contextlib.contextmanager
    def spied(t: Tools, change: Change) -> Iterator[list[str]]:
        before = parses
        with paused(t, change) as operands:
            starts.append(parses - before)
            yield operands

    monkeypatch.setattr(core_guard, "parse", counted)
    monkeypatch.setattr(agent_guard, "paused", spied)
    assert successor_of(agent, cluster, gpus).reconcile_once().outcome is Outcome.APPLIED
    assert starts == [1]  # the taint's choice and the record it writes from one parse


def test_rule_names_of_long_node_names_that_share_their_start_never_collide() -> None:
    """Issue 54, item 5: names cut at the cap alone collided for nodes whose long names share
    their first ~215 characters; the second node's change then failed with a bare 409."""
    nodes = [f"{'gpu-node-' * 24}east.rack-{i:02d}" for i in range(2)]  # 230 characters
    assert all(len(n) <= 253 for n in nodes)
    device = "gpu-0-mig-1g10gb-19-0"
    names = [device_taints.rule_name(n, device) for n in nodes]
    assert names[0] != names[1], names
    subdomain = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    for name in names:
        assert len(name) <= device_taints.NAME_CAP and subdomain.match(name), name
    # a name that fits is the plain one, as before
    assert device_taints.rule_name("node-a", device) == f"mig-agent.{device}.node-a"
