"""The cluster benchmarks vs_mig_manager, pool_rollout and agent_overhead run, once each, in
their quick modes (CI): each starts its own local cluster, so these tests only check that each
gets to its tables with exit code 0; the figures themselves, from full runs, are in
docs/benchmarks.md."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow


def bench(*argv: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


@pytest.mark.native
@pytest.mark.skipif(
    os.geteuid() != 0, reason="MIG Manager needs a private mount namespace: run as root"
)
def test_vs_mig_manager_quick_runs() -> None:
    out = bench("benchmarks/vs_mig_manager.py", "--quick")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for system in ("| MIG Manager |", "| mig-agent |"):
        assert system in out.stdout, out.stdout
    assert "time ratio MM/agent" in out.stdout
    # the API requests column, counted by a proxy in front of each manager, is filled for both
    head = next(line for line in out.stdout.splitlines() if line.startswith("| transition |"))
    column = [c.strip() for c in head.strip("|").split("|")].index("API req")
    api = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > column and cells[1] in ("MIG Manager", "mig-agent"):
            api.setdefault(cells[1], []).append(cells[column])
    assert set(api) == {"MIG Manager", "mig-agent"}, out.stdout
    for system, counts in api.items():
        assert all(c.isdigit() and int(c) > 0 for c in counts), (system, counts)


def test_pool_rollout_quick_runs() -> None:
    # a resync every second: the idle window holds resync passes, which must ask nothing
    out = bench("benchmarks/pool_rollout.py", "--quick", "--resync", "1", timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for measure in (
        "rollout wall time",
        "per node to success, p95",
        "agents' RSS after the rollout, total",
        "idle agent's API requests per minute",
        "API server CPU during the rollout",
    ):
        assert measure in out.stdout, out.stdout
    (beyond,) = [
        line.split("|")[2].strip()
        for line in out.stdout.splitlines()
        if line.startswith("|   beyond the watches")
    ]
    assert beyond == "0.00", out.stdout  # the DRA-enabled agents' resyncs asked nothing


def test_agent_overhead_quick_runs() -> None:
    out = bench("benchmarks/agent_overhead.py", "--quick", timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for table in (
        "## Label change to success",
        "## With a GPU pod on every device",
        "## Idle agent over",
    ):
        assert table in out.stdout, out.stdout
    # the split with pods: each transition evicted pods and its parts are figures
    rows = [
        line
        for line in out.stdout.splitlines()
        if line.startswith(("| a all-disabled", "| d1 all-balanced"))
    ]
    assert len(rows) == 2, out.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert int(cells[1]) > 0 and all(float(c) >= 0 for c in cells[2:6]), row
