"""Fixtures for end-to-end tests: simulated GPU nodes of the session's cluster, each with a real
agent process (under the DaemonSet's ServiceAccount, own-node admission policy active) and a
device plugin, as `scripts/local-cluster up` runs them: NVIDIA's own (`nvidia`, under the node
runtime; root only) or the home-made model of it (`simulated`); or, as on a GPUCluster's node, no
device plugin but NVIDIA's DRA kubelet plugin (`dra`; root only: the DRA driver's DaemonSet is
installed once per session, and a follower runs the plugin while the node's pod runs).
`agent_node(device_plugin=...)` chooses per node; the default is agents.default_device_plugin()
(MIG_AGENT_DEVICE_PLUGIN)."""

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
from migsim.cluster import Cluster, agents, dra_plugin
from migsim.nvml import state as simstate

from tests.node_watch import node_versions

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


_built: dict[str, Path] = {}


def _build_once(script: str) -> Path:
    """What scripts/<script> build prints last (built once per session, cached)."""
    if script not in _built:
        out = subprocess.run(
            [str(REPO / "scripts" / script), "build"], capture_output=True, text=True, check=False
        )
        assert out.returncode == 0, f"scripts/{script} build failed:\n{out.stderr}"
        _built[script] = Path(out.stdout.strip().splitlines()[-1])
    return _built[script]


def nvidia_binaries() -> Path:
    """NVIDIA's binaries (scripts/nvidia-binaries build: once, cached); a test that needs them
    skips loudly when not root (the plugin runs in a private mount namespace)."""
    if os.geteuid() != 0:
        pytest.skip(
            "NVIDIA's device plugin runs in a private mount namespace (unshare -m): run as root"
        )
    return _build_once("nvidia-binaries")


@pytest.fixture(scope="session")
def dra_installed(installed: Cluster) -> Cluster:
    """NVIDIA's DRA kubelet plugin built (and nvidia-cdi-hook), its DeviceClasses and default
    DaemonSet installed: once per session, for the first `agent_node(device_plugin="dra")`."""
    if os.geteuid() != 0:
        pytest.skip(
            "NVIDIA's DRA plugin runs in a private mount namespace (unshare -m): run as root"
        )
    _build_once("dra-driver")
    _build_once("nvidia-binaries")
    agents.install_dra(installed)
    return installed


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
        """Wait until the state label is one of ``states``; every state it passes through on the
        way goes to ``seen`` (a watch on the node: none is missed, however short)."""
        n = self.wait_settled(*states, timeout=timeout, seen=seen)
        return str((n.metadata.labels or {}).get(STATE, ""))

    def wait_settled(
        self, *states: str, timeout: float = 60.0, seen: list[str] | None = None
    ) -> Any:
        """As wait_state, but the node as it was when its state first became one of ``states``
        (the watch's version of it), so what a test asserts of it is what that state came with
        (a retry may start the next pass a moment later)."""
        state = None
        for n in node_versions(self.core, self.name, timeout):
            state = (n.metadata.labels or {}).get(STATE, "")
            if seen is not None and (not seen or seen[-1] != state):
                seen.append(state)
            if state in states:
                return n
        raise AssertionError(
            f"{self.name}: state {state!r}, not {states} after "
            f"{timeout} s; agent log:\n{self.log_tail()}"
        )

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

    def dra_devices(self) -> dict[str, dict[str, Any]]:
        """The devices the node's DRA slices list: name -> attributes (dra_plugin.devices)."""
        return dra_plugin.devices(self.cluster, self.name)

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


def wait_dra_slice(node: AgentNode, timeout: float = 60.0) -> None:
    """Wait until the node's DRA plugin has published its slice (the follower runs it once the
    DRA driver's pod runs there), so a test starts from a node as the plugin leaves it."""
    deadline = time.monotonic() + timeout
    while not dra_plugin.resource_slices(node.cluster, node.name):
        log = node.cluster.dir / "logs" / f"dra-runtime-{node.name}.log"
        assert time.monotonic() < deadline, (
            f"{node.name}: no DRA slice after {timeout:g} s; follower log:\n"
            f"{log.read_text()[-3000:] if log.exists() else ''}"
        )
        time.sleep(0.1)


def _agent_up(node: AgentNode, *, observe: bool) -> bool:
    """The agent has published the GPUs' state, as it does once it is up; one that only
    observes publishes nothing (no label yet), so its log line of start is looked for."""
    if observe:
        return '"agent.started"' in node.log_tail(200)
    return "mig-agent.dev/gpu-state" in (node.node().metadata.annotations or {})


@pytest.fixture
def agent_node(
    installed: Cluster, core: client.CoreV1Api, request: pytest.FixtureRequest
) -> Iterator[NodeFactory]:
    """Creates GPU nodes with a running agent; stops the agents and deletes the nodes after.
    `device_plugin="dra"` makes a DRA node (`dra_node_label_value` picks the DaemonSet: `true`
    is install_dra's default one; another value needs a DaemonSet of its own, installed with
    dra_plugin.install_daemonset(node_selector=..., feature_gates=...))."""
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
        dra_node_label_value: str = "true",
    ) -> AgentNode:
        kind = device_plugin or agents.default_device_plugin()
        if kind == "nvidia":
            nvidia_binaries()
        if kind == "dra":
            request.getfixturevalue("dra_installed")
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
            dra_node_label_value=dra_node_label_value,
        )
        node = AgentNode(name, installed, core, procs)
        made.append(node)
        observe = (settings or {}).get("MIG_AGENT_OBSERVE", "").lower() == "true"
        deadline = time.monotonic() + 30
        while not _agent_up(node, observe=observe):
            assert time.monotonic() < deadline, node.log_tail()
            time.sleep(0.1)
        if kind == "nvidia":
            wait_node_runtime(node)
        if kind == "dra":
            wait_dra_slice(node)
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
