"""The simulated gpu-workload (sim/native/gpu_workload.c): a process that shows, by its pid, as a
compute process on the devices it sees while it runs, as a CUDA program does.

We test these aspects: with one MIG device of a MIG-enabled 2xH100-80GB visible, the workload's
pid is a compute process of exactly that MIG device in pynvml over the C library and in the
simulated nvidia-smi's Processes section, and is gone once it exits on SIGTERM and once it is
SIGKILLed; a whole GPU with MIG off is held itself; a whole GPU with MIG on is held through each
of its MIG devices; mig-agent refuses (GpuBusy naming the pid) to destroy the MIG device while the
workload runs, and goes ahead once it is gone; a server drops what clients of an earlier server
on its socket held, and starts before its node's state exists; nothing visible is an error, and
so are bad arguments."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from migsim.nvml import state as st
from migsim.nvml.visibility import ENV_VISIBLE_DIR

from mig_agent.config.profiles import load_catalog
from mig_agent.core.errors import GpuBusy
from mig_agent.gpu.nvml import NvmlGpuBackend
from mig_agent.node.apply import apply_layout

from .conftest import REPO, MakeNode
from .test_nvidia_smi import mig_node

NvmlOn = Callable[[str], ModuleType]
OpenSim = Callable[[str], NvmlGpuBackend]
Serve = Callable[[str], str]
Workload = Callable[..., "Running"]

OPERATOR = load_catalog(
    [REPO / "tests" / "data" / "compat" / "gpu-operator-default-mig-config.yaml"]
)
NO_INSTANCE = 0xFFFFFFFF


class Running:
    """A started gpu-workload and the devices it said it holds."""

    def __init__(self, proc: subprocess.Popen[str], held: list[str]) -> None:
        self.proc, self.held = proc, held

    @property
    def pid(self) -> int:
        return self.proc.pid


@pytest.fixture
def workload(native_dir: Path, tmp_path: Path) -> Iterator[Workload]:
    """``workload(*visible_uuids, *, holds=n, args=[...])`` starts gpu-workload seeing only those
    devices and waits for its ``n`` "holding" lines."""
    started: list[subprocess.Popen[str]] = []

    def start(*visible: str, holds: int = 1, args: tuple[str, ...] = ()) -> Running:
        folder = tmp_path / f"visible{len(started)}"
        folder.mkdir()
        for uuid in visible:
            (folder / uuid).touch()
        proc = subprocess.Popen(
            [str(native_dir / "gpu-workload"), "--seconds", "60", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, ENV_VISIBLE_DIR: str(folder)},
        )
        started.append(proc)
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(holds)]
        assert all(line.startswith("holding ") for line in lines), (lines, proc.stderr)
        return Running(proc, [line.split()[1] for line in lines])

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def pids_of(path: str) -> dict[tuple[int, int | None, int | None], list[int]]:
    """(GPU, GI, CI) -> pids of the node's processes, from its state."""
    out: dict[tuple[int, int | None, int | None], list[int]] = {}
    for g in st.load_node(path).gpus:
        for p in g.processes:
            out.setdefault((g.index, p.gi, p.ci), []).append(p.pid)
    return out


def eventually_no_processes(path: str) -> None:
    """The server drops a workload's processes when its connection closes, just after it exits."""
    deadline = time.monotonic() + 10
    while pids_of(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pids_of(path) == {}


def host_smi(nvidia_smi: Path, tmp_path: Path) -> list[str]:
    out = subprocess.run(
        [str(nvidia_smi)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, ENV_VISIBLE_DIR: str(tmp_path / "no-visible-dir")},
    )
    return out.stdout.splitlines()


def test_one_visible_mig_device_is_held_until_the_workload_ends(
    make_node: MakeNode, nvml_on: NvmlOn, workload: Workload, nvidia_smi: Path, tmp_path: Path
) -> None:
    path, nv = mig_node(make_node, nvml_on)
    parent = st.load_node(path).gpus[1]
    gi, ci = parent.mig_devices()[0]

    running = workload(ci.uuid, args=("--memory-mib", "512", "--name", "train.py"))
    assert running.held == [ci.uuid]
    assert pids_of(path) == {(1, gi.id, ci.id): [running.pid]}

    gpu1 = nv.nvmlDeviceGetHandleByIndex(1)
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(gpu1, 0)
    assert nv.nvmlDeviceGetUUID(mig) == ci.uuid
    (proc,) = nv.nvmlDeviceGetComputeRunningProcesses(mig)
    assert (proc.pid, proc.usedGpuMemory) == (running.pid, 512 << 20)
    assert (proc.gpuInstanceId, proc.computeInstanceId) == (gi.id, ci.id)
    assert nv.nvmlSystemGetProcessName(running.pid) == "train.py"
    other = nv.nvmlDeviceGetMigDeviceHandleByIndex(gpu1, 1)
    assert nv.nvmlDeviceGetComputeRunningProcesses(other) == []
    gpu0 = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetComputeRunningProcesses(gpu0) == []
    for i in range(2):
        m = nv.nvmlDeviceGetMigDeviceHandleByIndex(gpu0, i)
        assert nv.nvmlDeviceGetComputeRunningProcesses(m) == []

    lines = host_smi(nvidia_smi, tmp_path)
    start = lines.index("| Processes:" + " " * 78 + "|")
    assert lines[start + 4 : start + 6] == [
        f"|    1 {gi.id:>5} {ci.id:>4} {running.pid:>15}      C   train.py"
        "                                512MiB |",
        "+" + "-" * 89 + "+",
    ]

    running.proc.send_signal(signal.SIGTERM)
    assert running.proc.wait(timeout=10) == 0
    eventually_no_processes(path)
    assert nv.nvmlDeviceGetComputeRunningProcesses(mig) == []
    assert "No running processes found" in "\n".join(host_smi(nvidia_smi, tmp_path))

    killed = workload(ci.uuid)
    assert pids_of(path) == {(1, gi.id, ci.id): [killed.pid]}
    killed.proc.kill()
    assert killed.proc.wait(timeout=10) == -signal.SIGKILL
    eventually_no_processes(path)


def test_a_whole_gpu_with_mig_off_is_held_itself(
    make_node: MakeNode, nvml_on: NvmlOn, workload: Workload
) -> None:
    path = make_node("2xH100-80GB")
    nv = nvml_on(path)
    gpu = st.load_node(path).gpus[1]

    running = workload(gpu.uuid)
    assert running.held == [gpu.uuid]
    (proc,) = nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByIndex(1))
    assert (proc.pid, proc.usedGpuMemory) == (running.pid, 1024 << 20)
    assert (proc.gpuInstanceId, proc.computeInstanceId) == (NO_INSTANCE, NO_INSTANCE)
    assert nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByIndex(0)) == []
    assert nv.nvmlSystemGetProcessName(running.pid) == "gpu-workload"

    running.proc.send_signal(signal.SIGINT)
    assert running.proc.wait(timeout=10) == 0
    eventually_no_processes(path)


def test_a_whole_gpu_with_mig_on_is_held_through_each_of_its_mig_devices(
    make_node: MakeNode, nvml_on: NvmlOn, workload: Workload
) -> None:
    path, _ = mig_node(make_node, nvml_on)
    gpu = st.load_node(path).gpus[0]
    devices = gpu.mig_devices()

    running = workload(gpu.uuid, holds=len(devices))
    assert running.held == [ci.uuid for _, ci in devices]
    assert pids_of(path) == {(0, gi.id, ci.id): [running.pid] for gi, ci in devices}


def test_the_agent_refuses_to_destroy_a_held_mig_device(
    make_node: MakeNode, open_sim: OpenSim, workload: Workload
) -> None:
    path = make_node("2xH100-80GB", mig_enabled=True)
    gpus = open_sim(path)
    apply_layout(OPERATOR.get("all-1g.10gb"), gpus)
    gi, ci = st.load_node(path).gpus[1].mig_devices()[2]
    running = workload(ci.uuid)
    before = gpus.observe()

    with pytest.raises(GpuBusy, match=rf"GPU 1 .*{running.pid}") as refused:
        apply_layout(OPERATOR.get("all-7g.80gb"), gpus)
    assert refused.value.context["pids"] == [running.pid]
    assert gpus.observe() == before

    running.proc.send_signal(signal.SIGTERM)
    assert running.proc.wait(timeout=10) == 0
    eventually_no_processes(path)
    apply_layout(OPERATOR.get("all-7g.80gb"), gpus)
    assert all(len(g.gpu_instances) == 1 for g in gpus.observe().gpus)


def test_a_server_drops_what_clients_of_an_earlier_one_held(
    make_node: MakeNode, serve: Serve, tmp_path: Path
) -> None:
    path = make_node("2xH100-80GB")
    socket_path = str(tmp_path / "nvml0.sock")  # the one serve() starts next
    st.hold_devices(
        path, 4242, [(0, None, None)], used_memory_mib=1, name="x", held_via=socket_path
    )
    st.hold_devices(path, 4343, [(1, None, None)], used_memory_mib=1, name="y", held_via="other")
    st.add_process(path, 0, 777)
    assert serve(path) == socket_path
    assert pids_of(path) == {(0, None, None): [777], (1, None, None): [4343]}


def test_a_server_starts_before_its_node_exists(
    serve: Serve, c_lib: ctypes.CDLL, tmp_path: Path
) -> None:
    path = str(tmp_path / "not-yet.json")
    serve(path)  # the node's state is created later
    # no node yet: no driver, as on a host still booting; then the same server serves it
    assert c_lib.nvmlInit_v2() == st.DRIVER_NOT_LOADED
    st.create_node(path, "2xH100-80GB")
    assert c_lib.nvmlInit_v2() == st.SUCCESS
    count = ctypes.c_uint()
    assert c_lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == st.SUCCESS
    assert count.value == 2


def test_nothing_visible_or_a_bad_argument_is_an_error(
    make_node: MakeNode, serve: Serve, native_dir: Path, tmp_path: Path
) -> None:
    path = make_node("2xH100-80GB")
    serve(path)
    empty = tmp_path / "empty"
    empty.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(native_dir / "gpu-workload"), "--seconds", "0", *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            env={**os.environ, ENV_VISIBLE_DIR: str(empty)},
        )

    out = run()
    assert (out.returncode, out.stdout) == (1, "")
    assert "no GPU or MIG device is visible" in out.stderr
    assert run("--memory-mib", "lots").returncode == 2
    assert run("--frobnicate").returncode == 2
    assert pids_of(path) == {}
