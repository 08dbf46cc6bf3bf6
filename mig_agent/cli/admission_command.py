"""``mig-agent admission-check``: the MIG layout AdmissionCheck controller for Kueue
(mig_agent.ops.admission_check), a round every ``--interval`` seconds, or one (``--once``)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import structlog

from mig_agent.cli.common import EXIT_OK, add_config_args, load_configs
from mig_agent.cli.verify_options import add_pod_options, verifier
from mig_agent.config.settings import Settings
from mig_agent.core.errors import ConfigError, KubeError, LeadershipLost
from mig_agent.ops.admission_check import CONTROLLER_NAME, Round, run_round
from mig_agent.ops.leadership import LeaseKeeper, leading

log = structlog.get_logger(__name__)

DESCRIPTION = (
    "Serve Kueue's AdmissionChecks whose controllerName is --controller-name: mark them "
    "Active; for each Workload that reserved quota and waits on one, mark it Ready once its "
    "pods fit the free MIG devices, else relabel the nodes (approved layouts only, the "
    "least-disruptive relabels serving it whole, no eviction unless the check's annotation "
    "mig-agent.dev/allow-evict says so) and wait for their success (and verify's checks of "
    "them, where the check's annotation mig-agent.dev/verify says so); say why in the check's "
    "message when no approved layout serves it."
)


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value}")
    return value


def register(sub: Any) -> None:
    p = sub.add_parser(
        "admission-check",
        help="Kueue's MIG layout AdmissionCheck controller",
        description=DESCRIPTION,
    )
    p.add_argument("--controller-name", default=CONTROLLER_NAME, metavar="NAME")
    p.add_argument("-l", "--selector", default="", help="label selector of the GPU nodes")
    p.add_argument("--interval", type=_positive, default=10.0, metavar="SECONDS")
    p.add_argument("--once", action="store_true", help="one round, then exit")
    p.add_argument(
        "--lease",
        default="",
        metavar="NAMESPACE/NAME",
        help="leader election: rounds only while holding this Lease (several replicas)",
    )
    p.add_argument(
        "--lease-duration",
        type=int,
        default=30,
        metavar="SECONDS",
        help="how long the Lease holds without a renewal (default 30; above --interval)",
    )
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG)")
    add_config_args(p, layout=False)
    add_pod_options(p)  # verify's pods, for checks annotated mig-agent.dev/verify: "true"
    p.set_defaults(func=cmd_admission_check)


def _print_round(r: Round) -> None:
    for name in r.activated:
        sys.stdout.write(f"check {name}: marked Active\n")
    for d in r.decisions:
        skipped = r.skipped.get(d.workload)
        tail = f" (not written: {skipped})" if skipped else ""
        sys.stdout.write(f"{d.workload}: {d.verdict.value}: {d.message}{tail}\n")
    sys.stdout.flush()


def _lease(text: str) -> tuple[str, str] | None:
    if not text:
        return None
    namespace, _, name = text.partition("/")
    if not namespace or not name:
        raise ConfigError(f"--lease must be NAMESPACE/NAME, got {text!r}")
    return namespace, name


def cmd_admission_check(
    args: argparse.Namespace, sleep: Callable[[float], None] = time.sleep
) -> int:
    from mig_agent.kube.client import KubernetesCluster

    lease = _lease(args.lease)
    catalog = load_configs(args)
    settings = Settings.from_env()
    cluster = KubernetesCluster.connect(args.kubeconfig or "", component="mig-agent-admission")
    keeper = _keeper(args, lease)
    if keeper is not None:  # every write of a round (verify's pods too) confirms the lease
        cluster = leading(cluster, keeper.confirm)
    verify = verifier(cluster, args, settings, lambda line: print(line, flush=True))
    try:
        while True:
            try:
                if keeper is not None and not keeper.holds() and not keeper.attempt():
                    log.info("admission_check.not_leader", lease=args.lease)
                    sys.stdout.write(f"not the leader: {args.lease} is held by another\n")
                    sys.stdout.flush()
                    if args.once:
                        return EXIT_OK
                    sleep(args.interval)
                    continue
                _print_round(
                    run_round(
                        cluster,
                        catalog,
                        settings,
                        controller_name=args.controller_name,
                        selector=args.selector,
                        verify=verify,
                    )
                )
            except LeadershipLost as exc:
                log.warning("admission_check.leadership_lost", error=str(exc))
                sys.stdout.write(f"stopped the round: {exc}\n")
                sys.stdout.flush()
            except KubeError as exc:  # a read the round needs: the next round reads again
                if args.once:
                    raise
                log.warning("admission_check.round_failed", error=str(exc))
            if args.once:
                return EXIT_OK
            sleep(args.interval)
    finally:
        if keeper is not None:
            keeper.stop()
        cluster.close()


def _keeper(args: argparse.Namespace, lease: tuple[str, str] | None) -> LeaseKeeper | None:
    """The Lease's keeper, renewing on its own thread over a connection of its own (none
    without ``--lease``; with ``--once``, one take and no thread)."""
    from mig_agent.kube.client import KubernetesCluster

    if lease is None:
        return None
    me = os.environ.get("POD_NAME") or socket.gethostname()
    own = KubernetesCluster.connect(args.kubeconfig or "", component="mig-agent-admission-lease")
    keeper = LeaseKeeper(
        lambda: own.hold_lease(*lease, me, args.lease_duration), args.lease_duration
    )
    keeper.attempt()
    if not args.once:
        keeper.start()
    return keeper
