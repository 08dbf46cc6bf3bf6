"""We test end to end, on the local cluster with real agent processes and the simulated device
plugin, that the agent holds a node to what NVIDIA's device plugin would advertise (issue #11):

* a layout with compute-instance-split MIG devices fails under the mixed strategy, naming the
  strategy and the profile, with no GPU mutation and the node clean; under single it succeeds
  and the node advertises the devices as ``nvidia.com/gpu``;
* a DGX Station node, whose display GPU the plugin skips, succeeds;
* a time-sliced node (the plugin's config chosen by the node's ``nvidia.com/device-plugin.config``
  label from a ConfigMap-style folder) succeeds with the multiplied, renamed counts;
* the node's ``nvidia.com/mig.strategy`` label wins over the agent's setting, both ways; a bad
  value fails the pass naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from .conftest import REASON, AgentNode, NodeFactory, mig_counts

REPO = Path(__file__).resolve().parents[2]
STATION = REPO / "tests" / "data" / "compat" / "mig-parted-dgx-station-80gb-config.yaml"
DP_LABEL = "nvidia.com/gpu.deploy.device-plugin"
SPLIT = """version: v1
mig-configs:
  e2e-split-3g:
    - devices: all
      mig-enabled: true
      mig-devices: {"1c.3g.40gb": 3}
"""


def assert_clean(node: AgentNode) -> None:
    n = node.node()
    assert not n.spec.unschedulable
    assert (n.metadata.labels or {}).get(DP_LABEL) == "true"
    annotations = n.metadata.annotations or {}
    assert "mig-agent.dev/cordoned" not in annotations
    assert "mig-agent.dev/paused-operands" not in annotations


def relabel(node: AgentNode, labels: Mapping[str, str]) -> None:
    node.core.patch_node(node.name, {"metadata": {"labels": dict(labels)}})


def fails_untouched(node: AgentNode, labels: Mapping[str, str]) -> str:
    """Apply ``labels``; the pass must fail with no GPU mutation and the node clean; the reason."""
    relabel(node, labels)
    assert node.wait_state("failed", "success") == "failed", node.log_tail()
    assert mig_counts(node.sim_state).total == 0
    assert_clean(node)
    return str(node.node().metadata.annotations[REASON])


def test_mixed_strategy_refuses_a_split_ci_layout(
    agent_node: NodeFactory, extra_profiles: Callable[[str], Path]
) -> None:
    node = agent_node("2xH100-80GB", profiles=extra_profiles(SPLIT))
    reason = fails_untouched(node, {"nvidia.com/mig.config": "e2e-split-3g"})
    assert reason.startswith(
        "layout e2e-split-3g: the mixed MIG strategy's device plugin has no "
        "resource for MIG devices that split a GPU instance"
    )
    assert "(1c.3g.40gb on GPU(s) 0, 1)" in reason
    assert node.gpu_resources() == {"nvidia.com/gpu": 2}


def test_single_strategy_applies_a_split_ci_layout_as_nvidia_gpu(
    agent_node: NodeFactory, extra_profiles: Callable[[str], Path]
) -> None:
    node = agent_node(
        "2xH100-80GB",
        profiles=extra_profiles(SPLIT),
        settings={"MIG_AGENT_MIG_STRATEGY": "single"},
        plugin_args=["--mig-strategy", "single"],
    )
    node.label("e2e-split-3g")
    assert node.wait_state("success", "failed") == "success", node.log_tail()
    assert node.gpu_resources() == {"nvidia.com/gpu": 6}
    assert_clean(node)


def test_a_dgx_station_with_its_display_gpu_succeeds(
    agent_node: NodeFactory, extra_profiles: Callable[[str], Path]
) -> None:
    node = agent_node("4xA100-80GB,1xDGX-Display", profiles=extra_profiles(STATION.read_text()))
    node.label("all-1g.10gb-dgx-station-80")
    assert node.wait_state("success", "failed", timeout=90) == "success", node.log_tail()
    assert node.gpu_resources() == {"nvidia.com/mig-1g.10gb": 28}
    assert mig_counts(node.sim_state).gpus == {0, 1, 2, 3}
    assert_clean(node)


TIME_SLICING = """version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/mig-1g.10gb
      replicas: 4
"""


def test_a_time_sliced_node_succeeds_with_multiplied_renamed_counts(
    agent_node: NodeFactory, tmp_path: Path
) -> None:
    # the GPU Operator's plugin ConfigMap as a volume: one file per config name
    configs = tmp_path / "device-plugin-configs"
    configs.mkdir()
    (configs / "ts-1g").write_text(TIME_SLICING)
    (configs / "plain").write_text("version: v1\n")
    node = agent_node(
        "2xH100-80GB",
        settings={"MIG_AGENT_DEVICE_PLUGIN_CONFIG": str(configs)},
        plugin_args=["--config-file", str(configs / "ts-1g")],
    )
    relabel(
        node, {"nvidia.com/device-plugin.config": "ts-1g", "nvidia.com/mig.config": "all-1g.10gb"}
    )
    assert node.wait_state("success", "failed") == "success", node.log_tail()
    assert node.gpu_resources() == {"nvidia.com/mig-1g.10gb.shared": 56}
    assert_clean(node)


def test_a_single_strategy_label_refuses_a_mixed_profile_layout_despite_the_setting(
    agent_node: NodeFactory,
) -> None:
    node = agent_node("2xH100-80GB", settings={"MIG_AGENT_MIG_STRATEGY": "mixed"})
    reason = fails_untouched(
        node, {"nvidia.com/mig.strategy": "single", "nvidia.com/mig.config": "all-balanced"}
    )
    assert reason == (
        "layout all-balanced: the single MIG strategy needs one MIG profile on the "
        "whole node, the layout makes 1g.10gb, 2g.20gb, 3g.40gb; use the mixed "
        "strategy or a single-profile layout"
    )


def test_a_mixed_strategy_label_applies_a_mixed_profile_layout_despite_the_setting(
    agent_node: NodeFactory,
) -> None:
    node = agent_node("2xH100-80GB", settings={"MIG_AGENT_MIG_STRATEGY": "single"})
    relabel(node, {"nvidia.com/mig.strategy": "mixed", "nvidia.com/mig.config": "all-balanced"})
    assert node.wait_state("success", "failed") == "success", node.log_tail()
    assert node.gpu_resources() == {
        "nvidia.com/mig-1g.10gb": 4,
        "nvidia.com/mig-2g.20gb": 2,
        "nvidia.com/mig-3g.40gb": 2,
    }


def test_a_bad_strategy_label_fails_naming_it(agent_node: NodeFactory) -> None:
    node = agent_node("2xH100-80GB")
    reason = fails_untouched(
        node, {"nvidia.com/mig.strategy": "Single", "nvidia.com/mig.config": "all-1g.10gb"}
    )
    assert reason == (
        "node label nvidia.com/mig.strategy='Single' is not a MIG strategy: "
        "expected mixed or single"
    )
