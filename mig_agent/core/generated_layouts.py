"""Layouts generated from a GPU model's own MIG profiles, for models the profile configs do not
cover -- what MIG Manager does for hardware it has no config for, so that a new GPU model can be
partitioned before anyone writes its layouts.

Per model: ``all-disabled``, ``all-enabled`` (MIG on, no instances) and ``all-<profile>`` for every
GPU-instance profile the model lists, at that profile's instance count; every rule filtered to the
model's PCI id. A generated rule joins a layout of the same name as its last rule (so it wins for
that model only: later rules override), or makes a new layout. Pure module: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mig_agent.core.errors import PlanError
from mig_agent.core.gpu_models import GpuModel
from mig_agent.core.layout import (
    DeviceFilter,
    DeviceSelector,
    GpuLayout,
    Layout,
    LayoutCatalog,
    MigProfile,
    Rule,
)
from mig_agent.core.planner import demands_for

SOURCE = "generated from the GPUs' MIG profiles"


def model_layouts(model: GpuModel) -> list[Layout]:
    """The generated layouts of one MIG-capable model (none for a model without MIG)."""
    if not model.mig_capable:
        return []
    select = DeviceSelector(filters=(DeviceFilter(model.pci_device_id),))
    out = [
        Layout("all-disabled", (Rule(select, GpuLayout.of(False)),), SOURCE),
        Layout("all-enabled", (Rule(select, GpuLayout.of(True)),), SOURCE),
    ]
    for gi in model.gi_profiles:
        profile = MigProfile.parse(gi.name)
        out.append(
            Layout(
                f"all-{gi.name.replace('+', '.')}",
                (Rule(select, GpuLayout.of(True, {profile: gi.instance_count})),),
                SOURCE,
            )
        )
    return out


def covers(catalog: LayoutCatalog, model: GpuModel) -> bool:
    """True when some layout partitions this model with profiles it has (beyond all-disabled
    and all-enabled, which fit any model)."""
    for layout in catalog.layouts.values():
        target = layout.target_for(0, model.pci_device_id, model.pci_subsystem_id)
        if target is None or not target.mig_enabled or not target.devices:
            continue
        try:
            demands_for(model, target)
        except PlanError:
            continue
        return True
    return False


def with_generated(
    catalog: LayoutCatalog, models: Iterable[GpuModel]
) -> tuple[LayoutCatalog, list[GpuModel]]:
    """``catalog`` plus the generated layouts of every MIG-capable model it does not cover;
    also the models generated for."""
    layouts = dict(catalog.layouts)
    generated: list[GpuModel] = []
    seen: set[int] = set()
    for model in models:
        if model.pci_device_id in seen or not model.mig_capable or covers(catalog, model):
            continue
        seen.add(model.pci_device_id)
        generated.append(model)
        for g in model_layouts(model):
            have = layouts.get(g.name)
            layouts[g.name] = (
                g if have is None else Layout(have.name, have.rules + g.rules, have.source)
            )
    return LayoutCatalog.of(layouts.values()), generated


def to_config(layouts: Iterable[Layout]) -> dict[str, Any]:
    """Generated layouts as a mig-parted ``version: v1`` config (for printing)."""
    configs: dict[str, list[dict[str, Any]]] = {}
    for layout in layouts:
        for rule in layout.rules:
            filters = [str(f) for f in rule.selector.filters]
            entry: dict[str, Any] = {
                "device-filter": filters[0] if len(filters) == 1 else filters,
                "devices": "all",
                "mig-enabled": rule.gpu_layout.mig_enabled,
            }
            if rule.gpu_layout.mig_enabled:
                entry["mig-devices"] = rule.gpu_layout.counts
            configs.setdefault(layout.name, []).append(entry)
    return {"version": "v1", "mig-configs": configs}
