"""``mig-agent repartition|status|verify|advise`` (also ``scripts/repartition``,
``scripts/mig-status``; ``verify``'s options are shared with ``kubectl mig``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mig_agent.cli import advise_command
from mig_agent.cli.common import add_config_args, default_config
from mig_agent.cli.verify_options import add_pod_options, pod_spec, verifier
from mig_agent.config.settings import Settings
from mig_agent.ops import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    Action,
    Writer,
    check_layout,
    dry_run,
    repartition,
    select_nodes,
    status,
    status_json,
    status_table,
)
from mig_agent.ops.verify import VerifyCluster, verdicts_json, verify

VERIFY_EXITS = (
    "Exit 0 when every node passed every check, 1 when a check failed, 2 for a usage error "
    "(an unknown node, a bad option), 130 on Ctrl-C (the pods made so far are deleted)."
)


def _write(line: str) -> None:
    # Flushed per line: the progress must show live through a pipe too.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _connect(args: argparse.Namespace) -> Any:
    from mig_agent.kube.client import KubernetesCluster

    return KubernetesCluster.connect(args.kubeconfig or "", component="mig-agent-ops")


def cmd_repartition(args: argparse.Namespace) -> int:
    from mig_agent.config.profiles import load_catalog

    catalog = load_catalog(args.config_file or [default_config()])
    check_layout(catalog, args.layout)  # a typo is refused before even connecting
    settings = Settings.from_env()
    cluster = _connect(args)
    try:
        nodes = select_nodes(cluster, args.nodes, args.selector)
        if args.dry_run:
            previews = dry_run(cluster, catalog, args.layout, nodes, settings=settings, out=_write)
            refused = any(p.action is Action.REFUSE for p in previews)
            return EXIT_USAGE if refused and not args.force else EXIT_OK
        summary = repartition(
            cluster,
            catalog,
            args.layout,
            nodes,
            max_parallel=args.max_parallel,
            failure_budget=args.failure_budget,
            timeout_s=args.timeout_s,
            poll_s=args.poll_s,
            heartbeat_s=args.heartbeat_s,
            force=args.force,
            settings=settings,
            out=_write,
            verify=verifier(cluster, args, settings, _write) if args.verify else None,
        )
        return summary.exit_code
    finally:
        cluster.close()


def cmd_status(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    cluster = _connect(args)
    try:
        rows = status(cluster, settings=settings, selector=args.selector)
    finally:
        cluster.close()
    if args.output == "json":
        _write(json.dumps(status_json(rows), indent=2))
    else:
        for line in status_table(rows):
            _write(line)
    return EXIT_OK


def cmd_advise(args: argparse.Namespace) -> int:
    return advise_command.run(args, _connect, _write)


def run_verify(cluster: VerifyCluster, args: argparse.Namespace, out: Writer) -> int:
    """``verify`` (mig-agent's and kubectl mig's): the checks, as lines or JSON."""
    spec = pod_spec(args)
    nodes = select_nodes(cluster, args.nodes, args.selector)
    as_json = args.output == "json"
    verdicts = verify(
        cluster,
        nodes,
        pods=spec,
        settings=Settings.from_env(),
        out=(lambda _line: None) if as_json else out,
    )
    if as_json:
        out(json.dumps(verdicts_json(verdicts), indent=2))
    return EXIT_OK if all(v.ok for v in verdicts) else EXIT_FAILED


def cmd_verify(args: argparse.Namespace) -> int:
    cluster = _connect(args)
    try:
        return run_verify(cluster, args, _write)
    finally:
        cluster.close()


def add_verify_parser(sub: Any, **parents: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "verify",
        help="check nodes: published GPUs, allocatable, a tiny pod per device kind",
        description="The operator's checks of GPU nodes: the GPUs as the node's agent publishes "
        "them (and how old that is), the node's allocatable (or DRA ResourceSlice) against what "
        "those GPUs make under the node's MIG strategy, and per advertised resource a tiny pod "
        "pinned to the node under the RuntimeClass, whose nvidia-smi -L must show exactly one "
        "device of that kind, one the node lists. A failure names the check, what the pod and "
        "its events said, and what to look at. " + VERIFY_EXITS,
        **parents,
    )
    p.add_argument("nodes", nargs="*", metavar="NODE", help="node names (or use -l)")
    p.add_argument("-l", "--selector", default="", help="label selector of the nodes")
    p.add_argument("-o", "--output", choices=["text", "json"], default="text")
    add_pod_options(p)
    return p


def register(sub: Any) -> None:
    """Add ``repartition``, ``status``, ``verify`` and ``advise`` to ``mig-agent``."""
    _register_repartition(sub)
    p = sub.add_parser(
        "status", help="GPU nodes: layout, state, reason, GPUs and advertised MIG resources"
    )
    p.add_argument("-l", "--selector", default="", help="label selector of the nodes")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "advise",
        help="propose the relabels that serve the pending GPU pods with the least disruption",
        description=advise_command.DESCRIPTION,
    )
    advise_command.add_args(p, outputs=("table", "json"))
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG)")
    p.set_defaults(func=cmd_advise)
    p = add_verify_parser(sub)
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG)")
    p.set_defaults(func=cmd_verify)


def _register_repartition(sub: Any) -> None:
    p = sub.add_parser(
        "repartition",
        help="set a layout on nodes through the label and follow each to success or failed",
        description="Set the layout label on the nodes, at most --max-parallel at a time, and "
        "follow each node's state label. Exit 0 when every node succeeded, 1 on a failure or "
        "timeout, 2 when refused before any node was touched, 130 on Ctrl-C.",
    )
    p.add_argument("layout", metavar="LAYOUT", help="layout name from the profile configs")
    p.add_argument("nodes", nargs="*", metavar="NODE", help="node names (or use -l)")
    p.add_argument("-l", "--selector", default="", help="label selector of the nodes")
    p.add_argument(
        "-p",
        "--max-parallel",
        type=_positive_int,
        default=1,
        metavar="K",
        help="nodes changing at the same time (default 1)",
    )
    p.add_argument(
        "--failure-budget",
        type=int,
        default=0,
        metavar="N",
        help="failed nodes tolerated before no new node is started (default 0)",
    )
    p.add_argument(
        "--timeout",
        dest="timeout_s",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="per node; a node not done by then counts as a failure and is no longer "
        "waited for, its agent carries on (default 1800)",
    )
    p.add_argument(
        "--poll",
        dest="poll_s",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how often each node in progress is read (default 1)",
    )
    p.add_argument("--heartbeat", dest="heartbeat_s", type=float, default=30.0, metavar="SECONDS")
    p.add_argument("--dry-run", action="store_true", help="show the plan per node, change nothing")
    p.add_argument(
        "--force",
        action="store_true",
        help="go ahead on nodes where the layout does not fit by the published GPU state",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="run verify's checks on each node after its success; a node that fails them "
        "counts as failed (and so stops the rollout)",
    )
    add_pod_options(p)
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG)")
    add_config_args(p, layout=False)
    p.set_defaults(func=cmd_repartition)
