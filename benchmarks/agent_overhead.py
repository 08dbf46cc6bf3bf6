"""Agent benchmark on the local cluster: label change to ``success`` on one 8-GPU simulated node
(zero simulated hardware latency), split by phase; with ``--pods``, the same with a GPU pod on
every device, split into what the agent waits on and its own time; then the idle agent's API
requests, memory and CPU.

Run: python benchmarks/agent_overhead.py [--gpus 8xH100-80GB] [--rounds 3] [--idle 60] [--pods]
                                         [--quick]
Starts its own cluster in a temporary folder and stops it at the end (needs scripts/k8s-binaries).

``--pods`` runs the side-by-side benchmark's transitions a, d1 and d2 (benchmarks/vs_mig_manager.py)
on a node set up as that benchmark sets up its mig-agent pool (its retry settings, a GPU pod on
every device, pods taking kwok's 2 s to terminate). Each label -> ``success`` is split by the
agent's own log lines: the drain's wait for the pods to go (its last eviction to its end), apply
and verify (the simulated NVML, in the agent's process), the device plugin's restart until the node
advertises the layout, and the rest, the agent's own time (plan, node patches, Events, evictions,
looks at the pods and the node).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from migsim.cluster import Cluster, agents  # noqa: E402
from migsim.cluster.processes import Proc  # noqa: E402

from benchmarks.options import add_cluster_options  # noqa: E402
from benchmarks.vs_mig_manager import (  # noqa: E402
    AGENT_SETTINGS,
    NS,
    SUITE,
    Bench,
    Transition,
    delete_pods,
    devices_on,
    fill_with_pods,
    set_layout,
    wait,
)
from mig_agent.observability import metrics  # noqa: E402

CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
PHASES = tuple(p for p in metrics.PHASES if p != "post_apply")  # no hooks here
WITH_PODS = ("a", "d1", "d2")  # the side-by-side benchmark's transitions on whole 8-GPU nodes


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def api_requests(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("mig_agent_api_requests_total"))


def phase_sums(metrics: dict[str, float]) -> dict[str, float]:
    return {
        p: metrics.get(f'mig_agent_reconfiguration_phase_seconds_sum{{phase="{p}"}}', 0.0)
        for p in PHASES
    }


def wait_state(cluster: Cluster, node: str, want: str, timeout: float = 120) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        labels = cluster.api.get(f"/api/v1/nodes/{node}")["metadata"].get("labels", {})
        if labels.get(STATE) == want:
            return time.monotonic() - start
        if labels.get(STATE) == "failed":
            raise RuntimeError(f"{node} failed")
        time.sleep(0.02)
    raise TimeoutError(f"{node} not {want} after {timeout} s")


@dataclass(frozen=True, slots=True)
class Split:
    """One label -> success with pods on the devices, split by the agent's log lines (s)."""

    key: str
    evicted: int
    wall: float
    pods_going: float  # the drain's wait after its last eviction, until the pods are gone
    nvml: float  # the apply and verify phases: the simulated NVML, in the agent's process
    device_plugin: float  # the plugin's restart until the node advertises the layout
    api: float
    cpu: float

    @property
    def own(self) -> float:
        return self.wall - self.pods_going - self.nvml - self.device_plugin


def read_lines(log: Path, offset: int) -> list[dict[str, Any]]:
    with log.open("rb") as f:
        f.seek(offset)
        data = f.read()
    out = []
    for raw in data.splitlines():
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue  # a line that is not the agent's JSON (the supervisor's, say)
    return out


def when(line: Mapping[str, Any]) -> float:
    return datetime.fromisoformat(str(line["timestamp"]).replace("Z", "+00:00")).timestamp()


def split_pass(
    key: str, lines: Sequence[Mapping[str, Any]], wall: float, api: float, cpu: float
) -> Split:
    """The pass's time split from its log lines (phase.started/finished, drain.pod_evicted)."""
    finished = {
        str(x["phase"]): float(x["duration_s"]) for x in lines if x.get("event") == "phase.finished"
    }
    missing = {"drain", "apply", "verify", "device_plugin"} - set(finished)
    if missing:
        raise RuntimeError(f"{key}: the agent's log has no end of phase(s) {sorted(missing)}")
    drain_start = next(
        when(x) for x in lines if x.get("event") == "phase.started" and x.get("phase") == "drain"
    )
    drain_end = next(
        when(x) for x in lines if x.get("event") == "phase.finished" and x.get("phase") == "drain"
    )
    evictions = [when(x) for x in lines if x.get("event") == "drain.pod_evicted"]
    going = drain_end - max([drain_start, *evictions])
    return Split(
        key,
        len(evictions),
        wall,
        going,
        finished["apply"] + finished["verify"],
        finished["device_plugin"],
        api,
        cpu,
    )


def run_with_pods(
    cluster: Cluster, node: str, port: int, suite: Sequence[Transition], rounds: int
) -> list[Split]:
    bench = Bench(cluster)
    log = cluster.dir / "logs" / f"agent-{node}.log"
    agent = Proc(**agents.running(cluster.dir)[node]["agent"])
    out = []
    for _ in range(rounds):
        for t in suite:
            set_layout(bench, [node], t.start)
            fill_with_pods(bench, node, t.pods_on)
            time.sleep(0.5)  # the agent's look at the pods' arrival is over
            offset, api0, cpu0 = log.stat().st_size, api_requests(scrape(port)), agent.cpu_seconds()
            bench.patch_labels(node, {CONFIG: t.target, STATE: None})
            wall = wait_state(cluster, node, "success")
            api, cpu = api_requests(scrape(port)) - api0, agent.cpu_seconds() - cpu0
            want = devices_on(bench.sim_state(node))  # the agent waited for it before success
            assert bench.advertised(node) == want, (t.target, bench.advertised(node), want)
            out.append(split_pass(t.key, read_lines(log, offset), wall, api, cpu))
            delete_pods(bench, [node])
    return out


def print_splits(
    splits: Sequence[Split], suite: Sequence[Transition], gpus: str, rounds: int
) -> None:
    print(
        f"\n## With a GPU pod on every device: label -> success on one node of {gpus}, zero "
        f"hardware latency, seconds (median of {rounds})\n"
    )
    print(
        "| transition | evicted | wall | pods going | apply+verify (simulated NVML) "
        "| device plugin restart | the agent's own | API requests | agent CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for t in suite:
        mine = [x for x in splits if x.key == t.key]
        if not mine:
            continue

        def med(f: Callable[[Split], float], mine: list[Split] = mine) -> float:
            return statistics.median(f(x) for x in mine)

        print(
            f"| {t.key} {t.start} -> {t.target} | {med(lambda x: x.evicted):.0f} "
            f"| {med(lambda x: x.wall):.2f} | {med(lambda x: x.pods_going):.2f} "
            f"| {med(lambda x: x.nvml):.2f} | {med(lambda x: x.device_plugin):.2f} "
            f"| {med(lambda x: x.own):.2f} | {med(lambda x: x.api):.0f} "
            f"| {med(lambda x: x.cpu):.2f} |"
        )
    owns = [x.own for x in splits]
    print(
        f"\n(the agent's own time over every run: {min(owns):.2f}-{max(owns):.2f} s; pods "
        "going is the drain's wait from its last eviction until the pods, the paused device "
        "plugin's among them, are gone: kwok deletes a pod 2 s after it is asked)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="8xH100-80GB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle", type=float, default=60.0, help="seconds of idle measurement")
    ap.add_argument(
        "--pods",
        action="store_true",
        help="also transitions a, d1 and d2 with a GPU pod on every device, split "
        "into the waits and the agent's own time",
    )
    add_cluster_options(ap, quick="2 GPUs, one round, --pods with transitions a and d1, 10 s idle")
    args = ap.parse_args()
    if args.quick:
        args.gpus, args.rounds, args.idle, args.pods = "2xH100-80GB", 1, 10.0, True
    layouts = ["all-1g.10gb", "all-balanced", "all-3g.40gb"]
    suite = [t for t in SUITE if t.key in (("a", "d1") if args.quick else WITH_PODS)]
    with tempfile.TemporaryDirectory(prefix="mig-agent-bench-") as tmp:
        cluster = Cluster.up(Path(tmp), gpu_nodes=1, gpus=args.gpus)
        try:
            agents.install(cluster)
            cluster.kubectl("create", "namespace", NS)
            node = "gpu-node-0"
            procs = agents.start_node(
                cluster, node, device_plugin=args.device_plugin, settings=AGENT_SETTINGS
            )
            port = procs.metrics_port
            wait("the agent's metrics", lambda: _answers(port), 10)
            rows = []
            for r in range(args.rounds):
                for layout in layouts:
                    before = phase_sums(scrape(port))
                    cluster.api.request(
                        "PATCH",
                        f"/api/v1/nodes/{node}",
                        # the old state goes in the same patch, so the
                        # next "success" seen is the answer to this change
                        {"metadata": {"labels": {CONFIG: layout, STATE: None}}},
                        content_type="application/merge-patch+json",
                    )
                    wall = wait_state(cluster, node, "success")
                    after = phase_sums(scrape(port))
                    rows.append((r, layout, wall, {p: after[p] - before[p] for p in PHASES}))
                    time.sleep(0.5)
            print(
                f"\n## Label change to success, one node of {args.gpus}, zero hardware "
                f"latency ({args.rounds} rounds)\n"
            )
            print(
                f"| {'layout':<13} | {'wall s':>6} | "
                + " | ".join(f"{p:>13}" for p in PHASES)
                + " |"
            )
            print(f"|{'-' * 15}|{'-' * 8}|" + "|".join("-" * 15 for _ in PHASES) + "|")
            for layout in layouts:
                mine = [x for x in rows if x[1] == layout]
                wall = statistics.median(x[2] for x in mine)
                ph = {p: statistics.median(x[3][p] for x in mine) for p in PHASES}
                print(
                    f"| {layout:<13} | {wall:>6.2f} | "
                    + " | ".join(f"{ph[p]:>13.3f}" for p in PHASES)
                    + " |"
                )
            print(
                "\n(phase seconds are medians from the agent's own histogram; drain waits for "
                "the paused device-plugin pod to go, device_plugin for the new one to "
                "advertise)",
                flush=True,
            )
            if args.pods:
                splits = run_with_pods(cluster, node, port, suite, args.rounds)
                print_splits(splits, suite, args.gpus, args.rounds)

            agent = Proc(**agents.running(cluster.dir)[node]["agent"])
            time.sleep(10)  # let the last pass settle
            m0, cpu0, t0 = scrape(port), agent.cpu_seconds(), time.monotonic()
            time.sleep(args.idle)
            m1, cpu1, t1 = scrape(port), agent.cpu_seconds(), time.monotonic()
            minutes = (t1 - t0) / 60
            calls = {
                k.split('"')[1]: m1[k] - m0.get(k, 0)
                for k in m1
                if k.startswith("mig_agent_api_requests_total") and m1[k] - m0.get(k, 0)
            }
            print(f"\n## Idle agent over {args.idle:.0f} s\n")
            print("| measure | value |\n|---|---|")
            per_minute = (api_requests(m1) - api_requests(m0)) / minutes
            detail = ", ".join(f"{k}: {v:.0f}" for k, v in sorted(calls.items())) or "none"
            print(f"| API requests per minute | {per_minute:.1f} ({detail}) |")
            print(f"| CPU (share of one core) | {(cpu1 - cpu0) / (t1 - t0):.2%} |")
            print(f"| RSS | {agent.rss_bytes() / 2**20:.0f} MiB |")
            dp = Proc(**agents.running(cluster.dir)[node]["device_plugin"])
            print(
                f"| simulated device plugin RSS (not part of the product) | "
                f"{dp.rss_bytes() / 2**20:.0f} MiB |"
            )
        finally:
            agents.stop_all(cluster.dir)
            cluster.down()
    return 0


def _answers(port: int) -> bool:
    try:
        scrape(port)
    except OSError:
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
