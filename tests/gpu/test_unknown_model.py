"""We test these aspects of the agent on a GPU model its catalog does not know (TEST-X6 of
tests/data/gpus, known to the simulator for the test only), whose profiles it can learn only
from NVML:

* the model is unknown and unlike the usual: no catalog model has its PCI id or name, and none of
  its GI profiles offers the CI profiles one would assume (the whole-GI CI at the index of its
  slice count, id = index);
* the backend's model lists its GI profiles (ids, indices, memory, SMs, engines, placements on its
  6-slice grid) and, inside each, the CI profiles exactly as the simulator's data says: read from
  NVML inside a GPU instance, made for the read where none exists and destroyed after it; with
  MIG off they cannot be read, and the model is read again once MIG is on;
* the planner and executor apply every layout generate-config makes for it and mixes with split
  compute instances; NVML then shows exactly the layout's MIG devices;
* a layout naming a CI profile the model lacks inside that GI is refused, naming it, with every
  instance left as it was;
* the CLI on it: profiles -o json, generate-config, plan, apply, assert, export.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog
import yaml
from migsim.gpus import GpuModel as SimModel
from migsim.nvml import library as simlib

from mig_agent import cli
from mig_agent.config.profiles import load_text
from mig_agent.core.errors import PlanError
from mig_agent.core.generated_layouts import model_layouts
from mig_agent.core.gpu_models import CI_INDEX_BY_SLICES, MODEL_BY_PCI_ID, MODELS, GpuModel
from mig_agent.core.layout import Layout
from mig_agent.gpu.nvml import NvmlGpuBackend
from mig_agent.node.apply import apply_layout

from .conftest import MakeNode

OpenSim = Callable[[str], NvmlGpuBackend]


def _layout(devices: dict[str, int], name: str = "mix") -> Layout:
    text = yaml.safe_dump(
        {
            "version": "v1",
            "mig-configs": {
                name: [{"devices": "all", "mig-enabled": True, "mig-devices": devices}]
            },
        }
    )
    (layout,) = load_text(text, "<test>")
    return layout


def _gi_table(m: SimModel | GpuModel) -> dict[str, object]:
    """What NVML tells of each GI profile and its CI profiles, in both models' terms."""
    return {
        p.name: (
            p.index,
            p.id,
            p.slices,
            p.memory_mib,
            p.instance_count,
            p.multiprocessors,
            (p.engines.copy, p.engines.decoder, p.engines.encoder, p.engines.jpeg, p.engines.ofa),
            [(x.start, x.size) for x in p.placements],
            sorted(
                (
                    c.index,
                    c.id,
                    c.slices,
                    c.instance_count,
                    c.multiprocessors,
                    [(x.start, x.size) for x in c.placements],
                )
                for c in p.ci_profiles
            ),
        )
        for p in m.gi_profiles
    }


def _devices(b: NvmlGpuBackend) -> Counter[str]:
    return Counter(d.name for d in b.mig_devices())


def test_the_model_is_unknown_and_unlike_the_usual(unknown_model: SimModel) -> None:
    assert unknown_model.pci_device_id not in MODEL_BY_PCI_ID
    assert unknown_model.name not in {m.name for m in MODELS.values()}
    catalog_names = {p.name for m in MODELS.values() for p in m.gi_profiles}
    for p in unknown_model.gi_profiles:
        assert p.name not in catalog_names
        assumed = CI_INDEX_BY_SLICES[p.slices]
        assert [(c.index, c.id) for c in p.ci_profiles] != [(assumed, assumed)], p.name


def test_the_model_is_read_from_nvml_as_the_data_says(
    unknown_model: SimModel, make_node: MakeNode, open_sim: OpenSim
) -> None:
    path = make_node("TEST-X6", mig_enabled=True)
    read = open_sim(path).models()[0]
    assert (read.name, read.pci_device_id, read.memory_total_mib) == (
        unknown_model.name,
        unknown_model.pci_device_id,
        unknown_model.memory_total_mib,
    )
    assert (read.memory_slices, read.compute_slices, read.placement_units) == (
        unknown_model.memory_slices,
        unknown_model.compute_slices,
        unknown_model.placement_grid,
    )
    assert _gi_table(read) == _gi_table(unknown_model)
    # the GPU instances made to read the CI profiles are gone again
    assert simlib.load_node(path).gpus[0].gpu_instances == []


def test_ci_profiles_are_read_inside_an_existing_gpu_instance(
    unknown_model: SimModel, make_node: MakeNode, open_sim: OpenSim
) -> None:
    # Two 3g GIs fill the GPU: nothing else can be made, the 3g table is read inside one of them.
    path = make_node("TEST-X6", mig_enabled=True)
    b = open_sim(path)
    three = next(p for p in unknown_model.gi_profiles if p.slices == 3)
    for pl in three.placements:
        b.create_gpu_instance(0, three.id, pl)  # type: ignore[arg-type]
    before = simlib.load_node(path).gpus[0].gpu_instances
    read = open_sim(path).models()[0]
    assert _gi_table(read)[three.name] == _gi_table(unknown_model)[three.name]
    assert simlib.load_node(path).gpus[0].gpu_instances == before


def test_ci_profiles_are_read_once_mig_is_on(
    unknown_model: SimModel, make_node: MakeNode, open_sim: OpenSim
) -> None:
    b = open_sim(make_node("TEST-X6"))
    b.models()  # MIG off: NVML lists no CI profile, so this read is not kept
    b.set_mig_mode(0, enabled=True)
    assert _gi_table(b.models()[0]) == _gi_table(unknown_model)


@pytest.mark.parametrize("mig_enabled", [False, True], ids=["mig-off", "mig-on"])
def test_generated_layouts_and_mixes_apply(
    unknown_model: SimModel, make_node: MakeNode, open_sim: OpenSim, mig_enabled: bool
) -> None:
    b = open_sim(make_node("TEST-X6", mig_enabled=mig_enabled))
    if not mig_enabled:  # MIG on first: NVML lists CI profiles only then
        apply_layout(_layout({}, "all-enabled"), b)
    model = b.models()[0]
    generated = [
        g for g in model_layouts(model) if g.name.startswith("all-") and "abled" not in g.name
    ]
    assert sorted(g.name for g in generated) == sorted(
        f"all-{p.name}" for p in unknown_model.gi_profiles
    )
    mixes = [
        {"3g.44gb": 1, "2g.33gb": 1, "1g.22gb": 1},
        {"1c.3g.44gb": 3, "3g.44gb": 1},
        {"2c.6g.88gb": 3},
        {"3c.6g.88gb": 2},
    ]
    for layout in [*generated, *(_layout(m) for m in mixes)]:
        apply_layout(layout, b)  # verifies the result against the layout
        want = layout.target_for(0, unknown_model.pci_device_id, 0)
        assert want is not None
        assert _devices(b) == Counter({str(p): n for p, n in want.devices}), layout.name
        assert apply_layout(layout, b).plan.is_empty


@pytest.mark.parametrize("profile", ["1c.2g.33gb", "1c.6g.88gb", "2c.3g.44gb"])
def test_a_ci_profile_the_gi_lacks_is_refused_untouched(
    unknown_model: SimModel, make_node: MakeNode, open_sim: OpenSim, profile: str
) -> None:
    path = make_node("TEST-X6", mig_enabled=True)
    b = open_sim(path)
    apply_layout(_layout({"3g.44gb": 1, "1g.22gb": 2}), b)
    before = simlib.load_node(path).gpus[0].gpu_instances
    with pytest.raises(PlanError, match=rf"no MIG profile {profile} on {unknown_model.name}"):
        apply_layout(_layout({profile: 1}), b)
    assert simlib.load_node(path).gpus[0].gpu_instances == before


# -- the CLI --------------------------------------------------------------------------------------


@pytest.fixture
def run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., tuple[int, str, str]]]:
    """``run(*argv)`` -> ``mig-agent argv``'s (exit code, stdout, stderr), no MIG_AGENT_* from
    the environment; the logging main() sets up is undone after the test."""
    for name in ("CONFIG", "LAYOUT", "BACKEND", "SIM_STATE", "SIM_GPUS", "LOG_FORMAT"):
        monkeypatch.delenv(f"MIG_AGENT_{name}", raising=False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    config = structlog.get_config()

    def run_(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["--log-format", "json", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    yield run_
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(**config)


def test_the_cli_on_the_unknown_model(
    unknown_model: SimModel,
    make_node: MakeNode,
    run: Callable[..., tuple[int, str, str]],
    tmp_path: Path,
) -> None:
    state = make_node("2xTEST-X6", mig_enabled=True)
    sim = ["--backend", "simulated", "--sim-state", state]

    code, out, _ = run("profiles", *sim, "-o", "json")
    assert code == 0
    (listed,) = json.loads(out).values()
    got = {
        p["name"]: sorted(
            (c["index"], c["id"], c["slices"], c["instances"], c["multiprocessors"])
            for c in p["compute_instances"]
        )
        for p in listed
    }
    assert got == {
        p.name: sorted(
            (c.index, c.id, c.slices, c.instance_count, c.multiprocessors) for c in p.ci_profiles
        )
        for p in unknown_model.gi_profiles
    }

    code, out, _ = run("generate-config", *sim)
    assert code == 0
    config = tmp_path / "generated.yaml"
    config.write_text(out)
    assert {f"all-{p.name}" for p in unknown_model.gi_profiles} <= set(
        yaml.safe_load(out)["mig-configs"]
    )
    layout = ["-f", str(config), "-c", "all-1g.22gb"]

    code, out, _ = run("plan", *layout, *sim, "--exit-code")
    assert code == 3 and "2 of 2 GPU(s) change" in out
    code, _, err = run("assert", *layout, *sim)
    assert code == 1
    code, out, err = run("apply", *layout, *sim)
    assert code == 0, err
    assert "GPU 0: destroyed 0 GPU instance(s), created 6" in out
    code, out, _ = run("assert", *layout, *sim)
    assert (code, out) == (0, "layout all-1g.22gb is applied\n")

    code, out, _ = run("export", "-l", "exported", *sim)
    assert code == 0
    (exported,) = load_text(out, "<export>")
    for gpu in (0, 1):
        target = exported.target_for(gpu, unknown_model.pci_device_id, 0)
        assert target is not None and dict(target.counts) == {"1g.22gb": 6}

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "version: v1\nmig-configs:\n  bad:\n    - devices: all\n      mig-enabled: true\n"
        "      mig-devices: {1c.2g.33gb: 1}\n"
    )
    code, _, err = run("apply", "-f", str(bad), "-c", "bad", *sim)
    assert code == 1 and "no MIG profile 1c.2g.33gb on NVIDIA Test X6 88GB" in err
    code, out, _ = run("assert", *layout, *sim)
    assert code == 0
