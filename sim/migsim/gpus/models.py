"""The simulator's own values for a GPU model: identity, memory, and its MIG geometry as NVML
reports it (GPU-instance profiles with their placements, compute-instance profiles per GPU
instance). Filled from the data files beside this module (see migsim.gpus.loader), never from
mig_agent, so that the agent's catalog can be checked against something it did not write.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Architecture(StrEnum):
    TURING = "turing"
    AMPERE = "ampere"
    HOPPER = "hopper"
    BLACKWELL = "blackwell"

    @property
    def nvml_code(self) -> int:
        """``nvmlDeviceGetArchitecture``'s NVML_DEVICE_ARCH_* value (nvml.h)."""
        return _ARCH_CODES[self]


_ARCH_CODES = {
    Architecture.TURING: 6,
    Architecture.AMPERE: 7,
    Architecture.HOPPER: 9,
    Architecture.BLACKWELL: 10,
}


class Brand(StrEnum):
    """What ``nvmlDeviceGetBrand`` reports (nvidia-smi's "Product Brand")."""

    NVIDIA = "nvidia"
    NVIDIA_RTX = "nvidia-rtx"

    @property
    def nvml_code(self) -> int:
        """The NVML_BRAND_* value (nvml.h)."""
        return _BRAND_CODES[self]


_BRAND_CODES = {Brand.NVIDIA: 14, Brand.NVIDIA_RTX: 13}


@dataclass(frozen=True, slots=True, order=True)
class Placement:
    """Where an instance sits: ``start`` and ``size`` in the units NVML reports (GPU instances:
    the model's placement grid; compute instances: compute slices within the GPU instance)."""

    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size

    def overlaps(self, other: Placement) -> bool:
        return self.start < other.end and other.start < self.end

    def __str__(self) -> str:  # as nvidia-smi prints one placement
        return f"{self.start}:{self.size}"


@dataclass(frozen=True, slots=True)
class Engines:
    """The engines of a GPU instance (its compute instances share them)."""

    copy: int
    decoder: int
    encoder: int
    jpeg: int
    ofa: int


@dataclass(frozen=True, slots=True)
class CiProfile:
    """A compute-instance profile offered inside GPU instances of one GI profile."""

    index: int  # NVML_COMPUTE_INSTANCE_PROFILE_*
    id: int
    slices: int  # compute slices
    instance_count: int
    multiprocessors: int
    placements: tuple[Placement, ...]


# The capability a GI profile's name carries after its memory size, by NVML profile index
# (nvml.h NVML_GPU_INSTANCE_PROFILE_*): REV1 "+me", GFX "+gfx", NO_ME "-me", ALL_ME "+me.all".
CAPABILITIES = ("", "+me", "+gfx", "-me", "+me.all")


@dataclass(frozen=True, slots=True)
class GiProfile:
    """A GPU-instance profile: what ``nvmlDeviceGetGpuInstanceProfileInfoV`` reports for NVML
    profile ``index``, where its instances can be placed, and the CI profiles inside them."""

    name: str  # as the driver names it, without nvidia-smi's "MIG " ("1g.18gb+me")
    index: int  # NVML_GPU_INSTANCE_PROFILE_*
    id: int  # the driver's profile id (what create, placements and capacity take)
    slices: int  # compute slices
    instance_count: int
    memory_mib: int
    multiprocessors: int
    engines: Engines
    placements: tuple[Placement, ...]
    ci_profiles: tuple[CiProfile, ...]

    @property
    def capability(self) -> str:
        """ "+me", "+gfx", "-me", "+me.all" or ""."""
        for cap in sorted(CAPABILITIES, key=len, reverse=True):
            if cap and self.name.endswith(cap):
                return cap
        return ""

    @property
    def placement_size(self) -> int:
        return self.placements[0].size

    def ci_profile_by_id(self, ci_id: int) -> CiProfile | None:
        return next((c for c in self.ci_profiles if c.id == ci_id), None)

    def ci_profile_at(self, index: int) -> CiProfile | None:
        return next((c for c in self.ci_profiles if c.index == index), None)

    def ci_name(self, ci: CiProfile) -> str:
        """The MIG device name of a compute instance of ``ci`` in this GPU instance: the GI's
        name when it spans the GI, else ``<C>c.`` before it (MIG User Guide device names)."""
        return self.name if ci.slices == self.slices else f"{ci.slices}c.{self.name}"


@dataclass(frozen=True, slots=True)
class Inferred:
    """A value the data file marks as inferred (no readout behind it), and why."""

    field: str  # where in the model: "gi_profiles[3g.90gb].memory_mib"
    reason: str


@dataclass(frozen=True, slots=True)
class Readings:
    """What the driver reports of an idle GPU of a model, as read on a real one: the values
    nvidia-smi's table shows besides identity and MIG (NVML answers NOT_SUPPORTED for all of
    them on a model without readings)."""

    temperature_c: int  # nvmlDeviceGetTemperature (NVML_TEMPERATURE_GPU)
    power_draw_mw: int  # nvmlDeviceGetPowerUsage
    power_limit_mw: int  # nvmlDeviceGetEnforcedPowerLimit
    performance_state: int  # nvmlDeviceGetPerformanceState: 0 for P0
    ecc_enabled: bool  # nvmlDeviceGetEccMode (current and pending)


@dataclass(frozen=True, slots=True)
class GpuModel:
    """One simulated GPU model. A model without MIG has no GI profiles and no slices."""

    key: str  # what GPU specs name it by: "H200" in "8xH200"
    name: str  # nvmlDeviceGetName
    pci_device_id: int  # nvmlPciInfo_t.pciDeviceId: device << 16 | vendor
    pci_subsystem_ids: tuple[int, ...]  # subdevice << 16 | subvendor; empty where unknown
    memory_total_mib: int
    multiprocessors: int | None  # of the whole GPU; None where no source gives it
    architecture: Architecture
    brand: Brand
    compute_capability: tuple[int, int]
    mig_mode_needs_reset: bool  # a MIG mode change applies only after a GPU reset
    memory_slices: int
    compute_slices: int
    placement_grid: int  # the units GI placements are given in (memory slices, or finer)
    gi_profiles: tuple[GiProfile, ...]
    inferred: tuple[Inferred, ...]
    source: str  # the data file it came from
    readings: Readings | None = None  # None where no readout of an idle GPU is at hand

    @property
    def mig_capable(self) -> bool:
        return bool(self.gi_profiles)

    @property
    def pci_subsystem_id(self) -> int:
        """What the simulated GPU reports: the first known subsystem id, 0 where none is known."""
        return self.pci_subsystem_ids[0] if self.pci_subsystem_ids else 0

    @property
    def product(self) -> str:
        """GPU Feature Discovery's ``nvidia.com/gpu.product``: the name, spaces as dashes
        ("NVIDIA H200" -> "NVIDIA-H200", as on the captured H200)."""
        return "-".join(self.name.split())

    @property
    def max_mig_devices(self) -> int:
        """``nvmlDeviceGetMaxMigDeviceCount`` with MIG on: one per compute slice."""
        return self.compute_slices

    def gi_profile_by_id(self, profile_id: int) -> GiProfile | None:
        return next((p for p in self.gi_profiles if p.id == profile_id), None)

    def gi_profile_at(self, index: int) -> GiProfile | None:
        return next((p for p in self.gi_profiles if p.index == index), None)

    def is_inferred(self, field: str) -> bool:
        """Whether ``field`` (or the part of the model it lies in) is marked inferred."""
        return any(field == i.field or field.startswith(i.field + ".") for i in self.inferred)
