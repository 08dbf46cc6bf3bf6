"""We test these aspects of the config loader (mig_agent.config.profiles):

* NVIDIA's own configs (tests/data/compat) load unchanged, with the content mig-parted reads;
* each malformed variant is refused with its own InvalidConfig naming file, layout, entry, key;
* YAML-level problems: repeated keys, syntax errors (with line and column), empty files;
* reading files, directories and stdin; a layout defined in two files;
* profiles/: every layout loads and fits every model it selects, each model has its all-*
  layouts, all-balanced and mixes of its own;
* fit_report on the GPU Operator default: NVIDIA's profile names match our catalog's names.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from mig_agent.config.profiles import FitResult, fit_report, load_catalog, load_text, parse_config
from mig_agent.core.errors import InvalidConfig
from mig_agent.core.gpu_models import FAMILY_PCI_IDS, MODELS, GpuModel
from mig_agent.core.layout import DeviceFilter, GpuLayout, Layout, LayoutCatalog, MigProfile

REPO = Path(__file__).resolve().parents[2]
COMPAT = REPO / "tests" / "data" / "compat"
SHARED_COMPAT = REPO.parent / "shared" / "reference" / "compat"
PROFILES = REPO / "profiles"
GPU_OPERATOR = COMPAT / "gpu-operator-default-mig-config.yaml"
EXAMPLE = COMPAT / "mig-parted-example-config.yaml"
DGX_STATION = COMPAT / "mig-parted-dgx-station-80gb-config.yaml"

MIG_MODELS = [m for m in MODELS.values() if m.mig_capable]
# Every PCI id our profiles select, by catalog model: the boards that share a model's profile
# names, counts and placements (SXM, PCIe, NVL, A800/H800, workstation editions).
FAMILY_IDS = FAMILY_PCI_IDS


def gl(counts: dict[str, int]) -> GpuLayout:
    return GpuLayout.of(True, {MigProfile.parse(k): v for k, v in counts.items()})


def fits_of(catalog: LayoutCatalog, model: GpuModel) -> dict[str, FitResult]:
    return {r.layout: r for r in fit_report(catalog, model)}


# ---------------------------------------------------------------------------------------------
# NVIDIA's configs


@pytest.mark.parametrize("path", sorted(COMPAT.glob("*.yaml")), ids=lambda p: p.name)
def test_nvidia_config_loads(path: Path) -> None:
    catalog = load_catalog([path])
    assert catalog.layouts
    assert all(layout.source == str(path) for layout in catalog.layouts.values())


def test_in_repo_copies_equal_the_reference_files() -> None:
    if not SHARED_COMPAT.is_dir():
        pytest.skip(f"{SHARED_COMPAT} is not present")
    names = sorted(p.name for p in SHARED_COMPAT.glob("*.yaml"))
    assert names == sorted(p.name for p in COMPAT.glob("*.yaml"))
    for name in names:
        assert (COMPAT / name).read_bytes() == (SHARED_COMPAT / name).read_bytes(), name


def test_gpu_operator_default_content() -> None:
    catalog = load_catalog([GPU_OPERATOR])
    assert len(catalog.layouts) == 81
    balanced = catalog.get("all-balanced")
    h200 = gl({"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1})
    assert balanced.target_for(0, 0x233510DE, 0x18BF10DE) == h200
    assert balanced.target_for(7, 0x233B10DE, 0) == h200  # H200 NVL, same entry
    assert balanced.target_for(0, 0x20B710DE, 0) == gl({"1g.6gb": 2, "2g.12gb": 1})
    assert balanced.target_for(0, 0x1FB010DE, 0) is None  # no entry for a display GPU
    a100_40 = catalog.get("all-1g.10gb")
    assert a100_40.target_for(0, 0x20B010DE, 0) == gl({"1g.10gb": 4})
    assert a100_40.target_for(0, 0x20B210DE, 0) == gl({"1g.10gb": 7})
    assert catalog.get("all-disabled").target_for(3, 0x1234ABCD, 0) == GpuLayout.of(False)
    assert catalog.get("all-enabled").target_for(3, 0x1234ABCD, 0) == GpuLayout.of(True)
    assert catalog.get("all-1g.24gb-me").target_for(0, 0x2BB510DE, 0) == gl({"1g.24gb-me": 4})


def test_mig_parted_example_content() -> None:
    custom = load_catalog([EXAMPLE]).get("custom-config")
    for index in range(4):
        assert custom.target_for(index, 0x20B010DE, 0) == GpuLayout.of(False)
    assert custom.target_for(4, 0x20B010DE, 0) == gl({"1g.5gb": 7})
    assert custom.target_for(7, 0x20B010DE, 0) == gl({"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1})
    assert custom.target_for(8, 0x20B010DE, 0) is None


def test_dgx_station_content() -> None:
    k8s = load_catalog([DGX_STATION]).get("balanced-k8s-dgx-station-80")
    assert k8s.target_for(2, 0x20B210DE, 0) == gl({"2g.20gb": 3, "1g.10gb": 1})
    assert k8s.target_for(3, 0x1FB010DE, 0) == GpuLayout.of(False)
    assert k8s.target_for(3, 0x20B210DE, 0) is None  # index 3 is the display GPU's only
    assert k8s.rules[0].selector.filters == (DeviceFilter(0x20B210DE),)


# What NVIDIA's comments in the GPU Operator default say each model gets (besides all-disabled,
# all-enabled and all-balanced, which every model gets).
OPERATOR_LAYOUTS = {
    "A100-40GB": {
        "all-1g.5gb",
        "all-1g.5gb.me",
        "all-1g.10gb",
        "all-2g.10gb",
        "all-3g.20gb",
        "all-4g.20gb",
        "all-7g.40gb",
    },
    "A100-80GB": {
        "all-1g.10gb",
        "all-1g.10gb.me",
        "all-1g.20gb",
        "all-2g.20gb",
        "all-3g.40gb",
        "all-4g.40gb",
        "all-7g.80gb",
    },
    "H100-80GB": {
        "all-1g.10gb",
        "all-1g.10gb.me",
        "all-1g.20gb",
        "all-2g.20gb",
        "all-3g.40gb",
        "all-4g.40gb",
        "all-7g.80gb",
    },
    "A30": {"all-1g.6gb", "all-1g.6gb.me", "all-2g.12gb", "all-2g.12gb.me", "all-4g.24gb"},
    "H100-NVL": {
        "all-1g.12gb",
        "all-1g.12gb.me",
        "all-1g.24gb",
        "all-2g.24gb",
        "all-3g.47gb",
        "all-4g.47gb",
        "all-7g.94gb",
    },
    "H200": {
        "all-1g.18gb",
        "all-1g.18gb.me",
        "all-1g.35gb",
        "all-2g.35gb",
        "all-3g.71gb",
        "all-4g.71gb",
        "all-7g.141gb",
    },
    "B200": {
        "all-1g.23gb",
        "all-1g.23gb.me",
        "all-1g.45gb",
        "all-2g.45gb",
        "all-3g.90gb",
        "all-4g.90gb",
        "all-7g.180gb",
    },
    "GB200": {
        "all-1g.23gb",
        "all-1g.23gb.me",
        "all-1g.47gb",
        "all-2g.47gb",
        "all-3g.93gb",
        "all-4g.93gb",
        "all-7g.186gb",
    },
    "B300": {
        "all-1g.34gb",
        "all-1g.34gb.me",
        "all-1g.67gb",
        "all-2g.67gb",
        "all-3g.135gb",
        "all-4g.135gb",
        "all-7g.269gb",
    },
    "GB300": {
        "all-1g.35gb",
        "all-1g.35gb.me",
        "all-1g.70gb",
        "all-2g.70gb",
        "all-3g.139gb",
        "all-4g.139gb",
        "all-7g.278gb",
    },
    "RTX-PRO-6000": {
        "all-1g.24gb",
        "all-1g.24gb.me",
        "all-1g.24gb.gfx",
        "all-1g.24gb.me.all",
        "all-1g.24gb-me",
        "all-2g.48gb",
        "all-2g.48gb.gfx",
        "all-2g.48gb.me.all",
        "all-2g.48gb-me",
        "all-4g.96gb",
        "all-4g.96gb.gfx",
    },
}


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.key)
def test_gpu_operator_default_fits_exactly_the_layouts_meant_for_each_model(
    model: GpuModel,
) -> None:
    # NVIDIA's all-<profile> layouts mostly select every GPU (devices: all, no device-filter) and
    # rely on the profile name existing on one model only. So: the layouts that fit are exactly
    # those NVIDIA lists for the model, every one that applies but does not fit fails only for
    # profile names the model lacks, and every entry that names the model's PCI id fits.
    report = fits_of(load_catalog([GPU_OPERATOR]), model)
    fitting = {name for name, r in report.items() if r.fits}
    assert fitting == OPERATOR_LAYOUTS[model.key] | {"all-disabled", "all-enabled", "all-balanced"}
    for r in report.values():
        if not r.applies:  # only layouts with device-filters leave a model out
            assert r.layout in ("all-1g.10gb", "all-1g.35gb"), r.layout
        elif not r.fits:
            assert r.unknown_profiles, r.reason
            assert not r.by_filter, r.reason
    assert report["all-balanced"].by_filter


def test_fit_report_on_other_configs() -> None:
    display = MODELS["DGX-Display"]
    station = fits_of(load_catalog([DGX_STATION]), display)
    assert all(r.applies and r.fits and r.by_filter for r in station.values())
    a100_80 = fits_of(load_catalog([DGX_STATION]), MODELS["A100-80GB"])
    assert all(r.fits for r in a100_80.values())
    assert a100_80["balanced-k8s-dgx-station-80"].targets == (
        GpuLayout.of(False),
        gl({"3g.40gb": 2}),
        gl({"2g.20gb": 3, "1g.10gb": 1}),
        gl({"1g.10gb": 7}),
    )
    h200 = fits_of(load_catalog([DGX_STATION]), MODELS["H200"])
    assert not any(r.applies for r in h200.values())
    assert h200["all-disabled-dgx-station-80"].reason == "selects no H200 GPU (PCI id 0x233510DE)"

    example = fits_of(load_catalog([EXAMPLE]), MODELS["H200"])
    custom = example["custom-config"]
    assert custom.applies and not custom.fits
    assert custom.reason.startswith("H200 GPU 4: no MIG profile 1g.5gb")
    assert custom.unknown_profiles == ("1g.5gb", "2g.10gb", "3g.20gb")
    assert fits_of(load_catalog([EXAMPLE]), display)["all-enabled"].reason == (
        "DGX-Display: DGX Display does not support MIG"
    )


def test_fit_report_keeps_the_planner_reason_for_a_layout_too_big() -> None:
    text = (
        "version: v1\nmig-configs:\n  too-many:\n    - devices: all\n      mig-enabled: true\n"
        '      mig-devices: {"3g.71gb": 2, "1g.18gb": 1}\n'
    )
    [result] = fit_report(LayoutCatalog.of(load_text(text, "t.yaml")), MODELS["H200"])
    assert result.applies and not result.fits and not result.unknown_profiles
    assert "memory slices" in result.reason or "compute slices" in result.reason


# ---------------------------------------------------------------------------------------------
# Malformed configs

OK = "{devices: all, mig-enabled: false}"


def one(entry: str, name: str = "a") -> str:
    """A config with one layout whose single entry is ``entry``."""
    return f"version: v1\nmig-configs:\n  {name}:\n    - {entry}\n"


def second(entry: str) -> str:
    """A config with one layout 'a' whose second entry is ``entry``."""
    return f"version: v1\nmig-configs:\n  a:\n    - {OK}\n    - {entry}\n"


def enabled(devices: str) -> str:
    return second(f"{{devices: all, mig-enabled: true, mig-devices: {devices}}}")


# (id, YAML text, fragment of the message, layout, entry, key) - layout/entry/key as expected in
# the error's context (None: absent).
MALFORMED: list[tuple[str, str, str, str | None, int | None, str | None]] = [
    (
        "unknown-top-level-key",
        one(OK) + "extra: 1\n",
        "unknown key (allowed: version, mig-configs)",
        None,
        None,
        "extra",
    ),
    (
        "top-level-not-mapping",
        "- version\n- v1\n",
        "expected a mapping with 'version'",
        None,
        None,
        None,
    ),
    (
        "missing-version",
        "mig-configs:\n  a:\n    - " + OK + "\n",
        "missing; the only supported",
        None,
        None,
        "version",
    ),
    (
        "wrong-version",
        one(OK).replace("v1", "v2", 1),
        "unsupported version 'v2'",
        None,
        None,
        "version",
    ),
    (
        "version-not-string",
        one(OK).replace("v1", "1", 1),
        "must be the string 'v1', got 1",
        None,
        None,
        "version",
    ),
    (
        "mig-configs-missing",
        "version: v1\n",
        "missing; it maps each layout name",
        None,
        None,
        "mig-configs",
    ),
    (
        "mig-configs-not-mapping",
        "version: v1\nmig-configs: [a, b]\n",
        "must be a mapping of layout name to a list of entries, got a list",
        None,
        None,
        "mig-configs",
    ),
    (
        "mig-configs-empty",
        "version: v1\nmig-configs: {}\n",
        "defines no layouts",
        None,
        None,
        "mig-configs",
    ),
    (
        "layout-not-list",
        "version: v1\nmig-configs:\n  a: " + OK + "\n",
        "must be a list of entries, got a mapping",
        "a",
        None,
        None,
    ),
    (
        "layout-empty-list",
        "version: v1\nmig-configs:\n  a: []\n",
        "has no entries",
        "a",
        None,
        None,
    ),
    (
        "layout-null",
        "version: v1\nmig-configs:\n  a:\n",
        "must be a list of entries, got null",
        "a",
        None,
        None,
    ),
    ("entry-not-mapping", second("all"), "each entry must be a mapping", "a", 2, None),
    (
        "unknown-entry-key",
        second("{devices: all, mig-enabled: true, mig-device: {}}"),
        "did you mean 'mig-devices'?",
        "a",
        2,
        "mig-device",
    ),
    (
        "devices-missing",
        second("{mig-enabled: false}"),
        "missing; use 'all' or a list",
        "a",
        2,
        "devices",
    ),
    (
        "devices-bad-string",
        second("{devices: every, mig-enabled: false}"),
        "must be 'all' or a list of GPU indices, got 'every' (a string)",
        "a",
        2,
        "devices",
    ),
    (
        "devices-ALL",
        second("{devices: ALL, mig-enabled: false}"),
        "got 'ALL' (a string)",
        "a",
        2,
        "devices",
    ),
    (
        "devices-bare-int",
        second("{devices: 0, mig-enabled: false}"),
        "write [0] for one GPU",
        "a",
        2,
        "devices",
    ),
    (
        "devices-negative",
        second("{devices: [0, -1], mig-enabled: false}"),
        "GPU index must be an integer >= 0, got -1",
        "a",
        2,
        "devices",
    ),
    (
        "devices-bool",
        second("{devices: [true], mig-enabled: false}"),
        "GPU index must be an integer >= 0, got true (a boolean)",
        "a",
        2,
        "devices",
    ),
    (
        "devices-duplicate",
        second("{devices: [1, 2, 1], mig-enabled: false}"),
        "GPU index 1 is listed twice",
        "a",
        2,
        "devices",
    ),
    (
        "devices-empty",
        second("{devices: [], mig-enabled: false}"),
        "got an empty list",
        "a",
        2,
        "devices",
    ),
    (
        "mig-enabled-missing",
        second("{devices: all}"),
        "missing; use true or false",
        "a",
        2,
        "mig-enabled",
    ),
    (
        "mig-enabled-string",
        second('{devices: all, mig-enabled: "true"}'),
        "must be true or false, got 'true' (a string)",
        "a",
        2,
        "mig-enabled",
    ),
    (
        "mig-enabled-without-mig-devices",
        second("{devices: all, mig-enabled: true}"),
        "required when mig-enabled is true (use {} for",
        "a",
        2,
        "mig-devices",
    ),
    (
        "mig-disabled-with-devices",
        second("{devices: all, mig-enabled: false, mig-devices: {1g.10gb: 7}}"),
        "must be empty or absent when mig-enabled is false",
        "a",
        2,
        "mig-devices",
    ),
    (
        "mig-devices-not-mapping",
        enabled("[1g.10gb]"),
        "must be a mapping of MIG profile name to count",
        "a",
        2,
        "mig-devices",
    ),
    ("mig-devices-null", enabled("null"), "got null", "a", 2, "mig-devices"),
    (
        "profile-bad-grammar",
        enabled("{1g10gb: 7}"),
        "'1g10gb' is not a MIG profile name",
        "a",
        2,
        "mig-devices",
    ),
    (
        "profile-c-exceeds-g",
        enabled("{2c.1g.10gb: 1}"),
        "compute slices 2c exceed GPU slices 1g",
        "a",
        2,
        "mig-devices",
    ),
    (
        "profile-name-not-string",
        enabled("{7: 1}"),
        "MIG profile names must be strings, got 7",
        "a",
        2,
        "mig-devices",
    ),
    (
        "profile-same-after-canonicalisation",
        enabled("{1g.10gb: 1, 1c.1g.10gb: 2}"),
        "'1g.10gb' and '1c.1g.10gb' are the same profile 1g.10gb",
        "a",
        2,
        "mig-devices",
    ),
    (
        "count-negative",
        enabled("{1g.10gb: -1}"),
        "count for '1g.10gb' must be an integer >= 0, got -1",
        "a",
        2,
        "mig-devices",
    ),
    ("count-string", enabled('{1g.10gb: "7"}'), "got '7' (a string)", "a", 2, "mig-devices"),
    ("count-bool", enabled("{1g.10gb: true}"), "got true (a boolean)", "a", 2, "mig-devices"),
    ("count-float", enabled("{1g.10gb: 1.5}"), "got 1.5 (a number)", "a", 2, "mig-devices"),
    (
        "all-counts-zero",
        enabled("{1g.10gb: 0, 2g.20gb: 0}"),
        "every count is 0",
        "a",
        2,
        "mig-devices",
    ),
    (
        "device-filter-not-pci-id",
        second("{device-filter: MODEL, devices: all, mig-enabled: false}"),
        "device-filter 'MODEL' is not a PCI id",
        "a",
        2,
        "device-filter",
    ),
    (
        "device-filter-device-only",
        second('{device-filter: "0x2330", devices: all, mig-enabled: false}'),
        "device-filter '0x2330' is not a PCI id",
        "a",
        2,
        "device-filter",
    ),
    (
        "device-filter-bad-in-list",
        second('{device-filter: ["0x233010DE", "H100"], devices: all, mig-enabled: false}'),
        "device-filter 'H100' is not a PCI id",
        "a",
        2,
        "device-filter",
    ),
    (
        "device-filter-empty-list",
        second("{device-filter: [], devices: all, mig-enabled: false}"),
        "must not be an empty list",
        "a",
        2,
        "device-filter",
    ),
    (
        "device-filter-unquoted-hex",
        second("{device-filter: 0x233010DE, devices: all, mig-enabled: false}"),
        'got 590352606; quote PCI ids, e.g. "0x233010DE"',
        "a",
        2,
        "device-filter",
    ),
    (
        "device-filter-int-in-list",
        second("{device-filter: [0x20B010DE], devices: all, mig-enabled: false}"),
        'each filter must be a PCI id string, got 548409566; quote PCI ids, e.g. "0x20B010DE"',
        "a",
        2,
        "device-filter",
    ),
    (
        "layout-name-not-label-value",
        one(OK, name='"all 1g.10gb"'),
        "not a valid Kubernetes label value",
        "all 1g.10gb",
        None,
        None,
    ),
    (
        "layout-name-ends-with-dot",
        one(OK, name="all-1g."),
        "not a valid Kubernetes label value",
        "all-1g.",
        None,
        None,
    ),
    ("layout-name-too-long", one(OK, name="a" * 64), "at most 63 characters", "a" * 64, None, None),
    ("layout-name-empty", one(OK, name='""'), "layout names must not be empty", "", None, None),
    (
        "layout-name-not-string",
        one(OK, name="5"),
        "layout names must be strings, got 5",
        "5",
        None,
        None,
    ),
    (
        "duplicate-layout-in-one-file",
        one(OK) + "  a:\n    - " + OK + "\n",
        "defined twice in this file (lines 3 and 5)",
        "a",
        None,
        None,
    ),
    (
        "duplicate-entry-key",
        second("{devices: all, mig-enabled: false, devices: [0]}"),
        "appears twice (line 5)",
        "a",
        2,
        "devices",
    ),
    (
        "duplicate-profile-key",
        enabled("{1g.10gb: 1, 1g.10gb: 2}"),
        "profile '1g.10gb' appears twice",
        "a",
        2,
        "mig-devices",
    ),
    (
        "duplicate-top-level-key",
        one(OK) + "version: v1\n",
        "appears twice (lines 1 and 5)",
        None,
        None,
        "version",
    ),
    (
        "yaml-syntax-error",
        "version: v1\nmig-configs:\n  a:\n    - {devices: all\n",
        "invalid YAML: while parsing a flow mapping at line 4: expected ',' or '}'",
        None,
        None,
        None,
    ),
    ("empty-file", "", "the file is empty", None, None, None),
    ("comments-only", "# nothing here\n", "the file is empty", None, None, None),
]


@pytest.mark.parametrize(
    ("text", "fragment", "layout", "entry", "key"),
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
def test_malformed_config_is_refused_naming_where(
    text: str, fragment: str, layout: str | None, entry: int | None, key: str | None
) -> None:
    source = "profiles/bad.yaml"
    with pytest.raises(InvalidConfig) as info:
        load_text(text, source)
    message, context = str(info.value), info.value.context
    assert fragment in message
    assert message.startswith(source + ":")
    assert not message.endswith(".")
    assert context["file"] == source
    assert context.get("layout") == layout
    assert context.get("entry") == entry
    assert context.get("key") == key
    if layout is not None:
        assert f"layout {layout!r}" in message
    if entry is not None:
        assert f"entry {entry}" in message
    if key is not None:
        assert f"key {key!r}" in message


def test_malformed_table_covers_distinct_messages() -> None:
    assert len(MALFORMED) >= 25
    assert len({case[0] for case in MALFORMED}) == len(MALFORMED)
    assert len({case[2] for case in MALFORMED}) >= len(MALFORMED) - 3


def test_error_message_format_matches_the_documented_example() -> None:
    text = (
        "version: v1\nmig-configs:\n  all-1g.10gb:\n    - {devices: all, mig-enabled: false}\n"
        '    - {devices: all, mig-enabled: true, mig-devices: {"1g.10gb": -1}}\n'
    )
    with pytest.raises(InvalidConfig) as info:
        load_text(text, "profiles/h100.yaml")
    assert str(info.value) == (
        "profiles/h100.yaml: layout 'all-1g.10gb', entry 2, key "
        "'mig-devices': count for '1g.10gb' must be an integer >= 0, got -1"
    )
    assert info.value.context == {
        "file": "profiles/h100.yaml",
        "layout": "all-1g.10gb",
        "entry": 2,
        "key": "mig-devices",
        "profile": "1g.10gb",
    }


def test_yaml_syntax_error_names_line_and_column() -> None:
    text = "version: v1\nmig-configs:\n  a:\n    - devices: all\n     mig-enabled: false\n"
    with pytest.raises(InvalidConfig) as info:
        load_text(text, "x.yaml")
    ctx = info.value.context
    assert ctx["file"] == "x.yaml" and ctx["line"] == 5 and isinstance(ctx["column"], int)
    assert str(info.value).startswith(f"x.yaml:5:{ctx['column']}: invalid YAML: ")


def test_duplicate_layout_error_names_the_lines() -> None:
    text = one(OK) + "  b:\n    - " + OK + "\n  a:\n    - " + OK + "\n"
    with pytest.raises(InvalidConfig) as info:
        load_text(text, "x.yaml")
    assert str(info.value) == "x.yaml: layout 'a': defined twice in this file (lines 3 and 7)"
    assert info.value.context["line"] == 7


def test_yaml_merge_keys_and_aliases_still_work() -> None:
    text = (
        "version: v1\nmig-configs:\n"
        "  a:\n    - &base {devices: all, mig-enabled: true, mig-devices: {1g.10gb: 7}}\n"
        "  b:\n    - <<: *base\n      devices: [0]\n"
    )
    a, b = load_text(text, "x.yaml")
    assert a.rules[0].gpu_layout == b.rules[0].gpu_layout == gl({"1g.10gb": 7})
    assert b.rules[0].selector.indices == frozenset({0})


def test_parse_config_is_pure_and_keeps_file_order() -> None:
    data = {
        "version": "v1",
        "mig-configs": {
            "z": [{"devices": "all", "mig-enabled": False}],
            "a": [
                {
                    "devices": [0, 1],
                    "device-filter": "0x233510de:0x18bf10de",
                    "mig-enabled": True,
                    "mig-devices": {"1g.18gb": 7, "1g.35gb": 0},
                }
            ],
        },
    }
    z, a = parse_config(data, source="mem")
    assert (z.name, a.name, a.source) == ("z", "a", "mem")
    rule = a.rules[0]
    assert rule.selector.indices == frozenset({0, 1})
    assert rule.selector.filters == (DeviceFilter(0x233510DE, 0x18BF10DE),)
    assert rule.gpu_layout == gl({"1g.18gb": 7})  # zero counts are dropped
    assert parse_config(data, source="mem") == [z, a]


def test_yes_is_a_yaml_boolean() -> None:
    # YAML 1.1 (which safe_load speaks) reads yes/no as booleans; only quoted strings are refused.
    [layout] = load_text(one("{devices: all, mig-enabled: no}"), "x.yaml")
    assert layout.rules[0].gpu_layout == GpuLayout.of(False)


# ---------------------------------------------------------------------------------------------
# Files, directories, stdin


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_load_catalog_reads_directories_sorted_skipping_other_files(tmp_path: Path) -> None:
    write(tmp_path / "b.yml", one(OK, name="from-b"))
    write(tmp_path / "a.yaml", one(OK, name="from-a"))
    write(tmp_path / "notes.txt", "not yaml")
    write(tmp_path / ".hidden.yaml", "not: [valid")
    (tmp_path / "..data").mkdir()  # a ConfigMap volume's internals
    catalog = load_catalog([tmp_path])
    assert catalog.names() == ("from-a", "from-b")
    assert catalog.get("from-a").source == str(tmp_path / "a.yaml")


def test_load_catalog_combines_files_and_directories(tmp_path: Path) -> None:
    sub = tmp_path / "d"
    sub.mkdir()
    write(sub / "x.yaml", one(OK, name="x"))
    single = write(tmp_path / "y.yaml", one(OK, name="y"))
    assert load_catalog([sub, str(single)]).names() == ("x", "y")
    assert load_catalog([]).names() == ()


def test_layout_defined_in_two_files_names_both(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", one(OK, name="same"))
    write(tmp_path / "b.yaml", one(OK, name="same"))
    with pytest.raises(InvalidConfig) as info:
        load_catalog([tmp_path])
    assert str(tmp_path / "a.yaml") in str(info.value)
    assert str(tmp_path / "b.yaml") in str(info.value)
    assert info.value.context["layout"] == "same"


def test_error_in_second_file_names_that_file(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", one(OK, name="a"))
    write(tmp_path / "b.yaml", one("{devices: all}", name="b"))
    with pytest.raises(InvalidConfig) as info:
        load_catalog([tmp_path])
    assert str(info.value).startswith(f"{tmp_path / 'b.yaml'}: layout 'b', entry 1, key ")


def test_missing_file_empty_directory_and_bad_encoding(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig, match="cannot read"):
        load_catalog([tmp_path / "nope.yaml"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidConfig, match=r"no \*\.yaml or \*\.yml files"):
        load_catalog([empty])
    (tmp_path / "latin1.yaml").write_bytes(b"version: v1\n# caf\xe9\n")
    with pytest.raises(InvalidConfig, match="not UTF-8 text") as info:
        load_catalog([tmp_path / "latin1.yaml"])
    assert info.value.context["file"] == str(tmp_path / "latin1.yaml")


def test_dash_reads_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(one(OK, name="piped")))
    catalog = load_catalog(["-"])
    assert catalog.get("piped").source == "<stdin>"


# ---------------------------------------------------------------------------------------------
# profiles/


def profile_files() -> list[Path]:
    return sorted(PROFILES.glob("*.yaml"))


def test_every_profile_file_loads_and_names_are_unique() -> None:
    names: dict[str, str] = {}
    for path in profile_files():
        for layout in load_text(path.read_text(encoding="utf-8"), str(path)):
            assert layout.name not in names, f"{layout.name} in {names.get(layout.name)} and {path}"
            names[layout.name] = path.name
    assert set(load_catalog([PROFILES]).names()) == set(names)
    first_lines = [p.read_text(encoding="utf-8").splitlines()[0] for p in profile_files()]
    assert all(line.startswith("# ") for line in first_lines)


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.key)
def test_every_profile_layout_fits_every_model_it_selects(model: GpuModel) -> None:
    for r in fit_report(load_catalog([PROFILES]), model):
        if r.applies:
            assert r.fits, r.reason


def test_every_profile_layout_selects_some_model() -> None:
    catalog = load_catalog([PROFILES])
    selected = {r.layout for m in MIG_MODELS for r in fit_report(catalog, m) if r.fits}
    assert selected == set(catalog.names())


def test_profile_rules_select_whole_model_families() -> None:
    # Each filtered rule selects all PCI ids of one model and no others, and the partition it
    # gives fits that model (the catalog model stands for its PCIe and NVL variants).
    catalog = load_catalog([PROFILES])
    for layout in catalog.layouts.values():
        for rule in layout.rules:
            if layout.name in ("all-disabled", "all-enabled"):
                assert not rule.selector.filters and rule.selector.indices is None
                continue
            assert rule.selector.indices is None, layout.name
            ids = {f.device_id for f in rule.selector.filters}
            assert all(f.subsystem_id is None for f in rule.selector.filters)
            [family] = [k for k, family_ids in FAMILY_IDS.items() if ids == family_ids]
            model = MODELS[family]
            single = LayoutCatalog.of([Layout(layout.name, (rule,), layout.source)])
            [result] = fit_report(single, model)
            assert result.fits, f"{layout.name} for {family}: {result.reason}"


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.key)
def test_each_model_has_all_layouts_for_each_of_its_profiles(model: GpuModel) -> None:
    catalog = load_catalog([PROFILES])
    pci, sub = model.pci_device_id, model.pci_subsystem_id
    for gi in model.gi_profiles:
        name = "all-" + gi.name.replace("+", ".")
        assert name in catalog, name
        expected = GpuLayout.of(True, {MigProfile.parse(gi.name): gi.instance_count})
        assert catalog.get(name).target_for(0, pci, sub) == expected, name


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.key)
def test_each_model_has_all_balanced_and_mixes_of_its_own(model: GpuModel) -> None:
    catalog = load_catalog([PROFILES])
    base = {gi.slices: gi.name for gi in model.gi_profiles if gi.index in (0, 1, 2)}
    counts = {base[1]: 2, base[2]: 1} | ({base[3]: 1} if model.compute_slices == 7 else {})
    balanced = catalog.get("all-balanced").target_for(0, model.pci_device_id, 0)
    assert balanced == gl(counts)
    report = fits_of(catalog, model)
    own = [name for name in catalog.names() if name.startswith(model.key.lower() + "-")]
    assert own, model.key
    for name in own:
        assert report[name].fits and report[name].by_filter, report[name].reason
    # The model's own mixes select no other model.
    for other in MIG_MODELS:
        if other is not model:
            assert not any(fits_of(catalog, other)[name].applies for name in own)


def test_profile_layouts_use_device_filters() -> None:
    catalog = load_catalog([PROFILES])
    for model in MIG_MODELS:
        for r in fit_report(catalog, model):
            if r.applies and r.layout not in ("all-disabled", "all-enabled"):
                assert r.by_filter, r.layout
    display = fits_of(catalog, MODELS["DGX-Display"])
    assert {name for name, r in display.items() if r.applies} == {"all-disabled", "all-enabled"}
