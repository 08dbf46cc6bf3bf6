"""We test these aspects of verify's pure judgements (mig_agent.core.device_listing): reading
``nvidia-smi -L``, what the node's allocatable must hold by its published GPUs, and whether a
pod given one device saw exactly that device, one the node published."""

from __future__ import annotations

import json

import pytest

from mig_agent.core.device_listing import (
    Listed,
    age_text,
    allocatable_problem,
    listing_problem,
    parse_listing,
    published_devices,
    wants_mig,
)
from mig_agent.core.gpu_models import GpuModel, model
from mig_agent.core.observed import ComputeInstance, GpuInfo, GpuInstance, GpuState, NodeState
from mig_agent.core.placement import Placement
from mig_agent.core.snapshot import compact, from_json

H100 = model("H100-80GB")
GPU0, GPU1 = "GPU-aaaaaaaa-0000", "GPU-bbbbbbbb-1111"
MIG0 = "MIG-11111111-aaaa"
MIG1 = "MIG-22222222-bbbb"


def _node() -> tuple[NodeState, dict[int, GpuModel]]:
    """GPU 0: MIG on, two 1g.10gb; GPU 1: MIG off."""
    resolved = H100.resolve("1g.10gb")
    assert resolved is not None
    gi, ci = resolved
    instances = tuple(
        GpuInstance(
            i + 1, gi.id, Placement(i, 1), (ComputeInstance(0, ci.id, Placement(0, 1), uuid),)
        )
        for i, uuid in enumerate((MIG0, MIG1))
    )
    gpus = (
        GpuState(
            GpuInfo(0, H100.name, GPU0, "0000:01:00.0", H100.pci_device_id, 0, 81559),
            True,
            True,
            True,
            instances,
        ),
        GpuState(GpuInfo(1, H100.name, GPU1, "0000:02:00.0", H100.pci_device_id, 0, 81559), True),
    )
    return NodeState(gpus), {0: H100, 1: H100}


def _listing(*lines: str) -> str:
    return "\n".join(lines) + "\n"


GPU0_LINE = f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {GPU0})"
GPU1_LINE = f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {GPU1})"
MIG0_LINE = f"  MIG 1g.10gb     Device  0: (UUID: {MIG0})"


def test_nvidia_smi_lines_are_read_and_other_lines_ignored() -> None:
    text = _listing("No devices found? no:", GPU0_LINE, MIG0_LINE, "")
    assert parse_listing(text) == [
        Listed(False, "NVIDIA H100 80GB HBM3", GPU0),
        Listed(True, "1g.10gb", MIG0),
    ]
    assert parse_listing("Failed to initialize NVML: Unknown Error\n") == []


def test_the_published_devices_carry_their_uuids_through_the_nodes_annotation() -> None:
    node, models = _node()
    back, back_models = from_json(json.loads(compact(node, models)))
    devices = published_devices(back, back_models)
    assert set(devices) == {GPU0, GPU1, MIG0, MIG1}
    assert devices[MIG1].profile == "1g.10gb" and devices[MIG1].gpu_uuid == GPU0
    assert devices[GPU0].mig_enabled and not devices[GPU1].mig_enabled


def test_a_mig_pod_that_saw_its_one_mig_device_passes() -> None:
    node, models = _node()
    pub = published_devices(node, models)
    log = _listing(GPU0_LINE, MIG0_LINE)
    assert listing_problem("nvidia.com/mig-1g.10gb", "mixed", log, node, pub) == ""
    # an agent that published no UUIDs: the kind is still checked
    assert listing_problem("nvidia.com/mig-1g.10gb", "mixed", log, node, {}) == ""
    assert "2g.20gb" in listing_problem("nvidia.com/mig-2g.20gb", "mixed", log, node, {})


@pytest.mark.parametrize(
    ("lines", "words"),
    [
        ((GPU0_LINE,), "saw 0 MIG device(s), expected 1"),
        ((GPU0_LINE, MIG0_LINE, MIG0_LINE.replace(MIG0, MIG1)), "saw 2 MIG device(s)"),
        ((GPU0_LINE, MIG0_LINE.replace(MIG0, "MIG-99999999-cccc")), "is not one the node's"),
        ((GPU0_LINE, MIG0_LINE.replace("1g.10gb", "2g.20gb")), "was given a 2g.20gb"),
        ((GPU1_LINE, MIG0_LINE), f"expected only {GPU0}"),
    ],
)
def test_a_mig_pod_that_saw_something_else_fails_naming_it(
    lines: tuple[str, ...], words: str
) -> None:
    node, models = _node()
    problem = listing_problem(
        "nvidia.com/mig-1g.10gb", "mixed", _listing(*lines), node, published_devices(node, models)
    )
    assert words in problem, problem


def test_a_whole_gpu_pod_must_see_one_gpu_with_mig_off() -> None:
    node, models = _node()
    pub = published_devices(node, models)
    assert listing_problem("nvidia.com/gpu", "mixed", _listing(GPU1_LINE), node, pub) == ""
    on = listing_problem("nvidia.com/gpu", "mixed", _listing(GPU0_LINE), node, pub)
    assert "MIG is on there" in on, on
    two = listing_problem("nvidia.com/gpu", "mixed", _listing(GPU0_LINE, GPU1_LINE), node, pub)
    assert "expected exactly one whole GPU" in two, two
    none = listing_problem("nvidia.com/gpu", "mixed", "", node, pub)
    assert "saw nothing" in none, none


def test_under_the_single_strategy_nvidia_com_gpu_is_a_mig_device_where_mig_is_on() -> None:
    node, models = _node()
    assert wants_mig("nvidia.com/gpu", "single", node)
    assert not wants_mig("nvidia.com/gpu", "mixed", node)
    assert wants_mig("nvidia.com/mig-1g.10gb.shared", "mixed", node)
    log = _listing(GPU0_LINE, MIG0_LINE)
    pub = published_devices(node, models)
    assert listing_problem("nvidia.com/gpu", "single", log, node, pub) == ""


def test_allocatable_must_hold_what_the_gpus_make_and_nothing_else() -> None:
    expected = {"nvidia.com/mig-1g.10gb": 14}
    assert allocatable_problem(expected, {"nvidia.com/mig-1g.10gb": 14}) == ""
    lacking = allocatable_problem(expected, {})
    assert "allocatable lacks nvidia.com/mig-1g.10gb: 0 of 14" in lacking, lacking
    stale = allocatable_problem(expected, {"nvidia.com/mig-1g.10gb": 14, "nvidia.com/gpu": 2})
    assert "do not make: {nvidia.com/gpu: 2}" in stale, stale
    # time-sliced: the shared resource stands in for the device's own
    assert allocatable_problem(expected, {"nvidia.com/mig-1g.10gb.shared": 56}) == ""


def test_ages_read_as_an_operator_says_them() -> None:
    assert [age_text(s) for s in (-3, 42, 600, 3 * 3600, 5 * 86400)] == [
        "0 s",
        "42 s",
        "10 min",
        "3 h",
        "5 d",
    ]
