"""Planner benchmarks: feasibility, disruption against destroy-and-recreate, and planning time.

* feasibility: every multiset of GPU-instance profiles that fits a model (exhaustive search over
  placements) -- the share the planner places from an empty GPU (must be 100%);
* disruption: over transitions between layouts on every model (random fitting layouts, seeded),
  GPU instances destroyed per reconfiguration by the planner vs by destroy-and-recreate (what
  mig-parted does to every GPU whose profile multiset changes);
* time: planning a full 8-GPU node, from empty and from a populated state.

Run: python benchmarks/planner_bench.py   (prints tables; no cluster needed)
"""

from __future__ import annotations

import itertools
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mig_agent.config.profiles import load_catalog  # noqa: E402
from mig_agent.core.gpu_models import MODELS, GpuModel  # noqa: E402
from mig_agent.core.layout import DeviceSelector, GpuLayout, Layout, MigProfile, Rule  # noqa: E402
from mig_agent.core.observed import NodeState  # noqa: E402
from mig_agent.core.planner import plan, plan_gpu  # noqa: E402
from mig_agent.node.apply import execute  # noqa: E402
from tests.oracle import fitting_multisets  # noqa: E402
from tests.unit.fake_gpus import FakeGpus  # noqa: E402

MIG_MODELS = [m for m in MODELS.values() if m.mig_capable]
CATALOG = load_catalog([Path(__file__).resolve().parents[1] / "profiles"])


def fitting(model: GpuModel) -> list[dict[str, int]]:
    return [dict(k) for k in sorted(fitting_multisets(model)) if k]


def layout(counts: dict[str, int]) -> Layout:
    gl = GpuLayout.of(True, {MigProfile.parse(k): v for k, v in counts.items()})
    return Layout("bench", (Rule(DeviceSelector(), gl),))


def feasibility() -> None:
    print("\n## Feasibility: fitting layouts the planner places (from an empty GPU)\n")
    print(f"| {'model':<12} | {'fitting layouts':>15} | {'placed':>7} | {'share':>7} |")
    print(f"|{'-' * 14}|{'-' * 17}|{'-' * 9}|{'-' * 9}|")
    for m in MIG_MODELS:
        fits = fitting(m)
        placed = 0
        for counts in fits:
            gpus = FakeGpus([m], mig_enabled=True)
            try:
                plan(layout(counts), gpus.observe(), gpus.models())
                placed += 1
            except Exception:  # noqa: BLE001 -- counted as not placed
                pass
        print(f"| {m.key:<12} | {len(fits):>15} | {placed:>7} | {placed / len(fits):>6.1%} |")


def disruption(transitions: int = 300, seed: int = 7) -> None:
    print(
        f"\n## Disruption: GPU instances destroyed per reconfiguration ({transitions} random "
        "transitions per model, seed 7)\n"
    )
    print(
        f"| {'model':<12} | {'changed GPUs':>12} | {'planner':>8} | {'destroy+recreate':>16} "
        f"| {'saved':>6} | {'kept instances':>14} |"
    )
    print(f"|{'-' * 14}|{'-' * 14}|{'-' * 10}|{'-' * 18}|{'-' * 8}|{'-' * 16}|")
    rng = random.Random(seed)
    for m in MIG_MODELS:
        fits = fitting(m)
        ours = theirs = changed = kept = 0
        for _ in range(transitions):
            a, b = rng.choice(fits), rng.choice(fits)
            gpus = FakeGpus([m], mig_enabled=True)
            execute(plan(layout(a), gpus.observe(), gpus.models()), gpus)
            gp = plan_gpu(m, gpus.observe().gpu(0), layout(b).rules[0].gpu_layout)
            if gp.is_empty:
                continue
            changed += 1
            ours += gp.destroyed_gpu_instances
            theirs += sum(a.values())
            kept += sum(d.kept for d in gp.devices)
        saved = 1 - ours / theirs if theirs else 0.0
        print(
            f"| {m.key:<12} | {changed:>12} | {ours / changed:>8.2f} | "
            f"{theirs / changed:>16.2f} | {saved:>6.1%} | {kept / changed:>14.2f} |"
        )


def suite_transitions(m: GpuModel) -> Iterator[tuple[str, str, Layout, NodeState, FakeGpus]]:
    """Every ordered pair of the shipped layouts that fit ``m``, as (from, to, the target layout,
    the 8-GPU node at ``from``, its fake GPUs)."""
    from mig_agent.config.profiles import fit_report

    names = [r.layout for r in fit_report(CATALOG, m) if r.applies and r.fits and r.by_filter]
    for a, b in itertools.permutations(names, 2):
        gpus = FakeGpus([m] * 8)
        execute(plan(CATALOG.get(a), gpus.observe(), gpus.models()), gpus)
        yield a, b, CATALOG.get(b), gpus.observe(), gpus


def suite() -> None:
    """Every transition between the shipped layouts of each model on an 8-GPU node, one pod per
    MIG device; plus changing 2 of the 8 GPUs of a node."""
    print(
        "\n## Layout suite: transitions between the layouts in profiles/, 8-GPU "
        "node, one pod per MIG device\n"
    )
    print(
        f"| {'model':<12} | {'transitions':>11} | {'instances destroyed':>19} | "
        f"{'destroy+recreate':>16} | {'pods evicted':>12} | {'node-wide drain':>15} |"
    )
    print(f"|{'-' * 14}|{'-' * 13}|{'-' * 21}|{'-' * 18}|{'-' * 14}|{'-' * 17}|")
    for m in MIG_MODELS:
        ours = theirs = pods = node_wide = n = 0
        for _a, _b, target, before, gpus in suite_transitions(m):
            p = plan(target, before, gpus.models())
            if p.is_empty:
                continue
            n += 1
            devices = sum(len(gi.compute_instances) for g in before.gpus for gi in g.gpu_instances)
            ours += sum(g.destroyed_gpu_instances for g in p.gpus)
            theirs += sum(len(before.gpu(g.gpu).gpu_instances) for g in p.gpus if not g.is_empty)
            kept = sum(d.kept for g in p.gpus if not g.is_empty for d in g.devices)
            on_changed = sum(
                len(gi.compute_instances)
                for g in p.gpus
                if not g.is_empty
                for gi in before.gpu(g.gpu).gpu_instances
            )
            pods += on_changed - kept
            node_wide += devices
        print(
            f"| {m.key:<12} | {n:>11} | {ours / n:>19.1f} | {theirs / n:>16.1f} | "
            f"{pods / n:>12.1f} | {node_wide / n:>15.1f} |"
        )
    two = Layout(
        "two",
        (
            Rule(DeviceSelector(), GpuLayout.of(True, {MigProfile.parse("1g.10gb"): 7})),
            Rule(
                DeviceSelector(frozenset({2, 5})),
                GpuLayout.of(
                    True, {MigProfile.parse("1g.10gb"): 5, MigProfile.parse("2g.20gb"): 1}
                ),
            ),
        ),
    )
    gpus = FakeGpus([MODELS["H100-80GB"]] * 8)
    execute(plan(layout({"1g.10gb": 7}), gpus.observe(), gpus.models()), gpus)
    p = plan(two, gpus.observe(), gpus.models())
    print(
        "\nH100-80GB node at all-1g.10gb, GPUs 2 and 5 change to 5x1g.10gb + 1x2g.20gb: "
        f"{sum(g.destroyed_gpu_instances for g in p.gpus)} instances destroyed and "
        f"{sum(g.destroyed_gpu_instances for g in p.gpus)} pods evicted (destroy+recreate of "
        f"the changed GPUs: 14 instances; node-wide drain: 56 pods)"
    )


def timing(repeats: int = 200) -> None:
    print(f"\n## Planner time for one 8-GPU node (median of {repeats})\n")
    print(f"| {'model':<12} | {'case':<28} | {'median ms':>9} | {'p95 ms':>7} |")
    print(f"|{'-' * 14}|{'-' * 30}|{'-' * 11}|{'-' * 9}|")
    for key, start, target in [
        ("H100-80GB", None, {"1g.10gb": 7}),
        ("H100-80GB", {"1g.10gb": 7}, {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}),
        ("H200", {"1g.18gb": 7}, {"7g.141gb": 1}),
        ("A100-40GB", {"1g.5gb": 7}, {"1c.7g.40gb": 7}),
        ("B200", {"1g.23gb": 7}, {"1g.23gb": 2, "2g.45gb": 1, "3g.90gb": 1}),
        ("RTX-PRO-6000", {"1g.24gb": 4}, {"2g.48gb": 1, "1g.24gb": 2}),
    ]:
        m = MODELS[key]
        gpus = FakeGpus([m] * 8, mig_enabled=True)
        if start:
            execute(plan(layout(start), gpus.observe(), gpus.models()), gpus)
        observed, models, lay = gpus.observe(), gpus.models(), layout(target)
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan(lay, observed, models)
            samples.append((time.perf_counter() - t0) * 1000)
        samples.sort()
        case = f"{'empty' if not start else '+'.join(start)} -> {'+'.join(target)}"
        print(
            f"| {key:<12} | {case[:28]:<28} | {statistics.median(samples):>9.2f} | "
            f"{samples[int(len(samples) * 0.95)]:>7.2f} |"
        )


def suite_timing(repeats: int = 20) -> None:
    """Planning time of every transition between the shipped layouts (8-GPU node): per model
    the median and p95 over all plans, and the transition with the slowest median."""
    print(f"\n## Planner time over the layout suite, 8-GPU node ({repeats} runs per transition)\n")
    print(
        f"| {'model':<12} | {'transitions':>11} | {'median ms':>9} | {'p95 ms':>6} | "
        f"{'slowest transition (median ms)':<60} |"
    )
    print(f"|{'-' * 14}|{'-' * 13}|{'-' * 11}|{'-' * 8}|{'-' * 62}|")
    for m in MIG_MODELS:
        every: list[float] = []
        slowest = (0.0, "")
        for a, b, target, observed, gpus in suite_transitions(m):
            models = gpus.models()
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                plan(target, observed, models)
                samples.append((time.perf_counter() - t0) * 1000)
            every.extend(samples)
            median = statistics.median(samples)
            if median > slowest[0]:
                slowest = (median, f"{a} -> {b}")
        every.sort()
        worst = f"{slowest[1]} ({slowest[0]:.2f})"
        print(
            f"| {m.key:<12} | {len(every) // repeats:>11} | {statistics.median(every):>9.2f} | "
            f"{every[int(len(every) * 0.95)]:>6.2f} | {worst:<60} |"
        )


if __name__ == "__main__":
    import logging

    from mig_agent.observability.logs import configure_logging

    configure_logging("console", level=logging.WARNING)
    feasibility()
    disruption()
    suite()
    timing()
    suite_timing()
