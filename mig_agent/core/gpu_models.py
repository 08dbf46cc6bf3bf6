"""GPU model catalog: every MIG profile of each supported GPU model, NVML ids, placements.

The numbers come from real readouts (nvidia-smi -lgip/-lgipp, NVML); the H200 rows are exactly
the capture of a real H200 (driver 580.159.04). Where no readout exists (the B300 and GB300 beyond
names, ids and counts, the 8-slice Blackwell rows past 2g, their placements) the value is
inferred, and the model's comment says so. Profile
*names* are not stored: they are derived from the profile index and memory size the way NVIDIA's
Kubernetes stack derives them (`mig_name`), and a test checks them against the names the
hardware prints.

Pure module: data and functions of data, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from mig_agent.core.placement import Placement


class Architecture(StrEnum):
    AMPERE = "ampere"
    HOPPER = "hopper"
    BLACKWELL = "blackwell"
    TURING = "turing"

    @property
    def mig_mode_needs_reset(self) -> bool:
        """Ampere applies a MIG mode change only after a GPU reset; Hopper and later at once."""
        return self is Architecture.AMPERE


# NVML GPU-instance profile index -> (GPU slices G, name suffix), after nvml.h's
# NVML_GPU_INSTANCE_PROFILE_* constants.
GI_INDEX_SHAPE: Mapping[int, tuple[int, str]] = {
    0: (1, ""),
    1: (2, ""),
    2: (3, ""),
    3: (4, ""),
    4: (7, ""),
    5: (8, ""),
    6: (6, ""),
    7: (1, "+me"),
    8: (2, "+me"),
    9: (1, ""),
    10: (1, "+gfx"),
    11: (2, "+gfx"),
    12: (4, "+gfx"),
    13: (1, "-me"),
    14: (2, "-me"),
    15: (1, "+me.all"),
    16: (2, "+me.all"),
    17: (3, "+gfx"),
}
GI_PROFILE_INDEX_COUNT = 18  # NVML_GPU_INSTANCE_PROFILE_COUNT
# A `+me.all` GI (1_SLICE_ALL_ME, 2_SLICE_ALL_ME) holds every media engine of the GPU, so beside
# it only `-me` GIs (1_SLICE_NO_ME, 2_SLICE_NO_ME) can be made (nvml.h).
GI_INDEX_ALL_ME = frozenset({15, 16})
GI_INDEX_NO_ME = frozenset({13, 14})

# NVML compute-instance profile index by compute slices C; the CI profile id equals the index.
CI_INDEX_BY_SLICES: Mapping[int, int] = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}
CI_PROFILE_1_SLICE_REV1 = 7
CI_PROFILE_INDEX_COUNT = 9


@dataclass(frozen=True, slots=True)
class Engines:
    copy: int
    decoder: int
    encoder: int
    jpeg: int
    ofa: int


@dataclass(frozen=True, slots=True)
class CiProfile:
    """A compute-instance profile inside a GPU instance of a given GI profile."""

    index: int
    id: int
    slices: int
    instance_count: int
    multiprocessors: int
    placements: tuple[Placement, ...]  # in compute slices within the GPU instance


@dataclass(frozen=True, slots=True)
class GiProfile:
    """A GPU-instance profile: what ``nvmlDeviceGetGpuInstanceProfileInfoV`` reports, and where
    it can be placed."""

    name: str  # canonical, e.g. "1g.18gb", "1g.18gb+me"
    index: int
    id: int
    slices: int  # compute slices G
    memory_mib: int
    instance_count: int
    multiprocessors: int
    engines: Engines
    placements: tuple[Placement, ...]  # in units of the model's placement grid
    ci_profiles: tuple[CiProfile, ...] = ()

    @property
    def placement_size(self) -> int:
        """How many units of the model's placement grid the GI spans (NVML's placement size)."""
        return self.placements[0].size

    @property
    def takes_all_media(self) -> bool:
        return self.index in GI_INDEX_ALL_ME

    @property
    def has_no_media(self) -> bool:
        return self.index in GI_INDEX_NO_ME

    @property
    def full_ci(self) -> CiProfile:
        """The compute instance that spans the whole GPU instance (the default one)."""
        return next(c for c in self.ci_profiles if c.slices == self.slices)

    def ci_profile_by_id(self, ci_id: int) -> CiProfile | None:
        """The compute-instance profile with NVML id ``ci_id`` in this GI, or None."""
        return next((c for c in self.ci_profiles if c.id == ci_id), None)

    def ci_name(self, ci: CiProfile) -> str:
        """MIG device name of ``ci`` in this GI: the GI name when it spans the GI, else
        ``Cc.`` + GI name."""
        if ci.slices == self.slices:
            return self.name
        return f"{ci.slices}c.{self.name}"


@dataclass(frozen=True, slots=True)
class GpuModel:
    """One GPU model: identity, memory, and its MIG geometry (empty for GPUs without MIG)."""

    key: str  # short name used on the command line, e.g. "H200"
    name: str  # NVML device name, e.g. "NVIDIA H200"
    product: str  # nvidia.com/gpu.product label value
    pci_device_id: int  # packed device<<16 | vendor, as mig-parted's device-filter
    pci_subsystem_id: int
    memory_total_mib: int
    architecture: Architecture
    memory_slices: int  # each about 1/n of the memory, L2 and bandwidth
    compute_slices: int
    # Width of NVML's placement grid: placements are in these units. One per memory slice on
    # most models; the RTX PRO 6000 Blackwell places on 12 units over its 4 memory slices.
    placement_units: int
    gi_profiles: tuple[GiProfile, ...] = ()
    gi_by_name: Mapping[str, GiProfile] = field(default_factory=dict, compare=False, repr=False)

    @property
    def mig_capable(self) -> bool:
        return bool(self.gi_profiles)

    def memory_slices_of(self, gi: GiProfile) -> int:
        """The memory slices ``gi`` takes (its placement size, in memory slices)."""
        return gi.placement_size * self.memory_slices // self.placement_units

    def gi_profile_by_id(self, profile_id: int) -> GiProfile | None:
        return next((p for p in self.gi_profiles if p.id == profile_id), None)

    def device_names(self) -> tuple[str, ...]:
        """Every MIG device name this model can host (GI names and ``Cc.`` sub-profiles)."""
        names: list[str] = []
        for gi in self.gi_profiles:
            for ci in gi.ci_profiles:
                name = gi.ci_name(ci)
                if name not in names:
                    names.append(name)
        return tuple(names)

    def resolve(self, device_name: str) -> tuple[GiProfile, CiProfile] | None:
        """The GI and CI profile that make a MIG device called ``device_name``, or None.

        NB: a 1g REV2 GI offers CI 0 and 1_SLICE_REV1, both named like the GI; NVIDIA's stack
        makes CI 0 (nvml-mig.md 4), so the REV1 one is taken only where no other has the name.
        """
        found = [
            (gi, ci)
            for gi in self.gi_profiles
            for ci in gi.ci_profiles
            if gi.ci_name(ci) == device_name
        ]
        rev1 = [f for f in found if f[1].slices == 1 and f[1].index == CI_PROFILE_1_SLICE_REV1]
        return next((f for f in found if f not in rev1), found[0] if found else None)


def mig_memory_gb(memory_mib: int, total_mib: int) -> int:
    """The ``gb`` of a MIG profile name, computed as NVIDIA's Kubernetes stack computes it.

    The fraction of total memory is rounded up to eighths, scaled by the total in whole GiB
    (rounded up), and rounded half away from zero (Go's math.Round, not Python's round()).
    NB: H200 3g.71gb: 71424 of 143771 MiB -> 4/8 * 141 = 70.5 -> 71.
    """
    frac = math.ceil(memory_mib / total_mib * 8) / 8
    total_gb = math.ceil(total_mib / 1024)
    return math.floor(frac * total_gb + 0.5)


def mig_name(index: int, memory_mib: int, total_mib: int) -> str:
    g, suffix = GI_INDEX_SHAPE[index]
    return f"{g}g.{mig_memory_gb(memory_mib, total_mib)}gb{suffix}"


def _ci_profiles(
    g: int, sm_per_slice: int, gi_sms: int, rev1_sms: int | None
) -> tuple[CiProfile, ...]:
    # C <= G and, below G, 2C <= G+1 (the rule NVIDIA's tools use); count floor(G/C).
    out: list[CiProfile] = []
    for c in sorted(CI_INDEX_BY_SLICES):
        if c > g or (c < g and 2 * c > g + 1):
            continue
        starts = [0] if c == g else list(range(0, g - c + 1, 2 if c == 2 else (4 if c == 3 else 1)))
        if c == 4:
            starts = [0]
        count = len(starts)
        # on a 1g REV2 GI the whole-GI CI is the REV1 one below: profile 0 is one compute slice
        sms = gi_sms if c == g and rev1_sms is None else c * sm_per_slice
        idx = CI_INDEX_BY_SLICES[c]
        out.append(CiProfile(idx, idx, c, count, sms, tuple(Placement(s, c) for s in starts)))
    if rev1_sms is not None:  # Hopper 1g REV2 GIs also offer a whole-GI CI with more SMs
        out.append(
            CiProfile(
                CI_PROFILE_1_SLICE_REV1, CI_PROFILE_1_SLICE_REV1, 1, 1, rev1_sms, (Placement(0, 1),)
            )
        )
    return tuple(out)


# (index, id, G, memory MiB, instances, SMs, CE, DEC, ENC, JPEG, OFA, placement starts, size)
_Row = tuple[int, int, int, int, int, int, int, int, int, int, int, tuple[int, ...], int]
_S7 = (0, 1, 2, 3, 4, 5, 6)
_Q4 = (0, 3, 6, 9)  # the RTX PRO 6000's 1g starts on its 12-unit grid


def _model(
    key: str,
    name: str,
    product: str,
    pci: int,
    subsys: int,
    total_mib: int,
    arch: Architecture,
    memory_slices: int,
    compute_slices: int,
    rows: tuple[_Row, ...],
    *,
    placement_units: int | None = None,  # default: one unit per memory slice
) -> GpuModel:
    sm_1g = next((r[5] for r in rows if r[0] == 0), 0)
    profiles = []
    for idx, pid, g, mem, inst, sms, ce, dec, enc, jpg, ofa, starts, size in rows:
        rev1 = sms if (idx == 9 and arch is not Architecture.AMPERE) else None
        profiles.append(
            GiProfile(
                name=mig_name(idx, mem, total_mib),
                index=idx,
                id=pid,
                slices=g,
                memory_mib=mem,
                instance_count=inst,
                multiprocessors=sms,
                engines=Engines(ce, dec, enc, jpg, ofa),
                placements=tuple(Placement(s, size) for s in starts),
                ci_profiles=_ci_profiles(g, sm_1g, sms, rev1),
            )
        )
    by_name = {p.name: p for p in profiles}
    return GpuModel(
        key=key,
        name=name,
        product=product,
        pci_device_id=pci,
        pci_subsystem_id=subsys,
        memory_total_mib=total_mib,
        architecture=arch,
        memory_slices=memory_slices,
        compute_slices=compute_slices,
        placement_units=placement_units or memory_slices,
        gi_profiles=tuple(profiles),
        gi_by_name=by_name,
    )


A = Architecture
MODELS: Mapping[str, GpuModel] = {
    m.key: m
    for m in (
        _model(
            "A100-40GB",
            "NVIDIA A100-SXM4-40GB",
            "NVIDIA-A100-SXM4-40GB",
            0x20B010DE,
            0x134F10DE,
            40536,
            A.AMPERE,
            8,
            7,
            (
                (0, 19, 1, 4864, 7, 14, 1, 0, 0, 0, 0, _S7, 1),
                (7, 20, 1, 4864, 1, 14, 1, 1, 0, 1, 1, _S7, 1),
                (9, 15, 1, 9856, 4, 14, 1, 1, 0, 0, 0, (0, 2, 4, 6), 2),
                (1, 14, 2, 9856, 3, 28, 2, 1, 0, 0, 0, (0, 2, 4), 2),
                (2, 9, 3, 19968, 2, 42, 3, 2, 0, 0, 0, (0, 4), 4),
                (3, 5, 4, 19968, 1, 56, 4, 2, 0, 0, 0, (0,), 4),
                (4, 0, 7, 40192, 1, 98, 7, 5, 0, 1, 1, (0,), 8),
            ),
        ),
        _model(
            "A100-80GB",
            "NVIDIA A100-SXM4-80GB",
            "NVIDIA-A100-SXM4-80GB",
            0x20B210DE,
            0x147F10DE,
            81920,
            A.AMPERE,
            8,
            7,
            (
                (0, 19, 1, 9728, 7, 14, 1, 0, 0, 0, 0, _S7, 1),
                (7, 20, 1, 9728, 1, 14, 1, 1, 0, 1, 1, _S7, 1),
                (9, 15, 1, 19968, 4, 14, 1, 1, 0, 0, 0, (0, 2, 4, 6), 2),
                (1, 14, 2, 19968, 3, 28, 2, 1, 0, 0, 0, (0, 2, 4), 2),
                (2, 9, 3, 40192, 2, 42, 3, 2, 0, 0, 0, (0, 4), 4),
                (3, 5, 4, 40192, 1, 56, 4, 2, 0, 0, 0, (0,), 4),
                (4, 0, 7, 80896, 1, 98, 7, 5, 0, 1, 1, (0,), 8),
            ),
        ),
        _model(
            "A30",
            "NVIDIA A30",
            "NVIDIA-A30",
            0x20B710DE,
            0x153210DE,
            24576,
            A.AMPERE,
            4,
            4,
            (
                (0, 14, 1, 5952, 4, 14, 1, 1, 0, 0, 0, (0, 1, 2, 3), 1),
                (7, 21, 1, 5952, 1, 14, 1, 1, 0, 1, 1, (0, 1, 2, 3), 1),
                (1, 5, 2, 11968, 2, 28, 2, 2, 0, 0, 0, (0, 2), 2),
                (8, 6, 2, 11968, 1, 28, 2, 2, 0, 1, 1, (0, 2), 2),
                (3, 0, 4, 24064, 1, 56, 4, 4, 0, 1, 1, (0,), 4),
            ),
        ),
        _model(
            "H100-80GB",
            "NVIDIA H100 80GB HBM3",
            "NVIDIA-H100-80GB-HBM3",
            0x233010DE,
            0x16C110DE,
            81559,
            A.HOPPER,
            8,
            7,
            (
                (0, 19, 1, 9984, 7, 16, 1, 1, 0, 1, 0, _S7, 1),
                (7, 20, 1, 9984, 1, 16, 1, 1, 0, 1, 1, _S7, 1),
                (9, 15, 1, 20096, 4, 26, 1, 1, 0, 1, 0, (0, 2, 4, 6), 2),
                (1, 14, 2, 20096, 3, 32, 2, 2, 0, 2, 0, (0, 2, 4), 2),
                (2, 9, 3, 40448, 2, 60, 3, 3, 0, 3, 0, (0, 4), 4),
                (3, 5, 4, 40448, 1, 64, 4, 4, 0, 4, 0, (0,), 4),
                (4, 0, 7, 81152, 1, 132, 8, 7, 0, 7, 1, (0,), 8),
            ),
        ),
        _model(
            "H100-NVL",
            "NVIDIA H100 NVL",
            "NVIDIA-H100-NVL",
            0x232110DE,
            0x183910DE,
            95830,
            A.HOPPER,
            8,
            7,
            (
                (0, 19, 1, 10880, 7, 16, 1, 1, 0, 1, 0, _S7, 1),
                (7, 20, 1, 10880, 1, 16, 1, 1, 0, 1, 1, _S7, 1),
                (9, 15, 1, 22016, 4, 26, 1, 1, 0, 1, 0, (0, 2, 4, 6), 2),
                (1, 14, 2, 22016, 3, 32, 2, 2, 0, 2, 0, (0, 2, 4), 2),
                (2, 9, 3, 47232, 2, 60, 3, 3, 0, 3, 0, (0, 4), 4),
                (3, 5, 4, 47232, 1, 64, 4, 4, 0, 4, 0, (0,), 4),
                (4, 0, 7, 94848, 1, 132, 8, 7, 0, 7, 1, (0,), 8),
            ),
        ),
        # NB: exactly the real H200 capture (reference captures h200-0x2335-*), driver 580.159.04.
        _model(
            "H200",
            "NVIDIA H200",
            "NVIDIA-H200",
            0x233510DE,
            0x18BF10DE,
            143771,
            A.HOPPER,
            8,
            7,
            (
                (0, 19, 1, 16384, 7, 16, 1, 1, 0, 1, 0, _S7, 1),
                (7, 20, 1, 16384, 1, 16, 1, 1, 0, 1, 1, _S7, 1),
                (9, 15, 1, 33280, 4, 26, 1, 1, 0, 1, 0, (0, 2, 4, 6), 2),
                (1, 14, 2, 33280, 3, 32, 2, 2, 0, 2, 0, (0, 2, 4), 2),
                (2, 9, 3, 71424, 2, 60, 3, 3, 0, 3, 0, (0, 4), 4),
                (3, 5, 4, 71424, 1, 64, 4, 4, 0, 4, 0, (0,), 4),
                (4, 0, 7, 143360, 1, 132, 8, 7, 0, 7, 1, (0,), 8),
            ),
        ),
        # Blackwell, 8 memory slices. No -lgipp readout exists for any of them: the placements
        # are the Hopper ones (same profile ids; the GI ids of a B200 readout fit them) [I].
        # B200: the 1g, 1g+me, 1g REV2 and 2g rows are readouts (mig-parted #166/#187,
        # gpu-operator #2155); 3g/4g/7g memory and SMs are a third party's (89.00 and 178.50
        # GiB), their ids and DEC/JPEG counts Hopper's [I], CE counts the user guide's.
        _model(
            "B200",
            "NVIDIA B200",
            "NVIDIA-B200",
            0x290110DE,
            0x199910DE,
            183359,
            A.BLACKWELL,
            8,
            7,
            (
                (0, 19, 1, 20992, 7, 18, 2, 1, 0, 1, 0, _S7, 1),
                (7, 20, 1, 20992, 1, 18, 2, 1, 0, 1, 1, _S7, 1),
                (9, 15, 1, 45312, 4, 30, 2, 1, 0, 1, 0, (0, 2, 4, 6), 2),
                (1, 14, 2, 45312, 3, 36, 4, 2, 0, 2, 0, (0, 2, 4), 2),
                (2, 9, 3, 91136, 2, 70, 6, 3, 0, 3, 0, (0, 4), 4),
                (3, 5, 4, 91136, 1, 72, 8, 4, 0, 4, 0, (0,), 4),
                (4, 0, 7, 182784, 1, 148, 16, 7, 0, 7, 1, (0,), 8),
            ),
        ),
        # GB200 (production boards): 1g to 2g rows read on hardware (mig-parted #227; 2g CE from
        # gpu-operator #1303); 3g/4g/7g scaled from the B200's ratios, ids Hopper's [I]. No
        # subsystem id is published (0: unknown).
        _model(
            "GB200",
            "NVIDIA GB200",
            "NVIDIA-GB200",
            0x294110DE,
            0x00000000,
            189471,
            A.BLACKWELL,
            8,
            7,
            (
                (0, 19, 1, 22528, 7, 18, 2, 1, 0, 1, 0, _S7, 1),
                (7, 20, 1, 22528, 1, 18, 2, 1, 0, 1, 1, _S7, 1),
                (9, 15, 1, 46592, 4, 32, 2, 1, 0, 1, 0, (0, 2, 4, 6), 2),
                (1, 14, 2, 46592, 3, 38, 4, 2, 0, 2, 0, (0, 2, 4), 2),
                (2, 9, 3, 93696, 2, 74, 6, 3, 0, 3, 0, (0, 4), 4),
                (3, 5, 4, 93696, 1, 76, 8, 4, 0, 4, 0, (0,), 4),
                (4, 0, 7, 187904, 1, 152, 16, 7, 0, 7, 1, (0,), 8),
            ),
        ),
        # B300 and GB300: only names, counts and ids are published (GB300 ids from a DGX Station
        # readout). Memory is scaled from the B200's ratios, SMs and engines copied from the
        # B200 (B300) and GB200 (GB300) [I]; the B300 1g's 18 SMs are known.
        _model(
            "B300",
            "NVIDIA B300 SXM6 AC",
            "NVIDIA-B300-SXM6-AC",
            0x318210DE,
            0x20E610DE,
            275040,
            A.BLACKWELL,
            8,
            7,
            (
                (0, 19, 1, 31488, 7, 18, 2, 1, 0, 1, 0, _S7, 1),
                (7, 20, 1, 31488, 1, 18, 2, 1, 0, 1, 1, _S7, 1),
                (9, 15, 1, 67840, 4, 30, 2, 1, 0, 1, 0, (0, 2, 4, 6), 2),
                (1, 14, 2, 67840, 3, 36, 4, 2, 0, 2, 0, (0, 2, 4), 2),
                (2, 9, 3, 136192, 2, 70, 6, 3, 0, 3, 0, (0, 4), 4),
                (3, 5, 4, 136192, 1, 72, 8, 4, 0, 4, 0, (0,), 4),
                (4, 0, 7, 272896, 1, 148, 16, 7, 0, 7, 1, (0,), 8),
            ),
        ),
        _model(
            "GB300",
            "NVIDIA GB300",
            "NVIDIA-GB300",
            0x31C210DE,
            0x21F110DE,
            284208,
            A.BLACKWELL,
            8,
            7,
            (
                (0, 19, 1, 32512, 7, 18, 2, 1, 0, 1, 0, _S7, 1),
                (7, 20, 1, 32512, 1, 18, 2, 1, 0, 1, 1, _S7, 1),
                (9, 15, 1, 70144, 4, 32, 2, 1, 0, 1, 0, (0, 2, 4, 6), 2),
                (1, 14, 2, 70144, 3, 38, 4, 2, 0, 2, 0, (0, 2, 4), 2),
                (2, 9, 3, 140800, 2, 74, 6, 3, 0, 3, 0, (0, 4), 4),
                (3, 5, 4, 140800, 1, 76, 8, 4, 0, 4, 0, (0,), 4),
                (4, 0, 7, 282112, 1, 152, 16, 7, 0, 7, 1, (0,), 8),
            ),
        ),
        # RTX PRO 6000 Blackwell Server Edition: 4 memory and 4 compute slices, but placements
        # on a 12-unit grid (a 1g spans 3 units). Every row is a readout (-lgip, -lgipp); the
        # 2g and 4g memory are the printed GiB x 1024 (47.38 and 95.12 GiB), the profile
        # indices matched to the rows by name [I]. Ids differ from every other model's.
        _model(
            "RTX-PRO-6000",
            "NVIDIA RTX PRO 6000 Blackwell Server Edition",
            "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition",
            0x2BB510DE,
            0x204E10DE,
            97887,
            A.BLACKWELL,
            4,
            4,
            (
                (0, 14, 1, 24192, 4, 46, 1, 1, 1, 1, 0, _Q4, 3),
                (7, 21, 1, 24192, 1, 46, 1, 1, 1, 1, 1, _Q4, 3),
                (10, 47, 1, 24192, 4, 46, 1, 1, 1, 1, 0, _Q4, 3),
                (13, 67, 1, 24192, 4, 46, 1, 0, 0, 0, 0, _Q4, 3),
                (15, 65, 1, 24192, 1, 46, 1, 4, 4, 4, 1, _Q4, 3),
                (1, 5, 2, 48512, 2, 94, 2, 2, 2, 2, 0, (0, 6), 6),
                (11, 35, 2, 48512, 2, 94, 2, 2, 2, 2, 0, (0, 6), 6),
                (14, 66, 2, 48512, 2, 94, 2, 0, 0, 0, 0, (0, 6), 6),
                (16, 64, 2, 48512, 1, 94, 2, 4, 4, 4, 1, (0, 6), 6),
                (3, 0, 4, 97408, 1, 188, 4, 4, 4, 4, 1, (0,), 12),
                (12, 32, 4, 97408, 1, 188, 4, 4, 4, 4, 1, (0,), 12),
            ),
            placement_units=12,
        ),
        # A display GPU without MIG, as in DGX Station configs (device-filter 0x1FB010DE).
        _model(
            "DGX-Display",
            "DGX Display",
            "DGX-Display",
            0x1FB010DE,
            0x000010DE,
            4096,
            A.TURING,
            0,
            0,
            (),
        ),
    )
}

# The GPUs' nvidia.com/gpu.product label values, for finding a model from a node label.
MODEL_BY_PRODUCT: Mapping[str, GpuModel] = {m.product: m for m in MODELS.values()}
MODEL_BY_PCI_ID: Mapping[int, GpuModel] = {m.pci_device_id: m for m in MODELS.values()}

# Every PCI id with a catalog model's MIG geometry (profile names, counts, placements): the ids
# the default layouts select for that model. The other boards are no models of their own, as
# their SM counts may differ (an H100 PCIe has 114 SMs, the SXM5 132); NVML tells them apart.
FAMILY_PCI_IDS: Mapping[str, frozenset[int]] = {
    "A100-40GB": frozenset({0x20B010DE, 0x20B110DE, 0x20F110DE, 0x20F610DE}),  # + A800 40GB
    "A100-80GB": frozenset({0x20B210DE, 0x20B510DE, 0x20F310DE, 0x20F510DE}),  # + A800 80GB
    "A30": frozenset({0x20B710DE}),
    "H100-80GB": frozenset({0x233010DE, 0x233110DE, 0x232210DE, 0x232410DE}),  # + PCIe, H800
    "H100-NVL": frozenset({0x232110DE, 0x233A10DE}),  # + H800 NVL
    "H200": frozenset({0x233510DE, 0x233B10DE}),  # + H200 NVL
    "B200": frozenset({0x290110DE}),
    "GB200": frozenset({0x294110DE}),
    "B300": frozenset({0x318210DE}),
    "GB300": frozenset({0x31C210DE}),
    # + the Workstation and Max-Q Workstation editions, whose profiles are the same
    "RTX-PRO-6000": frozenset({0x2BB510DE, 0x2BB110DE, 0x2BB410DE}),
}


def model(key: str) -> GpuModel:
    """The catalog model called ``key`` (case-insensitive); ValueError naming the known ones."""
    for k, m in MODELS.items():
        if k.lower() == key.lower():
            return m
    raise ValueError(f"unknown GPU model {key!r}; known models: {', '.join(MODELS)}")


def parse_gpu_spec(spec: str) -> tuple[GpuModel, ...]:
    """``8xH100-80GB`` or ``2xA100-40GB,2xA30`` or ``H200`` -> one model per GPU, in order."""
    out: list[GpuModel] = []
    for part in spec.split(","):
        part = part.strip()
        count_text, sep, key = part.partition("x")
        if sep and count_text.isdigit():
            count = int(count_text)
        else:
            count, key = 1, part
        if count < 1:
            raise ValueError(f"bad GPU count in {part!r}")
        out.extend([model(key)] * count)
    if not out:
        raise ValueError(f"no GPUs in {spec!r}")
    return tuple(out)


def resource_name(device_name: str, *, strategy: str = "mixed") -> str | None:
    """The Kubernetes extended resource NVIDIA's device plugin advertises for a MIG device.

    single: ``nvidia.com/gpu`` for every MIG device (its pattern is ``*``). mixed:
    ``nvidia.com/mig-<name>`` with ``+`` replaced by ``.``, and None for a device that splits a
    GPU instance (``1c.3g.71gb``): the plugin makes patterns only for profiles whose compute
    slices equal their GPU slices (k8s-device-plugin ``internal/rm/rm.go``), and refuses to start
    on a device that matches none (see mig_agent.core.advertised).
    """
    if strategy == "single":
        return "nvidia.com/gpu"
    if device_name.split(".")[0].endswith("c"):
        return None
    return "nvidia.com/mig-" + device_name.replace("+", ".")
