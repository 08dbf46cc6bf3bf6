"""Fixtures for end-to-end tests: simulated GPU nodes of the session's cluster, each with a real
agent process (under the DaemonSet's ServiceAccount, own-node admission policy active) and a
simulated device plugin, as `scripts/local-cluster up` runs them."""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from migsim.cluster import Cluster, agents
from migsim.nvml import state as simstate

REPO = Path(__file__).resolve().parents[2]
CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
REASON = "mig-agent.dev/reason"
_ids = itertools.count()


@pytest.fixture(scope="session")
def installed(cluster: Cluster) -> Cluster:
    agents.install(cluster)
    return cluster


@dataclass
class AgentNode:
    name: str
    cluster: Cluster
    core: client.CoreV1Api
    procs: agents.NodeAgents

    @property
    def sim_state(self) -> str:
        return self.procs.sim_state

    def node(self) -> Any:
        return self.core.read_node(self.name)

    def labels(self) -> dict[str, str]:
        return dict(self.node().metadata.labels or {})

    def label(self, layout: str | None) -> None:
        self.core.patch_node(self.name, {"metadata": {"labels": {CONFIG: layout}}})

    def wait_state(self, *states: str, timeout: float = 60.0,
                   seen: list[str] | None = None) -> str:
        """Poll until the state label is one of ``states``; every state seen goes to ``seen``."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.labels().get(STATE, "")
            if seen is not None and (not seen or seen[-1] != state):
                seen.append(state)
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: state {state!r}, not {states} after "
                                     f"{timeout} s; agent log:\n{self.log_tail()}")
            time.sleep(0.1)

    def gpu_resources(self) -> dict[str, int]:
        alloc = self.node().status.allocatable or {}
        return {k: int(v) for k, v in alloc.items()
                if k.startswith("nvidia.com/") and int(v) > 0}

    def log_tail(self, lines: int = 30) -> str:
        log = self.cluster.dir / "logs" / f"agent-{self.name}.log"
        return "\n".join(log.read_text().splitlines()[-lines:]) if log.exists() else ""

    def restart_agent(self, settings: Mapping[str, str] | None = None,
                      profiles: Path | None = None) -> None:
        agents.stop_node(self.cluster.dir, self.name)
        self.procs = agents.start_node(self.cluster, self.name, settings=settings,
                                       profiles=profiles or agents.PROFILES)


NodeFactory = Callable[..., AgentNode]


@pytest.fixture
def agent_node(installed: Cluster, core: client.CoreV1Api) -> Iterator[NodeFactory]:
    """Creates GPU nodes with a running agent; stops the agents and deletes the nodes after."""
    made: list[AgentNode] = []

    def make(gpus: str = "8xH100-80GB", *, settings: Mapping[str, str] | None = None,
             profiles: Path | None = None, sim: Mapping[str, Any] | None = None,
             name: str | None = None, plugin_args: Sequence[str] = ()) -> AgentNode:
        name = name or f"e2e-{next(_ids)}-{int(time.time() * 1000) % 100000}"
        installed.add_gpu_node(name, gpus)
        procs = agents.start_node(installed, name, settings=settings,
                                  profiles=profiles or agents.PROFILES, sim=sim,
                                  plugin_args=plugin_args)
        node = AgentNode(name, installed, core, procs)
        made.append(node)
        # the agent has published the GPUs' state once it is up
        deadline = time.monotonic() + 30
        while "mig-agent.dev/gpu-state" not in (node.node().metadata.annotations or {}):
            assert time.monotonic() < deadline, node.log_tail()
            time.sleep(0.1)
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
        shutil.copytree(REPO / "mig_agent" / "profiles", target, dirs_exist_ok=True)
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
