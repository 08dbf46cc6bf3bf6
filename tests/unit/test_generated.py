"""We test the layouts generated from a GPU model's own MIG profiles
(mig_agent.core.generated_layouts):

* for every MIG model, each generated layout is valid: it reads back through the v1 loader and
  plans on an empty GPU of that model;
* the shipped profile configs cover every catalog model, so nothing is generated for them;
* a model no config covers gets them, for itself only: the other models' layouts stay as they
  were; the agent with MIG_AGENT_GENERATE_CONFIG applies a generated layout on such a GPU and,
  without the setting, refuses it;
* ``mig-agent generate-config`` prints the same layouts as a v1 config.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from mig_agent import cli
from mig_agent.agent import Outcome
from mig_agent.config.profiles import load_catalog, load_text
from mig_agent.config.settings import PROFILES, Settings
from mig_agent.core import planner
from mig_agent.core.generated_layouts import covers, model_layouts, to_config, with_generated
from mig_agent.core.gpu_models import MODELS, GpuModel
from mig_agent.core.layout import LayoutCatalog

from .fake_gpus import FakeGpus
from .test_agent import label, make

MIG_MODELS = [m for m in MODELS.values() if m.mig_capable]
# A model no shipped config knows: the H200's geometry under another PCI id and name.
NOVEL = dataclasses.replace(
    MODELS["H200"], key="B-TEST", name="NVIDIA B-TEST", pci_device_id=0x2BFF10DE
)


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.key)
def test_every_generated_layout_loads_and_plans(model: GpuModel) -> None:
    layouts = model_layouts(model)
    names = {g.name for g in layouts}
    assert {"all-disabled", "all-enabled"} <= names
    assert {f"all-{gi.name.replace('+', '.')}" for gi in model.gi_profiles} <= names
    text = yaml.safe_dump(to_config(layouts))
    loaded = LayoutCatalog.of(load_text(text, "generated.yaml"))
    assert set(loaded.names()) == names
    empty = FakeGpus([model])
    for name in names:
        p = planner.plan(loaded.get(name), empty.observe(), empty.models())
        assert len(p.gpus) == 1, name


def test_the_shipped_configs_cover_every_catalog_model() -> None:
    catalog = load_catalog([PROFILES])
    assert all(covers(catalog, m) for m in MIG_MODELS)
    assert with_generated(catalog, MIG_MODELS) == (catalog, [])


def test_a_model_without_layouts_gets_its_own_and_nothing_else_changes() -> None:
    catalog = load_catalog([PROFILES])
    assert not covers(catalog, NOVEL)
    merged, generated = with_generated(catalog, [NOVEL, MODELS["H200"], NOVEL])
    assert generated == [NOVEL]
    h200 = MODELS["H200"]
    for name in catalog.names():  # the known models' targets are as they were
        old = catalog.get(name).target_for(0, h200.pci_device_id, h200.pci_subsystem_id)
        assert merged.get(name).target_for(0, h200.pci_device_id, h200.pci_subsystem_id) == old
    novel = merged.get("all-1g.18gb").target_for(0, NOVEL.pci_device_id, 0)
    assert novel is not None and novel.counts == {"1g.18gb": 7}
    assert "all-7g.141gb" in merged and covers(merged, NOVEL)


@pytest.mark.parametrize("generate", [True, False])
def test_the_agent_partitions_a_new_model_only_with_generated_layouts(generate: bool) -> None:
    gpus = FakeGpus([NOVEL] * 2)
    agent, cluster, _ = make(gpus, config=str(PROFILES), generate_config=generate)
    agent.reload_config()
    label(cluster, "all-3g.71gb")
    result = agent.reconcile_once()
    if generate:
        assert result.outcome is Outcome.APPLIED
        assert all(len(g.gpu_instances) == 2 for g in gpus.observe().gpus)
    else:
        assert result.outcome is Outcome.FAILED and not gpus.calls


def test_generate_config_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["generate-config", "--gpu", "A30"]) == 0
    text = capsys.readouterr().out
    (tmp_path / "a30.yaml").write_text(text)
    loaded = load_catalog([tmp_path / "a30.yaml"])
    assert set(loaded.names()) == {g.name for g in model_layouts(MODELS["A30"])}
    assert "device-filter: '0x20B710DE'" in text
    assert cli.main(["generate-config", "--gpu", "A30", "--gpu", "nope"]) == 2


def test_the_setting_reads_from_the_environment() -> None:
    from mig_agent.core.errors import ConfigError

    on = Settings.from_env({"MIG_AGENT_GENERATE_CONFIG": "true", "NODE_NAME": "n"})
    assert on.generate_config is True
    assert Settings.from_env({"NODE_NAME": "n"}).generate_config is False
    with pytest.raises(ConfigError, match="MIG_AGENT_GENERATE_CONFIG='maybe'"):
        Settings.from_env({"MIG_AGENT_GENERATE_CONFIG": "maybe", "NODE_NAME": "n"})
