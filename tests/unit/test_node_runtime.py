"""We test the node runtime's pure parts (migsim.node_runtime), with no process started:

* the node status patch writes capacity and allocatable as a kubelet does: changed values only,
  GPU resources no plugin lists removed, other resources untouched, nothing when nothing changed;
* NFD's labelling: features set, labels NFD set before and GFD no longer writes removed, labels
  set by others kept; the features file's comments and blank lines skipped;
* the devices the plugins list are offered in GPU, GI, CI, replica order, mapped to their place
  on the simulated GPUs; unhealthy or unknown ones (a stopped plugin's, after a repartition) are
  offered but never given out;
* the plugin DaemonSet pod is matched by an equality selector.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from migsim.device_plugin import Allocations
from migsim.node_runtime import (
    FEATURE_LABELS_ANNOTATION,
    _selected,
    label_patch,
    offered,
    read_features,
    status_patch,
)

from mig_agent.kube.cluster import PodRef, PodView


def pod(
    name: str, labels: dict[str, str] | None = None, requests: dict[str, int] | None = None
) -> PodView:
    return PodView(
        PodRef("ns", name, f"uid-{name}"),
        "n",
        "Running",
        True,
        False,
        labels or {},
        {},
        (),
        {},
        requests or {},
    )


def test_status_patch_sets_changed_values_and_removes_gpu_resources_no_plugin_lists() -> None:
    have = {
        "capacity": {"cpu": "64", "nvidia.com/gpu": "2", "nvidia.com/mig-1g.10gb": "7"},
        "allocatable": {"cpu": "64", "nvidia.com/gpu": "2", "nvidia.com/mig-1g.10gb": "7"},
    }
    patch = status_patch(
        have,
        {"nvidia.com/mig-1g.10gb": 7, "nvidia.com/mig-3g.40gb": 2},
        {"nvidia.com/mig-1g.10gb": 6, "nvidia.com/mig-3g.40gb": 2},
    )
    assert patch == {
        "status": {
            "capacity": {"nvidia.com/mig-3g.40gb": "2", "nvidia.com/gpu": None},
            "allocatable": {
                "nvidia.com/mig-1g.10gb": "6",
                "nvidia.com/mig-3g.40gb": "2",
                "nvidia.com/gpu": None,
            },
        }
    }
    same = {
        "capacity": {"cpu": "64", "nvidia.com/gpu": "2"},
        "allocatable": {"cpu": "64", "nvidia.com/gpu": "0"},
    }
    assert status_patch(same, {"nvidia.com/gpu": 2}, {"nvidia.com/gpu": 0}) is None


def test_nfd_labelling_sets_features_and_removes_only_its_own_stale_labels(tmp_path: Path) -> None:
    path = tmp_path / "gfd"
    assert read_features(path) is None
    path.write_text("# GFD\n\nnvidia.com/gpu.count=14\nnvidia.com/mig.strategy=single\n")
    features = read_features(path)
    assert features == {"nvidia.com/gpu.count": "14", "nvidia.com/mig.strategy": "single"}
    labels = {
        "nvidia.com/gpu.count": "2",
        "nvidia.com/mig-1g.10gb.count": "7",
        "nvidia.com/gpu.deploy.device-plugin": "true",
        "nvidia.com/mig.strategy": "single",
    }
    annotations = {FEATURE_LABELS_ANNOTATION: "nvidia.com/gpu.count,nvidia.com/mig-1g.10gb.count"}
    changes, owned = label_patch(labels, annotations, features)
    assert changes == {"nvidia.com/gpu.count": "14", "nvidia.com/mig-1g.10gb.count": None}
    assert owned == "nvidia.com/gpu.count,nvidia.com/mig.strategy"


def test_listed_devices_are_offered_in_place_order_and_stale_ones_never_given_out() -> None:
    places = {"GPU-a": (0, -1, -1), "MIG-b": (1, 2, 0), "MIG-c": (1, 1, 0)}
    listed = {
        "nvidia.com/mig-1g.10gb.shared": {
            "MIG-b::1": "Healthy",
            "MIG-b::0": "Healthy",
            "MIG-c::0": "Unhealthy",
        },
        "nvidia.com/gpu": {"GPU-a": "Healthy", "GPU-gone": "Healthy"},
    }
    devices = offered(listed, places)
    assert [d.id for d in devices] == ["GPU-gone", "GPU-a", "MIG-c::0", "MIG-b::0", "MIG-b::1"]
    assert [d.healthy for d in devices] == [False, True, False, True, True]
    assert (devices[3].gpu, devices[3].gi_id, devices[3].ci_id) == (1, 2, 0)
    table = Allocations()
    table.offer(devices)
    result = table.sync(
        [
            pod("a", requests={"nvidia.com/mig-1g.10gb.shared": 2}),
            pod("b", requests={"nvidia.com/gpu": 2}),
        ]
    )
    assert [d.id for d in result.allocated[PodRef("ns", "a", "uid-a")]] == ["MIG-b::0", "MIG-b::1"]
    assert PodRef("ns", "b", "uid-b") in result.waiting  # one healthy GPU only


def test_the_plugin_pod_is_matched_by_an_equality_selector() -> None:
    dp = pod("dp", {"app": "nvidia-device-plugin-daemonset", "tier": "x"})
    assert _selected(dp, "app=nvidia-device-plugin-daemonset")
    assert _selected(dp, "app==nvidia-device-plugin-daemonset, tier=x")
    assert not _selected(dp, "app=nvidia-device-plugin-daemonset,tier=y")
    assert not _selected(pod("other"), "app=nvidia-device-plugin-daemonset")


def test_a_reregistered_plugin_keeps_the_old_devices_unhealthy_until_it_lists_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before: between a new plugin's registration and its first ListAndWatch answer the
    resource had no devices at all, so the node runtime took the running pods' devices away for
    good (a CI run: the pod's process then held a device no pod held, and every later pass was
    refused). The kubelet keeps the old endpoint's devices until the new list arrives."""
    from migsim import kubelet

    monkeypatch.setattr(kubelet.threading, "Thread", _NoThread)
    manager = kubelet.DeviceManager(str(tmp_path))
    request = kubelet.MESSAGES["RegisterRequest"](
        version=kubelet.VERSION, endpoint="gpu.sock", resource_name="nvidia.com/gpu"
    )
    manager._register(request, None)
    manager.plugins["nvidia.com/gpu"].devices = {"GPU-a": kubelet.HEALTHY, "GPU-b": kubelet.HEALTHY}
    manager._register(request, None)  # the plugin restarted: registered, nothing listed yet
    assert manager.devices() == {
        "nvidia.com/gpu": {"GPU-a": kubelet.UNHEALTHY, "GPU-b": kubelet.UNHEALTHY}
    }
    assert manager.capacity() == {"nvidia.com/gpu": 2}
    assert manager.allocatable() == {"nvidia.com/gpu": 0}
    manager.plugins["nvidia.com/gpu"].devices = {"GPU-a": kubelet.HEALTHY}  # its own list
    assert manager.devices() == {"nvidia.com/gpu": {"GPU-a": kubelet.HEALTHY}}


class _NoThread:
    """Stands in for the ListAndWatch thread: the test plays the plugin's answers itself."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def start(self) -> None:
        pass
