"""We test the agent's reconcile pass on a DRA node (NVIDIA's DRA kubelet plugin publishes the
GPUs in ResourceSlices; pods hold them by ResourceClaim), with in-memory fakes of our own
Cluster and GpuBackend interfaces; NVIDIA's real driver is in tests/e2e/test_dra.py:

* a change restarts the plugin and succeeds once the slice lists the layout's devices;
* a plugin that republishes the old devices, or never comes back, fails the pass naming what
  is missing and extra, the node uncordoned;
* only the pods whose claimed devices go are evicted;
* DynamicMIG, and NVIDIA's device plugin beside the DRA driver, are refused before anything is
  touched;
* with DRA off in the settings, the DRA plugin is left alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from mig_agent.agent import Agent, Outcome
from mig_agent.agent.advertisers import dra
from mig_agent.config.profiles import load_catalog
from mig_agent.config.settings import Settings
from mig_agent.core import dra_devices
from mig_agent.core.errors import KubeError
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.layout import (
    DeviceSelector,
    GpuLayout,
    Layout,
    LayoutCatalog,
    MigProfile,
    Rule,
)
from mig_agent.core.planner import observed_devices
from mig_agent.node.waits import Clock
from tests.unit.fake_cluster import FakeCluster

from .fake_gpus import FakeGpus
from .test_agent import DP_NS, DP_SEL, NODE, PROFILES, STATE, FakeTime, assert_clean

DRA_NS, DRA_APP = "gpu-operator", "nvidia-dra-driver-kubelet-plugin"
REASON = "mig-agent.dev/reason"


def slice_of(gpus: FakeGpus, generation: int) -> dict[str, Any]:
    """The node's ResourceSlice as NVIDIA's plugin writes it for the GPUs as they are."""
    devices: list[dict[str, Any]] = []
    for gpu in gpus.observe().gpus:
        uuid = {"string": gpu.info.uuid}
        if not gpu.mig_current:
            attrs = {"type": {"string": "gpu"}, "uuid": uuid}
            devices.append({"name": f"gpu-{gpu.info.index}", "attributes": attrs})
            continue
        names = sorted(observed_devices(gpus.models()[gpu.info.index], gpu).elements())
        cis = [ci for gi in gpu.gpu_instances for ci in gi.compute_instances]
        for n, (name, ci) in enumerate(zip(names, cis, strict=True)):
            attrs = {
                "type": {"string": "mig"},
                "profile": {"string": name},
                "uuid": {"string": ci.uuid},
                "parentUUID": uuid,
            }
            devices.append({"name": f"gpu-{gpu.info.index}-mig-{n}", "attributes": attrs})
    pool = {"name": NODE, "generation": generation, "resourceSliceCount": 1}
    spec = {"driver": dra_devices.DRIVER, "nodeName": NODE, "pool": pool, "devices": devices}
    return {"metadata": {"name": f"{NODE}-gpu.nvidia.com-{generation}"}, "spec": spec}


@dataclasses.dataclass
class FakeDraPlugin:
    """Plays the DaemonSet controller and NVIDIA's DRA kubelet plugin: a deleted pod is
    replaced at once, and the new one republishes the node's slice from the GPUs (unless
    ``republishes`` is off: it keeps the old devices; ``comes_back`` off: no new pod)."""

    gpus: FakeGpus
    feature_gates: tuple[str, ...] = ()
    republishes: bool = True
    comes_back: bool = True
    generation: int = 0
    started: int = 0

    def __call__(self, c: FakeCluster) -> None:
        pods = c.list_pods(node=NODE, namespace=DRA_NS, label_selector=f"app={DRA_APP}")
        if pods or (self.started and not self.comes_back):
            return
        ref = c.add_pod(DRA_NS, f"dra-{self.started}", NODE, labels={"app": DRA_APP}, owner="")
        c.pods[ref] = dataclasses.replace(
            c.pods[ref], owner_kinds=("DaemonSet",), feature_gates=self.feature_gates
        )
        self.started += 1
        if self.republishes or not c.slices:
            self.generation += 1
            c.slices = [slice_of(self.gpus, self.generation)]


def make_dra(
    *, device_plugin: bool = False, cluster: FakeCluster | None = None, **plugin: Any
) -> tuple[Agent, FakeCluster, FakeGpus, FakeDraPlugin]:
    gpus = FakeGpus([MODELS["H100-80GB"]] * 2)
    cluster = cluster or FakeCluster()
    cluster.add_node(NODE, {})
    if device_plugin:
        cluster.add_pod(DP_NS, "dp", NODE, labels=DP_SEL, owner="DaemonSet")
    dra = FakeDraPlugin(gpus, **plugin)
    cluster.on_change = dra
    dra(cluster)
    t = FakeTime()
    s = Settings(node_name=NODE, config=PROFILES, device_plugin_timeout_s=30.0)
    agent = Agent(
        s, cluster, gpus, lambda p: load_catalog([p]), clock=Clock(t.now, t.sleep, t.wait, t.now)
    )
    agent.reload_config()
    return agent, cluster, gpus, dra


def label(cluster: FakeCluster, layout: str) -> None:
    cluster.patch_node(NODE, labels={"nvidia.com/mig.config": layout})


def kinds(cluster: FakeCluster) -> dict[tuple[str, str], int]:
    return dict(dra_devices.published_devices(cluster.slices, NODE))


def test_a_change_restarts_the_plugin_and_succeeds_once_the_slice_follows() -> None:
    agent, cluster, gpus, dra = make_dra()
    assert kinds(cluster) == {dra_devices.GPU: 2}
    label(cluster, "all-balanced")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.nodes[NODE].labels[STATE] == "success"
    assert dra.started == 2  # the pod there before was deleted, its replacement republished
    assert kinds(cluster) == {("mig", "1g.10gb"): 4, ("mig", "2g.20gb"): 2, ("mig", "3g.40gb"): 2}
    assert_clean(cluster)
    label(cluster, "all-disabled")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert kinds(cluster) == {dra_devices.GPU: 2} and dra.started == 3
    # in place: nothing restarts again
    assert agent.reconcile_once().outcome is Outcome.NOOP and dra.started == 3


def test_a_plugin_that_keeps_the_old_devices_fails_the_pass_naming_them() -> None:
    agent, cluster, gpus, dra = make_dra(republishes=False)
    label(cluster, "all-balanced")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    node = cluster.nodes[NODE]
    assert node.labels[STATE] == "failed"
    reason = node.annotations[REASON]
    assert "missing 4 x MIG 1g.10gb, 2 x MIG 2g.20gb, 2 x MIG 3g.40gb" in reason, reason
    assert "extra 2 x whole GPU" in reason, reason
    # the GPUs changed under the plugin's listing: no pod is to land on devices that are gone
    assert node.unschedulable and "the node stays cordoned until NVIDIA's DRA plugin" in reason


def test_a_plugin_that_never_comes_back_fails_the_pass_saying_so() -> None:
    agent, cluster, gpus, dra = make_dra(comes_back=False)
    label(cluster, "all-balanced")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    reason = cluster.nodes[NODE].annotations[REASON]
    assert "no new DRA kubelet plugin pod" in reason, reason
    assert cluster.nodes[NODE].unschedulable and "the node stays cordoned until" in reason


def _claim(namespace: str, pod: str, device: str) -> dict[str, Any]:
    result = {"driver": dra_devices.DRIVER, "pool": NODE, "device": device, "request": "mig"}
    return {
        "metadata": {"namespace": namespace, "name": pod},
        "status": {
            "allocation": {"devices": {"results": [result]}},
            "reservedFor": [{"resource": "pods", "name": pod, "uid": pod}],
        },
    }


def _device_on(cluster: FakeCluster, gpu: int) -> str:
    return next(
        d["name"]
        for d in cluster.slices[0]["spec"]["devices"]
        if d["name"].startswith(f"gpu-{gpu}-mig-")
    )


def test_only_pods_whose_claimed_devices_go_are_evicted() -> None:
    agent, cluster, gpus, dra = make_dra()
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    # no GPU resource: a claim holds it
    kept = cluster.add_pod("work", "on-gpu0", NODE, claims=("on-gpu0",))
    goes = cluster.add_pod("work", "on-gpu1", NODE, claims=("on-gpu1",))
    cpu = cluster.add_pod("work", "web", NODE)
    cluster.claims = [
        _claim("work", "on-gpu0", _device_on(cluster, 0)),
        _claim("work", "on-gpu1", _device_on(cluster, 1)),
    ]
    _with_layout(agent, "gpu1-changes", {0: {"1g.10gb": 7}, 1: {"3g.40gb": 2}})
    gpus.calls.clear()
    label(cluster, "gpu1-changes")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.evicted == [goes]
    assert kept in cluster.pods and cpu in cluster.pods
    assert gpus.calls[0] == 0, "GPU 0 kept its layout: not touched"
    assert_clean(cluster)


def _with_layout(agent: Agent, name: str, gpus: dict[int, dict[str, int]]) -> None:
    """Adds layout ``name``: per GPU index, its MIG devices."""
    rules = tuple(
        Rule(
            DeviceSelector(frozenset({gpu})),
            GpuLayout.of(True, {MigProfile.parse(p): n for p, n in devices.items()}),
        )
        for gpu, devices in gpus.items()
    )
    agent.catalog = LayoutCatalog.of([*agent.catalog.layouts.values(), Layout(name, rules)])  # type: ignore[union-attr]


def _refused(agent: Agent, cluster: FakeCluster, gpus: FakeGpus) -> str:
    label(cluster, "all-balanced")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    node = cluster.nodes[NODE]
    assert node.labels[STATE] == "failed"
    assert sum(gpus.calls.values()) == 0, "a refused node's GPUs are not touched"
    assert not cluster.evicted and not node.unschedulable
    assert_clean(cluster)
    return node.annotations[REASON]


def test_dynamic_mig_is_refused_before_anything_is_touched() -> None:
    agent, cluster, gpus, dra = make_dra(feature_gates=("DynamicMIG=true",))
    cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1})
    reason = _refused(agent, cluster, gpus)
    assert "DynamicMIG" in reason and "nothing was touched" in reason, reason
    assert dra.started == 1, "the plugin was not restarted"


def test_the_device_plugin_beside_the_dra_driver_is_refused() -> None:
    agent, cluster, gpus, dra = make_dra(device_plugin=True)
    reason = _refused(agent, cluster, gpus)
    assert "device plugin" in reason and "DRA" in reason and "nothing was touched" in reason
    assert dra.started == 1


def test_a_split_gpu_instance_is_refused_on_a_dra_node() -> None:
    agent, cluster, gpus, dra = make_dra()
    _with_layout(agent, "split", {0: {"1c.3g.40gb": 3}})
    label(cluster, "split")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    reason = cluster.nodes[NODE].annotations[REASON]
    assert "refuses to start" in reason and "1c.3g.40gb" in reason, reason
    assert sum(gpus.calls.values()) == 0


def test_with_dra_off_the_dra_plugin_is_not_the_agents() -> None:
    """With DRA off, nothing the agent would restart advertises the GPUs here (no device
    plugin either): the change is refused, the DRA plugin untouched (issue 42 path 8)."""
    agent, cluster, gpus, dra = make_dra()
    agent.settings = dataclasses.replace(agent.settings, dra=False)
    label(cluster, "all-balanced")
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and "no device plugin pod" in result.error
    assert dra.started == 1, "the DRA plugin was restarted with DRA off"
    assert not gpus.calls
    assert kinds(cluster) == {dra_devices.GPU: 2}


def test_a_dra_node_whose_plugin_pod_is_away_is_still_a_dra_node() -> None:
    """Between the plugin pod's deletion and its replacement (an API server outage, a slow
    DaemonSet controller) the node's slice is all that says it is a DRA node: a pass then must
    not take the stale slice for the layout, nor drain as if no claim held a device. With no
    plugin pod to restart after it, a change is refused before anything is touched, and
    retried: it goes ahead once the pod is back."""
    agent, cluster, gpus, dra = make_dra()
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    dra.comes_back = False
    cluster.pods.pop(next(r for r in cluster.pods if r.namespace == DRA_NS))
    _with_layout(agent, "gpu1-changes", {0: {"1g.10gb": 7}, 1: {"3g.40gb": 2}})
    label(cluster, "gpu1-changes")
    holder = cluster.add_pod("work", "on-gpu1", NODE, claims=("on-gpu1",))
    cluster.claims = [_claim("work", "on-gpu1", _device_on(cluster, 1))]
    calls = sum(gpus.calls.values())
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s is not None
    reason = cluster.nodes[NODE].annotations[REASON]
    assert f"namespace {DRA_NS} with selector app={DRA_APP}" in reason, reason
    assert "nothing was touched" in reason
    assert not cluster.evicted and sum(gpus.calls.values()) == calls
    assert not cluster.nodes[NODE].unschedulable
    assert_clean(cluster)
    dra.comes_back = True  # its DaemonSet's pod again: the retry drains by claim, then applies
    dra(cluster)
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.evicted == [holder]


def test_slices_with_shared_counters_are_refused_as_dynamic_mig() -> None:
    """DynamicMIG said by the slices, where the pod's gates do not say it (a pod set up
    otherwise, or away)."""
    agent, cluster, gpus, dra = make_dra()
    cluster.slices[0]["spec"]["sharedCounters"] = [{"name": "gpu-0-counter-set"}]
    reason = _refused(agent, cluster, gpus)
    assert "DynamicMIG" in reason and "share counters" in reason, reason


class NoDraApi(FakeCluster):
    """An API server before Kubernetes 1.34, or one the agent may not read slices from."""

    status = 404

    def list_resource_slices(self, node: str = "") -> list[dict[str, Any]]:
        raise KubeError(f"list resourceslices: {self.status} nope", status=self.status)


def test_without_the_dra_api_a_node_is_a_device_plugin_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from .test_agent import make

    logs: list[dict[str, Any]] = []

    class Log:  # the module's logger (cached by structlog once used: capture_logs misses it)
        def info(self, event: str, **kw: Any) -> None:
            logs.append({"event": event, **kw})

    monkeypatch.setattr(dra, "log", Log())
    agent, cluster, gpus = make(cluster=NoDraApi())
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    # said plainly, not as an API error (before: nothing said)
    [said] = [e for e in logs if e["event"] == "dra.api_missing"]
    assert "no resource.k8s.io/v1" in said["reason"], said


def test_a_forbidden_slice_list_fails_the_pass_naming_it() -> None:
    from .test_agent import make

    forbidden = NoDraApi()
    forbidden.status = 403
    agent, cluster, gpus = make(cluster=forbidden)
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    assert "list resourceslices: 403" in cluster.nodes[NODE].annotations[REASON]
    assert sum(gpus.calls.values()) == 0


def _swapped_layouts(agent: Agent) -> None:
    """ "x" and "y": the same devices on the node, on the other GPU: the kinds' counts match."""
    seven = GpuLayout.of(True, {MigProfile.parse("1g.10gb"): 7})
    two = GpuLayout.of(True, {MigProfile.parse("3g.40gb"): 2})
    gpu0, gpu1 = DeviceSelector(frozenset({0})), DeviceSelector(frozenset({1}))
    x = Layout("x", (Rule(gpu0, seven), Rule(gpu1, two)))
    y = Layout("y", (Rule(gpu0, two), Rule(gpu1, seven)))
    assert agent.catalog is not None
    agent.catalog = LayoutCatalog.of([*agent.catalog.layouts.values(), x, y])


def test_a_stale_slice_whose_kinds_match_by_chance_is_no_success() -> None:
    """Between layouts of the same kinds a plugin that never republished leaves a slice that
    counts right: its UUIDs are the old devices' (before: success over devices that are gone)."""
    agent, cluster, gpus, dra = make_dra()
    _swapped_layouts(agent)
    label(cluster, "x")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    dra.republishes = False  # its new pod keeps the old slice
    label(cluster, "y")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    reason = cluster.nodes[NODE].annotations[REASON]
    assert "lists the layout's kinds" in reason and "a stale slice" in reason, reason
    assert cluster.nodes[NODE].unschedulable  # it lists devices that are gone
    dra.republishes = True
    assert agent.reconcile_once().outcome is Outcome.APPLIED  # the retry: a fresh slice
    assert_clean(cluster)


def _phases_observed(agent: Agent) -> set[str]:
    return {
        s.labels["phase"]
        for metric in agent.metrics.phase_seconds.collect()
        for s in metric.samples
        if s.name.endswith("_count") and s.value
    }


def test_dra_work_is_named_for_the_dra_plugin() -> None:
    """A DRA node's restart is the Event MIGDraPluginRestart and the phase dra_plugin, and its
    wait running out is DraPluginTimeout (before: the device plugin's names for all three)."""
    agent, cluster, gpus, dra = make_dra(comes_back=False)
    label(cluster, "all-balanced")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    reasons = [reason for _, reason, _, _ in cluster.events]
    assert "MIGDraPluginRestart" in reasons and "MIGDevicePluginRestart" not in reasons, reasons
    (condition,) = (c for c in cluster.nodes[NODE].conditions if c.type == "MIGConfigApplied")
    assert condition.reason == "DraPluginTimeout", condition
    phases = _phases_observed(agent)
    assert "dra_plugin" in phases and "device_plugin" not in phases, phases
