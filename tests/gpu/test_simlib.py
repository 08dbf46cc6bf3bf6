"""The simulated NVML library, exercised through pynvml's real wrappers (and its own API, CLI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from ctypes import byref, c_uint
from pathlib import Path
from types import ModuleType
from typing import Any

import migsim
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from migsim.gpus import MODELS, Placement
from migsim.nvml import library as simlib
from migsim.nvml.state import DRIVER_NOT_LOADED, IN_USE, INSUFFICIENT_RESOURCES, NOT_SUPPORTED

import mig_agent

from .conftest import CAPTURES, REPO, MakeNode

NvmlOn = Callable[[str], ModuleType]


def probe(fn: Callable[..., Any], *args: Any) -> Any:
    """A call's result, or the error as the capture records it: {"err": code, "name": class}."""
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError as e:
        return {"err": e.value, "name": type(e).__name__}


def fields(struct: Any) -> dict[str, Any]:
    return {name: getattr(struct, name) for name, _ in struct._fields_}


def placements(nv: ModuleType, h: Any, profile_id: int) -> list[list[int]]:
    count = c_uint(0)
    nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, None, byref(count))
    arr = (nv.c_nvmlGpuInstancePlacement_t * count.value)()
    nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, byref(count))
    return [[arr[i].start, arr[i].size] for i in range(count.value)]


def create_gi(nv: ModuleType, h: Any, profile_id: int, start: int, size: int) -> Any:
    return nv.nvmlDeviceCreateGpuInstanceWithPlacement(
        h, profile_id, byref(nv.c_nvmlGpuInstancePlacement_t(start, size))
    )


def create_ci(nv: ModuleType, gi: Any, profile_id: int, start: int, size: int) -> Any:
    return nv.nvmlGpuInstanceCreateComputeInstanceWithPlacement(
        gi, profile_id, byref(nv.c_nvmlComputeInstancePlacement_t(start, size))
    )


def gi_ids(nv: ModuleType, h: Any, profile_id: int, capacity: int = 8) -> list[int]:
    arr = (nv.c_nvmlGpuInstance_t * capacity)()
    count = c_uint(capacity)
    nv.nvmlDeviceGetGpuInstances(h, profile_id, arr, byref(count))
    return [nv.nvmlGpuInstanceGetInfo(arr[i]).id for i in range(count.value)]


# -- (a) the real H200 readout ---------------------------------------------------------------------


def test_h200_reproduces_the_real_capture(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    probe2 = json.loads((CAPTURES / "h200-0x2335-probe2.json").read_text())
    probe1 = json.loads((CAPTURES / "h200-0x2335-probe1.json").read_text())
    want, want1 = probe2["devices"][0], probe1["devices"][0]
    nv = nvml_on(make_node("H200", passthrough=True))
    h = nv.nvmlDeviceGetHandleByIndex(0)

    assert nv.nvmlSystemGetDriverVersion() == probe2["driver"]
    assert nv.nvmlSystemGetNVMLVersion() == probe2["nvml"]
    assert nv.nvmlSystemGetCudaDriverVersion() == probe1["cuda"]
    assert nv.nvmlDeviceGetName(h) == want["name"]
    assert nv.nvmlDeviceGetArchitecture(h) == want["arch"]
    assert nv.nvmlDeviceGetMigMode(h) == want["migMode"]
    assert nv.nvmlDeviceGetMaxMigDeviceCount(h) == want["maxMigDevices"]
    assert nv.nvmlDeviceGetVirtualizationMode(h) == want["virtMode"]
    assert nv.nvmlDeviceGetMemoryInfo(h).total == want["memTotalBytes"]
    assert nv.nvmlDeviceGetMemoryInfo(h).total >> 20 == want1["memTotalMiB"]
    pci = nv.nvmlDeviceGetPciInfo(h)
    assert f"0x{pci.pciDeviceId:08x}" == want1["pciDeviceId"]
    assert f"0x{pci.pciSubSystemId:08x}" == want1["pciSubSystemId"]
    assert len(nv.nvmlDeviceGetComputeRunningProcesses(h)) == want1["computeProcs"]

    assert nv.nvmlDeviceIsMigDeviceHandle(h).value == want["isMigDeviceHandle(parent)"]
    assert probe(nv.nvmlDeviceGetGpuInstanceId, h) == want["getGpuInstanceId(parent)"]
    assert probe(nv.nvmlDeviceGetComputeInstanceId, h) == want["getComputeInstanceId(parent)"]
    assert probe(nv.nvmlDeviceGetMigDeviceHandleByIndex, h, 0) == want["migHandleByIndex(0)"]
    assert probe(nv.nvmlDeviceGetGpuInstanceById, h, 0) == want["getGpuInstanceById(0)"]
    assert probe(nv.nvmlDeviceGetAttributes, h) == want["attributes(parent)"]

    values = nv.nvmlDeviceGetFieldValues(h, [184, 199])
    for v in values:
        assert {
            "nvmlReturn": v.nvmlReturn,
            "valueType": v.valueType,
            "ui": v.value.uiVal,
            "ull": v.value.ullVal,
        } == want["fieldValues"][str(v.fieldId)]

    assert len(want["giProfiles"]) == 19
    for entry in want["giProfiles"]:
        index = entry["profileIndex"]
        got = probe(nv.nvmlDeviceGetGpuInstanceProfileInfo, h, index)
        if "err" in entry["info"]:
            assert got == entry["info"], index
            assert probe(nv.nvmlDeviceGetGpuInstanceProfileInfo, h, index, 1) == entry["v1"]
            continue
        assert fields(got) == entry["info"], index
        pid = got.id
        v1 = fields(nv.nvmlDeviceGetGpuInstanceProfileInfo(h, index, 1))
        assert v1 == {k: v for k, v in entry["info"].items() if k not in ("version", "name")}
        count = c_uint(0)
        nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid, None, byref(count))
        assert count.value == entry["placementCountNull"]
        assert placements(nv, h, pid) == entry["placements"]
        assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, pid) == entry["remaining"]
        assert len(gi_ids(nv, h, pid)) == entry["gpuInstances"]
        by_id = fields(nv.nvmlDeviceGetGpuInstanceProfileInfoById(h, pid))
        assert (by_id == fields(got)) is entry["byIdMatches"]

    for pid_text, expected in want["profileInfoByIdScan"].items():
        got = probe(nv.nvmlDeviceGetGpuInstanceProfileInfoById, h, int(pid_text))
        assert (got if isinstance(got, dict) else got.name) == expected, pid_text


def test_h200_nvidia_smi_lgipp_lines(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    """The -lgipp lines of the nvidia-smi capture, rebuilt from NVML as nvidia-smi does."""
    text = (CAPTURES / "h200-0x2335-nvidia-smi.txt").read_text()
    expected = [line for line in text.splitlines() if "Profile ID" in line]
    nv = nvml_on(make_node("H200"))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    got = []
    for p in MODELS["H200"].gi_profiles:  # nvidia-smi's order
        pls = placements(nv, h, p.id)
        starts = ",".join(str(s) for s, _ in pls)
        label = "Placements:" if len(pls) > 1 else "Placement :"
        got.append(f"GPU  0 Profile ID {p.id:>2} {label} {{{starts}}}:{pls[0][1]}")
    assert got == expected


# -- (b) profile index vs profile id ---------------------------------------------------------------


def test_profile_index_is_not_profile_id(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    nv = nvml_on(make_node("H200,A30", mig_enabled=True))
    h200, a30 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    # index 9 (1_SLICE_REV2) is profile id 15; id 9 is the 3g profile (index 2).
    assert nv.nvmlDeviceGetGpuInstanceProfileInfo(h200, 9).id == 15
    assert nv.nvmlDeviceGetGpuInstanceProfileInfoById(h200, 9).name == "MIG 3g.71gb"
    assert placements(nv, h200, 9) == [[0, 4], [4, 4]]
    # Using an index where an id belongs: index 1 (2g) is no profile id on the H200.
    with pytest.raises(nv.NVMLError_InvalidArgument):
        create_gi(nv, h200, 1, 0, 2)
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h200, 1)
    # Ids mean different things on different GPUs: 14 is 2g on the H200, 1g on the A30.
    assert nv.nvmlDeviceGetGpuInstanceProfileInfoById(h200, 14).sliceCount == 2
    assert nv.nvmlDeviceGetGpuInstanceProfileInfoById(a30, 14).sliceCount == 1
    assert nv.nvmlDeviceGetGpuInstanceProfileInfo(a30, 8).id == 6  # 2g.12gb+me
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetGpuInstanceProfileInfo(h200, 8)
    with pytest.raises(nv.NVMLError_NotFound):
        nv.nvmlDeviceGetGpuInstanceProfileInfoById(h200, 6)  # a driver id the H200 lacks
    # CI profile ids equal their indices; the REV1 CI (7) exists only in 1g REV2 GIs on Hopper.
    gi = create_gi(nv, h200, 15, 0, 2)
    ci_info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 7, 0)
    assert (ci_info.id, ci_info.multiprocessorCount, ci_info.name) == (7, 26, "MIG 1g.35gb")
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 1, 0)
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, 9, 0)


def test_non_mig_gpu(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    nv = nvml_on(make_node("DGX-Display"))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetMigMode(h)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceSetMigMode(h, 1)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetGpuInstanceProfileInfo(h, 0)
    assert nv.nvmlDeviceGetMaxMigDeviceCount(h) == 0


def test_a_driver_without_profile_info_while_mig_is_off(
    make_node: MakeNode, nvml_on: NvmlOn
) -> None:
    nv = nvml_on(make_node("H200", profile_info_needs_mig=True))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    for call in (
        lambda: nv.nvmlDeviceGetGpuInstanceProfileInfo(h, 0),
        lambda: nv.nvmlDeviceGetGpuInstanceProfileInfo(h, 0, 1),
        lambda: nv.nvmlDeviceGetGpuInstanceProfileInfoById(h, 19),
    ):
        with pytest.raises(nv.NVMLError_NotSupported):
            call()
    assert placements(nv, h, 19) == [[s, 1] for s in range(7)]  # placements still answer
    assert nv.nvmlDeviceSetMigMode(h, 1) == 0
    assert nv.nvmlDeviceGetGpuInstanceProfileInfo(h, 0).id == 19
    assert nv.nvmlDeviceGetGpuInstanceProfileInfoById(h, 19).sliceCount == 1


# -- (c) placements, capacity, ids -----------------------------------------------------------------


def test_create_refusals(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    nv = nvml_on(make_node("H200"))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(nv.NVMLError_NotSupported):  # MIG mode disabled
        create_gi(nv, h, 9, 0, 4)
    assert nv.nvmlDeviceSetMigMode(h, 1) == 0
    assert nv.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    create_gi(nv, h, 9, 4, 4)
    with pytest.raises(nv.NVMLError_InsufficientResources):  # overlap
        create_gi(nv, h, 14, 4, 2)
    with pytest.raises(nv.NVMLError_InvalidArgument):  # not a 2g placement
        create_gi(nv, h, 14, 1, 2)
    with pytest.raises(nv.NVMLError_InvalidArgument):  # wrong size
        create_gi(nv, h, 14, 0, 4)
    # 1g placements left: 0..3 (the 3g holds memory slices 4..7)
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19) == 4
    create_gi(nv, h, 20, 0, 1)  # 1g+me
    with pytest.raises(nv.NVMLError_InsufficientResources):  # a second +me
        create_gi(nv, h, 20, 1, 1)
    assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 20) == 0
    for start in (1, 2, 3):
        create_gi(nv, h, 19, start, 1)
    with pytest.raises(nv.NVMLError_InsufficientResources):  # nothing free
        nv.nvmlDeviceCreateGpuInstance(h, 19)
    with pytest.raises(nv.NVMLError_InsufficientResources):  # count: 3g x2 max, one slot used
        create_gi(nv, h, 9, 0, 4)


def test_a30_four_slices(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    nv = nvml_on(make_node("A30", mig_enabled=True))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetMaxMigDeviceCount(h) == 4
    assert placements(nv, h, 5) == [[0, 2], [2, 2]]
    g = create_gi(nv, h, 21, 3, 1)  # 1g.6gb+me
    with pytest.raises(nv.NVMLError_InsufficientResources):  # instanceCount 1
        create_gi(nv, h, 21, 2, 1)
    assert nv.nvmlGpuInstanceGetInfo(g).id == 3  # 4 memory slices: 1g ids are 3-6
    assert nv.nvmlGpuInstanceGetInfo(create_gi(nv, h, 5, 0, 2)).id == 1
    with pytest.raises(nv.NVMLError_InsufficientResources):
        create_gi(nv, h, 0, 0, 4)


def test_gi_and_ci_ids_follow_the_driver(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    nv = nvml_on(make_node("H200", mig_enabled=True))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    seven = create_gi(nv, h, 0, 0, 8)
    assert nv.nvmlGpuInstanceGetInfo(seven).id == 0
    cis = [create_ci(nv, seven, 0, s, 1) for s in (3, 0, 6)]
    assert [nv.nvmlComputeInstanceGetInfo(c).id for c in cis] == [0, 1, 2]
    nv.nvmlComputeInstanceDestroy(cis[1])
    assert nv.nvmlComputeInstanceGetInfo(create_ci(nv, seven, 0, 1, 1)).id == 1  # reused
    for ci in range(3):
        nv.nvmlComputeInstanceDestroy(nv.nvmlGpuInstanceGetComputeInstanceById(seven, ci))
    nv.nvmlGpuInstanceDestroy(seven)

    three = create_gi(nv, h, 9, 4, 4)
    two = create_gi(nv, h, 14, 2, 2)
    ones = [create_gi(nv, h, 19, s, 1) for s in (1, 0)]
    assert [nv.nvmlGpuInstanceGetInfo(g).id for g in (three, two, *ones)] == [1, 3, 7, 8]
    nv.nvmlGpuInstanceDestroy(ones[0])
    with pytest.raises(nv.NVMLError_InsufficientResources):
        create_gi(nv, h, 19, 2, 1)  # the 2g holds slices 2-3
    assert nv.nvmlGpuInstanceGetInfo(create_gi(nv, h, 19, 1, 1)).id == 7  # lowest free id
    assert gi_ids(nv, h, 19) == [7, 8]


def test_mig_devices_and_uuids(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    nv = nvml_on(make_node("H200", mig_enabled=True))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    g4 = create_gi(nv, h, 9, 4, 4)  # GI 1
    g0 = create_gi(nv, h, 9, 0, 4)  # GI 2
    c_b = create_ci(nv, g0, 0, 0, 1)
    c_a = create_ci(nv, g4, 0, 1, 1)
    c_c = create_ci(nv, g4, 0, 0, 1)
    assert nv.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    listed = []
    for i in range(7):
        r = probe(nv.nvmlDeviceGetMigDeviceHandleByIndex, h, i)
        if isinstance(r, dict):
            assert r["name"] == "NVMLError_NotFound"
            continue
        assert nv.nvmlDeviceIsMigDeviceHandle(r)
        assert nv.nvmlDeviceGetIndex(r) == i
        parent = nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(r)
        assert nv.nvmlDeviceGetUUID(parent) == nv.nvmlDeviceGetUUID(h)
        listed.append(
            (
                nv.nvmlDeviceGetGpuInstanceId(r),
                nv.nvmlDeviceGetComputeInstanceId(r),
                nv.nvmlDeviceGetUUID(r),
                nv.nvmlDeviceGetName(r),
            )
        )
    assert [(g, c) for g, c, _, _ in listed] == [(1, 0), (1, 1), (2, 0)]  # dense, by (GI, CI)
    assert {n for *_, n in listed} == {"NVIDIA H200 MIG 1c.3g.71gb"}
    uuids = {nv.nvmlDeviceGetUUID(nv.nvmlComputeInstanceGetInfo(c).device) for c in (c_a, c_b, c_c)}
    assert uuids == {u for _, _, u, _ in listed}
    assert all(u.startswith("MIG-") for u in uuids)
    by_uuid = nv.nvmlDeviceGetHandleByUUID(listed[0][2])
    assert nv.nvmlDeviceGetComputeInstanceId(by_uuid) == 0
    a = nv.nvmlDeviceGetAttributes(by_uuid)
    assert (
        a.multiprocessorCount,
        a.gpuInstanceSliceCount,
        a.computeInstanceSliceCount,
        a.memorySizeMB,
        a.sharedDecoderCount,
    ) == (16, 3, 1, 71424, 3)
    # UUIDs are stable while the CI lives.
    nv.nvmlComputeInstanceDestroy(c_b)
    after = {nv.nvmlDeviceGetUUID(nv.nvmlComputeInstanceGetInfo(c).device) for c in (c_a, c_c)}
    assert after <= uuids


def test_stale_handles_are_invalid(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    nv = nvml_on(make_node("H200", mig_enabled=True))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    gi = create_gi(nv, h, 14, 0, 2)
    ci = create_ci(nv, gi, 1, 0, 2)
    mig = nv.nvmlComputeInstanceGetInfo(ci).device
    nv.nvmlComputeInstanceDestroy(ci)
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlComputeInstanceGetInfo(ci)
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetUUID(mig)
    nv.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlGpuInstanceGetInfo(gi)
    again = create_gi(nv, h, 14, 0, 2)  # same id and place, a new instance
    assert nv.nvmlGpuInstanceGetInfo(again).id == 3
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(nv.NVMLError_NotFound):
        nv.nvmlDeviceGetGpuInstanceById(h, 4)


def test_caller_bugs_fail_loudly(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    nv = nvml_on(make_node("H200", mig_enabled=True))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    small = (nv.c_nvmlGpuInstancePlacement_t * 3)()
    with pytest.raises(simlib.SimulatedNvmlMisuse, match="holds 3 entries but NVML writes 7"):
        nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, 19, small, byref(c_uint(3)))
    with pytest.raises(simlib.SimulatedNvmlMisuse, match="by pointer"):
        nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, nv.c_nvmlGpuInstancePlacement_t(0, 1))
    for s in range(3):
        create_gi(nv, h, 19, s, 1)
    arr = (nv.c_nvmlGpuInstance_t * 2)()
    with pytest.raises(simlib.SimulatedNvmlMisuse):
        nv.nvmlDeviceGetGpuInstances(h, 19, arr, byref(c_uint(2)))
    info = nv.c_nvmlGpuInstanceProfileInfo_v2_t()
    info.version = 1
    fn = nv._nvmlGetFunctionPointer("nvmlDeviceGetGpuInstanceProfileInfoV")
    assert fn(h, 0, byref(info)) == 25  # ARGUMENT_VERSION_MISMATCH
    assert simlib.call_counts(nv.nvmlLib.state_file).by_function == {
        "nvmlDeviceCreateGpuInstanceWithPlacement": 3
    }  # the by-value call never got through


# -- (d) IN_USE ------------------------------------------------------------------------------------


def test_in_use_while_compute_instances_or_processes_remain(
    make_node: MakeNode, nvml_on: NvmlOn
) -> None:
    path = make_node("H200", mig_enabled=True)
    nv = nvml_on(path)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    gi = create_gi(nv, h, 9, 0, 4)
    ci = create_ci(nv, gi, 2, 0, 3)
    with pytest.raises(nv.NVMLError_InUse):
        nv.nvmlGpuInstanceDestroy(gi)
    gi_id = nv.nvmlGpuInstanceGetInfo(gi).id
    simlib.add_process(path, 0, 4242, gi=gi_id, ci=0, used_memory_mib=2048)
    (proc,) = nv.nvmlDeviceGetComputeRunningProcesses(h)
    assert (proc.pid, proc.gpuInstanceId, proc.computeInstanceId, proc.usedGpuMemory) == (
        4242,
        gi_id,
        0,
        2048 << 20,
    )
    mig = nv.nvmlComputeInstanceGetInfo(ci).device
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(mig)] == [4242]
    assert nv.nvmlDeviceGetMemoryInfo(mig).used == 2048 << 20
    with pytest.raises(nv.NVMLError_InUse):
        nv.nvmlComputeInstanceDestroy(ci)
    with pytest.raises(nv.NVMLError_InUse):  # GPU instances must go before MIG mode can
        nv.nvmlDeviceSetMigMode(h, 0)
    assert nv.nvmlDeviceGetMigMode(h) == [1, 1]
    assert simlib.remove_process(path, 4242) == 1
    nv.nvmlComputeInstanceDestroy(ci)
    nv.nvmlGpuInstanceDestroy(gi)


# -- (e) MIG mode and reset ------------------------------------------------------------------------


def test_ampere_mode_is_pending_until_reset_and_persists(
    make_node: MakeNode, nvml_on: NvmlOn
) -> None:
    path = make_node("A100-40GB,A30")
    nv = nvml_on(path)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceSetMigMode(h, 1) == 16  # RESET_REQUIRED: pending
    assert nv.nvmlDeviceGetMigMode(h) == [0, 1]
    assert nv.nvmlDeviceGetMaxMigDeviceCount(h) == 0
    with pytest.raises(nv.NVMLError_NotSupported):
        create_gi(nv, h, 9, 0, 4)
    simlib.reset_gpu(path, 0)
    assert nv.nvmlDeviceGetMigMode(h) == [1, 1]
    create_gi(nv, h, 9, 0, 4)
    simlib.reboot_node(path)  # Ampere keeps MIG mode (InfoROM), loses its instances
    assert nv.nvmlDeviceGetMigMode(h) == [1, 1]
    assert gi_ids(nv, h, 9) == []
    # Cancelling a pending change needs no reset.
    h30 = nv.nvmlDeviceGetHandleByIndex(1)
    nv.nvmlDeviceSetMigMode(h30, 1)
    assert nv.nvmlDeviceSetMigMode(h30, 0) == 0
    assert nv.nvmlDeviceGetMigMode(h30) == [0, 0]


def test_ampere_with_processes_or_without_reset(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    path = make_node("2xA100-80GB")
    nv = nvml_on(path)
    h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    simlib.add_process(path, 0, 77)
    assert nv.nvmlDeviceSetMigMode(h0, 1) == IN_USE
    assert nv.nvmlDeviceGetMigMode(h0) == [0, 1]
    with pytest.raises(simlib.SimError) as busy:
        simlib.reset_gpu(path, 0)
    assert busy.value.code == IN_USE
    simlib.remove_process(path, 77)
    simlib.reset_gpu(path, 0)
    assert nv.nvmlDeviceGetMigMode(h0) == [1, 1]

    simlib.set_reset_supported(path, False, gpu=1)  # pass-through VM
    assert nv.nvmlDeviceSetMigMode(h1, 1) == 16
    with pytest.raises(simlib.SimError) as impossible:
        simlib.reset_gpu(path, 1)
    assert impossible.value.code == NOT_SUPPORTED
    assert nv.nvmlDeviceGetMigMode(h1) == [0, 1]


def test_ampere_driver_self_reset_option(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    nv = nvml_on(make_node("A30", ampere_self_reset=True))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceSetMigMode(h, 1) == 0
    assert nv.nvmlDeviceGetMigMode(h) == [1, 1]


def test_hopper_mode_is_immediate_and_refused_when_busy(
    make_node: MakeNode, nvml_on: NvmlOn
) -> None:
    path = make_node("2xH100-80GB", passthrough=True, reset_supported=False)
    nv = nvml_on(path)
    h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceSetMigMode(h0, 1) == 0  # no reset needed, even in a pass-through VM
    assert nv.nvmlDeviceGetMigMode(h0) == [1, 1]
    simlib.add_process(path, 1, 99)
    assert nv.nvmlDeviceSetMigMode(h1, 1) == IN_USE
    assert nv.nvmlDeviceGetMigMode(h1) == [0, 0]
    gi = create_gi(nv, h0, 0, 0, 8)
    with pytest.raises(nv.NVMLError_InUse):  # GIs must go before MIG mode can
        nv.nvmlDeviceSetMigMode(h0, 0)
    nv.nvmlGpuInstanceDestroy(gi)
    create_gi(nv, h0, 0, 0, 8)
    simlib.reboot_node(path)  # Hopper MIG mode does not survive a reboot
    assert nv.nvmlDeviceGetMigMode(h0) == [0, 0]
    assert nv.nvmlDeviceGetComputeRunningProcesses(h1) == []


# -- (f) one node, many processes ------------------------------------------------------------------

_WORKER = """
import sys, ctypes, pynvml as nv
from migsim.nvml.library import SimulatedNvmlLibrary
path, starts, rounds = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3])
nv.nvmlLib = SimulatedNvmlLibrary(path)
nv.nvmlInit()
h = nv.nvmlDeviceGetHandleByIndex(0)
def create(start):
    return nv.nvmlDeviceCreateGpuInstanceWithPlacement(
        h, 19, ctypes.byref(nv.c_nvmlGpuInstancePlacement_t(start, 1)))
for _ in range(rounds):
    for gi in [create(s) for s in starts]:
        nv.nvmlGpuInstanceDestroy(gi)
for s in starts:
    create(s)
print(nv.nvmlDeviceGetUUID(h))
nv.nvmlShutdown()
"""


def _env() -> dict[str, str]:
    # The child imports the trees this process imports (an installed migsim may be another's).
    trees = {str(Path(p.__file__).resolve().parents[1]) for p in (mig_agent, migsim)}
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *sorted(trees)])}


def test_processes_share_one_node_without_lost_updates(
    make_node: MakeNode, nvml_on: NvmlOn
) -> None:
    path = make_node("H200", mig_enabled=True)
    rounds = 8
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, path, starts, str(rounds)],
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for starts in ("0,1,2", "3,4,5,6")
    ]
    outputs = [w.communicate(timeout=60)[0].strip() for w in workers]
    assert [w.returncode for w in workers] == [0, 0]
    nv = nvml_on(path)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert outputs == [nv.nvmlDeviceGetUUID(h)] * 2  # both saw this node
    assert sorted(gi_ids(nv, h, 19)) == list(range(7, 14))
    expected = 7 * (2 * rounds + 1)
    assert simlib.call_counts(path).total == expected  # every counter update survived


def test_other_process_sees_changes(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    path = make_node("H200", mig_enabled=True)
    nv = nvml_on(path)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    create_gi(nv, h, 9, 4, 4)
    script = (
        "import sys, pynvml as nv\n"
        "from migsim.nvml.library import SimulatedNvmlLibrary\n"
        "nv.nvmlLib = SimulatedNvmlLibrary(sys.argv[1]); nv.nvmlInit()\n"
        "h = nv.nvmlDeviceGetHandleByIndex(0)\n"
        "print(nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 9))\n"
        "nv.nvmlGpuInstanceDestroy(nv.nvmlDeviceGetGpuInstanceById(h, 1))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, path], capture_output=True, text=True, env=_env(), check=True
    ).stdout
    assert out.strip() == "1"
    assert gi_ids(nv, h, 9) == []


# -- (g) faults, latency, processes, counters ------------------------------------------------------


def test_fail_the_nth_mutating_call(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    path = make_node("H200", mig_enabled=True)
    nv = nvml_on(path)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    simlib.inject_failure(path, INSUFFICIENT_RESOURCES, nth=2)
    create_gi(nv, h, 19, 0, 1)
    nv.nvmlDeviceGetMigMode(h)  # reads do not count
    with pytest.raises(nv.NVMLError_InsufficientResources):
        create_gi(nv, h, 19, 1, 1)
    create_gi(nv, h, 19, 1, 1)  # the rule is used up
    simlib.inject_failure(path, 999, function="nvmlDeviceGetMigMode", times=2)
    for _ in range(2):
        with pytest.raises(nv.NVMLError_Unknown):
            nv.nvmlDeviceGetMigMode(h)
    assert nv.nvmlDeviceGetMigMode(h) == [1, 1]
    simlib.inject_failure(path, IN_USE, gpu=1)  # another GPU: no effect here
    create_gi(nv, h, 19, 2, 1)
    simlib.clear_faults(path)
    assert simlib.load_node(path).fail_rules == []


def test_a_fault_rule_on_an_init_refuses_the_inits_it_names(
    make_node: MakeNode, nvml_on: NvmlOn
) -> None:
    """A driver not ready yet, for one kind of client: go-nvml's init (nvmlInit_v2) fails twice,
    pynvml's (nvmlInitWithFlags) is not touched."""
    path = make_node("H200")
    nv = nvml_on(path)  # pynvml's init, before the rule
    simlib.inject_failure(path, DRIVER_NOT_LOADED, function="nvmlInit_v2", times=2)
    go = simlib.SimulatedNvmlLibrary(path)
    assert [go.nvmlInit_v2() for _ in range(3)] == [DRIVER_NOT_LOADED, DRIVER_NOT_LOADED, 0]
    assert simlib.load_node(path).fail_rules == []  # used up
    simlib.inject_failure(path, DRIVER_NOT_LOADED, function="nvmlInit_v2")
    nv.nvmlInit()  # another entry point: not refused
    nv.nvmlShutdown()
    assert go.nvmlInit_v2() == DRIVER_NOT_LOADED
    go.nvmlShutdown()


def test_latency(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    path = make_node("H200", mig_enabled=True)
    nv = nvml_on(path)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    simlib.set_latency(path, 0.15)
    t0 = time.monotonic()
    nv.nvmlDeviceGetMigMode(h)
    t1 = time.monotonic()
    create_gi(nv, h, 19, 0, 1)
    t2 = time.monotonic()
    assert t1 - t0 < 0.1 <= 0.15 <= t2 - t1
    simlib.set_latency(path, 0.15, scope="all")
    t0 = time.monotonic()
    nv.nvmlDeviceGetMigMode(h)
    assert time.monotonic() - t0 >= 0.15
    simlib.clear_faults(path)


def test_call_counters(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    path = make_node("8xH100-80GB", mig_enabled=True)
    nv = nvml_on(path)
    for gpu in (2, 5):
        h = nv.nvmlDeviceGetHandleByIndex(gpu)
        gi = create_gi(nv, h, 9, 0, 4)
        create_ci(nv, gi, 2, 0, 3)
    with pytest.raises(nv.NVMLError_InsufficientResources):  # failed calls count too
        create_gi(nv, nv.nvmlDeviceGetHandleByIndex(5), 5, 0, 4)
    counts = simlib.call_counts(path)
    assert counts.gpus == {2, 5}
    assert counts.by_gpu == {2: 2, 5: 3}
    assert counts.by_function == {
        "nvmlDeviceCreateGpuInstanceWithPlacement": 3,
        "nvmlGpuInstanceCreateComputeInstanceWithPlacement": 2,
    }
    simlib.reset_call_counts(path)
    for gpu in range(8):  # reading everything is not mutating
        h = nv.nvmlDeviceGetHandleByIndex(gpu)
        nv.nvmlDeviceGetMigMode(h)
        gi_ids(nv, h, 9)
    assert simlib.call_counts(path).total == 0


def test_cli(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "cli-node.json")
    monkeypatch.setenv("MIG_AGENT_SIM_STATE", path)

    def cli(*args: str) -> str:
        capsys.readouterr()
        assert simlib.main(list(args)) == 0, capsys.readouterr().err
        return capsys.readouterr().out

    assert "GPU 1 NVIDIA A30" in cli("create", "--gpus", "A100-40GB,A30", "--mig-enabled")
    cli("process", "add", "1", "321")
    cli("fault", "fail", "IN_USE", "--nth", "2", "--gpu", "0")
    cli("fault", "latency", "0.01")
    shown = cli("show")
    assert "process 321" in shown and "fail 1x with In use by another client" in shown
    assert json.loads(cli("show", "--json"))["gpus"][1]["processes"][0]["pid"] == 321
    assert json.loads(cli("counts", "--json")) == {}
    cli("fault", "clear")
    cli("process", "remove", "321")
    assert simlib.load_node(path).gpus[1].processes == []
    assert simlib.main(["reset", "9"]) == 1
    assert "no GPU 9" in capsys.readouterr().err
    # and as a program, state from the environment
    out = subprocess.run(
        [sys.executable, "-m", "migsim.nvml", "show"],
        capture_output=True,
        text=True,
        check=True,
        env={**_env(), "MIG_AGENT_SIM_STATE": path},
    ).stdout
    assert out.startswith("node cli-node: 2 GPU(s), bare metal")


def test_uuids_are_deterministic(tmp_path: Any) -> None:
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    simlib.create_node(a, "2xH200", seed="node-7")
    simlib.create_node(b, "2xH200", seed="node-7")
    ua = [g.uuid for g in simlib.load_node(a).gpus]
    assert ua == [g.uuid for g in simlib.load_node(b).gpus] and ua[0] != ua[1]
    assert simlib.load_node(a).gpus[1].bus_id == "00000000:19:00.0"


# -- random sequences ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), key=st.sampled_from(["H200", "A30", "A100-40GB", "B200", "RTX-PRO-6000"]))
def test_random_create_destroy_sequences(data: st.DataObject, key: str) -> None:
    """Whatever is created and destroyed, in any order: GIs never overlap, counts never exceed
    instanceCount, ids stay in the driver's ranges, every refusal is the one hardware gives, and
    capacity, CIs and MIG devices stay consistent."""
    import pynvml as nv

    m = MODELS[key]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "node.json")
        simlib.create_node(path, key, mig_enabled=True)
        nv.nvmlLib = simlib.SimulatedNvmlLibrary(path)
        nv._nvmlGetFunctionPointer_cache.clear()
        nv.nvmlInit()
        try:
            _random_ops(nv, m, data)
        finally:
            nv.nvmlShutdown()
            nv.nvmlLib = None
            nv._nvmlGetFunctionPointer_cache.clear()


def _random_ops(nv: ModuleType, m: Any, data: st.DataObject) -> None:
    h = nv.nvmlDeviceGetHandleByIndex(0)
    gis: dict[int, tuple[Any, Any, Placement]] = {}  # id -> (handle, profile, placement)
    cis: dict[tuple[int, int], tuple[Any, Any]] = {}  # (gi, ci) -> (handle, ci profile)
    for _ in range(data.draw(st.integers(5, 30), label="steps")):
        op = data.draw(
            st.sampled_from(["gi+", "gi+", "gi-", "ci+", "ci+", "ci+", "ci-"]), label="op"
        )
        if op == "gi+":
            p = data.draw(st.sampled_from(m.gi_profiles), label="profile")
            start = data.draw(
                st.sampled_from([*(pl.start for pl in p.placements), 1, 3, 5]), label="start"
            )
            pl = Placement(start, p.placement_size)
            same = sum(q.id == p.id for _, q, _ in gis.values())
            caps = [q.capability for _, q, _ in gis.values()]
            # +me.all holds every media engine: beside it only -me GIs (nvml.h ALL_ME)
            engines_taken = (p.capability == "+me.all" and any(c != "-me" for c in caps)) or (
                p.capability != "-me" and "+me.all" in caps
            )
            if pl not in p.placements:
                expected: Any = nv.NVMLError_InvalidArgument
            elif (
                same >= p.instance_count
                or engines_taken
                or any(pl.overlaps(o) for *_, o in gis.values())
            ):
                expected = nv.NVMLError_InsufficientResources
            else:
                expected = None
            result = probe(create_gi, nv, h, p.id, pl.start, pl.size)
            if expected is None:
                info = nv.nvmlGpuInstanceGetInfo(result)
                first = m.placement_grid // pl.size - 1
                assert first <= info.id <= 2 * first and info.id not in gis
                assert (info.profileId, info.placement.start, info.placement.size) == (
                    p.id,
                    pl.start,
                    pl.size,
                )
                gis[info.id] = (result, p, pl)
            else:
                assert result == {"err": expected(0).value, "name": expected.__name__}
        elif op == "gi-" and gis:
            gi_id = data.draw(st.sampled_from(sorted(gis)), label="gi")
            busy = any(g == gi_id for g, _ in cis)
            result = probe(nv.nvmlGpuInstanceDestroy, gis[gi_id][0])
            if busy:
                assert result["name"] == "NVMLError_InUse"
            else:
                assert result == 0
                del gis[gi_id]
        elif op == "ci+" and gis:
            gi_id = data.draw(st.sampled_from(sorted(gis)), label="gi")
            handle, p, _ = gis[gi_id]
            cp = data.draw(st.sampled_from(p.ci_profiles), label="ci profile")
            cpl = data.draw(st.sampled_from(cp.placements), label="ci placement")
            mine = [(ci_id, c) for (g, ci_id), (_, c) in cis.items() if g == gi_id]
            taken = [
                nv.nvmlComputeInstanceGetInfo(cis[gi_id, ci_id][0]).placement for ci_id, _ in mine
            ]
            clash = any(cpl.overlaps(Placement(t.start, t.size)) for t in taken)
            full = sum(c.id == cp.id for _, c in mine) >= cp.instance_count
            result = probe(create_ci, nv, handle, cp.id, cpl.start, cpl.size)
            if clash or full:
                assert result["name"] == "NVMLError_InsufficientResources"
            else:
                ci_id = nv.nvmlComputeInstanceGetInfo(result).id
                assert ci_id == min(set(range(8)) - {c for c, _ in mine})
                cis[gi_id, ci_id] = (result, cp)
        elif op == "ci-" and cis:
            key = data.draw(st.sampled_from(sorted(cis)), label="ci")
            nv.nvmlComputeInstanceDestroy(cis.pop(key)[0])
        _check(nv, h, m, gis, cis)


def _check(nv: ModuleType, h: Any, m: Any, gis: dict[int, Any], cis: dict[Any, Any]) -> None:
    listed = {}
    for p in m.gi_profiles:
        arr = (nv.c_nvmlGpuInstance_t * p.instance_count)()
        count = c_uint(len(arr))
        nv.nvmlDeviceGetGpuInstances(h, p.id, arr, byref(count))
        assert count.value <= p.instance_count
        for i in range(count.value):
            info = nv.nvmlGpuInstanceGetInfo(arr[i])
            listed[info.id] = Placement(info.placement.start, info.placement.size)
        taken = [pl for _, _, pl in gis.values()]
        free = [pl for pl in p.placements if not any(pl.overlaps(t) for t in taken)]
        left = p.instance_count - sum(q.id == p.id for _, q, _ in gis.values())
        assert nv.nvmlDeviceGetGpuInstanceRemainingCapacity(h, p.id) == max(0, min(left, len(free)))
    assert listed == {i: pl for i, (_, _, pl) in gis.items()}
    places = sorted(listed.values())
    assert all(not a.overlaps(b) for a, b in zip(places, places[1:], strict=False))
    devices = []
    for i in range(nv.nvmlDeviceGetMaxMigDeviceCount(h)):
        r = probe(nv.nvmlDeviceGetMigDeviceHandleByIndex, h, i)
        if not isinstance(r, dict):
            devices.append((nv.nvmlDeviceGetGpuInstanceId(r), nv.nvmlDeviceGetComputeInstanceId(r)))
    assert devices == sorted(cis)
