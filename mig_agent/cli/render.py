"""Plans and MIG profiles as text and JSON, for the one-node commands."""

from __future__ import annotations

import json
from typing import Any

from mig_agent.cli.common import (
    out,
)
from mig_agent.core.gpu_models import GpuModel
from mig_agent.core.plan_text import plan_lines
from mig_agent.core.planner import (
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    Plan,
    SetMigMode,
    Step,
)


def step_json(step: Step) -> dict[str, Any]:
    def pl(p: Any) -> dict[str, int]:
        return {"start": p.start, "size": p.size}

    match step:
        case SetMigMode(enabled=on):
            return {"op": "set_mig_mode", "enabled": on}
        case DestroyComputeInstance(gi_id=gi, ci_id=ci, profile=p):
            return {"op": "destroy_compute_instance", "gi_id": gi, "ci_id": ci, "profile": p}
        case DestroyGpuInstance(gi_id=gi, profile=p, placement=x):
            return {"op": "destroy_gpu_instance", "gi_id": gi, "profile": p, "placement": pl(x)}
        case CreateGpuInstance(profile=p, profile_id=pid, placement=x):
            return {
                "op": "create_gpu_instance",
                "profile": p,
                "profile_id": pid,
                "placement": pl(x),
            }
        case CreateComputeInstance(profile=p, profile_id=pid, gi_placement=g, placement=x):
            return {
                "op": "create_compute_instance",
                "profile": p,
                "profile_id": pid,
                "gi_placement": pl(g),
                "placement": pl(x),
            }
    raise AssertionError(step)


def plan_json(plan: Plan) -> dict[str, Any]:
    return {
        "layout": plan.layout,
        "changes": not plan.is_empty,
        "untouched_gpus": list(plan.untouched),
        "gpus": [
            {
                "gpu": g.gpu,
                "model": g.model,
                "desired": str(g.desired),
                "steps": [step_json(s) for s in g.steps],
                "destroyed_gpu_instances": g.destroyed_gpu_instances,
                "created_gpu_instances": g.created_gpu_instances,
                "devices": [
                    {
                        "profile": d.profile,
                        "placement": {"start": d.gi_placement.start, "size": d.gi_placement.size},
                        "compute_placement": {
                            "start": d.ci_placement.start,
                            "size": d.ci_placement.size,
                        },
                        "kept": d.kept,
                    }
                    for d in g.devices
                ],
            }
            for g in plan.gpus
        ],
    }


def print_plan(plan: Plan) -> None:
    for line in plan_lines(plan):
        out(line)


def print_profiles(models: dict[int, GpuModel] | dict[str, GpuModel], *, as_json: bool) -> None:
    seen: dict[str, GpuModel] = {}
    for m in models.values():
        seen.setdefault(m.key, m)
    if as_json:
        out(
            json.dumps(
                {
                    k: [
                        {
                            "name": p.name,
                            "index": p.index,
                            "id": p.id,
                            "slices": p.slices,
                            "memory_mib": p.memory_mib,
                            "instances": p.instance_count,
                            "multiprocessors": p.multiprocessors,
                            "engines": {
                                "copy": p.engines.copy,
                                "decoder": p.engines.decoder,
                                "encoder": p.engines.encoder,
                                "jpeg": p.engines.jpeg,
                                "ofa": p.engines.ofa,
                            },
                            "placements": [
                                {"start": x.start, "size": x.size} for x in p.placements
                            ],
                            "compute_instances": [
                                {
                                    "name": p.ci_name(c),
                                    "index": c.index,
                                    "id": c.id,
                                    "slices": c.slices,
                                    "instances": c.instance_count,
                                    "multiprocessors": c.multiprocessors,
                                    "placements": [
                                        {"start": x.start, "size": x.size} for x in c.placements
                                    ],
                                }
                                for c in p.ci_profiles
                            ],
                        }
                        for p in m.gi_profiles
                    ]
                    for k, m in seen.items()
                },
                indent=2,
            )
        )
        return
    for m in seen.values():
        # placements print in NVML's units; say so where they are not memory slices
        grid = (
            f"; {m.memory_slices} memory slices, placed on a {m.placement_units}-unit grid"
            if m.placement_units != m.memory_slices
            else ""
        )
        out(f"{m.name} ({m.key}, 0x{m.pci_device_id:08X}, {m.memory_total_mib} MiB{grid})")
        if not m.mig_capable:
            out("  no MIG support")
            continue
        out(
            f"  {'profile':<14}{'id':>4}{'idx':>5}{'inst':>6}{'MiB':>8}{'SM':>5}"
            f"  CE/DEC/ENC/JPG/OFA  placements"
        )
        for p in m.gi_profiles:
            e = p.engines
            starts = ",".join(str(x.start) for x in p.placements)
            out(
                f"  {p.name:<14}{p.id:>4}{p.index:>5}{p.instance_count:>6}{p.memory_mib:>8}"
                f"{p.multiprocessors:>5}  {e.copy}/{e.decoder}/{e.encoder}/{e.jpeg}/{e.ofa:<10}"
                f"  {{{starts}}}:{p.placement_size}"
            )
