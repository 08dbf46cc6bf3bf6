"""Agent benchmark on the local cluster: label change to ``success`` on one 8-GPU simulated node
(zero simulated hardware latency), split by phase; then the idle agent's API requests, memory and
CPU.

Run: python benchmarks/agent_overhead.py [--gpus 8xH100-80GB] [--rounds 3] [--idle 60]
Starts its own cluster in a temporary folder and stops it at the end (needs scripts/k8s-binaries).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from migsim.cluster import Cluster, agents  # noqa: E402
from migsim.cluster.processes import Proc  # noqa: E402

CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
PHASES = ("plan", "drain", "apply", "verify", "device_plugin")


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
    return {p: metrics.get(f'mig_agent_reconfiguration_phase_seconds_sum{{phase="{p}"}}', 0.0)
            for p in PHASES}


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="8xH100-80GB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle", type=float, default=60.0, help="seconds of idle measurement")
    ap.add_argument("--device-plugin", choices=("simulated", "nvidia"), default="simulated",
                    help="the node's device plugin: the project's simulated one (default) or "
                         "NVIDIA's under the node runtime (root)")
    args = ap.parse_args()
    layouts = ["all-1g.10gb", "all-balanced", "all-3g.40gb"]
    with tempfile.TemporaryDirectory(prefix="mig-agent-bench-") as tmp:
        cluster = Cluster.up(Path(tmp), gpu_nodes=1, gpus=args.gpus)
        try:
            agents.install(cluster)
            node = "gpu-node-0"
            procs = agents.start_node(cluster, node, device_plugin=args.device_plugin)
            port = procs.metrics_port
            for _ in range(100):
                try:
                    scrape(port)
                    break
                except OSError:
                    time.sleep(0.1)
            rows = []
            for r in range(args.rounds):
                for layout in layouts:
                    before = phase_sums(scrape(port))
                    cluster.api.request("PATCH", f"/api/v1/nodes/{node}",
                                        # the old state goes in the same patch, so the
                                        # next "success" seen is the answer to this change
                                        {"metadata": {"labels": {CONFIG: layout, STATE: None}}},
                                        content_type="application/merge-patch+json")
                    wall = wait_state(cluster, node, "success")
                    after = phase_sums(scrape(port))
                    rows.append((r, layout, wall, {p: after[p] - before[p] for p in PHASES}))
                    time.sleep(0.5)
            print(f"\n## Label change to success, one node of {args.gpus}, zero hardware "
                  f"latency ({args.rounds} rounds)\n")
            print(f"| {'layout':<13} | {'wall s':>6} | " + " | ".join(f"{p:>13}" for p in PHASES)
                  + " |")
            print(f"|{'-' * 15}|{'-' * 8}|" + "|".join("-" * 15 for _ in PHASES) + "|")
            for layout in layouts:
                mine = [x for x in rows if x[1] == layout]
                wall = statistics.median(x[2] for x in mine)
                ph = {p: statistics.median(x[3][p] for x in mine) for p in PHASES}
                print(f"| {layout:<13} | {wall:>6.2f} | "
                      + " | ".join(f"{ph[p]:>13.3f}" for p in PHASES) + " |")
            print("\n(phase seconds are medians from the agent's own histogram; drain waits for "
                  "the paused device-plugin pod to go, device_plugin for the new one to "
                  "advertise)")

            agent = Proc(**agents.running(cluster.dir)[node]["agent"])
            time.sleep(10)  # let the last pass settle
            m0, cpu0, t0 = scrape(port), agent.cpu_seconds(), time.monotonic()
            time.sleep(args.idle)
            m1, cpu1, t1 = scrape(port), agent.cpu_seconds(), time.monotonic()
            minutes = (t1 - t0) / 60
            calls = {k.split('"')[1]: m1[k] - m0.get(k, 0) for k in m1
                     if k.startswith("mig_agent_api_requests_total") and m1[k] - m0.get(k, 0)}
            print(f"\n## Idle agent over {args.idle:.0f} s\n")
            print("| measure | value |\n|---|---|")
            per_minute = (api_requests(m1) - api_requests(m0)) / minutes
            detail = ", ".join(f"{k}: {v:.0f}" for k, v in sorted(calls.items())) or "none"
            print(f"| API requests per minute | {per_minute:.1f} ({detail}) |")
            print(f"| CPU (share of one core) | {(cpu1 - cpu0) / (t1 - t0):.2%} |")
            print(f"| RSS | {agent.rss_bytes() / 2**20:.0f} MiB |")
            dp = Proc(**agents.running(cluster.dir)[node]["device_plugin"])
            print(f"| simulated device plugin RSS (not part of the product) | "
                  f"{dp.rss_bytes() / 2**20:.0f} MiB |")
        finally:
            cluster.down()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
