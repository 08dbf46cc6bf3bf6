"""What NVIDIA's DRA driver (driver ``gpu.nvidia.com``, static MIG) publishes for a node's GPUs,
and how a published ResourceSlice differs from it: what a DRA node waits for after a change, as
a device-plugin node waits for its allocatable.

Pure module. Facts from the driver's kubelet plugin (``../shared/reference/dra.md`` section 1,
checked with the driver over simulated GPUs in tests/native/test_dra_driver.py):

* a GPU with MIG off is one device, attribute ``type=gpu``;
* a GPU with MIG on publishes only its MIG devices, ``type=mig`` with attribute ``profile``
  (``1g.10gb``, ``1g.10gb+me``), and nothing at all when it has none;
* a MIG device that splits a GPU instance into compute instances (``1c.3g.40gb``) makes the plugin
  refuse to start: it publishes nothing for the node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Final

from mig_agent.core.advertised import Devices
from mig_agent.core.gpu_models import resource_name

DRIVER: Final = "gpu.nvidia.com"
GPU: Final = ("gpu", "")  # a whole GPU: (type, profile)

Kind = tuple[str, str]  # (type, profile): ("gpu", "") or ("mig", "2g.20gb")


def split_problem(devices: Devices) -> str:
    """Why the DRA plugin would publish nothing for these devices, or ""."""
    split = sorted({n for d in devices.values() if d for n in d if resource_name(n) is None})
    if not split:
        return ""
    return (
        "NVIDIA's DRA plugin refuses to start on MIG devices that split a GPU instance into "
        f"compute instances ({', '.join(split)}), and would publish no device"
    )


def expected_devices(devices: Devices) -> Counter[Kind]:
    """The devices the plugin publishes for these GPUs (``split_problem`` first)."""
    out: Counter[Kind] = Counter()
    for mig in devices.values():
        if mig is None:
            out[GPU] += 1
        else:
            out.update({("mig", name): n for name, n in mig.items()})
    return out


def published_devices(slices: Iterable[Mapping[str, Any]], node: str) -> Counter[Kind]:
    """The devices the driver's ResourceSlices publish for ``node`` (its pool), by kind."""
    out: Counter[Kind] = Counter()
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != DRIVER or (spec.get("pool") or {}).get("name") != node:
            continue
        for device in spec.get("devices") or []:
            attributes = device.get("attributes") or {}
            kind = _string(attributes.get("type"))
            out[(kind, _string(attributes.get("profile")) if kind == "mig" else "")] += 1
    return out


def difference(expected: Counter[Kind], published: Counter[Kind]) -> str:
    """What the published devices lack and hold beyond the expected, or "" when they agree."""
    missing, extra = expected - published, published - expected
    parts = []
    if missing:
        parts.append(f"missing {_kinds(missing)}")
    if extra:
        parts.append(f"extra {_kinds(extra)}")
    return "; ".join(parts)


def _string(attribute: Any) -> str:
    return str(attribute.get("string", "")) if isinstance(attribute, Mapping) else ""


def _kinds(kinds: Counter[Kind]) -> str:
    return ", ".join(
        f"{n} x {'whole GPU' if kind == GPU else f'MIG {kind[1]}'}"
        for kind, n in sorted(kinds.items())
    )
