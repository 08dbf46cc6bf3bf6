"""The project's build scripts (scripts/<name> build|path), as the local cluster calls them: each
prints the folder or file it built on its last line of output."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Final

from .errors import DevClusterError

REPO: Final = Path(__file__).resolve().parents[3]


def built(script: str, command: str = "build", *, failed: str | None = None) -> Path:
    """What `scripts/<script> <command>` prints last: the path it built or found. DevClusterError
    with its error output (prefixed by `failed`, default "scripts/<script> <command> failed")."""
    done = subprocess.run(
        [str(REPO / "scripts" / script), command], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise DevClusterError(
            f"{failed or f'scripts/{script} {command} failed'}: {done.stderr.strip()[-2000:]}"
        )
    return Path(done.stdout.strip().splitlines()[-1])
