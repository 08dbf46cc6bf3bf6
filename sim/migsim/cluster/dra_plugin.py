"""NVIDIA's DRA kubelet plugin (gpu-kubelet-plugin, scripts/dra-driver) on a simulated node of the
local cluster.

`start` runs the unmodified plugin over the node's simulated GPUs, as the DRA driver's DaemonSet
would run its `gpus` container, but as a local process: under `scripts/with-sim-gpus --host-view`
(root only: a private mount namespace with the node's /proc and /sys views, as NVIDIA's device
plugin gets in agents.py), authenticated with the admin kubeconfig, with a folder of the node for
what a pod would mount:

    nodes/<node>/dra/driver-root/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1   the simulated NVML
    nodes/<node>/dra/driver-root/usr/bin/nvidia-smi                          the simulated one
    nodes/<node>/dra/cdi/, plugins/, plugins_registry/                       CDI specs, sockets

The plugin reads the GPUs once, when it starts, and publishes one ResourceSlice for the node
(driver gpu.nvidia.com, pool = node name); no kubelet needs to connect for that. It leaves the
slice behind when it stops, so after a layout change the caller restarts it and waits until the
slice lists the new devices (`wait_devices`). A started plugin is recorded (agent_records), so
that the cluster's `down` stops it too. `install_device_classes` applies the driver's two
DeviceClasses, written here from what the chart's are (reference/dra.md 1), not copied from it.

`install_daemonset` applies the plugin's DaemonSet as the GPU Operator's GPUCluster renders it
(reference/dra.md 5): kwok "runs" its pods, and on each DRA node a follower (dra_runtime.py)
runs the plugin while the node's pod runs, as a kubelet runs the pod's `gpus` container.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import scripts
from .agent_records import record_dra, stop_dra_plugins
from .cluster import Cluster
from .errors import DevClusterError
from .processes import Proc, spawn

REPO = Path(__file__).resolve().parents[3]
DRIVER = "gpu.nvidia.com"
RESOURCE_API = "/apis/resource.k8s.io/v1"
IMAGE = "registry.invalid/dra-driver-nvidia-gpu:sim"  # required by the plugin, never pulled here
# The GPU Operator's names (manifests/state-dra-driver): the DaemonSet, its pods' label, the node
# label it selects, and the container that runs gpu-kubelet-plugin.
DAEMONSET = "nvidia-dra-driver-kubelet-plugin"
NAMESPACE = "gpu-operator"
APP = "nvidia-dra-driver-kubelet-plugin"
NODE_LABEL = "nvidia.com/gpu.deploy.dra-driver"
CONTAINER = "gpus"
FEATURE_GATES_ENV = "FEATURE_GATES"


def _device_class(name: str, device_type: str, extra: Mapping[str, Any]) -> dict[str, Any]:
    selector = (
        f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == '{device_type}'"
    )
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": selector}}], **extra},
    }


# The chart's classes: whole GPUs (also requestable as the extended resource nvidia.com/gpu where
# the API server's DRAExtendedResource gate is on; dropped otherwise) and MIG devices.
DEVICE_CLASSES = (
    _device_class("gpu.nvidia.com", "gpu", {"extendedResourceName": "nvidia.com/gpu"}),
    _device_class("mig.nvidia.com", "mig", {}),
)


def dra_bin() -> Path:
    """The folder holding gpu-kubelet-plugin (`scripts/dra-driver path`); DevClusterError saying
    how to build it when it is missing."""
    return scripts.built(
        "dra-driver",
        "path",
        failed="NVIDIA's DRA plugin is not built; run: scripts/dra-driver build",
    )


def install_device_classes(cluster: Cluster) -> None:
    """Apply the DeviceClasses gpu.nvidia.com and mig.nvidia.com (idempotent)."""
    for manifest in DEVICE_CLASSES:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))


def daemonset(
    *,
    name: str = DAEMONSET,
    namespace: str = NAMESPACE,
    app: str = APP,
    node_selector: Mapping[str, str] | None = None,
    feature_gates: str = "",
) -> dict[str, Any]:
    """The plugin's DaemonSet as a GPUCluster renders it; by default on the kwok nodes labelled
    NODE_LABEL=true (a real node would run the plugin in a container). `feature_gates` goes to
    the `gpus` container's FEATURE_GATES, which the follower passes on as --feature-gates."""
    container: dict[str, Any] = {"name": CONTAINER, "image": IMAGE}
    if feature_gates:
        container["env"] = [{"name": FEATURE_GATES_ENV, "value": feature_gates}]
    selector = {NODE_LABEL: "true", "type": "kwok"} if node_selector is None else node_selector
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": {"app": app}},
            "template": {
                "metadata": {"labels": {"app": app}},
                "spec": {
                    "nodeSelector": dict(selector),
                    "tolerations": [{"operator": "Exists"}],
                    "terminationGracePeriodSeconds": 1,
                    "containers": [container],
                },
            },
        },
    }


def install_daemonset(
    cluster: Cluster,
    *,
    name: str = DAEMONSET,
    namespace: str = NAMESPACE,
    app: str = APP,
    node_selector: Mapping[str, str] | None = None,
    feature_gates: str = "",
) -> None:
    """Apply `daemonset(...)` and its namespace (idempotent). A second one (another name, another
    NODE_LABEL value in `node_selector`) can carry other feature gates: the follower's default
    selector (app) takes the pod of either."""
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(ns))
    manifest = daemonset(
        name=name,
        namespace=namespace,
        app=app,
        node_selector=node_selector,
        feature_gates=feature_gates,
    )
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))


@dataclass(frozen=True)
class DraPlugin:
    """A running gpu-kubelet-plugin of one node."""

    node: str
    proc: Proc
    log: Path
    cluster_dir: Path

    def log_tail(self, lines: int = 30) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def node_folder(cluster: Cluster, node: str) -> Path:
    return cluster.node_dir(node) / "dra"


def _driver_root(folder: Path) -> Path:
    """The container driver root: the simulated NVML library and an nvidia-smi, as regular files
    (the plugin looks both up under it and refuses to start without them)."""
    root = folder / "driver-root"
    lib_dir = root / "usr" / "lib" / "x86_64-linux-gnu"
    bin_dir = root / "usr" / "bin"
    lib_dir.mkdir(parents=True, exist_ok=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    built = scripts.built("sim-nvml")
    # copied afresh each start: a rebuilt library is the one the plugin loads
    shutil.copyfile(built / "libnvidia-ml.so.1", lib_dir / "libnvidia-ml.so.1")
    smi = bin_dir / "nvidia-smi"
    shutil.copyfile(built / "nvidia-smi", smi)
    smi.chmod(0o755)
    return root


def start(
    cluster: Cluster,
    node: str,
    state: Path,
    *,
    args: Sequence[str] = (),
    bin_dir: Path | None = None,
    cdi_hook: Path | None = None,
) -> DraPlugin:
    """Start gpu-kubelet-plugin for `node` over the simulated GPUs of `state`, by hand: the node's
    plugin and follower are stopped first (one plugin per node, as its DaemonSet runs it). `args`
    are more of its flags; `cdi_hook` is NVIDIA's nvidia-cdi-hook (default: cdi_hook_path())."""
    stop_dra_plugins(cluster.dir, node)
    return launch(cluster, node, state, args=args, bin_dir=bin_dir, cdi_hook=cdi_hook)


def cdi_hook_path() -> Path:
    """NVIDIA's nvidia-cdi-hook (scripts/nvidia-binaries), which the plugin copies at start."""
    built = scripts.built(
        "nvidia-binaries",
        "path",
        failed="nvidia-cdi-hook is not built; run: scripts/nvidia-binaries build",
    )
    return built / "nvidia-cdi-hook"


def launch(
    cluster: Cluster,
    node: str,
    state: Path,
    *,
    args: Sequence[str] = (),
    bin_dir: Path | None = None,
    cdi_hook: Path | None = None,
) -> DraPlugin:
    """Start the plugin as `start` does, but beside whatever runs: the follower's way, which stops
    its own plugin first. Recorded at once as the node's `plugin`."""
    if os.geteuid() != 0:
        raise DevClusterError(
            "NVIDIA's DRA plugin runs in a private mount namespace (unshare -m): run as root"
        )
    plugin = (bin_dir or dra_bin()) / "gpu-kubelet-plugin"
    hook = cdi_hook or cdi_hook_path()
    folder = node_folder(cluster, node)
    dirs = {name: folder / name for name in ("cdi", "plugins", "plugins_registry")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    argv = [
        str(REPO / "scripts" / "with-sim-gpus"),
        "--host-view",
        str(state),
        "--",
        str(plugin),
        f"--kubeconfig={cluster.kubeconfig}",
        f"--node-name={node}",
        f"--image-name={IMAGE}",
        f"--container-driver-root={_driver_root(folder)}",
        f"--nvidia-cdi-hook-path={hook}",
        f"--cdi-root={dirs['cdi']}",
        f"--kubelet-plugins-directory-path={dirs['plugins']}",
        f"--kubelet-registrar-directory-path={dirs['plugins_registry']}",
        *args,
    ]
    log = cluster.dir / "logs" / f"dra-plugin-{node}.log"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = spawn(f"dra-plugin@{node}", argv, log, env=env)
    # recorded at once: the cluster's `down` stops it even if this process dies a moment later
    record_dra(cluster.dir, node, "plugin", proc)
    return DraPlugin(node, proc, log, cluster.dir)


def stop_plugin(plugin: DraPlugin) -> None:
    """Stop the plugin: its process group (with-sim-gpus, the GPU simulator and the plugin)."""
    stop_dra_plugins(plugin.cluster_dir, plugin.node)


def resource_slices(cluster: Cluster, node: str) -> list[dict[str, Any]]:
    """The ResourceSlices of DRIVER for `node`."""
    items = cluster.api.get(f"{RESOURCE_API}/resourceslices?fieldSelector=spec.nodeName%3D{node}")
    return [s for s in items["items"] if s["spec"].get("driver") == DRIVER]


def delete_slices(cluster: Cluster, node: str) -> None:
    """Delete the node's slices of DRIVER (what a plugin left behind), so that those seen next
    are the next plugin's."""
    for piece in resource_slices(cluster, node):
        cluster.api.request("DELETE", f"{RESOURCE_API}/resourceslices/{piece['metadata']['name']}")


def devices(cluster: Cluster, node: str) -> dict[str, dict[str, Any]]:
    """The devices the node's slices list: name -> {attribute: value} (values unwrapped from
    their string/int/bool/version fields)."""
    out: dict[str, dict[str, Any]] = {}
    for piece in resource_slices(cluster, node):
        for device in piece["spec"].get("devices") or []:
            attrs = device.get("attributes") or {}
            out[device["name"]] = {k: next(iter(v.values())) for k, v in attrs.items()}
    return out


def wait_devices(
    cluster: Cluster,
    plugin: DraPlugin,
    done: Callable[[dict[str, dict[str, Any]]], bool],
    *,
    timeout: float = 60.0,
) -> dict[str, dict[str, Any]]:
    """Poll the node's devices until `done(devices)`; DevClusterError with what the slices list
    and the plugin's log when that does not happen within `timeout`, or when the plugin exits."""
    deadline = time.monotonic() + timeout
    seen: dict[str, dict[str, Any]] = {}
    while True:
        seen = devices(cluster, plugin.node)
        if done(seen):
            return seen
        if not plugin.proc.alive():
            raise DevClusterError(
                f"the DRA plugin of {plugin.node} exited; slices list {sorted(seen)}; "
                f"log:\n{plugin.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise DevClusterError(
                f"{plugin.node}: the slices list {sorted(seen)} after {timeout:g} s; "
                f"plugin log:\n{plugin.log_tail()}"
            )
        time.sleep(0.3)
