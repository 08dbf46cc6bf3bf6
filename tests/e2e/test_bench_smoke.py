"""The cluster benchmarks vs_mig_manager, pool_rollout and agent_overhead run, once each, in
their quick modes (CI): each starts its own local cluster, so these tests only check that each
gets to its tables with exit code 0; the figures themselves, from full runs, are in
docs/benchmarks.md. kueue_bench (no cluster: a simulated pool) runs in its quick mode too, and
its figures are checked against what holds whatever the run: the admission check starts gang
workloads, no policy starts more workloads than arrived, the per-profile queue model agrees
with the simulation at the layouts as they are, the best fixed layouts do no worse than those,
and the large pool's check round decides for every workload."""

from __future__ import annotations

import os
import re
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


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _int(cell: str) -> int:
    return int(cell.replace(",", ""))


def _pair(cell: str) -> tuple[int, int] | None:
    """``1,234 (56)`` as (1234, 56); None for another cell."""
    m = re.fullmatch(r"([\d,]+) \(([\d,]+)\)", cell)
    return (_int(m[1]), _int(m[2])) if m else None


def test_kueue_bench_quick_runs_and_its_figures_hold() -> None:
    out = bench("benchmarks/kueue_bench.py", "--quick", timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text, lines = out.stdout, out.stdout.splitlines()
    head = re.search(r"([\d,]+) workloads \(([\d,]+) gangs of 2-4 pods", text)
    assert head, text
    workloads, gangs = _int(head[1]), _int(head[2])
    assert 0 < gangs < workloads
    # policy -> pending pod-min, idle device-min, relabels, GPUs changed, started, gangs started
    rows: dict[str, tuple[int, ...]] = {}
    for cells in map(_cells, lines):
        changes, started = (_pair(c) for c in cells[3:5]) if len(cells) == 5 else (None, None)
        if changes and started:
            rows[cells[0]] = (_int(cells[1]), _int(cells[2]), *changes, *started)
    assert len(rows) == 4, text
    for pending, idle, relabels, changed, started_n, gangs_n in rows.values():
        assert pending >= 0 and idle >= 0
        assert relabels <= changed <= 8 * relabels  # a relabel changes 1 to 8 GPUs
        assert 0 < started_n <= workloads and gangs_n <= min(gangs, started_n)
    static, check = rows["layouts as they are"], rows["admission check (max-nodes 4)"]
    assert static[2] == 0 and check[2] > 0
    assert check[5] > 0, "the admission check started no gang workload"
    best = next(_cells(x) for x in lines if x.startswith("| best fixed layouts"))
    assert 0 <= _int(best[1]) <= static[0]  # the layouts as they are are among its multisets
    model = re.search(r"as they are: ([\d,]+) pending pod-min \(the simulation: ([\d,]+)\)", text)
    assert model and _int(model[1]) == _int(model[2]) == static[0], text
    large = re.search(r"([\d,]+) pending workloads \(([\d,]+) gangs, ([\d,]+) pods\)", text)
    assert large, text
    round_row = next(_cells(x) for x in lines if x.startswith("| check: a round"))
    verdicts = {v: _int(n) for v, n in (x.rsplit(" ", 1) for x in round_row[2].split(", "))}
    assert sum(verdicts.values()) == _int(large[1]), round_row
    assert set(verdicts) <= {"Ready", "Relabel", "Wait"} and verdicts["Ready"] > 0
