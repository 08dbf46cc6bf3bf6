"""We test these aspects of the simulator's GPU data (sim/migsim/gpus) as data, without NVML:

* the H200 file is the captured H200 (tests/data/captures): NVML's readouts (name, PCI ids,
  memory, architecture, every profile index with its info and placements), nvidia-smi's -lgip
  table and -lgipp lines, nvidia-smi -q and nvidia-smi, GFD's labels;
* every profile name is what go-nvlib's formula makes of the memory sizes (the names NVIDIA's
  Kubernetes stack advertises), a check of the data against itself;
* values the references mark inferred are marked in the data, the H200's GI tables are not;
* the loader refuses what is not the format (repeated or unknown keys, a profile whose name is not
  its index's shape, a placement off the grid, an inferred mark naming nothing);
* GPU specs read as before, with the new models' keys;
* ``extra_models`` makes another file's model known (GPU specs name it) only inside its block,
  and refuses one with the key or PCI id of a known model.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from migsim.gpus import (
    MODELS,
    GpuDataError,
    extra_models,
    load_model_file,
    model,
    parse_gpu_spec,
)

REPO = Path(__file__).resolve().parents[2]
CAPTURES = REPO / "tests" / "data" / "captures"
H200 = MODELS["H200"]


def _capture(name: str) -> str:
    return (CAPTURES / name).read_text()


# -- the H200 is the captured one -----------------------------------------------------------------


def test_h200_identity_is_the_captured_h200() -> None:
    probe1 = json.loads(_capture("h200-0x2335-probe1.json"))["devices"][0]
    probe2 = json.loads(_capture("h200-0x2335-probe2.json"))["devices"][0]
    assert H200.name == probe1["name"] == probe2["name"]
    assert f"0x{H200.pci_device_id:08x}" == probe1["pciDeviceId"]
    assert [f"0x{s:08x}" for s in H200.pci_subsystem_ids] == [probe1["pciSubSystemId"]]
    assert H200.memory_total_mib == probe1["memTotalMiB"] == probe2["memTotalBytes"] >> 20
    assert H200.architecture.nvml_code == probe2["arch"]
    # Field 184, NVML_FI_DEV_IS_RESETLESS_MIG_SUPPORTED, is 1: a mode change needs no reset.
    assert probe2["fieldValues"]["184"]["ui"] == 1 and not H200.mig_mode_needs_reset


def test_h200_profiles_are_the_captured_ones() -> None:
    probe2 = json.loads(_capture("h200-0x2335-probe2.json"))["devices"][0]
    for entry in probe2["giProfiles"]:
        index, info = entry["profileIndex"], entry["info"]
        p = H200.gi_profile_at(index)
        if "err" in info:  # NOT_SUPPORTED (or past the driver's table): no profile there
            assert p is None, index
            continue
        assert p is not None, index
        e = p.engines
        assert {
            "id": p.id,
            "sliceCount": p.slices,
            "instanceCount": p.instance_count,
            "multiprocessorCount": p.multiprocessors,
            "copyEngineCount": e.copy,
            "decoderCount": e.decoder,
            "encoderCount": e.encoder,
            "jpegCount": e.jpeg,
            "ofaCount": e.ofa,
            "memorySizeMB": p.memory_mib,
            "name": f"MIG {p.name}",
        } == {k: v for k, v in info.items() if k not in ("version", "isP2pSupported")}, index
        assert [[pl.start, pl.size] for pl in p.placements] == entry["placements"], index
    assert len(H200.gi_profiles) == sum("err" not in e["info"] for e in probe2["giProfiles"])


def _lgip_rows(text: str) -> list[list[str]]:
    """The -lgip table: one list per profile, its two lines' cells joined."""
    lines = [ln.strip("|").split() for ln in text.splitlines() if ln.startswith("|  ")]
    rows = [ln for ln in lines if ln and ln[0] == "0" and ln[1] == "MIG"]
    seconds = [ln for ln in lines if ln and len(ln) == 3 and all(c.isdigit() for c in ln)]
    return [a + b for a, b in zip(rows, seconds, strict=True)]


def test_h200_nvidia_smi_lgip_and_lgipp_are_the_data_in_its_order() -> None:
    text = _capture("h200-0x2335-nvidia-smi.txt")
    want = [
        [
            "0",
            "MIG",
            p.name,
            str(p.id),
            f"{p.instance_count}/{p.instance_count}",
            f"{p.memory_mib / 1024:.2f}",
            "No",
            str(p.multiprocessors),
            str(p.engines.decoder),
            str(p.engines.encoder),
            str(p.engines.copy),
            str(p.engines.jpeg),
            str(p.engines.ofa),
        ]
        for p in H200.gi_profiles
    ]
    assert _lgip_rows(text) == want
    lgipp = []
    for p in H200.gi_profiles:
        starts = ",".join(str(pl.start) for pl in p.placements)
        label = "Placements:" if len(p.placements) > 1 else "Placement :"
        lgipp.append(f"GPU  0 Profile ID {p.id:>2} {label} {{{starts}}}:{p.placement_size}")
    assert [ln for ln in text.splitlines() if "Profile ID" in ln] == lgipp


def _smi_q(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(" : ")
        if sep:
            out.setdefault(key.strip(), value.strip())
    return out


def test_h200_nvidia_smi_q_and_nvidia_smi() -> None:
    q = _smi_q(_capture("h200-nvidia-smi-q-2026-12-01.txt"))
    assert q["Product Name"] == H200.name
    assert q["Product Architecture"] == H200.architecture.value.title()
    assert q["Device Id"] == f"0x{H200.pci_device_id:08X}"
    assert q["Sub System Id"] in [f"0x{s:08X}" for s in H200.pci_subsystem_ids]
    assert q["Total"] == f"{H200.memory_total_mib} MiB"  # the first Total: FB Memory Usage
    smi = _capture("h200-nvidia-smi-2026-12-01.txt")
    assert f" {H200.name} " in smi
    assert f"/ {H200.memory_total_mib}MiB" in smi


def test_h200_gfd_labels() -> None:
    labels = dict(
        ln.split("=", 1) for ln in _capture("h200-gfd-labels-mixed-2026-12-01.txt").splitlines()
    )
    assert labels["nvidia.com/gpu.product"] == H200.product
    assert labels["nvidia.com/gpu.memory"] == str(H200.memory_total_mib)
    assert labels["nvidia.com/gpu.family"] == H200.architecture.value
    major, minor = H200.compute_capability
    assert (labels["nvidia.com/gpu.compute.major"], labels["nvidia.com/gpu.compute.minor"]) == (
        str(major),
        str(minor),
    )
    assert labels["nvidia.com/mig.capable"] == str(H200.mig_capable).lower()


def test_h200_gi_tables_have_no_inferred_value() -> None:
    gi_values = [
        i.field
        for i in H200.inferred
        if i.field.startswith("mig.gi_profiles") and ".compute_instances" not in i.field
    ]
    assert gi_values == []


# -- names ----------------------------------------------------------------------------------------


def _go_round(x: float) -> int:
    return math.floor(x + 0.5)  # Go's math.Round for the positive values here


def _k8s_name(g: int, memory_mib: int, total_mib: int) -> str:
    """go-nvlib's getMigMemorySizeGB (nvml-mig.md 2.6, blackwell.md 6): eighths of the total,
    rounded up, times the total in whole GiB rounded up, rounded half away from zero."""
    frac = math.ceil(memory_mib / total_mib * 8) / 8
    return f"{g}g.{_go_round(frac * math.ceil(total_mib / 1024))}gb"


@pytest.mark.parametrize("key", [k for k, m in MODELS.items() if m.mig_capable])
def test_every_profile_name_is_what_kubernetes_names_it(key: str) -> None:
    m = MODELS[key]
    for p in m.gi_profiles:
        stem = re.sub(r"(\+me\.all|\+me|\+gfx|-me)$", "", p.name)
        assert stem == _k8s_name(p.slices, p.memory_mib, m.memory_total_mib), p.name
        assert p.name == stem + p.capability


# -- inferred marks -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "field"),
    [
        ("B200", "mig.gi_profiles[3g.90gb].id"),  # blackwell.md: 9 I
        ("B200", "mig.gi_profiles[7g.180gb].memory_mib"),  # 182784 I
        ("B200", "mig.gi_profiles[4g.90gb].engines.dec"),  # 4 I
        ("B200", "mig.gi_profiles[1g.23gb].placements"),  # no -lgipp published
        ("GB200", "mig.gi_profiles[7g.186gb].multiprocessors"),  # 152 I
        ("B300", "mig.gi_profiles[1g.34gb].id"),  # B300: I
        ("GB300", "mig.gi_profiles[3g.139gb].memory_mib"),
        ("RTX-PRO-6000", "mig.gi_profiles[1g.24gb+gfx].index"),  # mapped by name
        ("RTX-PRO-6000", "mig.gi_profiles[4g.96gb].memory_mib"),  # 97408 I
        ("RTX-PRO-6000-WS", "name"),
        ("A100-80GB", "mig.gi_profiles[1g.20gb].placements"),  # nvml-mig.md 3.2 [I]
        ("H200", "mig.gi_profiles[7g.141gb].compute_instances[2].multiprocessors"),
    ],
)
def test_values_the_references_mark_inferred_are_marked(key: str, field: str) -> None:
    assert MODELS[key].is_inferred(field)


@pytest.mark.parametrize(
    ("key", "field"),
    [
        ("B200", "mig.gi_profiles[1g.23gb].id"),  # 19 V
        ("B200", "mig.gi_profiles[2g.45gb].engines.ce"),  # 4 read out
        ("GB200", "mig.gi_profiles[2g.47gb].memory_mib"),  # 45.50 GiB V
        ("RTX-PRO-6000", "mig.gi_profiles[1g.24gb].placements"),  # RTXB -lgipp
        ("RTX-PRO-6000", "memory_total_mib"),
        ("B300", "memory_total_mib"),
    ],
)
def test_values_read_out_are_not_marked(key: str, field: str) -> None:
    assert not MODELS[key].is_inferred(field)


# -- the loader -----------------------------------------------------------------------------------


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "m.yaml"
    path.write_text(text)
    return path


_MINIMAL = """\
key: X
name: NVIDIA X
architecture: hopper
brand: nvidia
compute_capability: [9, 0]
pci_device_id: 0x12340DE
memory_total_mib: 1000
multiprocessors: null
mig:
  mode_change_needs_reset: false
  memory_slices: 2
  compute_slices: 2
  placement_grid: 2
  gi_profiles:
    - name: 1g.1gb
      index: 0
      id: 19
      slices: 1
      instances: 2
      memory_mib: 500
      multiprocessors: 10
      engines: {ce: 1, dec: 0, enc: 0, jpg: 0, ofa: 0}
      placements: "{0,1}:1"
      compute_instances:
        - {index: 0, id: 0, slices: 1, instances: 1, multiprocessors: 10, placements: "{0}:1"}
"""


def test_a_minimal_file_loads(tmp_path: Path) -> None:
    (m,) = load_model_file(_file(tmp_path, _MINIMAL))
    assert (m.key, m.gi_profiles[0].name, m.inferred) == ("X", "1g.1gb", ())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("key: X\n", "key: X\nkey: Y\n"), "repeated"),
        (("multiprocessors: null\n", "multiprocessors: null\ncolour: green\n"), "unknown key"),
        (("index: 0\n", "index: 7\n"), "not NVML profile index 7's shape"),
        (('placements: "{0,1}:1"', 'placements: "{0,2}:1"'), "within 0..2"),
        (("instances: 2\n", "instances: 3\n"), "at least one per instance"),
        (("multiprocessors: null\n", "multiprocessors: null\ninferred: {colour: x}\n"), "colour"),
        (("architecture: hopper", "architecture: volta"), "one of"),
        (("brand: nvidia", "brand: geforce"), "brand: one of"),
        (("brand: nvidia\n", ""), "brand"),
        (("memory_mib: 500", "memory_mib: lots"), "expected int"),
    ],
)
def test_the_loader_refuses(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    text = _MINIMAL.replace(*change, 1)
    assert text != _MINIMAL
    with pytest.raises(GpuDataError, match=message):
        load_model_file(_file(tmp_path, text))


# -- GPU specs ------------------------------------------------------------------------------------


def test_gpu_specs() -> None:
    assert [m.key for m in parse_gpu_spec("8xH200")] == ["H200"] * 8
    assert [m.key for m in parse_gpu_spec("4xA100-40GB, 4xA30")] == ["A100-40GB"] * 4 + ["A30"] * 4
    assert [m.key for m in parse_gpu_spec("B200,GB200,B300,GB300")] == [
        "B200",
        "GB200",
        "B300",
        "GB300",
    ]
    assert [m.key for m in parse_gpu_spec("2xrtx-pro-6000")] == ["RTX-PRO-6000"] * 2
    assert model("h100-nvl") is MODELS["H100-NVL"]
    for bad, message in (
        ("0xH200", "bad GPU count"),
        ("2xH300", "unknown GPU model"),
        ("", "not a GPU spec"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_gpu_spec(bad)


# -- models added for a while ---------------------------------------------------------------------


def test_extra_models_are_known_only_inside_the_block(tmp_path: Path) -> None:
    before = dict(MODELS)
    with extra_models(_file(tmp_path, _MINIMAL)) as (m,):
        assert parse_gpu_spec("2xX") == (m, m)
        assert MODELS["X"] is m
    assert dict(MODELS) == before
    with pytest.raises(ValueError, match="unknown GPU model"):
        model("X")


@pytest.mark.parametrize(
    "change",
    [("key: X\n", "key: h200\n"), ("0x12340DE", f"0x{H200.pci_device_id:08X}")],
    ids=["key", "pci-id"],
)
def test_extra_models_refuse_a_known_key_or_pci_id(tmp_path: Path, change: tuple[str, str]) -> None:
    before = dict(MODELS)
    text = _MINIMAL.replace(*change, 1)
    assert text != _MINIMAL
    with (
        pytest.raises(GpuDataError, match="has the key or PCI id of H200"),
        extra_models(_file(tmp_path, text)),
    ):
        pass
    assert dict(MODELS) == before
