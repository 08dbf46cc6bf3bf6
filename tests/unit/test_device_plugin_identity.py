"""The device plugin's restart is proven by identity: after a change, the layout counts as
advertised only once the kubelet offers (PodResources GetAllocatableResources) the MIG devices
the GPUs hold now, not a registration read before they changed whose counts match by chance.

Before: a new Ready plugin pod and matching counts were enough (issue item 5, device-plugin
side); a plugin that re-registered the old devices passed as success over stale UUIDs.
"""

from __future__ import annotations

from collections.abc import Mapping

from mig_agent.core.advertised import device_uuids, stale_devices
from tests.unit.fake_gpus import FakeGpus

from .test_agent import REASON, STATE, label, make


def _offered(gpus: FakeGpus) -> dict[str, frozenset[str]]:
    """resource -> the MIG device UUIDs the GPUs hold now, as the plugin would register them."""
    out: dict[str, set[str]] = {}
    models = gpus.models()
    for gpu in gpus.observe().gpus:
        for gi in gpu.gpu_instances:
            profile = next(p for p in models[gpu.info.index].gi_profiles if p.id == gi.profile_id)
            name = f"nvidia.com/mig-{profile.name}"
            out.setdefault(name, set()).update(ci.uuid for ci in gi.compute_instances)
    return {k: frozenset(v) for k, v in out.items()}


def test_the_layout_counts_as_advertised_only_once_the_kubelet_offers_the_new_devices() -> None:
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome.name == "APPLIED"
    before = _offered(gpus)  # the 1g.10gb devices, registered by the plugin
    asked: list[Mapping[str, frozenset[str]]] = []

    def allocatable() -> Mapping[str, frozenset[str]]:
        # the plugin's first answers after the restart: a registration read before the change
        # (same resource name, old devices); then the GPUs' own
        offered = before if len(asked) < 3 else _offered(gpus)
        asked.append(offered)
        return offered

    agent.allocatable_devices = allocatable
    label(cluster, "all-balanced")
    result = agent.reconcile_once()
    assert result.outcome.name == "APPLIED", result
    assert cluster.nodes["gpu-node-0"].labels[STATE] == "success"
    assert len(asked) == 4  # three stale answers waited out, the fourth believed
    assert asked[-1] == _offered(gpus)


def test_a_registration_that_stays_stale_fails_the_change_naming_the_devices() -> None:
    agent, cluster, gpus = make(device_plugin_timeout_s=30)
    label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome.name == "APPLIED"
    before = _offered(gpus)
    agent.allocatable_devices = lambda: before
    label(cluster, "all-balanced")
    agent.reconcile_once()
    node = cluster.nodes["gpu-node-0"]
    assert node.labels[STATE] == "failed"
    reason = node.annotations[REASON]
    assert "registration is stale" in reason, reason
    assert "nvidia.com/mig-1g.10gb: MIG-" in reason, reason


def test_stale_devices_judges_the_layouts_resources_by_uuid_only() -> None:
    present = frozenset({"GPU-a", "MIG-new-1", "MIG-new-2"})
    want = {"nvidia.com/mig-1g.10gb": 2, "nvidia.com/gpu": 0}
    offered = {
        "nvidia.com/mig-1g.10gb": frozenset({"MIG-new-1", "MIG-old-9"}),
        "nvidia.com/mig-3g.40gb": frozenset({"MIG-old-3"}),  # dropped: lingers, not judged
        "nvidia.com/gpu": frozenset({"GPU-gone"}),  # no device wanted of it
    }
    assert stale_devices(offered, want, present) == {
        "nvidia.com/mig-1g.10gb": frozenset({"MIG-old-9"})
    }
    # ids of another strategy (DEVICE_ID_STRATEGY=index) are not judged
    assert stale_devices({"nvidia.com/mig-1g.10gb": frozenset({"0", "1"})}, want, present) == {}


def test_device_uuids_holds_the_gpus_and_their_mig_devices() -> None:
    agent, cluster, gpus = make()
    label(cluster, "all-1g.10gb")
    agent.reconcile_once()
    held = device_uuids(gpus.observe())
    assert {f"GPU-{i:08d}" for i in range(8)} <= held
    assert sum(1 for u in held if u.startswith("MIG-")) == 8 * 7
