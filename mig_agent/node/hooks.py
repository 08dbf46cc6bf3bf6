"""The site's hooks around an apply: mig-parted's hooks file (``api/hooks/v1``) and the pre- and
post-apply commands, read here and run with the node's context (mig_agent.host.commands runs
each command).

Hooks file::

    version: v1
    hooks:
      apply-start:                  # each hook: a list of commands, run in order
      - command: /bin/sh            # absolute path, or found on the agent's PATH
        args: ["-c", "echo $MIG_PARTED_SELECTED_CONFIG"]
        envs: {KEY: value}          # optional
        workdir: /etc/site          # optional

Each command gets, over its own ``envs``, the variables mig-parted gives its hooks and
mig-agent's own:

* MIG_PARTED_CONFIG_FILE, MIG_PARTED_SELECTED_CONFIG (the layout), MIG_PARTED_HOOKS_FILE,
  MIG_PARTED_SKIP_RESET=false, MIG_PARTED_MODE_CHANGE_ONLY=false;
* NODE_NAME, MIG_AGENT_LAYOUT, MIG_AGENT_HOOK (the hook's name), MIG_AGENT_CHANGED_GPUS and
  MIG_AGENT_CHANGED_GPU_UUIDS (comma-separated), MIG_AGENT_MODE_CHANGE (true or false),
  MIG_AGENT_RESULT (apply-exit: success or failed) and MIG_AGENT_ERROR (apply-exit after a
  failure: the error);
* PATH, the agent's.
"""

from __future__ import annotations

import difflib
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog

from mig_agent.config.settings import Settings
from mig_agent.config.yaml_files import load_yaml, only_keys
from mig_agent.core import planner
from mig_agent.core.errors import HookFailed, InvalidConfig
from mig_agent.core.observed import NodeState
from mig_agent.host.commands import (
    DEFAULT_PATH,
    NODE_OUTPUT_CAP,
    Command,
    Completed,
    Runner,
    trimmed,
)

log = structlog.get_logger(__name__)

APPLY_START = "apply-start"
PRE_APPLY_MODE = "pre-apply-mode"
PRE_APPLY_CONFIG = "pre-apply-config"
APPLY_EXIT = "apply-exit"
POST_APPLY = "post-apply"
HOOK_NAMES = (APPLY_START, PRE_APPLY_MODE, PRE_APPLY_CONFIG, APPLY_EXIT, POST_APPLY)
"""mig-parted's four hooks, and post-apply: after a successful apply (mig-agent's own)."""


@dataclass(frozen=True, slots=True)
class Hooks:
    """The commands of each hook, in order; ``source`` names where they come from."""

    commands: Mapping[str, tuple[Command, ...]] = field(default_factory=dict)
    source: str = ""

    def of(self, name: str) -> tuple[Command, ...]:
        return self.commands.get(name, ())

    def __bool__(self) -> bool:
        return any(self.commands.values())


def load_hooks(path: str = "", *, pre_apply: str = "", post_apply: str = "") -> Hooks:
    """The hooks of mig-parted's hooks file ``path`` (if any), with ``pre_apply`` last of
    apply-start and ``post_apply`` last of post-apply. InvalidConfig naming the file, the hook
    and the key for anything mig-parted's format does not have, or a hook name no apply runs."""
    commands: dict[str, list[Command]] = {}
    if path:
        commands = {k: list(v) for k, v in _parse_hooks(load_yaml(path), path).items()}
    for name, text in ((APPLY_START, pre_apply), (POST_APPLY, post_apply)):
        if text.strip():
            commands.setdefault(name, []).append(Command(tuple(shlex.split(text))))
    sources = [
        s
        for s in (
            path,
            "pre_apply_command" if pre_apply.strip() else "",
            "post_apply_command" if post_apply.strip() else "",
        )
        if s
    ]
    return Hooks({k: tuple(v) for k, v in commands.items()}, ", ".join(sources))


def _parse_hooks(data: object, source: str) -> dict[str, tuple[Command, ...]]:
    if not isinstance(data, dict):
        raise InvalidConfig(
            f"{source}: a hooks file is a mapping with version and hooks, "
            f"not {type(data).__name__}",
            file=source,
        )
    only_keys(data, ("version", "hooks"), source, source)
    if data.get("version") != "v1":
        raise InvalidConfig(
            f"{source}: version must be v1, got {data.get('version')!r}", file=source
        )
    hooks = data.get("hooks") or {}
    if not isinstance(hooks, dict):
        raise InvalidConfig(
            f"{source}: hooks must map hook names to lists of commands", file=source
        )
    out: dict[str, tuple[Command, ...]] = {}
    for name, entries in hooks.items():
        where = f"{source}: hook {name!r}"
        if name not in HOOK_NAMES:
            near = difflib.get_close_matches(str(name), HOOK_NAMES, n=1)
            raise InvalidConfig(
                f"{where}: no such hook (hooks: {', '.join(HOOK_NAMES)})"
                + (f"; did you mean {near[0]}?" if near else ""),
                file=source,
                hook=str(name),
            )
        if not isinstance(entries, list):
            raise InvalidConfig(f"{where}: must be a list of commands", file=source)
        out[str(name)] = tuple(
            _parse_command(e, f"{where} command {i + 1}", source) for i, e in enumerate(entries)
        )
    return out


def _parse_command(raw: object, where: str, source: str) -> Command:
    if not isinstance(raw, dict):
        raise InvalidConfig(
            f"{where}: must be a mapping with command, args, envs, workdir", file=source
        )
    only_keys(raw, ("command", "args", "envs", "workdir"), where, source)
    command, args = raw.get("command"), raw.get("args") or []
    envs, workdir = raw.get("envs") or {}, raw.get("workdir") or ""
    if not isinstance(command, str) or not command:
        raise InvalidConfig(f"{where}: command must be a non-empty string", file=source)
    if not isinstance(args, list) or not all(isinstance(a, str | int | float) for a in args):
        raise InvalidConfig(f"{where}: args must be a list of strings", file=source)
    if not isinstance(envs, dict) or not all(isinstance(k, str) for k in envs):
        raise InvalidConfig(f"{where}: envs must map names to values", file=source)
    if not isinstance(workdir, str):
        raise InvalidConfig(f"{where}: workdir must be a string", file=source)
    return Command(
        (command, *(str(a) for a in args)),
        {k: "" if v is None else str(v) for k, v in envs.items()},
        workdir,
    )


def run_hook(
    hooks: Hooks, name: str, context: Mapping[str, str], *, runner: Runner, timeout_s: float
) -> int:
    """Run the commands of hook ``name`` in order; the first failure stops them (HookFailed
    with the command's output, trimmed). Each command's environment is mig-parted's: the
    hook's ``envs`` with ``context`` over them, plus the agent's PATH. Returns how many ran."""
    ran = 0
    for command in hooks.of(name):
        env = {"PATH": os.environ.get("PATH", DEFAULT_PATH), **command.envs, **context}
        done = runner(command, env, timeout_s)
        ran += 1
        if not done.ok:
            # the whole end of its output in the log; on the node, read by anyone who reads
            # Nodes, a short one with what looks like a secret masked
            log.error(
                "hook.failed",
                hook=name,
                command=str(command),
                returncode=done.returncode,
                error=done.error,
                output=trimmed(done.output),
            )
            raise HookFailed(
                f"{name} hook `{command}` {done.failure(NODE_OUTPUT_CAP, scrub=True)}",
                hook=name,
                command=str(command),
                returncode=done.returncode,
            )
    return ran


def load(s: Settings) -> Hooks:
    """The configured hooks; InvalidConfig naming the file for a malformed hooks file."""
    return load_hooks(s.hooks_file, pre_apply=s.pre_apply_command, post_apply=s.post_apply_command)


def context(
    s: Settings, layout: str, the_plan: planner.Plan, observed: NodeState
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

    @classmethod
    def none(cls) -> HookRunner:
        """No hooks: an apply without any."""
        return cls(Hooks(), lambda *_: Completed(0, ""), 0.0, {})

    def run(self, name: str, **extra: str) -> None:
        if not self.hooks.of(name):
            return
        log.info("hook.started", hook=name)
        ran = run_hook(
            self.hooks,
            name,
            {**self.env, "MIG_AGENT_HOOK": name, **extra},
            runner=self.run_command,
            timeout_s=self.timeout_s,
        )
        log.info("hook.finished", hook=name, commands=ran)
