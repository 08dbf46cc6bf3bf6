"""What a user waits for, on the real node: mig-agent side by side with NVIDIA's MIG Manager from
the label change until the Pending pod that wanted a device of the new layout is Running.

    python benchmarks/vs_mig_manager_real_node.py [--gpus 1xH100-80GB] [--latency 0.25]
                                                  [--term-s 10] [--rounds 1] [--cases a,b]

One real node (migsim.cluster.real_node: a kubelet on containerd and runc, NVIDIA's device plugin
as its DaemonSet's pod, NVIDIA's container runtime in CDI mode) with simulated GPUs, on a local
cluster. MIG Manager (v0.15.0, built here: migsim.cluster.mig_manager, with no device plugin of
its own) and mig-agent (a host process acting as its DaemonSet's ServiceAccount, as
tests/kubelet/test_agent.py runs it) take the node in turn, each through a counting proxy of its
own (migsim.cluster.api_faults), over the same GPUs and the same mig-parted config file.

Per case, before the label changes: a GPU pod on each device that changes (a's and b's trainer:
it holds its device with the simulated CUDA program, and its SIGTERM handler takes `--term-s`
seconds to checkpoint before it ends), in b a serving pod on each 3g device (which the new layout
keeps), and a Deployment's pod, Pending (the scheduler has found no node), that wants a device only
the new layout has. Cases: (a) whole GPUs -> all-balanced, the Pending pod wants
mig-2g.20gb; (b) all-balanced -> 4g.40gb + 3g.40gb per GPU, trainer on the 2g, the Pending pod
wants mig-4g.40gb.

MIG Manager does not drain: with a pod on a device it must destroy its pass fails (ERROR_IN_USE).
The benchmark does what an operator must first: delete the node's GPU pods (default grace: the
trainer's handler runs) and wait until they are gone, then relabel. Its times start at that
deletion; mig-agent's at the label change.

Per case and tool: seconds to `success`, to the new devices advertised, to the Pending pod
scheduled and Running; pods that lost their device (deleted, evicted, or running on a device that
is gone); GPU instances destroyed and created (the simulator's call counters); the manager's API
requests by verb and resource; any UnexpectedAdmissionError (a pod's status or Event); and
mig-agent's own breakdown from its /metrics (mig_agent_reconfiguration_phase_seconds).

Needs root, the Kubernetes binaries and NVIDIA's binaries, and the machine's one kubelet: where
other work starts real nodes too, run it under the lock they take. Wall-clock on a shared
machine: compare the two tools of one run, and ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing the package

from migsim.cluster import Cluster, ViaProxy, agents, images, mig_manager, real_node  # noqa: E402
from migsim.cluster.api_faults import ApiFaultProxy  # noqa: E402
from migsim.cluster.processes import free_ports, spawn, stop  # noqa: E402
from migsim.nvml import state as simstate  # noqa: E402

from benchmarks.vs_mig_manager import (  # noqa: E402
    AGENT_SETTINGS,
    CONFIG,
    CREATE_GI,
    DESTROY_GI,
    GPU_STATE,
    MA,
    MM,
    NS,
    POD_LABEL,
    PROFILES,
    STATE,
    Bench,
    delete_pods,
    devices_on,
    fmt,
    new_proxy,
    set_layout,
    wait,
)
from mig_agent.observability.metrics import PHASES  # noqa: E402

NODE = real_node.NAME
FOUR_THREE = "bench-4g-3g"
WAITING = "bench-waiting"  # the Pending pod's Deployment, and its pods' app label
PHASE_METRIC = "mig_agent_reconfiguration_phase_seconds"
ADMISSION = "UnexpectedAdmissionError"


@dataclass(frozen=True, slots=True)
class Case:
    key: str
    title: str
    start: str
    target: str
    trainers: str  # a trainer on each device of this resource (they change)
    servers: str  # a serving pod on each device of this resource ("": none)
    wants: str  # the Pending pod's resource: only the new layout has it


CASES = (
    Case(
        "a",
        "whole GPUs -> all-balanced",
        "all-disabled",
        "all-balanced",
        "nvidia.com/gpu",
        "",
        "nvidia.com/mig-2g.20gb",
    ),
    Case(
        "b",
        f"all-balanced -> {FOUR_THREE} (4g.40gb + 3g.40gb)",
        "all-balanced",
        FOUR_THREE,
        "nvidia.com/mig-2g.20gb",
        "nvidia.com/mig-3g.40gb",
        "nvidia.com/mig-4g.40gb",
    ),
)


def bench_config(path: Path) -> Path:
    """One mig-parted config file, both tools': all.yaml + common.yaml + case b's layout."""
    configs: dict[str, Any] = {}
    for name in ("common.yaml", "all.yaml"):
        configs.update(yaml.safe_load((PROFILES / name).read_text())["mig-configs"])
    configs[FOUR_THREE] = [
        {"devices": "all", "mig-enabled": True, "mig-devices": {"4g.40gb": 1, "3g.40gb": 1}},
    ]
    path.write_text(yaml.safe_dump({"version": "v1", "mig-configs": configs}, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------
# The pods


HOLD = "echo devices=$NVIDIA_VISIBLE_DEVICES; gpu-workload --name {name} & "
LOOP = "while true; do sleep 0.2; done"


def gpu_pod(name: str, resource: str, script: str, grace_s: int) -> dict[str, Any]:
    """A pod spec on the real node under NVIDIA's runtime, one container of the busybox image
    built here holding `resource` x1."""
    return {
        "nodeSelector": {"kubernetes.io/hostname": NODE},
        "tolerations": [{"operator": "Exists"}],
        "runtimeClassName": "nvidia",
        "terminationGracePeriodSeconds": grace_s,
        "automountServiceAccountToken": False,  # none reads the API
        "containers": [
            {
                "name": "main",
                "image": images.BUSYBOX,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", script],
                "resources": {"limits": {resource: "1"}},
            }
        ],
    }


def trainer(term_s: float) -> str:
    """A CUDA program's stand-in holds its device; on SIGTERM it checkpoints for `term_s`."""
    return (
        HOLD.format(name="trainer")
        + f"trap 'echo got TERM; sleep {term_s:g}; kill $!; wait; exit 0' TERM; {LOOP}"
    )


SERVER = HOLD.format(name="server") + f"trap 'kill $!; wait; exit 0' TERM; {LOOP}"


def workload_pods(bench: Bench, case: Case, term_s: float) -> int:
    """The case's trainers and servers, one per device of their resource; returns their number
    once each runs and holds its device."""
    have = devices_on(bench.sim_state(NODE))
    wait(f"{NODE} advertises {dict(have)}", lambda: bench.advertised(NODE) == have, 120)
    n = 0
    for resource, script, grace in (
        (case.trainers, trainer(term_s), int(term_s) + 30),
        (case.servers, SERVER, 10),
    ):
        for _ in range(have[resource] if resource else 0):
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"generateName": "gpu-", "labels": {POD_LABEL: NODE}},
                "spec": {**gpu_pod("gpu", resource, script, grace), "restartPolicy": "Never"},
            }
            bench.api.request("POST", f"/api/v1/namespaces/{NS}/pods", pod)
            n += 1

    def holding() -> bool:
        running = [p for p in bench.pods(NODE) if p["status"].get("phase") == "Running"]
        return len(running) == n and len(held_by_pod(bench.sim_state(NODE))) == n

    wait(f"{n} GPU pods running on {NODE}, holding their devices", holding, 120)
    return n


def waiting_deployment(bench: Bench, resource: str) -> None:
    """A Deployment whose pod wants `resource` (as a user's job would: a pod refused at admission
    is replaced); returns once the scheduler has said Unschedulable."""
    script = HOLD.format(name="new") + f"trap 'kill $!; wait; exit 0' TERM; {LOOP}"
    labels = {"app": WAITING}
    body = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": WAITING},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": gpu_pod("new", resource, script, 5),
            },
        },
    }
    bench.api.request("POST", f"/apis/apps/v1/namespaces/{NS}/deployments", body)

    def unschedulable() -> bool:
        return any(
            c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
            for p in waiting_pods(bench)
            for c in p["status"].get("conditions") or ()
        )

    wait("the scheduler to find no node for the waiting pod", unschedulable, 60)


def waiting_pods(bench: Bench) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = bench.api.get(
        f"/api/v1/namespaces/{NS}/pods?labelSelector=app%3D{WAITING}"
    )["items"]
    return items


def remove_waiting(bench: Bench) -> None:
    bench.api.request(
        "DELETE",
        f"/apis/apps/v1/namespaces/{NS}/deployments/{WAITING}",
        {"propagationPolicy": "Foreground", "gracePeriodSeconds": 0},
    )
    wait("the waiting pods gone", lambda: not waiting_pods(bench), 120)


def pod_uid_of(pid: int) -> str:
    """The UID of the pod whose container runs process `pid` (its cgroup, cgroupfs driver:
    .../kubepods/<qos>/pod<uid>/<container>), "" if none."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""
    for part in text.replace(":", "/").split("/"):
        if part.startswith("pod") and len(part) == 39:
            return part[3:]
    return ""


def held_by_pod(sim_state: str) -> dict[str, set[tuple[int, int]]]:
    """Pod UID -> the devices its processes hold: (GPU, GI serial; -1 for the whole GPU)."""
    out: dict[str, set[tuple[int, int]]] = {}
    for gpu in simstate.load_node(sim_state).gpus:
        for proc in gpu.processes:
            uid = pod_uid_of(proc.pid)
            gi = None if proc.gi is None else gpu.gi(proc.gi)
            if uid:
                out.setdefault(uid, set()).add((gpu.index, -1 if gi is None else gi.serial))
    return out


def alive(sim_state: str, device: tuple[int, int]) -> bool:
    gpu = simstate.load_node(sim_state).gpus[device[0]]
    return not gpu.mig_current if device[1] < 0 else gpu.gi_by_serial(device[1]) is not None


# ---------------------------------------------------------------------------------------------
# The two tools on the node


@dataclass
class Manager:
    system: str
    proxy: ApiFaultProxy
    metrics_port: int = 0  # mig-agent's

    def phases(self) -> dict[str, float]:
        """mig-agent's phase seconds so far, by phase ({} for MIG Manager)."""
        if not self.metrics_port:
            return {}
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(PHASE_METRIC + "_sum{"):
                phase = line.split('phase="', 1)[1].split('"', 1)[0]
                out[phase] = float(line.rpartition(" ")[2])
        return out


@contextmanager
def mig_manager_on(cluster: Cluster, config: Path) -> Iterator[Manager]:
    """NVIDIA's MIG Manager for the real node, through a counting proxy; the node's own
    device plugin DaemonSet is the one it pauses and brings back."""
    proxy = new_proxy(cluster)
    try:
        kubeconfig = mig_manager.admin_kubeconfig(
            cluster, cluster.node_dir(NODE) / "mig-manager.kubeconfig", proxy.url
        )
        record = mig_manager.start_node(
            cluster, NODE, config, device_plugin="none", kubeconfig=kubeconfig
        )
        wait(
            "MIG Manager's first look at the label",
            lambda: "Waiting for change" in Path(record.log).read_text(),
            120,
        )
        yield Manager(MM, proxy)
    finally:
        mig_manager.stop_node(cluster.dir, NODE)
        proxy.stop()


@contextmanager
def agent_on(cluster: Cluster, node: real_node.RealNode, config: Path) -> Iterator[Manager]:
    """mig-agent for the real node as a host process, acting as its DaemonSet's ServiceAccount
    (a token bound to a pod of it on the node), through a counting proxy; the agent's own
    settings but for bare pods (the benchmark's are) and the kubelet's PodResources socket."""
    proxy = new_proxy(cluster)
    holder = "mig-agent-on-host"
    pods = f"/api/v1/namespaces/{agents.AGENT_NS}/pods"
    spec = gpu_pod(holder, "cpu", "sleep 86400", 1)
    del spec["runtimeClassName"], spec["containers"][0]["resources"]
    spec["serviceAccountName"] = agents.AGENT_SA
    cluster.api.request("POST", pods, {"metadata": {"name": holder}, "spec": spec})
    proc = None
    try:
        wait(
            "the agent's token holder",
            lambda: cluster.api.get(f"{pods}/{holder}")["status"].get("phase") == "Running",
            60,
        )
        uid = cluster.api.get(f"{pods}/{holder}")["metadata"]["uid"]
        kubeconfig = ViaProxy(cluster, proxy.url).kubeconfig_for(
            agents.AGENT_NS,
            agents.AGENT_SA,
            Path(node.dir) / "agent.kubeconfig",
            bound_pod=(holder, uid),
        )
        port = free_ports(1)[0]
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("MIG_AGENT_")},
            **AGENT_SETTINGS,
            "MIG_AGENT_LOG_FORMAT": "json",
            "MIG_AGENT_EVICT_UNMANAGED_PODS": "true",
            "MIG_AGENT_POD_RESOURCES_SOCKET": str(node.pod_resources_socket),
        }
        argv = [sys.executable, "-m", "mig_agent", "run", "--node", NODE]
        argv += ["--kubeconfig", str(kubeconfig), "--backend", "simulated"]
        argv += ["--sim-state", str(node.sim_state), "-f", str(config)]
        argv += ["--metrics-port", str(port)]
        log = cluster.dir / "logs" / f"agent-{NODE}.log"
        proc = spawn(f"mig-agent@{NODE}", argv, log, env=env)
        wait(
            "the agent's first pass",
            lambda: (
                proc.alive()
                and GPU_STATE in (Bench(cluster).node(NODE)["metadata"].get("annotations") or {})
            ),
            60,
        )
        yield Manager(MA, proxy, port)
    finally:
        if proc is not None:
            stop([proc])
        cluster.api.request("DELETE", f"{pods}/{holder}", {"gracePeriodSeconds": 0})
        proxy.stop()


# ---------------------------------------------------------------------------------------------
# One case, one tool


@dataclass
class Row:
    case: str
    system: str
    outcome: str = "timeout"
    to_success: float | None = None  # the start -> state label success (or failed)
    to_devices: float | None = None  # -> the node advertises the new layout's devices
    to_scheduled: float | None = None  # -> the waiting pod bound to the node
    to_running: float | None = None  # -> the waiting pod Running
    by_hand: float = 0.0  # MIG Manager: the operator's deletion of the GPU pods, until gone
    pods: int = 0
    lost: int = 0  # pods that lost their device: gone, or running on a device that is gone
    destroyed: int = 0
    created: int = 0
    admission: int = 0  # UnexpectedAdmissionError: pods refused so, and Events
    api: Counter[str] = field(default_factory=Counter)
    phases: dict[str, float] = field(default_factory=dict)  # mig-agent's, from its /metrics

    @property
    def after_pods(self) -> float | None:
        """Label -> Running less the wait for the GPU pods to go (the trainer's handler, both
        tools): MIG Manager's deletion by hand, mig-agent's drain phase."""
        going = self.by_hand if self.system == MM else self.phases.get("drain")
        return None if self.to_running is None or going is None else self.to_running - going


def admission_errors(bench: Bench, since: float) -> int:
    """Pods refused with UnexpectedAdmissionError, by their status and by Events since `since`
    (epoch seconds), in the benchmark's namespace."""
    refused = {
        p["metadata"]["uid"] for p in waiting_pods(bench) if p["status"].get("reason") == ADMISSION
    }
    events = bench.api.get(f"/api/v1/namespaces/{NS}/events?fieldSelector=reason%3D{ADMISSION}")
    for e in events["items"]:
        when = e.get("lastTimestamp") or e.get("eventTime") or ""
        stamp = time.mktime(time.strptime(when[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
        if stamp >= since - 1:
            refused.add(e["involvedObject"].get("uid", e["metadata"]["uid"]))
    return len(refused)


def watch_until_running(bench: Bench, row: Row, start: float, timeout: float) -> None:
    """Poll (0.1 s) until the waiting pod runs and the state label is set: each time seen."""
    deadline = start + timeout
    while time.monotonic() < deadline:
        now = time.monotonic() - start
        if row.to_success is None:
            state = bench.labels(NODE).get(STATE, "")
            if state in ("success", "failed"):
                row.outcome, row.to_success = state, now
        if (
            row.to_devices is None
            and row.outcome == "success"
            and bench.advertised(NODE) == devices_on(bench.sim_state(NODE))
        ):
            row.to_devices = now
        pods = [p for p in waiting_pods(bench) if not p["metadata"].get("deletionTimestamp")]
        if row.to_scheduled is None and any(p["spec"].get("nodeName") for p in pods):
            row.to_scheduled = now
        if row.to_running is None and any(p["status"].get("phase") == "Running" for p in pods):
            row.to_running = now
        settled = row.to_devices is not None or row.outcome != "success"
        if row.outcome == "failed" or (
            row.to_running is not None and row.to_success is not None and settled
        ):
            return
        time.sleep(0.1)


def run_case(bench: Bench, manager: Manager, case: Case, term_s: float) -> Row:
    sim = bench.sim_state(NODE)
    set_layout(bench, [NODE], case.start)
    row = Row(case.key, manager.system)
    row.pods = workload_pods(bench, case, term_s)
    waiting_deployment(bench, case.wants)
    before = held_by_pod(sim)
    simstate.reset_call_counts(sim)
    api0, phases0 = manager.proxy.snapshot(), manager.phases()
    since, start = time.time(), time.monotonic()
    if manager.system == MM:  # it does not drain: the operator deletes the GPU pods first
        delete_pods(bench, [NODE], grace=None)
        row.by_hand = time.monotonic() - start
    bench.patch_labels(NODE, {CONFIG: case.target, STATE: None})
    watch_until_running(bench, row, start, 600)
    row.api = manager.proxy.snapshot() - api0
    phases = manager.phases()
    row.phases = {p: s - phases0.get(p, 0.0) for p, s in phases.items() if s > phases0.get(p, 0)}
    counts = simstate.call_counts(sim).by_function
    row.destroyed = counts.get(DESTROY_GI, 0)
    row.created = sum(counts.get(f, 0) for f in CREATE_GI)
    pods = bench.pods(NODE)
    now = {p["metadata"]["uid"] for p in pods if not p["metadata"].get("deletionTimestamp")}
    row.lost = sum(
        1 for uid, held in before.items() if uid not in now or not all(alive(sim, d) for d in held)
    )
    row.admission = admission_errors(bench, since)
    remove_waiting(bench)
    delete_pods(bench, [NODE])
    return row


# ---------------------------------------------------------------------------------------------
# The run and its report


def run_all(
    cluster: Cluster, node: real_node.RealNode, config: Path, args: argparse.Namespace
) -> list[Row]:
    """Every round: each tool in turn takes the node and runs every case."""
    bench = Bench(cluster)
    cases = [c for c in CASES if c.key in args.cases.split(",")]
    rows: list[Row] = []
    for r in range(args.rounds):
        for system in (MM, MA):
            with (
                mig_manager_on(cluster, config) if system == MM else agent_on(cluster, node, config)
            ) as manager:
                for case in cases:
                    say(f"round {r + 1}, {system}: ({case.key}) {case.title}")
                    rows.append(run_case(bench, manager, case, args.term_s))
                    say(f"  {rows[-1]}")
    return rows


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def median(rows: Sequence[Row], what: str) -> float | None:
    values = [getattr(r, what) for r in rows if getattr(r, what) is not None]
    return statistics.median(values) if values else None


def print_rows(rows: Sequence[Row]) -> None:
    head = (
        "case",
        "tool",
        "outcome",
        "pods deleted by hand s",
        "to success s",
        "to devices s",
        "Pending pod scheduled s",
        "Pending pod Running s",
        "pods lost device",
        "GI destroyed / created",
        "API requests",
        ADMISSION,
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        cells = [
            r.case,
            r.system,
            r.outcome,
            fmt(r.by_hand) if r.system == MM else "-",
            fmt(r.to_success),
            fmt(r.to_devices),
            fmt(r.to_scheduled),
            fmt(r.to_running),
            f"{r.lost}/{r.pods}",
            f"{r.destroyed} / {r.created}",
            str(sum(r.api.values())),
            str(r.admission),
        ]
        print("| " + " | ".join(cells) + " |")


def print_ratios(rows: Sequence[Row]) -> None:
    """Medians over the rounds, MIG Manager / mig-agent."""
    print(
        "\n| case | to success s MM / agent | ratio | Pending pod Running s MM / agent | ratio "
        "| after the pods went s MM / agent | ratio | GIs destroyed MM / agent "
        "| pods that lost a device MM / agent |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for case in CASES:
        mm = [r for r in rows if r.case == case.key and r.system == MM]
        ma = [r for r in rows if r.case == case.key and r.system == MA]
        if not mm or not ma:
            continue
        cells = [f"{case.key} {case.title}"]
        for what in ("to_success", "to_running", "after_pods"):
            a, b = median(mm, what), median(ma, what)
            cells.append(f"{fmt(a)} / {fmt(b)}")
            cells.append(f"{a / b:.2f}" if a is not None and b else "-")
        for what in ("destroyed", "lost"):
            cells.append(f"{median(mm, what):g} / {median(ma, what):g}")
        print("| " + " | ".join(cells) + " |")


def print_details(rows: Sequence[Row]) -> None:
    print("\nAPI requests by verb and resource (each tool's proxy, start to the end of the row):\n")
    for r in rows:
        kinds = sorted(r.api.items(), key=lambda kv: (-kv[1], kv[0]))
        print(f"- {r.case}, {r.system}: " + (", ".join(f"{k} x{v}" for k, v in kinds) or "none"))
    print("\nmig-agent's phases (mig_agent_reconfiguration_phase_seconds, this change's sums):\n")
    for r in rows:
        if r.system != MA or r.to_success is None:
            continue
        total = sum(r.phases.values())
        parts = ", ".join(f"{p} {r.phases[p]:.2f}" for p in PHASES if p in r.phases)
        print(
            f"- {r.case}: {parts}; phases {total:.2f} s of {r.to_success:.2f} s to success "
            "(the rest: the label's watch, then the uncordon and success after the layout is "
            "advertised)"
        )
    ma_rows = [r for r in rows if r.system == MA]
    print(
        "\nAfter the pods went: label -> the Pending pod Running less the wait for the GPU pods "
        "to go, which both tools wait alike (the trainer's handler): MIG Manager's deletion "
        "by hand, mig-agent's drain phase."
    )
    print(
        f"\n{ADMISSION}: {sum(r.admission for r in rows) or 'none'} "
        f"({sum(r.admission for r in ma_rows)} with mig-agent)"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", default="1xH100-80GB", help="the real node's simulated GPUs")
    p.add_argument(
        "--latency",
        type=float,
        default=0.25,
        help="seconds added to every mutating NVML call (default 0.25, as vs_mig_manager.py)",
    )
    p.add_argument(
        "--term-s", type=float, default=10.0, help="the trainer's SIGTERM handler (default 10)"
    )
    p.add_argument("--rounds", type=int, default=1, help="each tool takes the node this often")
    p.add_argument("--cases", default="a,b", help="comma-separated (default a,b)")
    p.add_argument("--logs", type=Path, default=None, help="copy the cluster's logs here")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("the real node runs containerd and a kubelet: run as root", file=sys.stderr)
        return 2
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="vs-mm-real-") as tmp:
        cluster = Cluster.up(Path(tmp) / "c", gpu_nodes=0)
        node = None
        try:
            config = bench_config(Path(tmp) / "bench-profiles.yaml")
            agents.install(cluster)
            cluster.kubectl("create", "namespace", NS)
            node = real_node.start(cluster, NODE, gpus=args.gpus)
            real_node.install_device_plugin(cluster, node)
            simstate.set_latency(node.sim_state, args.latency)
            rows = run_all(cluster, node, config, args)
        finally:
            if node is not None:
                real_node.stop_node(real_node.load(cluster, NODE) or node)
            cluster.down()
            if args.logs is not None:
                shutil.copytree(cluster.dir / "logs", args.logs, dirs_exist_ok=True)
    print(
        f"\n# What a user waits for on the real node: {args.gpus}, NVIDIA's device plugin as the "
        f"kubelet's DaemonSet pod, {args.latency:g} s per mutating NVML call, the trainer's "
        f"SIGTERM handler {args.term_s:g} s; MIG Manager's GPU pods deleted by hand (its times "
        "start at that deletion), then the node relabelled\n"
    )
    print_rows(rows)
    print_ratios(rows)
    print_details(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
