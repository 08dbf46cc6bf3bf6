"""The node guard: the one place that cordons a node for a change and the one that lets it go.

``paused`` cordons and pauses the GPU operands for a change, writing in the same patch what the
node is then owed (mig_agent.core.guard.Record: the GPUs as the advertiser listed them). Every
exit of every pass then calls ``settle``: it reads the record, asks NVML (and, where asked,
the advertiser restarted) and the node's pods for the facts, lets ``core.guard.decide`` say
whether the node may be schedulable, and writes the answer: operands resumed always, the
cordon lifted or kept with the record and its reason. Nothing else uncordons."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import structlog

from mig_agent.agent import marks
from mig_agent.agent.advertisers import advertiser as advertisers
from mig_agent.agent.advertisers import dra
from mig_agent.agent.change import Change, Tools
from mig_agent.config.settings import Settings
from mig_agent.core import device_taints, guard, labels
from mig_agent.core.errors import KubeForbidden, MigAgentError
from mig_agent.core.guard import Owed, Record, Verdict
from mig_agent.core.observed import NodeState
from mig_agent.kube.cluster import NodeView, PodRef
from mig_agent.node.drain import still_present

log = structlog.get_logger(__name__)

UNKNOWN = "unknown"  # the digest of GPUs no one can vouch for: only a proof clears it


def digest(state: NodeState) -> str:
    """What of the GPUs an advertiser lists, as a short digest: MIG modes and instances (their
    UUIDs included: instances made again are other devices), not processes."""
    text = repr(
        tuple((g.info.uuid, g.mig_current, g.mig_pending, g.gpu_instances) for g in state.gpus)
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextlib.contextmanager
def paused(t: Tools, change: Change) -> Iterator[list[str]]:
    """Cordon (unless cordoned already) and pause the operands for ``change``; the record of
    what the node is owed in the same patch (a kill right after leaves it to the next agent).
    Left normally, the advertiser has proven the GPUs: ``settle``. Left by an exception, the
    pass's exit settles (mig_agent.agent.reconcile)."""
    s, node = t.settings, change.node
    record = marks.record(s, node)  # one parse for all that follows
    taints = _devices_to_taint(t, change, record)
    cordon = taints is None and not node.unschedulable
    annotations: dict[str, str | None] = {}
    if cordon:
        annotations[s.cordon_annotation] = "true"
    pause = labels.pause_patch(node.labels, s.operand_labels)
    operands = labels.paused_during_change(node.labels, s.operand_labels)
    if operands:
        annotations[s.paused_annotation] = ",".join(operands)
    owed = _owed_at_the_cordon(s, node, change, record)
    change.tainted = taints is not None
    if taints is not None:  # the record first: a kill before the rules leaves it owed
        base = owed or record
        base = base or Record(layout=change.desired, gpus=digest(change.observed))
        owed = replace(base, tainted=taints.gpus)
    if owed is not None:
        annotations[s.guard_annotation] = owed.to_json()
    if annotations or pause:
        t.cluster.patch_node(
            s.node_name,
            labels=pause,
            annotations=annotations,
            unschedulable=True if cordon else None,
        )
        devices = _taint(t, taints.gpus, change.slices, taints.rules) if taints else 0
        log.info("node.paused", cordoned=cordon, tainted=devices, operands=operands)
    yield operands
    settle(t, change.desired, succeeded=True, dra_node=change.dra)


@dataclass(frozen=True)
class _Taints:
    """How a change holds its GPUs back instead of a cordon."""

    gpus: tuple[str, ...]  # the GPUs (UUIDs) whose devices to taint
    rules: list[dict[str, Any]]  # the DeviceTaintRules as the permission probe listed them


def _devices_to_taint(t: Tools, change: Change, record: Record | None) -> _Taints | None:
    """The GPUs (UUIDs) whose devices to taint instead of a cordon, with those an earlier pass
    tainted; None for the cordon: not a DRA node, taints off or not served, the node cordoned
    by the agent already, a record (the node's, as parsed) that owes a cordon or is unreadable,
    or nothing of the GPUs that change listed (nothing to hold back but a listing to come: the
    cordon holds that)."""
    s, node = t.settings, change.node
    if not (change.dra and s.device_taints) or s.cordon_annotation in node.annotations:
        return None
    if s.guard_annotation in node.annotations and (
        record is None or not (record.empty or record.tainted)
    ):
        return None
    if not t.cluster.device_taints_served():
        log.warning("devices.taints_not_served", fallback="cordon")
        t.metrics.taint_fallbacks.inc()
        return None
    rules = _listed_taints(t)
    if rules is None:
        t.metrics.taint_fallbacks.inc()
        return None
    changing = {change.observed.gpu(i).info.uuid for i in change.plan.changed_gpus}
    slices = change.slices
    if slices is None:
        slices = change.slices = t.cluster.list_resource_slices(s.node_name)
    if not device_taints.devices_of_gpus(slices, s.node_name, changing):
        return None
    return _Taints(tuple(sorted({*changing, *(record.tainted if record else ())})), rules)


def _listed_taints(t: Tools) -> list[dict[str, Any]] | None:
    """The DeviceTaintRules as listed now (handed on to ``_taint``: one request), or None
    where the agent may not list them: an install whose RBAC predates them (no
    devicetaintrules) gets the cordon, said once a pass, rather than a failed change."""
    try:
        return t.cluster.list_device_taints()
    except KubeForbidden as exc:
        log.warning("devices.taints_forbidden", error=str(exc), fallback="cordon")
        return None


def _taint(
    t: Tools,
    gpus: tuple[str, ...],
    slices: list[dict[str, Any]] | None = None,
    rules: list[dict[str, Any]] | None = None,
) -> int:
    """A rule for each device the node's slices list now for these GPUs that has none yet (a
    device listed since the last taint, under a name of its own, is taken out too): how many
    devices are tainted. ``slices`` and ``rules``: as the caller listed them, else listed."""
    node = t.settings.node_name
    if slices is None:
        slices = t.cluster.list_resource_slices(node)
    if rules is None:
        rules = t.cluster.list_device_taints()
    devices = device_taints.devices_of_gpus(slices, node, gpus)
    have = device_taints.rules_of_node(rules, node)
    for device in devices:
        if device not in have:
            t.cluster.create_device_taint(device_taints.rule(node, device, t.settings.taint_key))
    return len(set(devices) | set(have))


def _untaint(t: Tools) -> int:
    """Every rule of the agent's for the node's devices deleted: how many there were."""
    have = device_taints.rules_of_node(t.cluster.list_device_taints(), t.settings.node_name)
    for name in have.values():
        t.cluster.delete_device_taint(name)
    return len(have)


def _owed_at_the_cordon(
    s: Settings, node: NodeView, change: Change, record: Record | None
) -> Record | None:
    """The record as the cordon leaves it: the GPUs' digest as the advertiser lists them now
    added to what the node is owed already (``record``, the node's as parsed: a failed drain's
    window, pods evicted); None: left as is (an annotation the agent never wrote: settle proves
    the GPUs again).

    An older digest that the GPUs no longer match vouches for nothing now: since the GPUs
    changed, the advertiser may have listed them (resumed by the last pass, or restarted on its
    own), and a change back to the old layout would match the digest over a listing of the
    other one. Only a proof clears it then (UNKNOWN)."""
    if s.guard_annotation not in node.annotations:
        return Record(layout=change.desired, gpus=digest(change.observed))
    if record is None:
        return None
    if not record.gpus:
        return replace(record, gpus=digest(change.observed))
    if record.gpus not in (UNKNOWN, digest(change.observed)):
        return replace(record, gpus=UNKNOWN)
    return None


@dataclass(frozen=True)
class Settled:
    verdict: Verdict
    note: str = ""  # what was done for the listing (a restart of the advertiser), for reasons


def settle(
    t: Tools,
    desired: str | None,
    *,
    node: NodeView | None = None,
    owed: Owed | None = None,
    succeeded: bool = False,
    readvertise: bool = False,
    dra_node: bool | None = None,
) -> Settled:
    """End of a pass, whichever way it ends: the node schedulable or kept cordoned as the
    record, the facts and ``core.guard.decide`` say, operands resumed. ``succeeded``: the layout
    is in place and the pass saw the advertiser list the GPUs as they are (nothing is owed).
    ``readvertise``: the advertiser is restarted and waited for when the GPUs changed since it
    listed them (not for a stop or a relabel: the agent goes, or the next pass advertises).
    ``node`` as just read, where the caller has it; no request at all when the node carries
    none of the guard's marks."""
    s = t.settings
    owed = owed or Owed()
    node = node or t.cluster.get_node(s.node_name)
    record = _record(s, node, desired)
    if record is None and owed == Owed() and not _marks(s, node):
        return Settled(Verdict(True, None))
    record = guard.merged(record or Record(layout=desired or ""), desired, owed)
    tainted = record.tainted
    if succeeded:
        record = Record(layout=record.layout, tainted=tainted)
    now = _gpus_now(t) if record.gpus else ""
    note, proven = "", succeeded
    if record.gpus and now != record.gpus and not proven and readvertise:
        proven, note = _readvertise(t, node, dra_node)
        node = t.cluster.get_node(s.node_name)  # the plugin's restart may have resumed one
    verdict = guard.decide(
        record,
        guard.Facts(
            gpus_now=now,
            proven=proven,
            present=_present(t, record),
            now=t.clock.wall(),
            give_up_s=s.drain_give_up_s,
            advertiser=_name(dra_node),
        ),
    )
    if tainted:
        _taints(t, verdict)
    _write(t, node, verdict)
    return Settled(verdict, note)


def _taints(t: Tools, verdict: Verdict) -> None:
    """The device taints as the verdict wants them, before the node's record says so (a
    failure here leaves the record, and the next settle tries again): lifted, or kept (made
    again where someone deleted one while owed)."""
    if verdict.schedulable:
        lifted = _untaint(t)
        log.info("devices.untainted", rules=lifted)
        return
    assert verdict.record is not None  # a reason keeps a debt
    devices = _taint(t, verdict.record.tainted)
    log.warning("devices.taint_kept", reason=verdict.why, devices=devices)


def _record(s: Settings, node: NodeView, desired: str | None) -> Record | None:
    if s.guard_annotation not in node.annotations:
        return None
    # one the agent never wrote vouches for nothing: the GPUs must be proven again
    return marks.record(s, node) or Record(layout=desired or "", gpus=UNKNOWN)


def _marks(s: Settings, node: NodeView) -> bool:
    return s.cordon_annotation in node.annotations or s.paused_annotation in node.annotations


def _gpus_now(t: Tools) -> str:
    try:
        return digest(t.gpus.observe())
    except MigAgentError as exc:  # unreadable GPUs prove nothing
        log.warning("guard.gpus_unreadable", error=str(exc))
        return ""


def _present(t: Tools, record: Record) -> frozenset[str]:
    names = set(record.evicted) | set(record.given_up)
    if not names:
        return frozenset()
    refs = [PodRef(*n.split("/", 1)) for n in names]
    try:
        left = still_present(t.cluster, t.settings.node_name, refs)
    except MigAgentError as exc:  # not known to be gone: still there
        log.warning("guard.pods_unknown", error=str(exc))
        return frozenset(names)
    return frozenset(str(r) for r in left)


def _name(dra_node: bool | None) -> str:
    return advertisers.DraPlugin.name if dra_node else advertisers.DevicePlugin.name


def _readvertise(t: Tools, node: NodeView, dra_node: bool | None) -> tuple[bool, str]:
    """Restart the advertiser and wait for it to list the GPUs as they are (best effort):
    whether it did, and what was done, as the failure's reason says it."""
    s = t.settings
    try:
        if dra_node is None:
            dra_node = dra.find(t.cluster, s, t.cluster.list_pods(node=s.node_name)) is not None
        advertiser: advertisers.Advertiser = (
            advertisers.DraPlugin(t) if dra_node else advertisers.DevicePlugin(t)
        )
        operands = [o for o in node.annotations.get(s.paused_annotation, "").split(",") if o]
        # every plugin pod there now is an old one: one that outlived a short pause of its
        # operand would otherwise pass for the restarted one
        old = {p.ref.uid for p in advertiser.find()}
        log.warning("guard.readvertising", advertiser=advertiser.name, old=len(old))
        advertiser.advertise(node, t.gpus.models(), operands, old)
    except MigAgentError as err:
        name = _name(dra_node)
        return False, (
            f"the GPUs had changed and {name} does not advertise them as they are now ({err})"
        )
    return True, (
        f"the GPUs had changed: {advertiser.name} was restarted and advertises them as they are now"
    )


def _write(t: Tools, node: NodeView, verdict: Verdict) -> None:
    """The verdict on the node in one patch: operands resumed, the record kept or cleared,
    the agent's cordon lifted or kept (set again if someone lifted it while owed)."""
    s = t.settings
    resume = labels.resume_patch(node.labels, s.operand_labels)
    annotations: dict[str, str | None] = {}
    if s.paused_annotation in node.annotations:
        annotations[s.paused_annotation] = None
    kept = verdict.record.to_json() if verdict.record else None
    if node.annotations.get(s.guard_annotation) != kept:
        annotations[s.guard_annotation] = kept
    unschedulable = _cordon(s, node, verdict, annotations)
    if resume or annotations or unschedulable is not None:
        t.cluster.patch_node(
            s.node_name, labels=resume, annotations=annotations, unschedulable=unschedulable
        )
        if verdict.schedulable:
            log.info("node.resumed", uncordoned=unschedulable is False, operands=sorted(resume))
        else:
            log.warning("node.cordon_kept", reason=verdict.why, operands=sorted(resume))


def _cordon(
    s: Settings, node: NodeView, verdict: Verdict, annotations: dict[str, str | None]
) -> bool | None:
    """The cordon as the verdict wants it: None (as it is), False (lifted), True (set)."""
    ours = s.cordon_annotation in node.annotations
    if not verdict.schedulable:
        if node.unschedulable or (verdict.record and verdict.record.tainted and not ours):
            return None  # cordoned, or held back by its devices' taints instead
        annotations[s.cordon_annotation] = "true"  # lifted by hand while owed: set again
        log.warning("node.cordoned_again", reason=verdict.why)
        return True
    if not ours:
        return None
    annotations[s.cordon_annotation] = None
    if node.unschedulable and not node.cordoned_by_agent:
        log.info(
            "node.cordon_kept",
            reason="cordoned again by someone else",
            managers=list(node.unschedulable_by),
        )
        return None
    return False if node.unschedulable else None
