"""Fixtures for end-to-end tests: simulated GPU nodes of the session's cluster, each with a real
agent process (under the DaemonSet's ServiceAccount, own-node admission policy active) and a
device plugin, as `scripts/local-cluster up` runs them: NVIDIA's own (`nvidia`, under the node
runtime; root only) or the home-made model of it (`simulated`). `agent_node(device_plugin=...)`
chooses per node; the default is agents.default_device_plugin() (MIG_AGENT_DEVICE_PLUGIN)."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from migsim.cluster import Cluster, agents
from migsim.nvml import state as simstate

REPO = Path(__file__).resolve().parents[2]
CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
REASON = "mig-agent.dev/reason"
# An agent that exits is restarted by its supervisor as a kubelet would, sooner than a kubelet's
# 10 s doubling to 5 min: tests wait for the restart.
RESTART_BACKOFF = (0.5, 5.0)
_ids = itertools.count()


@pytest.fixture(scope="session")
def installed(cluster: Cluster) -> Cluster:
    agents.install(cluster)
    if agents.default_device_plugin() != "nvidia" and "MIG_AGENT_DEVICE_PLUGIN" not in os.environ:
        # said out loud (warnings summary): these nodes do not run NVIDIA's plugin
        warnings.warn(
            "not root: the e2e nodes run the simulated device plugin, not NVIDIA's "
            "(test_nvidia_plugin.py skips)",
            stacklevel=1,
        )
    return cluster


_built: list[Path] = []


def nvidia_binaries() -> Path:
    """NVIDIA's binaries (scripts/nvidia-binaries build: once, cached); a test that needs them
    skips loudly when not root (the plugin runs in a private mount namespace)."""
    if os.geteuid() != 0:
        pytest.skip(
            "NVIDIA's device plugin runs in a private mount namespace (unshare -m): run as root"
        )
    if not _built:
        out = subprocess.run(
            [str(REPO / "scripts" / "nvidia-binaries"), "build"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert out.returncode == 0, f"scripts/nvidia-binaries build failed:\n{out.stderr}"
        _built.append(Path(out.stdout.strip()))
    return _built[0]


@dataclass
class AgentNode:
    name: str
    cluster: Cluster
    core: client.CoreV1Api
    procs: agents.NodeAgents
    known_agent: dict[str, Any] = field(default_factory=dict)  # the agent process last seen

    def __post_init__(self) -> None:
        self.known_agent = self.known_agent or asdict(self.procs.agent)

    @property
    def sim_state(self) -> str:
        return self.procs.sim_state

    def node(self) -> Any:
        return self.core.read_node(self.name)

    def labels(self) -> dict[str, str]:
        return dict(self.node().metadata.labels or {})

    def label(self, layout: str | None) -> None:
        self.core.patch_node(self.name, {"metadata": {"labels": {CONFIG: layout}}})

    def wait_state(self, *states: str, timeout: float = 60.0, seen: list[str] | None = None) -> str:
        """Poll until the state label is one of ``states``; every state seen goes to ``seen``."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.labels().get(STATE, "")
            if seen is not None and (not seen or seen[-1] != state):
                seen.append(state)
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.name}: state {state!r}, not {states} after "
                    f"{timeout} s; agent log:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def gpu_resources(self) -> dict[str, int]:
        alloc = self.node().status.allocatable or {}
        return {k: int(v) for k, v in alloc.items() if k.startswith("nvidia.com/") and int(v) > 0}

    def log_tail(self, lines: int = 30, *, skip: tuple[str, ...] = ()) -> str:
        """The agent's last `lines` log lines, leaving out those that hold any of `skip`."""
        log = self.cluster.dir / "logs" / f"agent-{self.name}.log"
        if not log.exists():
            return ""
        kept = [ln for ln in log.read_text().splitlines() if not any(s in ln for s in skip)]
        return "\n".join(kept[-lines:])

    def restart_device_plugin(self, timeout: float = 60.0) -> None:
        """Delete the node's device plugin pod (its DaemonSet makes a new one) and wait until
        the node advertises healthy devices again: NVIDIA's plugin marks every device unhealthy
        for good when NVML fails under its health check, until it is restarted."""
        for pod in self.core.list_namespaced_pod(
            agents.PLUGIN_NS, field_selector=f"spec.nodeName={self.name}"
        ).items:
            self.core.delete_namespaced_pod(pod.metadata.name, agents.PLUGIN_NS)
        deadline = time.monotonic() + timeout
        while not self.gpu_resources():
            assert time.monotonic() < deadline, f"{self.name}: no device plugin back"
            time.sleep(0.1)

    def agent_record(self) -> dict[str, Any]:
        """The node's agent as `agents.running` has it: `agent` (now), `state`, `restarts`."""
        return agents.running(self.cluster.dir)[self.name]

    def wait_agent_restarted(self, restarts: int, timeout: float = 30.0) -> None:
        """Wait until the supervisor has restarted the agent `restarts` times and it runs."""
        deadline = time.monotonic() + timeout
        while True:
            record = self.agent_record()
            if record.get("restarts", 0) >= restarts and agents.agent_state(record) == "running":
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.name}: agent not restarted {restarts} time(s) "
                    f"after {timeout} s: {record}"
                )
            time.sleep(0.05)

    def restart_agent(
        self, settings: Mapping[str, str] | None = None, profiles: Path | None = None
    ) -> None:
        """An agent that was killed: wait for its supervisor to restart it, as a kubelet does.
        New settings or profiles (or an agent still running): stop it and start it anew; the
        node's device plugin keeps running."""
        record = self.agent_record()
        if settings is None and profiles is None:
            if agents.agent_state(record) == "back-off":
                self.wait_agent_restarted(record.get("restarts", 0) + 1)
                self.known_agent = self.agent_record()["agent"]
                return
            if record["agent"] != self.known_agent:  # killed, and restarted already
                self.known_agent = record["agent"]
                return
        # the device plugin keeps running, as when the agent's DaemonSet rolls
        self.procs = agents.restart_agent(
            self.cluster,
            self.name,
            settings=settings,
            profiles=profiles or agents.PROFILES,
            restart_backoff=RESTART_BACKOFF,
        )
        self.known_agent = asdict(self.procs.agent)


NodeFactory = Callable[..., AgentNode]
NFD_ANNOTATION = "nfd.node.kubernetes.io/feature-labels"


def wait_node_runtime(node: AgentNode, timeout: float = 60.0) -> None:
    """Wait until NVIDIA's plugin advertises on the node (the node runtime wrote what it lists)
    and GFD's labels are on it, so a test starts from a node as a kubelet and NFD leave it."""
    log = node.cluster.dir / "logs" / f"node-runtime-{node.name}.log"
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_text() if log.exists() else ""
        if '"node_runtime.advertised"' in text and NFD_ANNOTATION in (
            node.node().metadata.annotations or {}
        ):
            return
        assert time.monotonic() < deadline, (
            f"{node.name}: node runtime not ready:\n{text[-3000:]}\n{plugin_pods_report(node)}"
        )
        time.sleep(0.1)


def plugin_pods_report(node: AgentNode) -> str:
    """What the device plugin's DaemonSet did about the node: its pods there (phase, scheduling
    conditions), the node's deploy label and the Events about them, for a failure message."""
    pods = node.core.list_namespaced_pod(agents.PLUGIN_NS).items
    lines = [f"deploy label: {node.labels().get('nvidia.com/gpu.deploy.device-plugin')!r}"]
    for p in pods:
        conditions = [f"{c.type}={c.status}({c.reason or ''})" for c in (p.status.conditions or [])]
        lines.append(
            f"pod {p.metadata.name} node={p.spec.node_name} phase={p.status.phase} "
            f"deleting={p.metadata.deletion_timestamp is not None} {' '.join(conditions)}"
        )
    events = node.core.list_namespaced_event(agents.PLUGIN_NS).items[-15:]
    lines += [f"event {e.involved_object.name}: {e.reason} {e.message}" for e in events]
    kwok = node.cluster.dir / "logs" / "kwok.log"
    if kwok.exists():  # kwok plays the pod's stages once it holds the node's lease
        said = [ln for ln in kwok.read_text(errors="replace").splitlines() if node.name in ln]
        lines += ["kwok: " + ln[:300] for ln in said[-10:]]
    return "\n".join(lines)


@pytest.fixture
def agent_node(installed: Cluster, core: client.CoreV1Api) -> Iterator[NodeFactory]:
    """Creates GPU nodes with a running agent; stops the agents and deletes the nodes after."""
    made: list[AgentNode] = []

    def make(
        gpus: str = "8xH100-80GB",
        *,
        settings: Mapping[str, str] | None = None,
        profiles: Path | None = None,
        sim: Mapping[str, Any] | None = None,
        name: str | None = None,
        plugin_args: Sequence[str] = (),
        device_plugin: str | None = None,
    ) -> AgentNode:
        kind = device_plugin or agents.default_device_plugin()
        if kind == "nvidia":
            nvidia_binaries()
        name = name or f"e2e-{next(_ids)}-{int(time.time() * 1000) % 100000}"
        installed.add_gpu_node(name, gpus)
        procs = agents.start_node(
            installed,
            name,
            settings=settings,
            profiles=profiles or agents.PROFILES,
            sim=sim,
            plugin_args=plugin_args,
            restart_backoff=RESTART_BACKOFF,
            device_plugin=kind,
        )
        node = AgentNode(name, installed, core, procs)
        made.append(node)
        # the agent has published the GPUs' state once it is up
        deadline = time.monotonic() + 30
        while "mig-agent.dev/gpu-state" not in (node.node().metadata.annotations or {}):
            assert time.monotonic() < deadline, node.log_tail()
            time.sleep(0.1)
        if kind == "nvidia":
            wait_node_runtime(node)
        return node

    yield make
    for n in made:
        agents.stop_node(installed.dir, n.name)
        installed.delete_node(n.name)


@pytest.fixture
def extra_profiles(tmp_path: Path) -> Callable[[str], Path]:
    """A copy of the packaged profiles plus one more file with the given YAML text."""

    def make(text: str) -> Path:
        target = tmp_path / "profiles"
        shutil.copytree(REPO / "profiles", target, dirs_exist_ok=True)
        (target / "e2e.yaml").write_text(text)
        return target

    return make


def wait_running(core: client.CoreV1Api, namespace: str, name: str, timeout: float = 30) -> Any:
    """The pod once kwok reports it Running; AssertionError with its status after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        pod = core.read_namespaced_pod(name, namespace)
        if pod.status.phase == "Running":
            return pod
        assert time.monotonic() < deadline, f"{name} not running: {pod.status}"
        time.sleep(0.1)


def mig_counts(sim_state: str) -> simstate.CallCounts:
    return simstate.call_counts(sim_state)
