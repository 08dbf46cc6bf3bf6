"""Commands the agent runs on the host besides NVML -- the site's hooks, the host's GPU client
services (systemctl through the host's root) -- and the file that names those services. The
boundary of these commands: one function runs a command with a timeout and returns its exit
status and output.

GPU clients file (the GPU Operator's ``default-gpu-clients`` ConfigMap)::

    version: v1
    systemd-services: [nvsm.service, nvidia-dcgm.service, dcgm-exporter.service]
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mig_agent.config.yaml_files import load_yaml, only_keys
from mig_agent.core.errors import InvalidConfig

OUTPUT_CAP = 1500
"""Characters of a failed command's output kept for the failure reason (its end)."""
NODE_OUTPUT_CAP = 300
"""Characters of a failed hook's output put on the node, which anyone who reads Nodes reads
(its annotation, condition and Event); the agent's log keeps OUTPUT_CAP."""
_SECRET = re.compile(
    r"(?i)\b(password|passwd|token|secret|api[_-]?key|authorization|bearer)(\s*[=:]?\s*)(\S+)"
)
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

    def failure(self, cap: int = OUTPUT_CAP, *, scrub: bool = False) -> str:
        """What went wrong, with the end of the output (at most ``cap`` characters; with
        ``scrub``, what looks like a password or token masked): for a reason."""
        said = trimmed(scrubbed(self.output) if scrub else self.output, cap)
        what = self.error or f"exited with status {self.returncode}"
        return what + (f": {said}" if said else "")


Runner = Callable[[Command, Mapping[str, str], float], Completed]
"""Runs a command with this environment (replacing the agent's) and timeout (run_command)."""


def scrubbed(output: str) -> str:
    """``output`` with the values after words like password, token or secret masked."""
    return _SECRET.sub(lambda m: f"{m.group(1)}{m.group(2)}***", output)


def trimmed(output: str, cap: int = OUTPUT_CAP) -> str:
    """The end of ``output``, at most ``cap`` characters, lines joined with " | "."""
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    text = " | ".join(lines)
    return text if len(text) <= cap else "..." + text[-(cap - 3) :]


def run_command(command: Command, env: Mapping[str, str], timeout_s: float) -> Completed:
    """Run ``command`` in a session of its own; past ``timeout_s`` the whole session is killed."""
    try:
        proc = subprocess.Popen(  # noqa: S603  (the operator's own command, no shell)
            list(command.argv),
            env=dict(env),
            cwd=command.workdir or None,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
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


def load_gpu_clients(path: str) -> tuple[str, ...]:
    """The systemd services of a GPU clients file (the GPU Operator's format)."""
    data = load_yaml(path)
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise InvalidConfig(
            f"{path}: a GPU clients file is a mapping with version and "
            f"systemd-services, not {type(data).__name__}",
            file=path,
        )
    only_keys(data, ("version", "systemd-services"), path, path)
    if data.get("version", "v1") != "v1":
        raise InvalidConfig(f"{path}: version must be v1, got {data.get('version')!r}", file=path)
    services = data.get("systemd-services") or []
    if not isinstance(services, list) or not all(
        isinstance(s, str) and s and not s.startswith("-") and " " not in s for s in services
    ):
        raise InvalidConfig(f"{path}: systemd-services must be a list of unit names", file=path)
    return tuple(dict.fromkeys(services))  # in order, once each


def service_command(base: str, action: str, service: str) -> Command:
    """``base`` (systemctl or a command that takes its arguments) with ``action service``."""
    return Command((*shlex.split(base), action, service))
