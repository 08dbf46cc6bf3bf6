"""The C face of the simulated NVML (libnvidia-ml.so.1 over the simulator server) answers as the
Python face does: the behaviour tests written for the Python face (tests/gpu) run here unchanged,
with pynvml over the C library (this folder's fixtures), and then what only the C face has.

We test these aspects: every behaviour test of the Python face that does not reach into the
Python objects themselves; mig-agent's NVML backend over the C library, on every model; error codes
for bad, stale and foreign handles; functions of nvml.h that are not simulated; Init/Shutdown
reference counting; handles stable per object; nvmlErrorString; the table against the library."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from types import ModuleType

import pynvml
import pytest
from migsim.nvml import abi
from migsim.nvml import state as st
from migsim.nvml.library import SimulatedNvmlLibrary

# The Python face's behaviour tests, collected again here over the C face.
from tests.gpu.test_dra_discovery import (  # noqa: F401
    test_a_mig_device_reports_its_parents_brand,
    test_addressing_mode_checks_its_struct_version,
    test_brand_comes_from_the_model_data,
    test_h200_brand_and_addressing_mode_as_captured,
)
from tests.gpu.test_executor import (  # noqa: F401
    test_ampere_mode_change_resets_only_the_gpus_that_need_it,
    test_busy_instance_that_must_go_is_refused_and_nothing_changes,
    test_hopper_mode_change_needs_no_reset,
    test_operator_layout_applies_asserts_and_exports,
    test_pending_change_blocks_nothing_else,
)
from tests.gpu.test_nvml_backend import (  # noqa: F401
    test_destroy_and_errors,
    test_memory_total_from_hardware_equals_the_catalog,
    test_mig_mode_and_reset,
    test_models_from_hardware_equal_the_catalog,
    test_observe_round_trip,
)
from tests.gpu.test_simlib import (  # noqa: F401
    test_a30_four_slices,
    test_ampere_mode_is_pending_until_reset_and_persists,
    test_ampere_with_processes_or_without_reset,
    test_create_refusals,
    test_fail_the_nth_mutating_call,
    test_gi_and_ci_ids_follow_the_driver,
    test_h200_nvidia_smi_lgipp_lines,
    test_h200_reproduces_the_real_capture,
    test_hopper_mode_is_immediate_and_refused_when_busy,
    test_in_use_while_compute_instances_or_processes_remain,
    test_mig_devices_and_uuids,
    test_non_mig_gpu,
    test_profile_index_is_not_profile_id,
    test_stale_handles_are_invalid,
)

from .conftest import MakeNode

NvmlOn = Callable[[str], ModuleType]


def test_every_forwarded_function_is_one_the_library_implements() -> None:
    exported = SimulatedNvmlLibrary.exported()
    assert {f.server_name for f in abi.FUNCTIONS} <= exported
    # Everything the Python face implements is reachable from C (by name or as the local ones).
    assert exported - {f.name for f in abi.FUNCTIONS} - set(abi.LOCAL_FUNCTIONS) == set()


def test_bad_foreign_and_null_handles(
    make_node: MakeNode, nvml_on: NvmlOn, c_lib: ctypes.CDLL
) -> None:
    nv = nvml_on(make_node("H200"))
    mode = ctypes.c_uint(7)
    foreign = ctypes.create_string_buffer(16)  # a pointer the library never handed out
    assert (
        c_lib.nvmlDeviceGetMigMode(
            ctypes.c_void_p(ctypes.addressof(foreign)), ctypes.byref(mode), ctypes.byref(mode)
        )
        == st.INVALID_ARGUMENT
    )
    assert (
        c_lib.nvmlDeviceGetMigMode(None, ctypes.byref(mode), ctypes.byref(mode))
        == st.INVALID_ARGUMENT
    )
    assert mode.value == 7  # nothing written on failure
    h = nv.nvmlDeviceGetHandleByIndex(0)
    # A GPU handle where a GPU instance handle is expected.
    assert c_lib.nvmlGpuInstanceDestroy(h) == st.INVALID_ARGUMENT
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlDeviceGetHandleByUUID(b"GPU-00000000-0000-0000-0000-000000000000")


@pytest.mark.parametrize("key", ["H200", "A30", "A100-40GB", "H100-80GB"])
def test_profile_queries_answer_as_the_python_face(
    key: str, make_node: MakeNode, nvml_on: NvmlOn
) -> None:
    """Every GI profile index, present, absent (NOT_SUPPORTED) or past the driver's table
    (INVALID_ARGUMENT): the same code and the same struct from both faces."""
    path = make_node(key, mig_enabled=True)
    python_face = SimulatedNvmlLibrary(path)
    assert python_face.nvmlInit_v2() == st.SUCCESS
    py_handle = ctypes.c_void_p()
    assert python_face.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(py_handle)) == st.SUCCESS
    nv = nvml_on(path)
    h = nv.nvmlDeviceGetHandleByIndex(0)
    codes = []
    for index in range(20):
        py_info = abi.GpuInstanceProfileInfo()
        py_code = python_face.nvmlDeviceGetGpuInstanceProfileInfo(
            py_handle, index, ctypes.byref(py_info)
        )
        c_info = nv.c_nvmlGpuInstanceProfileInfo_t()
        c_code = nv.nvmlLib.nvmlDeviceGetGpuInstanceProfileInfo(h, index, ctypes.byref(c_info))
        assert c_code == py_code, index
        assert bytes(c_info) == bytes(py_info), index
        codes.append(c_code)
    assert {st.SUCCESS, st.NOT_SUPPORTED, st.INVALID_ARGUMENT} <= set(codes)
    assert python_face.nvmlShutdown() == st.SUCCESS


def test_unimplemented_functions_are_not_supported(
    make_node: MakeNode, nvml_on: NvmlOn, c_lib: ctypes.CDLL
) -> None:
    nv = nvml_on(make_node("H200"))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    fan = ctypes.c_uint(0)  # the H200 has none (smi-q Fan Speed: N/A)
    assert c_lib.nvmlDeviceGetFanSpeed(h, ctypes.byref(fan)) == st.NOT_SUPPORTED
    active = ctypes.c_uint(7)
    # NvLink: a PCIe GPU has none (the device plugin's preferred allocation skips the links)
    assert c_lib.nvmlDeviceGetNvLinkState(h, 0, ctypes.byref(active)) == st.NOT_SUPPORTED
    assert active.value == 7
    assert fan.value == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetTotalEnergyConsumption(h)


def test_error_strings_and_calls_before_init(c_lib: ctypes.CDLL) -> None:
    c_lib.nvmlErrorString.restype = ctypes.c_char_p
    assert c_lib.nvmlErrorString(st.IN_USE) == b"In use by another client"
    assert c_lib.nvmlErrorString(12345) == b"Unknown Error"
    count = ctypes.c_uint(0)
    assert c_lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == st.UNINITIALIZED
    assert c_lib.nvmlShutdown() == st.UNINITIALIZED


def test_init_without_a_simulator_is_driver_not_loaded(
    c_lib: ctypes.CDLL, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(abi.ENV_SOCKET, f"{tmp_path}/absent.sock")
    assert c_lib.nvmlInit_v2() == st.DRIVER_NOT_LOADED
    monkeypatch.delenv(abi.ENV_SOCKET)
    assert c_lib.nvmlInit_v2() == st.DRIVER_NOT_LOADED


def test_init_and_shutdown_are_reference_counted(
    make_node: MakeNode, nvml_on: NvmlOn, c_lib: ctypes.CDLL
) -> None:
    nv = nvml_on(make_node("2xH200"))
    assert c_lib.nvmlInit_v2() == st.SUCCESS  # nested, as mig-parted's go-nvml instances do
    assert c_lib.nvmlShutdown() == st.SUCCESS
    assert nv.nvmlDeviceGetCount() == 2  # still initialised
    assert c_lib.nvmlShutdown() == st.SUCCESS
    count = ctypes.c_uint(0)
    assert c_lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == st.UNINITIALIZED
    assert c_lib.nvmlInit_v2() == st.SUCCESS  # and again, on a new connection
    assert c_lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == st.SUCCESS
    assert count.value == 2


def test_handles_are_stable_per_object(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    nv = nvml_on(make_node("H200", mig_enabled=True))
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert (
        ctypes.cast(h, ctypes.c_void_p).value
        == ctypes.cast(nv.nvmlDeviceGetHandleByIndex(0), ctypes.c_void_p).value
    )
    gi = nv.nvmlDeviceCreateGpuInstance(h, 0)
    info = nv.nvmlGpuInstanceGetInfo(gi)
    again = nv.nvmlDeviceGetGpuInstanceById(h, info.id)
    assert ctypes.cast(gi, ctypes.c_void_p).value == ctypes.cast(again, ctypes.c_void_p).value
    # The struct's device field is the library's handle of the GPU, not the server's token.
    assert ctypes.cast(info.device, ctypes.c_void_p).value == ctypes.cast(h, ctypes.c_void_p).value
    ci = nv.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    ci_info = nv.nvmlComputeInstanceGetInfo(ci)
    assert (
        ctypes.cast(ci_info.gpuInstance, ctypes.c_void_p).value
        == ctypes.cast(gi, ctypes.c_void_p).value
    )


def test_threads_share_the_library(make_node: MakeNode, nvml_on: NvmlOn) -> None:
    nv = nvml_on(make_node("8xH200"))
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(30):
                for i in range(8):
                    h = nv.nvmlDeviceGetHandleByIndex(i)
                    assert nv.nvmlDeviceGetMemoryInfo(h).total > 0
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# -- what NVIDIA's device plugin and GFD need besides MIG (tests/native/test_device_plugin.py) --

TIMEOUT = 10  # NVML_ERROR_TIMEOUT
XID_CRITICAL = 0x8


class EventData(ctypes.Structure):  # nvmlEventData_t
    _fields_ = [
        ("device", ctypes.c_void_p),
        ("eventType", ctypes.c_ulonglong),
        ("eventData", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


def test_event_wait_blocks_for_its_timeout_without_holding_the_library(
    make_node: MakeNode, nvml_on: NvmlOn, c_lib: ctypes.CDLL
) -> None:
    nv = nvml_on(make_node("2xH100-80GB"))
    gpu = nv.nvmlDeviceGetHandleByIndex(0)
    events = ctypes.c_void_p()
    assert c_lib.nvmlEventSetCreate(ctypes.byref(events)) == st.SUCCESS
    supported = ctypes.c_ulonglong()
    assert c_lib.nvmlDeviceGetSupportedEventTypes(gpu, ctypes.byref(supported)) == st.SUCCESS
    assert supported.value & XID_CRITICAL
    assert (
        c_lib.nvmlDeviceRegisterEvents(gpu, ctypes.c_ulonglong(XID_CRITICAL), events) == st.SUCCESS
    )
    # a type the GPU does not report is refused, as NVML documents
    assert (
        c_lib.nvmlDeviceRegisterEvents(gpu, ctypes.c_ulonglong(1 << 40), events) == st.NOT_SUPPORTED
    )
    assert (
        c_lib.nvmlDeviceRegisterEvents(None, ctypes.c_ulonglong(XID_CRITICAL), events)
        == st.INVALID_ARGUMENT
    )

    data = EventData()
    calls_meanwhile: list[float] = []

    def other_thread() -> None:
        time.sleep(0.1)
        t0 = time.monotonic()
        nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(1))
        calls_meanwhile.append(time.monotonic() - t0)

    t = threading.Thread(target=other_thread)
    t.start()
    start = time.monotonic()
    code = c_lib.nvmlEventSetWait_v2(events, ctypes.byref(data), ctypes.c_uint(700))
    waited = time.monotonic() - start
    t.join()
    assert code == TIMEOUT
    assert 0.69 <= waited < 3.0
    assert len(calls_meanwhile) == 1 and calls_meanwhile[0] < 0.5  # not queued behind the wait
    assert (
        c_lib.nvmlEventSetWait_v2(None, ctypes.byref(data), ctypes.c_uint(10))
        == st.INVALID_ARGUMENT
    )
    assert c_lib.nvmlEventSetFree(events) == st.SUCCESS


def test_cuda_capability_topology_and_versions(
    make_node: MakeNode, nvml_on: NvmlOn, c_lib: ctypes.CDLL
) -> None:
    nv = nvml_on(make_node("2xA100-40GB"))
    a, b = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    assert nv.nvmlDeviceGetCudaComputeCapability(a) == (8, 0)
    level = ctypes.c_uint(99)
    assert c_lib.nvmlDeviceGetTopologyCommonAncestor(a, b, ctypes.byref(level)) == st.SUCCESS
    assert level.value == 40  # NVML_TOPOLOGY_NODE
    assert c_lib.nvmlDeviceGetTopologyCommonAncestor(a, a, ctypes.byref(level)) == st.SUCCESS
    assert level.value == 0  # NVML_TOPOLOGY_INTERNAL
    assert nv.nvmlSystemGetCudaDriverVersion_v2() == nv.nvmlSystemGetCudaDriverVersion() > 0


def test_xid_events_reach_the_sets_registered_on_their_gpu(
    make_node: MakeNode, nvml_on: NvmlOn, c_lib: ctypes.CDLL
) -> None:
    path = make_node("2xH100-80GB")
    nv = nvml_on(path)
    gpu0, gpu1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    on0, on1 = ctypes.c_void_p(), ctypes.c_void_p()
    assert c_lib.nvmlEventSetCreate(ctypes.byref(on0)) == st.SUCCESS  # on a node without events
    st.raise_xid(path, 1, 31)  # before on1 exists: not its
    assert c_lib.nvmlEventSetCreate(ctypes.byref(on1)) == st.SUCCESS
    for events, gpu in ((on0, gpu0), (on1, gpu1)):
        assert (
            c_lib.nvmlDeviceRegisterEvents(gpu, ctypes.c_ulonglong(XID_CRITICAL), events)
            == st.SUCCESS
        )
    data = EventData()
    assert c_lib.nvmlEventSetWait_v2(on1, ctypes.byref(data), ctypes.c_uint(150)) == TIMEOUT

    raiser = threading.Timer(0.3, lambda: (st.raise_xid(path, 1, 79), st.raise_xid(path, 0, 48)))
    raiser.start()
    start = time.monotonic()
    assert c_lib.nvmlEventSetWait_v2(on1, ctypes.byref(data), ctypes.c_uint(5000)) == st.SUCCESS
    assert 0.25 <= time.monotonic() - start < 2.0
    raiser.join()
    assert (data.eventType, data.eventData) == (XID_CRITICAL, 79)
    assert data.device == ctypes.cast(gpu1, ctypes.c_void_p).value
    assert (data.gpuInstanceId, data.computeInstanceId) == (st.NO_INSTANCE, st.NO_INSTANCE)
    # seen once; the other GPU's set sees its own event only (created before any event)
    assert c_lib.nvmlEventSetWait_v2(on1, ctypes.byref(data), ctypes.c_uint(150)) == TIMEOUT
    assert c_lib.nvmlEventSetWait_v2(on0, ctypes.byref(data), ctypes.c_uint(150)) == st.SUCCESS
    assert data.eventData == 48 and data.device == ctypes.cast(gpu0, ctypes.c_void_p).value
    assert c_lib.nvmlEventSetWait_v2(on0, ctypes.byref(data), ctypes.c_uint(150)) == TIMEOUT
    for events in (on0, on1):
        assert c_lib.nvmlEventSetFree(events) == st.SUCCESS
