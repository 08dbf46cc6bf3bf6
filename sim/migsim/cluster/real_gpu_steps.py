"""The steps scripts/real-gpu-node's checks share (real_gpu.py, real_gpu_dra.py): mig-agent's
command lines and its host agent, the node's labels, the GPUs as NVML reads them, waiting."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from . import real_node, seed_checks
from .cluster import Cluster
from .errors import DevClusterError
from .processes import Proc, spawn, stop

CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"


def say(text: str) -> None:
    print(text, flush=True)


def mig_agent(
    *args: str, backend: Sequence[str] = (), kubeconfig: Path | None = None, check: bool = True
) -> str:
    """`mig-agent ARGS` (with `backend`'s options: the GPUs it reads), its command line and
    output in the transcript."""
    say(f"$ mig-agent {' '.join(args)}")
    env = {**os.environ, **({"KUBECONFIG": str(kubeconfig)} if kubeconfig else {})}
    done = subprocess.run(
        [sys.executable, "-m", "mig_agent", *args, *backend],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    say((done.stdout + done.stderr).rstrip() + "\n")
    if check and done.returncode != 0:
        raise DevClusterError(f"mig-agent {args[0]} exited {done.returncode}")
    return done.stdout


def backend_of(node: real_node.RealNode) -> list[str]:
    """mig-agent's options for the node's GPUs: the real NVML, or the simulated GPUs' state."""
    if node.driver_root:
        return ["--backend", "nvml"]
    return ["--backend", "simulated", "--sim-state", str(node.sim_state)]


def gpu_state(node: real_node.RealNode) -> str:
    """The GPUs as NVML reports them (MIG mode, instances), to compare before and after."""
    done = subprocess.run(
        [sys.executable, "-m", "mig_agent", "export", "-o", "json", *backend_of(node)],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def wait_for(what: str, probe: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise DevClusterError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def node_object(cluster: Cluster) -> dict[str, object]:
    node = cluster.api.get(f"/api/v1/nodes/{real_node.NAME}")
    assert isinstance(node, dict)
    return node


def allocatable(cluster: Cluster) -> dict[str, str]:
    status = node_object(cluster).get("status") or {}
    assert isinstance(status, dict)
    return {k: v for k, v in (status.get("allocatable") or {}).items() if k.startswith("nvidia")}


def node_label(cluster: Cluster, key: str) -> str:
    meta = node_object(cluster).get("metadata") or {}
    assert isinstance(meta, dict)
    return str((meta.get("labels") or {}).get(key, ""))


def set_label(cluster: Cluster, key: str, value: str) -> None:
    say(f"$ kubectl label node {real_node.NAME} {key}={value} --overwrite")
    cluster.api.request(
        "PATCH",
        f"/api/v1/nodes/{real_node.NAME}",
        {"metadata": {"labels": {key: value}}},
        content_type="application/merge-patch+json",
    )


@contextlib.contextmanager
def host_agent(
    cluster: Cluster, node: real_node.RealNode, logs: Path, *extra: str
) -> Iterator[Proc]:
    """`mig-agent run` on the host for the real node, over its GPUs; stopped on leaving."""
    argv = [sys.executable, "-m", "mig_agent", "run", "--node", real_node.NAME]
    argv += [*backend_of(node), "--kubeconfig", str(cluster.kubeconfig), *extra]
    agent = spawn(f"mig-agent{'-'.join(extra)}", argv, logs / f"mig-agent{'-'.join(extra)}.log")
    try:
        yield agent
    finally:
        stop([agent])


def held_layout_applies(cluster: Cluster, node: real_node.RealNode, logs: Path, held: str) -> None:
    """The agent, with the layout the GPUs hold: `success` without a change."""
    # exits non-zero unless nothing would change: no agent is started then
    mig_agent("plan", "-c", held, "--exit-code", backend=backend_of(node))
    with host_agent(cluster, node, logs):
        set_label(cluster, CONFIG, held)
        wait_for("state success", lambda: node_label(cluster, STATE) == "success", 180)
    say(f"state: {node_label(cluster, STATE)}\n")


def host_smi(node: real_node.RealNode) -> None:
    """nvidia-smi on the host: the driver's (MIG mode by query), or the simulated one's list."""
    if not node.driver_root:
        say(f"$ nvidia-smi -L\n{seed_checks.host_nvidia_smi(node, '-L').rstrip()}\n")
        return
    query = ["--query-gpu=name,uuid,mig.mode.current,mig.mode.pending", "--format=csv"]
    say(f"$ nvidia-smi {' '.join(query)}")
    smi = Path(node.driver_root) / "bin" / "nvidia-smi"
    done = subprocess.run([str(smi), *query], capture_output=True, text=True, check=False)
    say((done.stdout + done.stderr).rstrip() + "\n")
