"""Fault matrix on the local cluster: each fault at each point of a real agent's pass, then the
invariants of issue 15 (tests/faults/harness.py); prints the table points x faults with
converged / failed (with the reason) / VIOLATED (with what was violated).

Run: python benchmarks/fault_matrix.py [--quick] [--faults kill,relabel-typo] [--points P,...]
     [--scenarios h100,a100-mig-on] [--dir CLUSTER_DIR] [-v] [--save FILE] [--table FILE...]
Starts its own cluster in a temporary folder and stops it at the end (needs scripts/k8s-binaries),
or uses the running cluster in --dir. One trial (a fresh node, set up, the fault, settled) takes
12-70 s; the label faults land at every point (39 x 5), the API, control-plane and node faults at
one point per phase or per kind of NVML call (about 120 more trials): over two hours on 2 cores,
so runs side by side with --save and one --table are the practical way to the whole table.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from migsim.cluster import Cluster, agents  # noqa: E402

from tests.faults import harness  # noqa: E402

FAULT_NOTES = f"""
Faults: kill = SIGKILL, restarted by the node's supervisor ({harness.BACKOFF[0]:g} s back-off);
relabel-other / -typo / -removed = the layout label set to the other layout, to a typo, removed;
repartition-other = the other layout and the state label cleared in one patch, as `repartition`
does. Through a proxy between the agent and the API server (migsim.cluster.api_faults):
api-500x3 = the next 3 requests answered 500; api-503-15s = every request answered 503 for 15 s;
api-429 = the next 3 answered 429 with Retry-After: 2; api-hang = the next request never answered;
api-reset = the next 3 connections reset; api-409 = the next 2 node PATCHes answered 409;
watch-end = the node watch ended cleanly; watch-silent = its connection goes dead (no events, no
end), then once the pass is over the layout is relabelled (node watch timeout
{harness.WATCH_TIMEOUT_S} s in these trials). apiserver-restart = etcd and the API server stopped
and started again (Cluster.restart). On the node: nvml-error = the next mutating NVML call fails;
nvml-half = it takes effect and reports an error all the same; gpu-busy = a process no pod owns on
each MIG device of GPU 0; reset-fails = every GPU reset fails (A100); reboot-hangs = the GPU
cannot be reset (A100, as in a pass-through VM) and the reboot command never returns (time limit
{harness.REBOOT_TIMEOUT_S:g} s in these trials); plugin-gone = the device
plugin stopped for good; plugin-wrong = stopped, the node left advertising one device short;
post-apply-fails = the site's post-apply hook starts failing once the GPUs change;
config-invalid = the profile config overwritten with broken YAML; config-changed = the target
layout's H100 entry changed to 2 x 3g.40gb. Failures that are retried count once they outlived
one retry."""

MARK = {
    "converged": "converged",
    "failed": "failed+reason",
    "violated": "**VIOLATED**",
    "not-reached": "(not reached)",
}


def print_matrix(results: Sequence[harness.Result], faults: Sequence[str]) -> None:
    by = {(r.point, r.fault): r for r in results}
    rows = list(dict.fromkeys(r.point for r in results))
    w = max(len(p) for p in rows + ["point"])
    cw = max(len(f) for f in faults) if faults else 0
    cw = max(cw, max(len(m) for m in MARK.values()))
    print(f"| {'point':<{w}} | " + " | ".join(f"{f:<{cw}}" for f in faults) + " |")
    print(f"|{'-' * (w + 2)}|" + "|".join("-" * (cw + 2) for _ in faults) + "|")
    for p in rows:
        cells = [MARK[by[(p, f)].outcome] if (p, f) in by else "" for f in faults]
        print(f"| {p:<{w}} | " + " | ".join(f"{c:<{cw}}" for c in cells) + " |")
    counts = {f: collections.Counter(r.outcome for r in results if r.fault == f) for f in faults}
    print(
        f"| {'total':<{w}} | "
        + " | ".join(
            f"{'/'.join(str(counts[f][o]) for o in ('converged', 'failed', 'violated')):<{cw}}"
            for f in faults
        )
        + " |"
    )
    print("\n(total: converged/failed+reason/violated)")
    reasons = collections.Counter(
        (r.fault, r.detail[:110]) for r in results if r.outcome == "failed"
    )
    if reasons:
        print("\nFailed with reason:")
        for (fault, reason), n in sorted(reasons.items()):
            print(f"- {fault} (x{n}): {reason}")
    bad = [r for r in results if r.outcome in ("violated", "not-reached")]
    if bad:
        print("\nViolated or not reached:")
        for r in bad:
            print(f"- {r.fault} at {r.point}: {r.outcome}: {r.detail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"only {harness.QUICK_POINTS}")
    ap.add_argument("--scenarios", default=",".join(sc.name for sc in harness.SCENARIOS))
    ap.add_argument("--faults", default=",".join(harness.FAULTS))
    ap.add_argument("--points", default="", help="point names, comma-separated (default all)")
    ap.add_argument("--dir", type=Path, help="use this running cluster instead of a new one")
    ap.add_argument("--verbose", "-v", action="store_true", help="print each trial as it ends")
    ap.add_argument("--save", type=Path, help="append each trial's result to this JSON-lines file")
    ap.add_argument(
        "--table",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="only print the table of results saved by earlier runs (--save)",
    )
    args = ap.parse_args()
    faults = [f for f in args.faults.split(",") if f]
    if args.table:
        saved = [
            harness.Result(**json.loads(line))
            for f in args.table
            for line in f.read_text().splitlines()
            if line.strip()
        ]
        print(f"\n## Fault matrix: {len(saved)} trials\n")
        print_matrix(saved, [f for f in harness.FAULTS if any(r.fault == f for r in saved)])
        return 1 if any(r.outcome in ("violated", "not-reached") for r in saved) else 0
    names = (
        tuple(args.points.split(","))
        if args.points
        else (harness.QUICK_POINTS if args.quick else None)
    )
    scenarios = [sc for sc in harness.SCENARIOS if sc.name in args.scenarios.split(",")]
    with tempfile.TemporaryDirectory(prefix="mig-agent-faults-") as tmp:
        own = args.dir is None
        cluster = Cluster.up(Path(tmp), gpu_nodes=0) if own else Cluster.attach(args.dir)
        try:
            agents.install(cluster)
            if harness.DRA in scenarios:
                agents.install_dra(cluster)
            harness.ensure_namespace(cluster)
            started = time.monotonic()
            results = []
            for sc in scenarios:
                for fault in faults:
                    for point in harness.fault_points(fault, sc, names):
                        r = harness.run_trial(cluster, point, fault, scenario=sc)
                        if sc is not harness.H100:
                            r.point = f"{sc.name}: {r.point}"
                        results.append(r)
                        if args.save:
                            with args.save.open("a") as out:
                                out.write(json.dumps(dataclasses.asdict(r)) + "\n")
                        if args.verbose:
                            print(
                                f"{fault:<17} {r.point:<34} {r.outcome:<11} "
                                f"{r.seconds:5.1f} s  {r.detail[:80]}"
                                + (f"  [{r.hits}]" if r.hits else ""),
                                file=sys.stderr,
                                flush=True,
                            )
            wall = time.monotonic() - started
        finally:
            if own:
                cluster.down()
    print(f"\n## Fault matrix: {len(results)} trials in {wall / 60:.1f} min\n")
    for sc in scenarios:
        print(
            f"- {sc.name}: {sc.start} -> {sc.target} on {sc.gpus}, a pod holding "
            f"{dict(sc.pod_limits)}; relabelled to {sc.other} or {sc.typo}"
        )
    print()
    print_matrix(results, faults)
    print(FAULT_NOTES)
    return 1 if any(r.outcome in ("violated", "not-reached") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
