"""We test observe mode end to end: a real agent process run with MIG_AGENT_OBSERVE=true on a
node of the local cluster (real API server, the DaemonSet's ServiceAccount and admission
policies, simulated GPUs under the real NVML bindings, the node's device plugin):

* labelled with a layout that would change every GPU, with a GPU pod and a CPU pod on the node,
  the agent says what it would do (its annotation and an Event MIGObserved: the GPUs, the
  instances created, the GPU pod it would evict) and nothing else happens: NVML reads the same
  and saw no mutating call, the node is not cordoned, no label (state, operands) or condition
  is written, no pod is evicted or restarted (the device plugin's neither);
* with a state label written as MIG Manager writes it, a relabel is said again and the state
  label stays MIG Manager's;
* beside NVIDIA's MIG Manager (root: it runs in a private mount namespace), which applies the
  label: the agent ends up saying the layout is in place, and of the node it owns (managedFields)
  its annotation alone, no label, no spec; its Events are MIGObserved only;
* its log says it started with observe on.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
from kubernetes import client
from migsim.cluster import Cluster, agents, mig_manager
from migsim.cluster.processes import stop
from migsim.cluster.waiting import wait_until
from migsim.nvml import open_node
from migsim.nvml import state as simstate

from mig_agent.core.observed import NodeState

from .conftest import (
    REPO,
    RESTART_BACKOFF,
    STATE,
    AgentNode,
    NodeFactory,
    mig_counts,
    wait_running,
)

PLAN = "mig-agent.dev/observed-plan"


def nvml_reads(node: AgentNode) -> NodeState:
    """The node's GPUs as NVML reads them (the test's own read, read-only)."""
    backend = open_node(node.sim_state, read_only=True)
    try:
        return backend.observe()
    finally:
        backend.close()


def with_processes(state: NodeState) -> NodeState | None:
    """``state`` once some process runs on its GPUs, else None."""
    return state if any(g.processes for g in state.gpus) else None


def node_and_pods(node: AgentNode) -> dict[str, Any]:
    """What observe mode must leave as it is: the node but its observe annotation, and every
    pod on it (by UID: an evicted or restarted pod comes back with another)."""
    n = node.node()
    pods = node.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node.name}")
    return {
        "labels": dict(n.metadata.labels or {}),
        "annotations": {k: v for k, v in (n.metadata.annotations or {}).items() if k != PLAN},
        "unschedulable": bool(n.spec.unschedulable),
        "conditions": sorted(c.type for c in n.status.conditions or ()),
        "mig condition": [c.to_dict() for c in n.status.conditions or () if "MIG" in c.type],
        "pods": sorted(
            (p.metadata.namespace, p.metadata.name, p.metadata.uid)
            for p in pods.items
            if p.metadata.deletion_timestamp is None
        ),
    }


def wait_report(node: AgentNode, layout: str, timeout: float = 60.0) -> dict[str, Any]:
    """The agent's report once it is about ``layout`` and its Event has been written."""
    deadline = time.monotonic() + timeout
    while True:
        text = (node.node().metadata.annotations or {}).get(PLAN)
        data = json.loads(text) if text else {}
        if data.get("layout") == layout and observed_events(node, layout):
            return data
        assert time.monotonic() < deadline, f"no report for {layout}: {data}\n{node.log_tail()}"
        time.sleep(0.1)


def observed_events(node: AgentNode, layout: str) -> list[Any]:
    events = node.core.list_namespaced_event(
        "default", field_selector=f"involvedObject.kind=Node,involvedObject.name={node.name}"
    ).items
    return [e for e in events if e.reason == "MIGObserved" and f"layout {layout}" in e.message]


def test_observe_mode_says_what_it_would_do_and_changes_nothing(
    agent_node: NodeFactory, namespace: str, gpu_pod: Any, core: client.CoreV1Api
) -> None:
    node = agent_node("8xH100-80GB", settings={"MIG_AGENT_OBSERVE": "true"})
    gpu = gpu_pod(namespace, "trainer", node=node.name, resources={"nvidia.com/gpu": 1})
    core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": "web"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node.name},
                "containers": [{"name": "web", "image": "registry.invalid/web:1"}],
            },
        },
    )
    wait_running(core, namespace, "trainer")
    wait_running(core, namespace, "web")
    simstate.reset_call_counts(node.sim_state)
    # the trainer's process shows on its GPU a moment after its pod runs: read once it does
    gpus_before = wait_until(
        lambda: with_processes(nvml_reads(node)),
        timeout=30,
        what="the trainer's process on its GPU",
    )
    node_before = node_and_pods(node)
    assert not any(g.mig_current for g in gpus_before.gpus)

    node.label("all-1g.10gb")
    data = wait_report(node, "all-1g.10gb")
    assert data["changes"] is True and [g["gpu"] for g in data["gpus"]] == list(range(8))
    assert all(g["mig_mode"] == "enabled" and len(g["created"]) == 7 for g in data["gpus"])
    assert data["evict"] == [f"{namespace}/{gpu.metadata.name}"]
    (event,) = observed_events(node, "all-1g.10gb")
    assert event.type == "Normal" and event.message.startswith(
        "observe mode, nothing changed: would apply layout all-1g.10gb: 8 of 8 GPU(s) change"
    )
    assert f"would evict 1 GPU pod(s): {namespace}/trainer" in event.message

    node_after = node_and_pods(node)
    assert node_after["labels"] == {**node_before["labels"], "nvidia.com/mig.config": "all-1g.10gb"}
    assert STATE not in node_after["labels"] and not node_after["unschedulable"]
    assert node_after == {**node_before, "labels": node_after["labels"]}
    assert nvml_reads(node) == gpus_before and mig_counts(node.sim_state).total == 0
    assert '"observe": true' in node.log_tail(400) and '"agent.started"' in node.log_tail(400)


def test_mig_managers_state_label_stays_its_own(agent_node: NodeFactory) -> None:
    """Beside MIG Manager, which writes the state label: a relabel is said again, and the state
    label is left as MIG Manager wrote it."""
    node = agent_node("8xH100-80GB", settings={"MIG_AGENT_OBSERVE": "true"})
    node.label("all-1g.10gb")
    wait_report(node, "all-1g.10gb")
    simstate.reset_call_counts(node.sim_state)
    gpus_before = nvml_reads(node)
    node.core.patch_node(
        node.name,
        {"metadata": {"labels": {"nvidia.com/mig.config": "all-balanced", STATE: "pending"}}},
    )
    before = node_and_pods(node)
    data = wait_report(node, "all-balanced")
    assert data["changes"] is True and data["evict"] == []
    assert node_and_pods(node) == before and node.labels()[STATE] == "pending"
    assert nvml_reads(node) == gpus_before and mig_counts(node.sim_state).total == 0


def _owned_by_the_agent(node: Any) -> list[dict[str, Any]]:
    """The managedFields entries of the agent's field manager on ``node``."""
    return [
        m.to_dict()["fields_v1"]
        for m in node.metadata.managed_fields or ()
        if m.manager == "mig-agent"
    ]


def _wait(what: str, ready: Any, log: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not after {timeout:g} s\n{log()}"
        time.sleep(0.1)


@pytest.mark.native
def test_beside_mig_manager_it_says_and_owns_nothing_but_its_annotation(
    installed: Cluster, core: client.CoreV1Api
) -> None:
    if os.geteuid() != 0:
        pytest.skip("nvidia-mig-manager runs in a private mount namespace (unshare -m): root")
    layouts = REPO / "profiles" / "all.yaml"  # one file: what MIG Manager reads
    name = f"observe-{int(time.time() * 1000) % 100000}"
    installed.add_gpu_node(name, "2xH100-80GB")
    procs = []
    log = installed.dir / "logs" / f"agent-{name}.log"

    def agent_log() -> str:
        return log.read_text()[-3000:] if log.exists() else ""

    try:
        mig_manager.start_node(installed, name, layouts)
        procs = list(
            agents.start_agent_only(
                installed,
                name,
                settings={"MIG_AGENT_OBSERVE": "true"},
                profiles=layouts,
                restart_backoff=RESTART_BACKOFF,
            )
        )
        _wait("the agent started", lambda: '"agent.started"' in agent_log(), agent_log)
        core.patch_node(name, {"metadata": {"labels": {"nvidia.com/mig.config": "all-balanced"}}})

        def labels() -> dict[str, str]:
            return dict(core.read_node(name).metadata.labels or {})

        _wait("MIG Manager's success", lambda: labels().get(STATE) == "success", agent_log)

        def in_place() -> bool:
            text = (core.read_node(name).metadata.annotations or {}).get(PLAN) or "{}"
            data = json.loads(text)
            return data.get("layout") == "all-balanced" and data.get("changes") is False

        _wait("the agent saying the layout is in place", in_place, agent_log)
        n = core.read_node(name)
        owned = _owned_by_the_agent(n)
        assert owned, "the agent wrote its annotation"
        for fields in owned:
            assert set(fields) == {"f:metadata"}, fields
            assert set(fields["f:metadata"]) == {"f:annotations"}, fields
            assert set(fields["f:metadata"]["f:annotations"]) == {f"f:{PLAN}"}, fields
        events = core.list_namespaced_event(
            "default", field_selector=f"involvedObject.kind=Node,involvedObject.name={name}"
        ).items
        ours = {e.reason for e in events if (e.source and e.source.component) == "mig-agent"}
        assert ours == {"MIGObserved"}, ours
        assert "reconcile.started" not in log.read_text()
    finally:
        stop(list(reversed(procs)))
        mig_manager.stop_node(installed.dir, name)
        installed.delete_node(name)
