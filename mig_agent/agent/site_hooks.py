"""The hooks of a change, with the node's context: mig-parted's hooks file and the pre- and
post-apply commands (mig_agent.hooks runs them). Each command gets, over its own ``envs``, the
variables mig-parted gives its hooks and mig-agent's own:

* MIG_PARTED_CONFIG_FILE, MIG_PARTED_SELECTED_CONFIG (the layout), MIG_PARTED_HOOKS_FILE,
  MIG_PARTED_SKIP_RESET=false, MIG_PARTED_MODE_CHANGE_ONLY=false;
* NODE_NAME, MIG_AGENT_LAYOUT, MIG_AGENT_HOOK (the hook's name), MIG_AGENT_CHANGED_GPUS and
  MIG_AGENT_CHANGED_GPU_UUIDS (comma-separated), MIG_AGENT_MODE_CHANGE (true or false),
  MIG_AGENT_RESULT (apply-exit: success or failed) and MIG_AGENT_ERROR (apply-exit after a
  failure: the error);
* PATH, the agent's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import structlog

from mig_agent import hooks, planner
from mig_agent.errors import GpuResetRequired, HookFailed
from mig_agent.executor import ApplyReport, execute
from mig_agent.gpu.backend import GpuBackend
from mig_agent.hooks import Hooks, Runner, load_hooks, run_hook
from mig_agent.settings import Settings
from mig_agent.state import NodeState

log = structlog.get_logger(__name__)


def load(s: Settings) -> Hooks:
    """The configured hooks; InvalidConfig naming the file for a malformed hooks file."""
    return load_hooks(s.hooks_file, pre_apply=s.pre_apply_command,
                      post_apply=s.post_apply_command)


def context(s: Settings, layout: str, the_plan: planner.Plan, observed: NodeState
            ) -> dict[str, str]:
    changed = the_plan.changed_gpus
    uuids = [g.info.uuid for g in observed.gpus if g.index in changed]
    return {
        "MIG_PARTED_CONFIG_FILE": s.config,
        "MIG_PARTED_SELECTED_CONFIG": layout,
        "MIG_PARTED_HOOKS_FILE": s.hooks_file,
        "MIG_PARTED_SKIP_RESET": "false",
        "MIG_PARTED_MODE_CHANGE_ONLY": "false",
        "NODE_NAME": s.node_name,
        "MIG_AGENT_LAYOUT": layout,
        "MIG_AGENT_CHANGED_GPUS": ",".join(map(str, changed)),
        "MIG_AGENT_CHANGED_GPU_UUIDS": ",".join(uuids),
        "MIG_AGENT_MODE_CHANGE": str(any(g.changes_mig_mode for g in the_plan.gpus)).lower(),
    }


@dataclass(frozen=True, slots=True)
class HookRunner:
    """Runs the hooks of one pass; HookFailed (with the command's output) when one fails."""

    hooks: Hooks
    run_command: Runner
    timeout_s: float
    env: dict[str, str]

    def run(self, name: str, **extra: str) -> None:
        if not self.hooks.of(name):
            return
        log.info("hook.started", hook=name)
        ran = run_hook(self.hooks, name, {**self.env, "MIG_AGENT_HOOK": name, **extra},
                       runner=self.run_command, timeout_s=self.timeout_s)
        log.info("hook.finished", hook=name, commands=ran)


def execute_in_phases(the_plan: planner.Plan, gpus: GpuBackend, hook_run: HookRunner, *,
                      report: ApplyReport | None = None, reset: bool = True
                      ) -> GpuResetRequired | None:
    """Apply as mig-parted does with its hooks: pre-apply-mode and the mode phase (on each GPU
    whose MIG mode changes, its steps up to and with that change: the destroys first), then
    pre-apply-config and the config phase (the instances). A GPU whose mode stays pending skips
    the second; its GpuResetRequired is returned once the other GPUs are done."""
    mode, config = split(the_plan)
    pending = None
    if not mode.is_empty:
        hook_run.run(hooks.PRE_APPLY_MODE)
        try:
            execute(mode, gpus, report=report, reset=reset)
        except GpuResetRequired as exc:
            pending = exc
    waiting: set[int] = set()
    if pending is not None:  # the GPUs it names, else every GPU whose mode changes
        waiting = _gpus_of(pending) or {g.gpu for g in mode.gpus if not g.is_empty}
    config = replace(config, gpus=tuple(g for g in config.gpus if g.gpu not in waiting))
    if not config.is_empty:
        hook_run.run(hooks.PRE_APPLY_CONFIG)
        execute(config, gpus, report=report, reset=reset)
    return pending


def apply_exit(hook_run: HookRunner, error: Exception | None) -> None:
    """apply-exit, after a successful or failed apply (MIG_AGENT_RESULT, MIG_AGENT_ERROR): its
    failure is the apply's only when nothing else failed, as in mig-parted."""
    try:
        hook_run.run(hooks.APPLY_EXIT, MIG_AGENT_RESULT="failed" if error else "success",
                     MIG_AGENT_ERROR=str(error) if error else "")
    except HookFailed as exc:
        if error is None:
            raise
        log.error("hook.failed", hook=hooks.APPLY_EXIT, error=str(exc))


def split(the_plan: planner.Plan) -> tuple[planner.Plan, planner.Plan]:
    """The plan's mode phase (on each GPU whose MIG mode changes: its steps up to and with the
    mode change) and config phase (the rest)."""
    mode, config = [], []
    for g in the_plan.gpus:
        cut = next((i + 1 for i, st in enumerate(g.steps) if isinstance(st, planner.SetMigMode)),
                   0)
        mode.append(replace(g, steps=g.steps[:cut]))
        config.append(replace(g, steps=g.steps[cut:]))
    return replace(the_plan, gpus=tuple(mode)), replace(the_plan, gpus=tuple(config))


def _gpus_of(exc: GpuResetRequired) -> set[int]:
    many = exc.context.get("gpus")
    if isinstance(many, list):
        return {g for g in many if isinstance(g, int)}
    one = exc.context.get("gpu")
    return {one} if isinstance(one, int) else set()
