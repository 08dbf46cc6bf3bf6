"""The reboot command's time limit is the setting reboot_timeout_s (MIG_AGENT_REBOOT_TIMEOUT_S,
120 s by default): a command still running then is killed and the pass fails naming it."""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from mig_agent.agent.phases.reboot import REBOOT_TIMEOUT_S, run_reboot
from mig_agent.config.settings import Settings
from mig_agent.core.errors import ConfigError, RebootFailed

HANGS = shlex.join([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_reboot_command_that_never_returns_fails_at_the_timeout_naming_it() -> None:
    started = time.monotonic()
    with pytest.raises(RebootFailed) as err:
        run_reboot(HANGS, timeout_s=0.5)
    assert time.monotonic() - started < 10
    assert str(err.value) == f"reboot command {HANGS!r} did not return within 0.5 s (killed)"
    assert err.value.context["command"] == HANGS


def test_the_reboot_timeout_is_a_setting() -> None:
    assert Settings().reboot_timeout_s == REBOOT_TIMEOUT_S == 120.0
    env = {"NODE_NAME": "n", "MIG_AGENT_REBOOT_TIMEOUT_S": "10"}
    assert Settings.from_env(env).reboot_timeout_s == 10.0
    for bad, message in (
        ("0", "reboot timeout must be positive"),
        ("soon", "MIG_AGENT_REBOOT_TIMEOUT_S='soon' is not a valid float"),
    ):
        with pytest.raises(ConfigError, match=message):
            Settings.from_env({**env, "MIG_AGENT_REBOOT_TIMEOUT_S": bad})


def _running(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:  # gone meanwhile
                continue
            # the arguments are NUL-separated
            if marker.encode() in cmdline.replace(b"\0", b" ") and int(proc.name) != os.getpid():
                pids.append(int(proc.name))
    return pids


def test_what_a_hanging_reboot_command_started_is_killed_with_it() -> None:
    """A shell script that waits on a child: before, the shell alone was killed and its child
    lived on (the agent's container would collect such orphans at every failed reboot)."""
    marker = f"{os.getpid()}.{time.monotonic_ns() % 1000}"
    command = f"sh -c 'sleep {marker}; echo never'"
    with pytest.raises(RebootFailed, match="did not return within 0.5 s"):
        run_reboot(command, timeout_s=0.5)
    deadline = time.monotonic() + 5
    while _running(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(f"sleep {marker}") == []
