"""``mig-agent advise`` and ``kubectl mig advise``: one set of flags, one runner."""

from __future__ import annotations

import argparse
import json
import sys
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
        "--apply",
        action="store_true",
        help="relabel through the rollout, each node only if, looked at again just before, it "
        "is as read (labels, no new eviction, its pods still waiting), then follow the pods "
        "and sum up what was done and what was not",
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
        as_table = args.output == "table"
        if as_table:
            for line in ops_advise.report_lines(report):
                out(line)
        if not args.apply or not report.proposals:
            if not as_table:
                out(_document(ops_advise.report_json(report), args.output, dump))
            return EXIT_OK
        # JSON and YAML: one document on stdout once done, the rollout's progress on stderr
        progress = out if as_table else _stderr
        applied = ops_advise.apply(
            cluster,
            catalog,
            report,
            max_parallel=args.max_parallel,
            settings=settings,
            out=progress,
            verify=verifier(cluster, args, settings, progress) if args.verify else None,
        )
        if not as_table:
            doc = {**ops_advise.report_json(report), "apply": ops_advise.applied_json(applied)}
            out(_document(doc, args.output, dump))
        return applied.exit_code
    finally:
        cluster.close()


def _document(doc: Any, output: str, dump: Callable[[Any], str] | None) -> str:
    if output == "json" or dump is None:
        return json.dumps(doc, indent=2)
    return dump(doc).rstrip("\n")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
