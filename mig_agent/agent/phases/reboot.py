"""The reboot command, for a MIG mode change only a reboot can finish (no GPU reset possible)."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
from pathlib import Path

from mig_agent.config.settings import Settings
from mig_agent.core.errors import RebootFailed

REBOOT_TIMEOUT_S = Settings().reboot_timeout_s
"""The default of the setting reboot_timeout_s."""
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")  # the host's, also inside a container


def current_boot_id() -> str:
    """The kernel's id of this boot ("" if unreadable): the reboot guard tells by it whether the
    node rebooted since the reboot was asked."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def asked_reboot(layout: str, boot_id: str) -> str:
    """The reboot annotation's value: the layout a reboot was asked for, and the boot it was
    asked in (``layout@boot``; the layout alone when the boot id is unknown)."""
    return f"{layout}@{boot_id}" if boot_id else layout


def parse_asked(value: str) -> tuple[str, str]:
    """(layout, boot id) of a reboot annotation's value ("" for a boot id not recorded)."""
    layout, _, boot = value.partition("@")
    return layout, boot


def run_reboot(command: str, timeout_s: float = REBOOT_TIMEOUT_S) -> None:
    """Run the reboot command; RebootFailed naming the command and how it failed. The command
    runs in a session of its own: still running after ``timeout_s`` (the setting
    reboot_timeout_s), it is killed with whatever it started (a shell's children too)."""
    try:
        proc = subprocess.Popen(  # noqa: S603  (the operator's own command, no shell)
            shlex.split(command),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
    except (OSError, ValueError) as exc:  # not found, not executable, unbalanced quotes
        raise RebootFailed(
            f"reboot command {command!r} could not run: {exc}", command=command
        ) from exc
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()  # not communicate(): something that left the session may hold the pipes
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        raise RebootFailed(
            f"reboot command {command!r} did not return within {timeout_s:g} s (killed)",
            command=command,
        ) from exc
    if proc.returncode != 0:
        said = (err or out or "").strip().splitlines()[-1:]
        raise RebootFailed(
            f"reboot command {command!r} failed with exit status "
            f"{proc.returncode}" + (f": {said[0][:300]}" if said else ""),
            command=command,
        )
