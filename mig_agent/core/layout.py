"""Desired state: MIG profile names, device selectors, per-GPU layouts, named layouts.

A *layout* is one named entry of the profile configs (mig-parted calls it a mig-config): rules
that map GPUs to a partition. A *MIG profile* is a name such as ``1g.18gb``. Values are frozen and
canonical, so equal layouts compare equal. Pure module: no I/O.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mig_agent.core.errors import InvalidConfig, UnknownLayout

# [<C>c.]<G>g.<GB>gb[+attr[,attr...] | -attr[,attr...]]; attributes alphanumeric or '.', not
# starting with a digit.
_PROFILE = re.compile(
    r"(?:(?P<c>[1-9]\d*)c\.)?(?P<g>[1-9]\d*)g\.(?P<gb>[1-9]\d*)gb"
    r"(?:(?P<sign>[+-])(?P<attrs>[A-Za-z][A-Za-z0-9.]*(?:,[A-Za-z][A-Za-z0-9.]*)*))?"
)


@dataclass(frozen=True, slots=True)
class MigProfile:
    """A MIG profile name: ``1g.18gb``, ``1c.3g.71gb``, ``1g.18gb+me``, ``1g.24gb-me``.

    Only the name is modelled; NVML profile ids differ per GPU model and are resolved per GPU.
    """

    compute_slices: int
    gpu_slices: int
    memory_gb: int
    attributes: tuple[str, ...] = ()
    negative: bool = False

    @classmethod
    def parse(cls, text: str) -> MigProfile:
        """Parse a profile name; ValueError saying what is wrong with it."""
        m = _PROFILE.fullmatch(text)
        if m is None:
            raise ValueError(
                f"{text!r} is not a MIG profile name "
                "(expected e.g. 1g.10gb, 1c.3g.40gb, 1g.10gb+me)"
            )
        g = int(m["g"])
        c = int(m["c"]) if m["c"] else g
        attrs = tuple(m["attrs"].split(",")) if m["attrs"] else ()
        if c > g:
            raise ValueError(f"{text!r}: compute slices {c}c exceed GPU slices {g}g")
        if len(set(attrs)) != len(attrs):
            raise ValueError(f"{text!r}: repeated attribute")
        return cls(c, g, int(m["gb"]), attrs, m["sign"] == "-")

    def __str__(self) -> str:
        head = f"{self.gpu_slices}g.{self.memory_gb}gb"
        if self.compute_slices != self.gpu_slices:
            head = f"{self.compute_slices}c.{head}"
        if self.attributes:
            return head + ("-" if self.negative else "+") + ",".join(self.attributes)
        return head

    @property
    def sort_key(self) -> tuple[int, int, int, str]:
        """Largest first: by G, then C, then memory, then attributes (mig-parted's order)."""
        return (-self.gpu_slices, -self.compute_slices, -self.memory_gb, str(self))


@dataclass(frozen=True, slots=True)
class DeviceFilter:
    """A PCI id ``0xDDDDVVVV`` (device, vendor), optionally with ``:0xSSSSVVVV`` (subsystem)."""

    device_id: int
    subsystem_id: int | None = None

    @classmethod
    def parse(cls, text: str) -> DeviceFilter:
        """ValueError unless ``text`` is a PCI id that could match a GPU (mig-parted v0.15's
        ``0xDDDDVVVV`` or ``0xDDDDVVVV:0xSSSSVVVV``; stricter: eight hex digits each)."""
        primary, sep, sub = text.partition(":")

        def pci(part: str) -> int:
            if not re.fullmatch(r"0[xX][0-9a-fA-F]{8}", part):
                raise ValueError(
                    f"device-filter {text!r} is not a PCI id of the form 0xDDDDVVVV "
                    "(device and vendor, e.g. 0x233010DE), optionally followed by :0xSSSSVVVV "
                    "(subsystem device and vendor)"
                )
            return int(part, 16)

        return cls(pci(primary), pci(sub) if sep else None)

    def matches(self, device_id: int, subsystem_id: int) -> bool:
        """With a subsystem id, both ids must be equal (a GPU whose subsystem id is unknown, 0,
        matches only a 0x00000000 subsystem); without, any subsystem matches."""
        return device_id == self.device_id and (
            self.subsystem_id is None or subsystem_id == self.subsystem_id
        )

    def __str__(self) -> str:
        text = f"0x{self.device_id:08X}"
        return text if self.subsystem_id is None else f"{text}:0x{self.subsystem_id:08X}"


@dataclass(frozen=True, slots=True)
class DeviceSelector:
    """mig-parted's ``devices`` and ``device-filter``, decoded: which GPUs a rule applies to."""

    indices: frozenset[int] | None = None  # None means all
    filters: tuple[DeviceFilter, ...] = ()  # empty means any model

    def matches(self, index: int, device_id: int, subsystem_id: int) -> bool:
        return (self.indices is None or index in self.indices) and (
            not self.filters or any(f.matches(device_id, subsystem_id) for f in self.filters)
        )


@dataclass(frozen=True, slots=True)
class GpuLayout:
    """The desired partition of one GPU: MIG on or off, and how many devices of each profile."""

    mig_enabled: bool
    devices: tuple[tuple[MigProfile, int], ...] = ()  # canonical: sorted, counts > 0

    @classmethod
    def of(cls, mig_enabled: bool, counts: Mapping[MigProfile, int] | None = None) -> GpuLayout:
        items = [(p, n) for p, n in (counts or {}).items() if n > 0]
        return cls(mig_enabled, tuple(sorted(items, key=lambda pn: pn[0].sort_key)))

    @property
    def counts(self) -> dict[str, int]:
        return {str(p): n for p, n in self.devices}

    def flatten(self) -> tuple[MigProfile, ...]:
        return tuple(p for p, n in self.devices for _ in range(n))

    def __str__(self) -> str:
        if not self.mig_enabled:
            return "MIG disabled"
        if not self.devices:
            return "MIG enabled, no devices"
        return ", ".join(f"{p} x{n}" for p, n in self.devices)


@dataclass(frozen=True, slots=True)
class Rule:
    """One entry of a layout: the GPUs it selects and the partition they get."""

    selector: DeviceSelector
    gpu_layout: GpuLayout


@dataclass(frozen=True, slots=True)
class Layout:
    """A named layout. Rules are walked in file order; a later rule overrides an earlier one."""

    name: str
    rules: tuple[Rule, ...]
    source: str = ""

    def target_for(self, index: int, device_id: int, subsystem_id: int) -> GpuLayout | None:
        """The partition for GPU ``index`` of the given PCI ids, or None if no rule selects it."""
        found: GpuLayout | None = None
        for rule in self.rules:
            if rule.selector.matches(index, device_id, subsystem_id):
                found = rule.gpu_layout
        return found


# an unknown layout's refusal lists the known ones up to this many, else counts them
LISTED_MAX = 10


@dataclass(frozen=True, slots=True)
class LayoutCatalog:
    """All layouts loaded from the profile configs, by name."""

    layouts: Mapping[str, Layout]

    @classmethod
    def of(cls, layouts: Iterable[Layout]) -> LayoutCatalog:
        by_name: dict[str, Layout] = {}
        for layout in layouts:
            if layout.name in by_name:
                first = by_name[layout.name].source
                raise InvalidConfig(
                    f"layout {layout.name!r} is defined twice: in {first} and in {layout.source}",
                    layout=layout.name,
                )
            by_name[layout.name] = layout
        return cls(by_name)

    def get(self, name: str) -> Layout:
        """The layout called ``name``; UnknownLayout naming close matches and the known ones
        (a count of them, beyond LISTED_MAX: the close matches are what helps)."""
        try:
            return self.layouts[name]
        except KeyError:
            close = difflib.get_close_matches(name, list(self.layouts), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            if len(self.layouts) > LISTED_MAX:
                known = f"{len(self.layouts)} known layouts; `mig-agent validate` lists them all"
            else:
                known = f"known layouts: {', '.join(sorted(self.layouts)) or '(none)'}"
            raise UnknownLayout(f"unknown layout {name!r}{hint} ({known})", layout=name) from None

    def __contains__(self, name: object) -> bool:
        return name in self.layouts

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.layouts))
