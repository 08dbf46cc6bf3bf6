"""``mig-agent``: the command line. One engine, three ways in.

``run`` is the node agent (DaemonSet); ``apply|plan|assert|export|validate|profiles`` work on one
node by hand without Kubernetes; ``repartition|status`` are the ops commands. This module wires
real or simulated backends and prints; the work happens elsewhere.

Exit codes: 0 ok, 1 runtime failure (or assert: not applied), 2 usage or config error,
3 changes needed (``plan --exit-code``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from mig_agent import __version__
from mig_agent.cli import admission_command, device_classes_command, node, ops_commands, run
from mig_agent.cli.common import default_config, dispatch

__all__ = ["build_parser", "default_config", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mig-agent", description="Partition NVIDIA GPUs into MIG instances from a layout."
    )
    parser.add_argument("--version", action="version", version=f"mig-agent {__version__}")
    parser.add_argument(
        "--log-format",
        choices=["auto", "json", "console"],
        default=os.environ.get("MIG_AGENT_LOG_FORMAT", "auto"),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    node.register(sub)
    run.register(sub)
    ops_commands.register(sub)
    admission_command.register(sub)
    device_classes_command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from mig_agent.observability.logs import configure_logging

    configure_logging(args.log_format, level=10 if args.verbose else 20)
    return dispatch(args)
