"""Start, identify and stop the cluster's processes, each in a process group of its own.

A PID alone is a weak handle: after a reboot or a long pause the number may belong to some other
program. Each started process is therefore recorded with its kernel start time (field 22 of
/proc/<pid>/stat), and `stop` signals a PID only while that start time still matches, so it can
never hit a stranger. Processes are started in a session of their own (setsid): each is the leader
of its own group (pgid == pid), is detached from the terminal that ran `up`, and is stopped
together with any child it forks by signalling that one group.

Whoever stops or kills a process it started itself (a test session, a benchmark) also waits for
it, so that no zombie stays behind; a process that another one started (`local-cluster up`, then
`down` from another shell) belongs to init once its starter has exited, and init reaps it.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Proc:
    """A process this cluster started: its name (`etcd`, `kube-apiserver`, ...), PID, start time."""

    name: str
    pid: int
    start_ticks: int

    def alive(self) -> bool:
        """Whether this very process (same PID *and* start time) still runs and is not a zombie."""
        stat = _read_stat(self.pid)
        return stat is not None and stat[1] == self.start_ticks and stat[0] != "Z"

    def rss_bytes(self) -> int:
        """Resident memory of the process (0 when it is gone)."""
        if not self.alive():
            return 0
        try:
            pages = int(Path(f"/proc/{self.pid}/statm").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            return 0
        return pages * _PAGE_SIZE

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the process has used so far (0 when it is gone)."""
        fields = _stat_fields(self.pid)
        if fields is None or int(fields[19]) != self.start_ticks:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / _TICKS_PER_SECOND


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on, or None if there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; fields after the last ')' cannot.
    return text[text.rindex(")") + 2 :].split()


def parent_pid(pid: int) -> int | None:
    """The parent's PID of `pid`, or None if there is no such process."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


def _read_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of `pid`, or None if there is no such process."""
    fields = _stat_fields(pid)
    return None if fields is None else (fields[0], int(fields[19]))


_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10000  # below the ephemeral range, above the well-known servers' ports


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default if unreadable)."""
    try:
        low, high = _PORT_RANGE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports that are free on 127.0.0.1 right now, all below the kernel's
    ephemeral range.

    Below it because any outgoing connection (a watch on the API server, a probe) takes a local
    port from that range: a server told to bind a port chosen there could find it taken, and a
    restarted agent then failed for minutes with "address already in use". Ports are drawn at
    random and each is bound once to check that it is free; the sockets stay open until every
    port is chosen so that they are distinct. Another server of ours could still take one in
    between (two draws of the same free port): rare, and the price of not hard-coding ports
    (which would stop two clusters running side by side).
    """
    low, high = _LOWEST_PORT, ephemeral_range()[0] - 1
    rng = random.SystemRandom()
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", rng.randint(low, high)))
            except OSError:
                s.close()
                continue
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def spawn(name: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> Proc:
    """Start `argv` in a new session, stdout and stderr appended to `log`, stdin from /dev/null;
    `env` replaces the environment (default: this process's)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        # posix_spawn rather than subprocess.Popen: the process must outlive this Python process
        # (`up` returns to the shell), so its handle is the recorded PID and start time, and
        # `stop`/`kill` reap it while it is our child. Python opens its own descriptors
        # close-on-exec, so only these three reach the child.
        pid = os.posix_spawn(
            argv[0],
            list(argv),
            dict(os.environ if env is None else env),
            file_actions=[
                (os.POSIX_SPAWN_DUP2, devnull, 0),
                (os.POSIX_SPAWN_DUP2, out, 1),
                (os.POSIX_SPAWN_DUP2, out, 2),
            ],
            setsid=True,
        )
    finally:
        os.close(out)
        os.close(devnull)
    stat = _read_stat(pid)
    if stat is None or stat[0] == "Z":  # died at once (bad flag, missing library)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        raise RuntimeError(f"{name} exited immediately; see {log}")
    return Proc(name, pid, stat[1])


def stop(procs: Sequence[Proc], timeout: float = 10.0) -> list[str]:
    """SIGTERM each process group, wait, SIGKILL what is left; names of those that needed SIGKILL.

    Groups are signalled one after the other in the given order (callers pass the reverse of the
    start order, so kwok and the controllers go before the API server, and etcd goes last).
    """
    killed: list[str] = []
    for proc in procs:
        if _ended(proc):
            continue
        _signal_group(proc, signal.SIGTERM)
        if not _wait_ended(proc, time.monotonic() + timeout):
            _signal_group(proc, signal.SIGKILL)
            killed.append(proc.name)
            _wait_ended(proc, None)
    return killed


def kill(proc: Proc) -> None:
    """SIGKILL the group of `proc` at once, as a crash would; return once it has ended."""
    if not _ended(proc):
        _signal_group(proc, signal.SIGKILL)
        _wait_ended(proc, None)


def _signal_group(proc: Proc, sig: signal.Signals) -> None:
    # The group id is the leader's PID; the caller has just checked that the leader is still ours.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _wait_ended(proc: Proc, deadline: float | None) -> bool:
    """Wait until `proc` has ended (None: however long that takes); False on the deadline."""
    while not _ended(proc):
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _ended(proc: Proc) -> bool:
    """Whether `proc` is over: collected, when it is our own child (collected here if it has
    exited); exited, when another process started it (its zombie is that parent's, or init's)."""
    fields = _stat_fields(proc.pid)
    if fields is None or int(fields[19]) != proc.start_ticks:
        return True  # collected already; the PID may name another process by now
    if int(fields[1]) == os.getpid():
        # Not `alive()`: the leader of a multi-threaded program shows Z while its other threads
        # still run or exit, and cannot be collected until they are gone.
        with contextlib.suppress(ChildProcessError):
            return os.waitpid(proc.pid, os.WNOHANG)[0] != 0
        return True
    return fields[0] == "Z"
