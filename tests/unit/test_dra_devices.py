"""What NVIDIA's DRA driver publishes for a node's GPUs, against a ResourceSlice as the driver
writes it (the shape tests/native/test_dra_driver.py reads from the real driver)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from mig_agent.core import dra_devices as dra


def _slice(node: str, *devices: tuple[str, str], driver: str = dra.DRIVER) -> dict[str, Any]:
    def device(i: int, kind: str, profile: str) -> dict[str, Any]:
        attributes: dict[str, Any] = {"type": {"string": kind}, "uuid": {"string": f"U-{i}"}}
        if profile:
            attributes["profile"] = {"string": profile}
        return {"name": f"gpu-{i}", "attributes": attributes}

    return {
        "spec": {
            "driver": driver,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "nodeName": node,
            "devices": [device(i, k, p) for i, (k, p) in enumerate(devices)],
        }
    }


def test_whole_gpus_and_mig_devices_by_kind() -> None:
    devices = {0: None, 1: Counter({"1g.10gb": 2, "3g.40gb": 1}), 2: Counter()}
    assert dra.expected_devices(devices) == Counter(
        {dra.GPU: 1, ("mig", "1g.10gb"): 2, ("mig", "3g.40gb"): 1}
    )  # GPU 2: MIG on with no device publishes nothing
    assert dra.split_problem(devices) == ""


def test_a_split_gpu_instance_publishes_nothing() -> None:
    problem = dra.split_problem({0: Counter({"1c.3g.40gb": 2}), 1: None})
    assert "1c.3g.40gb" in problem and "publish no device" in problem


def test_published_devices_count_only_the_drivers_slices_of_the_node() -> None:
    slices = [
        _slice("n1", ("mig", "1g.10gb"), ("mig", "1g.10gb"), ("mig", "2g.20gb+me")),
        _slice("n1", ("gpu", "")),
        _slice("n2", ("gpu", "")),  # another node's pool
        _slice("n1", ("gpu", ""), driver="other.example.com"),
    ]
    assert dra.published_devices(slices, "n1") == Counter(
        {("mig", "1g.10gb"): 2, ("mig", "2g.20gb+me"): 1, dra.GPU: 1}
    )


def test_the_difference_names_what_is_missing_and_what_is_extra() -> None:
    want = Counter({("mig", "1g.10gb"): 4, ("mig", "2g.20gb"): 2})
    got = Counter({("mig", "1g.10gb"): 3, dra.GPU: 2, ("mig", "2g.20gb"): 2})
    assert dra.difference(want, got) == "missing 1 x MIG 1g.10gb; extra 2 x whole GPU"
    assert dra.difference(want, Counter(want)) == ""


def test_dynamic_mig_is_on_only_when_the_last_word_says_true() -> None:
    assert dra.dynamic_mig(["DynamicMIG=true"])
    assert dra.dynamic_mig(["A=true, DynamicMIG=True"])
    assert not dra.dynamic_mig(["DynamicMIG=false"])
    assert not dra.dynamic_mig(["DynamicMIG=true", "DynamicMIG=false"])  # the flag after wins
    assert not dra.dynamic_mig(["", "PassthroughSupport=true", "NotDynamicMIG=true"])
    assert not dra.dynamic_mig([])


def _claim(namespace: str, pods: list[str], *results: tuple[str, str, str]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": namespace, "name": f"claim-{'-'.join(pods) or 'none'}"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"driver": d, "pool": p, "device": name, "request": "r"}
                        for d, p, name in results
                    ]
                }
            },
            "reservedFor": [{"resource": "pods", "name": pod, "uid": "u"} for pod in pods],
        },
    }


def test_claim_holders_name_the_uuids_of_the_nodes_devices_each_pod_holds() -> None:
    slices = [_slice("n1", ("mig", "1g.10gb"), ("mig", "2g.20gb")), _slice("n2", ("gpu", ""))]
    claims = [
        _claim("a", ["p1", "p2"], (dra.DRIVER, "n1", "gpu-0")),  # one claim, two pods
        _claim("a", ["p1"], (dra.DRIVER, "n1", "gpu-1")),
        _claim("b", ["p3"], (dra.DRIVER, "n2", "gpu-0")),  # another node's pool
        _claim("b", ["p4"], ("other.example.com", "n1", "gpu-1")),  # another driver
        _claim("b", [], (dra.DRIVER, "n1", "gpu-1")),  # allocated, reserved by no pod
        {"metadata": {"namespace": "c", "name": "pending"}, "spec": {}},  # not allocated
        _claim("c", ["p5"], (dra.DRIVER, "n1", "gone")),  # a device the slice no longer lists
    ]
    assert dra.claim_holders(claims, slices, "n1") == {
        ("a", "p1"): frozenset({"U-0", "U-1"}),
        ("a", "p2"): frozenset({"U-0"}),
        ("c", "p5"): frozenset({"n1/gone"}),
    }


def test_kinds_are_named_by_profile_or_gpu() -> None:
    kinds = Counter({("mig", "2g.20gb"): 2, dra.GPU: 1, ("mig", "1g.10gb+me"): 1})
    assert dra.named(kinds) == {"gpu": 1, "1g.10gb+me": 1, "2g.20gb": 2}


def test_slices_of_an_older_pool_generation_are_stale() -> None:
    old = _slice("n1", ("mig", "1g.10gb"), ("mig", "1g.10gb"))
    new = _slice("n1", ("gpu", ""))
    new["spec"]["pool"]["generation"] = 2
    assert dra.published_devices([old, new], "n1") == Counter({dra.GPU: 1})
    assert dra.published_devices([old], "n1") == Counter({("mig", "1g.10gb"): 2})


def test_a_node_publishes_while_any_slice_of_the_driver_names_its_pool() -> None:
    assert dra.publishes([_slice("n1", ("gpu", ""))], "n1")
    assert dra.publishes([_slice("n1")], "n1")  # a MIG-on GPU without devices: an empty slice
    assert not dra.publishes([_slice("n2", ("gpu", ""))], "n1")
    assert not dra.publishes([_slice("n1", ("gpu", ""), driver="other.example.com")], "n1")


def test_shared_counters_are_dynamic_migs() -> None:
    static = _slice("n1", ("mig", "1g.10gb"))
    assert not dra.partitionable([static], "n1")
    shared = _slice("n1", ("mig", "1g.10gb"))
    shared["spec"]["sharedCounters"] = [{"name": "gpu-0-counter-set", "counters": {}}]
    assert dra.partitionable([shared], "n1") and not dra.partitionable([shared], "n2")
    consuming = _slice("n1", ("mig", "1g.10gb"))
    consuming["spec"]["devices"][0]["consumesCounters"] = [{"counterSet": "gpu-0-counter-set"}]
    assert dra.partitionable([consuming], "n1")
