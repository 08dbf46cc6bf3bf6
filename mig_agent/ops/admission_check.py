"""``mig-agent admission-check``: Kueue's check controller for the AdmissionChecks whose
``spec.controllerName`` is ours. One round (``run_round``):

1. reads each of our AdmissionChecks' parameters from its annotations
   (``mig-agent.dev/allow-evict: "true"``, ``mig-agent.dev/max-nodes: "N"``,
   ``mig-agent.dev/reject-unservable: "true"``, ``mig-agent.dev/verify: "true"``;
   ``spec.parameters`` is not read) and marks it Active (``status.conditions``: Kueue keeps a
   ClusterQueue that names an inactive check inactive), or, where an annotation is not what it
   must be, inactive with reason ``InvalidParameters`` and a Warning Event naming it and its
   value (its workloads are left alone until it is mended);
2. reads the Workloads that reserved quota and whose ``status.admissionChecks[]`` entry of one
   of our checks is Pending (or Ready, not yet admitted), those admitted after our check was
   Ready whose pods (by the label its podSetUpdates gave them) are not all bound yet, the pool
   as ``advise`` reads it (mig_agent.ops.advise_read), and each workload's ledger
   (mig_agent.core.admission_ledger, mig_agent.ops.admission_read): the promise of a Ready or
   admitted workload is kept where it was made, never placed again;
3. decides (mig_agent.core.admission_check) and writes, the ledger first: a relabel is recorded
   on the Workload (``mig-agent.dev/admission-relabels``: target, the label before, not yet
   landed), then each node's layout label is patched, conditional on its labels as read, then
   the record marks the writes that landed (one that did not is written again next round);
   Ready records the promise (``mig-agent.dev/admission-promise``) and sets the entry with
   ``podSetUpdates`` pinning each pod set whose pods were placed on one node to it and labelling
   its pods with the workload's UID and their pod set; Retry (with ``requeueAfterSeconds``
   doubling from 15 s to 10 min by Kueue's ``retryCount``) and Rejected drop the record. Status
   writes carry the resourceVersion read: a workload changed meanwhile is left for the next
   round. Each change of state or message gets an Event on the Workload. Where the check asks
   ``verify``, the relabelled nodes its pods are placed on pass verify's checks (its tiny pods
   on the new devices) before it is Ready; a node that fails them makes it Retry and keeps it
   off that node for 10 minutes (``mig-agent.dev/admission-avoid``). The round waits for those
   pods (seconds each; minutes at most), once it has written every other workload's decision.

All its state is on the objects (the ledger's annotations, the entry, the nodes' labels): a
restarted controller, or the next leader, carries on where the last one stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Final

import structlog

from mig_agent.config.settings import Settings
from mig_agent.core import admission_ledger as ledger
from mig_agent.core import kueue_demand
from mig_agent.core.admission_check import Decision, Params, Target, Verdict, decide
from mig_agent.core.errors import KubeError, LabelsChanged
from mig_agent.core.layout import LayoutCatalog
from mig_agent.kube.cluster import KUEUE_GROUP, KUEUE_VERSIONS, KueueCluster, ObjectRef
from mig_agent.ops import admission_read as read
from mig_agent.ops.admission_read import PENDING, READY, entry, key
from mig_agent.ops.advise_read import Pool, read_pool
from mig_agent.ops.verify import NodeVerdict

log = structlog.get_logger(__name__)

CONTROLLER_NAME: Final = "mig-agent.dev/mig-layout"
RELABELS: Final = ledger.RELABELS
ALLOW_EVICT: Final = "mig-agent.dev/allow-evict"
MAX_NODES: Final = "mig-agent.dev/max-nodes"
REJECT_UNSERVABLE: Final = "mig-agent.dev/reject-unservable"
VERIFY: Final = "mig-agent.dev/verify"
API_VERSION: Final = f"{KUEUE_GROUP}/{KUEUE_VERSIONS[0]}"
AVOID_S: Final = 600  # how long a node that failed verify for a workload is kept from it


@dataclass(frozen=True, slots=True)
class Round:
    """What one round did: the checks it marked Active, a decision per workload, the
    workloads it could not write (-> why), the checks refused (-> why)."""

    activated: tuple[str, ...] = ()
    decisions: tuple[Decision, ...] = ()
    skipped: Mapping[str, str] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)


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
    got = {_name(c): (c, read_params(c)) for c in checks}
    activated = tuple(n for n, (c, p) in got.items() if _mark(cluster, c, p, now()))
    refused = {n: p for n, (_, p) in got.items() if isinstance(p, str)}
    params = {n: p for n, (_, p) in got.items() if isinstance(p, Params)}
    workloads = cluster.list_kueue("workloads")
    objects = read.waiting_workloads(workloads, params)
    admitted = read.admitted_unbound(workloads, params)
    if not objects and not admitted:
        return Round(activated, refused=refused)
    as_waiting = {key(w): read.as_waiting(w) for w, _ in admitted}
    listed = [as_waiting.get(key(w), w) for w in workloads]
    pool = read_pool(
        cluster, catalog, settings, selector=selector, allow_evict=True, workloads=listed
    )
    t = now()
    waiting = [read.waiting(w, c, params[c], (pool, settings), t) for w, c in objects]
    held, holding = read.held(cluster, admitted, pool)
    decisions = decide(waiting + held, pool.supplies, pool.left_alone, pool.budgets)
    # an admitted workload is written only to be requeued (its devices gone)
    requeued = [
        (pair, d)
        for pair, d in zip(holding, decisions[len(waiting) :], strict=True)
        if d.verdict is Verdict.RETRY
    ]
    objects += [pair for pair, _ in requeued]
    done = list(decisions[: len(waiting)]) + [d for _, d in requeued]
    later = [_verified_on(d, w, params[c]) for (w, c), d in zip(objects, done, strict=True)]
    skipped: dict[str, str] = {}
    # verify's pods take seconds to minutes: every other workload is written first (a stable
    # sort keeps the queue's order within each)
    for i in sorted(range(len(done)), key=lambda i: bool(later[i])):
        w, check = objects[i]
        if later[i]:
            done[i] = _verified(done[i], later[i], verify)
        try:
            _apply(cluster, settings, (w, check), done[i], pool, now())
        except KubeError as exc:
            skipped[done[i].workload] = str(exc)
            log.warning("admission_check.write_failed", workload=done[i].workload, error=str(exc))
    return Round(activated, tuple(done), skipped, refused)


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def _stamp(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _mark(cluster: KueueCluster, check: Mapping[str, Any], got: Params | str, t: datetime) -> bool:
    """The check's Active condition as ``got`` says (its parameters, or why they are
    refused), written where it says otherwise now; a refusal gets a Warning Event on the
    check naming the annotations. True where it was marked Active."""
    ok = isinstance(got, Params)
    active = {
        "type": "Active",
        "status": "True" if ok else "False",
        "reason": "Active" if ok else "InvalidParameters",
        "message": "mig-agent's MIG layout check controller serves it" if ok else str(got),
    }
    now = next((c for c in read.conditions(check) if c.get("type") == "Active"), {})
    if all(now.get(k) == v for k, v in active.items()):
        return False
    active["lastTransitionTime"] = _stamp(t)
    try:
        cluster.patch_kueue(
            "admissionchecks", _name(check), {"status": {"conditions": [active]}}, status=True
        )
    except KubeError as exc:  # written again next round
        log.warning("admission_check.mark_failed", check=_name(check), error=str(exc))
        return False
    if ok:
        log.info("admission_check.activated", check=_name(check))
        return True
    log.warning("admission_check.refused", check=_name(check), why=str(got))
    meta = check.get("metadata") or {}
    ref = ObjectRef("AdmissionCheck", "", _name(check), str(meta.get("uid", "")), API_VERSION)
    try:
        cluster.emit_object_event(ref, reason="InvalidParameters", message=str(got), warning=True)
    except KubeError as exc:
        log.warning("admission_check.event_failed", check=_name(check), error=str(exc))
    return False


def read_params(check: Mapping[str, Any]) -> Params | str:
    """The check's parameters from its annotations, or why they are refused: each annotation
    that is there must be what it must be (``"true"``/``"false"``; ``max-nodes`` a whole
    number above 0), never read as a default."""
    notes = (check.get("metadata") or {}).get("annotations") or {}
    bad: list[str] = []

    def flag(key: str) -> bool:
        value = notes.get(key)
        if value is None or str(value).strip().lower() in ("true", "false"):
            return str(value).strip().lower() == "true"
        bad.append(f'{key}: {str(value)!r} is not "true" or "false"')
        return False

    got = Params(flag(ALLOW_EVICT), None, flag(REJECT_UNSERVABLE), flag(VERIFY))
    raw = notes.get(MAX_NODES)
    if raw is not None:
        text = str(raw).strip()
        if text.isascii() and text.isdigit() and int(text) > 0:
            got = replace(got, max_nodes=int(text))
        else:
            bad.append(f"{MAX_NODES}: {str(raw)!r} is not a whole number above 0")
    if bad:
        return "refused: " + "; ".join(bad)
    return got


def _verified_on(d: Decision, w: Mapping[str, Any], params: Params) -> list[str]:
    """The nodes verify's checks must pass before ``d`` is Ready: where the check asks them,
    the nodes its pods are placed on that were relabelled for ``w`` or failed verify for it
    before."""
    if d.verdict is not Verdict.READY or not params.verify:
        return []
    asked = set(ledger.intents_of(w)) | ledger.failed_verify(w)
    return sorted(asked & set(d.placed.values()))


def _verified(
    d: Decision, nodes: list[str], verify: Callable[[str], NodeVerdict] | None
) -> Decision:
    """``d``, or Retry where one of ``nodes`` fails verify's checks (run once: on the round
    that finds the relabels done); the workload is then kept off that node for a while."""
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
            why = f"failed verify after its relabel: {failed.name}: {failed.detail}"
            return Decision(
                d.workload,
                Verdict.RETRY,
                f"{node} {why}; kept off it for {AVOID_S // 60} min",
                avoid={node: why},
            )
    return replace(d, message=f"{d.message}; verified {', '.join(nodes)}")


def _apply(
    cluster: KueueCluster,
    s: Settings,
    waits: tuple[Mapping[str, Any], str],
    d: Decision,
    pool: Pool,
    t: datetime,
) -> None:
    """``d`` written: the ledger first (relabels, promise, avoided nodes), the nodes' labels
    for a relabel, then the check's entry and an Event where its state or message changes."""
    w, check = waits
    e = entry(w, check)
    odd = pool.not_understood.get(f"workload {d.workload}")
    if odd:
        d = Decision(d.workload, Verdict.WAIT, f"not understood: {odd}")
    promise = ledger.promise_from(d.placed) if d.verdict is Verdict.READY else {}
    pins = kueue_demand.Pins()
    if d.verdict is Verdict.READY and d.placed:
        pins = kueue_demand.pod_set_updates(w, d.placed, pool.hostnames)
    settled = not ledger.intents_of(w) and not ledger.failed_verify(w)
    # the promise and the pins Kueue will apply agree (the two are written one after the
    # other: a status write refused after the promise's leaves them apart, mended here)
    pinned = list(e.get("podSetUpdates") or ()) == [dict(u) for u in pins.updates]
    kept = settled and pinned and promise == ledger.promise_of(w)
    if d.verdict is Verdict.READY and e.get("state") == READY and kept:
        return  # kept where it was promised: nothing to write
    # a promise made is written before the entry, one dropped after it: a write refused in
    # between never leaves an entry Ready without its promise
    record = {ledger.PROMISE: ledger.promise_value(promise)} if promise else {}
    if d.avoid:
        record[ledger.AVOID] = ledger.avoid_value(w, d.avoid, t.timestamp() + AVOID_S)
    elif d.verdict is Verdict.READY:
        record[ledger.AVOID] = None
    if d.verdict is Verdict.RELABEL:
        w = _relabel(cluster, s, _record(cluster, w, record), d, pool)
    else:
        intents = _intents(w, d.relabels, pool, s)
        w = _record(cluster, w, {**record, ledger.RELABELS: ledger.intents_value(intents)})
    state = PENDING if d.verdict in (Verdict.RELABEL, Verdict.WAIT) else d.verdict.value
    if pins.updates or pins.not_pinned:
        d = replace(d, message="; ".join(filter(None, (d.message, pins.describe()))))
    if state != e.get("state") or d.message != e.get("message") or state == READY:
        w = _set_state(cluster, w, e, (state, d.message, pins.updates), t)
        _event(cluster, w, d)
    if not promise:
        _record(cluster, w, {ledger.PROMISE: None})


def _intents(
    w: Mapping[str, Any], relabels: Mapping[str, Target], pool: Pool, s: Settings
) -> dict[str, ledger.Intent]:
    """The record of ``relabels``: those recorded already as they are, new ones with the
    node's layout label before and not yet landed."""
    had = ledger.intents_of(w)
    return {
        n: had.get(n)
        or ledger.Intent(
            t.layout, dict(t.resources), pool.labels.get(n, {}).get(s.config_label), False
        )
        for n, t in relabels.items()
    }


def _relabel(
    cluster: KueueCluster, s: Settings, w: Mapping[str, Any], d: Decision, pool: Pool
) -> Mapping[str, Any]:
    """The relabels recorded on the workload, then each node's label written (unless it is
    the target already) while its labels are as read, then the record says which landed; a
    node someone else relabelled meanwhile is taken off it again. A write that fails leaves
    its intent unlanded: written again next round."""
    intents = _intents(w, d.relabels, pool, s)
    w = _record(cluster, w, {ledger.RELABELS: ledger.intents_value(intents)})
    landed, lost = [], []
    for node, intent in sorted(intents.items()):
        labels = pool.labels.get(node, {})
        if labels.get(s.config_label) != intent.layout:
            try:
                cluster.patch_node(
                    node, labels={s.config_label: intent.layout}, expect_labels=labels
                )
                log.info(
                    "admission_check.relabel", workload=d.workload, node=node, to=intent.layout
                )
            except LabelsChanged:
                lost.append(node)
                continue
        landed.append(node)
    kept = {n: i for n, i in intents.items() if n not in lost}
    return _record(cluster, w, {ledger.RELABELS: ledger.intents_value(ledger.landed(kept, landed))})


def _record(
    cluster: KueueCluster, w: Mapping[str, Any], values: Mapping[str, str | None]
) -> Mapping[str, Any]:
    """The ledger's annotations on ``w`` set to ``values`` (None: removed), written only where
    one differs from what ``w`` carries."""
    notes = ledger.notes_of(w)
    changed = {k: v for k, v in values.items() if notes.get(k) != v}
    if not changed:
        return w
    meta = w.get("metadata") or {}
    return cluster.patch_kueue(
        "workloads",
        str(meta.get("name", "")),
        {"metadata": {"annotations": changed}},
        namespace=str(meta.get("namespace", "")),
    )


def _set_state(
    cluster: KueueCluster,
    w: Mapping[str, Any],
    e: Mapping[str, Any],
    written: tuple[str, str, Sequence[Mapping[str, Any]]],
    t: datetime,
) -> Mapping[str, Any]:
    """The check's entry at ``written``'s state, message and podSetUpdates (none but for
    Ready: Kueue applies them when it admits; Retry asks Kueue to wait before queueing it
    again, longer each time), the other entries as they are, written only while the
    workload is as ``w`` (its resourceVersion)."""
    state, message, updates = written
    since = e.get("lastTransitionTime") if e.get("state") == state else None
    mine = {**e, "state": state, "message": message[:32768], "lastTransitionTime": since}
    mine["lastTransitionTime"] = mine["lastTransitionTime"] or _stamp(t)
    mine.pop("podSetUpdates", None)
    mine.pop("requeueAfterSeconds", None)
    if updates:
        mine["podSetUpdates"] = [dict(u) for u in updates]
    if state == Verdict.RETRY.value:
        mine["requeueAfterSeconds"] = ledger.retry_after(int(e.get("retryCount") or 0))
    entries = [
        mine if x.get("name") == e.get("name") else x
        for x in (w.get("status") or {}).get("admissionChecks") or ()
    ]
    meta = w.get("metadata") or {}
    return cluster.patch_kueue(
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
