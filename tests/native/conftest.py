"""Fixtures for the C face of the simulated NVML: the built libnvidia-ml.so.1 (scripts/sim-nvml),
a simulator server per node, and pynvml pointed at the C library, so that pynvml's real wrappers
run over C marshalling, a unix socket and the same SimulatedNvmlLibrary the Python face uses.

The fixtures keep the names of tests/gpu's (``nvml_on``, ``open_sim``, ``make_node``) so that
tests written for the Python face run unchanged over the C face (test_c_face.py imports them)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pynvml
import pytest
from migsim.nvml import abi
from migsim.nvml import state as st
from migsim.nvml.server import NvmlServer

from mig_agent.gpu.nvml import NvmlGpuBackend, open_backend
from tests.gpu.conftest import MakeNode, make_node

__all__ = ["MakeNode", "make_node"]

REPO = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/native/" in str(item.path).replace(os.sep, "/"):
            item.add_marker(pytest.mark.native)


@pytest.fixture(scope="session")
def native_dir() -> Path:
    """The folder of the built libnvidia-ml.so.1 and nvidia-smi (built once; needs gcc and
    NVML's header from Go)."""
    out = subprocess.run(
        [str(REPO / "scripts" / "sim-nvml"), "build"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, f"scripts/sim-nvml build failed:\n{out.stderr}"
    return Path(out.stdout.strip())


@pytest.fixture(scope="session")
def native_lib(native_dir: Path) -> str:
    """Path of the built libnvidia-ml.so.1."""
    return str(native_dir / "libnvidia-ml.so.1")


@pytest.fixture(scope="session")
def nvidia_smi(native_dir: Path) -> Path:
    """Path of the simulated nvidia-smi built beside the library."""
    return native_dir / "nvidia-smi"


class NodeServer:
    """A simulator server for one node, in a thread of the test process."""

    def __init__(self, state_file: str, socket_path: str) -> None:
        self.server = NvmlServer(state_file, socket_path)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def serve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """``serve(state_file)`` starts the node's server and points the C library at it."""
    servers: list[NodeServer] = []

    def start(state_file: str) -> str:
        sock = str(tmp_path / f"nvml{len(servers)}.sock")
        servers.append(NodeServer(state_file, sock))
        monkeypatch.setenv(abi.ENV_SOCKET, sock)
        return sock

    yield start
    for s in servers:
        s.stop()


def shut_down(lib: ctypes.CDLL) -> None:
    """nvmlShutdown until the C library is uninitialised (its connection closed)."""
    while lib.nvmlShutdown() == st.SUCCESS:
        pass


def _install(lib: ctypes.CDLL) -> None:
    pynvml.nvmlLib = lib
    pynvml._nvmlGetFunctionPointer_cache.clear()


@pytest.fixture
def c_lib(native_lib: str) -> Iterator[ctypes.CDLL]:
    """The C library itself (one per process: the dynamic linker loads it once)."""
    lib = ctypes.CDLL(native_lib)
    shut_down(lib)
    yield lib
    shut_down(lib)


@pytest.fixture
def nvml_on(
    c_lib: ctypes.CDLL, serve: Callable[[str], str]
) -> Iterator[Callable[[str], ModuleType]]:
    """``nvml_on(path)`` -> pynvml initialised over the C library serving node ``path``."""

    def install(path: str) -> ModuleType:
        serve(path)
        _install(c_lib)
        c_lib.state_file = path  # as SimulatedNvmlLibrary has it (tests read it)
        pynvml.nvmlInit()
        return pynvml

    yield install
    _install(c_lib)
    shut_down(c_lib)
    pynvml.nvmlLib = None
    pynvml._nvmlGetFunctionPointer_cache.clear()


@pytest.fixture
def open_sim(
    c_lib: ctypes.CDLL,
    serve: Callable[[str], str],
    nvidia_smi: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[[str], NvmlGpuBackend]]:
    """``open_sim(path)`` -> mig-agent's NVML backend over the C library serving node ``path``,
    as on a real node: GPU resets run ``nvidia-smi -r`` (the simulated one on PATH)."""
    opened: list[NvmlGpuBackend] = []
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").symlink_to(nvidia_smi)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def open_(path: str) -> NvmlGpuBackend:
        serve(path)
        monkeypatch.setenv(st.ENV_STATE, path)
        backend = open_backend(c_lib)
        opened.append(backend)
        return backend

    yield open_
    for backend in reversed(opened):
        backend.close()
    shut_down(c_lib)
    pynvml.nvmlLib = None
    pynvml._nvmlGetFunctionPointer_cache.clear()
