"""What the observe-only agent (``mig-agent run --observe``) says it would do for the layout
label: the GPUs that would change, the instances destroyed and created, the pods the drain would
evict, or why the pass would be refused or fail. As an Event message (the words of ``mig-agent
plan``) and as the JSON of its annotation, both within the sizes the API and the admission
policies allow. Pure."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mig_agent.core.plan_text import gpu_line, headline
from mig_agent.core.planner import (
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    GpuPlan,
    Plan,
    SetMigMode,
)

ANNOTATION_CAP = 4096
"""The admission policies cap the agent's annotations at this many characters (deploy/
policies.py REASON_CAP)."""
MESSAGE_CAP = 1024
"""Event messages are cut at this length by the client."""
NOTHING_DONE = "observe mode, nothing changed"


@dataclass(frozen=True, slots=True)
class ObserveReport:
    """One observe pass: the plan for ``layout``, or the ``error`` that stopped it."""

    layout: str
    plan: Plan | None = None
    evict: tuple[str, ...] = ()  # "namespace/name" of each pod the drain would evict
    refused: tuple[str, ...] = ()  # why the drain would refuse to start (nothing touched)
    error: str = ""  # why the pass would fail before touching anything

    @property
    def changes(self) -> bool:
        return self.plan is not None and not self.plan.is_empty


def _destroyed(g: GpuPlan) -> list[str]:
    """What of the GPU goes: GPU instances, and compute instances of GPU instances that stay
    (a destroyed GPU instance's go with it)."""
    gone = {s.gi_id for s in g.steps if isinstance(s, DestroyGpuInstance)}
    out = []
    for s in g.steps:
        if isinstance(s, DestroyGpuInstance):
            out.append(f"{s.profile}@{s.placement}")
        elif isinstance(s, DestroyComputeInstance) and s.gi_id not in gone:
            out.append(f"{s.profile} (compute instance {s.ci_id} of GPU instance {s.gi_id})")
    return out


def _created(g: GpuPlan) -> list[str]:
    """What is made: GPU instances, and compute instances in GPU instances that stay."""
    made = {s.placement for s in g.steps if isinstance(s, CreateGpuInstance)}
    out = []
    for s in g.steps:
        if isinstance(s, CreateGpuInstance):
            out.append(f"{s.profile}@{s.placement}")
        elif isinstance(s, CreateComputeInstance) and s.gi_placement not in made:
            out.append(f"{s.profile}@{s.placement} in the GPU instance at {s.gi_placement}")
    return out


def _gpu_json(g: GpuPlan, *, detail: bool) -> dict[str, Any]:
    modes = [s.enabled for s in g.steps if isinstance(s, SetMigMode)]
    out: dict[str, Any] = {"gpu": g.gpu, "model": g.model}
    if modes:
        out["mig_mode"] = "enabled" if modes[-1] else "disabled"
    destroyed, created = _destroyed(g), _created(g)
    if detail:
        out["destroyed"], out["created"] = destroyed, created
    else:  # too long for the annotation: how many
        out["destroyed"], out["created"] = len(destroyed), len(created)
    return out


def _as_json(r: ObserveReport, *, detail: bool, evict: int) -> str:
    data: dict[str, Any] = {"layout": r.layout, "changes": r.changes}
    if r.plan is not None:
        data["summary"] = headline(r.plan)
        data["gpus"] = [_gpu_json(g, detail=detail) for g in r.plan.gpus if not g.is_empty]
    if r.changes:
        data["evict"] = list(r.evict[:evict])
        if evict < len(r.evict):
            data["evict_count"] = len(r.evict)
    if r.refused:
        data["refused"] = list(r.refused)
    if r.error:
        data["error"] = r.error
    return json.dumps(data, separators=(",", ":"))


def annotation(r: ObserveReport, cap: int = ANNOTATION_CAP) -> str:
    """The report as compact JSON of at most ``cap`` characters: the instances listed, or
    counted where the lists do not fit; then as many pods as fit (``evict_count`` all of them);
    then the texts cut."""
    for detail in (True, False):
        text = _as_json(r, detail=detail, evict=len(r.evict))
        if len(text) <= cap:
            return text
    keep = len(r.evict)
    while keep and len(text) > cap:
        keep //= 2
        text = _as_json(r, detail=False, evict=keep)
    if len(text) <= cap:
        return text
    short = ObserveReport(
        r.layout, r.plan, r.evict, tuple(t[:200] for t in r.refused[:3]), r.error[:1000]
    )
    return _as_json(short, detail=False, evict=0)


def message(r: ObserveReport) -> str:
    """The report in words, for an Event: what a pass would do, nothing of which was done."""
    if r.error:
        text = f"{NOTHING_DONE}: layout {r.layout} would fail: {r.error}"
    elif r.plan is None or r.plan.is_empty:
        text = f"{NOTHING_DONE}: layout {r.layout} is applied; nothing to change"
    else:
        gpus = "; ".join(gpu_line(g) for g in r.plan.gpus if not g.is_empty)
        pods = (
            f"would evict {len(r.evict)} GPU pod(s): {', '.join(r.evict)}"
            if r.evict
            else "would evict no pod"
        )
        text = f"{NOTHING_DONE}: would apply {headline(r.plan)}: {gpus}; {pods}"
        if r.refused:
            text += "; but the drain would refuse to start: " + "; ".join(r.refused)
    return text if len(text) <= MESSAGE_CAP else text[: MESSAGE_CAP - 3] + "..."
