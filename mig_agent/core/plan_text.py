"""A plan in words: what ``mig-agent plan`` prints and what the observe-only agent reports
(mig_agent.core.observe_report), so that both say a change the same way; and device ids named
in a reason. Pure."""

from __future__ import annotations

from mig_agent.core.planner import (
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    GpuPlan,
    Plan,
    SetMigMode,
    Step,
)


def step_text(step: Step) -> str:
    match step:
        case SetMigMode(enabled=on):
            return f"set MIG mode {'enabled' if on else 'disabled'}"
        case DestroyComputeInstance(gi_id=gi, ci_id=ci, profile=p):
            return f"destroy compute instance {ci} ({p}) in GPU instance {gi}"
        case DestroyGpuInstance(gi_id=gi, profile=p, placement=pl):
            return f"destroy GPU instance {gi} ({p}) at {pl}"
        case CreateGpuInstance(profile=p, placement=pl):
            return f"create GPU instance {p} at {pl}"
        case CreateComputeInstance(profile=p, gi_placement=gpl, placement=pl):
            return f"create compute instance {p} at {pl} in the GPU instance at {gpl}"
    raise AssertionError(step)


def headline(plan: Plan) -> str:
    return f"layout {plan.layout}: {len(plan.changed_gpus)} of {len(plan.gpus)} GPU(s) change"


def gpu_line(g: GpuPlan) -> str:
    """One GPU's change in a line (or that it has none)."""
    if g.is_empty:
        return f"GPU {g.gpu} ({g.model}): already {g.desired}, nothing to do"
    return (
        f"GPU {g.gpu} ({g.model}): {g.desired} -- {len(g.steps)} step(s), "
        f"{g.destroyed_gpu_instances} GPU instance(s) destroyed, "
        f"{g.created_gpu_instances} created"
    )


def plan_lines(plan: Plan) -> list[str]:
    """The plan as ``mig-agent plan`` prints it: per GPU its change, steps and result."""
    lines = [headline(plan)]
    for g in plan.gpus:
        lines.append(gpu_line(g))
        if g.is_empty:
            continue
        lines.extend(f"  {step_text(s)}" for s in g.steps)
        if g.devices:
            lines.append(
                "  result: "
                + ", ".join(
                    f"{d.profile}@{d.gi_placement}{' (kept)' if d.kept else ''}" for d in g.devices
                )
            )
    lines.extend(f"GPU {i}: not selected by the layout, left as it is" for i in plan.untouched)
    return lines


def first_few(ids: frozenset[str] | list[str], shown: int = 3) -> str:
    """``ids`` sorted, the first ``shown`` of them named and the rest as "...": a reason stays
    short whatever the number of devices."""
    listed = sorted(ids)
    return ", ".join(listed[:shown]) + (", ..." if len(listed) > shown else "")
