"""Applying a plan to this node's GPUs: the one apply sequence of the agent and the CLI (the
site's hooks around the steps, as mig-parted runs them), the steps themselves, and the check
that the GPUs are as the layout says.

Node-local: knows no Kubernetes. NVML create/destroy calls are never retried blindly (they are
not idempotent); a failed step stops the apply, and the next apply re-plans from what NVML says.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import assert_never

import structlog

from mig_agent.core import planner
from mig_agent.core.errors import GpuError, GpuResetRequired, GpuStepFailed, HookFailed
from mig_agent.core.gpu_models import GpuModel
from mig_agent.core.layout import Layout
from mig_agent.core.observed import NodeState
from mig_agent.core.placement import Placement
from mig_agent.core.planner import (
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    Plan,
    SetMigMode,
    Step,
)
from mig_agent.gpu.backend import GpuBackend
from mig_agent.node.hooks import (
    APPLY_EXIT,
    APPLY_START,
    POST_APPLY,
    PRE_APPLY_CONFIG,
    PRE_APPLY_MODE,
    HookRunner,
)

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class GpuReport:
    """What the executor did to one GPU."""

    gpu: int
    destroyed_gpu_instances: int = 0
    created_gpu_instances: int = 0
    destroyed_compute_instances: int = 0
    created_compute_instances: int = 0
    mig_mode_set: bool = False
    reset: bool = False

    @property
    def touched(self) -> bool:
        return bool(
            self.destroyed_gpu_instances
            or self.created_gpu_instances
            or self.destroyed_compute_instances
            or self.created_compute_instances
            or self.mig_mode_set
            or self.reset
        )


@dataclass(slots=True)
class ApplyReport:
    layout: str
    plan: Plan
    gpus: dict[int, GpuReport] = field(default_factory=dict)
    duration_s: float = 0.0

    @property
    def changed(self) -> bool:
        return any(r.touched for r in self.gpus.values())


def apply_layout(
    layout: Layout,
    gpus: GpuBackend,
    hook_run: HookRunner | None = None,
    *,
    destroy_in_use: bool = False,
    reset: bool = True,
    dry_run: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> ApplyReport:
    """Plan ``layout`` against the GPUs as they are, apply it (``apply_plan``, with the hooks of
    ``hook_run``), verify the result, and run the post-apply hooks when something changed.

    Raises PlanError/GpuBusy before anything is touched when the layout cannot be reached,
    GpuError when NVML refuses a step, GpuResetRequired when a MIG mode change stays pending,
    HookFailed when a hook does.
    """
    start = clock()
    models = gpus.models()
    the_plan = planner.plan(layout, gpus.observe(), models, destroy_in_use=destroy_in_use)
    report = ApplyReport(layout.name, the_plan)
    if dry_run:
        report.duration_s = clock() - start
        return report
    hook_run = hook_run or HookRunner.none()
    pending = apply_plan(the_plan, gpus, hook_run, report=report, reset=reset)
    if pending is not None:
        raise pending
    if not the_plan.is_empty:
        verify(layout, gpus.observe(), models)
        hook_run.run(POST_APPLY)
    report.duration_s = clock() - start
    return report


def apply_plan(
    the_plan: Plan,
    gpus: GpuBackend,
    hook_run: HookRunner,
    *,
    report: ApplyReport | None = None,
    reset: bool = True,
) -> GpuResetRequired | None:
    """The one apply sequence, as mig-parted runs it with its hooks: apply-start; pre-apply-mode
    and the mode phase; pre-apply-config and the instances; apply-exit always (told how the
    apply ended; its own failure the apply's only when nothing else failed). A GPU whose MIG
    mode change stays pending is returned once the other GPUs are done; anything else that
    fails is raised."""
    hook_run.run(APPLY_START)
    try:
        pending = execute_in_phases(the_plan, gpus, hook_run, report=report, reset=reset)
    except Exception as exc:
        apply_exit(hook_run, exc)
        raise
    apply_exit(hook_run, pending)
    return pending


def verify(layout: Layout, observed: NodeState, models: Mapping[int, GpuModel]) -> None:
    """GpuError unless the GPUs are now exactly as ``layout`` says."""
    after = planner.plan(layout, observed, models, destroy_in_use=True)
    if not after.is_empty:
        left = "; ".join(
            f"GPU {g.gpu}: {len(g.steps)} step(s) left" for g in after.gpus if not g.is_empty
        )
        raise GpuError(
            f"layout {layout.name!r} not reached after apply ({left})", layout=layout.name
        )


def execute(
    the_plan: Plan, gpus: GpuBackend, *, report: ApplyReport | None = None, reset: bool = True
) -> ApplyReport:
    """Run every step of ``the_plan`` in order; GPU instances are found by their placement.

    A GPU whose MIG mode change stays pending does not stop the others: they are done first, so
    that one reboot finishes the node; GpuResetRequired then names every such GPU. Any other
    error stops the apply at once.
    """
    report = report if report is not None else ApplyReport(the_plan.layout, the_plan)
    pending: list[GpuResetRequired] = []
    for gpu_plan in the_plan.gpus:
        if gpu_plan.is_empty:
            continue
        r = report.gpus.setdefault(gpu_plan.gpu, GpuReport(gpu_plan.gpu))
        gi_ids: dict[Placement, int] = {}
        try:
            for step in gpu_plan.steps:
                _run(step, gpus, r, gi_ids, reset=reset)
        except GpuResetRequired as exc:
            pending.append(exc)
        except GpuError as exc:
            if type(exc) is not GpuError:  # busy, no NVML: already what they are
                raise
            # part of the change may be done (a call that half succeeded): a retry re-plans
            raise GpuStepFailed(str(exc), **exc.context) from exc
    if len(pending) == 1:
        raise pending[0]
    if pending:
        indices = [e.context.get("gpu") for e in pending]
        raise GpuResetRequired(
            "; ".join(str(e) for e in pending), gpu=indices[0], gpus=indices
        ) from pending[0]
    return report


def _run(
    step: Step, gpus: GpuBackend, r: GpuReport, gi_ids: dict[Placement, int], *, reset: bool
) -> None:
    match step:
        case DestroyComputeInstance(gpu=g, gi_id=gi, ci_id=ci, profile=p):
            gpus.destroy_compute_instance(g, gi, ci)
            r.destroyed_compute_instances += 1
            log.info("gpu.compute_instance_destroyed", gpu=g, gi_id=gi, ci_id=ci, profile=p)
        case DestroyGpuInstance(gpu=g, gi_id=gi, profile=p, placement=pl):
            gpus.destroy_gpu_instance(g, gi)
            r.destroyed_gpu_instances += 1
            log.info("gpu.instance_destroyed", gpu=g, gi_id=gi, profile=p, placement=str(pl))
        case SetMigMode(gpu=g, enabled=on):
            gpus.set_mig_mode(g, enabled=on)
            r.mig_mode_set = True
            log.info("gpu.mig_mode_set", gpu=g, enabled=on)
            state = gpus.observe().gpu(g)
            if state.mig_current != on and reset:
                # NB: Ampere applies the mode only after a reset; reset just this GPU.
                gpus.reset_gpu(g)
                r.reset = True
                log.info("gpu.reset", gpu=g)
                state = gpus.observe().gpu(g)
            if state.mig_current != on:
                raise GpuResetRequired(
                    f"GPU {g}: MIG mode change to {'enabled' if on else 'disabled'} is pending "
                    "and needs a GPU reset or a reboot",
                    gpu=g,
                )
        case CreateGpuInstance(gpu=g, profile=p, profile_id=pid, placement=pl):
            gi_ids[pl] = gpus.create_gpu_instance(g, pid, pl)
            r.created_gpu_instances += 1
            log.info("gpu.instance_created", gpu=g, gi_id=gi_ids[pl], profile=p, placement=str(pl))
        case CreateComputeInstance(
            gpu=g, gi_placement=gpl, profile=p, profile_id=pid, placement=pl
        ):
            found = gi_ids.get(gpl)
            if found is None:  # a kept GPU instance: find it where it sits
                found = next(
                    (x.id for x in gpus.observe().gpu(g).gpu_instances if x.placement == gpl),
                    None,
                )
                if found is None:  # destroyed since the plan was made (by hand, another tool)
                    raise GpuStepFailed(
                        f"GPU {g}: the GPU instance at {gpl} that the plan keeps is gone "
                        f"(destroyed since the plan was made); {p} not created, the next pass "
                        "plans again",
                        gpu=g,
                    )
                gi_ids[gpl] = found
            ci = gpus.create_compute_instance(g, found, pid, pl)
            r.created_compute_instances += 1
            log.info(
                "gpu.compute_instance_created",
                gpu=g,
                gi_id=found,
                ci_id=ci,
                profile=p,
                placement=str(gpl),
            )
        case _:
            assert_never(step)


def execute_in_phases(
    the_plan: Plan,
    gpus: GpuBackend,
    hook_run: HookRunner,
    *,
    report: ApplyReport | None = None,
    reset: bool = True,
) -> GpuResetRequired | None:
    """Apply as mig-parted does with its hooks: pre-apply-mode and the mode phase (on each GPU
    whose MIG mode changes, its steps up to and with that change: the destroys first), then
    pre-apply-config and the config phase (the instances). A GPU whose mode stays pending skips
    the second; its GpuResetRequired is returned once the other GPUs are done."""
    mode, config = split(the_plan)
    pending = None
    if not mode.is_empty:
        hook_run.run(PRE_APPLY_MODE)
        try:
            execute(mode, gpus, report=report, reset=reset)
        except GpuResetRequired as exc:
            pending = exc
    waiting: set[int] = set()
    if pending is not None:  # the GPUs it names, else every GPU whose mode changes
        waiting = _gpus_of(pending) or {g.gpu for g in mode.gpus if not g.is_empty}
    config = replace(config, gpus=tuple(g for g in config.gpus if g.gpu not in waiting))
    if not config.is_empty:
        hook_run.run(PRE_APPLY_CONFIG)
        execute(config, gpus, report=report, reset=reset)
    return pending


def split(the_plan: Plan) -> tuple[Plan, Plan]:
    """The plan's mode phase (on each GPU whose MIG mode changes: its steps up to and with the
    mode change) and config phase (the rest)."""
    mode, config = [], []
    for g in the_plan.gpus:
        cut = next((i + 1 for i, st in enumerate(g.steps) if isinstance(st, SetMigMode)), 0)
        mode.append(replace(g, steps=g.steps[:cut]))
        config.append(replace(g, steps=g.steps[cut:]))
    return replace(the_plan, gpus=tuple(mode)), replace(the_plan, gpus=tuple(config))


def _gpus_of(exc: GpuResetRequired) -> set[int]:
    many = exc.context.get("gpus")
    if isinstance(many, list):
        return {g for g in many if isinstance(g, int)}
    one = exc.context.get("gpu")
    return {one} if isinstance(one, int) else set()


def apply_exit(hook_run: HookRunner, error: Exception | None) -> None:
    """apply-exit, after a successful or failed apply (MIG_AGENT_RESULT, MIG_AGENT_ERROR): its
    failure is the apply's only when nothing else failed, as in mig-parted."""
    try:
        hook_run.run(
            APPLY_EXIT,
            MIG_AGENT_RESULT="failed" if error else "success",
            MIG_AGENT_ERROR=str(error) if error else "",
        )
    except HookFailed as exc:
        if error is None:
            raise
        log.error("hook.failed", hook=APPLY_EXIT, error=str(exc))
