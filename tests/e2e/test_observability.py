"""We test these aspects of what an operator sees of a real agent process on the local cluster
(its metrics port, its JSON log file, the Node's events):

* health: /healthz answers 200; /readyz answers 200, turns 503 naming NVML while the simulated
  GPUs cannot be reached (their state file moved away) and 200 again once they are back, and the
  failed NVML calls are counted;
* metrics during a reconfiguration (the simulated NVML slowed down so the apply takes seconds):
  the state gauge says pending, NVML create calls are moving, nothing is counted as a success yet;
* metrics after it: one success for the layout, one observation per phase (drain, apply, device
  plugin, verify) with the apply's time in its sum, the eviction of the GPU pod, the NVML calls by
  name, the state gauge, the MIG devices per GPU and profile, a recent last-success time;
* a layout that fails (an unknown name) is counted as failed and the state gauge follows;
* the JSON log: every line is a JSON object with the fixed keys (event, level, logger, timestamp,
  node), durations are `*_s` keys, each phase has a `phase.started` and `phase.finished` line in
  order, the GPU lines name the gpu, profile and placement, the failure's `reconcile.failed` line
  carries the reason in `error`, and the agent's bearer token is nowhere in the log;
* Node events, as `kubectl describe node` shows them: a Normal event per phase and on success, a
  Warning `MIGConfigFailed` with the reason.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from migsim.nvml import state as simstate
from prometheus_client.parser import text_string_to_metric_families

from .conftest import AgentNode, NodeFactory, wait_running

LAYOUT = "all-1g.10gb"  # 8 x H100-80GB: MIG mode on 8 GPUs, 7 GIs and 7 CIs on each
BAD_LAYOUT = "no-such-layout"
PHASES = ["drain", "apply", "verify", "device_plugin"]
PHASE_EVENTS = [
    "MIGReconfiguring",
    "MIGDraining",
    "MIGApplying",
    "MIGVerifying",
    "MIGDevicePluginRestart",
    "MIGConfigApplied",
]
LATENCY_S = 0.02  # per mutating NVML call: 8 + 56 + 56 calls, about 2.4 s of apply

Sample = tuple[str, frozenset[tuple[str, str]]]


class Scrape:
    """One scrape of /metrics: sample values by name and labels."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.values: dict[Sample, float] = {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def get(self, name: str, **labels: str) -> float | None:
        return self.values.get((name, frozenset(labels.items())))

    def __call__(self, name: str, **labels: str) -> float:
        """The value, 0 for a series not (yet) exposed."""
        return self.get(name, **labels) or 0.0

    def by_label(self, name: str, label: str) -> dict[str, float]:
        return {
            dict(lbls)[label]: v
            for (n, lbls), v in self.values.items()
            if n == name and label in dict(lbls)
        }


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:  # noqa: S310
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(node: AgentNode) -> Scrape:
    status, text = http_get(node.procs.metrics_port, "/metrics")
    assert status == 200, text
    return Scrape(text)


def poll(what: str, fn: Callable[[], Any], node: AgentNode, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = fn()
        if result:
            return result
        assert time.monotonic() < deadline, f"{what} after {timeout} s; log:\n{node.log_tail()}"
        time.sleep(0.1)


def log_lines(node: AgentNode) -> tuple[str, list[dict[str, Any]]]:
    text = (node.cluster.dir / "logs" / f"agent-{node.name}.log").read_text()
    lines = []
    for raw in text.splitlines():
        line = json.loads(raw)  # every line is JSON, nothing else reaches the file
        assert isinstance(line, dict), raw
        lines.append(line)
    return text, lines


def node_events(core: client.CoreV1Api, node: str) -> list[Any]:
    events = core.list_event_for_all_namespaces(
        field_selector=f"involvedObject.kind=Node,involvedObject.name={node}"
    ).items
    return sorted(events, key=lambda e: int(e.metadata.resource_version))


def readiness_follows_nvml(node: AgentNode) -> None:
    port = node.procs.metrics_port
    assert http_get(port, "/healthz") == (200, "ok\n")
    assert http_get(port, "/readyz") == (200, "ok\n")
    errors_before = scrape(node)("mig_agent_nvml_errors_total", call="observe")
    state, away = node.sim_state, node.sim_state + ".away"
    os.rename(state, away)  # the "driver" is gone: NVML calls fail
    try:
        # the agent's loop looks at NVML every few seconds; /readyz answers from that look
        deadline = time.monotonic() + 20
        while (answer := http_get(port, "/readyz"))[0] == 200:
            assert time.monotonic() < deadline, "/readyz never saw NVML gone"
            time.sleep(0.2)
        status, body = answer
        assert status == 503, body
        assert "NVML" in body and "Driver Not Loaded" in body, body
        # and it names the runtime its pod runs under (without NVIDIA's, no libnvidia-ml)
        assert re.search(r"RuntimeClass '[^']+'|the node's default runtime", body), body
        assert http_get(port, "/healthz") == (200, "ok\n")  # alive, just not ready
        assert scrape(node)("mig_agent_nvml_errors_total", call="observe") > errors_before
    finally:
        os.rename(away, state)
    deadline = time.monotonic() + 20
    while http_get(port, "/readyz") != (200, "ok\n"):
        assert time.monotonic() < deadline, "/readyz not ready again"
        time.sleep(0.2)


def test_metrics_health_logs_and_events_of_a_reconfiguration(
    agent_node: NodeFactory, namespace: str, gpu_pod: Any, core: client.CoreV1Api
) -> None:
    node = agent_node("8xH100-80GB")
    readiness_follows_nvml(node)
    if node.procs.device_plugin_kind == "nvidia":  # its health check marked every GPU unhealthy
        node.restart_device_plugin()

    before = scrape(node)
    assert before.get("mig_agent_reconfigurations_total", result="success", layout=LAYOUT) is None
    assert before.by_label("mig_agent_mig_devices", "gpu") == {}  # MIG off everywhere
    gpu_pod(namespace, "victim", node=node.name)
    wait_running(core, namespace, "victim")

    # -- during: pending, the apply visibly in progress -----------------------------------------
    simstate.set_latency(node.sim_state, LATENCY_S)
    node.label(LAYOUT)
    during: list[Scrape] = []
    deadline = time.monotonic() + 300  # generous: a loaded CI machine stretches every phase
    while True:
        s = scrape(node)
        if s("mig_agent_reconfigurations_total", result="success", layout=LAYOUT):
            after = s
            break
        if s("mig_agent_state", state="pending") == 1:
            during.append(s)
        assert time.monotonic() < deadline, node.log_tail(
            60, skip=("instance_created", "mig_mode_set")
        )  # the phases, not every creation
        time.sleep(0.05)
    simstate.clear_faults(node.sim_state)
    node.wait_state("success")

    assert during, "no scrape saw the pending state"
    for s in during:
        assert s("mig_agent_state", state="success") == 0
        assert s("mig_agent_reconfigurations_total", result="success", layout=LAYOUT) == 0
    creating = [s("mig_agent_nvml_calls_total", call="create_gpu_instance") for s in during]
    assert any(0 < n < 56 for n in creating), creating  # scraped in the middle of the apply

    # -- after: counters, phase durations, gauges -----------------------------------------------
    assert after("mig_agent_reconfigurations_total", result="success", layout=LAYOUT) == 1
    assert after("mig_agent_reconfigurations_total", result="failed", layout=LAYOUT) == 0
    for phase in PHASES:
        assert after("mig_agent_reconfiguration_phase_seconds_count", phase=phase) == 1, phase
        assert (
            after("mig_agent_reconfiguration_phase_seconds_bucket", phase=phase, le="+Inf") == 1
        ), phase
    apply_s = after("mig_agent_reconfiguration_phase_seconds_sum", phase="apply")
    assert apply_s >= 120 * LATENCY_S * 0.9, apply_s  # the slowed NVML calls are in there
    assert after("mig_agent_reconfiguration_phase_seconds_sum", phase="drain") > 0
    assert after("mig_agent_reconfiguration_phase_seconds_count", phase="plan") >= 1
    # the checks, pending and the cordon before the drain (no log lines of their own)
    assert after("mig_agent_reconfiguration_phase_seconds_count", phase="prepare") == 1
    assert after("mig_agent_evictions_total") == 1
    calls = after.by_label("mig_agent_nvml_calls_total", "call")
    assert calls["create_gpu_instance"] == 56 and calls["create_compute_instance"] == 56
    assert calls["set_mig_mode"] == 8
    assert calls["observe"] > 0 and calls["models"] > 0
    assert "destroy_gpu_instance" not in calls  # nothing to destroy on fresh GPUs
    errors = after.by_label("mig_agent_nvml_errors_total", "call")
    assert "observe" in errors and set(errors) <= {"observe", "models"}  # only while moved away
    assert after.by_label("mig_agent_state", "state") == {
        "pending": 0,
        "rebooting": 0,
        "success": 1,
        "failed": 0,
    }
    devices = {
        (dict(lbls)["gpu"], dict(lbls)["profile"]): v
        for (n, lbls), v in after.values.items()
        if n == "mig_agent_mig_devices"
    }
    assert devices == {(str(g), "1g.10gb"): 7 for g in range(8)}
    last = after("mig_agent_last_success_timestamp_seconds")
    assert time.time() - 300 < last <= time.time()
    assert after("mig_agent_api_requests_total", call="patch_node") > 0

    # -- a failing layout -----------------------------------------------------------------------
    node.label(BAD_LAYOUT)
    node.wait_state("failed")

    def failure_counted() -> Scrape | None:
        s = scrape(node)
        return (
            s
            if s("mig_agent_reconfigurations_total", result="failed", layout=BAD_LAYOUT) == 1
            else None
        )

    failed = poll("failure counted", failure_counted, node)
    assert failed("mig_agent_reconfigurations_total", result="success", layout=LAYOUT) == 1
    assert failed.by_label("mig_agent_state", "state") == {
        "pending": 0,
        "rebooting": 0,
        "success": 0,
        "failed": 1,
    }
    for phase in PHASES:  # refused before any phase began
        assert failed("mig_agent_reconfiguration_phase_seconds_count", phase=phase) == 1

    # -- the JSON log ---------------------------------------------------------------------------
    def failure_logged() -> tuple[str, list[dict[str, Any]]] | None:
        text, lines = log_lines(node)
        return (text, lines) if any(x["event"] == "reconcile.failed" for x in lines) else None

    text, lines = poll("reconcile.failed logged", failure_logged, node)
    token = yaml.safe_load(Path(node.procs.kubeconfig).read_text())["users"][0]["user"]["token"]
    assert len(token) > 20 and token not in text
    for line in lines:
        assert {"event", "level", "logger", "timestamp", "node"} <= line.keys(), line
        assert line["node"] == node.name, line
        for key in line:
            if any(w in key for w in ("duration", "elapsed", "second", "timeout", "retry_in")):
                assert key.endswith("_s"), (key, line)
    events = [line["event"] for line in lines]
    assert "agent.started" in events and "config.loaded" in events
    started = [line["phase"] for line in lines if line["event"] == "phase.started"]
    finished = [line for line in lines if line["event"] == "phase.finished"]
    assert started == PHASES
    assert [line["phase"] for line in finished] == PHASES
    assert all(line["layout"] == LAYOUT and line["duration_s"] >= 0 for line in finished)
    logged_apply_s = next(line["duration_s"] for line in finished if line["phase"] == "apply")
    assert abs(logged_apply_s - apply_s) < 0.5, (logged_apply_s, apply_s)
    order = [
        events.index(e)
        for e in (
            "reconcile.started",
            "phase.started",
            "phase.finished",
            "reconcile.succeeded",
            "reconcile.finished",
        )
    ]
    assert order == sorted(order)
    created = [line for line in lines if line["event"] == "gpu.instance_created"]
    assert len(created) == 56
    assert {(line["gpu"], line["profile"]) for line in created} == {
        (g, "1g.10gb") for g in range(8)
    }
    assert all(isinstance(line["placement"], str) for line in created)
    (failure,) = [line for line in lines if line["event"] == "reconcile.failed"]
    assert failure["level"] == "error" and failure["layout"] == BAD_LAYOUT
    assert failure["error"].startswith(f"unknown layout {BAD_LAYOUT!r}"), failure
    assert failure["error_type"] == "UnknownLayout"

    # -- events on the Node, as `kubectl describe node` shows them ------------------------------
    def warned() -> list[Any] | None:  # the event follows the label and the log line
        events = [e for e in node_events(core, node.name) if e.source.component == "mig-agent"]
        return events if any(e.type == "Warning" for e in events) else None

    ours = poll("the MIGConfigFailed event", warned, node)
    assert [e.reason for e in ours if e.type == "Normal"] == PHASE_EVENTS
    (warning,) = [e for e in ours if e.type == "Warning"]
    assert warning.reason == "MIGConfigFailed"
    assert warning.message.startswith(f"unknown layout {BAD_LAYOUT!r}"), warning.message
    assert all(e.source.host == node.name and e.count == 1 for e in ours)
    described = node.cluster.kubectl("describe", "node", node.name)
    events_part = described[described.index("Events:") :]
    for reason in [*PHASE_EVENTS, "MIGConfigFailed"]:
        assert reason in events_part, described
    assert f"unknown layout {BAD_LAYOUT!r}" in events_part, events_part
