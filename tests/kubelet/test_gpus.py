"""We test NVIDIA's device plugin on the real node: its DaemonSet's pod, run by the real kubelet
from the image built here, registers with the kubelet's own device manager; the node's allocatable
is what the kubelet makes of it; a pod asking for a GPU, then for a MIG device after a
repartition, is admitted by the kubelet, which calls the plugin's Allocate for the device the pod
gets (its NVIDIA_VISIBLE_DEVICES), and run under the RuntimeClass `nvidia`, whose CDI spec gives
it the simulated NVML and nvidia-smi and lets it see only that device. These are the checks an
operator makes on a GPU node (migsim.cluster.seed_checks, scripts/demo --real-node)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from kubernetes import client
from migsim.cluster import Cluster, real_node, seed_checks

from .conftest import (
    REAL_GPUS,
    gpu_resources,
    plugin_pods,
    wait_phase,
    wait_resources,
)


def gpu_uuids(node: real_node.RealNode) -> tuple[set[str], set[str]]:
    """The simulated GPUs' UUIDs and their MIG devices' UUIDs."""
    state = json.loads(node.sim_state.read_text())
    text = json.dumps(state)
    gpus = {u for u in _values(state, "uuid") if u.startswith("GPU-")}
    migs = {u for u in _values(state, "uuid") if u.startswith("MIG-")}
    assert gpus, text[:500]
    return gpus, migs


def _values(obj: object, key: str) -> list[str]:
    if isinstance(obj, dict):
        found = [str(v) for k, v in obj.items() if k == key]
        return found + [x for v in obj.values() for x in _values(v, key)]
    if isinstance(obj, list):
        return [x for v in obj for x in _values(v, key)]
    return []


def gpu_pod(name: str, resource: str) -> dict[str, Any]:
    """A tiny pod under the RuntimeClass `nvidia` given one `resource`: the device NVIDIA's
    plugin named, and what nvidia-smi in the container lists."""
    return seed_checks.gpu_pod(
        name, resource, "sh", "-c", "echo devices=$NVIDIA_VISIBLE_DEVICES; nvidia-smi -L"
    )


def listed(log: str) -> tuple[str, list[str], list[str]]:
    """The pod's device from its log, and the GPU and MIG lines nvidia-smi -L printed."""
    lines = log.splitlines()
    device = lines[0].removeprefix("devices=")
    return (
        device,
        [ln for ln in lines if ln.startswith("GPU ")],
        [ln for ln in lines if ln.startswith("  MIG ")],
    )


def test_nvidias_plugin_registers_with_the_kubelet_and_sets_allocatable(
    kubelet_node: real_node.RealNode, core: client.CoreV1Api
) -> None:
    wait_resources(core, {"nvidia.com/gpu": REAL_GPUS.split("x")[0]})
    [pod] = plugin_pods(core)
    # the kubelet reports the pod Running on its own schedule, which can trail the plugin's
    # registration (a CI run saw allocatable set with the pod still Pending in the API)
    wait_phase(core, pod.metadata.namespace, pod.metadata.name, "Running")
    # the socket the plugin serves is in the real kubelet's own device-plugin folder
    assert (kubelet_node.device_plugin_dir / "nvidia-gpu.sock").is_socket()


def test_the_operators_checks_whole_gpus_then_a_mig_device_after_a_repartition(
    kubelet_node: real_node.RealNode, core: client.CoreV1Api, cluster: Cluster, namespace: str
) -> None:
    """nvidia-smi on the host, the node's allocatable, a tiny GPU pod whose log shows its GPU;
    then, the GPUs repartitioned, a pod given a MIG device sees that device and no other."""
    wait_resources(core, {"nvidia.com/gpu": "2"})
    gpus, _ = gpu_uuids(kubelet_node)
    table = seed_checks.host_nvidia_smi(kubelet_node)
    assert table.count("NVIDIA H100 80GB HBM3") == 2, table
    assert "No running processes found" in table
    assert seed_checks.gpu_resources(cluster) == {"nvidia.com/gpu": "2"}

    log = seed_checks.run_pod(cluster, gpu_pod("whole", "nvidia.com/gpu"), namespace)
    device, gpu_lines, mig_lines = listed(log)
    assert device in gpus, (log, gpus)
    # NVIDIA's runtime gave the container that GPU alone: nvidia-smi numbers it 0
    assert gpu_lines == [f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {device})"], log
    assert mig_lines == [], log

    # the GPUs repartitioned on the host (mig-agent's CLI on the simulated GPUs), then the
    # plugin's pod deleted: its DaemonSet's new pod registers what the GPUs now hold
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mig_agent",
            "apply",
            "-c",
            "all-1g.10gb",
            "--backend",
            "simulated",
            "--sim-state",
            str(kubelet_node.sim_state),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    [old] = plugin_pods(core)
    core.delete_namespaced_pod(old.metadata.name, old.metadata.namespace)
    wait_resources(core, {"nvidia.com/mig-1g.10gb": "14"})
    [new] = plugin_pods(core)
    assert new.metadata.uid != old.metadata.uid
    host = seed_checks.host_nvidia_smi(kubelet_node, "-L")
    assert host.count("  MIG 1g.10gb     Device") == 14, host

    # under the RuntimeClass nvidia: the node's CDI spec has followed the repartition
    log = seed_checks.run_pod(cluster, gpu_pod("slice", "nvidia.com/mig-1g.10gb"), namespace)
    device, gpu_lines, mig_lines = listed(log)
    _, migs = gpu_uuids(kubelet_node)
    assert device in migs, (log, sorted(migs)[:3])
    parent = next(
        g["uuid"]
        for g in json.loads(kubelet_node.sim_state.read_text())["gpus"]
        if device in json.dumps(g)
    )
    assert gpu_lines == [f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {parent})"], log
    assert len(mig_lines) == 1 and mig_lines[0].endswith(f"(UUID: {device})"), log
    assert mig_lines[0].startswith("  MIG 1g.10gb"), log
    assert gpu_resources(core) == {"nvidia.com/mig-1g.10gb": "14"}
