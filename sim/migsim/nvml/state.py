"""The simulated node: its state document, the file it lives in, and how its GPUs behave.

One simulated node is one JSON file, so separate processes (CLI calls, the agent, a simulated
device plugin) see one node. Every mutation is a read-modify-write under an exclusive ``flock`` on
``<file>.lock`` with an atomic replace; reads take a shared lock. The behaviour (ids, placements,
IN_USE, MIG mode pending until reset on Ampere, ...) follows real hardware as described in the
project's NVML reference; the GPU tables are the simulator's own (migsim.gpus, written from the
reference documents), not the agent's catalog.

This module knows NVML only as return codes (ints). It must not import pynvml or ctypes: the C
ABI lives in migsim.nvml.library, which drives these functions.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from migsim.gpus import CiProfile, GiProfile, GpuModel, Placement, model, parse_gpu_spec

ENV_STATE = "MIG_AGENT_SIM_STATE"
SCHEMA = 1

# nvmlReturn_t values (nvml.h); only those the simulator produces or accepts.
SUCCESS = 0
UNINITIALIZED = 1
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
INSUFFICIENT_SIZE = 7
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
RESET_REQUIRED = 16
IN_USE = 19
INSUFFICIENT_RESOURCES = 23
ARGUMENT_VERSION_MISMATCH = 25
INVALID_STATE = 29
UNKNOWN = 999

ERROR_STRINGS: Mapping[int, str] = {
    SUCCESS: "Success",
    UNINITIALIZED: "Uninitialized",
    INVALID_ARGUMENT: "Invalid Argument",
    NOT_SUPPORTED: "Not Supported",
    NO_PERMISSION: "Insufficient Permissions",
    5: "Already Initialized",
    NOT_FOUND: "Not Found",
    INSUFFICIENT_SIZE: "Insufficient Size",
    8: "Insufficient External Power",
    DRIVER_NOT_LOADED: "Driver Not Loaded",
    TIMEOUT: "Timeout",
    11: "Interrupt Request Issue",
    12: "NVML Shared Library Not Found",
    FUNCTION_NOT_FOUND: "Function Not Found",
    14: "Corrupted infoROM",
    GPU_IS_LOST: "GPU is lost",
    RESET_REQUIRED: "GPU requires restart",
    17: "The operating system has blocked the request.",
    18: "RM has detected an NVML/RM version mismatch.",
    IN_USE: "In use by another client",
    20: "Insufficient Memory",
    21: "No data",
    INSUFFICIENT_RESOURCES: "Insufficient Resources",
    ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
    27: "Not ready",
    28: "GPU not found",
    INVALID_STATE: "Invalid state",
    UNKNOWN: "Unknown Error",
}

ERROR_NAMES: Mapping[str, int] = {
    "UNINITIALIZED": UNINITIALIZED,
    "INVALID_ARGUMENT": INVALID_ARGUMENT,
    "NOT_SUPPORTED": NOT_SUPPORTED,
    "NO_PERMISSION": NO_PERMISSION,
    "NOT_FOUND": NOT_FOUND,
    "INSUFFICIENT_SIZE": INSUFFICIENT_SIZE,
    "DRIVER_NOT_LOADED": DRIVER_NOT_LOADED,
    "TIMEOUT": TIMEOUT,
    "GPU_IS_LOST": GPU_IS_LOST,
    "RESET_REQUIRED": RESET_REQUIRED,
    "IN_USE": IN_USE,
    "INSUFFICIENT_RESOURCES": INSUFFICIENT_RESOURCES,
    "INVALID_STATE": INVALID_STATE,
    "UNKNOWN": UNKNOWN,
}

# The C functions that change GPU state; the call counters count these (and the reset).
MUTATING_FUNCTIONS = frozenset(
    {
        "nvmlDeviceSetMigMode",
        "nvmlDeviceCreateGpuInstance",
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceDestroy",
        "nvmlGpuInstanceCreateComputeInstance",
        "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
        "nvmlComputeInstanceDestroy",
    }
)
RESET = "reset"  # the counter/fault name of reset_gpu (nvidia-smi -r on hardware, not NVML)

# GI profile ids the driver's global table knows (GetGpuInstanceProfileInfoById answers
# NOT_FOUND for those a GPU lacks, INVALID_ARGUMENT for the rest) — measured on an H200, 580.159.
DRIVER_GI_PROFILE_IDS = frozenset(
    {0, 5, 6, 9, 10, 14, 15, 19, 20, 21, 32, 35, 38, 47, 48, 64, 65, 66, 67, 72, 73}
)
# Profile indices from here on are past the 580 driver's table: INVALID_ARGUMENT, not NOT_SUPPORTED
# (measured: 17 = 3_SLICE_GFX and 18 on the H200). A newer driver's table (GI_PROFILE_INDEX_COUNT)
# knows 3_SLICE_GFX: then every index a GPU lacks up to it answers NOT_SUPPORTED.
DRIVER_GI_PROFILE_INDEX_LIMIT = 17
GI_PROFILE_INDEX_COUNT = 18  # NVML_GPU_INSTANCE_PROFILE_COUNT (nvml.h)
CI_PROFILE_INDEX_LIMIT = 9

DRIVER_VERSION = "580.159.04"
NVML_VERSION = "13.580.159.04"
CUDA_VERSION = 13000

XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError
NO_INSTANCE = 0xFFFFFFFF  # an event's gpuInstanceId/computeInstanceId when not on a MIG device
KEPT_EVENTS = 256  # the node keeps its last events only (an event set sees those after its start)

_UUID_NAMESPACE = uuid.UUID("6f1c4a52-3b7e-4d7a-9a51-6d1b2c1e0f42")


class SimError(Exception):
    """A simulator operation outside NVML (reset, process injection) was refused; ``code`` is the
    NVML return code real tools would report (IN_USE, NOT_SUPPORTED, NOT_FOUND)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Refused(Exception):
    """Internal: the NVML call fails with ``code`` (behaviour code raises, the ABI returns it)."""

    def __init__(self, code: int) -> None:
        super().__init__(ERROR_STRINGS.get(code, str(code)))
        self.code = code


# -------------------------------------------------------------------------------------------------
# The state document. Mutable on purpose: it is read, changed and written back under a lock.


@dataclass(slots=True)
class SimComputeInstance:
    id: int
    profile_id: int
    start: int
    size: int
    serial: int  # unique on the node for its lifetime: handles and MIG UUIDs derive from it
    uuid: str

    @property
    def placement(self) -> Placement:
        return Placement(self.start, self.size)


@dataclass(slots=True)
class SimGpuInstance:
    id: int
    profile_id: int
    start: int
    size: int
    serial: int
    compute_instances: list[SimComputeInstance] = field(default_factory=list)

    @property
    def placement(self) -> Placement:
        return Placement(self.start, self.size)

    def ci(self, ci_id: int) -> SimComputeInstance | None:
        return next((c for c in self.compute_instances if c.id == ci_id), None)


@dataclass(slots=True)
class SimProcess:
    pid: int
    gi: int | None = None
    ci: int | None = None
    used_memory_mib: int = 0
    owner: str = ""  # who started it in the simulated world, e.g. a pod ("" for a test's own)
    name: str = ""  # nvmlSystemGetProcessName ("": NOT_FOUND, as for a process NVML cannot see)
    # The simulator (migsim.nvml.server, by its socket) whose client holds it (hold_devices);
    # that simulator removes it when the client's connection closes, or when it starts again.
    held_via: str = ""


@dataclass(slots=True)
class SimEvent:
    """An NVML event a GPU raised (nvmlEventData_t): what nvmlEventSetWait_v2 returns to the event
    sets registered for its type on the GPU after it was raised."""

    seq: int
    gpu: int
    event_type: int  # nvmlEventType*, e.g. XID_CRITICAL_ERROR
    data: int  # the Xid for an XidCriticalError
    gi: int = NO_INSTANCE  # the MIG device's ids, NO_INSTANCE for the whole GPU
    ci: int = NO_INSTANCE


@dataclass(slots=True)
class SimGpu:
    index: int
    model_key: str
    uuid: str
    bus_id: str
    mig_current: bool = False
    mig_pending: bool = False
    reset_supported: bool = True
    gpu_instances: list[SimGpuInstance] = field(default_factory=list)
    processes: list[SimProcess] = field(default_factory=list)

    @property
    def model(self) -> GpuModel:
        return model(self.model_key)

    def gi(self, gi_id: int) -> SimGpuInstance | None:
        return next((g for g in self.gpu_instances if g.id == gi_id), None)

    def gi_by_serial(self, serial: int) -> SimGpuInstance | None:
        return next((g for g in self.gpu_instances if g.serial == serial), None)

    def ci_by_serial(self, serial: int) -> tuple[SimGpuInstance, SimComputeInstance] | None:
        for g in self.gpu_instances:
            for c in g.compute_instances:
                if c.serial == serial:
                    return g, c
        return None

    def mig_devices(self) -> list[tuple[SimGpuInstance, SimComputeInstance]]:
        """MIG devices in NVML's dense index order: by (GI id, CI id)."""
        return [
            (g, c)
            for g in sorted(self.gpu_instances, key=lambda g: g.id)
            for c in sorted(g.compute_instances, key=lambda c: c.id)
        ]

    def max_mig_devices(self) -> int:
        return self.model.max_mig_devices if self.mig_current else 0


@dataclass(slots=True)
class FailRule:
    """Fail a matching call with ``code``: after letting ``skip`` matches pass, ``times`` times.
    Without ``function`` it matches mutating calls only. With ``after`` the call takes effect
    and then reports ``code`` (a creation that half succeeds: the instance is there)."""

    code: int
    function: str | None = None
    gpu: int | None = None
    skip: int = 0
    times: int = 1
    after: bool = False

    def matches(self, function: str, gpu: int | None, mutating: bool) -> bool:
        if self.function is None:
            if not mutating:
                return False
        elif self.function != function:
            return False
        return self.gpu is None or self.gpu == gpu


@dataclass(slots=True)
class SimNode:
    name: str
    seed: str
    gpus: list[SimGpu]
    virtualization_mode: int = 0  # NVML_GPU_VIRTUALIZATION_MODE_*: 0 bare metal, 1 pass-through
    ampere_self_reset: bool = False  # Ampere: the driver's own reset succeeds when the GPU is idle
    # Driver behaviour: GI profile info (GetGpuInstanceProfileInfo[V|ByIdV]) answers NOT_SUPPORTED
    # on a GPU whose current MIG mode is disabled, as older drivers may ("NOT_SUPPORTED If device
    # doesn't have MIG mode enabled", nvml.h). The measured 580 driver answers it with MIG off.
    profile_info_needs_mig: bool = False
    # The profile indices the driver's table holds (GetGpuInstanceProfileInfo answers
    # INVALID_ARGUMENT from here on): DRIVER_GI_PROFILE_INDEX_LIMIT, or GI_PROFILE_INDEX_COUNT.
    gi_profile_indices: int = DRIVER_GI_PROFILE_INDEX_LIMIT
    driver_version: str = DRIVER_VERSION
    nvml_version: str = NVML_VERSION
    cuda_version: int = CUDA_VERSION
    # Host settings the driver reports per GPU (nvmlDeviceGetPersistenceMode): the H200's host
    # runs with persistence mode on (smi-q Persistence Mode: Enabled; the table's "On").
    persistence_mode: bool = True
    next_serial: int = 1
    fail_rules: list[FailRule] = field(default_factory=list)
    latency_seconds: float = 0.0
    latency_scope: str = "mutating"  # or "all"
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # gpu -> function -> calls
    events: list[SimEvent] = field(default_factory=list)
    next_event: int = 1
    schema: int = SCHEMA

    def gpu(self, index: int) -> SimGpu:
        if not 0 <= index < len(self.gpus):
            raise SimError(
                NOT_FOUND, f"no GPU {index} on simulated node {self.name!r} ({len(self.gpus)} GPUs)"
            )
        return self.gpus[index]

    def serial(self) -> int:
        s = self.next_serial
        self.next_serial += 1
        return s

    def mig_uuid(self, serial: int) -> str:
        return "MIG-" + str(uuid.uuid5(_UUID_NAMESPACE, f"{self.seed}/mig/{serial}"))

    def latency_for(self, mutating: bool) -> float:
        if self.latency_scope == "all" or mutating:
            return self.latency_seconds
        return 0.0

    def match_rule(self, function: str, gpu: int | None, mutating: bool) -> FailRule | None:
        return next((r for r in self.fail_rules if r.matches(function, gpu, mutating)), None)

    def consume_rule(self, function: str, gpu: int | None, mutating: bool) -> int | None:
        """Advance the first matching fault rule; the code to fail with, or None to proceed."""
        rule = self.consume(function, gpu, mutating)
        return rule.code if rule is not None else None

    def consume(self, function: str, gpu: int | None, mutating: bool) -> FailRule | None:
        """Advance the first matching fault rule; the rule that applies to this call, if any."""
        rule = self.match_rule(function, gpu, mutating)
        if rule is None:
            return None
        if rule.skip > 0:
            rule.skip -= 1
            return None
        rule.times -= 1
        if rule.times <= 0:
            self.fail_rules.remove(rule)
        return rule

    def count(self, function: str, gpu: int | None) -> None:
        per = self.counts.setdefault("-" if gpu is None else str(gpu), {})
        per[function] = per.get(function, 0) + 1


def _node_from_json(raw: Mapping[str, Any]) -> SimNode:
    if raw.get("schema") != SCHEMA:
        raise ValueError(
            f"simulated node state has schema {raw.get('schema')!r}, expected {SCHEMA}; recreate it"
        )
    gpus = [
        SimGpu(
            index=g["index"],
            model_key=g["model_key"],
            uuid=g["uuid"],
            bus_id=g["bus_id"],
            mig_current=g["mig_current"],
            mig_pending=g["mig_pending"],
            reset_supported=g["reset_supported"],
            gpu_instances=[
                SimGpuInstance(
                    gi["id"],
                    gi["profile_id"],
                    gi["start"],
                    gi["size"],
                    gi["serial"],
                    [SimComputeInstance(**ci) for ci in gi["compute_instances"]],
                )
                for gi in g["gpu_instances"]
            ],
            processes=[SimProcess(**p) for p in g["processes"]],
        )
        for g in raw["gpus"]
    ]
    scalars = {k: v for k, v in raw.items() if k not in ("gpus", "fail_rules", "events")}
    return SimNode(
        gpus=gpus,
        fail_rules=[FailRule(**r) for r in raw["fail_rules"]],
        events=[SimEvent(**e) for e in raw.get("events", ())],
        **scalars,
    )


# -------------------------------------------------------------------------------------------------
# The file


class StateFile:
    """One node's state file with its lock. ``read()`` caches the parsed document while the file
    is unchanged; ``mutate()`` yields a fresh copy and writes it back atomically."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.lock_path = self.path + ".lock"
        # The cached document and an open fd of the file it came from: files are only ever
        # replaced, never rewritten, and holding the fd keeps its inode from being reused.
        self._cached: tuple[int, int, int, SimNode] | None = None  # fd, dev, ino, node
        self._cache_lock = threading.Lock()

    def exists(self) -> bool:
        return os.path.exists(self.path)

    @contextmanager
    def _lock(self, exclusive: bool) -> Iterator[None]:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # releases the flock

    def read(self) -> SimNode:
        """The current document. Callers must not change it (use ``mutate``)."""
        with self._cache_lock, self._lock(exclusive=False):
            fd = os.open(self.path, os.O_RDONLY)
            st = os.fstat(fd)
            if self._cached and self._cached[1:3] == (st.st_dev, st.st_ino):
                os.close(fd)
                return self._cached[3]
            node = _node_from_json(json.loads(_read_fd(fd)))
            self._drop_cache()
            self._cached = (fd, st.st_dev, st.st_ino, node)
            return node

    @contextmanager
    def mutate(self) -> Iterator[SimNode]:
        """Exclusive read-modify-write; the document is written back when the block succeeds."""
        with self._lock(exclusive=True):
            with open(self.path, "rb") as f:
                node = _node_from_json(json.loads(f.read()))
            yield node
            self._write(node)

    def create(self, node: SimNode) -> None:
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        with self._lock(exclusive=True):
            self._write(node)

    def _write(self, node: SimNode) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(node), f, indent=1)
        os.replace(tmp, self.path)

    def close(self) -> None:
        with self._cache_lock:
            self._drop_cache()

    def _drop_cache(self) -> None:
        if self._cached is not None:
            os.close(self._cached[0])
            self._cached = None


def _read_fd(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


# -------------------------------------------------------------------------------------------------
# Behaviour. Functions raise Refused(code) where NVML returns an error.


def gi_profile(gpu: SimGpu, profile_id: int) -> GiProfile:
    m = gpu.model
    if not m.mig_capable:
        raise Refused(NOT_SUPPORTED)
    p = m.gi_profile_by_id(profile_id)
    if p is None:
        raise Refused(INVALID_ARGUMENT)
    return p


def _gi_id_range(m: GpuModel, size: int) -> range:
    # The driver numbers GIs like nodes of a binary tree over the placement grid: on 8 slices the
    # whole GPU is 0, halves 1-2, quarters 3-6, eighths 7-14 (7g -> 0; 3g/4g -> 1-2; ...).
    first = m.placement_grid // size - 1
    return range(first, 2 * first + 1)


def _free_placements(gpu: SimGpu, p: GiProfile) -> list[Placement]:
    taken = [gi.placement for gi in gpu.gpu_instances]
    return [pl for pl in p.placements if not any(pl.overlaps(t) for t in taken)]


def gi_remaining(gpu: SimGpu, profile_id: int) -> int:
    p = gi_profile(gpu, profile_id)
    existing = sum(gi.profile_id == profile_id for gi in gpu.gpu_instances)
    return max(0, min(p.instance_count - existing, len(_free_placements(gpu, p))))


def create_gi(
    node: SimNode, gpu: SimGpu, profile_id: int, placement: Placement | None
) -> SimGpuInstance:
    p = gi_profile(gpu, profile_id)
    if not gpu.mig_current:
        raise Refused(NOT_SUPPORTED)
    if placement is not None and placement not in p.placements:
        raise Refused(INVALID_ARGUMENT)
    if sum(gi.profile_id == profile_id for gi in gpu.gpu_instances) >= p.instance_count:
        raise Refused(INSUFFICIENT_RESOURCES)
    if not _media_engines_allow(gpu, p):
        raise Refused(INSUFFICIENT_RESOURCES)
    free = _free_placements(gpu, p)
    if placement is None:
        if not free:
            raise Refused(INSUFFICIENT_RESOURCES)
        # Without a placement the driver packs small profiles from the top so that large ones
        # keep slot 0 (the real order differs in detail; nobody may depend on it).
        placement = max(free, key=lambda pl: pl.start)
    elif placement not in free:
        raise Refused(INSUFFICIENT_RESOURCES)
    used = {gi.id for gi in gpu.gpu_instances}
    gi_id = next((i for i in _gi_id_range(gpu.model, placement.size) if i not in used), None)
    if gi_id is None:
        raise Refused(INSUFFICIENT_RESOURCES)
    gi = SimGpuInstance(gi_id, profile_id, placement.start, placement.size, node.serial())
    gpu.gpu_instances.append(gi)
    gpu.gpu_instances.sort(key=lambda g: g.id)
    return gi


def _media_engines_allow(gpu: SimGpu, p: GiProfile) -> bool:
    # An ALL_ME GI (+me.all) holds every media engine: it "prevents allocation of all but _NO_ME
    # profiles" (nvml.h), and so cannot join GIs that hold media engines themselves. The code the
    # driver refuses with is not in the references: INSUFFICIENT_RESOURCES, as for a taken slot.
    others = [gi_profile(gpu, gi.profile_id).capability for gi in gpu.gpu_instances]
    if p.capability == "+me.all":
        return all(cap == "-me" for cap in others)
    return p.capability == "-me" or "+me.all" not in others


def destroy_gi(gpu: SimGpu, gi: SimGpuInstance) -> None:
    if gi.compute_instances or any(p.gi == gi.id for p in gpu.processes):
        raise Refused(IN_USE)
    gpu.gpu_instances.remove(gi)


def ci_profile(gpu: SimGpu, gi: SimGpuInstance, profile_id: int) -> CiProfile:
    gp = gi_profile(gpu, gi.profile_id)
    cp = gp.ci_profile_by_id(profile_id)
    if cp is None:
        raise Refused(
            NOT_SUPPORTED if 0 <= profile_id < CI_PROFILE_INDEX_LIMIT else INVALID_ARGUMENT
        )
    return cp


def ci_remaining(gpu: SimGpu, gi: SimGpuInstance, profile_id: int) -> int:
    cp = ci_profile(gpu, gi, profile_id)
    taken = [c.placement for c in gi.compute_instances]
    free = [pl for pl in cp.placements if not any(pl.overlaps(t) for t in taken)]
    existing = sum(c.profile_id == profile_id for c in gi.compute_instances)
    return max(0, min(cp.instance_count - existing, len(free)))


def ci_placements(gpu: SimGpu, gi: SimGpuInstance, profile_id: int) -> tuple[Placement, ...]:
    return ci_profile(gpu, gi, profile_id).placements


def create_ci(
    node: SimNode, gpu: SimGpu, gi: SimGpuInstance, profile_id: int, placement: Placement | None
) -> SimComputeInstance:
    cp = ci_profile(gpu, gi, profile_id)
    if placement is not None and placement not in cp.placements:
        raise Refused(INVALID_ARGUMENT)
    if sum(c.profile_id == profile_id for c in gi.compute_instances) >= cp.instance_count:
        raise Refused(INSUFFICIENT_RESOURCES)
    taken = [c.placement for c in gi.compute_instances]
    free = [pl for pl in cp.placements if not any(pl.overlaps(t) for t in taken)]
    if placement is None:
        if not free:
            raise Refused(INSUFFICIENT_RESOURCES)
        placement = free[0]
    elif placement not in free:
        raise Refused(INSUFFICIENT_RESOURCES)
    used = {c.id for c in gi.compute_instances}
    ci_id = next(i for i in range(len(used) + 1) if i not in used)
    serial = node.serial()
    ci = SimComputeInstance(
        ci_id, profile_id, placement.start, placement.size, serial, node.mig_uuid(serial)
    )
    gi.compute_instances.append(ci)
    gi.compute_instances.sort(key=lambda c: c.id)
    return ci


def destroy_ci(gpu: SimGpu, gi: SimGpuInstance, ci: SimComputeInstance) -> None:
    if any(p.gi == gi.id and p.ci == ci.id for p in gpu.processes):
        raise Refused(IN_USE)
    gi.compute_instances.remove(ci)


def set_mig_mode(node: SimNode, gpu: SimGpu, mode: int) -> int:
    """Apply nvmlDeviceSetMigMode; returns the activation status (Refused for the return code)."""
    if not gpu.model.mig_capable:
        raise Refused(NOT_SUPPORTED)
    if mode not in (0, 1):
        raise Refused(INVALID_ARGUMENT)
    want = bool(mode)
    if want == gpu.mig_current:
        gpu.mig_pending = want  # also cancels a pending change
        return SUCCESS
    if gpu.gpu_instances:  # tools destroy every GI before toggling; the driver refuses otherwise
        raise Refused(IN_USE)
    busy = bool(gpu.processes)
    if gpu.model.mig_mode_needs_reset:
        # Ampere: the new mode is pending until a reset; the driver tries one itself, which
        # fails while clients hold the GPU or where reset is not exposed (pass-through VM).
        gpu.mig_pending = want
        if busy:
            return IN_USE
        if node.ampere_self_reset and gpu.reset_supported:
            gpu.mig_current = want
            return SUCCESS
        return RESET_REQUIRED
    # Hopper and later: no reset needed, but a GPU with clients is refused outright.
    if busy:
        return IN_USE
    gpu.mig_current = gpu.mig_pending = want
    return SUCCESS


# -------------------------------------------------------------------------------------------------
# Public API (also behind the CLI in migsim.nvml.library)


def bus_id(index: int) -> str:
    """PCI bus id of simulated GPU ``index``; bus order equals NVML index order."""
    return f"00000000:{0x18 + index:02X}:00.0"


def create_node(
    path: str | os.PathLike[str],
    gpus: str | tuple[GpuModel, ...],
    *,
    name: str | None = None,
    seed: str | None = None,
    reset_supported: bool = True,
    passthrough: bool = False,
    ampere_self_reset: bool = False,
    profile_info_needs_mig: bool = False,
    driver_knows_3_slice_gfx: bool = False,
    mig_enabled: bool = False,
    uuids: Sequence[str] = (),
    bus_ids: Sequence[str] = (),
    replace: bool = True,
) -> None:
    """Create the state file of a simulated node with ``gpus`` ("8xH100-80GB", "2xA100-40GB,2xA30").

    UUIDs derive from ``seed`` (default: the node name, default: the file's stem), so the same
    arguments give the same node. ``passthrough`` reports virtualization mode pass-through;
    ``reset_supported=False`` makes resets impossible (Ampere mode changes then stay pending).
    ``mig_enabled`` starts MIG-capable GPUs with MIG mode on. ``profile_info_needs_mig`` makes
    the driver one that answers GPU-instance profile info only on GPUs with MIG mode on;
    ``driver_knows_3_slice_gfx`` one whose profile table includes index 0x11 (NOT_SUPPORTED there
    on GPUs without it, where the measured 580 driver answers INVALID_ARGUMENT).
    ``uuids`` and ``bus_ids`` give the first GPUs those of real ones (a capture's), the others
    keep the derived ones (``bus_id(index)``).
    """
    models = parse_gpu_spec(gpus) if isinstance(gpus, str) else gpus
    if len(uuids) > len(models) or len(bus_ids) > len(models):
        raise ValueError(f"more UUIDs or bus ids than the node's {len(models)} GPU(s)")
    state = StateFile(path)
    if state.exists() and not replace:
        raise FileExistsError(f"simulated node state {state.path} exists")
    name = name or Path(state.path).stem
    seed = seed or name
    node = SimNode(
        name=name,
        seed=seed,
        virtualization_mode=1 if passthrough else 0,
        ampere_self_reset=ampere_self_reset,
        profile_info_needs_mig=profile_info_needs_mig,
        gi_profile_indices=(
            GI_PROFILE_INDEX_COUNT if driver_knows_3_slice_gfx else DRIVER_GI_PROFILE_INDEX_LIMIT
        ),
        gpus=[
            SimGpu(
                index=i,
                model_key=m.key,
                uuid=(
                    uuids[i]
                    if i < len(uuids)
                    else "GPU-" + str(uuid.uuid5(_UUID_NAMESPACE, f"{seed}/gpu/{i}"))
                ),
                bus_id=bus_ids[i] if i < len(bus_ids) else bus_id(i),
                mig_current=mig_enabled and m.mig_capable,
                mig_pending=mig_enabled and m.mig_capable,
                reset_supported=reset_supported,
            )
            for i, m in enumerate(models)
        ],
    )
    state.create(node)


def load_node(path: str | os.PathLike[str]) -> SimNode:
    """A snapshot of the node (for display and tests); changing it changes nothing."""
    state = StateFile(path)
    try:
        return state.read()
    finally:
        state.close()


def _mutate(path: str | os.PathLike[str]) -> Any:
    return StateFile(path).mutate()


def reset_gpu(path: str | os.PathLike[str], index: int) -> None:
    """Reset GPU ``index`` as ``nvidia-smi -r`` would: the pending MIG mode becomes current.

    SimError(IN_USE) while processes hold the GPU; SimError(NOT_SUPPORTED) where reset is not
    possible (pass-through VM). Counted as a mutating call named "reset"; fault rules naming
    "reset" and latency for mutating calls apply.
    """
    delay = load_node(path).latency_for(True)
    if delay:
        time.sleep(delay)
    # The failure is decided inside the locked update but raised after it, so that the count
    # and the consumed fault rule are saved even when the reset fails.
    failure: SimError | None = None
    with _mutate(path) as node:
        gpu = node.gpu(index)
        node.count(RESET, index)
        code = node.consume_rule(RESET, index, True)
        if code is not None:
            failure = SimError(
                code, f"reset of GPU {index} failed: {ERROR_STRINGS.get(code, code)} (injected)"
            )
        elif gpu.processes:
            pids = ", ".join(str(p.pid) for p in gpu.processes)
            failure = SimError(IN_USE, f"GPU {index} cannot be reset: in use by process(es) {pids}")
        elif not gpu.reset_supported:
            failure = SimError(
                NOT_SUPPORTED,
                f"GPU {index} cannot be reset here (pass-through VM): reboot the node",
            )
        else:
            gpu.mig_current = gpu.mig_pending
    if failure is not None:
        raise failure


def reboot_node(path: str | os.PathLike[str]) -> None:
    """Simulate a node reboot: processes and GPU instances are gone; a pending MIG mode applies;
    MIG mode survives only on Ampere (kept in the InfoROM), Hopper and later come up with MIG
    disabled."""
    with _mutate(path) as node:
        for gpu in node.gpus:
            gpu.processes.clear()
            gpu.gpu_instances.clear()
            if gpu.model.mig_mode_needs_reset:
                gpu.mig_current = gpu.mig_pending
            else:
                gpu.mig_current = gpu.mig_pending = False


def add_process(
    path: str | os.PathLike[str],
    gpu: int,
    pid: int,
    *,
    gi: int | None = None,
    ci: int | None = None,
    used_memory_mib: int = 1024,
    name: str = "",
) -> None:
    """Put process ``pid`` on GPU ``gpu``, or on its existing MIG device (``gi``, ``ci``);
    ``name`` is what NVML reports as its name (nvidia-smi's "Process name")."""
    if (gi is None) != (ci is None):
        raise ValueError("give both gi and ci for a process on a MIG device, or neither")
    with _mutate(path) as node:
        g = node.gpu(gpu)
        if any(p.pid == pid for p in g.processes):
            raise SimError(INVALID_ARGUMENT, f"process {pid} is already on GPU {gpu}")
        if gi is not None and ci is not None:
            inst = g.gi(gi)
            if inst is None or inst.ci(ci) is None:
                raise SimError(NOT_FOUND, f"GPU {gpu} has no MIG device gi={gi} ci={ci}")
        g.processes.append(SimProcess(pid, gi, ci, used_memory_mib, name=name))


def raise_xid(
    path: str | os.PathLike[str],
    gpu: int,
    xid: int,
    *,
    gi: int | None = None,
    ci: int | None = None,
) -> int:
    """GPU ``gpu`` (its MIG device ``gi``/``ci`` if given) reports Xid ``xid``: an
    XidCriticalError event for the event sets registered on it. Returns the event's number."""
    if (gi is None) != (ci is None):
        raise ValueError("give both gi and ci for an Xid on a MIG device, or neither")
    with _mutate(path) as node:
        g = node.gpu(gpu)
        if gi is not None and ci is not None:
            inst = g.gi(gi)
            if inst is None or inst.ci(ci) is None:
                raise SimError(NOT_FOUND, f"GPU {gpu} has no MIG device gi={gi} ci={ci}")
        seq: int = node.next_event
        node.next_event += 1
        node.events.append(
            SimEvent(
                seq,
                gpu,
                XID_CRITICAL_ERROR,
                xid,
                NO_INSTANCE if gi is None else gi,
                NO_INSTANCE if ci is None else ci,
            )
        )
        del node.events[:-KEPT_EVENTS]
    return seq


_FIRST_SIM_PID = 100_000  # above the pids tests pick by hand


def start_process(
    path: str | os.PathLike[str],
    gpu: int,
    *,
    gi: int | None = None,
    ci: int | None = None,
    owner: str,
    used_memory_mib: int = 1024,
) -> int:
    """Start a process on GPU ``gpu`` (or its MIG device ``gi``/``ci``) under a free pid;
    returns the pid. ``owner`` names who holds it, for processes_of() and end_processes()."""
    with _mutate(path) as node:
        taken = {p.pid for g in node.gpus for p in g.processes}
        pid = max(taken | {_FIRST_SIM_PID - 1}) + 1
        g = node.gpu(gpu)
        if gi is not None and ci is not None:
            inst = g.gi(gi)
            if inst is None or inst.ci(ci) is None:
                raise SimError(NOT_FOUND, f"GPU {gpu} has no MIG device gi={gi} ci={ci}")
        g.processes.append(SimProcess(pid, gi, ci, used_memory_mib, owner))
    return pid


def processes_by_owner(path: str | os.PathLike[str]) -> dict[str, list[tuple[int, SimProcess]]]:
    """owner -> (GPU index, process) of every owned process."""
    out: dict[str, list[tuple[int, SimProcess]]] = {}
    for g in load_node(path).gpus:
        for p in g.processes:
            if p.owner:
                out.setdefault(p.owner, []).append((g.index, p))
    return out


def end_processes(path: str | os.PathLike[str], owners: Collection[str]) -> int:
    """End every process of these owners; returns how many ended."""
    if not owners:
        return 0
    ended = 0
    with _mutate(path) as node:
        for g in node.gpus:
            keep = [p for p in g.processes if p.owner not in owners]
            ended += len(g.processes) - len(keep)
            g.processes = keep
    return ended


def remove_process(path: str | os.PathLike[str], pid: int, *, gpu: int | None = None) -> int:
    """Remove process ``pid`` (from every GPU, or only ``gpu``); returns how many were removed."""
    removed = 0
    with _mutate(path) as node:
        for g in node.gpus:
            if gpu is None or g.index == gpu:
                before = len(g.processes)
                g.processes = [p for p in g.processes if p.pid != pid]
                removed += before - len(g.processes)
    return removed


def hold_devices(
    path: str | os.PathLike[str],
    pid: int,
    devices: Sequence[tuple[int, int | None, int | None]],
    *,
    used_memory_mib: int,
    name: str,
    held_via: str,
) -> None:
    """Put process ``pid`` on each of ``devices`` ((GPU index, GI id, CI id), the ids None for
    the whole GPU) for the simulator ``held_via``, after removing what it held for ``pid``
    before; release_holds() takes them off again."""
    with _mutate(path) as node:
        for g in node.gpus:
            g.processes = [p for p in g.processes if (p.pid, p.held_via) != (pid, held_via)]
        for index, gi, ci in devices:
            g = node.gpu(index)
            if gi is not None and ci is not None:
                inst = g.gi(gi)
                if inst is None or inst.ci(ci) is None:
                    raise SimError(NOT_FOUND, f"GPU {index} has no MIG device gi={gi} ci={ci}")
            g.processes.append(
                SimProcess(pid, gi, ci, used_memory_mib, name=name, held_via=held_via)
            )


def release_holds(path: str | os.PathLike[str], held_via: str, pid: int | None = None) -> int:
    """Remove the processes the simulator ``held_via`` holds (only ``pid``'s if given);
    returns how many were removed."""
    removed = 0
    with _mutate(path) as node:
        for g in node.gpus:
            keep = [
                p
                for p in g.processes
                if p.held_via != held_via or (pid is not None and p.pid != pid)
            ]
            removed += len(g.processes) - len(keep)
            g.processes = keep
    return removed


def inject_failure(
    path: str | os.PathLike[str],
    code: int,
    *,
    function: str | None = None,
    nth: int = 1,
    times: int = 1,
    gpu: int | None = None,
    after: bool = False,
) -> None:
    """Fail the ``nth`` matching call from now (and ``times - 1`` more) with NVML ``code``.

    Without ``function`` the rule matches mutating calls (creates, destroys, SetMigMode, reset);
    with it, calls of that C function (e.g. "nvmlDeviceGetMigMode") or "reset". ``gpu`` limits
    the rule to calls on that GPU. With ``after`` the call does what it was asked and then
    reports ``code`` (an instance created, or destroyed, though the caller is told it failed).
    """
    if nth < 1 or times < 1:
        raise ValueError("nth and times count from 1")
    with _mutate(path) as node:
        node.fail_rules.append(FailRule(code, function, gpu, nth - 1, times, after))


def set_latency(path: str | os.PathLike[str], seconds: float, *, scope: str = "mutating") -> None:
    """Each mutating call (scope "mutating") or every call ("all") takes ``seconds`` longer."""
    if scope not in ("mutating", "all") or seconds < 0:
        raise ValueError("scope is 'mutating' or 'all'; seconds >= 0")
    with _mutate(path) as node:
        node.latency_seconds, node.latency_scope = seconds, scope


def set_reset_supported(
    path: str | os.PathLike[str], supported: bool, *, gpu: int | None = None
) -> None:
    """Make GPU reset possible or impossible (pass-through VM behaviour), on one GPU or all."""
    with _mutate(path) as node:
        for g in node.gpus:
            if gpu is None or g.index == gpu:
                g.reset_supported = supported


def clear_faults(path: str | os.PathLike[str]) -> None:
    """Remove fault rules and latency (processes and reset support stay)."""
    with _mutate(path) as node:
        node.fail_rules.clear()
        node.latency_seconds = 0.0


@dataclass(frozen=True, slots=True)
class CallCounts:
    """Mutating calls made since the node was created or the counters were reset."""

    by_gpu_function: Mapping[int, Mapping[str, int]]

    @property
    def total(self) -> int:
        return sum(self.by_gpu.values())

    @property
    def by_gpu(self) -> Mapping[int, int]:
        return {g: sum(f.values()) for g, f in self.by_gpu_function.items()}

    @property
    def by_function(self) -> Mapping[str, int]:
        out: dict[str, int] = {}
        for per in self.by_gpu_function.values():
            for fn, n in per.items():
                out[fn] = out.get(fn, 0) + n
        return out

    @property
    def gpus(self) -> frozenset[int]:
        """The GPUs that saw at least one mutating call."""
        return frozenset(g for g, n in self.by_gpu.items() if n)


def call_counts(path: str | os.PathLike[str]) -> CallCounts:
    node = load_node(path)
    return CallCounts({int(g) if g != "-" else -1: dict(f) for g, f in node.counts.items()})


def reset_call_counts(path: str | os.PathLike[str]) -> None:
    with _mutate(path) as node:
        node.counts.clear()
