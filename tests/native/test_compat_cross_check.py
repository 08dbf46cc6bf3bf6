"""Every layout of NVIDIA's config files (the GPU Operator's default config, mig-parted's example
and DGX Station configs, `tests/data/compat/`) on every model it fits, both ways between
mig-agent and NVIDIA's nvidia-mig-parted (built from the pinned upstream source), on simulated
nodes through scripts/with-sim-gpus --host-view:

* mig-agent applies it on a fresh node, then `nvidia-mig-parted assert` of the same layout passes;
* `nvidia-mig-parted apply` of it on a fresh node, then `mig-agent assert` passes, and
  `nvidia-mig-parted export` means what `mig-agent export` means for every GPU of the node (MIG
  mode and devices; the two group GPUs into entries differently: mig-parted one entry for GPUs
  alike in partition, mig-agent one per model), which is also what mig-agent's own apply left.

Any disagreement is a bug in the simulator or the agent until shown otherwise. mig-agent's command
line runs in this process; mig-parted runs as NVIDIA ships it, its commands of one node in one host
view (tests/native/sim_host.py). Cases that ask the same of the same GPUs (a layout written alike
in two files) run once; which case stands for which is itself tested."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
from migsim.nvml import open_node
from migsim.nvml import state as st

from mig_agent.config.profiles import fit_report, load_catalog
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.layout import GpuLayout, LayoutCatalog

from .conftest import REPO
from .sim_host import HostViews, Ran, mig_agent_in_process, run_in_host_view
from .test_mig_parted import NOT_APPLIED, nvidia_bin

__all__ = ["nvidia_bin"]  # the session fixture, shared with test_mig_parted

COMPAT = REPO / "tests" / "data" / "compat"
STATION = "mig-parted-dgx-station-80gb-config.yaml"
# The fitting (layout, model) cases per file, pinned: the case list comes from fit_report, code
# under test, so a fit_report that wrongly rejected layouts would otherwise shrink what is tested.
CASES_PER_FILE = {
    "gpu-operator-default-mig-config.yaml": 112,
    "mig-parted-example-config.yaml": 31,
    STATION: 9,
}

if os.geteuid() != 0:  # said out loud in the summary (-ra), never a silent pass
    pytest.skip(
        "nvidia-mig-parted needs a private mount namespace (unshare -m): run as root",
        allow_module_level=True,
    )

Case = tuple[str, str, str]


@functools.cache
def _catalog(file: str) -> LayoutCatalog:
    return load_catalog([COMPAT / file])


def _cases() -> list[Case]:
    cases = []
    for path in sorted(COMPAT.glob("*.yaml")):
        catalog = _catalog(path.name)
        for model in MODELS.values():
            if model.mig_capable:
                cases += [
                    (path.name, r.layout, model.key)
                    for r in fit_report(catalog, model)
                    if r.applies and r.fits
                ]
    return cases


def _gpus(file: str, layout: str, model: str) -> str:
    """The node: enough GPUs of the model for every index the layout names (at least two); a
    DGX Station's four A100-80GB with its display GPU at index 3, where the Station has it and
    its config expects it (mig-parted's assert wants every GPU selected by some entry, and
    fails a node whose A100 at index 3 no entry selects; mig-agent leaves such a GPU as it is)."""
    if file == STATION:
        return "3xA100-80GB,1xDGX-Display,1xA100-80GB"
    rules = _catalog(file).get(layout).rules
    named = [i for r in rules for i in (r.selector.indices or ())]
    return f"{max([1, *named]) + 1}x{model}"


def _asks(case: Case) -> tuple[str, str, str]:
    """What a case asks: the layout's rules (not its name or file), the model, the node."""
    file, layout, model = case
    return repr(_catalog(file).get(layout).rules), model, _gpus(*case)


def _distinct(cases: list[Case]) -> dict[Case, Case]:
    """Each case -> the first case that asks the same (itself when it is the first)."""
    first: dict[tuple[str, str, str], Case] = {}
    return {c: first.setdefault(_asks(c), c) for c in cases}


CASES = _cases()
STANDS_FOR = _distinct(CASES)
RUN = sorted(set(STANDS_FOR.values()), key=CASES.index)


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
    """The cases cover each file and each MIG model its layouts are written for, as many per file
    as pinned; every folded case asks exactly what the case run in its place asks."""
    per_file = {f: sum(1 for c in CASES if c[0] == f) for f in CASES_PER_FILE}
    assert per_file == CASES_PER_FILE
    assert {f for f, _, _ in CASES} == {p.name for p in COMPAT.glob("*.yaml")}
    assert {m for _, _, m in CASES} == {m.key for m in MODELS.values() if m.mig_capable}
    for case, stand_in in STANDS_FOR.items():
        assert stand_in in RUN
        assert case[2] == stand_in[2]
        assert _asks(case) == _asks(stand_in)
    assert len(RUN) < len(CASES)  # layouts written alike in two files, run once


def _ok(ran: Ran) -> str:
    assert ran.returncode == 0, ran.stdout + ran.stderr
    return ran.stdout


@pytest.fixture(scope="module")
def host_views(tmp_path_factory: pytest.TempPathFactory) -> HostViews:
    return HostViews(tmp_path_factory.mktemp("host-views"))


@pytest.mark.parametrize(
    ("file", "layout", "model"),
    RUN,
    ids=[f"{f.split('-config')[0]}:{lay}:{m}" for f, lay, m in RUN],
)
def test_mig_agent_and_mig_parted_agree_both_ways(
    file: str,
    layout: str,
    model: str,
    tmp_path: Path,
    nvidia_bin: Path,
    native_dir: Path,
    host_views: HostViews,
) -> None:
    parted = str(nvidia_bin / "nvidia-mig-parted")
    cfg = ["-f", str(COMPAT / file), "-c", layout]
    gpus = _gpus(file, layout, model)
    sim = ["--backend", "simulated", "--sim-state"]

    ours = str(tmp_path / "agent-applied.json")
    st.create_node(ours, gpus)
    _ok(mig_agent_in_process("apply", *cfg, *sim, ours))
    [asserted] = run_in_host_view(
        host_views, native_dir, ours, [[parted, "assert", *cfg]], tmp_path / "ours"
    )
    assert asserted.returncode == 0, asserted.stderr
    assert NOT_APPLIED not in asserted.stderr

    theirs = str(tmp_path / "parted-applied.json")
    st.create_node(theirs, gpus)
    applied, exported = run_in_host_view(
        host_views,
        native_dir,
        theirs,
        [[parted, "apply", *cfg], [parted, "export"]],
        tmp_path / "theirs",
    )
    assert applied.returncode == 0, applied.stderr
    _ok(mig_agent_in_process("assert", *cfg, *sim, theirs))

    assert exported.returncode == 0, exported.stderr
    agent_export = _ok(mig_agent_in_process("export", *sim, theirs))
    meant = per_gpu(exported.stdout, theirs, tmp_path)
    assert any(t is not None for t in meant)
    assert per_gpu(agent_export, theirs, tmp_path) == meant
    own_export = _ok(mig_agent_in_process("export", *sim, ours))
    assert per_gpu(own_export, ours, tmp_path) == meant
