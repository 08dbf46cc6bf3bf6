"""We test that the agent's GPU catalog (mig_agent.core.gpu_models) agrees with the simulator's GPU
data (sim/migsim/gpus, written from the reference documents, not from the catalog), for every
model both know, matched by PCI device id: so a model is covered as soon as both sides have it.

Aspect by aspect: identity (key, NVML name, GFD product label), subsystem id (where the references
give one), memory total, architecture and whether a MIG mode change needs a reset, the placement
grid and compute slices, the GI profiles (id -> index and name), their instance counts, memory,
SMs, slices, engines and placements, the CI profiles of each (those of the 1g REV2 GI apart), and
the MIG device names. A disagreement the references do not settle is listed in
tests/catalog_findings.py and expected to fail here (xfail, strict).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from migsim import gpus as sim
from migsim.gpus import GpuModel as SimModel

from mig_agent.core.gpu_models import MODELS, GpuModel
from tests.catalog_findings import FINDINGS

View = Callable[[Any], object]  # the part of a model an aspect compares, as plain values


def _engines(e: Any) -> tuple[int, ...]:
    return (e.copy, e.decoder, e.encoder, e.jpeg, e.ofa)


def _per_gi(view: Callable[[Any], object], where: Callable[[Any], bool] = bool) -> View:
    return lambda m: {p.id: view(p) for p in m.gi_profiles if where(p)}


def _rev2(p: Any) -> bool:
    return bool(p.index == 9)  # NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2


def _placements(pls: Any) -> tuple[tuple[int, int], ...]:
    return tuple((p.start, p.size) for p in pls)


def _cis(gi: Any) -> tuple[tuple[object, ...], ...]:
    return tuple(
        sorted(
            (
                c.index,
                c.id,
                c.slices,
                c.instance_count,
                c.multiprocessors,
                _placements(c.placements),
            )
            for c in gi.ci_profiles
        )
    )


def _device_names(m: Any) -> frozenset[str]:
    return frozenset(gi.ci_name(ci) for gi in m.gi_profiles for ci in gi.ci_profiles)


def _grid(m: Any) -> tuple[int, int, int]:
    # the width of the grid placements are given in (the catalog's placement_units, what the
    # agent's backend reads from NVML: the end of the last placement; the simulator's
    # placement_grid), the memory slices and the compute slices
    grid = m.placement_grid if isinstance(m, SimModel) else m.placement_units
    return grid, m.memory_slices, m.compute_slices


def _reset(m: Any) -> tuple[str, bool]:
    if isinstance(m, SimModel):
        return m.architecture.value, m.mig_mode_needs_reset and m.mig_capable
    return m.architecture.value, m.architecture.mig_mode_needs_reset and m.mig_capable


ASPECTS: dict[str, View] = {
    "identity": lambda m: (m.key, m.name, m.product),
    "memory_total_mib": lambda m: m.memory_total_mib,
    "architecture": _reset,
    "geometry": _grid,
    "gi_profiles": _per_gi(lambda p: (p.index, p.name)),
    "instance_counts": _per_gi(lambda p: p.instance_count),
    "gi_memory_mib": _per_gi(lambda p: p.memory_mib),
    "gi_multiprocessors": _per_gi(lambda p: p.multiprocessors),
    "gi_slices": _per_gi(lambda p: p.slices),
    "engines": _per_gi(lambda p: _engines(p.engines)),
    "placements": _per_gi(lambda p: _placements(p.placements)),
    "ci_profiles": _per_gi(_cis, lambda p: not _rev2(p)),
    "ci_profiles_1g_rev2": _per_gi(_cis, _rev2),
    "device_names": _device_names,
}

BOTH = sorted(
    (
        (c, sim.MODEL_BY_PCI_ID[c.pci_device_id])
        for c in MODELS.values()
        if c.pci_device_id in sim.MODEL_BY_PCI_ID
    ),
    key=lambda pair: pair[0].key,
)


def _param(c: GpuModel, s: SimModel, aspect: str) -> Any:
    finding = FINDINGS.get((c.key, aspect))
    marks = [pytest.mark.xfail(strict=True, reason=finding)] if finding else []
    return pytest.param(c, s, aspect, id=f"{c.key}-{aspect}", marks=marks)


@pytest.mark.parametrize(
    ("catalog", "simulated", "aspect"), [_param(c, s, a) for c, s in BOTH for a in ASPECTS]
)
def test_the_catalog_agrees_with_the_simulated_gpu(
    catalog: GpuModel, simulated: SimModel, aspect: str
) -> None:
    view = ASPECTS[aspect]
    assert view(catalog) == view(simulated), f"{catalog.key} {aspect}: catalog != simulator"


@pytest.mark.parametrize(("catalog", "simulated"), BOTH, ids=[c.key for c, _ in BOTH])
def test_the_catalog_subsystem_id_is_one_the_references_give(
    catalog: GpuModel, simulated: SimModel
) -> None:
    if not simulated.pci_subsystem_ids:
        pytest.skip(f"no subsystem id of {catalog.key} in the references: the catalog's unchecked")
    assert catalog.pci_subsystem_id in simulated.pci_subsystem_ids


def test_the_models_compared_are_the_ones_both_sides_know() -> None:
    """Each catalog model with simulator data is compared; the findings name compared pairs."""
    assert {c.key for c, _ in BOTH} >= {"A100-40GB", "A30", "H100-80GB", "H200", "DGX-Display"}
    compared = {(c.key, a) for c, _ in BOTH for a in ASPECTS}
    assert set(FINDINGS) <= compared, set(FINDINGS) - compared


def test_catalog_models_without_simulator_data() -> None:
    """Every catalog model has simulator data: none goes unchecked against the references."""
    missing = [k for k, m in MODELS.items() if m.pci_device_id not in sim.MODEL_BY_PCI_ID]
    assert missing == [], (
        f"in the catalog, not in sim/migsim/gpus (checked against nothing): {missing}"
    )
