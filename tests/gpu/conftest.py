"""Fixtures: a fresh simulated node in tmp_path, pynvml over its simulated library, the adapter."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pynvml
import pytest
from migsim.gpus import GpuModel, extra_models
from migsim.nvml import library as simlib
from migsim.nvml import open_node

from mig_agent.gpu.nvml import NvmlGpuBackend

CAPTURES = Path(__file__).resolve().parents[1] / "data" / "captures"
REPO = Path(__file__).resolve().parents[2]
TEST_GPUS = REPO / "tests" / "data" / "gpus"

MakeNode = Callable[..., str]


@pytest.fixture
def make_node(tmp_path: Path) -> MakeNode:
    """``make_node("2xA100-40GB,H200", passthrough=True)`` -> path of a new node state file."""
    counter = itertools.count()

    def make(gpus: str = "H200", **kwargs: Any) -> str:
        path = str(tmp_path / f"node{next(counter)}.json")
        simlib.create_node(path, gpus, **kwargs)
        return path

    return make


@pytest.fixture
def unknown_model() -> Iterator[GpuModel]:
    """The simulator's model of tests/data/gpus/test-x6.yaml (key TEST-X6), one no catalog
    knows, known to the simulator for the test: ``make_node("TEST-X6")``."""
    with extra_models(TEST_GPUS / "test-x6.yaml") as (model,):
        yield model


@pytest.fixture
def nvml_on() -> Iterator[Callable[[str], ModuleType]]:
    """``nvml_on(path)`` -> the pynvml module, initialised over the simulated library of path."""
    libs: list[simlib.SimulatedNvmlLibrary] = []

    def install(path: str) -> ModuleType:
        lib = simlib.SimulatedNvmlLibrary(path)
        pynvml.nvmlLib = lib
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml.nvmlInit()
        libs.append(lib)
        return pynvml

    yield install
    for lib in libs:
        pynvml.nvmlLib = lib
        pynvml._nvmlGetFunctionPointer_cache.clear()
        while lib._init_count:
            pynvml.nvmlShutdown()
    pynvml.nvmlLib = None
    pynvml._nvmlGetFunctionPointer_cache.clear()


@pytest.fixture
def open_sim() -> Iterator[Callable[[str], NvmlGpuBackend]]:
    """``open_sim(path)`` -> an NvmlGpuBackend over the simulated node, closed at teardown."""
    opened: list[NvmlGpuBackend] = []

    def open_(path: str) -> NvmlGpuBackend:
        backend = open_node(path)
        opened.append(backend)
        return backend

    yield open_
    for backend in reversed(opened):
        backend.close()
