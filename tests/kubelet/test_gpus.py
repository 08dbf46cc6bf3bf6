"""We test NVIDIA's device plugin on the real node: its DaemonSet's pod, run by the real kubelet
from the image built here, registers with the kubelet's own device manager; the node's allocatable
is what the kubelet makes of it; a pod asking for a GPU, then for a MIG device after a
repartition, is admitted by the kubelet, which calls the plugin's Allocate for the device the pod
gets (its NVIDIA_VISIBLE_DEVICES)."""

from __future__ import annotations

import json
import subprocess
import sys

from kubernetes import client
from migsim.cluster import real_node

from .conftest import (
    REAL_GPUS,
    busybox_pod,
    gpu_resources,
    plugin_pods,
    pod_log,
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


def visible_devices_pod(name: str, resource: str) -> dict[str, object]:
    pod = busybox_pod(name, "echo devices=$NVIDIA_VISIBLE_DEVICES")
    pod["spec"]["containers"][0]["resources"] = {"limits": {resource: 1}}  # type: ignore[index]
    return pod


def test_nvidias_plugin_registers_with_the_kubelet_and_sets_allocatable(
    kubelet_node: real_node.RealNode, core: client.CoreV1Api
) -> None:
    wait_resources(core, {"nvidia.com/gpu": REAL_GPUS.split("x")[0]})
    [pod] = plugin_pods(core)
    assert pod.status.phase == "Running", pod.status
    # the socket the plugin serves is in the real kubelet's own device-plugin folder
    assert (kubelet_node.device_plugin_dir / "nvidia-gpu.sock").is_socket()


def test_a_gpu_pod_is_given_a_gpu_by_the_kubelet_and_a_mig_device_after_a_repartition(
    kubelet_node: real_node.RealNode, core: client.CoreV1Api, namespace: str
) -> None:
    wait_resources(core, {"nvidia.com/gpu": "2"})
    core.create_namespaced_pod(namespace, visible_devices_pod("whole", "nvidia.com/gpu"))
    wait_phase(core, namespace, "whole", "Succeeded")
    gpus, _ = gpu_uuids(kubelet_node)
    line = pod_log(core, namespace, "whole").strip()
    assert line.startswith("devices=") and line.removeprefix("devices=") in gpus, (line, gpus)

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

    core.create_namespaced_pod(namespace, visible_devices_pod("slice", "nvidia.com/mig-1g.10gb"))
    wait_phase(core, namespace, "slice", "Succeeded")
    _, migs = gpu_uuids(kubelet_node)
    line = pod_log(core, namespace, "slice").strip()
    assert line.removeprefix("devices=") in migs, (line, sorted(migs)[:3])
    assert gpu_resources(core) == {"nvidia.com/mig-1g.10gb": "14"}
