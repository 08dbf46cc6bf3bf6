"""What a pending pod asks of the GPUs, as a device kind and a count: from its requests of
NVIDIA's extended resources (``nvidia.com/mig-<profile>``, mixed strategy; ``nvidia.com/gpu``),
or from its ResourceClaims on a DRA cluster (DeviceClass ``mig.nvidia.com`` with a CEL
selector on the ``profile`` attribute, a class that picks one profile itself, or
``gpu.nvidia.com`` for whole GPUs). What it cannot
read is said, never guessed.

Kinds are the extended resource's name, or ``dra:<profile>`` / ``dra:gpu`` for DRA devices.

Pure module: no I/O. Facts: ``../shared/reference/dra.md`` section 1 (classes, attributes);
resource.k8s.io/v1 DeviceRequest (``exactly``: deviceClassName, selectors, allocationMode
ExactCount (default, count 1) or All; ``firstAvailable``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from mig_agent.core.dra_devices import DRIVER

GPU_RESOURCE: Final = "nvidia.com/gpu"
MIG_PREFIX: Final = "nvidia.com/mig-"
MIG_CLASS: Final = "mig.nvidia.com"
GPU_CLASS: Final = "gpu.nvidia.com"
DRA_GPU: Final = "dra:gpu"
# labels that put a pod in a gang, served all or none: the coscheduling plugin's PodGroup
# (scheduling-plugins), and Kueue's plain pod groups
GANG_LABELS: Final = ("scheduling.x-k8s.io/pod-group", "kueue.x-k8s.io/pod-group-name")

# device.attributes["gpu.nvidia.com"].profile == "3g.40gb", either way round
_PROFILE_EQUALS = (
    re.compile(
        r"^\s*device\.attributes\[\s*(['\"])gpu\.nvidia\.com\1\s*\]\.profile"
        r"\s*==\s*(['\"])(?P<p>[^'\"]+)\2\s*$"
    ),
    re.compile(
        r"^\s*(['\"])(?P<p>[^'\"]+)\1\s*==\s*"
        r"device\.attributes\[\s*(['\"])gpu\.nvidia\.com\3\s*\]\.profile\s*$"
    ),
)
_DRIVER_EQUALS = re.compile(r"^\s*device\.driver\s*==\s*(['\"])([^'\"]+)\1\s*$")


@dataclass(frozen=True, slots=True)
class Ask:
    kind: str
    count: int


def gang_of(namespace: str, labels: Mapping[str, str]) -> str:
    """The gang a pod belongs to ("namespace/group"), or "" for none."""
    for key in GANG_LABELS:
        if labels.get(key):
            return f"{namespace}/{labels[key]}"
    return ""


def dra_kind(profile: str) -> str:
    return f"dra:{profile}" if profile else DRA_GPU


def from_requests(requests: Mapping[str, int]) -> Ask | str:
    """The device a pod asks for by extended resources, or why it cannot be served here."""
    asked = {k: n for k, n in requests.items() if n > 0}
    kinds = [k for k in asked if k == GPU_RESOURCE or k.startswith(MIG_PREFIX)]
    if not kinds:
        return f"asks for {', '.join(sorted(asked))}, which no layout offers"
    if len(asked) > 1:
        return f"asks for several GPU device kinds at once ({', '.join(sorted(asked))})"
    return Ask(kinds[0], asked[kinds[0]])


def from_claims(
    claims: Iterable[Mapping[str, Any]], classes: Mapping[str, str] | None = None
) -> Ask | str | None:
    """The devices a pod's ResourceClaims ask of NVIDIA's DRA driver (None: nothing of it), or
    what is not understood. Claims already allocated ask nothing more. ``classes``: the
    cluster's DeviceClasses that pick NVIDIA's MIG devices of one profile (name -> profile:
    ``mig-agent dra-classes``' per-profile classes, or written alike), which a request may
    name instead of ``mig.nvidia.com`` and a profile selector."""
    asks: list[Ask] = []
    for claim in claims:
        if (claim.get("status") or {}).get("allocation"):
            continue
        name = (claim.get("metadata") or {}).get("name", "")
        for request in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
            got = _request(request, classes or {})
            if isinstance(got, str):
                return f"claim {name}, request {request.get('name', '')!r}: {got}"
            if got is not None:
                asks.append(got)
    if not asks:
        return None
    kinds = {a.kind for a in asks}
    if len(kinds) > 1:
        return f"asks for several GPU device kinds at once ({', '.join(sorted(kinds))})"
    return Ask(asks[0].kind, sum(a.count for a in asks))


def _request(request: Mapping[str, Any], classes: Mapping[str, str]) -> Ask | str | None:
    exactly = request.get("exactly")
    if exactly is None:
        if request.get("firstAvailable"):
            return "a prioritized list (firstAvailable) is not understood"
        return None
    device_class = exactly.get("deviceClassName", "")
    if device_class not in (MIG_CLASS, GPU_CLASS, *classes):
        return None  # not a device of NVIDIA's GPU driver
    if exactly.get("allocationMode", "ExactCount") != "ExactCount":
        return f"allocation mode {exactly.get('allocationMode')} is not understood"
    count = int(exactly.get("count") or 1)
    # a per-profile class picks its profile itself
    profiles: set[str] = {classes[device_class]} if device_class in classes else set()
    for selector in exactly.get("selectors") or []:
        expression = str((selector.get("cel") or {}).get("expression", ""))
        if match := _DRIVER_EQUALS.match(expression):
            if match.group(2) != DRIVER:
                return f"selector {expression!r} names another driver"
            continue
        profile = _profile(expression)
        if profile is None or device_class == GPU_CLASS:
            return f"selector {expression!r} is not understood (only profile == '<name>')"
        profiles.add(profile)
    if device_class == GPU_CLASS:
        return Ask(DRA_GPU, count)
    if len(profiles) != 1:
        return (
            "a MIG device without a profile selector is not understood"
            if not profiles
            else f"selectors ask for several profiles at once ({', '.join(sorted(profiles))})"
        )
    return Ask(dra_kind(profiles.pop()), count)


def _profile(expression: str) -> str | None:
    for pattern in _PROFILE_EQUALS:
        if match := pattern.match(expression):
            return match.group("p")
    return None


def held_kinds(
    claim: Mapping[str, Any], devices: Mapping[str, Mapping[str, Any]], node: str
) -> dict[str, int]:
    """The device kinds an allocated claim holds on ``node``, by the devices its slices list
    (name -> device); a device they no longer list counts as a whole GPU."""
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
        "results"
    ) or []
    out: dict[str, int] = {}
    for r in results:
        if r.get("driver") != DRIVER or r.get("pool") != node:
            continue
        attributes = (devices.get(str(r.get("device", ""))) or {}).get("attributes") or {}
        kind = (attributes.get("type") or {}).get("string", "gpu")
        profile = (attributes.get("profile") or {}).get("string", "") if kind == "mig" else ""
        out[dra_kind(profile)] = out.get(dra_kind(profile), 0) + 1
    return out
