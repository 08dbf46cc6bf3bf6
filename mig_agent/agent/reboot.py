"""The reboot command, for a MIG mode change only a reboot can finish (no GPU reset possible)."""

from __future__ import annotations

import shlex
import subprocess

from mig_agent.errors import RebootFailed
from mig_agent.settings import Settings

REBOOT_TIMEOUT_S = Settings().reboot_timeout_s
"""The default of the setting reboot_timeout_s."""


def run_reboot(command: str, timeout_s: float = REBOOT_TIMEOUT_S) -> None:
    """Run the reboot command; RebootFailed naming the command and how it failed. A command
    still running after ``timeout_s`` (the setting reboot_timeout_s) is killed."""
    try:
        subprocess.run(
            shlex.split(command),
            check=True,
            timeout=timeout_s,  # noqa: S603
            capture_output=True,
            text=True,
        )
    except subprocess.CalledProcessError as exc:
        said = (exc.stderr or exc.stdout or "").strip().splitlines()[-1:]
        raise RebootFailed(
            f"reboot command {command!r} failed with exit status "
            f"{exc.returncode}" + (f": {said[0][:300]}" if said else ""),
            command=command,
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise RebootFailed(
            f"reboot command {command!r} did not return within {timeout_s:g} s",
            command=command,
        ) from exc
    except (OSError, ValueError) as exc:  # not found, not executable, unbalanced quotes
        raise RebootFailed(
            f"reboot command {command!r} could not run: {exc}", command=command
        ) from exc
