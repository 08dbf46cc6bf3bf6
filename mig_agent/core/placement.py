"""Placement: where a GPU instance sits on a GPU, in NVML's placement units, as NVML reports it.

A unit is a memory slice on most GPUs; the RTX PRO 6000 Blackwell places on 12 units over its 4
memory slices (GpuModel.placement_units). Compute instances are placed in compute slices.

Pure value module; imports nothing from mig_agent.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class Placement:
    """``start`` is the first unit, ``size`` the number of units (memory slices on most GPUs)."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def mask(self) -> int:
        """Bit i set for every unit i the placement occupies."""
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
