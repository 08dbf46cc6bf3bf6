"""mig-agent on the local cluster: one agent and one simulated device plugin per GPU node.

`install` applies daemonset.yaml (namespace, ServiceAccount, RBAC, admission policy, profile
ConfigMap, DaemonSet) and a device-plugin DaemonSet in the GPU Operator's style. kwok "runs" their
pods on the simulated nodes; the real work is done by local processes started here: per node, an
agent (`mig-agent run`) authenticated with a token bound to that node's agent pod -- so it has the
DaemonSet ServiceAccount's rights and the node name the admission policy checks -- and a simulated
device plugin (`mig-agent sim-device-plugin`). Both share the node's simulated GPU state file.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mig_agent.settings import PROFILES as DEFAULT_PROFILES
from migsim.nvml import state as simstate

from .cluster import Cluster
from .errors import DevClusterError
from .processes import Proc, free_ports, kill, spawn, stop

REPO = Path(__file__).resolve().parents[3]
DAEMONSET = REPO / "daemonset.yaml"
PROFILES = DEFAULT_PROFILES  # the layouts shipped in the agent's package
AGENT_NS = AGENT_SA = "mig-agent"
PLUGIN_NS = "gpu-operator"
PLUGIN_LABEL = "app=nvidia-device-plugin-daemonset"

DEVICE_PLUGIN = {
    "apiVersion": "apps/v1", "kind": "DaemonSet",
    "metadata": {"name": "nvidia-device-plugin-daemonset", "namespace": PLUGIN_NS},
    "spec": {
        "selector": {"matchLabels": {"app": "nvidia-device-plugin-daemonset"}},
        "template": {
            "metadata": {"labels": {"app": "nvidia-device-plugin-daemonset"}},
            "spec": {
                # As the GPU Operator deploys it: pausing this label removes the pod.
                "nodeSelector": {"nvidia.com/gpu.deploy.device-plugin": "true"},
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
    device_plugin: Proc
    metrics_port: int
    sim_state: str
    kubeconfig: str


def install(cluster: Cluster) -> None:
    """Apply daemonset.yaml and the simulated device plugin's DaemonSet (idempotent)."""
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": PLUGIN_NS}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(ns))
    cluster.kubectl("apply", "-f", "-", input=json.dumps(DEVICE_PLUGIN))
    cluster.kubectl("apply", "-f", str(DAEMONSET))


def sim_state_path(cluster: Cluster, node: str) -> Path:
    return cluster.node_dir(node) / "gpu-state.json"


def _agent_pod(cluster: Cluster, node: str, timeout: float) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    path = (f"/api/v1/namespaces/{AGENT_NS}/pods?fieldSelector=spec.nodeName%3D{node}"
            "&labelSelector=app.kubernetes.io%2Fname%3Dmig-agent")
    while True:
        for item in cluster.api.get(path)["items"]:
            meta = item["metadata"]
            if not meta.get("deletionTimestamp"):
                return str(meta["name"]), str(meta["uid"])
        if time.monotonic() > deadline:
            raise DevClusterError(f"no mig-agent pod on {node} after {timeout:g} s")
        time.sleep(0.2)


def start_node(cluster: Cluster, node: str, *, settings: Mapping[str, str] | None = None,
               profiles: Path = PROFILES, timeout: float = 60.0,
               sim: Mapping[str, Any] | None = None,
               plugin_args: Sequence[str] = ()) -> NodeAgents:
    """Start the agent and the simulated device plugin of `node`; its GPUs from nodes/<node>/gpus.

    `settings` are MIG_AGENT_* environment variables for the agent (e.g. a short drain timeout);
    `sim` are options of the node's simulated GPUs when they are first created (e.g.
    `{"reset_supported": False}` for a pass-through VM); `plugin_args` are more flags of the
    simulated device plugin (e.g. `--mig-strategy single`, `--config-file FILE`).
    """
    state = sim_state_path(cluster, node)
    if not state.exists():
        spec = (cluster.node_dir(node) / "gpus").read_text().strip()
        simstate.create_node(state, gpus=spec, name=node, **dict(sim or {}))
    pod, uid = _agent_pod(cluster, node, timeout)
    kubeconfig = cluster.kubeconfig_for(AGENT_NS, AGENT_SA, cluster.node_dir(node) /
                                        "agent.kubeconfig", bound_pod=(pod, uid))
    port = free_ports(1)[0]
    logs = cluster.dir / "logs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIG_AGENT_")}
    env.update({"MIG_AGENT_LOG_FORMAT": "json", "MIG_AGENT_BACKOFF_S": "2",
                "MIG_AGENT_BACKOFF_MAX_S": "30", "MIG_AGENT_POLL_S": "0.2",
                "MIG_AGENT_EVICTION_RETRY_S": "1"})
    # The simulated device plugin plays the kubelet's PodResources API here, so the agent can
    # drain only the pods on GPUs that change.
    pod_resources = cluster.node_dir(node) / "pod-resources.sock"
    env.update(settings or {})
    agent_env = {"MIG_AGENT_POD_RESOURCES_SOCKET": str(pod_resources), **env}
    agent = spawn(f"mig-agent@{node}", [
        sys.executable, "-m", "mig_agent", "run", "--node", node, "--kubeconfig", str(kubeconfig),
        "--backend", "simulated", "--sim-state", str(state), "-f", str(profiles),
        "--metrics-port", str(port)], logs / f"agent-{node}.log", env=agent_env)
    plugin = spawn(f"device-plugin@{node}", [
        sys.executable, "-m", "migsim", "--log-format", "json", "device-plugin",
        "--node", node, "--kubeconfig", str(cluster.kubeconfig), "--sim-state", str(state),
        "--namespace", PLUGIN_NS, "--selector", PLUGIN_LABEL,
        "--pod-resources-socket", str(pod_resources), *plugin_args],
        logs / f"device-plugin-{node}.log",
        env=env)
    started = NodeAgents(node, agent, plugin, port, str(state), str(kubeconfig))
    _record(cluster.dir, started)
    return started


def stop_node(directory: Path, node: str) -> None:
    """Stop the agent and device plugin of `node` (SIGTERM, then SIGKILL)."""
    records = _load(directory)
    mine = records.pop(node, None)
    if mine is not None:
        stop([Proc(**mine["agent"]), Proc(**mine["device_plugin"])])
    _save(directory, records)


def kill_agent(directory: Path, node: str) -> None:
    """SIGKILL the agent of `node` at once, as a crash would: no clean-up runs."""
    mine = _load(directory).get(node)
    if mine is not None:
        kill(Proc(**mine["agent"]))


def stop_all(directory: Path) -> list[str]:
    records = _load(directory)
    procs = [Proc(**r[k]) for r in records.values() for k in ("agent", "device_plugin")]
    killed = stop(procs)
    _save(directory, {})
    return killed


def running(directory: Path) -> dict[str, dict[str, Any]]:
    return _load(directory)


def _record(directory: Path, started: NodeAgents) -> None:
    records = _load(directory)
    records[started.node] = asdict(started)
    _save(directory, records)


def _load(directory: Path) -> dict[str, dict[str, Any]]:
    try:
        data: dict[str, dict[str, Any]] = json.loads((directory / "agents.json").read_text())
        return data
    except (OSError, ValueError):
        return {}


def _save(directory: Path, records: Mapping[str, Any]) -> None:
    tmp = directory / "agents.json.tmp"
    tmp.write_text(json.dumps(records, indent=2) + "\n")
    tmp.replace(directory / "agents.json")
