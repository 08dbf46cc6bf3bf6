"""What a round of the MIG layout check reads: the Workloads waiting on one of our checks, in
queue order; those admitted whose pods are not all bound yet; and each as the decision's
``Waiting``, its ledger (mig_agent.core.admission_ledger) set against the pool as read now.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from mig_agent.config.settings import Settings
from mig_agent.core import admission_ledger as ledger
from mig_agent.core import kueue_demand
from mig_agent.core.admission_check import Params, Target, Waiting
from mig_agent.core.advise_assign import Want
from mig_agent.core.kueue_demand import is_true
from mig_agent.kube.cluster import KueueCluster, PodView
from mig_agent.ops.advise_read import Pool

PENDING, READY = "Pending", "Ready"
Listed = Sequence[Mapping[str, Any]]
Pairs = Sequence[tuple[Mapping[str, Any], str]]  # workload, our check


def key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def conditions(obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list((obj.get("status") or {}).get("conditions") or ())


def entry(workload: Mapping[str, Any], check: str) -> Mapping[str, Any]:
    """The workload's admission check state of ``check`` ({} for none)."""
    for e in (workload.get("status") or {}).get("admissionChecks") or ():
        if e.get("name") == check:
            return dict(e)
    return {}


def waiting_workloads(
    workloads: Listed, checks: Mapping[str, Params]
) -> list[tuple[Mapping[str, Any], str]]:
    """(workload, our check it waits on), in queue order: higher priority first, then older."""
    out = []
    for w in workloads:
        if not is_true(w, "QuotaReserved") or is_true(w, "Admitted"):
            continue
        if is_true(w, "Finished") or (w.get("spec") or {}).get("active") is False:
            continue
        for check in checks:
            if entry(w, check).get("state") in (PENDING, READY):
                out.append((w, check))
                break

    def order(item: tuple[Mapping[str, Any], str]) -> tuple[int, str, str]:
        w = item[0]
        created = str((w.get("metadata") or {}).get("creationTimestamp", ""))
        return (-int((w.get("spec") or {}).get("priority") or 0), created, key(w))

    return sorted(out, key=order)


def admitted_unbound(
    workloads: Listed, checks: Mapping[str, Params]
) -> list[tuple[Mapping[str, Any], str]]:
    """The workloads admitted after one of our checks was Ready and not finished, each with
    that check."""
    return [
        (w, check)
        for w in workloads
        if is_true(w, "Admitted") and not is_true(w, "Finished") and (check := _ready_by(w, checks))
    ]


def as_waiting(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    """``workload`` as not yet admitted: read as demand, its pod sets' as they wait."""
    status = {**(workload.get("status") or {})}
    status["conditions"] = [c for c in conditions(workload) if c.get("type") != "Admitted"]
    return {**workload, "status": status}


def wants_of(pool: Pool, workload: Mapping[str, Any]) -> tuple[Want, ...]:
    return tuple(x for x in pool.wants if x.gang == f"workload:{key(workload)}")


def waiting(
    w: Mapping[str, Any], check: str, params: Params, read: tuple[Pool, Settings], t: datetime
) -> Waiting:
    """``w`` as the decision takes it: its relabel intents set against its nodes now (those
    whose write never landed to be written again; those relabelled elsewhere or gone dropped,
    with why), its promise while it is Ready (kept only whole), the nodes it is kept off."""
    pool, s = read
    wants = wants_of(pool, w)
    relabelled: dict[str, Target] = {}
    unwritten: set[str] = set()
    lost: dict[str, str] = {}
    for node, intent in ledger.intents_of(w).items():
        labels = pool.labels.get(node)
        now = (labels or {}).get(s.config_label)
        fate = ledger.fate(intent, now, labels is not None)
        if fate is ledger.Fate.GONE:
            lost[node] = "left the pool (deleted, or no longer selected)"
        elif fate is ledger.Fate.AWAY:
            lost[node] = f"was relabelled to {now} meanwhile, not by this check"
        else:
            relabelled[node] = Target(intent.layout, intent.resources)
            if fate is ledger.Fate.UNWRITTEN:
                unwritten.add(node)
    ready = entry(w, check).get("state") == READY
    promised = ledger.kept(wants, ledger.promise_of(w), {}) if ready else {}
    if len(promised) != len(wants):
        promised = {}
    avoid = {**ledger.avoided(w, t.timestamp()), **lost}  # kept off what went elsewhere
    return Waiting(
        key(w), wants, params, relabelled, ready, promised, frozenset(unwritten), lost, avoid
    )


def held(
    cluster: KueueCluster, admitted: Pairs, pool: Pool
) -> tuple[list[Waiting], list[tuple[Mapping[str, Any], str]]]:
    """The admitted workloads whose pods are not all bound yet (made, scheduled: seconds after
    the admission), each holding the devices promised to its pods still to bind: per pod set,
    its promise less the pods bound or finished, by node (a workload admitted before promises
    were recorded: per pod set, as many of its wants as its pods still to bind, placed where
    they fit). Their wants are those read for them as demand (asks by claim included). Each
    with its workload and check."""
    out, pairs = [], []
    for w, check in admitted:
        meta = w.get("metadata") or {}
        found = _pods_of(w, check)
        if not found:
            continue
        pods = cluster.list_pods(namespace=str(meta.get("namespace", "")), label_selector=found)
        wants = wants_of(pool, w)
        done = _done_by_set(pods, wants)
        promise = ledger.promise_of(w)
        promised = ledger.kept(wants, promise, done) if promise else {}
        left = tuple(x for x in wants if x.pod in promised) if promise else _unbound(wants, done)
        if left:
            out.append(Waiting(key(w), left, ready=True, promised=promised, admitted=True))
            pairs.append((w, check))
    return out, pairs


def _done_by_set(pods: Sequence[PodView], wants: Sequence[Want]) -> dict[str, dict[str, int]]:
    """Pod set -> node -> the workload's pods there bound or finished."""
    sets: dict[str, set[str]] = {}
    for x in wants:
        sets.setdefault(kueue_demand.pod_set_of(x.pod), set()).add(x.kind)
    done: dict[str, dict[str, int]] = {}
    for p in pods:
        if p.node or p.finished:
            pod_set = ledger.pod_set_of_pod(p.labels, p.gpu_requests, sets)
            by_node = done.setdefault(pod_set, {})
            by_node[p.node] = by_node.get(p.node, 0) + 1
    return done


def _unbound(wants: Sequence[Want], done: Mapping[str, Mapping[str, int]]) -> tuple[Want, ...]:
    """Per pod set, its wants less as many as its pods bound or finished."""
    skip = {pod_set: sum(nodes.values()) for pod_set, nodes in done.items()}
    out = []
    for x in wants:
        pod_set = kueue_demand.pod_set_of(x.pod)
        if skip.get(pod_set, 0) > 0:
            skip[pod_set] -= 1
        else:
            out.append(x)
    return tuple(out)


def _ready_by(workload: Mapping[str, Any], checks: Mapping[str, Params]) -> str:
    """The one of our checks that marked ``workload`` Ready ("" for none)."""
    return next((c for c in checks if entry(workload, c).get("state") == READY), "")


def _pods_of(workload: Mapping[str, Any], check: str) -> str:
    """The label selector of the pods of ``workload``, which ``check`` marked Ready: the label
    its podSetUpdates put on them, else (marked Ready before the check set labels) its Job's;
    "" for none."""
    found = kueue_demand.pods_selector(entry(workload, check))
    if found:
        return found
    job = _job_of(workload)
    return f"batch.kubernetes.io/job-name={job}" if job else ""


def _job_of(workload: Mapping[str, Any]) -> str:
    """The Job that owns ``workload`` ("" for none)."""
    for o in (workload.get("metadata") or {}).get("ownerReferences") or ():
        if o.get("kind") == "Job":
            return str(o.get("name", ""))
    return ""
