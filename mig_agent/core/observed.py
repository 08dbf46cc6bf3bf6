"""Observed state: what NVML reports about this node's GPUs now.

Kept apart from the desired state (mig_agent.core.layout) so that "what is" is never confused with
"what should be". Pure module: frozen values, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from mig_agent.core.placement import Placement


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """Identity of one physical GPU. ``index`` is NVML's, which follows PCI bus id order."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    pci_device_id: int  # packed device<<16 | vendor, e.g. 0x233510DE
    pci_subsystem_id: int
    memory_total_mib: int


@dataclass(frozen=True, slots=True)
class ComputeInstance:
    id: int
    profile_id: int
    placement: Placement  # compute slices within the GPU instance
    uuid: str = ""  # the MIG device's UUID


@dataclass(frozen=True, slots=True)
class GpuInstance:
    id: int
    profile_id: int
    placement: Placement  # memory slices on the GPU
    compute_instances: tuple[ComputeInstance, ...] = ()


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A process using the GPU; ``gi_id``/``ci_id`` are None when it is not on a MIG device."""

    pid: int
    gi_id: int | None = None
    ci_id: int | None = None
    used_memory_mib: int | None = None


@dataclass(frozen=True, slots=True)
class GpuState:
    info: GpuInfo
    mig_capable: bool
    mig_current: bool = False
    mig_pending: bool = False
    gpu_instances: tuple[GpuInstance, ...] = ()
    processes: tuple[GpuProcess, ...] = ()

    @property
    def index(self) -> int:
        return self.info.index

    @property
    def mig_change_pending(self) -> bool:
        """MIG mode was set but takes effect only after a reset (Ampere) or a reboot."""
        return self.mig_current != self.mig_pending

    @property
    def mig_device_uuids(self) -> frozenset[str]:
        """The UUIDs of its MIG devices (compute instances) NVML names."""
        return frozenset(
            ci.uuid for gi in self.gpu_instances for ci in gi.compute_instances if ci.uuid
        )

    def processes_on(self, gi_id: int) -> tuple[GpuProcess, ...]:
        return tuple(p for p in self.processes if p.gi_id == gi_id)


@dataclass(frozen=True, slots=True)
class NodeState:
    gpus: tuple[GpuState, ...]

    def gpu(self, index: int) -> GpuState:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(index)
