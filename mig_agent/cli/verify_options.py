"""The options of ``verify``'s pods, shared by ``verify``, ``repartition --verify`` and
``advise --apply --verify`` (mig-agent's and kubectl mig's)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from mig_agent.config.settings import Settings
from mig_agent.core.errors import ConfigError
from mig_agent.ops import Writer
from mig_agent.ops.verify import NodeVerdict, VerifyCluster, verify_node
from mig_agent.ops.verify_pods import DEFAULT_IMAGE, DEFAULT_RUNTIME_CLASS, PodSpec


def pod_spec(args: argparse.Namespace) -> PodSpec:
    if args.pod_timeout_s <= 0:
        raise ConfigError(f"--pod-timeout must be positive, got {args.pod_timeout_s}")
    return PodSpec(args.image, args.runtime_class, args.pod_namespace, args.pod_timeout_s)


def verifier(
    cluster: VerifyCluster, args: argparse.Namespace, settings: Settings, out: Writer
) -> Callable[[str], NodeVerdict]:
    """``verify``'s checks of one node with the command's options, for ``--verify``."""
    spec = pod_spec(args)
    return lambda node: verify_node(cluster, node, pods=spec, settings=settings, out=out)


def add_pod_options(p: argparse.ArgumentParser) -> None:
    """The options of ``verify``'s pods (also ``repartition --verify``'s)."""
    p.add_argument(
        "--image",
        default=DEFAULT_IMAGE,
        help="the pods' image; NVIDIA's runtime injects nvidia-smi into it (default %(default)s)",
    )
    p.add_argument(
        "--runtime-class",
        default=DEFAULT_RUNTIME_CLASS,
        help="the pods' RuntimeClass, '' for the cluster's default runtime (default %(default)s)",
    )
    p.add_argument(
        "--pod-namespace", default="default", help="where the pods run (default %(default)s)"
    )
    p.add_argument(
        "--pod-timeout",
        dest="pod_timeout_s",
        type=float,
        default=180.0,
        metavar="SECONDS",
        help="how long a node's pods may take to end (default %(default)s)",
    )
