"""A real node of the local cluster: a kubelet built from the cluster's pinned Kubernetes release,
with Debian's containerd and runc, running real containers of images built here (images.py).

Beside the kwok nodes (which stay for pools of many), a real node is where graceful termination,
probes, the kubelet's device manager and its PodResources socket are the real ones. Everything it
keeps is under the node's folder (``nodes/<name>/``): containerd's root and state (the pods'
network namespaces too), pod logs, its CNI config and address leases, NVIDIA's container
runtime's config and the node's CDI spec; but for the kubelet's root, ``/var/lib/kubelet`` as on
a production node (the device manager keeps its sockets at that fixed path, and the chart mounts
its pod-resources folder), emptied when a real node starts and stops, and for its sockets
(containerd's, the GPU simulator's), in ``/run/mig-agent-real-node`` where a path stays short
enough for a unix socket.

What this machine asks of such a node (checked by hand, see docs/real-node.md):

* containerd's CRI must not lower ``oom_score_adj`` (no CAP_SYS_RESOURCE here):
  ``restrict_oom_score_adj``;
* runc, not crun (crun refuses this hybrid cgroup v1/v2 layout);
* a pod network (without one containerd 1.6 fails every sandbox, "failed to find network
  info"): Debian's CNI plugins, a bridge (``BRIDGE``) with addresses from ``POD_SUBNET`` (a
  private range) and portmap, loopback as containerd adds it; no masquerading, so pods reach
  this machine (the API server's forwarder, below) and each other, and nothing beyond. What it
  leaves on the machine (the bridge, IP forwarding the bridge plugin turns on, portmap's
  iptables chains) goes when the node stops;
* the kubelet refuses a loopback node IP: it reports and serves on the address this machine's
  default route leaves from, and accepts only the API server's client certificate there.

With ``gpus`` the node has simulated GPUs: their state file, the GPU simulator serving it on a
socket in the node's folder, and the host view NVIDIA's binaries read (/proc/driver/nvidia-caps,
the PCI devices). NVIDIA's device plugin then runs as a DaemonSet pod of the real kubelet
(``device_plugin_daemonset``), from an image holding the binaries built from ../shared/upstream
and the simulated ``libnvidia-ml.so.1``; it registers with the kubelet's own device manager.

The RuntimeClass ``nvidia`` maps to NVIDIA's ``nvidia-container-runtime`` (built from
../shared/upstream) in CDI mode, over runc, with a CDI spec written from the simulated GPUs and
kept current with them (``cdi.py``): a container given a device (``NVIDIA_VISIBLE_DEVICES``)
gets the simulated libnvidia-ml.so.1, nvidia-smi and the node's GPU simulator, and sees only its
devices, as the real runtime injects the driver's.

One real node per machine: its kubelet's root and cgroups (``/kubepods``) are the machine's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from migsim.nvml import state as simstate

from . import images, pki, scripts
from .agents import NVIDIA_RUNTIME_CLASS, PLUGIN_LABEL, PLUGIN_NS, nvidia_bin
from .cluster import Cluster, find_binaries
from .errors import DevClusterError
from .processes import Proc, free_ports, parent_pid, spawn, stop
from .waiting import wait_until

NAME: Final = "kubelet-node-0"  # the machine's one real node
RECORD: Final = "real-node.json"
REAL_NODE_LABEL: Final = "mig-agent.dev/real-node"
KUBELET_ROOT: Final = "/var/lib/kubelet"
# A unix socket's path has at most 107 bytes (containerd's own limit is 104, for its .ttrpc
# twin): the node's folder may be deeper (a test's tmp_path), so its sockets live here.
SOCKETS: Final = "/run/mig-agent-real-node"
KUBELET_DEVICE_PLUGINS: Final = f"{KUBELET_ROOT}/device-plugins"
TOOLS: Final = ("containerd", "containerd-shim-runc-v2", "runc", "ctr")
CNI_BIN: Final = "/usr/lib/cni"
CNI_PLUGINS: Final = ("loopback", "bridge", "host-local", "portmap")
BRIDGE: Final = "migagent0"
POD_SUBNET: Final = "10.250.0.0/24"  # private, local to this machine: no route leads out of it
IP_FORWARD: Final = Path("/proc/sys/net/ipv4/ip_forward")
NO_PORTMAP_ENV: Final = "MIG_AGENT_REAL_NODE_NO_PORTMAP"


@dataclass(frozen=True, slots=True)
class RealNode:
    """A running real node: its processes and the paths other parts of a test need."""

    name: str
    dir: str
    containerd: Proc
    kubelet: Proc
    kubelet_port: int
    gpus: str = ""  # the simulated GPUs (`2xH100-80GB`); "" for none
    simulator: Proc | None = None  # the GPU simulator serving the node's state file
    service_proxy: Proc | None = None  # the `kubernetes` Service for in-cluster clients
    cdi_writer: Proc | None = None  # keeps the CDI spec current with the GPUs (cdi.py)
    # a real GPU driver's root (its bin/ and lib64/): the node's GPUs are the machine's own
    driver_root: str = ""

    @property
    def sim_state(self) -> Path:
        return Path(self.dir) / "gpu-state.json"

    @property
    def nvml_socket(self) -> Path:
        return Path(SOCKETS) / "gpu" / "nvml.sock"

    @property
    def cdi_spec(self) -> Path:
        return Path(self.dir) / "cdi" / "nvidia.json"

    @property
    def host_view(self) -> Path:
        return Path(self.dir) / "host-view"

    @property
    def root_dir(self) -> Path:
        # a production kubelet's: the chart mounts /var/lib/kubelet/pod-resources
        return Path(KUBELET_ROOT)

    @property
    def containerd_socket(self) -> Path:
        return Path(SOCKETS) / "containerd" / "containerd.sock"

    @property
    def pod_resources_socket(self) -> Path:
        return self.root_dir / "pod-resources" / "kubelet.sock"

    @property
    def device_plugin_dir(self) -> Path:
        # the kubelet's device manager listens at this fixed path, whatever its --root-dir
        return Path(KUBELET_DEVICE_PLUGINS)


def missing_tools() -> list[str]:
    """What the real node needs and this machine lacks (Debian: containerd runc umoci
    busybox-static), besides the kubelet."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if not os.environ.get(images.PREBUILT_ENV):  # else its images were built elsewhere
        missing += [t for t in ("umoci", "gcc") if shutil.which(t) is None]
        if not images.BUSYBOX_BINARY.exists():
            missing.append(str(images.BUSYBOX_BINARY))
    plugins = [p for p in CNI_PLUGINS if p != "portmap" or _portmap()]
    missing += [f"{CNI_BIN}/{p}" for p in plugins if not Path(CNI_BIN, p).exists()]
    if shutil.which("iptables") is None and not os.environ.get(NO_PORTMAP_ENV):  # portmap's
        missing.append("iptables")
    return missing


def _portmap() -> bool:
    """Whether the pod network has portmap (hostPort): not on a machine without iptables that
    says so (NO_PORTMAP_ENV; the real GPU's machine has none)."""
    return not os.environ.get(NO_PORTMAP_ENV)


def node_address() -> str:
    """The address a real node reports (InternalIP) and its kubelet serves on: the one this
    machine's default route leaves from (a kubelet refuses a loopback node IP). No packet is
    sent: connecting a UDP socket only picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # TEST-NET-2: routed, never reached
            address = str(s.getsockname()[0])
        except OSError as e:
            raise DevClusterError(f"the real node needs a non-loopback address: {e}") from None
    if address.startswith("127."):
        raise DevClusterError("the real node needs a non-loopback address; this machine has none")
    return address


def _nvidia_runtime(d: Path, nvidia: Path) -> None:
    """NVIDIA's container runtime for the RuntimeClass `nvidia`: CDI mode, its config and the
    node's CDI specs in the node's folder (a wrapper points it there), runc beneath."""
    folder = d / "nvidia"
    (folder / "config" / "nvidia-container-runtime").mkdir(parents=True, exist_ok=True)
    (d / "cdi").mkdir(exist_ok=True)
    (folder / "config" / "nvidia-container-runtime" / "config.toml").write_text(
        f"""[nvidia-container-runtime]
debug = "{folder / "runtime.log"}"
log-level = "info"
mode = "cdi"
runtimes = ["runc"]

[nvidia-container-runtime.modes.cdi]
default-kind = "nvidia.com/gpu"
spec-dirs = ["{d / "cdi"}"]
annotation-prefixes = ["cdi.k8s.io/"]

[nvidia-ctk]
path = "{nvidia / "nvidia-ctk"}"
"""
    )
    wrapper = folder / "nvidia-container-runtime"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'XDG_CONFIG_HOME="{folder / "config"}" PATH="{nvidia}:$PATH" '
        f'exec "{nvidia / "nvidia-container-runtime"}" "$@"\n'
    )
    wrapper.chmod(0o755)


def _containerd_config(d: Path) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{d / "containerd" / "root"}"
state = "{d / "containerd" / "state"}"

[grpc]
  address = "{Path(SOCKETS) / "containerd" / "containerd.sock"}"

[ttrpc]
  address = ""

[debug]
  address = ""

[{cri}]
  sandbox_image = "{images.PAUSE}"
  # no CAP_SYS_RESOURCE here: the pod sandbox's -998 cannot be set, keep the runtime's own
  restrict_oom_score_adj = true
  # the pods' network namespaces in the node's folder, unmounted with it when the node stops
  netns_mounts_under_state_dir = true
  [{cri}.containerd]
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
    # the RuntimeClass `nvidia`: NVIDIA's container runtime in CDI mode over runc
    [{cri}.containerd.runtimes.nvidia]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.nvidia.options]
        BinaryName = "{d / "nvidia" / "nvidia-container-runtime"}"
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{d / "cni"}"
"""


def _pod_network(d: Path) -> dict[str, Any]:
    """The node's CNI network: a bridge whose address is the pods' gateway (the pods reach this
    machine's addresses, the `kubernetes` Service's among them), host-local leases kept in the
    node's folder, portmap for hostPort; no masquerading, nothing routed beyond the machine."""
    return {
        "cniVersion": "0.4.0",
        "name": "mig-agent-real-node",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(d / "cni" / "leases"),
                },
            },
            *([{"type": "portmap", "capabilities": {"portMappings": True}}] if _portmap() else []),
        ],
    }


def _kubelet_config(
    d: Path, socket: Path, address: str, port: int, healthz_port: int, ca_cert: Path
) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "failCgroupV1": False,
        "containerRuntimeEndpoint": f"unix://{socket}",
        "enforceNodeAllocatable": [],
        "address": address,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        # as on a real node: callers (the API server, for logs and exec) show a certificate of
        # the cluster's CA, and the API server says what they may do
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca_cert)},
        },
        "authorization": {"mode": "Webhook"},
        "podLogsDir": str(d / "pod-logs"),
        "resolvConf": "",
        # a test machine's disk may be fuller than a node's: no eviction or image GC for it
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "nodeStatusUpdateFrequency": "2s",
        "syncFrequency": "5s",
    }


def _ctr(node: RealNode, *args: str) -> str:
    done = subprocess.run(
        ["ctr", "--address", str(node.containerd_socket), "-n", "k8s.io", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise DevClusterError(f"ctr {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def start(
    cluster: Cluster, name: str, *, gpus: str = "", driver_root: str = "", timeout: float = 120.0
) -> RealNode:
    """Start containerd and a kubelet for node `name`, import the images, and return once the
    Node is Ready; with `gpus` (`2xH100-80GB`), also the node's GPU simulator, the device plugin's
    image and the node labels its DaemonSet selects; with `driver_root` instead, the machine's
    real GPUs and driver (scripts/real-gpu-node): a CDI spec NVIDIA's `nvidia-ctk` generates
    from it, and the device plugin's image without a library of its own. Raises
    DevClusterError naming what is missing or what failed."""
    if gpus and driver_root:
        raise DevClusterError("a real node has simulated GPUs or a real driver, not both")
    missing = missing_tools()
    kubelet_bin = find_binaries() / "kubelet"
    if not kubelet_bin.exists():
        missing.append(f"{kubelet_bin} (scripts/k8s-binaries build)")
    if missing:
        raise DevClusterError(f"the real node needs: {', '.join(missing)}")
    if os.geteuid() != 0:
        raise DevClusterError("the real node runs containerd and a kubelet: run as root")
    others = running_kubelets()
    if others:
        raise DevClusterError(
            f"a kubelet already runs here (pid {others[0]}): one real node per machine"
        )
    _clear_kubelet_root()
    d = cluster.node_dir(name)
    for sub in ("containerd", "cni", "pod-logs"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    shutil.rmtree(SOCKETS, ignore_errors=True)  # no kubelet runs: an earlier node's, if any
    for sub in ("containerd", "gpu"):
        (Path(SOCKETS) / sub).mkdir(parents=True, exist_ok=True)
    (d / "containerd.toml").write_text(_containerd_config(d))
    _nvidia_runtime(d, nvidia_bin())
    _drop_pod_network()  # an earlier node's, if one was killed before it could clean up
    (d / "ip_forward").write_text(IP_FORWARD.read_text())  # the bridge plugin turns it on
    (d / "cni" / "10-pod-network.conflist").write_text(json.dumps(_pod_network(d)))
    logs = cluster.dir / "logs"
    containerd = spawn(
        f"containerd-{name}",
        [shutil.which("containerd") or "containerd", "--config", str(d / "containerd.toml")],
        logs / f"containerd-{name}.log",
    )
    port, healthz = free_ports(2)
    address = node_address()
    node = RealNode(name, str(d), containerd, containerd, port, gpus, driver_root=driver_root)
    try:
        proxy = _start_service_proxy(cluster, name, logs)
        node = dataclasses.replace(node, service_proxy=proxy)
        library = sim_nvml() if gpus else None
        if library is not None:
            node = _start_gpus(node, logs)
            node = _start_cdi_writer(node, library, logs)
        if driver_root:
            _real_cdi_spec(node, Path(driver_root))
        wait_until(
            lambda: _alive_or_raise(containerd, logs) and node.containerd_socket.is_socket(),
            timeout=30,
            what=f"containerd of {name} to listen",
        )
        wanted = images.all_images()
        if library is not None or driver_root:
            wanted.append(images.nvidia_plugin(nvidia_bin(), library))
        if driver_root:
            wanted.append(images.gpu_workload())
        for image in wanted:
            import_image(node, image)
        (d / "kubelet.yaml").write_text(
            json.dumps(
                _kubelet_config(d, node.containerd_socket, address, port, healthz, cluster.ca_cert),
                indent=1,
            )
        )
        kubelet = _spawn_kubelet(cluster, node, address)
        node = dataclasses.replace(node, kubelet=kubelet)
        (d / RECORD).write_text(json.dumps(asdict(node)))
        wait_until(
            lambda: _alive_or_raise(kubelet, logs) and _ready(cluster, name),
            timeout=timeout,
            what=f"real node {name} to be Ready",
        )
        labels: dict[str, str] = {REAL_NODE_LABEL: "true"}
        if gpus or driver_root:
            labels["nvidia.com/gpu.deploy.device-plugin"] = "true"
        cluster.api.request(
            "PATCH",
            f"/api/v1/nodes/{name}",
            {"metadata": {"labels": labels}},
            content_type="application/merge-patch+json",
        )
    except BaseException:
        stop_node(node)
        raise
    return node


def _spawn_kubelet(cluster: Cluster, node: RealNode, address: str) -> Proc:
    d = Path(node.dir)
    return spawn(
        f"kubelet-{node.name}",
        [
            str(find_binaries() / "kubelet"),
            f"--config={d / 'kubelet.yaml'}",
            f"--kubeconfig={cluster.kubeconfig}",
            f"--root-dir={node.root_dir}",
            f"--hostname-override={node.name}",
            f"--node-ip={address}",
            "--v=1",
        ],
        cluster.dir / "logs" / f"kubelet-{node.name}.log",
    )


def restart_kubelet(
    cluster: Cluster, node: RealNode, *, down_s: float = 0.0, timeout: float = 120.0
) -> RealNode:
    """Stop the node's kubelet (SIGTERM), as an upgrade or a crash of it would, and start it
    again `down_s` later; its pods' containers run on under containerd meanwhile. Returns the
    node with its new kubelet once the Node is Ready again."""
    stop([node.kubelet])
    time.sleep(down_s)
    since = time.time() - 1  # the API server's heartbeat stamps have whole seconds
    kubelet = _spawn_kubelet(cluster, node, node_address())
    node = dataclasses.replace(node, kubelet=kubelet)
    (Path(node.dir) / RECORD).write_text(json.dumps(asdict(node)))
    logs = cluster.dir / "logs"
    wait_until(
        lambda: _alive_or_raise(kubelet, logs) and _ready(cluster, node.name, since=since),
        timeout=timeout,
        what=f"real node {node.name} to be Ready again",
    )
    return node


def import_image(node: RealNode, image: images.Image) -> None:
    """Make `image` present in the node's containerd (pods use it with imagePullPolicy: Never)."""
    _ctr(node, "images", "import", "--base-name", image.base_name, str(image.tar))


def _start_service_proxy(cluster: Cluster, name: str, logs: Path) -> Proc:
    """The `kubernetes` Service's ClusterIP on the loopback interface, forwarded to the API
    server (no kube-proxy runs here): what an in-cluster client of the node dials."""
    ip = pki.KUBERNETES_SERVICE_IP
    subprocess.run(["ip", "addr", "add", f"{ip}/32", "dev", "lo"], capture_output=True, check=False)
    server = cluster.server.removeprefix("https://")
    argv = [sys.executable, "-m", "migsim.cluster.service_proxy", "--listen", f"{ip}:443"]

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex((ip, 443)) == 0

    return _spawn_ready(
        f"service-proxy-{name}",
        [*argv, "--to", server],
        logs,
        listening,
        what="the kubernetes Service's forwarder",
        timeout=15,
    )


def sim_nvml() -> Path:
    """The folder of the simulated libnvidia-ml.so.1 (scripts/sim-nvml build)."""
    return scripts.built("sim-nvml")


def _start_gpus(node: RealNode, logs: Path) -> RealNode:
    """The node's simulated GPUs: state file (kept if it exists), host view, simulator."""
    if not node.sim_state.exists():
        simstate.create_node(node.sim_state, gpus=node.gpus, name=node.name)
    node.nvml_socket.parent.mkdir(parents=True, exist_ok=True)
    node.nvml_socket.unlink(missing_ok=True)
    hostview = [sys.executable, "-m", "migsim.nvml.hostview", "--state", str(node.sim_state)]
    done = subprocess.run(
        [*hostview, "--out", str(node.host_view)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise DevClusterError(f"host view of {node.name}: {done.stderr.strip()}")
    argv = [sys.executable, "-m", "migsim.nvml.server", "--state", str(node.sim_state)]
    simulator = _spawn_ready(
        f"gpu-simulator-{node.name}",
        [*argv, "--socket", str(node.nvml_socket)],
        logs,
        node.nvml_socket.is_socket,
        what=f"the GPU simulator of {node.name} to listen",
        timeout=30,
    )
    return dataclasses.replace(node, simulator=simulator)


def _start_cdi_writer(node: RealNode, library: Path, logs: Path) -> RealNode:
    """The node's CDI spec, written before any container may ask for it and kept current with
    the GPUs while the node runs."""
    argv = [
        sys.executable,
        "-m",
        "migsim.cluster.cdi",
        "--state",
        str(node.sim_state),
        "--out",
        str(node.cdi_spec),
        "--sim-nvml",
        str(library),
        "--socket",
        str(node.nvml_socket),
    ]
    writer = _spawn_ready(
        f"cdi-writer-{node.name}",
        argv,
        logs,
        node.cdi_spec.exists,
        what=f"the CDI spec of {node.name}",
        timeout=15,
    )
    return dataclasses.replace(node, cdi_writer=writer)


def _real_cdi_spec(node: RealNode, driver_root: Path) -> None:
    """The node's CDI spec for the machine's real GPUs, as the GPU Operator's toolkit writes it:
    `nvidia-ctk cdi generate` over the driver root (its NVML lists the GPUs and MIG devices)."""
    tools = nvidia_bin()
    done = subprocess.run(
        [
            str(tools / "nvidia-ctk"),
            "cdi",
            "generate",
            f"--driver-root={driver_root}",
            "--dev-root=/",
            f"--nvidia-cdi-hook-path={tools / 'nvidia-cdi-hook'}",
            f"--output={node.cdi_spec}",
            "--format=json",
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "LD_LIBRARY_PATH": str(driver_root / "lib64")},
    )
    if done.returncode != 0 or not node.cdi_spec.exists():
        raise DevClusterError(f"nvidia-ctk cdi generate failed: {done.stderr.strip()[-2000:]}")


def _spawn_ready(
    name: str, argv: list[str], logs: Path, ready: Callable[[], bool], *, what: str, timeout: float
) -> Proc:
    """Start `argv` as process `name` (its log in `logs`) and return it once `ready()`; stopped
    again if it exits or is not ready in time (DevClusterError, naming `what`)."""
    proc = spawn(name, argv, logs / f"{name}.log")
    try:
        wait_until(lambda: _alive_or_raise(proc, logs) and ready(), timeout=timeout, what=what)
    except BaseException:
        stop([proc])
        raise
    return proc


def device_plugin_daemonset(node: RealNode, mig_strategy: str = "mixed") -> dict[str, Any]:
    """NVIDIA's device plugin as the real node's DaemonSet: its pods carry the label the agent
    selects plugin pods by (PLUGIN_LABEL), run privileged (a mount namespace shows the host view
    at /proc/driver/nvidia-caps and /sys/bus/pci/devices) and reach the node's GPU simulator and
    the kubelet's device-plugin folder through hostPath volumes."""
    key, value = PLUGIN_LABEL.split("=")
    labels = {key: value, REAL_NODE_LABEL: "true"}

    def host_path(name: str, path: Path) -> dict[str, Any]:
        return {"name": name, "hostPath": {"path": str(path), "type": "DirectoryOrCreate"}}

    pod = _real_driver_pod(node, mig_strategy) if node.driver_root else None

    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "nvidia-device-plugin-real-node", "namespace": PLUGIN_NS},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": pod
                or {
                    "nodeSelector": {
                        "nvidia.com/gpu.deploy.device-plugin": "true",
                        REAL_NODE_LABEL: "true",
                    },
                    "tolerations": [{"operator": "Exists"}],
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "nvidia-device-plugin",
                            "image": images.NVIDIA_PLUGIN,
                            "imagePullPolicy": "Never",
                            "command": [
                                "/usr/local/bin/enter-host-view",
                                str(node.host_view),
                                "/usr/bin/nvidia-device-plugin",
                                f"--mig-strategy={mig_strategy}",
                            ],
                            "env": [
                                {"name": "HOST_VIEW_KUBELET", "value": "real"},
                                {
                                    "name": "MIG_AGENT_SIM_NVML_SOCKET",
                                    "value": str(node.nvml_socket),
                                },
                            ],
                            "securityContext": {"privileged": True},
                            "volumeMounts": [
                                {
                                    "name": "device-plugins",
                                    "mountPath": "/var/lib/kubelet/device-plugins",
                                },
                                {"name": "host-view", "mountPath": str(node.host_view)},
                                {
                                    "name": "gpu-simulator",
                                    "mountPath": str(node.nvml_socket.parent),
                                },
                            ],
                        }
                    ],
                    "volumes": [
                        host_path("device-plugins", node.device_plugin_dir),
                        host_path("host-view", node.host_view),
                        host_path("gpu-simulator", node.nvml_socket.parent),
                    ],
                },
            },
        },
    }


def _real_driver_pod(node: RealNode, mig_strategy: str) -> dict[str, Any]:
    """The device plugin's pod over a real driver: its NVML is the driver's library (the root's
    lib64, mounted), its devices the machine's (privileged); no host view, no simulator."""
    lib64 = str(Path(node.driver_root) / "lib64")
    return {
        "nodeSelector": {"nvidia.com/gpu.deploy.device-plugin": "true", REAL_NODE_LABEL: "true"},
        "tolerations": [{"operator": "Exists"}],
        "terminationGracePeriodSeconds": 5,
        "containers": [
            {
                "name": "nvidia-device-plugin",
                "image": images.NVIDIA_PLUGIN,
                "imagePullPolicy": "Never",
                "command": ["/usr/bin/nvidia-device-plugin", f"--mig-strategy={mig_strategy}"],
                "env": [{"name": "LD_LIBRARY_PATH", "value": lib64}],
                "securityContext": {"privileged": True},
                "volumeMounts": [
                    {"name": "device-plugins", "mountPath": "/var/lib/kubelet/device-plugins"},
                    {"name": "driver", "mountPath": lib64, "readOnly": True},
                ],
            }
        ],
        "volumes": [
            {"name": "device-plugins", "hostPath": {"path": str(node.device_plugin_dir)}},
            {"name": "driver", "hostPath": {"path": lib64, "type": "Directory"}},
        ],
    }


def _processes() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, argv) of every process this machine runs."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                yield int(entry.name), (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue


def running_kubelets() -> list[int]:
    return [
        pid for pid, argv in _processes() if argv[0].endswith(b"/kubelet") or argv[0] == b"kubelet"
    ]


def _unmount_under(prefix: str) -> None:
    prefix = prefix.rstrip("/") + "/"
    mounts = [
        line.split()[4]
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if line.split()[4].startswith(prefix)
    ]
    for point in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def _clear_kubelet_root() -> None:
    """Empty the kubelet's root (no kubelet runs): the device manager's checkpoint an earlier
    real node left there would give this one's kubelet that node's resources (at 0) until they
    time out, and its pods' folders would be cleaned up as orphans."""
    _unmount_under(KUBELET_ROOT)
    plugins = Path(KUBELET_DEVICE_PLUGINS)
    plugins.mkdir(parents=True, exist_ok=True)
    # the device-plugin folder itself stays: the kwok nodes' runtimes mount a tmpfs of their own
    # on it in their mount namespaces, which removing it would detach
    for entry in Path(KUBELET_ROOT).iterdir():
        if entry != plugins:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    for entry in plugins.iterdir():
        if not entry.is_dir():
            entry.unlink(missing_ok=True)


def install_device_plugin(cluster: Cluster, node: RealNode) -> None:
    """What the GPU Operator leaves for the node: the RuntimeClass `nvidia`, the namespace and
    the real node's device-plugin DaemonSet (idempotent)."""
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": PLUGIN_NS}}
    for manifest in (NVIDIA_RUNTIME_CLASS, namespace, device_plugin_daemonset(node)):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))


def _alive_or_raise(proc: Proc, logs: Path) -> bool:
    if not proc.alive():
        tail = (logs / f"{proc.name}.log").read_text(errors="replace").splitlines()[-20:]
        raise DevClusterError(f"{proc.name} exited:\n" + "\n".join(tail))
    return True


def _ready(cluster: Cluster, name: str, *, since: float = 0.0) -> bool:
    """Whether the Node is Ready, by a kubelet heartbeat at `since` (epoch seconds) or later."""
    try:
        node = cluster.api.get(f"/api/v1/nodes/{name}")
    except Exception:  # noqa: BLE001 - not registered yet
        return False
    conditions = node.get("status", {}).get("conditions") or []
    return any(
        c["type"] == "Ready"
        and c["status"] == "True"
        and _epoch(c.get("lastHeartbeatTime") or "") >= since
        for c in conditions
    )


def _epoch(stamp: str) -> float:
    try:
        return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def load(cluster: Cluster, name: str) -> RealNode | None:
    record = cluster.node_dir(name) / RECORD
    if not record.exists():
        return None
    raw = json.loads(record.read_text())
    procs = {
        key: Proc(**raw[key]) if raw.get(key) else None
        for key in ("simulator", "service_proxy", "cdi_writer")
    }
    return RealNode(
        raw["name"],
        raw["dir"],
        Proc(**raw["containerd"]),
        Proc(**raw["kubelet"]),
        raw["kubelet_port"],
        raw.get("gpus", ""),
        **procs,
        driver_root=raw.get("driver_root", ""),
    )


def _shims(socket: Path) -> list[int]:
    """PIDs of the containerd shims that serve this node's containerd."""
    return [
        pid
        for pid, argv in _processes()
        if argv[0].endswith(b"containerd-shim-runc-v2") and str(socket).encode() in argv
    ]


def _children(pid: int) -> list[int]:
    return [child for child, _ in _processes() if parent_pid(child) == pid]


def _kill_tree(pid: int) -> None:
    for child in _children(pid):
        _kill_tree(child)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def stop_node(node: RealNode) -> None:
    """Stop the kubelet, the node's containers and shims, containerd; unmount what they left
    under the node's folder (the kubelet's pod volumes, containers' root filesystems, the pods'
    network namespaces); remove the pod network's traces on the machine."""
    stop([node.kubelet])
    for shim in _shims(node.containerd_socket):
        _kill_tree(shim)
    stop([node.containerd])
    _unmount_under(node.dir)
    deadline = time.monotonic() + 5
    while _shims(node.containerd_socket) and time.monotonic() < deadline:
        time.sleep(0.1)
    stop([p for p in (node.simulator, node.service_proxy, node.cdi_writer) if p is not None])
    shutil.rmtree(SOCKETS, ignore_errors=True)
    if node.service_proxy is not None:
        ip = pki.KUBERNETES_SERVICE_IP
        subprocess.run(
            ["ip", "addr", "del", f"{ip}/32", "dev", "lo"], capture_output=True, check=False
        )
    _clear_kubelet_root()
    _drop_pod_network()
    saved = Path(node.dir) / "ip_forward"
    if saved.exists():
        with contextlib.suppress(OSError):
            IP_FORWARD.write_text(saved.read_text())
        saved.unlink()


def _drop_pod_network() -> None:
    """Remove what the node's CNI plugins leave on the machine once its pods are gone: the bridge
    (the pods' veth ends went with their namespaces) and portmap's iptables chains (``CNI-``,
    in the nat table; no other CNI user runs here: one real node per machine)."""
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)
    if shutil.which("iptables") is None:
        return
    rules = subprocess.run(
        ["iptables", "-t", "nat", "-S"], capture_output=True, text=True, check=False
    ).stdout.splitlines()
    for rule in rules:  # the jumps into the chains first, then the chains
        if rule.startswith("-A ") and " -j CNI-" in rule:
            argv = ["iptables", "-t", "nat", "-D", *shlex.split(rule)[1:]]
            subprocess.run(argv, capture_output=True, check=False)
    for rule in rules:
        if rule.startswith("-N CNI-"):
            for flag in ("-F", "-X"):
                argv = ["iptables", "-t", "nat", flag, rule.split()[1]]
                subprocess.run(argv, capture_output=True, check=False)
