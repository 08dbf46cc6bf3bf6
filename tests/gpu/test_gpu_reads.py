"""We test scripts/gpu-reads, the node command line's reads and its empty apply, over the
simulated NVML library through the real pynvml wrappers, against the transcript it printed on a
real H200 (tests/data/captures/h200-gpu-reads-2026-12-03.txt): from `mig-agent profiles` on, the
simulated H200 must read exactly as the real one did -- its MIG profiles, placements, the plans
and the generated config -- and the script must refuse an apply that would change the GPUs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from migsim.nvml import library as simlib
from migsim.nvml import open_node

from .conftest import CAPTURES, REPO

REAL = CAPTURES / "h200-gpu-reads-2026-12-03.txt"


def from_the_profiles(transcript: str) -> str:
    """The transcript from `mig-agent profiles` on (nvidia-smi's query before it is the real
    driver's, which the simulated nvidia-smi does not answer)."""
    return transcript[transcript.index("$ mig-agent profiles") :]


def gpu_reads(state: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MIG_AGENT_BACKEND": "nvml"}
    return subprocess.run(
        [
            str(REPO / "scripts" / "with-sim-gpus"),
            state,
            "--",
            str(REPO / "scripts" / "gpu-reads"),
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_the_simulated_h200_reads_as_the_real_one_did(tmp_path: Path) -> None:
    state = str(tmp_path / "node.json")
    simlib.create_node(state, "H200")
    res = gpu_reads(state)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "unchanged: MIG mode and instances read the same" in res.stdout
    assert from_the_profiles(res.stdout) == from_the_profiles(REAL.read_text())


def test_an_apply_that_would_change_the_gpus_is_refused(tmp_path: Path) -> None:
    state = str(tmp_path / "node.json")
    simlib.create_node(state, "H200")
    before = mig_layout(state)
    res = gpu_reads(state, "all-1g.18gb")  # the GPU holds all-disabled
    assert res.returncode == 1, res.stdout + res.stderr
    assert "refused: the GPUs do not hold all-1g.18gb" in res.stderr
    assert "$ mig-agent apply" not in res.stdout
    assert mig_layout(state) == before


def mig_layout(state: str) -> list[object]:
    backend = open_node(state)
    try:
        return [(g.mig_current, g.mig_pending, g.gpu_instances) for g in backend.observe().gpus]
    finally:
        backend.close()
