"""Every layout of NVIDIA's config files (the GPU Operator's default config, mig-parted's example
and DGX Station configs, `tests/data/compat/`) on every model it fits, both ways between
mig-agent and NVIDIA's nvidia-mig-parted (built from the pinned upstream source), on simulated
nodes through scripts/with-sim-gpus --host-view:

* mig-agent applies it on a fresh node, then `nvidia-mig-parted assert` of the same layout passes;
* `nvidia-mig-parted apply` of it on a fresh node, then `mig-agent assert` passes, and
  `nvidia-mig-parted export` means what `mig-agent export` means for every GPU of the node (MIG
  mode and devices; the two group GPUs into entries differently: mig-parted one entry for GPUs
  alike in partition, mig-agent one per model), which is also what mig-agent's own apply left.

Any disagreement is a bug in the simulator or the agent until shown otherwise. mig-agent runs in
its own process, mig-parted as NVIDIA ships it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from migsim.nvml import open_node
from migsim.nvml import state as st

from mig_agent.config.profiles import fit_report, load_catalog
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.layout import GpuLayout

from .conftest import REPO
from .test_mig_parted import NOT_APPLIED, nvidia_bin, with_sim_gpus

__all__ = ["nvidia_bin"]  # the session fixture, shared with test_mig_parted

COMPAT = REPO / "tests" / "data" / "compat"
STATION = "mig-parted-dgx-station-80gb-config.yaml"

if os.geteuid() != 0:  # said out loud in the summary (-ra), never a silent pass
    pytest.skip(
        "nvidia-mig-parted needs a private mount namespace (unshare -m): run as root",
        allow_module_level=True,
    )


def _cases() -> list[tuple[str, str, str]]:
    cases = []
    for path in sorted(COMPAT.glob("*.yaml")):
        catalog = load_catalog([path])
        for model in MODELS.values():
            if model.mig_capable:
                cases += [
                    (path.name, r.layout, model.key)
                    for r in fit_report(catalog, model)
                    if r.applies and r.fits
                ]
    return cases


CASES = _cases()


def _gpus(file: str, layout: str, model: str) -> str:
    """The node: enough GPUs of the model for every index the layout names (at least two); a
    DGX Station's four A100-80GB with its display GPU at index 3, where the Station has it and
    its config expects it (mig-parted's assert wants every GPU selected by some entry, and
    fails a node whose A100 at index 3 no entry selects; mig-agent leaves such a GPU as it is)."""
    if file == STATION:
        return "3xA100-80GB,1xDGX-Display,1xA100-80GB"
    rules = load_catalog([COMPAT / file]).get(layout).rules
    named = [i for r in rules for i in (r.selector.indices or ())]
    return f"{max([1, *named]) + 1}x{model}"


def agent(*args: str) -> tuple[int, str]:
    """`mig-agent ARGS` in its own process (its logging set-up stays out of this one)."""
    done = subprocess.run(
        ["mig-agent", *args], capture_output=True, text=True, check=False, timeout=120
    )
    return done.returncode, done.stdout if done.returncode == 0 else done.stdout + done.stderr


def per_gpu(export: str, state: str, tmp_path: Path) -> list[GpuLayout | None]:
    """What an exported config (its one layout, `current`) asks of each GPU of the node."""
    path = tmp_path / "export.yaml"
    path.write_text(export)
    current = load_catalog([path]).get("current")
    backend = open_node(state)
    try:
        gpus = backend.observe().gpus
    finally:
        backend.close()
    return [
        current.target_for(g.index, g.info.pci_device_id, g.info.pci_subsystem_id) for g in gpus
    ]


def test_every_fitting_layout_is_crossed() -> None:
    """The cases below cover each file and each MIG model its layouts are written for."""
    files = {f for f, _, _ in CASES}
    assert files == {p.name for p in COMPAT.glob("*.yaml")}
    assert len(CASES) >= 80
    assert {m for _, _, m in CASES} == {m.key for m in MODELS.values() if m.mig_capable}


@pytest.mark.parametrize(
    ("file", "layout", "model"),
    CASES,
    ids=[f"{f.split('-config')[0]}:{lay}:{m}" for f, lay, m in CASES],
)
def test_mig_agent_and_mig_parted_agree_both_ways(
    file: str, layout: str, model: str, tmp_path: Path, nvidia_bin: Path
) -> None:
    parted = str(nvidia_bin / "nvidia-mig-parted")
    cfg = ["-f", str(COMPAT / file), "-c", layout]
    gpus = _gpus(file, layout, model)
    sim = ["--backend", "simulated", "--sim-state"]

    ours = str(tmp_path / "agent-applied.json")
    st.create_node(ours, gpus)
    code, out = agent("apply", *cfg, *sim, ours)
    assert code == 0, out
    asserted = with_sim_gpus(ours, parted, "assert", *cfg)
    assert asserted.returncode == 0, asserted.stderr
    assert NOT_APPLIED not in asserted.stderr

    theirs = str(tmp_path / "parted-applied.json")
    st.create_node(theirs, gpus)
    applied = with_sim_gpus(theirs, parted, "apply", *cfg)
    assert applied.returncode == 0, applied.stderr
    code, out = agent("assert", *cfg, *sim, theirs)
    assert code == 0, out

    exported = with_sim_gpus(theirs, parted, "export")
    assert exported.returncode == 0, exported.stderr
    code, agent_export = agent("export", *sim, theirs)
    assert code == 0, agent_export
    meant = per_gpu(exported.stdout, theirs, tmp_path)
    assert any(t is not None for t in meant)
    assert per_gpu(agent_export, theirs, tmp_path) == meant
    code, own_export = agent("export", *sim, ours)
    assert code == 0, own_export
    assert per_gpu(own_export, ours, tmp_path) == meant
