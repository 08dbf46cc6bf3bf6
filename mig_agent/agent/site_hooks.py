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

from dataclasses import dataclass

import structlog

from mig_agent import planner
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
