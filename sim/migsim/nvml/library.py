"""A simulated NVML *C library*: the object pynvml uses as ``pynvml.nvmlLib`` on GPU-less machines.

Each attribute is named like a C symbol pynvml calls (``nvmlDeviceGetMigMode``, ...) and takes the
ctypes arguments pynvml passes: out-parameters arrive as ``byref(x)`` and are written into pynvml's
own structs by field name; the return value is an int nvmlReturn_t. pynvml's real wrappers,
structs and exceptions therefore run unchanged above it. Handles are pointers to small buffers
this library owns; it decodes the handles it is given back, and treats handles of destroyed
instances as INVALID_ARGUMENT, as the driver does.

State and behaviour live in migsim.nvml.state (one JSON file per node, shared by processes).
This module adds the ABI, the handle registry, fault and latency hooks, and a small CLI:
``python -m migsim.nvml --state FILE create|show|reset|reboot|process|fault|xid|counts``.

It must not import pynvml (only mig_agent.gpu.nvml does): it works on whatever ctypes objects it is
handed. Caller bugs that would corrupt memory under real NVML (an array too small for what NVML
writes, a struct passed by value) raise SimulatedNvmlMisuse instead of returning a code.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, NamedTuple, TypeVar

from migsim.gpus import CiProfile, GiProfile, Placement, Readings
from migsim.nvml import state as st
from migsim.nvml.state import (
    ENV_STATE,
    ERROR_NAMES,
    ERROR_STRINGS,
    CallCounts,
    Refused,
    SimComputeInstance,
    SimError,
    SimEvent,
    SimGpu,
    SimGpuInstance,
    SimNode,
    StateFile,
    add_process,
    call_counts,
    clear_faults,
    create_node,
    inject_failure,
    load_node,
    raise_xid,
    reboot_node,
    remove_process,
    reset_call_counts,
    reset_gpu,
    set_latency,
    set_reset_supported,
)
from migsim.nvml.visibility import EVERYTHING, Visibility

__all__ = [
    "ENV_STATE",
    "CallCounts",
    "SimError",
    "SimulatedNvmlLibrary",
    "SimulatedNvmlMisuse",
    "add_process",
    "call_counts",
    "clear_faults",
    "create_node",
    "inject_failure",
    "load_node",
    "main",
    "raise_xid",
    "reboot_node",
    "remove_process",
    "reset_call_counts",
    "reset_gpu",
    "set_latency",
    "set_reset_supported",
]

_NO_ID = 0xFFFFFFFF  # NVML_GPU_INSTANCE_ID_ANY / "not on a MIG device" in process infos
_TOPOLOGY_INTERNAL = 0  # NVML_TOPOLOGY_INTERNAL: the same GPU
_TOPOLOGY_NODE = 40  # NVML_TOPOLOGY_NODE: PCIe GPUs under host bridges of one NUMA node
# nvmlEventType*: SingleBitEccError, DoubleBitEccError, PState, XidCriticalError, Clock,
# PowerSourceChange, MigConfigChange (what a data-centre GPU's driver reports as supported).
SUPPORTED_EVENT_TYPES = 0x1 | 0x2 | 0x4 | 0x8 | 0x10 | 0x80 | 0x100
_FI_RESETLESS_MIG = 184  # NVML_FI_DEV_IS_RESETLESS_MIG_SUPPORTED
_FI_MIG_QUERY_INDEPENDENT = 199  # NVML_FI_DEV_IS_MIG_MODE_INDEPENDENT_MIG_QUERY_CAPABLE
_VALUE_TYPE_UINT = 1
_VOLATILE_ECC, _AGGREGATE_ECC = 0, 1  # nvmlEccCounterType_t
_TEMPERATURE_GPU = 0  # nvmlTemperatureSensors_t
_COMPUTEMODE_DEFAULT = 0  # nvmlComputeMode_t
_ADDRESSING_MODE_NONE = 0  # NVML_DEVICE_ADDRESSING_MODE_NONE

_CArgObject: Any = type(ctypes.byref(ctypes.c_int()))


class SimulatedNvmlMisuse(AssertionError):
    """The caller used the C API in a way that corrupts memory or crashes with real NVML."""


# -------------------------------------------------------------------------------------------------
# ctypes argument helpers


def _uint(arg: Any, what: str) -> int:
    if isinstance(arg, int):
        return arg
    if isinstance(arg, ctypes._SimpleCData):
        return int(arg.value)
    raise SimulatedNvmlMisuse(f"{what}: expected an integer, got {type(arg).__name__}")


def _out(arg: Any, what: str) -> Any:
    """The object an out-parameter points to (``byref(x)`` or ``pointer(x)``)."""
    if isinstance(arg, _CArgObject):
        return arg._obj
    if isinstance(arg, ctypes._Pointer):
        return arg.contents
    raise SimulatedNvmlMisuse(
        f"{what}: out-parameter must be passed by reference (byref), got {type(arg).__name__}"
    )


def _text_in(arg: Any, what: str) -> str:
    if isinstance(arg, ctypes.c_char_p):
        return (arg.value or b"").decode()
    if isinstance(arg, bytes):
        return arg.decode()
    raise SimulatedNvmlMisuse(f"{what}: expected a char*, got {type(arg).__name__}")


def _text_out(buf: Any, length: Any, text: str, what: str) -> None:
    data = text.encode()
    size = _uint(length, what)
    if len(data) + 1 > size:
        raise Refused(st.INSUFFICIENT_SIZE)
    if not isinstance(buf, ctypes.Array) or ctypes.sizeof(buf) < size:
        raise SimulatedNvmlMisuse(f"{what}: buffer smaller than the length passed with it")
    buf.value = data


def _address(handle: Any) -> int | None:
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    if isinstance(handle, ctypes.c_void_p):
        return handle.value
    return None


def _store_address(obj: Any, addr: int, offset: int = 0) -> None:
    ctypes.c_void_p.from_address(ctypes.addressof(obj) + offset).value = addr


def _store_field_address(struct: Any, name: str, addr: int) -> None:
    _store_address(struct, addr, getattr(type(struct), name).offset)


def _zero(struct: Any) -> None:
    ctypes.memset(ctypes.addressof(struct), 0, ctypes.sizeof(struct))


def _check_version(info: Any, version: int) -> None:
    # NVML_STRUCT_VERSION(x, v) = sizeof(x) | v << 24
    if info.version != (version << 24 | ctypes.sizeof(info)):
        raise Refused(st.ARGUMENT_VERSION_MISMATCH)


def _array(arg: Any, count_in: int, needed: int, what: str) -> tuple[Any, int]:
    """(indexable array, base address) for a caller-allocated array NVML fills with ``needed``
    entries; fails loudly when it cannot hold them (real NVML writes past its end)."""
    if isinstance(arg, _CArgObject):
        arg = arg._obj
    if isinstance(arg, ctypes.Array):
        capacity, base = len(arg), ctypes.addressof(arg)
    elif isinstance(arg, ctypes._Pointer):
        capacity, base = count_in, ctypes.cast(arg, ctypes.c_void_p).value or 0
    else:
        raise SimulatedNvmlMisuse(
            f"{what}: expected a caller-allocated array, got {type(arg).__name__}"
        )
    if capacity < needed:
        raise SimulatedNvmlMisuse(
            f"{what}: the caller's array holds {capacity} entries but NVML writes {needed}; "
            "real NVML does not check and corrupts memory. Size it from the count query "
            "(NULL array) or the profile's instanceCount"
        )
    return arg, base


def _write_handles(arr_arg: Any, count: Any, handles: Sequence[int], what: str) -> None:
    """Fill a caller's array of opaque handles (if given) and set the count, as NVML does."""
    c = _out(count, what)
    if arr_arg is not None:
        _, base = _array(arr_arg, c.value, len(handles), what)
        size = ctypes.sizeof(ctypes.c_void_p)
        for i, handle in enumerate(handles):
            ctypes.c_void_p.from_address(base + i * size).value = handle
    c.value = len(handles)


def _placement_in(arg: Any, what: str) -> Placement:
    if isinstance(arg, ctypes.Structure):
        raise SimulatedNvmlMisuse(
            f"{what}: the placement must be passed by pointer (byref(placement)), not by value"
        )
    p = _out(arg, what)
    return Placement(int(p.start), int(p.size))


# -------------------------------------------------------------------------------------------------
# Handles


class _Key(NamedTuple):
    kind: str  # "gpu", "gi", "ci" or "mig"
    gpu: int
    serial: int  # of the GPU/compute instance (0 for a GPU); see SimGpuInstance.serial


class _Handles:
    """Pointer values handed out as handles. The same object always gets the same handle."""

    def __init__(self) -> None:
        self._buffers: dict[_Key, ctypes.Array[ctypes.c_char]] = {}
        self._keys: dict[int, _Key] = {}

    def address(self, key: _Key) -> int:
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = ctypes.create_string_buffer(8)
            self._keys[ctypes.addressof(buf)] = key
        return ctypes.addressof(buf)

    def key(self, handle: Any) -> _Key | None:
        addr = _address(handle)
        return self._keys.get(addr) if addr else None


# -------------------------------------------------------------------------------------------------
# The library


_Impl = Callable[..., Any]
_F = TypeVar("_F", bound=_Impl)


class _Export(NamedTuple):
    method: str
    mutating: bool
    needs_init: bool
    uses_state: bool
    viewed: bool  # the implementation takes the caller's Visibility (keyword ``view``)


_EXPORTS: dict[str, _Export] = {}
_INITS = frozenset({"nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags"})  # fault rules apply to them


def _export(
    *names: str,
    mutating: bool = False,
    needs_init: bool = True,
    uses_state: bool = True,
    viewed: bool = False,
) -> Callable[[_F], _F]:
    def register(fn: _F) -> _F:
        for name in names:
            _EXPORTS[name] = _Export(fn.__name__, mutating, needs_init, uses_state, viewed)
        return fn

    return register


class _CFunction:
    """One exported symbol. pynvml sets ``restype`` on some, as on a ctypes function."""

    def __init__(self, lib: SimulatedNvmlLibrary, name: str, impl: _Impl, spec: _Export) -> None:
        self.__name__ = name
        self.restype: Any = None
        self.argtypes: Any = None
        self._lib, self._impl, self.spec = lib, impl, spec

    def __call__(self, *args: Any) -> Any:
        return self._lib._call(self.__name__, self._impl, self.spec, args, self._lib.visible)


class SimulatedNvmlLibrary:
    """The NVML C library of one simulated node, whose state is in ``state_file``; ``visible``
    is what its callers see (migsim.nvml.visibility; the server passes each client's per call)."""

    def __init__(
        self, state_file: str | os.PathLike[str], visible: Visibility = EVERYTHING
    ) -> None:
        self.state_file = os.fspath(state_file)
        self.visible = visible
        self._store = StateFile(self.state_file)
        self._handles = _Handles()
        self._init_count = 0
        for name, spec in _EXPORTS.items():
            setattr(self, name, _CFunction(self, name, getattr(self, spec.method), spec))

    def __repr__(self) -> str:
        return f"SimulatedNvmlLibrary({self.state_file!r})"

    @property
    def initialized(self) -> bool:
        """nvmlInit was called more often than nvmlShutdown."""
        return self._init_count > 0

    @staticmethod
    def exported() -> frozenset[str]:
        """The names of the C functions this library implements."""
        return frozenset(_EXPORTS)

    def call(self, name: str, *args: Any, view: Visibility | None = None) -> int:
        """Calls the C function ``name`` with ctypes arguments as a client that sees ``view``
        (default: ``visible``): its nvmlReturn_t (the face the C library's simulator server
        uses; pynvml calls the attributes directly)."""
        spec = _EXPORTS[name]
        impl = getattr(self, spec.method)
        return int(self._call(name, impl, spec, args, self.visible if view is None else view))

    def poll_events(
        self, cursor: int | None, registrations: Sequence[tuple[Any, int]]
    ) -> tuple[int, SimEvent | None, int]:
        """The next event after number ``cursor`` for an event set registered for
        ``registrations`` ((GPU handle, nvmlEventType mask) each): (the number to poll after
        next, the event or None, the GPU's handle or 0). Cursor None: no event, only the latest
        number (an event set sees the events raised after it was created). INVALID_ARGUMENT
        (Refused) for a handle that is not a GPU's."""
        node = self._store.read()
        wanted: list[tuple[int, int]] = []
        for handle, types in registrations:
            key = self._handles.key(handle)
            if key is None or key.kind != "gpu":
                raise Refused(st.INVALID_ARGUMENT)
            wanted.append((key.gpu, types))
        latest = node.next_event - 1
        if cursor is None:
            return latest, None, 0
        for event in node.events:
            if event.seq > cursor and any(
                event.gpu == g and event.event_type & t for g, t in wanted
            ):
                return event.seq, event, self._gpu_handle(event.gpu)
        return latest, None, 0

    def reset_gpu(self, index: int) -> None:
        """``nvidia-smi -r`` for the simulated node (SimError when refused)."""
        reset_gpu(self.state_file, index)

    def reset_device(self, handle: Any) -> tuple[int, str]:
        """``nvidia-smi -r`` of the GPU whose handle this library handed out: (NVML code, why it
        was refused), the simulated nvidia-smi's reset (migsim.nvml.abi.RESET_GPU)."""
        key = self._handles.key(handle)
        if self._init_count == 0:
            return st.UNINITIALIZED, ""
        if key is None or key.kind != "gpu":
            return st.INVALID_ARGUMENT, "not a GPU handle"
        try:
            reset_gpu(self.state_file, key.gpu)
        except SimError as exc:
            return exc.code, str(exc)
        return st.SUCCESS, ""

    def hold_devices(
        self, view: Visibility, pid: int, used_memory_mib: int, name: str, held_via: str
    ) -> tuple[int, list[str]]:
        """Process ``pid`` (a client seeing ``view``) as a CUDA program on every device it sees,
        until release_holds(): (NVML code, the UUIDs held). A MIG device it sees is held; a GPU
        seen whole with MIG off is held itself; a GPU seen whole with MIG on is used through
        its MIG devices, as CUDA does (the GPU itself runs no CUDA context then), so each of
        them is held (none if it has none). The simulated gpu-workload's migsimHoldDevices
        (migsim.nvml.abi.HOLD_DEVICES)."""
        if self._init_count == 0:
            return st.UNINITIALIZED, []
        try:
            node = self._store.read()
        except FileNotFoundError:
            return st.DRIVER_NOT_LOADED, []
        devices: list[tuple[int, int | None, int | None]] = []
        uuids: list[str] = []
        for gpu in view.gpus(node):
            if gpu.mig_current:
                for gi, ci in view.mig_devices(gpu):
                    devices.append((gpu.index, gi.id, ci.id))
                    uuids.append(ci.uuid)
            else:
                devices.append((gpu.index, None, None))
                uuids.append(gpu.uuid)
        try:
            st.hold_devices(
                self.state_file,
                pid,
                devices,
                used_memory_mib=used_memory_mib,
                name=name,
                held_via=held_via,
            )
        except SimError as exc:
            return exc.code, []
        return st.SUCCESS, uuids

    def release_holds(self, held_via: str, pid: int | None = None) -> int:
        """Take off what hold_devices() put on for ``held_via`` (only ``pid``'s if given)."""
        return st.release_holds(self.state_file, held_via, pid)

    # -- dispatch --------------------------------------------------------------------------------

    def _call(
        self, name: str, impl: _Impl, spec: _Export, args: tuple[Any, ...], view: Visibility
    ) -> Any:
        if spec.needs_init and self._init_count == 0:
            return st.UNINITIALIZED
        if name in _INITS:
            refused = self._init_refused(name)
            if refused is not None:
                return refused
        if not spec.uses_state:
            return impl(*args)
        if spec.viewed:
            impl = functools.partial(impl, view=view)
        try:
            node = self._store.read()
        except FileNotFoundError:
            return st.DRIVER_NOT_LOADED
        key = self._handles.key(args[0]) if args else None
        gpu = key.gpu if key else None
        delay = node.latency_for(spec.mutating)
        if spec.mutating or node.match_rule(name, gpu, False):
            with self._store.mutate() as fresh:
                if spec.mutating:
                    fresh.count(name, gpu)
                rule = fresh.consume(name, gpu, spec.mutating)
                if rule is None:
                    code = self._run(impl, fresh, args)
                elif rule.after:  # done, yet reported as failed
                    self._run(impl, fresh, args)
                    code = rule.code
                else:
                    code = rule.code
        else:
            code = self._run(impl, node, args)
        if delay:
            time.sleep(delay)
        return code

    def _init_refused(self, name: str) -> int | None:
        """The code of a fault rule on this init (a driver not ready yet, as while a node boots
        or its driver reloads), the rule consumed; None to go on."""
        try:
            node = self._store.read()
        except FileNotFoundError:
            return None  # the init answers DRIVER_NOT_LOADED itself
        if node.match_rule(name, None, False) is None:
            return None
        with self._store.mutate() as fresh:
            return fresh.consume_rule(name, None, False)

    @staticmethod
    def _run(impl: _Impl, node: SimNode, args: tuple[Any, ...]) -> int:
        try:
            impl(node, *args)
        except Refused as r:
            return r.code
        return st.SUCCESS

    # -- handle resolution (Refused(INVALID_ARGUMENT) for stale or foreign handles) -------------

    def _gpu_handle(self, index: int) -> int:
        return self._handles.address(_Key("gpu", index, 0))

    def _gi_handle(self, gpu: SimGpu, gi: SimGpuInstance) -> int:
        return self._handles.address(_Key("gi", gpu.index, gi.serial))

    def _ci_handle(self, gpu: SimGpu, ci: SimComputeInstance) -> int:
        return self._handles.address(_Key("ci", gpu.index, ci.serial))

    def _mig_handle(self, gpu: SimGpu, ci: SimComputeInstance) -> int:
        return self._handles.address(_Key("mig", gpu.index, ci.serial))

    def _key(self, node: SimNode, handle: Any, *kinds: str) -> tuple[_Key, SimGpu]:
        key = self._handles.key(handle)
        if key is None or key.kind not in kinds or key.gpu >= len(node.gpus):
            raise Refused(st.INVALID_ARGUMENT)
        return key, node.gpus[key.gpu]

    def _parent(self, node: SimNode, handle: Any) -> SimGpu:
        return self._key(node, handle, "gpu")[1]

    def _device(
        self, node: SimNode, handle: Any
    ) -> tuple[SimGpu, tuple[SimGpuInstance, SimComputeInstance] | None]:
        """A GPU or MIG device handle: the GPU and, for a MIG device, its GI and CI."""
        key, gpu = self._key(node, handle, "gpu", "mig")
        if key.kind == "gpu":
            return gpu, None
        found = gpu.ci_by_serial(key.serial)
        if found is None:
            raise Refused(st.INVALID_ARGUMENT)
        return gpu, found

    def _gi(self, node: SimNode, handle: Any) -> tuple[SimGpu, SimGpuInstance]:
        key, gpu = self._key(node, handle, "gi")
        gi = gpu.gi_by_serial(key.serial)
        if gi is None:
            raise Refused(st.INVALID_ARGUMENT)
        return gpu, gi

    def _ci(self, node: SimNode, handle: Any) -> tuple[SimGpu, SimGpuInstance, SimComputeInstance]:
        key, gpu = self._key(node, handle, "ci")
        found = gpu.ci_by_serial(key.serial)
        if found is None:
            raise Refused(st.INVALID_ARGUMENT)
        return gpu, *found

    # -- init, system ------------------------------------------------------------------------------

    @_export("nvmlInitWithFlags", needs_init=False, uses_state=False)
    def _init_with_flags(self, flags: Any = 0) -> int:
        _uint(flags, "nvmlInitWithFlags")
        if not self._store.exists():
            return st.DRIVER_NOT_LOADED
        self._store.read()  # a broken state file fails here, loudly
        self._init_count += 1
        return st.SUCCESS

    @_export("nvmlInit_v2", "nvmlInit", needs_init=False, uses_state=False)
    def _init(self) -> int:
        return self._init_with_flags(0)

    @_export("nvmlShutdown", uses_state=False)
    def _shutdown(self) -> int:
        self._init_count -= 1
        if self._init_count == 0:
            self._store.close()
        return st.SUCCESS

    @_export("nvmlErrorString", needs_init=False, uses_state=False)
    def _error_string(self, code: Any) -> bytes:
        return ERROR_STRINGS.get(_uint(code, "nvmlErrorString"), "Unknown Error").encode()

    @_export("nvmlSystemGetDriverVersion")
    def _driver_version(self, node: SimNode, buf: Any, length: Any) -> None:
        _text_out(buf, length, node.driver_version, "nvmlSystemGetDriverVersion")

    @_export("nvmlSystemGetNVMLVersion")
    def _nvml_version(self, node: SimNode, buf: Any, length: Any) -> None:
        _text_out(buf, length, node.nvml_version, "nvmlSystemGetNVMLVersion")

    @_export("nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2")
    def _cuda_version(self, node: SimNode, out: Any) -> None:
        _out(out, "nvmlSystemGetCudaDriverVersion").value = node.cuda_version

    # -- devices -----------------------------------------------------------------------------------

    # GPUs and MIG devices are enumerated as the caller sees them (migsim.nvml.visibility):
    # indices are positions among the visible ones, the others are not found.

    @_export("nvmlDeviceGetCount_v2", viewed=True)
    def _count(self, node: SimNode, out: Any, *, view: Visibility) -> None:
        _out(out, "nvmlDeviceGetCount_v2").value = len(view.gpus(node))

    @_export("nvmlDeviceGetHandleByIndex_v2", viewed=True)
    def _by_index(self, node: SimNode, index: Any, out: Any, *, view: Visibility) -> None:
        i = _uint(index, "nvmlDeviceGetHandleByIndex_v2")
        gpus = view.gpus(node)
        if i >= len(gpus):
            raise Refused(st.INVALID_ARGUMENT)
        _store_address(_out(out, "nvmlDeviceGetHandleByIndex_v2"), self._gpu_handle(gpus[i].index))

    @_export("nvmlDeviceGetHandleByUUID", viewed=True)
    def _by_uuid(self, node: SimNode, uuid: Any, out: Any, *, view: Visibility) -> None:
        text = _text_in(uuid, "nvmlDeviceGetHandleByUUID")
        target = _out(out, "nvmlDeviceGetHandleByUUID")
        for gpu in view.gpus(node):
            if gpu.uuid == text:
                _store_address(target, self._gpu_handle(gpu.index))
                return
            for _, ci in view.mig_devices(gpu):
                if ci.uuid == text:
                    _store_address(target, self._mig_handle(gpu, ci))
                    return
        raise Refused(st.NOT_FOUND)

    @_export("nvmlDeviceGetHandleByPciBusId_v2", viewed=True)
    def _by_bus_id(self, node: SimNode, bus: Any, out: Any, *, view: Visibility) -> None:
        text = _text_in(bus, "nvmlDeviceGetHandleByPciBusId_v2").upper()
        if text.count(":") == 1:
            text = "00000000:" + text
        elif len(text.split(":")[0]) == 4:
            text = "0000" + text
        gpu = next((g for g in view.gpus(node) if g.bus_id.upper() == text), None)
        if gpu is None:
            raise Refused(st.NOT_FOUND)
        _store_address(_out(out, "nvmlDeviceGetHandleByPciBusId_v2"), self._gpu_handle(gpu.index))

    @_export("nvmlDeviceGetName")
    def _name(self, node: SimNode, handle: Any, buf: Any, length: Any) -> None:
        gpu, mig = self._device(node, handle)
        name = gpu.model.name
        if mig is not None:
            gp = st.gi_profile(gpu, mig[0].profile_id)
            name += " MIG " + gp.ci_name(st.ci_profile(gpu, mig[0], mig[1].profile_id))
        _text_out(buf, length, name, "nvmlDeviceGetName")

    @_export("nvmlDeviceGetUUID")
    def _uuid(self, node: SimNode, handle: Any, buf: Any, length: Any) -> None:
        gpu, mig = self._device(node, handle)
        _text_out(buf, length, gpu.uuid if mig is None else mig[1].uuid, "nvmlDeviceGetUUID")

    @_export("nvmlDeviceGetIndex", viewed=True)
    def _index(self, node: SimNode, handle: Any, out: Any, *, view: Visibility) -> None:
        gpu, mig = self._device(node, handle)
        if mig is None:
            gpus = [g.index for g in view.gpus(node)]
            index = gpus.index(gpu.index) if gpu.index in gpus else None
        else:
            devices = view.mig_devices(gpu)
            index = devices.index(mig) if mig in devices else None
        if index is None:  # a handle of a device the caller was not given
            raise Refused(st.INVALID_ARGUMENT)
        _out(out, "nvmlDeviceGetIndex").value = index

    @_export("nvmlDeviceGetMinorNumber")
    def _minor(self, node: SimNode, handle: Any, out: Any) -> None:
        _out(out, "nvmlDeviceGetMinorNumber").value = self._parent(node, handle).index

    @_export("nvmlDeviceGetPciInfo_v3")
    def _pci(self, node: SimNode, handle: Any, out: Any) -> None:
        gpu, _ = self._device(node, handle)
        info = _out(out, "nvmlDeviceGetPciInfo_v3")
        domain, bus, rest = gpu.bus_id.split(":")
        m = gpu.model
        _zero(info)
        info.busIdLegacy = f"{int(domain, 16):04x}:{bus}:{rest}".encode()
        info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(rest[:2], 16)
        info.pciDeviceId, info.pciSubSystemId = m.pci_device_id, m.pci_subsystem_id
        info.busId = gpu.bus_id.encode()

    @_export("nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2")
    def _memory(self, node: SimNode, handle: Any, out: Any) -> None:
        gpu, mig = self._device(node, handle)
        info = _out(out, "nvmlDeviceGetMemoryInfo")
        if hasattr(info, "version"):
            _check_version(info, 2)
        if mig is None:
            total, procs = gpu.model.memory_total_mib, gpu.processes
        else:
            gi, ci = mig
            total = st.gi_profile(gpu, gi.profile_id).memory_mib
            procs = [p for p in gpu.processes if (p.gi, p.ci) == (gi.id, ci.id)]
        used = sum(p.used_memory_mib for p in procs) << 20
        info.total, info.used, info.free = total << 20, used, max(0, (total << 20) - used)

    @_export("nvmlDeviceGetArchitecture")
    def _arch(self, node: SimNode, handle: Any, out: Any) -> None:
        gpu, _ = self._device(node, handle)
        _out(out, "nvmlDeviceGetArchitecture").value = gpu.model.architecture.nvml_code

    @_export("nvmlDeviceGetCudaComputeCapability")
    def _compute_capability(self, node: SimNode, handle: Any, major: Any, minor: Any) -> None:
        gpu, _ = self._device(node, handle)
        cc = gpu.model.compute_capability
        _out(major, "nvmlDeviceGetCudaComputeCapability").value = cc[0]
        _out(minor, "nvmlDeviceGetCudaComputeCapability").value = cc[1]

    @_export("nvmlDeviceGetTopologyCommonAncestor")
    def _common_ancestor(self, node: SimNode, first: Any, second: Any, out: Any) -> None:
        a, b = self._parent(node, first), self._parent(node, second)
        level = _TOPOLOGY_INTERNAL if a.index == b.index else _TOPOLOGY_NODE
        _out(out, "nvmlDeviceGetTopologyCommonAncestor").value = level

    @_export("nvmlDeviceGetSupportedEventTypes")
    def _event_types(self, node: SimNode, handle: Any, out: Any) -> None:
        self._parent(node, handle)
        _out(out, "nvmlDeviceGetSupportedEventTypes").value = SUPPORTED_EVENT_TYPES

    @_export("nvmlDeviceGetVirtualizationMode")
    def _virt(self, node: SimNode, handle: Any, out: Any) -> None:
        self._parent(node, handle)
        _out(out, "nvmlDeviceGetVirtualizationMode").value = node.virtualization_mode

    # -- what nvidia-smi's table shows: the model's readings of an idle GPU, host settings ------

    @staticmethod
    def _readings(gpu: SimGpu) -> Readings:
        r = gpu.model.readings
        if r is None:  # no readout of this model: nothing to report (nvidia-smi prints N/A)
            raise Refused(st.NOT_SUPPORTED)
        return r

    @_export("nvmlDeviceGetPersistenceMode")
    def _persistence(self, node: SimNode, handle: Any, out: Any) -> None:
        self._parent(node, handle)
        _out(out, "nvmlDeviceGetPersistenceMode").value = int(node.persistence_mode)

    @_export("nvmlDeviceGetDisplayActive")
    def _display_active(self, node: SimNode, handle: Any, out: Any) -> None:
        # Data-centre GPUs drive no display (smi-q Display Active: Disabled; the table's "Off").
        self._parent(node, handle)
        _out(out, "nvmlDeviceGetDisplayActive").value = 0

    @_export("nvmlDeviceGetEccMode")
    def _ecc_mode(self, node: SimNode, handle: Any, current: Any, pending: Any) -> None:
        enabled = int(self._readings(self._parent(node, handle)).ecc_enabled)
        _out(current, "nvmlDeviceGetEccMode").value = enabled
        _out(pending, "nvmlDeviceGetEccMode").value = enabled

    @_export("nvmlDeviceGetTotalEccErrors")
    def _ecc_errors(
        self, node: SimNode, handle: Any, error_type: Any, counter: Any, out: Any
    ) -> None:
        gpu, mig = self._device(node, handle)
        _uint(error_type, "memory error type")
        if _uint(counter, "ECC counter type") not in (_VOLATILE_ECC, _AGGREGATE_ECC):
            raise Refused(st.INVALID_ARGUMENT)
        if not self._readings(gpu).ecc_enabled:
            raise Refused(st.NOT_SUPPORTED)
        # NB: with MIG on, the parent GPU's counts are not answered: nvidia-smi then shows the
        # ECC mode ("On") in the Volatile Uncorr. ECC column, as every MIG-enabled GPU's row in
        # nvidia-smi's output does; the MIG devices answer their own. A fresh GPU counts none.
        if mig is None and gpu.mig_current:
            raise Refused(st.NOT_SUPPORTED)
        _out(out, "nvmlDeviceGetTotalEccErrors").value = 0

    @_export("nvmlDeviceGetTemperature")
    def _temperature(self, node: SimNode, handle: Any, sensor: Any, out: Any) -> None:
        r = self._readings(self._parent(node, handle))
        if _uint(sensor, "temperature sensor") != _TEMPERATURE_GPU:
            raise Refused(st.INVALID_ARGUMENT)
        _out(out, "nvmlDeviceGetTemperature").value = r.temperature_c

    @_export("nvmlDeviceGetPerformanceState")
    def _performance_state(self, node: SimNode, handle: Any, out: Any) -> None:
        r = self._readings(self._parent(node, handle))
        _out(out, "nvmlDeviceGetPerformanceState").value = r.performance_state

    @_export("nvmlDeviceGetPowerUsage")
    def _power_usage(self, node: SimNode, handle: Any, out: Any) -> None:
        r = self._readings(self._parent(node, handle))
        _out(out, "nvmlDeviceGetPowerUsage").value = r.power_draw_mw

    @_export("nvmlDeviceGetEnforcedPowerLimit")
    def _power_limit(self, node: SimNode, handle: Any, out: Any) -> None:
        r = self._readings(self._parent(node, handle))
        _out(out, "nvmlDeviceGetEnforcedPowerLimit").value = r.power_limit_mw

    @_export("nvmlDeviceGetUtilizationRates")
    def _utilization(self, node: SimNode, handle: Any, out: Any) -> None:
        gpu = self._parent(node, handle)
        self._readings(gpu)
        if gpu.mig_current:  # per-GPU utilization is not sampled in MIG mode (nvidia-smi: N/A)
            raise Refused(st.NOT_SUPPORTED)
        u = _out(out, "nvmlDeviceGetUtilizationRates")
        u.gpu, u.memory = 0, 0  # idle: smi-q Utilization GPU 0 %, Memory 0 %

    @_export("nvmlDeviceGetComputeMode")
    def _compute_mode(self, node: SimNode, handle: Any, out: Any) -> None:
        self._parent(node, handle)
        _out(out, "nvmlDeviceGetComputeMode").value = _COMPUTEMODE_DEFAULT  # smi-q: Default

    @_export("nvmlSystemGetProcessName")
    def _process_name(self, node: SimNode, pid: Any, buf: Any, length: Any) -> None:
        wanted = _uint(pid, "nvmlSystemGetProcessName")
        for gpu in node.gpus:
            for p in gpu.processes:
                if p.pid == wanted and p.name:
                    _text_out(buf, length, p.name, "nvmlSystemGetProcessName")
                    return
        raise Refused(st.NOT_FOUND)

    @_export("nvmlDeviceGetFieldValues")
    def _fields(self, node: SimNode, handle: Any, count: Any, values: Any) -> None:
        gpu = self._parent(node, handle)
        n = _uint(count, "nvmlDeviceGetFieldValues")
        arr, _ = _array(values, n, n, "nvmlDeviceGetFieldValues")
        m = gpu.model
        known = {
            _FI_RESETLESS_MIG: int(m.mig_capable and not m.mig_mode_needs_reset),
            _FI_MIG_QUERY_INDEPENDENT: int(m.mig_capable),
        }
        for i in range(n):
            v = arr[i]
            v.timestamp, v.latencyUsec = int(time.time() * 1e6), 0
            if v.fieldId in known:
                v.nvmlReturn, v.valueType = st.SUCCESS, _VALUE_TYPE_UINT
                v.value.ullVal = known[v.fieldId]
            else:
                v.nvmlReturn = st.NOT_SUPPORTED

    @_export(
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        viewed=True,
    )
    def _processes(
        self, node: SimNode, handle: Any, count: Any, infos: Any, *, view: Visibility
    ) -> None:
        gpu, mig = self._device(node, handle)
        procs = gpu.processes
        if mig is not None:
            procs = [p for p in procs if (p.gi, p.ci) == (mig[0].id, mig[1].id)]
        elif not view.whole(gpu):  # a GPU seen through some of its MIG devices: theirs only
            ids = {(gi.id, ci.id) for gi, ci in view.mig_devices(gpu)}
            procs = [p for p in procs if (p.gi, p.ci) in ids]
        self._write_processes(procs, count, infos)

    @_export(
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    )
    def _no_processes(self, node: SimNode, handle: Any, count: Any, infos: Any) -> None:
        self._device(node, handle)
        self._write_processes([], count, infos)

    @staticmethod
    def _write_processes(procs: Sequence[st.SimProcess], count: Any, infos: Any) -> None:
        # Two-call protocol: NULL array -> SUCCESS if none, else INSUFFICIENT_SIZE + needed count.
        c = _out(count, "running processes count")
        if infos is None or c.value < len(procs):
            c.value = len(procs)
            if procs:
                raise Refused(st.INSUFFICIENT_SIZE)
            return
        arr, _ = _array(infos, c.value, len(procs), "running processes")
        for i, p in enumerate(procs):
            arr[i].pid, arr[i].usedGpuMemory = p.pid, p.used_memory_mib << 20
            arr[i].gpuInstanceId = _NO_ID if p.gi is None else p.gi
            arr[i].computeInstanceId = _NO_ID if p.ci is None else p.ci
        c.value = len(procs)

    # -- MIG mode ----------------------------------------------------------------------------------

    @_export("nvmlDeviceGetMigMode")
    def _get_mig_mode(self, node: SimNode, handle: Any, current: Any, pending: Any) -> None:
        gpu = self._parent(node, handle)
        if not gpu.model.mig_capable:
            raise Refused(st.NOT_SUPPORTED)
        _out(current, "nvmlDeviceGetMigMode").value = int(gpu.mig_current)
        _out(pending, "nvmlDeviceGetMigMode").value = int(gpu.mig_pending)

    @_export("nvmlDeviceSetMigMode", mutating=True)
    def _set_mig_mode(self, node: SimNode, handle: Any, mode: Any, status: Any) -> None:
        gpu = self._parent(node, handle)
        out = _out(status, "nvmlDeviceSetMigMode")
        out.value = st.set_mig_mode(node, gpu, _uint(mode, "nvmlDeviceSetMigMode"))

    @_export("nvmlDeviceGetMaxMigDeviceCount")
    def _max_mig(self, node: SimNode, handle: Any, out: Any) -> None:
        gpu = self._parent(node, handle)
        _out(out, "nvmlDeviceGetMaxMigDeviceCount").value = gpu.max_mig_devices()

    @_export("nvmlDeviceGetMigDeviceHandleByIndex", viewed=True)
    def _mig_by_index(
        self, node: SimNode, handle: Any, index: Any, out: Any, *, view: Visibility
    ) -> None:
        gpu = self._parent(node, handle)
        devices = view.mig_devices(gpu)
        i = _uint(index, "nvmlDeviceGetMigDeviceHandleByIndex")
        if i >= len(devices):
            raise Refused(st.NOT_FOUND)
        _store_address(
            _out(out, "nvmlDeviceGetMigDeviceHandleByIndex"), self._mig_handle(gpu, devices[i][1])
        )

    @_export("nvmlDeviceIsMigDeviceHandle")
    def _is_mig(self, node: SimNode, handle: Any, out: Any) -> None:
        _, mig = self._device(node, handle)
        _out(out, "nvmlDeviceIsMigDeviceHandle").value = int(mig is not None)

    def _mig(self, node: SimNode, handle: Any) -> tuple[SimGpu, SimGpuInstance, SimComputeInstance]:
        gpu, mig = self._device(node, handle)
        if mig is None:
            raise Refused(st.INVALID_ARGUMENT)
        return gpu, *mig

    @_export("nvmlDeviceGetGpuInstanceId")
    def _mig_gi_id(self, node: SimNode, handle: Any, out: Any) -> None:
        _out(out, "nvmlDeviceGetGpuInstanceId").value = self._mig(node, handle)[1].id

    @_export("nvmlDeviceGetComputeInstanceId")
    def _mig_ci_id(self, node: SimNode, handle: Any, out: Any) -> None:
        _out(out, "nvmlDeviceGetComputeInstanceId").value = self._mig(node, handle)[2].id

    @_export("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
    def _mig_parent(self, node: SimNode, handle: Any, out: Any) -> None:
        gpu = self._mig(node, handle)[0]
        _store_address(
            _out(out, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle"), self._gpu_handle(gpu.index)
        )

    @_export("nvmlDeviceGetAttributes_v2")
    def _attributes(self, node: SimNode, handle: Any, out: Any) -> None:
        gpu, mig = self._device(node, handle)
        if mig is None:
            raise Refused(st.NOT_SUPPORTED)
        gi, ci = mig
        gp = st.gi_profile(gpu, gi.profile_id)
        cp = st.ci_profile(gpu, gi, ci.profile_id)
        a = _out(out, "nvmlDeviceGetAttributes_v2")
        e = gp.engines
        a.multiprocessorCount = cp.multiprocessors
        a.sharedCopyEngineCount, a.sharedDecoderCount = e.copy, e.decoder
        a.sharedEncoderCount, a.sharedJpegCount, a.sharedOfaCount = e.encoder, e.jpeg, e.ofa
        a.gpuInstanceSliceCount, a.computeInstanceSliceCount = gp.slices, cp.slices
        a.memorySizeMB = gp.memory_mib

    # -- GPU instances -----------------------------------------------------------------------------

    @staticmethod
    def _gi_profile_at(node: SimNode, gpu: SimGpu, index: int) -> GiProfile:
        if not 0 <= index < node.gi_profile_indices:
            raise Refused(st.INVALID_ARGUMENT)
        p = gpu.model.gi_profile_at(index)
        if p is None:  # every index this model lacks, as go-nvlib's walk over them expects
            raise Refused(st.NOT_SUPPORTED)
        return p

    @staticmethod
    def _check_profile_info_answered(node: SimNode, gpu: SimGpu) -> None:
        # Drivers that list GI profiles only while MIG mode is on (SimNode.profile_info_needs_mig).
        if node.profile_info_needs_mig and not gpu.mig_current:
            raise Refused(st.NOT_SUPPORTED)

    @staticmethod
    def _fill_gi_profile(info: Any, p: GiProfile) -> None:
        # The driver hands the struct back zeroed, version included (measured on an H200).
        _zero(info)
        info.id, info.isP2pSupported, info.sliceCount = p.id, 0, p.slices
        info.instanceCount, info.multiprocessorCount = p.instance_count, p.multiprocessors
        e = p.engines
        info.copyEngineCount, info.decoderCount, info.encoderCount = e.copy, e.decoder, e.encoder
        info.jpegCount, info.ofaCount, info.memorySizeMB = e.jpeg, e.ofa, p.memory_mib
        if hasattr(info, "name"):
            info.name = f"MIG {p.name}".encode()

    @_export("nvmlDeviceGetGpuInstanceProfileInfo", "nvmlDeviceGetGpuInstanceProfileInfoV")
    def _gi_profile_info(self, node: SimNode, handle: Any, index: Any, out: Any) -> None:
        gpu = self._parent(node, handle)
        info = _out(out, "nvmlDeviceGetGpuInstanceProfileInfo")
        if hasattr(info, "version"):
            _check_version(info, 2)
        self._check_profile_info_answered(node, gpu)
        p = self._gi_profile_at(node, gpu, _uint(index, "profile index"))
        self._fill_gi_profile(info, p)

    @_export("nvmlDeviceGetGpuInstanceProfileInfoByIdV")
    def _gi_profile_info_by_id(self, node: SimNode, handle: Any, pid: Any, out: Any) -> None:
        gpu = self._parent(node, handle)
        info = _out(out, "nvmlDeviceGetGpuInstanceProfileInfoByIdV")
        _check_version(info, 2)
        self._check_profile_info_answered(node, gpu)
        profile_id = _uint(pid, "profile id")
        p = gpu.model.gi_profile_by_id(profile_id)
        if p is None:
            known = st.DRIVER_GI_PROFILE_IDS if gpu.model.mig_capable else frozenset()
            raise Refused(st.NOT_FOUND if profile_id in known else st.INVALID_ARGUMENT)
        self._fill_gi_profile(info, p)

    @_export("nvmlDeviceGetGpuInstancePossiblePlacements_v2")
    def _gi_placements(
        self, node: SimNode, handle: Any, pid: Any, placements: Any, count: Any
    ) -> None:
        gpu = self._parent(node, handle)
        p = st.gi_profile(gpu, _uint(pid, "profile id"))
        self._write_placements(
            p.placements, placements, count, "nvmlDeviceGetGpuInstancePossiblePlacements_v2"
        )

    @staticmethod
    def _write_placements(pls: Sequence[Placement], arr_arg: Any, count: Any, what: str) -> None:
        c = _out(count, what)
        if arr_arg is not None:  # NULL array: a count query
            arr, _ = _array(arr_arg, c.value, len(pls), what)
            for i, pl in enumerate(pls):
                arr[i].start, arr[i].size = pl.start, pl.size
        c.value = len(pls)

    @_export("nvmlDeviceGetGpuInstanceRemainingCapacity")
    def _gi_remaining(self, node: SimNode, handle: Any, pid: Any, out: Any) -> None:
        gpu = self._parent(node, handle)
        remaining = st.gi_remaining(gpu, _uint(pid, "profile id"))
        _out(out, "nvmlDeviceGetGpuInstanceRemainingCapacity").value = remaining

    @_export("nvmlDeviceCreateGpuInstance", mutating=True)
    def _create_gi(self, node: SimNode, handle: Any, pid: Any, out: Any) -> None:
        gpu = self._parent(node, handle)
        target = _out(out, "nvmlDeviceCreateGpuInstance")
        gi = st.create_gi(node, gpu, _uint(pid, "profile id"), None)
        _store_address(target, self._gi_handle(gpu, gi))

    @_export("nvmlDeviceCreateGpuInstanceWithPlacement", mutating=True)
    def _create_gi_at(self, node: SimNode, handle: Any, pid: Any, placement: Any, out: Any) -> None:
        gpu = self._parent(node, handle)
        what = "nvmlDeviceCreateGpuInstanceWithPlacement"
        target = _out(out, what)
        gi = st.create_gi(node, gpu, _uint(pid, "profile id"), _placement_in(placement, what))
        _store_address(target, self._gi_handle(gpu, gi))

    @_export("nvmlGpuInstanceDestroy", mutating=True)
    def _destroy_gi(self, node: SimNode, handle: Any) -> None:
        st.destroy_gi(*self._gi(node, handle))

    @_export("nvmlDeviceGetGpuInstances")
    def _gis(self, node: SimNode, handle: Any, pid: Any, arr_arg: Any, count: Any) -> None:
        gpu = self._parent(node, handle)
        profile_id = _uint(pid, "profile id")
        st.gi_profile(gpu, profile_id)
        gis = [g for g in gpu.gpu_instances if g.profile_id == profile_id]
        _write_handles(
            arr_arg, count, [self._gi_handle(gpu, gi) for gi in gis], "nvmlDeviceGetGpuInstances"
        )

    @_export("nvmlDeviceGetGpuInstanceById")
    def _gi_by_id(self, node: SimNode, handle: Any, gi_id: Any, out: Any) -> None:
        gpu = self._parent(node, handle)
        gi = gpu.gi(_uint(gi_id, "GPU instance id"))
        if gi is None:
            raise Refused(st.NOT_FOUND)
        _store_address(_out(out, "nvmlDeviceGetGpuInstanceById"), self._gi_handle(gpu, gi))

    @_export("nvmlGpuInstanceGetInfo")
    def _gi_info(self, node: SimNode, handle: Any, out: Any) -> None:
        gpu, gi = self._gi(node, handle)
        info = _out(out, "nvmlGpuInstanceGetInfo")
        _store_field_address(info, "device", self._gpu_handle(gpu.index))
        info.id, info.profileId = gi.id, gi.profile_id
        info.placement.start, info.placement.size = gi.start, gi.size

    # -- compute instances -------------------------------------------------------------------------

    @staticmethod
    def _ci_profile_at(gpu: SimGpu, gi: SimGpuInstance, index: int, eng: int) -> CiProfile:
        if not 0 <= index < st.CI_PROFILE_INDEX_LIMIT or eng != 0:
            raise Refused(st.INVALID_ARGUMENT)
        cp = st.gi_profile(gpu, gi.profile_id).ci_profile_at(index)
        if cp is None:
            raise Refused(st.NOT_SUPPORTED)
        return cp

    @_export(
        "nvmlGpuInstanceGetComputeInstanceProfileInfo",
        "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
    )
    def _ci_profile_info(self, node: SimNode, handle: Any, index: Any, eng: Any, out: Any) -> None:
        gpu, gi = self._gi(node, handle)
        info = _out(out, "nvmlGpuInstanceGetComputeInstanceProfileInfo")
        if hasattr(info, "version"):
            _check_version(info, 2)
        cp = self._ci_profile_at(
            gpu, gi, _uint(index, "CI profile index"), _uint(eng, "engine profile")
        )
        gp = st.gi_profile(gpu, gi.profile_id)
        e = gp.engines
        _zero(info)
        info.id, info.sliceCount, info.instanceCount = cp.id, cp.slices, cp.instance_count
        info.multiprocessorCount = cp.multiprocessors
        info.sharedCopyEngineCount, info.sharedDecoderCount = e.copy, e.decoder
        info.sharedEncoderCount, info.sharedJpegCount, info.sharedOfaCount = (
            e.encoder,
            e.jpeg,
            e.ofa,
        )
        if hasattr(info, "name"):
            info.name = f"MIG {gp.ci_name(cp)}".encode()

    @_export("nvmlGpuInstanceGetComputeInstanceRemainingCapacity")
    def _ci_remaining(self, node: SimNode, handle: Any, pid: Any, out: Any) -> None:
        gpu, gi = self._gi(node, handle)
        remaining = st.ci_remaining(gpu, gi, _uint(pid, "CI profile id"))
        _out(out, "nvmlGpuInstanceGetComputeInstanceRemainingCapacity").value = remaining

    @_export("nvmlGpuInstanceGetComputeInstancePossiblePlacements")
    def _ci_placements(
        self, node: SimNode, handle: Any, pid: Any, placements: Any, count: Any
    ) -> None:
        gpu, gi = self._gi(node, handle)
        pls = st.ci_profile(gpu, gi, _uint(pid, "CI profile id")).placements
        self._write_placements(
            pls, placements, count, "nvmlGpuInstanceGetComputeInstancePossiblePlacements"
        )

    @_export("nvmlGpuInstanceCreateComputeInstance", mutating=True)
    def _create_ci(self, node: SimNode, handle: Any, pid: Any, out: Any) -> None:
        gpu, gi = self._gi(node, handle)
        target = _out(out, "nvmlGpuInstanceCreateComputeInstance")
        ci = st.create_ci(node, gpu, gi, _uint(pid, "CI profile id"), None)
        _store_address(target, self._ci_handle(gpu, ci))

    @_export("nvmlGpuInstanceCreateComputeInstanceWithPlacement", mutating=True)
    def _create_ci_at(self, node: SimNode, handle: Any, pid: Any, placement: Any, out: Any) -> None:
        gpu, gi = self._gi(node, handle)
        what = "nvmlGpuInstanceCreateComputeInstanceWithPlacement"
        target = _out(out, what)
        ci = st.create_ci(
            node, gpu, gi, _uint(pid, "CI profile id"), _placement_in(placement, what)
        )
        _store_address(target, self._ci_handle(gpu, ci))

    @_export("nvmlComputeInstanceDestroy", mutating=True)
    def _destroy_ci(self, node: SimNode, handle: Any) -> None:
        st.destroy_ci(*self._ci(node, handle))

    @_export("nvmlGpuInstanceGetComputeInstances")
    def _cis(self, node: SimNode, handle: Any, pid: Any, arr_arg: Any, count: Any) -> None:
        gpu, gi = self._gi(node, handle)
        profile_id = _uint(pid, "CI profile id")
        st.ci_profile(gpu, gi, profile_id)
        cis = [c for c in gi.compute_instances if c.profile_id == profile_id]
        _write_handles(
            arr_arg,
            count,
            [self._ci_handle(gpu, ci) for ci in cis],
            "nvmlGpuInstanceGetComputeInstances",
        )

    @_export("nvmlGpuInstanceGetComputeInstanceById")
    def _ci_by_id(self, node: SimNode, handle: Any, ci_id: Any, out: Any) -> None:
        gpu, gi = self._gi(node, handle)
        ci = gi.ci(_uint(ci_id, "compute instance id"))
        if ci is None:
            raise Refused(st.NOT_FOUND)
        _store_address(_out(out, "nvmlGpuInstanceGetComputeInstanceById"), self._ci_handle(gpu, ci))

    @_export("nvmlComputeInstanceGetInfo_v2", "nvmlComputeInstanceGetInfo")
    def _ci_info(self, node: SimNode, handle: Any, out: Any) -> None:
        gpu, gi, ci = self._ci(node, handle)
        info = _out(out, "nvmlComputeInstanceGetInfo_v2")
        _store_field_address(info, "device", self._mig_handle(gpu, ci))
        _store_field_address(info, "gpuInstance", self._gi_handle(gpu, gi))
        info.id, info.profileId = ci.id, ci.profile_id
        info.placement.start, info.placement.size = ci.start, ci.size

    # -- read by NVIDIA's DRA driver (gpu-kubelet-plugin) when it discovers the GPUs -------------

    @_export("nvmlDeviceGetBrand")
    def _brand(self, node: SimNode, handle: Any, out: Any) -> None:
        # a MIG device answers its parent's brand (inferred: no readout of one)
        gpu, _ = self._device(node, handle)
        _out(out, "nvmlDeviceGetBrand").value = gpu.model.brand.nvml_code

    @_export("nvmlDeviceGetAddressingMode")
    def _addressing_mode(self, node: SimNode, handle: Any, out: Any) -> None:
        # The H200 of the captures (x86, driver 580) reads "Addressing Mode: None": supported, no
        # HMM or ATS active. Coherent platforms (Grace: ATS) are not simulated.
        self._parent(node, handle)
        info = _out(out, "nvmlDeviceGetAddressingMode")
        _check_version(info, 1)
        info.value = _ADDRESSING_MODE_NONE


# -------------------------------------------------------------------------------------------------
# CLI


def _code(text: str) -> int:
    key = text.upper().removeprefix("NVML_ERROR_")
    if key in ERROR_NAMES:
        return ERROR_NAMES[key]
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(
        f"unknown NVML error {text!r}; use a number or one of {', '.join(ERROR_NAMES)}"
    )


def _show(node: SimNode) -> str:
    virt = "pass-through VM" if node.virtualization_mode == 1 else "bare metal"
    driver = f"driver {node.driver_version}"
    if node.profile_info_needs_mig:
        driver += " (GI profile info only with MIG on)"
    if node.gi_profile_indices != st.DRIVER_GI_PROFILE_INDEX_LIMIT:
        driver += f" ({node.gi_profile_indices} GI profile indices)"
    lines = [f"node {node.name}: {len(node.gpus)} GPU(s), {virt}, {driver}"]
    for g in node.gpus:
        m = g.model
        mode = "MIG n/a"
        if m.mig_capable:
            mode = f"MIG {'on' if g.mig_current else 'off'}"
            if g.mig_pending != g.mig_current:
                mode += f" (pending {'on' if g.mig_pending else 'off'})"
        reset = "" if g.reset_supported else ", reset impossible"
        lines.append(f"GPU {g.index} {m.name} {g.bus_id} {g.uuid} {mode}{reset}")
        for gi in g.gpu_instances:
            gp = st.gi_profile(g, gi.profile_id)
            lines.append(f"  GI {gi.id:<2} {gp.name:<12} {gi.placement}")
            for ci in gi.compute_instances:
                name = gp.ci_name(st.ci_profile(g, gi, ci.profile_id))
                lines.append(f"    CI {ci.id} {name:<14} {ci.placement}  {ci.uuid}")
        for p in g.processes:
            where = "" if p.gi is None else f" on gi={p.gi} ci={p.ci}"
            lines.append(f"  process {p.pid}{where} ({p.used_memory_mib} MiB)")
    for r in node.fail_rules:
        target = r.function or "mutating calls"
        on = "" if r.gpu is None else f" on GPU {r.gpu}"
        lines.append(
            f"fault: {target}{on}: skip {r.skip}, then fail {r.times}x with "
            f"{ERROR_STRINGS.get(r.code, r.code)}"
        )
    if node.latency_seconds:
        lines.append(f"latency: {node.latency_seconds}s per {node.latency_scope} call")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m migsim.nvml",
        description="Simulated GPU node for mig-agent (no GPU needed).",
    )
    p.add_argument(
        "--state",
        default=os.environ.get(ENV_STATE),
        help=f"node state file (default: ${ENV_STATE})",
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("create", help="create (or replace) a simulated node")
    c.add_argument("--gpus", required=True, help='e.g. "8xH100-80GB" or "2xA100-40GB,2xA30"')
    c.add_argument("--name")
    c.add_argument("--seed", help="UUID seed (default: the node name)")
    c.add_argument("--passthrough", action="store_true", help="pass-through VM: no GPU reset")
    c.add_argument("--mig-enabled", action="store_true")
    c.add_argument(
        "--ampere-self-reset",
        action="store_true",
        help="Ampere MIG mode changes apply at once when the GPU is idle",
    )
    c.add_argument(
        "--profile-info-needs-mig",
        action="store_true",
        help="a driver that answers GI profile info NOT_SUPPORTED while MIG is off",
    )
    c.add_argument(
        "--driver-knows-3-slice-gfx",
        action="store_true",
        help="a driver whose GI profile table includes index 0x11 (NOT_SUPPORTED, not "
        "INVALID_ARGUMENT, where a GPU lacks it)",
    )

    s = sub.add_parser("show", help="print the node")
    s.add_argument("--json", action="store_true")

    r = sub.add_parser("reset", help="reset a GPU (nvidia-smi -r)")
    r.add_argument("gpu", type=int)
    sub.add_parser("reboot", help="reboot the node")

    pr = sub.add_parser("process", help="add or remove a process")
    prs = pr.add_subparsers(dest="action", required=True)
    pa = prs.add_parser("add")
    pa.add_argument("gpu", type=int)
    pa.add_argument("pid", type=int)
    pa.add_argument("--gi", type=int)
    pa.add_argument("--ci", type=int)
    pa.add_argument("--memory", type=int, default=1024, help="MiB")
    pa.add_argument("--name", default="", help="its name as NVML reports it (nvidia-smi)")
    pd = prs.add_parser("remove")
    pd.add_argument("pid", type=int)
    pd.add_argument("--gpu", type=int)

    f = sub.add_parser("fault", help="inject faults")
    fs = f.add_subparsers(dest="action", required=True)
    ff = fs.add_parser("fail", help="fail the Nth matching call with an NVML error")
    ff.add_argument("code", type=_code, help="e.g. IN_USE, INSUFFICIENT_RESOURCES or 999")
    ff.add_argument("--function", help="C function name (default: any mutating call)")
    ff.add_argument("--nth", type=int, default=1)
    ff.add_argument("--times", type=int, default=1)
    ff.add_argument("--gpu", type=int)
    fl = fs.add_parser("latency", help="seconds added to each mutating (or every) call")
    fl.add_argument("seconds", type=float)
    fl.add_argument("--all", action="store_true", help="every call, not only mutating ones")
    fr = fs.add_parser("reset", help="make GPU reset possible or impossible")
    fr.add_argument("possible", choices=["on", "off"])
    fr.add_argument("--gpu", type=int)
    fs.add_parser("clear", help="remove fault rules and latency")

    x = sub.add_parser("xid", help="a GPU (or its MIG device) reports an Xid error event")
    x.add_argument("gpu", type=int)
    x.add_argument("xid", type=int, help="e.g. 79 (fallen off the bus) or 48 (DBE)")
    x.add_argument("--gi", type=int)
    x.add_argument("--ci", type=int)

    n = sub.add_parser("counts", help="mutating calls per GPU and function")
    n.add_argument("--reset", action="store_true")
    n.add_argument("--json", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    path = args.state
    if not path:
        print(f"no state file: pass --state FILE or set {ENV_STATE}", file=sys.stderr)
        return 2
    try:
        return _run_cli(args, path)
    except (SimError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _run_cli(args: argparse.Namespace, path: str) -> int:
    match args.cmd:
        case "create":
            create_node(
                path,
                args.gpus,
                name=args.name,
                seed=args.seed,
                reset_supported=not args.passthrough,
                passthrough=args.passthrough,
                mig_enabled=args.mig_enabled,
                ampere_self_reset=args.ampere_self_reset,
                profile_info_needs_mig=args.profile_info_needs_mig,
                driver_knows_3_slice_gfx=args.driver_knows_3_slice_gfx,
            )
            print(_show(load_node(path)))
        case "show":
            node = load_node(path)
            print(json.dumps(asdict(node), indent=1) if args.json else _show(node))
        case "reset":
            reset_gpu(path, args.gpu)
        case "reboot":
            reboot_node(path)
        case "process" if args.action == "add":
            add_process(
                path,
                args.gpu,
                args.pid,
                gi=args.gi,
                ci=args.ci,
                used_memory_mib=args.memory,
                name=args.name,
            )
        case "process":
            if not remove_process(path, args.pid, gpu=args.gpu):
                print(f"no process {args.pid}", file=sys.stderr)
                return 1
        case "fault":
            match args.action:
                case "fail":
                    inject_failure(
                        path,
                        args.code,
                        function=args.function,
                        nth=args.nth,
                        times=args.times,
                        gpu=args.gpu,
                    )
                case "latency":
                    set_latency(path, args.seconds, scope="all" if args.all else "mutating")
                case "reset":
                    set_reset_supported(path, args.possible == "on", gpu=args.gpu)
                case _:
                    clear_faults(path)
        case "xid":
            raise_xid(path, args.gpu, args.xid, gi=args.gi, ci=args.ci)
        case "counts":
            counts = call_counts(path)
            if args.json:
                print(json.dumps({str(g): dict(f) for g, f in counts.by_gpu_function.items()}))
            else:
                print(f"mutating calls: {counts.total}")
                for g, per in sorted(counts.by_gpu_function.items()):
                    detail = ", ".join(f"{fn} {n}" for fn, n in sorted(per.items()))
                    print(f"  GPU {g}: {sum(per.values())} ({detail})")
            if args.reset:
                reset_call_counts(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
