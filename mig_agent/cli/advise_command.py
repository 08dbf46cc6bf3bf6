"""``mig-agent advise`` and ``kubectl mig advise``: one set of flags, one runner."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from mig_agent.cli.common import EXIT_OK, add_config_args, load_configs
from mig_agent.cli.verify_options import add_pod_options, verifier
from mig_agent.config.settings import Settings
from mig_agent.ops import advise as ops_advise

DESCRIPTION = (
    "Propose relabels among the approved layouts (the config) that serve the pods Pending for "
    "GPU devices (nvidia.com/mig-*, nvidia.com/gpu, DRA claims of mig.nvidia.com or "
    "gpu.nvidia.com): the most pods served, then the fewest pods evicted (none unless "
    "--allow-evict), GPUs and nodes changed. Reads only, unless --apply."
)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_args(p: argparse.ArgumentParser, *, outputs: tuple[str, ...]) -> None:
    p.add_argument("-l", "--selector", default="", help="label selector of the GPU nodes")
    p.add_argument(
        "--allow-evict",
        action="store_true",
        help="allow proposals that evict running GPU pods (as few as possible; PDBs respected)",
    )
    p.add_argument(
        "--max-nodes", type=_positive_int, default=None, metavar="N", help="propose at most N"
    )
    p.add_argument(
        "--generated",
        action="store_true",
        help="also consider the layouts generated for GPU models the config does not cover",
    )
    p.add_argument("-o", "--output", choices=outputs, default=outputs[0])
    p.add_argument(
        "--apply", action="store_true", help="relabel through the rollout, then follow the pods"
    )
    p.add_argument(
        "-p",
        "--max-parallel",
        type=_positive_int,
        default=1,
        metavar="K",
        help="with --apply: nodes changing at the same time (default 1)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="with --apply: run verify's checks on each node after its success; a node that "
        "fails them stops the rollout",
    )
    add_pod_options(p)
    add_config_args(p, layout=False)


def run(
    args: argparse.Namespace,
    connect: Callable[[argparse.Namespace], Any],
    out: Callable[[str], None],
    *,
    dump: Callable[[Any], str] | None = None,
) -> int:
    """Read the pool, print the proposals (``dump`` for outputs other than table and json),
    and with --apply carry them out."""
    catalog = load_configs(args)
    settings = Settings.from_env()
    cluster = connect(args)
    try:
        report = ops_advise.run(
            cluster,
            catalog,
            settings=settings,
            selector=args.selector,
            allow_evict=args.allow_evict,
            max_nodes=args.max_nodes,
            generated=args.generated,
        )
        if args.output == "json":
            out(json.dumps(ops_advise.report_json(report), indent=2))
        elif args.output == "table":
            for line in ops_advise.report_lines(report):
                out(line)
        elif dump is not None:
            out(dump(ops_advise.report_json(report)).rstrip("\n"))
        if not args.apply or not report.proposals:
            return EXIT_OK
        return ops_advise.apply(
            cluster,
            catalog,
            report,
            max_parallel=args.max_parallel,
            settings=settings,
            out=out,
            verify=verifier(cluster, args, settings, out) if args.verify else None,
        )
    finally:
        cluster.close()
