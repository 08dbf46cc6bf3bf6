"""Device taints (resource.k8s.io/v1 DeviceTaintRule, GA in Kubernetes 1.37): on a DRA node,
the devices of the GPUs a change touches are taken out of scheduling instead of the whole node.
The scheduler allocates no tainted device to a new claim; claims already allocated keep theirs
(the effect is ``NoSchedule``: the drain evicts through the Eviction API, budgets honoured, as
on a cordoned node). The devices of the other GPUs take new claims throughout the change.

One rule per device, since a rule's selector names one device (or a whole pool): the driver,
the node's pool and the device's name. The driver names a MIG device by its place on the GPU,
not its UUID, so a device made again in the same place keeps its name and its taint. Pure."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, Final

from mig_agent.core import dra_devices

DRIVER: Final = dra_devices.DRIVER
EFFECT: Final = "NoSchedule"
MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGER: Final = "mig-agent"
GROUP_VERSION: Final = ("resource.k8s.io", "v1")
PLURAL: Final = "devicetaintrules"
NAME_CAP: Final = 253  # a DeviceTaintRule's name is a DNS subdomain


def devices_of_gpus(
    slices: Iterable[Mapping[str, Any]], node: str, gpu_uuids: Iterable[str]
) -> tuple[str, ...]:
    """The names of the devices ``node``'s pool lists for these GPUs: a whole GPU by its own
    UUID, a MIG device by its parent's."""
    uuids = set(gpu_uuids)
    out = set()
    for device in dra_devices.node_devices(slices, node):
        attributes = device.get("attributes") or {}
        own = _string(attributes.get("uuid"))
        parent = _string(attributes.get("parentUUID"))
        if own in uuids or parent in uuids:
            out.add(str(device.get("name", "")))
    return tuple(sorted(n for n in out if n))


def rule_name(node: str, device: str) -> str:
    """The rule's name: the device and the node, within the name's cap; where they do not fit,
    the node's name cut short and a digest of the whole, so that two nodes whose long names
    share their start never share a rule's name."""
    name = f"mig-agent.{device}.{node}"
    if len(name) <= NAME_CAP:
        return name
    digest = hashlib.sha256(f"{device}/{node}".encode()).hexdigest()[:16]
    head = name[: NAME_CAP - len(digest) - 1].rstrip(".-")
    return f"{head}-{digest}"


def rule(node: str, device: str, key: str) -> dict[str, Any]:
    """The DeviceTaintRule that takes ``device`` of ``node``'s pool out of scheduling while
    the agent changes its GPU (a taint of ``key``)."""
    return {
        "apiVersion": "/".join(GROUP_VERSION),
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": rule_name(node, device),
            "labels": {MANAGED_BY: MANAGER},
        },
        "spec": {
            "deviceSelector": {"driver": dra_devices.DRIVER, "pool": node, "device": device},
            "taint": {"key": key, "value": "changing", "effect": EFFECT},
        },
    }


def rules_of_node(rules: Iterable[Mapping[str, Any]], node: str) -> dict[str, str]:
    """The agent's rules (by their label) that select a device of ``node``'s pool: device ->
    the rule's name."""
    out = {}
    for r in rules:
        meta = r.get("metadata") or {}
        if (meta.get("labels") or {}).get(MANAGED_BY) != MANAGER:
            continue
        selector = (r.get("spec") or {}).get("deviceSelector") or {}
        if selector.get("pool") == node and selector.get("driver") == dra_devices.DRIVER:
            out[str(selector.get("device", ""))] = str(meta.get("name", ""))
    return out


def _string(attribute: Any) -> str:
    return str(attribute.get("string", "")) if isinstance(attribute, Mapping) else ""
