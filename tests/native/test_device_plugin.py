"""NVIDIA's nvidia-device-plugin and gpu-feature-discovery (built from the pinned upstream source
by scripts/nvidia-binaries) on simulated nodes laid out by mig-agent, through
scripts/with-sim-gpus --host-view (the simulated libnvidia-ml.so.1; /proc/driver/nvidia-caps/
mig-minors, /sys/bus/pci/devices and an empty /var/lib/kubelet/device-plugins of the node), with
the simulated kubelet device manager (migsim.kubelet) on the kubelet's registration socket.

We test these aspects: under each MIG strategy the real plugin registers exactly the resources,
with exactly the device counts, that mig-agent's `expected_resources` predicts for the layout, and
the device ids are the MIG UUIDs (GPU UUIDs with MIG off) NVML reports; its health checks run
(event wait) without marking anything unhealthy, and an Xid the simulated GPU raises marks devices
unhealthy; Allocate hands out the UUID; under mixed, a layout with MIG devices that split a GPU
instance makes the plugin refuse to start (what mig-agent's `strategy_problem` relies on); GFD's
labels (strategy, count, product, memory, compute capability, MIG capability) on every MIG model
against what the local cluster's simulated nodes are labelled with (`gpu_node_labels`, display
GPUs not counted), and where GFD's differ with the layout (single strategy)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from migsim.cluster.nodes import gpu_node_labels
from migsim.gpus import parse_gpu_spec  # the simulated GPUs GFD reads, not the agent's catalog
from migsim.nvml import open_node
from migsim.nvml import state as st
from migsim.nvml.hostview import mig_minor, mig_minors

from mig_agent.core.advertised import (
    NO_SHARING,
    Sharing,
    expected_resources,
    is_skipped,
    parse_sharing,
)

from .conftest import REPO

if os.geteuid() != 0:  # said out loud in the summary (-ra), never a silent pass
    pytest.skip(
        "the device plugin runs in a private mount namespace (unshare -m): run as root",
        allow_module_level=True,
    )

SPLIT_CI = {"H100-80GB": "1c.3g.40gb", "A100-40GB": "1c.3g.20gb", "H200": "1c.3g.71gb"}
MIXED = {
    "H100-80GB": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1},
    "A100-40GB": {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1},
    "H200": {"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1},
    "B200": {"1g.23gb": 2, "2g.45gb": 1, "3g.90gb": 1},
    "GB200": {"1g.23gb": 2, "2g.47gb": 1, "3g.93gb": 1},
    "B300": {"1g.34gb": 2, "2g.67gb": 1, "3g.135gb": 1},
    "GB300": {"1g.35gb": 2, "2g.70gb": 1, "3g.139gb": 1},
    "RTX-PRO-6000": {"1g.24gb": 2, "2g.48gb": 1},  # its 4 memory slices: two resources
}
BLACKWELL = ["B200", "GB200", "B300", "GB300", "RTX-PRO-6000"]
SINGLE = {
    "H100-80GB": {"1g.10gb": 7},
    "A100-40GB": {"2g.10gb": 3},
    "H200": {"3g.71gb": 2},
    "B200": {"1g.23gb": 7},
    "GB200": {"2g.47gb": 3},
    "B300": {"3g.135gb": 2},
    "GB300": {"1g.35gb": 7},
    "RTX-PRO-6000": {"1g.24gb": 4},
}


@pytest.fixture(scope="session")
def nvidia_bin() -> Path:
    out = subprocess.run(
        [str(REPO / "scripts" / "nvidia-binaries"), "build"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, f"scripts/nvidia-binaries build failed:\n{out.stderr}"
    return Path(out.stdout.strip())


def layout_file(tmp_path: Path, devices: dict[str, int] | None) -> Path:
    """A mig-parted config file with one layout, ``c``, for every GPU (None: MIG off)."""
    if devices is None:
        entry = {"devices": "all", "mig-enabled": False}
    else:
        entry = {"devices": "all", "mig-enabled": True, "mig-devices": devices}
    path = tmp_path / "layout.json"  # JSON is YAML
    path.write_text(json.dumps({"version": "v1", "mig-configs": {"c": [entry]}}))
    return path


def node(tmp_path: Path, gpus: str, devices: dict[str, int] | None) -> str:
    """A simulated node with ``gpus``, laid out by mig-agent (``mig-agent apply``)."""
    state = str(tmp_path / "node.json")
    st.create_node(state, gpus)
    out = subprocess.run(
        [
            "mig-agent",
            "apply",
            "-f",
            str(layout_file(tmp_path, devices)),
            "-c",
            "c",
            "--backend",
            "simulated",
            "--sim-state",
            state,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return state


def expected(state: str, strategy: str, sharing: Sharing = NO_SHARING) -> dict[str, int]:
    backend = open_node(state)
    try:
        return expected_resources(backend.observe(), backend.models(), strategy, sharing)
    finally:
        backend.close()


class Run:
    def __init__(self, proc: subprocess.CompletedProcess[str], report: dict[str, Any]) -> None:
        self.proc, self.report = proc, report
        self.log = proc.stdout + proc.stderr

    @property
    def devices(self) -> dict[str, dict[str, str]]:
        return {
            r: p["devices"] for r, p in self.report["plugins"].items() if p["devices"] is not None
        }

    def counts(self) -> dict[str, int]:
        return {r: len(d) for r, d in self.devices.items()}


def run_plugin(
    state: str,
    nvidia_bin: Path,
    tmp_path: Path,
    strategy: str,
    resources: int,
    *,
    timeout: float = 40,
    allocate: str = "",
    then: str = "",
    extra: tuple[str, ...] = (),
) -> Run:
    report = tmp_path / f"kubelet-{strategy}.json"
    cmd = [
        str(REPO / "scripts" / "with-sim-gpus"),
        "--host-view",
        state,
        "--",
        "python3",
        "-m",
        "migsim.kubelet",
        "--report",
        str(report),
        "--resources",
        str(resources),
        "--timeout",
        str(timeout),
    ]
    if allocate:
        cmd += ["--allocate", allocate]
    if then:
        cmd += ["--then", then]
    cmd += ["--", str(nvidia_bin / "nvidia-device-plugin"), f"--mig-strategy={strategy}", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout + 60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return Run(proc, json.loads(report.read_text()))


def uuids(state: str) -> tuple[set[str], set[str]]:
    """(MIG device UUIDs, GPU UUIDs) of the node as NVML reports them."""
    node_ = st.load_node(state)
    mig = {ci.uuid for g in node_.gpus for gi in g.gpu_instances for ci in gi.compute_instances}
    return mig, {g.uuid for g in node_.gpus}


# -- the host view ------------------------------------------------------------------------------


def test_mig_minors_list_every_possible_instance_in_the_drivers_numbering() -> None:
    text = mig_minors([0, 1])
    lines = text.splitlines()
    assert lines[:4] == ["config 1", "monitor 2", "gpu0/gi0/access 3", "gpu0/gi0/ci0/access 4"]
    assert "gpu1/gi0/access 138" in lines  # 15 GIs x (1 + 8 CIs) minors per GPU
    assert f"gpu1/gi14/ci7/access {mig_minor(1, 14, 7)}" == lines[-1]
    numbers = [int(line.split()[-1]) for line in lines]
    assert numbers == list(range(1, 3 + 2 * 135))  # consecutive, none twice


# -- the device plugin --------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["H100-80GB", "A100-40GB", "H200", *BLACKWELL])
def test_mixed_strategy_advertises_what_mig_agent_expects(
    model: str, tmp_path: Path, nvidia_bin: Path
) -> None:
    state = node(tmp_path, f"2x{model}", MIXED[model])
    want = expected(state, "mixed")
    # the test means something
    assert len(want) == len(MIXED[model]) and all(n >= 2 for n in want.values())
    run = run_plugin(
        state,
        nvidia_bin,
        tmp_path,
        "mixed",
        len(want),
        allocate=next(r for r in want if r.startswith("nvidia.com/mig-1g")),
    )
    assert run.report["complete"], run.log
    assert run.counts() == want, run.log
    mig, _ = uuids(state)
    listed = {i for d in run.devices.values() for i in d}
    assert listed == mig
    assert all(h == "Healthy" for d in run.devices.values() for h in d.values())
    assert run.report["allocatable"] == want  # health checks ran and marked nothing
    assert "Registered device plugin for 'nvidia.com/mig-" in run.log
    assert run.report["plugin_exit"] is None  # still serving when stopped
    allocated = run.report["allocated"]
    ((resource, env),) = allocated.items()
    assert env["NVIDIA_VISIBLE_DEVICES"] in run.devices[resource]
    for p in run.report["plugins"].values():
        assert p["version"] == "v1beta1" and p["error"] == ""


@pytest.mark.parametrize("model", ["H100-80GB", *BLACKWELL])
def test_single_strategy_advertises_mig_devices_as_gpus(
    model: str, tmp_path: Path, nvidia_bin: Path
) -> None:
    state = node(tmp_path, f"2x{model}", SINGLE[model])
    want = expected(state, "single")
    assert want == {"nvidia.com/gpu": 2 * sum(SINGLE[model].values())}
    run = run_plugin(state, nvidia_bin, tmp_path, "single", 1)
    assert run.counts() == want, run.log
    mig, _ = uuids(state)
    assert set(run.devices["nvidia.com/gpu"]) == mig


def test_single_strategy_refuses_a_mixed_layout(tmp_path: Path, nvidia_bin: Path) -> None:
    state = node(tmp_path, "2xH100-80GB", MIXED["H100-80GB"])
    assert expected(state, "single") == {}
    run = run_plugin(state, nvidia_bin, tmp_path, "single", 1, timeout=20)
    assert run.report["plugins"] == {}, run.log
    assert run.report["plugin_exit"] not in (None, 0), run.log


def test_none_strategy_with_mig_off_advertises_whole_gpus(tmp_path: Path, nvidia_bin: Path) -> None:
    state = node(tmp_path, "2xA100-40GB", None)
    want = expected(state, "none")
    assert want == {"nvidia.com/gpu": 2}
    run = run_plugin(state, nvidia_bin, tmp_path, "none", 1)
    assert run.counts() == want, run.log
    _, gpus = uuids(state)
    assert set(run.devices["nvidia.com/gpu"]) == gpus
    assert (
        run.report["plugins"]["nvidia.com/gpu"]["options"]["get_preferred_allocation_available"]
        is True
    )


@pytest.mark.parametrize("rename", [False, True])
def test_time_slicing_multiplies_as_mig_agent_expects(
    rename: bool, tmp_path: Path, nvidia_bin: Path
) -> None:
    state = node(tmp_path, "2xH100-80GB", MIXED["H100-80GB"])
    config: dict[str, Any] = {
        "version": "v1",
        "sharing": {
            "timeSlicing": {
                "renameByDefault": rename,
                "resources": [
                    {"name": "nvidia.com/mig-1g.10gb", "replicas": 4},
                    {"name": "nvidia.com/mig-3g.40gb", "replicas": 2},
                ],
            }
        },
    }
    path = tmp_path / "plugin-config.json"
    path.write_text(json.dumps(config))
    want = expected(state, "mixed", parse_sharing(config, source=str(path)))
    one_g = "nvidia.com/mig-1g.10gb" + (".shared" if rename else "")
    assert want[one_g] == 16  # 4 devices x 4 replicas: the test means something
    run = run_plugin(
        state, nvidia_bin, tmp_path, "mixed", len(want), extra=(f"--config-file={path}",)
    )
    assert run.counts() == want, run.log
    mig, _ = uuids(state)
    assert {i.split("::")[0] for d in run.devices.values() for i in d} == mig
    assert all("::" in i for i in run.devices[one_g])


def test_an_xid_makes_the_plugin_mark_that_gpus_devices_unhealthy(
    tmp_path: Path, nvidia_bin: Path
) -> None:
    """The plugin's health check (an event set per plugin, nvmlEventSetWait_v2) sees an Xid the
    simulated GPU 0 raises. What NVIDIA's plugin then does (internal/rm/health.go keys its devices
    by parent GPU UUID, one per GPU and plugin): it marks *one* MIG device per resource of GPU 0
    unhealthy, not all of them; the kubelet's allocatable drops by those."""
    state = node(tmp_path, "2xH100-80GB", MIXED["H100-80GB"])
    want = expected(state, "mixed")
    run = run_plugin(
        state,
        nvidia_bin,
        tmp_path,
        "mixed",
        len(want),
        then=f"python3 -m migsim.nvml --state {state} xid 0 79",
    )
    assert run.report["then_updated"], run.log
    assert run.report["capacity"] == want
    gpus = st.load_node(state).gpus
    on = [{ci.uuid for gi in g.gpu_instances for ci in gi.compute_instances} for g in gpus]
    health = {i: h for d in run.devices.values() for i, h in d.items()}
    unhealthy = {i for i, h in health.items() if h != "Healthy"}
    assert unhealthy <= on[0], run.log
    assert all(sum(h != "Healthy" for h in d.values()) == 1 for d in run.devices.values())
    assert sum(run.report["allocatable"].values()) == sum(want.values()) - len(want)
    assert "XidCriticalError: Xid=79" in run.log, run.log


@pytest.mark.parametrize("model", ["H100-80GB", "A100-40GB"])
def test_mixed_strategy_refuses_to_start_on_split_compute_instances(
    model: str, tmp_path: Path, nvidia_bin: Path
) -> None:
    """The fact mig-agent's mixed_strategy_problem states: not even the whole GPU is advertised."""
    state = str(tmp_path / "node.json")
    st.create_node(state, f"2x{model}")
    # GPU 0 split into compute instances, GPU 1 with MIG off
    cfg = {
        "version": "v1",
        "mig-configs": {
            "c": [
                {"devices": [0], "mig-enabled": True, "mig-devices": {SPLIT_CI[model]: 3}},
                {"devices": [1], "mig-enabled": False},
            ]
        },
    }
    (tmp_path / "split.json").write_text(json.dumps(cfg))
    out = subprocess.run(
        [
            "mig-agent",
            "apply",
            "-f",
            str(tmp_path / "split.json"),
            "-c",
            "c",
            "--backend",
            "simulated",
            "--sim-state",
            state,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert expected(state, "mixed") == {}
    run = run_plugin(state, nvidia_bin, tmp_path, "mixed", 1, timeout=20)
    assert run.report["plugins"] == {}, run.log
    assert run.report["plugin_exit"] not in (None, 0), run.log


# -- gpu-feature-discovery ----------------------------------------------------------------------


def gfd(state: str, nvidia_bin: Path, tmp_path: Path, strategy: str) -> dict[str, str]:
    out_file = tmp_path / f"gfd-{strategy}"
    proc = subprocess.run(
        [
            str(REPO / "scripts" / "with-sim-gpus"),
            "--host-view",
            state,
            "--",
            str(nvidia_bin / "gpu-feature-discovery"),
            "--oneshot",
            "--use-node-feature-api=false",
            "--no-timestamp",
            f"--mig-strategy={strategy}",
            f"--output-file={out_file}",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(line.split("=", 1) for line in out_file.read_text().splitlines() if line)


COMPARED = ("nvidia.com/gpu.product", "nvidia.com/gpu.count", "nvidia.com/mig.capable")


@pytest.mark.parametrize("model", ["H100-80GB", "A100-40GB", "H200", *BLACKWELL])
def test_gfd_labels_match_the_simulated_nodes_labels_with_mixed(
    model: str, tmp_path: Path, nvidia_bin: Path
) -> None:
    state = node(tmp_path, f"2x{model}", MIXED[model])
    labels = gfd(state, nvidia_bin, tmp_path, "mixed")
    ours = gpu_node_labels("n", parse_gpu_spec(f"2x{model}"))
    assert {k: labels.get(k) for k in COMPARED} == {k: ours[k] for k in COMPARED}
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    m = parse_gpu_spec(model)[0]
    assert labels["nvidia.com/gpu.memory"] == str(m.memory_total_mib)
    assert labels["nvidia.com/vgpu.present"] == "false"
    assert labels["nvidia.com/gpu.mode"] == "compute"
    for resource, count in expected(state, "mixed").items():
        name = resource.removeprefix("nvidia.com/")
        assert labels[f"nvidia.com/{name}.count"] == str(count)
        assert labels[f"nvidia.com/{name}.product"] == f"{m.product}-MIG-{name[4:]}"


@pytest.mark.parametrize(
    "model", ["A100-40GB", "A100-80GB", "A30", "H100-80GB", "H100-NVL", "H200", *BLACKWELL]
)
def test_gfd_with_mig_off_labels_as_the_simulated_node_is(
    model: str, tmp_path: Path, nvidia_bin: Path
) -> None:
    state = str(tmp_path / "node.json")
    st.create_node(state, f"2x{model}")
    labels = gfd(state, nvidia_bin, tmp_path, "none")
    m = parse_gpu_spec(model)[0]
    ours = gpu_node_labels("n", [m, m])
    assert {k: labels.get(k) for k in COMPARED} == {k: ours[k] for k in COMPARED}
    assert labels["nvidia.com/gpu.memory"] == str(m.memory_total_mib)
    # compute capability from the simulated model's data (Blackwell: 10.0, 10.3, 12.0)
    assert (
        labels["nvidia.com/gpu.compute.major"],
        labels["nvidia.com/gpu.compute.minor"],
        labels["nvidia.com/gpu.family"],
    ) == (*map(str, m.compute_capability), m.architecture.value)
    assert "nvidia.com/mig.strategy" not in labels


def test_gfd_does_not_count_a_display_gpu(tmp_path: Path, nvidia_bin: Path) -> None:
    """GFD (go-nvlib's VisitDevices) skips "DGX Display" GPUs as the device plugin does
    (mig_agent.core.advertised.is_skipped), and so does the local cluster's gpu_node_labels."""
    state = str(tmp_path / "node.json")
    st.create_node(state, "2xA100-80GB,1xDGX-Display")
    labels = gfd(state, nvidia_bin, tmp_path, "mixed")
    models = parse_gpu_spec("2xA100-80GB,1xDGX-Display")
    assert labels["nvidia.com/gpu.count"] == str(sum(not is_skipped(m.name) for m in models))
    assert labels["nvidia.com/gpu.product"] == models[0].product
    ours = gpu_node_labels("n", models)
    assert {k: labels.get(k) for k in COMPARED} == {k: ours[k] for k in COMPARED}


def test_gfd_single_strategy_labels_the_mig_device_not_the_gpu(
    tmp_path: Path, nvidia_bin: Path
) -> None:
    """Under single, GFD's product and count are the MIG device's, not the GPU's that
    gpu_node_labels puts on a new node (MIG off); where GFD runs on the local cluster (the node
    runtime), its labels replace those as the layout changes (tests/e2e/test_nvidia_plugin.py)."""
    state = node(tmp_path, "2xH100-80GB", SINGLE["H100-80GB"])
    labels = gfd(state, nvidia_bin, tmp_path, "single")
    m = parse_gpu_spec("H100-80GB")[0]
    assert labels["nvidia.com/gpu.product"] == f"{m.product}-MIG-1g.10gb"
    assert labels["nvidia.com/gpu.count"] == "14"


def test_gfd_labels_one_model_of_a_node_with_two(tmp_path: Path, nvidia_bin: Path) -> None:
    """Where the local cluster's first labels differ from GFD's: a node with two GPU models gets
    one model's product, count and memory from GFD -- either model, from run to run (GFD
    keeps them in a Go map, whose order is random) -- not the first GPU's and the total (the
    node runtime's GFD replaces them on the local cluster)."""
    spec = "4xA100-40GB,4xA30"
    state = str(tmp_path / "node.json")
    st.create_node(state, spec)
    labels = gfd(state, nvidia_bin, tmp_path, "mixed")
    models = {m.product: m for m in (parse_gpu_spec("A30")[0], parse_gpu_spec("A100-40GB")[0])}
    assert labels["nvidia.com/gpu.product"] in models, labels
    one = models[labels["nvidia.com/gpu.product"]]
    assert labels["nvidia.com/gpu.count"] == "4"
    assert labels["nvidia.com/gpu.memory"] == str(one.memory_total_mib)
    ours = gpu_node_labels("n", parse_gpu_spec(spec))
    assert (ours["nvidia.com/gpu.product"], ours["nvidia.com/gpu.count"]) == (
        parse_gpu_spec("A100-40GB")[0].product,
        "8",
    )
