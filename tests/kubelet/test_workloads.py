"""We test mig-agent, installed with the chart on the real node, against workloads and a node that
behave as real ones do: a training pod whose SIGTERM handler takes 60 s (grace 120 s) under a
PodDisruptionBudget, a GPU DaemonSet on an operand label, a Pending pod waiting for a MIG device
only the new layout has; a budget that forbids the eviction; a pass made long by slow NVML calls
while the kubelet probes the agent; the kubelet itself restarted mid-pass; NVIDIA's device plugin
crash-looping after the change. The tests run in order, each from the layout the last one left.

On a cluster of its own (test_chart.py's reasons), with a drain timeout of 20 s and retries at
most 10 s apart so that a refused change is seen, and retried, within a test."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from migsim.cluster import Cluster, agents, images, real_node, seed_checks
from migsim.cluster.waiting import wait_until

from .conftest import (
    CONFIG,
    STATE,
    NodeCluster,
    agent_log,
    agent_pods,
    helm_install,
    kube,
    node_pod,
    wait_ready_agent,
    wait_settled,
)

NS = "work"
MONITOR_LABEL = "nvidia.com/gpu.deploy.dcgm-exporter"  # an operand label the agent pauses
DRAIN_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def chart(node_cluster: NodeCluster) -> NodeCluster:
    c = node_cluster.cluster
    helm_install(
        c,
        node_cluster.helm,
        f"timeouts.drain={DRAIN_TIMEOUT_S}",
        "extraEnv.backoff_max_s=10",
    )
    c.kubectl("create", "namespace", NS)
    wait_ready_agent(c)
    return node_cluster


def apply(c: Cluster, *manifests: dict[str, Any]) -> None:
    for m in manifests:
        m.setdefault("metadata", {})["namespace"] = NS
        c.kubectl("apply", "-f", "-", input=json.dumps(m))


def node(c: Cluster) -> Any:
    return kube(c, "get", "node", real_node.NAME)


def pods(c: Cluster, selector: str) -> list[Any]:
    return list(kube(c, "get", "pods", "-n", NS, "-l", selector)["items"])


def until(what: str, check: Callable[[], Any], timeout: float = 90) -> Any:
    return wait_until(check, timeout=timeout, what=what, interval=0.5)


def relabel(c: Cluster, layout: str) -> None:
    c.kubectl("label", "node", real_node.NAME, "--overwrite", f"{CONFIG}={layout}", f"{STATE}-")


def sim(node_: real_node.RealNode, *args: str) -> str:
    """The GPU simulator's own command line (faults) on the real node's GPUs."""
    done = subprocess.run(
        [sys.executable, "-m", "migsim.nvml", "--state", str(node_.sim_state), *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@contextlib.contextmanager
def sim_fault(node_: real_node.RealNode, *args: str) -> Iterator[None]:
    sim(node_, "fault", *args)
    try:
        yield
    finally:
        sim(node_, "fault", "clear")


def gpu_instances(node_: real_node.RealNode) -> list[tuple[int, str, int]]:
    """(GPU, GI profile, placement start) of every GPU instance the simulated GPUs hold."""
    state = json.loads(node_.sim_state.read_text())
    return sorted(
        (gpu["index"], str(gi["profile_id"]), int(gi["start"]))
        for gpu in state["gpus"]
        for gi in gpu["gpu_instances"]
    )


def shell(script: str, grace_s: int = 30) -> dict[str, Any]:
    """A pod template's spec: busybox running `script` on the real node."""
    pod = node_pod("x", {"image": images.BUSYBOX, "command": ["/bin/sh", "-c", script]})
    spec: dict[str, Any] = pod["spec"]
    spec["terminationGracePeriodSeconds"] = grace_s
    spec["restartPolicy"] = "Always"
    # no service-account token: none of these pods reads the API, and a restarted kubelet
    # (test_the_kubelet_restarted_mid_pass) was seen retrying a projected token volume
    # ("kube-root-ca.crt not registered") and never stopping such a pod's container, which
    # then held its device through the next test's drain
    spec["automountServiceAccountToken"] = False
    return spec


def deployment(name: str, spec: dict[str, Any], resource: str) -> dict[str, Any]:
    spec["containers"][0]["resources"] = {"limits": {resource: 1}}
    # placed by the scheduler, which keeps off a cordoned node: a pod template bound by name
    # would put each replacement back on the node the agent drains (and the agent rightly
    # refuses to change the GPUs under pods that keep arriving)
    node_name = spec.pop("nodeName")
    spec["nodeSelector"] = {"kubernetes.io/hostname": node_name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec},
        },
    }


def budget(name: str, **rule: int) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name},
        "spec": {"selector": {"matchLabels": {"app": name}}, **rule},
    }


QUICK = "trap 'exit 0' TERM; while true; do sleep 0.2; done"


def running(c: Cluster, selector: str) -> Any:
    live = [
        p
        for p in pods(c, selector)
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]
    return live[0] if live else None


def stamp(rfc3339: str) -> float:
    """An API server timestamp (whole seconds, UTC) as seconds since the epoch."""
    return datetime.strptime(rfc3339, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def newest_event_time(c: Cluster, reason: str) -> float:
    """When the newest Event of `reason` on the real node was last seen."""
    events = kube(
        c,
        "get",
        "events",
        "-n",
        "default",
        "--field-selector",
        f"involvedObject.name={real_node.NAME},reason={reason}",
    )["items"]
    assert events, f"no {reason} Event on the node"
    return max(stamp(e["lastTimestamp"]) for e in events)


def test_a_60s_training_pod_a_budget_a_gpu_daemonset_and_a_pending_pod(chart: NodeCluster) -> None:
    c = chart.cluster
    c.kubectl("label", "node", real_node.NAME, "--overwrite", f"{MONITOR_LABEL}=true")
    monitor_spec = shell(QUICK)
    monitor_spec["nodeSelector"] = {MONITOR_LABEL: "true"}
    monitor_spec["runtimeClassName"] = "nvidia"
    monitor_spec["containers"][0]["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    monitor = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "gpu-monitor"},
        "spec": {
            "selector": {"matchLabels": {"app": "gpu-monitor"}},
            "template": {"metadata": {"labels": {"app": "gpu-monitor"}}, "spec": monitor_spec},
        },
    }
    # a CUDA program's stand-in holds its GPU as a GPU process; on SIGTERM the pod takes 60 s
    # to finish, holding it, then ends the program
    train = (
        "gpu-workload --name trainer & "
        "trap 'echo got TERM; sleep 60; kill $!; wait; exit 0' TERM; "
        "while true; do sleep 0.2; done"
    )
    trainer_spec = shell(train, grace_s=120)
    trainer_spec["runtimeClassName"] = "nvidia"
    trainer = deployment("trainer", trainer_spec, "nvidia.com/gpu")
    waiting = node_pod(
        "new-slice",
        {
            "image": images.BUSYBOX,
            "command": ["/bin/sh", "-c", "echo devices=$NVIDIA_VISIBLE_DEVICES; " + QUICK],
            "resources": {"limits": {"nvidia.com/mig-2g.20gb": 1}},
        },
    )
    del waiting["spec"]["nodeName"]  # the scheduler's: Pending until the layout offers one
    waiting["spec"]["automountServiceAccountToken"] = False  # as shell's pods
    apply(c, monitor, trainer, budget("trainer", maxUnavailable=1), waiting)
    first_monitor = until("the GPU DaemonSet's pod", lambda: running(c, "app=gpu-monitor"))
    first_trainer = until("the trainer", lambda: running(c, "app=trainer"))
    until(
        "new-slice to be unschedulable",
        lambda: any(
            x.get("reason") == "Unschedulable"
            for x in kube(c, "get", "pod", "-n", NS, "new-slice")["status"].get("conditions", [])
        ),
    )

    # the trainer's program is a process of its GPU, by its host PID, as NVML reports it
    def trainer_listed() -> str:
        table = seed_checks.host_nvidia_smi(chart.node)
        return table if " trainer " in table else ""

    table = until("the trainer's GPU process", trainer_listed, timeout=30)
    [row] = [ln for ln in table.splitlines() if " trainer " in ln]
    pid = int(row.split()[4])  # |  GPU  GI  CI  PID  Type  Process name ...
    assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"gpu-workload"), row

    relabel(c, "all-balanced")
    states: list[str] = []
    evicted_at = gone_at = 0.0
    evicted_stamp = 0.0  # the API server's time of the eviction (deletionTimestamp - grace)
    monitor_paused = False
    deadline = time.monotonic() + 300
    while True:
        n = node(c)
        state = n["metadata"]["labels"].get(STATE, "")
        if not states or states[-1] != state:
            states.append(state)
        if n["metadata"]["labels"].get(MONITOR_LABEL) != "true":
            monitor_paused = True
        live = {p["metadata"]["uid"]: p for p in pods(c, "app=trainer")}
        old = live.get(first_trainer["metadata"]["uid"])
        if old and old["metadata"].get("deletionTimestamp") and not evicted_at:
            evicted_at = time.monotonic()
            evicted_stamp = stamp(old["metadata"]["deletionTimestamp"]) - int(
                old["metadata"]["deletionGracePeriodSeconds"]
            )
        # gone: the object, or its containers all exited (phase Succeeded/Failed: the agent
        # then waits no more, it holds no device) while the kubelet finishes the deletion
        finished = old is not None and old["status"].get("phase") in ("Succeeded", "Failed")
        if evicted_at and (not old or finished) and not gone_at:
            gone_at = time.monotonic()
        slice_pod = kube(c, "get", "pod", "-n", NS, "new-slice")
        assert slice_pod["status"].get("reason") != "UnexpectedAdmissionError", slice_pod["status"]
        if state in ("success", "failed"):
            break
        assert time.monotonic() < deadline, (states, agent_log(c))
        time.sleep(0.5)
    assert states[-1] == "success", (states, agent_log(c))
    assert evicted_at and gone_at, "the trainer was not drained"
    # the kubelet, not the agent, decided: the handler's 60 s ran before the pod was gone
    assert gone_at - evicted_at >= 55, gone_at - evicted_at
    # and the GPUs changed only after it: by the API server's clock (whole seconds), the
    # agent's MIGApplying Event came at least the handler's 60 s after the eviction; a poll
    # cannot order the two, as success may follow the trainer's exit within one round
    applied = newest_event_time(c, "MIGApplying")
    assert applied - evicted_stamp >= 59, (applied - evicted_stamp, agent_log(c))
    assert monitor_paused, "the GPU DaemonSet's operand label was never paused"
    assert " trainer " not in seed_checks.host_nvidia_smi(chart.node)  # it left with its pod

    n = node(c)
    assert n["metadata"]["labels"][MONITOR_LABEL] == "true"
    assert not n["spec"].get("unschedulable"), n["spec"]
    assert n["status"]["allocatable"]["nvidia.com/mig-2g.20gb"] == "2"
    slice_pod = until(
        "new-slice to run",
        lambda: (
            (p := kube(c, "get", "pod", "-n", NS, "new-slice"))["status"].get("phase") == "Running"
            and p
        ),
        timeout=60,
    )
    assert slice_pod["spec"]["nodeName"] == real_node.NAME
    monitor_now = until("the GPU DaemonSet's pod again", lambda: running(c, "app=gpu-monitor"))
    assert monitor_now["metadata"]["uid"] != first_monitor["metadata"]["uid"]


def test_a_budget_that_forbids_the_eviction_fails_the_change_touching_no_gpu(
    chart: NodeCluster,
) -> None:
    c, rn = chart.cluster, chart.node
    apply(
        c,
        deployment("serving", shell(QUICK), "nvidia.com/mig-2g.20gb"),
        budget("serving", minAvailable=1),
    )
    until("serving", lambda: running(c, "app=serving"))
    before = gpu_instances(rn)

    relabel(c, "all-1g.10gb")
    try:
        n, seen = wait_settled(c, timeout=DRAIN_TIMEOUT_S + 120)
        assert seen[-1] == "failed", (seen, agent_log(c))
        reason = n["metadata"]["annotations"].get("mig-agent.dev/reason", "")
        assert f"PodDisruptionBudget {NS}/serving" in reason, reason
        assert gpu_instances(rn) == before  # no GPU touched
        assert running(c, "app=serving") is not None
        assert n["metadata"]["labels"][MONITOR_LABEL] == "true"  # operands resumed
        # the drain is retried with the node cordoned between tries
        assert n["spec"].get("unschedulable") and "stays cordoned between tries" in reason, reason
    finally:
        # the budget lifted, the agent's next try finishes the change (and the tests after
        # this one, failed or not, start from a node the agent can change)
        c.kubectl("delete", "pdb", "-n", NS, "serving", "--ignore-not-found")
    until(
        "the retry to end in success",
        lambda: node(c)["metadata"]["labels"].get(STATE) == "success",
        timeout=180,
    )
    assert node(c)["status"]["allocatable"]["nvidia.com/mig-1g.10gb"] == "14", agent_log(c)
    assert not node(c)["spec"].get("unschedulable")


def test_a_long_pass_keeps_the_agent_live_and_ready(chart: NodeCluster) -> None:
    """Every mutating NVML call takes 6 s (as MIG calls and resets take seconds on hardware):
    the pass lasts longer than the liveness probe's window (3 x 20 s), which must not kill it."""
    c, rn = chart.cluster, chart.node
    (agent,) = agent_pods(c)
    with sim_fault(rn, "latency", "6"):
        relabel(c, "all-3g.40gb")
        started = time.monotonic()
        not_ready: list[str] = []
        while True:
            pod = kube(c, "get", "pod", "-n", "mig-agent", agent["metadata"]["name"])
            ready = {x["type"]: x["status"] for x in pod["status"]["conditions"]}["Ready"]
            if ready != "True":
                not_ready.append(f"{time.monotonic() - started:.0f}s")
            state = node(c)["metadata"]["labels"].get(STATE)
            if state in ("success", "failed"):
                break
            assert time.monotonic() - started < 400, agent_log(c)
            time.sleep(1)
        took = time.monotonic() - started
    assert state == "success", agent_log(c)
    assert took > 60, f"the pass took {took:.0f} s: not longer than the liveness window"
    (status,) = pod["status"]["containerStatuses"]
    assert status["restartCount"] == 0, status
    assert not not_ready, f"not Ready at {not_ready}"
    assert node(c)["status"]["allocatable"]["nvidia.com/mig-3g.40gb"] == "4"


def test_the_kubelet_restarted_mid_pass(chart: NodeCluster) -> None:
    """The kubelet restarted while the drain waits for a pod that takes 15 s to stop: the change
    ends in `success` with the node schedulable, the agent's container untouched (the pods
    mount no service-account token: see shell)."""
    c = chart.cluster
    slow = shell("trap 'sleep 15; exit 0' TERM; while true; do sleep 0.2; done", grace_s=60)
    apply(c, deployment("slow", slow, "nvidia.com/mig-3g.40gb"))
    first = until("slow", lambda: running(c, "app=slow"))
    (agent,) = agent_pods(c)

    # one 2g.20gb device a GPU, as all-balanced after it: the next test's plugin restart then
    # finds the kubelet keeping the old plugin's 2g.20gb count while the new one registers
    relabel(c, "h100-80gb-1x4g-1x2g-1x1g")
    until(
        "the drain to evict the slow pod",
        lambda: any(
            p["metadata"]["uid"] == first["metadata"]["uid"]
            and p["metadata"].get("deletionTimestamp")
            for p in pods(c, "app=slow")
        ),
    )
    rn = real_node.restart_kubelet(c, real_node.load(c, real_node.NAME) or chart.node, down_s=10)
    assert rn.kubelet.alive()
    # the pod's 15 s and the kubelet's 10 s away can outlast the drain's 20 s: a try may fail
    # naming the pod still terminating, and the retry (at most 10 s later) then ends the change
    seen: list[tuple[str, str]] = []

    def succeeded() -> bool:
        n = node(c)
        now = (
            n["metadata"]["labels"].get(STATE, ""),
            n["metadata"]["annotations"].get("mig-agent.dev/reason", ""),
        )
        if not seen or seen[-1] != now:
            seen.append(now)
        return now[0] == "success"

    until("the change to succeed", succeeded, timeout=240)
    for state, reason in seen:
        if state == "failed":
            assert "still terminating" in reason and f"{NS}/slow-" in reason, seen
    n = node(c)
    assert n["status"]["allocatable"]["nvidia.com/mig-2g.20gb"] == "2", (seen, agent_log(c))
    assert not n["spec"].get("unschedulable"), n["spec"]
    (after,) = agent_pods(c)  # the kubelet's restart left the agent's container running
    assert after["metadata"]["uid"] == agent["metadata"]["uid"]
    assert after["status"]["containerStatuses"][0]["restartCount"] == 0
    c.kubectl("delete", "deployment", "-n", NS, "slow")


def test_the_device_plugin_crash_looping_after_the_change(chart: NodeCluster) -> None:
    """NVIDIA's plugin fails to initialise NVML three times after the agent restarts it (go-nvml
    calls nvmlInit_v2; the agent's pynvml another entry point): the kubelet restarts it with its
    back-off, and the agent says `success` only once the plugin advertises the layout: each
    resource of it, the 2g.20gb devices too, which the kubelet went on counting (none of them
    allocatable) from the plugin stopped until the new one registered them."""
    c = chart.cluster
    rn = real_node.load(c, real_node.NAME) or chart.node
    with sim_fault(rn, "fail", "DRIVER_NOT_LOADED", "--function", "nvmlInit_v2", "--times", "3"):
        relabel(c, "all-balanced")
        seen: list[tuple[str, str]] = []
        deadline = time.monotonic() + 300
        while True:
            n = node(c)
            state = n["metadata"]["labels"].get(STATE, "")
            g2 = n["status"].get("allocatable", {}).get("nvidia.com/mig-2g.20gb", "0")
            if not seen or seen[-1] != (state, g2):
                seen.append((state, g2))
            if state in ("success", "failed"):
                break
            assert time.monotonic() < deadline, (seen, agent_log(c))
            time.sleep(0.5)
    assert state == "success" and g2 == "2", (seen, agent_log(c))
    plugin = kube(c, "get", "pods", "-n", agents.PLUGIN_NS, "-l", agents.PLUGIN_LABEL)
    restarts = [
        s["restartCount"] for p in plugin["items"] for s in p["status"]["containerStatuses"]
    ]
    assert max(restarts) >= 3, restarts  # it did crash-loop
