"""We test the agent against an older Kubernetes release, behind a switch: with
`MIG_AGENT_OLD_K8S_BIN=<folder of that release's binaries>` (v1.34.3, as scripts/k8s-binaries
built them before the pin moved to v1.37), a local cluster of that release of its own runs a DRA
node (NVIDIA's DRA kubelet plugin over simulated GPUs), whose API server serves no
DeviceTaintRule in resource.k8s.io/v1. A change of one GPU then cordons the node, as before
device taints, and ends in `success` with the node uncordoned and no rule written. Left out of
the default run: a second cluster costs a minute, and the suite at 652c6b0 ran whole on v1.34.3.

Needs root (private mount namespaces), as tests/e2e/test_dra.py.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from migsim.cluster import Cluster, agents, dra_plugin

from tests.node_watch import core_for, node_versions

from .conftest import CONFIG, STATE
from .test_dra import DRA_HALF

OLD = os.environ.get("MIG_AGENT_OLD_K8S_BIN", "")

pytestmark = pytest.mark.skipif(not OLD, reason="with MIG_AGENT_OLD_K8S_BIN=<folder> only")


@pytest.fixture
def old_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    monkeypatch.setenv("MIG_AGENT_K8S_BIN", OLD)
    # a short folder: the DRA plugin's socket path must fit a Unix socket's 108 bytes
    with tempfile.TemporaryDirectory(prefix="old-k8s-") as tmp:
        cluster = Cluster.up(Path(tmp), gpu_nodes=0)
        try:
            agents.install(cluster)
            agents.install_dra(cluster)
            yield cluster
        finally:
            cluster.down()


def test_on_an_older_release_a_dra_node_is_cordoned_for_a_change(
    old_cluster: Cluster, tmp_path: Path
) -> None:
    version = old_cluster.api.get("/version")["gitVersion"]
    assert not version.startswith("v1.37"), version
    resources = old_cluster.api.get("/apis/resource.k8s.io/v1")["resources"]
    assert "devicetaintrules" not in {r["name"] for r in resources}
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    for f in agents.PROFILES.glob("*.yaml"):
        (profiles / f.name).write_text(f.read_text())
    (profiles / "half.yaml").write_text(DRA_HALF)
    old_cluster.add_gpu_node("old-dra", "2xH100-80GB")
    agents.start_node(old_cluster, "old-dra", device_plugin="dra", profiles=profiles)
    try:
        deadline = time.monotonic() + 120
        while not dra_plugin.resource_slices(old_cluster, "old-dra"):
            assert time.monotonic() < deadline, "no DRA slice for the node"
            time.sleep(0.1)
        assert _change(old_cluster, "all-1g.10gb") == (True, "success")
        assert _change(old_cluster, "dra-half") == (True, "success")
        node = old_cluster.api.get("/api/v1/nodes/old-dra")
        assert not (node.get("spec") or {}).get("unschedulable")
        assert dra_plugin.devices(old_cluster, "old-dra")
    finally:
        agents.stop_node(old_cluster.dir, "old-dra")


def _change(cluster: Cluster, layout: str) -> tuple[bool, str]:
    """Label the node; (whether it was seen cordoned meanwhile, the state it ended in)."""
    cluster.api.request(
        "PATCH",
        "/api/v1/nodes/old-dra",
        {"metadata": {"labels": {CONFIG: layout, STATE: None}}},
        content_type="application/merge-patch+json",
    )
    cordoned = False
    with core_for(cluster.kubeconfig) as core:  # a watch on the node: a cordon is never missed
        for node in node_versions(core, "old-dra", timeout=180):
            cordoned = cordoned or bool(node.spec.unschedulable)
            state = (node.metadata.labels or {}).get(STATE, "")
            if state in ("success", "failed"):
                return cordoned, state
    raise AssertionError(f"no end of the change to {layout}")
