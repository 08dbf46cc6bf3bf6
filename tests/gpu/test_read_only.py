"""We test the NVML adapter opened read-only, as ``mig-agent run --observe`` opens it:

* every entry point that changes a GPU (MIG mode, GPU reset by callback or by nvidia-smi, create
  and destroy of GPU and compute instances) is refused with ObserveOnlyRefused, and no mutating
  pynvml function (recorded here, every one pynvml has) nor nvidia-smi nor the reset is called:
  NVML reads the same before and after;
* reading (observe, models, MIG devices) works and changes nothing, also on a model the catalog
  does not know, whose CI profiles the writable adapter reads inside a GPU instance it makes;
* the adapter's source makes every mutating NVML call through its one door (``_mutate``), so no
  code path of it gets past the refusal.
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from migsim.gpus import GpuModel as SimModel
from migsim.nvml import library as simlib
from migsim.nvml import open_node
from migsim.nvml import state as simstate

import mig_agent.gpu.nvml as nvml_module
from mig_agent.config.profiles import load_catalog
from mig_agent.core.errors import ObserveOnlyRefused
from mig_agent.core.observed import NodeState
from mig_agent.core.placement import Placement
from mig_agent.gpu.nvml import MUTATING_NVML, NvmlGpuBackend, open_backend
from mig_agent.node.apply import apply_layout

from .conftest import MakeNode

PROFILES = Path(__file__).resolve().parents[2] / "profiles"
# what pynvml calls a function that changes something (its getters say Get, Is, Query)
_CHANGES = re.compile(r"^nvml\w*(Set|Create|Destroy|Reset|Clear|Register|Modify|Remove|Add)")


def _mutating_pynvml() -> list[str]:
    """Every function of pynvml that changes a GPU, and the adapter's list of its own."""
    named = {n for n in dir(pynvml) if _CHANGES.match(n) and callable(getattr(pynvml, n))}
    return sorted(named | MUTATING_NVML)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The mutating calls that reach pynvml or nvidia-smi, each recorded before it runs."""
    calls: list[str] = []
    for name in _mutating_pynvml():
        real = getattr(pynvml, name)

        def record(*args: Any, _name: str = name, _real: Any = real) -> Any:
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(pynvml, name, record)
    run = subprocess.run

    def record_run(argv: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(" ".join(map(str, argv)))
        return run(["true"], *args, **kwargs)

    monkeypatch.setattr(nvml_module.subprocess, "run", record_run)
    yield calls


@pytest.fixture
def partitioned(make_node: MakeNode) -> str:
    """A node of two H100s partitioned all-balanced (MIG on, GPU and compute instances)."""
    path = make_node("2xH100-80GB")
    layout = load_catalog([PROFILES]).get("all-balanced")
    with open_node(path) as writable:
        apply_layout(layout, writable)
    simstate.reset_call_counts(path)
    return path


def _open(path: str, *, resets: list[str], hardware_reset: bool = False) -> NvmlGpuBackend:
    lib = simlib.SimulatedNvmlLibrary(path)

    def reset(gpu: int) -> None:
        resets.append(f"reset {gpu}")
        lib.reset_gpu(gpu)

    return open_backend(lib, reset=None if hardware_reset else reset, read_only=True)


def _first_instance(state: NodeState) -> tuple[int, int, Placement, int]:
    """(GI id, GI profile id, its placement, one CI id) of GPU 0's first GPU instance."""
    gi = state.gpus[0].gpu_instances[0]
    return gi.id, gi.profile_id, gi.placement, gi.compute_instances[0].id


Change = Callable[[NvmlGpuBackend, NodeState], object]
CHANGES: dict[str, Change] = {
    "set MIG mode off": lambda b, s: b.set_mig_mode(0, enabled=False),
    "set MIG mode on": lambda b, s: b.set_mig_mode(1, enabled=True),
    "reset a GPU": lambda b, s: b.reset_gpu(0),
    "destroy a compute instance": lambda b, s: b.destroy_compute_instance(
        0, _first_instance(s)[0], _first_instance(s)[3]
    ),
    "destroy a GPU instance": lambda b, s: b.destroy_gpu_instance(0, _first_instance(s)[0]),
    "create a GPU instance": lambda b, s: b.create_gpu_instance(
        0, _first_instance(s)[1], _first_instance(s)[2]
    ),
    "create a compute instance": lambda b, s: b.create_compute_instance(
        0, _first_instance(s)[0], 0, Placement(0, 1)
    ),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_change_is_refused_before_any_mutating_call(
    change: str, partitioned: str, recorded: list[str]
) -> None:
    resets: list[str] = []
    backend = _open(partitioned, resets=resets)
    try:
        before = backend.observe()
        with pytest.raises(ObserveOnlyRefused, match="read-only"):
            CHANGES[change](backend, before)
        assert recorded == [] and resets == []
        assert backend.observe() == before
    finally:
        backend.close()
    assert simstate.call_counts(partitioned).total == 0


def test_a_hardware_reset_is_refused_before_nvidia_smi(
    partitioned: str, recorded: list[str]
) -> None:
    backend = _open(partitioned, resets=[], hardware_reset=True)
    try:
        with pytest.raises(ObserveOnlyRefused):
            backend.reset_gpu(0)
        assert recorded == []
        backend.observe()  # NVML still open: nothing let go of it for a reset
    finally:
        backend.close()


def test_the_recorder_sees_a_writable_backends_changes(
    partitioned: str, recorded: list[str]
) -> None:
    """The check above would see a change that got past: the same call on a writable
    backend is recorded."""
    with open_node(partitioned) as writable:
        gi_id = writable.observe().gpus[0].gpu_instances[0].id
        for ci in writable.observe().gpus[0].gpu_instances[0].compute_instances:
            writable.destroy_compute_instance(0, gi_id, ci.id)
        writable.destroy_gpu_instance(0, gi_id)
    assert "nvmlComputeInstanceDestroy" in recorded and "nvmlGpuInstanceDestroy" in recorded


def test_reads_work_and_change_nothing(partitioned: str, recorded: list[str]) -> None:
    backend = _open(partitioned, resets=[])
    try:
        state, models, devices = backend.observe(), backend.models(), backend.mig_devices()
        assert backend.read_only
        assert [len(g.gpu_instances) for g in state.gpus] == [4, 4]
        assert models[0].key == "H100-80GB" and len(devices) == 8
    finally:
        backend.close()
    assert recorded == [] and simstate.call_counts(partitioned).total == 0


def test_an_unknown_model_is_read_without_the_gpu_instance_made_for_the_read(
    unknown_model: SimModel, make_node: MakeNode, recorded: list[str]
) -> None:
    """The writable adapter makes a GPU instance to read an unknown model's CI profiles
    (tests/gpu/test_unknown_model.py); read-only, it reads the model without them."""
    path = make_node("TEST-X6", mig_enabled=True)
    backend = _open(path, resets=[])
    try:
        model = backend.models()[0]
    finally:
        backend.close()
    assert model.name == unknown_model.name and model.gi_profiles
    assert recorded == [] and simlib.load_node(path).gpus[0].gpu_instances == []


def _mutate_arguments(tree: ast.AST) -> set[int]:
    """ids of the nodes passed as the callable of a ``self._mutate(op, call, ...)``."""
    out = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "_mutate"
            and len(node.args) >= 2
        ):
            out.add(id(node.args[1]))
    return out


def test_every_mutating_nvml_call_of_the_adapter_goes_through_its_one_door() -> None:
    tree = ast.parse(Path(nvml_module.__file__).read_text())
    through_door = _mutate_arguments(tree)
    named = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "pynvml"
        and n.attr.startswith("nvml")
    ]
    around = [n.attr for n in named if n.attr in MUTATING_NVML and id(n) not in through_door]
    assert not around, f"mutating NVML calls made around _mutate: {around}"
    unlisted = sorted({n.attr for n in named if _CHANGES.match(n.attr)} - MUTATING_NVML)
    assert not unlisted, f"NVML calls that change a GPU, missing from MUTATING_NVML: {unlisted}"
    assert {n.attr for n in named} >= MUTATING_NVML  # the list names what the adapter calls
