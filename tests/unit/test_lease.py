"""We test the leader election's decision (mig_agent.core.lease): a replica may take a Lease
that does not exist, has no holder, is its own, or whose holder let it expire; not one another
replica renewed within its duration."""

from __future__ import annotations

from mig_agent.core.lease import LeaseSeen, may_hold

T0 = 1_796_558_400.0  # 2026-12-06 12:00 UTC


def test_who_may_hold_the_lease() -> None:
    assert may_hold(None, "a", T0)
    assert may_hold(LeaseSeen("", T0, 30), "a", T0)
    assert may_hold(LeaseSeen("a", T0, 30), "a", T0 + 5)
    assert not may_hold(LeaseSeen("b", T0, 30), "a", T0 + 29)
    assert may_hold(LeaseSeen("b", T0, 30), "a", T0 + 30)
    assert may_hold(LeaseSeen("b", None, 30), "a", T0)
