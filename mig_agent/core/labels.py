"""Node labels and annotations of the MIG protocol, as pure functions that return patches.

A patch is a mapping of key -> value, where None deletes the key (JSON merge patch semantics).
Pure module: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum

PAUSED = "paused-for-mig-change"


class State(StrEnum):
    PENDING = "pending"
    REBOOTING = "rebooting"
    SUCCESS = "success"
    FAILED = "failed"


Patch = dict[str, str | None]


def pause_patch(labels: Mapping[str, str], operand_labels: Sequence[str]) -> Patch:
    """Pause every operand label present on the node, never overriding ``false``."""
    return {k: PAUSED for k in operand_labels if k in labels and labels[k] not in ("false", PAUSED)}


def paused_during_change(labels: Mapping[str, str], operand_labels: Sequence[str]) -> list[str]:
    """The operand labels a change holds paused: those it pauses and those already paused."""
    pause = pause_patch(labels, operand_labels)
    return sorted({*pause, *(k for k in operand_labels if labels.get(k) == PAUSED)})


def resume_patch(labels: Mapping[str, str], operand_labels: Sequence[str]) -> Patch:
    """Set every paused operand label back to ``true``; ``false`` stays ``false``."""
    return {k: "true" for k in operand_labels if labels.get(k) == PAUSED}


def is_valid_label_value(value: str) -> bool:
    """A Kubernetes label value: at most 63 characters of [A-Za-z0-9-_.], alphanumeric ends."""
    if not value:
        return True
    if len(value) > 63 or not (value[0].isalnum() and value[-1].isalnum()):
        return False
    return all(c.isalnum() or c in "-_." for c in value) and value.isascii()
