"""What NVIDIA's device plugin advertises for a node's GPUs, and why it would advertise nothing.

Pure module: the plugin's rules applied to the MIG devices of each GPU, the MIG strategy and the
plugin's sharing config. Facts from NVIDIA's k8s-device-plugin (``internal/rm/device_map.go``,
``internal/rm/rm.go`` AddDefaultResourcesToConfig, ``api/config/v1``) and go-nvlib
(``pkg/nvlib/device``), which the plugin and GPU Feature Discovery list devices through:

* GPUs named "DGX Display" or "NVIDIA DGX Display" are skipped: not advertised, not labelled,
  and not part of single strategy's uniformity rules;
* mixed: one ``nvidia.com/mig-<profile>`` per MIG device; a device that splits a GPU instance
  (``1c.3g.71gb``) matches no resource pattern, and then the plugin refuses to start: nothing
  is advertised, not even whole GPUs;
* single: every MIG device is ``nvidia.com/gpu``, but only when every GPU has MIG on (each with a
  device) or every GPU has it off, and all MIG devices are alike; else nothing is advertised;
* sharing (time-slicing or MPS): each device of a shared resource becomes ``replicas`` devices,
  advertised as ``<resource>.shared`` with ``renameByDefault`` (the plugin ignores a per-resource
  ``rename`` and ``devices`` selection: every device is shared). MPS refuses MIG devices, and the
  mixed strategy.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from mig_agent.core.errors import ConfigError, InvalidConfig
from mig_agent.core.gpu_models import GpuModel, resource_name
from mig_agent.core.observed import NodeState
from mig_agent.core.planner import Plan, observed_devices

GPU_RESOURCE: Final = "nvidia.com/gpu"
MIG_STRATEGIES: Final = ("mixed", "single")
# NB: go-nvlib's device.New skips these by NVML name unless told otherwise (WithSkippedDevices
# defaults, pkg/nvlib/device/api.go): by name, not by MIG capability.
SKIPPED_GPU_NAMES: Final = frozenset({"DGX Display", "NVIDIA DGX Display"})

# Per GPU index, the MIG devices the plugin sees (name -> count); None: MIG disabled.
Devices = Mapping[int, Counter[str] | None]


@dataclass(frozen=True, slots=True)
class SharedResource:
    """One resource the plugin replicates: each of its devices is offered ``replicas`` times."""

    name: str  # nvidia.com/gpu, nvidia.com/mig-1g.10gb
    replicas: int  # >= 2
    rename: str = ""  # what the replicas are advertised as, if not ``name``


@dataclass(frozen=True, slots=True)
class Sharing:
    """The sharing config the device plugin runs with (``sharing`` of its config file)."""

    strategy: str = "none"  # none, time-slicing, mps
    resources: tuple[SharedResource, ...] = ()
    source: str = ""  # the config file, for messages


NO_SHARING: Final = Sharing()


def node_mig_strategy(labels: Mapping[str, str], *, label: str, fallback: str) -> str:
    """The MIG strategy of this node's device plugin: GPU Feature Discovery's ``label`` (it
    labels the strategy it runs with, as the plugin does) when present, else ``fallback``.
    ConfigError naming a label value that is no strategy."""
    value = labels.get(label) if label else None
    if value is None:
        return fallback
    if value not in MIG_STRATEGIES:
        raise ConfigError(
            f"node label {label}={value!r} is not a MIG strategy: expected "
            f"{' or '.join(MIG_STRATEGIES)}",
            label=label,
            value=value,
        )
    return value


def is_skipped(gpu_name: str) -> bool:
    """True for GPUs NVIDIA's device plugin and GFD do not see (display GPUs)."""
    return gpu_name in SKIPPED_GPU_NAMES


def plugin_devices(
    node: NodeState, models: Mapping[int, GpuModel]
) -> dict[int, Counter[str] | None]:
    """Per GPU the device plugin sees, its MIG devices now (None: MIG disabled)."""
    return {
        gpu.index: observed_devices(models[gpu.index], gpu) if gpu.mig_current else None
        for gpu in node.gpus
        if not is_skipped(gpu.info.name)
    }


def planned_devices(
    the_plan: Plan, node: NodeState, models: Mapping[int, GpuModel]
) -> dict[int, Counter[str] | None]:
    """Per GPU the device plugin sees, its MIG devices once ``the_plan`` is applied."""
    out = plugin_devices(node, models)
    for gp in the_plan.gpus:
        if gp.gpu in out:
            out[gp.gpu] = Counter(d.profile for d in gp.devices) if gp.desired.mig_enabled else None
    return out


def strategy_problem(devices: Devices, strategy: str, sharing: Sharing = NO_SHARING) -> str:
    """Why NVIDIA's device plugin would advertise nothing for these devices under ``strategy``
    and ``sharing``, or ""."""
    if sharing.strategy == "mps":
        if strategy == "mixed":
            return (
                f"the device plugin's MPS sharing ({sharing.source}) does not work with the "
                f"mixed MIG strategy: it would advertise nothing"
            )
        mig = sorted(i for i, d in devices.items() if d)
        if mig:
            return (
                f"the device plugin's MPS sharing ({sharing.source}) does not support MIG "
                f"devices, GPU(s) {_ids(mig)} would have some: it would advertise nothing"
            )
    if strategy == "single":
        return single_strategy_problem(devices)
    return mixed_strategy_problem(devices)


def mixed_strategy_problem(devices: Devices) -> str:
    """Why NVIDIA's device plugin in mixed strategy would advertise nothing, or "": it has a
    resource only for MIG devices that span their GPU instance, and refuses to start on others."""
    split = sorted({n for d in devices.values() if d for n in d if resource_name(n) is None})
    if not split:
        return ""
    gpus = sorted(i for i, d in devices.items() if d and any(n in split for n in d))
    return (
        f"the mixed MIG strategy's device plugin has no resource for MIG devices that split "
        f"a GPU instance into compute instances ({', '.join(split)} on GPU(s) {_ids(gpus)}) "
        f"and would advertise nothing, not even whole GPUs; use the single strategy or "
        f"profiles without a 'Nc.' prefix"
    )


def single_strategy_problem(devices: Devices) -> str:
    """Why NVIDIA's device plugin in single strategy would advertise nothing for these GPUs, or
    "": it needs every GPU in the same MIG mode and every MIG device of one profile."""
    modes = {d is not None for d in devices.values()}
    if len(modes) > 1:
        off = sorted(i for i, d in devices.items() if d is None)
        return (
            f"the single MIG strategy needs MIG on every GPU or on none; GPU(s) "
            f"{_ids(off)} would have MIG disabled"
        )
    names = sorted({n for d in devices.values() if d for n in d})
    if len(names) > 1:
        return (
            f"the single MIG strategy needs one MIG profile on the whole node, the layout "
            f"makes {', '.join(names)}; use the mixed strategy or a single-profile layout"
        )
    if modes == {True} and any(not d for d in devices.values()):
        empty = sorted(i for i, d in devices.items() if not d)
        return (
            f"the single MIG strategy needs at least one MIG device on every MIG GPU; GPU(s) "
            f"{_ids(empty)} would have none"
        )
    return ""


def shared_as(resource: str, sharing: Sharing) -> tuple[str, int]:
    """What each device of ``resource`` is advertised as under ``sharing``: the name and how
    many replicas. Listed twice, the largest replicas win (the plugin's replica ids coincide)."""
    entries = [r for r in sharing.resources if r.name == resource]
    if not entries:
        return resource, 1
    best = max(entries, key=lambda r: r.replicas)
    return best.rename or best.name, best.replicas


def advertised_resources(
    devices: Devices, strategy: str, sharing: Sharing = NO_SHARING
) -> dict[str, int]:
    """What NVIDIA's device plugin advertises for these devices: nothing where it refuses to
    start (strategy_problem), else a whole GPU per GPU without MIG and one resource per MIG
    device, each multiplied and renamed as ``sharing`` says."""
    if strategy_problem(devices, strategy, sharing):
        return {}
    out: Counter[str] = Counter()
    for gpu in devices.values():
        for res, n in _unshared(gpu, strategy).items():
            name, replicas = shared_as(res, sharing)
            out[name] += n * replicas
    return dict(out)


def expected_resources(
    node: NodeState, models: Mapping[int, GpuModel], strategy: str, sharing: Sharing = NO_SHARING
) -> dict[str, int]:
    """What NVIDIA's device plugin advertises for the GPUs as they are now."""
    return advertised_resources(plugin_devices(node, models), strategy, sharing)


def _unshared(gpu: Counter[str] | None, strategy: str) -> Counter[str]:
    if gpu is None:
        return Counter({GPU_RESOURCE: 1})
    out: Counter[str] = Counter()
    for name, n in gpu.items():
        res = resource_name(name, strategy=strategy)
        if res:
            out[res] += n
    return out


@dataclass(frozen=True, slots=True)
class Listing:
    """What the device plugin lists on a node, read from its capacity and allocatable."""

    listed: dict[str, int]  # devices per resource, healthy or not
    unhealthy: dict[str, int]  # of those, the ones the kubelet keeps out of allocatable
    unoffered: tuple[str, ...]  # the expected resources none of whose devices is allocatable

    @property
    def fresh(self) -> bool:
        """Every expected resource has a device allocatable: a plugin has registered each."""
        return not self.unoffered


def plugin_listing(
    capacity: Mapping[str, int], allocatable: Mapping[str, int], expected: Mapping[str, int]
) -> Listing:
    """The node's devices as the plugin lists them. Capacity counts every device, allocatable
    only the healthy ones: a layout is in place when capacity says so, whatever an Xid did to a
    device. A resource no plugin lists any more keeps its capacity with allocatable 0 for the
    kubelet's stop grace period (5 min), and NVIDIA's plugin registers each resource on its
    own: after its restart, an expected resource with no device allocatable may still be the
    stopped plugin's count (``unoffered``), while the others are the new one's. Pure."""
    listed = {
        r: n for r, n in capacity.items() if n > 0 and (allocatable.get(r, 0) > 0 or r in expected)
    }
    unhealthy = {
        r: n - allocatable.get(r, 0) for r, n in listed.items() if n > allocatable.get(r, 0)
    }
    unoffered = tuple(
        sorted(r for r, n in expected.items() if n > 0 and allocatable.get(r, 0) <= 0)
    )
    return Listing(listed, unhealthy, unoffered)


def device_uuids(state: NodeState) -> frozenset[str]:
    """Every device the GPUs hold now, by UUID: the GPUs' and their MIG devices'."""
    out = {gpu.info.uuid for gpu in state.gpus}
    out.update(u for gpu in state.gpus for u in gpu.mig_device_uuids)
    return frozenset(u for u in out if u)


UUID_PREFIXES: Final = ("GPU-", "MIG-")


def stale_devices(
    allocatable: Mapping[str, frozenset[str]], want: Mapping[str, int], present: frozenset[str]
) -> dict[str, frozenset[str]]:
    """Per resource the layout lists, the device ids the kubelet offers (PodResources
    GetAllocatableResources) that name no device the GPUs hold: the registration of a plugin
    that read the GPUs before they changed. A resource's ids are replaced as a whole when a
    plugin registers it anew, so only the layout's resources are judged (a dropped resource's
    ids linger for the kubelet's grace period), and only ids in UUID form (GPU-..., MIG-...):
    other id strategies are not judged."""
    out: dict[str, frozenset[str]] = {}
    for resource, count in want.items():
        gone = frozenset(
            i
            for i in allocatable.get(resource, frozenset())
            if i.startswith(UUID_PREFIXES) and i not in present
        )
        if count and gone:
            out[resource] = gone
    return out


def format_resources(resources: Mapping[str, int]) -> str:
    if not resources:
        return "nothing"
    return "{" + ", ".join(f"{k}: {v}" for k, v in sorted(resources.items())) + "}"


def _ids(indices: list[int]) -> str:
    return ", ".join(map(str, indices))


# -- the device plugin's config file -------------------------------------------------------------


_RESOURCE_PREFIX = "nvidia.com/"
_SHARED_SUFFIX = ".shared"
_MAX_RESOURCE_NAME = 63
# Kubernetes' IsDNS1123Subdomain, which the plugin checks the part after "nvidia.com/" against
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def parse_sharing(data: object, *, source: str) -> Sharing:
    """The sharing part of a parsed NVIDIA device plugin config (``version: v1``), as the plugin
    reads it: ``sharing.mps`` wins over ``sharing.timeSlicing``; resource names get the
    ``nvidia.com/`` prefix; replicas must be >= 2; ``renameByDefault`` renames every shared
    resource to ``<name>.shared`` and any other ``rename`` is ignored. Other keys are not read.
    InvalidConfig naming the file and key where the plugin itself would refuse the file."""
    if data is None:  # an empty file: the config-manager's "empty" config
        return Sharing(source=source)
    if not isinstance(data, Mapping):
        raise _invalid(source, "", "the config must be a mapping")
    version = data.get("version", "v1")
    if version != "v1":
        raise _invalid(source, "version", f"unknown version {version!r}, expected 'v1'")
    sharing = data.get("sharing")
    if sharing is None:
        return Sharing(source=source)
    if not isinstance(sharing, Mapping):
        raise _invalid(source, "sharing", "must be a mapping")
    parsed = {
        key: _replicated(sharing[key], source, f"sharing.{key}")
        for key in ("mps", "timeSlicing")
        if sharing.get(key) is not None
    }
    if "mps" in parsed:
        return Sharing("mps", parsed["mps"], source)
    if "timeSlicing" in parsed:
        return Sharing("time-slicing", parsed["timeSlicing"], source)
    return Sharing(source=source)


def _replicated(raw: object, source: str, key: str) -> tuple[SharedResource, ...]:
    if not isinstance(raw, Mapping):
        raise _invalid(source, key, "must be a mapping")
    rename_by_default = raw.get("renameByDefault", False)
    if not isinstance(rename_by_default, bool):
        raise _invalid(source, f"{key}.renameByDefault", "must be true or false")
    resources = raw.get("resources")
    if not isinstance(resources, list) or not resources:
        raise _invalid(source, f"{key}.resources", "no resources specified")
    out = []
    for i, r in enumerate(resources):
        where = f"{key}.resources[{i}]"
        if not isinstance(r, Mapping):
            raise _invalid(source, where, "must be a mapping")
        name = _resource_name(r.get("name"), source, f"{where}.name")
        replicas = r.get("replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 2:
            raise _invalid(
                source,
                f"{where}.replicas",
                f"number of replicas must be an integer >= 2, got {replicas!r}",
            )
        if r.get("rename") is not None:
            _resource_name(r.get("rename"), source, f"{where}.rename")
        _check_devices(r.get("devices", "all"), source, f"{where}.devices")
        out.append(
            SharedResource(name, replicas, name + _SHARED_SUFFIX if rename_by_default else "")
        )
    return tuple(out)


def _resource_name(raw: object, source: str, key: str) -> str:
    if not isinstance(raw, str) or not raw:
        raise _invalid(source, key, f"must be a resource name, got {raw!r}")
    name = raw if raw.startswith(_RESOURCE_PREFIX) else _RESOURCE_PREFIX + raw
    short = name.split("/", 1)[1]
    if len(name) > _MAX_RESOURCE_NAME or not _is_dns_subdomain(short):
        raise _invalid(
            source,
            key,
            f"{raw!r} is not a valid resource name (at most "
            f"{_MAX_RESOURCE_NAME} characters; lower case letters, digits, '-', '.')",
        )
    return name


def _is_dns_subdomain(name: str) -> bool:
    return len(name) <= 253 and _DNS_SUBDOMAIN.fullmatch(name) is not None


def _check_devices(raw: object, source: str, key: str) -> None:
    """The plugin parses ``devices`` (all, a count, or GPU/MIG indices or UUIDs) and then shares
    every device anyway; a malformed value still stops it."""
    ok = (
        raw == "all"
        or (isinstance(raw, int) and not isinstance(raw, bool) and raw > 0)
        or (
            isinstance(raw, list)
            and all(isinstance(x, str | int) and not isinstance(x, bool) for x in raw)
        )
    )
    if not ok:
        raise _invalid(source, key, f"must be 'all', a count > 0 or a list of devices, got {raw!r}")


def _invalid(source: str, key: str, message: str) -> InvalidConfig:
    where = f"{source}: key '{key}'" if key else source
    return InvalidConfig(f"device plugin config {where}: {message}", file=source, key=key)
