"""We test these aspects of the desired-state values (mig_agent.core.layout):

* MigProfile: parse and str round-trip for generated names and for every name of every catalog
  model; non-canonical spellings canonicalise; malformed names are refused with a reason;
* DeviceFilter: the PCI id forms mig-parted accepts (with and without a subsystem), matching;
* DeviceSelector and Layout.target_for: which GPUs a rule selects, the last rule wins;
* GpuLayout: canonical, so equal partitions compare and hash equal whatever the order;
* LayoutCatalog: lookup, close-match hints for unknown names, names defined twice.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mig_agent.core.errors import InvalidConfig, UnknownLayout
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.layout import (
    DeviceFilter,
    DeviceSelector,
    GpuLayout,
    Layout,
    LayoutCatalog,
    MigProfile,
    Rule,
)

# ---------------------------------------------------------------------------------------------
# MigProfile

ATTRIBUTE = st.from_regex(r"[A-Za-z][A-Za-z0-9.]{0,5}", fullmatch=True)


@st.composite
def profile_names(draw: st.DrawFn) -> str:
    """Canonical profile names: C only when below G, unique attributes with one sign."""
    g = draw(st.integers(1, 8))
    c = draw(st.integers(1, g))
    gb = draw(st.integers(1, 400))
    attrs = draw(st.lists(ATTRIBUTE, max_size=3, unique=True))
    head = f"{g}g.{gb}gb" if c == g else f"{c}c.{g}g.{gb}gb"
    if not attrs:
        return head
    return head + draw(st.sampled_from("+-")) + ",".join(attrs)


@given(profile_names())
def test_profile_name_round_trips(name: str) -> None:
    profile = MigProfile.parse(name)
    assert str(profile) == name
    assert MigProfile.parse(str(profile)) == profile


CATALOG_NAMES = sorted({name for m in MODELS.values() for name in m.device_names()})


@pytest.mark.parametrize("name", CATALOG_NAMES)
def test_every_catalog_device_name_round_trips(name: str) -> None:
    assert str(MigProfile.parse(name)) == name


def test_profile_fields() -> None:
    assert MigProfile.parse("1c.3g.71gb") == MigProfile(1, 3, 71)
    assert MigProfile.parse("1g.18gb+me") == MigProfile(1, 1, 18, ("me",))
    assert MigProfile.parse("1g.24gb-me") == MigProfile(1, 1, 24, ("me",), negative=True)
    assert MigProfile.parse("1g.24gb+me.all") == MigProfile(1, 1, 24, ("me.all",))
    assert MigProfile.parse("1g.24gb+me") != MigProfile.parse("1g.24gb-me")


def test_non_canonical_spelling_canonicalises() -> None:
    assert str(MigProfile.parse("1c.1g.10gb")) == "1g.10gb"
    assert MigProfile.parse("3c.3g.40gb") == MigProfile.parse("3g.40gb")


def test_profiles_sort_largest_first() -> None:
    names = ["1g.10gb", "7g.80gb", "1c.3g.40gb", "3g.40gb", "1g.20gb", "2g.20gb", "1g.10gb+me"]
    ordered = sorted((MigProfile.parse(n) for n in names), key=lambda p: p.sort_key)
    assert [str(p) for p in ordered] == [
        "7g.80gb",
        "3g.40gb",
        "1c.3g.40gb",
        "2g.20gb",
        "1g.20gb",
        "1g.10gb",
        "1g.10gb+me",
    ]


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "is not a MIG profile name"),
        ("1g10gb", "is not a MIG profile name"),
        ("1g.10", "is not a MIG profile name"),
        ("g.10gb", "is not a MIG profile name"),
        ("0g.10gb", "is not a MIG profile name"),
        ("1g.0gb", "is not a MIG profile name"),
        ("01g.10gb", "is not a MIG profile name"),
        ("1G.10GB", "is not a MIG profile name"),
        (" 1g.10gb", "is not a MIG profile name"),
        ("1g.10gb ", "is not a MIG profile name"),
        ("1g.10gb+", "is not a MIG profile name"),
        ("1g.10gb+1me", "is not a MIG profile name"),
        ("1g.10gb+me-gfx", "is not a MIG profile name"),
        ("1c.1c.1g.10gb", "is not a MIG profile name"),
        ("all-1g.10gb", "is not a MIG profile name"),
        ("2c.1g.10gb", "compute slices 2c exceed GPU slices 1g"),
        ("1g.10gb+me,me", "repeated attribute"),
    ],
)
def test_malformed_profile_names_are_refused(name: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        MigProfile.parse(name)


# ---------------------------------------------------------------------------------------------
# DeviceFilter and DeviceSelector


def test_device_filter_forms() -> None:
    assert DeviceFilter.parse("0x233010DE") == DeviceFilter(0x233010DE)
    assert DeviceFilter.parse("0x233510de") == DeviceFilter(0x233510DE)
    assert DeviceFilter.parse("0X20B710DE") == DeviceFilter(0x20B710DE)
    with_sub = DeviceFilter.parse("0x233510DE:0x18BF10DE")
    assert with_sub == DeviceFilter(0x233510DE, 0x18BF10DE)
    assert str(with_sub) == "0x233510DE:0x18BF10DE"
    assert str(DeviceFilter.parse("0x20b010de")) == "0x20B010DE"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "MODEL",
        "H100",
        "0x2330",
        "233010DE",
        "0x233010DE0",
        "0xZZ3010DE",
        "0x233010DE:0x18BF",
        "0x233010DE:MODEL",
        "0x233010DE:",  # mig-parted refuses the empty subsystem too
        "0x233010DE:0x18BF10DE:0x18BF10DE",
        ":0x18BF10DE",
        "590352606",
    ],
)
def test_device_filter_refuses_what_is_no_pci_id(text: str) -> None:
    with pytest.raises(ValueError, match="is not a PCI id of the form 0xDDDDVVVV"):
        DeviceFilter.parse(text)


def test_device_filter_matching() -> None:
    primary = DeviceFilter(0x233510DE)
    assert primary.matches(0x233510DE, 0x18BF10DE)
    assert primary.matches(0x233510DE, 0)
    assert not primary.matches(0x233B10DE, 0x18BF10DE)
    exact = DeviceFilter(0x233510DE, 0x18BF10DE)
    assert exact.matches(0x233510DE, 0x18BF10DE)
    assert not exact.matches(0x233510DE, 0x18C010DE)
    assert not exact.matches(0x233510DE, 0)  # a GPU whose subsystem id is unknown
    assert not exact.matches(0x233B10DE, 0x18BF10DE)  # both ids, not either
    assert DeviceFilter(0x233510DE, 0).matches(0x233510DE, 0)


def test_selector_matching() -> None:
    anything = DeviceSelector()
    assert anything.matches(0, 0x233510DE, 0) and anything.matches(15, 0x1FB010DE, 0)
    some = DeviceSelector(indices=frozenset({1, 3}))
    assert some.matches(3, 0x233510DE, 0) and not some.matches(2, 0x233510DE, 0)
    h100 = DeviceSelector(filters=(DeviceFilter(0x233010DE), DeviceFilter(0x233110DE)))
    assert h100.matches(5, 0x233110DE, 0) and not h100.matches(5, 0x233510DE, 0)
    both = DeviceSelector(frozenset({0}), (DeviceFilter(0x20B210DE),))
    assert both.matches(0, 0x20B210DE, 0)
    assert not both.matches(1, 0x20B210DE, 0)
    assert not both.matches(0, 0x1FB010DE, 0)


# ---------------------------------------------------------------------------------------------
# GpuLayout and Layout


def p(name: str) -> MigProfile:
    return MigProfile.parse(name)


def test_gpu_layout_is_canonical() -> None:
    a = GpuLayout.of(True, {p("1g.18gb"): 2, p("3g.71gb"): 1, p("2g.35gb"): 1})
    b = GpuLayout.of(True, {p("2g.35gb"): 1, p("1g.18gb"): 2, p("3g.71gb"): 1, p("1g.35gb"): 0})
    assert a == b and hash(a) == hash(b)
    assert a.counts == {"3g.71gb": 1, "2g.35gb": 1, "1g.18gb": 2}
    assert [str(x) for x in a.flatten()] == ["3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"]
    assert str(a) == "3g.71gb x1, 2g.35gb x1, 1g.18gb x2"
    assert GpuLayout.of(True, {p("1c.1g.10gb"): 7}) == GpuLayout.of(True, {p("1g.10gb"): 7})


def test_gpu_layout_distinguishes_mode_and_counts() -> None:
    assert GpuLayout.of(False) != GpuLayout.of(True)
    assert GpuLayout.of(True, {p("1g.18gb"): 0}) == GpuLayout.of(True)
    assert GpuLayout.of(True, {p("1g.18gb"): 6}) != GpuLayout.of(True, {p("1g.18gb"): 7})
    assert str(GpuLayout.of(False)) == "MIG disabled"
    assert str(GpuLayout.of(True)) == "MIG enabled, no devices"


def test_target_for_walks_rules_and_the_last_match_wins() -> None:
    off = GpuLayout.of(False)
    seven = GpuLayout.of(True, {p("1g.10gb"): 7})
    two = GpuLayout.of(True, {p("3g.40gb"): 2})
    layout = Layout(
        "mixed",
        (
            Rule(DeviceSelector(filters=(DeviceFilter(0x20B210DE),)), seven),
            Rule(DeviceSelector(frozenset({1})), two),
            Rule(DeviceSelector(frozenset({2}), (DeviceFilter(0x1FB010DE),)), off),
        ),
    )
    assert layout.target_for(0, 0x20B210DE, 0) == seven
    assert layout.target_for(1, 0x20B210DE, 0) == two
    assert layout.target_for(2, 0x20B210DE, 0) == seven
    assert layout.target_for(2, 0x1FB010DE, 0) == off
    assert layout.target_for(0, 0x1FB010DE, 0) is None


# ---------------------------------------------------------------------------------------------
# LayoutCatalog


def catalog(*names: str, source: str = "x.yaml") -> LayoutCatalog:
    rule = Rule(DeviceSelector(), GpuLayout.of(False))
    return LayoutCatalog.of(Layout(n, (rule,), source) for n in names)


def test_catalog_lookup() -> None:
    cat = catalog("all-1g.10gb", "all-balanced", "all-1g.20gb")
    assert cat.get("all-balanced").name == "all-balanced"
    assert "all-1g.20gb" in cat and "all-1g.5gb" not in cat
    assert cat.names() == ("all-1g.10gb", "all-1g.20gb", "all-balanced")


def test_unknown_layout_names_close_matches() -> None:
    cat = catalog("all-1g.10gb", "all-balanced", "all-1g.20gb", "h200-1x3g-4x1g")
    with pytest.raises(UnknownLayout) as info:
        cat.get("all-1g.10g")
    message = str(info.value)
    assert "unknown layout 'all-1g.10g'; did you mean all-1g.10gb" in message
    assert "known layouts: all-1g.10gb, all-1g.20gb, all-balanced, h200-1x3g-4x1g" in message
    assert info.value.context == {"layout": "all-1g.10g"}
    with pytest.raises(UnknownLayout) as info:
        cat.get("zzz")
    assert "did you mean" not in str(info.value)
    with pytest.raises(UnknownLayout, match=r"\(known layouts: \(none\)\)"):
        catalog().get("all-balanced")


def test_catalog_refuses_a_name_defined_twice() -> None:
    rule = Rule(DeviceSelector(), GpuLayout.of(False))
    with pytest.raises(InvalidConfig) as info:
        LayoutCatalog.of([Layout("a", (rule,), "one.yaml"), Layout("a", (rule,), "two.yaml")])
    assert str(info.value) == "layout 'a' is defined twice: in one.yaml and in two.yaml"
    assert info.value.context == {"layout": "a"}
