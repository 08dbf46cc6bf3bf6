"""We test these aspects of the one-node command line (``mig-agent validate|profiles|plan|apply|
assert|export``), through ``cli.main`` with its output captured:

* ``profiles --backend simulated`` on one simulated H200 reproduces the real H200's readout kept
  in tests/data/captures (profile ids and indices, memory, SMs, engines, instance counts and
  placements, the device name and memory); ``profiles --gpu A30`` prints the A30's table;
* ``validate``: a good file exits 0; a bad one exits 2 naming the file and the key; ``--gpu``
  lists the layouts that fit the model, hides those written for other models, and exits 1 when
  a layout meant for the model does not fit;
* ``plan --gpus 1xH200 -o json`` places every instance where the H200 allows it, without
  overlaps; ``plan --from`` reads ``export -o json``; ``--exit-code`` gives 3 only with changes;
* ``apply``/``assert``/``export`` on a simulated node: assert exits 1 before apply and 0 after,
  a second apply changes nothing, the exported config reads back as the applied layout;
* usage errors: an unknown layout exits 2 naming close matches; ``--backend nvml`` without an
  NVIDIA library fails pointing to ``--backend simulated``; ``--help`` works for every command.
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from migsim.nvml import library as simlib

from mig_agent import cli
from mig_agent.config.profiles import load_catalog, load_text
from mig_agent.core.layout import GpuLayout, MigProfile

REPO = Path(__file__).resolve().parents[2]
PROFILES = str(REPO / "profiles")
OPERATOR = str(REPO / "tests" / "data" / "compat" / "gpu-operator-default-mig-config.yaml")
CAPTURES = REPO / "tests" / "data" / "captures"
H200 = 0x233510DE

# The H200's GPU instance placements (start: size), as its driver lists them (nvidia-smi mig
# -lgipp on the captured H200).
H200_PLACEMENTS = {
    "1g.18gb": ({0, 1, 2, 3, 4, 5, 6}, 1),
    "1g.18gb+me": ({0, 1, 2, 3, 4, 5, 6}, 1),
    "1g.35gb": ({0, 2, 4, 6}, 2),
    "2g.35gb": ({0, 2, 4}, 2),
    "3g.71gb": ({0, 4}, 4),
    "4g.71gb": ({0}, 4),
    "7g.141gb": ({0}, 8),
}


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No MIG_AGENT_* setting from the environment; logging set up by main() is undone."""
    for name in ("CONFIG", "LAYOUT", "BACKEND", "SIM_STATE", "SIM_GPUS", "LOG_FORMAT"):
        monkeypatch.delenv(f"MIG_AGENT_{name}", raising=False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    config = structlog.get_config()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(**config)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``mig-agent argv`` -> (exit code, stdout, stderr)."""
    code = cli.main(["--log-format", "json", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def sim(state: Path, gpus: str = "2xH200") -> list[str]:
    return ["--backend", "simulated", "--sim-state", str(state), "--sim-gpus", gpus]


# -- profiles -----------------------------------------------------------------------------------


def test_profiles_of_a_simulated_h200_reproduce_the_real_readout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    probe2 = json.loads((CAPTURES / "h200-0x2335-probe2.json").read_text())
    probe1 = json.loads((CAPTURES / "h200-0x2335-probe1.json").read_text())
    expected = {}
    for entry in probe2["devices"][0]["giProfiles"]:
        info = entry["info"]
        if "err" in info:
            continue  # profile indices this GPU does not have
        name = info["name"].removeprefix("MIG ")
        expected[name] = {
            "name": name,
            "index": entry["profileIndex"],
            "id": info["id"],
            "slices": info["sliceCount"],
            "memory_mib": info["memorySizeMB"],
            "instances": info["instanceCount"],
            "multiprocessors": info["multiprocessorCount"],
            "engines": {
                "copy": info["copyEngineCount"],
                "decoder": info["decoderCount"],
                "encoder": info["encoderCount"],
                "jpeg": info["jpegCount"],
                "ofa": info["ofaCount"],
            },
            "placements": [{"start": s, "size": n} for s, n in entry["placements"]],
        }
    assert len(expected) == 7

    state = tmp_path / "h200.json"
    code, out, _ = run(capsys, "profiles", *sim(state, "H200"), "-o", "json")
    assert code == 0
    got = json.loads(out)
    assert list(got) == ["H200"]
    # the capture has no CI profiles (read with MIG off): compare the GI profiles
    gi_only = [{k: v for k, v in p.items() if k != "compute_instances"} for p in got["H200"]]
    assert {p["name"]: p for p in gi_only} == expected

    # The table: device name, memory, and each profile's placements as nvidia-smi lists them.
    code, out, _ = run(capsys, "profiles", *sim(state, "H200"))
    assert code == 0
    device = probe1["devices"][0]
    pci = int(device["pciDeviceId"], 16)
    assert (
        out.splitlines()[0] == f"{device['name']} (H200, 0x{pci:08X}, {device['memTotalMiB']} MiB)"
    )
    smi = (CAPTURES / "h200-0x2335-nvidia-smi.txt").read_text()
    lgipp = dict(re.findall(r"Profile ID\s+(\d+) Placements?\s*:\s*(\{[\d,]+\}:\d+)", smi))
    assert len(lgipp) == 7
    rows = {fields[1]: fields[-1] for line in out.splitlines()[2:] if (fields := line.split())}
    assert rows == lgipp


def test_profiles_of_a_catalog_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "profiles", "--gpu", "A30")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "NVIDIA A30 (A30, 0x20B710DE, 24576 MiB)"
    assert lines[1].split()[:6] == ["profile", "id", "idx", "inst", "MiB", "SM"]
    table = {f[0]: (int(f[1]), int(f[2]), int(f[3]), f[-1]) for f in map(str.split, lines[2:])}
    assert table == {  # name: (id, index, instances, placements)
        "1g.6gb": (14, 0, 4, "{0,1,2,3}:1"),
        "1g.6gb+me": (21, 7, 1, "{0,1,2,3}:1"),
        "2g.12gb": (5, 1, 2, "{0,2}:2"),
        "2g.12gb+me": (6, 8, 1, "{0,2}:2"),
        "4g.24gb": (0, 3, 1, "{0}:4"),
    }


def test_profiles_of_the_rtx_pro_6000_name_its_placement_grid(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "profiles", "--gpu", "RTX-PRO-6000")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == (
        "NVIDIA RTX PRO 6000 Blackwell Server Edition (RTX-PRO-6000, 0x2BB510DE, 97887 MiB; "
        "4 memory slices, placed on a 12-unit grid)"
    )
    table = {f[0]: (int(f[1]), f[-1]) for f in map(str.split, lines[2:])}
    assert table["1g.24gb+me.all"] == (65, "{0,3,6,9}:3")
    assert table["2g.48gb-me"] == (66, "{0,6}:6")
    assert table["4g.96gb+gfx"] == (32, "{0}:12")
    assert len(table) == 11


# -- validate -----------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [OPERATOR, PROFILES], ids=["gpu-operator", "profiles"])
def test_validate_good_config(config: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "validate", "-f", config)
    assert code == 0, err
    assert re.match(r"\d+ layout\(s\) valid: ", out)
    assert "all-balanced" in out


BAD = {
    "unknown-key": ("      mig-devces: {}\n", "'mig-devces'"),
    "bad-profile": ('      mig-devices: {"1g.5gbx": 2}\n', "'1g.5gbx'"),
    "bad-count": ('      mig-devices: {"1g.5gb": two}\n', "'1g.5gb'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_validate_bad_config(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line, key = BAD[case]
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "version: v1\nmig-configs:\n  broken:\n    - devices: all\n      mig-enabled: true\n" + line
    )
    code, out, err = run(capsys, "validate", "-f", str(bad))
    assert code == 2
    assert str(bad) in err and key in err and "broken" in err
    assert out == ""


def test_validate_gpu_lists_what_fits_and_hides_other_models(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, "validate", "-f", OPERATOR, "--gpu", "H200")
    assert code == 0
    rows = dict(line.split(maxsplit=1) for line in out.splitlines() if line.startswith("  all-"))
    assert rows == {
        name: "fits"
        for name in (
            "all-1g.18gb",
            "all-1g.18gb.me",
            "all-1g.35gb",
            "all-2g.35gb",
            "all-3g.71gb",
            "all-4g.71gb",
            "all-7g.141gb",
            "all-balanced",
            "all-disabled",
            "all-enabled",
        )
    }
    others = next(line for line in out.splitlines() if "for other models" in line)
    assert "all-1g.5gb," in others and "all-7g.80gb" in others and "all-1g.18gb" not in others

    code, out, _ = run(capsys, "validate", "-f", PROFILES, "--gpu", "H200", "--gpu", "A30")
    assert code == 0
    assert "H200 (0x233510DE):" in out and "A30 (0x20B710DE):" in out
    assert "DOES NOT FIT" not in out


def test_validate_gpu_names_a_layout_that_does_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "h200.yaml"
    config.write_text(
        "version: v1\nmig-configs:\n  too-much:\n    - device-filter: '0x233510DE'\n"
        "      devices: all\n      mig-enabled: true\n      mig-devices: {'3g.71gb': 3}\n"
    )
    code, out, _ = run(capsys, "validate", "-f", str(config), "--gpu", "H200")
    assert code == 1
    assert re.search(r"too-much\s+DOES NOT FIT: .*3 x 3g.71gb", out)


# -- plan ---------------------------------------------------------------------------------------


def test_plan_places_every_instance_where_the_h200_allows(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(
        capsys, "plan", "-f", PROFILES, "-c", "all-balanced", "--gpus", "1xH200", "-o", "json"
    )
    assert code == 0
    plan = json.loads(out)
    assert plan["layout"] == "all-balanced" and plan["changes"] is True
    (gpu,) = plan["gpus"]
    assert gpu["model"] == "H200"
    devices = gpu["devices"]
    assert sorted(d["profile"] for d in devices) == ["1g.18gb", "1g.18gb", "2g.35gb", "3g.71gb"]
    taken: set[int] = set()
    for d in devices:
        starts, size = H200_PLACEMENTS[d["profile"]]
        start = d["placement"]["start"]
        assert start in starts and d["placement"]["size"] == size, d
        slices = set(range(start, start + size))
        assert not slices & taken, d
        taken |= slices
    steps = [s["op"] for s in gpu["steps"]]
    assert steps == ["set_mig_mode"] + ["create_gpu_instance"] * 4 + ["create_compute_instance"] * 4
    created = {(s["placement"]["start"], s["placement"]["size"]) for s in gpu["steps"][1:5]}
    assert created == {(d["placement"]["start"], d["placement"]["size"]) for d in devices}


def test_plan_text_and_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "plan", "-f", PROFILES, "-c", "all-balanced", "--gpus", "2xA30", "--exit-code"
    )
    assert code == 3
    assert out.startswith("layout all-balanced: 2 of 2 GPU(s) change")
    assert "create GPU instance 2g.12gb at 0:2" in out
    code, out, _ = run(
        capsys, "plan", "-f", PROFILES, "-c", "all-disabled", "--gpus", "2xA30", "--exit-code"
    )
    assert code == 0
    assert "0 of 2 GPU(s) change" in out


def test_plan_from_a_bad_snapshot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "snapshot.json"
    bad.write_text(json.dumps({"gpus": [{"index": 0}]}))
    code, _, err = run(capsys, "plan", "-f", PROFILES, "-c", "all-balanced", "--from", str(bad))
    assert code == 2
    assert str(bad) in err and "not a GPU state snapshot" in err


# -- apply, assert, export on a simulated node --------------------------------------------------


def test_apply_assert_export_on_a_simulated_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "node.json"
    layout = ["-f", OPERATOR, "-c", "all-balanced"]

    code, _, err = run(capsys, "assert", *layout, *sim(state))
    assert code == 1
    assert "layout all-balanced is not applied: GPU(s) 0, 1 differ" in err

    code, out, _ = run(capsys, "apply", *layout, "--dry-run", *sim(state))
    assert code == 0 and "2 of 2 GPU(s) change" in out
    assert simlib.call_counts(state).total == 0

    code, out, err = run(capsys, "apply", *layout, *sim(state))
    assert code == 0, err
    assert "GPU 0: destroyed 0 GPU instance(s), created 4, MIG mode set" in out
    assert "layout all-balanced applied in" in out

    code, out, _ = run(capsys, "assert", *layout, *sim(state))
    assert (code, out) == (0, "layout all-balanced is applied\n")
    simlib.reset_call_counts(state)
    code, out, _ = run(capsys, "apply", *layout, *sim(state))
    assert (code, out) == (0, "layout all-balanced already applied; nothing changed\n")
    assert simlib.call_counts(state).total == 0

    # export: a v1 config that reads back as the applied layout
    code, out, _ = run(capsys, "export", "-l", "exported", *sim(state))
    assert code == 0
    (exported,) = load_text(out, "<export>")
    applied = load_catalog([OPERATOR]).get("all-balanced")
    for gpu in (0, 1):
        assert exported.target_for(gpu, H200, 0) == applied.target_for(gpu, H200, 0)
    assert exported.target_for(0, H200, 0) == GpuLayout.of(
        True,
        {MigProfile.parse(n): c for n, c in {"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1}.items()},
    )
    config = tmp_path / "exported.yaml"
    config.write_text(out)
    code, _, _ = run(capsys, "assert", "-f", str(config), *sim(state))
    assert code == 0

    # export -o json -> plan --from: nothing to do for the applied layout, changes for another
    snapshot = tmp_path / "snapshot.json"
    code, out, _ = run(capsys, "export", "-o", "json", *sim(state))
    assert code == 0
    snapshot.write_text(out)
    code, out, _ = run(capsys, "plan", *layout, "--from", str(snapshot), "--exit-code")
    assert code == 0 and "0 of 2 GPU(s) change" in out
    code, out, _ = run(
        capsys,
        "plan",
        "-f",
        OPERATOR,
        "-c",
        "all-3g.71gb",
        "--from",
        str(snapshot),
        "--exit-code",
        "-o",
        "json",
    )
    assert code == 3
    plan = json.loads(out)
    # 3g.71gb at 4 stays; the 2g and the two 1g go, and a second 3g goes at 0
    assert [(g["destroyed_gpu_instances"], g["created_gpu_instances"]) for g in plan["gpus"]] == [
        (3, 1),
        (3, 1),
    ]
    assert simlib.call_counts(state).total == 0


# -- usage errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["plan", "apply", "assert"])
def test_unknown_layout_names_close_matches(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ["--gpus", "H200"] if command == "plan" else sim(tmp_path / "node.json")
    code, out, err = run(capsys, command, "-f", OPERATOR, "-c", "all-balancd", *extra)
    assert code == 2
    assert "unknown layout 'all-balancd'; did you mean all-balanced?" in err
    assert out == ""
    assert (
        not (tmp_path / "node.json").exists()
        or simlib.call_counts(tmp_path / "node.json").total == 0
    )


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None, reason="an NVIDIA library is installed"
)
@pytest.mark.parametrize("command", [["profiles"], ["export"], ["apply", "-c", "all-balanced"]])
def test_nvml_backend_without_a_gpu_library(command: list[str]) -> None:
    # A process of its own: this test process may hold the simulated libnvidia-ml.so.1 that
    # tests/native load (a library once loaded answers every later dlopen of its name).
    import os
    import subprocess
    import sys

    extra = ["-f", OPERATOR] if command[0] == "apply" else []
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "LD_LIBRARY_PATH" and not k.startswith("MIG_AGENT_")
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mig_agent",
            "--log-format",
            "json",
            *command,
            *extra,
            "--backend",
            "nvml",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode != 0
    assert "libnvidia-ml" in done.stderr and "--backend simulated" in done.stderr
    assert done.stdout == ""


def _commands() -> list[str]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def test_every_one_node_command_is_there() -> None:
    assert {"validate", "profiles", "plan", "apply", "assert", "export"} <= set(_commands())


@pytest.mark.parametrize("argv", [[], *([c] for c in _commands())], ids=["main", *_commands()])
def test_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage: mig-agent")


def test_simulated_backend_without_the_simulated_world_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The agent's package does not ship the simulated GPUs: without the package that
    registers them, --backend simulated is a usage error that names the fix."""
    import importlib.metadata

    real = importlib.metadata.entry_points

    def without_sim(**kwargs: str) -> object:
        if kwargs.get("group") == "mig_agent.gpu_backends":
            return []
        return real(**kwargs)

    monkeypatch.setattr(importlib.metadata, "entry_points", without_sim)
    code = cli.main(
        [
            "assert",
            "-c",
            "all-1g.10gb",
            "--backend",
            "simulated",
            "--sim-state",
            str(tmp_path / "node.json"),
        ]
    )
    assert code == 2
    assert "pip install -e ./sim" in capsys.readouterr().err
    assert not (tmp_path / "node.json").exists()  # nothing was created
