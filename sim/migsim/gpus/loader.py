"""Reads the GPU model files (one YAML file per model, beside this module) into GpuModel values.

A file is strict: a key repeated in one mapping, a key the format does not know, or a value of the
wrong type is refused with the file and the place in it, and so are tables that contradict NVML's
rules (a profile index whose slice count or capability differs from the name, a placement off the
grid, more instances than placements). Any mapping may hold ``inferred: {field: reason}``, marking
values of that mapping that have no readout behind them (``list.field`` marks that field of every
row of a list); they are kept as GpuModel.inferred. A top-level ``reasons`` mapping only holds
YAML anchors for those reasons.

Format (see h200.yaml): key, name, architecture, brand, compute_capability, pci_device_id,
pci_subsystem_ids, memory_total_mib, multiprocessors, and for MIG-capable models ``mig`` with
mode_change_needs_reset, memory_slices, compute_slices, placement_grid and gi_profiles (name,
index, id, slices, instances, memory_mib, multiprocessors, engines {ce, dec, enc, jpg, ofa},
placements "{starts}:size", compute_instances [{index, id, slices, instances, multiprocessors,
placements}]); ``variants`` lists other PCI ids of the same tables (key, name, pci_device_id,
pci_subsystem_ids, memory_total_mib); ``readings`` (optional) what the driver reports of the idle
GPU: temperature_c, power_draw_mw, power_limit_mw, performance_state, ecc_enabled.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from migsim.gpus.models import (
    Architecture,
    Brand,
    CiProfile,
    Engines,
    GiProfile,
    GpuModel,
    Inferred,
    Placement,
    Readings,
)

# NVML_GPU_INSTANCE_PROFILE_* (nvml.h): index -> (compute slices, capability in the name).
GI_PROFILE_SHAPES: Mapping[int, tuple[int, str]] = {
    0x0: (1, ""),
    0x1: (2, ""),
    0x2: (3, ""),
    0x3: (4, ""),
    0x4: (7, ""),
    0x5: (8, ""),
    0x6: (6, ""),
    0x7: (1, "+me"),  # 1_SLICE_REV1
    0x8: (2, "+me"),  # 2_SLICE_REV1
    0x9: (1, ""),  # 1_SLICE_REV2: twice the memory
    0xA: (1, "+gfx"),
    0xB: (2, "+gfx"),
    0xC: (4, "+gfx"),
    0xD: (1, "-me"),  # NO_ME
    0xE: (2, "-me"),
    0xF: (1, "+me.all"),  # ALL_ME
    0x10: (2, "+me.all"),
    0x11: (3, "+gfx"),
}
# NVML_COMPUTE_INSTANCE_PROFILE_*: index -> compute slices (7 is 1_SLICE_REV1, 8 7_SLICE_NVL).
CI_PROFILE_SLICES: Mapping[int, int] = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6, 7: 1, 8: 7}

_NAME = re.compile(r"(?P<g>\d+)g\.(?P<gb>\d+)gb(?P<cap>\+me\.all|\+me|\+gfx|-me)?")
_PLACEMENTS = re.compile(r"\{(?P<starts>\d+(?:,\d+)*)\}:(?P<size>\d+)")

T = TypeVar("T")


class GpuDataError(ValueError):
    """A GPU model file that cannot be read, or whose tables break NVML's rules."""


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key repeated in one mapping (plain YAML keeps the last)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise GpuDataError(f"key {key!r} repeated (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _Fields:
    """One mapping of a file, read field by field: types checked, unknown keys refused, its
    ``inferred`` marks collected under ``where``."""

    def __init__(self, raw: object, where: str, inferred: list[Inferred]) -> None:
        if not isinstance(raw, Mapping):
            raise GpuDataError(f"{where}: expected a mapping, got {type(raw).__name__}")
        self.raw, self.where, self._inferred = raw, where, inferred
        marks = raw.get("inferred", {})
        if not isinstance(marks, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in marks.items()
        ):
            raise GpuDataError(f"{where}.inferred: expected field: reason (text)")
        self._marks: Mapping[str, str] = marks
        self._read: set[str] = {"inferred"}

    def _get(self, key: str, kind: type[T], default: object = ...) -> T:
        self._read.add(key)
        if key not in self.raw:
            if default is ...:
                raise GpuDataError(f"{self.where}: {key!r} missing")
            return default  # type: ignore[return-value]
        value = self.raw[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise GpuDataError(f"{self.where}.{key}: expected {kind.__name__}, got {value!r}")
        return value

    def integer(self, key: str) -> int:
        return self._get(key, int)

    def optional_integer(self, key: str) -> int | None:
        self._read.add(key)
        return None if self.raw.get(key) is None else self._get(key, int)

    def text(self, key: str) -> str:
        return self._get(key, str)

    def flag(self, key: str) -> bool:
        return self._get(key, bool)

    def rows(self, key: str, default: object = ...) -> list[Any]:
        return self._get(key, list, default)

    def integer_or(self, key: str, default: int) -> int:
        return self._get(key, int, default)

    def skip(self, key: str) -> None:
        """``key`` may be there and holds nothing to read (YAML anchors)."""
        self._read.add(key)

    def sub(self, key: str, where: str | None = None) -> _Fields:
        self._read.add(key)
        return _Fields(self.raw.get(key), f"{self.where}.{where or key}", self._inferred)

    def done(self) -> None:
        unknown = set(self.raw) - self._read
        if unknown:
            raise GpuDataError(f"{self.where}: unknown key(s) {', '.join(sorted(unknown))}")
        for name, reason in self._marks.items():
            why = " ".join(reason.split())
            head, _, tail = name.partition(".")
            value = self.raw.get(head)
            if tail and isinstance(value, list):  # "compute_instances.placements": every row's
                rows = [r for r in value if isinstance(r, Mapping) and tail in r]
                if value and len(rows) == len(value):
                    self._inferred += [
                        Inferred(f"{self.where}.{head}[{i}].{tail}", why) for i in range(len(rows))
                    ]
                    continue
            elif not tail and head in self.raw and head != "inferred":
                self._inferred.append(Inferred(f"{self.where}.{name}", why))
                continue
            raise GpuDataError(f"{self.where}.inferred names {name!r}, which it does not hold")


def parse_placements(text: str) -> tuple[Placement, ...]:
    """``"{0,2,4}:2"`` (nvidia-smi mig -lgipp's form) -> the placements."""
    m = _PLACEMENTS.fullmatch(text.replace(" ", ""))
    if not m:
        raise GpuDataError(f"not placements like '{{0,2,4}}:2': {text!r}")
    size = int(m["size"])
    return tuple(Placement(int(s), size) for s in m["starts"].split(","))


def _placements(f: _Fields, key: str, grid: int) -> tuple[Placement, ...]:
    pls = parse_placements(f.text(key))
    if pls != tuple(sorted(set(pls))) or any(p.size < 1 or p.end > grid for p in pls):
        raise GpuDataError(f"{f.where}.{key}: placements must be ascending and within 0..{grid}")
    return pls


def _ci_profile(raw: object, where: str, gi_slices: int, inferred: list[Inferred]) -> CiProfile:
    f = _Fields(raw, where, inferred)
    ci = CiProfile(
        index=f.integer("index"),
        id=f.integer("id"),
        slices=f.integer("slices"),
        instance_count=f.integer("instances"),
        multiprocessors=f.integer("multiprocessors"),
        placements=_placements(f, "placements", gi_slices),
    )
    f.done()
    if CI_PROFILE_SLICES.get(ci.index) != ci.slices or ci.slices > gi_slices:
        raise GpuDataError(f"{where}: CI profile index {ci.index} with {ci.slices} slices")
    if any(p.size != ci.slices for p in ci.placements) or ci.instance_count > len(ci.placements):
        raise GpuDataError(
            f"{where}: placements do not fit {ci.slices} slices x {ci.instance_count}"
        )
    return ci


def _gi_profile(raw: object, where: str, grid: int, inferred: list[Inferred]) -> GiProfile:
    f = _Fields(raw, where, inferred)
    name = f.text("name")
    where = f.where = f"{where.rsplit('[', 1)[0]}[{name}]"
    e = f.sub("engines")
    engines = Engines(
        e.integer("ce"), e.integer("dec"), e.integer("enc"), e.integer("jpg"), e.integer("ofa")
    )
    e.done()
    slices = f.integer("slices")
    cis = f.rows("compute_instances")
    p = GiProfile(
        name=name,
        index=f.integer("index"),
        id=f.integer("id"),
        slices=slices,
        instance_count=f.integer("instances"),
        memory_mib=f.integer("memory_mib"),
        multiprocessors=f.integer("multiprocessors"),
        engines=engines,
        placements=_placements(f, "placements", grid),
        ci_profiles=tuple(
            _ci_profile(c, f"{where}.compute_instances[{i}]", slices, inferred)
            for i, c in enumerate(cis)
        ),
    )
    f.done()
    m = _NAME.fullmatch(name)
    if not m or (int(m["g"]), m["cap"] or "") != GI_PROFILE_SHAPES.get(p.index):
        raise GpuDataError(f"{where}: name {name!r} is not NVML profile index {p.index}'s shape")
    if int(m["g"]) != p.slices:
        raise GpuDataError(f"{where}: {p.slices} slices, but the name says {m['g']}")
    if len({pl.size for pl in p.placements}) != 1 or p.instance_count > len(p.placements):
        raise GpuDataError(f"{where}: placements of one size, at least one per instance")
    ids = [c.id for c in p.ci_profiles]
    if len(set(ids)) != len(ids) or not any(c.slices == p.slices for c in p.ci_profiles):
        raise GpuDataError(f"{where}: CI ids repeat, or no CI spans the GPU instance")
    return p


def _mig(f: _Fields) -> tuple[bool, int, int, int, tuple[GiProfile, ...]]:
    grid = f.integer("placement_grid")
    profiles = tuple(
        _gi_profile(p, f"{f.where}.gi_profiles[{i}]", grid, f._inferred)
        for i, p in enumerate(f.rows("gi_profiles"))
    )
    out = (
        f.flag("mode_change_needs_reset"),
        f.integer("memory_slices"),
        f.integer("compute_slices"),
        grid,
        profiles,
    )
    f.done()
    for what, values in (("index", [p.index for p in profiles]), ("id", [p.id for p in profiles])):
        if len(set(values)) != len(values):
            raise GpuDataError(f"{f.where}: a GI profile {what} repeats")
    if grid % out[1] or any(p.slices > out[2] for p in profiles):
        raise GpuDataError(f"{f.where}: grid, memory slices and profiles do not agree")
    return out


def _ids(f: _Fields, key: str) -> tuple[int, ...]:
    values = f.rows(key, [])
    if not all(isinstance(v, int) for v in values):
        raise GpuDataError(f"{f.where}.{key}: expected a list of ids")
    return tuple(values)


def _readings(f: _Fields) -> Readings:
    r = Readings(
        temperature_c=f.integer("temperature_c"),
        power_draw_mw=f.integer("power_draw_mw"),
        power_limit_mw=f.integer("power_limit_mw"),
        performance_state=f.integer("performance_state"),
        ecc_enabled=f.flag("ecc_enabled"),
    )
    f.done()
    if not 0 <= r.performance_state <= 15 or not 0 < r.power_draw_mw <= r.power_limit_mw:
        raise GpuDataError(f"{f.where}: a P-state is P0..P15; power drawn is within the limit")
    return r


def _model(f: _Fields, source: str, inferred: list[Inferred]) -> GpuModel:
    cc = f.rows("compute_capability")
    if len(cc) != 2 or not all(isinstance(v, int) for v in cc):
        raise GpuDataError(f"{f.where}.compute_capability: expected [major, minor]")
    try:
        arch = Architecture(f.text("architecture"))
    except ValueError:
        known = ", ".join(a.value for a in Architecture)
        raise GpuDataError(f"{f.where}.architecture: one of {known}") from None
    try:
        brand = Brand(f.text("brand"))
    except ValueError:
        known = ", ".join(b.value for b in Brand)
        raise GpuDataError(f"{f.where}.brand: one of {known}") from None
    reset, memory_slices, compute_slices, grid = False, 0, 0, 0
    profiles: tuple[GiProfile, ...] = ()
    if "mig" in f.raw:
        reset, memory_slices, compute_slices, grid, profiles = _mig(f.sub("mig"))
    readings = _readings(f.sub("readings")) if "readings" in f.raw else None
    return GpuModel(
        key=f.text("key"),
        name=f.text("name"),
        pci_device_id=f.integer("pci_device_id"),
        pci_subsystem_ids=_ids(f, "pci_subsystem_ids"),
        memory_total_mib=f.integer("memory_total_mib"),
        multiprocessors=f.optional_integer("multiprocessors"),
        architecture=arch,
        brand=brand,
        compute_capability=(cc[0], cc[1]),
        mig_mode_needs_reset=reset,
        memory_slices=memory_slices,
        compute_slices=compute_slices,
        placement_grid=grid,
        gi_profiles=profiles,
        inferred=(),
        source=source,
        readings=readings,
    )


def _variant(base: GpuModel, f: _Fields, inferred: list[Inferred]) -> GpuModel:
    v = dataclasses.replace(
        base,
        key=f.text("key"),
        name=f.text("name"),
        pci_device_id=f.integer("pci_device_id"),
        pci_subsystem_ids=_ids(f, "pci_subsystem_ids"),
        memory_total_mib=f.integer_or("memory_total_mib", base.memory_total_mib),
    )
    f.done()
    return v


def load_model_file(path: Path) -> tuple[GpuModel, ...]:
    """The model a file describes, then its variants (same tables, other PCI ids)."""
    try:
        raw = yaml.load(path.read_text(), Loader=_StrictLoader)  # a SafeLoader
    except (yaml.YAMLError, GpuDataError) as exc:
        raise GpuDataError(f"{path.name}: {exc}") from exc
    try:
        inferred: list[Inferred] = []
        f = _Fields(raw, "", inferred)
        f.skip("reasons")
        variants = f.rows("variants", [])
        model = _model(f, path.name, inferred)
        f.done()
        out = [dataclasses.replace(model, inferred=_tidy(inferred))]
        for i, raw_variant in enumerate(variants):
            mine: list[Inferred] = []
            v = _variant(model, _Fields(raw_variant, f"variants[{i}]", mine), mine)
            out.append(dataclasses.replace(v, inferred=_tidy(inferred + _unprefix(mine))))
    except GpuDataError as exc:
        raise GpuDataError(f"{path.name}: {exc}") from exc
    return tuple(out)


def _unprefix(marks: Iterable[Inferred]) -> list[Inferred]:
    return [Inferred(m.field.split(".", 1)[1], m.reason) for m in marks]


def _tidy(marks: Iterable[Inferred]) -> tuple[Inferred, ...]:
    return tuple(Inferred(m.field.lstrip("."), m.reason) for m in marks)


def load_models(folder: Path) -> dict[str, GpuModel]:
    """Every model (and variant) of the ``*.yaml`` files in ``folder``, by key; keys and PCI ids
    must be unique across them."""
    out: dict[str, GpuModel] = {}
    for path in sorted(folder.glob("*.yaml")):
        for m in load_model_file(path):
            same = (o for o in out.values() if m.key.lower() == o.key.lower())
            clash = next(same, None) or next(
                (o for o in out.values() if o.pci_device_id == m.pci_device_id), None
            )
            if clash is not None:
                raise GpuDataError(f"{path.name}: {m.key} has the key or PCI id of {clash.key}")
            out[m.key] = m
    return out
