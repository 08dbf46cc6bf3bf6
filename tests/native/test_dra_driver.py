"""NVIDIA's DRA kubelet plugin (gpu-kubelet-plugin, built from the pinned upstream source by
scripts/dra-driver) on a kwok node of a local cluster of its own, over the node's simulated GPUs
(migsim.cluster.dra_plugin: scripts/with-sim-gpus --host-view, the simulated libnvidia-ml.so.1 in
the plugin's driver root).

We test these aspects: with MIG off the node's ResourceSlice (driver gpu.nvidia.com, pool = node
name) lists each GPU as `gpu-<minor>` with type gpu and the UUID, brand, architecture and product
NVML reports; after mig-agent applies all-balanced and the plugin restarts (it reads the GPUs only
when it starts) it lists exactly the MIG devices of the simulator's state, named
gpu-<minor>-mig-<profile>-<GI profile id>-<placement start>, with type mig, uuid, parentUUID and
profile, as many per profile as the layout says, and no whole GPU; a `+me` profile's name made
RFC 1123 (`1g10gb-me`); MIG on without MIG devices: a slice without devices; a compute instance
that does not span its GPU instance (1c.3g.40gb): the plugin refuses to start, naming the MIG
device (as NVIDIA's device plugin does under the mixed strategy); the DeviceClasses select by type;
the cluster's `down` stops a plugin left running.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from migsim.cluster import Cluster, dra_plugin
from migsim.cluster.agent_records import stop_all
from migsim.cluster.errors import DevClusterError
from migsim.nvml import state as st

from .conftest import REPO

if os.geteuid() != 0:  # said out loud in the summary (-ra), never a silent pass
    pytest.skip(
        "the DRA plugin runs in a private mount namespace (unshare -m): run as root",
        allow_module_level=True,
    )

NODE, GPUS, MODEL_PCI_ID = "gpu-node-0", "2xH100-80GB", "0x233010DE"
Devices = dict[str, dict[str, Any]]


def _build(script: str) -> Path:
    out = subprocess.run(
        [str(REPO / "scripts" / script), "build"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, f"scripts/{script} build failed:\n{out.stderr[-3000:]}"
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster of its own with one kwok node of 2 simulated H100s; the plugin built first."""
    _build("dra-driver")
    _build("nvidia-binaries")  # nvidia-cdi-hook
    c = Cluster.up(tmp_path_factory.mktemp("dra-cluster"), gpu_nodes=0)
    try:
        c.add_gpu_node(NODE, GPUS)
        dra_plugin.install_device_classes(c)
        yield c
    finally:
        c.down()


@pytest.fixture
def state(cluster: Cluster) -> Path:
    path = cluster.node_dir(NODE) / "gpu-state.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    st.create_node(path, gpus=GPUS, name=NODE)
    return path


def apply(state: Path, layout: str, *config: str) -> None:
    """mig-agent applies `layout` (from `config` files, default the shipped profiles)."""
    files = [arg for f in config for arg in ("-f", f)]
    subprocess.run(
        [sys.executable, "-m", "mig_agent", "apply", "--backend", "simulated"]
        + ["--sim-state", str(state), *files, "-c", layout],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'sim'}"},
    )


def mig_devices(state: Path) -> Devices:
    """The MIG devices of the simulator's state as the plugin names them (reference/dra.md 1):
    gpu-<minor>-mig-<profile, dots removed, RFC 1123>-<GI profile id>-<placement start>."""
    want: Devices = {}
    for gpu in st.load_node(state).gpus:
        for gi, ci in gpu.mig_devices():
            gp = st.gi_profile(gpu, gi.profile_id)
            profile = gp.ci_name(st.ci_profile(gpu, gi, ci.profile_id))
            label = re.sub(r"[^a-z0-9-]", "-", profile.replace(".", "").lower())
            name = f"gpu-{gpu.index}-mig-{label}-{gi.profile_id}-{gi.start}"
            want[name] = {"uuid": ci.uuid, "parentUUID": gpu.uuid, "profile": profile}
    return want


def run_plugin_until(cluster: Cluster, state: Path, done: Any, *, fresh: bool = True) -> Devices:
    """Start the plugin, wait until the node's devices satisfy `done`, stop it. `fresh`: the
    slices a plugin left behind are deleted first (else the new plugin has to replace them)."""
    if fresh:
        dra_plugin.delete_slices(cluster, NODE)
        assert dra_plugin.resource_slices(cluster, NODE) == []
    plugin = dra_plugin.start(cluster, NODE, state)
    try:
        return dra_plugin.wait_devices(cluster, plugin, done, timeout=90)
    finally:
        dra_plugin.stop_plugin(plugin)
        assert not plugin.proc.alive()


def test_mig_off_lists_each_gpu(cluster: Cluster, state: Path) -> None:
    node = st.load_node(state)
    gpu_names = {f"gpu-{g.index}" for g in node.gpus}
    devices = run_plugin_until(cluster, state, lambda d: set(d) == gpu_names)

    for gpu in node.gpus:
        dev = devices[f"gpu-{gpu.index}"]
        assert dev["type"] == "gpu"
        assert dev["uuid"] == gpu.uuid
        assert dev["productName"] == gpu.model.name
        assert dev["brand"] == "Nvidia"  # go-nvlib's name of NVML_BRAND_NVIDIA
        assert dev["architecture"] == "Hopper"
        assert dev["cudaComputeCapability"] == "9.0.0"
        # a version attribute is semver: 580.159.04 is announced as 580.159.4
        assert dev["driverVersion"] == ".".join(str(int(p)) for p in node.driver_version.split("."))
        assert dev["resource.kubernetes.io/pciBusID"] == gpu.bus_id[4:].lower()
    (piece,) = dra_plugin.resource_slices(cluster, NODE)
    assert piece["spec"]["pool"]["name"] == NODE
    assert piece["spec"]["nodeName"] == NODE
    assert piece["metadata"]["ownerReferences"][0]["kind"] == "Node"


def _layout(name: str) -> dict[str, int]:
    """The layout's MIG devices for the H100 80GB, from the profiles mig-agent ships."""
    spec = yaml.safe_load((REPO / "profiles" / "all.yaml").read_text())
    for entry in spec["mig-configs"][name]:
        filters = entry.get("device-filter", [])
        if MODEL_PCI_ID in ([filters] if isinstance(filters, str) else filters):
            return dict(entry["mig-devices"])
    raise AssertionError(f"{name} has no entry for {MODEL_PCI_ID}")


def test_all_balanced_lists_exactly_the_mig_devices(cluster: Cluster, state: Path) -> None:
    # the plugin ran on the GPUs with MIG off: its slice lists them, and stays when it stops
    run_plugin_until(cluster, state, lambda d: set(d) == {"gpu-0", "gpu-1"})
    apply(state, "all-balanced")
    node = st.load_node(state)
    want = mig_devices(state)
    assert len(want) == 8

    # restarted (it reads the layout only at start), it replaces the GPUs by the MIG devices
    devices = run_plugin_until(cluster, state, lambda d: set(d) == set(want), fresh=False)
    for name, dev in devices.items():
        assert dev["type"] == "mig", name
        assert {k: dev[k] for k in ("uuid", "parentUUID", "profile")} == want[name], name
    per_gpu = Counter(dev["profile"] for dev in devices.values())
    layout = _layout("all-balanced")
    assert per_gpu == Counter({p: n * len(node.gpus) for p, n in layout.items()})
    assert not any(dev["type"] == "gpu" for dev in devices.values())


def test_device_classes_select_by_type(cluster: Cluster) -> None:
    classes = cluster.api.get(f"{dra_plugin.RESOURCE_API}/deviceclasses")["items"]
    by_name = {c["metadata"]["name"]: c["spec"] for c in classes}
    for name, device_type in (("gpu.nvidia.com", "gpu"), ("mig.nvidia.com", "mig")):
        (selector,) = by_name[name]["selectors"]
        assert f".type == '{device_type}'" in selector["cel"]["expression"]
        assert "device.driver == 'gpu.nvidia.com'" in selector["cel"]["expression"]


CONFIG = """\
version: v1
mig-configs:
  me:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb+me": 1, "1g.20gb": 1, "4g.40gb": 1}
  none:
    - devices: all
      mig-enabled: true
      mig-devices: {}
  split:
    - devices: all
      mig-enabled: true
      mig-devices: {"1c.3g.40gb": 1, "3g.40gb": 1}
"""


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "layouts.yaml"
    path.write_text(CONFIG)
    return str(path)


def test_a_me_profile_is_named_rfc1123(cluster: Cluster, state: Path, config: str) -> None:
    apply(state, "me", config)
    want = mig_devices(state)
    assert {"gpu-0-mig-1g10gb-me-20-6", "gpu-1-mig-1g10gb-me-20-6"} <= set(want)
    devices = run_plugin_until(cluster, state, lambda d: set(d) == set(want))
    for name, dev in devices.items():
        assert {k: dev[k] for k in ("uuid", "parentUUID", "profile")} == want[name], name


def test_mig_on_without_mig_devices_publishes_an_empty_slice(
    cluster: Cluster, state: Path, config: str
) -> None:
    apply(state, "none", config)
    devices = run_plugin_until(
        cluster, state, lambda _d: bool(dra_plugin.resource_slices(cluster, NODE))
    )
    assert devices == {}


def test_a_split_gpu_instance_makes_the_plugin_refuse_to_start(
    cluster: Cluster, state: Path, config: str
) -> None:
    apply(state, "split", config)
    split = [
        ci.uuid
        for gpu in st.load_node(state).gpus
        for gi, ci in gpu.mig_devices()
        if st.ci_profile(gpu, gi, ci.profile_id).slices != st.gi_profile(gpu, gi.profile_id).slices
    ]
    assert split
    dra_plugin.delete_slices(cluster, NODE)
    plugin = dra_plugin.start(cluster, NODE, state)
    try:
        with pytest.raises(DevClusterError, match="exited") as exited:
            dra_plugin.wait_devices(cluster, plugin, lambda _d: False, timeout=60)
    finally:
        dra_plugin.stop_plugin(plugin)
    assert "error getting profile info for MIG device: " in str(exited.value)
    assert any(uuid in str(exited.value) for uuid in split)
    assert dra_plugin.resource_slices(cluster, NODE) == []


def test_the_clusters_down_stops_a_plugin_left_running(cluster: Cluster, state: Path) -> None:
    plugin = dra_plugin.start(cluster, NODE, state)
    dra_plugin.wait_devices(cluster, plugin, lambda d: set(d) == {"gpu-0", "gpu-1"})
    stop_all(cluster.dir)  # what Cluster.down and `scripts/local-cluster down` stop first
    assert not plugin.proc.alive()
    with pytest.raises(ProcessLookupError):
        os.killpg(plugin.proc.pid, 0)  # nothing of its group is left: plugin, GPU simulator
