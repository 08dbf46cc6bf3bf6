"""We test the node commands boundary (mig_agent.node.hooks), with real processes:

* mig-parted's hooks file format loads (its own default hooks file unchanged), with the pre- and
  post-apply commands appended to their hooks; a malformed file is refused naming the file,
  the hook and the key (and the near name for a misspelt one);
* the GPU Operator's GPU clients file loads; a malformed one is refused;
* run_command: exit status and output, a command that cannot run, a timeout that kills the
  command and what it started; run_hook stops at the first failure with its output trimmed and
  gives each command mig-parted's environment (its envs, the context over them, PATH);
* settings: a command that does not split, or stopping host clients without a list, is refused.
"""

from __future__ import annotations

import os
import select
import time
from pathlib import Path
from typing import Any

import pytest

from mig_agent.config.settings import Settings
from mig_agent.core.errors import ConfigError, HookFailed, InvalidConfig
from mig_agent.host import commands
from mig_agent.node import hooks

# mig-parted's deployments/systemd/hooks-default.yaml (facts of its format: version, hooks, and
# per command workdir, command, args)
MIG_PARTED_DEFAULT = """\
version: v1
hooks:
    apply-start:
    - workdir: "/etc/nvidia-mig-manager"
      command: "/bin/bash"
      args: ["-x", "-c", "source hooks.sh; apply-start ${MIG_PARTED_SELECTED_CONFIG}"]
    pre-apply-mode:
    - workdir: "/etc/nvidia-mig-manager"
      command: "/bin/bash"
      args: ["-x", "-c", "source hooks.sh; pre-apply-mode"]
    pre-apply-config:
    - workdir: "/etc/nvidia-mig-manager"
      command: "/bin/bash"
      args: ["-x", "-c", "source hooks.sh; pre-apply-config"]
    apply-exit:
    - workdir: "/etc/nvidia-mig-manager"
      command: "/bin/bash"
      args: ["-x", "-c", "source hooks.sh; apply-exit"]
    - workdir: "/etc/nvidia-mig-manager"
      command: "/bin/bash"
      args: ["-x", "-c", "source hooks.sh; refresh-cdi"]
"""


def write(tmp_path: Path, text: str, name: str = "hooks.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_mig_parteds_default_hooks_file_loads(tmp_path: Path) -> None:
    h = hooks.load_hooks(
        write(tmp_path, MIG_PARTED_DEFAULT),
        pre_apply="/bin/true --pre",
        post_apply="nvidia-ctk cdi generate --mode=management",
    )
    assert [str(c) for c in h.of("apply-exit")] == [
        "/bin/bash -x -c 'source hooks.sh; apply-exit'",
        "/bin/bash -x -c 'source hooks.sh; refresh-cdi'",
    ]
    assert h.of("pre-apply-mode")[0].workdir == "/etc/nvidia-mig-manager"
    # the commands of the settings come last of their hooks
    assert h.of("apply-start")[-1].argv == ("/bin/true", "--pre")
    assert h.of("post-apply") == (
        commands.Command(("nvidia-ctk", "cdi", "generate", "--mode=management")),
    )
    assert "pre_apply_command" in h.source and "hooks.yaml" in h.source
    assert not hooks.load_hooks() and hooks.load_hooks(post_apply="x")


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("version: v2\nhooks: {}\n", "version must be v1, got 'v2'"),
        (
            "version: v1\nhook: {}\n",
            "unknown key 'hook' (keys: version, hooks); did you mean hooks?",
        ),
        (
            "version: v1\nhooks:\n  pre-apply-modes: []\n",
            "hook 'pre-apply-modes': no such hook (hooks: apply-start, pre-apply-mode, "
            "pre-apply-config, apply-exit, post-apply); did you mean pre-apply-mode?",
        ),
        ("version: v1\nhooks:\n  apply-exit: {command: /bin/true}\n", "must be a list of commands"),
        (
            "version: v1\nhooks:\n  apply-exit:\n  - {command: /bin/true, arg: [x]}\n",
            "hook 'apply-exit' command 1: unknown key 'arg'",
        ),
        (
            "version: v1\nhooks:\n  apply-exit:\n  - {args: [x]}\n",
            "hook 'apply-exit' command 1: command must be a non-empty string",
        ),
        (
            "version: v1\nhooks:\n  apply-exit:\n  - {command: /bin/true, args: x}\n",
            "args must be a list of strings",
        ),
        (
            "version: v1\nhooks:\n  apply-exit:\n  - {command: /bin/true, envs: [A]}\n",
            "envs must map names to values",
        ),
        ("- just a list\n", "a hooks file is a mapping"),
        ("version: v1\nhooks: [\n", "invalid YAML"),
    ],
)
def test_malformed_hooks_files_are_refused_naming_the_problem(
    tmp_path: Path, text: str, fragment: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(InvalidConfig) as err:
        hooks.load_hooks(path)
    assert fragment in str(err.value) and path in str(err.value)


def test_gpu_clients_file_of_the_gpu_operator_loads(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "version: v1\nsystemd-services:\n  - nvsm.service\n"
        "  - nvidia-dcgm.service\n  - nvsm.service\n",
        "clients.yaml",
    )
    assert commands.load_gpu_clients(path) == ("nvsm.service", "nvidia-dcgm.service")
    assert commands.load_gpu_clients(write(tmp_path, "", "empty.yaml")) == ()


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("version: v1\nsystemd-service: [a]\n", "did you mean systemd-services"),
        ("version: v1\nsystemd-services: a.service\n", "must be a list of unit names"),
        ("version: v1\nsystemd-services: ['--all']\n", "must be a list of unit names"),
        ("version: v2\nsystemd-services: []\n", "version must be v1"),
    ],
)
def test_malformed_gpu_clients_files_are_refused(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(InvalidConfig, match=fragment):
        commands.load_gpu_clients(write(tmp_path, text, "clients.yaml"))


def test_run_command_returns_status_and_output(tmp_path: Path) -> None:
    script = "echo out; echo err >&2; exit 3"
    done = commands.run_command(
        commands.Command(("/bin/sh", "-c", script), workdir=str(tmp_path)), {}, 10
    )
    assert (done.returncode, done.ok, done.error) == (3, False, "")
    assert done.output.split() == ["out", "err"]
    assert done.failure() == "exited with status 3: out | err"
    ok = commands.run_command(commands.Command(("/bin/sh", "-c", "pwd")), {}, 10)
    assert ok.ok and ok.failure() == "exited with status 0: " + os.getcwd()
    missing = commands.run_command(commands.Command(("/nonexistent/tool",)), {}, 10)
    assert not missing.ok and missing.failure().startswith("could not run: ")
    assert "/nonexistent/tool" in missing.failure()


def test_a_command_past_its_timeout_is_killed_with_what_it_started(tmp_path: Path) -> None:
    # What the command starts holds a FIFO open for writing: the end of file is its end.
    fifo = tmp_path / "held-by-the-child"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    script = '(exec 3>"$0" >/dev/null 2>&1; echo up >&3; exec sleep 30) & echo started; sleep 30'
    try:
        start = time.monotonic()
        done = commands.run_command(commands.Command(("/bin/sh", "-c", script, str(fifo))), {}, 0.5)
        assert time.monotonic() - start < 5
        assert done.error == "did not finish within 0.5 s (killed)" and "started" in done.output
        # the whole session was killed, not only the shell
        assert read_to_end(reader, within_s=10) == b"up\n"
    finally:
        os.close(reader)


def read_to_end(fd: int, *, within_s: float) -> bytes | None:
    """What a non-blocking ``fd`` gives until end of file, or None if that takes longer."""
    data, deadline = b"", time.monotonic() + within_s
    while select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(fd, 4096)
        if not chunk:
            return data
        data += chunk
    return None


def test_run_hook_gives_mig_parteds_environment_and_stops_at_the_first_failure(
    tmp_path: Path,
) -> None:
    log = tmp_path / "log"
    text = f"""version: v1
hooks:
  apply-exit:
  - command: /bin/sh
    args: ["-c", "echo \\"$A $B $MIG_PARTED_SELECTED_CONFIG ${{HOME:-nohome}}\\" >> {log}"]
    envs: {{A: hook, B: hook}}
  - command: /bin/sh
    args: ["-c", "seq 1 3; exit 7"]
  - command: /bin/sh
    args: ["-c", "echo never >> {log}"]
"""
    h = hooks.load_hooks(write(tmp_path, text))
    with pytest.raises(HookFailed) as err:
        hooks.run_hook(
            h,
            "apply-exit",
            {"B": "context", "MIG_PARTED_SELECTED_CONFIG": "all-x"},
            runner=commands.run_command,
            timeout_s=10,
        )
    # envs, the context over them, and not the agent's own environment (HOME)
    assert log.read_text() == "hook context all-x nohome\n"
    assert str(err.value) == (
        "apply-exit hook `/bin/sh -c 'seq 1 3; exit 7'` exited with status 7: 1 | 2 | 3"
    )
    assert err.value.context["returncode"] == 7
    assert hooks.run_hook(h, "pre-apply-mode", {}, runner=commands.run_command, timeout_s=1) == 0


def test_a_failed_hooks_output_on_the_node_is_short_and_masked_the_log_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: up to 1,500 characters of a hook's output went into the node's annotation,
    condition and Event, read by anyone who may read Nodes, a token it printed included."""
    text = """version: v1
hooks:
  apply-exit:
  - command: /bin/sh
    args: ["-c", "seq 1 400; echo login failed: token=$T password: $P; exit 5"]
    envs: {T: s3cr3t, P: hunter2}
"""
    h = hooks.load_hooks(write(tmp_path, text))
    logs: list[dict[str, Any]] = []

    class Log:  # the module's logger (cached by structlog once used: capture_logs misses it)
        def error(self, event: str, **kw: Any) -> None:
            logs.append({"event": event, **kw})

    monkeypatch.setattr(hooks, "log", Log())
    with pytest.raises(HookFailed) as err:
        hooks.run_hook(h, "apply-exit", {}, runner=commands.run_command, timeout_s=10)
    reason = str(err.value)
    said = reason.split("exited with status 5: ", 1)[1]
    assert len(said) <= commands.NODE_OUTPUT_CAP and said.startswith("...")
    assert said.endswith("login failed: token=*** password: ***"), said
    assert "s3cr3t" not in reason and "hunter2" not in reason
    [failed] = [e for e in logs if e["event"] == "hook.failed"]
    assert "token=s3cr3t" in failed["output"] and len(failed["output"]) > 1000
    assert failed["returncode"] == 5 and failed["hook"] == "apply-exit"


def test_output_in_a_reason_is_trimmed_to_its_end() -> None:
    text = "\n".join(f"line {i}" for i in range(1000))
    out = commands.trimmed(text, cap=60)
    assert len(out) == 60 and out.startswith("...") and out.endswith("line 999")


@pytest.mark.parametrize(
    "env, fragment",
    [
        (
            {"MIG_AGENT_POST_APPLY_COMMAND": "sh -c 'unbalanced"},
            'MIG_AGENT_POST_APPLY_COMMAND="sh -c \'unbalanced" is not a valid command',
        ),
        ({"MIG_AGENT_STOP_HOST_GPU_CLIENTS": "true"}, "no host_gpu_clients_file"),
        ({"MIG_AGENT_COMMAND_TIMEOUT_S": "0"}, "command timeout must be positive"),
        ({"MIG_AGENT_RESTART_VALIDATORS": "maybe"}, "is not a valid bool"),
    ],
)
def test_settings_refuse_commands_that_cannot_run(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        Settings.from_env(env)
