"""The kubelet's part for an agent process: restart it when it exits, with the kubelet's back-off.

`python -m migsim.cluster.supervisor --status FILE --log LOG --name NAME -- ARGV...` runs ARGV
(in a session of its own, output appended to LOG) and, whenever it exits -- crashed, killed, or
ended by itself, as a container with `restartPolicy: Always` -- starts it again after a delay
that begins at `--backoff` seconds and doubles after each restart up to `--backoff-max` (a
kubelet: 10 s doubling to 5 min); a run that lasted longer than twice the cap (the kubelet's 10
minutes) resets the delay. SIGTERM or SIGINT to the supervisor stops the process (SIGTERM, then
SIGKILL) and ends the supervisor without a restart: what is stopped on purpose stays stopped.

The status FILE (JSON, replaced atomically) says what runs now: `state` (`running`, `back-off`,
`stopped`), the current process (`agent`: name, pid, start_ticks), `restarts`, `last_exit` (e.g.
`killed by SIGKILL`, `exit status 1`) and, in back-off, `restart_at` (wall-clock seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any

from .processes import Proc, spawn, stop

_stopping = False


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _stopping
    _stopping = True


def backoff_delay(restarts: int, initial: float, cap: float) -> float:
    """Delay before restart number `restarts + 1` after `restarts` back-to-back restarts."""
    return float(min(cap, initial * 2 ** min(restarts, 64)))


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exit status {os.WEXITSTATUS(status)}"


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data) + "\n")
    tmp.replace(path)


def _say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "time": time.time(), **fields}), flush=True)


def _wait_exit(proc: Proc) -> int | None:
    """The wait status once `proc` (our child) exits; None if we were told to stop first."""
    while not _stopping:
        try:
            pid, status = os.waitpid(proc.pid, os.WNOHANG)
        except ChildProcessError:
            return 0
        if pid:
            return status
        time.sleep(0.05)
    return None


def supervise(
    argv: Sequence[str],
    *,
    name: str,
    log: Path,
    status_file: Path,
    initial: float,
    cap: float,
    reset_after: float | None = None,
) -> int:
    reset_after = 2 * cap if reset_after is None else reset_after
    restarts = consecutive = 0
    last_exit = ""
    while not _stopping:
        started = time.monotonic()
        try:
            proc: Proc | None = spawn(name, argv, log)
        except RuntimeError as e:  # died at once: counts as an exit like any other
            proc, status = None, None
            last_exit = str(e)
        if proc is not None:
            _write(
                status_file,
                {
                    "state": "running",
                    "agent": asdict(proc),
                    "restarts": restarts,
                    "last_exit": last_exit,
                    "supervisor_pid": os.getpid(),
                },
            )
            _say("process.started", name=name, pid=proc.pid, restarts=restarts)
            status = _wait_exit(proc)
            if status is None:  # told to stop
                stop([proc], timeout=8.0)
                break
            last_exit = _describe(status)
        if time.monotonic() - started > reset_after:
            consecutive = 0
        delay = backoff_delay(consecutive, initial, cap)
        _say("process.exited", name=name, how=last_exit, restart_in_s=delay)
        _write(
            status_file,
            {
                "state": "back-off",
                "agent": asdict(proc) if proc else None,
                "restarts": restarts,
                "last_exit": last_exit,
                "restart_at": time.time() + delay,
                "supervisor_pid": os.getpid(),
            },
        )
        deadline = time.monotonic() + delay
        while not _stopping and time.monotonic() < deadline:
            time.sleep(0.05)
        if _stopping:
            break
        restarts += 1
        consecutive += 1
    try:
        current = json.loads(status_file.read_text())
    except (OSError, ValueError):
        current = {}
    _write(status_file, {**current, "state": "stopped", "supervisor_pid": os.getpid()})
    _say("supervisor.stopped", name=name, restarts=restarts)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m migsim.cluster.supervisor")
    p.add_argument("--name", required=True)
    p.add_argument("--log", type=Path, required=True, help="the process's output (appended)")
    p.add_argument("--status", type=Path, required=True, help="JSON status file")
    p.add_argument("--backoff", type=float, default=10.0, help="first restart delay (10 s)")
    p.add_argument("--backoff-max", type=float, default=300.0, help="delay cap (300 s)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command to supervise")
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return supervise(
        command,
        name=args.name,
        log=args.log,
        status_file=args.status,
        initial=args.backoff,
        cap=args.backoff_max,
    )


if __name__ == "__main__":
    sys.exit(main())
