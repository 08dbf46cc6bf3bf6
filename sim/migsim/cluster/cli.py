"""`scripts/local-cluster up|down|status|env`: the local cluster from a shell."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from . import agents, kueue, real_node
from .cluster import COMPONENTS, Cluster, default_dir, down
from .errors import ClusterNotRunning, DevClusterError
from .nodes import DEFAULT_GPUS
from .processes import Proc

PLUGIN_NAMES = {
    "nvidia": "NVIDIA's device plugin and GFD",
    "simulated": "a simulated device plugin",
    "dra": "NVIDIA's DRA kubelet plugin",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="local-cluster",
        description="A local Kubernetes on loopback with kwok-simulated GPU nodes.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    def with_dir(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument(
            "--dir",
            type=Path,
            default=None,
            help=f"cluster folder (default: $MIG_AGENT_CLUSTER_DIR or {default_dir()})",
        )
        return sp

    up = with_dir(sub.add_parser("up", help="start the cluster (reuse it if already up)"))
    up.add_argument(
        "--nodes",
        type=int,
        default=2,
        metavar="N",
        help="simulated GPU nodes gpu-node-0..N-1 (default 2)",
    )
    up.add_argument(
        "--gpus",
        action="append",
        metavar="SPEC",
        help=f"GPUs of each GPU node, e.g. 8xH100-80GB or 4xA100-40GB,4xA30 "
        f"(default {DEFAULT_GPUS}); repeat to give nodes different GPUs, cycling",
    )
    up.add_argument(
        "--cpu-nodes",
        type=int,
        default=0,
        metavar="M",
        help="simulated nodes without GPUs, cpu-node-0..M-1 (default 0)",
    )
    up.add_argument(
        "--pod-delete-delay",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="how long a deleted pod lingers (default 2; per pod: annotation "
        "pod-delete.stage.kwok.x-k8s.io/delay)",
    )
    up.add_argument(
        "--restart-backoff",
        type=float,
        default=agents.KUBELET_BACKOFF[0],
        metavar="SECONDS",
        help="an agent that exits is restarted after this delay, "
        "doubled after each restart, as a kubelet does (default %(default)g)",
    )
    up.add_argument(
        "--restart-backoff-max",
        type=float,
        default=agents.KUBELET_BACKOFF[1],
        metavar="SECONDS",
        help="cap of that delay (default %(default)g)",
    )
    up.add_argument(
        "--no-agents",
        action="store_true",
        help="do not install mig-agent nor start an agent and a device plugin per GPU node",
    )
    up.add_argument(
        "--device-plugin",
        choices=agents.DEVICE_PLUGINS,
        default=None,
        help="nvidia: NVIDIA's device plugin and GFD over the simulated GPUs (root; "
        "scripts/nvidia-binaries build); simulated: the home-made model of it "
        "(default: $MIG_AGENT_DEVICE_PLUGIN, else nvidia as root); dra: no device plugin "
        "but NVIDIA's DRA kubelet plugin while its DaemonSet's pod runs (root; "
        "scripts/dra-driver build)",
    )
    up.add_argument(
        "--real-node",
        metavar="GPUS",
        default=None,
        help="also a real node, kubelet-node-0: a kubelet on containerd (root; "
        "scripts/node-packages) with these simulated GPUs (e.g. 2xH100-80GB) and NVIDIA's "
        "device plugin as its DaemonSet's pod",
    )
    up.add_argument(
        "--kueue",
        action="store_true",
        help="also Kueue's controller and CRDs (scripts/kueue-binary build); no webhook is "
        "registered: queue Jobs created suspended with the label kueue.x-k8s.io/queue-name",
    )
    down_p = with_dir(sub.add_parser("down", help="stop the cluster's processes"))
    down_p.add_argument("--purge", action="store_true", help="also remove the cluster folder")
    with_dir(sub.add_parser("status", help="show processes, health, memory and nodes"))
    with_dir(sub.add_parser("env", help="print `export KUBECONFIG=...` for eval"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "up":
            return _up(args)
        if args.command == "down":
            return _down(args)
        if args.command == "status":
            return _status(args)
        return _env(args)
    except (DevClusterError, ValueError) as e:  # ValueError: a bad --gpus spec
        print(f"local-cluster: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # `local-cluster status | head`: the reader left early, which is no error of ours. Point
        # stdout at /dev/null so that the interpreter's final flush does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _up(args: argparse.Namespace) -> int:
    started = time.monotonic()
    cluster = Cluster.up(
        args.dir,
        gpu_nodes=args.nodes,
        gpus=args.gpus or DEFAULT_GPUS,
        cpu_nodes=args.cpu_nodes,
        pod_delete_delay=args.pod_delete_delay,
        log=lambda msg: print(msg, file=sys.stderr),
    )
    if not args.no_agents:
        agents.install(cluster)
        kind = args.device_plugin or agents.default_device_plugin()
        if kind == "dra":
            agents.install_dra(cluster)
        gpu_nodes = [f"gpu-node-{i}" for i in range(args.nodes)]
        running = agents.running(cluster.dir)
        backoff = (args.restart_backoff, args.restart_backoff_max)
        for node in gpu_nodes:
            record = running.get(node)
            if record is not None and _node_up(record):
                continue
            if record is not None:  # recorded, but the agent or the device plugin is gone
                print(
                    f"{node}: restarting mig-agent and the device plugin "
                    f"(agent {agents.agent_state(record)})",
                    file=sys.stderr,
                )
                agents.stop_node(cluster.dir, node)
            agents.start_node(cluster, node, restart_backoff=backoff, device_plugin=kind)
        running = agents.running(cluster.dir)
        up_now = [n for n in gpu_nodes if n in running and _node_up(running[n])]
        print(
            f"mig-agent and {PLUGIN_NAMES[kind]} running on {len(up_now)} of "
            f"{len(gpu_nodes)} node(s); logs in {cluster.dir / 'logs'}",
            file=sys.stderr,
        )
        if len(up_now) != len(gpu_nodes):
            return 1
    if args.real_node:
        real = real_node.load(cluster, real_node.NAME)
        if real is None or not real.kubelet.alive():
            real = real_node.start(cluster, real_node.NAME, gpus=args.real_node)
            real_node.install_device_plugin(cluster, real)
        print(f"real node {real.name}: kubelet on containerd, {real.gpus}", file=sys.stderr)
    if args.kueue:
        kueue.start(cluster)
        print(f"Kueue running; its log: {cluster.dir / 'logs' / 'kueue.log'}", file=sys.stderr)
    print(f"ready in {time.monotonic() - started:.1f} s; use it with:", file=sys.stderr)
    print(f"  export KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}", file=sys.stderr)
    return 0


def _node_up(record: dict[str, object]) -> bool:
    """The node's agent runs (or is in back-off under a live supervisor) and its plugin runs."""
    plugin = record.get("device_plugin")
    return (
        agents.agent_state(record) != "STOPPED"
        and isinstance(plugin, dict)
        and Proc(**plugin).alive()
    )


def _down(args: argparse.Namespace) -> int:
    with contextlib.suppress(ClusterNotRunning):
        cluster = Cluster.load(args.dir)
        real = real_node.load(cluster, real_node.NAME)
        if real is not None:
            real_node.stop_node(real)
    killed = down(args.dir, purge=args.purge)
    if killed:
        print(f"stopped; had to kill: {', '.join(killed)}", file=sys.stderr)
    else:
        print("stopped", file=sys.stderr)
    return 0


def _status(args: argparse.Namespace) -> int:
    """Exit 0: up and healthy; 1: some component is stopped or unhealthy; 3: no cluster."""
    try:
        cluster = Cluster.load(args.dir)
    except ClusterNotRunning as e:
        # "Not running" is an answer, not a failure of `status`; the exit code tells scripts which.
        print(str(e))
        return 3
    statuses = cluster.status()
    print(f"cluster folder  {cluster.dir}")
    print(f"API server      {cluster.server}")
    print(f"kubeconfig      {cluster.kubeconfig}")
    print()
    print(f"{'component':<26}{'pid':>8}  {'state':<10}{'RSS MiB':>8}  restarts")
    for s in statuses:
        state = "healthy" if s.healthy else "UNHEALTHY" if s.running else "STOPPED"
        print(f"{s.name:<26}{s.pid:>8}  {state:<10}{s.rss_bytes / 2**20:>8.0f}")
    print(f"{'total':<26}{'':>8}  {'':<10}{sum(s.rss_bytes for s in statuses) / 2**20:>8.0f}")
    agents_up = True
    for node, rec in sorted(agents.running(cluster.dir).items()):
        for kind in ("agent", "device_plugin"):
            proc = Proc(**rec[kind])
            if kind == "agent":
                state = agents.agent_state(rec)
                restarts = str(rec.get("restarts", 0))
                if rec.get("last_exit"):
                    restarts += f" (last: {rec['last_exit']})"
            else:
                state, restarts = ("running" if proc.alive() else "STOPPED"), ""
            agents_up = agents_up and state == "running"
            label = f"{'mig-agent' if kind == 'agent' else 'device-plugin'}@{node}"
            print(
                f"{label:<26}{proc.pid:>8}  {state:<10}{proc.rss_bytes() / 2**20:>8.0f}  "
                f"{restarts}".rstrip()
            )
    healthy = len(statuses) == len(COMPONENTS) and all(s.healthy for s in statuses) and agents_up
    if healthy:
        print()
        print(
            cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product,nvidia.com/gpu.count"),
            end="",
        )
    return 0 if healthy else 1


def _env(args: argparse.Namespace) -> int:
    cluster = Cluster.attach(args.dir)
    print(f"export KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}")
    # Lets `pytest tests/cluster` reuse this cluster instead of starting its own.
    print(f"export MIG_AGENT_TEST_CLUSTER_DIR={shlex.quote(str(cluster.dir))}")
    return 0
