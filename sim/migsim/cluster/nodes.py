"""Simulated Node objects: GPU nodes labelled as NVIDIA's GPU Operator labels them, and CPU nodes.

Pure: builds manifests (plain dicts), talks to nothing. kwok manages exactly the nodes that carry
the annotation `KWOK_ANNOTATION`, so nodes without it (a real kubelet's) are never touched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mig_agent.core.advertised import is_skipped
from migsim.gpus import GpuModel, parse_gpu_spec

KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
# The GPU spec a simulated node was created with (`8xH100-80GB`), for that node's GPU simulator.
GPUS_ANNOTATION = "devcluster.mig-agent.dev/gpus"
DEFAULT_GPUS = "8xH100-80GB"
GPU_RESOURCE = "nvidia.com/gpu"
# An image for pods on simulated nodes: kwok runs no containers, so it is never pulled.
SIMULATED_IMAGE = "registry.invalid/simulated:1"

# What every simulated node offers besides GPUs: a typical 2-socket GPU server.
_BASE_RESOURCES = {"cpu": "64", "memory": "512Gi", "pods": "110"}

Manifest = dict[str, Any]


def gpu_node_labels(name: str, gpus: Sequence[GpuModel]) -> dict[str, str]:
    """The labels GPU Feature Discovery and the GPU Operator put on a node with these GPUs, with
    MIG off (where GFD runs on the node, its labels replace these as the layout changes).

    As GFD does (checked against NVIDIA's in tests/native/test_device_plugin.py): display GPUs
    (DGX Station) are not counted. A node with GPUs of several models is labelled here with its
    first counted GPU's product and the count of all; GFD labels one model's product and the count
    of that model only (4xA100-40GB,4xA30: NVIDIA-A30, 4), and replaces these where it runs.
    """
    counted = [g for g in gpus if not is_skipped(g.name)] or list(gpus[:1])
    return {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": counted[0].product,
        "nvidia.com/gpu.count": str(sum(not is_skipped(g.name) for g in gpus)),
        "nvidia.com/mig.capable": "true" if any(g.mig_capable for g in counted) else "false",
        "nvidia.com/gpu.deploy.device-plugin": "true",
    }


def node_manifest(
    name: str,
    *,
    labels: Mapping[str, str],
    annotations: Mapping[str, str] | None = None,
    resources: Mapping[str, str] | None = None,
    taints: Sequence[Mapping[str, str]] = (),
) -> Manifest:
    """A kwok-managed Node with `labels`; capacity = allocatable = base resources + `resources`."""
    allocatable = {**_BASE_RESOURCES, **(resources or {})}
    spec: Manifest = {}
    if taints:
        spec["taints"] = [dict(t) for t in taints]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1], **(annotations or {})},
            "labels": dict(labels),
        },
        "spec": spec,
        # A Node's status may be set on create; kwok's node-initialize stage keeps it.
        "status": {"capacity": dict(allocatable), "allocatable": dict(allocatable)},
    }


def gpu_node_manifest(
    name: str,
    gpus: str = DEFAULT_GPUS,
    *,
    extra_labels: Mapping[str, str] | None = None,
    taints: Sequence[Mapping[str, str]] = (),
) -> Manifest:
    """A simulated GPU node; `gpus` as `migsim.gpus.parse_gpu_spec` reads it
    (`8xH100-80GB`).

    It advertises `nvidia.com/gpu: <count>`, as the device plugin does before MIG is configured
    (display GPUs, which the plugin skips, not counted).
    """
    models = parse_gpu_spec(gpus)
    labels = {**gpu_node_labels(name, models), **(extra_labels or {})}
    count = sum(not is_skipped(m.name) for m in models)
    return node_manifest(
        name,
        labels=labels,
        annotations={GPUS_ANNOTATION: gpus},
        resources={GPU_RESOURCE: str(count)},
        taints=taints,
    )


def cpu_node_manifest(name: str, *, extra_labels: Mapping[str, str] | None = None) -> Manifest:
    """A simulated node without GPUs (no `nvidia.com/*` labels or resources)."""
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        **(extra_labels or {}),
    }
    return node_manifest(name, labels=labels)
