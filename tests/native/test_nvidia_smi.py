"""The simulated nvidia-smi (sim/native/nvidia_smi.c) over the simulated libnvidia-ml.so.1, and
what a process given only some devices sees (migsim.nvml.visibility).

We test these aspects: the table of a simulated H200 with MIG off equals the real H200's
(tests/data/captures) but for the date; ``-L`` in the real tool's format, for GPUs and MIG
devices; the MIG devices section of a MIG-enabled node; GPU processes in the Processes section;
``-r`` (GPU reset) and its refusals; usage errors; the visible-devices folder: one MIG device
shows its parent GPU (renumbered from 0) with only that device, ``all`` shows everything, no
folder shows everything, and pynvml over the C library enumerates the same filtered view."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pynvml
import pytest
from migsim.nvml import state as st
from migsim.nvml.visibility import ENV_VISIBLE_DIR

from .conftest import MakeNode

CAPTURE = Path(__file__).resolve().parents[1] / "data" / "captures"
H200_TABLE = CAPTURE / "h200-nvidia-smi-2026-12-01.txt"  # the table, then `nvidia-smi -L`
# The captured H200's identity (smi-q GPU UUID, Bus Id), which the simulated one takes on.
H200_UUID = "GPU-45e29108-bb8d-f695-22a5-5c4c8e712da8"
H200_BUS_ID = "00000000:00:06.0"

Serve = Callable[[str], str]
NvmlOn = Callable[[str], ModuleType]
Smi = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def smi(nvidia_smi: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Smi:
    """``smi(*args)`` runs the simulated nvidia-smi against the served node, as the host (no
    visible-devices folder) unless the test points $MIG_AGENT_SIM_VISIBLE_DIR at one."""
    monkeypatch.setenv(ENV_VISIBLE_DIR, str(tmp_path / "no-visible-dir"))

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(nvidia_smi), *args], capture_output=True, text=True, timeout=60, check=False
        )

    return run


def visible_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *names: str) -> Path:
    folder = tmp_path / "visible"
    folder.mkdir()
    for name in names:
        (folder / name).touch()
    monkeypatch.setenv(ENV_VISIBLE_DIR, str(folder))
    return folder


def h200_as_captured(make_node: MakeNode) -> str:
    return make_node("H200", passthrough=True, uuids=[H200_UUID], bus_ids=[H200_BUS_ID])


def mig_node(make_node: MakeNode, nvml_on: NvmlOn) -> tuple[str, ModuleType]:
    """2xH100-80GB with MIG on: GPU 0 holds 3g.40gb and 1g.10gb, GPU 1 holds 2g.20gb and a
    1c.3g.40gb, all created through NVML (pynvml over the C library)."""
    path = make_node("2xH100-80GB", mig_enabled=True)
    nv = nvml_on(path)
    gi_1, gi_2, gi_3 = (
        pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE,
        pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE,
        pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE,
    )
    ci_1, ci_2, ci_3 = (
        pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
        pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
        pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
    )
    wanted = {0: [(gi_3, ci_3), (gi_1, ci_1)], 1: [(gi_2, ci_2), (gi_3, ci_1)]}
    for index, instances in wanted.items():
        h = nv.nvmlDeviceGetHandleByIndex(index)
        for gi_index, ci_index in instances:
            gi = nv.nvmlDeviceCreateGpuInstance(
                h, nv.nvmlDeviceGetGpuInstanceProfileInfo(h, gi_index).id
            )
            info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_index, 0)
            nv.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
    return path, nv


def mig_lines(path: str) -> dict[int, list[str]]:
    """GPU index -> the -L lines its MIG devices should give, from the node's state."""
    node = st.load_node(path)
    out: dict[int, list[str]] = {}
    for g in node.gpus:
        lines = []
        for i, (gi, ci) in enumerate(g.mig_devices()):
            gp = st.gi_profile(g, gi.profile_id)
            name = gp.ci_name(st.ci_profile(g, gi, ci.profile_id))
            lines.append(f"  MIG {name:<11} Device {i:>2}: (UUID: {ci.uuid})")
        out[g.index] = lines
    return out


# -- the table and -L --------------------------------------------------------------------------


def test_h200_table_equals_the_capture_but_the_date(
    make_node: MakeNode, serve: Serve, smi: Smi
) -> None:
    serve(h200_as_captured(make_node))
    captured = H200_TABLE.read_text().splitlines()
    table, listing = captured[:-1], captured[-1]

    out = smi()
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1:] == table[1:]
    # The date line as nvidia-smi writes it: ctime's fields, then seven spaces.
    date = r"[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}       "
    assert re.fullmatch(date, table[0])
    assert re.fullmatch(date, lines[0]), lines[0]

    out = smi("-L")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [listing]
    assert smi("--list-gpus").stdout == out.stdout


def test_list_gpus_names_each_gpu_by_its_simulated_uuid(
    make_node: MakeNode, serve: Serve, smi: Smi
) -> None:
    path = make_node("H200,A30")
    serve(path)
    node = st.load_node(path)
    assert smi("-L").stdout.splitlines() == [
        f"GPU {g.index}: {g.model.name} (UUID: {g.uuid})" for g in node.gpus
    ]


def test_mig_node_lists_its_mig_devices(make_node: MakeNode, nvml_on: NvmlOn, smi: Smi) -> None:
    path, _ = mig_node(make_node, nvml_on)
    node = st.load_node(path)
    expected = mig_lines(path)
    assert [line.split("Device")[0].split()[1] for line in expected[0] + expected[1]] == [
        "3g.40gb",
        "1g.10gb",
        "1c.3g.40gb",  # MIG devices go by GI id: the 3g GI is 1 (a half), the 2g GI 3 (a quarter)
        "2g.20gb",
    ]
    out = smi("-L")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {node.gpus[0].uuid})",
        *expected[0],
        f"GPU 1: NVIDIA H100 80GB HBM3 (UUID: {node.gpus[1].uuid})",
        *expected[1],
    ]


def test_mig_node_table_has_the_mig_devices_section(
    make_node: MakeNode, nvml_on: NvmlOn, smi: Smi
) -> None:
    path, _ = mig_node(make_node, nvml_on)
    out = smi()
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert all(len(line) == 91 for line in lines[1:] if line), "a line off the frame"
    mig_on = "|" + " " * 41 + "|" + " " * 24 + "|" + "Enabled".rjust(21) + " |"
    assert lines.count(mig_on) == 2
    start = lines.index("| MIG devices:" + " " * 76 + "|")
    rows = [line for line in lines[start:] if re.match(r"\|\s+\d+\s+\d+\s+\d+\s+\d+\s+\|", line)]
    node = st.load_node(path)
    want = []
    for g in node.gpus:
        for i, (gi, ci) in enumerate(g.mig_devices()):
            memory = st.gi_profile(g, gi.profile_id).memory_mib
            sms = st.ci_profile(g, gi, ci.profile_id).multiprocessors
            want.append((g.index, gi.id, ci.id, i, memory, sms))
    got = [
        tuple(int(x) for x in re.findall(r"\d+", r.split("|")[1]))
        + (int(re.findall(r"(\d+)MiB", r)[1]), int(r.split("|")[3].split()[0]))
        for r in rows
    ]
    assert got == want
    assert "No running processes found" in out.stdout


def test_gpu_processes_appear_in_the_processes_section(
    make_node: MakeNode, nvml_on: NvmlOn, smi: Smi
) -> None:
    path, _ = mig_node(make_node, nvml_on)
    gi, ci = st.load_node(path).gpus[1].mig_devices()[0]
    st.add_process(path, 1, 4242, gi=gi.id, ci=ci.id, used_memory_mib=512, name="python3")
    st.add_process(path, 0, 777, used_memory_mib=2048)  # no name NVML could report
    lines = smi().stdout.splitlines()
    start = lines.index("| Processes:" + " " * 78 + "|")
    assert lines[start + 4 : start + 7] == [
        "|    0   N/A  N/A             777      C   N/A"
        "                                    2048MiB |",
        f"|    1 {gi.id:>5} {ci.id:>4}            4242      C   python3"
        "                                 512MiB |",
        "+" + "-" * 89 + "+",
    ]
    assert "No running processes found" not in "\n".join(lines)


# -- -r and usage ------------------------------------------------------------------------------


def test_reset_makes_a_pending_mig_mode_current(
    make_node: MakeNode, nvml_on: NvmlOn, smi: Smi
) -> None:
    path = make_node("2xA100-40GB")
    nv = nvml_on(path)
    nv.nvmlDeviceSetMigMode(nv.nvmlDeviceGetHandleByIndex(1), 1)
    gpu = st.load_node(path).gpus[1]
    assert (gpu.mig_current, gpu.mig_pending) == (False, True)

    out = smi("-r", "-i", gpu.bus_id.lower().removeprefix("0000"))
    assert (out.returncode, out.stdout) == (0, f"GPU {gpu.bus_id} was successfully reset.\n")
    assert st.load_node(path).gpus[1].mig_current
    assert st.call_counts(path).by_gpu_function[1][st.RESET] == 1
    assert 0 not in st.call_counts(path).by_gpu_function


def test_reset_refusals(make_node: MakeNode, serve: Serve, smi: Smi) -> None:
    path = make_node("2xA100-40GB")
    serve(path)
    st.add_process(path, 0, 4242)
    busy = st.load_node(path).gpus[0]
    out = smi("--gpu-reset", "--id", busy.uuid)
    assert out.returncode == 255
    assert out.stderr.startswith(f"Unable to reset GPU {busy.bus_id}: ")
    assert "in use by process(es) 4242" in out.stderr

    out = smi("-r", "-i", "1,7")  # every id is looked up before any GPU is reset
    assert (out.returncode, out.stderr) == (6, "No devices were found matching 7\n")
    assert st.call_counts(path).by_gpu_function == {0: {st.RESET: 1}}  # the refused one


@pytest.mark.parametrize("args", [["-q"], ["-L", "-r"], ["-i", "0"], ["--id"], ["mig", "-lgi"]])
def test_anything_else_is_a_usage_error(
    make_node: MakeNode, serve: Serve, smi: Smi, args: list[str]
) -> None:
    serve(make_node("H200"))
    out = smi(*args)
    assert out.returncode == 2
    assert out.stdout == ""
    assert "usage: nvidia-smi" in out.stderr


# -- visibility --------------------------------------------------------------------------------


def test_one_visible_mig_device_shows_only_it_under_its_gpu(
    make_node: MakeNode,
    nvml_on: NvmlOn,
    smi: Smi,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, _ = mig_node(make_node, nvml_on)
    node = st.load_node(path)
    parent = node.gpus[1]
    gi, ci = parent.mig_devices()[0]  # the 1c.3g.40gb on GPU 1
    visible_dir(tmp_path, monkeypatch, ci.uuid, "GPU-not-on-this-node", ".hidden")

    out = smi("-L")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {parent.uuid})",
        f"  MIG 1c.3g.40gb  Device  0: (UUID: {ci.uuid})",
    ]
    table = smi().stdout
    assert table.count("NVIDIA H100 80GB HBM3") == 1
    assert re.search(rf"\|  0 {gi.id:>4} {ci.id:>3}   0  \|", table)
    assert len(re.findall(r"^\|\s+\d+\s+\d+\s+\d+\s+\d+\s+\|", table, re.M)) == 1


def test_a_visible_gpu_shows_all_its_mig_devices(
    make_node: MakeNode,
    nvml_on: NvmlOn,
    smi: Smi,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, _ = mig_node(make_node, nvml_on)
    gpu0 = st.load_node(path).gpus[0]
    visible_dir(tmp_path, monkeypatch, gpu0.uuid)
    assert smi("-L").stdout.splitlines() == [
        f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {gpu0.uuid})",
        *mig_lines(path)[0],
    ]


def test_all_or_no_folder_shows_everything(
    make_node: MakeNode,
    nvml_on: NvmlOn,
    smi: Smi,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, _ = mig_node(make_node, nvml_on)
    everything = smi("-L").stdout  # the fixture's folder does not exist: the host
    assert everything.count("GPU ") == 2 and everything.count("  MIG ") == 4
    visible_dir(tmp_path, monkeypatch, "all", st.load_node(path).gpus[0].uuid)
    assert smi("-L").stdout == everything


def test_an_empty_folder_shows_no_gpu(
    make_node: MakeNode, serve: Serve, smi: Smi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    serve(make_node("2xH200"))
    visible_dir(tmp_path, monkeypatch)
    out = smi("-L")
    assert (out.returncode, out.stdout) == (6, "No devices found.\n")


def test_pynvml_over_the_c_library_sees_the_filtered_view(
    make_node: MakeNode,
    nvml_on: NvmlOn,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, nv = mig_node(make_node, nvml_on)
    nv.nvmlShutdown()  # what a process sees is read when it connects
    node = st.load_node(path)
    hidden_gpu, parent = node.gpus
    gi, ci = parent.mig_devices()[1]
    visible_dir(tmp_path, monkeypatch, ci.uuid)
    nv.nvmlInit()
    os.environ.pop(ENV_VISIBLE_DIR)  # the connection keeps what it was told

    assert nv.nvmlDeviceGetCount() == 1
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetUUID(h) == parent.uuid
    assert nv.nvmlDeviceGetIndex(h) == 0
    assert nv.nvmlDeviceGetMinorNumber(h) == 1  # the device node it was given: /dev/nvidia1
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlDeviceGetHandleByUUID(hidden_gpu.uuid)
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlDeviceGetHandleByPciBusId(hidden_gpu.bus_id)
    assert nv.nvmlDeviceGetHandleByPciBusId(parent.bus_id) is not None

    assert nv.nvmlDeviceGetMaxMigDeviceCount(h) == parent.model.max_mig_devices  # an upper bound
    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    assert nv.nvmlDeviceGetUUID(mig) == ci.uuid
    assert nv.nvmlDeviceGetIndex(mig) == 0
    assert (nv.nvmlDeviceGetGpuInstanceId(mig), nv.nvmlDeviceGetComputeInstanceId(mig)) == (
        gi.id,
        ci.id,
    )
    for j in range(1, nv.nvmlDeviceGetMaxMigDeviceCount(h)):
        with pytest.raises(pynvml.NVMLError_NotFound):
            nv.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
    other = parent.mig_devices()[0][1].uuid
    with pytest.raises(pynvml.NVMLError_NotFound):
        nv.nvmlDeviceGetHandleByUUID(other)
    assert nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByUUID(ci.uuid)) == ci.uuid

    # Processes of the GPU: those of the MIG devices it was given only.
    st.add_process(path, 1, 4242, gi=gi.id, ci=ci.id)
    other_gi, other_ci = parent.mig_devices()[0]
    st.add_process(path, 1, 4343, gi=other_gi.id, ci=other_ci.id)
    assert [p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(h)] == [4242]
