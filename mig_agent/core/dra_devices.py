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
from mig_agent.core.observed import NodeState

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
    for device in _devices(slices, node):
        attributes = device.get("attributes") or {}
        kind = _string(attributes.get("type"))
        out[(kind, _string(attributes.get("profile")) if kind == "mig" else "")] += 1
    return out


def published_uuids(slices: Iterable[Mapping[str, Any]], node: str) -> frozenset[str]:
    """The UUIDs the newest slices of ``node``'s pool give their devices (static mode gives
    every GPU and MIG device its ``uuid``; empty where a driver gives none)."""
    out = (_string((d.get("attributes") or {}).get("uuid")) for d in _devices(slices, node))
    return frozenset(u for u in out if u)


def held_uuids(state: NodeState) -> frozenset[str]:
    """The UUIDs of the devices the plugin publishes for the GPUs as they are: the MIG devices
    of a GPU in MIG mode, else the GPU."""
    out: set[str] = set()
    for gpu in state.gpus:
        out.update(gpu.mig_device_uuids if gpu.mig_current else {gpu.info.uuid})
    return frozenset(out)


def stale_uuids(
    slices: Iterable[Mapping[str, Any]], node: str, held: frozenset[str]
) -> frozenset[str]:
    """UUIDs ``node``'s slice lists that the GPUs no longer hold, or ``held`` ones it lacks
    (none where the slice names no UUIDs): a slice whose kinds match by chance is no proof."""
    published_ids = published_uuids(slices, node)
    return published_ids ^ held if published_ids else frozenset()


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


def publishes(slices: Iterable[Mapping[str, Any]], node: str) -> bool:
    """Whether the driver has a slice for ``node``'s pool: its plugin ran there (a slice
    outlives the plugin's pod, and claims allocated from it outlive both)."""
    return any(_of_node(s, node) for s in slices)


def partitionable(slices: Iterable[Mapping[str, Any]], node: str) -> bool:
    """Whether ``node``'s slices are DynamicMIG's: counters shared by the devices they list
    (``sharedCounters``, ``consumesCounters``), which static MIG never publishes."""
    for s in slices:
        spec = s.get("spec") or {}
        if _of_node(s, node) and (
            spec.get("sharedCounters")
            or any(d.get("consumesCounters") for d in spec.get("devices") or [])
        ):
            return True
    return False


def _of_node(piece: Mapping[str, Any], node: str) -> bool:
    spec = piece.get("spec") or {}
    return spec.get("driver") == DRIVER and (spec.get("pool") or {}).get("name") == node


def dynamic_mig(feature_gates: Iterable[str]) -> bool:
    """Whether the plugin's feature gates (``FEATURE_GATES`` values, ``--feature-gates`` flags:
    ``A=true,B=false``) switch on DynamicMIG, under which the driver creates one MIG device per
    claim and destroys at start every MIG device it did not create."""
    on = False
    for gates in feature_gates:
        for gate in gates.split(","):
            name, _, value = gate.partition("=")
            if name.strip() == "DynamicMIG":
                on = value.strip().lower() == "true"
    return on


def claim_holders(
    claims: Iterable[Mapping[str, Any]], slices: Iterable[Mapping[str, Any]], node: str
) -> dict[tuple[str, str], frozenset[str]]:
    """(namespace, pod) -> the UUIDs of the devices of ``node``'s pool that its claims were
    allocated (a pod reserved a claim: ``status.reservedFor``). A device the slices no longer
    list is named by its device name: it is held, and no UUID that stays is it."""
    uuids: dict[str, str] = {}
    for device in _devices(slices, node):
        uuid = _string((device.get("attributes") or {}).get("uuid"))
        uuids[str(device.get("name", ""))] = uuid or str(device.get("name", ""))
    out: dict[tuple[str, str], set[str]] = {}
    for claim in claims:
        status = claim.get("status") or {}
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        held = {
            uuids.get(str(r.get("device", "")), f"{node}/{r.get('device', '')}")
            for r in results
            if r.get("driver") == DRIVER and r.get("pool") == node
        }
        if not held:
            continue
        namespace = (claim.get("metadata") or {}).get("namespace", "")
        for consumer in status.get("reservedFor") or []:
            if consumer.get("resource", "pods") == "pods" and not consumer.get("apiGroup"):
                out.setdefault((namespace, str(consumer.get("name", ""))), set()).update(held)
    return {k: frozenset(v) for k, v in out.items()}


def named(kinds: Mapping[Kind, int]) -> dict[str, int]:
    """Kinds by name, sorted: ``gpu`` for a whole GPU, the profile for a MIG device."""
    return {("gpu" if k == GPU else k[1]): n for k, n in sorted(kinds.items())}


def node_devices(slices: Iterable[Mapping[str, Any]], node: str) -> list[Mapping[str, Any]]:
    """The devices of ``node``'s pool as its newest slices list them."""
    return _devices(slices, node)


def _devices(slices: Iterable[Mapping[str, Any]], node: str) -> list[Mapping[str, Any]]:
    """The devices the driver's slices list for ``node``'s pool, from its newest generation
    only: a slice of an older one is stale (the plugin that wrote it restarted), as the
    scheduler reads a pool."""
    specs = [s.get("spec") or {} for s in slices if _of_node(s, node)]
    newest = max((_generation(spec) for spec in specs), default=0)
    return [d for spec in specs if _generation(spec) == newest for d in spec.get("devices") or []]


def _generation(spec: Mapping[str, Any]) -> int:
    return int((spec.get("pool") or {}).get("generation") or 0)
