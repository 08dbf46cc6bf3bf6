"""The C face of the simulated NVML library: one table of the C functions it implements.

Each entry names an NVML C function (as nvml.h declares it) and the kind of each of its
parameters. Two things are derived from this table and nothing else:

* the C marshalling of ``libnvidia-ml.so.1`` (``migsim.nvml.cgen`` turns the table into C at build
  time, checking every entry against the prototype and every struct layout against nvml.h), and
* the decoding of the calls that library forwards to ``migsim.nvml.server``, which rebuilds the
  ctypes arguments below and calls the *same* ``SimulatedNvmlLibrary`` that pynvml calls in-process.

So the behaviour of a call is written once (library.py); this module only says how its arguments
travel. The structs here are the nvml.h layouts under nvml.h's names (the library writes fields by
name); handle fields are ``c_void_p`` and listed in ``_handles_``.

Wire format (native byte order, one request and one reply per call on a unix stream socket):
request ``u32 length, name NUL, args``; reply ``u32 length, i32 nvmlReturn_t, outs``. Per parameter:

=============  ================================  ===========================================
kind           request                           reply
=============  ================================  ===========================================
Handle         u64 token (0: NULL or not ours)   --
HandleOut      u8 present                        u64 token (0: not written), if present
UInt/Int       u32 / i32                         --
Ptr(T)         u8 present, sizeof(T) bytes       sizeof(T) bytes if present and T is in/out
Text           u32 length (~0: NULL), bytes      --
TextOut(n)     u8 present, u32 capacity          u32 k, k bytes (written prefix)
Array(T, n)    u8 present, u32 n, n*T (inout)    u32 k, k*T (the entries written)
=============  ================================  ===========================================

Tokens are the handle values of the server's library; the C library maps each token to a pointer
it owns (stable for the life of the process), so a token never reaches a caller.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Literal, TypeAlias

ENV_SOCKET = "MIG_AGENT_SIM_NVML_SOCKET"

# Arrays NVML fills without a capacity argument (GI/CI handles, placements) are bounded by this
# many entries on the server; NVML writes all it has, as real NVML does.
UNBOUNDED_ARRAY = 256


# -------------------------------------------------------------------------------------------------
# nvml.h struct layouts (checked against nvml.h by static asserts in the generated C)


class _Struct(ctypes.Structure):
    _c_name_ = ""
    _handles_: tuple[str, ...] = ()


class PciInfo(_Struct):
    _c_name_ = "nvmlPciInfo_t"
    _fields_ = [
        ("busIdLegacy", ctypes.c_char * 16),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),
    ]


class Memory(_Struct):
    _c_name_ = "nvmlMemory_t"
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class MemoryV2(_Struct):
    _c_name_ = "nvmlMemory_v2_t"
    _fields_ = [
        ("version", ctypes.c_uint),
        ("total", ctypes.c_ulonglong),
        ("reserved", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class Value(ctypes.Union):
    _fields_ = [
        ("dVal", ctypes.c_double),
        ("siVal", ctypes.c_int),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("usVal", ctypes.c_ushort),
    ]


class FieldValue(_Struct):
    _c_name_ = "nvmlFieldValue_t"
    _fields_ = [
        ("fieldId", ctypes.c_uint),
        ("scopeId", ctypes.c_uint),
        ("timestamp", ctypes.c_longlong),
        ("latencyUsec", ctypes.c_longlong),
        ("valueType", ctypes.c_uint),
        ("nvmlReturn", ctypes.c_uint),
        ("value", Value),
    ]


class Utilization(_Struct):
    _c_name_ = "nvmlUtilization_t"
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class ProcessInfo(_Struct):
    _c_name_ = "nvmlProcessInfo_t"
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class DeviceAttributes(_Struct):
    _c_name_ = "nvmlDeviceAttributes_t"
    _fields_ = [
        ("multiprocessorCount", ctypes.c_uint),
        ("sharedCopyEngineCount", ctypes.c_uint),
        ("sharedDecoderCount", ctypes.c_uint),
        ("sharedEncoderCount", ctypes.c_uint),
        ("sharedJpegCount", ctypes.c_uint),
        ("sharedOfaCount", ctypes.c_uint),
        ("gpuInstanceSliceCount", ctypes.c_uint),
        ("computeInstanceSliceCount", ctypes.c_uint),
        ("memorySizeMB", ctypes.c_ulonglong),
    ]


class GpuInstancePlacement(_Struct):
    _c_name_ = "nvmlGpuInstancePlacement_t"
    _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]


class ComputeInstancePlacement(_Struct):
    _c_name_ = "nvmlComputeInstancePlacement_t"
    _fields_ = [("start", ctypes.c_uint), ("size", ctypes.c_uint)]


_GI_PROFILE_FIELDS = [
    ("id", ctypes.c_uint),
    ("isP2pSupported", ctypes.c_uint),
    ("sliceCount", ctypes.c_uint),
    ("instanceCount", ctypes.c_uint),
    ("multiprocessorCount", ctypes.c_uint),
    ("copyEngineCount", ctypes.c_uint),
    ("decoderCount", ctypes.c_uint),
    ("encoderCount", ctypes.c_uint),
    ("jpegCount", ctypes.c_uint),
    ("ofaCount", ctypes.c_uint),
    ("memorySizeMB", ctypes.c_ulonglong),
]


class GpuInstanceProfileInfo(_Struct):
    _c_name_ = "nvmlGpuInstanceProfileInfo_t"
    _fields_ = _GI_PROFILE_FIELDS


class GpuInstanceProfileInfoV2(_Struct):
    _c_name_ = "nvmlGpuInstanceProfileInfo_v2_t"
    _fields_ = [("version", ctypes.c_uint), *_GI_PROFILE_FIELDS, ("name", ctypes.c_char * 96)]


class GpuInstanceInfo(_Struct):
    _c_name_ = "nvmlGpuInstanceInfo_t"
    _handles_ = ("device",)
    _fields_ = [
        ("device", ctypes.c_void_p),
        ("id", ctypes.c_uint),
        ("profileId", ctypes.c_uint),
        ("placement", GpuInstancePlacement),
    ]


_CI_PROFILE_FIELDS = [
    ("id", ctypes.c_uint),
    ("sliceCount", ctypes.c_uint),
    ("instanceCount", ctypes.c_uint),
    ("multiprocessorCount", ctypes.c_uint),
    ("sharedCopyEngineCount", ctypes.c_uint),
    ("sharedDecoderCount", ctypes.c_uint),
    ("sharedEncoderCount", ctypes.c_uint),
    ("sharedJpegCount", ctypes.c_uint),
    ("sharedOfaCount", ctypes.c_uint),
]


class ComputeInstanceProfileInfo(_Struct):
    _c_name_ = "nvmlComputeInstanceProfileInfo_t"
    _fields_ = _CI_PROFILE_FIELDS


class ComputeInstanceProfileInfoV2(_Struct):
    _c_name_ = "nvmlComputeInstanceProfileInfo_v2_t"
    _fields_ = [("version", ctypes.c_uint), *_CI_PROFILE_FIELDS, ("name", ctypes.c_char * 96)]


class ComputeInstanceInfo(_Struct):
    _c_name_ = "nvmlComputeInstanceInfo_t"
    _handles_ = ("device", "gpuInstance")
    _fields_ = [
        ("device", ctypes.c_void_p),
        ("gpuInstance", ctypes.c_void_p),
        ("id", ctypes.c_uint),
        ("profileId", ctypes.c_uint),
        ("placement", ComputeInstancePlacement),
    ]


class DeviceAddressingMode(_Struct):
    _c_name_ = "nvmlDeviceAddressingMode_t"
    _fields_ = [("version", ctypes.c_uint), ("value", ctypes.c_uint)]


Scalar: TypeAlias = type[ctypes.c_uint] | type[ctypes.c_int] | type[ctypes.c_ulonglong]
CType: TypeAlias = Scalar | type[_Struct]


# -------------------------------------------------------------------------------------------------
# Parameter kinds


@dataclass(frozen=True)
class Handle:
    """An opaque handle passed in (nvmlDevice_t, nvmlGpuInstance_t, nvmlComputeInstance_t)."""


@dataclass(frozen=True)
class HandleOut:
    """A pointer to a handle NVML writes."""


@dataclass(frozen=True)
class UInt:
    """An unsigned int (or enum) passed by value."""


@dataclass(frozen=True)
class Int:
    """A signed int passed by value."""


@dataclass(frozen=True)
class Ptr:
    """A pointer to one value of ``ctype``; ``inout`` False for const inputs (placements)."""

    ctype: CType
    inout: bool = True


@dataclass(frozen=True)
class Text:
    """A NUL-terminated ``const char*`` input."""


@dataclass(frozen=True)
class TextOut:
    """A ``char*`` buffer NVML fills, its capacity in the value parameter at ``length``."""

    length: int


ArrayMode = Literal["inout", "capacity", "unbounded"]


@dataclass(frozen=True)
class Array:
    """A caller's array of ``ctype`` (``None``: of handles), its size at parameter ``count``.

    ``inout``: the count is a value, entries go both ways (field values); ``capacity``: the count
    is an in/out pointer holding the capacity (running processes); ``unbounded``: the count is an
    out pointer and NVML writes all it has (instance handles, placements)."""

    ctype: CType | None
    count: int
    mode: ArrayMode


Kind: TypeAlias = Handle | HandleOut | UInt | Int | Ptr | Text | TextOut | Array

HANDLE, HANDLE_OUT, UINT, INT, TEXT = Handle(), HandleOut(), UInt(), Int(), Text()
U32_OUT, I32_OUT, U64_OUT = Ptr(ctypes.c_uint), Ptr(ctypes.c_int), Ptr(ctypes.c_ulonglong)


@dataclass(frozen=True)
class Function:
    """A C function of libnvidia-ml.so.1, answered by ``SimulatedNvmlLibrary.<serve>``."""

    name: str
    params: tuple[Kind, ...]
    serve: str = ""

    @property
    def server_name(self) -> str:
        return self.serve or self.name


def _fn(name: str, *params: Kind, serve: str = "") -> Function:
    return Function(name, params, serve)


# nvmlInit*, nvmlShutdown and nvmlErrorString are the C library's own (reference counting,
# strings); every function below is forwarded to the server.
FUNCTIONS: tuple[Function, ...] = (
    _fn("nvmlSystemGetDriverVersion", TextOut(1), UINT),
    _fn("nvmlSystemGetNVMLVersion", TextOut(1), UINT),
    _fn("nvmlSystemGetCudaDriverVersion", I32_OUT),
    _fn("nvmlSystemGetCudaDriverVersion_v2", I32_OUT),
    _fn("nvmlDeviceGetCount_v2", U32_OUT),
    _fn("nvmlDeviceGetCount", U32_OUT, serve="nvmlDeviceGetCount_v2"),
    _fn("nvmlDeviceGetHandleByIndex_v2", UINT, HANDLE_OUT),
    _fn("nvmlDeviceGetHandleByIndex", UINT, HANDLE_OUT, serve="nvmlDeviceGetHandleByIndex_v2"),
    _fn("nvmlDeviceGetHandleByUUID", TEXT, HANDLE_OUT),
    _fn("nvmlDeviceGetHandleByPciBusId_v2", TEXT, HANDLE_OUT),
    _fn(
        "nvmlDeviceGetHandleByPciBusId", TEXT, HANDLE_OUT, serve="nvmlDeviceGetHandleByPciBusId_v2"
    ),
    _fn("nvmlDeviceGetName", HANDLE, TextOut(2), UINT),
    _fn("nvmlDeviceGetUUID", HANDLE, TextOut(2), UINT),
    _fn("nvmlDeviceGetIndex", HANDLE, U32_OUT),
    _fn("nvmlDeviceGetMinorNumber", HANDLE, U32_OUT),
    _fn("nvmlDeviceGetPciInfo_v3", HANDLE, Ptr(PciInfo)),
    _fn("nvmlDeviceGetMemoryInfo", HANDLE, Ptr(Memory)),
    _fn("nvmlDeviceGetMemoryInfo_v2", HANDLE, Ptr(MemoryV2)),
    _fn("nvmlDeviceGetArchitecture", HANDLE, U32_OUT),
    _fn("nvmlDeviceGetVirtualizationMode", HANDLE, U32_OUT),
    _fn("nvmlDeviceGetCudaComputeCapability", HANDLE, I32_OUT, I32_OUT),
    _fn("nvmlDeviceGetTopologyCommonAncestor", HANDLE, HANDLE, U32_OUT),
    _fn("nvmlDeviceGetSupportedEventTypes", HANDLE, U64_OUT),
    _fn("nvmlDeviceGetFieldValues", HANDLE, INT, Array(FieldValue, 1, "inout")),
    _fn(
        "nvmlDeviceGetComputeRunningProcesses_v3",
        HANDLE,
        U32_OUT,
        Array(ProcessInfo, 1, "capacity"),
    ),
    _fn(
        "nvmlDeviceGetComputeRunningProcesses_v2",
        HANDLE,
        U32_OUT,
        Array(ProcessInfo, 1, "capacity"),
    ),
    _fn(
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        HANDLE,
        U32_OUT,
        Array(ProcessInfo, 1, "capacity"),
    ),
    _fn(
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        HANDLE,
        U32_OUT,
        Array(ProcessInfo, 1, "capacity"),
    ),
    _fn(
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        HANDLE,
        U32_OUT,
        Array(ProcessInfo, 1, "capacity"),
    ),
    _fn(
        "nvmlDeviceGetMPSComputeRunningProcesses_v2",
        HANDLE,
        U32_OUT,
        Array(ProcessInfo, 1, "capacity"),
    ),
    # what nvidia-smi's table shows besides identity and MIG
    _fn("nvmlDeviceGetPersistenceMode", HANDLE, U32_OUT),
    _fn("nvmlDeviceGetDisplayActive", HANDLE, U32_OUT),
    _fn("nvmlDeviceGetEccMode", HANDLE, U32_OUT, U32_OUT),
    _fn("nvmlDeviceGetTotalEccErrors", HANDLE, UINT, UINT, U64_OUT),
    _fn("nvmlDeviceGetTemperature", HANDLE, UINT, U32_OUT),
    _fn("nvmlDeviceGetPerformanceState", HANDLE, U32_OUT),
    _fn("nvmlDeviceGetPowerUsage", HANDLE, U32_OUT),
    _fn("nvmlDeviceGetEnforcedPowerLimit", HANDLE, U32_OUT),
    _fn("nvmlDeviceGetUtilizationRates", HANDLE, Ptr(Utilization)),
    _fn("nvmlDeviceGetComputeMode", HANDLE, U32_OUT),
    _fn("nvmlSystemGetProcessName", UINT, TextOut(2), UINT),
    _fn("nvmlDeviceGetMigMode", HANDLE, U32_OUT, U32_OUT),
    _fn("nvmlDeviceSetMigMode", HANDLE, UINT, U32_OUT),
    _fn("nvmlDeviceGetMaxMigDeviceCount", HANDLE, U32_OUT),
    _fn("nvmlDeviceGetMigDeviceHandleByIndex", HANDLE, UINT, HANDLE_OUT),
    _fn("nvmlDeviceIsMigDeviceHandle", HANDLE, U32_OUT),
    _fn("nvmlDeviceGetGpuInstanceId", HANDLE, U32_OUT),
    _fn("nvmlDeviceGetComputeInstanceId", HANDLE, U32_OUT),
    _fn("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", HANDLE, HANDLE_OUT),
    _fn("nvmlDeviceGetAttributes_v2", HANDLE, Ptr(DeviceAttributes)),
    _fn(
        "nvmlDeviceGetAttributes", HANDLE, Ptr(DeviceAttributes), serve="nvmlDeviceGetAttributes_v2"
    ),
    _fn("nvmlDeviceGetGpuInstanceProfileInfo", HANDLE, UINT, Ptr(GpuInstanceProfileInfo)),
    _fn("nvmlDeviceGetGpuInstanceProfileInfoV", HANDLE, UINT, Ptr(GpuInstanceProfileInfoV2)),
    _fn("nvmlDeviceGetGpuInstanceProfileInfoByIdV", HANDLE, UINT, Ptr(GpuInstanceProfileInfoV2)),
    _fn(
        "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
        HANDLE,
        UINT,
        Array(GpuInstancePlacement, 3, "unbounded"),
        U32_OUT,
    ),
    _fn("nvmlDeviceGetGpuInstanceRemainingCapacity", HANDLE, UINT, U32_OUT),
    _fn("nvmlDeviceCreateGpuInstance", HANDLE, UINT, HANDLE_OUT),
    _fn(
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        HANDLE,
        UINT,
        Ptr(GpuInstancePlacement, inout=False),
        HANDLE_OUT,
    ),
    _fn("nvmlGpuInstanceDestroy", HANDLE),
    _fn("nvmlDeviceGetGpuInstances", HANDLE, UINT, Array(None, 3, "unbounded"), U32_OUT),
    _fn("nvmlDeviceGetGpuInstanceById", HANDLE, UINT, HANDLE_OUT),
    _fn("nvmlGpuInstanceGetInfo", HANDLE, Ptr(GpuInstanceInfo)),
    _fn(
        "nvmlGpuInstanceGetComputeInstanceProfileInfo",
        HANDLE,
        UINT,
        UINT,
        Ptr(ComputeInstanceProfileInfo),
    ),
    _fn(
        "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
        HANDLE,
        UINT,
        UINT,
        Ptr(ComputeInstanceProfileInfoV2),
    ),
    _fn("nvmlGpuInstanceGetComputeInstanceRemainingCapacity", HANDLE, UINT, U32_OUT),
    _fn(
        "nvmlGpuInstanceGetComputeInstancePossiblePlacements",
        HANDLE,
        UINT,
        Array(ComputeInstancePlacement, 3, "unbounded"),
        U32_OUT,
    ),
    _fn("nvmlGpuInstanceCreateComputeInstance", HANDLE, UINT, HANDLE_OUT),
    _fn(
        "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
        HANDLE,
        UINT,
        Ptr(ComputeInstancePlacement, inout=False),
        HANDLE_OUT,
    ),
    _fn("nvmlComputeInstanceDestroy", HANDLE),
    _fn("nvmlGpuInstanceGetComputeInstances", HANDLE, UINT, Array(None, 3, "unbounded"), U32_OUT),
    _fn("nvmlGpuInstanceGetComputeInstanceById", HANDLE, UINT, HANDLE_OUT),
    _fn("nvmlComputeInstanceGetInfo_v2", HANDLE, Ptr(ComputeInstanceInfo)),
    _fn(
        "nvmlComputeInstanceGetInfo",
        HANDLE,
        Ptr(ComputeInstanceInfo),
        serve="nvmlComputeInstanceGetInfo_v2",
    ),
)

# Read by NVIDIA's DRA driver (gpu-kubelet-plugin) when it discovers the GPUs, besides the above.
FUNCTIONS += (
    _fn("nvmlDeviceGetBrand", HANDLE, U32_OUT),
    _fn("nvmlDeviceGetAddressingMode", HANDLE, Ptr(DeviceAddressingMode)),
)

BY_NAME: dict[str, Function] = {f.name: f for f in FUNCTIONS}

# Not an NVML function: what the C library's nvmlEventSetWait_v2 asks the simulator, every
# EVENT_POLL_MS while it waits (without holding the library between polls). Request: u64 cursor
# (the last event number seen; ~0: return no event, only the latest number), u32 n, n x (u64 GPU
# token, u64 event type mask). Reply on NVML_SUCCESS: u64 cursor to poll after next, u8 found, if
# found: u64 GPU token, u64 eventType, u64 eventData, u32 gpuInstanceId, u32 computeInstanceId.
POLL_EVENTS = "migsimPollEvents"
EVENT_POLL_MS = 100

# Not an NVML function either: GPU reset, which the driver does outside NVML (nvidia-smi -r) and
# the simulated nvidia-smi asks the simulator for through the C library's migsimDeviceReset.
# Request: u64 GPU token. Reply: i32 code, u32 k, k bytes (why it was refused, or nothing).
RESET_GPU = "migsimResetGpu"

# Not an NVML function either: a CUDA program's footprint. The simulated gpu-workload asks the
# simulator, through the C library's migsimHoldDevices, to show its process (by the pid the
# kernel gives the socket's peer) as a compute process on every device it sees, until its
# connection closes. Request: u32 used memory (MiB), u32 n, n bytes (the process name).
# Reply: i32 code, u32 k, k bytes: the UUIDs held, each followed by a newline.
HOLD_DEVICES = "migsimHoldDevices"

# Visibility (migsim.nvml.visibility): the init calls (nvmlInit_v2; nvmlInitWithFlags after its
# u32 flags) end with what the connecting process sees: u32 n (VISIBLE_EVERYTHING: all), then
# n x (u32 length, bytes): the names of the files in its visible folder. A request without them
# (an older library) sees everything.
VISIBLE_EVERYTHING = 0xFFFFFFFF

# Implemented in C by the library itself, not forwarded.
# Event sets are the library's own too: nvmlEventSetWait_v2 polls the simulator (POLL_EVENTS) and
# sleeps in between without holding the connection, up to its timeout (then NVML_ERROR_TIMEOUT);
# nvmlDeviceRegisterEvents checks its handle and types with the simulator.
LOCAL_FUNCTIONS = (
    "nvmlInit_v2",
    "nvmlInit",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlEventSetCreate",
    "nvmlEventSetFree",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetWait_v2",
    "nvmlEventSetWait",
)
