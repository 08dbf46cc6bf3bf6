"""The operator's checks on a machine's real GPU (scripts/real-gpu-node): the local cluster with a
real node whose kubelet runs on containerd and runc over the machine's own NVIDIA driver, NVIDIA's
device plugin over the real NVML, a CDI spec from `nvidia-ctk cdi generate`, the RuntimeClass
`nvidia`; then mig-agent on the host against that kubelet with the layout the GPUs already hold
(its plan must be empty: nothing is changed), `mig-agent verify` of the node, with
``--chart`` the chart's agent in a pod (observe mode) over the layout they hold, and the
agent in observe mode with a layout that would change the GPUs. MIG mode and instances must read
the same before and after, else it fails. Prints a transcript: each command, then its output.

``python -m migsim.cluster.real_gpu [--driver-root DIR | --gpus SPEC] [--held LAYOUT]
[--other LAYOUT] [--no-observe] [--chart MANIFEST] [--dra]``

With ``--dra`` the node is a DRA node instead (real_gpu_dra.py): NVIDIA's DRA kubelet plugin
publishes the GPUs, mig-agent reaches `success` by its ResourceSlice, and a pod's ResourceClaim
is prepared by the kubelet and runs `nvidia-smi -L` on the claimed GPU.

Never changes a GPU: no apply runs unless its plan is empty, and the agent is started only after
that check. Needs root, the Kubernetes and NVIDIA binaries and the real node's tools
(real_node.missing_tools).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from . import images, real_gpu_dra, real_node, seed_checks
from .agents import PLUGIN_NS
from .cluster import Cluster
from .errors import DevClusterError
from .real_gpu_steps import (
    CONFIG,
    STATE,
    allocatable,
    gpu_state,
    held_layout_applies,
    host_agent,
    host_smi,
    mig_agent,
    node_label,
    node_object,
    say,
    set_label,
    wait_for,
)

OBSERVED = "mig-agent.dev/observed-plan"


def observed_report(cluster: Cluster) -> dict[str, object]:
    """The observe-mode agent's report on the node ({} when there is none)."""
    meta = node_object(cluster).get("metadata") or {}
    assert isinstance(meta, dict)
    text = str((meta.get("annotations") or {}).get(OBSERVED) or "{}")
    found = json.loads(text)
    assert isinstance(found, dict)
    return found


def chart_observes(cluster: Cluster, node: real_node.RealNode, held: str, manifest: Path) -> None:
    """The chart's agent in a pod of its DaemonSet, under the RuntimeClass `nvidia` (the NVIDIA
    runtime brings the driver's NVML into the image built here): Ready once its NVML answered
    (the kubelet's readiness probe), then its observe pass over the GPUs for the layout they
    hold: no change found. ``manifest``: the chart rendered in observe mode
    (seed_checks.render_chart), in which the pod can change neither the GPUs nor the node."""
    say(f"$ kubectl apply -f {manifest.name}  # the chart, observe=true, image {images.AGENT}")
    real_node.import_image(node, images.agent())
    cluster.kubectl("label", "node", real_node.NAME, "--overwrite", "nvidia.com/gpu.present=true")
    cluster.kubectl("create", "namespace", "mig-agent")
    cluster.kubectl("apply", "-f", str(manifest))
    try:
        pod = seed_checks.wait_agent_ready(cluster, 180)
        (status,) = pod["status"]["containerStatuses"]
        say(
            f"pod {pod['metadata']['name']}: Ready on {pod['spec']['nodeName']}, "
            f"runtimeClassName {pod['spec'].get('runtimeClassName')}, image {status['image']}"
        )
        wait_for(
            f"the pod's {OBSERVED} for {held}",
            lambda: observed_report(cluster).get("layout") == held,
            120,
        )
        report = observed_report(cluster)
        say(f"{OBSERVED}: {json.dumps(report)}")
        name = str(pod["metadata"]["name"])
        log = cluster.kubectl("logs", "-n", "mig-agent", name, "--tail=200", check=False)
        said = [line for line in log.splitlines() if "agent.started" in line or "observe" in line]
        say("\n".join(said[:6]) + "\n")
        if report.get("changes") is not False or report.get("error"):
            raise DevClusterError(f"the chart's agent did not find {held} in place: {report}")
    finally:
        cluster.kubectl("delete", "-f", str(manifest), "--wait=true", check=False)


def observe_reports(cluster: Cluster, node: real_node.RealNode, logs: Path, other: str) -> None:
    """The agent in observe mode with a layout that would change the GPUs: what it would do,
    published, and nothing done (the state label stays the last agent's)."""
    state = node_label(cluster, STATE)
    with host_agent(cluster, node, logs, "--observe"):
        set_label(cluster, CONFIG, other)
        wait_for(
            f"the annotation {OBSERVED}",
            lambda: observed_report(cluster).get("layout") == other,
            120,
        )
    say(f"{OBSERVED}: {json.dumps(observed_report(cluster))}")
    after = node_label(cluster, STATE)
    say(f"state label: {after!r} (before: {state!r})\n")
    if after != state:
        raise DevClusterError("the observing agent changed the state label")


def checks(cluster: Cluster, logs: Path, args: argparse.Namespace) -> bool:
    """The checks on a real node over the GPUs; whether the GPUs read the same after."""
    node = real_node.start(
        cluster, real_node.NAME, gpus=args.gpus, driver_root="" if args.gpus else args.driver_root
    )
    try:
        before = gpu_state(node)
        host_smi(node)
        real_node.install_device_plugin(cluster, node)
        wait_for("nvidia.com/gpu in allocatable", lambda: bool(allocatable(cluster)), 180)
        say(f"allocatable of {real_node.NAME}: {json.dumps(allocatable(cluster))}\n")
        held_layout_applies(cluster, node, logs, args.held)
        mig_agent(
            "verify",
            real_node.NAME,
            "--image",
            images.GPU_WORKLOAD if node.driver_root else images.BUSYBOX,
            "--runtime-class",
            "nvidia",
            kubeconfig=cluster.kubeconfig,
        )
        if args.chart:
            chart_observes(cluster, node, args.held, args.chart)
        if not args.no_observe:
            observe_reports(cluster, node, logs, args.other)
        return gpu_state(node) == before
    finally:
        with contextlib.suppress(Exception):
            cluster.kubectl("delete", "daemonset", "-n", PLUGIN_NS, "--all")
        real_node.stop_node(node)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m migsim.cluster.real_gpu", description=__doc__)
    p.add_argument("--driver-root", default="/usr/local/nvidia", help="the real driver's root")
    p.add_argument(
        "--gpus", default="", help="simulated GPUs instead (`1xH200`): the script's CI run"
    )
    p.add_argument("--held", default="all-disabled", help="the layout the GPUs hold")
    p.add_argument("--other", default="all-1g.18gb", help="observe mode's layout (a change)")
    p.add_argument("--no-observe", action="store_true", help="leave out the agent's observe mode")
    p.add_argument(
        "--chart",
        type=Path,
        default=None,
        metavar="MANIFEST",
        help="also run the chart's agent in a pod: the chart rendered with observe=true "
        "(migsim.cluster.seed_checks.render_chart: helm template)",
    )
    p.add_argument(
        "--dir", type=Path, default=None, help="the cluster's folder (default: a new one)"
    )
    p.add_argument(
        "--dra",
        action="store_true",
        help="the node as a DRA node instead: NVIDIA's DRA kubelet plugin, a pod's "
        "ResourceClaim prepared by the kubelet (migsim.cluster.real_gpu_dra)",
    )
    args = p.parse_args(argv)
    directory = args.dir or Path(tempfile.mkdtemp(prefix="real-gpu-"))
    cluster = Cluster.up(directory, gpu_nodes=0, log=say)
    try:
        if args.dra:
            driver_root = "" if args.gpus else args.driver_root
            logs = directory / "logs"
            unchanged = real_gpu_dra.checks(cluster, logs, args.held, args.gpus, driver_root)
        else:
            unchanged = checks(cluster, directory / "logs", args)
    finally:
        cluster.down()
    if not unchanged:
        say("CHANGED: the GPUs read differently after")
        return 1
    say("unchanged: MIG mode and instances read the same before and after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
