"""The real node's side-by-side benchmark (benchmarks/vs_mig_manager_real_node.py) runs, once, its
case a with a short trainer: it starts its own cluster and real node (after this folder's other
modules have stopped theirs), so this only checks that both tools get the Pending pod Running
and the benchmark to its tables with exit code 0; the figures, from full runs, are in
docs/benchmarks.md."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.native]


def test_the_real_node_side_by_side_runs() -> None:
    argv = ["benchmarks/vs_mig_manager_real_node.py", "--cases", "a", "--term-s", "1"]
    out = subprocess.run(
        [sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| a |")]
    tools = {cells[2].strip(): cells for cells in rows}
    assert set(tools) == {"MIG Manager", "mig-agent"}, out.stdout
    for tool, cells in tools.items():
        assert cells[3].strip() == "success", (tool, out.stdout)
        assert cells[8].strip() not in ("-", ""), (tool, "the Pending pod never ran", out.stdout)
    assert "UnexpectedAdmissionError: none" in out.stdout, out.stdout
