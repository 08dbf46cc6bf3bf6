"""A model of Kueue and the pool around the MIG layout check (mig_agent.ops.admission_check),
driven by hypothesis's rule-based state machine through random sequences of what a cluster does
to it, as the node guard has one (test_guard_model.py). The world:

* three GPU nodes of one H100 each, their agents taking a relabel to ``pending`` and then
  ``success`` (the new devices published) or ``failed``, and retrying a failure (as the real
  agent's backoff does); someone else relabelling a node to a layout of their own, or deleting
  it (it comes back later, as a node replaced does);
* Kueue: workloads submitted (one pod set or two, of 1g.10gb and 3g.40gb pods) with quota
  reserved; admitted once the check is Ready, applying its podSetUpdates to the pods; a Retry
  releasing the quota and queueing it again; a Rejected one deactivated; an admitted workload
  preempted (its pods gone, the check back to Pending); pods created and bound by the
  scheduler (to the node their nodeSelector names, else to any node with a device left);
  workloads finishing;
* the controller: a round at any step, any of its writes answered once with a 503, a status
  write with a 409, or the controller killed at its n-th write (the next round is a restarted
  controller: all it knows is on the objects).

After every step (``_check``): per node and kind, the devices held by bound pods and promised
to the pinned pods still to bind of Ready or admitted workloads are at most the devices there,
and the unpinned ones fit what is left (capacity; workloads whose node someone else changed or
deleted are exempt: their promise was broken by another); the check never relabels a node while
its own relabel of it to another layout is still under way (back and forth); no pod is evicted
by a change the check made (it may not evict here). At the end (``teardown``) the faults stop,
the nodes come back to their own layouts, and a bounded number of rounds must bring every
workload that the pool could serve alone to its end; one that no layout could serve must say
so in its message (progress).

The default run holds a fixed, derandomized budget (EXAMPLES examples of up to STEPS steps;
``MIG_AGENT_MODEL=0`` leaves it out); docs/reliability.md, "The admission check", says which
of the ledger's fixes, reverted, it finds. More: ``MIG_AGENT_MODEL_EXAMPLES=5000`` (still
derandomized; ``MIG_AGENT_MODEL_RANDOM=1`` for fresh sequences).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from mig_agent.config.profiles import load_catalog
from mig_agent.core.errors import KubeError, LeadershipLost
from mig_agent.core.kueue_demand import HOSTNAME
from mig_agent.core.layout import LayoutCatalog
from mig_agent.kube.cluster import PodRef
from mig_agent.ops import advise as advise_ops
from mig_agent.ops.admission_check import run_round
from mig_agent.ops.leadership import LeaseKeeper, leading
from mig_agent.ops.verify import Check, NodeVerdict
from tests.unit.test_admission_check_ops import CHECK, CONTROLLER, KueueFake, S, _gpu_state
from tests.unit.test_kueue_demand import CONFIG

EXAMPLES = 1200
STEPS = 30
SETTLE_ROUNDS = 8  # and three more a workload
NODES = ("gpu-a", "gpu-b", "gpu-c")
LAYOUTS = ("all-1g.10gb", "all-3g")
DEVICES = {"all-1g.10gb": {"nvidia.com/mig-1g.10gb": 7}, "all-3g": {"nvidia.com/mig-3g.40gb": 2}}
KINDS = ("nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb")
MALFORMED = ("0", "2.0", "two")  # max-nodes values the check must refuse


@cache
def _catalog() -> LayoutCatalog:
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"admission-model-{os.getpid()}"
    folder.mkdir(exist_ok=True)
    (folder / "layouts.yaml").write_text(CONFIG)
    return load_catalog([folder / "layouts.yaml"])


@cache
def _state_of(layout: str) -> str:
    return _gpu_state(_catalog(), layout)


class Killed(BaseException):
    """The controller killed at one of its writes (not an error it could catch)."""


@dataclass
class ModelCluster(KueueFake):
    """KueueFake answering as the API server would (a status write on an old resourceVersion
    is a 409, not an assertion), reads as copies, and the faults armed for the next writes."""

    fail: list[str] = field(default_factory=list)  # one-shot: "node", "kueue", "conflict"
    kill_at: int | None = None  # the controller dies at this write (counting down)
    relabels: list[tuple[str, str]] = field(default_factory=list)  # (node, layout) by the check

    def _write(self, what: str) -> None:
        if self.kill_at is not None:
            self.kill_at -= 1
            if self.kill_at < 0:
                self.kill_at = None
                raise Killed
        if what in self.fail:
            self.fail.remove(what)
            raise KubeError(f"{what}: 503 Service Unavailable (model)", status=503)

    def list_kueue(self, plural: str) -> list[dict[str, Any]]:
        return copy.deepcopy(super().list_kueue(plural))

    def patch_node(self, name: str, **kw: Any) -> Any:
        self._write("node")
        if name not in self.nodes:
            raise KubeError(f"patch node {name}: 404 Not Found (model)", status=404)
        got = super().patch_node(name, **kw)
        layout = (kw.get("labels") or {}).get(S.config_label)
        if layout:
            self.relabels.append((name, layout))
        return got

    def patch_kueue(self, plural: str, name: str, body: Mapping[str, Any], **kw: Any) -> Any:
        self._write("kueue")
        rv = (body.get("metadata") or {}).get("resourceVersion")
        for obj in self.kueue.get(plural, []):
            meta = obj["metadata"]
            if meta["name"] == name and meta.get("namespace", "") == kw.get("namespace", ""):
                if "conflict" in self.fail and rv is not None:
                    self.fail.remove("conflict")
                    meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
                if rv is not None and rv != meta.get("resourceVersion"):
                    raise KubeError("409 Conflict (model)", status=409)
        return super().patch_kueue(plural, name, body, **kw)

    def emit_object_event(self, obj: Any, **kw: Any) -> None:
        self._write("event")
        super().emit_object_event(obj, **kw)


class _Stale:
    """A replica's view: reads from what it read at its round's start, writes to the
    cluster as it is now."""

    def __init__(self, read: ModelCluster, live: ModelCluster) -> None:
        self._read, self._live = read, live

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("patch_", "emit_", "create_", "delete_")):
            return getattr(self._live, name)
        return getattr(self._read, name)


@dataclass
class NodeModel:
    applied: str  # the layout its GPU holds
    by_check: bool = False  # the pending label was written by the check


def _ask(ps: Mapping[str, Any]) -> tuple[str, int]:
    """What each pod of a pod set asks: its kind, and how many."""
    [(kind, n)] = ps["template"]["spec"]["containers"][0]["resources"]["requests"].items()
    return kind, int(n)


Sets = tuple[tuple[str, str, int, int], ...]  # (pod set, kind, pods, devices each)
Pod = tuple[str, str, int, Mapping[str, Any]]  # a pod to come: pod set, kind, devices, update


def _workload(name: str, sets: Sets) -> dict[str, Any]:
    pod_sets = []
    for ps, kind, count, per in sets:
        container = {
            "name": "c",
            "image": "x",
            "resources": {"requests": {kind: str(per)}, "limits": {kind: str(per)}},
        }
        pod_sets.append(
            {"name": ps, "count": count, "template": {"spec": {"containers": [container]}}}
        )
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {
            "namespace": "team",
            "name": name,
            "resourceVersion": "1",
            "uid": f"uid-{name}",
            "creationTimestamp": f"2026-12-07T10:{len(name):02d}:00Z",
        },
        "spec": {"queueName": "lq", "podSets": pod_sets},
        "status": {
            "conditions": [{"type": "QuotaReserved", "status": "True"}],
            "admissionChecks": [
                {"name": CHECK, "state": "Pending", "message": "", "lastTransitionTime": "t0"}
            ],
        },
    }


def _true(w: Mapping[str, Any], kind: str) -> bool:
    return any(c["type"] == kind and c["status"] == "True" for c in w["status"]["conditions"])


def _set(w: dict[str, Any], kind: str, value: bool) -> None:
    w["status"]["conditions"] = [c for c in w["status"]["conditions"] if c["type"] != kind]
    w["status"]["conditions"].append({"type": kind, "status": "True" if value else "False"})


def _entry(w: Mapping[str, Any]) -> dict[str, Any]:
    return w["status"]["admissionChecks"][0]  # type: ignore[no-any-return]


SIZES = st.sampled_from(
    [
        (("main", KINDS[0], 1, 1),),
        (("main", KINDS[0], 3, 1),),
        (("main", KINDS[0], 7, 1),),
        (("main", KINDS[0], 1, 2),),  # pods of two devices: placed on the fullest node
        (("main", KINDS[0], 3, 2),),
        (("main", KINDS[1], 1, 1),),
        (("main", KINDS[1], 2, 1),),
        (("main", KINDS[1], 3, 1),),
        (("big", KINDS[1], 1, 1), ("small", KINDS[0], 2, 1)),
        (("main", KINDS[1], 7, 1),),  # more than the pool can hold: never served
    ]
)


class AdmissionModel(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.c = ModelCluster()
        self.c.kueue["admissionchecks"] = [
            {
                "metadata": {"name": CHECK, "uid": "check"},
                "spec": {"controllerName": CONTROLLER},
            }
        ]
        self.c.kueue["workloads"] = []
        self.nodes: dict[str, NodeModel] = {}
        for name in NODES:
            self._add_node(name, "all-1g.10gb")
        self.exempt: set[str] = set()  # workloads whose promise another broke
        self.in_flight: dict[str, str] = {}  # node -> the layout the check set, not yet done
        self.check_label: dict[str, str] = {}  # node -> the label the check wrote last
        self.pins: dict[str, list[dict[str, Any]]] = {}  # Ready workload -> its pins then
        self.pods = itertools.count()
        self.names = itertools.count()
        self.t = datetime(2026, 12, 7, 10, tzinfo=UTC)
        self.stale: ModelCluster | None = None  # what a second replica read, not written yet
        self.led_since: bool = False  # the leader ran a round since that replica read
        self.verify_on = False  # the check asks verify; gpu-c always fails it
        self.broken_verify = False

    def _add_node(self, name: str, layout: str) -> None:
        self.c.add_node(name, {HOSTNAME: f"host-{name}"}, {KINDS[0]: "7"})
        self._publish(name, layout, "success")
        self.nodes[name] = NodeModel(layout)

    def _publish(self, name: str, layout: str, state: str) -> None:
        node = self.c.nodes[name]
        labels = {**node.labels, S.config_label: layout, S.state_label: state}
        notes = {S.gpu_state_annotation: _state_of(layout)}
        self.c.nodes[name] = dataclasses.replace(node, labels=labels, annotations=notes)

    def _label(self, name: str) -> str:
        return self.c.nodes[name].labels[S.config_label]

    def _state(self, name: str) -> str:
        return self.c.nodes[name].labels[S.state_label]

    def _workloads(self) -> list[dict[str, Any]]:
        return self.c.kueue["workloads"]

    # -- Kueue and its users -------------------------------------------------------------

    @rule(sets=SIZES)
    def submit(self, sets: Sets) -> None:
        self._workloads().append(_workload(f"w{next(self.names)}", sets))

    @rule()
    def kueue_reconciles(self) -> None:
        """Admit where the check is Ready; requeue a Retry; deactivate a Rejected."""
        for w in self._workloads():
            state = _entry(w)["state"]
            if state == "Ready" and not _true(w, "Admitted") and _true(w, "QuotaReserved"):
                _set(w, "Admitted", True)
            elif state == "Retry":  # evicted if admitted, queued again
                for ref in self._pods_of(w):
                    del self.c.pods[ref]
                _set(w, "Admitted", False)
                _entry(w).update(state="Pending", retryCount=_entry(w).get("retryCount", 0) + 1)
                _entry(w).pop("podSetUpdates", None)
                self.exempt.discard(w["metadata"]["name"])
            elif state == "Rejected":
                w["spec"]["active"] = False
            w["metadata"]["resourceVersion"] = str(int(w["metadata"]["resourceVersion"]) + 1)

    @rule(i=st.integers(0, 30))
    def bind_a_pod(self, i: int) -> None:
        admitted = [w for w in self._workloads() if self._unbound(w)]
        if admitted:
            w = admitted[i % len(admitted)]
            self._bind(w, self._unbound(w)[0])

    @rule(i=st.integers(0, 30))
    def finish(self, i: int) -> None:
        done = [w for w in self._workloads() if _true(w, "Admitted") and not self._unbound(w)]
        if done and not _true(done[i % len(done)], "Finished"):
            w = done[i % len(done)]
            _set(w, "Finished", True)
            for ref in self._pods_of(w):
                self.c.pods[ref] = dataclasses.replace(self.c.pods[ref], phase="Succeeded")

    @rule(i=st.integers(0, 30))
    def preempt(self, i: int) -> None:
        admitted = [w for w in self._workloads() if _true(w, "Admitted")]
        admitted = [w for w in admitted if not _true(w, "Finished")]
        if admitted:
            w = admitted[i % len(admitted)]
            for ref in self._pods_of(w):
                del self.c.pods[ref]
            _set(w, "Admitted", False)
            _entry(w).update(state="Pending", message="")
            _entry(w).pop("podSetUpdates", None)
            w["metadata"]["resourceVersion"] = str(int(w["metadata"]["resourceVersion"]) + 1)

    def _pods_of(self, w: Mapping[str, Any]) -> list[PodRef]:
        uid = w["metadata"]["uid"]
        return [r for r, p in self.c.pods.items() if p.labels.get("workload") == uid]

    def _unbound(self, w: Mapping[str, Any]) -> list[Pod]:
        """The pods of an admitted workload not made yet: (pod set, kind, devices, update)."""
        if not _true(w, "Admitted") or _true(w, "Finished"):
            return []
        have = Counter(self.c.pods[r].labels["pod-set"] for r in self._pods_of(w))
        updates = {u["name"]: u for u in _entry(w).get("podSetUpdates") or ()}
        out = []
        for ps in w["spec"]["podSets"]:
            kind, per = _ask(ps)
            for _ in range(ps["count"] - have[ps["name"]]):
                out.append((ps["name"], kind, per, updates.get(ps["name"], {})))
        return out

    def _bind(self, w: Mapping[str, Any], pod: Pod) -> None:
        """The scheduler: a pinned pod to its node (its device must be there: the check's
        promise), another to a node with a device of its kind not promised to pinned pods."""
        pod_set, kind, per, update = pod
        host = (update.get("nodeSelector") or {}).get(HOSTNAME)
        free = self._free()
        if host:
            node = host.removeprefix("host-")
            exempt = w["metadata"]["name"] in self.exempt
            if node not in self.c.nodes or (exempt and free[node][kind] < per):
                return  # pending: its promise was broken by another
            assert free[node][kind] >= per, (
                f"{w['metadata']['name']}: its pod of {pod_set} is pinned to {node}, which "
                f"has no {kind} left for it"
            )
        else:  # not onto a node changing (its agent cordons it), nor a device promised
            room = self._unpromised()
            fits = [n for n in sorted(room) if room[n][kind] >= per and self._steady(n)]
            if not fits:
                return
            node = fits[0]
        labels = {"workload": w["metadata"]["uid"], "pod-set": pod_set, **update.get("labels", {})}
        self.c.add_pod("team", f"p{next(self.pods)}", node, gpu={kind: per}, labels=labels)

    # -- the nodes, their agents and the others ----------------------------------------------

    @rule(node=st.sampled_from(NODES), fails=st.booleans())
    def agent_step(self, node: str, fails: bool) -> None:
        if node not in self.c.nodes:
            return
        label, state = self._label(node), self._state(node)
        model = self.nodes[node]
        if state == "pending":
            if fails or label not in LAYOUTS:
                self._publish(node, model.applied, "failed")
                self.c.nodes[node].labels[S.config_label] = label
            else:
                model.applied = label
                self._publish(node, label, "success")
            if self.in_flight.get(node) == label:
                del self.in_flight[node]
        elif label != model.applied or state == "failed":
            model.by_check = self.check_label.get(node) == label
            on_it = [r for r, p in self.c.pods.items() if p.node == node and not p.finished]
            assert not (on_it and model.by_check), (
                f"{node}: the check's relabel to {label} evicts {len(on_it)} running pod(s)"
            )
            for ref in on_it:  # the agent's drain
                del self.c.pods[ref]
            self.c.nodes[node].labels[S.state_label] = "pending"

    @rule(node=st.sampled_from(NODES), layout=st.sampled_from([*LAYOUTS, "mine"]))
    def someone_relabels(self, node: str, layout: str) -> None:
        if node in self.c.nodes and self._label(node) != layout:
            self._break_promises(node)
            self.c.nodes[node].labels[S.config_label] = layout
            self.in_flight.pop(node, None)
            self.check_label.pop(node, None)

    @rule(node=st.sampled_from(NODES))
    def node_deleted_or_back(self, node: str) -> None:
        if node in self.c.nodes:
            self._break_promises(node)
            del self.c.nodes[node]
            self.c.pods = {r: p for r, p in self.c.pods.items() if p.node != node}
            self.in_flight.pop(node, None)
            self.check_label.pop(node, None)
        else:
            self._add_node(node, "all-1g.10gb")

    def _break_promises(self, node: str) -> None:
        for w in self._workloads():
            pins = [u.get("nodeSelector", {}).get(HOSTNAME) for u in self._updates(w)]
            unpinned = any(HOSTNAME not in u.get("nodeSelector", {}) for u in self._updates(w))
            if f"host-{node}" in pins or unpinned:
                self.exempt.add(w["metadata"]["name"])

    def _updates(self, w: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        if _entry(w)["state"] != "Ready" or _true(w, "Finished"):
            return []
        return list(_entry(w).get("podSetUpdates") or ())

    # -- the controller ----------------------------------------------------------------------

    @rule(fault=st.sampled_from(["", "", "node", "kueue", "conflict", "event", "kill"]))
    def check_round(self, fault: str) -> None:
        if fault == "kill":
            self.c.kill_at = 2
        elif fault:
            self.c.fail.append(fault)
        before = len(self.c.relabels)
        self.t += timedelta(minutes=1)  # a round a minute
        self.led_since = True
        try:
            run_round(
                self.c,
                _catalog(),
                S,
                controller_name=CONTROLLER,
                now=lambda: self.t,
                verify=self._verify,
            )
        except Killed:
            pass
        finally:
            self.c.fail.clear()
            self.c.kill_at = None
        self._relabelled_since(before)

    def _verify(self, node: str) -> NodeVerdict:
        ok = node != "gpu-c"
        return NodeVerdict(node, (Check("pod", ok, "" if ok else "the pod saw no MIG device"),))

    def _relabelled_since(self, before: int, read: ModelCluster | None = None) -> None:
        """What the check's relabels since ``before`` must keep to: none while its
        annotations (as ``read``) are refused, no more nodes changing than its cap, no back
        and forth."""
        notes = (read or self.c).kueue["admissionchecks"][0]["metadata"].get("annotations") or {}
        value = notes.get("mig-agent.dev/max-nodes")
        new = self.c.relabels[before:]
        assert not (new and value in MALFORMED), f"relabelled {new} though max-nodes is {value!r}"
        for node, layout in new:
            going = self.in_flight.get(node)
            assert going in (None, layout), (
                f"the check relabelled {node} to {layout} while its relabel to {going} was "
                "under way"
            )
            self.in_flight[node] = layout
            self.check_label[node] = layout
        cap = None if value is None or value in MALFORMED else int(value)
        changing = {n for n in self.in_flight if n in self.c.nodes and not self._steady(n)}
        assert not new or cap is None or len(changing) <= cap, f"{changing} changing, cap {cap}"

    # -- a second replica, and the operator's settings of the check ---------------------------

    @rule()
    def second_replica_reads(self) -> None:
        """A second replica begins a round: what it reads now, it writes later."""
        self.stale = copy.deepcopy(self.c)
        self.stale.fail, self.stale.kill_at = [], None
        self.led_since = False

    @rule()
    def second_replica_writes(self) -> None:
        """...and writes it, its Lease kept only while no other round ran meanwhile: a
        leader's round since means the Lease went to another (it lapsed), and every write
        must confirm it first."""
        if self.stale is None:
            return
        keeper = LeaseKeeper(lambda: not self.led_since, 30, lambda: 0.0)
        keeper.attempt()
        before, writes = len(self.c.relabels), self.c.writes + len(self.c.object_events)
        with contextlib.suppress(LeadershipLost):
            run_round(
                leading(_Stale(self.stale, self.c), keeper.confirm),
                _catalog(),
                S,
                controller_name=CONTROLLER,
                now=lambda: self.t,
                verify=self._verify,
            )
        stale, self.stale = self.stale, None
        wrote = self.c.writes + len(self.c.object_events) - writes
        assert not (self.led_since and wrote), f"{wrote} write(s) without the Lease"
        self._relabelled_since(before, stale)

    @rule(
        max_nodes=st.sampled_from([None, None, "1", "2", *MALFORMED]),
        verify=st.booleans(),
    )
    def operator_annotates_the_check(self, max_nodes: str | None, verify: bool) -> None:
        notes = {"mig-agent.dev/verify": "true"} if verify else {}
        if max_nodes is not None:
            notes["mig-agent.dev/max-nodes"] = max_nodes
        self.c.kueue["admissionchecks"][0]["metadata"]["annotations"] = notes
        self.verify_on = self.verify_on or verify

    @rule()
    def advise_applies(self) -> None:
        """``advise --apply``'s relabels, beside the check."""
        report = advise_ops.run(self.c, _catalog(), settings=S)
        for p in report.proposals:
            self.c.nodes[p.node].labels[S.config_label] = p.option.layout

    # -- what must hold ----------------------------------------------------------------------

    def _free(self) -> dict[str, Counter[str]]:
        """Per node, the devices there less those bound pods hold."""
        free = {n: Counter(DEVICES[self.nodes[n].applied]) for n in self.c.nodes}
        for p in self.c.pods.values():
            if p.node in free and not p.finished:
                free[p.node].update({k: -v for k, v in p.gpu_requests.items()})
        return free

    def _steady(self, node: str) -> bool:
        return self._label(node) == self.nodes[node].applied and self._state(node) == "success"

    def _unpromised(self) -> dict[str, Counter[str]]:
        """Per node, its free devices less those promised to pinned pods still to bind."""
        return self._promised()[0]

    def _promised(self) -> tuple[dict[str, Counter[str]], Counter[str]]:
        """Per node, its free devices less those promised to the pinned pods of Ready and
        admitted workloads still to bind (not those exempt); the unpinned pods, by kind."""
        free = self._free()
        unpinned: Counter[str] = Counter()
        for w in self._workloads():
            if w["metadata"]["name"] in self.exempt:
                continue
            if _entry(w)["state"] != "Ready" and not _true(w, "Admitted"):
                continue
            for _, kind, per, update in self._pending_pods(w):
                host = (update.get("nodeSelector") or {}).get(HOSTNAME)
                if host and host.removeprefix("host-") in free:
                    free[host.removeprefix("host-")][kind] -= per
                elif not host:
                    unpinned[kind] += per
        return free, unpinned

    @invariant()
    def promises_stay(self) -> None:
        """A Ready workload's pins never move while it stays Ready (unless another broke its
        promise): Kueue applies them as they were when it admits it."""
        if not hasattr(self, "c"):
            return
        for w in self._workloads():
            name = w["metadata"]["name"]
            if _entry(w)["state"] != "Ready" or name in self.exempt:
                self.pins.pop(name, None)
                continue
            now = [dict(u) for u in _entry(w).get("podSetUpdates") or ()]
            assert self.pins.setdefault(name, now) == now, f"{name}'s pins moved while Ready"

    @invariant()
    def promises_fit(self) -> None:
        if not hasattr(self, "c"):
            return
        free, unpinned = self._promised()
        for node, left in free.items():
            over = {k: -v for k, v in left.items() if v < 0}
            assert not over, f"{node}: promised beyond its devices by {over}"
        for kind, n in unpinned.items():
            assert n <= sum(left[kind] for left in free.values()), f"{n} unpinned {kind} pods"

    def _pending_pods(self, w: Mapping[str, Any]) -> list[Pod]:
        if _true(w, "Admitted"):
            return self._unbound(w)
        updates = {u["name"]: u for u in _entry(w).get("podSetUpdates") or ()}
        out = []
        for ps in w["spec"]["podSets"]:
            kind, per = _ask(ps)
            out += [(ps["name"], kind, per, updates.get(ps["name"], {}))] * ps["count"]
        return out

    def _left(self) -> list[dict[str, Any]]:
        """The workloads neither finished nor deactivated."""
        return [
            w
            for w in self._workloads()
            if not _true(w, "Finished") and w["spec"].get("active") is not False
        ]

    def teardown(self) -> None:
        if not hasattr(self, "c"):
            return
        self.stale = None
        check = self.c.kueue["admissionchecks"][0]  # and lifts the check's cap, if any
        check["metadata"]["annotations"] = (
            {"mig-agent.dev/verify": "true"} if self.verify_on else {}
        )
        for node in NODES:  # the operator mends what others broke
            if node not in self.c.nodes:
                self._add_node(node, "all-1g.10gb")
            elif self._label(node) not in LAYOUTS:
                self.c.nodes[node].labels[S.config_label] = self.nodes[node].applied
        # with verify asked, gpu-c (which fails it) may be all that would serve a workload
        usable = NODES[:2] if self.verify_on else NODES
        rounds = SETTLE_ROUNDS + 3 * len(self._workloads())  # bounded by the queue
        for _ in range(rounds):
            self.t += timedelta(minutes=4)  # time passes: what a workload is kept off lapses
            for node in NODES:
                for _ in range(3):
                    self.agent_step(node, False)
            self.check_round("")
            self.kueue_reconciles()
            for w in self._workloads():
                for pod in self._unbound(w):
                    self._bind(w, pod)
            for i in range(len(self._workloads())):
                self.finish(i)
            if all(_beyond(w, usable) and _entry(w)["message"] for w in self._left()):
                break  # what is left, no pool could serve: nothing more to come
        for w in self._left():
            message = _entry(w)["message"]
            assert _beyond(w, usable), (
                f"{w['metadata']['name']} did not end in {rounds} rounds with the pool "
                f"to itself: {_entry(w)['state']}: {message!r}"
            )
            assert "no approved layout can serve" in message or "gpu-c" in message, message


def _beyond(w: Mapping[str, Any], nodes: tuple[str, ...]) -> bool:
    """Whether no layout of ``nodes`` could serve ``w`` alone (by devices in sum)."""
    need = Counter[str]()
    for ps in w["spec"]["podSets"]:
        kind, per = _ask(ps)
        need[kind] += ps["count"] * per
    for layouts in itertools.product(LAYOUTS, repeat=len(nodes)):
        have = Counter[str]()
        for layout in layouts:
            have.update(DEVICES[layout])
        if all(have[k] >= n for k, n in need.items()):
            return False
    return True


# MIG_AGENT_MODEL_SHRINK=0: a failure reported as found, unshrunk (runs of reverted fixes)
_shrink = os.environ.get("MIG_AGENT_MODEL_SHRINK") != "0"
AdmissionModel.TestCase.settings = settings(
    phases=list(Phase) if _shrink else [Phase.explicit, Phase.reuse, Phase.generate],
    max_examples=int(os.environ.get("MIG_AGENT_MODEL_EXAMPLES", EXAMPLES)),
    stateful_step_count=int(os.environ.get("MIG_AGENT_MODEL_STEPS", STEPS)),
    derandomize=os.environ.get("MIG_AGENT_MODEL_RANDOM") != "1",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    database=None,
    print_blob=True,
)
test_admission_model = pytest.mark.skipif(
    os.environ.get("MIG_AGENT_MODEL") == "0", reason="MIG_AGENT_MODEL=0 leaves the models out"
)(AdmissionModel.TestCase)
