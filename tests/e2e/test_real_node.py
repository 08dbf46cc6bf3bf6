"""We test, end to end on the local cluster (real API server and controllers, agent processes),
what a real node asks of the agent that kwok's nodes never did (issue: what real nodes do):

* an admin who cordons the node while a pass runs keeps the cordon: the API server's
  managedFields name kubectl, not the agent, as the last to set spec.unschedulable;
* a bare GPU pod (no controller) is refused before the cordon by the agent's default;
* SIGTERM mid-drain: the agent stops within a second or two and undoes its cordon and pauses;
* an Xid on a device (NVIDIA's device plugin marks it unhealthy) is reported, and never makes a
  finished node count as interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from kubernetes import client
from migsim.cluster import agents

from .conftest import REASON, STATE, AgentNode, NodeFactory, wait_running
from .test_agent import assert_clean, wait_clean

CORDON = "mig-agent.dev/cordoned"


def guard(core: client.CoreV1Api, namespace: str, app: str) -> client.PolicyV1Api:
    """A PodDisruptionBudget that refuses every eviction of the pods labelled app=``app``,
    once the disruption controller has seen it."""
    policy = client.PolicyV1Api(core.api_client)
    policy.create_namespaced_pod_disruption_budget(
        namespace,
        {
            "metadata": {"name": f"keep-{app}"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": app}}},
        },
    )
    deadline = time.monotonic() + 20
    while (
        policy.read_namespaced_pod_disruption_budget(
            f"keep-{app}", namespace
        ).status.observed_generation
        is None
    ):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return policy


def wait_cordoned_by_agent(node: AgentNode, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        n = node.node()
        if n.spec.unschedulable and CORDON in (n.metadata.annotations or {}):
            return
        assert time.monotonic() < deadline, node.log_tail()
        time.sleep(0.1)


def log_events(node: AgentNode) -> list[dict[str, Any]]:
    path = node.cluster.dir / "logs" / f"agent-{node.name}.log"
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_a_cordon_an_admin_sets_during_the_pass_survives_it(
    agent_node: NodeFactory, namespace: str, gpu_pod: Any, core: client.CoreV1Api
) -> None:
    node = agent_node("8xH100-80GB", settings={"MIG_AGENT_DRAIN_TIMEOUT_S": "120"})
    gpu_pod(namespace, "guarded", node=node.name, labels={"app": "guarded"})
    wait_running(core, namespace, "guarded")
    policy = guard(core, namespace, "guarded")
    node.label("all-3g.40gb")
    wait_cordoned_by_agent(node)  # the drain waits on the budget
    # kubectl uncordon, then kubectl cordon: maintenance begins while the agent drains
    for value in (None, True):
        core.patch_node(
            node.name, {"spec": {"unschedulable": value}}, field_manager="kubectl-cordon"
        )
    policy.patch_namespaced_pod_disruption_budget(
        "keep-guarded", namespace, {"spec": {"minAvailable": 0}}
    )
    assert node.wait_state("success", timeout=90) == "success", node.log_tail()
    n = node.node()
    assert n.spec.unschedulable, "the admin's cordon was undone"
    assert CORDON not in (n.metadata.annotations or {})
    assert any(e.get("event") == "node.cordon_kept" for e in log_events(node))
    core.patch_node(node.name, {"spec": {"unschedulable": None}})


def test_the_agents_own_cordon_is_undone_when_nobody_else_touched_it(
    agent_node: NodeFactory, namespace: str, gpu_pod: Any, core: client.CoreV1Api
) -> None:
    """The other side of the rule: managedFields name the agent, so it uncordons."""
    node = agent_node("8xH100-80GB")
    gpu_pod(namespace, "job", node=node.name)
    wait_running(core, namespace, "job")
    node.label("all-3g.40gb")
    assert node.wait_state("success", timeout=90) == "success", node.log_tail()
    wait_clean(node)


def test_a_bare_gpu_pod_is_refused_before_the_cordon_by_default(
    agent_node: NodeFactory, namespace: str, gpu_pod: Any, core: client.CoreV1Api
) -> None:
    node = agent_node("8xH100-80GB", settings={"MIG_AGENT_EVICT_UNMANAGED_PODS": "false"})
    gpu_pod(namespace, "notebook", node=node.name)
    wait_running(core, namespace, "notebook")
    node.label("all-3g.40gb")
    assert node.wait_state("failed", "success") == "failed", node.log_tail()
    reason = node.node().metadata.annotations[REASON]
    assert f"{namespace}/notebook have no controller" in reason
    assert core.read_namespaced_pod("notebook", namespace).metadata.deletion_timestamp is None
    assert not any(e.get("event") == "node.paused" for e in log_events(node))  # never cordoned
    assert_clean(node)


def test_sigterm_mid_drain_stops_the_agent_at_once_and_undoes_its_marks(
    agent_node: NodeFactory, namespace: str, gpu_pod: Any, core: client.CoreV1Api
) -> None:
    """Before: the drain's wait (up to 300 s) never looked at the stop: SIGKILL at the end of
    the pod's grace period."""
    node = agent_node("8xH100-80GB", settings={"MIG_AGENT_DRAIN_TIMEOUT_S": "120"})
    gpu_pod(namespace, "guarded", node=node.name, labels={"app": "guarded"})
    wait_running(core, namespace, "guarded")
    guard(core, namespace, "guarded")
    node.label("all-3g.40gb")
    wait_cordoned_by_agent(node)
    pid = node.agent_record()["agent"]["pid"]
    sent = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    deadline = sent + 10
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the agent did not stop within 10 s of SIGTERM"
        time.sleep(0.05)
    took = time.monotonic() - sent
    events = [e.get("event") for e in log_events(node)]
    assert "reconcile.stopped" in events, node.log_tail()
    stopped = len(events) - 1 - events[::-1].index("reconcile.stopped")
    assert "node.resumed" in events[events.index("node.paused") : stopped + 1]
    assert took < 5.0, took


def test_an_xid_on_a_device_is_reported_and_never_repeats_a_change(
    agent_node: NodeFactory, core: client.CoreV1Api
) -> None:
    """NVIDIA's device plugin marks the devices of a GPU that raised Xid 79 unhealthy; the
    kubelet's side keeps them in capacity and out of allocatable. Before: with the state
    'failed' (an earlier pass's) and allocatable short, the next pass counted as interrupted:
    pending, cordon, operands paused, device plugin restarted, with nothing to change."""
    if agents.default_device_plugin() != "nvidia":
        pytest.skip("needs NVIDIA's device plugin (root)")
    node = agent_node("2xH100-80GB")
    node.label("all-1g.10gb")
    assert node.wait_state("success", timeout=90) == "success", node.log_tail()
    plugins = {
        p.metadata.uid
        for p in core.list_namespaced_pod(
            agents.PLUGIN_NS, field_selector=f"spec.nodeName={node.name}"
        ).items
    }
    # every line from here on: a pass the agent runs for another reason (GFD's labels arriving
    # late wake one) may be the one that notices the devices first
    at_xid = len(log_events(node))
    subprocess.run(
        [sys.executable, "-m", "migsim.nvml", "--state", node.sim_state, "xid", "0", "79"],
        check=True,
    )
    deadline = time.monotonic() + 60
    while node.gpu_resources().get("nvidia.com/mig-1g.10gb", 0) == 14:  # allocatable
        assert time.monotonic() < deadline, "the plugin never marked GPU 0's devices unhealthy"
        time.sleep(0.2)
    assert node.node().status.capacity["nvidia.com/mig-1g.10gb"] == "14"
    core.patch_node(node.name, {"metadata": {"labels": {STATE: "failed"}}})
    assert node.wait_state("success", timeout=60) == "success", node.log_tail()
    deadline = time.monotonic() + 30
    while not any(e.get("event") == "devices.unhealthy" for e in log_events(node)[at_xid:]):
        assert time.monotonic() < deadline, node.log_tail()
        time.sleep(0.2)
    events = [e.get("event") for e in log_events(node)[at_xid:]]
    assert "node.paused" not in events and "device_plugin.restarted" not in events, events
    assert plugins == {
        p.metadata.uid
        for p in core.list_namespaced_pod(
            agents.PLUGIN_NS, field_selector=f"spec.nodeName={node.name}"
        ).items
    }

    def condition_message() -> str:
        return next(
            (
                c.message
                for c in node.node().status.conditions or ()
                if c.type == "MIGConfigApplied"
            ),
            "",
        )

    # the condition is written after the state label and the log line: wait for it
    deadline = time.monotonic() + 30
    while "device(s) unhealthy" not in (message := condition_message()):
        assert time.monotonic() < deadline, message
        time.sleep(0.2)
    assert_clean(node)
