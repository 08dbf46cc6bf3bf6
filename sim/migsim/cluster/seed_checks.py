"""The checks an operator makes on a GPU node, made on the real node: ``nvidia-smi`` on the host,
the GPU resources in the node's allocatable, and a tiny pod under the RuntimeClass ``nvidia``
asking for one GPU (or one MIG device) whose log shows the device it was given.

``python -m migsim.cluster.seed_checks --dir DIR`` (scripts/demo --real-node) installs mig-agent
with its Helm chart on the local cluster's real node, makes the checks, has the agent apply a MIG
layout, and makes them again with a MIG device."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from . import images, real_node, scripts
from .cluster import Cluster
from .errors import DevClusterError
from .waiting import wait_until

CHART: Final = scripts.REPO / "charts" / "mig-agent"
CONFIG: Final = "nvidia.com/mig.config"
STATE: Final = "nvidia.com/mig.config.state"
NAMESPACE: Final = "default"


def host_nvidia_smi(node: real_node.RealNode, *args: str) -> str:
    """The simulated ``nvidia-smi`` on the host, over the node's GPUs (as the driver's reads the
    driver there)."""
    folder = real_node.sim_nvml()
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(folder),
        "MIG_AGENT_SIM_NVML_SOCKET": str(node.nvml_socket),
    }
    done = subprocess.run(
        [str(folder / "nvidia-smi"), *args], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        raise DevClusterError(f"nvidia-smi {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def gpu_resources(cluster: Cluster, name: str = real_node.NAME) -> dict[str, str]:
    """The node's allocatable GPU resources (those not 0)."""
    node = cluster.api.get(f"/api/v1/nodes/{name}")
    allocatable = node.get("status", {}).get("allocatable") or {}
    return {k: v for k, v in allocatable.items() if k.startswith("nvidia.com/") and v != "0"}


def wait_gpu_resources(cluster: Cluster, timeout: float = 120) -> dict[str, str]:
    """The node's GPU resources once NVIDIA's plugin has registered some with the kubelet."""
    return wait_until(
        lambda: gpu_resources(cluster),
        timeout=timeout,
        what=f"a GPU resource on {real_node.NAME}",
        interval=0.5,
    )


def gpu_pod(name: str, resource: str, *command: str) -> dict[str, Any]:
    """A pod on the real node under the RuntimeClass `nvidia`, asking one `resource`, running
    `command` (default ``nvidia-smi -L``) in the workload image built here."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "runtimeClassName": "nvidia",
            "restartPolicy": "Never",
            "nodeSelector": {real_node.REAL_NODE_LABEL: "true"},
            "containers": [
                {
                    "name": "main",
                    "image": images.BUSYBOX,
                    "imagePullPolicy": "Never",
                    "command": list(command or ("nvidia-smi", "-L")),
                    "resources": {"limits": {resource: 1}},
                }
            ],
        },
    }


def run_pod(
    cluster: Cluster, pod: dict[str, Any], namespace: str = NAMESPACE, timeout: float = 120
) -> str:
    """Run `pod` to its end and return its log; raises DevClusterError if it did not succeed."""
    name = pod["metadata"]["name"]
    path = f"/api/v1/namespaces/{namespace}/pods"
    cluster.api.request("POST", path, pod)

    def ended() -> dict[str, Any]:  # the pod's status once it ended, {} before
        status: dict[str, Any] = cluster.api.get(f"{path}/{name}").get("status", {})
        return status if status.get("phase") in ("Succeeded", "Failed") else {}

    try:
        status = wait_until(ended, timeout=timeout, what=f"pod {name} to end", interval=0.3)
        log = cluster.kubectl("logs", "-n", namespace, name, check=False)
        if status["phase"] != "Succeeded":
            raise DevClusterError(f"pod {name} {status['phase']}: {status} {log}")
        return log
    finally:
        cluster.api.request("DELETE", f"{path}/{name}", {"gracePeriodSeconds": 0})


def install_chart(cluster: Cluster, helm: str, *values: str) -> None:
    """mig-agent installed with its Helm chart, from the image built here (imported into the real
    node's containerd); `values` are more `--set` pairs."""
    node = real_node.load(cluster, real_node.NAME)
    if node is None:
        raise DevClusterError("no real node runs: local-cluster up --real-node GPUS")
    real_node.import_image(node, images.agent())
    cluster.kubectl("label", "node", real_node.NAME, "--overwrite", "nvidia.com/gpu.present=true")
    repository, tag = images.AGENT.rsplit(":", 1)
    sets = [
        f"image.repository={repository}",
        f"image.tag={tag}",
        "image.pullPolicy=Never",
        *values,
    ]
    argv = [helm, "--kubeconfig", str(cluster.kubeconfig), "install", "mig-agent", str(CHART)]
    argv += ["-n", "mig-agent", "--create-namespace"]
    argv += [arg for pair in sets for arg in ("--set", pair)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise DevClusterError(f"helm install: {done.stderr.strip()}")


def render_chart(helm: str, *values: str) -> str:
    """The chart rendered (``helm template``) with the image built here and ``values`` (more
    ``--set`` pairs): the manifest a machine without helm applies (scripts/real-gpu-node)."""
    repository, tag = images.AGENT.rsplit(":", 1)
    sets = [f"image.repository={repository}", f"image.tag={tag}", "image.pullPolicy=Never"]
    argv = [helm, "template", "mig-agent", str(CHART), "-n", "mig-agent"]
    argv += [arg for pair in (*sets, *values) for arg in ("--set", pair)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise DevClusterError(f"helm template: {done.stderr.strip()}")
    return done.stdout


def wait_agent_ready(cluster: Cluster, timeout: float = 180) -> dict[str, Any]:
    """The chart's agent pod on the real node, once the kubelet's readiness probe passed."""
    selector = "labelSelector=app.kubernetes.io/name%3Dmig-agent"

    def ready() -> dict[str, Any]:  # a Ready pod, {} while there is none
        pods = cluster.api.get(f"/api/v1/namespaces/mig-agent/pods?{selector}")["items"]
        for pod in pods:
            conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
            if conditions.get("Ready") == "True" and not pod["metadata"].get("deletionTimestamp"):
                return dict(pod)
        return {}

    return wait_until(ready, timeout=timeout, what="mig-agent's pod to be Ready", interval=0.5)


def apply_layout(cluster: Cluster, layout: str, timeout: float = 300) -> str:
    """Label the real node with `layout` and return the state the agent ends it in."""
    cluster.kubectl("label", "node", real_node.NAME, "--overwrite", f"{CONFIG}={layout}")

    def ended() -> str:
        labels = cluster.api.get(f"/api/v1/nodes/{real_node.NAME}")["metadata"]["labels"]
        done = labels.get(CONFIG) == layout and labels.get(STATE) in ("success", "failed")
        return str(labels[STATE]) if done else ""

    return wait_until(ended, timeout=timeout, what=f"{layout} to be applied", interval=0.3)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m migsim.cluster.seed_checks", description=__doc__)
    p.add_argument("--dir", type=Path, required=True, help="the local cluster's folder")
    p.add_argument("--helm", required=True, help="the helm binary (scripts/helm-binary build)")
    p.add_argument("--layout", default="all-1g.10gb", help="the MIG layout (%(default)s)")
    args = p.parse_args(argv)
    try:
        cluster = Cluster.load(args.dir)
        node = real_node.load(cluster, real_node.NAME)
        if node is None:
            raise DevClusterError("no real node runs: local-cluster up --real-node GPUS")

        def say(title: str, text: str) -> None:
            print(f"\n== {title}\n{text.rstrip()}", flush=True)

        say("nvidia-smi on the host", host_nvidia_smi(node))
        say("the node's GPU resources", json.dumps(wait_gpu_resources(cluster)))
        say(
            "a pod asking nvidia.com/gpu: 1 (runtimeClassName: nvidia), its log",
            run_pod(cluster, gpu_pod("gpu-check", "nvidia.com/gpu")),
        )
        install_chart(cluster, args.helm)
        pod = wait_agent_ready(cluster)
        say(
            "mig-agent, installed with the chart, Ready on the real node",
            f"{pod['metadata']['name']} on {pod['spec']['nodeName']}, image "
            f"{pod['spec']['containers'][0]['image']}",
        )
        started = time.monotonic()
        state = apply_layout(cluster, args.layout)
        say(
            f"{CONFIG}={args.layout}",
            f"{STATE}={state} in {time.monotonic() - started:.1f} s; resources now "
            + json.dumps(gpu_resources(cluster)),
        )
        if state != "success":
            return 1
        say("nvidia-smi -L on the host", host_nvidia_smi(node, "-L"))
        resource = f"nvidia.com/mig-{args.layout.removeprefix('all-')}"
        say(
            f"a pod asking {resource}: 1, its log",
            run_pod(cluster, gpu_pod("mig-check", resource)),
        )
    except DevClusterError as e:
        print(f"seed checks: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
