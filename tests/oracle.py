"""Test oracle: every multiset of GPU-instance profiles that fits a model, by brute force over
placements. Deliberately independent of the planner, which it checks (tests and benchmarks)."""

from __future__ import annotations

from collections import Counter
from functools import cache

from mig_agent.core.gpu_models import GpuModel


@cache
def fitting_multisets(model: GpuModel) -> frozenset[tuple[tuple[str, int], ...]]:
    """Sorted (profile name, count) tuples of every multiset with a non-overlapping placement
    within the profiles' instance counts (the empty multiset included)."""
    options = [(gi, pl) for gi in model.gi_profiles for pl in gi.placements]
    found: set[tuple[tuple[str, int], ...]] = set()

    def walk(start: int, mask: int, chosen: Counter[str]) -> None:
        found.add(tuple(sorted(chosen.items())))
        for k in range(start, len(options)):
            gi, pl = options[k]
            if pl.mask & mask or chosen[gi.name] >= gi.instance_count:
                continue
            chosen[gi.name] += 1
            walk(k + 1, mask | pl.mask, chosen)
            chosen[gi.name] -= 1
            if not chosen[gi.name]:
                del chosen[gi.name]

    walk(0, 0, Counter())
    return frozenset(found)
