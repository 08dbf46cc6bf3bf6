"""Fixtures for the tests on the real node: a kubelet built from the cluster's Kubernetes release,
Debian's containerd and runc, images built here (migsim.cluster.real_node). Root only: containerd
and the kubelet run as root; as root, `scripts/test` installs what they need."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from kubernetes import client
from migsim.cluster import Cluster, agents, images, real_node, seed_checks
from migsim.cluster.errors import WaitTimeout

from tests.node_watch import core_for, node_versions

REAL_NODE = real_node.NAME
REAL_GPUS = "2xH100-80GB"
PLUGIN_DAEMONSET = "nvidia-device-plugin-real-node"


@pytest.fixture(scope="module")
def kubelet_node(cluster: Cluster) -> Iterator[real_node.RealNode]:
    """A real node of the session's cluster with simulated GPUs and NVIDIA's device plugin as
    its DaemonSet's pod, Ready; stopped and deleted after the module."""
    with real_node_running(cluster) as node:
        yield node


@contextlib.contextmanager
def real_node_running(cluster: Cluster) -> Iterator[real_node.RealNode]:
    """The real node (kubelet_node's), stopped and deleted, with its GPUs, when the block ends."""
    if os.geteuid() != 0:
        pytest.skip("the real node runs containerd and a kubelet: run as root")
    missing = real_node.missing_tools()
    if missing:  # scripts/test installs them as root: their absence is a failure, not a skip
        pytest.fail(f"the real node needs: {', '.join(missing)}", pytrace=False)
    node = real_node.start(cluster, REAL_NODE, gpus=REAL_GPUS)
    try:
        real_node.install_device_plugin(cluster, node)
        yield node
    finally:
        with contextlib.suppress(Exception):
            cluster.kubectl("delete", "daemonset", "-n", agents.PLUGIN_NS, PLUGIN_DAEMONSET)
        real_node.stop_node(node)
        cluster.delete_node(REAL_NODE)


def node_pod(
    name: str, container: dict[str, Any], *, grace_s: int = 30, **spec: Any
) -> dict[str, Any]:
    """A pod on the real node (in its pod network) of one container from an image built here
    (imagePullPolicy Never)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": REAL_NODE,
            "terminationGracePeriodSeconds": grace_s,
            "restartPolicy": "Never",
            "containers": [{"name": "main", "imagePullPolicy": "Never", **container}],
            **spec,
        },
    }


def busybox_pod(name: str, script: str, *, grace_s: int = 30, **spec: Any) -> dict[str, Any]:
    """A pod on the real node running `script` in the busybox image built here."""
    container = {"image": images.BUSYBOX, "command": ["/bin/sh", "-c", script]}
    return node_pod(name, container, grace_s=grace_s, **spec)


def wait_phase(
    core: client.CoreV1Api, namespace: str, name: str, *phases: str, timeout: float = 60
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        pod = core.read_namespaced_pod(name, namespace)
        if pod.status.phase in phases:
            return pod
        assert time.monotonic() < deadline, f"{name}: {pod.status}"
        time.sleep(0.2)


def gone(core: client.CoreV1Api, namespace: str, name: str) -> bool:
    with contextlib.suppress(client.ApiException):
        core.read_namespaced_pod(name, namespace)
        return False
    return True


def gpu_resources(core: client.CoreV1Api) -> dict[str, str]:
    allocatable = core.read_node(REAL_NODE).status.allocatable or {}
    return {k: v for k, v in allocatable.items() if k.startswith("nvidia.com/") and v != "0"}


def wait_resources(core: client.CoreV1Api, want: dict[str, str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while gpu_resources(core) != want:
        assert time.monotonic() < deadline, f"allocatable {gpu_resources(core)}, want {want}"
        time.sleep(0.5)


def plugin_pods(core: client.CoreV1Api) -> list[Any]:
    pods = core.list_namespaced_pod(
        agents.PLUGIN_NS, field_selector=f"spec.nodeName={REAL_NODE}"
    ).items
    return [p for p in pods if p.metadata.deletion_timestamp is None]


def pod_log(core: client.CoreV1Api, namespace: str, name: str) -> str:
    """The container's log, read by the API server from the real kubelet."""
    raw = core.read_namespaced_pod_log(name, namespace, _preload_content=False)
    return str(raw.data.decode())


# -- a cluster whose one node is the real node, and the chart on it ----------------------------

REPO = Path(__file__).resolve().parents[2]
CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"


class NodeCluster(NamedTuple):
    cluster: Cluster
    helm: str  # the helm binary
    node: real_node.RealNode


@pytest.fixture(scope="module")
def node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    """A cluster whose one node is the real node, with NVIDIA's plugin and the agent's image;
    and helm."""
    if os.geteuid() != 0:
        pytest.skip("the real node runs containerd and a kubelet: run as root")
    helm = subprocess.run(
        [str(REPO / "scripts" / "helm-binary"), "build"],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout.strip()
    c = Cluster.up(tmp_path_factory.mktemp("chart-cluster"), gpu_nodes=0)
    node = None
    try:
        node = real_node.start(c, real_node.NAME, gpus="2xH100-80GB")
        real_node.install_device_plugin(c, node)
        yield NodeCluster(c, helm, node)
    finally:
        if node is not None:  # as recorded last: a test may have restarted its kubelet
            real_node.stop_node(real_node.load(c, real_node.NAME) or node)
        c.down()


def kube(c: Cluster, *args: str) -> Any:
    return json.loads(c.kubectl(*args, "-o", "json"))


def agent_pods(c: Cluster) -> list[Any]:
    pods = kube(c, "get", "pods", "-n", "mig-agent", "-l", "app.kubernetes.io/name=mig-agent")
    return [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]


def wait_ready_agent(c: Cluster, timeout: float = 120) -> Any:
    """The chart's agent pod once Ready (the pods described if none is in time)."""
    try:
        return seed_checks.wait_agent_ready(c, timeout)
    except WaitTimeout as e:
        raise AssertionError(f"{e}\n{c.kubectl('describe', 'pods', '-n', 'mig-agent')}") from e


def wait_state(c: Cluster, timeout: float = 120) -> tuple[str, list[str]]:
    n, seen = wait_settled(c, timeout)
    return n["metadata"]["labels"][STATE], seen


def wait_settled(c: Cluster, timeout: float = 120) -> tuple[Any, list[str]]:
    """The node (as JSON) as it was when its state first said `success` or `failed`, and every
    state it passed through on the way (a watch on the node: none is missed, however short),
    so that what a test asserts of it is what that state came with (a retry may start the next
    pass a moment later)."""
    seen: list[str] = []
    with core_for(c.kubeconfig) as core:
        for version in node_versions(core, real_node.NAME, timeout):
            n = core.api_client.sanitize_for_serialization(version)
            state = n["metadata"].get("labels", {}).get(STATE, "")
            if not seen or seen[-1] != state:
                seen.append(state)
            if state in ("success", "failed"):
                return n, seen
    raise AssertionError((seen, agent_log(c)))


def agent_log(c: Cluster) -> str:
    return c.kubectl(
        "logs",
        "-n",
        "mig-agent",
        "-l",
        "app.kubernetes.io/name=mig-agent",
        "--tail=40",
        check=False,
    )


def helm_install(c: Cluster, helm: str, *values: str) -> None:
    """The chart installed with the image built here; `values` are more `--set` pairs."""
    # the tests' workloads are bare pods
    seed_checks.install_chart(c, helm, "drain.evictUnmanagedPods=true", *values)
