"""Which running pod holds which GPU device, as the agent publishes it beside its GPU state (the
``holders`` of the gpu-state annotation), for ``advise`` and the AdmissionCheck: on a
device-plugin node only the kubelet knows which of a kind's devices a pod was given, so without
this a pod counts as losing its device whenever a relabel destroys any device of its kind.

The agent reads the kubelet's PodResources (by namespace and name) and then the node's pods (by
UID): a pod is published only if its kubelet took it (``status.startTime``) before that read
began, less a margin (startTime is in whole seconds), so the devices read are its own and not
those of a pod of the same name before it. A pod not published (started since, or nothing read)
is judged by kind, as before: the map can only make a judgement exact, never wrong. A device
plugin gives a pod its devices once, at admission, so a published entry holds for the pod's
life.

Pure module: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

MARGIN_S: Final = 2.0
# how NVIDIA's plugin names devices by default (uuid strategy), as a plan's staying devices are
UUID_PREFIXES: Final = ("GPU-", "MIG-")

# (namespace, name, uid, status.startTime in epoch seconds: None before) of a pod on the node
PodFacts = tuple[str, str, str, float | None]


def _named_by_uuid(ids: frozenset[str]) -> bool:
    return bool(ids) and all(i.startswith(UUID_PREFIXES) for i in ids)


def _taken_before(started: float | None, read_at: float) -> bool:
    return started is not None and started < read_at - MARGIN_S


def held_by_uid(
    listed: Mapping[tuple[str, str], frozenset[str]],
    pods: Iterable[PodFacts],
    read_at: float,
) -> dict[str, frozenset[str]]:
    """Pod UID -> the device ids (GPU and MIG UUIDs) the kubelet listed for it, for the pods
    whose kubelet took them before ``read_at`` (the wall time the PodResources read began) and
    whose ids are all UUIDs (a device plugin naming devices by index is not published)."""
    out: dict[str, frozenset[str]] = {}
    for namespace, name, uid, started in pods:
        ids = listed.get((namespace, name))
        if ids and _named_by_uuid(ids) and uid and _taken_before(started, read_at):
            out[uid] = ids
    return out


def unsettled(
    listed: Mapping[tuple[str, str], frozenset[str]],
    pods: Iterable[PodFacts],
    read_at: float,
) -> bool:
    """Whether a pod ``held_by_uid`` left out only for its start (not yet taken, or too near
    the read to tell from a namesake) may be published by a later read: listed by UUID, and
    among the node's pods."""
    return any(
        uid
        and _named_by_uuid(listed.get((namespace, name), frozenset()))
        and not _taken_before(started, read_at)
        for namespace, name, uid, started in pods
    )
