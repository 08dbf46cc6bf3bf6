"""We test that the real node is one: a kubelet registered with containerd as its runtime, real
containers whose output the API server reads from the kubelet, and a deletion that waits for the
container's own SIGTERM handler, where kwok deletes every pod after a fixed delay; a pod network
(a network namespace and an address of a pod's own), gone with the node."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from migsim.cluster import Cluster, real_node

from .conftest import (
    REAL_NODE,
    busybox_pod,
    gone,
    plugin_pods,
    pod_log,
    real_node_running,
    wait_phase,
    wait_resources,
)


def _pinned_release() -> str:
    """The Kubernetes release scripts/k8s-binaries pins (the one place it is named)."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "k8s-binaries"
    for line in script.read_text().splitlines():
        if line.startswith("K8S_VERSION="):
            return line.split("=", 1)[1].split()[0]
    raise AssertionError(f"no K8S_VERSION in {script}")


def test_the_node_runs_a_real_kubelet_on_containerd(
    kubelet_node: real_node.RealNode, core: client.CoreV1Api
) -> None:
    info = core.read_node(REAL_NODE).status.node_info
    assert info.container_runtime_version.startswith("containerd://1."), info
    assert info.kubelet_version == _pinned_release(), info
    assert "kwok.x-k8s.io/node" not in (core.read_node(REAL_NODE).metadata.annotations or {})


@pytest.fixture(scope="module")
def kubelet_node(cluster: Cluster, core: client.CoreV1Api) -> Iterator[real_node.RealNode]:
    """This module's real node, started where one whose plugin advertised MIG devices ran just
    before: the precondition of test_a_new_real_node_inherits_no_resource_of_an_earlier_one."""
    forwarding = real_node.IP_FORWARD.read_text()
    with real_node_running(cluster) as earlier:
        done = subprocess.run(
            [sys.executable, "-m", "mig_agent", "apply", "-c", "all-1g.10gb"]
            + ["--backend", "simulated", "--sim-state", str(earlier.sim_state)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        [plugin] = plugin_pods(core)  # its DaemonSet's next pod registers the MIG devices
        core.delete_namespaced_pod(plugin.metadata.name, plugin.metadata.namespace)
        wait_resources(core, {"nvidia.com/mig-1g.10gb": "14"})
        # the plugin's pod is in the pod network: the bridge is there while the node runs
        assert Path("/sys/class/net", real_node.BRIDGE).exists()
    # and gone with the node, as its pods' namespaces and the forwarding the bridge turned on
    assert not Path("/sys/class/net", real_node.BRIDGE).exists()
    assert real_node.IP_FORWARD.read_text() == forwarding
    nat = subprocess.run(["iptables", "-t", "nat", "-S"], capture_output=True, text=True)
    assert "CNI-" not in nat.stdout, nat.stdout
    with real_node_running(cluster) as node:
        yield node


def test_a_new_real_node_inherits_no_resource_of_an_earlier_one(
    kubelet_node: real_node.RealNode, core: client.CoreV1Api
) -> None:
    """The device manager's checkpoint sits at a fixed path: the earlier node (this module's
    fixture), which ended with MIG devices, must not leave its resources on this one (GPUs
    without MIG)."""
    deadline = time.monotonic() + 60
    while "nvidia.com/gpu" not in (core.read_node(REAL_NODE).status.allocatable or {}):
        assert time.monotonic() < deadline, core.read_node(REAL_NODE).status.allocatable
        time.sleep(0.5)
    allocatable = core.read_node(REAL_NODE).status.allocatable
    assert not [k for k in allocatable if k.startswith("nvidia.com/mig-")], allocatable


def test_a_container_runs_and_its_log_comes_from_the_kubelet(
    kubelet_node: real_node.RealNode, core: client.CoreV1Api, namespace: str
) -> None:
    core.create_namespaced_pod(
        namespace, busybox_pod("hello", "echo hello from $(cat /proc/1/comm)")
    )
    wait_phase(core, namespace, "hello", "Succeeded")
    assert pod_log(core, namespace, "hello").strip() == "hello from sh"


def test_a_pod_has_a_network_namespace_and_an_address_of_its_own(
    kubelet_node: real_node.RealNode, core: client.CoreV1Api, namespace: str
) -> None:
    # /proc/net/dev lists the interfaces of the container's network namespace
    core.create_namespaced_pod(namespace, busybox_pod("net", "cat /proc/net/dev"))
    pod = wait_phase(core, namespace, "net", "Succeeded")
    assert pod.spec.host_network is not True
    assert ipaddress.ip_address(pod.status.pod_ip) in ipaddress.ip_network(real_node.POD_SUBNET)
    assert pod.status.pod_ip != real_node.node_address()
    interfaces = {
        line.split(":")[0].strip() for line in pod_log(core, namespace, "net").splitlines()[2:]
    }
    assert interfaces == {"lo", "eth0"}, interfaces  # not the machine's (its bridge among them)


def test_a_deletion_waits_for_the_containers_sigterm_handler(
    kubelet_node: real_node.RealNode, core: client.CoreV1Api, namespace: str
) -> None:
    script = (
        "trap 'echo got TERM; sleep 6; echo done; exit 0' TERM; echo up; "
        "while true; do sleep 0.2; done"
    )
    core.create_namespaced_pod(namespace, busybox_pod("slow", script, grace_s=30))
    wait_phase(core, namespace, "slow", "Running")
    deadline = time.monotonic() + 30
    while "up" not in pod_log(core, namespace, "slow"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    started = time.monotonic()
    core.delete_namespaced_pod("slow", namespace)
    # the handler runs: TERM seen, its 6 s not over (the kubelet may take a moment to signal)
    while (last := pod_log(core, namespace, "slow").splitlines()[-1]) == "up":
        assert time.monotonic() - started < 10, "no SIGTERM reached the container"
        time.sleep(0.2)
    assert last == "got TERM", last
    while not gone(core, namespace, "slow"):
        assert time.monotonic() - started < 30, "the pod outlived its grace period"
        time.sleep(0.2)
    took = time.monotonic() - started
    # the handler's 6 s, not kwok's fixed delay and not the 30 s grace period
    assert 5.5 < took < 20, took
