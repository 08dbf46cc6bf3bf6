"""``verify``'s tiny pods: the manifest of one (a device of one resource kind, pinned to the node,
``nvidia-smi -L``), and what a pod that did not run says about why, with what to look at.

Pure: manifests and verdicts from the pods and Events as the API returns them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

# NVIDIA's CUDA base image: the GPU Operator's runtime injects nvidia-smi and the driver's
# libraries into it, as into any container given a GPU
DEFAULT_IMAGE: Final = "nvcr.io/nvidia/cuda:12.8.1-base-ubuntu24.04"
DEFAULT_RUNTIME_CLASS: Final = "nvidia"
LABEL: Final = "app.kubernetes.io/name"
LABEL_VALUE: Final = "mig-agent-verify"
# one value per run of a node's checks: its pods are deleted by it, those whose create's answer
# was lost too, and a create's repeat knows its own pod by it (KubernetesCluster.create_pod)
RUN_LABEL: Final = "mig-agent.dev/verify-run"
# a container that will not start with restartPolicy Never: no point waiting for it
_STUCK: Final = frozenset(
    {
        "ErrImageNeverPull",
        "InvalidImageName",
        "ImagePullBackOff",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
_HINTS: Final = (
    (
        ("FailedScheduling",),
        "the scheduler found no device for the pod on the node: the DeviceClass serving its "
        "resource (mig-agent dra-classes), the node's ResourceSlice, the claims holding its "
        "devices",
    ),
    (
        ("UnexpectedAdmissionError", "OutOf", "Allocate"),
        "the kubelet could not give the pod the device: the device plugin's pod log on the "
        "node and the kubelet's log (the plugin's Allocate, its health); the pods that hold "
        "the node's devices",
    ),
    (
        ("ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName"),
        "the image: --image (one the node can pull, or has), the registry, imagePullSecrets",
    ),
    (
        ("FailedCreatePodSandBox",),
        "the pod sandbox: the node's CNI network and the RuntimeClass's handler in the "
        "container runtime's config",
    ),
    (
        ("RunContainerError", "CreateContainerError", "StartError", "ContainerCannotRun"),
        "the container runtime could not give the container its device: the RuntimeClass's "
        "handler (NVIDIA's container runtime), the node's CDI spec for the device (nvidia-ctk "
        "cdi list; /etc/cdi, /var/run/cdi) and the container runtime's log",
    ),
)
# Warnings of every pod on some nodes that say nothing about its devices
_NOISE: Final = frozenset({"MissingClusterDNS", "DNSConfigForming"})
_NOT_RUN_HINT: Final = (
    "the pod's events (kubectl describe pod), the kubelet's log, the device plugin's pod"
)


@dataclass(frozen=True, slots=True)
class PodSpec:
    """What ``verify``'s pods are made of (the options of the command)."""

    image: str = DEFAULT_IMAGE
    runtime_class: str = DEFAULT_RUNTIME_CLASS  # "": the cluster's default runtime
    namespace: str = "default"
    timeout_s: float = 180.0  # per node, for its pods to end


@dataclass(frozen=True, slots=True)
class Outcome:
    """Where a pod stands: ``done`` once it ended or will not start; ``ran`` when its container
    ran to its end (its log is nvidia-smi's), ``why`` and ``hint`` otherwise."""

    done: bool
    ran: bool = False
    why: str = ""
    hint: str = ""


def pod_name(node: str, resource: str, suffix: str) -> str:
    """``mig-agent-verify-<resource>-<suffix>``, a valid pod name whatever the resource."""
    short = re.sub(r"[^a-z0-9-]+", "-", resource.removeprefix("nvidia.com/").lower())
    return f"{LABEL_VALUE}-{short.strip('-')}"[:50].rstrip("-") + f"-{suffix}"


def manifest(
    name: str, node: str, resource: str, spec: PodSpec, run: str, *, scheduled: bool = False
) -> dict[str, Any]:
    """A pod of the run ``run`` pinned to ``node`` (nodeName: no scheduler, a cordoned node
    too; every taint tolerated) given one ``resource``, listing its devices. ``scheduled``: held
    to ``node`` by node affinity instead, for the scheduler to place: a resource a DeviceClass
    serves is allocated by it (it makes the pod's claim), never by the kubelet."""
    pod_spec: dict[str, Any] = {
        "nodeName": node,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "automountServiceAccountToken": False,
        "tolerations": [{"operator": "Exists"}],
        "containers": [
            {
                "name": "nvidia-smi",
                "image": spec.image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["nvidia-smi", "-L"],
                "resources": {"limits": {resource: 1}},
            }
        ],
    }
    if scheduled:
        del pod_spec["nodeName"]
        term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        pod_spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
            }
        }
    if spec.runtime_class:
        pod_spec["runtimeClassName"] = spec.runtime_class
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {
                LABEL: LABEL_VALUE,
                "mig-agent.dev/verify-node": node[:63],
                RUN_LABEL: run,
            },
        },
        "spec": pod_spec,
    }


def outcome(pod: Mapping[str, Any] | None, events: Sequence[Mapping[str, Any]]) -> Outcome:
    """Where ``pod`` (as read from the API; None when gone) stands, with its Events."""
    if pod is None:
        return Outcome(True, why="the pod was deleted meanwhile", hint=_NOT_RUN_HINT)
    status = pod.get("status") or {}
    phase = status.get("phase", "")
    states = [(c.get("state") or {}) for c in status.get("containerStatuses") or []]
    terminated = [s["terminated"] for s in states if "terminated" in s]
    waiting = [s["waiting"] for s in states if "waiting" in s]
    if phase == "Succeeded":
        return Outcome(True, ran=True)
    said = _said(status, terminated, waiting, events)
    if phase == "Failed":
        exit_codes = [t.get("exitCode") for t in terminated]
        if terminated and all(t.get("reason") in ("Error", None) for t in terminated):
            return Outcome(
                True,
                ran=True,
                why=f"nvidia-smi failed in the container (exit code {exit_codes[0]}){said}",
                hint="the driver's libraries and device nodes the runtime gives a container",
            )
        return Outcome(True, why=f"the pod failed{said}", hint=_hint(said))
    stuck = [w for w in waiting if w.get("reason") in _STUCK]
    if stuck:
        return Outcome(True, why=f"the container does not start{said}", hint=_hint(said))
    return Outcome(False, why=f"the pod is {phase or 'Pending'}{said}", hint=_hint(said))


def _said(
    status: Mapping[str, Any],
    terminated: Sequence[Mapping[str, Any]],
    waiting: Sequence[Mapping[str, Any]],
    events: Sequence[Mapping[str, Any]],
) -> str:
    """The pod's own words: its status' reason, its container's, its Warning Events'."""
    parts = []
    if status.get("reason"):
        parts.append(f"{status['reason']}: {status.get('message', '')}".rstrip(": "))
    for state in (*terminated, *waiting):
        if state.get("reason") or state.get("message"):
            parts.append(f"{state.get('reason', '')}: {state.get('message', '')}".rstrip(": "))
    for e in events:
        message = str(e.get("message", ""))
        if e.get("type") != "Warning" or e.get("reason") in _NOISE:
            continue
        if not any(message and message in p for p in parts):  # the status said it already
            parts.append(f"event {e.get('reason', '')}: {message}".rstrip(": "))
    return "".join(f"; {p}" for p in dict.fromkeys(parts))


def _hint(said: str) -> str:
    for words, hint in _HINTS:
        if any(w in said for w in words):
            return hint
    return _NOT_RUN_HINT
