"""``mig-agent admission-check``: Kueue's check controller for the AdmissionChecks whose
``spec.controllerName`` is ours. One round (``run_round``):

1. marks each of our AdmissionChecks Active (``status.conditions``: Kueue keeps a ClusterQueue
   that names an inactive check inactive), reading its parameters from its annotations
   (``mig-agent.dev/allow-evict: "true"``, ``mig-agent.dev/max-nodes: "N"``,
   ``mig-agent.dev/reject-unservable: "true"``, ``mig-agent.dev/verify: "true"``;
   ``spec.parameters`` is not read);
2. reads the Workloads that reserved quota and whose ``status.admissionChecks[]`` entry of one
   of our checks is Pending (or Ready, not yet admitted: their devices stay promised), and the
   pool as ``advise`` reads it (mig_agent.ops.advise_read); a workload admitted after our check
   was Ready whose pods (by the label its podSetUpdates gave them) are not all bound yet holds
   the devices of those still to be;
3. decides (mig_agent.core.admission_check) and writes: a relabel names its nodes in the
   Workload's annotation ``mig-agent.dev/admission-relabels`` first, then patches each node's
   layout label, conditional on its labels as read; Ready, Retry and Rejected set the entry's
   state (status subresource, with the resourceVersion read: a workload changed meanwhile is
   left for the next round); a wait sets the entry's message. Each change of state or message
   gets an Event on the Workload. Ready carries ``podSetUpdates`` pinning each pod set whose
   pods were placed on one node to it (mig_agent.core.kueue_demand.pod_set_updates). Where the
   check asks ``verify``, the nodes relabelled for a workload pass verify's checks (its tiny pods
   on the new devices) before it is Ready; a node that fails them makes it Retry, naming the
   check that failed. The round waits for those pods (seconds each; minutes at most, the pods'
   timeout), once it has written every other workload's decision.

All its state is on the objects (the annotation, the entry, the nodes' labels): a restarted
controller carries on where the last one stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Final

import structlog

from mig_agent.config.settings import Settings
from mig_agent.core import kueue_demand
from mig_agent.core.admission_check import Decision, Params, Target, Verdict, Waiting, decide
from mig_agent.core.errors import KubeError, LabelsChanged
from mig_agent.core.layout import LayoutCatalog
from mig_agent.kube.cluster import KUEUE_GROUP, KUEUE_VERSIONS, KueueCluster, ObjectRef
from mig_agent.ops.advise_read import Pool, read_pool
from mig_agent.ops.verify import NodeVerdict

log = structlog.get_logger(__name__)

CONTROLLER_NAME: Final = "mig-agent.dev/mig-layout"
RELABELS: Final = "mig-agent.dev/admission-relabels"
ALLOW_EVICT: Final = "mig-agent.dev/allow-evict"
MAX_NODES: Final = "mig-agent.dev/max-nodes"
REJECT_UNSERVABLE: Final = "mig-agent.dev/reject-unservable"
VERIFY: Final = "mig-agent.dev/verify"
PENDING, READY = "Pending", "Ready"
API_VERSION: Final = f"{KUEUE_GROUP}/{KUEUE_VERSIONS[0]}"


@dataclass(frozen=True, slots=True)
class Round:
    """What one round did: the checks it marked Active, a decision per workload, and the
    workloads it could not write (-> why)."""

    activated: tuple[str, ...] = ()
    decisions: tuple[Decision, ...] = ()
    skipped: Mapping[str, str] = field(default_factory=dict)


def run_round(
    cluster: KueueCluster,
    catalog: LayoutCatalog,
    settings: Settings,
    *,
    controller_name: str = CONTROLLER_NAME,
    selector: str = "",
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
    verify: Callable[[str], NodeVerdict] | None = None,
) -> Round:
    """One round of the controller (see the module), over the GPU nodes ``selector`` picks;
    ``verify``: verify's checks of one node, for the checks that ask them."""
    checks = [
        c
        for c in cluster.list_kueue("admissionchecks")
        if (c.get("spec") or {}).get("controllerName") == controller_name
    ]
    activated = tuple(_activate(cluster, c, now()) for c in checks if not _active(c))
    params = {_name(c): _params(c) for c in checks}
    workloads = cluster.list_kueue("workloads")
    objects = _waiting_workloads(workloads, params)
    if not objects:
        return Round(activated)
    admitted = _admitted_unbound(workloads, params)
    as_waiting = {_key(w): _as_waiting(w) for w, _ in admitted}
    read = [as_waiting.get(_key(w), w) for w in workloads]
    pool = read_pool(
        cluster, catalog, settings, selector=selector, allow_evict=True, workloads=read
    )
    waiting = [_waiting(w, check, params[check], pool) for w, check in objects]
    held = _held(cluster, admitted, pool)
    decisions = decide(waiting + held, pool.supplies, pool.left_alone, pool.budgets)
    done = list(decisions[: len(waiting)])
    skipped: dict[str, str] = {}
    later = [_asks_verify(d, w, params[check]) for (w, check), d in zip(objects, done, strict=True)]
    # verify's pods take seconds to minutes: every other workload is written first (a stable
    # sort keeps the queue's order within each)
    for i in sorted(range(len(done)), key=later.__getitem__):
        w, check = objects[i]
        if later[i]:
            done[i] = _verified(done[i], w, params[check], verify)
        try:
            _apply(cluster, settings, w, check, done[i], pool, now())
        except KubeError as exc:
            skipped[done[i].workload] = str(exc)
            log.warning("admission_check.write_failed", workload=done[i].workload, error=str(exc))
    return Round(activated, tuple(done), skipped)


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _conditions(obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list((obj.get("status") or {}).get("conditions") or ())


def _is_true(obj: Mapping[str, Any], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True" for c in _conditions(obj))


def _active(check: Mapping[str, Any]) -> bool:
    return _is_true(check, "Active")


def _stamp(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _activate(cluster: KueueCluster, check: Mapping[str, Any], t: datetime) -> str:
    active = {
        "type": "Active",
        "status": "True",
        "reason": "Active",
        "message": "mig-agent's MIG layout check controller serves it",
        "lastTransitionTime": _stamp(t),
    }
    cluster.patch_kueue(
        "admissionchecks", _name(check), {"status": {"conditions": [active]}}, status=True
    )
    log.info("admission_check.activated", check=_name(check))
    return _name(check)


def _params(check: Mapping[str, Any]) -> Params:
    notes = (check.get("metadata") or {}).get("annotations") or {}
    max_nodes = str(notes.get(MAX_NODES, "")).strip()
    return Params(
        allow_evict=str(notes.get(ALLOW_EVICT, "")).lower() == "true",
        max_nodes=int(max_nodes) if max_nodes.isdigit() and int(max_nodes) > 0 else None,
        reject_unservable=str(notes.get(REJECT_UNSERVABLE, "")).lower() == "true",
        verify=str(notes.get(VERIFY, "")).lower() == "true",
    )


def _entry(workload: Mapping[str, Any], check: str) -> Mapping[str, Any]:
    for e in (workload.get("status") or {}).get("admissionChecks") or ():
        if e.get("name") == check:
            return dict(e)
    return {}


def _waiting_workloads(
    workloads: Sequence[Mapping[str, Any]], checks: Mapping[str, Params]
) -> list[tuple[Mapping[str, Any], str]]:
    """(workload, our check it waits on), in queue order: higher priority first, then older."""
    out = []
    for w in workloads:
        if not _is_true(w, "QuotaReserved") or _is_true(w, "Admitted"):
            continue
        if _is_true(w, "Finished") or (w.get("spec") or {}).get("active") is False:
            continue
        for check in checks:
            if _entry(w, check).get("state") in (PENDING, READY):
                out.append((w, check))
                break

    def order(item: tuple[Mapping[str, Any], str]) -> tuple[int, str, str]:
        w = item[0]
        created = str((w.get("metadata") or {}).get("creationTimestamp", ""))
        return (-int((w.get("spec") or {}).get("priority") or 0), created, _key(w))

    return sorted(out, key=order)


def _admitted_unbound(
    workloads: Sequence[Mapping[str, Any]], checks: Mapping[str, Params]
) -> list[tuple[Mapping[str, Any], str]]:
    """The workloads admitted after one of our checks was Ready and not finished, each with
    the label selector of its pods."""
    return [
        (w, found)
        for w in workloads
        if _is_true(w, "Admitted")
        and not _is_true(w, "Finished")
        and (found := _pods_of(w, checks))
    ]


def _as_waiting(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    """``workload`` as not yet admitted: read as demand, its pod sets' as they wait."""
    status = {**(workload.get("status") or {})}
    status["conditions"] = [c for c in _conditions(workload) if c.get("type") != "Admitted"]
    return {**workload, "status": status}


def _held(
    cluster: KueueCluster, admitted: Sequence[tuple[Mapping[str, Any], str]], pool: Pool
) -> list[Waiting]:
    """The admitted workloads whose pods are not all bound yet (made, scheduled: seconds after
    the admission), as Ready ones holding the devices of the pods still to be bound, so that
    no later workload is marked Ready on them. Their wants are those read for them as demand
    (asks by claim included, renamed on DRA nodes as a waiting workload's are)."""
    out = []
    for w, found in admitted:
        meta = w.get("metadata") or {}
        pods = cluster.list_pods(namespace=str(meta.get("namespace", "")), label_selector=found)
        done = sum(1 for p in pods if p.node or p.finished)
        wants = [x for x in pool.wants if x.gang == f"workload:{_key(w)}"]
        if len(wants) > done:
            out.append(Waiting(_key(w), tuple(wants[done:]), ready=True))
    return out


def _asks_verify(d: Decision, w: Mapping[str, Any], params: Params) -> bool:
    """Whether ``d`` is Ready only once verify's checks pass: the check asks them and nodes
    were relabelled for ``w``."""
    return d.verdict is Verdict.READY and params.verify and bool(_relabelled(w))


def _verified(
    d: Decision,
    w: Mapping[str, Any],
    params: Params,
    verify: Callable[[str], NodeVerdict] | None,
) -> Decision:
    """``d``, or Retry where the check asks verify and a node relabelled for ``w`` fails it
    (verify's checks run once: on the round that finds the relabels done)."""
    nodes = sorted(_relabelled(w))
    if not _asks_verify(d, w, params):
        return d
    if verify is None:
        return Decision(
            d.workload,
            Verdict.WAIT,
            f"its check asks for verify ({VERIFY}), which this controller was started without",
        )
    for node in nodes:
        failed = verify(node).failed
        if failed is not None:
            log.warning("admission_check.verify_failed", workload=d.workload, node=node)
            return Decision(
                d.workload,
                Verdict.RETRY,
                f"{node} failed verify after its relabel: {failed.name}: {failed.detail}",
                _relabelled(w),  # kept on the workload: verified again when it comes back
            )
    return replace(d, message=f"{d.message}; verified {', '.join(nodes)}")


def _pods_of(workload: Mapping[str, Any], checks: Mapping[str, Params]) -> str:
    """The label selector of the pods of ``workload`` where one of our checks marked it Ready:
    the label that check's podSetUpdates put on them, else (marked Ready before the check set
    labels) its Job's; "" for none."""
    for check in checks:
        entry = _entry(workload, check)
        if entry.get("state") == READY:
            found = kueue_demand.pods_selector(entry)
            if found:
                return found
            job = _job_of(workload)
            return f"batch.kubernetes.io/job-name={job}" if job else ""
    return ""


def _job_of(workload: Mapping[str, Any]) -> str:
    """The Job that owns ``workload`` ("" for none)."""
    for o in (workload.get("metadata") or {}).get("ownerReferences") or ():
        if o.get("kind") == "Job":
            return str(o.get("name", ""))
    return ""


def _relabelled(workload: Mapping[str, Any]) -> dict[str, Target]:
    notes = (workload.get("metadata") or {}).get("annotations") or {}
    try:
        got = json.loads(notes.get(RELABELS, "") or "{}")
        return {
            str(n): Target(str(t["layout"]), {str(k): int(v) for k, v in t["resources"].items()})
            for n, t in got.items()
        }
    except (ValueError, TypeError, KeyError, AttributeError):
        return {}


def _waiting(w: Mapping[str, Any], check: str, params: Params, pool: Pool) -> Waiting:
    key = _key(w)
    wants = tuple(x for x in pool.wants if x.gang == f"workload:{key}")
    return Waiting(key, wants, params, _relabelled(w), ready=_entry(w, check).get("state") == READY)


def _apply(
    cluster: KueueCluster,
    s: Settings,
    w: Mapping[str, Any],
    check: str,
    d: Decision,
    pool: Pool,
    t: datetime,
) -> None:
    entry = _entry(w, check)
    odd = pool.not_understood.get(f"workload {d.workload}")
    if odd:
        d = Decision(d.workload, Verdict.WAIT, f"not understood: {odd}")
    if d.verdict is Verdict.READY and entry.get("state") == READY:
        return
    if d.verdict is Verdict.RELABEL:
        w = _relabel(cluster, s, w, d, pool)
    elif d.verdict is not Verdict.WAIT and _relabelled(w) and not d.relabels:
        w = _annotate(cluster, w, None)
    state = PENDING if d.verdict in (Verdict.RELABEL, Verdict.WAIT) else d.verdict.value
    updates: tuple[Mapping[str, Any], ...] = ()
    if d.verdict is Verdict.READY and d.placed:
        pins = kueue_demand.pod_set_updates(w, d.placed, pool.hostnames)
        updates = pins.updates
        d = replace(d, message="; ".join(filter(None, (d.message, pins.describe()))))
    if state == entry.get("state") and d.message == entry.get("message"):
        return
    _set_state(cluster, w, entry, (state, d.message, updates), t)
    _event(cluster, w, d)


def _relabel(
    cluster: KueueCluster, s: Settings, w: Mapping[str, Any], d: Decision, pool: Pool
) -> Mapping[str, Any]:
    """The nodes named on the workload, then relabelled each while its labels are as read;
    a node someone else relabelled meanwhile is taken off the annotation again."""
    w = _annotate(cluster, w, d.relabels)
    lost = []
    for node, target in sorted(d.relabels.items()):
        try:
            cluster.patch_node(
                node, labels={s.config_label: target.layout}, expect_labels=pool.seen[node]
            )
            log.info("admission_check.relabel", workload=d.workload, node=node, to=target.layout)
        except LabelsChanged:
            lost.append(node)
    if lost:
        kept = {n: t for n, t in d.relabels.items() if n not in lost}
        w = _annotate(cluster, w, kept or None)
    return w


def _annotate(
    cluster: KueueCluster, w: Mapping[str, Any], relabels: Mapping[str, Target] | None
) -> Mapping[str, Any]:
    value = (
        json.dumps(
            {n: {"layout": t.layout, "resources": dict(t.resources)} for n, t in relabels.items()},
            sort_keys=True,
        )
        if relabels
        else None
    )
    meta = w.get("metadata") or {}
    return cluster.patch_kueue(
        "workloads",
        str(meta.get("name", "")),
        {"metadata": {"annotations": {RELABELS: value}}},
        namespace=str(meta.get("namespace", "")),
    )


def _set_state(
    cluster: KueueCluster,
    w: Mapping[str, Any],
    entry: Mapping[str, Any],
    written: tuple[str, str, Sequence[Mapping[str, Any]]],
    t: datetime,
) -> None:
    """The check's entry at ``written``'s state, message and podSetUpdates (none but for
    Ready: Kueue applies them when it admits), the other entries as they are, written only
    while the workload is as ``w`` (its resourceVersion)."""
    state, message, updates = written
    since = entry.get("lastTransitionTime") if entry.get("state") == state else None
    mine = {**entry, "state": state, "message": message[:32768], "lastTransitionTime": since}
    mine["lastTransitionTime"] = mine["lastTransitionTime"] or _stamp(t)
    mine.pop("podSetUpdates", None)
    if updates:
        mine["podSetUpdates"] = [dict(u) for u in updates]
    entries = [
        mine if e.get("name") == entry.get("name") else e
        for e in (w.get("status") or {}).get("admissionChecks") or ()
    ]
    meta = w.get("metadata") or {}
    cluster.patch_kueue(
        "workloads",
        str(meta.get("name", "")),
        {
            "metadata": {"resourceVersion": meta.get("resourceVersion")},
            "status": {"admissionChecks": entries},
        },
        namespace=str(meta.get("namespace", "")),
        status=True,
    )


def _event(cluster: KueueCluster, w: Mapping[str, Any], d: Decision) -> None:
    meta = w.get("metadata") or {}
    reason = {
        Verdict.READY: "MIGLayoutReady",
        Verdict.RELABEL: "MIGLayoutRelabel",
        Verdict.WAIT: "MIGLayoutWaiting",
        Verdict.RETRY: "MIGLayoutRetry",
        Verdict.REJECTED: "MIGLayoutRejected",
    }[d.verdict]
    ref = ObjectRef(
        "Workload",
        str(meta.get("namespace", "")),
        str(meta.get("name", "")),
        str(meta.get("uid", "")),
        API_VERSION,
    )
    warning = d.verdict in (Verdict.RETRY, Verdict.REJECTED)
    try:
        cluster.emit_object_event(ref, reason=reason, message=d.message, warning=warning)
    except KubeError as exc:  # the state is written; an Event lost says nothing less
        log.warning("admission_check.event_failed", workload=d.workload, error=str(exc))
