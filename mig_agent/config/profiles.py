"""The profile configs: mig-parted's ``version: v1`` YAML, read into a LayoutCatalog.

``parse_config`` is pure: it turns an already-parsed YAML document into typed Layouts, so that
past this module there is no ``"all"`` sentinel and no ``str | list[int]``. ``load_text`` and
``load_catalog`` add the YAML parsing and the file reading. ``fit_report`` says, for one GPU
model, which layouts select it and whether they fit it.

Validation is mig-parted's, made stricter where mig-parted silently does the wrong thing: a
device-filter that is no PCI id (it would match nothing), a key repeated in one mapping (YAML
would keep the last one), non-integer counts. Every error is an InvalidConfig whose message and
``.context`` name the file, the layout, the entry and the key.

The YAML itself is read by mig_agent.config.yaml_files.
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from mig_agent.config.yaml_files import DuplicateKey, parse, read
from mig_agent.core.errors import InvalidConfig, PlanError
from mig_agent.core.gpu_models import GpuModel
from mig_agent.core.layout import (
    DeviceFilter,
    DeviceSelector,
    GpuLayout,
    Layout,
    LayoutCatalog,
    MigProfile,
    Rule,
)
from mig_agent.core.planner import check_fits, demands_for

VERSION = "v1"
_TOP_KEYS = ("version", "mig-configs")
_ENTRY_KEYS = ("devices", "device-filter", "mig-enabled", "mig-devices")
# Layout names become the value of a node label, so they must be valid label values.
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE_MAX = 63
# GPU indices fit_report tries: enough for an 8-GPU node, which is what `devices: [i]` rules use.
FIT_INDICES = range(8)
STDIN = "-"
# what a layout may ask for: a count no GPU could hold (the planner expands counts), a GPU index
# no node has
MAX_COUNT = 64  # today's GPUs hold at most 7 MIG devices
MAX_GPU_INDEX = 255
_SHOWN_MAX = 80  # characters of a value an error message shows


# ---------------------------------------------------------------------------------------------
# Error locations


@dataclass(frozen=True, slots=True)
class _Where:
    """Where in a config file a value sits; builds InvalidConfig errors that say so."""

    file: str
    layout: str | None = None
    entry: int | None = None  # 1-based, as a human counts list items
    key: str | None = None

    def at(self, key: str) -> _Where:
        return _Where(self.file, self.layout, self.entry, key)

    def error(self, message: str, **extra: object) -> InvalidConfig:
        parts = []
        if self.layout is not None:
            parts.append(f"layout {_shown(self.layout)}")
        if self.entry is not None:
            parts.append(f"entry {self.entry}")
        if self.key is not None:
            parts.append(f"key {_shown(self.key)}")
        head = f"{self.file}: {', '.join(parts)}" if parts else self.file
        context: dict[str, object] = {"file": self.file}
        context.update(
            (k, v)
            for k, v in (("layout", self.layout), ("entry", self.entry), ("key", self.key))
            if v is not None
        )
        return InvalidConfig(f"{head}: {message}", **context, **extra)


def _shown(text: str) -> str:
    """``repr(text)``, but a hostile file's megabyte of text stays out of the message."""
    if len(text) <= _SHOWN_MAX:
        return repr(text)
    return f"{text[:_SHOWN_MAX]!r}... ({len(text)} characters)"


def _got(value: object) -> str:
    """A value as an error message shows it, with its YAML type where that is the problem."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return f"{_shown(value)} (a string)"
    if isinstance(value, float):
        return f"{value} (a number)"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)  # bool is an int in Python


def _unknown_key(where: _Where, key: object, allowed: Sequence[str]) -> InvalidConfig:
    if not isinstance(key, str):
        return where.error(f"keys must be strings, got {_got(key)}")
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return where.at(key).error(f"unknown key (allowed: {', '.join(allowed)}){hint}")


# ---------------------------------------------------------------------------------------------
# The document -> Layouts


def parse_config(data: object, *, source: str) -> list[Layout]:
    """The layouts of one parsed config document, in file order; InvalidConfig if malformed."""
    top = _Where(source)
    if data is None:
        raise top.error("the file is empty (expected 'version: v1' and 'mig-configs')")
    if not isinstance(data, dict):
        raise top.error(f"expected a mapping with 'version' and 'mig-configs', got {_got(data)}")
    for key in data:
        if key not in _TOP_KEYS:
            raise _unknown_key(top, key, _TOP_KEYS)

    if "version" not in data:
        raise top.at("version").error(f"missing; the only supported version is {VERSION!r}")
    version = data["version"]
    if not isinstance(version, str):
        raise top.at("version").error(f"must be the string {VERSION!r}, got {_got(version)}")
    if version != VERSION:
        raise top.at("version").error(
            f"unsupported version {_shown(version)}; the only supported version is {VERSION!r}"
        )

    if "mig-configs" not in data:
        raise top.at("mig-configs").error("missing; it maps each layout name to its entries")
    configs = data["mig-configs"]
    if not isinstance(configs, dict):
        raise top.at("mig-configs").error(
            f"must be a mapping of layout name to a list of entries, got {_got(configs)}"
        )
    if not configs:
        raise top.at("mig-configs").error("defines no layouts")
    return [_parse_layout(name, raw, source) for name, raw in configs.items()]


def _parse_layout(name: object, raw: object, source: str) -> Layout:
    if not isinstance(name, str):
        raise _Where(source, layout=str(name)).error(
            f"layout names must be strings, got {_got(name)}; quote the name"
        )
    where = _Where(source, layout=name)
    if not name:
        raise where.error("layout names must not be empty")
    if len(name) > _LABEL_VALUE_MAX or not _LABEL_VALUE.fullmatch(name):
        raise where.error(
            "not a valid Kubernetes label value (at most 63 characters of A-Z, a-z, 0-9, "
            "'-', '_', '.', starting and ending with a letter or digit); the name is set "
            "as a node label"
        )
    if not isinstance(raw, list):
        raise where.error(f"must be a list of entries, got {_got(raw)}")
    if not raw:
        raise where.error("has no entries")
    rules = tuple(_parse_rule(item, _Where(source, name, i)) for i, item in enumerate(raw, 1))
    return Layout(name, rules, source)


def _parse_rule(raw: object, where: _Where) -> Rule:
    if not isinstance(raw, dict):
        raise where.error(
            f"each entry must be a mapping with 'devices' and 'mig-enabled', got {_got(raw)}"
        )
    for key in raw:
        if key not in _ENTRY_KEYS:
            raise _unknown_key(where, key, _ENTRY_KEYS)

    if "devices" not in raw:
        raise where.at("devices").error("missing; use 'all' or a list of GPU indices")
    indices = _parse_devices(raw["devices"], where.at("devices"))
    filters = (
        _parse_device_filter(raw["device-filter"], where.at("device-filter"))
        if "device-filter" in raw
        else ()
    )

    if "mig-enabled" not in raw:
        raise where.at("mig-enabled").error("missing; use true or false")
    enabled = raw["mig-enabled"]
    if not isinstance(enabled, bool):
        raise where.at("mig-enabled").error(f"must be true or false, got {_got(enabled)}")

    counts: dict[MigProfile, int] = {}
    if "mig-devices" in raw:
        counts = _parse_mig_devices(raw["mig-devices"], where.at("mig-devices"))
    elif enabled:
        raise where.at("mig-devices").error(
            "missing; required when mig-enabled is true (use {} for MIG enabled without devices)"
        )
    if not enabled and counts:
        raise where.at("mig-devices").error("must be empty or absent when mig-enabled is false")

    return Rule(DeviceSelector(indices, filters), GpuLayout.of(enabled, counts))


def _parse_devices(value: object, where: _Where) -> frozenset[int] | None:
    expected = "must be 'all' or a list of GPU indices"
    if value == "all":
        return None
    if _is_int(value):
        raise where.error(f"{expected}, got {_got(value)}; write [{value}] for one GPU")
    if not isinstance(value, list):
        raise where.error(f"{expected}, got {_got(value)}")
    if not value:
        raise where.error(f"{expected}, got an empty list")
    seen: set[int] = set()
    for index in value:
        if not _is_int(index) or index < 0:
            raise where.error(f"GPU index must be an integer >= 0, got {_got(index)}")
        if index > MAX_GPU_INDEX:
            raise where.error(f"GPU index {index} is beyond any node (at most {MAX_GPU_INDEX})")
        if index in seen:
            raise where.error(f"GPU index {index} is listed twice")
        seen.add(index)
    return frozenset(seen)


def _parse_device_filter(value: object, where: _Where) -> tuple[DeviceFilter, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise where.error(
            f"must be a PCI id string or a list of them, got {_got(value)}" + _hex_hint(value)
        )
    if not items:
        raise where.error("must not be an empty list; leave device-filter out to select any model")
    filters = []
    for item in items:
        if not isinstance(item, str):
            raise where.error(
                f"each filter must be a PCI id string, got {_got(item)}" + _hex_hint(item)
            )
        try:
            filters.append(DeviceFilter.parse(item))
        except ValueError as e:
            raise where.error(str(e)) from None
    return tuple(filters)


def _hex_hint(value: object) -> str:
    # YAML reads an unquoted 0x233010DE as the integer 590356702; say how to write it.
    if _is_int(value) and 0 <= value < 1 << 32:
        return f'; quote PCI ids, e.g. "0x{value:08X}"'
    return ""


def _parse_mig_devices(value: object, where: _Where) -> dict[MigProfile, int]:
    if not isinstance(value, dict):
        raise where.error(
            f'must be a mapping of MIG profile name to count (e.g. {{"1g.10gb": 7}}), '
            f"got {_got(value)}"
        )
    counts: dict[MigProfile, int] = {}
    spelled: dict[MigProfile, str] = {}
    for name, count in value.items():
        if not isinstance(name, str):
            raise where.error(f"MIG profile names must be strings, got {_got(name)}")
        try:
            profile = MigProfile.parse(name)
        except ValueError as e:
            if len(name) > _SHOWN_MAX:  # no MIG profile name is that long
                raise where.error(
                    f"{_shown(name)} is not a MIG profile name", profile=name[:_SHOWN_MAX]
                ) from None
            raise where.error(str(e), profile=name) from None
        if profile in counts:
            raise where.error(
                f"{spelled[profile]!r} and {name!r} are the same profile {profile}", profile=name
            )
        if not _is_int(count) or count < 0:
            raise where.error(
                f"count for {name!r} must be an integer >= 0, got {_got(count)}", profile=name
            )
        if count > MAX_COUNT:
            raise where.error(
                f"count for {name!r} is {count}; no GPU holds more than {MAX_COUNT} MIG devices "
                "(today's hold at most 7)",
                profile=name,
            )
        counts[profile] = count
        spelled[profile] = name
    if counts and not any(counts.values()):
        raise where.error(
            "every count is 0; give a profile a count > 0, or use {} for MIG without devices"
        )
    return counts


# ---------------------------------------------------------------------------------------------
# YAML text and files -> Layouts


def _duplicate_key_error(source: str, dup: DuplicateKey) -> InvalidConfig:
    path, lines = dup.path, dup.lines
    if path == ("mig-configs",):
        return _Where(source, dup.key).error(
            f"defined twice in this file ({lines})", line=dup.again
        )
    layout = str(path[1]) if len(path) >= 2 and path[0] == "mig-configs" else None
    entry = path[2] + 1 if len(path) >= 3 and isinstance(path[2], int) else None
    where = _Where(source, layout, entry)
    if path == () or (len(path) == 3 and entry is not None):  # a top-level or an entry key
        return where.at(dup.key).error(f"appears twice ({lines})", line=dup.again)
    if len(path) == 4 and entry is not None and path[3] == "mig-devices":
        return where.at("mig-devices").error(
            f"profile {dup.key!r} appears twice ({lines})", line=dup.again, profile=dup.key
        )
    return where.error(f"key {dup.key!r} appears twice ({lines})", line=dup.again)


def load_text(text: str, source: str) -> list[Layout]:
    """The layouts of one config file's text; InvalidConfig naming ``source`` if malformed."""
    return parse_config(parse(text, source, on_duplicate=_duplicate_key_error), source=source)


def load_catalog(paths: Sequence[str | Path]) -> LayoutCatalog:
    """All layouts of the given files, directories (their ``*.yaml``/``*.yml``) and ``-`` (stdin).

    InvalidConfig for unreadable or malformed files, or a layout name defined in two files.
    """
    layouts: list[Layout] = []
    for source, text in _read_sources(paths):
        layouts.extend(load_text(text, source))
    return LayoutCatalog.of(layouts)


def _read_sources(paths: Sequence[str | Path]) -> Iterator[tuple[str, str]]:
    for path in paths:
        if str(path) == STDIN:
            yield "<stdin>", sys.stdin.read()
            continue
        path = Path(path)
        if path.is_dir():
            # Dot-files are skipped: ConfigMap volumes hold '..data' links and editors leave
            # hidden swap files next to the real ones.
            files = sorted(
                p
                for p in path.iterdir()
                if p.suffix in (".yaml", ".yml") and not p.name.startswith(".") and p.is_file()
            )
            if not files:
                raise InvalidConfig(
                    f"{path}: no *.yaml or *.yml files in this directory", file=str(path)
                )
            for file in files:
                yield str(file), read(file)
        else:
            yield str(path), read(path)


# ---------------------------------------------------------------------------------------------
# Which layouts suit a GPU model


@dataclass(frozen=True, slots=True)
class FitResult:
    """Whether one layout suits one GPU model."""

    layout: str
    model: str  # GpuModel.key
    applies: bool  # some rule selects a GPU of this model (at an index in FIT_INDICES)
    fits: bool  # applies, and every partition it selects for this model fits the model
    reason: str = ""  # why not, when it does not fit or does not apply
    by_filter: bool = False  # a selecting rule names this model's PCI id in its device-filter
    targets: tuple[GpuLayout, ...] = ()  # the distinct partitions selected for this model
    # Profile names those partitions use that this model does not have: a layout written for
    # other models (NVIDIA's all-<profile> layouts select every GPU) rather than a broken one.
    unknown_profiles: tuple[str, ...] = ()


def fit_report(catalog: LayoutCatalog, model: GpuModel) -> list[FitResult]:
    """For every layout (by name), whether it applies to ``model`` and whether it fits."""
    return [_fit(catalog.layouts[name], model) for name in catalog.names()]


def _fit(layout: Layout, model: GpuModel) -> FitResult:
    pci, subsystem = model.pci_device_id, model.pci_subsystem_id
    by_target: dict[GpuLayout, list[int]] = {}
    for index in FIT_INDICES:
        target = layout.target_for(index, pci, subsystem)
        if target is not None:
            by_target.setdefault(target, []).append(index)
    if not by_target:
        return FitResult(
            layout.name, model.key, False, False, f"selects no {model.key} GPU (PCI id 0x{pci:08X})"
        )
    by_filter = any(
        bool(rule.selector.filters) and rule.selector.matches(i, pci, subsystem)
        for rule in layout.rules
        for i in FIT_INDICES
    )
    targets = tuple(by_target)
    reason = ""
    for target, indices in by_target.items():
        where = model.key
        if len(indices) < len(FIT_INDICES):
            where += f" GPU {','.join(map(str, indices))}"
        reason = _misfit(model, target, where)
        if reason:
            break
    unknown = sorted(
        {
            str(p)
            for t in targets
            if t.mig_enabled
            for p, _ in t.devices
            if model.mig_capable and model.resolve(str(p)) is None
        }
    )
    return FitResult(
        layout.name, model.key, True, not reason, reason, by_filter, targets, tuple(unknown)
    )


def _misfit(model: GpuModel, target: GpuLayout, where: str) -> str:
    """Why ``target`` cannot be made on an empty GPU of ``model``, or '' if it can."""
    if not target.mig_enabled:
        return ""
    if not model.mig_capable:
        return f"{where}: {model.name} does not support MIG"
    try:
        check_fits(model, [d.gi for d in demands_for(model, target, where)], where)
    except PlanError as e:
        return str(e)
    return ""


__all__ = [
    "FIT_INDICES",
    "FitResult",
    "VERSION",
    "fit_report",
    "load_catalog",
    "load_text",
    "parse_config",
]
