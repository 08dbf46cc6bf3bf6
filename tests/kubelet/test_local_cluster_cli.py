"""We test the README's real-node commands: `scripts/local-cluster up --real-node GPUS` gives a
Ready node on containerd whose allocatable comes from NVIDIA's plugin, and `down` stops its
kubelet, containerd and containers and leaves the device manager's folder empty."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from migsim.cluster import Cluster, real_node

REPO = Path(__file__).resolve().parents[2]


def local_cluster(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(REPO / "scripts" / "local-cluster"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_up_with_a_real_node_then_down(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the real node runs containerd and a kubelet: run as root")
    where = str(tmp_path / "lc")
    up = local_cluster(
        "up", "--dir", where, "--nodes", "0", "--no-agents", "--real-node", "1xH100-80GB"
    )
    try:
        assert up.returncode == 0, up.stderr
        assert "real node kubelet-node-0: kubelet on containerd, 1xH100-80GB" in up.stderr
        cluster = Cluster.load(Path(where))
        deadline = time.monotonic() + 60
        while True:
            node = cluster.api.get(f"/api/v1/nodes/{real_node.NAME}")
            if node["status"].get("allocatable", {}).get("nvidia.com/gpu") == "1":
                break
            assert time.monotonic() < deadline, json.dumps(node["status"])[:2000]
            time.sleep(0.5)
        assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
        record = real_node.load(cluster, real_node.NAME)
        assert record is not None and record.kubelet.alive() and record.containerd.alive()
    finally:
        down = local_cluster("down", "--dir", where)
    assert down.returncode == 0, down.stderr
    assert not record.kubelet.alive() and not record.containerd.alive()
    assert record.simulator is not None and not record.simulator.alive()
    assert not list(Path(real_node.KUBELET_DEVICE_PLUGINS).iterdir())


def test_the_demo_on_a_real_node() -> None:
    """`scripts/demo --real-node`, the README's command: the operator's checks, then a MIG layout
    applied by the chart's agent and a pod given one MIG device; it stops what it started."""
    if os.geteuid() != 0:
        pytest.skip("the real node runs containerd and a kubelet: run as root")
    done = subprocess.run(
        [str(REPO / "scripts" / "demo"), "--real-node"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, (out[-3000:], done.stderr[-3000:])
    assert out.count("NVIDIA H100 80GB HBM3") >= 2, out  # the host's nvidia-smi table
    assert '{"nvidia.com/gpu": "2"}' in out, out
    whole = out.split("nvidia.com/gpu: 1 (runtimeClassName: nvidia), its log\n", 1)[1]
    assert whole.startswith("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-"), out
    assert "nvidia.com/mig.config.state=success" in out, out
    pod = out.split("nvidia.com/mig-1g.10gb: 1, its log\n", 1)[1].splitlines()
    assert pod[0].startswith("GPU 0: ") and pod[1].startswith("  MIG 1g.10gb     Device  0:"), out
    assert not pod[2].startswith("  MIG"), out  # that device alone
    assert "kubelet-node-0  all-1g.10gb  success" in out, out
    assert not real_node.running_kubelets(), "the demo left a kubelet running"
