"""We test, end to end on the local cluster, the failures a real cluster hits that the agent's
first tests did not see, because no simulated pod held a GPU process:

* a MIG mode change (whole GPUs to MIG, MIG to whole GPUs) with GPU pods running drains them
  (their processes end with them) and applies; a process that no pod owns is named;
* an interrupted pass whose successor fails early (a layout typo) leaves the node clean;
* a relabel during a pass never shows ``success`` with the old layout's resources;
* a failing reboot command is ``failed`` with its reason, the guard not armed, the agent alive;
* a change on a node without a device plugin is refused before anything is touched;
* a kill after the GPUs changed leaves the node's record, which the next agent keeps;
* /healthz stays 200 while the agent waits for a label fix long after its last pass.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import Any

from kubernetes import client, watch
from migsim.cluster import agents
from migsim.cluster.processes import Proc
from migsim.nvml import state as simstate

from .conftest import REASON, STATE, AgentNode, NodeFactory, wait_running
from .test_agent import applied, assert_clean, pod_exists, wait_clean

CONFIG = "nvidia.com/mig.config"
GUARD = "mig-agent.dev/guard"


def pod_processes(node: AgentNode) -> list[tuple[int, simstate.SimProcess]]:
    """(GPU, process) of every simulated process a pod holds on the node."""
    return [gp for owned in simstate.processes_by_owner(node.sim_state).values() for gp in owned]


def wait_for(check: Any, what: str, node: AgentNode, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}; agent log:\n{node.log_tail()}"
        time.sleep(0.1)


def test_whole_gpus_to_mig_and_back_drain_the_pods_holding_them(
    agent_node: NodeFactory, namespace: str, gpu_pod: Any, core: client.CoreV1Api
) -> None:
    node = agent_node("2xH100-80GB")
    whole = gpu_pod(namespace, "whole", node=node.name, grace_period=1)
    wait_running(core, namespace, "whole")
    wait_for(lambda: len(pod_processes(node)) == 1, "the pod's process on its GPU", node)
    assert pod_processes(node)[0][1].gi is None  # on the whole GPU
    node.label("all-1g.10gb")
    assert node.wait_state("success", "failed", timeout=90) == "success", node.log_tail()
    assert not pod_exists(core, namespace, "whole", whole.metadata.uid)
    assert applied(node, "all-1g.10gb") and not pod_processes(node)
    assert_clean(node)

    mig = gpu_pod(
        namespace, "mig", node=node.name, grace_period=1, resources={"nvidia.com/mig-1g.10gb": 1}
    )
    wait_running(core, namespace, "mig", timeout=60)
    wait_for(lambda: len(pod_processes(node)) == 1, "the pod's process on its MIG device", node)
    assert pod_processes(node)[0][1].gi is not None
    # as `repartition` does: the new layout, the old state cleared
    core.patch_node(node.name, {"metadata": {"labels": {CONFIG: "all-disabled", STATE: None}}})
    assert node.wait_state("success", "failed", timeout=90) == "success", node.log_tail()
    assert not pod_exists(core, namespace, "mig", mig.metadata.uid)
    assert node.gpu_resources() == {"nvidia.com/gpu": 2}
    assert_clean(node)


def test_a_process_no_pod_owns_is_named_and_the_gpus_are_left_alone(
    agent_node: NodeFactory, namespace: str, gpu_pod: Any, core: client.CoreV1Api
) -> None:
    """No drain ends such a process, so the pass fails before the cordon: the pod running on
    the node stays (before: it was evicted, then the pass failed all the same)."""
    node = agent_node("2xH100-80GB", settings={"MIG_AGENT_GPU_RELEASE_TIMEOUT_S": "1"})
    pod = gpu_pod(namespace, "stays", node=node.name, grace_period=1)
    wait_running(core, namespace, "stays")
    for gpu in (0, 1):  # a host process outside Kubernetes on both GPUs, one the pod's too
        simstate.add_process(node.sim_state, gpu, 4242)
    simstate.reset_call_counts(node.sim_state)
    node.label("all-1g.10gb")
    assert node.wait_state("failed", "success", timeout=60) == "failed"
    reason = node.node().metadata.annotations[REASON]
    assert "MIG mode change is in use by process(es) 4242, which no pod holds" in reason
    assert simstate.call_counts(node.sim_state).total == 0
    assert pod_exists(core, namespace, "stays", pod.metadata.uid)
    assert "node.paused" not in node.log_tail(200), node.log_tail()  # never cordoned
    wait_clean(node)


def test_an_interrupted_pass_then_a_typo_leaves_the_node_clean(
    agent_node: NodeFactory, namespace: str, gpu_pod: Any, core: client.CoreV1Api
) -> None:
    node = agent_node("8xH100-80GB")
    gpu_pod(
        namespace,
        "slow",
        node=node.name,
        grace_period=30,
        annotations={"pod-delete.stage.kwok.x-k8s.io/delay": "6s"},
    )
    wait_running(core, namespace, "slow")
    node.label("all-2g.20gb")
    wait_for(lambda: "drain.started" in node.log_tail(5), "the drain to start", node)
    agents.kill_agent(node.cluster.dir, node.name)
    assert node.node().spec.unschedulable  # the kill left our cordon and paused operands
    node.label("all-2g.20gbx")  # and the next pass fails before any clean-up of its own
    node.restart_agent()
    assert node.wait_state("failed", "success", timeout=60) == "failed", node.log_tail()
    assert "unknown layout 'all-2g.20gbx'" in node.node().metadata.annotations[REASON]
    wait_clean(node)


def test_a_relabel_during_the_drain_never_reports_the_old_layout(
    agent_node: NodeFactory, namespace: str, gpu_pod: Any, core: client.CoreV1Api
) -> None:
    node = agent_node("8xH100-80GB")
    gpu_pod(
        namespace,
        "slow",
        node=node.name,
        grace_period=30,
        annotations={"pod-delete.stage.kwok.x-k8s.io/delay": "4s"},
    )
    wait_running(core, namespace, "slow")
    # every version of the node, from a watch: a short-lived false "success" is not missed
    versions: list[tuple[str | None, str | None, dict[str, str]]] = []
    stop = threading.Event()
    w = watch.Watch()

    def record() -> None:
        try:
            for event in w.stream(
                core.list_node, field_selector=f"metadata.name={node.name}", timeout_seconds=120
            ):
                n = event["object"]
                labels = n.metadata.labels or {}
                versions.append(
                    (
                        labels.get(CONFIG),
                        labels.get(STATE),
                        {
                            k: v
                            for k, v in (n.status.allocatable or {}).items()
                            if k.startswith("nvidia.com/") and v != "0"
                        },
                    )
                )
                if stop.is_set():
                    return
        except Exception:  # the test cut the watch short
            if not stop.is_set():
                raise

    watcher = threading.Thread(target=record, daemon=True)
    watcher.start()
    node.label("all-2g.20gb")
    wait_for(lambda: "drain.started" in node.log_tail(5), "the drain to start", node)
    # as `repartition` does: the new layout, the state cleared
    core.patch_node(node.name, {"metadata": {"labels": {CONFIG: "all-3g.40gb", STATE: None}}})
    wait_for(
        lambda: (
            node.labels().get(STATE) == "success"
            and node.gpu_resources() == {"nvidia.com/mig-3g.40gb": 16}
        ),
        "success with the new layout's resources",
        node,
        timeout=90,
    )
    stop.set()
    w.stop()
    watcher.join(10)
    successes = [v for v in versions if v[0] == "all-3g.40gb" and v[1] == "success"]
    assert successes, versions
    assert all(res == {"nvidia.com/mig-3g.40gb": "16"} for _, _, res in successes), successes
    assert applied(node, "all-3g.40gb")
    assert_clean(node)


def test_a_failing_reboot_command_is_failed_with_its_reason(agent_node: NodeFactory) -> None:
    node = agent_node(
        "2xA100-40GB",
        sim={"reset_supported": False},
        settings={"MIG_AGENT_REBOOT_COMMAND": "/bin/false --reboot"},
    )
    node.label("all-1g.5gb")
    assert node.wait_state("failed", "success", timeout=60) == "failed", node.log_tail()
    annotations = node.node().metadata.annotations or {}
    assert "reboot command '/bin/false --reboot' failed with exit status 1" in annotations[REASON]
    assert "mig-agent.dev/reboot-attempted" not in annotations  # no reboot: no guard
    wait_clean(node)
    record = agents.running(node.cluster.dir)[node.name]
    # before, the agent crashed (its supervisor would now restart it: count the restarts)
    assert Proc(**record["agent"]).alive() and record["restarts"] == 0, node.log_tail()


def test_a_change_without_a_device_plugin_is_refused_before_anything_is_touched(
    agent_node: NodeFactory, core: client.CoreV1Api
) -> None:
    node = agent_node("2xH100-80GB", settings={"MIG_AGENT_DEVICE_PLUGIN_TIMEOUT_S": "5"})

    def plugin_pods() -> list[Any]:
        return [
            p
            for p in core.list_namespaced_pod(
                agents.PLUGIN_NS, field_selector=f"spec.nodeName={node.name}"
            ).items
            if not p.metadata.deletion_timestamp
        ]

    # the DaemonSet has placed its plugin pod: removing the label now cannot race its creation
    wait_for(
        lambda: any(p.status.phase == "Running" for p in plugin_pods()),
        "the device plugin pod to run",
        node,
        timeout=60,
    )
    # no device plugin on this node, only a DCGM exporter among the operands
    core.patch_node(
        node.name,
        {
            "metadata": {
                "labels": {
                    "nvidia.com/gpu.deploy.device-plugin": None,
                    "nvidia.com/gpu.deploy.dcgm-exporter": "true",
                }
            }
        },
    )
    wait_for(lambda: not plugin_pods(), "the device plugin pod to go", node, timeout=60)
    before = [g.mig_current for g in simstate.load_node(node.sim_state).gpus]
    node.label("all-1g.10gb")
    # before (issue 42 path 8): applied and `success` over a listing no one proved
    assert node.wait_state("success", "failed", timeout=60) == "failed", node.log_tail()
    reason = node.node().metadata.annotations[REASON]
    assert "no device plugin pod is on the node" in reason and "nothing was touched" in reason
    assert [g.mig_current for g in simstate.load_node(node.sim_state).gpus] == before
    assert node.labels()["nvidia.com/gpu.deploy.dcgm-exporter"] == "true"
    assert not node.node().spec.unschedulable


def test_a_kill_after_the_gpus_changed_leaves_the_record_the_next_agent_keeps(
    agent_node: NodeFactory,
) -> None:
    """Issue 42: killed while a post-apply hook runs (the GPUs changed, the device plugin still
    lists them whole), the agent leaves its cordon and the node's record of what it owes (the
    GPUs' digest as advertised); the agent's next pod reads it, keeps the node cordoned until
    the plugin lists the GPUs as they are, then lets it go."""
    node = agent_node("2xH100-80GB", settings={"MIG_AGENT_POST_APPLY_COMMAND": "sleep 60"})
    node.label("all-1g.10gb")
    wait_for(lambda: "hook.started" in node.log_tail(10), "the post-apply hook", node, 60)
    agents.kill_agent(node.cluster.dir, node.name)
    seen = node.node()
    assert seen.spec.unschedulable
    record = json.loads(seen.metadata.annotations[GUARD])
    assert record["layout"] == "all-1g.10gb" and record["gpus"], record
    assert all(g.mig_current for g in simstate.load_node(node.sim_state).gpus)  # changed
    assert "nvidia.com/gpu" in (seen.status.allocatable or {})  # listed as they were
    node.restart_agent(settings={"MIG_AGENT_POST_APPLY_COMMAND": "true"})
    assert node.wait_state("success", "failed", timeout=90) == "success", node.log_tail()
    wait_clean(node)
    done = node.node()
    assert GUARD not in (done.metadata.annotations or {})
    assert int(done.status.allocatable.get("nvidia.com/mig-1g.10gb", "0")) == 14


def test_healthz_stays_ok_while_waiting_for_a_label_fix(agent_node: NodeFactory) -> None:
    # the loop beats at least every 5 s (its config poll) while it waits
    node = agent_node("2xH100-80GB", settings={"MIG_AGENT_STALL_S": "8"})
    node.label("all-1g.10gbx")
    assert node.wait_state("failed", "success", timeout=60) == "failed"
    time.sleep(12)  # longer than the stall limit with no pass: the loop still beats
    url = f"http://127.0.0.1:{node.procs.metrics_port}/healthz"
    with urllib.request.urlopen(url, timeout=5) as answer:  # noqa: S310 (loopback)
        assert answer.status == 200 and answer.read() == b"ok\n"
