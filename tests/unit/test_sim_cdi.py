"""The real node's CDI spec follows its simulated GPUs: every GPU and MIG device by index and by
UUID, each device mounting its own visibility marker; the writer beside the node writes it again
when the agent changes the layout (a MIG device created after the node started is found)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from migsim.cluster import cdi
from migsim.nvml import open_node
from migsim.nvml import state as simstate

from mig_agent.config.profiles import load_catalog
from mig_agent.node.apply import apply_layout

CATALOG = load_catalog([Path(__file__).resolve().parents[2] / "profiles"])


def _node(tmp_path: Path) -> Path:
    path = tmp_path / "gpu-state.json"
    simstate.create_node(path, gpus="2xH100-80GB", name="cdi-node")
    return path


def _mig_uuids(path: Path) -> list[str]:
    return [ci.uuid for gpu in simstate.load_node(path).gpus for _, ci in gpu.mig_devices()]


def _spec(out: Path) -> dict[str, dict[str, object]]:
    return {d["name"]: d for d in json.loads(out.read_text())["devices"]}


def test_every_gpu_and_mig_device_by_index_and_uuid_with_its_own_marker(tmp_path: Path) -> None:
    state = _node(tmp_path)
    with open_node(str(state)) as gpus:
        apply_layout(CATALOG.get("all-1g.10gb"), gpus)
    migs = _mig_uuids(state)
    assert len(migs) == 14
    out, lib = tmp_path / "cdi" / "nvidia.json", tmp_path / "lib"
    lib.mkdir()
    names = cdi.write(state, out, sim_nvml_dir=lib, socket=tmp_path / "gpu" / "nvml.sock")
    gpu_uuids = [g.uuid for g in simstate.load_node(state).gpus]
    assert set(names) == {
        "0",
        "1",
        "all",
        *gpu_uuids,
        *migs,
        *(f"{g}:{i}" for g in (0, 1) for i in range(7)),
    }
    devices = _spec(out)
    mount = devices[migs[3]]["containerEdits"]["mounts"][0]  # type: ignore[index]
    assert mount["containerPath"] == f"{cdi.VISIBLE_DIR}/{migs[3]}"
    assert Path(mount["hostPath"]).is_file()  # a bind mount's source must exist
    assert devices["1:0"] == {**devices[migs[7]], "name": "1:0"}  # GPU 1's first MIG device
    edits = json.loads(out.read_text())["containerEdits"]
    paths = [m["containerPath"] for m in edits["mounts"]]
    assert cdi.LIBRARY_PATH in paths
    assert cdi.SMI_PATH not in paths  # no simulated nvidia-smi in that folder: none mounted
    assert cdi.WORKLOAD_PATH not in paths


def test_the_writer_follows_a_repartition(tmp_path: Path) -> None:
    state = _node(tmp_path)
    out, lib = tmp_path / "cdi" / "nvidia.json", tmp_path / "lib"
    lib.mkdir()
    (lib / "nvidia-smi").write_text("")
    (lib / "gpu-workload").write_text("")
    argv = [sys.executable, "-m", "migsim.cluster.cdi", "--state", str(state), "--out", str(out)]
    argv += ["--sim-nvml", str(lib), "--socket", str(tmp_path / "nvml.sock"), "--interval", "0.05"]
    writer = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(_spec(out)) == {
            "0",
            "1",
            "all",
            *(g.uuid for g in simstate.load_node(state).gpus),
        }
        paths = [
            m["containerPath"] for m in json.loads(out.read_text())["containerEdits"]["mounts"]
        ]
        assert cdi.SMI_PATH in paths
        assert cdi.WORKLOAD_PATH in paths
        with open_node(str(state)) as gpus:
            apply_layout(CATALOG.get("all-3g.40gb"), gpus)
        migs = _mig_uuids(state)
        assert len(migs) == 4
        while not set(migs) <= set(_spec(out)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(migs) <= set(_spec(out))
    finally:
        writer.terminate()
        writer.wait(timeout=10)
