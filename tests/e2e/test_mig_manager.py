"""NVIDIA's nvidia-mig-manager on a simulated node of the local cluster
(migsim.cluster.mig_manager), the tool the side-by-side benchmark (benchmarks/vs_mig_manager.py)
is built on.

We test these aspects: a label change takes MIG Manager through `pending` to `success` and the
simulated GPUs then hold the layout (read from the state file, not from MIG Manager's word), with
the device plugin's pod paused and brought back so the node advertises the MIG devices; a MIG mode
change on Ampere goes through the simulated GPU reset; an unknown layout ends in `failed` with no
GPU touched; stop_node leaves none of the node's processes running; kill_manager ends MIG
Manager's whole process group mid-pass (as a crashed container) and restart_manager starts it
again, which finishes the layout (observed: it re-applies from what it finds)."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client
from migsim.cluster import Cluster, agents, mig_manager
from migsim.cluster.processes import Proc
from migsim.nvml import state as simstate

from tests.node_watch import node_versions

from .conftest import CONFIG, REPO, STATE

LAYOUTS = REPO / "profiles" / "all.yaml"
DP_LABEL = "nvidia.com/gpu.deploy.device-plugin"

pytestmark = pytest.mark.native

if os.geteuid() != 0:  # said out loud in the summary (-ra), never a silent pass
    pytest.skip(
        "nvidia-mig-manager runs in a private mount namespace (unshare -m): run as root",
        allow_module_level=True,
    )


class ManagedNode:
    def __init__(
        self,
        cluster: Cluster,
        core: client.CoreV1Api,
        name: str,
        record: mig_manager.NodeMigManager,
    ) -> None:
        self.cluster, self.core, self.name, self.record = cluster, core, name, record

    def labels(self) -> dict[str, str]:
        return dict(self.core.read_node(self.name).metadata.labels or {})

    def label(self, layout: str) -> None:
        self.core.patch_node(self.name, {"metadata": {"labels": {CONFIG: layout}}})

    def wait_state(self, *states: str, timeout: float = 120.0) -> tuple[str, list[str]]:
        """The state label once it is one of `states`, and every state it passed through on the
        way (a watch on the node: none is missed, however short)."""
        seen: list[str] = []
        state = None
        for n in node_versions(self.core, self.name, timeout):
            state = (n.metadata.labels or {}).get(STATE, "")
            if not seen or seen[-1] != state:
                seen.append(state)
            if state in states:
                return state, seen
        raise AssertionError(
            f"{self.name}: state {state!r} after {timeout} s; MIG Manager's log:\n"
            + Path(self.record.log).read_text()[-3000:]
        )

    def gpu_resources(self) -> dict[str, int]:
        alloc = self.core.read_node(self.name).status.allocatable or {}
        return {k: int(v) for k, v in alloc.items() if k.startswith("nvidia.com/") and int(v)}


MakeNode = Callable[[str], ManagedNode]


def layout_of(sim_state: str) -> list[tuple[bool, dict[str, int]]]:
    """Per simulated GPU: MIG mode now, and its GPU instances by profile name."""
    out = []
    for gpu in simstate.load_node(sim_state).gpus:
        names = Counter(
            gpu.model.gi_profile_by_id(gi.profile_id).name  # type: ignore[union-attr]
            for gi in gpu.gpu_instances
        )
        out.append((gpu.mig_current, dict(names)))
    return out


@pytest.fixture
def managed_node(cluster: Cluster, core: client.CoreV1Api) -> Iterator[MakeNode]:
    """Makes simulated GPU nodes run by MIG Manager; stops its processes and deletes the nodes."""
    agents.install(cluster)  # the device plugin's DaemonSet, as the GPU Operator leaves it
    made: list[ManagedNode] = []
    stopped: list[Proc] = []

    def make(gpus: str) -> ManagedNode:
        name = f"mm-{len(made)}-{int(time.time() * 1000) % 100000}"
        cluster.add_gpu_node(name, gpus)
        record = mig_manager.start_node(cluster, name, LAYOUTS)
        node = ManagedNode(cluster, core, name, record)
        made.append(node)
        return node

    yield make
    for n in made:
        mig_manager.stop_node(cluster.dir, n.name)
        stopped.extend([n.record.mig_manager, n.record.dbus, n.record.device_plugin])
        cluster.delete_node(n.name)
    for proc in stopped:
        assert not proc.alive(), f"{proc.name} still runs after stop_node"


def test_label_change_reaches_success_and_the_gpus_hold_the_layout(managed_node: MakeNode) -> None:
    make = managed_node
    node = make("2xH100-80GB")
    node.label("all-balanced")
    state, seen = node.wait_state("success", "failed")
    assert state == "success", seen
    assert "pending" in seen  # it paused the operands and applied, not "nothing to do"
    balanced = {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
    assert layout_of(node.record.sim_state) == [(True, balanced), (True, balanced)]
    assert node.labels()[DP_LABEL] == "true"  # operands resumed
    # the device plugin's pod was paused and came back, and advertises the new devices
    deadline = time.monotonic() + 60
    while node.gpu_resources() != {
        "nvidia.com/mig-1g.10gb": 4,
        "nvidia.com/mig-2g.20gb": 2,
        "nvidia.com/mig-3g.40gb": 2,
    }:
        assert time.monotonic() < deadline, node.gpu_resources()
        time.sleep(0.2)


def test_ampere_mode_change_goes_through_the_reset(managed_node: MakeNode) -> None:
    make = managed_node
    node = make("1xA100-40GB")
    node.label("all-3g.20gb")
    state, seen = node.wait_state("success", "failed")
    assert state == "success", seen
    assert layout_of(node.record.sim_state) == [(True, {"3g.20gb": 2})]
    assert simstate.call_counts(node.record.sim_state).by_function.get(simstate.RESET, 0) >= 1


def test_unknown_layout_fails_and_touches_no_gpu(managed_node: MakeNode) -> None:
    make = managed_node
    node = make("2xH100-80GB")
    node.label("all-1g.10gb")
    assert node.wait_state("success", "failed")[0] == "success"
    simstate.reset_call_counts(node.record.sim_state)
    before = layout_of(node.record.sim_state)
    node.label("no-such-layout")
    state, seen = node.wait_state("failed", timeout=60)
    assert state == "failed", seen
    assert simstate.call_counts(node.record.sim_state).total == 0
    assert layout_of(node.record.sim_state) == before
    assert node.labels()[DP_LABEL] == "true"


def test_killed_mid_pass_and_restarted_it_finishes_the_layout(managed_node: MakeNode) -> None:
    make = managed_node
    node = make("2xH100-80GB")
    node.label("all-balanced")
    assert node.wait_state("success", "failed")[0] == "success"
    simstate.set_latency(node.record.sim_state, 0.2)
    simstate.reset_call_counts(node.record.sim_state)
    node.label("all-1g.10gb")
    deadline = time.monotonic() + 60
    while simstate.call_counts(node.record.sim_state).total < 3:
        assert time.monotonic() < deadline, "MIG Manager made no NVML change"
        time.sleep(0.02)
    killed = mig_manager.kill_manager(node.cluster.dir, node.name)
    assert killed is not None and not killed.alive()
    assert node.labels()[STATE] == "pending"  # nobody says anything while it is down
    half = layout_of(node.record.sim_state)
    assert half != [(True, {"1g.10gb": 7})] * 2, "the kill came after the pass"
    restarted = mig_manager.restart_manager(node.cluster, node.name)
    assert restarted.mig_manager.alive() and restarted.mig_manager != killed
    state, seen = node.wait_state("success", "failed")
    assert state == "success", seen
    assert layout_of(node.record.sim_state) == [(True, {"1g.10gb": 7})] * 2
    assert node.labels()[DP_LABEL] == "true"
