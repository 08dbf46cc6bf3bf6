"""The local cluster's record of the agents it started (agents.json) and of NVIDIA's DRA plugins
and their followers (dra-plugins.json): what runs per node, and stopping them all. Apart from
agents.py so that the cluster's `down` stops them without a circle of imports (agents.py starts
agents on a Cluster)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .processes import Proc, stop
from .records import RecordFile, procs

RECORDS = RecordFile("agents.json", lock=".agents.lock")
# NVIDIA's DRA kubelet plugin per node: {"plugin": Proc} (dra_plugin.py) and, where it follows
# the node's DRA driver pod, {"runtime": Proc}, the follower that runs it (dra_runtime.py)
DRA_RECORDS = RecordFile("dra-plugins.json", lock=".dra-plugins.lock")


def supervisor_status(status_file: Path | str) -> dict[str, Any]:
    """What the supervisor says (supervisor.py); {} when it has not said anything yet."""
    try:
        data: dict[str, Any] = json.loads(Path(status_file).read_text())
        return data
    except (OSError, ValueError):
        return {}


def node_procs(record: Mapping[str, Any]) -> list[Proc]:
    """The processes of a node's record, in stopping order: the supervisor before its agent."""
    return procs(record, ("supervisor", "agent", "device_plugin"))


def reap_group(leader: Proc, timeout: float = 10.0) -> None:
    """Wait until no process of `leader`'s group (it is gone) is left, SIGKILL what stays: the
    node runtime's children (NVIDIA's plugin, GFD, the GPU simulator) outlive the script that led
    the group by the moment they take to stop. A group id is never reused while the group has
    members, so this signals only processes that the node's start put there."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(leader.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader.pid, signal.SIGKILL)
            return
        time.sleep(0.05)


def stop_all(directory: Path) -> list[str]:
    """Stop every recorded node process (agents, device plugins, DRA followers and plugins); the
    names of those that needed SIGKILL."""
    killed = stop_dra_plugins(directory)
    with RECORDS.locked(directory):
        records = running(directory)
        killed += stop([p for r in records.values() for p in node_procs(r)])
        for r in records.values():
            if r.get("device_plugin"):
                reap_group(Proc(**r["device_plugin"]))
        RECORDS.save(directory, {})
    return killed


def stop_dra_plugins(directory: Path, node: str | None = None) -> list[str]:
    """Stop the recorded DRA followers and plugins (of `node` only, if given), the process groups
    to the last member (the plugin and the GPU simulator outlive the script that leads the group).

    The followers go first, so that none starts a plugin again, and without the records' lock
    held: a follower that stops clears its plugin's record. Then whatever plugin is still recorded
    (a follower's that was killed, or one started by hand) is stopped."""

    def mine(records: Mapping[str, Any]) -> dict[str, Any]:
        return {n: r for n, r in records.items() if node is None or n == node}

    with DRA_RECORDS.locked(directory):
        followers = [
            p for r in mine(DRA_RECORDS.load(directory)).values() for p in procs(r, ("runtime",))
        ]
    killed = stop(followers)
    for follower in followers:
        reap_group(follower)
    with DRA_RECORDS.locked(directory):
        records = DRA_RECORDS.load(directory)
        gone = mine(records)
        plugins = [p for r in gone.values() for p in procs(r, ("plugin",))]
        killed += stop(plugins)
        for plugin in plugins:
            reap_group(plugin)
        DRA_RECORDS.save(directory, {n: r for n, r in records.items() if n not in gone})
    return killed


def record_dra(directory: Path, node: str, key: str, proc: Proc) -> None:
    """Record `proc` as `node`'s DRA `key` (`plugin` or `runtime`), beside the node's other one."""
    with DRA_RECORDS.locked(directory):
        records = DRA_RECORDS.load(directory)
        records[node] = {**records.get(node, {}), key: asdict(proc)}
        DRA_RECORDS.save(directory, records)


def forget_dra(directory: Path, node: str, key: str, proc: Proc) -> None:
    """Drop `node`'s DRA `key` if it still records `proc` (a stopped plugin, say)."""
    with DRA_RECORDS.locked(directory):
        records = DRA_RECORDS.load(directory)
        record = records.get(node, {})
        if record.get(key) != asdict(proc):
            return
        del record[key]
        if record:
            records[node] = record
        else:
            del records[node]
        DRA_RECORDS.save(directory, records)


def running(directory: Path) -> dict[str, dict[str, Any]]:
    """The recorded agents per node; `agent` is the process that runs now (or ran last), as
    its supervisor reports it, with the supervisor's `state` and `restarts`."""
    records = RECORDS.load(directory)
    for record in records.values():
        if not record.get("status_file"):
            continue
        status = supervisor_status(record["status_file"])
        if status.get("agent"):
            record["agent"] = status["agent"]
        record["restarts"] = int(status.get("restarts", 0))
        record["state"] = status.get("state", "")
        record["last_exit"] = status.get("last_exit", "")
    return records
