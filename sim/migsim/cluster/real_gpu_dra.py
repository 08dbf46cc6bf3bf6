"""scripts/real-gpu-node --dra: the real node as a DRA node. NVIDIA's DRA kubelet plugin
(gpu-kubelet-plugin, scripts/dra-driver) instead of its device plugin, run on the host as
tests/native/test_dra_driver.py runs it, but beside a real kubelet: its sockets in the kubelet's
own plugin folders (``/var/lib/kubelet/plugins``, ``plugins_registry``), so that the kubelet
registers it and calls its NodePrepareResources; its NVML the machine's driver (or, with
``--gpus``, the simulated GPUs under scripts/with-sim-gpus --host-view); its CDI specs in
``/var/run/cdi``, one of the folders containerd reads CDI specs from when it injects them
(containerd 1.7 with ``enable_cdi``, 2.x by default). Then:

1. the node's ResourceSlice (driver gpu.nvidia.com) lists the GPUs by the UUIDs NVML reports;
2. mig-agent on the host, the node labelled with the layout the GPUs hold: `success`, by the
   slice (the node is a DRA node by its slice; the plan is empty, so no plugin restart is due);
3. a ResourceClaim for one gpu.nvidia.com device and a pod holding it under the RuntimeClass
   `nvidia`, running ``nvidia-smi -L``: the scheduler allocates the claim, the kubelet prepares
   it through the plugin (its CDI spec for the claim written), the container runtime injects
   the device; the pod prints the GPU's UUID;
4. the pod deleted: the kubelet unprepares the claim (its CDI spec gone), the resource-claim
   controller (run here beside the cluster's controller manager, which runs without it)
   releases the allocation; the slice lists the same devices as before.

Never changes a GPU: the plugin runs without DynamicMIG (it makes no MIG device), a whole GPU's
claim is prepared without touching the GPU, and the agent starts only after an empty plan.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from migsim.nvml import state as simstate

from . import dra_plugin, images, real_node, scripts
from .agent_records import record_dra, stop_dra_plugins
from .agents import NVIDIA_RUNTIME_CLASS, nvidia_bin
from .cluster import Cluster, find_binaries
from .errors import DevClusterError
from .processes import Proc, spawn, stop
from .real_gpu_steps import (
    gpu_state,
    held_layout_applies,
    host_smi,
    say,
    wait_for,
)

KUBELET_PLUGINS = Path(real_node.KUBELET_ROOT) / "plugins"
KUBELET_REGISTRY = Path(real_node.KUBELET_ROOT) / "plugins_registry"
CDI_ROOT = Path("/var/run/cdi")  # containerd's default CDI folders: /etc/cdi, /var/run/cdi
CLAIM_SPEC_PREFIX = "k8s.gpu.nvidia.com-claim_"  # the plugin's spec file for one claim
CHECKPOINT = KUBELET_PLUGINS / dra_plugin.DRIVER / "checkpoint.json"
CLAIM, POD, NAMESPACE = "real-gpu", "real-gpu-claim", "default"
SAID = "nvidia-smi exit code:"  # the pod's line after nvidia-smi's
NVIDIA_MAJOR, NVIDIA_CTL_MINOR = 195, 255  # the driver's character devices: nvidia<N>, nvidiactl


def _sim_driver_root(folder: Path, state: Path) -> Path:
    """The simulated driver root the plugin looks its NVML and nvidia-smi up in (as
    dra_plugin's: both regular files), and a file named as the driver's libcuda.so of the
    simulated version: preparing a claim, the plugin's CDI spec locates the driver's libraries
    by it (an empty file: nothing runs CUDA here)."""
    root = folder / "driver-root"
    lib_dir, bin_dir = root / "usr" / "lib" / "x86_64-linux-gnu", root / "usr" / "bin"
    for d in (lib_dir, bin_dir):
        d.mkdir(parents=True, exist_ok=True)
    built = scripts.built("sim-nvml")
    shutil.copyfile(built / "libnvidia-ml.so.1", lib_dir / "libnvidia-ml.so.1")
    shutil.copyfile(built / "nvidia-smi", bin_dir / "nvidia-smi")
    (bin_dir / "nvidia-smi").chmod(0o755)
    (lib_dir / f"libcuda.so.{simstate.DRIVER_VERSION}").touch()
    _sim_device_nodes(root / "dev", simstate.load_node(state).gpus)
    return root


def _sim_device_nodes(dev: Path, gpus: Sequence[simstate.SimGpu]) -> None:
    """The driver's device nodes in the simulated root's dev/ (which makes it the plugin's dev
    root): character devices of the driver's major that no driver serves here, so that the
    plugin's CDI spec of a claimed GPU names its device node, as on a real node."""
    dev.mkdir(exist_ok=True)
    nodes = {"nvidiactl": NVIDIA_CTL_MINOR, **{f"nvidia{g.index}": g.index for g in gpus}}
    for name, minor in nodes.items():
        if not (dev / name).exists():
            os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, minor))


def plugin_argv(cluster: Cluster, node: real_node.RealNode) -> list[str]:
    """gpu-kubelet-plugin's command line for the real node: over the driver's root, or over
    the node's simulated GPUs in a private mount namespace with their host view."""
    plugin = dra_plugin.dra_bin() / "gpu-kubelet-plugin"
    folder = dra_plugin.node_folder(cluster, node.name)
    folder.mkdir(parents=True, exist_ok=True)
    root = Path(node.driver_root) if node.driver_root else _sim_driver_root(folder, node.sim_state)
    argv = [
        str(plugin),
        f"--kubeconfig={cluster.kubeconfig}",
        f"--node-name={node.name}",
        f"--image-name={dra_plugin.IMAGE}",
        f"--container-driver-root={root}",
        *([f"--nvidia-driver-root={root}"] if node.driver_root else []),
        f"--nvidia-cdi-hook-path={nvidia_bin() / 'nvidia-cdi-hook'}",
        f"--cdi-root={CDI_ROOT}",
        f"--kubelet-plugins-directory-path={KUBELET_PLUGINS}",
        f"--kubelet-registrar-directory-path={KUBELET_REGISTRY}",
    ]
    if node.driver_root:
        return argv
    with_sim = scripts.REPO / "scripts" / "with-sim-gpus"
    return [str(with_sim), "--host-view", str(node.sim_state), "--", *argv]


@contextlib.contextmanager
def dra_plugin_running(cluster: Cluster, node: real_node.RealNode) -> Iterator[Proc]:
    """The plugin on the host for the node, recorded (the cluster's `down` stops it too);
    stopped on leaving, and the CDI specs it wrote for claims removed."""
    CDI_ROOT.mkdir(parents=True, exist_ok=True)
    log = cluster.dir / "logs" / f"dra-plugin-{node.name}.log"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = spawn(f"dra-plugin@{node.name}", plugin_argv(cluster, node), log, env=env)
    record_dra(cluster.dir, node.name, "plugin", proc)
    try:
        yield proc
    finally:
        stop_dra_plugins(cluster.dir, node.name)
        for spec in CDI_ROOT.glob("k8s.gpu.nvidia.com-*"):
            spec.unlink(missing_ok=True)


@contextlib.contextmanager
def claim_controller(cluster: Cluster) -> Iterator[Proc]:
    """kube-controller-manager with only its resource-claim controller (the cluster's runs
    without it): it takes a deleted pod out of its claims' reservedFor and releases their
    allocation."""
    argv = [
        str(find_binaries() / "kube-controller-manager"),
        f"--kubeconfig={cluster.kubeconfig}",
        "--controllers=resourceclaim-controller",
        "--leader-elect=false",
        "--secure-port=0",
    ]
    proc = spawn("resourceclaim-controller", argv, cluster.dir / "logs" / "claim-controller.log")
    try:
        yield proc
    finally:
        stop([proc])


def slice_devices(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return dra_plugin.devices(cluster, real_node.NAME)


def expected_uuids(node: real_node.RealNode) -> set[str]:
    """The UUIDs the slice should list: the whole GPUs with MIG off, else their MIG devices."""
    found = json.loads(gpu_state(node))
    out: set[str] = set()
    for gpu in found.get("gpus") or []:
        cis = [ci for gi in gpu["gpu_instances"] for ci in gi.get("compute_instances") or []]
        migs = {str(ci["uuid"]) for ci in cis if ci.get("uuid")}
        out |= migs if gpu["mig_enabled"] else {str(gpu["uuid"])}
    return out


def slice_lists_gpus(cluster: Cluster, node: real_node.RealNode, plugin: Proc) -> None:
    """Wait until the node's slice lists the devices of the GPUs, by UUID; said."""
    want = expected_uuids(node)

    def listed() -> bool:
        if not plugin.alive():
            raise DevClusterError("the DRA plugin exited; its log: dra-plugin-*.log")
        return {d.get("uuid") for d in slice_devices(cluster).values()} == want

    wait_for(f"the ResourceSlice to list {sorted(want)}", listed, 120)
    (piece,) = dra_plugin.resource_slices(cluster, real_node.NAME)
    say(f"$ kubectl get resourceslice {piece['metadata']['name']}  # driver {dra_plugin.DRIVER}")
    for name, attrs in sorted(slice_devices(cluster).items()):
        keys = ("type", "uuid", "productName", "driverVersion")
        say(f"{name}: " + ", ".join(f"{k}={attrs.get(k)}" for k in keys))
    say("")


def claim_manifest() -> dict[str, Any]:
    """A ResourceClaim of one whole GPU (DeviceClass gpu.nvidia.com)."""
    request = {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": CLAIM, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [request]}},
    }


def pod_manifest(image: str) -> dict[str, Any]:
    """The pod holding CLAIM: `nvidia-smi -L` under the RuntimeClass nvidia, its exit code,
    then it sleeps until deleted."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": POD, "namespace": NAMESPACE},
        "spec": {
            "runtimeClassName": "nvidia",
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": CLAIM}],
            "containers": [
                {
                    "name": "smi",
                    "image": image,
                    "imagePullPolicy": "Never",
                    # said, then held: the claim stays prepared until the pod is deleted
                    "command": ["sh", "-c", f"nvidia-smi -L; echo {SAID} $?; exec sleep 600"],
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


def get_claim(cluster: Cluster) -> dict[str, Any]:
    path = f"{dra_plugin.RESOURCE_API}/namespaces/{NAMESPACE}/resourceclaims/{CLAIM}"
    found = cluster.api.get(path)
    assert isinstance(found, dict)
    return found


def get_pod(cluster: Cluster) -> dict[str, Any]:
    found = cluster.api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{POD}")
    assert isinstance(found, dict)
    return found


def allocated(claim: dict[str, Any]) -> list[str]:
    """The devices the claim was allocated (pool/device)."""
    results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {})
    return [f"{r['pool']}/{r['device']}" for r in results.get("results") or []]


def claim_specs() -> list[str]:
    """The CDI spec files the plugin wrote for claims (one per prepared claim)."""
    return sorted(p.name for p in CDI_ROOT.glob(f"{CLAIM_SPEC_PREFIX}*"))


def prepared_claims() -> list[str]:
    """The claim UIDs the plugin's checkpoint holds as prepared."""
    if not CHECKPOINT.exists():
        return []
    raw = json.loads(CHECKPOINT.read_text())
    return sorted(((raw.get("v2") or {}).get("preparedClaims") or {}).keys())


def pod_log(cluster: Cluster) -> str:
    return cluster.kubectl("logs", "-n", NAMESPACE, POD, check=False).strip()


def pod_said(cluster: Cluster) -> bool:
    """Whether the pod's nvidia-smi ran (its exit code said); raises if the pod ended."""
    phase = (get_pod(cluster).get("status") or {}).get("phase")
    if phase in ("Succeeded", "Failed"):
        raise DevClusterError(f"the claim's pod ended ({phase}): {pod_log(cluster)}")
    return phase == "Running" and SAID in pod_log(cluster)


def runtime_version(cluster: Cluster) -> str:
    node = cluster.api.get(f"/api/v1/nodes/{real_node.NAME}")
    return str(node["status"]["nodeInfo"].get("containerRuntimeVersion", "?"))


def injects_cdi(runtime: str) -> bool:
    """Whether the node's container runtime (`containerd://1.6.20`) injects the CDI devices the
    kubelet hands it in the CRI's CDIDevices field: containerd from 1.7 on (with enable_cdi,
    the default from 2.0)."""
    name, _, version = runtime.partition("://")
    parts = [int(p) for p in version.split("~")[0].split(".")[:2] if p.isdigit()]
    return name == "containerd" and len(parts) == 2 and tuple(parts) >= (1, 7)


def pod_events(cluster: Cluster) -> list[str]:
    query = f"fieldSelector=involvedObject.name%3D{POD}"
    items = cluster.api.get(f"/api/v1/namespaces/{NAMESPACE}/events?{query}")["items"]
    return [f"{e.get('reason')}: {str(e.get('message'))[:300]}" for e in items]


def claim_served(cluster: Cluster, node: real_node.RealNode, uuids: set[str]) -> str:
    """The claim and its pod: allocated by the scheduler, prepared by the kubelet through the
    plugin, the pod's `nvidia-smi -L`; what it printed. DevClusterError if the kubelet did not
    prepare the claim, or if the runtime injects CDI devices and the pod did not print the UUID
    of the GPU; with a runtime that does not (containerd 1.6), said."""
    image = images.GPU_WORKLOAD if node.driver_root else images.BUSYBOX
    say("$ kubectl create -f claim.yaml  # ResourceClaim real-gpu: one device of gpu.nvidia.com")
    cluster.kubectl("create", "-f", "-", input=json.dumps(claim_manifest()))
    say(f"$ kubectl create -f pod.yaml  # runtimeClassName nvidia, {image}: nvidia-smi -L")
    cluster.kubectl("create", "-f", "-", input=json.dumps(pod_manifest(image)))
    try:
        wait_for("the claim's pod to run nvidia-smi", lambda: pod_said(cluster), 90)
    except DevClusterError as exc:
        raise DevClusterError(f"{exc}; its events: {pod_events(cluster)}") from None
    claim, pod = get_claim(cluster), get_pod(cluster)
    reserved = [r.get("name") for r in (claim.get("status") or {}).get("reservedFor") or []]
    say(f"claim {CLAIM}: allocated {allocated(claim)}, reserved for {reserved}")
    say(f"the plugin's checkpoint: prepared claims {prepared_claims()}")
    say(f"CDI specs of claims: {claim_specs()}")
    say(f"pod {POD}: {pod['status'].get('phase')} on {pod['spec'].get('nodeName')}")
    log = pod_log(cluster)
    say(f"$ kubectl logs {POD}\n{log}\n")
    if claim["metadata"]["uid"] not in prepared_claims():
        raise DevClusterError("the kubelet did not prepare the claim (the plugin holds none)")
    runtime = runtime_version(cluster)
    if any(u in log for u in uuids):
        say("the pod saw the claimed GPU by its UUID\n")
    elif injects_cdi(runtime):
        raise DevClusterError("the claim's pod did not print the claimed GPU's UUID")
    else:
        say(
            f"not injected: {runtime} does not read the CRI's CDIDevices field, the one way "
            "the kubelet hands a prepared claim's CDI devices to the runtime since Kubernetes "
            "1.31 (annotations no longer); containerd 1.7 with enable_cdi, or 2.x, injects them\n"
        )
    return log


def claim_released(cluster: Cluster, before: dict[str, dict[str, Any]]) -> None:
    """The pod deleted: the kubelet unprepares the claim, the claim controller releases it,
    the claim deleted; the slice lists what it listed before."""
    say(f"$ kubectl delete pod {POD}")
    cluster.kubectl("delete", "pod", "-n", NAMESPACE, POD, "--wait=true")
    wait_for("the kubelet to unprepare the claim", lambda: not claim_specs(), 60)

    def released() -> bool:
        status = get_claim(cluster).get("status") or {}
        return not status.get("reservedFor") and not status.get("allocation")

    wait_for("the claim's release", released, 60)
    say(f"claim {CLAIM}: allocated {allocated(get_claim(cluster))}, reserved for []")
    say(f"the plugin's checkpoint: prepared claims {prepared_claims()}")
    say(f"CDI specs of claims: {claim_specs()}")
    cluster.kubectl("delete", "resourceclaim", "-n", NAMESPACE, CLAIM, "--wait=true")
    after = slice_devices(cluster)
    same = "the same" if after == before else f"DIFFERENT: {sorted(after)}"
    say(f"the slice after: {sorted(after)}, {same}\n")
    if after != before:
        raise DevClusterError("the ResourceSlice changed over the claim")


def checks(cluster: Cluster, logs: Path, held: str, gpus: str, driver_root: str) -> bool:
    """The DRA node's checks (the module's docstring); whether the GPUs read the same after."""
    node = real_node.start(cluster, real_node.NAME, gpus=gpus, driver_root=driver_root)
    try:
        before = gpu_state(node)
        host_smi(node)
        say(f"the node's container runtime: {runtime_version(cluster)}\n")
        dra_plugin.install_device_classes(cluster)
        cluster.kubectl("apply", "-f", "-", input=json.dumps(NVIDIA_RUNTIME_CLASS))
        with dra_plugin_running(cluster, node) as plugin, claim_controller(cluster):
            slice_lists_gpus(cluster, node, plugin)
            listed = slice_devices(cluster)
            held_layout_applies(cluster, node, logs, held)
            claim_served(cluster, node, expected_uuids(node))
            claim_released(cluster, listed)
        return gpu_state(node) == before
    finally:
        real_node.stop_node(node)
