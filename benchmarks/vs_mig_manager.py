"""mig-agent side by side with NVIDIA's MIG Manager: the same transitions, the same simulated GPUs
and hardware latencies, the same pods, the same profile config, in one run on one local cluster.

    python benchmarks/vs_mig_manager.py [--nodes 1] [--latency 0.25] [--gpus 8xH100-80GB]
                                        [--ampere-gpus 8xA100-40GB] [--quick]
                                        [--parts suite,failures,idle,handover]

Two pools of identical simulated nodes (`--nodes` Hopper nodes and as many Ampere nodes each): one
run by NVIDIA's `nvidia-mig-manager` (migsim.cluster.mig_manager: as its DaemonSet runs it, with
`nvidia-mig-parted` on its PATH, over the simulated libnvidia-ml.so.1), one by mig-agent
(migsim.cluster.agents), each node with the simulated device plugin. Both read one config file:
the packaged all.yaml and common.yaml plus the benchmark's per-GPU layouts.

The suite, each transition with a GPU pod on every device of the node before the label changes:
(a) whole GPUs -> all-balanced (Hopper); (b) one GPU of the node changes (all-balanced -> the last
GPU all-1g); (c) a layout that keeps most instances (all-balanced -> the 3g of every GPU becomes
three 1g); (d) all-balanced -> all-1g and back; (e) whole GPUs -> all-balanced on Ampere (MIG mode
change pending until a GPU reset). Each suite runs twice: with the simulated hardware latency
(`--latency` seconds added to every mutating NVML call -- GPU/compute instance create and destroy,
MIG mode change -- and to the GPU reset; the simulator has one knob for all of these) and with
none, which shows pure overhead. Pods take 2 s to terminate (kwok's deletion delay), the device
plugin's pod too.

Per transition and system: outcome, wall time label -> state label (`success`/`failed`) and label
-> the node advertises the new devices, GPU instances destroyed and created (the simulator's call
counters), pods that lost their device (evicted, or still running on a destroyed device), pods
evicted, the manager's API requests, its CPU seconds (MIG Manager: with the mig-parted runs it
waited for) and peak RSS. Each manager reaches the API server through a proxy of its own
(migsim.cluster.api_faults, no fault set: it only counts), so both systems' requests are counted
the same way, by verb and resource. MIG Manager does not drain:
where pods hold the devices its apply fails; the benchmark then deletes the node's GPU pods by hand
(what an operator must do first) and relabels, and reports that retry as its own row; the ratios
compare mig-agent with MIG Manager's drain-by-hand-then-apply.

`--parts` adds, after the suite or instead of it (in this order):

* `failures`, cases (i)-(iv) on the first Hopper node of each pool, from all-balanced, with the
  simulated hardware latency: (i) a layout naming a profile no GPU has (1g.99gb), fixed by
  relabelling to the layout meant; (ii) a GPU pod on a 3g device under a PodDisruptionBudget that
  allows no disruption, fixed by relaxing the budget (minAvailable 0); (iii) a GPU process that is
  no pod's on the last GPU's 3g instance, fixed by ending it; (iv) the manager SIGKILLed once the
  pass has made 3 mutating NVML calls (MIG Manager: its whole process group, as a crashed
  container; mig-agent: its process), restarted 10 s later (the kubelet's first back-off: the
  agent's supervisor, MIG Manager by the benchmark). The fault stands `--window` seconds; then
  the state label, what the operator is told (MIG Manager: its log's first error line; mig-agent:
  its reason annotation and last warning Event), GPU instances destroyed, the GPUs that hold
  neither the old nor the new layout, cordon and paused operands; then the fix, and its time to
  `success` (`--settle` at most). Where MIG Manager's `failed` outlives the fix, the benchmark
  then does what an operator must (delete the pod, relabel through another value) and says how
  long that took. The agent runs with its own retry defaults (AGENT_SETTINGS).
* `idle`, both pools at their layouts: each manager's API requests over `--idle` seconds.
* `handover`, run last: MIG Manager's node is handed to mig-agent and the agent's node to MIG
  Manager, at all-balanced with a pod on every device: the newcomer's first pass (NVML mutations,
  pods evicted, state), then a new layout (bench-keep-most) applied by it.

Needs root (MIG Manager's private mount namespace), the Kubernetes binaries and NVIDIA's binaries
(scripts/k8s-binaries, scripts/nvidia-binaries). Timings are wall-clock on a shared machine: compare
ratios and counts rather than absolute seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing the package

from migsim.cluster import Cluster, ViaProxy, agents, mig_manager  # noqa: E402
from migsim.cluster.api_faults import ApiFaultProxy  # noqa: E402
from migsim.cluster.processes import Proc  # noqa: E402
from migsim.nvml import state as simstate  # noqa: E402

from benchmarks.options import add_cluster_options  # noqa: E402
from benchmarks.tables import print_table  # noqa: E402

CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
GPU_STATE = "mig-agent.dev/gpu-state"
NS = "bench"
POD_LABEL = "bench.mig-agent.dev/node"
MM, MA = "MIG Manager", "mig-agent"
DESTROY_GI = "nvmlGpuInstanceDestroy"
CREATE_GI = ("nvmlDeviceCreateGpuInstance", "nvmlDeviceCreateGpuInstanceWithPlacement")
PROFILES = REPO / "profiles"
HOPPER_BALANCED = {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
# The agent's own defaults for retries (agents.start_node's test settings make them shorter):
# back-off 5 s doubling to 300 s after a failed pass, an eviction refused by a PDB retried every
# 5 s; its supervisor restarts it as a kubelet would (10 s, doubling to 5 min).
AGENT_SETTINGS = {
    "MIG_AGENT_BACKOFF_S": "5",
    "MIG_AGENT_BACKOFF_MAX_S": "300",
    "MIG_AGENT_EVICTION_RETRY_S": "5",
}


@dataclass(frozen=True, slots=True)
class Transition:
    key: str
    title: str
    kind: str  # "hopper" or "ampere": which nodes of the pool
    start: str
    target: str
    pods_on: str = ""  # only devices of this resource get a pod ("": every device)


SUITE = (
    Transition("a", "whole GPUs -> all-balanced", "hopper", "all-disabled", "all-balanced"),
    Transition("b", "one GPU changes", "hopper", "all-balanced", "bench-one-gpu"),
    Transition("c", "keeps most instances", "hopper", "all-balanced", "bench-keep-most"),
    Transition("d1", "all-balanced -> all-1g", "hopper", "all-balanced", "all-1g.10gb"),
    Transition("d2", "all-1g -> all-balanced", "hopper", "all-1g.10gb", "all-balanced"),
    Transition("e", "Ampere: whole -> MIG, reset", "ampere", "all-disabled", "all-balanced"),
    Transition(
        "f",
        "d1 with pods on the 1g devices only",
        "hopper",
        "all-balanced",
        "all-1g.10gb",
        pods_on="nvidia.com/mig-1g.10gb",
    ),
)


def bench_config(path: Path, hopper_gpus: int) -> Path:
    """One mig-parted config file: all.yaml + common.yaml + the suite's per-GPU layouts."""
    configs: dict[str, Any] = {}
    for name in ("common.yaml", "all.yaml"):
        configs.update(yaml.safe_load((PROFILES / name).read_text())["mig-configs"])
    last = hopper_gpus - 1
    configs["bench-one-gpu"] = [
        {"devices": list(range(last)), "mig-enabled": True, "mig-devices": HOPPER_BALANCED},
        {"devices": [last], "mig-enabled": True, "mig-devices": {"1g.10gb": 7}},
    ]
    configs["bench-keep-most"] = [
        {"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 5, "2g.20gb": 1}},
    ]
    # failure (i): a profile no GPU has (meant: bench-keep-most)
    configs["bench-bad-profile"] = [
        {"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 5, "1g.99gb": 1}},
    ]
    path.write_text(yaml.safe_dump({"version": "v1", "mig-configs": configs}, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------
# The cluster, as both systems see it


class Bench:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.api = cluster.api

    def node(self, name: str) -> dict[str, Any]:
        node: dict[str, Any] = self.api.get(f"/api/v1/nodes/{name}")
        return node

    def labels(self, name: str) -> dict[str, str]:
        return dict(self.node(name)["metadata"].get("labels") or {})

    def patch_labels(self, name: str, labels: Mapping[str, str | None]) -> None:
        self.api.request(
            "PATCH",
            f"/api/v1/nodes/{name}",
            {"metadata": {"labels": labels}},
            content_type="application/merge-patch+json",
        )

    def advertised(self, name: str) -> Counter[str]:
        alloc = self.node(name)["status"].get("allocatable") or {}
        return Counter(
            {k: int(v) for k, v in alloc.items() if k.startswith("nvidia.com/") and int(v) > 0}
        )

    def pods(self, name: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.api.get(
            f"/api/v1/namespaces/{NS}/pods?labelSelector={POD_LABEL}%3D{name}"
        )["items"]
        return items

    def sim_state(self, name: str) -> str:
        return str(agents.sim_state_path(self.cluster, name))


def devices_on(sim_state: str) -> Counter[str]:
    """The resources NVIDIA's device plugin (mixed strategy) offers for the GPUs as they are."""
    out: Counter[str] = Counter()
    for gpu in simstate.load_node(sim_state).gpus:
        if not gpu.mig_current:
            out["nvidia.com/gpu"] += 1
            continue
        for gi in gpu.gpu_instances:
            profile = gpu.model.gi_profile_by_id(gi.profile_id)
            assert profile is not None
            out[f"nvidia.com/mig-{profile.name}"] += len(gi.compute_instances)
    return out


def held_devices(sim_state: str) -> dict[str, set[tuple[int, int]]]:
    """Pod UID -> the devices its processes hold: (GPU, GI serial; -1 for the whole GPU)."""
    node = simstate.load_node(sim_state)
    out: dict[str, set[tuple[int, int]]] = {}
    for owner, procs in simstate.processes_by_owner(sim_state).items():
        if not owner.startswith("pod/"):
            continue
        for gpu_index, proc in procs:
            gi = None if proc.gi is None else node.gpus[gpu_index].gi(proc.gi)
            out.setdefault(owner[4:], set()).add((gpu_index, -1 if gi is None else gi.serial))
    return out


def device_alive(node: simstate.SimNode, device: tuple[int, int]) -> bool:
    gpu = node.gpus[device[0]]
    if device[1] < 0:
        return not gpu.mig_current
    return gpu.gi_by_serial(device[1]) is not None


def wait(what: str, ready: Callable[[], bool], timeout: float, poll: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout:g} s")
        time.sleep(poll)


def fill_with_pods(bench: Bench, name: str, only: str = "") -> int:
    """A GPU pod on every device the node advertises (of resource `only`, if given); returns
    once each runs and holds its device (a simulated process on it). The number of pods."""
    want = devices_on(bench.sim_state(name))
    wait(f"{name} advertises {dict(want)}", lambda: bench.advertised(name) == want, 120)
    n = 0
    for resource, count in sorted(want.items()):
        if only and resource != only:
            continue
        for _ in range(count):
            limits = {resource: "1"}
            bench.api.request(
                "POST",
                f"/api/v1/namespaces/{NS}/pods",
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"generateName": f"{name}-", "labels": {POD_LABEL: name}},
                    "spec": {
                        "nodeSelector": {"kubernetes.io/hostname": name},
                        "tolerations": [{"operator": "Exists"}],
                        "containers": [
                            {
                                "name": "cuda",
                                "image": "registry.invalid/sim:1",
                                "resources": {"limits": limits, "requests": limits},
                            }
                        ],
                    },
                },
            )
            n += 1

    def holding() -> bool:
        pods = bench.pods(name)
        running = sum(1 for p in pods if p["status"].get("phase") == "Running")
        return running == n and len(held_devices(bench.sim_state(name))) == n

    wait(f"{n} GPU pods running on {name}", holding, 120)
    return n


def delete_pods(bench: Bench, names: Iterable[str], *, grace: int | None = 0) -> None:
    """Delete the benchmark's pods on `names`; return once they and their processes are gone."""
    names = list(names)
    for name in names:
        for pod in bench.pods(name):
            body = None if grace is None else {"gracePeriodSeconds": grace}
            bench.api.request(
                "DELETE", f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}", body
            )
    wait(
        "GPU pods gone",
        lambda: all(not bench.pods(n) and not held_devices(bench.sim_state(n)) for n in names),
        120,
    )


# ---------------------------------------------------------------------------------------------
# The two systems


@dataclass
class Pool:
    system: str
    hopper: list[str]
    ampere: list[str]
    metrics_ports: dict[str, int] = field(default_factory=dict)  # mig-agent only
    proxies: dict[str, ApiFaultProxy] = field(default_factory=dict)  # node -> its manager's

    def nodes(self, kind: str) -> list[str]:
        return self.hopper if kind == "hopper" else self.ampere

    def api_requests(self, nodes: Iterable[str]) -> int:
        """Requests the managers of `nodes` have made so far (their counting proxies)."""
        return sum(self.proxies[n].requests for n in nodes)

    def api_kinds(self, nodes: Iterable[str]) -> Counter[str]:
        """The same by verb and resource ("patch nodes", ...)."""
        out: Counter[str] = Counter()
        for n in nodes:
            out += self.proxies[n].snapshot()
        return out


def new_proxy(cluster: Cluster) -> ApiFaultProxy:
    """A proxy with no fault between one manager and the API server: it only counts."""
    pki = cluster.dir / "pki"
    return ApiFaultProxy(
        cluster.server, cert=pki / "serving.crt", key=pki / "serving.key", ca=cluster.ca_cert
    )


def manager_proc(cluster: Cluster, pool: Pool, node: str) -> Proc | None:
    """The process doing the work on `node`: the agent, or the nvidia-mig-manager binary."""
    if pool.system == MA:
        return Proc(**agents.running(cluster.dir)[node]["agent"])
    record = mig_manager.running(cluster.dir)[node]
    group = record["mig_manager"]["pid"]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) == group and comm.startswith("nvidia-mig-man"):
            return Proc("nvidia-mig-manager", int(stat.parent.name), int(fields[19]))
    return None


def cpu_with_children(proc: Proc | None) -> float:
    """User + system CPU seconds of `proc` and of the children it has waited for."""
    if proc is None or not proc.alive():
        return 0.0
    text = Path(f"/proc/{proc.pid}/stat").read_text()
    f = text[text.rindex(")") + 2 :].split()
    return sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(proc: Proc | None) -> float:
    if proc is None or not proc.alive():
        return 0.0
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def agent_api_requests(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("mig_agent_api_requests_total")
    )


# ---------------------------------------------------------------------------------------------
# One transition on one pool


@dataclass
class Row:
    transition: str
    system: str
    outcome: str
    to_state_s: float  # label -> success/failed (max over the pool's nodes)
    to_devices_s: float | None  # label -> the new devices advertised (None: not reached)
    destroyed: int
    created: int
    lost: int  # pods that lost their device: evicted, or running on a destroyed device
    evicted: int
    dead_device: int  # pods still running on a device that is gone
    api: float | None
    cpu_s: float
    rss_mib: float
    pods: int
    reason: str = ""  # why it failed: MIG Manager's last error line, mig-agent's reason
    api_by_kind: Counter[str] = field(default_factory=Counter)


def log_size(cluster: Cluster, pool: Pool, node: str) -> int:
    if pool.system != MM:
        return 0
    return Path(mig_manager.running(cluster.dir)[node]["log"]).stat().st_size


def failure_reason(bench: Bench, pool: Pool, node: str, offset: int) -> str:
    """MIG Manager: the cause mig-parted logged since `offset` (the first error or fatal line
    that names a busy GPU, else the first fatal, else the first error line); mig-agent: its
    reason annotation."""
    if pool.system == MA:
        annotations = bench.node(node)["metadata"].get("annotations") or {}
        return str(annotations.get("mig-agent.dev/reason", ""))[:200]
    with open(mig_manager.running(bench.cluster.dir)[node]["log"], "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    lines = [
        (level, m)
        for level, m in re.findall(r'level=(error|fatal) msg="((?:[^"\\]|\\.)*)"', text)
        if "not currently applied" not in m
    ]  # mig-parted's assert before the apply
    busy = [m for _, m in lines if "IN_USE" in m or "in use" in m]
    fatal = [m for level, m in lines if level == "fatal"]
    errors = [m for _, m in lines]
    for found in (busy, fatal, errors):
        if found:
            return found[0].replace("\\n", " ")[:200]
    return ""


def set_layout(bench: Bench, nodes: Sequence[str], layout: str, timeout: float = 300) -> None:
    """Bring `nodes` to `layout` (no pods on them), for the start of a transition."""
    todo = [
        n
        for n in nodes
        if bench.labels(n).get(CONFIG) != layout or bench.labels(n).get(STATE) != "success"
    ]
    for n in todo:
        if bench.labels(n).get(CONFIG) == layout:  # failed before: MIG Manager needs a change
            retrigger(bench, n)
        bench.patch_labels(n, {CONFIG: layout, STATE: None})
    for n in todo:
        wait_layout(bench, n, layout, timeout)


def wait_layout(bench: Bench, node: str, layout: str, timeout: float) -> None:
    wait(f"{node} at {layout}", lambda: bench.labels(node).get(STATE) == "success", timeout)
    want = devices_on(bench.sim_state(node))
    wait(f"{node} advertises {layout}", lambda: bench.advertised(node) == want, 120)


def retrigger(bench: Bench, node: str) -> None:
    """MIG Manager acts on a *change* of the label's value only: go through a layout that does
    not exist (refused at once, no GPU touched) so that setting the same layout again counts."""
    bench.patch_labels(node, {CONFIG: "bench-retrigger", STATE: None})
    wait(f"{node} refused bench-retrigger", lambda: bench.labels(node).get(STATE) == "failed", 60)


def run_transition(
    bench: Bench, pool: Pool, t: Transition, *, manual_drain: bool = False, with_pods: bool = True
) -> Row:
    cluster = bench.cluster
    nodes = pool.nodes(t.kind)
    pods = sum(fill_with_pods(bench, n, t.pods_on) for n in nodes) if with_pods else 0
    logs = {n: log_size(cluster, pool, n) for n in nodes}
    before_pods = {n: {p["metadata"]["uid"] for p in bench.pods(n)} for n in nodes}
    before_held = {n: held_devices(bench.sim_state(n)) for n in nodes}
    procs = {n: manager_proc(cluster, pool, n) for n in nodes}
    cpu0 = sum(cpu_with_children(p) for p in procs.values())
    api0 = pool.api_requests(nodes)
    kinds0 = pool.api_kinds(nodes)
    for n in nodes:
        simstate.reset_call_counts(bench.sim_state(n))
    start = time.monotonic()
    for n in nodes:
        bench.patch_labels(n, {CONFIG: t.target, STATE: None})
    to_state: dict[str, float] = {}
    to_devices: dict[str, float] = {}
    outcome: dict[str, str] = {}
    deadline = start + 600
    while len(to_devices) + sum(1 for o in outcome.values() if o == "failed") < len(nodes):
        now = time.monotonic()
        if now > deadline:
            break
        for n in nodes:
            if n in to_devices or outcome.get(n) == "failed":
                continue
            labels = bench.labels(n)
            state = labels.get(STATE, "")
            if n not in to_state and state in ("success", "failed"):
                to_state[n], outcome[n] = now - start, state
            if outcome.get(n) == "success" and bench.advertised(n) == devices_on(
                bench.sim_state(n)
            ):
                to_devices[n] = now - start
        time.sleep(0.05)
    cpu = sum(cpu_with_children(p) for p in procs.values()) - cpu0
    api = pool.api_requests(nodes) - api0
    kinds = pool.api_kinds(nodes) - kinds0
    destroyed = created = lost = evicted = dead = 0
    for n in nodes:
        counts = simstate.call_counts(bench.sim_state(n)).by_function
        destroyed += counts.get(DESTROY_GI, 0)
        created += sum(counts.get(f, 0) for f in CREATE_GI)
        now_pods = {
            p["metadata"]["uid"]
            for p in bench.pods(n)
            if not p["metadata"].get("deletionTimestamp")
        }
        sim_node = simstate.load_node(bench.sim_state(n))
        for uid in before_pods[n]:
            gone = uid not in now_pods
            dead_dev = not all(device_alive(sim_node, d) for d in before_held[n].get(uid, ()))
            evicted += gone
            dead += dead_dev and not gone
            lost += gone or dead_dev
    outcomes = Counter(outcome.get(n, "timeout") for n in nodes)
    reasons = {
        why
        for n in nodes
        if outcome.get(n) != "success"
        for why in [failure_reason(bench, pool, n, logs[n])]
        if why
    }
    label = t.key + (" (pods deleted by hand, relabelled)" if manual_drain else "")
    return Row(
        label,
        pool.system,
        ", ".join(
            f"{k}" + (f" x{v}" if len(nodes) > 1 else "") for k, v in sorted(outcomes.items())
        ),
        max(to_state.values(), default=float("nan")),
        max(to_devices.values()) if len(to_devices) == len(nodes) else None,
        destroyed,
        created,
        lost,
        evicted,
        dead,
        api,
        cpu,
        max(peak_rss_mib(p) for p in procs.values()),
        pods,
        "; ".join(sorted(reasons)),
        kinds,
    )


def run_suite(
    bench: Bench, pools: Sequence[Pool], suite: Sequence[Transition], say: Callable[[str], None]
) -> list[Row]:
    rows: list[Row] = []
    for t in suite:
        for pool in pools:
            nodes = pool.nodes(t.kind)
            set_layout(bench, nodes, t.start)
            say(f"  ({t.key}) {pool.system}: {t.start} -> {t.target}")
            row = run_transition(bench, pool, t)
            rows.append(row)
            failed = [n for n in nodes if bench.labels(n).get(STATE) != "success"]
            if failed:
                # MIG Manager leaves the pods where they are: delete them by hand, then ask again
                drain_start = time.monotonic()
                delete_pods(bench, failed, grace=None)
                drain_s = time.monotonic() - drain_start
                for n in failed:
                    retrigger(bench, n)
                retry = run_transition(bench, pool, t, manual_drain=True, with_pods=False)
                retry.to_state_s += drain_s
                if retry.to_devices_s is not None:
                    retry.to_devices_s += drain_s
                retry.pods, retry.lost, retry.evicted = row.pods, row.pods, row.pods
                rows.append(retry)
            delete_pods(bench, nodes)
    return rows


# ---------------------------------------------------------------------------------------------
# Failures side by side: a fault stands for a while, then its cause is fixed


REASON = "mig-agent.dev/reason"
BAD_PROFILE, KEEP_MOST, ALL_1G = "bench-bad-profile", "bench-keep-most", "all-1g.10gb"
HOST_OWNER = "host/bench-busy"  # a GPU process that is no pod's (a host service, say)


@dataclass(frozen=True, slots=True)
class Case:
    key: str
    title: str
    target: str  # the label the fault comes with
    fix: str  # what fixes the cause
    fixed_target: str  # the layout the node ends at once fixed
    want: dict[str, int]  # per GPU, the layout the node should end at


CASES = (
    Case(
        "i",
        "unknown profile 1g.99gb in the layout",
        BAD_PROFILE,
        f"label fixed ({KEEP_MOST})",
        KEEP_MOST,
        {"1g.10gb": 5, "2g.20gb": 1},
    ),
    Case(
        "ii",
        "a GPU pod under a PDB with maxUnavailable 0",
        ALL_1G,
        "PDB relaxed (minAvailable 0)",
        ALL_1G,
        {"1g.10gb": 7},
    ),
    Case(
        "iii",
        "a GPU process that is no pod's, on the last GPU",
        ALL_1G,
        "the process ended",
        ALL_1G,
        {"1g.10gb": 7},
    ),
    Case(
        "iv",
        "the manager SIGKILLed mid-pass",
        ALL_1G,
        "restarted 10 s later (the kubelet's first back-off)",
        ALL_1G,
        {"1g.10gb": 7},
    ),
)


@dataclass
class FailureRow:
    case: str
    system: str
    state: str  # the state label when the fault had stood `window` seconds
    seen: str  # the states seen on the way
    reason: str  # what the operator is told: MM's log; mig-agent's reason annotation and Event
    destroyed: int  # GIs destroyed while the fault stood
    created: int
    gpus: str  # GPUs as before / as wanted / neither (half-configured)
    node: str  # cordoned, operands paused
    end: str  # the state label after the fix
    fix_s: float | None  # fix -> success (None: not within the wait)
    destroyed_after: int  # GIs destroyed after the fix
    way_out: str = ""  # MIG Manager: what it took when the fix alone did not do


def gpu_layouts(sim_state: str) -> list[Counter[str]]:
    out = []
    for gpu in simstate.load_node(sim_state).gpus:
        names: Counter[str] = Counter()
        for gi in gpu.gpu_instances:
            profile = gpu.model.gi_profile_by_id(gi.profile_id)
            assert profile is not None
            names[profile.name] += 1
        out.append(names)
    return out


def gpus_summary(sim_state: str, before: Sequence[Counter[str]], want: Mapping[str, int]) -> str:
    now = gpu_layouts(sim_state)
    as_before = sum(1 for a, b in zip(now, before, strict=True) if a == b)
    as_wanted = sum(1 for a in now if a == Counter(want))
    odd = [a for a, b in zip(now, before, strict=True) if a != b and a != Counter(want)]
    kinds = Counter(
        ", ".join(f"{k} x{v}" for k, v in sorted(a.items())) or "no instance" for a in odd
    )
    detail = "; ".join(f"{n} GPU(s) with {k}" for k, n in sorted(kinds.items()))
    return f"{as_before} / {as_wanted} / {len(odd)}" + (f" ({detail})" if detail else "")


def node_summary(bench: Bench, name: str) -> str:
    node = bench.node(name)
    paused = [
        k.rsplit(".", 1)[-1]
        for k, v in (node["metadata"].get("labels") or {}).items()
        if k.startswith("nvidia.com/gpu.deploy.") and v == "paused-for-mig-change"
    ]
    cordoned = bool(node["spec"].get("unschedulable"))
    parts = (["cordoned"] if cordoned else []) + (
        [f"paused: {', '.join(paused)}"] if paused else []
    )
    return "; ".join(parts) or "uncordoned, operands running"


def agent_events(bench: Bench, name: str, since: float) -> list[dict[str, Any]]:
    """The agent's Events on Node `name` of the last `since` wall-clock epoch on, oldest first."""
    items = bench.api.get(f"/api/v1/events?fieldSelector=involvedObject.name%3D{name}")["items"]
    out = []
    for e in items:
        when = e.get("lastTimestamp") or e.get("eventTime") or ""
        stamp = (
            time.mktime(time.strptime(when[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
            if when
            else 0.0
        )
        if stamp >= since - 1:
            out.append({**e, "_stamp": stamp})
    return sorted(out, key=lambda e: e["_stamp"])


def operator_view(bench: Bench, pool: Pool, name: str, log_offset: int, since: float) -> str:
    """What the operator is told: MIG Manager's log (the first error line); mig-agent's reason
    annotation and its last warning Event."""
    if pool.system == MM:
        return failure_reason(bench, pool, name, log_offset) or "(no error logged)"
    annotations = bench.node(name)["metadata"].get("annotations") or {}
    reason = str(annotations.get(REASON, ""))
    warnings = [e for e in agent_events(bench, name, since) if e.get("type") == "Warning"]
    event = f"{warnings[-1]['reason']}: {warnings[-1]['message']}" if warnings else ""
    parts = [f"reason: {reason[:220]}" if reason else "no reason annotation"]
    if event and (not reason or reason not in event):
        parts.append(f"Event {event[:220]}")
    elif event:
        parts.append(f"Event {warnings[-1]['reason']} (the same)")
    return "; ".join(parts)


def pdb_body(name: str, max_unavailable: int) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": f"bench-{name}"},
        "spec": {"maxUnavailable": max_unavailable, "selector": {"matchLabels": {POD_LABEL: name}}},
    }


def one_pod(bench: Bench, name: str, resource: str) -> str:
    """One GPU pod holding one device of `resource`; returns its UID once it holds it."""
    limits = {resource: "1"}
    pod = bench.api.request(
        "POST",
        f"/api/v1/namespaces/{NS}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"generateName": f"{name}-", "labels": {POD_LABEL: name}},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": name},
                "tolerations": [{"operator": "Exists"}],
                "containers": [
                    {
                        "name": "cuda",
                        "image": "registry.invalid/sim:1",
                        "resources": {"limits": limits, "requests": limits},
                    }
                ],
            },
        },
    )
    uid = str(pod["metadata"]["uid"])
    wait(f"pod {uid} holds a device", lambda: uid in held_devices(bench.sim_state(name)), 120)
    return uid


def wait_state(
    bench: Bench, name: str, states: Sequence[str], timeout: float, seen: list[str]
) -> str | None:
    deadline = time.monotonic() + timeout
    while True:
        state = bench.labels(name).get(STATE, "")
        if not seen or seen[-1] != state:
            seen.append(state)
        if state in states:
            return state
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


def run_case(
    bench: Bench,
    pool: Pool,
    case: Case,
    window: float,
    window_max: float,
    settle: float,
    say: Callable[[str], None],
) -> FailureRow:
    cluster = bench.cluster
    name = pool.hopper[0]
    sim = bench.sim_state(name)
    set_layout(bench, [name], "all-balanced")
    before = gpu_layouts(sim)
    offset = log_size(cluster, pool, name)
    pdb = f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets"
    if case.key == "ii":
        one_pod(bench, name, "nvidia.com/mig-3g.40gb")
        bench.api.request("POST", pdb, pdb_body(name, 0))
    if case.key == "iii":
        last = simstate.load_node(sim).gpus[-1]
        gi = next(
            g
            for g in last.gpu_instances
            if last.model.gi_profile_by_id(g.profile_id).name == "3g.40gb"
        )  # type: ignore[union-attr]
        simstate.start_process(
            sim, last.index, gi=gi.id, ci=gi.compute_instances[0].id, owner=HOST_OWNER
        )
    simstate.reset_call_counts(sim)
    since = time.time()
    start = time.monotonic()
    bench.patch_labels(name, {CONFIG: case.target, STATE: None})
    seen: list[str] = []
    restart_at = None
    if case.key == "iv":
        wait(f"{name} mid-pass", lambda: simstate.call_counts(sim).total >= 3, 120, poll=0.02)
        if pool.system == MM:
            mig_manager.kill_manager(cluster.dir, name)
        else:
            agents.kill_agent(cluster.dir, name)
        killed_at = time.monotonic()
        restart_at = killed_at + 10.0
        say(f"    killed after {killed_at - start:.1f} s")
        time.sleep(1.0)  # what the kill left: read below, before the restart
    else:
        # the fault stands `window` seconds, and until the manager has ended its pass (success
        # or failed: MIG Manager may still be applying; mig-agent's drain gives up on a PDB at
        # its drain timeout), `window_max` at most
        while True:
            state = bench.labels(name).get(STATE, "")
            if not seen or seen[-1] != state:
                seen.append(state)
            now = time.monotonic()
            if now >= start + window_max or (
                now >= start + window and state in ("success", "failed")
            ):
                break
            time.sleep(0.2)
    state = bench.labels(name).get(STATE, "")
    if not seen or seen[-1] != state:
        seen.append(state)
    counts = simstate.call_counts(sim).by_function
    destroyed = counts.get(DESTROY_GI, 0)
    created = sum(counts.get(f, 0) for f in CREATE_GI)
    gpus = gpus_summary(sim, before, case.want)
    node_now = node_summary(bench, name)
    reason = operator_view(bench, pool, name, offset, since)
    # the fix
    simstate.reset_call_counts(sim)
    if case.key == "i":
        fixed = time.monotonic()
        bench.patch_labels(name, {CONFIG: case.fixed_target, STATE: None})
    elif case.key == "ii":
        fixed = time.monotonic()
        # relaxed: the disruption controller allows a bare pod (no controller with a scale)
        # no disruption under any maxUnavailable, so the budget becomes minAvailable 0
        bench.api.request(
            "PATCH",
            f"{pdb}/bench-{name}",
            {"spec": {"maxUnavailable": None, "minAvailable": 0}},
            content_type="application/merge-patch+json",
        )
    elif case.key == "iii":
        fixed = time.monotonic()
        simstate.end_processes(sim, [HOST_OWNER])
    else:
        assert restart_at is not None
        time.sleep(max(0.0, restart_at - time.monotonic()))
        fixed = time.monotonic()
        if pool.system == MM:
            mig_manager.restart_manager(cluster, name)
        # mig-agent: its supervisor restarts it after the same 10 s
    after: list[str] = []
    end = wait_state(bench, name, ("success",), settle, after)
    fix_s = time.monotonic() - fixed if end == "success" else None
    if end == "success":
        wait(
            f"{name} advertises its layout", lambda: bench.advertised(name) == devices_on(sim), 120
        )
    destroyed_after = simstate.call_counts(sim).by_function.get(DESTROY_GI, 0)
    end_state = bench.labels(name).get(STATE, "")
    way_out = ""
    if end != "success" and pool.system == MM:
        # failed is sticky: what the operator must do by hand
        t0 = time.monotonic()
        steps = []
        if bench.pods(name):
            delete_pods(bench, [name], grace=None)
            steps.append("delete the pod")
        retrigger(bench, name)
        bench.patch_labels(name, {CONFIG: case.fixed_target, STATE: None})
        steps.append(f"relabel (via another value) to {case.fixed_target}")
        ok = wait_state(bench, name, ("success",), settle, [])
        way_out = " + ".join(steps) + (
            f": success {time.monotonic() - t0:.1f} s later" if ok else ": still not success"
        )
    # clean up for the next case
    if case.key == "ii":
        bench.api.request("DELETE", f"{pdb}/bench-{name}")
        delete_pods(bench, [name])
    simstate.end_processes(sim, [HOST_OWNER])
    return FailureRow(
        case.key,
        pool.system,
        state,
        " -> ".join(s or "(none)" for s in seen),
        reason,
        destroyed,
        created,
        gpus,
        node_now,
        end_state,
        fix_s,
        destroyed_after,
        way_out,
    )


def run_failures(
    bench: Bench,
    pools: Sequence[Pool],
    window: float,
    window_max: float,
    settle: float,
    cases: Sequence[str],
    say: Callable[[str], None],
) -> list[FailureRow]:
    rows = []
    for case in CASES:
        if cases and case.key not in cases:
            continue
        for pool in pools:
            say(f"  ({case.key}) {pool.system}: {case.title}")
            rows.append(run_case(bench, pool, case, window, window_max, settle, say))
            say(f"    {rows[-1]}")
    return rows


def print_failures(
    rows: Sequence[FailureRow], window: float, window_max: float, settle: float
) -> None:
    print(
        f"\n## Failures: the fault stands {window:g} s and until the manager ends its pass "
        f"({window_max:g} s at most), then its cause is fixed\n"
    )
    print(
        "| case | system | state after the fault | GIs destroyed | GPUs before / wanted / "
        "neither | node | fix | state after the fix | fix -> success s | GIs destroyed "
        "after the fix |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    titles = {c.key: c for c in CASES}
    for r in rows:
        c = titles[r.case]
        print(
            f"| {r.case} {c.title} | {r.system} | {r.state} | {r.destroyed} | {r.gpus} | "
            f"{r.node} | {c.fix} | {r.end} | "
            f"{'not reached' if r.fix_s is None else fmt(r.fix_s)} | {r.destroyed_after} |"
        )
    print("\nWhat the operator is told (and what it took where the fix alone did not do):\n")
    for r in rows:
        print(
            f"- {r.case}, {r.system} (states {r.seen}): {r.reason}"
            + (f". Way out: {r.way_out}" if r.way_out else "")
        )
    print(
        f"\n'not reached': no success within {settle:g} s of the fix. 'GPUs before / wanted / "
        "neither' counts the node's GPUs, while the fault stood, that held the layout before "
        "the label change, the layout the case ends at, or something else (half-configured)."
    )


# ---------------------------------------------------------------------------------------------
# Output


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def print_rows(rows: Sequence[Row]) -> None:
    head = (
        "transition",
        "system",
        "outcome",
        "to state s",
        "to devices s",
        "GI destroyed",
        "GI created",
        "pods lost device",
        "evicted",
        "running on dead device",
        "API req",
        "CPU s",
        "peak RSS MiB",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        print(
            "| "
            + " | ".join(
                [
                    r.transition,
                    r.system,
                    r.outcome,
                    fmt(r.to_state_s),
                    fmt(r.to_devices_s),
                    str(r.destroyed),
                    str(r.created),
                    f"{r.lost}/{r.pods}",
                    str(r.evicted),
                    str(r.dead_device),
                    "n/a" if r.api is None else f"{r.api:.0f}",
                    fmt(r.cpu_s, 2),
                    fmt(r.rss_mib, 0),
                ]
            )
            + " |"
        )


def print_reasons(rows: Sequence[Row]) -> None:
    failed = [r for r in rows if r.reason]
    if failed:
        print("\nWhy the failed rows failed:\n")
        for r in failed:
            print(f"- {r.transition}, {r.system}: {r.reason}")


def print_api_kinds(rows: Sequence[Row]) -> None:
    print("\nAPI requests by verb and resource (each manager's proxy):\n")
    for r in rows:
        kinds = ", ".join(
            f"{k} x{v}" for k, v in sorted(r.api_by_kind.items(), key=lambda kv: (-kv[1], kv[0]))
        )
        print(f"- {r.transition}, {r.system}: {kinds or 'none'}")


def comparable(rows: Sequence[Row], key: str, system: str) -> Row | None:
    """The row that reached the layout: the retry after the drain by hand when the first failed."""
    mine = [r for r in rows if r.transition.split(" ")[0] == key and r.system == system]
    ok = [r for r in mine if r.to_devices_s is not None]
    return ok[-1] if ok else None


def print_ratios(rows: Sequence[Row], suite: Sequence[Transition]) -> list[str]:
    """Ratio table; returns the transitions where mig-agent is not ahead (and why)."""
    behind: list[str] = []
    print(
        "| transition | MIG Manager to devices s | mig-agent to devices s | time ratio MM/agent "
        "| GI destroyed MM / agent | pods lost device MM / agent |"
    )
    print("|---|---|---|---|---|---|")
    for t in suite:
        mm, ma = comparable(rows, t.key, MM), comparable(rows, t.key, MA)
        first_mm = next((r for r in rows if r.transition == t.key and r.system == MM), None)
        if mm is None or ma is None or first_mm is None:
            print(
                f"| {t.key} {t.title} | {'-' if mm is None else fmt(mm.to_devices_s)} | "
                f"{'-' if ma is None else fmt(ma.to_devices_s)} | - | - | - |"
            )
            behind.append(f"{t.key}: a system did not reach the layout")
            continue
        assert mm.to_devices_s is not None and ma.to_devices_s is not None
        ratio = mm.to_devices_s / ma.to_devices_s if ma.to_devices_s else float("inf")
        destroyed_mm = first_mm.destroyed + (mm.destroyed if mm is not first_mm else 0)
        lost_mm = mm.lost
        print(
            f"| {t.key} {t.title} | {fmt(mm.to_devices_s)} | {fmt(ma.to_devices_s)} | "
            f"{ratio:.2f} | {destroyed_mm} / {ma.destroyed} | {lost_mm} / {ma.lost} |"
        )
        if ratio < 1:
            behind.append(f"{t.key}: slower ({ma.to_devices_s:.1f} s vs {mm.to_devices_s:.1f} s)")
        if ma.destroyed > destroyed_mm:
            behind.append(
                f"{t.key}: destroys more GPU instances ({ma.destroyed} vs {destroyed_mm})"
            )
        if ma.lost > lost_mm:
            behind.append(f"{t.key}: more pods lose their device ({ma.lost} vs {lost_mm})")
        api_mm = sum(
            r.api or 0 for r in rows if r.transition.split(" ")[0] == t.key and r.system == MM
        )
        if ma.api is not None and ma.api > api_mm:
            behind.append(
                f"{t.key}: more API requests ({ma.api:.0f} vs {api_mm:.0f}, MIG "
                "Manager's first try and retry together)"
            )
    return behind


def mig_manager_passes(log: str) -> int:
    """How many passes MIG Manager has finished: each ends waiting for the next label change."""
    return Path(log).read_text().count("Waiting for change to 'nvidia.com/mig.config' label")


def run_handover(
    bench: Bench,
    pools: Sequence[Pool],
    config: Path,
    bin_dir: Path,
    args: argparse.Namespace,
    say: Callable[[str], None],
) -> list[tuple[str, str, str]]:
    """Each system takes over the other's first Hopper node, at all-balanced with a GPU pod on
    every device: the new manager's first pass (NVML mutations, pods, state), then a new layout
    (bench-keep-most) applied by it. Run last: the pools' nodes swap managers."""
    cluster = bench.cluster
    rows: list[tuple[str, str, str]] = []
    mm_node, ma_node = pools[0].hopper[0], pools[1].hopper[0]
    for name in (mm_node, ma_node):
        set_layout(bench, [name], "all-balanced")
        fill_with_pods(bench, name)
    for name, old, new in ((mm_node, MM, MA), (ma_node, MA, MM)):
        sim = bench.sim_state(name)
        pods = {p["metadata"]["uid"] for p in bench.pods(name)}
        say(f"  {old} -> {new} on {name}")
        proxy = pools[0 if old == MM else 1].proxies[name]
        if old == MM:
            mig_manager.stop_node(cluster.dir, name)
        else:
            agents.stop_node(cluster.dir, name)
        simstate.reset_call_counts(sim)
        api0 = proxy.requests
        start = time.monotonic()
        if new == MA:
            agents.start_node(
                ViaProxy(cluster, proxy.url),
                name,
                profiles=config,
                device_plugin=args.device_plugin,
                settings=AGENT_SETTINGS,
            )
            wait(
                "the agent's first pass",
                lambda n=name: GPU_STATE in (bench.node(n)["metadata"].get("annotations") or {}),
                120,
            )
        else:
            kubeconfig = mig_manager.admin_kubeconfig(
                cluster, cluster.node_dir(name) / "mig-manager.kubeconfig", proxy.url
            )
            record = mig_manager.start_node(
                cluster,
                name,
                config,
                bin_dir=bin_dir,
                device_plugin=args.device_plugin,
                kubeconfig=kubeconfig,
            )
            wait(
                "MIG Manager's first pass", lambda log=record.log: mig_manager_passes(log) >= 2, 120
            )
        first_s = time.monotonic() - start
        time.sleep(3)  # anything it would do after its first look is under way by now
        mutations = simstate.call_counts(sim).total
        left = {
            p["metadata"]["uid"]
            for p in bench.pods(name)
            if not p["metadata"].get("deletionTimestamp")
        }
        rows.append(
            (
                f"{old} -> {new}: first pass",
                f"{mutations} NVML mutations",
                f"state {bench.labels(name).get(STATE)}, {len(pods - left)} of "
                f"{len(pods)} pods evicted, {node_summary(bench, name)}, "
                f"{first_s:.1f} s from start to its first pass done, "
                f"{proxy.requests - api0} API requests",
            )
        )
        # a new layout by the new manager
        by_hand = ""
        if new == MM:  # it does not drain
            delete_pods(bench, [name], grace=None)
            by_hand = "the pods deleted by hand first; "
        simstate.reset_call_counts(sim)
        before = {p["metadata"]["uid"] for p in bench.pods(name)}
        start = time.monotonic()
        bench.patch_labels(name, {CONFIG: KEEP_MOST, STATE: None})
        wait_layout(bench, name, KEEP_MOST, 300)
        took = time.monotonic() - start
        counts = simstate.call_counts(sim).by_function
        left = {
            p["metadata"]["uid"]
            for p in bench.pods(name)
            if not p["metadata"].get("deletionTimestamp")
        }
        rows.append(
            (
                f"{old} -> {new}: then {KEEP_MOST}",
                f"{counts.get(DESTROY_GI, 0)} GIs destroyed",
                f"{by_hand}{sum(counts.get(f, 0) for f in CREATE_GI)} created, "
                f"{len(before - left)} pods evicted, {len(left)} kept, {took:.1f} s to "
                f"the new devices advertised",
            )
        )
        delete_pods(bench, [name])
    return rows


def measure_idle(
    bench: Bench, pools: Sequence[Pool], seconds: float, say: Callable[[str], None]
) -> list[tuple[str, str, str]]:
    """Every node at its layout, nothing to do: each manager's requests over `seconds`."""
    say(f"  idle: {seconds:g} s")
    before = {(p.system, n): p.proxies[n].snapshot() for p in pools for n in p.proxies}
    metrics0 = {n: agent_api_requests(port) for p in pools for n, port in p.metrics_ports.items()}
    time.sleep(seconds)
    rows = []
    for p in pools:
        for n in p.proxies:
            diff = p.proxies[n].snapshot() - before[(p.system, n)]
            total = sum(diff.values())
            note = ", ".join(f"{k} x{v}" for k, v in sorted(diff.items())) or "none"
            if n in p.metrics_ports:
                own = agent_api_requests(p.metrics_ports[n]) - metrics0[n]
                note += f" (its own /metrics: {own:.0f})"
            rows.append((f"{p.system} {n}", f"{total * 60 / seconds:.2f}", note))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="Hopper nodes per pool, and as many Ampere nodes (default 1)",
    )
    p.add_argument("--gpus", default="8xH100-80GB", help="GPUs of a Hopper node")
    p.add_argument("--ampere-gpus", default="8xA100-40GB", help="GPUs of an Ampere node")
    p.add_argument(
        "--latency",
        type=float,
        default=0.25,
        help="seconds added to every mutating NVML call and GPU reset in the "
        "realistic run (default 0.25)",
    )
    p.add_argument(
        "--parts",
        default="suite",
        help="comma-separated, run in this order: suite (transitions a-f), "
        "failures (cases i-iv), idle (API requests of idle managers), handover "
        "(each system takes over the other's node); default suite",
    )
    p.add_argument(
        "--window",
        type=float,
        default=60.0,
        help="failures: seconds the fault stands before its cause is fixed",
    )
    p.add_argument(
        "--window-max",
        type=float,
        default=330.0,
        help="failures: at most this long while the manager has not ended its pass "
        "(default 330: past mig-agent's 300 s drain timeout)",
    )
    p.add_argument("--cases", default="", help="failures: the cases to run (default all)")
    p.add_argument(
        "--settle",
        type=float,
        default=180.0,
        help="failures: seconds to wait for success after the fix",
    )
    p.add_argument(
        "--idle", type=float, default=180.0, help="idle: seconds of idle API requests measured"
    )
    p.add_argument(
        "--logs",
        type=Path,
        default=None,
        help="copy the cluster's logs (managers, device plugins, API server) here "
        "before the cluster goes",
    )
    p.add_argument(
        "--skip-zero",
        action="store_true",
        help="suite: only the run at --latency, not the second one at zero latency",
    )
    p.add_argument(
        "--transitions",
        default="",
        help="suite: comma-separated keys of the transitions to run (default all)",
    )
    add_cluster_options(p, quick="2+1 GPUs per node, zero latency only, transitions a, b and e")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("MIG Manager runs in a private mount namespace: run as root", file=sys.stderr)
        return 2
    order = ("suite", "failures", "idle", "handover")  # handover swaps the nodes' managers
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = set(parts) - set(order)
    if unknown:
        p.error(f"unknown parts: {', '.join(sorted(unknown))}")
    parts = [x for x in order if x in parts]
    if args.quick:
        args.gpus, args.ampere_gpus, args.nodes = "2xH100-80GB", "1xA100-40GB", 1
    hopper_gpus = int(args.gpus.split("x")[0])
    if hopper_gpus < 2:
        p.error("a Hopper node needs at least 2 GPUs (transition b changes one of them)")
    keys = {k.strip() for k in args.transitions.split(",") if k.strip()}
    if keys - {t.key for t in SUITE}:
        p.error(f"unknown transitions: {', '.join(sorted(keys - {t.key for t in SUITE}))}")
    suite = [
        t
        for t in SUITE
        if (not args.quick or t.key in ("a", "b", "e")) and (not keys or t.key in keys)
    ]
    latencies = [0.0] if args.quick else [args.latency] if args.skip_zero else [args.latency, 0.0]
    with_ampere = "suite" in parts and any(t.kind == "ampere" for t in suite)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    all_rows: dict[float, list[Row]] = {}
    failure_rows: list[FailureRow] = []
    handover_rows: list[tuple[str, str, str]] = []
    idle_rows: list[tuple[str, str, str]] = []
    proxies: list[ApiFaultProxy] = []
    with tempfile.TemporaryDirectory(prefix="vs-mm-") as tmp:
        cluster = Cluster.up(Path(tmp) / "c", gpu_nodes=0)
        try:
            config = bench_config(Path(tmp) / "bench-profiles.yaml", hopper_gpus)
            agents.install(cluster)
            cluster.kubectl("create", "namespace", NS)
            bin_dir = mig_manager.nvidia_bin_dir()
            pools = [Pool(MM, [], []), Pool(MA, [], [])]
            for pool, prefix in zip(pools, ("mm", "ma"), strict=True):
                for i in range(args.nodes):
                    pool.hopper.append(cluster.add_gpu_node(f"{prefix}-h-{i}", args.gpus))
                    if with_ampere:
                        pool.ampere.append(
                            cluster.add_gpu_node(f"{prefix}-a-{i}", args.ampere_gpus)
                        )
            for pool in pools:
                for n in pool.hopper + pool.ampere:
                    proxy = new_proxy(cluster)
                    proxies.append(proxy)
                    pool.proxies[n] = proxy
            for n in pools[0].hopper + pools[0].ampere:
                kubeconfig = mig_manager.admin_kubeconfig(
                    cluster, cluster.node_dir(n) / "mig-manager.kubeconfig", pools[0].proxies[n].url
                )
                mig_manager.start_node(
                    cluster,
                    n,
                    config,
                    bin_dir=bin_dir,
                    device_plugin=args.device_plugin,
                    kubeconfig=kubeconfig,
                )
            for n in pools[1].hopper + pools[1].ampere:
                pools[1].metrics_ports[n] = agents.start_node(
                    ViaProxy(cluster, pools[1].proxies[n].url),
                    n,
                    profiles=config,
                    device_plugin=args.device_plugin,
                    settings=AGENT_SETTINGS,
                ).metrics_port
            bench = Bench(cluster)
            wait(
                "every agent's published GPU state",
                lambda: all(
                    GPU_STATE in (bench.node(n)["metadata"].get("annotations") or {})
                    for n in pools[1].metrics_ports
                ),
                120,
            )
            for part in parts:
                if part == "suite":
                    for latency in latencies:
                        for pool in pools:
                            for n in pool.hopper + pool.ampere:
                                simstate.set_latency(bench.sim_state(n), latency)
                        say(f"suite at {latency:g} s per mutating NVML call")
                        all_rows[latency] = run_suite(bench, pools, suite, say)
                elif part == "failures":
                    for pool in pools:
                        for n in pool.hopper:
                            simstate.set_latency(bench.sim_state(n), args.latency)
                    say(f"failures at {args.latency:g} s per mutating NVML call")
                    failure_rows = run_failures(
                        bench,
                        pools,
                        args.window,
                        args.window_max,
                        args.settle,
                        [c.strip() for c in args.cases.split(",") if c.strip()],
                        say,
                    )
                elif part == "handover":
                    say("handover")
                    handover_rows = run_handover(bench, pools, config, bin_dir, args, say)
                elif part == "idle":
                    for pool in pools:
                        set_layout(bench, pool.hopper + pool.ampere, "all-balanced")
                    idle_rows = measure_idle(bench, pools, args.idle, say)
        finally:
            mig_manager.stop_all(cluster.dir)
            agents.stop_all(cluster.dir)
            for proxy in proxies:
                proxy.stop()
            cluster.down()
            if args.logs is not None:
                shutil.copytree(cluster.dir / "logs", args.logs, dirs_exist_ok=True)

    print(
        f"\n# mig-agent vs NVIDIA's MIG Manager: {args.nodes} node(s) of {args.gpus}"
        + (f" and {args.nodes} of {args.ampere_gpus}" if with_ampere else "")
        + f" per system; {args.device_plugin} device plugin on both; each manager's API "
        "requests counted by a proxy of its own in front of the API server\n"
    )
    behind_all: list[str] = []
    for latency, rows in all_rows.items():
        print(f"\n## Simulated hardware latency {latency:g} s per mutating NVML call and reset\n")
        print_rows(rows)
        print_reasons(rows)
        print_api_kinds(rows)
        print()
        behind = print_ratios(rows, suite)
        behind_all += [f"latency {latency:g}: {b}" for b in behind]
    if all_rows:
        print(
            "\nTimes are the slowest node of the pool; 'to devices' ends when the node "
            "advertises the new layout (MIG Manager says success before its device plugin is "
            "back). MIG Manager's retry row counts the drain by hand (delete the pods, wait "
            "until gone) in its times. API req: requests through the manager's proxy, label "
            "change to the end of the row. CPU: mig-agent's process (its NVML calls run the "
            "simulator in-process); MIG Manager's process with the mig-parted runs it waited "
            "for (the simulator runs in another process). Shared 2-core machine: compare "
            "ratios and counts."
        )
        print("\nWhere mig-agent is not ahead: " + ("; ".join(behind_all) or "none"))
    if failure_rows:
        print_failures(failure_rows, args.window, args.window_max, args.settle)
    if handover_rows:
        print("\n## Handover: each system takes over a node the other configured\n")
        print_table(handover_rows)
    if idle_rows:
        print(
            f"\n## Idle API requests per minute, over {args.idle:g} s, every node at its layout\n"
        )
        print_table(idle_rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
