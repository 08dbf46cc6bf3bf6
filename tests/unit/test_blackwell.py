"""We test these aspects of the Blackwell models (B200, GB200, B300, GB300, RTX PRO 6000):

* the catalog rows are the reference's figures (ids, indices, placements, memory, SMs, engines),
  spot-checked per model, and the names and device-plugin resources come out as NVIDIA's;
* the RTX PRO 6000's 12-unit placement grid over 4 memory slices: the planner places on it as
  the hardware does, and counts memory slices (not grid units) when a layout is too big;
* a ``+me.all`` instance shares the GPU with ``-me`` instances only;
* a layout naming a profile the model lacks is refused by name;
* a MIG mode change needs no GPU reset;
* mig-parted v0.15's ``device-filter`` with a subsystem id selects GPUs by both ids.
"""

from __future__ import annotations

import dataclasses

import pytest

from mig_agent.agent.host_clients import reset_gpus
from mig_agent.config.profiles import fit_report, load_catalog, load_text
from mig_agent.config.settings import PROFILES
from mig_agent.core.errors import PlanError
from mig_agent.core.gpu_models import MODELS, Architecture, GpuModel, resource_name
from mig_agent.core.layout import DeviceFilter, GpuLayout, LayoutCatalog, MigProfile
from mig_agent.core.planner import CreateGpuInstance, SetMigMode, plan

from .fake_gpus import FakeGpus

BLACKWELL = ["B200", "GB200", "B300", "GB300", "RTX-PRO-6000"]
RTX = MODELS["RTX-PRO-6000"]


def row(m: GpuModel, name: str) -> tuple[object, ...]:
    p = m.gi_by_name[name]
    e = p.engines
    return (
        p.index,
        p.id,
        p.memory_mib,
        p.instance_count,
        p.multiprocessors,
        (e.copy, e.decoder, e.encoder, e.jpeg, e.ofa),
        " ".join(str(x) for x in p.placements),
    )


def one_layout(counts: dict[str, int], device_filter: str = "") -> LayoutCatalog:
    """A catalog of one layout ``l``: one entry, MIG on with ``counts``."""
    devices = ", ".join(f'"{p}": {n}' for p, n in counts.items())
    head = f'device-filter: "{device_filter}", ' if device_filter else ""
    entry = f"{{{head}devices: all, mig-enabled: true, mig-devices: {{{devices}}}}}"
    return LayoutCatalog.of(
        load_text(f"version: v1\nmig-configs:\n  l:\n    - {entry}\n", "t.yaml")
    )


# ---------------------------------------------------------------------------------------------
# The catalog rows


def test_identity_of_each_model() -> None:
    got = {
        k: (
            MODELS[k].name,
            MODELS[k].pci_device_id,
            MODELS[k].memory_total_mib,
            MODELS[k].architecture,
            MODELS[k].memory_slices,
            MODELS[k].compute_slices,
            MODELS[k].placement_units,
        )
        for k in BLACKWELL
    }
    bw = Architecture.BLACKWELL
    assert got == {
        "B200": ("NVIDIA B200", 0x290110DE, 183359, bw, 8, 7, 8),
        "GB200": ("NVIDIA GB200", 0x294110DE, 189471, bw, 8, 7, 8),
        "B300": ("NVIDIA B300 SXM6 AC", 0x318210DE, 275040, bw, 8, 7, 8),
        "GB300": ("NVIDIA GB300", 0x31C210DE, 284208, bw, 8, 7, 8),
        "RTX-PRO-6000": ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 0x2BB510DE, 97887, bw)
        + (4, 4, 12),
    }
    assert RTX.pci_subsystem_id == 0x204E10DE
    assert MODELS["B300"].pci_subsystem_id == 0x20E610DE


S7 = "0:1 1:1 2:1 3:1 4:1 5:1 6:1"


def test_b200_rows() -> None:
    b200 = MODELS["B200"]
    assert row(b200, "1g.23gb") == (0, 19, 20992, 7, 18, (2, 1, 0, 1, 0), S7)
    assert row(b200, "1g.23gb+me") == (7, 20, 20992, 1, 18, (2, 1, 0, 1, 1), S7)
    assert row(b200, "1g.45gb") == (9, 15, 45312, 4, 30, (2, 1, 0, 1, 0), "0:2 2:2 4:2 6:2")
    assert row(b200, "2g.45gb") == (1, 14, 45312, 3, 36, (4, 2, 0, 2, 0), "0:2 2:2 4:2")
    assert row(b200, "3g.90gb") == (2, 9, 91136, 2, 70, (6, 3, 0, 3, 0), "0:4 4:4")
    assert row(b200, "4g.90gb") == (3, 5, 91136, 1, 72, (8, 4, 0, 4, 0), "0:4")
    assert row(b200, "7g.180gb") == (4, 0, 182784, 1, 148, (16, 7, 0, 7, 1), "0:8")


def test_gb200_b300_gb300_rows() -> None:
    gb200, b300, gb300 = MODELS["GB200"], MODELS["B300"], MODELS["GB300"]
    assert row(gb200, "1g.23gb") == (0, 19, 22528, 7, 18, (2, 1, 0, 1, 0), S7)
    assert row(gb200, "1g.47gb")[:5] == (9, 15, 46592, 4, 32)
    assert row(gb200, "2g.47gb") == (1, 14, 46592, 3, 38, (4, 2, 0, 2, 0), "0:2 2:2 4:2")
    assert row(gb200, "7g.186gb")[:5] == (4, 0, 187904, 1, 152)
    ids = {"1g": 19, "1g+me": 20, "1g.r2": 15, "2g": 14, "3g": 9, "4g": 5, "7g": 0}
    for m in (b300, gb300):
        assert [p.id for p in m.gi_profiles] == list(ids.values()), m.key
        assert [p.instance_count for p in m.gi_profiles] == [7, 1, 4, 3, 2, 1, 1], m.key
    assert row(b300, "1g.34gb")[:5] == (0, 19, 31488, 7, 18)
    assert row(b300, "3g.135gb")[:5] == (2, 9, 136192, 2, 70)
    assert row(gb300, "1g.35gb")[:5] == (0, 19, 32512, 7, 18)
    assert row(gb300, "7g.278gb") == (4, 0, 282112, 1, 152, (16, 7, 0, 7, 1), "0:8")


def test_rtx_pro_6000_rows() -> None:
    q4, h2, whole = "0:3 3:3 6:3 9:3", "0:6 6:6", "0:12"
    assert row(RTX, "1g.24gb") == (0, 14, 24192, 4, 46, (1, 1, 1, 1, 0), q4)
    assert row(RTX, "1g.24gb+me") == (7, 21, 24192, 1, 46, (1, 1, 1, 1, 1), q4)
    assert row(RTX, "1g.24gb+gfx") == (10, 47, 24192, 4, 46, (1, 1, 1, 1, 0), q4)
    assert row(RTX, "1g.24gb+me.all") == (15, 65, 24192, 1, 46, (1, 4, 4, 4, 1), q4)
    assert row(RTX, "1g.24gb-me") == (13, 67, 24192, 4, 46, (1, 0, 0, 0, 0), q4)
    assert row(RTX, "2g.48gb") == (1, 5, 48512, 2, 94, (2, 2, 2, 2, 0), h2)
    assert row(RTX, "2g.48gb+gfx") == (11, 35, 48512, 2, 94, (2, 2, 2, 2, 0), h2)
    assert row(RTX, "2g.48gb+me.all") == (16, 64, 48512, 1, 94, (2, 4, 4, 4, 1), h2)
    assert row(RTX, "2g.48gb-me") == (14, 66, 48512, 2, 94, (2, 0, 0, 0, 0), h2)
    assert row(RTX, "4g.96gb") == (3, 0, 97408, 1, 188, (4, 4, 4, 4, 1), whole)
    assert row(RTX, "4g.96gb+gfx") == (12, 32, 97408, 1, 188, (4, 4, 4, 4, 1), whole)
    assert [RTX.memory_slices_of(p) for p in RTX.gi_profiles] == [1] * 5 + [2] * 4 + [4] * 2
    # a GI of the 2g.48gb profile: its full CI is profile 1, and it offers 1c
    two = RTX.gi_by_name["2g.48gb"]
    assert [(c.id, c.slices) for c in two.ci_profiles] == [(0, 1), (1, 2)]


RESOURCES = {
    "B200": "1g.23gb 1g.23gb.me 1g.45gb 2g.45gb 3g.90gb 4g.90gb 7g.180gb",
    "GB200": "1g.23gb 1g.23gb.me 1g.47gb 2g.47gb 3g.93gb 4g.93gb 7g.186gb",
    "B300": "1g.34gb 1g.34gb.me 1g.67gb 2g.67gb 3g.135gb 4g.135gb 7g.269gb",
    "GB300": "1g.35gb 1g.35gb.me 1g.70gb 2g.70gb 3g.139gb 4g.139gb 7g.278gb",
    "RTX-PRO-6000": "1g.24gb 1g.24gb.me 1g.24gb.gfx 1g.24gb.me.all 1g.24gb-me 2g.48gb "
    "2g.48gb.gfx 2g.48gb.me.all 2g.48gb-me 4g.96gb 4g.96gb.gfx",
}


@pytest.mark.parametrize("key", BLACKWELL)
def test_mixed_strategy_resources_are_nvidias(key: str) -> None:
    names = [resource_name(n) for n in MODELS[key].device_names()]
    assert sorted(n for n in names if n) == sorted(
        f"nvidia.com/mig-{r}" for r in RESOURCES[key].split()
    )
    # the devices that split a GPU instance get none (1c.2g.48gb+gfx, 3c.7g.180gb, ...)
    assert names.count(None) == sum("c." in n for n in MODELS[key].device_names()) > 0


def test_profile_names_of_the_rtx_pro_6000_parse_and_print_back() -> None:
    for name in RTX.device_names():
        profile = MigProfile.parse(name)
        assert str(profile) == name
        assert RTX.resolve(str(profile)) is not None
    assert MigProfile.parse("1g.24gb+me.all").attributes == ("me.all",)
    assert MigProfile.parse("2g.48gb-me").negative
    assert MigProfile.parse("1c.4g.96gb+gfx").compute_slices == 1


# ---------------------------------------------------------------------------------------------
# The planner on the 12-unit grid


def planned(model: GpuModel, counts: dict[str, int]) -> list[tuple[str, str]]:
    gpus = FakeGpus([model], mig_enabled=True)
    p = plan(one_layout(counts).get("l"), gpus.observe(), gpus.models())
    return [(s.profile, str(s.placement)) for s in p.steps if isinstance(s, CreateGpuInstance)]


def test_rtx_pro_6000_places_as_the_hardware_does() -> None:
    # nvidia-smi mig -lgi on a real RTX PRO 6000: 2g.48gb 0:6, 1g.24gb 6:3, 1g.24gb 9:3
    assert planned(RTX, {"2g.48gb": 1, "1g.24gb": 2}) == [
        ("2g.48gb", "0:6"),
        ("1g.24gb", "6:3"),
        ("1g.24gb", "9:3"),
    ]
    assert planned(RTX, {"1g.24gb-me": 4}) == [("1g.24gb-me", f"{s}:3") for s in (0, 3, 6, 9)]
    assert planned(RTX, {"4g.96gb+gfx": 1}) == [("4g.96gb+gfx", "0:12")]


def test_rtx_pro_6000_too_big_counts_memory_slices() -> None:
    with pytest.raises(PlanError) as info:
        planned(RTX, {"2g.48gb": 2, "1g.24gb": 1})
    assert "needs 5 memory slices (2g.48gb:2 + 2g.48gb:2 + 1g.24gb:1), RTX-PRO-6000 has 4" in str(
        info.value
    )


def test_me_all_shares_the_gpu_with_no_media_instances_only() -> None:
    assert len(planned(RTX, {"1g.24gb+me.all": 1, "1g.24gb-me": 3})) == 4
    assert len(planned(RTX, {"2g.48gb+me.all": 1, "2g.48gb-me": 1})) == 2
    for other in ("1g.24gb", "1g.24gb+gfx", "1g.24gb+me"):
        with pytest.raises(PlanError, match=r"1g\.24gb\+me\.all takes every media engine") as e:
            planned(RTX, {"1g.24gb+me.all": 1, other: 1})
        assert str(e.value).endswith(f"beside it only -me profiles fit, not {other}")
    with pytest.raises(PlanError, match=r"2g\.48gb\+me\.all takes every media engine"):
        planned(RTX, {"1g.24gb+me.all": 1, "2g.48gb+me.all": 1})
    [result] = fit_report(one_layout({"2g.48gb+me.all": 1, "1g.24gb": 2}), RTX)
    assert result.applies and not result.fits and "takes every media engine" in result.reason


@pytest.mark.parametrize(
    ("key", "lacking"),
    [
        ("B200", "1g.24gb+gfx"),  # the RTX PRO 6000's
        ("GB200", "1g.24gb"),  # its pre-production name (now 1g.23gb)
        ("GB200", "7g.189gb"),  # in mig-parted's config, for pre-production boards
        ("B300", "1g.35gb"),  # the GB300's
        ("GB300", "1g.34gb+me"),  # the B300's
        ("RTX-PRO-6000", "1g.23gb"),  # B200 and GB200's
        ("RTX-PRO-6000", "1g.24gb+me,gfx"),
        ("RTX-PRO-6000", "3g.72gb+gfx"),  # NVML's 3_SLICE_GFX, which no model has
    ],
)
def test_a_profile_the_model_lacks_is_refused_by_name(key: str, lacking: str) -> None:
    m = MODELS[key]
    with pytest.raises(PlanError) as info:
        planned(m, {lacking: 1})
    assert f"no MIG profile {lacking} on {m.name}; profiles there: " in str(info.value)
    assert info.value.context["profile"] == lacking
    [result] = fit_report(one_layout({lacking: 1}), m)
    assert not result.fits and result.unknown_profiles == (lacking,)


@pytest.mark.parametrize("key", BLACKWELL)
def test_a_mig_mode_change_needs_no_reset(key: str) -> None:
    m = MODELS[key]
    assert not m.architecture.mig_mode_needs_reset
    gpus = FakeGpus([m, m])
    p = plan(load_catalog([PROFILES]).get("all-balanced"), gpus.observe(), gpus.models())
    assert all(g.changes_mig_mode for g in p.gpus)
    assert [type(s) for s in p.gpus[0].steps][0] is SetMigMode
    assert reset_gpus(p, gpus.models()) == []


# ---------------------------------------------------------------------------------------------
# device-filter with a subsystem id (mig-parted v0.15)


def test_subsystem_filter_loads_and_selects_by_both_ids() -> None:
    catalog = one_layout({"1g.24gb": 4}, device_filter="0x2BB510DE:0x204E10DE")
    layout = catalog.get("l")
    assert layout.rules[0].selector.filters == (DeviceFilter(0x2BB510DE, 0x204E10DE),)
    want = GpuLayout.of(True, {MigProfile.parse("1g.24gb"): 4})
    assert layout.target_for(0, 0x2BB510DE, 0x204E10DE) == want
    assert layout.target_for(0, 0x2BB510DE, 0x220B10DE) is None  # the other board
    assert layout.target_for(0, 0x2BB510DE, 0) is None  # subsystem unknown
    assert layout.target_for(0, 0x2BB110DE, 0x204E10DE) is None  # another device id
    lower = one_layout({"1g.24gb": 4}, device_filter="0x2bb510de:0x204e10de").get("l")
    assert lower.rules == layout.rules


def test_subsystem_filter_plans_only_the_matching_board() -> None:
    other_board = dataclasses.replace(RTX, pci_subsystem_id=0x220B10DE)
    gpus = FakeGpus([RTX, other_board, RTX])
    layout = one_layout({"2g.48gb": 2}, device_filter="0x2BB510DE:0x204E10DE").get("l")
    p = plan(layout, gpus.observe(), gpus.models())
    assert [g.gpu for g in p.gpus] == [0, 2] and p.untouched == (1,)
    assert fit_report(LayoutCatalog.of([layout]), RTX)[0].fits
    assert not fit_report(LayoutCatalog.of([layout]), other_board)[0].applies


def test_subsystem_filter_in_a_list_with_a_plain_one() -> None:
    text = (
        "version: v1\nmig-configs:\n  l:\n    - device-filter: "
        '["0x2BB510DE:0x204E10DE", "0x290110DE"]\n'
        "      devices: all\n      mig-enabled: false\n"
    )
    [layout] = load_text(text, "t.yaml")
    assert layout.target_for(0, 0x290110DE, 0x12345678) == GpuLayout.of(False)
    assert layout.target_for(0, 0x2BB510DE, 0x204E10DE) == GpuLayout.of(False)
    assert layout.target_for(0, 0x2BB510DE, 0x220B10DE) is None
