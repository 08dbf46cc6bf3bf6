"""The MIG layout check's ledger: what it promised each workload and the relabels it made for
it, kept on the Workload as annotations and read back first every round, never re-derived.

- A **promise** (``mig-agent.dev/admission-promise``): where the check placed a Ready
  workload's pods, pod set -> node -> pods. It holds those devices on those nodes until the
  pods hold them themselves (bound or finished), the workload is gone, or it is no longer
  Ready or admitted. A Ready workload is never placed again while its promise can be kept.
- A **relabel intent** (``mig-agent.dev/admission-relabels``): node -> the layout it was
  relabelled to, the devices that makes, the layout label as read before, and whether the
  node's write landed. Each round sets it against the node as it is now (``fate``): written
  again where the write did not land, dropped where the node went elsewhere or is gone.
- **Avoided nodes** (``mig-agent.dev/admission-avoid``): nodes that failed verify's checks
  for the workload, with why and until when it is placed elsewhere.

Pure module: no I/O.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from mig_agent.core.advise_assign import Want
from mig_agent.core.kueue_demand import POD_SET_LABEL, is_true, pod_set_of

PROMISE: Final = "mig-agent.dev/admission-promise"
RELABELS: Final = "mig-agent.dev/admission-relabels"
AVOID: Final = "mig-agent.dev/admission-avoid"
KUEUE_POD_SET_LABEL: Final = "kueue.x-k8s.io/podset"

Promise = Mapping[str, Mapping[str, int]]  # pod set -> node -> pods


@dataclass(frozen=True, slots=True)
class Intent:
    """A relabel the check made: the node's layout label ``before`` -> ``layout``, which makes
    ``resources`` there; ``landed``: the node's write was seen to succeed (records written
    before intents had it count as landed)."""

    layout: str
    resources: Mapping[str, int]
    before: str | None = None
    landed: bool = True


class Fate(enum.StrEnum):
    """What became of a relabel intent, the node as read now."""

    ONWARD = "onward"  # the node's label is the target: changing, done or failed
    UNWRITTEN = "unwritten"  # the write never landed: the label is as it was before
    AWAY = "away"  # relabelled to another layout, not by this check
    GONE = "gone"  # no longer among the pool's GPU nodes (deleted, or not selected)


def fate(intent: Intent, layout_now: str | None, present: bool) -> Fate:
    """What became of ``intent``, its node's layout label now ``layout_now`` (``present``:
    the node is still one of the pool's GPU nodes)."""
    if not present:
        return Fate.GONE
    if layout_now == intent.layout:
        return Fate.ONWARD
    if not intent.landed and layout_now == intent.before:
        return Fate.UNWRITTEN
    return Fate.AWAY


def notes_of(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    return (workload.get("metadata") or {}).get("annotations") or {}


def _json(workload: Mapping[str, Any], key: str) -> Any:
    try:
        return json.loads(str(notes_of(workload).get(key) or "{}"))
    except ValueError:
        return {}


def intents_of(workload: Mapping[str, Any]) -> dict[str, Intent]:
    """The relabel intents recorded on ``workload`` (an unreadable record: none)."""
    out = {}
    got = _json(workload, RELABELS)
    for node, t in (got if isinstance(got, dict) else {}).items():
        try:
            resources = {str(k): int(v) for k, v in t["resources"].items()}
            before = t.get("before")
            out[str(node)] = Intent(
                str(t["layout"]),
                resources,
                None if before is None else str(before),
                bool(t.get("landed", True)),
            )
        except (TypeError, KeyError, AttributeError, ValueError):
            continue
    return out


def intents_value(intents: Mapping[str, Intent]) -> str | None:
    """The annotation's value for ``intents`` (None: no annotation)."""
    if not intents:
        return None
    body = {
        n: {"layout": i.layout, "resources": dict(i.resources), "before": i.before}
        | ({} if i.landed else {"landed": False})
        for n, i in intents.items()
    }
    return json.dumps(body, sort_keys=True)


def landed(intents: Mapping[str, Intent], nodes: Iterable[str]) -> dict[str, Intent]:
    """``intents`` with those of ``nodes`` marked landed."""
    done = set(nodes)
    return {n: replace(i, landed=True) if n in done else i for n, i in intents.items()}


def promise_of(workload: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """The promise recorded on ``workload`` (an unreadable record: none)."""
    got = _json(workload, PROMISE)
    out: dict[str, dict[str, int]] = {}
    for pod_set, nodes in (got if isinstance(got, dict) else {}).items():
        try:
            out[str(pod_set)] = {str(n): int(c) for n, c in nodes.items() if int(c) > 0}
        except (TypeError, AttributeError, ValueError):
            return {}
    return out


def promise_from(placed: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """The promise of a placement, pod (``ns/workload[pod-set/i]``) -> node."""
    out: dict[str, dict[str, int]] = {}
    for pod, node in placed.items():
        by_node = out.setdefault(pod_set_of(pod), {})
        by_node[node] = by_node.get(node, 0) + 1
    return out


def promise_value(promise: Promise) -> str | None:
    return json.dumps(promise, sort_keys=True) if promise else None


def kept(
    wants: Sequence[Want], promise: Promise, done: Mapping[str, Mapping[str, int]]
) -> dict[str, str]:
    """The pods of ``wants`` still promised, pod -> node: per pod set, the promise less its
    pods ``done`` (pod set -> node -> pods bound or finished), by node; a pod done on a node
    the promise does not name counts against the set's nodes in their order. Pods of a pod set
    the promise does not name are not held."""
    out: dict[str, str] = {}
    by_set: dict[str, list[Want]] = {}
    for w in wants:
        by_set.setdefault(pod_set_of(w.pod), []).append(w)
    for pod_set, nodes in promise.items():
        left = {n: c - done.get(pod_set, {}).get(n, 0) for n, c in sorted(nodes.items())}
        extra = sum(c for n, c in done.get(pod_set, {}).items() if n not in nodes)
        slots = [n for n, c in left.items() for _ in range(max(c, 0))][extra:]
        for want, node in zip(by_set.get(pod_set, ()), slots, strict=False):
            out[want.pod] = node
    return out


def avoided(workload: Mapping[str, Any], now: float) -> dict[str, str]:
    """The nodes ``workload`` is kept off at ``now`` (seconds since the epoch), with why."""
    got = _json(workload, AVOID)
    out = {}
    for node, entry in (got if isinstance(got, dict) else {}).items():
        try:
            if float(entry["until"]) > now:
                out[str(node)] = str(entry["why"])
        except (TypeError, KeyError, ValueError):
            continue
    return out


def avoid_value(workload: Mapping[str, Any], avoid: Mapping[str, str], until: float) -> str:
    """The avoid annotation's value with ``avoid`` (node -> why) added, kept off until
    ``until``; entries past their time stay (their nodes are verified again before the
    workload is Ready on them) until it is Ready."""
    got = _json(workload, AVOID)
    body = {str(n): e for n, e in (got if isinstance(got, dict) else {}).items()}
    body.update({node: {"why": why, "until": until} for node, why in avoid.items()})
    return json.dumps(body, sort_keys=True)


def failed_verify(workload: Mapping[str, Any]) -> set[str]:
    """The nodes that failed verify's checks for ``workload`` since it was last Ready."""
    got = _json(workload, AVOID)
    return {str(n) for n in got} if isinstance(got, dict) else set()


def retry_after(retries: int, base: int = 15, cap: int = 600) -> int:
    """Seconds before Kueue queues a workload again after its ``retries``-th Retry (0: the
    first): ``base`` doubled each time, at most ``cap``."""
    return int(min(cap, base * 2 ** min(max(retries, 0), 16)))


def pod_set_of_pod(
    labels: Mapping[str, str], kinds: Iterable[str], sets: Mapping[str, set[str]]
) -> str:
    """The pod set a running pod of a workload belongs to: by the label the check's
    podSetUpdates gave it, Kueue's own, the workload's only pod set, or the one pod set whose
    devices are of the kinds it asks ("" when none says); ``sets``: pod set -> its kinds."""
    for key in (POD_SET_LABEL, KUEUE_POD_SET_LABEL):
        if labels.get(key) in sets:
            return labels[key]
    if len(sets) == 1:
        return next(iter(sets))
    asked = set(kinds)
    matching = [name for name, have in sorted(sets.items()) if asked and asked <= have]
    return matching[0] if len(matching) == 1 else ""


def held_nodes(
    workloads: Iterable[Mapping[str, Any]], done: Mapping[str, int]
) -> tuple[dict[str, str], set[str]]:
    """The nodes the check's ledger holds, -> why: those promised to a workload Ready or
    admitted whose pods are not all bound (``done``: workload UID -> its pods bound or
    finished), and those relabelled for a workload that waits on them; for ``advise``, which
    must not relabel them from under it. And the workloads (namespace/name) holding a
    promise: their pods are served where they were promised, no demand of advise's."""
    out: dict[str, str] = {}
    promised: set[str] = set()
    for w in workloads:
        meta = w.get("metadata") or {}
        name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        if is_true(w, "Finished"):
            continue
        ready = is_true(w, "Admitted") or any(
            e.get("state") == "Ready" for e in (w.get("status") or {}).get("admissionChecks") or ()
        )
        promise = promise_of(w)
        total = sum(sum(nodes.values()) for nodes in promise.values())
        if ready and done.get(str(meta.get("uid", "")), 0) < total:
            promised.add(name)
            for nodes in promise.values():
                for node in nodes:
                    out.setdefault(node, f"its devices are promised to workload {name}")
        if not is_true(w, "Admitted"):
            for node in intents_of(w):
                out.setdefault(node, f"it is being relabelled for workload {name}")
    return out, promised
