"""The fault matrix: a fault injected at each point of a real agent's pass; invariants after.

A trial runs on a fresh simulated GPU node of a local cluster, with a real agent process (restarted
by its supervisor as a kubelet would, back-off 0.5 s) and the simulated device plugin: the node is
brought to `START` with a GPU pod on it, then labelled `TARGET`; when the agent's JSON log shows the
trial's point (an event such as `phase.started` of `apply`, or the Nth `gpu.instance_destroyed`),
the fault is injected at once. Then the node is left to settle and the invariants of issue 15 are
checked:

* the node ends in the state its layout label asks for (`success` with that layout in place on the
  GPUs; no label: no state), or `failed` with a reason that names the cause;
* it is not left cordoned nor with operands paused (unless `rebooting`), nor, on a DRA node,
  with device taints of the agent's (unless kept, and said, over a stale slice);
* no stray GPU instance (one without a compute instance);
* `success` only when the label names the layout that is applied;
* the agent's process is up (restarted by its supervisor when it was killed).

Faults: the agent killed; the layout label changed; API errors between the agent and the API
server (a proxy of the trial's own, migsim.cluster.api_faults, that the agent's kubeconfig names);
etcd and the API server restarted; NVML errors and half successes, a busy GPU, a failing reset,
a GPU that cannot be reset with a reboot command that never returns, the device plugin gone or
wrong, the profile config broken or changed (on the trial's copy).

Each trial's outcome is `converged`, `failed` (with the reason, when it names the cause) or
`violated` (with what was violated). Used by tests/faults and benchmarks/fault_matrix.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from migsim.cluster import SIMULATED_IMAGE, Cluster, ViaProxy, agents, dra_plugin
from migsim.cluster.api import ApiError
from migsim.cluster.api_faults import ApiFaultProxy, Fault
from migsim.cluster.errors import DevClusterError
from migsim.cluster.processes import stop
from migsim.node_runtime import FEATURE_LABELS_ANNOTATION
from migsim.nvml import open_node
from migsim.nvml import state as simstate

from mig_agent.config.profiles import load_catalog
from mig_agent.core import device_taints, dra_devices, planner
from mig_agent.core.advertised import expected_resources, plugin_devices
from mig_agent.core.errors import MigAgentError

CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
REASON = "mig-agent.dev/reason"
PAUSED = "paused-for-mig-change"
GPUS = "1xH100-80GB"
START, TARGET, OTHER = "all-1g.10gb", "all-balanced", "all-2g.20gb"
TYPO = "all-balancedx"
RESOURCE = "/apis/resource.k8s.io/v1"
NAMESPACE = "fault-matrix"
BACKOFF = (0.5, 5.0)
_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class Point:
    """Where a fault lands: just after the `nth` log line with `event` (and `fields`)."""

    name: str
    event: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    nth: int = 1

    def matches(self, line: Mapping[str, Any]) -> bool:
        return line.get("event") == self.event and all(
            line.get(k) == v for k, v in self.fields.items()
        )


def _phase(name: str, edge: str) -> Point:
    return Point(f"phase.{edge}({name})", f"phase.{edge}", {"phase": name})


# The agent's pass from START to TARGET on one H100 with a pod on three 1g.10gb devices (at least
# one of which goes), in the order the agent logs them.
POINTS: tuple[Point, ...] = (
    Point("reconcile.started", "reconcile.started"),
    Point("labels.patched(pending)", "labels.patched", {"state": "pending"}),
    Point("node.paused", "node.paused"),
    _phase("drain", "started"),
    Point("operands.waiting", "operands.waiting"),
    Point("drain.started", "drain.started"),
    Point("drain.pod_evicted", "drain.pod_evicted"),
    Point("drain.finished", "drain.finished"),
    _phase("drain", "finished"),
    _phase("apply", "started"),
    Point("gpu.compute_instance_destroyed#1", "gpu.compute_instance_destroyed"),
    Point("gpu.instance_destroyed#1", "gpu.instance_destroyed"),
    Point("gpu.compute_instance_destroyed#3", "gpu.compute_instance_destroyed", nth=3),
    Point("gpu.instance_destroyed#3", "gpu.instance_destroyed", nth=3),
    Point("gpu.instance_destroyed#5", "gpu.instance_destroyed", nth=5),
    Point("gpu.instance_created#1", "gpu.instance_created"),
    Point("gpu.instance_created#2", "gpu.instance_created", nth=2),
    Point("gpu.compute_instance_created#1", "gpu.compute_instance_created"),
    Point("gpu.compute_instance_created#2", "gpu.compute_instance_created", nth=2),
    _phase("apply", "finished"),
    _phase("verify", "started"),
    _phase("verify", "finished"),
    _phase("device_plugin", "started"),
    Point("device_plugin.resources_match", "device_plugin.resources_match"),
    _phase("device_plugin", "finished"),
    Point("node.resumed", "node.resumed"),
    Point("reconcile.succeeded", "reconcile.succeeded"),
    Point("reconcile.finished", "reconcile.finished"),
)
# MIG mode on: an A100 (its mode change waits for a GPU reset) with a pod on the whole GPU.
A100_POINTS: tuple[Point, ...] = (
    Point("node.paused", "node.paused"),
    Point("drain.pod_evicted", "drain.pod_evicted"),
    _phase("apply", "started"),
    Point("gpu.mig_mode_set", "gpu.mig_mode_set"),
    Point("gpu.reset", "gpu.reset"),
    Point("gpu.instance_created#1", "gpu.instance_created"),
    Point("gpu.instance_created#7", "gpu.instance_created", nth=7),
    Point("gpu.compute_instance_created#4", "gpu.compute_instance_created", nth=4),
    _phase("verify", "finished"),
    Point("device_plugin.resources_match", "device_plugin.resources_match"),
    Point("node.resumed", "node.resumed"),
)


@dataclass(frozen=True, slots=True)
class Scenario:
    """A transition START -> TARGET on a node of `gpus` with a pod holding `pod_limits`."""

    name: str
    gpus: str
    start: str
    target: str
    other: str
    typo: str
    pod_limits: Mapping[str, str]
    ready: tuple[str, int]  # the resource START advertises, and how many, before the pod
    points: tuple[Point, ...]
    # a pod made first, on a device the pass keeps: the drain must leave it running
    stay_pod_limits: Mapping[str, str] | None = None
    # "dra": NVIDIA's DRA driver publishes the node's GPUs; `pod_limits` and `ready` then name
    # MIG profiles: the pod's ResourceClaim asks that many devices of the profile, and the
    # node's ResourceSlice lists that many of START's before the pod
    device_plugin: str | None = None


H100 = Scenario(
    "h100",
    GPUS,
    START,
    TARGET,
    OTHER,
    TYPO,
    {"nvidia.com/mig-1g.10gb": "3"},
    ("nvidia.com/mig-1g.10gb", 7),
    POINTS,
    {"nvidia.com/mig-1g.10gb": "1"},
)
A100 = Scenario(
    "a100-mig-on",
    "1xA100-40GB",
    "all-disabled",
    "all-1g.5gb",
    "all-2g.10gb",
    "all-1g.5gbx",
    {"nvidia.com/gpu": "1"},
    ("nvidia.com/gpu", 1),
    A100_POINTS,
)
# A DRA node (NVIDIA's DRA kubelet plugin): the H100's pass, the pod holding its devices by claim.
DRA_POINTS: tuple[Point, ...] = (
    Point("node.paused", "node.paused"),
    Point("drain.pod_evicted", "drain.pod_evicted"),
    _phase("apply", "started"),
    Point("gpu.instance_destroyed#3", "gpu.instance_destroyed", nth=3),
    Point("gpu.instance_created#1", "gpu.instance_created"),
    _phase("apply", "finished"),
    _phase("dra_plugin", "started"),
    Point("dra_plugin.restarted", "dra_plugin.restarted"),
    Point("dra_plugin.devices_match", "dra_plugin.devices_match"),
    Point("node.resumed", "node.resumed"),
)
DRA = Scenario(
    "h100-dra",
    GPUS,
    START,
    TARGET,
    OTHER,
    TYPO,
    {"1g.10gb": "3"},
    ("1g.10gb", 7),
    DRA_POINTS,
    device_plugin="dra",
)
SCENARIOS = (H100, A100, DRA)

QUICK_POINTS = (
    "node.paused",
    "drain.pod_evicted",
    "gpu.instance_destroyed#3",
    "gpu.compute_instance_created#1",
    "phase.started(device_plugin)",
    "node.resumed",
)

LABEL_FAULTS = ("kill", "relabel-other", "relabel-typo", "relabel-removed", "repartition-other")
# Between the agent and the API server (migsim.cluster.api_faults): the agent's kubeconfig names
# a proxy that answers these instead of the API server.
API_FAULTS = {
    "api-500x3": Fault("status", status=500, times=3, watch=False),
    "api-503-15s": Fault("status", status=503, watch=False),  # an outage longer than retries
    "api-429": Fault("throttle", retry_after=2, times=3, watch=False),
    "api-hang": Fault("hang", times=1, watch=False),
    "api-reset": Fault("reset", times=3, watch=False),
    "api-409": Fault("conflict", method="PATCH", path=r"^/api/v1/nodes/[^/]+$", times=2),
    "watch-end": Fault("watch-end"),
    # the drain's pod watches answered as from a resource version the API server no longer
    # holds: an ERROR event (410 Expired) in the stream
    "watch-expired": Fault("watch-expired", path=r"^/api/v1/pods$", watch=True, times=3),
    # the node watch's connection dies unnoticed; once the pass is over the layout is relabelled
    "watch-silent": Fault("watch-silent"),
}
API_FAULT_SECONDS = {"api-503-15s": 15.0}
# Points that one request of the agent's marks, as the proxy sees it. An API fault for such a
# point is added before the pass, armed by that request, and lands on the first it matches after
# it: added at the log line instead, it missed what the agent asked meanwhile (the drain's pod
# watch, opened at once and ended by the pod's going, so the watch-expired trial answered none).
ARMING_REQUESTS = {"drain.pod_evicted": "create pods/eviction"}
# The node watch's timeout in trials with a proxy: a dead watch is noticed at its read timeout
WATCH_TIMEOUT_S = 20
# etcd and the API server stopped and started again (Cluster.restart), under every agent's feet
CONTROL_PLANE_FAULTS = ("apiserver-restart",)
# On the node: NVML, the GPUs, the device plugin, the profile config (each trial's own copy).
NODE_FAULTS = (
    "nvml-error",
    "nvml-half",
    "gpu-busy",
    "reset-fails",
    "reboot-hangs",
    "plugin-gone",
    "plugin-wrong",
    "post-apply-fails",
    "config-invalid",
    "config-changed",
)
# reboot-hangs: the node's reboot command, a shell whose child never returns (the marker is in
# the command line of both, none of which may outlive the agent's time limit)
REBOOT_MARKER = "sleep 3599.25"
REBOOT_HANGS = shlex.join(["sh", "-c", f"{REBOOT_MARKER}; :"])
REBOOT_TIMEOUT_S = 10.0
NODE_FAULT_SETTINGS = {  # shorter waits, so that a trial ends in a minute
    "gpu-busy": {"MIG_AGENT_GPU_RELEASE_TIMEOUT_S": "5"},
    "plugin-gone": {"MIG_AGENT_DEVICE_PLUGIN_TIMEOUT_S": "15"},
    "plugin-wrong": {"MIG_AGENT_DEVICE_PLUGIN_TIMEOUT_S": "15"},
    "reboot-hangs": {
        "MIG_AGENT_REBOOT_COMMAND": REBOOT_HANGS,
        "MIG_AGENT_REBOOT_TIMEOUT_S": f"{REBOOT_TIMEOUT_S:g}",
    },
}
# How long a trial may take to settle after its fault, where a wait that is not the agent's
# outlasts the default 90 s: an agent that does not read MIG_AGENT_REBOOT_TIMEOUT_S waits 120 s
# for the hanging reboot command.
FAULT_SETTLE = {"reboot-hangs": 120.0 + 60.0}
# How long a new node's agent pod and its first pass may take (on a loaded machine, the
# DaemonSet controller is slow to place the agent's and the device plugin's pods)
SETUP_TIMEOUT_S = 120.0
# NVML faults land before each kind of mutating call; the others once per phase.
NVML_POINTS = (
    "phase.started(apply)",
    "gpu.compute_instance_destroyed#1",
    "gpu.instance_destroyed#1",
    "gpu.instance_destroyed#5",
    "gpu.instance_created#1",
    "gpu.instance_created#2",
    "gpu.compute_instance_created#1",
)
NODE_POINTS = {
    "nvml-error": NVML_POINTS,
    "nvml-half": NVML_POINTS,
    "gpu-busy": (
        "node.paused",
        "drain.pod_evicted",
        "phase.started(apply)",
        "gpu.instance_destroyed#1",
        "gpu.instance_created#1",
    ),
    "reset-fails": ("node.paused", "phase.started(apply)", "gpu.mig_mode_set"),  # A100
    # A100: its mode change needs a reset, made impossible before the agent gets to it
    # (later, the injection could race the agent's reset)
    "reboot-hangs": ("node.paused", "drain.pod_evicted"),
    # once the GPUs are done (the simulated plugin also ends the processes of deleted pods, as
    # the kubelet's runtime would: stopped before the drain, the GPUs would stay busy)
    "plugin-gone": ("phase.finished(apply)", "phase.started(device_plugin)"),
    "plugin-wrong": ("phase.finished(apply)", "phase.started(device_plugin)"),
    # the site's post-apply hook (a CDI spec regenerated, say) fails once the GPUs changed
    "post-apply-fails": ("phase.started(apply)", "gpu.instance_created#1"),
    "config-invalid": (
        "labels.patched(pending)",
        "drain.pod_evicted",
        "phase.started(apply)",
        "gpu.instance_created#1",
        "phase.started(device_plugin)",
        "node.resumed",
    ),
    "config-changed": (
        "labels.patched(pending)",
        "drain.pod_evicted",
        "phase.started(apply)",
        "gpu.instance_created#1",
        "phase.started(device_plugin)",
        "node.resumed",
    ),
}
# the H100's all-balanced in the trial's copy of the profiles, before and after config-changed
BALANCED_H100 = (
    '- device-filter: ["0x233010DE", "0x233110DE"]\n      devices: all\n'
    '      mig-enabled: true\n      mig-devices: {"1g.10gb": 2, "2g.20gb": 1, '
    '"3g.40gb": 1}'
)
CHANGED_H100 = BALANCED_H100.replace('{"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}', '{"3g.40gb": 2}')
FAULTS = LABEL_FAULTS + tuple(API_FAULTS) + CONTROL_PLANE_FAULTS + NODE_FAULTS
# The DRA scenario's faults beyond the label faults (every point), and where they land: the
# plugin stopped once the GPUs are done (nothing republishes: the slice lists START's devices)
DRA_FAULT_POINTS: dict[str, tuple[str, ...]] = {
    **{
        f: ("drain.pod_evicted", "phase.started(dra_plugin)", "dra_plugin.restarted")
        for f in (*API_FAULTS, *CONTROL_PLANE_FAULTS)
        if f != "watch-silent"
    },
    "plugin-gone": ("phase.finished(apply)", "phase.started(dra_plugin)"),
}
# API faults land at one point of each phase (the H100 scenario).
API_POINTS = (
    "labels.patched(pending)",
    "node.paused",
    "drain.started",
    "drain.pod_evicted",
    "phase.started(apply)",
    "gpu.instance_created#1",
    "phase.started(device_plugin)",
    "device_plugin.resources_match",
    "node.resumed",
    "reconcile.succeeded",
)


@dataclass(slots=True)
class Result:
    point: str
    fault: str
    outcome: str  # converged | failed | violated | not-reached
    detail: str = ""
    seconds: float = 0.0
    log: str = ""
    scenario: str = H100.name
    hits: str = ""  # what an API fault answered (the proxy's counts), when there was a proxy


class FaultNode:
    """One fresh GPU node with its agent, set up at START with a GPU pod, for one trial."""

    def __init__(
        self,
        cluster: Cluster,
        scenario: Scenario | None = None,
        *,
        proxy: bool = False,
        settings: Mapping[str, str] | None = None,
        own_profiles: bool = False,
    ) -> None:
        self.cluster = cluster
        # the trial's pods (name -> UID) and the devices they hold, as `prepare` leaves them
        self.pods_at_start: dict[str, str] = {}
        self.held_at_start: dict[str, set[tuple[int, int]]] = {}
        self.scenario = scenario or H100
        self.name = f"fault-{next(_ids)}-{int(time.time() * 1000) % 100000}"
        self.proxy: ApiFaultProxy | None = None
        self.profiles = agents.PROFILES
        if own_profiles:  # a copy of its own, for the config faults
            self.profiles = cluster.node_dir(self.name) / "profiles"
            shutil.copytree(agents.PROFILES, self.profiles, dirs_exist_ok=True)
        settings = dict(settings or {})
        via: Cluster = cluster
        if proxy:
            self.proxy = ApiFaultProxy(
                cluster.server,
                cert=cluster.dir / "pki" / "serving.crt",
                key=cluster.dir / "pki" / "serving.key",
                ca=cluster.ca_cert,
            )
            via = ViaProxy(cluster, self.proxy.url)
            settings["MIG_AGENT_WATCH_TIMEOUT_S"] = str(WATCH_TIMEOUT_S)
        cluster.add_gpu_node(self.name, self.scenario.gpus)
        try:
            self.procs = agents.start_node(
                via,
                self.name,
                device_plugin=self.scenario.device_plugin,
                restart_backoff=BACKOFF,
                settings=settings,
                profiles=self.profiles,
                timeout=SETUP_TIMEOUT_S,
            )
        except BaseException:
            if self.proxy:
                self.proxy.stop()
            raise
        self.log_path = cluster.dir / "logs" / f"agent-{self.name}.log"
        self.offset = 0
        self.lines: list[dict[str, Any]] = []  # every log line read during the trial
        self.samples: list[tuple[float, str | None, str | None]] = []  # (time, layout, state)
        self.restart_seconds = 0.0  # how long a control-plane restart took

    # -- the API server ----------------------------------------------------------------------

    def node(self) -> dict[str, Any]:
        data: dict[str, Any] = self.cluster.api.get(f"/api/v1/nodes/{self.name}")
        return data

    def patch_labels(self, labels: Mapping[str, str | None]) -> None:
        self.cluster.api.request(
            "PATCH",
            f"/api/v1/nodes/{self.name}",
            {"metadata": {"labels": dict(labels)}},
            content_type="application/merge-patch+json",
        )

    def labels(self) -> dict[str, str]:
        return dict(self.node()["metadata"].get("labels") or {})

    def wait(self, what: str, pred: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name}: no {what} after {timeout:g} s; log:\n" + self.log_tail()
                )
            time.sleep(0.1)

    # -- the agent's log ---------------------------------------------------------------------

    def log_lines(self) -> list[dict[str, Any]]:
        """The agent's JSON log lines written since the last call."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        lines = []
        for raw in data[:end].splitlines():
            try:
                lines.append(json.loads(raw))
            except ValueError:
                continue
        self.lines.extend(lines)
        return lines

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    # -- set-up ------------------------------------------------------------------------------

    def prepare(self) -> None:
        self.wait(
            "gpu-state annotation",
            lambda: "mig-agent.dev/gpu-state" in (self.node()["metadata"].get("annotations") or {}),
            SETUP_TIMEOUT_S,
        )
        sc = self.scenario
        self.patch_labels({CONFIG: sc.start})
        self.wait(
            f"success of {sc.start}", lambda: self.labels().get(STATE) == "success", SETUP_TIMEOUT_S
        )
        self.wait(
            "GPU resources" if sc.device_plugin != "dra" else "the node's DRA devices",
            lambda: self.ready() == sc.ready[1],
            SETUP_TIMEOUT_S,
        )
        if self.procs.device_plugin_kind == "nvidia":
            # GFD's labels are on the node (the node's own nvidia.com/gpu may be there before
            # the node runtime runs): none lands mid-pass, where its MIG strategy label would
            # rightly wake the agent for a second pass
            self.wait(
                "GFD's labels",
                lambda: (
                    FEATURE_LABELS_ANNOTATION in (self.node()["metadata"].get("annotations") or {})
                ),
                SETUP_TIMEOUT_S,
            )
        # first a pod on the first 1g.10gb device, which the pass keeps (H100), then a GPU pod
        # on three of the others: the drain has work to do, and a pod to leave alone
        if sc.stay_pod_limits:
            self._run_pod(self.stay_pod, sc.stay_pod_limits)
        self._run_pod(self.name, sc.pod_limits)
        # a running pod's processes start on its devices a moment later: the start taken before
        # that leaves the pod out of the check that it was not evicted from devices that stay
        self.wait(
            "the GPU pods' processes on their devices", self._pods_hold_devices, SETUP_TIMEOUT_S
        )
        self.pods_at_start, self.held_at_start = self.pods_left(), self.held_devices()
        # each mutating NVML call takes a moment, as on hardware: a fault lands near its point
        simstate.set_latency(self.procs.sim_state, 0.02)
        simstate.reset_call_counts(self.procs.sim_state)
        self.log_lines()
        self.lines = []  # from here on: the trial's lines

    def ready(self) -> int:
        """How many of `scenario.ready` the node offers: allocatable, or devices in its slice."""
        what = self.scenario.ready[0]
        if self.scenario.device_plugin == "dra":
            devices = dra_plugin.devices(self.cluster, self.name).values()
            return sum(d.get("profile") == what for d in devices)
        return int(self.node()["status"].get("allocatable", {}).get(what, "0"))

    def listing_problem(self) -> str:
        """How what the node advertises differs from what the GPUs hold now ("" if it agrees):
        its slice on a DRA node, else the capacity NVIDIA's plugin lists (mixed strategy)."""
        if self.scenario.device_plugin == "dra":
            return self.dra_problem()
        backend = open_node(self.procs.sim_state)
        try:
            want = expected_resources(backend.observe(), backend.models(), "mixed")
        finally:
            backend.close()
        # a resource whose plugin no longer lists it keeps its capacity with nothing allocatable
        status = self.node()["status"]
        capacity, allocatable = status.get("capacity", {}), status.get("allocatable", {})
        have = {
            k: int(v)
            for k, v in capacity.items()
            if k.startswith(GPU_PREFIXES) and int(v) and int(allocatable.get(k, "0"))
        }
        return "" if have == want else f"the GPUs hold {want}, the node lists {have}"

    def dra_problem(self) -> str:
        """On a DRA node, how its slice differs from what the GPUs hold now ("" if it agrees)."""
        if self.scenario.device_plugin != "dra":
            return ""
        backend = open_node(self.procs.sim_state)
        try:
            want = dra_devices.expected_devices(plugin_devices(backend.observe(), backend.models()))
        finally:
            backend.close()
        have = dra_devices.published_devices(
            dra_plugin.resource_slices(self.cluster, self.name), self.name
        )
        return dra_devices.difference(want, have)

    def taint_rules(self) -> dict[str, str]:
        """On a DRA node, the agent's DeviceTaintRules of its pool: device -> rule name."""
        if self.scenario.device_plugin != "dra":
            return {}
        rules = self.cluster.api.get(f"{RESOURCE}/{device_taints.PLURAL}")["items"]
        return device_taints.rules_of_node(rules, self.name)

    def untainted_gone(self) -> list[str]:
        """On a DRA node, the devices its slice lists that NVML no longer holds and no taint
        of the agent's takes out of scheduling."""
        backend = open_node(self.procs.sim_state)
        try:
            held = dra_devices.held_uuids(backend.observe())
        finally:
            backend.close()
        tainted = set(self.taint_rules())
        listed = dra_plugin.devices(self.cluster, self.name)
        return sorted(
            n for n, d in listed.items() if d.get("uuid") not in held and n not in tainted
        )

    @property
    def stay_pod(self) -> str:
        return f"{self.name}-stays"

    def _run_pod(self, name: str, limits: Mapping[str, str]) -> None:
        claims: dict[str, Any] = {}
        if self.scenario.device_plugin == "dra":  # a claim of the MIG devices, then its pod
            ((profile, count),) = limits.items()
            self.cluster.api.request(
                "POST",
                f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims",
                _claim(name, profile, int(count)),
            )
            claims = {
                "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                "containers": [
                    {
                        "name": "cuda",
                        "image": SIMULATED_IMAGE,
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
            }
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {
                "terminationGracePeriodSeconds": 1,
                "nodeSelector": {"kubernetes.io/hostname": self.name},
                "containers": [
                    {
                        "name": "cuda",
                        "image": SIMULATED_IMAGE,
                        "resources": {"limits": dict(limits), "requests": dict(limits)},
                    }
                ],
                **claims,
            },
        }
        self.cluster.api.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod)
        self.wait(
            f"the GPU pod {name} to run",
            lambda: (
                self.cluster.api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
                .get("status", {})
                .get("phase")
                == "Running"
            ),
            SETUP_TIMEOUT_S,
        )

    def _pods_hold_devices(self) -> bool:
        """Whether each trial pod holds a process on every device it asked for (a claim's
        devices, on a DRA node, hold none)."""
        if self.scenario.device_plugin == "dra":
            return True
        asked = {self.name: self.scenario.pod_limits, self.stay_pod: self.scenario.stay_pod_limits}
        held = self.held_devices()
        return all(
            len(held.get(uid, ())) == sum(int(n) for n in (asked[name] or {}).values())
            for name, uid in self.pods_left().items()
        )

    def pods_left(self) -> dict[str, str]:
        """The trial's GPU pods there and not terminating: name -> UID."""
        pods = self.cluster.api.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
        mine = {self.name, self.stay_pod}
        return {
            p["metadata"]["name"]: p["metadata"]["uid"]
            for p in pods
            if p["metadata"]["name"] in mine and not p["metadata"].get("deletionTimestamp")
        }

    def held_devices(self) -> dict[str, set[tuple[int, int]]]:
        """Pod UID -> the devices its processes hold: (GPU, GI serial; -1 for the whole GPU).
        A GI serial is never reused, so a destroyed and re-created instance is another one."""
        sim = simstate.load_node(self.procs.sim_state)
        out: dict[str, set[tuple[int, int]]] = {}
        for owner, procs in simstate.processes_by_owner(self.procs.sim_state).items():
            if owner.startswith("pod/"):
                for index, proc in procs:
                    gi = None if proc.gi is None else sim.gpus[index].gi(proc.gi)
                    out.setdefault(owner[4:], set()).add((index, -1 if gi is None else gi.serial))
        return out

    def evicted_though_kept(self) -> list[str]:
        """The trial's pods gone although every device they held at the start is still there."""
        sim = simstate.load_node(self.procs.sim_state)

        def alive(device: tuple[int, int]) -> bool:
            gpu = sim.gpus[device[0]]
            return not gpu.mig_current if device[1] < 0 else gpu.gi_by_serial(device[1]) is not None

        left = set(self.pods_left().values())
        return sorted(
            name
            for name, uid in self.pods_at_start.items()
            if uid not in left
            and self.held_at_start.get(uid)
            and all(map(alive, self.held_at_start[uid]))
        )

    def close(self) -> None:
        agents.stop_node(self.cluster.dir, self.name)
        # a reboot command runs in a session of its own: stopping the agent (its process group)
        # leaves it running, where a pod's end would take it along
        for pid in _processes_of(REBOOT_MARKER):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if self.proxy is not None:
            self.proxy.stop()
        with contextlib.suppress(ApiError):  # gone already
            self.cluster.api.request(
                "DELETE",
                f"/api/v1/namespaces/{NAMESPACE}/pods/{self.name}",
                {"gracePeriodSeconds": 0},
            )
        if self.scenario.stay_pod_limits:
            with contextlib.suppress(ApiError):
                self.cluster.api.request(
                    "DELETE",
                    f"/api/v1/namespaces/{NAMESPACE}/pods/{self.stay_pod}",
                    {"gracePeriodSeconds": 0},
                )
        if self.scenario.device_plugin == "dra":
            with contextlib.suppress(ApiError):
                self.cluster.api.request(
                    "DELETE", f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims/{self.name}"
                )
        self.cluster.delete_node(self.name)

    # -- checks ------------------------------------------------------------------------------

    def instance_calls(self) -> dict[str, int]:
        """NVML calls that create or destroy GPU or compute instances since `prepare`."""
        counts = simstate.call_counts(self.procs.sim_state).by_function
        return {f: n for f, n in sorted(counts.items()) if "Create" in f or "Destroy" in f}

    def gpus_match(self, layout: str) -> tuple[bool, list[str]]:
        """Whether `layout` is in place on the GPUs; the stray GPU instances (no CI)."""
        try:
            catalog = load_catalog([self.profiles])
        except MigAgentError:  # made invalid by the trial: the layouts the agent had
            catalog = load_catalog([agents.PROFILES])
        backend = open_node(self.procs.sim_state)
        try:
            observed = backend.observe()
            stray = [
                f"GPU {g.index} GI {gi.id}"
                for g in observed.gpus
                for gi in g.gpu_instances
                if not gi.compute_instances
            ]
            applied = (
                planner.plan(
                    catalog.get(layout), observed, backend.models(), destroy_in_use=True
                ).is_empty
                if layout in catalog.layouts
                else False
            )
        finally:
            backend.close()
        return applied, stray


def ensure_namespace(cluster: Cluster) -> None:
    try:
        cluster.api.get(f"/api/v1/namespaces/{NAMESPACE}")
    except ApiError:  # not there yet
        cluster.api.request("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})


def inject(node: FaultNode, fault: str) -> None:
    sc = node.scenario
    if fault == "kill":
        agents.kill_agent(node.cluster.dir, node.name)
    elif fault == "relabel-other":
        node.patch_labels({CONFIG: sc.other})
    elif fault == "relabel-typo":
        node.patch_labels({CONFIG: sc.typo})
    elif fault == "relabel-removed":
        node.patch_labels({CONFIG: None})
    elif fault == "repartition-other":  # as `mig-agent repartition` relabels: state cleared
        node.patch_labels({CONFIG: sc.other, STATE: None})
    elif fault in NODE_FAULTS:
        inject_node_fault(node, fault)
    elif fault == "apiserver-restart":
        node.restart_seconds = node.cluster.restart(timeout=120)
    elif fault in API_FAULTS:
        assert node.proxy is not None
        node.proxy.add(dataclasses.replace(API_FAULTS[fault]), seconds=API_FAULT_SECONDS.get(fault))
    else:
        raise ValueError(fault)


def arm_before_the_pass(node: FaultNode, fault: str, point: Point) -> bool:
    """Whether `fault` was added to the proxy now, to land right after the request that marks
    `point` (ARMING_REQUESTS); else it is injected when the agent logs the point."""
    after = ARMING_REQUESTS.get(point.name)
    if after is None or point.nth != 1 or fault not in API_FAULTS or fault in API_FAULT_SECONDS:
        return False
    if API_FAULTS[fault].kind in ("watch-end", "watch-silent"):  # they act on the open watches
        return False
    assert node.proxy is not None
    node.proxy.add(dataclasses.replace(API_FAULTS[fault], after=after))
    return True


def inject_node_fault(node: FaultNode, fault: str) -> None:
    path = node.procs.sim_state
    if fault == "nvml-error":  # the next mutating NVML call fails
        simstate.inject_failure(path, simstate.UNKNOWN)
    elif fault == "nvml-half":  # the next one takes effect, and reports an error all the same
        simstate.inject_failure(path, simstate.UNKNOWN, after=True)
    elif fault == "gpu-busy":  # a process that no pod owns on each MIG device of GPU 0
        for gi in simstate.load_node(path).gpus[0].gpu_instances:
            for ci in gi.compute_instances[:1]:
                simstate.start_process(path, 0, gi=gi.id, ci=ci.id, owner="fault-matrix")
    elif fault == "reset-fails":
        simstate.inject_failure(path, simstate.UNKNOWN, function=simstate.RESET, times=1000)
    elif fault == "reboot-hangs":  # as in a pass-through VM: only a reboot can finish the change
        simstate.set_reset_supported(path, False)
    elif fault in ("plugin-gone", "plugin-wrong"):
        stop([node.procs.device_plugin])  # and nothing restarts it
        if fault == "plugin-wrong":  # what it advertised last time, one device short
            res = node.scenario.ready[0]
            value = str(node.scenario.ready[1] - 1)
            node.cluster.api.request(
                "PATCH",
                f"/api/v1/nodes/{node.name}/status",
                {"status": {"capacity": {res: value}, "allocatable": {res: value}}},
                content_type="application/merge-patch+json",
            )
    elif fault == "post-apply-fails":
        post_apply_flag(node.cluster, node.name).touch()
    elif fault == "config-invalid":
        (node.profiles / "all.yaml").write_text("mig-configs: [unclosed\n")
    elif fault == "config-changed":
        f = node.profiles / "all.yaml"
        text = f.read_text()
        assert text.count(BALANCED_H100) == 1, "the H100's all-balanced entry moved"
        f.write_text(text.replace(BALANCED_H100, CHANGED_H100))
    else:
        raise ValueError(fault)


def expected_cause(fault: str, scenario: Scenario) -> str:
    """What a `failed` reason must name for a trial with `fault` to count as failed-with-reason."""
    if fault == "plugin-gone" and scenario.device_plugin == "dra":
        return "does not list the layout's devices"
    return {
        "relabel-typo": scenario.typo,
        "gpu-busy": "in use by",
        "plugin-gone": "node resources do not match",
        "plugin-wrong": "node resources do not match",
        "post-apply-fails": "post-apply hook",
        "reset-fails": "reset",
        "reboot-hangs": f"reboot command {REBOOT_HANGS!r} did not return within",
    }.get(fault, "")


_clean: dict[str, dict[str, int]] = {}


def clean_calls(cluster: Cluster, scenario: Scenario) -> dict[str, int]:
    """The instance calls of START -> TARGET with no fault (measured once per process)."""
    if scenario.name not in _clean:
        node = FaultNode(cluster, scenario)
        try:
            node.prepare()
            node.patch_labels({CONFIG: scenario.target})
            outcome, detail = settle_and_check(node, "none", 90)
            if (outcome, detail) != ("converged", f"{scenario.target} applied"):
                raise RuntimeError(
                    f"the pass without a fault: {outcome}: {detail}\n" + node.log_tail()
                )
            _clean[scenario.name] = node.instance_calls()
        finally:
            node.close()
    return dict(_clean[scenario.name])


def post_apply_flag(cluster: Cluster, node: str) -> Path:
    """The file whose presence makes the node's post-apply hook fail (post-apply-fails)."""
    return cluster.dir / f"post-apply-fails-{node}"


def fault_settings(cluster: Cluster, fault: str) -> dict[str, str] | None:
    if fault != "post-apply-fails":
        return NODE_FAULT_SETTINGS.get(fault)
    flag = shlex.quote(str(cluster.dir / "post-apply-fails-"))
    check = f'test ! -e {flag}"$NODE_NAME" || {{ echo CDI spec not written >&2; exit 3; }}'
    return {"MIG_AGENT_POST_APPLY_COMMAND": shlex.join(["sh", "-c", check])}


def run_trial(
    cluster: Cluster,
    point: Point,
    fault: str,
    *,
    settle: float = 90.0,
    scenario: Scenario | None = None,
) -> Result:
    sc = scenario or H100
    settle = max(settle, FAULT_SETTLE.get(fault, 0.0))
    keeps_label = fault in ("kill", *CONTROL_PLANE_FAULTS) or (
        fault in API_FAULTS and fault != "watch-silent"
    )
    reference = clean_calls(cluster, sc) if keeps_label else None
    started = time.monotonic()
    try:
        node = FaultNode(
            cluster,
            sc,
            proxy=fault in API_FAULTS,
            settings=fault_settings(cluster, fault),
            own_profiles=fault.startswith("config-"),
        )
    except (DevClusterError, ApiError, OSError) as e:  # no node, no agent: no verdict
        return Result(
            point.name,
            fault,
            "not-reached",
            f"set-up: {str(e).splitlines()[0]}",
            time.monotonic() - started,
            "",
            sc.name,
        )
    try:
        try:
            node.prepare()
        except TimeoutError as e:  # the trial never started: no verdict on the agent
            return Result(
                point.name,
                fault,
                "not-reached",
                f"set-up: {str(e).splitlines()[0]}",
                time.monotonic() - started,
                node.log_tail(),
                sc.name,
            )
        armed = arm_before_the_pass(node, fault, point)
        node.patch_labels({CONFIG: sc.target})
        seen = 0
        deadline = time.monotonic() + 60
        reached = False
        while time.monotonic() < deadline and not reached:
            for line in node.log_lines():
                if point.matches(line):
                    seen += 1
                    if seen == point.nth:
                        if not armed:
                            inject(node, fault)
                        reached = True
                        break
                if line.get("event") == "reconcile.finished":
                    deadline = 0.0  # the pass ended without the point
            time.sleep(0.005)
        if not reached:
            return Result(
                point.name,
                fault,
                "not-reached",
                "the pass never logged this point",
                time.monotonic() - started,
                node.log_tail(),
                sc.name,
            )
        if fault == "watch-silent":  # the pass ends; then a relabel only the watch would tell
            node.wait(
                "the pass to end", lambda: node.labels().get(STATE) in ("success", "failed"), settle
            )
            time.sleep(1.0)
            node.patch_labels({CONFIG: sc.other})
            try:  # noticed by the node watch (a new one, once the dead one's read timed out)
                node.wait(
                    f"a pass for {sc.other}",
                    lambda: any(
                        line.get("event") == "reconcile.started" and line.get("layout") == sc.other
                        for line in node.log_lines()
                    ),
                    WATCH_TIMEOUT_S + 30,
                )
            except TimeoutError as e:
                return Result(
                    point.name,
                    fault,
                    "violated",
                    f"relabel not noticed: {str(e).splitlines()[0]}",
                    time.monotonic() - started,
                    node.log_tail(),
                    sc.name,
                )
        outcome, detail = settle_and_check(node, fault, settle)
        calls = node.instance_calls()
        if reference is not None and outcome != "violated" and calls != reference:
            # the same label throughout: a restarted agent must finish the pass, not redo it
            outcome, detail = (
                "violated",
                (f"GPU/compute instance calls {calls}, a pass without the fault makes {reference}"),
            )
        # by the agent (after an API server restart the node-lifecycle controller may evict
        # too), knowing who holds what (else every GPU pod goes, by design)
        evicted = {
            line.get("pod") for line in node.lines if line.get("event") == "drain.pod_evicted"
        }
        wrongly = [p for p in node.evicted_though_kept() if p in evicted]
        if any(line.get("event") == "drain.pod_resources_unavailable" for line in node.lines):
            wrongly = []
        if reference is not None and outcome != "violated" and wrongly:
            # the label the same throughout: a pod whose devices all outlived the pass stays
            outcome, detail = "violated", f"evicted though every device it held stays: {wrongly}"
        hits = (
            ", ".join(f"{k} x{v}" for k, v in sorted(node.proxy.hits.items())) if node.proxy else ""
        )
        if node.restart_seconds:
            hits = f"API server down {node.restart_seconds:.1f} s"
        return Result(
            point.name,
            fault,
            outcome,
            detail,
            time.monotonic() - started,
            node.log_tail() if outcome == "violated" else "",
            sc.name,
            hits,
        )
    except TimeoutError as e:
        return Result(
            point.name,
            fault,
            "violated",
            str(e).splitlines()[0],
            time.monotonic() - started,
            node.log_tail(),
            sc.name,
        )
    except (OSError, ApiError, DevClusterError) as e:  # the harness's own request failed, or
        # the restarted API server was not healthy in time (an overloaded machine)
        return Result(
            point.name,
            fault,
            "not-reached",
            f"harness: {e}",
            time.monotonic() - started,
            node.log_tail(),
            sc.name,
        )
    finally:
        node.close()


def agent_reported_state(node: FaultNode) -> str | None:
    """The state the running agent's own metric reports (`mig_agent_state`): what its last pass
    ended in ("" when no layout is asked for); None before its first pass or when unreachable."""
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{node.procs.metrics_port}/metrics", timeout=2
        ) as r:
            text = r.read().decode()
    except OSError:
        return None
    states = {}
    for line in text.splitlines():
        m = re.match(r'mig_agent_state\{state="([^"]*)"\} (\S+)', line)
        if m:
            states[m.group(1)] = float(m.group(2))
    if not states:
        return None
    return next((k for k, v in states.items() if v == 1), "")


def _settled(node: FaultNode, state: str | None, quiet: float) -> bool:
    """The agent runs, its own last pass ended in `state` (the node's state label), and it has
    been quiet for `quiet` seconds."""
    record = agents.running(node.cluster.dir).get(node.name, {})
    if agents.agent_state(record) != "running":
        return False
    if agent_reported_state(node) != (state or ""):
        return False
    try:
        age = time.time() - node.log_path.stat().st_mtime
    except OSError:
        return False
    return age >= quiet


PASS_ENDS = ("reconcile.succeeded", "reconcile.failed")


def verdict_due(layout: str | None, state: str | None, lines: list[dict[str, Any]]) -> bool:
    """Whether the node's labels are the agent's last word on the trial, given the agent's log
    lines since the trial began. A state label is the agent's answer to a layout only once the
    agent has ended a pass for that layout: read just after the harness set it, the label still
    holds the verdict on the layout before."""
    if not layout:
        return state is None
    if state not in ("success", "failed"):
        return False
    if not any(line.get("event") in PASS_ENDS and line.get("layout") == layout for line in lines):
        return False
    fails = [line for line in lines if line.get("event") == "reconcile.failed"]
    # a retry is due: settled once the failure outlived one retry
    return not (
        state == "failed" and fails and fails[-1].get("retry_in_s") is not None and len(fails) < 2
    )


def settle_and_check(node: FaultNode, fault: str, timeout: float) -> tuple[str, str]:
    """Wait until the agent has settled; then (outcome, detail)."""
    deadline = time.monotonic() + timeout
    if fault.startswith("config-"):  # the agent reads its config files between passes
        node.wait(
            "the agent to read the changed config",
            lambda: any(
                line.get("event") in ("config.loaded", "config.invalid")
                for line in node.log_lines()
            ),
            timeout,
        )
    while True:
        labels = node.labels()
        layout = labels.get(CONFIG)
        state = labels.get(STATE)
        node.samples.append((time.time(), layout, state))
        node.log_lines()
        if verdict_due(layout, state, node.lines) and _settled(node, state, 2.0):
            break
        if time.monotonic() > deadline:
            return "violated", (
                f"not settled after {timeout:g} s: layout {layout!r}, state {state!r}"
            )
        time.sleep(0.05)
    node.log_lines()
    # settled: now the invariants
    n = node.node()
    labels = dict(n["metadata"].get("labels") or {})
    annotations = dict(n["metadata"].get("annotations") or {})
    layout, state = labels.get(CONFIG), labels.get(STATE)
    problems = []
    listing = node.listing_problem()
    cordoned = bool(n.get("spec", {}).get("unschedulable"))
    # the one cordon (or, on a DRA node of Kubernetes 1.37, the device taints) a failure keeps
    # on purpose: the node lists devices the GPUs no longer hold
    why = annotations.get(REASON, "")
    kept = bool(listing) and state == "failed" and (STAYS_CORDONED in why or STAYS_TAINTED in why)
    if cordoned and state != "rebooting" and not kept:
        problems.append("left cordoned")
    if not cordoned and listing and (node.scenario.device_plugin != "dra" or node.untainted_gone()):
        problems.append(f"schedulable over devices that are gone: {listing}")
    taints = node.taint_rules()
    if taints and not kept:
        problems.append(f"device taints left: {sorted(taints)}")
    paused = sorted(k for k, v in labels.items() if v == PAUSED)
    if paused and state != "rebooting":
        problems.append(f"operands left paused: {paused}")
    for key in ("mig-agent.dev/cordoned", "mig-agent.dev/paused-operands"):
        if key in annotations and state != "rebooting" and not (kept and key.endswith("cordoned")):
            problems.append(f"{key} left on the node")
    record = agents.running(node.cluster.dir).get(node.name, {})
    if agents.agent_state(record) != "running":
        problems.append(f"agent not running: {record.get('last_exit')}")
    applied, stray = (
        node.gpus_match(layout) if layout else (False, node.gpus_match(node.scenario.start)[1])
    )
    if stray:
        problems.append(f"stray GPU instance(s) without a compute instance: {stray}")
    if state == "success" and not applied:
        problems.append(f"success, but layout {layout} is not what the GPUs hold")
    if state == "success" and (slice_off := node.dra_problem()):
        problems.append(f"success, but the node's ResourceSlice differs: {slice_off}")
    false = false_success(node)
    if false:
        problems.append(false)
    if layout and state == "success" and REASON in annotations:
        problems.append(f"success with a stale reason: {annotations[REASON]}")
    if fault == "reboot-hangs":
        problems += reboot_problems(node, annotations)
    # a bug the pass survived (reported as an internal error, retried) is still a bug
    crashed = [ln for ln in node.lines if ln.get("event") in ("reconcile.crashed", "cli.crashed")]
    if crashed:
        problems.append(
            "a pass crashed: "
            + "; ".join(f"{ln.get('error_type', '')}: {ln.get('error', '')}" for ln in crashed)
        )
    if problems:
        return "violated", "; ".join(problems)
    if not layout:
        return "converged", "no layout asked for: no state, node clean"
    if state == "success":
        return "converged", f"{layout} applied"
    reason = annotations.get(REASON, "")
    cause = expected_cause(fault, node.scenario)
    if not reason:
        return "violated", "failed without a reason"
    if cause and cause not in reason:
        return "violated", f"failed, reason does not name {cause}: {reason}"
    return "failed", reason


REBOOT_GUARD = "mig-agent.dev/reboot-attempted"
STAYS_CORDONED = "the node stays cordoned until"
STAYS_TAINTED = "the devices of the GPUs that change stay tainted until"
GPU_PREFIXES = ("nvidia.com/gpu", "nvidia.com/mig-")


def reboot_problems(node: FaultNode, annotations: Mapping[str, str]) -> list[str]:
    """What a reboot command that never returned must not leave: the reboot guard armed (no
    reboot happened, so a fixed command must get its one reboot), processes of the command, or
    GPU state the command would have changed (no reboot: MIG mode still pending)."""
    out = []
    if REBOOT_GUARD in annotations:
        out.append(f"reboot guard armed though no reboot happened: {annotations[REBOOT_GUARD]}")
    left = _processes_of(REBOOT_MARKER)
    if left:
        out.append(f"the reboot command's processes outlived its time limit: pids {left}")
    if not any(line.get("event") == "node.rebooting" for line in node.lines):
        out.append("the agent never ran the reboot command")
    gpus = simstate.load_node(node.procs.sim_state).gpus
    if any(g.mig_current for g in gpus):
        out.append("MIG mode took effect without a reset or a reboot")
    return out


def _processes_of(marker: str) -> list[int]:
    pids = []
    for proc in os.scandir("/proc"):
        if proc.name.isdigit():
            try:
                with open(os.path.join(proc.path, "cmdline"), "rb") as f:
                    cmdline = f.read()
            except OSError:  # gone meanwhile
                continue
            # the arguments are NUL-separated: `sleep 3599.25` reads sleep\03599.25\0
            if marker.encode() in cmdline.replace(b"\0", b" ") and int(proc.name) != os.getpid():
                pids.append(int(proc.name))
    return pids


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def false_success(node: FaultNode) -> str:
    """A `success` written for a layout the GPUs did not hold: a sample showed `success` under
    layout L, and the agent later started a pass that had to change GPUs for L. The run of
    `success` samples that the trial starts with is left out: a relabel keeps the old state label
    until the agent's next pass (`repartition` clears it), which is no report of the agent's."""
    starts = [
        (_epoch(line["timestamp"]), line.get("layout"))
        for line in node.lines
        if line.get("event") == "reconcile.started"
        and line.get("changed_gpus")
        and "timestamp" in line
    ]
    samples = list(node.samples)
    while samples and samples[0][2] == "success":
        samples.pop(0)
    for t, layout, state in samples:
        if state != "success":
            continue
        if layout is None or layout == node.scenario.typo:
            return f"success seen with layout label {layout!r}"
        if any(ts > t and lay == layout for ts, lay in starts):
            return f"success seen for {layout} before {layout} was applied"
    return ""


def points(names: tuple[str, ...] | None = None, scenario: Scenario | None = None) -> list[Point]:
    return [p for p in (scenario or H100).points if names is None or p.name in names]


def fault_points(
    fault: str, scenario: Scenario, names: tuple[str, ...] | None = None
) -> list[Point]:
    """The points of the matrix where `fault` is injected: every point of the scenario for the
    label faults, one per phase of the H100 pass for the API and control-plane faults."""
    if scenario is DRA:  # the faults of its own: the agent, the API, the DRA plugin
        named = DRA_FAULT_POINTS.get(fault) if fault not in LABEL_FAULTS else None
        if fault not in LABEL_FAULTS and named is None:
            return []
        return [p for p in points(named, scenario) if names is None or p.name in names]
    if fault in ("reset-fails", "reboot-hangs"):  # only the A100 resets
        return (
            []
            if scenario is H100
            else [
                p for p in points(NODE_POINTS[fault], scenario) if names is None or p.name in names
            ]
        )
    if fault in NODE_POINTS:
        if scenario is not H100:
            return []
        return [p for p in points(NODE_POINTS[fault], scenario) if names is None or p.name in names]
    if fault in API_FAULTS or fault in CONTROL_PLANE_FAULTS:
        if scenario is not H100:
            return []
        return [p for p in points(API_POINTS, scenario) if names is None or p.name in names]
    return points(names, scenario)


def _claim(name: str, profile: str, count: int) -> dict[str, Any]:
    """A ResourceClaim of `count` MIG devices of `profile` (DeviceClass mig.nvidia.com)."""
    request = {
        "deviceClassName": "mig.nvidia.com",
        "allocationMode": "ExactCount",
        "count": count,
        "selectors": [
            {"cel": {"expression": f"device.attributes['gpu.nvidia.com'].profile == '{profile}'"}}
        ],
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": request}]}},
    }
