"""Cost of a pool rollout: `repartition` over N simulated nodes, K at a time, with real agents.

    python benchmarks/pool_rollout.py [--nodes 12] [--parallel 4] [--layout all-1g.10gb]
                                      [--gpus 8xH100-80GB] [--idle 5] [--poll 0.2] [--verbose]
                                      [--agent-idle 60] [--resync 300] [--quick]

Starts its own local cluster in a temporary folder (N GPU nodes `gpu-node-<i>`), installs
mig-agent and starts one agent and one simulated device plugin per node, waits until every agent
has published its GPU state, then runs the rollout through the ops API (`ops.repartition`, what
`mig-agent repartition -l ... -p K` runs) and tears everything down.

Reported: set-up time, total wall time of the rollout, per node the time from the label change to
`success` (median, p95, max; as the rollout saw it, so rounded up to the poll interval), where the
agents spent it (their `mig_agent_reconfiguration_phase_seconds` histograms, scraped from each
agent's /metrics), the rollout's own API calls, and the API requests the API server served during
the rollout (its `apiserver_request_total`, all clients: agents, device plugins, kwok, controllers),
less an idle baseline measured over `--idle` seconds just before; the API server's CPU seconds
during the rollout; the agents' total and largest RSS after it; then, over `--agent-idle` seconds
of an idle pool, the API requests each agent makes per minute (its own
`mig_agent_api_requests_total`, so a watch that is re-opened counts), and those beyond its
watches. The agents run as the chart runs them where NVIDIA's DRA driver is installed (DRA on,
with the rights to read slices and claims), and resync every `--resync` seconds (the agent's
default 300: a short one puts resync passes into the idle window). `--quick` (CI) runs 2 nodes
of 2 GPUs with short idle windows.
"""

from __future__ import annotations

import argparse
import re
import ssl
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing the package

from migsim.cluster import DEFAULT_GPUS, Cluster, agents, wait_until  # noqa: E402

from benchmarks.options import add_cluster_options  # noqa: E402
from benchmarks.tables import print_table  # noqa: E402
from mig_agent import ops  # noqa: E402
from mig_agent.config.profiles import load_catalog  # noqa: E402
from mig_agent.config.settings import Settings  # noqa: E402
from mig_agent.kube.client import KubernetesCluster  # noqa: E402
from mig_agent.kube.cluster import Cluster as KubeApi  # noqa: E402
from mig_agent.observability.metrics import PHASES  # noqa: E402

GPU_STATE = Settings().gpu_state_annotation
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# ---------------------------------------------------------------------------------------------
# Prometheus text, the API server's and the agents'


def samples(text: str, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of metric ``name`` in Prometheus text format."""
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            yield dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))


def apiserver_requests(cluster: Cluster) -> Counter[str]:
    """Requests served so far by the API server, by "VERB resource[/subresource]"."""
    req = urllib.request.Request(cluster.server + "/metrics")
    req.add_header("Authorization", f"Bearer {cluster.admin_token}")
    tls = ssl.create_default_context(cafile=str(cluster.ca_cert))
    with urllib.request.urlopen(req, context=tls, timeout=10) as resp:
        text = resp.read().decode()
    out: Counter[str] = Counter()
    for labels, value in samples(text, "apiserver_request_total"):
        sub = f"/{labels['subresource']}" if labels.get("subresource") else ""
        out[f"{labels.get('verb', '?')} {labels.get('resource', '?')}{sub}"] += int(value)
    return out


def agent_phases(ports: Sequence[int]) -> dict[str, tuple[float, int]]:
    """Per phase, (seconds, passes) summed over the agents' histograms."""
    seconds: dict[str, float] = {}
    passes: Counter[str] = Counter()
    metric = "mig_agent_reconfiguration_phase_seconds"
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for labels, value in samples(text, metric + "_sum"):
            phase = labels.get("phase", "")
            seconds[phase] = seconds.get(phase, 0.0) + value
        for labels, value in samples(text, metric + "_count"):
            passes[labels.get("phase", "")] += int(value)
    return {p: (seconds.get(p, 0.0), passes[p]) for p in PHASES}


# ---------------------------------------------------------------------------------------------
# The rollout's own calls


class CountingApi:
    """Delegates to a KubernetesCluster and counts the calls the rollout makes, by method."""

    def __init__(self, inner: KubernetesCluster) -> None:
        self._inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._inner, name)
        if not callable(target):
            return target

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return target(*args, **kwargs)

        return counted


# ---------------------------------------------------------------------------------------------
# Set-up and figures


def start_agents(
    cluster: Cluster,
    names: Sequence[str],
    timeout: float,
    device_plugin: str,
    settings: Mapping[str, str] | None = None,
) -> list[int]:
    """Install mig-agent, start an agent and device plugin per node, wait for published state;
    the agents' metrics ports."""
    agents.install(cluster)
    ports = [
        agents.start_node(cluster, n, device_plugin=device_plugin, settings=settings).metrics_port
        for n in names
    ]

    def published() -> bool:
        return all(
            GPU_STATE
            in (cluster.api.get(f"/api/v1/nodes/{n}")["metadata"].get("annotations") or {})
            for n in names
        )

    wait_until(published, timeout=timeout, what="every agent's published GPU state")
    return ports


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (as numpy's default), for a handful of values."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def delta(after: Mapping[str, int], before: Mapping[str, int]) -> Counter[str]:
    return Counter({k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=12, help="simulated GPU nodes (default 12)")
    p.add_argument(
        "--parallel",
        type=int,
        default=4,
        help="nodes changing at the same time, -p of repartition (default 4)",
    )
    p.add_argument("--layout", default="all-1g.10gb", help="layout to roll out")
    p.add_argument("--gpus", default=DEFAULT_GPUS, help=f"GPUs per node (default {DEFAULT_GPUS})")
    p.add_argument(
        "--idle",
        type=float,
        default=5.0,
        help="seconds of idle API traffic measured as the baseline (default 5)",
    )
    p.add_argument(
        "--poll",
        type=float,
        default=0.2,
        help="how often the rollout reads each node in progress (default 0.2)",
    )
    p.add_argument("--verbose", action="store_true", help="print the rollout's progress lines")
    p.add_argument(
        "--agent-idle",
        type=float,
        default=60.0,
        help="seconds of an idle pool over which the agents' own API requests are "
        "counted (default 60)",
    )
    p.add_argument(
        "--resync",
        type=float,
        default=300.0,
        help="the agents' resync period in seconds (default 300, the agent's own)",
    )
    add_cluster_options(p, quick="2 nodes of 2xH100-80GB, -p 2, 1 s idle windows")
    args = p.parse_args()
    if args.quick:
        args.nodes, args.parallel, args.gpus, args.idle, args.agent_idle = (
            2,
            2,
            "2xH100-80GB",
            1.0,
            2.0,
        )
    if args.nodes < 1 or args.parallel < 1:
        p.error("--nodes and --parallel must be at least 1")

    catalog = load_catalog([agents.PROFILES])
    ops.check_layout(catalog, args.layout)  # a typo costs no cluster start
    names = [f"gpu-node-{i}" for i in range(args.nodes)]
    progress: list[str] = []
    out: Callable[[str], None] = print if args.verbose else progress.append
    with tempfile.TemporaryDirectory(prefix="mig-agent-rollout-") as tmp:
        t0 = time.monotonic()
        cluster = Cluster.up(Path(tmp) / "cluster", gpu_nodes=args.nodes, gpus=args.gpus)
        api: KubernetesCluster | None = None
        try:
            ports = start_agents(
                cluster,
                names,
                timeout=60.0 + 10.0 * args.nodes,
                device_plugin=args.device_plugin,
                settings={"MIG_AGENT_RESYNC_S": f"{args.resync:g}"},
            )
            setup_s = time.monotonic() - t0
            api = KubernetesCluster.connect(str(cluster.kubeconfig), component="pool-rollout")
            counting = CountingApi(api)

            idle0 = apiserver_requests(cluster)
            time.sleep(args.idle)
            idle = delta(apiserver_requests(cluster), idle0)
            idle_rate = sum(idle.values()) / args.idle

            phases0 = agent_phases(ports)
            agent_procs = [agents.running(cluster.dir)[n] for n in names]
            cpu0 = sum(_cpu(r) for r in agent_procs)
            before = apiserver_requests(cluster)
            apiserver = next(p for p in cluster.state.procs if p.name == "kube-apiserver")
            apiserver_cpu0 = apiserver.cpu_seconds()
            agent_calls0 = agent_requests(ports)
            start = time.monotonic()
            summary = ops.repartition(
                cast(KubeApi, counting),
                catalog,
                args.layout,
                names,
                max_parallel=args.parallel,
                poll_s=args.poll,
                timeout_s=600.0,
                out=out,
            )
            wall = time.monotonic() - start
            during = delta(apiserver_requests(cluster), before)
            apiserver_cpu = apiserver.cpu_seconds() - apiserver_cpu0
            agent_calls = delta(agent_requests(ports), agent_calls0)
            agent_cpu = sum(_cpu(r) for r in agent_procs) - cpu0
            phases1 = agent_phases(ports)
            rss = [_rss(r) for r in agents.running(cluster.dir).values()]
            time.sleep(min(10.0, args.agent_idle))  # the last passes settle
            idle_calls0 = agent_requests(ports)
            idle_start = time.monotonic()
            time.sleep(args.agent_idle)
            idle_calls = delta(agent_requests(ports), idle_calls0)
            idle_minutes = (time.monotonic() - idle_start) / 60
        finally:
            if api is not None:
                api.close()
            agents.stop_all(cluster.dir)
            cluster.down()

    if not summary.ok:
        print("\n".join(progress))
        print(f"rollout did not succeed (exit code {summary.exit_code})", file=sys.stderr)
        return 1
    times = [r.elapsed_s for r in summary.results if r.elapsed_s is not None]
    beyond = Counter({k: v for k, v in idle_calls.items() if "watch" not in k})
    total = sum(during.values())
    baseline = idle_rate * wall
    top = ", ".join(f"{k} {v}" for k, v in during.most_common(6))
    ops_calls = ", ".join(f"{k} {v}" for k, v in sorted(counting.calls.items()))
    rows = [
        ("nodes x GPUs", f"{args.nodes} x {args.gpus}", f"layout {args.layout}"),
        ("parallelism (-p)", str(args.parallel), f"poll {args.poll:g} s"),
        (
            "set-up: cluster + agents ready",
            f"{setup_s:.1f} s",
            "Cluster.up, install, one agent + device plugin per node, GPU state published",
        ),
        (
            "rollout wall time",
            f"{wall:.1f} s",
            f"exit code {summary.exit_code}; ideal nodes/p x median = "
            f"{-(-args.nodes // args.parallel) * statistics.median(times):.1f} s",
        ),
        (
            "per node to success, median",
            f"{statistics.median(times):.2f} s",
            "label change -> state success, as the rollout saw it",
        ),
        (
            "per node to success, p95",
            f"{quantile(times, 0.95):.2f} s",
            f"min {min(times):.2f} s, max {max(times):.2f} s",
        ),
    ]
    for phase in PHASES:
        secs = phases1[phase][0] - phases0[phase][0]
        passes = phases1[phase][1] - phases0[phase][1]
        if passes:
            rows.append(
                (
                    f"agent phase {phase}, mean",
                    f"{secs / passes:.2f} s",
                    f"{passes} pass(es), from the agents' /metrics",
                )
            )
    rows += [
        (
            "agents' CPU during the rollout",
            f"{agent_cpu:.1f} s",
            f"{agent_cpu / args.nodes:.2f} s per node (agent processes only)",
        ),
        (
            "API server CPU during the rollout",
            f"{apiserver_cpu:.1f} s",
            f"{apiserver_cpu / wall:.0%} of one core on average",
        ),
        (
            "agents' RSS after the rollout, total",
            f"{sum(rss) / 2**20:.0f} MiB",
            f"largest {max(rss) / 2**20:.0f} MiB, mean {statistics.mean(rss) / 2**20:.0f} MiB",
        ),
        (
            "idle agent's API requests per minute",
            f"{sum(idle_calls.values()) / args.nodes / idle_minutes:.2f}",
            f"over {args.agent_idle:g} s of an idle pool, resync every {args.resync:g} s; "
            + (", ".join(f"{k} {v}" for k, v in idle_calls.most_common(4)) or "none"),
        ),
        (
            "  beyond the watches",
            f"{sum(beyond.values()) / args.nodes / idle_minutes:.2f}",
            "requests other than watches re-opened: "
            + (", ".join(f"{k} {v}" for k, v in beyond.most_common(4)) or "none"),
        ),
        (
            "agents' own API requests, per node",
            f"{sum(agent_calls.values()) / args.nodes:.1f}",
            "during the rollout, from the agents' counters; top: "
            + ", ".join(f"{k} {v}" for k, v in agent_calls.most_common(5)),
        ),
        ("rollout's own API calls", str(sum(counting.calls.values())), ops_calls),
        (
            "API requests during rollout",
            str(total),
            f"{total / wall:.0f}/s, all clients; top: {top}",
        ),
        (
            "  idle baseline",
            f"{baseline:.0f}",
            f"{idle_rate:.0f}/s over {args.idle:g} s before (kwok, agents, plugins, controllers)",
        ),
        (
            "  attributable, per node",
            f"{(total - baseline) / args.nodes:.0f}",
            "(during - baseline) / nodes; the baseline moves with the simulated device "
            "plugins' pod polling, so this is rough",
        ),
    ]
    print_table(rows)
    return 0


def agent_requests(ports: Sequence[int]) -> Counter[str]:
    """The agents' own API requests so far (their mig_agent_api_requests_total), by labels."""
    out: Counter[str] = Counter()
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for labels, value in samples(text, "mig_agent_api_requests_total"):
            out[" ".join(f"{k}={v}" for k, v in sorted(labels.items()))] += int(value)
    return out


def _rss(record: Mapping[str, Any]) -> int:
    from migsim.cluster.processes import Proc

    return Proc(**record["agent"]).rss_bytes()


def _cpu(record: Mapping[str, Any]) -> float:
    from migsim.cluster.processes import Proc

    return Proc(**record["agent"]).cpu_seconds()


if __name__ == "__main__":
    raise SystemExit(main())
