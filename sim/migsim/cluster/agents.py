"""mig-agent on the local cluster: one agent and one device plugin (with what a kubelet does for
it) per GPU node.

`install` applies daemonset.yaml (namespace, ServiceAccount, RBAC, admission policy, profile
ConfigMap, DaemonSet) and a device-plugin DaemonSet in the GPU Operator's style. kwok "runs" their
pods on the simulated nodes; the real work is done by local processes started here: per node, an
agent (`mig-agent run`) authenticated with a token bound to that node's agent pod -- so it has the
DaemonSet ServiceAccount's rights and the node name the admission policy checks -- and a simulated
device plugin. Both share the node's simulated GPU state file. The device plugin is either

- `nvidia`: NVIDIA's own nvidia-device-plugin and gpu-feature-discovery (scripts/nvidia-binaries)
  over the node's simulated libnvidia-ml.so.1, under the node runtime (migsim.node_runtime, in
  `scripts/with-sim-gpus --host-view`: root only), which plays the kubelet's device manager and
  PodResources API and NFD; or
- `simulated`: the home-made model of it (`python -m migsim device-plugin`), which computes what
  NVIDIA's plugin would advertise and needs neither root nor NVIDIA's binaries; or
- `dra`: no device plugin, but NVIDIA's DRA kubelet plugin, as on a GPUCluster's node: the node
  is labelled for the DRA driver's DaemonSet (`install_dra`) and loses the device plugin's label,
  and a follower (dra_runtime.py; root only) runs gpu-kubelet-plugin while the node's pod runs.

The default is `nvidia` as root, `simulated` otherwise (MIG_AGENT_DEVICE_PLUGIN overrides it).

As a kubelet restarts a container that exits, a supervisor per node (`supervisor.py`) runs the
agent and restarts it with the kubelet's back-off (10 s doubling to 5 min; `start_node`'s
`restart_backoff` makes it shorter for tests): an agent that is killed comes back by itself.
`stop_node` and `stop_all` stop the supervisor first, so what is stopped on purpose stays stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from mig_agent.config.settings import PROFILES as DEFAULT_PROFILES
from migsim.nvml import state as simstate

# running and stop_all are this module's too: they are what its callers know it by
from . import dra_plugin, dra_runtime, scripts
from .agent_records import RECORDS, node_procs, reap_group, stop_dra_plugins, supervisor_status
from .agent_records import running as running
from .agent_records import stop_all as stop_all
from .cluster import Cluster
from .errors import DevClusterError
from .processes import Proc, free_ports, spawn, stop
from .records import kill_one, procs

KUBELET_BACKOFF = (10.0, 300.0)  # a kubelet's restart delay: first, cap (seconds)

REPO = Path(__file__).resolve().parents[3]
DAEMONSET = REPO / "daemonset.yaml"
PROFILES = DEFAULT_PROFILES  # the layouts shipped in the agent's package
AGENT_NS = AGENT_SA = "mig-agent"
PLUGIN_NS = "gpu-operator"
PLUGIN_LABEL = "app=nvidia-device-plugin-daemonset"
DEVICE_PLUGINS = ("nvidia", "simulated", "dra")
DEVICE_PLUGIN_NODE_LABEL = "nvidia.com/gpu.deploy.device-plugin"

DEVICE_PLUGIN = {
    "apiVersion": "apps/v1",
    "kind": "DaemonSet",
    "metadata": {"name": "nvidia-device-plugin-daemonset", "namespace": PLUGIN_NS},
    "spec": {
        "selector": {"matchLabels": {"app": "nvidia-device-plugin-daemonset"}},
        "template": {
            "metadata": {"labels": {"app": "nvidia-device-plugin-daemonset"}},
            "spec": {
                # As the GPU Operator deploys it: pausing this label removes the pod. Only on
                # kwok's nodes: a real node runs NVIDIA's plugin in a container (real_node.py).
                "nodeSelector": {DEVICE_PLUGIN_NODE_LABEL: "true", "type": "kwok"},
                "tolerations": [{"operator": "Exists"}],
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "device-plugin", "image": "registry.invalid/sim:1"}],
            },
        },
    },
}


@dataclass(frozen=True, slots=True)
class NodeAgents:
    node: str
    agent: Proc
    device_plugin: Proc  # for `dra`, the follower that runs NVIDIA's DRA plugin
    metrics_port: int
    sim_state: str
    kubeconfig: str
    supervisor: Proc | None = None  # restarts `agent` when it exits; None: not supervised
    status_file: str = ""  # the supervisor's status (supervisor.py)
    device_plugin_kind: str = "simulated"  # one of DEVICE_PLUGINS


# The GPU Operator creates it; daemonset.yaml runs the agent under it (runtimeClassName: nvidia),
# and without it the API server admits none of the agent's pods.
NVIDIA_RUNTIME_CLASS = {
    "apiVersion": "node.k8s.io/v1",
    "kind": "RuntimeClass",
    "metadata": {"name": "nvidia"},
    "handler": "nvidia",
}


def install(cluster: Cluster) -> None:
    """Apply daemonset.yaml, the simulated device plugin's DaemonSet and the nvidia RuntimeClass,
    as the GPU Operator leaves them (idempotent)."""
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": PLUGIN_NS}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(ns))
    cluster.kubectl("apply", "-f", "-", input=json.dumps(NVIDIA_RUNTIME_CLASS))
    cluster.kubectl("apply", "-f", "-", input=json.dumps(DEVICE_PLUGIN))
    cluster.kubectl("apply", "-f", str(DAEMONSET))
    grant_dra(cluster)


# What the chart adds where NVIDIA's DRA driver is installed (dra.enabled auto finds its
# DeviceClass; daemonset.yaml, rendered without a cluster, leaves DRA off): the agents here run
# with DRA on (the setting's default), so they may read slices and claims and write their device
# taints, and the admission policy lets them delete the DRA plugin's pod
DRA_READS: Final = [
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "mig-agent-dra-reads"},
        "rules": [
            {
                "apiGroups": ["resource.k8s.io"],
                "resources": ["resourceslices"],
                "verbs": ["list", "watch"],
            },
            {
                "apiGroups": ["resource.k8s.io"],
                "resources": ["resourceclaims"],
                "verbs": ["list"],
            },
            {  # on Kubernetes 1.37: the devices of changing GPUs tainted instead of a cordon
                "apiGroups": ["resource.k8s.io"],
                "resources": ["devicetaintrules"],
                "verbs": ["list", "create", "delete"],
            },
        ],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "mig-agent-dra-reads"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "mig-agent-dra-reads",
        },
        "subjects": [{"kind": "ServiceAccount", "name": AGENT_SA, "namespace": AGENT_NS}],
    },
]


def grant_dra(cluster: Cluster) -> None:
    """The agents' DRA rights and the admission policies rendered with DRA on (idempotent)."""
    for obj in DRA_READS:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    rendered = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "sync-daemonset"), "--policies"],
        env={**os.environ, "MIG_AGENT_DRA": "true"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cluster.kubectl("apply", "-f", "-", input=rendered)


def install_dra(cluster: Cluster) -> None:
    """Apply NVIDIA's DRA DeviceClasses and the DRA plugin's default DaemonSet (idempotent)."""
    dra_plugin.install_device_classes(cluster)
    dra_plugin.install_daemonset(cluster)


def make_dra_node(
    cluster: Cluster, node: str, *, label_value: str = "true", timeout: float = 30.0
) -> None:
    """Make `node` a DRA node as on a GPUCluster: the DRA driver's label set to `label_value`
    (what the DRA DaemonSets select), the device plugin's taken away, as the node-labeling
    controller deletes it (the driver cannot run beside the device plugin, reference/dra.md 5),
    and no `nvidia.com/` extended resource in the node's status (the kwok node's manifest
    advertises nvidia.com/gpu, which only a device plugin would). Returns once no pod of the
    device plugin's DaemonSet is left on the node."""
    labels = {dra_plugin.NODE_LABEL: label_value, DEVICE_PLUGIN_NODE_LABEL: None}
    cluster.api.request(
        "PATCH",
        f"/api/v1/nodes/{node}",
        {"metadata": {"labels": labels}},
        content_type="application/merge-patch+json",
    )
    status = cluster.api.get(f"/api/v1/nodes/{node}").get("status") or {}
    resources = {
        key: {r: None for r in status.get(key) or {} if r.startswith("nvidia.com/")}
        for key in ("capacity", "allocatable")
    }
    cluster.api.request(
        "PATCH",
        f"/api/v1/nodes/{node}/status",
        {"status": resources},
        content_type="application/merge-patch+json",
    )
    path = (
        f"/api/v1/namespaces/{PLUGIN_NS}/pods?fieldSelector=spec.nodeName%3D{node}"
        f"&labelSelector={PLUGIN_LABEL.replace('=', '%3D')}"
    )
    deadline = time.monotonic() + timeout
    while cluster.api.get(path)["items"]:
        if time.monotonic() > deadline:
            raise DevClusterError(f"the device plugin's pod is still on {node} after {timeout:g} s")
        time.sleep(0.2)


def sim_state_path(cluster: Cluster, node: str) -> Path:
    return cluster.node_dir(node) / "gpu-state.json"


def sim_state(cluster: Cluster, node: str, sim: Mapping[str, Any] | None = None) -> Path:
    """The node's simulated GPU state file, first created (GPUs from nodes/<node>/gpus, `sim`
    the options of the simulated GPUs) when it does not exist yet."""
    state = sim_state_path(cluster, node)
    if not state.exists():
        spec = (cluster.node_dir(node) / "gpus").read_text().strip()
        simstate.create_node(state, gpus=spec, name=node, **dict(sim or {}))
    return state


def _agent_pod(cluster: Cluster, node: str, timeout: float) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    path = (
        f"/api/v1/namespaces/{AGENT_NS}/pods?fieldSelector=spec.nodeName%3D{node}"
        "&labelSelector=app.kubernetes.io%2Fname%3Dmig-agent"
    )
    while True:
        for item in cluster.api.get(path)["items"]:
            meta = item["metadata"]
            if not meta.get("deletionTimestamp"):
                return str(meta["name"]), str(meta["uid"])
        if time.monotonic() > deadline:
            raise DevClusterError(f"no mig-agent pod on {node} after {timeout:g} s")
        time.sleep(0.2)


def default_device_plugin() -> str:
    """The device plugin of start_node when none is named: MIG_AGENT_DEVICE_PLUGIN if set, else
    NVIDIA's where it can run (root: private mount namespaces), else the simulated one."""
    kind = os.environ.get("MIG_AGENT_DEVICE_PLUGIN") or (
        "nvidia" if os.geteuid() == 0 else "simulated"
    )
    if kind not in DEVICE_PLUGINS:
        raise DevClusterError(
            f"MIG_AGENT_DEVICE_PLUGIN={kind!r}: expected one of {', '.join(DEVICE_PLUGINS)}"
        )
    return kind


def nvidia_bin() -> Path:
    """The folder of NVIDIA's binaries, as `scripts/nvidia-binaries path` reports it (it honours
    MIG_AGENT_NVIDIA_BIN); DevClusterError saying how to build them when they are missing."""
    return scripts.built(
        "nvidia-binaries",
        "path",
        failed="NVIDIA's device plugin is not built; run: scripts/nvidia-binaries build",
    )


def start_node(
    cluster: Cluster,
    node: str,
    *,
    settings: Mapping[str, str] | None = None,
    profiles: Path = PROFILES,
    timeout: float = 60.0,
    sim: Mapping[str, Any] | None = None,
    plugin_args: Sequence[str] = (),
    restart_backoff: tuple[float, float] = KUBELET_BACKOFF,
    device_plugin: str | None = None,
    dra_node_label_value: str = "true",
) -> NodeAgents:
    """Start the agent and the device plugin of `node`; its GPUs from nodes/<node>/gpus.

    `settings` are MIG_AGENT_* environment variables for the agent (e.g. a short drain timeout);
    `sim` are options of the node's simulated GPUs when they are first created (e.g.
    `{"reset_supported": False}` for a pass-through VM); `plugin_args` are more flags of the
    device plugin (both kinds take `--mig-strategy single` and `--config-file FILE`);
    `restart_backoff` is the agent's restart delay (first, cap) when it exits; `device_plugin`
    is `nvidia`, `simulated` or `dra` (default: default_device_plugin()). A `dra` node is labelled
    `nvidia.com/gpu.deploy.dra-driver=<dra_node_label_value>` (make_dra_node; another value picks
    another DaemonSet of dra_plugin.install_daemonset), and `plugin_args` go to NVIDIA's DRA
    plugin; install_dra first.
    """
    kind = device_plugin or default_device_plugin()
    if kind not in DEVICE_PLUGINS:
        raise DevClusterError(
            f"device plugin {kind!r}: expected one of {', '.join(DEVICE_PLUGINS)}"
        )
    if kind in ("nvidia", "dra") and os.geteuid() != 0:
        raise DevClusterError(
            "NVIDIA's plugins run in a private mount namespace "
            "(unshare -m): run as root, or use device_plugin='simulated'"
        )
    bin_dir = nvidia_bin() if kind == "nvidia" else None
    if kind == "dra":
        dra_plugin.dra_bin()  # said now if it is not built, not in the follower's log
        make_dra_node(cluster, node, label_value=dra_node_label_value, timeout=timeout)
    state = sim_state(cluster, node, sim)
    supervisor, agent, port, kubeconfig, status_file = _start_agent(
        cluster, node, settings, profiles, timeout, restart_backoff
    )
    if kind == "dra":
        plugin = dra_runtime.start(cluster, node, state, plugin_args=plugin_args)
    else:
        plugin = start_device_plugin(
            cluster, node, kind, state, _env(settings), plugin_args, bin_dir=bin_dir
        )
    started = NodeAgents(
        node, agent, plugin, port, str(state), str(kubeconfig), supervisor, str(status_file), kind
    )
    _record(cluster.dir, started)
    return started


def start_agent_only(
    cluster: Cluster,
    node: str,
    *,
    settings: Mapping[str, str] | None = None,
    profiles: Path = PROFILES,
    timeout: float = 60.0,
    restart_backoff: tuple[float, float] = KUBELET_BACKOFF,
) -> tuple[Proc, Proc]:
    """Start the agent of `node` alone, supervised, beside what runs there already (MIG
    Manager and its device plugin, for an agent in observe mode); not recorded: stop it with
    processes.stop([supervisor, agent]). (supervisor, agent)."""
    supervisor, agent, _, _, _ = _start_agent(
        cluster, node, settings, profiles, timeout, restart_backoff
    )
    return supervisor, agent


def start_device_plugin(
    cluster: Cluster,
    node: str,
    kind: str,
    state: Path,
    env: Mapping[str, str],
    plugin_args: Sequence[str] = (),
    *,
    bin_dir: Path | None = None,
) -> Proc:
    """Start the device plugin side of `node`: `nvidia`, NVIDIA's plugin and GFD under the node
    runtime (NVIDIA's binaries from `bin_dir`, default `nvidia_bin()`), or `simulated`, the
    project's plugin. Also used by mig_manager.py, so that both pools of a comparison run the
    same plugin the same way."""
    logs = cluster.dir / "logs"
    pod_resources = _pod_resources(cluster, node)
    if kind == "nvidia":
        argv = [
            str(REPO / "scripts" / "with-sim-gpus"),
            "--host-view",
            str(state),
            "--",
            sys.executable,
            "-m",
            "migsim.node_runtime",
            "--node",
            node,
            "--cluster-dir",
            str(cluster.dir),
            "--sim-state",
            str(state),
            "--nvidia-bin",
            str(bin_dir or nvidia_bin()),
            "--namespace",
            PLUGIN_NS,
            "--selector",
            PLUGIN_LABEL,
            "--pod-resources-socket",
            str(pod_resources),
            "--allocations-file",
            str(cluster.node_dir(node) / "allocations.json"),
            "--gfd",
            *plugin_args,
        ]
        return spawn(
            f"node-runtime@{node}",
            argv,
            logs / f"node-runtime-{node}.log",
            env={**env, "PYTHON": sys.executable},
        )
    return spawn(
        f"device-plugin@{node}",
        [
            sys.executable,
            "-m",
            "migsim",
            "--log-format",
            "json",
            "device-plugin",
            "--node",
            node,
            "--kubeconfig",
            str(cluster.kubeconfig),
            "--sim-state",
            str(state),
            "--namespace",
            PLUGIN_NS,
            "--selector",
            PLUGIN_LABEL,
            "--pod-resources-socket",
            str(pod_resources),
            *plugin_args,
        ],
        logs / f"device-plugin-{node}.log",
        env=env,
    )


def restart_agent(
    cluster: Cluster,
    node: str,
    *,
    settings: Mapping[str, str] | None = None,
    profiles: Path = PROFILES,
    timeout: float = 60.0,
    restart_backoff: tuple[float, float] = KUBELET_BACKOFF,
) -> NodeAgents:
    """Stop the agent of `node` (its supervisor first) and start it anew with these settings and
    profiles, as a rollout of the agent's DaemonSet does: the node's device plugin (and the node
    runtime, GFD) keeps running, as it does on a real node."""
    record = running(cluster.dir).get(node)
    if record is None:
        raise DevClusterError(f"no agent recorded for {node}; start it with start_node")
    stop(procs(record, ("supervisor", "agent")))
    supervisor, agent, port, kubeconfig, status_file = _start_agent(
        cluster, node, settings, profiles, timeout, restart_backoff
    )
    started = NodeAgents(
        node,
        agent,
        Proc(**record["device_plugin"]),
        port,
        str(sim_state_path(cluster, node)),
        str(kubeconfig),
        supervisor,
        str(status_file),
        record.get("device_plugin_kind", "simulated"),
    )
    _record(cluster.dir, started)
    return started


def _env(settings: Mapping[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIG_AGENT_")}
    # the local cluster's workloads (the tests', the demo's, the benchmarks') are bare pods:
    # its agents may evict them, where the agent's default refuses, as kubectl drain does
    env.update(
        {
            "MIG_AGENT_LOG_FORMAT": "json",
            "MIG_AGENT_BACKOFF_S": "2",
            "MIG_AGENT_BACKOFF_MAX_S": "30",
            "MIG_AGENT_POLL_S": "0.2",
            "MIG_AGENT_EVICTION_RETRY_S": "1",
            "MIG_AGENT_EVICT_UNMANAGED_PODS": "true",
        }
    )
    env.update(settings or {})
    return env


def _pod_resources(cluster: Cluster, node: str) -> Path:
    # The device plugin's side (the node runtime, or the simulated plugin) plays the kubelet's
    # PodResources API here, so the agent can drain only the pods on GPUs that change.
    return cluster.node_dir(node) / "pod-resources.sock"


def _start_agent(
    cluster: Cluster,
    node: str,
    settings: Mapping[str, str] | None,
    profiles: Path,
    timeout: float,
    restart_backoff: tuple[float, float],
) -> tuple[Proc, Proc, int, Path, Path]:
    """(supervisor, agent, metrics port, kubeconfig, supervisor status file) of a new agent."""
    state = sim_state_path(cluster, node)
    pod, uid = _agent_pod(cluster, node, timeout)
    kubeconfig = cluster.kubeconfig_for(
        AGENT_NS, AGENT_SA, cluster.node_dir(node) / "agent.kubeconfig", bound_pod=(pod, uid)
    )
    port = free_ports(1)[0]
    logs = cluster.dir / "logs"
    agent_env = {
        "MIG_AGENT_POD_RESOURCES_SOCKET": str(_pod_resources(cluster, node)),
        **_env(settings),
    }
    status_file = cluster.node_dir(node) / "agent-supervisor.json"
    status_file.unlink(missing_ok=True)
    supervisor = spawn(
        f"supervisor@{node}",
        [
            sys.executable,
            "-m",
            "migsim.cluster.supervisor",
            "--name",
            f"mig-agent@{node}",
            "--log",
            str(logs / f"agent-{node}.log"),
            "--status",
            str(status_file),
            "--backoff",
            str(restart_backoff[0]),
            "--backoff-max",
            str(restart_backoff[1]),
            "--",
            sys.executable,
            "-m",
            "mig_agent",
            "run",
            "--node",
            node,
            "--kubeconfig",
            str(kubeconfig),
            "--backend",
            "simulated",
            "--sim-state",
            str(state),
            "-f",
            str(profiles),
            "--metrics-port",
            str(port),
        ],
        logs / f"supervisor-{node}.log",
        env=agent_env,
    )
    return supervisor, _first_agent(supervisor, status_file), port, kubeconfig, status_file


def _first_agent(supervisor: Proc, status_file: Path, timeout: float = 30.0) -> Proc:
    deadline = time.monotonic() + timeout
    while True:
        agent = supervisor_status(status_file).get("agent")
        if agent:
            return Proc(**agent)
        if not supervisor.alive():
            raise DevClusterError(f"{supervisor.name} exited; see its log")
        if time.monotonic() > deadline:
            stop([supervisor])
            raise DevClusterError(f"{supervisor.name} started no agent in {timeout:g} s")
        time.sleep(0.02)


def stop_node(directory: Path, node: str) -> None:
    """Stop the agent (its supervisor first), device plugin or DRA follower and DRA plugin of
    `node` (SIGTERM, then SIGKILL)."""
    mine = running(directory).get(node)
    if mine is not None:
        stop(node_procs(mine))
        if mine.get("device_plugin"):
            reap_group(Proc(**mine["device_plugin"]))
    stop_dra_plugins(directory, node)  # a follower's plugin, or one left by a killed follower
    with RECORDS.locked(directory):
        RECORDS.save(directory, {n: r for n, r in RECORDS.load(directory).items() if n != node})


def kill_agent(directory: Path, node: str) -> Proc | None:
    """SIGKILL the agent of `node` at once, as a crash would: no clean-up runs. Its supervisor
    restarts it after the back-off. The killed process, or None if no agent runs."""
    return kill_one(running(directory), node, "agent")


def agent_state(record: Mapping[str, Any]) -> str:
    """`running`, `back-off` (exited; the supervisor restarts it soon) or `STOPPED` (nothing will
    restart it: the supervisor is gone)."""
    supervisor = record.get("supervisor")
    agent_alive = bool(record.get("agent")) and Proc(**record["agent"]).alive()
    if supervisor is None:  # not supervised
        return "running" if agent_alive else "STOPPED"
    if not Proc(**supervisor).alive():
        return "running" if agent_alive else "STOPPED"
    return "running" if agent_alive else "back-off"


def _record(directory: Path, started: NodeAgents) -> None:
    RECORDS.put(directory, started.node, asdict(started))
