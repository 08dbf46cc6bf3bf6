"""NvmlGpuBackend over the simulated NVML library: reading, changing, and error mapping."""

from __future__ import annotations

import ctypes.util
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest
from migsim.gpus import model as sim_model
from migsim.nvml import library as simlib
from migsim.nvml import open_node
from migsim.nvml.state import DRIVER_NOT_LOADED, INSUFFICIENT_RESOURCES, NOT_FOUND, UNKNOWN

from mig_agent.core.errors import GpuBusy, GpuError, GpuResetRequired, GpuUnavailable
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.observed import ComputeInstance, GpuProcess
from mig_agent.core.placement import Placement
from mig_agent.gpu.nvml import MigDevice, NvmlGpuBackend, open_backend
from tests.catalog_findings import FINDINGS

from .conftest import MakeNode

OpenSim = Callable[[str], NvmlGpuBackend]


# What NVML tells of a model; where the catalog and the simulator's data disagree on it, a finding.
# The memory total is checked apart, so that a finding on it does not hide the rest of the read.
_READ = ("identity", "gi_profiles")
_MEMORY = "memory_total_mib"


def _keys(aspects: tuple[str, ...]) -> list[Any]:
    return [
        pytest.param(
            k,
            marks=[
                pytest.mark.xfail(strict=True, reason=FINDINGS[k, a])
                for a in aspects
                if (k, a) in FINDINGS
            ],
        )
        for k in sorted(MODELS)
    ]


@pytest.mark.parametrize("key", _keys(_READ))
def test_models_from_hardware_equal_the_catalog(
    key: str, make_node: MakeNode, open_sim: OpenSim
) -> None:
    gpus = open_sim(make_node(key)).models()
    read = gpus[0]
    if not sim_model(key).pci_subsystem_ids:  # none in the references: the simulator reports 0
        read = dataclasses.replace(read, pci_subsystem_id=MODELS[key].pci_subsystem_id)
    # the memory total is test_memory_total_from_hardware_equals_the_catalog's
    read = dataclasses.replace(read, memory_total_mib=MODELS[key].memory_total_mib)
    assert read == MODELS[key]
    assert dict(read.gi_by_name) == dict(MODELS[key].gi_by_name)


@pytest.mark.parametrize("key", _keys((_MEMORY,)))
def test_memory_total_from_hardware_equals_the_catalog(
    key: str, make_node: MakeNode, open_sim: OpenSim
) -> None:
    read = open_sim(make_node(key)).models()[0]
    assert read.memory_total_mib == MODELS[key].memory_total_mib


def test_models_are_read_again_when_the_mig_mode_changes(
    make_node: MakeNode, open_sim: OpenSim
) -> None:
    path = make_node("H200")
    b = open_sim(path)
    before = b.models()
    simlib.inject_failure(path, UNKNOWN, function="nvmlDeviceGetGpuInstanceProfileInfoV")
    assert b.models() == before  # kept: no profile is read
    b.set_mig_mode(0, enabled=True)
    with pytest.raises(GpuError, match="read the MIG profiles of GPU 0: Unknown Error"):
        b.models()
    assert b.models() == before


def test_profiles_unanswered_while_mig_is_off_are_read_again(
    make_node: MakeNode, open_sim: OpenSim
) -> None:
    # A driver that answers NOT_SUPPORTED for GPU-instance profile info while MIG is off.
    path = make_node("H200,A100-40GB,DGX-Display", profile_info_needs_mig=True)
    complete = open_sim(make_node("H200,A100-40GB,DGX-Display")).models()  # a driver that answers
    b = open_sim(path)
    assert [m.gi_profiles for m in b.models().values()] == [(), (), ()]
    b.set_mig_mode(0, enabled=True)  # Hopper: at once
    b.set_mig_mode(1, enabled=True)  # Ampere: pending until the reset
    models = b.models()
    assert models[0] == complete[0]
    assert models[1].gi_profiles == ()
    b.reset_gpu(1)
    assert b.models() == complete
    b.set_mig_mode(0, enabled=False)
    assert b.models()[0] == complete[0]  # unanswered again: the complete read stands...
    simlib.inject_failure(path, UNKNOWN, function="nvmlDeviceGetGpuInstanceProfileInfoV", gpu=0)
    with pytest.raises(GpuError, match="read the MIG profiles of GPU 0"):
        b.models()  # ...yet is no reason to stop asking


def test_rtx_pro_6000_reads_and_places_on_its_grid(make_node: MakeNode, open_sim: OpenSim) -> None:
    # 4 memory slices on a 12-unit placement grid; the subsystem id device-filters can name
    b = open_sim(make_node("RTX-PRO-6000", mig_enabled=True))
    rtx = MODELS["RTX-PRO-6000"]
    model = b.models()[0]
    assert (model.memory_slices, model.placement_units) == (4, 12)
    assert b.observe().gpu(0).info.pci_subsystem_id == 0x204E10DE
    b.create_gpu_instance(0, rtx.gi_by_name["2g.48gb"].id, Placement(0, 6))
    b.create_gpu_instance(0, rtx.gi_by_name["1g.24gb-me"].id, Placement(9, 3))
    gis = b.observe().gpu(0).gpu_instances
    assert [(gi.profile_id, gi.placement) for gi in gis] == [
        (5, Placement(0, 6)),
        (67, Placement(9, 3)),
    ]


def test_observe_round_trip(make_node: MakeNode, open_sim: OpenSim) -> None:
    path = make_node("H200,A100-40GB,A30,DGX-Display", mig_enabled=True)
    b = open_sim(path)
    h200, a100 = MODELS["H200"], MODELS["A100-40GB"]
    three = h200.gi_by_name["3g.71gb"]
    g1 = b.create_gpu_instance(0, three.id, Placement(4, 4))
    assert b.create_compute_instance(0, g1, 0, Placement(2, 1)) == 0  # 1c.3g.71gb
    assert b.create_compute_instance(0, g1, 1, Placement(0, 2)) == 1  # 2c.3g.71gb
    rev2 = h200.gi_by_name["1g.35gb"]
    g2 = b.create_gpu_instance(0, rev2.id, Placement(2, 2))
    b.create_compute_instance(0, g2, 7, Placement(0, 1))  # the whole-GI REV1 CI
    g3 = b.create_gpu_instance(1, a100.gi_by_name["7g.40gb"].id, Placement(0, 8))
    b.create_compute_instance(1, g3, 4, Placement(0, 7))
    simlib.add_process(path, 0, 1234, gi=g1, ci=1, used_memory_mib=512)

    node = b.observe()
    assert [g.info.name for g in node.gpus] == [
        "NVIDIA H200",
        "NVIDIA A100-SXM4-40GB",
        "NVIDIA A30",
        "DGX Display",
    ]
    assert [g.info.pci_bus_id for g in node.gpus] == sorted(g.info.pci_bus_id for g in node.gpus)
    assert node.gpu(0).info.pci_device_id == 0x233510DE
    assert node.gpu(0).info.memory_total_mib == 143771
    assert [g.mig_capable for g in node.gpus] == [True, True, True, False]
    gpu0 = node.gpu(0)
    assert [(gi.id, gi.profile_id, gi.placement) for gi in gpu0.gpu_instances] == [
        (1, 9, Placement(4, 4)),
        (3, 15, Placement(2, 2)),
    ]
    cis = gpu0.gpu_instances[0].compute_instances
    assert [(c.id, c.profile_id, c.placement) for c in cis] == [
        (0, 0, Placement(2, 1)),
        (1, 1, Placement(0, 2)),
    ]
    assert all(c.uuid.startswith("MIG-") for c in cis)
    assert gpu0.processes == (GpuProcess(1234, g1, 1, 512),)
    assert gpu0.processes_on(g1) == gpu0.processes
    gpu1 = node.gpu(1)
    assert gpu1.gpu_instances[0].compute_instances == (
        ComputeInstance(0, 4, Placement(0, 7), gpu1.gpu_instances[0].compute_instances[0].uuid),
    )

    devices = b.mig_devices()
    by_uuid = {
        c.uuid: (g.index, gi.id, c.id)
        for g in node.gpus
        for gi in g.gpu_instances
        for c in gi.compute_instances
    }
    assert {d.uuid: (d.gpu, d.gi_id, d.ci_id) for d in devices} == by_uuid
    assert [d.name for d in devices] == ["1c.3g.71gb", "2c.3g.71gb", "1g.35gb", "7g.40gb"]
    assert devices[0] == MigDevice(0, 1, 0, cis[0].uuid, "1c.3g.71gb")

    # Reading is not mutating.
    simlib.reset_call_counts(path)
    b.observe(), b.models(), b.mig_devices()
    assert simlib.call_counts(path).total == 0


def test_destroy_and_errors(make_node: MakeNode, open_sim: OpenSim) -> None:
    path = make_node("H200", mig_enabled=True)
    b = open_sim(path)
    gi = b.create_gpu_instance(0, 9, Placement(4, 4))
    ci = b.create_compute_instance(0, gi, 2, Placement(0, 3))
    with pytest.raises(GpuError) as err:
        b.create_gpu_instance(0, 9, Placement(4, 4))
    assert str(err.value) == "create GPU instance 3g.71gb at 4:4 on GPU 0: Insufficient Resources"
    assert type(err.value) is GpuError
    assert err.value.context["nvml_code"] == INSUFFICIENT_RESOURCES
    with pytest.raises(
        GpuError,
        match=r"create compute instance 3g.71gb at 0:3 in GPU instance "
        r"1 on GPU 0: Insufficient Resources",
    ):
        b.create_compute_instance(0, gi, 2, Placement(0, 3))
    with pytest.raises(GpuError, match="Invalid Argument"):
        b.create_gpu_instance(0, 14, Placement(1, 2))
    with pytest.raises(GpuBusy, match="destroy GPU instance 1 on GPU 0: In use by another client"):
        b.destroy_gpu_instance(0, gi)
    simlib.add_process(path, 0, 7, gi=gi, ci=ci)
    with pytest.raises(GpuBusy):
        b.destroy_compute_instance(0, gi, ci)
    simlib.remove_process(path, 7)
    b.destroy_compute_instance(0, gi, ci)
    b.destroy_gpu_instance(0, gi)
    with pytest.raises(GpuError) as gone:
        b.destroy_gpu_instance(0, gi)
    assert gone.value.context["nvml_code"] == NOT_FOUND
    assert b.observe().gpu(0).gpu_instances == ()

    simlib.inject_failure(path, DRIVER_NOT_LOADED)
    with pytest.raises(GpuUnavailable):
        b.create_gpu_instance(0, 0, Placement(0, 8))


def test_mig_mode_and_reset(make_node: MakeNode, open_sim: OpenSim) -> None:
    path = make_node("H100-80GB,A100-80GB,A30,A100-40GB")
    simlib.set_reset_supported(path, False, gpu=3)
    b = open_sim(path)
    b.set_mig_mode(0, enabled=True)  # Hopper: at once
    b.set_mig_mode(1, enabled=True)  # Ampere: pending, not an error
    node = b.observe()
    assert (node.gpu(0).mig_current, node.gpu(0).mig_pending) == (True, True)
    assert (node.gpu(1).mig_current, node.gpu(1).mig_pending) == (False, True)
    assert node.gpu(1).mig_change_pending
    b.reset_gpu(1)
    assert b.observe().gpu(1).mig_current

    simlib.add_process(path, 2, 55)
    with pytest.raises(GpuBusy, match="set MIG mode on on GPU 2"):
        b.set_mig_mode(2, enabled=True)
    assert b.observe().gpu(2).mig_pending  # Ampere keeps the pending request
    with pytest.raises(GpuBusy, match="process"):
        b.reset_gpu(2)
    simlib.add_process(path, 0, 56)
    with pytest.raises(GpuBusy):
        b.set_mig_mode(0, enabled=False)  # Hopper refuses while busy
    assert b.observe().gpu(0).mig_current

    b.set_mig_mode(3, enabled=True)
    with pytest.raises(GpuResetRequired, match="reset GPU 3"):
        b.reset_gpu(3)
    assert b.observe().gpu(3).mig_change_pending

    b.create_gpu_instance(1, 0, Placement(0, 8))
    with pytest.raises(GpuBusy):
        b.set_mig_mode(1, enabled=False)


def test_open_backend_errors(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(GpuUnavailable, match="no simulated node"):
        open_node("/nonexistent/node.json")
    monkeypatch.delenv("MIG_AGENT_SIM_STATE", raising=False)
    with pytest.raises(GpuUnavailable, match="MIG_AGENT_SIM_STATE"):
        open_node()
    # Without an NVIDIA driver pynvml cannot load the library, unless the simulated one is in
    # this process already (tests/native loads it, and the dynamic linker then hands it out by
    # its soname): in a run of both suites that is not "no driver".
    loaded = "libnvidia-ml.so" in Path("/proc/self/maps").read_text()
    if ctypes.util.find_library("nvidia-ml") is None and not loaded:
        with pytest.raises(GpuUnavailable, match="--backend simulated"):
            open_backend()
        assert pynvml.nvmlLib is None


def test_env_state_close_and_two_nodes(
    make_node: MakeNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b_path = make_node("H200", mig_enabled=True), make_node("2xA30", mig_enabled=True)
    monkeypatch.setenv("MIG_AGENT_SIM_STATE", a)
    with open_node() as first, open_node(b_path) as second:
        first.create_gpu_instance(0, 0, Placement(0, 8))
        second.create_gpu_instance(1, 0, Placement(0, 4))
        assert len(first.observe().gpus) == 1  # each backend sees its own node
        assert [len(g.gpu_instances) for g in second.observe().gpus] == [0, 1]
        assert first.models()[0].key == "H200"
    assert pynvml.nvmlLib is None and not pynvml._nvmlGetFunctionPointer_cache
    with pytest.raises(GpuUnavailable, match="closed"):
        first.observe()
    first.close()  # closing twice is harmless
