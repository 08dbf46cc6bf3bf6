"""NVIDIA's nvidia-mig-parted (built from the pinned upstream source by scripts/nvidia-binaries) on
simulated nodes, through scripts/with-sim-gpus --host-view: the simulated libnvidia-ml.so.1, a
private mount namespace with /proc/modules and /sys/bus/pci/devices of the simulated GPUs, and a
simulated `nvidia-smi -r` for MIG mode changes.

We test these aspects, per MIG model: mig-parted applies a layout from a fresh node (MIG mode change
included, which on Ampere needs the GPU reset) and asserts it; pynvml-based mig-agent sees exactly
that layout applied (its assert passes, its export equals mig-parted's); the other way round,
what mig-agent applies mig-parted asserts; a layout not applied fails mig-parted's assert."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from migsim.nvml import state as st

from .conftest import REPO

LAYOUTS = REPO / "profiles" / "all.yaml"
COMMON = REPO / "profiles" / "common.yaml"
NOT_APPLIED = "not currently applied"
MODELS = ["A100-40GB", "A100-80GB", "A30", "H100-80GB", "H100-NVL", "H200"]

if os.geteuid() != 0:  # said out loud in the summary (-ra), never a silent pass
    pytest.skip(
        "nvidia-mig-parted needs a private mount namespace (unshare -m): run as root",
        allow_module_level=True,
    )


@pytest.fixture(scope="session")
def nvidia_bin() -> Path:
    out = subprocess.run(
        [str(REPO / "scripts" / "nvidia-binaries"), "build"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, f"scripts/nvidia-binaries build failed:\n{out.stderr}"
    return Path(out.stdout.strip())


def with_sim_gpus(
    state: str, *cmd: str, host_view: bool = True
) -> subprocess.CompletedProcess[str]:
    flags = ["--host-view"] if host_view else []
    return subprocess.run(
        [str(REPO / "scripts" / "with-sim-gpus"), *flags, state, "--", *cmd],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


def mig_agent(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["mig-agent", *args], capture_output=True, text=True, check=False, timeout=120
    )


def content(export_yaml: str) -> list[tuple[bool, dict[str, int]]]:
    """An exported config's content: per entry, MIG mode and devices (names and counts)."""
    doc: dict[str, Any] = yaml.safe_load(export_yaml)
    entries = doc["mig-configs"]["current"]
    return sorted((bool(e["mig-enabled"]), dict(e.get("mig-devices") or {})) for e in entries)


@pytest.mark.parametrize("model", MODELS)
def test_mig_parted_apply_is_what_mig_agent_sees(
    model: str, tmp_path: Path, nvidia_bin: Path
) -> None:
    state = str(tmp_path / "node.json")
    st.create_node(state, f"2x{model}")
    parted = str(nvidia_bin / "nvidia-mig-parted")
    cfg = ["-f", str(LAYOUTS), "-c", "all-balanced"]

    refused = with_sim_gpus(state, parted, "assert", *cfg)
    assert refused.returncode == 1, refused.stderr  # MIG off: not applied
    assert NOT_APPLIED in refused.stderr, refused.stderr

    applied = with_sim_gpus(state, parted, "apply", *cfg)
    assert applied.returncode == 0, applied.stderr
    assert "MIG configuration applied successfully" in applied.stdout + applied.stderr
    node = st.load_node(state)
    assert all(g.mig_current and g.mig_pending for g in node.gpus)  # the mode change happened
    assert all(g.gpu_instances for g in node.gpus)

    asserted = with_sim_gpus(state, parted, "assert", *cfg)
    assert asserted.returncode == 0, asserted.stderr

    agent = mig_agent("assert", *cfg, "--backend", "simulated", "--sim-state", state)
    assert agent.returncode == 0, agent.stdout + agent.stderr
    # mig-agent's NVML backend over the C library sees the same.
    agent_c = with_sim_gpus(
        state, "mig-agent", "assert", *cfg, "--backend", "nvml", host_view=False
    )
    assert agent_c.returncode == 0, agent_c.stdout + agent_c.stderr

    parted_export = with_sim_gpus(state, parted, "export")
    assert parted_export.returncode == 0, parted_export.stderr
    agent_export = mig_agent("export", "--backend", "simulated", "--sim-state", state)
    assert agent_export.returncode == 0, agent_export.stderr
    assert content(parted_export.stdout) == content(agent_export.stdout)
    assert content(parted_export.stdout)[0][0] is True


@pytest.mark.parametrize("model", ["A100-40GB", "H200"])
def test_mig_agent_apply_is_what_mig_parted_asserts(
    model: str, tmp_path: Path, nvidia_bin: Path
) -> None:
    state = str(tmp_path / "node.json")
    st.create_node(state, f"2x{model}")
    parted = str(nvidia_bin / "nvidia-mig-parted")
    cfg = ["-f", str(LAYOUTS), "-c", "all-balanced"]
    applied = mig_agent("apply", *cfg, "--backend", "simulated", "--sim-state", state)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    asserted = with_sim_gpus(state, parted, "assert", *cfg)
    assert asserted.returncode == 0, asserted.stderr
    other = with_sim_gpus(state, parted, "assert", "-f", str(COMMON), "-c", "all-disabled")
    assert other.returncode == 1
    assert NOT_APPLIED in other.stderr, other.stderr
