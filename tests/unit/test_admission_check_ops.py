"""We test these aspects of the AdmissionCheck controller's rounds (mig_agent.ops.admission_check)
on FakeCluster with Kueue's objects shaped as v0.17 writes them:

* our AdmissionChecks (by controllerName) are marked Active, another controller's are not;
* a workload waiting on the check whose pods need a relabel: the first round names the node
  on the workload's annotation and relabels it, the entry stays Pending with the message; a
  round while the node changes (and one that finds the old ``success`` with the old devices)
  changes nothing; once the agent's success publishes the new devices, a round (a fresh call:
  all state is on the objects, as after a restart) marks it Ready, drops the annotation and
  sends an Event;
  and pins its pod set to the node (podSetUpdates: its hostname as node selector);
  Ready taken back to Pending drops the pins;
* a workload no approved layout serves stays Pending, its message saying why, once;
* a relabel that failed makes the entry Retry; the check's annotations allow evictions, or
  make an unservable workload Rejected;
* a workload admitted after the check was Ready, its Job's pods not bound yet, keeps its
  devices from the next workload.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from mig_agent.config.profiles import load_catalog
from mig_agent.config.settings import Settings
from mig_agent.core.admission_ledger import AVOID, PROMISE
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.planner import plan
from mig_agent.core.snapshot import compact
from mig_agent.kube.cluster import ObjectRef
from mig_agent.node.apply import execute
from mig_agent.ops.admission_check import RELABELS, run_round
from tests.unit import test_advise_ops as advise_ops_tests
from tests.unit import test_kueue_demand as kueue_tests
from tests.unit.fake_cluster import FakeCluster
from tests.unit.fake_gpus import FakeGpus
from tests.unit.test_kueue_demand import CONFIG  # the two approved layouts

MIG_1G, MIG_3G = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"
S = Settings()
CHECK, CONTROLLER = "mig-layout", "mig-agent.dev/mig-layout"


def _merge(into: dict[str, Any], patch: Mapping[str, Any]) -> None:
    for k, v in patch.items():
        if v is None:
            into.pop(k, None)
        elif isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)


@dataclass
class KueueFake(FakeCluster):
    """FakeCluster with Kueue's writes: merge patches of its objects, Events about them."""

    object_events: list[tuple[str, str, str, bool]] = field(default_factory=list)
    writes: int = 0

    def patch_kueue(
        self,
        plural: str,
        name: str,
        body: Mapping[str, Any],
        *,
        namespace: str = "",
        status: bool = False,
    ) -> dict[str, Any]:
        for obj in self.kueue.get(plural, []):
            meta = obj["metadata"]
            if meta["name"] == name and meta.get("namespace", "") == namespace:
                body = dict(body)
                rv = (body.get("metadata") or {}).get("resourceVersion")
                assert rv is None or rv == meta.get("resourceVersion"), "409"
                _merge(obj, {k: v for k, v in body.items() if k == "status" or not status})
                meta["resourceVersion"] = str(int(meta.get("resourceVersion", "0")) + 1)
                self.writes += 1
                return copy.deepcopy(obj)
        raise AssertionError(f"no {plural} {namespace}/{name}")

    def emit_object_event(
        self, obj: ObjectRef, *, reason: str, message: str, warning: bool = False
    ) -> None:
        self.object_events.append((obj.name, reason, message, warning))


def _gpu_state(catalog: Any, layout: str) -> str:
    gpus = FakeGpus([MODELS["H100-80GB"]])
    execute(plan(catalog.get(layout), gpus.observe(), gpus.models()), gpus)
    return compact(gpus.observe(), gpus.models())


@pytest.fixture
def catalog(tmp_path: Path) -> Any:
    (tmp_path / "layouts.yaml").write_text(CONFIG)
    return load_catalog([tmp_path / "layouts.yaml"])


def _at(c: FakeCluster, catalog: Any, node: str, layout: str, state: str = "success") -> None:
    labels = {**c.nodes[node].labels, S.config_label: layout, S.state_label: state}
    c.nodes[node] = dataclasses.replace(
        c.nodes[node],
        labels=labels,
        annotations={S.gpu_state_annotation: _gpu_state(catalog, layout)},
    )


def _workload(name: str, pods: int, resource: str, state: str = "Pending") -> dict[str, Any]:
    container = {
        "name": "c",
        "image": "x",
        "resources": {"requests": {resource: "1"}, "limits": {resource: "1"}},
    }
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {"namespace": "team", "name": name, "resourceVersion": "1", "uid": name},
        "spec": {
            "queueName": "lq",
            "podSets": [
                {"name": "main", "count": pods, "template": {"spec": {"containers": [container]}}}
            ],
        },
        "status": {
            "conditions": [
                {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved"},
                {"type": "Admitted", "status": "False", "reason": "NoChecks"},
            ],
            "admissionChecks": [
                {"name": CHECK, "state": state, "message": "", "lastTransitionTime": "t0"}
            ],
        },
    }


def _pool(catalog: Any, *workloads: dict[str, Any]) -> KueueFake:
    c = KueueFake()
    c.add_node("gpu-a", {"kubernetes.io/hostname": "host-a"}, {MIG_1G: "7"})
    _at(c, catalog, "gpu-a", "all-1g.10gb")
    c.kueue["admissionchecks"] = [
        {"metadata": {"name": CHECK}, "spec": {"controllerName": CONTROLLER}},
        {"metadata": {"name": "other"}, "spec": {"controllerName": "example.com/x"}},
    ]
    c.kueue["workloads"] = list(workloads)
    return c


def _entry(c: KueueFake, name: str) -> dict[str, Any]:
    [w] = [w for w in c.kueue["workloads"] if w["metadata"]["name"] == name]
    return dict(w["status"]["admissionChecks"][0])


def _notes(c: KueueFake, name: str) -> dict[str, str]:
    [w] = [w for w in c.kueue["workloads"] if w["metadata"]["name"] == name]
    return dict(w["metadata"].get("annotations") or {})


def test_relabels_for_a_workload_then_marks_it_ready_once_the_node_is_done(catalog: Any) -> None:
    c = _pool(catalog, _workload("train", 2, MIG_3G))
    r = run_round(c, catalog, S, controller_name=CONTROLLER)
    assert r.activated == (CHECK,)
    ours, other = c.kueue["admissionchecks"]
    assert ours["status"]["conditions"][0]["type"] == "Active"
    assert "status" not in other
    assert c.nodes["gpu-a"].labels[S.config_label] == "all-3g"
    assert json.loads(_notes(c, "train")[RELABELS]) == {  # its write landed
        "gpu-a": {"layout": "all-3g", "resources": {MIG_3G: 2}, "before": "all-1g.10gb"}
    }
    entry = _entry(c, "train")
    assert entry["state"] == "Pending" and entry["message"] == "relabelling gpu-a to all-3g for it"
    assert [e[1] for e in c.object_events] == ["MIGLayoutRelabel"]

    # the old success, the old devices still published (the agent has not begun): waits
    [d] = run_round(c, catalog, S, controller_name=CONTROLLER).decisions
    assert d.verdict.value == "Wait"
    assert _entry(c, "train")["message"] == "waiting for gpu-a (to all-3g) to reach success"
    c.nodes["gpu-a"] = dataclasses.replace(
        c.nodes["gpu-a"], labels={**c.nodes["gpu-a"].labels, S.state_label: "pending"}
    )
    writes = c.writes
    run_round(c, catalog, S, controller_name=CONTROLLER)  # changing: waits, writes nothing
    assert c.writes == writes

    _at(c, catalog, "gpu-a", "all-3g")  # the agent's success, the new devices published
    r = run_round(c, catalog, S, controller_name=CONTROLLER)
    assert [d.verdict.value for d in r.decisions] == ["Ready"]
    assert _entry(c, "train")["state"] == "Ready"
    # both pods on gpu-a: pinned there, so that they take the devices made for them
    assert _entry(c, "train")["podSetUpdates"] == [
        {
            "name": "main",
            # its UID, and its pod set
            "labels": {
                "mig-agent.dev/admission-workload": "train",
                "mig-agent.dev/admission-pod-set": "main",
            },
            "nodeSelector": {"kubernetes.io/hostname": "host-a"},
        }
    ]
    assert _entry(c, "train")["message"] == (
        "its 2 pod(s) fit on gpu-a; pod set main pinned to host-a"
    )
    assert RELABELS not in _notes(c, "train")
    assert json.loads(_notes(c, "train")[PROMISE]) == {"main": {"gpu-a": 2}}
    assert c.object_events[-1][1] == "MIGLayoutReady"
    writes = c.writes
    run_round(c, catalog, S, controller_name=CONTROLLER)
    assert c.writes == writes


def test_a_workload_no_layout_serves_waits_saying_why_once(catalog: Any) -> None:
    c = _pool(catalog, _workload("huge", 3, "nvidia.com/mig-7g.80gb"))
    run_round(c, catalog, S, controller_name=CONTROLLER)
    entry = _entry(c, "huge")
    assert entry["state"] == "Pending"
    assert entry["message"] == (
        "3 pod(s) asking mig-7g.80gb: no approved layout can serve all of its pods"
    )
    assert c.nodes["gpu-a"].labels[S.config_label] == "all-1g.10gb"
    events = len(c.object_events)
    run_round(c, catalog, S, controller_name=CONTROLLER)
    assert len(c.object_events) == events


def test_a_failed_relabel_makes_the_check_retry(catalog: Any) -> None:
    w = _workload("train", 2, MIG_3G)
    w["metadata"]["annotations"] = {
        RELABELS: json.dumps({"gpu-a": {"layout": "all-3g", "resources": {MIG_3G: 2}}})
    }
    c = _pool(catalog, w)
    _at(c, catalog, "gpu-a", "all-3g", state="failed")
    run_round(c, catalog, S, controller_name=CONTROLLER)
    assert _entry(c, "train")["state"] == "Retry"
    assert RELABELS not in _notes(c, "train")
    assert c.object_events[-1][1:] == (
        "MIGLayoutRetry",
        "the relabel for it failed (gpu-a: its last change failed (state failed))",
        True,
    )


def test_an_admitted_workload_whose_pods_are_not_bound_yet_keeps_its_devices(
    catalog: Any,
) -> None:
    first = _workload("first", 2, MIG_3G, state="Ready")
    first["metadata"]["ownerReferences"] = [{"kind": "Job", "name": "first"}]
    first["status"]["conditions"][1] = {"type": "Admitted", "status": "True"}
    c = _pool(catalog, first, _workload("second", 1, MIG_3G))
    _at(c, catalog, "gpu-a", "all-3g")  # two 3g.40gb, both for first's pods to come
    r = run_round(c, catalog, S, controller_name=CONTROLLER)
    [d] = r.decisions
    assert (d.workload, d.verdict.value) == ("team/second", "Wait"), d
    assert _entry(c, "second")["state"] == "Pending"
    c.kueue["workloads"] = [_workload("second", 1, MIG_3G)]  # first gone: its devices free
    [d] = run_round(c, catalog, S, controller_name=CONTROLLER).decisions
    assert d.verdict.value == "Ready"


def test_the_checks_annotations_are_its_parameters(catalog: Any) -> None:
    c = _pool(catalog, _workload("train", 2, MIG_3G))
    c.add_pod("team", "busy", "gpu-a", gpu={MIG_1G: 1})
    [d] = run_round(c, catalog, S, controller_name=CONTROLLER).decisions
    assert d.verdict.value == "Wait" and "does not allow evictions" in d.message
    c.kueue["admissionchecks"][0]["metadata"]["annotations"] = {"mig-agent.dev/allow-evict": "true"}
    [d] = run_round(c, catalog, S, controller_name=CONTROLLER).decisions
    assert d.verdict.value == "Relabel", d
    assert c.nodes["gpu-a"].labels[S.config_label] == "all-3g"
    huge = _workload("huge", 3, "nvidia.com/mig-7g.80gb")
    c = _pool(catalog, huge)
    c.kueue["admissionchecks"][0]["metadata"]["annotations"] = {
        "mig-agent.dev/reject-unservable": "true"
    }
    run_round(c, catalog, S, controller_name=CONTROLLER)
    assert _entry(c, "huge")["state"] == "Rejected"
    assert c.object_events[-1][1] == "MIGLayoutRejected" and c.object_events[-1][3]


def test_pins_go_with_ready_and_only_with_it(catalog: Any) -> None:
    c = _pool(catalog, _workload("small", 1, MIG_1G))
    [d] = run_round(c, catalog, S, controller_name=CONTROLLER).decisions
    assert d.verdict.value == "Ready"
    assert [u["name"] for u in _entry(c, "small")["podSetUpdates"]] == ["main"]
    # Kueue takes the check back to Pending (its workload evicted): the pins go with Ready
    [w] = c.kueue["workloads"]
    w["status"]["admissionChecks"][0]["state"] = "Pending"
    c.add_pod("team", "busy", "gpu-a", gpu={MIG_1G: 7})  # no device left meanwhile
    [d] = run_round(c, catalog, S, controller_name=CONTROLLER).decisions
    assert d.verdict.value == "Wait", d
    assert _entry(c, "small")["state"] == "Pending"
    assert "podSetUpdates" not in _entry(c, "small")


def test_an_admitted_workload_of_any_kind_holds_its_devices_until_its_pods_are_bound(
    catalog: Any,
) -> None:
    """A JobSet's workload (no Job owns it): its pods found by the label the check's
    podSetUpdates gave them."""
    first = _workload("first", 2, MIG_3G, state="Ready")
    first["metadata"]["ownerReferences"] = [{"kind": "JobSet", "name": "first"}]
    first["status"]["conditions"][1] = {"type": "Admitted", "status": "True"}
    label = {"mig-agent.dev/admission-workload": "first"}
    first["status"]["admissionChecks"][0]["podSetUpdates"] = [{"name": "main", "labels": label}]
    c = _pool(catalog, first, _workload("second", 1, MIG_3G))
    _at(c, catalog, "gpu-a", "all-3g")  # two 3g.40gb, both for first's pods to come
    [d] = run_round(c, catalog, S, controller_name=CONTROLLER).decisions
    assert (d.workload, d.verdict.value) == ("team/second", "Wait"), d
    for i in range(2):  # first's pods made and bound: they hold the devices themselves now
        c.add_pod("team", f"first-{i}", "gpu-a", gpu={MIG_3G: 1}, labels=label)
    [d] = run_round(c, catalog, S, controller_name=CONTROLLER).decisions
    assert d.verdict.value == "Wait", d
    [done] = [ref for ref in c.pods if ref.name == "first-1"]
    c.pods[done] = dataclasses.replace(c.pods[done], phase="Succeeded")  # its device free
    [d] = run_round(c, catalog, S, controller_name=CONTROLLER).decisions
    assert d.verdict.value == "Ready", d


def _verdict(node: str, ok: bool) -> Any:
    from mig_agent.ops.verify import Check, NodeVerdict

    detail = "1 device of nvidia.com/mig-3g.40gb" if ok else "the pod saw no MIG device"
    return NodeVerdict(node, (Check("pod nvidia.com/mig-3g.40gb", ok, detail),))


def test_a_check_asking_verify_verifies_the_relabelled_nodes_before_ready(catalog: Any) -> None:
    c = _pool(catalog, _workload("train", 2, MIG_3G))
    c.kueue["admissionchecks"][0]["metadata"]["annotations"] = {"mig-agent.dev/verify": "true"}
    asked: list[str] = []
    results = [False, True]

    def verify(node: str) -> Any:
        asked.append(node)
        return _verdict(node, results[len(asked) - 1])

    run_round(c, catalog, S, controller_name=CONTROLLER, verify=verify)  # the relabel
    assert asked == []
    _at(c, catalog, "gpu-a", "all-3g")
    [d] = run_round(c, catalog, S, controller_name=CONTROLLER, verify=verify).decisions
    assert asked == ["gpu-a"]
    assert d.verdict.value == "Retry"
    assert _entry(c, "train")["message"] == (
        "gpu-a failed verify after its relabel: pod nvidia.com/mig-3g.40gb: "
        "the pod saw no MIG device; kept off it for 10 min"
    )
    assert _entry(c, "train")["requeueAfterSeconds"] == 15  # Kueue's first retry
    assert c.object_events[-1][1] == "MIGLayoutRetry"
    assert RELABELS not in _notes(c, "train")
    assert "gpu-a" in json.loads(_notes(c, "train")[AVOID])

    [w] = c.kueue["workloads"]  # Kueue queues it again: the check Pending once more
    w["status"]["admissionChecks"][0].update(state="Pending", retryCount=1)
    [d] = run_round(c, catalog, S, controller_name=CONTROLLER, verify=verify).decisions
    assert asked == ["gpu-a"] and d.verdict.value == "Wait"  # the only node: kept off it
    assert "kept off for now (gpu-a: failed verify" in d.message, d.message
    later = datetime.now(UTC) + timedelta(minutes=11)
    [d] = run_round(
        c, catalog, S, controller_name=CONTROLLER, verify=verify, now=lambda: later
    ).decisions
    assert asked == ["gpu-a", "gpu-a"]  # verified again before it is used
    assert d.verdict.value == "Ready"
    assert _entry(c, "train")["message"] == (
        "its 2 pod(s) fit on gpu-a; verified gpu-a; pod set main pinned to host-a"
    )
    assert AVOID not in _notes(c, "train") and "requeueAfterSeconds" not in _entry(c, "train")


def test_verify_waits_for_no_other_workloads_decision(catalog: Any) -> None:
    """verify's pods take up to minutes: a workload that fits now is Ready before they run.
    Before: the round verified in the workloads' order and wrote every decision after."""
    c = _pool(catalog, _workload("train", 2, MIG_3G))
    c.kueue["admissionchecks"][0]["metadata"]["annotations"] = {"mig-agent.dev/verify": "true"}
    run_round(c, catalog, S, controller_name=CONTROLLER)  # train's relabel of gpu-a
    _at(c, catalog, "gpu-a", "all-3g")
    c.add_node("gpu-b", {"kubernetes.io/hostname": "host-b"}, {MIG_1G: "7"})
    _at(c, catalog, "gpu-b", "all-1g.10gb")
    # queued after train, so that the queue's order would write it last
    small = _workload("small", 1, MIG_1G)
    c.kueue["workloads"][0]["metadata"]["creationTimestamp"] = "2026-12-07T10:00:00Z"
    small["metadata"]["creationTimestamp"] = "2026-12-07T10:05:00Z"
    c.kueue["workloads"].append(small)
    when_verified: list[str] = []

    def verify(node: str) -> Any:
        when_verified.append(_entry(c, "small")["state"])
        return _verdict(node, True)

    r = run_round(c, catalog, S, controller_name=CONTROLLER, verify=verify)
    assert when_verified == ["Ready"]
    assert [(d.workload, d.verdict.value) for d in r.decisions] == [
        ("team/train", "Ready"),
        ("team/small", "Ready"),
    ]
    assert _entry(c, "train")["state"] == "Ready"


def test_verify_is_not_run_unless_the_check_asks_or_without_a_relabel(catalog: Any) -> None:
    asked: list[str] = []

    def verify(node: str) -> Any:
        asked.append(node)
        return _verdict(node, False)

    c = _pool(catalog, _workload("train", 2, MIG_3G))
    run_round(c, catalog, S, controller_name=CONTROLLER, verify=verify)
    _at(c, catalog, "gpu-a", "all-3g")
    [d] = run_round(c, catalog, S, controller_name=CONTROLLER, verify=verify).decisions
    assert d.verdict.value == "Ready" and asked == []
    c = _pool(catalog, _workload("small", 1, MIG_1G))  # fits now: nothing was relabelled
    c.kueue["admissionchecks"][0]["metadata"]["annotations"] = {"mig-agent.dev/verify": "true"}
    [d] = run_round(c, catalog, S, controller_name=CONTROLLER, verify=verify).decisions
    assert d.verdict.value == "Ready" and asked == []


def test_a_check_asking_verify_of_a_controller_without_it_waits_saying_so(catalog: Any) -> None:
    c = _pool(catalog, _workload("train", 2, MIG_3G))
    c.kueue["admissionchecks"][0]["metadata"]["annotations"] = {"mig-agent.dev/verify": "true"}
    run_round(c, catalog, S, controller_name=CONTROLLER)
    _at(c, catalog, "gpu-a", "all-3g")
    [d] = run_round(c, catalog, S, controller_name=CONTROLLER).decisions
    assert d.verdict.value == "Wait"
    assert _entry(c, "train")["message"] == (
        "its check asks for verify (mig-agent.dev/verify), which this controller was started "
        "without"
    )


def _claiming(name: str, pods: int, state: str = "Pending") -> dict[str, Any]:
    """``_workload`` whose pods ask one 1g.10gb each by a ResourceClaimTemplate instead."""
    w = _workload(name, pods, MIG_1G, state)
    spec = w["spec"]["podSets"][0]["template"]["spec"]
    spec["containers"][0]["resources"] = {}
    spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "one-1g"}]
    return w


def test_an_admitted_workload_asking_by_claim_holds_its_dra_devices(catalog: Any) -> None:
    """On a DRA node (14 1g.10gb in its slice), a workload admitted after Ready whose 14 pods
    ask by claim template and are not bound yet keeps them all from the next one."""
    dra = advise_ops_tests._pool(catalog, "dra-b", dra=True)
    c = _pool(catalog)
    c.nodes = dra.nodes
    c.slices = dra.slices
    c.claim_templates.append(kueue_tests._template("one-1g", kueue_tests._mig("1g.10gb")))
    first = _claiming("first", 14, state="Ready")
    first["status"]["conditions"][1] = {"type": "Admitted", "status": "True"}
    label = {"mig-agent.dev/admission-workload": "first"}
    first["status"]["admissionChecks"][0]["podSetUpdates"] = [{"name": "main", "labels": label}]
    c.kueue["workloads"] = [first, _claiming("second", 1)]
    [d] = run_round(
        c, catalog, dataclasses.replace(S, dra=True), controller_name=CONTROLLER
    ).decisions
    assert (d.workload, d.verdict.value) == ("team/second", "Wait"), d
    c.kueue["workloads"] = [_claiming("second", 1)]  # first gone: its devices free
    [d] = run_round(
        c, catalog, dataclasses.replace(S, dra=True), controller_name=CONTROLLER
    ).decisions
    assert d.verdict.value == "Ready", d
