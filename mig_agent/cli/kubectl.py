"""``kubectl mig``: the ops commands as a kubectl plugin (the ``kubectl-mig`` program on PATH).

Kubectl's conventions: ``--kubeconfig`` and ``--context`` choose the cluster, ``-l`` selects nodes,
``-o wide|json|yaml`` the output, exit 0 on success, 1 on a failure, 2 on a usage or config error.
Colour only when stdout is a terminal and ``NO_COLOR`` is unset. ``-n`` names the namespace the
agents run in; ``status -o wide`` shows each node's agent pod from it.

    kubectl mig status [-l SELECTOR] [-o wide|json|yaml]
    kubectl mig plan NODE LAYOUT [-o json|yaml]
    kubectl mig repartition LAYOUT [NODE ...] [-l SELECTOR] [-p K] [--dry-run] [--verify]
    kubectl mig verify [NODE ...] [-l SELECTOR] [-o json] [--image IMAGE] [--runtime-class RC]
    kubectl mig advise [-l SELECTOR] [--allow-evict] [--max-nodes N] [-o json|yaml]
                       [--apply [--verify]]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from mig_agent.cli import advise_command
from mig_agent.cli.common import EXIT_OK, EXIT_USAGE, add_config_args, dispatch, load_configs
from mig_agent.cli.ops_commands import add_verify_parser, run_verify
from mig_agent.cli.verify_options import add_pod_options, verifier
from mig_agent.config.settings import Settings
from mig_agent.config.yaml_files import dump_yaml
from mig_agent.kube.client import KubernetesCluster
from mig_agent.kube.cluster import Cluster
from mig_agent.ops import (
    Action,
    NodeStatus,
    check_layout,
    dry_run,
    preview,
    repartition,
    resources_text,
    select_nodes,
    status,
    status_json,
)
from mig_agent.ops.values import table

_COLOURS = {"success": "32", "failed": "31", "pending": "33", "rebooting": "33"}
_REASON_WIDTH = 60


def err(text: str) -> None:
    sys.stderr.write(f"error: {text}\n")  # kubectl's own prefix


def colour_enabled(stream: Any = None) -> bool:
    stream = stream or sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)()) and "NO_COLOR" not in os.environ


def _paint(text: str, state: str | None, on: bool) -> str:
    code = _COLOURS.get(state or "")
    return f"\033[{code}m{text}\033[0m" if on and code else text


def status_lines(
    rows: Sequence[NodeStatus], *, wide: bool, colour: bool, agents: dict[str, str] | None = None
) -> list[str]:
    """The status table; ``wide`` adds GPUs, the agent pod and the whole reason."""
    if not rows:
        return ["No GPU nodes found."]
    header = ["NAME", "LAYOUT", "STATE", "RESOURCES", "REASON"]
    if wide:
        header[3:3] = ["GPUS"]
        header.append("AGENT")
    body = []
    for r in rows:
        state = (r.state or "-") + (",cordoned" if r.unschedulable else "")
        reason = r.reason.replace("\n", " ") or "-"
        if not wide and len(reason) > _REASON_WIDTH:
            reason = reason[: _REASON_WIDTH - 3] + "..."
        line = [r.node, r.layout or "-", state, resources_text(r), reason]
        if wide:
            gpus = (
                "?"
                if r.gpus is None
                else ",".join(
                    f"{g.index}:{g.model}{'(mig)' if g.mig_enabled else ''}" for g in r.gpus
                )
            )
            line[3:3] = [gpus]
            line.append((agents or {}).get(r.node, "-"))
        body.append(line)
    lines = table(header, body)
    if colour:  # paint after aligning, so escape codes do not shift the columns
        out = [lines[0]]
        for text, r in zip(lines[1:], rows, strict=True):
            out.append(text.replace(r.state or "\0", _paint(r.state or "", r.state, True), 1))
        return out
    return lines


def _connect(args: argparse.Namespace) -> KubernetesCluster:

    return KubernetesCluster.connect(
        args.kubeconfig or "", context=args.context or "", component="kubectl-mig"
    )


def _agent_pods(cluster: Cluster, namespace: str) -> dict[str, str]:
    """node -> "pod (Ready|NotReady)" of the agents in ``namespace``."""
    out = {}
    for p in cluster.list_pods(
        namespace=namespace, label_selector="app.kubernetes.io/name=mig-agent"
    ):
        if p.node:
            out[p.node] = f"{p.ref.name} ({'Ready' if p.ready else 'NotReady'})"
    return out


def cmd_status(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    cluster = _connect(args)
    try:
        rows = status(cluster, settings=settings, selector=args.selector)
        agents = _agent_pods(cluster, args.namespace) if args.output == "wide" else None
    finally:
        cluster.close()
    if args.output == "json":
        print(json.dumps(status_json(rows), indent=2))
    elif args.output == "yaml":
        print(dump_yaml(status_json(rows)), end="")
    else:
        for line in status_lines(
            rows, wide=args.output == "wide", colour=colour_enabled(), agents=agents
        ):
            print(line)
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    catalog = load_configs(args)
    the_layout = check_layout(catalog, args.layout)
    cluster = _connect(args)
    try:
        select_nodes(cluster, [args.node])
        (p,) = preview(cluster, the_layout, [args.node], settings=Settings.from_env())
    finally:
        cluster.close()
    if args.output in ("json", "yaml"):
        data = {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(p).items()
        }
        data["action"] = str(p.action)
        print(json.dumps(data, indent=2) if args.output == "json" else dump_yaml(data), end="")
        if args.output == "json":
            print()
    else:
        from mig_agent.ops import preview_text

        print(preview_text(p))
    return EXIT_USAGE if p.action is Action.REFUSE else EXIT_OK


def cmd_repartition(args: argparse.Namespace) -> int:
    catalog = load_configs(args)
    check_layout(catalog, args.layout)  # a typo is refused before connecting
    settings = Settings.from_env()
    cluster = _connect(args)
    try:
        nodes = select_nodes(cluster, args.nodes, args.selector)
        if args.dry_run:
            previews = dry_run(cluster, catalog, args.layout, nodes, settings=settings, out=_print)
            return EXIT_USAGE if any(p.action is Action.REFUSE for p in previews) else EXIT_OK
        return repartition(
            cluster,
            catalog,
            args.layout,
            nodes,
            max_parallel=args.max_parallel,
            timeout_s=args.timeout_s,
            settings=settings,
            out=_print,
            verify=verifier(cluster, args, settings, _print) if args.verify else None,
        ).exit_code
    finally:
        cluster.close()


def cmd_advise(args: argparse.Namespace) -> int:
    return advise_command.run(args, _connect, _print, dump=dump_yaml)


def cmd_verify(args: argparse.Namespace) -> int:
    cluster = _connect(args)
    try:
        return run_verify(cluster, args, _print)
    finally:
        cluster.close()


def _print(line: str) -> None:
    print(line, flush=True)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--kubeconfig",
        default=os.environ.get("KUBECONFIG"),
        help="kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)",
    )
    common.add_argument("--context", default=None, help="kubeconfig context to use")
    common.add_argument(
        "-n",
        "--namespace",
        default="mig-agent",
        help="namespace of the mig-agent pods (default mig-agent)",
    )
    parser = argparse.ArgumentParser(
        prog="kubectl mig",
        parents=[common],
        description="MIG layouts of GPU nodes, through mig-agent's node labels.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("status", parents=[common], help="GPU nodes: layout, state, resources")
    p.add_argument("-l", "--selector", default="", help="label selector of the nodes")
    p.add_argument("-o", "--output", choices=["table", "wide", "json", "yaml"], default="table")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser(
        "plan",
        parents=[common],
        help="what a layout would change on a node, from its published GPU state",
    )
    p.add_argument("node", metavar="NODE")
    p.add_argument("layout", metavar="LAYOUT")
    p.add_argument("-o", "--output", choices=["text", "json", "yaml"], default="text")
    add_config_args(p, layout=False)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "repartition",
        parents=[common],
        help="set a layout on nodes, K at a time, and follow each to its result",
    )
    p.add_argument("layout", metavar="LAYOUT")
    p.add_argument("nodes", nargs="*", metavar="NODE")
    p.add_argument("-l", "--selector", default="", help="label selector of the nodes")
    p.add_argument("-p", "--max-parallel", type=int, default=1, metavar="K")
    p.add_argument("--timeout", dest="timeout_s", type=float, default=1800.0, metavar="SECONDS")
    p.add_argument("--dry-run", action="store_true", help="show the plan per node, change nothing")
    p.add_argument(
        "--verify", action="store_true", help="verify each node after its success (see verify)"
    )
    add_pod_options(p)
    add_config_args(p, layout=False)
    p.set_defaults(func=cmd_repartition)

    p = sub.add_parser(
        "advise",
        parents=[common],
        help="propose the relabels that serve the pending GPU pods with the least disruption",
        description=advise_command.DESCRIPTION,
    )
    advise_command.add_args(p, outputs=("table", "json", "yaml"))
    p.set_defaults(func=cmd_advise)
    p = add_verify_parser(sub, parents=[common])
    p.set_defaults(func=cmd_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mig_agent.observability.logs import configure_logging

    configure_logging("console", level=30)  # a kubectl plugin prints results, not logs
    return dispatch(args, say=err, crashed="kubectl_mig.crashed")
