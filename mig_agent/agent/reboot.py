"""The reboot command, for a MIG mode change only a reboot can finish (no GPU reset possible)."""

from __future__ import annotations

import shlex
import subprocess

from mig_agent.errors import RebootFailed

REBOOT_TIMEOUT_S = 120.0


def run_reboot(command: str) -> None:
    """Run the reboot command; RebootFailed naming the command and how it failed."""
    try:
        subprocess.run(
            shlex.split(command),
            check=True,
            timeout=REBOOT_TIMEOUT_S,  # noqa: S603
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
            f"reboot command {command!r} did not return within {REBOOT_TIMEOUT_S:.0f} s",
            command=command,
        ) from exc
    except (OSError, ValueError) as exc:  # not found, not executable, unbalanced quotes
        raise RebootFailed(
            f"reboot command {command!r} could not run: {exc}", command=command
        ) from exc
