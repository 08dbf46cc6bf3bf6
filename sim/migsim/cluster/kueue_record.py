"""Where the local cluster records the Kueue controller it started, and how ``down`` stops it:
apart from kueue.py, which needs the cluster, so that the cluster's ``down`` needs nothing of
Kueue's but this."""

from __future__ import annotations

from pathlib import Path
from typing import Final

from .processes import stop
from .records import RecordFile, procs

RECORDS: Final = RecordFile("kueue.json", lock=".kueue.lock")
KEY: Final = "kueue"


def stop_recorded(directory: Path) -> list[str]:
    """Stop the Kueue controller recorded in `directory`, if any; names needing SIGKILL."""
    if not (directory / RECORDS.lock).exists() and not (directory / RECORDS.name).exists():
        return []
    with RECORDS.locked(directory):
        killed = stop(procs(RECORDS.load(directory).get(KEY, {}), (KEY,)))
        RECORDS.save(directory, {})
    return killed
