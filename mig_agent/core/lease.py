"""Leader election over a coordination.k8s.io Lease, the decision only: who may hold the
Lease now, given what it says. A holder renews it every round; another replica takes it once
the holder has not renewed it for ``leaseDurationSeconds``.

Pure module: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LeaseSeen:
    """What a Lease says (None: no such Lease yet); times in seconds since the epoch."""

    holder: str
    renewed: float | None
    duration_s: int


def may_hold(seen: LeaseSeen | None, me: str, now: float) -> bool:
    """Whether ``me`` may write itself as the Lease's holder at ``now``: no Lease yet, no
    holder, ``me`` already, or a holder that let it expire (a Lease without a renew time has
    expired)."""
    if seen is None or not seen.holder or seen.holder == me:
        return True
    if seen.renewed is None:
        return True
    return now >= seen.renewed + seen.duration_s
