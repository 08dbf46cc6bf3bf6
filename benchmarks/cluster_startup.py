"""Cost of the local cluster: cold build of the binaries, warm start, memory, stop.

    python benchmarks/cluster_startup.py [--nodes 2] [--repeat 3] [--settle 10] [--idle 20]
                                         [--build-log LOG]

Cold build: runs `scripts/k8s-binaries build` only when the binaries are missing (then it is a real
cold or partly warm build, depending on the Go caches); when they are cached the build costs nothing
and the row says so. `--build-log` adds the wall time and peak RSS of an earlier build recorded by
`/usr/bin/time -v scripts/k8s-binaries build > LOG 2>&1`.

Warm start: `Cluster.up` in a fresh folder until every node is Ready and schedulable, repeated.
Memory and idle CPU: resident sets after `--settle` seconds of idling (controllers and caches grow a
little after start-up), and CPU used over the `--idle` seconds that follow, per component and in
total.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing the package

from migsim.cluster import BinariesMissing, Cluster, find_binaries  # noqa: E402

from benchmarks.tables import print_table  # noqa: E402


def build() -> tuple[float, str]:
    """(seconds, note) for making the binaries available."""
    try:
        find_binaries()
        return 0.0, "cached (nothing built; delete the cache folder to time a cold build)"
    except BinariesMissing:
        pass
    start = time.monotonic()
    subprocess.run(
        [str(REPO / "scripts" / "k8s-binaries"), "build"], check=True, stdout=subprocess.DEVNULL
    )
    return time.monotonic() - start, "built now (cold or partly warm Go caches)"


def recorded_build(log: Path) -> tuple[str, str] | None:
    """(wall time, peak RSS) from a `/usr/bin/time -v` log, or None if it has no such figures."""
    text = log.read_text(errors="replace")
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text)
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if wall is None or peak is None:
        return None
    parts = [float(x) for x in wall.group(1).split(":")]
    seconds = sum(v * 60**i for i, v in enumerate(reversed(parts)))
    return f"{seconds:.0f} s", f"{int(peak.group(1)) / 2**20:.1f} GiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2, help="simulated GPU nodes (default 2)")
    p.add_argument("--repeat", type=int, default=3, help="warm starts to time (default 3)")
    p.add_argument(
        "--settle",
        type=float,
        default=10.0,
        help="seconds to idle before measuring memory (default 10)",
    )
    p.add_argument(
        "--idle",
        type=float,
        default=20.0,
        help="seconds over which idle CPU is measured, after settling (default 20)",
    )
    p.add_argument(
        "--build-log",
        type=Path,
        action="append",
        default=[],
        help="log of `/usr/bin/time -v scripts/k8s-binaries build` to report (repeatable)",
    )
    args = p.parse_args()

    build_s, build_note = build()
    starts: list[float] = []
    stops: list[float] = []
    rss: dict[str, int] = {}
    cpu: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="mig-agent-bench-") as tmp:
        for i in range(args.repeat):
            t0 = time.monotonic()
            cluster = Cluster.up(Path(tmp) / f"c{i}", gpu_nodes=args.nodes)
            starts.append(time.monotonic() - t0)
            try:
                if i == args.repeat - 1:  # the last one is measured idling, after settling
                    time.sleep(args.settle)
                    procs = cluster.state.procs
                    cpu0, t_cpu = [p.cpu_seconds() for p in procs], time.monotonic()
                    time.sleep(args.idle)
                    cpu = {
                        p.name: (p.cpu_seconds() - c0) / (time.monotonic() - t_cpu)
                        for p, c0 in zip(procs, cpu0, strict=True)
                    }
                    rss = {s.name: s.rss_bytes for s in cluster.status()}
            finally:
                t0 = time.monotonic()
                cluster.down()
                stops.append(time.monotonic() - t0)

    mib = 2**20
    rows = [("build of the 6 binaries, this run", f"{build_s:.0f} s", build_note)]
    for log in args.build_log:
        recorded = recorded_build(log)
        if recorded is not None:
            rows.append(
                (
                    f"build recorded in {log.name}",
                    recorded[0],
                    f"peak RSS {recorded[1]} (/usr/bin/time -v)",
                )
            )
    rows += [
        (
            f"warm start, {args.nodes} GPU nodes Ready",
            f"{statistics.median(starts):.1f} s",
            f"median of {len(starts)}; min {min(starts):.1f} s, max {max(starts):.1f} s",
        ),
        ("stop (down)", f"{statistics.median(stops):.1f} s", f"median of {len(stops)}"),
    ]
    rows += [
        (f"RSS {name}", f"{b / mib:.0f} MiB", f"idle CPU {cpu[name]:.1%} of a core")
        for name, b in rss.items()
    ]
    rows.append(
        (
            "RSS total",
            f"{sum(rss.values()) / mib:.0f} MiB",
            f"idle CPU {sum(cpu.values()):.1%} of a core (over {args.idle:g} s, "
            f"after {args.settle:g} s settling)",
        )
    )
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
