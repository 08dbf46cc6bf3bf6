"""NVIDIA's MIG Manager on the local cluster: per GPU node, `nvidia-mig-manager` as its DaemonSet
would run it, over the node's simulated GPUs -- a test tool for side-by-side benchmarks.

Per node, `start_node` starts three processes (each in its own process group, see processes.py):

* a `dbus-daemon` with a config of its own, listening at
  `<node dir>/host/run/dbus/system_bus_socket`: MIG Manager connects to the host's systemd over
  the system bus at `<HOST_ROOT_MOUNT>/run/dbus/system_bus_socket` before every reconfiguration,
  and fails it without one (sim/NVML-SURVEY.md section 4.2). A plain bus is enough: it calls
  systemd only with `--with-shutdown-host-gpu-clients` or a host state file, neither used here;
* the device plugin, of the kind `agents.start_node` runs: `simulated` (the home-made model,
  `python -m migsim device-plugin`) or `nvidia` (NVIDIA's plugin and GFD under the node runtime,
  migsim.node_runtime), each as the kubelet's side too (PodResources socket), so GPU pods get
  devices and hold simulated processes on them. A side-by-side comparison gives both pools the
  same kind. `none` on a real node (real_node.py), whose kubelet runs NVIDIA's plugin as its
  DaemonSet's pod;
* `nvidia-mig-manager` under `scripts/with-sim-gpus --host-view <state>` (simulated
  libnvidia-ml.so.1, /proc/modules and /sys/bus/pci/devices of the simulated GPUs, simulated
  `nvidia-smi -r`), with `nvidia-mig-parted` on PATH, the cluster's admin kubeconfig (a test tool:
  no RBAC story here), CONFIG_FILE = one mig-parted config file (MIG Manager reads one file: give
  the same file to mig-agent for a fair comparison), and DEFAULT_GPU_CLIENTS_NAMESPACE = the
  namespace of the device plugin's DaemonSet, whose pod it waits for to go once it has paused it.

`kill_manager` SIGKILLs MIG Manager's process group (nvidia-mig-manager, the mig-parted run it
waits for, the node's NVML simulator under it), as a container that crashes or is OOM-killed
goes; `restart_manager` starts it again with the same settings, as its DaemonSet's kubelet
would (nothing restarts it by itself: the caller waits the kubelet's back-off if it wants to).
`start_node`'s `kubeconfig` lets MIG Manager reach the API server through something else (e.g.
a counting proxy, api_faults.py; `admin_kubeconfig` writes one with the admin token for any
server URL).

Needs root (the private mount namespace of --host-view) and NVIDIA's binaries
(`scripts/nvidia-binaries build`). Records go to `<cluster dir>/mig-managers.json`, so
`stop_node`/`stop_all` work from another process too.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import kubeconfig as kubeconfig_file
from . import scripts
from .agents import PLUGIN_NS, REPO, sim_state, start_device_plugin
from .cluster import Cluster
from .errors import DevClusterError
from .processes import Proc, spawn, stop
from .records import RecordFile, kill_one, procs

WITH_SIM_GPUS = REPO / "scripts" / "with-sim-gpus"
DBUS_DAEMON = "/usr/bin/dbus-daemon"
RECORDS = RecordFile("mig-managers.json", lock=".mig-managers.json.lock")

_DBUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_type="method_call"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>
</busconfig>
"""


@dataclass(frozen=True, slots=True)
class NodeMigManager:
    node: str
    mig_manager: Proc
    dbus: Proc
    device_plugin: Proc | None  # None: the node's own (a real node's DaemonSet)
    sim_state: str
    config_file: str
    log: str
    manager_env: dict[str, str] | None = None  # MIG Manager's own settings, for a restart
    manager_argv: list[str] | None = None


def nvidia_bin_dir() -> Path:
    """The folder of NVIDIA's binaries (built once by scripts/nvidia-binaries, then cached)."""
    return scripts.built("nvidia-binaries")


def start_node(
    cluster: Cluster,
    node: str,
    config_file: Path,
    *,
    sim: Mapping[str, Any] | None = None,
    bin_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    device_plugin: str = "simulated",
    kubeconfig: Path | None = None,
) -> NodeMigManager:
    """Start MIG Manager (with its D-Bus and a device plugin) on `node`.

    `config_file`: the mig-parted config (one file); `sim`: options of the node's simulated GPUs
    when they are first created (as agents.start_node); `bin_dir`: NVIDIA's binaries (default:
    build or find them); `env`: more environment for nvidia-mig-manager (e.g. WITH_REBOOT);
    `device_plugin`: `simulated` or `nvidia` (as agents.start_node's), or `none` where the node
    runs its own (a real node); `kubeconfig`: MIG Manager's (default the cluster's admin
    kubeconfig).
    """
    if device_plugin not in ("simulated", "nvidia", "none"):
        raise DevClusterError(
            f"device plugin {device_plugin!r}: expected simulated, nvidia or none"
        )
    if os.geteuid() != 0:
        raise DevClusterError(
            "MIG Manager runs in a private mount namespace (with-sim-gpus --host-view): run as root"
        )
    if not Path(DBUS_DAEMON).exists():
        raise DevClusterError(f"{DBUS_DAEMON} is missing (package dbus)")
    bin_dir = bin_dir or nvidia_bin_dir()
    state = sim_state(cluster, node, sim)
    logs = cluster.dir / "logs"
    host = cluster.node_dir(node) / "host"
    bus_dir = host / "run" / "dbus"
    bus_dir.mkdir(parents=True, exist_ok=True)
    socket = bus_dir / "system_bus_socket"
    socket.unlink(missing_ok=True)
    if len(str(socket)) >= 108:  # sun_path
        raise DevClusterError(f"D-Bus socket path too long for a unix socket: {socket}")
    dbus_config = cluster.node_dir(node) / "dbus-system.conf"
    dbus_config.write_text(_DBUS_CONFIG.format(socket=socket))
    started: list[Proc] = []
    try:
        dbus = spawn(
            f"dbus-daemon@{node}",
            [DBUS_DAEMON, f"--config-file={dbus_config}", "--nofork", "--nopidfile", "--nosyslog"],
            logs / f"dbus-{node}.log",
        )
        started.append(dbus)
        _wait_for(
            lambda: socket.exists(),
            dbus,
            f"dbus-daemon@{node} opened no socket",
            logs / f"dbus-{node}.log",
        )
        base_env = _base_env()
        plugin = None
        if device_plugin != "none":
            plugin = start_device_plugin(
                cluster, node, device_plugin, state, base_env, bin_dir=bin_dir
            )
            started.append(plugin)
        log = logs / f"mig-manager-{node}.log"
        own_env = {
            "PATH": f"{bin_dir}:{base_env.get('PATH', '/usr/bin:/bin')}",
            "KUBECONFIG": str(kubeconfig or cluster.kubeconfig),
            "NODE_NAME": node,
            "CONFIG_FILE": str(Path(config_file).resolve()),
            "HOST_ROOT_MOUNT": str(host),
            "DEFAULT_GPU_CLIENTS_NAMESPACE": PLUGIN_NS,
            **dict(env or {}),
        }
        argv = [
            str(WITH_SIM_GPUS),
            "--host-view",
            str(state),
            "--",
            str(bin_dir / "nvidia-mig-manager"),
        ]
        manager = spawn(f"mig-manager@{node}", argv, log, env={**base_env, **own_env})
        started.append(manager)
    except BaseException:
        stop(list(reversed(started)))
        raise
    record = NodeMigManager(
        node, manager, dbus, plugin, str(state), str(config_file), str(log), own_env, argv
    )
    RECORDS.put(cluster.dir, node, asdict(record))
    return record


def admin_kubeconfig(cluster: Cluster, path: Path, server: str) -> Path:
    """A kubeconfig at `path` with the cluster's admin token (what MIG Manager uses here by
    default) for API server URL `server`: one that goes through a proxy, which cannot pass the
    admin kubeconfig's client certificate on."""
    return kubeconfig_file.write(
        path, server=server, ca_cert=cluster.ca_cert, user="admin", token=cluster.admin_token
    )


def kill_manager(directory: Path, node: str) -> Proc | None:
    """SIGKILL MIG Manager's process group on `node` at once (a crashed container: the
    mig-parted run under way dies with it; no clean-up runs). The killed process, or None."""
    return kill_one(running(directory), node, "mig_manager")


def restart_manager(cluster: Cluster, node: str) -> NodeMigManager:
    """Start MIG Manager on `node` again with the settings it had (its D-Bus and device plugin
    keep running), as the DaemonSet's kubelet restarts a container that exited; a manager
    still running is stopped first."""
    with RECORDS.locked(cluster.dir):
        records = RECORDS.load(cluster.dir)
        record = records.get(node)
        if record is None or not record.get("manager_argv"):
            raise DevClusterError(f"no MIG Manager recorded for {node}; start it with start_node")
        stop([Proc(**record["mig_manager"])])
        base_env = _base_env()
        manager = spawn(
            f"mig-manager@{node}",
            record["manager_argv"],
            Path(record["log"]),
            env={**base_env, **record["manager_env"]},
        )
        record["mig_manager"] = asdict(manager)
        RECORDS.save(cluster.dir, records)
    return NodeMigManager(
        **{
            **record,
            "mig_manager": manager,
            "dbus": Proc(**record["dbus"]),
            "device_plugin": Proc(**record["device_plugin"]) if record["device_plugin"] else None,
        }
    )


def _base_env() -> dict[str, str]:
    """The environment of the node's processes: this one's, less mig-agent's settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIG_AGENT_")}
    env["MIG_AGENT_LOG_FORMAT"] = "json"
    return env


def _wait_for(
    ready: Callable[[], bool], proc: Proc, message: str, log: Path, timeout: float = 10.0
) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if not proc.alive() or time.monotonic() > deadline:
            tail = log.read_text()[-2000:] if log.exists() else ""
            stop([proc])
            raise DevClusterError(f"{message}; log:\n{tail}")
        time.sleep(0.02)


def _procs(record: Mapping[str, Any]) -> list[Proc]:
    """A record's processes in stopping order: MIG Manager, the device plugin, then the bus."""
    return procs(record, ("mig_manager", "device_plugin", "dbus"))


def running(directory: Path) -> dict[str, dict[str, Any]]:
    """The recorded MIG Managers per node."""
    return RECORDS.load(directory)


def stop_node(directory: Path, node: str) -> None:
    """Stop MIG Manager, the device plugin and the D-Bus daemon of `node`."""
    with RECORDS.locked(directory):
        records = RECORDS.load(directory)
        mine = records.pop(node, None)
        if mine is not None:
            stop(_procs(mine))
            shutil.rmtree(Path(mine["sim_state"]).parent / "host", ignore_errors=True)
        RECORDS.save(directory, records)


def stop_all(directory: Path) -> list[str]:
    """Stop every recorded MIG Manager node; names of the processes that needed SIGKILL."""
    with RECORDS.locked(directory):
        records = RECORDS.load(directory)
        killed = stop([p for r in records.values() for p in _procs(r)])
        RECORDS.save(directory, {})
    return killed
