"""Observed state as plain data: the v1 config of what is applied now, and a JSON snapshot with
placements that can be read back (``mig-agent export -o json`` / ``plan --from``).

Pure module: dicts in, dicts out; the CLI does the I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mig_agent.core.gpu_models import MODEL_BY_PCI_ID, GpuModel, model
from mig_agent.core.observed import (
    ComputeInstance,
    GpuInfo,
    GpuInstance,
    GpuProcess,
    GpuState,
    NodeState,
)
from mig_agent.core.placement import Placement
from mig_agent.core.planner import observed_devices


def export_config(
    node: NodeState, models: Mapping[int, GpuModel], *, name: str = "current"
) -> dict[str, Any]:
    """A v1 config with one layout ``name`` describing the GPUs as they are.

    GPUs with the same model and partition share one entry; ``devices`` becomes ``all`` when an
    entry covers every GPU of its model, and ``device-filter`` appears only on mixed nodes.
    """
    by_model: dict[int, list[int]] = {}
    specs: list[tuple[int, bool, tuple[tuple[str, int], ...], int]] = []
    for gpu in node.gpus:
        m = models[gpu.index]
        by_model.setdefault(m.pci_device_id, []).append(gpu.index)
        devices = tuple(sorted(observed_devices(m, gpu).items()))
        specs.append((m.pci_device_id, gpu.mig_current, devices, gpu.index))
    mixed = len(by_model) > 1
    groups: dict[tuple[int, bool, tuple[tuple[str, int], ...]], list[int]] = {}
    for pci, enabled, devices, index in specs:
        groups.setdefault((pci, enabled, devices), []).append(index)
    entries: list[dict[str, Any]] = []
    for (pci, enabled, devices), indices in groups.items():
        entry: dict[str, Any] = {}
        if mixed:
            entry["device-filter"] = f"0x{pci:08X}"
        entry["devices"] = "all" if indices == by_model[pci] else indices
        entry["mig-enabled"] = enabled
        if enabled:
            entry["mig-devices"] = dict(devices)
        entries.append(entry)
    return {"version": "v1", "mig-configs": {name: entries}}


def _placement(p: Placement) -> dict[str, int]:
    return {"start": p.start, "size": p.size}


def to_json(node: NodeState, models: Mapping[int, GpuModel]) -> dict[str, Any]:
    """Every GPU with its model, MIG mode, instances, placements and device names."""
    gpus = []
    for gpu in node.gpus:
        m = models[gpu.index]
        gis = []
        for gi in gpu.gpu_instances:
            prof = m.gi_profile_by_id(gi.profile_id)
            cis = []
            for ci in gi.compute_instances:
                ci_prof = prof.ci_profile_by_id(ci.profile_id) if prof else None
                cis.append(
                    {
                        "id": ci.id,
                        "profile_id": ci.profile_id,
                        "profile": prof.ci_name(ci_prof) if prof and ci_prof else None,
                        "placement": _placement(ci.placement),
                        "uuid": ci.uuid,
                    }
                )
            gis.append(
                {
                    "id": gi.id,
                    "profile_id": gi.profile_id,
                    "profile": prof.name if prof else None,
                    "placement": _placement(gi.placement),
                    "compute_instances": cis,
                }
            )
        gpus.append(
            {
                "index": gpu.index,
                "model": m.key,
                "name": gpu.info.name,
                "uuid": gpu.info.uuid,
                "pci_bus_id": gpu.info.pci_bus_id,
                "pci_device_id": f"0x{gpu.info.pci_device_id:08X}",
                "mig_capable": gpu.mig_capable,
                "mig_enabled": gpu.mig_current,
                "mig_pending": gpu.mig_pending,
                "gpu_instances": gis,
                "devices": dict(sorted(observed_devices(m, gpu).items())),
                "processes": [
                    {"pid": p.pid, "gi_id": p.gi_id, "ci_id": p.ci_id} for p in gpu.processes
                ],
            }
        )
    return {"gpus": gpus}


def from_json(data: Mapping[str, Any]) -> tuple[NodeState, dict[int, GpuModel]]:
    """Read back ``to_json`` output (models by catalog key); ValueError naming what is wrong."""
    try:
        gpus: list[GpuState] = []
        models: dict[int, GpuModel] = {}
        for g in data["gpus"]:
            m = model(g["model"]) if "model" in g else MODEL_BY_PCI_ID[int(g["pci_device_id"], 16)]
            idx = int(g["index"])
            models[idx] = m
            gis = tuple(
                GpuInstance(
                    int(gi["id"]),
                    int(gi["profile_id"]),
                    Placement(**gi["placement"]),
                    tuple(
                        ComputeInstance(
                            int(ci["id"]),
                            int(ci["profile_id"]),
                            Placement(**ci["placement"]),
                            ci.get("uuid", ""),
                        )
                        for ci in gi.get("compute_instances", ())
                    ),
                )
                for gi in g.get("gpu_instances", ())
            )
            info = GpuInfo(
                idx,
                g.get("name", m.name),
                g.get("uuid", f"GPU-sim-{idx}"),
                g.get("pci_bus_id", ""),
                m.pci_device_id,
                m.pci_subsystem_id,
                m.memory_total_mib,
            )
            procs = tuple(
                GpuProcess(int(p["pid"]), p.get("gi_id"), p.get("ci_id"))
                for p in g.get("processes", ())
            )
            enabled = bool(g.get("mig_enabled", False))
            gpus.append(
                GpuState(
                    info, m.mig_capable, enabled, bool(g.get("mig_pending", enabled)), gis, procs
                )
            )
        return NodeState(tuple(gpus)), models
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a GPU state snapshot ({type(exc).__name__}: {exc})") from exc


def empty_node(models: list[GpuModel]) -> tuple[NodeState, dict[int, GpuModel]]:
    """GPUs of the given models with MIG disabled and nothing on them."""
    gpus = tuple(
        GpuState(
            GpuInfo(
                i,
                m.name,
                f"GPU-planned-{i}",
                f"00000000:{0x18 + i:02X}:00.0",
                m.pci_device_id,
                m.pci_subsystem_id,
                m.memory_total_mib,
            ),
            m.mig_capable,
        )
        for i, m in enumerate(models)
    )
    return NodeState(gpus), dict(enumerate(models))


def compact(
    node: NodeState,
    models: Mapping[int, GpuModel],
    holders: Mapping[str, frozenset[str]] | None = None,
) -> str:
    """A small, stable JSON of the GPUs (model, UUID, mode, instances, placements and MIG
    devices' UUIDs: what ``verify`` holds a pod's device to) for a node annotation;
    ``from_json(json.loads(...))`` reads it back. ``holders``: pod UID -> the device ids it
    holds (mig_agent.core.pod_devices), kept beside the GPUs where any; ``holders_of`` reads
    them back."""
    gpus = []
    for g in to_json(node, models)["gpus"]:
        gpus.append(
            {
                "index": g["index"],
                "model": g["model"],
                "uuid": g["uuid"],
                "mig_enabled": g["mig_enabled"],
                "mig_pending": g["mig_pending"],
                "gpu_instances": [
                    {
                        "id": gi["id"],
                        "profile_id": gi["profile_id"],
                        "placement": gi["placement"],
                        "compute_instances": [
                            {
                                "id": ci["id"],
                                "profile_id": ci["profile_id"],
                                "placement": ci["placement"],
                                **({"uuid": ci["uuid"]} if ci["uuid"] else {}),
                            }
                            for ci in gi["compute_instances"]
                        ],
                    }
                    for gi in g["gpu_instances"]
                ],
            }
        )
    doc: dict[str, Any] = {"gpus": gpus}
    if holders:
        doc["holders"] = {uid: sorted(ids) for uid, ids in holders.items()}
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


def holders_of(raw: Mapping[str, Any]) -> dict[str, frozenset[str]]:
    """The ``holders`` of a compact GPU state (pod UID -> device ids); none where it has none
    or they are not as ``compact`` writes them (a pod not named is judged by kind)."""
    got = raw.get("holders")
    if not isinstance(got, dict):
        return {}
    return {
        str(uid): frozenset(str(i) for i in ids)
        for uid, ids in got.items()
        if isinstance(ids, list) and all(isinstance(i, str) for i in ids)
    }
