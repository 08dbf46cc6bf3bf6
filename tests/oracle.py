"""Test oracle: every multiset of GPU-instance profiles that fits a model, by brute force over
placements. Deliberately independent of the planner, which it checks (tests and benchmarks).

Besides placements and instance counts it knows one engine rule, from nvml.h: a ``+me.all``
instance holds every media engine, so beside it only ``-me`` instances fit."""

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
    return frozenset(k for k in found if _media_ok(k))


def _media_ok(multiset: tuple[tuple[str, int], ...]) -> bool:
    names = [name for name, n in multiset for _ in range(n)]
    if not any(name.endswith("+me.all") for name in names):
        return True
    return len(names) == 1 or sum(not name.endswith("-me") for name in names) == 1
