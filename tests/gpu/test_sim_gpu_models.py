"""We test the simulated GPUs of every model through pynvml's real wrappers, as hardware behaves:

* go-nvlib's walk over GI profile indices 0..0x11: each index answers the model's profile or
  NOT_SUPPORTED; 0x11 answers INVALID_ARGUMENT on the measured 580 driver (as on the captured H200)
  and NOT_SUPPORTED on a driver whose table knows it;
* profile info, placements and capacity are the model's data (the RTX PRO 6000's on its 12-unit
  grid), GI ids number that grid, MaxMigDeviceCount is the compute slices;
* a MIG mode change needs no reset on Hopper and Blackwell (even where reset is impossible), and
  stays pending until one on Ampere;
* an ALL_ME (+me.all) GPU instance leaves room only for NO_ME (-me) ones;
* MIG device names are CUDA's ("NVIDIA B200 MIG 1g.23gb"); the captured H200's -lgip table, GFD's
  labels and the device plugin's resources with MIG off come out of NVML as captured;
* the agent's NVML backend reads every simulated model, those its catalog lacks too, naming the
  profiles as the driver does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from ctypes import byref, c_uint
from types import ModuleType
from typing import Any

import pytest
from migsim import device_plugin as sim_device_plugin
from migsim.cluster.nodes import gpu_node_labels
from migsim.gpus import MODELS, GpuModel
from migsim.nvml.state import RESET_REQUIRED, SUCCESS

from mig_agent.gpu.nvml import NvmlGpuBackend

from .conftest import CAPTURES, MakeNode

NvmlOn = Callable[[str], ModuleType]
MIG_MODELS = sorted(k for k, m in MODELS.items() if m.mig_capable)
GO_NVLIB_INDICES = range(0x12)  # NVML_GPU_INSTANCE_PROFILE_COUNT


def _placements(nv: ModuleType, h: Any, profile_id: int) -> list[tuple[int, int]]:
    count = c_uint(0)
    nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, None, byref(count))
    arr = (nv.c_nvmlGpuInstancePlacement_t * count.value)()
    nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, byref(count))
    return [(arr[i].start, arr[i].size) for i in range(count.value)]


def _create_gi(nv: ModuleType, h: Any, profile_id: int, start: int, size: int) -> Any:
    return nv.nvmlDeviceCreateGpuInstanceWithPlacement(
        h, profile_id, byref(nv.c_nvmlGpuInstancePlacement_t(start, size))
    )


def _info(nv: ModuleType, h: Any, index: int) -> Any:
    try:
        return nv.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
    except nv.NVMLError as e:
        return type(e)


@pytest.mark.parametrize("newer_driver", [False, True])
@pytest.mark.parametrize("key", MIG_MODELS)
def test_go_nvlib_walks_every_profile_index(
    key: str, newer_driver: bool, make_node: MakeNode, nvml_on: NvmlOn
) -> None:
    m = MODELS[key]
    nv = nvml_on(make_node(key, driver_knows_3_slice_gfx=newer_driver))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    for index in GO_NVLIB_INDICES:
        got, p = _info(nv, h, index), m.gi_profile_at(index)
        if p is not None:
            assert (got.id, got.name, got.memorySizeMB) == (p.id, f"MIG {p.name}", p.memory_mib)
        elif index == 0x11 and not newer_driver:
            assert got is nv.NVMLError_InvalidArgument  # past the 580 driver's table
        else:
            assert got is nv.NVMLError_NotSupported, index


@pytest.mark.parametrize("key", MIG_MODELS)
def test_profiles_and_placements_are_the_models(
    key: str, make_node: MakeNode, nvml_on: NvmlOn
) -> None:
    m = MODELS[key]
    nv = nvml_on(make_node(key, mig_enabled=True))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetMaxMigDeviceCount(h) == m.compute_slices
    assert nv.nvmlDeviceGetArchitecture(h) == m.architecture.nvml_code
    assert tuple(nv.nvmlDeviceGetCudaComputeCapability(h)) == m.compute_capability
    for p in m.gi_profiles:
        info = nv.nvmlDeviceGetGpuInstanceProfileInfoById(h, p.id)
        e = p.engines
        assert (
            info.sliceCount,
            info.instanceCount,
            info.multiprocessorCount,
            (info.copyEngineCount, info.decoderCount, info.encoderCount),
            (info.jpegCount, info.ofaCount),
        ) == (
            p.slices,
            p.instance_count,
            p.multiprocessors,
            (e.copy, e.decoder, e.encoder),
            (e.jpeg, e.ofa),
        )
        assert _placements(nv, h, p.id) == [(pl.start, pl.size) for pl in p.placements]
        assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, p.id) == p.instance_count


def test_the_rtx_pro_6000_grid(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    nv = nvml_on(make_node("RTX-PRO-6000", mig_enabled=True))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert _placements(nv, h, 14) == [(0, 3), (3, 3), (6, 3), (9, 3)]  # 1g.24gb
    assert _placements(nv, h, 5) == [(0, 6), (6, 6)]  # 2g.48gb
    assert _placements(nv, h, 0) == [(0, 12)]  # 4g.96gb
    # the -lgi layout blackwell.md quotes: 2g.48gb 0:6, 1g.24gb 6:3 and 9:3
    two = _create_gi(nv, h, 5, 0, 6)
    ones = [_create_gi(nv, h, 14, s, 3) for s in (6, 9)]
    # GI ids number the 12-unit grid as a tree: halves 1-2, quarters 3-6 (lowest free first)
    assert [nv.nvmlGpuInstanceGetInfo(g).id for g in (two, *ones)] == [1, 3, 4]
    with pytest.raises(nv.NVMLError_InvalidArgument):  # not on the grid
        _create_gi(nv, h, 14, 1, 3)
    with pytest.raises(nv.NVMLError_InsufficientResources):
        _create_gi(nv, h, 14, 3, 3)  # the 2g holds 0..5
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 14) == 0
    names = {
        nv.nvmlDeviceGetName(nv.nvmlComputeInstanceGetInfo(c).device)
        for c in (nv.nvmlGpuInstanceCreateComputeInstance(g, 0) for g in ones)
    }
    assert names == {"NVIDIA RTX PRO 6000 Blackwell Server Edition MIG 1g.24gb"}


def test_all_media_engines_leave_room_for_no_media_engines_only(
    make_node: MakeNode, nvml_on: NvmlOn
) -> None:
    nv = nvml_on(make_node("RTX-PRO-6000", mig_enabled=True))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    all_me = _create_gi(nv, h, 65, 0, 3)  # 1g.24gb+me.all
    for profile_id, start in ((14, 3), (21, 3), (47, 3), (64, 6)):  # 1g, +me, +gfx, 2g+me.all
        with pytest.raises(nv.NVMLError_InsufficientResources):
            _create_gi(nv, h, profile_id, start, 6 if profile_id == 64 else 3)
    _create_gi(nv, h, 67, 3, 3)  # 1g.24gb-me
    _create_gi(nv, h, 66, 6, 6)  # 2g.48gb-me
    nv.nvmlGpuInstanceDestroy(all_me)
    _create_gi(nv, h, 14, 0, 3)
    with pytest.raises(nv.NVMLError_InsufficientResources):  # a 1g.24gb holds media engines
        nv.nvmlDeviceCreateGpuInstance(h, 65)


@pytest.mark.parametrize("key", MIG_MODELS)
def test_a_mig_mode_change_needs_a_reset_on_ampere_only(
    key: str, make_node: MakeNode, nvml_on: NvmlOn
) -> None:
    nv = nvml_on(make_node(key, passthrough=True, reset_supported=False))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    status = nv.nvmlDeviceSetMigMode(h, 1)
    if MODELS[key].mig_mode_needs_reset:
        assert MODELS[key].architecture.value == "ampere"
        assert (status, nv.nvmlDeviceGetMigMode(h)) == (RESET_REQUIRED, [0, 1])
    else:
        assert (status, nv.nvmlDeviceGetMigMode(h)) == (SUCCESS, [1, 1])
        values = nv.nvmlDeviceGetFieldValues(h, [184])  # NVML_FI_DEV_IS_RESETLESS_MIG_SUPPORTED
        assert values[0].value.ullVal == 1


@pytest.mark.parametrize(
    ("key", "gi", "cuda_name"),  # blackwell.md 1: the MIG device names CUDA shows
    [
        ("B200", 19, "NVIDIA B200 MIG 1g.23gb"),
        ("GB200", 14, "NVIDIA GB200 MIG 2g.47gb"),
        ("B300", 19, "NVIDIA B300 SXM6 AC MIG 1g.34gb"),
        ("H200", 9, "NVIDIA H200 MIG 3g.71gb"),  # nvml-mig.md 1.2
    ],
)
def test_mig_device_names(
    key: str, gi: int, cuda_name: str, make_node: MakeNode, nvml_on: NvmlOn
) -> None:
    nv = nvml_on(make_node(key, mig_enabled=True))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    p = MODELS[key].gi_profile_by_id(gi)
    assert p is not None
    whole = next(c for c in p.ci_profiles if c.slices == p.slices)  # CI 0 before REV1's 7
    ci = nv.nvmlGpuInstanceCreateComputeInstance(nv.nvmlDeviceCreateGpuInstance(h, gi), whole.id)
    assert nv.nvmlDeviceGetName(nv.nvmlComputeInstanceGetInfo(ci).device) == cuda_name


# -- the captured H200, as tools read it from NVML -----------------------------------------------


def test_h200_lgip_as_nvidia_smi_rebuilds_it(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    """-lgip's rows from NVML: name, id, free/total, GiB, P2P, SM, DEC, ENC, CE, JPEG, OFA."""
    text = (CAPTURES / "h200-0x2335-nvidia-smi.txt").read_text()
    lines = [ln.strip("|").split() for ln in text.splitlines() if ln.startswith("|  ")]
    firsts = [ln for ln in lines if ln[:2] == ["0", "MIG"]]
    seconds = [ln for ln in lines if len(ln) == 3 and all(c.isdigit() for c in ln)]
    want = [a[2:] + b for a, b in zip(firsts, seconds, strict=True)]
    nv = nvml_on(make_node("H200", passthrough=True))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    answered = [(x, _info(nv, h, x)) for x in range(0x13)]
    # nvidia-smi's order: by slices, then memory, then index (blackwell.md 3)
    answered = sorted(
        ((i.sliceCount, i.memorySizeMB, x, i) for x, i in answered if not isinstance(i, type)),
        key=lambda t: t[:3],
    )
    infos = [t[3] for t in answered]
    got = [
        [
            i.name.removeprefix("MIG "),
            str(i.id),
            f"{nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, i.id)}/{i.instanceCount}",
            f"{i.memorySizeMB / 1024:.2f}",
            "Yes" if i.isP2pSupported else "No",
            str(i.multiprocessorCount),
            str(i.decoderCount),
            str(i.encoderCount),
            str(i.copyEngineCount),
            str(i.jpegCount),
            str(i.ofaCount),
        ]
        for i in infos
    ]
    assert got == want


def test_h200_gfd_labels_and_device_plugin_from_nvml(
    make_node: MakeNode, nvml_on: NvmlOn, open_sim: Callable[[str], NvmlGpuBackend]
) -> None:
    labels = dict(
        ln.split("=", 1)
        for ln in (CAPTURES / "h200-gfd-labels-mixed-2026-12-01.txt").read_text().splitlines()
    )
    path = make_node("H200", passthrough=True)
    nv = nvml_on(path)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    major, minor = nv.nvmlDeviceGetCudaComputeCapability(h)
    assert (str(major), str(minor)) == (
        labels["nvidia.com/gpu.compute.major"],
        labels["nvidia.com/gpu.compute.minor"],
    )
    assert str(nv.nvmlDeviceGetMemoryInfo(h).total >> 20) == labels["nvidia.com/gpu.memory"]
    assert nv.nvmlSystemGetDriverVersion() == labels["nvidia.com/cuda.driver-version.full"]
    cuda = nv.nvmlSystemGetCudaDriverVersion()
    assert f"{cuda // 1000}.{cuda % 1000 // 10}" == labels["nvidia.com/cuda.runtime-version.full"]
    ours = gpu_node_labels("n", [MODELS["H200"]])
    for label in ("gpu.product", "gpu.count", "mig.capable"):
        assert ours[f"nvidia.com/{label}"] == labels[f"nvidia.com/{label}"], label
    plugin = json.loads((CAPTURES / "h200-device-plugin-mixed-2026-12-01.json").read_text())
    offered = sim_device_plugin.offered_devices(open_sim(path), "mixed")  # MIG off: the GPU
    counts: dict[str, int] = {}
    for d in offered:
        counts[d.resource] = counts.get(d.resource, 0) + 1
    assert counts == plugin["allocatable"]


# -- the agent reads every model ----------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(MODELS))
def test_the_agent_reads_every_simulated_model(
    key: str, make_node: MakeNode, open_sim: Callable[[str], NvmlGpuBackend]
) -> None:
    m: GpuModel = MODELS[key]
    read = open_sim(make_node(key)).models()[0]
    assert (read.name, read.pci_device_id, read.memory_total_mib) == (
        m.name,
        m.pci_device_id,
        m.memory_total_mib,
    )
    # the agent names profiles by go-nvlib's formula: the driver's names here
    assert sorted(p.name for p in read.gi_profiles) == sorted(p.name for p in m.gi_profiles)
    by_id = {p.id: p for p in m.gi_profiles}
    for p in read.gi_profiles:
        assert [(pl.start, pl.size) for pl in p.placements] == [
            (pl.start, pl.size) for pl in by_id[p.id].placements
        ]
    assert read.placement_units == m.placement_grid and read.compute_slices == m.compute_slices
    assert read.memory_slices == m.memory_slices
