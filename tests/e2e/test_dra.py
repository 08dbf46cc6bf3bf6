"""We test end to end, on the local cluster, nodes that run NVIDIA's DRA kubelet plugin instead of
a device plugin, as on a GPUCluster (agent_node(device_plugin="dra"): the node labelled for the
DRA driver's DaemonSet, a follower running gpu-kubelet-plugin while the node's pod runs), with
real agents:

* such a node publishes one ResourceSlice of the driver gpu.nvidia.com listing its whole GPUs
  (MIG off), and neither runs a pod of the device plugin's DaemonSet nor advertises a
  `nvidia.com/` extended resource;
* the agent takes it from whole GPUs to all-balanced and back: it restarts the DRA plugin, and
  says success only once the slice lists the layout's devices (then exactly those);
* a pod whose ResourceClaim asks a mig.nvidia.com device with `profile == "2g.20gb"` (CEL) stays
  Pending while the node has whole GPUs, and the real scheduler places it once the layout
  offers one;
* of two pods holding MIG devices by claim, the one whose GPU changes is evicted, the one whose
  device stays runs on, its claim still allocated;
* a node whose DRA driver runs DynamicMIG is refused (failed, the reason naming DynamicMIG), its
  GPUs untouched, never cordoned; so is a node where NVIDIA's device plugin runs beside the
  DRA driver.

Needs root (private mount namespaces): skips loudly otherwise.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from migsim.cluster import Cluster, agents, dra_plugin
from migsim.nvml import state as simstate

from .conftest import REASON, AgentNode, NodeFactory, mig_counts, wait_running
from .test_agent import wait_unschedulable
from .test_ops import mig_agent_cli

RESOURCE = "/apis/resource.k8s.io/v1"
# a layout of a 2-GPU node that changes GPU 1 only (from all-1g.10gb)
DRA_HALF = """version: v1
mig-configs:
  dra-half:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
    - devices: [1]
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
"""


@pytest.fixture
def dra_node(agent_node: NodeFactory) -> AgentNode:
    """A DRA node of 2 H100 80GB (MIG off), its slice published."""
    return agent_node("2xH100-80GB", device_plugin="dra")


def test_a_dra_node_publishes_its_whole_gpus_and_runs_no_device_plugin(
    dra_node: AgentNode, core: client.CoreV1Api
) -> None:
    gpus = simstate.load_node(dra_node.sim_state).gpus
    devices = dra_node.dra_devices()
    assert set(devices) == {f"gpu-{g.index}" for g in gpus} and len(devices) == 2
    assert {d["uuid"] for d in devices.values()} == {g.uuid for g in gpus}
    assert all(d["type"] == "gpu" for d in devices.values())
    (piece,) = dra_plugin.resource_slices(dra_node.cluster, dra_node.name)
    assert piece["spec"]["pool"]["name"] == dra_node.name

    on_node = core.list_namespaced_pod(
        agents.PLUGIN_NS, field_selector=f"spec.nodeName={dra_node.name}"
    ).items
    apps = {(p.metadata.labels or {}).get("app") for p in on_node}
    assert dra_plugin.APP in apps
    assert "nvidia-device-plugin-daemonset" not in apps
    assert agents.DEVICE_PLUGIN_NODE_LABEL not in dra_node.labels()
    assert dra_node.labels()[dra_plugin.NODE_LABEL] == "true"
    assert dra_node.gpu_resources() == {}


def kinds(node: AgentNode) -> Counter[str]:
    return Counter(d.get("profile", d["type"]) for d in node.dra_devices().values())


def claim(node: AgentNode, namespace: str, name: str, cel: str) -> None:
    """A ResourceClaim of one MIG device (DeviceClass mig.nvidia.com) matching `cel`."""
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "mig",
                        "exactly": {
                            "deviceClassName": "mig.nvidia.com",
                            "selectors": [{"cel": {"expression": cel}}],
                        },
                    }
                ]
            }
        },
    }
    node.cluster.api.request("POST", f"{RESOURCE}/namespaces/{namespace}/resourceclaims", body)


def claiming_pod(core: client.CoreV1Api, namespace: str, name: str, claim_name: str) -> Any:
    """A pod on no particular node that holds the claim `claim_name` (no GPU resource)."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
            "containers": [
                {
                    "name": "cuda",
                    "image": "registry.invalid/cuda:1",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }
    return core.create_namespaced_pod(namespace, body)


def allocated_device(node: AgentNode, namespace: str, name: str) -> str:
    got = node.cluster.api.get(f"{RESOURCE}/namespaces/{namespace}/resourceclaims/{name}")
    results = ((got.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
    return str(results[0]["device"]) if results else ""


def change(node: AgentNode, layout: str) -> str:
    """Label the node with `layout`; the state the agent ends the change in (a DRA pass takes a
    plugin restart, seconds: its `pending` is seen, not an earlier layout's `success`)."""
    node.label(layout)
    node.wait_state("pending", timeout=30)
    return node.wait_state("success", "failed", timeout=120)


def until(what: str, done: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_layouts_come_and_go_and_the_slice_follows(dra_node: AgentNode) -> None:
    dra_node.label("all-balanced")
    assert dra_node.wait_state("success", "failed", timeout=120) == "success", dra_node.log_tail()
    # success is said once the restarted plugin lists the layout: no wait here
    assert kinds(dra_node) == Counter({"1g.10gb": 4, "2g.20gb": 2, "3g.40gb": 2})
    assert all(d["type"] == "mig" for d in dra_node.dra_devices().values())
    assert not dra_node.node().spec.unschedulable
    # status reads the slices as the agent does (every node's, one request)
    st = mig_agent_cli(
        "status",
        "-l",
        f"kubernetes.io/hostname={dra_node.name}",
        "-o",
        "json",
        "--kubeconfig",
        str(dra_node.cluster.kubeconfig),
    )
    assert st.returncode == 0, st.stderr
    (row,) = [r for r in json.loads(st.stdout) if r["node"] == dra_node.name]
    assert row["dra_devices"] == {"1g.10gb": 4, "2g.20gb": 2, "3g.40gb": 2}, row
    assert row["resources"] == {} and row["state"] == "success"
    assert change(dra_node, "all-disabled") == "success", dra_node.log_tail()
    assert kinds(dra_node) == Counter({"gpu": 2})
    assert "dra_plugin.devices_match" in dra_node.log_tail(60)


def test_a_claim_for_a_profile_waits_until_a_layout_offers_it(
    dra_node: AgentNode, namespace: str, core: client.CoreV1Api
) -> None:
    claim(
        dra_node,
        namespace,
        "wants-2g",
        "device.attributes['gpu.nvidia.com'].profile == '2g.20gb'",
    )
    claiming_pod(core, namespace, "wants-2g", "wants-2g")
    pod = wait_unschedulable(core, namespace, "wants-2g")  # the scheduler looked: no 2g.20gb
    assert pod.status.phase == "Pending" and not pod.spec.node_name
    dra_node.label("all-balanced")
    assert dra_node.wait_state("success", "failed", timeout=120) == "success", dra_node.log_tail()
    pod = wait_running(core, namespace, "wants-2g", timeout=60)
    assert pod.spec.node_name == dra_node.name
    device = allocated_device(dra_node, namespace, "wants-2g")
    assert dra_node.dra_devices()[device]["profile"] == "2g.20gb"


def test_only_the_pod_whose_claimed_device_goes_is_evicted(
    agent_node: NodeFactory,
    namespace: str,
    core: client.CoreV1Api,
    extra_profiles: Callable[[str], Path],
) -> None:
    profiles = extra_profiles(DRA_HALF)
    node = agent_node("2xH100-80GB", device_plugin="dra", profiles=profiles)
    node.label("all-1g.10gb")
    assert node.wait_state("success", "failed", timeout=120) == "success", node.log_tail()
    gpus = simstate.load_node(node.sim_state).gpus
    for g in gpus:  # one pod on a MIG device of each GPU
        claim(
            node,
            namespace,
            f"on-gpu-{g.index}",
            f"device.attributes['gpu.nvidia.com'].parentUUID == '{g.uuid}'",
        )
        claiming_pod(core, namespace, f"on-gpu-{g.index}", f"on-gpu-{g.index}")
    kept = wait_running(core, namespace, "on-gpu-0")
    wait_running(core, namespace, "on-gpu-1")
    held = allocated_device(node, namespace, "on-gpu-0")
    # a dry run counts both: they hold the node's devices by claim, requesting no GPU resource
    dry = mig_agent_cli(
        "repartition",
        "dra-half",
        node.name,
        "--dry-run",
        "-f",
        str(profiles),
        "--kubeconfig",
        str(node.cluster.kubeconfig),
    )
    assert dry.returncode == 0 and "2 GPU pod(s) would be evicted" in dry.stdout, dry
    assert change(node, "dra-half") == "success", node.log_tail()
    assert kinds(node) == Counter({"1g.10gb": 7, "3g.40gb": 2})
    now = core.read_namespaced_pod("on-gpu-0", namespace)
    assert now.metadata.uid == kept.metadata.uid and now.status.phase == "Running"
    assert allocated_device(node, namespace, "on-gpu-0") == held
    gone = core.list_namespaced_pod(namespace, field_selector="metadata.name=on-gpu-1").items
    assert not gone or gone[0].metadata.deletion_timestamp, "the pod on GPU 1 was not evicted"


def test_a_dynamic_mig_node_is_refused_untouched(
    agent_node: NodeFactory, dra_installed: Cluster
) -> None:
    dra_plugin.install_daemonset(
        dra_installed,
        name="nvidia-dra-driver-kubelet-plugin-dynamic",
        node_selector={dra_plugin.NODE_LABEL: "dynamic", "type": "kwok"},
        feature_gates="DynamicMIG=true",
    )
    node = agent_node("2xH100-80GB", device_plugin="dra", dra_node_label_value="dynamic")
    simstate.reset_call_counts(node.sim_state)
    node.label("all-balanced")
    assert node.wait_state("success", "failed", timeout=60) == "failed", node.log_tail()
    reason = node.node().metadata.annotations[REASON]
    assert "DynamicMIG" in reason and "nothing was touched" in reason, reason
    assert mig_counts(node.sim_state).total == 0
    assert not node.node().spec.unschedulable
    assert all(not g.mig_current for g in simstate.load_node(node.sim_state).gpus)


def test_a_node_with_both_the_device_plugin_and_the_dra_driver_is_refused(
    dra_node: AgentNode, core: client.CoreV1Api
) -> None:
    # the device plugin's DaemonSet comes to the node too
    core.patch_node(
        dra_node.name, {"metadata": {"labels": {agents.DEVICE_PLUGIN_NODE_LABEL: "true"}}}
    )
    until(
        "no device plugin pod came",
        lambda: bool(
            core.list_namespaced_pod(
                agents.PLUGIN_NS,
                field_selector=f"spec.nodeName={dra_node.name}",
                label_selector=agents.PLUGIN_LABEL,
            ).items
        ),
    )
    simstate.reset_call_counts(dra_node.sim_state)
    dra_node.label("all-balanced")
    assert dra_node.wait_state("success", "failed", timeout=60) == "failed", dra_node.log_tail()
    reason = dra_node.node().metadata.annotations[REASON]
    assert "device plugin" in reason and "DRA" in reason and "nothing was touched" in reason
    assert mig_counts(dra_node.sim_state).total == 0
    assert not dra_node.node().spec.unschedulable
