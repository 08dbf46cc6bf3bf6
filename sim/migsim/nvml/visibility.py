"""Which devices of a simulated node one client of its NVML library sees, as a container does.

A container given some GPUs or MIG devices sees only those: NVML enumerates just them, its GPU
indices renumbered from 0. The simulated library learns what a client was given from a folder
the client's mount namespace holds (the real-node code writes CDI specs that mount it):

* the folder is ``/run/migsim-visible`` (``$MIG_AGENT_SIM_VISIBLE_DIR`` overrides it); where it
  does not exist, everything is visible (the host);
* where it exists, the names of the files in it (dotfiles aside) are the UUIDs of the visible
  devices (``GPU-...`` or ``MIG-...``); a file named ``all`` makes everything visible; names that
  match no device are ignored; a folder that cannot be read shows nothing;
* a visible MIG device makes its parent GPU visible, with only the visible MIG devices under it;
  a visible GPU shows all its MIG devices.

The C library reads the folder when it connects (nvmlInit, or the first call of a forked child)
and sends the names to the simulator with its init call (``migsim.nvml.abi``, "Visibility");
``from_dir`` is the same reading in Python. This module knows only the node's state.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from migsim.nvml.state import SimComputeInstance, SimGpu, SimGpuInstance, SimNode

ENV_VISIBLE_DIR = "MIG_AGENT_SIM_VISIBLE_DIR"
VISIBLE_DIR = "/run/migsim-visible"
ALL = "all"


@dataclass(frozen=True, slots=True)
class Visibility:
    """The devices one client sees: ``uuids`` of GPUs and MIG devices, or None for everything."""

    uuids: frozenset[str] | None = None

    @classmethod
    def of(cls, names: Iterable[str] | None) -> Visibility:
        """From a folder's file names (None: no folder, everything)."""
        if names is None:
            return EVERYTHING
        chosen = frozenset(n for n in names if not n.startswith("."))
        return EVERYTHING if ALL in chosen else cls(chosen)

    @classmethod
    def from_dir(cls, path: str | None = None) -> Visibility:
        """What a process with this folder sees (default: the environment's, as the C library)."""
        folder = path or os.environ.get(ENV_VISIBLE_DIR) or VISIBLE_DIR
        try:
            return cls.of(os.listdir(folder))
        except FileNotFoundError:
            return EVERYTHING
        except OSError:
            return cls(frozenset())

    @property
    def is_everything(self) -> bool:
        return self.uuids is None

    def _whole(self, gpu: SimGpu) -> bool:
        return self.uuids is None or gpu.uuid in self.uuids

    def sees(self, gpu: SimGpu) -> bool:
        """Whether the GPU is visible (itself, or through one of its MIG devices)."""
        return self._whole(gpu) or bool(self.mig_devices(gpu))

    def gpus(self, node: SimNode) -> list[SimGpu]:
        """The visible GPUs in NVML index order: the client's index of each is its position."""
        return [g for g in node.gpus if self.sees(g)]

    def mig_devices(self, gpu: SimGpu) -> list[tuple[SimGpuInstance, SimComputeInstance]]:
        """The GPU's visible MIG devices in NVML's order (their client indices: the positions)."""
        devices = gpu.mig_devices()
        if self._whole(gpu):
            return devices
        assert self.uuids is not None
        return [(gi, ci) for gi, ci in devices if ci.uuid in self.uuids]

    def whole(self, gpu: SimGpu) -> bool:
        """Whether the GPU itself is visible, not only some of its MIG devices."""
        return self._whole(gpu)


EVERYTHING = Visibility()
