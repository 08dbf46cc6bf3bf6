"""``python -m migsim device-plugin``: the simulated device plugin of one simulated node."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Sequence

import structlog

from mig_agent.kube.client import KubernetesCluster
from mig_agent.observability.logs import configure_logging

from . import device_plugin
from .nvml import open_node


def cmd_device_plugin(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    cluster = KubernetesCluster.connect(args.kubeconfig or "", component="sim-device-plugin")
    structlog.get_logger("migsim.device_plugin").info("device_plugin.started", node=args.node)
    try:
        device_plugin.run(
            cluster,
            lambda: open_node(args.sim_state),
            node=args.node,
            namespace=args.namespace,
            selector=args.selector,
            strategy=args.mig_strategy,
            stop=stop,
            pod_resources_socket=args.pod_resources_socket,
            config_file=args.config_file or "",
            # GPU pods hold processes on their devices, as on a real node
            processes=device_plugin.PodProcesses(args.sim_state)
            if args.pod_resources_socket
            else None,
        )
    finally:
        cluster.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m migsim", description="The simulated world's node-level commands."
    )
    parser.add_argument("--log-format", choices=["json", "console"], default="console")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("device-plugin", help="the simulated device plugin of a simulated node")
    p.add_argument("--node", required=True)
    p.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"))
    p.add_argument("--sim-state", required=True, help="the node's simulated GPU state file")
    p.add_argument("--namespace", default="gpu-operator")
    p.add_argument("--selector", default="app=nvidia-device-plugin-daemonset")
    p.add_argument("--mig-strategy", choices=["mixed", "single"], default="mixed")
    p.add_argument(
        "--config-file",
        metavar="FILE",
        default=None,
        help="the device plugin's config file (NVIDIA's format); its sharing section (time-"
        "slicing, MPS) multiplies and renames what is advertised",
    )
    p.add_argument(
        "--pod-resources-socket",
        metavar="PATH",
        default=None,
        help="also assign devices to the node's GPU pods and serve the kubelet's PodResources "
        "API on this unix socket",
    )
    p.set_defaults(func=cmd_device_plugin)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format)
    return int(args.func(args))
