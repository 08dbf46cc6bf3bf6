"""``mig-agent dra-classes``: publish one DeviceClass per MIG profile the approved layouts create
(mig_agent.ops.device_classes); the chart runs it as a Job at install and upgrade."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mig_agent.cli.common import EXIT_FAILED, EXIT_OK, add_config_args, load_configs
from mig_agent.ops.device_classes import changes_json, sync

DESCRIPTION = (
    "On clusters where NVIDIA's DRA driver (gpu.nvidia.com) publishes the GPUs (Kubernetes 1.37 "
    "or later): one DeviceClass per MIG profile the approved layouts create, selecting the "
    "driver's devices of that profile and naming the extended resource NVIDIA's device plugin "
    "advertises for it (nvidia.com/mig-<profile>), so that pods asking for it run unchanged on "
    "DRA nodes. Classes labelled app.kubernetes.io/managed-by=mig-agent are mig-agent's: those "
    "no layout needs any more are deleted. Another class is never touched, and a resource it "
    "serves already is not published (only one class may serve a name). Without --apply, says "
    "what it would change. Exit 0 when every wanted class is published (or would be), 1 when "
    "one is refused or a request failed, 2 for a config error."
)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "dra-classes",
        help="publish a DeviceClass per MIG profile, serving nvidia.com/mig-<profile> on DRA nodes",
        description=DESCRIPTION,
    )
    p.add_argument("--apply", action="store_true", help="make the changes (default: say them)")
    p.add_argument(
        "--remove",
        action="store_true",
        help="want none: every class of mig-agent's goes (with --apply)",
    )
    p.add_argument("-o", "--output", choices=["text", "json"], default="text")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG)")
    add_config_args(p, layout=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mig_agent.kube.client import KubernetesCluster

    catalog = None if args.remove else load_configs(args)  # a bad config: before connecting
    cluster = KubernetesCluster.connect(args.kubeconfig or "", component="mig-agent-dra-classes")
    as_json = args.output == "json"
    try:
        got = sync(cluster, catalog, apply=args.apply, out=(lambda _l: None) if as_json else _write)
    finally:
        cluster.close()
    if as_json:
        _write(json.dumps(changes_json(got, applied=args.apply), indent=2))
    return EXIT_FAILED if got.refused else EXIT_OK


def _write(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
