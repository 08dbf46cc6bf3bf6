"""The operator's checks of a node, judged: what its allocatable should hold by the GPU state its
agent published, and whether a pod given one device saw exactly that device in its
``nvidia-smi -L``.

Pure module: the published state, the node's allocatable and a pod's log in, a problem out ("" when
there is none). ``nvidia-smi -L`` prints a line per GPU the container sees and, under a GPU with
MIG on, a line per MIG device of it::

    GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5e1d...)
      MIG 1g.10gb     Device  0: (UUID: MIG-0b6c...)

A container given one MIG device sees its parent GPU and that MIG device alone; one given a whole
GPU sees that GPU alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from mig_agent.core.advertised import GPU_RESOURCE, format_resources
from mig_agent.core.gpu_models import GpuModel, resource_name
from mig_agent.core.observed import NodeState

SHARED_SUFFIX: Final = ".shared"
_GPU_LINE: Final = re.compile(r"GPU (\d+): (.*?) \(UUID: (GPU-[^)\s]+)\)")
_MIG_LINE: Final = re.compile(r"MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[^)\s]+)\)")


@dataclass(frozen=True, slots=True)
class Listed:
    """One device line of ``nvidia-smi -L``."""

    mig: bool
    name: str  # the GPU's product name, or the MIG device's profile (1g.10gb)
    uuid: str


@dataclass(frozen=True, slots=True)
class Published:
    """A device as the node's agent published it: a GPU (``profile`` "") or a MIG device."""

    uuid: str
    gpu: int  # the GPU's index
    profile: str = ""  # the MIG device's name (1g.10gb)
    gpu_uuid: str = ""  # a MIG device's parent
    mig_enabled: bool = False  # a GPU's MIG mode


def parse_listing(text: str) -> list[Listed]:
    """The device lines of ``nvidia-smi -L`` output, in order; other lines are ignored."""
    out = []
    for line in text.splitlines():
        if m := _MIG_LINE.fullmatch(line.strip()):
            out.append(Listed(True, m.group(1), m.group(3)))
        elif m := _GPU_LINE.fullmatch(line.strip()):
            out.append(Listed(False, m.group(2), m.group(3)))
    return out


def published_devices(node: NodeState, models: Mapping[int, GpuModel]) -> dict[str, Published]:
    """The node's GPUs and MIG devices by UUID, those the agent published a UUID for."""
    out: dict[str, Published] = {}
    for gpu in node.gpus:
        uuid = gpu.info.uuid
        if uuid:
            out[uuid] = Published(uuid, gpu.index, mig_enabled=gpu.mig_current)
        model = models[gpu.index]
        for gi in gpu.gpu_instances:
            profile = model.gi_profile_by_id(gi.profile_id)
            for ci in gi.compute_instances:
                ci_profile = profile.ci_profile_by_id(ci.profile_id) if profile else None
                if ci.uuid and profile and ci_profile:
                    name = profile.ci_name(ci_profile)
                    out[ci.uuid] = Published(ci.uuid, gpu.index, name, uuid)
    return out


def allocatable_problem(expected: Mapping[str, int], allocatable: Mapping[str, int]) -> str:
    """What the node's allocatable GPU resources lack or hold beyond ``expected`` (what NVIDIA's
    device plugin advertises for the published GPUs), or "". A shared resource (``<name>.shared``,
    time-slicing or MPS) stands in for its device's resource: the verdict cannot know the replicas,
    so it only has to be there."""
    lacking = []
    for resource, n in sorted(expected.items()):
        has = allocatable.get(resource, 0)
        if has < n and not allocatable.get(resource + SHARED_SUFFIX, 0):
            lacking.append(f"{resource}: {has} of {n}")
    known = set(expected) | {r + SHARED_SUFFIX for r in expected}
    extra = {r: n for r, n in allocatable.items() if n > 0 and r not in known}
    parts = []
    if lacking:
        parts.append(f"allocatable lacks {', '.join(lacking)}")
    if extra:
        parts.append(f"allocatable holds what the GPUs do not make: {format_resources(extra)}")
    if parts:
        parts.append(f"expected {format_resources(expected)}")
    return "; ".join(parts)


def wants_mig(resource: str, strategy: str, node: NodeState) -> bool:
    """Whether a pod given one ``resource`` gets a MIG device: a ``nvidia.com/mig-*`` resource, or
    ``nvidia.com/gpu`` under the single strategy on a node whose GPUs have MIG on."""
    base = resource.removesuffix(SHARED_SUFFIX)
    if base != GPU_RESOURCE:
        return True
    return strategy == "single" and any(g.mig_current for g in node.gpus)


def listing_problem(
    resource: str,
    strategy: str,
    log: str,
    node: NodeState,
    published: Mapping[str, Published],
) -> str:
    """Why a pod given one ``resource`` did not see exactly one device of that kind, one the node
    published, in its ``nvidia-smi -L`` ``log``; "" when it did. With no UUID published (an agent
    before they were), the device's kind is checked, not its identity."""
    listed = parse_listing(log)
    migs = [d for d in listed if d.mig]
    gpus = [d for d in listed if not d.mig]
    shown = "; ".join(f"{'MIG ' if d.mig else ''}{d.name} {d.uuid}" for d in listed) or "nothing"
    if wants_mig(resource, strategy, node):
        if len(migs) != 1:
            return f"the pod saw {len(migs)} MIG device(s), expected 1 ({shown})"
        mig = migs[0]
        base = resource.removesuffix(SHARED_SUFFIX)
        if strategy != "single" and resource_name(mig.name) != base:
            return f"the pod asked {resource} and was given a {mig.name} MIG device ({mig.uuid})"
        if not published:
            return ""
        found = published.get(mig.uuid)
        if found is None or not found.profile:
            return f"the pod's MIG device {mig.uuid} is not one the node's GPU state lists"
        if found.profile != mig.name:
            return f"the pod's MIG device {mig.uuid} is a {found.profile} by the node's GPU state"
        if [g.uuid for g in gpus] != [found.gpu_uuid]:
            return f"the pod saw GPU(s) {shown}, expected only {found.gpu_uuid}, its MIG device's"
        return ""
    if migs or len(gpus) != 1:
        return f"the pod saw {shown}, expected exactly one whole GPU"
    if not published:
        return ""
    gpu = published.get(gpus[0].uuid)
    if gpu is None or gpu.profile:
        return f"the pod's GPU {gpus[0].uuid} is not one the node's GPU state lists"
    if gpu.mig_enabled:
        return f"the pod was given GPU {gpu.gpu} ({gpu.uuid}) whole, but MIG is on there"
    return ""


def age_text(seconds: float) -> str:
    """``40 s``, ``3 min``, ``5 h``, ``2 d``."""
    s = max(0, int(seconds))
    if s < 120:
        return f"{s} s"
    if s < 2 * 3600:
        return f"{s // 60} min"
    if s < 2 * 86400:
        return f"{s // 3600} h"
    return f"{s // 86400} d"
