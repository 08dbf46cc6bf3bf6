"""We test the kubectl plugin's own rules (the cluster side is in tests/e2e/test_kubectl_plugin.py):
the status table in table and wide form, reasons cut to a column but whole in wide, colour only
on a terminal without NO_COLOR and never shifting the columns, kubectl's flags on every command."""

from __future__ import annotations

import io
import re

import pytest

from mig_agent.cli import kubectl
from mig_agent.ops import GpuSummary, NodeStatus

ROWS = [
    NodeStatus(
        "gpu-a",
        "all-1g.10gb",
        "success",
        "",
        False,
        {"nvidia.com/mig-1g.10gb": 14},
        (
            GpuSummary(0, "H100-80GB", True, {"1g.10gb": 7}),
            GpuSummary(1, "H100-80GB", True, {"1g.10gb": 7}),
        ),
    ),
    NodeStatus("gpu-b", "all-7g.80gb", "failed", "x" * 200, True, {}, None),
]


def test_table_and_wide() -> None:
    lines = kubectl.status_lines(ROWS, wide=False, colour=False)
    assert lines[0].split() == ["NAME", "LAYOUT", "STATE", "RESOURCES", "REASON"]
    assert lines[1].split() == ["gpu-a", "all-1g.10gb", "success", "mig-1g.10gb=14", "-"]
    assert lines[2].split()[:3] == ["gpu-b", "all-7g.80gb", "failed,cordoned"]
    assert lines[2].endswith("x" * 57 + "...")
    wide = kubectl.status_lines(ROWS, wide=True, colour=False, agents={"gpu-a": "agent-1 (Ready)"})
    assert wide[0].split() == ["NAME", "LAYOUT", "STATE", "GPUS", "RESOURCES", "REASON", "AGENT"]
    assert "0:H100-80GB(mig),1:H100-80GB(mig)" in wide[1] and wide[1].endswith("agent-1 (Ready)")
    assert "x" * 200 in wide[2] and wide[2].split()[3] == "?"
    assert kubectl.status_lines([], wide=False, colour=False) == ["No GPU nodes found."]


def test_colour_paints_states_without_moving_columns() -> None:
    plain = kubectl.status_lines(ROWS, wide=False, colour=False)
    painted = kubectl.status_lines(ROWS, wide=False, colour=True)
    assert "\033[32msuccess\033[0m" in painted[1] and "\033[31mfailed\033[0m" in painted[2]
    assert [re.sub(r"\033\[[0-9]+m", "", p) for p in painted] == plain


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_only_on_a_terminal_without_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert kubectl.colour_enabled(Tty()) and not kubectl.colour_enabled(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not kubectl.colour_enabled(Tty())


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "--context", "c", "--kubeconfig", "k", "-n", "ns", "-o", "wide", "-l", "a=b"],
        ["plan", "node", "layout", "--context", "c", "-o", "yaml"],
        [
            "repartition",
            "layout",
            "n1",
            "n2",
            "-l",
            "a=b",
            "-p",
            "3",
            "--dry-run",
            "--context",
            "c",
        ],
    ],
)
def test_kubectl_flags_on_every_command(argv: list[str]) -> None:
    args = kubectl.build_parser().parse_args(argv)
    assert args.context == "c"


def test_bad_output_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        kubectl.main(["status", "-o", "xml"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err
