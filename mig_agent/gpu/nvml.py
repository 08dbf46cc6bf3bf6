"""NvmlGpuBackend: the GpuBackend over pynvml, over the real NVML library or one it is handed.

The only module that imports pynvml. It hides pynvml's traps (nvml-mig.md): GI profile *index*
vs *id*, placement and instance arrays that NVML fills without bounds checks (sized here from the
NULL count query and instanceCount), ``nvmlDeviceSetMigMode`` returning the activation status as a
plain int, ``nvmlDeviceIsMigDeviceHandle`` returning a c_uint. Every NVMLError becomes a GpuError
(GpuBusy, GpuResetRequired, GpuUnavailable) in ``_nvml``, with the operation in the message.

It must not decide anything (that is the planner's and executor's job): it reports and obeys.
One exception to "reports": NVML lists compute-instance profiles only inside a GPU instance, so on
a model the catalog does not know, reading its profiles may create a GPU instance without compute
instances and destroy it again (``_ci_profiles_of``).

Every call that changes a GPU (MUTATING_NVML, a GPU reset) goes through one door,
``NvmlGpuBackend._mutate``; a backend opened ``read_only`` (``mig-agent run --observe``) refuses
there with ObserveOnlyRefused before anything is called, whatever code asked for it.
"""

from __future__ import annotations

import ctypes
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from ctypes import byref, c_uint
from dataclasses import replace
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

import pynvml

from mig_agent.core.errors import (
    GpuBusy,
    GpuError,
    GpuResetRequired,
    GpuUnavailable,
    ObserveOnlyRefused,
)
from mig_agent.core.gpu_models import (
    CI_INDEX_BY_SLICES,
    GI_INDEX_SHAPE,
    GI_PROFILE_INDEX_COUNT,
    MODEL_BY_PCI_ID,
    Architecture,
    CiProfile,
    Engines,
    GiProfile,
    GpuModel,
    mig_name,
)
from mig_agent.core.observed import (
    ComputeInstance,
    GpuInfo,
    GpuInstance,
    GpuProcess,
    GpuState,
    NodeState,
)
from mig_agent.core.placement import Placement
from mig_agent.gpu.backend import GpuBackend

_ERROR_BY_CODE: Mapping[int, type[GpuError]] = {
    pynvml.NVML_ERROR_IN_USE: GpuBusy,
    pynvml.NVML_ERROR_RESET_REQUIRED: GpuResetRequired,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: GpuUnavailable,
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: GpuUnavailable,
    pynvml.NVML_ERROR_UNINITIALIZED: GpuUnavailable,
}
_ABSENT = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT)
_NO_ID = 0xFFFFFFFF
_ARCHITECTURE = {
    pynvml.NVML_DEVICE_ARCH_AMPERE: Architecture.AMPERE,
    pynvml.NVML_DEVICE_ARCH_HOPPER: Architecture.HOPPER,
    pynvml.NVML_DEVICE_ARCH_BLACKWELL: Architecture.BLACKWELL,
    pynvml.NVML_DEVICE_ARCH_TURING: Architecture.TURING,
}

# The NVML calls that change a GPU: made through NvmlGpuBackend._mutate only (tests/gpu/
# test_read_only.py reads this module to hold it to that), where a read-only backend refuses them.
MUTATING_NVML = frozenset(
    {
        "nvmlDeviceSetMigMode",
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
        "nvmlComputeInstanceDestroy",
        "nvmlGpuInstanceDestroy",
    }
)
_T = TypeVar("_T")

# pynvml keeps its library in a module global; backends over different libraries (two simulated
# nodes in one process, say) take turns installing theirs under this lock.
_LIB_LOCK = threading.RLock()


@contextmanager
def _nvml(op: str, **context: object) -> Iterator[None]:
    """Turn an NVMLError raised in the block into the project's GpuError for ``op``."""
    try:
        yield
    except pynvml.NVMLError as exc:
        code = int(exc.value)
        cls = _ERROR_BY_CODE.get(code, GpuError)
        raise cls(f"{op}: {exc}", op=op, nvml_code=code, **context) from exc


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class MigDevice(NamedTuple):
    """One MIG device (a compute instance) as a device plugin sees it."""

    gpu: int
    gi_id: int
    ci_id: int
    uuid: str
    name: str  # e.g. "3g.71gb", "1c.3g.71gb", "1g.18gb+me"


class NvmlGpuBackend(GpuBackend):
    """GpuBackend over pynvml and the library beneath it; ``reset`` resets a GPU where that is
    not ``nvidia-smi -r`` (a library that is no driver). ``read_only``: every change refused
    (observe mode)."""

    def __init__(
        self,
        lib: Any,
        previous_lib: Any,
        reset: Callable[[int], None] | None = None,
        *,
        read_only: bool = False,
    ) -> None:
        self._lib, self._previous_lib, self._reset = lib, previous_lib, reset
        self._read_only = read_only
        self._closed = False
        self._handles: dict[int, Any] = {}
        # Each GPU's model with the MIG mode (current; None without MIG) it was read under: read
        # again once that mode changes (set_mig_mode, a reset, or anyone else). Only complete
        # models are kept: see _model_under.
        self._models: dict[int, tuple[bool | None, GpuModel]] = {}
        # CI profiles as NVML lists them inside a GI, by (GPU, GI profile id).
        self._ci_table: dict[tuple[int, int], tuple[CiProfile, ...]] = {}

    # -- library lifetime --------------------------------------------------------------------------

    @contextmanager
    def _active(self) -> Iterator[None]:
        with _LIB_LOCK:
            if self._closed:
                raise GpuUnavailable("the NVML backend is closed")
            if pynvml.nvmlLib is not self._lib:
                pynvml.nvmlLib = self._lib
                pynvml._nvmlGetFunctionPointer_cache.clear()
            yield

    def close(self) -> None:
        with _LIB_LOCK:
            if self._closed:
                return
            try:
                with self._active(), _nvml("shut down NVML"):
                    pynvml.nvmlShutdown()
            finally:
                self._closed = True
                if pynvml.nvmlLib is self._lib:
                    previous = self._previous_lib
                    if getattr(previous, "initialized", True) is False:
                        previous = None  # a backend closed before this one: nothing to restore
                    pynvml.nvmlLib = previous
                    pynvml._nvmlGetFunctionPointer_cache.clear()

    def __enter__(self) -> NvmlGpuBackend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- helpers -----------------------------------------------------------------------------------

    def _handle(self, gpu: int) -> Any:
        h = self._handles.get(gpu)
        if h is None:
            with _nvml(f"get GPU {gpu}", gpu=gpu):
                h = self._handles[gpu] = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        return h

    def _count(self) -> int:
        with _nvml("count GPUs"):
            return int(pynvml.nvmlDeviceGetCount())

    def _gi_handle(self, gpu: int, gi_id: int) -> Any:
        with _nvml(f"get GPU instance {gi_id} on GPU {gpu}", gpu=gpu, gi=gi_id):
            return pynvml.nvmlDeviceGetGpuInstanceById(self._handle(gpu), gi_id)

    @staticmethod
    def _mig_current(h: Any) -> bool | None:
        """The GPU's current MIG mode; None for a GPU without MIG."""
        try:
            return bool(pynvml.nvmlDeviceGetMigMode(h)[0])
        except pynvml.NVMLError_NotSupported:
            return None

    def _gi_profile(self, gpu: int, profile_id: int) -> GiProfile | None:
        return self._model(gpu).gi_profile_by_id(profile_id)

    @property
    def read_only(self) -> bool:
        return self._read_only

    def _mutate(self, op: str, call: Callable[..., _T], *args: Any) -> _T:
        """The one door to a change of a GPU (a call of MUTATING_NVML, a reset): a read-only
        backend refuses here, before anything is called, so that no bug elsewhere gets past."""
        if self._read_only:
            raise ObserveOnlyRefused(
                f"{op}: refused, the GPUs are open read-only (observe mode)", op=op
            )
        return call(*args)

    # -- GpuBackend: reading -----------------------------------------------------------------------

    def observe(self) -> NodeState:
        with self._active():
            return NodeState(tuple(self._observe_gpu(i) for i in range(self._count())))

    def _observe_gpu(self, index: int) -> GpuState:
        h = self._handle(index)
        where = f"read GPU {index}"
        with _nvml(where, gpu=index):
            pci = pynvml.nvmlDeviceGetPciInfo(h)
            info = GpuInfo(
                index=index,
                name=_text(pynvml.nvmlDeviceGetName(h)),
                uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                pci_bus_id=_text(pci.busId),
                pci_device_id=int(pci.pciDeviceId),
                pci_subsystem_id=int(pci.pciSubSystemId),
                memory_total_mib=int(pynvml.nvmlDeviceGetMemoryInfo(h).total) >> 20,
            )
            try:
                current, pending = pynvml.nvmlDeviceGetMigMode(h)
            except pynvml.NVMLError_NotSupported:
                current = pending = None
            processes = tuple(
                GpuProcess(
                    pid=int(p.pid),
                    gi_id=None if p.gpuInstanceId in (None, _NO_ID) else int(p.gpuInstanceId),
                    ci_id=None
                    if p.computeInstanceId in (None, _NO_ID)
                    else int(p.computeInstanceId),
                    used_memory_mib=None if p.usedGpuMemory is None else int(p.usedGpuMemory) >> 20,
                )
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            )
        if current is None:
            return GpuState(info, mig_capable=False, processes=processes)
        gis = self._gpu_instances(index, h, bool(current)) if current else ()
        return GpuState(
            info,
            mig_capable=True,
            mig_current=bool(current),
            mig_pending=bool(pending),
            gpu_instances=gis,
            processes=processes,
        )

    def _gpu_instances(self, gpu: int, h: Any, mig_current: bool) -> tuple[GpuInstance, ...]:
        out = []
        for profile in self._model_under(gpu, mig_current).gi_profiles:
            with _nvml(f"list {profile.name} GPU instances on GPU {gpu}", gpu=gpu):
                arr = (pynvml.c_nvmlGpuInstance_t * profile.instance_count)()
                count = c_uint(len(arr))
                pynvml.nvmlDeviceGetGpuInstances(h, profile.id, arr, byref(count))
                for k in range(count.value):
                    info = pynvml.nvmlGpuInstanceGetInfo(arr[k])
                    out.append(
                        GpuInstance(
                            int(info.id),
                            int(info.profileId),
                            Placement(int(info.placement.start), int(info.placement.size)),
                            self._compute_instances(gpu, int(info.profileId), arr[k]),
                        )
                    )
        return tuple(sorted(out, key=lambda g: g.id))

    def _ci_profiles_in(self, gi_profile_id: int, gi: Any, gpu: int) -> tuple[CiProfile, ...]:
        """The CI profiles NVML lists inside GPU instance ``gi`` (of GI profile
        ``gi_profile_id``), with their placements; read once per GPU and GI profile."""
        key = (gpu, gi_profile_id)
        if key not in self._ci_table:
            found = []
            for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
                try:
                    ci = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                        gi, index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                    )
                except pynvml.NVMLError as exc:
                    if exc.value in _ABSENT:
                        continue
                    raise
                count = c_uint(0)
                pynvml.nvmlGpuInstanceGetComputeInstancePossiblePlacements(
                    gi, int(ci.id), None, byref(count)
                )
                # as for GI placements: sized from the count query and instanceCount both
                arr = (
                    pynvml.c_nvmlComputeInstancePlacement_t
                    * max(count.value, int(ci.instanceCount), 1)
                )()
                count.value = len(arr)
                pynvml.nvmlGpuInstanceGetComputeInstancePossiblePlacements(
                    gi, int(ci.id), arr, byref(count)
                )
                found.append(
                    CiProfile(
                        index=index,
                        id=int(ci.id),
                        slices=int(ci.sliceCount),
                        instance_count=int(ci.instanceCount),
                        multiprocessors=int(ci.multiprocessorCount),
                        placements=tuple(
                            Placement(int(arr[k].start), int(arr[k].size))
                            for k in range(count.value)
                        ),
                    )
                )
            self._ci_table[key] = tuple(found)
        return self._ci_table[key]

    def _compute_instances(
        self, gpu: int, gi_profile_id: int, gi: Any
    ) -> tuple[ComputeInstance, ...]:
        out = []
        for cp in self._ci_profiles_in(gi_profile_id, gi, gpu):
            arr = (pynvml.c_nvmlComputeInstance_t * cp.instance_count)()
            count = c_uint(len(arr))
            pynvml.nvmlGpuInstanceGetComputeInstances(gi, cp.id, arr, byref(count))
            for k in range(count.value):
                info = pynvml.nvmlComputeInstanceGetInfo(arr[k])
                out.append(
                    ComputeInstance(
                        int(info.id),
                        int(info.profileId),
                        Placement(int(info.placement.start), int(info.placement.size)),
                        _text(pynvml.nvmlDeviceGetUUID(info.device)),
                    )
                )
        return tuple(sorted(out, key=lambda c: c.id))

    def models(self) -> Mapping[int, GpuModel]:
        with self._active():
            return {i: self._model(i) for i in range(self._count())}

    def _model(self, gpu: int) -> GpuModel:
        with _nvml(f"read the MIG mode of GPU {gpu}", gpu=gpu):
            mig_current = self._mig_current(self._handle(gpu))
        return self._model_under(gpu, mig_current)

    def _model_under(self, gpu: int, mig_current: bool | None) -> GpuModel:
        """GPU ``gpu``'s model, kept while its current MIG mode stays ``mig_current``.

        Some drivers answer NOT_SUPPORTED for GPU-instance profile info while MIG is off
        (nvml-mig.md 2.3): a MIG GPU read without a single profile was read incomplete, and so
        was one with a GI profile whose CI profiles could not be read (see _ci_profiles_of).
        Such a read is not kept (the next call reads again); the last complete read, if any,
        stands.
        """
        kept = self._models.get(gpu)
        if kept is not None and kept[0] == mig_current:
            return kept[1]
        model, complete = self._read_model(gpu, mig_current)
        if complete and (model.gi_profiles or mig_current is None):
            self._models[gpu] = (mig_current, model)
            return model
        return kept[1] if kept is not None else model

    def _read_model(self, index: int, mig_current: bool | None) -> tuple[GpuModel, bool]:
        """GPU ``index``'s model as NVML reports it, and whether every CI profile was read."""
        h = self._handle(index)
        with _nvml(f"read the MIG profiles of GPU {index}", gpu=index):
            name = _text(pynvml.nvmlDeviceGetName(h))
            pci = pynvml.nvmlDeviceGetPciInfo(h)
            pci_id = int(pci.pciDeviceId)
            total_mib = int(pynvml.nvmlDeviceGetMemoryInfo(h).total) >> 20
            arch_code = int(pynvml.nvmlDeviceGetArchitecture(h))
            catalog = MODEL_BY_PCI_ID.get(pci_id)
            profiles = []
            for gi_index in range(GI_PROFILE_INDEX_COUNT):
                try:
                    info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, gi_index)
                except pynvml.NVMLError as exc:
                    if exc.value in _ABSENT:  # what go-nvlib skips too
                        continue
                    raise
                profiles.append(self._profile(h, gi_index, info, total_mib))
            complete = True
            for i, p in enumerate(profiles):
                cis = self._ci_profiles_of(index, h, p, catalog, mig_on=bool(mig_current))
                if cis is None:
                    complete = False
                    cis = (_whole_gi_ci(p),)
                profiles[i] = replace(p, ci_profiles=cis)
        profiles.sort(key=lambda p: (p.slices, p.memory_mib, p.index))  # nvidia-smi -lgip order
        if catalog is not None:
            arch = catalog.architecture
        else:
            arch = _ARCHITECTURE.get(
                arch_code, Architecture.HOPPER if arch_code >= 9 else Architecture.TURING
            )
        # Placements are in units of NVML's grid; the smallest placement is one memory slice
        # (12 units over 4 slices on an RTX PRO 6000 Blackwell, one unit a slice elsewhere).
        units = max((p.placements[-1].end for p in profiles if p.placements), default=0)
        smallest = min((p.placement_size for p in profiles if p.placements), default=1)
        model = GpuModel(
            key=catalog.key if catalog else name,
            name=name,
            product=catalog.product if catalog else name.replace(" ", "-"),
            pci_device_id=pci_id,
            pci_subsystem_id=int(pci.pciSubSystemId),
            memory_total_mib=total_mib,
            architecture=arch,
            memory_slices=units // smallest,
            compute_slices=max((p.slices for p in profiles), default=0),
            placement_units=units,
            gi_profiles=tuple(profiles),
            gi_by_name={p.name: p for p in profiles},
        )
        return model, complete

    def _ci_profiles_of(
        self, gpu: int, h: Any, p: GiProfile, catalog: GpuModel | None, *, mig_on: bool
    ) -> tuple[CiProfile, ...] | None:
        """The CI profiles inside a GI of ``p`` on GPU ``gpu``; None where they cannot be read.

        NVML lists CI profiles only inside an existing GPU instance. For a GI profile the catalog
        knows (same PCI id, id and index) they are the catalog's, tested against the simulator's
        tables. Otherwise they are read from NVML inside a GI of ``p``: one that exists, else,
        with MIG on and room for one, a GI created for the read (no compute instance, so no
        client can see it) and destroyed after it. With MIG off or no room: None.
        """
        known = catalog.gi_profile_by_id(p.id) if catalog else None
        if known is not None and known.index == p.index:
            return known.ci_profiles
        if (gpu, p.id) in self._ci_table:
            return self._ci_table[gpu, p.id]
        if not mig_on:
            return None
        arr = (pynvml.c_nvmlGpuInstance_t * p.instance_count)()
        count = c_uint(len(arr))
        pynvml.nvmlDeviceGetGpuInstances(h, p.id, arr, byref(count))
        if count.value:
            return self._ci_profiles_in(p.id, arr[0], gpu)
        if not pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(h, p.id):
            return None
        op = f"create a {p.name} GPU instance on GPU {gpu} to read its profiles"
        for pl in p.placements:
            try:
                gi = self._mutate(
                    op,
                    pynvml.nvmlDeviceCreateGpuInstanceWithPlacement,
                    h,
                    p.id,
                    byref(pynvml.c_nvmlGpuInstancePlacement_t(pl.start, pl.size)),
                )
            except pynvml.NVMLError_InsufficientResources:
                continue  # taken: the next placement
            except ObserveOnlyRefused:
                return None  # read-only: unknown, as with MIG off
            try:
                return self._ci_profiles_in(p.id, gi, gpu)
            finally:
                self._mutate(op, pynvml.nvmlGpuInstanceDestroy, gi)
        return None

    @staticmethod
    def _profile(h: Any, index: int, info: Any, total_mib: int) -> GiProfile:
        profile_id = int(info.id)
        count = c_uint(0)
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, None, byref(count))
        # NVML writes without a bounds check: size from the count query and instanceCount both.
        arr = (pynvml.c_nvmlGpuInstancePlacement_t * max(count.value, int(info.instanceCount), 1))()
        count.value = len(arr)
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, byref(count))
        placements = tuple(
            Placement(int(arr[k].start), int(arr[k].size)) for k in range(count.value)
        )
        slices = int(info.sliceCount)
        name = (
            mig_name(index, int(info.memorySizeMB), total_mib)
            if index in GI_INDEX_SHAPE
            else _text(info.name).removeprefix("MIG ")
        )
        return GiProfile(
            name=name,
            index=index,
            id=profile_id,
            slices=slices,
            memory_mib=int(info.memorySizeMB),
            instance_count=int(info.instanceCount),
            multiprocessors=int(info.multiprocessorCount),
            engines=Engines(
                int(info.copyEngineCount),
                int(info.decoderCount),
                int(info.encoderCount),
                int(info.jpegCount),
                int(info.ofaCount),
            ),
            placements=placements,
        )

    def mig_devices(self) -> tuple[MigDevice, ...]:
        """Every MIG device, found the way device plugins find them (by MIG device index)."""
        with self._active():
            out = []
            for gpu in range(self._count()):
                h = self._handle(gpu)
                with _nvml(f"list MIG devices on GPU {gpu}", gpu=gpu):
                    try:
                        slots = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(h))
                    except pynvml.NVMLError_NotSupported:
                        slots = 0
                    for k in range(slots):
                        try:
                            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
                        except (pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument):
                            continue
                        gi_id = int(pynvml.nvmlDeviceGetGpuInstanceId(mig))
                        ci_id = int(pynvml.nvmlDeviceGetComputeInstanceId(mig))
                        out.append(
                            MigDevice(
                                gpu,
                                gi_id,
                                ci_id,
                                _text(pynvml.nvmlDeviceGetUUID(mig)),
                                self._device_name(gpu, h, gi_id, ci_id),
                            )
                        )
            return tuple(out)

    def _device_name(self, gpu: int, h: Any, gi_id: int, ci_id: int) -> str:
        gi = pynvml.nvmlDeviceGetGpuInstanceById(h, gi_id)
        gp = self._gi_profile(gpu, int(pynvml.nvmlGpuInstanceGetInfo(gi).profileId))
        ci = pynvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
        ci_profile_id = int(pynvml.nvmlComputeInstanceGetInfo(ci).profileId)
        if gp is None:
            return f"gi-profile-{gi_id}"
        cp = gp.ci_profile_by_id(ci_profile_id)
        return gp.ci_name(cp) if cp else f"{gp.name}/ci-profile-{ci_profile_id}"

    # -- GpuBackend: changing ----------------------------------------------------------------------

    def set_mig_mode(self, gpu: int, *, enabled: bool) -> None:
        op = f"set MIG mode {'on' if enabled else 'off'} on GPU {gpu}"
        with self._active():
            h = self._handle(gpu)
            mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
            with _nvml(op, gpu=gpu):
                # pynvml returns the activation status as a plain int instead of raising it.
                status = int(self._mutate(op, pynvml.nvmlDeviceSetMigMode, h, mode))
            if status == pynvml.NVML_SUCCESS:
                return
            if status == pynvml.NVML_ERROR_IN_USE:
                raise GpuBusy(
                    f"{op}: in use by another client; stop the GPU's processes",
                    op=op,
                    gpu=gpu,
                    nvml_code=status,
                )
            with _nvml(op, gpu=gpu):
                _, pending = pynvml.nvmlDeviceGetMigMode(h)
            if bool(pending) == enabled:
                return  # pending until a reset (RESET_REQUIRED and the like): re-observe
            raise GpuError(
                f"{op}: activation failed: {pynvml.nvmlErrorString(status)}",
                op=op,
                gpu=gpu,
                nvml_code=status,
            )

    def reset_gpu(self, gpu: int) -> None:
        op = f"reset GPU {gpu}"
        with self._active():
            self._mutate(op, self._reset or self._reset_hardware, gpu)

    def _reset_hardware(self, gpu: int) -> None:
        op = f"reset GPU {gpu}"
        h = self._handle(gpu)
        with _nvml(op, gpu=gpu):
            pids = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
            bus_id = _text(pynvml.nvmlDeviceGetPciInfo(h).busId)
        if pids:
            raise GpuBusy(
                f"{op}: in use by process(es) {', '.join(map(str, pids))}", op=op, gpu=gpu
            )
        # nvidia-smi refuses to reset a GPU that has clients; let go of ours for the duration.
        with _nvml("shut down NVML"):
            pynvml.nvmlShutdown()
        self._handles.clear()
        try:
            result = subprocess.run(
                ["nvidia-smi", "-r", "-i", bus_id],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise GpuResetRequired(f"{op}: nvidia-smi -r failed: {exc}", op=op, gpu=gpu) from exc
        finally:
            with _nvml("initialise NVML"):
                pynvml.nvmlInit()
        if result.returncode != 0:
            text = (result.stdout + result.stderr).strip()
            cls = GpuBusy if "in use" in text.lower() else GpuResetRequired
            raise cls(f"{op}: nvidia-smi -r: {text}", op=op, gpu=gpu)

    def create_gpu_instance(self, gpu: int, profile_id: int, placement: Placement) -> int:
        with self._active():
            profile = self._gi_profile(gpu, profile_id)
            name = profile.name if profile else f"profile id {profile_id}"
            op = f"create GPU instance {name} at {placement} on GPU {gpu}"
            h = self._handle(gpu)
            with _nvml(op, gpu=gpu, profile_id=profile_id, placement=str(placement)):
                gi = self._mutate(
                    op,
                    pynvml.nvmlDeviceCreateGpuInstanceWithPlacement,
                    h,
                    profile_id,
                    byref(pynvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)),
                )
                return int(pynvml.nvmlGpuInstanceGetInfo(gi).id)

    def create_compute_instance(
        self, gpu: int, gi_id: int, profile_id: int, placement: Placement
    ) -> int:
        with self._active():
            gi = self._gi_handle(gpu, gi_id)
            name = f"profile id {profile_id}"
            with _nvml(f"read GPU instance {gi_id} on GPU {gpu}", gpu=gpu, gi=gi_id):
                gp = self._gi_profile(gpu, int(pynvml.nvmlGpuInstanceGetInfo(gi).profileId))
            cp = gp.ci_profile_by_id(profile_id) if gp else None
            if gp is not None and cp is not None:
                name = gp.ci_name(cp)
            op = (
                f"create compute instance {name} at {placement} in GPU instance {gi_id} "
                f"on GPU {gpu}"
            )
            with _nvml(op, gpu=gpu, gi=gi_id, profile_id=profile_id, placement=str(placement)):
                ci = self._mutate(
                    op,
                    pynvml.nvmlGpuInstanceCreateComputeInstanceWithPlacement,
                    gi,
                    profile_id,
                    byref(pynvml.c_nvmlComputeInstancePlacement_t(placement.start, placement.size)),
                )
                return int(pynvml.nvmlComputeInstanceGetInfo(ci).id)

    def destroy_compute_instance(self, gpu: int, gi_id: int, ci_id: int) -> None:
        op = f"destroy compute instance {ci_id} in GPU instance {gi_id} on GPU {gpu}"
        with self._active():
            gi = self._gi_handle(gpu, gi_id)
            with _nvml(op, gpu=gpu, gi=gi_id, ci=ci_id):
                ci = pynvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
                self._mutate(op, pynvml.nvmlComputeInstanceDestroy, ci)

    def destroy_gpu_instance(self, gpu: int, gi_id: int) -> None:
        op = f"destroy GPU instance {gi_id} on GPU {gpu}"
        with self._active():
            gi = self._gi_handle(gpu, gi_id)
            with _nvml(op, gpu=gpu, gi=gi_id):
                self._mutate(op, pynvml.nvmlGpuInstanceDestroy, gi)


def _whole_gi_ci(p: GiProfile) -> CiProfile:
    """What a GI of ``p`` is taken to offer while NVML cannot be asked (MIG off, no room for a
    GI of it): the one compute instance that spans it, at the index of its slice count."""
    index = CI_INDEX_BY_SLICES.get(p.slices, 0)
    return CiProfile(index, index, p.slices, 1, p.multiprocessors, (Placement(0, p.slices),))


def open_backend(
    library: Any | None = None,
    *,
    reset: Callable[[int], None] | None = None,
    read_only: bool = False,
) -> NvmlGpuBackend:
    """Initialise NVML: over ``library`` when given (any object pynvml can call as its
    ``nvmlLib``, with ``reset`` for GPU resets), else over libnvidia-ml.so.1 as pynvml loads it.
    ``read_only``: a backend that refuses every change (observe mode)."""
    with _LIB_LOCK:
        previous = pynvml.nvmlLib
        if library is not None:
            pynvml.nvmlLib = library
        elif previous is not None and not isinstance(previous, ctypes.CDLL):
            pynvml.nvmlLib = None  # a library handed to an earlier backend: load the real one
        pynvml._nvmlGetFunctionPointer_cache.clear()
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            lib = pynvml.nvmlLib
            pynvml.nvmlLib = previous
            pynvml._nvmlGetFunctionPointer_cache.clear()
            if exc.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
                raise GpuUnavailable(
                    "NVML library libnvidia-ml.so.1 not found: no NVIDIA driver on this machine; "
                    "use --backend simulated to run on simulated GPUs",
                    nvml_code=int(exc.value),
                ) from exc
            code = int(exc.value)
            raise _ERROR_BY_CODE.get(code, GpuError)(
                f"initialise NVML ({lib!r}): {exc}", op="initialise NVML", nvml_code=code
            ) from exc
        return NvmlGpuBackend(pynvml.nvmlLib, previous, reset, read_only=read_only)
