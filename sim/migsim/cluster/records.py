"""Per-node records of the processes started on a node of the local cluster (agents.py,
mig_manager.py): a JSON file in the cluster directory, node -> record, so that another process
(a test, `scripts/local-cluster down`) can find and stop them.

Every read-modify-write of the file holds its lock: processes that start and stop nodes side by
side (parallel tests, benchmarks) would otherwise drop each other's records, and a node whose
record is lost keeps its processes running after stop_node.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .processes import Proc, kill


@dataclass(frozen=True, slots=True)
class RecordFile:
    """The records file `name` of a cluster directory, with the lock file `lock` beside it."""

    name: str
    lock: str

    @contextlib.contextmanager
    def locked(self, directory: Path) -> Iterator[None]:
        """Hold the lock for a read-modify-write of the records."""
        with (directory / self.lock).open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def load(self, directory: Path) -> dict[str, dict[str, Any]]:
        """The records per node; {} when there are none (no file, or not a readable one)."""
        try:
            data: dict[str, dict[str, Any]] = json.loads((directory / self.name).read_text())
            return data
        except (OSError, ValueError):
            return {}

    def save(self, directory: Path, records: Mapping[str, Any]) -> None:
        """Replace the records at once (written beside the file, then renamed over it)."""
        tmp = directory / f"{self.name}.tmp"
        tmp.write_text(json.dumps(records, indent=2) + "\n")
        tmp.replace(directory / self.name)

    def put(self, directory: Path, node: str, record: dict[str, Any]) -> None:
        """Record `record` as `node`'s, in place of any it had."""
        with self.locked(directory):
            records = self.load(directory)
            records[node] = record
            self.save(directory, records)


def procs(record: Mapping[str, Any], keys: Sequence[str]) -> list[Proc]:
    """The processes `record` has under `keys`, in their order (a key it lacks is skipped)."""
    return [Proc(**record[k]) for k in keys if record.get(k)]


def kill_one(records: Mapping[str, Mapping[str, Any]], node: str, key: str) -> Proc | None:
    """SIGKILL the process `node`'s record has under `key`; the killed process, or None when
    there is no such record or process."""
    record = records.get(node)
    if record is None or not record.get(key):
        return None
    proc = Proc(**record[key])
    kill(proc)
    return proc
