"""We test these aspects of mig_agent.core.advertised (what NVIDIA's device plugin
advertises) and of the device plugin config reading in mig_agent.config.profiles:

* mixed strategy: a MIG device that splits a GPU instance (``1c.3g.40gb``) makes the plugin
  advertise nothing at all, with a reason naming the strategy, the profile and the GPUs; single
  strategy advertises such devices as ``nvidia.com/gpu``;
* display GPUs ("DGX Display") are neither advertised nor counted by single strategy's rules;
* sharing: replicas multiply, ``renameByDefault`` renames to ``.shared``, a per-resource
  ``rename`` and ``devices`` are ignored, MPS wins over time-slicing and refuses MIG devices and
  the mixed strategy; every malformed config is refused naming the file and the key;
* the strategy comes from the node label where there is one; a bad value is an error naming it;
* in a ConfigMap folder, the config is the one the node label names, else the default, else none.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from mig_agent.config.device_plugin import device_plugin_sharing
from mig_agent.config.profiles import load_text
from mig_agent.core.advertised import (
    NO_SHARING,
    SharedResource,
    Sharing,
    advertised_resources,
    expected_resources,
    node_mig_strategy,
    parse_sharing,
    planned_devices,
    strategy_problem,
)
from mig_agent.core.errors import ConfigError, InvalidConfig
from mig_agent.core.gpu_models import MODELS, GpuModel
from mig_agent.core.planner import plan
from mig_agent.node.apply import execute

from .fake_gpus import FakeGpus

H100, A100, DISPLAY = MODELS["H100-80GB"], MODELS["A100-80GB"], MODELS["DGX-Display"]


def partitioned(models: list[GpuModel], rules: str) -> FakeGpus:
    """GPUs of ``models`` with the layout whose entries are ``rules`` applied."""
    gpus = FakeGpus(models)
    [layout] = load_text(f"version: v1\nmig-configs:\n  t:\n{rules}", "t.yaml")
    execute(plan(layout, gpus.observe(), gpus.models()), gpus)
    return gpus


def entry(devices: str, mig_devices: str, *, filter_: str = "") -> str:
    enabled = "true" if mig_devices else "false"
    dev_filter = f"      device-filter: {filter_!r}\n" if filter_ else ""
    return (
        f"    - devices: {devices}\n{dev_filter}      mig-enabled: {enabled}\n"
        f"      mig-devices: {{{mig_devices}}}\n"
    )


SPLIT = entry("[0]", '"1c.3g.40gb": 3') + entry("[1]", "")


# -- 7: compute-instance-split MIG devices ------------------------------------------------------


def test_split_ci_devices_make_the_mixed_plugin_advertise_nothing() -> None:
    gpus = partitioned([H100, H100], SPLIT)
    # it refuses to start: not even the whole GPU 1 is advertised
    assert expected_resources(gpus.observe(), gpus.models(), "mixed") == {}


def test_the_mixed_refusal_names_strategy_profile_and_gpus() -> None:
    devices = {
        0: Counter({"1c.3g.40gb": 3, "3g.40gb": 1}),
        1: Counter({"2c.3g.40gb": 1}),
        2: Counter({"1g.10gb": 7}),
        3: None,
    }
    problem = strategy_problem(devices, "mixed")
    assert "mixed MIG strategy" in problem
    assert "(1c.3g.40gb, 2c.3g.40gb on GPU(s) 0, 1)" in problem
    assert strategy_problem({0: Counter({"3g.40gb": 2}), 1: None}, "mixed") == ""


def test_single_strategy_advertises_split_ci_devices_as_gpus() -> None:
    gpus = partitioned([H100, H100], entry("all", '"1c.3g.40gb": 3'))
    assert expected_resources(gpus.observe(), gpus.models(), "single") == {"nvidia.com/gpu": 6}
    # a node with one split and one whole profile is not uniform
    mixed = partitioned([H100], entry("all", '"1c.3g.40gb": 1, "3g.40gb": 1'))
    assert expected_resources(mixed.observe(), mixed.models(), "single") == {}


def test_a_planned_split_layout_is_refused_in_mixed_before_anything_changes() -> None:
    gpus = FakeGpus([H100, H100])
    [layout] = load_text(f"version: v1\nmig-configs:\n  t:\n{SPLIT}", "t.yaml")
    the_plan = plan(layout, gpus.observe(), gpus.models())
    devices = planned_devices(the_plan, gpus.observe(), gpus.models())
    assert devices == {0: Counter({"1c.3g.40gb": 3}), 1: None}
    assert "1c.3g.40gb" in strategy_problem(devices, "mixed")
    # single: GPU 1 without MIG is the problem, not the split
    assert "GPU(s) 1 would have MIG disabled" in strategy_problem(devices, "single")
    assert not gpus.calls


# -- 8: display GPUs ----------------------------------------------------------------------------


STATION = entry("all", '"1g.10gb": 7', filter_="0x20B210DE") + entry(
    "all", "", filter_="0x1FB010DE"
)


def test_display_gpus_are_not_advertised() -> None:
    gpus = FakeGpus([A100, A100, DISPLAY])
    assert expected_resources(gpus.observe(), gpus.models(), "mixed") == {"nvidia.com/gpu": 2}
    gpus = partitioned([A100, A100, DISPLAY], STATION)
    for strategy, name in (("mixed", "nvidia.com/mig-1g.10gb"), ("single", "nvidia.com/gpu")):
        assert expected_resources(gpus.observe(), gpus.models(), strategy) == {name: 14}


def test_a_display_gpu_does_not_break_single_strategy_uniformity() -> None:
    gpus = FakeGpus([A100, A100, DISPLAY])
    [layout] = load_text(f"version: v1\nmig-configs:\n  t:\n{STATION}", "t.yaml")
    the_plan = plan(layout, gpus.observe(), gpus.models())
    devices = planned_devices(the_plan, gpus.observe(), gpus.models())
    assert 2 not in devices
    assert strategy_problem(devices, "single") == ""


# -- 9: sharing ---------------------------------------------------------------------------------


def test_replicas_multiply_and_rename_by_default_renames() -> None:
    devices = {0: Counter({"1g.10gb": 7}), 1: Counter({"3g.40gb": 2})}
    ts = Sharing("time-slicing", (SharedResource("nvidia.com/mig-1g.10gb", 4),))
    assert advertised_resources(devices, "mixed", ts) == {
        "nvidia.com/mig-1g.10gb": 28,
        "nvidia.com/mig-3g.40gb": 2,
    }
    renamed = Sharing(
        "time-slicing", (SharedResource("nvidia.com/gpu", 2, "nvidia.com/gpu.shared"),)
    )
    assert advertised_resources(devices, "single", renamed) == {}  # two profiles
    assert advertised_resources(
        {0: Counter({"1g.10gb": 7}), 1: Counter({"1g.10gb": 7})}, "single", renamed
    ) == {"nvidia.com/gpu.shared": 28}
    assert advertised_resources({0: None, 1: None}, "mixed", renamed) == {
        "nvidia.com/gpu.shared": 4
    }


def test_a_shared_resource_the_node_lacks_changes_nothing() -> None:
    ts = Sharing("time-slicing", (SharedResource("nvidia.com/mig-7g.80gb", 3),))
    assert advertised_resources({0: Counter({"1g.10gb": 7})}, "mixed", ts) == {
        "nvidia.com/mig-1g.10gb": 7
    }


CONFIG = """
version: v1
flags:
  migStrategy: mixed
sharing:
  timeSlicing:
    renameByDefault: {rename}
    resources:
    - name: mig-1g.10gb
      replicas: 4
      rename: something-else
      devices: [0, "1:0"]
    - name: nvidia.com/gpu
      replicas: 2
"""


def sharing_of(text: str) -> Sharing:
    return parse_sharing(yaml.safe_load(text), source="dp.yaml")


def test_parse_sharing_as_the_plugin_reads_it() -> None:
    assert sharing_of(CONFIG.format(rename="false")) == Sharing(
        "time-slicing",
        (SharedResource("nvidia.com/mig-1g.10gb", 4), SharedResource("nvidia.com/gpu", 2)),
        "dp.yaml",
    )
    renamed = sharing_of(CONFIG.format(rename="true"))
    assert [r.rename for r in renamed.resources] == [
        "nvidia.com/mig-1g.10gb.shared",
        "nvidia.com/gpu.shared",
    ]
    assert (
        sharing_of("")
        == sharing_of("version: v1\nflags: {migStrategy: single}\n")
        == Sharing(source="dp.yaml")
    )
    both = sharing_of(
        "sharing:\n  mps: {resources: [{name: gpu, replicas: 3}]}\n"
        "  timeSlicing: {resources: [{name: gpu, replicas: 5}]}\n"
    )
    assert both == Sharing("mps", (SharedResource("nvidia.com/gpu", 3),), "dp.yaml")


@pytest.mark.parametrize(
    "text,key,fragment",
    [
        ("version: v2\n", "version", "unknown version 'v2'"),
        ("sharing: [1]\n", "sharing", "must be a mapping"),
        ("sharing: {timeSlicing: {}}\n", "sharing.timeSlicing.resources", "no resources specified"),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu}]}}\n",
            "sharing.timeSlicing.resources[0].replicas",
            "must be an integer >= 2, got None",
        ),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 1}]}}\n",
            "sharing.timeSlicing.resources[0].replicas",
            "got 1",
        ),
        (
            "sharing: {mps: {resources: [{name: mig-1g.10gb+me, replicas: 2}]}}\n",
            "sharing.mps.resources[0].name",
            "'mig-1g.10gb+me' is not a valid resource name",
        ),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, devices: none}]}}\n",
            "sharing.timeSlicing.resources[0].devices",
            "got 'none'",
        ),
        (
            "sharing: {timeSlicing: {renameByDefault: 'yes', "
            "resources: [{name: gpu, replicas: 2}]}}\n",
            "sharing.timeSlicing.renameByDefault",
            "must be true or false",
        ),
    ],
)
def test_a_config_the_plugin_refuses_is_refused_naming_file_and_key(
    text: str, key: str, fragment: str
) -> None:
    with pytest.raises(InvalidConfig) as info:
        sharing_of(text)
    assert f"device plugin config dp.yaml: key '{key}'" in str(info.value)
    assert fragment in str(info.value)


def test_mps_refuses_mig_devices_and_the_mixed_strategy() -> None:
    mps = Sharing("mps", (SharedResource("nvidia.com/gpu", 2),), "dp.yaml")
    assert advertised_resources({0: None, 1: None}, "single", mps) == {"nvidia.com/gpu": 4}
    assert "MPS sharing (dp.yaml) does not work with the mixed" in strategy_problem(
        {0: None}, "mixed", mps
    )
    assert "does not support MIG devices, GPU(s) 1" in strategy_problem(
        {0: None, 1: Counter({"1g.10gb": 7})}, "single", mps
    )
    assert advertised_resources({0: Counter({"1g.10gb": 7})}, "single", mps) == {}


# -- 10: the strategy label ---------------------------------------------------------------------


LABEL = "nvidia.com/mig.strategy"


def test_the_node_label_wins_over_the_setting() -> None:
    assert node_mig_strategy({LABEL: "single"}, label=LABEL, fallback="mixed") == "single"
    assert node_mig_strategy({LABEL: "mixed"}, label=LABEL, fallback="single") == "mixed"
    assert node_mig_strategy({}, label=LABEL, fallback="single") == "single"
    assert node_mig_strategy({LABEL: "single"}, label="", fallback="mixed") == "mixed"


@pytest.mark.parametrize("value", ["Mixed", "none", ""])
def test_a_bad_strategy_label_is_an_error_naming_it(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        node_mig_strategy({LABEL: value}, label=LABEL, fallback="mixed")
    assert f"node label nvidia.com/mig.strategy={value!r} is not a MIG strategy" in str(info.value)


# -- the config the node's plugin runs with -----------------------------------------------------


DP_LABEL = "nvidia.com/device-plugin.config"


@pytest.fixture
def configmap(tmp_path: Path) -> Path:
    """A ConfigMap volume as the kubelet writes it: files link into a '..data' folder."""
    data = tmp_path / "..2026_01_01"
    data.mkdir()
    (data / "ts").write_text(CONFIG.format(rename="true"))
    (data / "plain").write_text("version: v1\n")
    (tmp_path / "..data").symlink_to(data.name)
    for name in ("ts", "plain"):
        (tmp_path / name).symlink_to(f"..data/{name}")
    return tmp_path


def test_the_node_label_selects_the_config_in_a_configmap_folder(configmap: Path) -> None:
    def sharing(labels: dict[str, str], default: str = "") -> Sharing:
        return device_plugin_sharing(str(configmap), labels, label=DP_LABEL, default=default)

    assert sharing({DP_LABEL: "ts"}).strategy == "time-slicing"
    assert sharing({DP_LABEL: "plain"}, default="ts").strategy == "none"
    assert sharing({}, default="ts").source == str(configmap / "ts")
    assert sharing({}) == NO_SHARING  # the Operator's config-manager: an empty config
    with pytest.raises(ConfigError) as info:
        sharing({DP_LABEL: "tss"})
    assert str(info.value) == (
        f"node label {DP_LABEL} names config 'tss', which {configmap} "
        f"does not have (it has: plain, ts)"
    )
    assert (
        device_plugin_sharing(
            str(configmap / "ts"), {DP_LABEL: "plain"}, label=DP_LABEL, default=""
        ).strategy
        == "time-slicing"
    )  # a file is the file
    assert device_plugin_sharing("", {DP_LABEL: "ts"}, label=DP_LABEL, default="") == NO_SHARING
