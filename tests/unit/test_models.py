"""We test these aspects of the GPU model catalog:

* profile names derived from index and memory equal the names NVIDIA's tools print, including the
  rounding rule (half away from zero, not Python's round-half-even);
* the H200 rows are the real H200's readout;
* Kubernetes resource names as NVIDIA's device plugin forms them (mixed and single strategy);
* GPU specs on the command line, and errors naming the known models.
"""

from __future__ import annotations

import pytest

from mig_agent.core.gpu_models import MODELS, mig_memory_gb, model, parse_gpu_spec, resource_name
from mig_agent.core.placement import Placement

NVIDIA_NAMES = {
    "A100-40GB": ["1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"],
    "A100-80GB": ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    "A30": ["1g.6gb", "1g.6gb+me", "2g.12gb", "2g.12gb+me", "4g.24gb"],
    "H100-80GB": ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    "H100-NVL": ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"],
    "H200": ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
    # mig-parted's config-default.yaml and nvidia-smi readouts (blackwell.md section 6)
    "B200": ["1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"],
    "GB200": ["1g.23gb", "1g.23gb+me", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb"],
    "B300": ["1g.34gb", "1g.34gb+me", "1g.67gb", "2g.67gb", "3g.135gb", "4g.135gb", "7g.269gb"],
    "GB300": ["1g.35gb", "1g.35gb+me", "1g.70gb", "2g.70gb", "3g.139gb", "4g.139gb", "7g.278gb"],
    "RTX-PRO-6000": [
        "1g.24gb",
        "1g.24gb+me",
        "1g.24gb+gfx",
        "1g.24gb-me",
        "1g.24gb+me.all",
        "2g.48gb",
        "2g.48gb+gfx",
        "2g.48gb-me",
        "2g.48gb+me.all",
        "4g.96gb",
        "4g.96gb+gfx",
    ],
}


@pytest.mark.parametrize("key", sorted(NVIDIA_NAMES))
def test_profile_names_match_nvidia(key: str) -> None:
    assert [p.name for p in MODELS[key].gi_profiles] == NVIDIA_NAMES[key]


def test_memory_rounds_half_away_from_zero() -> None:
    # H200: 71424 of 143771 MiB is 4/8 of 141 GB = 70.5 -> 71 (Python's round() would say 70)
    assert mig_memory_gb(71424, 143771) == 71
    assert round(70.5) == 70
    assert mig_memory_gb(16384, 143771) == 18
    assert mig_memory_gb(10880, 95830) == 12


def test_h200_is_the_real_readout() -> None:
    h200 = MODELS["H200"]
    assert (h200.name, h200.pci_device_id, h200.memory_total_mib) == (
        "NVIDIA H200",
        0x233510DE,
        143771,
    )
    rows = {
        p.name: (
            p.index,
            p.id,
            p.memory_mib,
            p.instance_count,
            p.multiprocessors,
            p.engines.copy,
            p.engines.decoder,
            p.engines.jpeg,
            p.engines.ofa,
            [str(x) for x in p.placements],
        )
        for p in h200.gi_profiles
    }
    assert rows["1g.18gb"] == (0, 19, 16384, 7, 16, 1, 1, 1, 0, [f"{i}:1" for i in range(7)])
    assert rows["1g.18gb+me"][:2] == (7, 20) and rows["1g.18gb+me"][8] == 1
    assert rows["1g.35gb"] == (9, 15, 33280, 4, 26, 1, 1, 1, 0, ["0:2", "2:2", "4:2", "6:2"])
    assert rows["3g.71gb"] == (2, 9, 71424, 2, 60, 3, 3, 3, 0, ["0:4", "4:4"])
    assert rows["7g.141gb"] == (4, 0, 143360, 1, 132, 8, 7, 7, 1, ["0:8"])


@pytest.mark.parametrize(
    "name,mixed,single",
    [
        ("1g.10gb", "nvidia.com/mig-1g.10gb", "nvidia.com/gpu"),
        ("1g.10gb+me", "nvidia.com/mig-1g.10gb.me", "nvidia.com/gpu"),
        ("1g.24gb-me", "nvidia.com/mig-1g.24gb-me", "nvidia.com/gpu"),
        ("1g.24gb+me.all", "nvidia.com/mig-1g.24gb.me.all", "nvidia.com/gpu"),
        # CI-split devices match no mixed-strategy pattern; single matches every MIG device
        ("1c.3g.40gb", None, "nvidia.com/gpu"),
    ],
)
def test_resource_names(name: str, mixed: str | None, single: str | None) -> None:
    assert resource_name(name, strategy="mixed") == mixed
    assert resource_name(name, strategy="single") == single


def test_compute_instance_profiles_follow_the_slice_rule() -> None:
    gi = MODELS["A100-40GB"].gi_by_name["7g.40gb"]
    assert {c.slices: c.instance_count for c in gi.ci_profiles} == {1: 7, 2: 3, 3: 2, 4: 1, 7: 1}
    three = MODELS["A100-40GB"].gi_by_name["3g.20gb"]
    assert {c.slices: c.placements for c in three.ci_profiles}[2] == (Placement(0, 2),)
    assert MODELS["H200"].resolve("2c.3g.71gb") is not None
    assert MODELS["H200"].resolve("1g.10gb") is None


def test_gpu_specs() -> None:
    assert [m.key for m in parse_gpu_spec("2xA100-40GB,1xA30")] == ["A100-40GB"] * 2 + ["A30"]
    assert [m.key for m in parse_gpu_spec("h200")] == ["H200"]
    with pytest.raises(ValueError, match="unknown GPU model 'R100'; known models: A100-40GB"):
        model("R100")


def test_one_lookup_finds_a_compute_instance_profile_by_id() -> None:
    gi = next(g for g in MODELS["H200"].gi_profiles if g.name == "3g.71gb")
    for ci in gi.ci_profiles:
        assert gi.ci_profile_by_id(ci.id) is ci
    assert gi.ci_profile_by_id(99) is None
