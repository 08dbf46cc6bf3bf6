"""Kueue's workloads as demand (mig_agent.core.kueue_demand), on objects shaped as Kueue v0.17
writes them (kueue.x-k8s.io/v1beta2), and through ``advise`` on FakeCluster:

* a workload that reserved quota and waits on an admission check is demand: each pod set
  ``count`` pods asking what the template asks, with its nodeSelector and tolerations and those
  of the ResourceFlavor its GPU resource was assigned; a partial admission's count wins;
* one that quota holds back (QuotaReserved False, or not yet set) is left out and counted, an
  admitted, finished or deactivated one is not demand at all, a pod set without GPUs is no
  demand, and a pod asking two device kinds is not understood;
* property: every GPU workload ends in exactly one of demand, left out for quota, not
  understood, or skipped, and the pods of the demand are the reserved pod sets' counts;
* a pod set asking by ResourceClaimTemplate is ``count`` pods each asking what the template's
  requests ask (DeviceClass mig.nvidia.com by profile selector, either way round; gpu.nvidia.com);
  one naming a shared ResourceClaim asks its devices once for the pod set, nothing once it is
  allocated; a template or claim not found, a pod set asking by resource and by claim, or by
  claims of two kinds, is not understood, naming why; a class not NVIDIA's is no demand;
* the kube boundary lists v1beta2, falls back to v1beta1 where that is not served, and reads
  nothing where Kueue is not installed;
* advise proposes the relabel that gives a waiting workload's gang its devices, says so in
  text and JSON, and counts the workloads left out for quota; ``--apply`` relabels for it
  without looking for its pods (none exists before Kueue admits it); a workload asking by claim
  template gets the relabel of a DRA node, its ask renamed to the extended resource a
  DeviceClass serves and kept to DRA nodes, as a pending pod's claim is.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from mig_agent.config.profiles import load_catalog
from mig_agent.config.settings import Settings
from mig_agent.core import device_classes
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.kueue_demand import workload_demand
from mig_agent.core.layout import MigProfile
from mig_agent.core.planner import plan
from mig_agent.core.scheduling import Taint
from mig_agent.core.snapshot import compact
from mig_agent.kube.client import KubernetesCluster
from mig_agent.node.apply import execute
from mig_agent.node.waits import Clock
from mig_agent.ops import advise as ops_advise
from mig_agent.ops.advise_read import read_pool
from tests.unit import test_advise_ops as advise_ops_tests
from tests.unit.fake_cluster import FakeCluster
from tests.unit.fake_gpus import FakeGpus

MIG_1G, MIG_3G = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"
S = Settings()


def _condition(kind: str, status: str, reason: str = "", message: str = "") -> dict[str, str]:
    return {"type": kind, "status": status, "reason": reason, "message": message}


def _workload(
    name: str,
    *pod_sets: tuple[str, int, dict[str, int]],
    conditions: list[dict[str, str]] | None = None,
    assignments: list[dict[str, Any]] | None = None,
    spec: dict[str, Any] | None = None,
    active: bool = True,
) -> dict[str, Any]:
    """A Workload with pod sets (name, count, requests of its one container)."""
    status: dict[str, Any] = {"conditions": conditions or []}
    if assignments is not None:
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": assignments}
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {"namespace": "team", "name": name},
        "spec": {
            "active": active,
            "queueName": "lq",
            "podSets": [
                {
                    "name": ps,
                    "count": count,
                    "template": {
                        "spec": {
                            **(spec or {}),
                            "containers": [
                                {
                                    "name": "c",
                                    "image": "x",
                                    "resources": {
                                        "requests": {k: str(v) for k, v in requests.items()},
                                        "limits": {k: str(v) for k, v in requests.items()},
                                    },
                                }
                            ],
                        }
                    },
                }
                for ps, count, requests in pod_sets
            ],
        },
        "status": status,
    }


RESERVED = [
    _condition("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
    _condition("Admitted", "False", "NoChecks", "The workload has not all checks ready"),
]
FOR_QUOTA = [
    _condition(
        "QuotaReserved",
        "False",
        "Pending",
        "couldn't assign flavors to pod set main: insufficient quota for "
        "nvidia.com/mig-1g.10gb in flavor default, request > maximum capacity (3 > 2)",
    )
]
ADMITTED = [_condition("QuotaReserved", "True"), _condition("Admitted", "True")]


def test_a_workload_waiting_on_its_checks_is_demand_per_pod_set() -> None:
    w = _workload("train", ("main", 3, {MIG_1G: 1}), ("driver", 1, {"cpu": 1}), conditions=RESERVED)
    got = workload_demand([w])
    assert got.workloads == ["team/train"]
    (ps,) = got.pod_sets
    assert (ps.pod_set, ps.count, ps.ask.kind, ps.ask.count) == ("main", 3, MIG_1G, 1)
    assert ps.pods() == ["team/train[main/0]", "team/train[main/1]", "team/train[main/2]"]
    assert got.waiting_for_quota == {} and got.not_understood == {}


def test_quota_held_workloads_are_left_out_with_the_reason() -> None:
    held = _workload("big", ("main", 3, {MIG_1G: 1}), conditions=FOR_QUOTA)
    fresh = _workload("new", ("main", 1, {MIG_3G: 1}))
    cpu_only = _workload("cpu", ("main", 1, {"cpu": 2}), conditions=FOR_QUOTA)
    got = workload_demand([held, fresh, cpu_only])
    assert got.pod_sets == ()
    assert sorted(got.waiting_for_quota) == ["team/big", "team/new"]
    assert got.waiting_for_quota["team/big"].startswith("Pending: couldn't assign flavors")
    assert got.waiting_for_quota["team/new"] == "no quota reserved yet"


def test_admitted_finished_and_deactivated_workloads_are_not_demand() -> None:
    finished = [*RESERVED, _condition("Finished", "True", "Succeeded")]
    got = workload_demand(
        [
            _workload("running", ("main", 2, {MIG_1G: 1}), conditions=ADMITTED),
            _workload("done", ("main", 2, {MIG_1G: 1}), conditions=finished),
            _workload("off", ("main", 2, {MIG_1G: 1}), conditions=RESERVED, active=False),
        ]
    )
    assert got == type(got)()


def test_the_flavor_and_template_constraints_and_a_partial_admission_count() -> None:
    toleration = {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
    w = _workload(
        "pinned",
        ("main", 4, {MIG_3G: 2}),
        conditions=RESERVED,
        assignments=[{"name": "main", "count": 2, "flavors": {MIG_3G: "h100"}}],
        spec={"nodeSelector": {"zone": "a"}},
    )
    flavor = {
        "metadata": {"name": "h100"},
        "spec": {"nodeLabels": {"pool": "h100"}, "tolerations": [toleration]},
    }
    (ps,) = workload_demand([w], {"h100": flavor}).pod_sets
    assert (ps.count, ps.ask.count) == (2, 2)
    taint = [Taint("gpu", "", "NoSchedule")]
    assert ps.constraints.refusal("n", {"zone": "a", "pool": "h100"}, taint) == ""
    assert ps.constraints.refusal("n", {"zone": "a"}, []) != ""
    unflavored = workload_demand([w]).pod_sets[0]
    assert unflavored.constraints.refusal("n", {"zone": "a"}, taint) != ""  # taint not tolerated


def test_a_pod_asking_two_device_kinds_is_not_understood() -> None:
    w = _workload("odd", ("main", 1, {MIG_1G: 1, MIG_3G: 1}), conditions=RESERVED)
    got = workload_demand([w])
    assert got.pod_sets == () and "several GPU device kinds" in got.not_understood["team/odd"]


# DRA: pod sets asking by ResourceClaim, as resource.k8s.io/v1 writes templates and claims
PROFILE = 'device.attributes["gpu.nvidia.com"].profile == "{}"'


def _mig(profile: str, count: int = 1, expression: str = PROFILE) -> dict[str, Any]:
    return {
        "name": "mig",
        "exactly": {
            "deviceClassName": "mig.nvidia.com",
            "count": count,
            "selectors": [{"cel": {"expression": expression.format(profile)}}],
        },
    }


def _template(name: str, *requests: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"namespace": "team", "name": name},
        "spec": {"spec": {"devices": {"requests": list(requests)}}},
    }


def _shared(name: str, *requests: dict[str, Any], allocated: bool = False) -> dict[str, Any]:
    claim: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "team", "name": name},
        "spec": {"devices": {"requests": list(requests)}},
    }
    if allocated:
        claim["status"] = {"allocation": {"devices": {"results": []}}}
    return claim


def _by_claim(
    name: str, count: int, *claims: dict[str, str], requests: dict[str, int] | None = None
) -> dict[str, Any]:
    """A reserved workload of one pod set ``main`` whose pods name ``claims``
    (spec.resourceClaims entries), besides the container's ``requests``."""
    w = _workload(name, ("main", count, requests or {}), conditions=RESERVED)
    w["spec"]["podSets"][0]["template"]["spec"]["resourceClaims"] = list(claims)
    return w


def _keyed(*objects: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in objects}


def test_a_claim_template_asks_per_pod_times_the_count() -> None:
    t = _template("two-3g", _mig("3g.40gb", 2))
    w = _by_claim("train", 3, {"name": "gpus", "resourceClaimTemplateName": "two-3g"})
    got = workload_demand([w], templates=_keyed(t))
    assert got.not_understood == {}
    (ps,) = got.pod_sets
    assert (ps.count, ps.ask.kind, ps.ask.count) == (3, "dra:3g.40gb", 2)
    assert ps.pods() == [f"team/train[main/{i}]" for i in range(3)]
    whole = _template("gpu", {"name": "g", "exactly": {"deviceClassName": "gpu.nvidia.com"}})
    w = _by_claim("whole", 2, {"name": "g", "resourceClaimTemplateName": "gpu"})
    (ps,) = workload_demand([w], templates=_keyed(whole)).pod_sets
    assert (ps.count, ps.ask.kind, ps.ask.count) == (2, "dra:gpu", 1)


def test_a_shared_claim_asks_once_for_the_pod_set_and_nothing_once_allocated() -> None:
    entry = {"name": "shared", "resourceClaimName": "pool-1g"}
    w = _by_claim("serve", 4, entry)
    got = workload_demand([w], claims=_keyed(_shared("pool-1g", _mig("1g.10gb", 2))))
    (ps,) = got.pod_sets
    assert (ps.count, ps.ask.kind, ps.ask.count) == (1, "dra:1g.10gb", 2)
    assert ps.pods() == ["team/serve[main/claim:pool-1g]"]
    allocated = _keyed(_shared("pool-1g", _mig("1g.10gb", 2), allocated=True))
    got = workload_demand([w], claims=allocated)
    assert got == type(got)()  # asks nothing more: no demand, nothing odd


def test_a_template_or_claim_not_found_is_not_understood_naming_it() -> None:
    w = _by_claim("lost", 2, {"name": "gpus", "resourceClaimTemplateName": "gone"})
    got = workload_demand([w], templates={})
    assert got.pod_sets == ()
    assert got.not_understood == {
        "team/lost": "pod set 'main': ResourceClaimTemplate team/gone not found"
    }
    w = _by_claim("lost", 2, {"name": "gpus", "resourceClaimName": "gone"})
    assert workload_demand([w], claims={}).not_understood == {
        "team/lost": "pod set 'main': ResourceClaim team/gone not found"
    }


def test_without_templates_or_claims_given_claims_are_not_read() -> None:
    # admission_check's admitted workloads: a pod set by resource still asks what it asked
    entry = {"name": "gpus", "resourceClaimTemplateName": "gone"}
    assert workload_demand([_by_claim("by-claim", 2, entry)]) == workload_demand([])
    (ps,) = workload_demand([_by_claim("both", 2, entry, requests={MIG_1G: 1})]).pod_sets
    assert (ps.count, ps.ask.kind) == (2, MIG_1G)


def test_claims_of_several_kinds_or_claims_and_resources_are_not_understood() -> None:
    t1, t3 = _template("one-1g", _mig("1g.10gb")), _template("one-3g", _mig("3g.40gb"))
    templates = _keyed(t1, t3)
    a = {"name": "a", "resourceClaimTemplateName": "one-1g"}
    b = {"name": "b", "resourceClaimTemplateName": "one-3g"}
    got = workload_demand([_by_claim("two", 1, a, b)], templates=templates)
    assert (
        "several GPU device kinds at once (dra:1g.10gb, dra:3g.40gb)"
        in got.not_understood["team/two"]
    )
    both = _by_claim("both", 1, b, requests={MIG_1G: 1})
    got = workload_demand([both], templates=templates)
    assert got.pod_sets == ()
    assert (
        f"several GPU device kinds at once ({MIG_1G}, dra:3g.40gb)"
        in got.not_understood["team/both"]
    )
    shared = {"name": "s", "resourceClaimName": "pool-3g"}
    claims = _keyed(_shared("pool-3g", _mig("3g.40gb")))
    got = workload_demand([_by_claim("mixed", 2, b, shared)], templates=templates, claims=claims)
    assert "per pod and a shared claim at once" in got.not_understood["team/mixed"]


def test_a_class_not_nvidias_is_no_demand() -> None:
    fpga = _template("fpga", {"name": "f", "exactly": {"deviceClassName": "fpga.example.com"}})
    entry = {"name": "f", "resourceClaimTemplateName": "fpga"}
    got = workload_demand([_by_claim("fpga", 2, entry)], templates=_keyed(fpga))
    assert got == type(got)()
    # beside a MIG resource: the resource is the demand
    w = _by_claim("fpga-and-mig", 2, entry, requests={MIG_1G: 1})
    (ps,) = workload_demand([w], templates=_keyed(fpga)).pod_sets
    assert (ps.count, ps.ask.kind, ps.ask.count) == (2, MIG_1G, 1)


@pytest.mark.parametrize(
    ("request_", "want"),
    [
        (_mig("3g.40gb", expression="'{}' == device.attributes['gpu.nvidia.com'].profile"), ""),
        (
            _mig("3g.40gb", expression='device.attributes["gpu.nvidia.com"].profile != "{}"'),
            "pod set 'main': claim gpus (template t), request 'mig': selector "
            '\'device.attributes["gpu.nvidia.com"].profile != "3g.40gb"\' is not understood '
            "(only profile == '<name>')",
        ),
        (
            {"name": "mig", "firstAvailable": [{"name": "a"}]},
            "pod set 'main': claim gpus (template t), request 'mig': a prioritized list "
            "(firstAvailable) is not understood",
        ),
    ],
)
def test_the_profile_selector_of_a_template(request_: dict[str, Any], want: str) -> None:
    w = _by_claim("sel", 1, {"name": "gpus", "resourceClaimTemplateName": "t"})
    got = workload_demand([w], templates=_keyed(_template("t", request_)))
    if want:
        assert got.not_understood == {"team/sel": want}
    else:
        assert [(p.ask.kind, p.ask.count) for p in got.pod_sets] == [("dra:3g.40gb", 1)]


def test_a_claim_pod_set_takes_every_flavor_assigned_to_it() -> None:
    # with Kueue's DRA gate on, a claim's quota is a logical resource (deviceClassMappings), by
    # a name advise does not know: the pod set's flavors are all Kueue adds to its pods
    w = _by_claim("pinned", 2, {"name": "gpus", "resourceClaimTemplateName": "t"})
    w["status"]["admission"] = {
        "clusterQueue": "cq",
        "podSetAssignments": [{"name": "main", "count": 2, "flavors": {"mig-3g": "h100"}}],
    }
    flavor = {"metadata": {"name": "h100"}, "spec": {"nodeLabels": {"pool": "h100"}}}
    got = workload_demand([w], {"h100": flavor}, templates=_keyed(_template("t", _mig("3g.40gb"))))
    (ps,) = got.pod_sets
    assert ps.constraints.refusal("n", {"pool": "h100"}, []) == ""
    assert ps.constraints.refusal("n", {}, []) != ""


_states = st.sampled_from(["reserved", "quota", "fresh", "admitted", "finished", "off"])
_pod_sets = st.lists(
    st.tuples(
        st.integers(0, 4), st.sampled_from([{MIG_1G: 1}, {MIG_3G: 2}, {"cpu": 1}, {MIG_1G: 1}])
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(_states, _pod_sets), max_size=6))
def test_every_gpu_workload_lands_in_one_place_and_pods_add_up(
    specs: list[tuple[str, list[tuple[int, dict[str, int]]]]],
) -> None:
    conditions = {
        "reserved": RESERVED,
        "quota": FOR_QUOTA,
        "fresh": [],
        "admitted": ADMITTED,
        "finished": [*RESERVED, _condition("Finished", "True")],
        "off": RESERVED,
    }
    workloads = [
        _workload(
            f"w{i}",
            *[(f"ps{j}", n, r) for j, (n, r) in enumerate(sets)],
            conditions=conditions[state],
            active=state != "off",
        )
        for i, (state, sets) in enumerate(specs)
    ]
    got = workload_demand(workloads)
    for i, (state, sets) in enumerate(specs):
        name = f"team/w{i}"
        gpu_pods = sum(n for n, r in sets if "cpu" not in r)
        places = [name in got.workloads, name in got.waiting_for_quota]
        assert sum(places) <= 1
        if state == "reserved" and gpu_pods:
            assert name in got.workloads
            pods = sum(p.count for p in got.pod_sets if p.workload == name)
            assert pods == gpu_pods
        elif state in ("quota", "fresh") and gpu_pods:
            assert name in got.waiting_for_quota
        else:
            assert not any(places)


class _Answer:
    def __init__(self, body: bytes) -> None:
        self.data = body

    def release_conn(self) -> None:
        pass


def _served(*versions: str) -> Any:
    """A list_cluster_custom_object that serves ``versions`` only (404 for the others)."""
    asked: list[str] = []

    def list_cluster_custom_object(group: str, version: str, plural: str, **_: Any) -> _Answer:
        asked.append(version)
        if version not in versions:
            raise ApiException(status=404, reason="Not Found")
        item = {"apiVersion": f"{group}/{version}", "metadata": {"name": plural}}
        return _Answer(json.dumps({"items": [item]}).encode())

    list_cluster_custom_object.asked = asked
    return list_cluster_custom_object


@pytest.mark.parametrize(
    ("served", "asked", "got"),
    [
        (("v1beta2", "v1beta1"), ["v1beta2"], ["kueue.x-k8s.io/v1beta2"]),
        (("v1beta1",), ["v1beta2", "v1beta1"], ["kueue.x-k8s.io/v1beta1"]),
        ((), ["v1beta2", "v1beta1"], []),
    ],
)
def test_the_boundary_lists_the_newest_version_served(
    served: tuple[str, ...], asked: list[str], got: list[str]
) -> None:
    k = KubernetesCluster(client.ApiClient(), attempts=1)
    fake = _served(*served)
    k._custom = type("Custom", (), {"list_cluster_custom_object": staticmethod(fake)})()
    try:
        assert [w["apiVersion"] for w in k.list_kueue("workloads")] == got
    finally:
        k.close()
    assert fake.asked == asked


# the approved layouts of the Kueue tests (test_admission_check_ops and tests/cluster import them)
CONFIG = """
version: v1
mig-configs:
  all-1g.10gb:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
  all-3g:
    - devices: all
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
"""


@pytest.fixture
def catalog(tmp_path: Path) -> Any:
    (tmp_path / "layouts.yaml").write_text(CONFIG)
    return load_catalog([tmp_path / "layouts.yaml"])


def _pool(catalog: Any, *names: str) -> FakeCluster:
    gpus = FakeGpus([MODELS["H100-80GB"]] * 2)
    execute(plan(catalog.get("all-1g.10gb"), gpus.observe(), gpus.models()), gpus)
    state = compact(gpus.observe(), gpus.models())
    c = FakeCluster()
    for name in names:
        labels = {S.config_label: "all-1g.10gb", S.state_label: "success"}
        c.add_node(name, labels, {MIG_1G: "14"})
        c.nodes[name] = dataclasses.replace(
            c.nodes[name], annotations={S.gpu_state_annotation: state}
        )
    return c


def test_advise_serves_a_waiting_workloads_gang_and_counts_those_held_by_quota(
    catalog: Any,
) -> None:
    c = _pool(catalog, "gpu-a", "gpu-b")
    c.kueue["workloads"] = [
        _workload("train", ("main", 3, {MIG_3G: 1}), conditions=RESERVED),
        _workload("big", ("main", 9, {MIG_1G: 1}), conditions=FOR_QUOTA),
        _workload("running", ("main", 2, {MIG_3G: 1}), conditions=ADMITTED),
    ]
    report = ops_advise.run(c, catalog, settings=S)
    served = sorted(pod for p in report.proposals for pod in p.serves)
    assert served == [f"team/train[main/{i}]" for i in range(3)]
    assert {p.option.layout for p in report.proposals} == {"all-3g"}
    assert len(report.proposals) == 1  # all-3g: four 3g.40gb a node, room for the three
    assert report.workloads == ("team/train",)
    lines = ops_advise.report_lines(report)
    assert "Kueue workloads read as demand: 1" in lines
    assert "left out: 1 workload(s) wait for quota, not devices" in lines
    doc = ops_advise.report_json(report)["workloads"]
    assert doc["read"] == ["team/train"]
    assert [w["workload"] for w in doc["left_out_for_quota"]] == ["team/big"]


def test_a_gang_too_big_for_the_pool_is_served_not_at_all(catalog: Any) -> None:
    c = _pool(catalog, "gpu-a")
    c.kueue["workloads"] = [_workload("huge", ("main", 5, {MIG_3G: 1}), conditions=RESERVED)]
    report = ops_advise.run(c, catalog, settings=S)
    assert report.proposals == ()
    assert len(report.unserved) == 5
    assert all("gang workload:team/huge" in why for _, why in report.unserved)


def test_apply_relabels_for_a_workload_and_follows_none_of_its_pods(catalog: Any) -> None:
    c = _pool(catalog, "gpu-a")
    c.kueue["workloads"] = [_workload("train", ("main", 2, {MIG_3G: 1}), conditions=RESERVED)]

    def agent(cluster: FakeCluster) -> None:
        node = cluster.nodes["gpu-a"]
        if node.labels.get(S.config_label) == "all-3g" and S.state_label not in node.labels:
            cluster.nodes["gpu-a"] = dataclasses.replace(
                node, labels={**node.labels, S.state_label: "success"}
            )

    c.on_change = agent
    report = ops_advise.run(c, catalog, settings=S)
    assert [p.node for p in report.proposals] == ["gpu-a"]
    t = [0.0]
    clock = Clock(now=lambda: t[0], sleep=lambda s: t.__setitem__(0, t[0] + s))
    lines: list[str] = []
    applied = ops_advise.apply(c, catalog, report, clock=clock, out=lines.append, poll_s=0.1)
    assert c.nodes["gpu-a"].labels[S.config_label] == "all-3g"
    assert applied.pods == () and applied.exit_code == 0, lines


def _dra_pool(catalog: Any) -> FakeCluster:
    """A device-plugin node at all-3g (3g.40gb free today) and a DRA node at all-1g.10gb, its
    devices in a ResourceSlice, with DeviceClasses serving 1g.10gb and 3g.40gb as resources."""
    c = _pool(catalog, "plugin-a")
    c.nodes["plugin-a"] = dataclasses.replace(
        c.nodes["plugin-a"],
        labels={**c.nodes["plugin-a"].labels, S.config_label: "all-3g"},
        annotations={S.gpu_state_annotation: advise_ops_tests._state(catalog, "all-3g")[0]},
    )
    dra = advise_ops_tests._pool(catalog, "dra-b", dra=True)
    c.nodes.update(dra.nodes)
    c.slices = dra.slices
    for p in ("1g.10gb", "3g.40gb"):
        made = device_classes.device_class(MigProfile.parse(p))
        c.device_classes[made["metadata"]["name"]] = made
    return c


def test_advise_relabels_a_dra_node_for_a_workload_asking_by_claim_template(catalog: Any) -> None:
    c = _dra_pool(catalog)
    c.claim_templates.append(_template("one-3g", _mig("3g.40gb")))
    entry = {"name": "gpus", "resourceClaimTemplateName": "one-3g"}
    c.kueue["workloads"] = [_by_claim("train", 3, entry)]
    report = ops_advise.run(c, catalog, settings=S)
    assert report.workloads == ("team/train",) and report.unserved == ()
    # the 3g.40gb of the plugin node are no claim's: the DRA node is relabelled, one gang
    [proposal] = report.proposals
    assert (proposal.node, proposal.option.layout) == ("dra-b", "all-3g")
    assert sorted(proposal.serves) == [f"team/train[main/{i}]" for i in range(3)]
    assert "dra:3g.40gb" not in proposal.option.resources  # renamed, as the supply is
    wants = read_pool(c, catalog, S).wants
    assert {(w.kind, w.nodes) for w in wants} == {(MIG_3G, frozenset({"dra-b"}))}

    c.claim_templates.clear()
    report = ops_advise.run(c, catalog, settings=S)
    assert report.proposals == ()
    assert dict(report.unserved) == {
        "workload team/train": "pod set 'main': ResourceClaimTemplate team/one-3g not found"
    }
