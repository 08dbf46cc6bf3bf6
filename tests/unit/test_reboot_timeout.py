"""The reboot command's time limit is the setting reboot_timeout_s (MIG_AGENT_REBOOT_TIMEOUT_S,
120 s by default): a command still running then is killed and the pass fails naming it."""

from __future__ import annotations

import shlex
import sys
import time

import pytest

from mig_agent.agent.reboot import REBOOT_TIMEOUT_S, run_reboot
from mig_agent.errors import ConfigError, RebootFailed
from mig_agent.settings import Settings

HANGS = shlex.join([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_reboot_command_that_never_returns_fails_at_the_timeout_naming_it() -> None:
    started = time.monotonic()
    with pytest.raises(RebootFailed) as err:
        run_reboot(HANGS, timeout_s=0.5)
    assert time.monotonic() - started < 10
    assert str(err.value) == f"reboot command {HANGS!r} did not return within 0.5 s"
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
