"""Commands the agent runs on the node besides NVML: the hooks around an apply (mig-parted's
hooks file, the pre- and post-apply commands) and the host's GPU client services (systemctl
through the host's root). The boundary of these commands: one function runs a command with a
timeout and returns its exit status and output; the two files they come from are parsed here.

Hooks file (mig-parted's ``api/hooks/v1`` format)::

    version: v1
    hooks:
      apply-start:                  # each hook: a list of commands, run in order
      - command: /bin/sh            # absolute path, or found on the agent's PATH
        args: ["-c", "echo $MIG_PARTED_SELECTED_CONFIG"]
        envs: {KEY: value}          # optional
        workdir: /etc/site          # optional

GPU clients file (the GPU Operator's ``default-gpu-clients`` ConfigMap)::

    version: v1
    systemd-services: [nvsm.service, nvidia-dcgm.service, dcgm-exporter.service]
"""

from __future__ import annotations

import contextlib
import difflib
import os
import shlex
import signal
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mig_agent.catalog import load_yaml
from mig_agent.errors import HookFailed, InvalidConfig

APPLY_START = "apply-start"
PRE_APPLY_MODE = "pre-apply-mode"
PRE_APPLY_CONFIG = "pre-apply-config"
APPLY_EXIT = "apply-exit"
POST_APPLY = "post-apply"
HOOK_NAMES = (APPLY_START, PRE_APPLY_MODE, PRE_APPLY_CONFIG, APPLY_EXIT, POST_APPLY)
"""mig-parted's four hooks, and post-apply: after a successful apply (mig-agent's own)."""

OUTPUT_CAP = 1500
"""Characters of a failed command's output kept for the failure reason (its end)."""
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True, slots=True)
class Command:
    argv: tuple[str, ...]
    envs: Mapping[str, str] = field(default_factory=dict)
    workdir: str = ""

    def __str__(self) -> str:
        return shlex.join(self.argv)


@dataclass(frozen=True, slots=True)
class Completed:
    """How a command ended: ``error`` says why it could not run or finish ("" when it exited,
    with ``returncode``); ``output`` is its stdout and stderr together."""

    returncode: int
    output: str
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.returncode == 0

    def failure(self) -> str:
        """What went wrong, with the end of the output: for a reason on the node."""
        said = trimmed(self.output)
        what = self.error or f"exited with status {self.returncode}"
        return what + (f": {said}" if said else "")


Runner = Callable[[Command, Mapping[str, str], float], Completed]
"""Runs a command with this environment (replacing the agent's) and timeout (run_command)."""


def trimmed(output: str, cap: int = OUTPUT_CAP) -> str:
    """The end of ``output``, at most ``cap`` characters, lines joined with " | "."""
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    text = " | ".join(lines)
    return text if len(text) <= cap else "..." + text[-(cap - 3):]


def run_command(command: Command, env: Mapping[str, str], timeout_s: float) -> Completed:
    """Run ``command`` in a session of its own; past ``timeout_s`` the whole session is killed."""
    try:
        proc = subprocess.Popen(  # noqa: S603  (the operator's own command, no shell)
            list(command.argv), env=dict(env), cwd=command.workdir or None,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace", start_new_session=True)
    except (OSError, ValueError) as exc:  # not found, not executable, no such workdir
        return Completed(-1, "", f"could not run: {exc}")
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the command and whatever it started
        out, _ = proc.communicate()
        return Completed(-1, out or "", f"did not finish within {timeout_s:g} s (killed)")
    return Completed(proc.returncode, out or "")


# ---------------------------------------------------------------------------------------------
# Hooks


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
    sources = [s for s in (path, "pre_apply_command" if pre_apply.strip() else "",
                           "post_apply_command" if post_apply.strip() else "") if s]
    return Hooks({k: tuple(v) for k, v in commands.items()}, ", ".join(sources))


def _parse_hooks(data: object, source: str) -> dict[str, tuple[Command, ...]]:
    if not isinstance(data, dict):
        raise InvalidConfig(f"{source}: a hooks file is a mapping with version and hooks, "
                            f"not {type(data).__name__}", file=source)
    _only(data, ("version", "hooks"), source, source)
    if data.get("version") != "v1":
        raise InvalidConfig(f"{source}: version must be v1, got {data.get('version')!r}",
                            file=source)
    hooks = data.get("hooks") or {}
    if not isinstance(hooks, dict):
        raise InvalidConfig(f"{source}: hooks must map hook names to lists of commands",
                            file=source)
    out: dict[str, tuple[Command, ...]] = {}
    for name, entries in hooks.items():
        where = f"{source}: hook {name!r}"
        if name not in HOOK_NAMES:
            near = difflib.get_close_matches(str(name), HOOK_NAMES, n=1)
            raise InvalidConfig(f"{where}: no such hook (hooks: {', '.join(HOOK_NAMES)})"
                                + (f"; did you mean {near[0]}?" if near else ""),
                                file=source, hook=str(name))
        if not isinstance(entries, list):
            raise InvalidConfig(f"{where}: must be a list of commands", file=source)
        out[str(name)] = tuple(_parse_command(e, f"{where} command {i + 1}", source)
                               for i, e in enumerate(entries))
    return out


def _parse_command(raw: object, where: str, source: str) -> Command:
    if not isinstance(raw, dict):
        raise InvalidConfig(f"{where}: must be a mapping with command, args, envs, workdir",
                            file=source)
    _only(raw, ("command", "args", "envs", "workdir"), where, source)
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
    return Command((command, *(str(a) for a in args)),
                   {k: "" if v is None else str(v) for k, v in envs.items()}, workdir)


def _only(data: Mapping[object, object], allowed: tuple[str, ...], where: str,
          source: str) -> None:
    for key in data:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), allowed, n=1)
            raise InvalidConfig(f"{where}: unknown key {key!r} (keys: {', '.join(allowed)})"
                                + (f"; did you mean {near[0]}?" if near else ""),
                                file=source, key=str(key))


def run_hook(hooks: Hooks, name: str, context: Mapping[str, str], *, runner: Runner,
             timeout_s: float) -> int:
    """Run the commands of hook ``name`` in order; the first failure stops them (HookFailed
    with the command's output, trimmed). Each command's environment is mig-parted's: the
    hook's ``envs`` with ``context`` over them, plus the agent's PATH. Returns how many ran."""
    ran = 0
    for command in hooks.of(name):
        env = {"PATH": os.environ.get("PATH", DEFAULT_PATH), **command.envs, **context}
        done = runner(command, env, timeout_s)
        ran += 1
        if not done.ok:
            raise HookFailed(f"{name} hook `{command}` {done.failure()}",
                             hook=name, command=str(command), returncode=done.returncode)
    return ran


# ---------------------------------------------------------------------------------------------
# Host GPU clients


def load_gpu_clients(path: str) -> tuple[str, ...]:
    """The systemd services of a GPU clients file (the GPU Operator's format)."""
    data = load_yaml(path)
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise InvalidConfig(f"{path}: a GPU clients file is a mapping with version and "
                            f"systemd-services, not {type(data).__name__}", file=path)
    _only(data, ("version", "systemd-services"), path, path)
    if data.get("version", "v1") != "v1":
        raise InvalidConfig(f"{path}: version must be v1, got {data.get('version')!r}",
                            file=path)
    services = data.get("systemd-services") or []
    if not isinstance(services, list) or not all(
            isinstance(s, str) and s and not s.startswith("-") and " " not in s
            for s in services):
        raise InvalidConfig(f"{path}: systemd-services must be a list of unit names",
                            file=path)
    return tuple(dict.fromkeys(services))  # in order, once each


def service_command(base: str, action: str, service: str) -> Command:
    """``base`` (systemctl or a command that takes its arguments) with ``action service``."""
    return Command((*shlex.split(base), action, service))
