"""mig-agent side by side with NVIDIA's MIG Manager: the same transitions, the same simulated GPUs
and hardware latencies, the same pods, the same profile config, in one run on one local cluster.

    python benchmarks/vs_mig_manager.py [--nodes 1] [--latency 0.25] [--gpus 8xH100-80GB]
                                        [--ampere-gpus 8xA100-40GB] [--quick]

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
evicted, the manager's API requests (mig-agent's /metrics; MIG Manager has none), its CPU seconds
(MIG Manager: with the mig-parted runs it waited for) and peak RSS. MIG Manager does not drain:
where pods hold the devices its apply fails; the benchmark then deletes the node's GPU pods by hand
(what an operator must do first) and relabels, and reports that retry as its own row; the ratios
compare mig-agent with MIG Manager's drain-by-hand-then-apply.

Needs root (MIG Manager's private mount namespace), the Kubernetes binaries and NVIDIA's binaries
(scripts/k8s-binaries, scripts/nvidia-binaries). Timings are wall-clock on a shared machine: compare
ratios and counts rather than absolute seconds.
"""

from __future__ import annotations

import argparse
import os
import re
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

from migsim.cluster import Cluster, agents, mig_manager  # noqa: E402
from migsim.cluster.processes import Proc  # noqa: E402
from migsim.nvml import state as simstate  # noqa: E402

CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
GPU_STATE = "mig-agent.dev/gpu-state"
NS = "bench"
POD_LABEL = "bench.mig-agent.dev/node"
MM, MA = "MIG Manager", "mig-agent"
DESTROY_GI = "nvmlGpuInstanceDestroy"
CREATE_GI = ("nvmlDeviceCreateGpuInstance", "nvmlDeviceCreateGpuInstanceWithPlacement")
PROFILES = REPO / "mig_agent" / "profiles"
HOPPER_BALANCED = {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}


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
    Transition("f", "d1 with pods on the 1g devices only", "hopper", "all-balanced",
               "all-1g.10gb", pods_on="nvidia.com/mig-1g.10gb"),
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
        self.api.request("PATCH", f"/api/v1/nodes/{name}", {"metadata": {"labels": labels}},
                         content_type="application/merge-patch+json")

    def advertised(self, name: str) -> Counter[str]:
        alloc = self.node(name)["status"].get("allocatable") or {}
        return Counter({k: int(v) for k, v in alloc.items()
                        if k.startswith("nvidia.com/") and int(v) > 0})

    def pods(self, name: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.api.get(
            f"/api/v1/namespaces/{NS}/pods?labelSelector={POD_LABEL}%3D{name}")["items"]
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
            bench.api.request("POST", f"/api/v1/namespaces/{NS}/pods", {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"generateName": f"{name}-", "labels": {POD_LABEL: name}},
                "spec": {"nodeSelector": {"kubernetes.io/hostname": name},
                         "tolerations": [{"operator": "Exists"}],
                         "containers": [{"name": "cuda", "image": "registry.invalid/sim:1",
                                         "resources": {"limits": limits,
                                                       "requests": limits}}]}})
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
            bench.api.request("DELETE", f"/api/v1/namespaces/{NS}/pods/"
                              f"{pod['metadata']['name']}", body)
    wait("GPU pods gone", lambda: all(not bench.pods(n) and not held_devices(bench.sim_state(n))
                                      for n in names), 120)


# ---------------------------------------------------------------------------------------------
# The two systems


@dataclass
class Pool:
    system: str
    hopper: list[str]
    ampere: list[str]
    metrics_ports: dict[str, int] = field(default_factory=dict)  # mig-agent only

    def nodes(self, kind: str) -> list[str]:
        return self.hopper if kind == "hopper" else self.ampere


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
        comm = text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        if int(fields[2]) == group and comm.startswith("nvidia-mig-man"):
            return Proc("nvidia-mig-manager", int(stat.parent.name), int(fields[19]))
    return None


def cpu_with_children(proc: Proc | None) -> float:
    """User + system CPU seconds of `proc` and of the children it has waited for."""
    if proc is None or not proc.alive():
        return 0.0
    text = Path(f"/proc/{proc.pid}/stat").read_text()
    f = text[text.rindex(")") + 2:].split()
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
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("mig_agent_api_requests_total"))


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
    lines = [(level, m) for level, m in
             re.findall(r'level=(error|fatal) msg="((?:[^"\\]|\\.)*)"', text)
             if "not currently applied" not in m]  # mig-parted's assert before the apply
    busy = [m for _, m in lines if "IN_USE" in m or "in use" in m]
    fatal = [m for level, m in lines if level == "fatal"]
    errors = [m for _, m in lines]
    for found in (busy, fatal, errors):
        if found:
            return found[0].replace("\\n", " ")[:200]
    return ""


def set_layout(bench: Bench, nodes: Sequence[str], layout: str, timeout: float = 300) -> None:
    """Bring `nodes` to `layout` (no pods on them), for the start of a transition."""
    todo = [n for n in nodes if bench.labels(n).get(CONFIG) != layout
            or bench.labels(n).get(STATE) != "success"]
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
    wait(f"{node} refused bench-retrigger",
         lambda: bench.labels(node).get(STATE) == "failed", 60)


def run_transition(bench: Bench, pool: Pool, t: Transition, *, manual_drain: bool = False,
                   with_pods: bool = True) -> Row:
    cluster = bench.cluster
    nodes = pool.nodes(t.kind)
    pods = sum(fill_with_pods(bench, n, t.pods_on) for n in nodes) if with_pods else 0
    logs = {n: log_size(cluster, pool, n) for n in nodes}
    before_pods = {n: {p["metadata"]["uid"] for p in bench.pods(n)} for n in nodes}
    before_held = {n: held_devices(bench.sim_state(n)) for n in nodes}
    procs = {n: manager_proc(cluster, pool, n) for n in nodes}
    cpu0 = sum(cpu_with_children(p) for p in procs.values())
    api0 = sum(agent_api_requests(pool.metrics_ports[n]) for n in nodes) if pool.system == MA \
        else None
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
            if outcome.get(n) == "success" and \
                    bench.advertised(n) == devices_on(bench.sim_state(n)):
                to_devices[n] = now - start
        time.sleep(0.05)
    cpu = sum(cpu_with_children(p) for p in procs.values()) - cpu0
    api = None if api0 is None else \
        sum(agent_api_requests(pool.metrics_ports[n]) for n in nodes) - api0
    destroyed = created = lost = evicted = dead = 0
    for n in nodes:
        counts = simstate.call_counts(bench.sim_state(n)).by_function
        destroyed += counts.get(DESTROY_GI, 0)
        created += sum(counts.get(f, 0) for f in CREATE_GI)
        now_pods = {p["metadata"]["uid"] for p in bench.pods(n)
                    if not p["metadata"].get("deletionTimestamp")}
        sim_node = simstate.load_node(bench.sim_state(n))
        for uid in before_pods[n]:
            gone = uid not in now_pods
            dead_dev = not all(device_alive(sim_node, d) for d in before_held[n].get(uid, ()))
            evicted += gone
            dead += dead_dev and not gone
            lost += gone or dead_dev
    outcomes = Counter(outcome.get(n, "timeout") for n in nodes)
    reasons = {why for n in nodes if outcome.get(n) != "success"
               for why in [failure_reason(bench, pool, n, logs[n])] if why}
    label = t.key + (" (pods deleted by hand, relabelled)" if manual_drain else "")
    return Row(
        label, pool.system, ", ".join(f"{k}" + (f" x{v}" if len(nodes) > 1 else "")
                                      for k, v in sorted(outcomes.items())),
        max(to_state.values(), default=float("nan")),
        max(to_devices.values()) if len(to_devices) == len(nodes) else None,
        destroyed, created, lost, evicted, dead, api, cpu,
        max(peak_rss_mib(p) for p in procs.values()), pods, "; ".join(sorted(reasons)))


def run_suite(bench: Bench, pools: Sequence[Pool], suite: Sequence[Transition],
              say: Callable[[str], None]) -> list[Row]:
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
# Output


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}"


def print_rows(rows: Sequence[Row]) -> None:
    head = ("transition", "system", "outcome", "to state s", "to devices s", "GI destroyed",
            "GI created", "pods lost device", "evicted", "running on dead device", "API req",
            "CPU s", "peak RSS MiB")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        print("| " + " | ".join([
            r.transition, r.system, r.outcome, fmt(r.to_state_s), fmt(r.to_devices_s),
            str(r.destroyed), str(r.created), f"{r.lost}/{r.pods}", str(r.evicted),
            str(r.dead_device), "n/a" if r.api is None else f"{r.api:.0f}", fmt(r.cpu_s, 2),
            fmt(r.rss_mib, 0)]) + " |")


def print_reasons(rows: Sequence[Row]) -> None:
    failed = [r for r in rows if r.reason]
    if failed:
        print("\nWhy the failed rows failed:\n")
        for r in failed:
            print(f"- {r.transition}, {r.system}: {r.reason}")


def comparable(rows: Sequence[Row], key: str, system: str) -> Row | None:
    """The row that reached the layout: the retry after the drain by hand when the first failed."""
    mine = [r for r in rows if r.transition.split(" ")[0] == key and r.system == system]
    ok = [r for r in mine if r.to_devices_s is not None]
    return ok[-1] if ok else None


def print_ratios(rows: Sequence[Row], suite: Sequence[Transition]) -> list[str]:
    """Ratio table; returns the transitions where mig-agent is not ahead (and why)."""
    behind: list[str] = []
    print("| transition | MIG Manager to devices s | mig-agent to devices s | time ratio MM/agent "
          "| GI destroyed MM / agent | pods lost device MM / agent |")
    print("|---|---|---|---|---|---|")
    for t in suite:
        mm, ma = comparable(rows, t.key, MM), comparable(rows, t.key, MA)
        first_mm = next((r for r in rows if r.transition == t.key and r.system == MM), None)
        if mm is None or ma is None or first_mm is None:
            print(f"| {t.key} {t.title} | {'-' if mm is None else fmt(mm.to_devices_s)} | "
                  f"{'-' if ma is None else fmt(ma.to_devices_s)} | - | - | - |")
            behind.append(f"{t.key}: a system did not reach the layout")
            continue
        assert mm.to_devices_s is not None and ma.to_devices_s is not None
        ratio = mm.to_devices_s / ma.to_devices_s if ma.to_devices_s else float("inf")
        destroyed_mm = first_mm.destroyed + (mm.destroyed if mm is not first_mm else 0)
        lost_mm = mm.lost
        print(f"| {t.key} {t.title} | {fmt(mm.to_devices_s)} | {fmt(ma.to_devices_s)} | "
              f"{ratio:.2f} | {destroyed_mm} / {ma.destroyed} | {lost_mm} / {ma.lost} |")
        if ratio < 1:
            behind.append(f"{t.key}: slower ({ma.to_devices_s:.1f} s vs {mm.to_devices_s:.1f} s)")
        if ma.destroyed > destroyed_mm:
            behind.append(f"{t.key}: destroys more GPU instances ({ma.destroyed} vs "
                          f"{destroyed_mm})")
        if ma.lost > lost_mm:
            behind.append(f"{t.key}: more pods lose their device ({ma.lost} vs {lost_mm})")
    return behind


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1,
                   help="Hopper nodes per pool, and as many Ampere nodes (default 1)")
    p.add_argument("--gpus", default="8xH100-80GB", help="GPUs of a Hopper node")
    p.add_argument("--ampere-gpus", default="8xA100-40GB", help="GPUs of an Ampere node")
    p.add_argument("--latency", type=float, default=0.25,
                   help="seconds added to every mutating NVML call and GPU reset in the "
                        "realistic run (default 0.25)")
    p.add_argument("--device-plugin", choices=("simulated", "nvidia"), default="simulated",
                   help="the device plugin on every node of both pools: the home-made model "
                        "(default; light enough for this shared machine) or NVIDIA's plugin "
                        "and GFD")
    p.add_argument("--quick", action="store_true",
                   help="CI: 2+1 GPUs per node, zero latency only, transitions a, b and e")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("MIG Manager runs in a private mount namespace: run as root", file=sys.stderr)
        return 2
    if args.quick:
        args.gpus, args.ampere_gpus, args.nodes = "2xH100-80GB", "1xA100-40GB", 1
    hopper_gpus = int(args.gpus.split("x")[0])
    if hopper_gpus < 2:
        p.error("a Hopper node needs at least 2 GPUs (transition b changes one of them)")
    suite = [t for t in SUITE if not args.quick or t.key in ("a", "b", "e")]
    latencies = [0.0] if args.quick else [args.latency, 0.0]

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

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
                    pool.ampere.append(cluster.add_gpu_node(f"{prefix}-a-{i}",
                                                            args.ampere_gpus))
            for n in pools[0].hopper + pools[0].ampere:
                mig_manager.start_node(cluster, n, config, bin_dir=bin_dir,
                                       device_plugin=args.device_plugin)
            for n in pools[1].hopper + pools[1].ampere:
                pools[1].metrics_ports[n] = agents.start_node(
                    cluster, n, profiles=config, device_plugin=args.device_plugin).metrics_port
            bench = Bench(cluster)
            wait("every agent's published GPU state", lambda: all(
                GPU_STATE in (bench.node(n)["metadata"].get("annotations") or {})
                for n in pools[1].metrics_ports), 120)
            all_rows: dict[float, list[Row]] = {}
            for latency in latencies:
                for pool in pools:
                    for n in pool.hopper + pool.ampere:
                        simstate.set_latency(bench.sim_state(n), latency)
                say(f"suite at {latency:g} s per mutating NVML call")
                all_rows[latency] = run_suite(bench, pools, suite, say)
        finally:
            mig_manager.stop_all(cluster.dir)
            agents.stop_all(cluster.dir)
            cluster.down()

    print(f"\n# mig-agent vs NVIDIA's MIG Manager: {args.nodes} node(s) of {args.gpus} and "
          f"{args.nodes} of {args.ampere_gpus} per system; a GPU pod on every device; "
          f"{args.device_plugin} device plugin on both\n")
    behind_all: list[str] = []
    for latency, rows in all_rows.items():
        print(f"\n## Simulated hardware latency {latency:g} s per mutating NVML call and reset\n")
        print_rows(rows)
        print_reasons(rows)
        print()
        behind = print_ratios(rows, suite)
        behind_all += [f"latency {latency:g}: {b}" for b in behind]
    print("\nTimes are the slowest node of the pool; 'to devices' ends when the node advertises "
          "the new layout (MIG Manager says success before its device plugin is back). MIG "
          "Manager's retry row counts the drain by hand (delete the pods, wait until gone) in "
          "its times. CPU: mig-agent's process (its NVML calls run the simulator in-process); "
          "MIG Manager's process with the mig-parted runs it waited for (the simulator runs in "
          "another process). Shared 2-core machine: compare ratios and counts.")
    print("\nWhere mig-agent is not ahead: " + ("; ".join(behind_all) or "none"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
