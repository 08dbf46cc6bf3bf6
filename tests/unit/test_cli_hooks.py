"""We test ``mig-agent apply -k HOOKS`` on a simulated node, as mig-parted's ``apply -k``:

* the hooks run in mig-parted's order around the mode and config phases (each command sees the
  GPUs as they are at that point), with mig-parted's environment; apply-start and apply-exit
  also when nothing changes, the others not;
* a failing pre-apply-config hook stops the apply after the mode phase and fails the command
  naming the hook and its output; apply-exit still runs;
* a malformed hooks file fails before any GPU is touched.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from migsim.nvml import library as simlib

from .test_cli import OPERATOR, _isolated, run, sim

__all__ = ["_isolated"]  # the autouse fixture of test_cli, here too


def hooks_file(tmp_path: Path, state: Path, failing: str = "") -> Path:
    """Each hook appends its name, the layout and GPU 0's MIG mode and instance count (read from
    the simulated node's state file) to hooks.log."""
    log = tmp_path / "hooks.log"
    probe = tmp_path / "probe.py"
    probe.write_text(f"""import json, os, sys
node = json.load(open({str(state)!r}))
gpu = node["gpus"][0]
with open({str(log)!r}, "a") as f:
    f.write(" ".join([sys.argv[1], os.environ["MIG_PARTED_SELECTED_CONFIG"],
                      os.environ.get("MIG_AGENT_RESULT", "-"), str(gpu["mig_current"]),
                      str(len(gpu["gpu_instances"]))]) + "\\n")
if sys.argv[1] == {failing!r}:
    print("site check: GPU 0 still busy", file=sys.stderr)
    sys.exit(2)
""")
    import sys

    names = ("apply-start", "pre-apply-mode", "pre-apply-config", "apply-exit", "post-apply")
    body = "".join(
        f"  {n}:\n  - command: {sys.executable}\n    args: [{str(probe)!r}, {n}]\n" for n in names
    )
    path = tmp_path / "hooks.yaml"
    path.write_text("version: v1\nhooks:\n" + body)
    return path


def test_apply_with_mig_parteds_hooks_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "node.json"
    layout = ["-f", OPERATOR, "-c", "all-balanced"]
    run(capsys, "assert", *layout, *sim(state))  # creates the simulated node
    hooks = hooks_file(tmp_path, state)
    code, out, err = run(capsys, "apply", *layout, "-k", str(hooks), *sim(state))
    assert code == 0, err
    assert "layout all-balanced applied in" in out
    log = tmp_path / "hooks.log"
    assert log.read_text().splitlines() == [
        "apply-start all-balanced - False 0",
        "pre-apply-mode all-balanced - False 0",
        "pre-apply-config all-balanced - True 0",  # mode phase done, no instance yet
        "apply-exit all-balanced success True 4",
        "post-apply all-balanced - True 4",
    ]
    # nothing to change: apply-start and apply-exit only, as mig-parted runs them
    log.unlink()
    code, out, _ = run(capsys, "apply", *layout, "-k", str(hooks), *sim(state))
    assert (code, out) == (0, "layout all-balanced already applied; nothing changed\n")
    assert log.read_text().splitlines() == [
        "apply-start all-balanced - True 4",
        "apply-exit all-balanced success True 4",
    ]


def test_a_failing_hook_stops_the_apply_and_names_its_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "node.json"
    layout = ["-f", OPERATOR, "-c", "all-balanced"]
    run(capsys, "assert", *layout, *sim(state))
    hooks = hooks_file(tmp_path, state, failing="pre-apply-config")
    code, _, err = run(capsys, "apply", *layout, "-k", str(hooks), *sim(state))
    assert code != 0
    assert "pre-apply-config hook" in err and "site check: GPU 0 still busy" in err
    assert [ln.split()[0] for ln in (tmp_path / "hooks.log").read_text().splitlines()] == [
        "apply-start",
        "pre-apply-mode",
        "pre-apply-config",
        "apply-exit",
    ]
    assert (tmp_path / "hooks.log").read_text().splitlines()[-1].split()[2] == "failed"


def test_a_malformed_hooks_file_touches_no_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "node.json"
    layout = ["-f", OPERATOR, "-c", "all-balanced"]
    run(capsys, "assert", *layout, *sim(state))
    bad = tmp_path / "hooks.yaml"
    bad.write_text("version: v1\nhooks:\n  apply-begin: []\n")
    simlib.reset_call_counts(state)
    code, _, err = run(capsys, "apply", *layout, "-k", str(bad), *sim(state))
    assert code != 0 and "hook 'apply-begin': no such hook" in err
    assert simlib.call_counts(state).total == 0
