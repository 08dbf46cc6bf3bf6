"""What one reconcile pass came to."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Outcome(enum.StrEnum):
    IDLE = "idle"  # no layout label
    NOOP = "noop"  # already applied
    APPLIED = "applied"
    FAILED = "failed"
    REBOOTING = "rebooting"
    SUPERSEDED = "superseded"  # the layout label changed during the pass: start over
    STOPPED = "stopped"  # the agent was told to stop inside the pass: undone, the loop ends
    OBSERVED = "observed"  # observe mode: what a pass would do was said, nothing done


@dataclass(frozen=True, slots=True)
class PassResult:
    outcome: Outcome
    retry_after_s: float | None = None  # set for retryable failures
    error: str = ""
