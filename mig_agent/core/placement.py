"""Placement: where a GPU instance sits on a GPU, in memory slices, as NVML reports it.

Pure value module; imports nothing from mig_agent.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class Placement:
    """``start`` is the first memory slice, ``size`` the number of memory slices (NVML units)."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def mask(self) -> int:
        """Bit i set for every memory slice i the placement occupies."""
        return ((1 << self.size) - 1) << self.start

    def overlaps(self, other: Placement) -> bool:
        return self.start < other.end and other.start < self.end

    def __str__(self) -> str:  # nvidia-smi's "start:size"
        return f"{self.start}:{self.size}"

    @classmethod
    def parse(cls, text: str) -> Placement:
        start, _, size = text.partition(":")
        if not (start.isdigit() and size.isdigit()) or int(size) == 0:
            raise ValueError(f"not a placement 'start:size': {text!r}")
        return cls(int(start), int(size))
