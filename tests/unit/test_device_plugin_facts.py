"""We test these aspects of how the agent and the simulated device plugin follow what NVIDIA's
device plugin does (issue #11, items 7-10), with in-memory fakes for the agent and the simulated
NVML library for the simulated plugin:

* a layout with compute-instance-split MIG devices is refused under the mixed strategy before
  anything changes (failed, not retried, reason naming strategy and profile, GPUs untouched,
  node clean) and applied under single, where the node advertises them as ``nvidia.com/gpu``;
* a node with a display GPU reaches ``success``: the display GPU is not expected;
* a time-sliced node reaches ``success`` with the multiplied, renamed counts its plugin config
  (the ConfigMap entry the node label selects) says;
* the node's ``nvidia.com/mig.strategy`` label wins over the setting, both ways; a bad value
  fails the pass naming it;
* the simulated plugin refuses (advertises nothing, logs why) where the real one would, skips
  display GPUs and offers one device per replica under a sharing config.

The fake device plugin here advertises fixed numbers per test (what the real plugin would),
not the agent's own computation.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import structlog.testing
from migsim import device_plugin as sim_device_plugin
from migsim.nvml import open_node
from migsim.nvml import state as simstate

from mig_agent.agent import Agent, Outcome
from mig_agent.config.profiles import load_catalog, load_text
from mig_agent.config.settings import Settings
from mig_agent.core.advertised import NO_SHARING, SharedResource, Sharing
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.layout import Layout
from mig_agent.core.observed import NodeState
from mig_agent.gpu.nvml import NvmlGpuBackend
from mig_agent.node.apply import apply_layout
from mig_agent.node.waits import Clock
from tests.unit.fake_cluster import FakeCluster

from .fake_gpus import FakeGpus

REPO = Path(__file__).resolve().parents[2]
PROFILES = str(REPO / "profiles")
STATION = str(REPO / "tests" / "data" / "compat" / "mig-parted-dgx-station-80gb-config.yaml")
NODE = "gpu-node-0"
DP_NS, DP_SEL = "gpu-operator", {"app": "nvidia-device-plugin-daemonset"}
CONFIG, STATE, REASON = (
    "nvidia.com/mig.config",
    "nvidia.com/mig.config.state",
    "mig-agent.dev/reason",
)
DP_LABEL = "nvidia.com/gpu.deploy.device-plugin"
STRATEGY = "nvidia.com/mig.strategy"
H100, A100, DISPLAY = MODELS["H100-80GB"], MODELS["A100-80GB"], MODELS["DGX-Display"]

Advertised = Callable[[NodeState], Mapping[str, int]]


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def make(
    gpus: FakeGpus,
    advertised: Advertised,
    *,
    labels: Mapping[str, str] | None = None,
    **settings: object,
) -> tuple[Agent, FakeCluster]:
    """An agent on a node whose device plugin advertises ``advertised(GPUs)`` when it starts."""
    cluster = FakeCluster()
    cluster.add_node(
        NODE,
        {DP_LABEL: "true", **(labels or {})},
        {k: str(v) for k, v in advertised(gpus.observe()).items()},
    )

    def device_plugin(c: FakeCluster) -> None:  # the DaemonSet controller and the plugin
        node = c.nodes[NODE]
        dp = c.list_pods(
            node=NODE, namespace=DP_NS, label_selector="app=nvidia-device-plugin-daemonset"
        )
        if dp and node.labels.get(DP_LABEL) != "true":
            c.pods.pop(dp[0].ref)
            c.patch_node_resources(NODE, {k: 0 for k in node.gpu_resources()})
        elif not dp and node.labels.get(DP_LABEL) == "true":
            c.add_pod(
                DP_NS,
                "dp",
                NODE,
                labels=DP_SEL,
                owner="DaemonSet",
                node_selector={DP_LABEL: "true"},
            )
            c.patch_node_resources(
                NODE, {**{k: 0 for k in node.gpu_resources()}, **advertised(gpus.observe())}
            )

    cluster.on_change = device_plugin
    device_plugin(cluster)
    t = FakeTime()
    s = Settings(node_name=NODE, **{"config": PROFILES, **settings})  # type: ignore[arg-type]
    agent = Agent(
        s, cluster, gpus, lambda p: load_catalog([p]), clock=Clock(t.now, t.sleep, wall=t.now)
    )
    agent.reload_config()
    return agent, cluster


def apply(cluster: FakeCluster, agent: Agent, layout: str) -> Outcome:
    cluster.patch_node(NODE, labels={CONFIG: layout})
    return agent.reconcile_once().outcome


def assert_clean(cluster: FakeCluster) -> None:
    node = cluster.nodes[NODE]
    assert not node.unschedulable
    assert node.labels.get(DP_LABEL) == "true"
    assert not {"mig-agent.dev/cordoned", "mig-agent.dev/paused-operands"} & set(node.annotations)


def mig_on(state: NodeState) -> bool:
    return any(g.mig_current for g in state.gpus)


SPLIT = """version: v1
mig-configs:
  split-3g:
    - devices: all
      mig-enabled: true
      mig-devices: {"1c.3g.40gb": 3}
"""


@pytest.fixture
def split_profiles(tmp_path: Path) -> str:
    (tmp_path / "split.yaml").write_text(SPLIT)
    return str(tmp_path / "split.yaml")


# -- 7 ------------------------------------------------------------------------------------------


def test_mixed_strategy_refuses_split_ci_layouts_before_touching_anything(
    split_profiles: str,
) -> None:
    gpus = FakeGpus([H100, H100])
    # what the real plugin does with such devices: refuse to start, advertise nothing
    agent, cluster = make(
        gpus, lambda s: {} if mig_on(s) else {"nvidia.com/gpu": 2}, config=split_profiles
    )
    cluster.patch_node(NODE, labels={CONFIG: "split-3g"})
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s is None
    reason = cluster.nodes[NODE].annotations[REASON]
    assert reason.startswith(
        "layout split-3g: the mixed MIG strategy's device plugin has no "
        "resource for MIG devices that split a GPU instance"
    )
    assert "(1c.3g.40gb on GPU(s) 0, 1)" in reason
    assert not gpus.calls
    assert cluster.nodes[NODE].labels[STATE] == "failed"
    assert_clean(cluster)


def test_single_strategy_applies_split_ci_layouts_as_nvidia_gpu(split_profiles: str) -> None:
    gpus = FakeGpus([H100, H100])
    agent, cluster = make(
        gpus,
        lambda s: {"nvidia.com/gpu": 6 if mig_on(s) else 2},
        config=split_profiles,
        mig_strategy="single",
    )
    assert apply(cluster, agent, "split-3g") is Outcome.APPLIED
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert_clean(cluster)


# -- 8 ------------------------------------------------------------------------------------------


def test_a_node_with_a_display_gpu_succeeds() -> None:
    gpus = FakeGpus([A100] * 4 + [DISPLAY])
    # the plugin lists devices through go-nvlib, which skips "DGX Display" by name
    agent, cluster = make(
        gpus,
        lambda s: {"nvidia.com/mig-1g.10gb": 28} if mig_on(s) else {"nvidia.com/gpu": 4},
        config=STATION,
        device_plugin_timeout_s=5.0,
    )
    assert apply(cluster, agent, "all-1g.10gb-dgx-station-80") is Outcome.APPLIED
    assert cluster.nodes[NODE].labels[STATE] == "success"
    # nothing to do the next time, and the resources are held right
    assert agent.reconcile_once().outcome is Outcome.NOOP


# -- 9 ------------------------------------------------------------------------------------------


TIME_SLICING = """version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/mig-1g.10gb
      replicas: 4
"""


@pytest.fixture
def plugin_configmap(tmp_path: Path) -> Path:
    folder = tmp_path / "device-plugin-config"
    folder.mkdir()
    (folder / "ts-1g").write_text(TIME_SLICING)
    (folder / "plain").write_text("version: v1\n")
    return folder


def test_a_time_sliced_node_succeeds_with_the_multiplied_renamed_counts(
    plugin_configmap: Path,
) -> None:
    gpus = FakeGpus([H100, H100])
    agent, cluster = make(
        gpus,
        lambda s: {"nvidia.com/mig-1g.10gb.shared": 56} if mig_on(s) else {"nvidia.com/gpu": 2},
        device_plugin_timeout_s=5.0,
        labels={"nvidia.com/device-plugin.config": "ts-1g"},
        device_plugin_config=str(plugin_configmap),
    )
    assert apply(cluster, agent, "all-1g.10gb") is Outcome.APPLIED
    assert cluster.nodes[NODE].gpu_resources() == {"nvidia.com/mig-1g.10gb.shared": 56}
    assert agent.reconcile_once().outcome is Outcome.NOOP


def test_a_node_label_naming_a_missing_plugin_config_fails_naming_it(
    plugin_configmap: Path,
) -> None:
    gpus = FakeGpus([H100, H100])
    agent, cluster = make(
        gpus,
        lambda s: {"nvidia.com/gpu": 2},
        labels={"nvidia.com/device-plugin.config": "ts-2g"},
        device_plugin_config=str(plugin_configmap),
    )
    assert apply(cluster, agent, "all-1g.10gb") is Outcome.FAILED
    assert (
        "node label nvidia.com/device-plugin.config names config 'ts-2g'"
        in cluster.nodes[NODE].annotations[REASON]
    )
    assert not gpus.calls
    assert_clean(cluster)


# -- 10 -----------------------------------------------------------------------------------------


BALANCED = {"nvidia.com/mig-1g.10gb": 4, "nvidia.com/mig-2g.20gb": 2, "nvidia.com/mig-3g.40gb": 2}


def test_the_strategy_label_single_wins_over_the_mixed_setting() -> None:
    gpus = FakeGpus([H100, H100])
    agent, cluster = make(
        gpus, lambda s: {"nvidia.com/gpu": 2}, labels={STRATEGY: "single"}, mig_strategy="mixed"
    )
    assert apply(cluster, agent, "all-balanced") is Outcome.FAILED
    assert (
        "the single MIG strategy needs one MIG profile on the whole node"
        in cluster.nodes[NODE].annotations[REASON]
    )
    assert not gpus.calls
    assert_clean(cluster)


def test_the_strategy_label_mixed_wins_over_the_single_setting() -> None:
    gpus = FakeGpus([H100, H100])
    agent, cluster = make(
        gpus,
        lambda s: BALANCED if mig_on(s) else {"nvidia.com/gpu": 2},
        labels={STRATEGY: "mixed"},
        mig_strategy="single",
        device_plugin_timeout_s=5.0,
    )
    assert apply(cluster, agent, "all-balanced") is Outcome.APPLIED
    assert cluster.nodes[NODE].gpu_resources() == BALANCED


def test_a_bad_strategy_label_fails_the_pass_naming_it() -> None:
    gpus = FakeGpus([H100, H100])
    agent, cluster = make(gpus, lambda s: {"nvidia.com/gpu": 2}, labels={STRATEGY: "mixd"})
    assert apply(cluster, agent, "all-1g.10gb") is Outcome.FAILED
    assert cluster.nodes[NODE].annotations[REASON] == (
        "node label nvidia.com/mig.strategy='mixd' is not a MIG strategy: expected mixed or single"
    )
    assert not gpus.calls
    assert_clean(cluster)


# -- the simulated device plugin ----------------------------------------------------------------


@contextlib.contextmanager
def simulated(tmp_path: Path, spec: str, layout: Layout) -> Iterator[NvmlGpuBackend]:
    """A simulated node of ``spec`` GPUs with ``layout`` applied."""
    path = str(tmp_path / "gpu-state.json")
    simstate.create_node(path, gpus=spec, name=NODE)
    with open_node(path) as gpus:
        apply_layout(layout, gpus)
        yield gpus


def layout_of(text: str) -> Layout:
    [layout] = load_text(text, "t.yaml")
    return layout


def node_advertising(gpus: int) -> FakeCluster:
    cluster = FakeCluster()
    cluster.add_node(NODE, {}, {"nvidia.com/gpu": str(gpus)})
    return cluster


def test_the_simulated_plugin_refuses_split_ci_devices_in_mixed(tmp_path: Path) -> None:
    layout = layout_of(
        SPLIT + "    - devices: [1]\n      mig-enabled: false\n      mig-devices: {}\n"
    )
    with simulated(tmp_path, "2xH100-80GB", layout) as gpus:
        cluster = node_advertising(2)
        with structlog.testing.capture_logs() as logs:
            assert sim_device_plugin.advertise(cluster, NODE, gpus, "mixed") == {}
        assert cluster.nodes[NODE].gpu_resources() == {}  # not even GPU 1, left whole
        [refused] = [e for e in logs if e["event"] == "device_plugin.refused"]
        assert refused["strategy"] == "mixed" and "1c.3g.40gb" in refused["reason"]
        assert sim_device_plugin.offered_devices(gpus, "mixed") == ()


def test_the_simulated_plugin_offers_split_ci_devices_as_gpus_in_single(tmp_path: Path) -> None:
    with simulated(tmp_path, "2xH100-80GB", layout_of(SPLIT)) as gpus:
        cluster = node_advertising(2)
        assert sim_device_plugin.advertise(cluster, NODE, gpus, "single") == {"nvidia.com/gpu": 6}
        offered = sim_device_plugin.offered_devices(gpus, "single")
        assert [d.resource for d in offered] == ["nvidia.com/gpu"] * 6
        assert all(d.id.startswith("MIG-") for d in offered)


def test_the_simulated_plugin_skips_display_gpus(tmp_path: Path) -> None:
    layout = load_catalog([STATION]).get("all-1g.10gb-dgx-station-80")
    with simulated(tmp_path, "2xA100-80GB,1xDGX-Display", layout) as gpus:
        cluster = node_advertising(3)
        assert sim_device_plugin.advertise(cluster, NODE, gpus, "mixed") == {
            "nvidia.com/mig-1g.10gb": 14
        }
        assert cluster.nodes[NODE].gpu_resources() == {"nvidia.com/mig-1g.10gb": 14}
        assert all(d.gpu != 2 for d in sim_device_plugin.offered_devices(gpus, "mixed"))


def test_the_simulated_plugin_offers_one_device_per_replica(tmp_path: Path) -> None:
    layout = SPLIT.replace('"1c.3g.40gb": 3', '"1g.10gb": 2')
    ts = Sharing(
        "time-slicing",
        (SharedResource("nvidia.com/mig-1g.10gb", 3, "nvidia.com/mig-1g.10gb.shared"),),
    )
    with simulated(tmp_path, "1xH100-80GB", layout_of(layout)) as gpus:
        cluster = node_advertising(1)
        assert sim_device_plugin.advertise(cluster, NODE, gpus, "mixed", ts) == {
            "nvidia.com/mig-1g.10gb.shared": 6
        }
        # the stale whole-GPU count is withdrawn
        assert cluster.nodes[NODE].gpu_resources() == {"nvidia.com/mig-1g.10gb.shared": 6}
        offered = sim_device_plugin.offered_devices(gpus, "mixed", ts)
        assert Counter(d.resource for d in offered) == {"nvidia.com/mig-1g.10gb.shared": 6}
        uuids = sorted({d.id.split("::")[0] for d in offered})
        assert len(uuids) == 2
        assert sorted(d.id for d in offered) == sorted(f"{u}::{i}" for u in uuids for i in range(3))
        unshared = sim_device_plugin.offered_devices(gpus, "mixed", NO_SHARING)
        assert sorted(d.id for d in unshared) == uuids
