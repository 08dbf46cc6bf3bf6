"""We test these aspects of ``advise`` as the operator runs it (mig_agent.ops.advise), against
FakeCluster with nodes whose agents published their GPU state:

* a pod Pending for a profile no node offers gets the proposal that changes the fewest GPUs,
  on a node where no running pod loses its device; nothing is proposed when nothing is pending
  or when the pending pod fits a node today;
* a pod pinned by nodeSelector to a node where only an evicting layout serves it is unserved
  with a reason naming the selector, proposed with --allow-evict, and refused again when a
  PodDisruptionBudget allows no disruption;
* nodes cordoned, with a change under way, or tainted against the pod are left alone and named;
* a profile no approved layout offers is unserved with that reason; --max-nodes caps proposals;
* a DRA node: a pending pod whose ResourceClaim (as the API returns it) asks DeviceClass
  mig.nvidia.com for profile == '3g.40gb' is served the same way;
* demand parsing of ResourceClaims and scheduling constraints on real-shaped objects, and what
  is not understood is said;
* the JSON has the documented fields; --apply relabels through the rollout and reports the
  served pods scheduled (what it checks again before each relabel: test_advise_apply.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from mig_agent.config.profiles import load_catalog
from mig_agent.config.settings import Settings
from mig_agent.core import demand, dra_devices
from mig_agent.core.errors import ConfigError
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.planner import plan
from mig_agent.core.scheduling import (
    LabelSelector,
    Taint,
    constraints_of,
    label_selector_of,
)
from mig_agent.core.snapshot import compact
from mig_agent.kube.client import _node, _pod
from mig_agent.kube.cluster import PdbView, PodRef
from mig_agent.node.apply import execute
from mig_agent.node.waits import Clock
from mig_agent.ops import advise as ops_advise
from tests.unit.fake_cluster import FakeCluster
from tests.unit.fake_gpus import FakeGpus

S = Settings()
CONFIG = """
version: v1
mig-configs:
  all-1g.10gb:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
  one-3g:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
    - devices: [1]
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
  all-3g:
    - devices: all
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
"""
MIG_1G, MIG_3G = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"
PROFILE_3G = 'device.attributes["gpu.nvidia.com"].profile == "3g.40gb"'


@pytest.fixture
def catalog(tmp_path: Path) -> Any:
    (tmp_path / "layouts.yaml").write_text(CONFIG)
    return load_catalog([tmp_path / "layouts.yaml"])


def _state(catalog: Any, layout: str) -> tuple[str, dict[int, int]]:
    gpus = FakeGpus([MODELS["H100-80GB"]] * 2)
    execute(plan(catalog.get(layout), gpus.observe(), gpus.models()), gpus)
    return compact(gpus.observe(), gpus.models()), {}


def _pool(catalog: Any, *names: str, dra: bool = False) -> FakeCluster:
    c = FakeCluster()
    state, _ = _state(catalog, "all-1g.10gb")
    for name in names:
        c.add_node(
            name,
            {
                S.config_label: "all-1g.10gb",
                S.state_label: "success",
                "kubernetes.io/hostname": name,
            },
            {} if dra else {MIG_1G: "14"},
        )
        c.nodes[name] = dataclasses.replace(
            c.nodes[name], annotations={S.gpu_state_annotation: state}
        )
        if dra:
            c.slices.append(_slice(name))
    return c


def _slice(node: str) -> dict[str, Any]:
    devices = [
        {
            "name": f"gpu-{g}-mig-1g10gb-19-{i}",
            "attributes": {"type": {"string": "mig"}, "profile": {"string": "1g.10gb"}},
        }
        for g in range(2)
        for i in range(7)
    ]
    return {
        "metadata": {"name": f"0-gpu.nvidia.com-{node}-abcde"},
        "spec": {
            "driver": dra_devices.DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def _pending(c: FakeCluster, name: str, **requests: int) -> PodRef:
    ref = c.add_pod("team", name, "", gpu={k.replace("_", "/"): v for k, v in requests.items()})
    c.pods[ref] = dataclasses.replace(c.pods[ref], phase="Pending")
    return ref


def _ask_3g(c: FakeCluster, name: str, **constraints: Any) -> PodRef:
    ref = c.add_pod("team", name, "", gpu={MIG_3G: 1})
    c.pods[ref] = dataclasses.replace(
        c.pods[ref], phase="Pending", constraints=constraints_of(constraints)
    )
    return ref


def _rows(report: ops_advise.Report) -> list[tuple[str, str, tuple[int, ...], tuple[str, ...]]]:
    return [(p.node, p.option.layout, p.option.gpus_changed, p.serves) for p in report.proposals]


def test_a_pending_profile_gets_the_smallest_change_where_nobody_is_evicted(catalog: Any) -> None:
    c = _pool(catalog, "gpu-a", "gpu-b")
    c.add_pod("team", "busy", "gpu-a", gpu={MIG_1G: 1})
    _ask_3g(c, "wants-3g")
    report = ops_advise.run(c, catalog, settings=S)
    assert _rows(report) == [("gpu-b", "one-3g", (1,), ("team/wants-3g",))]
    assert report.unserved == () and report.optimal
    p = report.proposals[0]
    assert p.resources_before == {MIG_1G: 14}
    assert p.option.resources == {MIG_1G: 7, MIG_3G: 2}
    lines = ops_advise.report_lines(report)
    assert "gpu-b" in lines[1] and "all-1g.10gb -> one-3g" in lines[1]


def test_nothing_pending_nothing_proposed_and_a_pod_that_fits_today_is_left_to_the_scheduler(
    catalog: Any,
) -> None:
    c = _pool(catalog, "gpu-a")
    assert ops_advise.run(c, catalog).proposals == ()
    _pending(c, "fits", **{"nvidia.com_mig-1g.10gb": 1})
    report = ops_advise.run(c, catalog)
    assert report.proposals == () and report.unserved == ()
    assert ops_advise.report_lines(report) == ["no relabel proposed"]


def test_a_pinned_pod_is_named_with_its_selector_then_served_with_allow_evict(
    catalog: Any,
) -> None:
    c = _pool(catalog, "gpu-a", "gpu-b")
    busy = c.add_pod("team", "busy", "gpu-a", gpu={MIG_1G: 1}, labels={"app": "busy"})
    _ask_3g(c, "pinned", nodeSelector={"kubernetes.io/hostname": "gpu-a"})
    report = ops_advise.run(c, catalog)
    assert report.proposals == ()
    [(pod, why)] = report.unserved
    assert pod == "team/pinned"
    assert "nodeSelector kubernetes.io/hostname=gpu-a" in why and "--allow-evict" in why

    report = ops_advise.run(c, catalog, allow_evict=True)
    assert [(p.node, p.option.evicts) for p in report.proposals] == [("gpu-a", (str(busy),))]

    c.pdbs.append(PdbView("team", "busy-pdb", LabelSelector({"app": "busy"}), 0))
    report = ops_advise.run(c, catalog, allow_evict=True)
    assert report.proposals == ()
    assert "PodDisruptionBudgets forbid" in report.unserved[0][1]


def test_nodes_left_alone_are_named(catalog: Any) -> None:
    c = _pool(catalog, "gpu-a", "gpu-b", "gpu-c")
    c.patch_node("gpu-a", unschedulable=True)
    c.patch_node("gpu-b", labels={S.state_label: "pending"})
    c.nodes["gpu-c"] = dataclasses.replace(c.nodes["gpu-c"], taints=(Taint("dedicated", "x"),))
    _ask_3g(c, "wants-3g")
    report = ops_advise.run(c, catalog)
    assert report.proposals == ()
    assert report.left_alone == {
        "gpu-a": "cordoned",
        "gpu-b": "a change is under way (state pending)",
    }
    assert report.unserved == (
        (
            "team/wants-3g",
            "every node it may use is left alone: gpu-a (cordoned), gpu-b "
            "(a change is under way (state pending))",
        ),
    )
    _ask_3g(c, "tolerates", tolerations=[{"key": "dedicated", "operator": "Exists"}])
    report = ops_advise.run(c, catalog)
    assert _rows(report) == [("gpu-c", "one-3g", (1,), ("team/tolerates",))]


def test_a_profile_no_layout_offers_and_max_nodes(catalog: Any) -> None:
    c = _pool(catalog, "gpu-a", "gpu-b")
    _pending(c, "huge", **{"nvidia.com_mig-7g.80gb": 1})
    for i in range(6):
        _ask_3g(c, f"w{i}")
    assert [len(p.serves) for p in ops_advise.run(c, catalog).proposals] == [4, 2]
    report = ops_advise.run(c, catalog, max_nodes=1)
    assert len(report.proposals) == 1 and len(report.proposals[0].serves) == 4
    reasons = dict(report.unserved)
    assert reasons["team/huge"] == "no approved layout offers mig-7g.80gb on any GPU node"
    assert sum("beyond --max-nodes 1" in r for r in reasons.values()) == 2
    with pytest.raises(ConfigError, match="max-nodes"):
        ops_advise.run(c, catalog, max_nodes=0)


def _claim(name: str, request: dict[str, Any], allocated: bool = False) -> dict[str, Any]:
    claim: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "team"},
        "spec": {"devices": {"requests": [{"name": "mig", **request}]}},
    }
    if allocated:
        claim["status"] = {"allocation": {"devices": {"results": []}}}
    return claim


def _mig_request(expression: str = PROFILE_3G, **more: Any) -> dict[str, Any]:
    return {
        "exactly": {
            "deviceClassName": "mig.nvidia.com",
            "selectors": [{"cel": {"expression": expression}}],
            **more,
        }
    }


def test_a_dra_claim_for_a_profile_is_served_the_same_way(catalog: Any) -> None:
    c = _pool(catalog, "dra-a", dra=True)
    c.claims.append(_claim("wants-3g-claim", _mig_request()))
    raw = {
        "metadata": {"name": "wants-3g", "namespace": "team"},
        "spec": {
            "containers": [{"name": "c", "image": "x"}],
            "resourceClaims": [{"name": "mig", "resourceClaimTemplateName": "t"}],
        },
        "status": {
            "phase": "Pending",
            "resourceClaimStatuses": [{"name": "mig", "resourceClaimName": "wants-3g-claim"}],
        },
    }
    pod = _pod(raw)
    assert pod.claims == ("wants-3g-claim",)
    c.pods[pod.ref] = pod
    report = ops_advise.run(c, catalog)
    assert _rows(report) == [("dra-a", "one-3g", (1,), ("team/wants-3g",))]
    assert report.proposals[0].option.resources == {"dra:1g.10gb": 7, "dra:3g.40gb": 2}


@pytest.mark.parametrize(
    ("request_", "want"),
    [
        (_mig_request(), demand.Ask("dra:3g.40gb", 1)),
        (
            _mig_request("'3g.40gb' == device.attributes['gpu.nvidia.com'].profile", count=2),
            demand.Ask("dra:3g.40gb", 2),
        ),
        ({"exactly": {"deviceClassName": "gpu.nvidia.com"}}, demand.Ask("dra:gpu", 1)),
        (
            _mig_request('device.attributes["gpu.nvidia.com"].profile != "1g.10gb"'),
            "is not understood (only profile == '<name>')",
        ),
        (_mig_request(allocationMode="All"), "allocation mode All is not understood"),
        ({"firstAvailable": [{"name": "a"}]}, "firstAvailable) is not understood"),
        ({"exactly": {"deviceClassName": "mig.nvidia.com"}}, "without a profile selector"),
        ({"exactly": {"deviceClassName": "other.example.com"}}, None),
    ],
)
def test_claim_demand(request_: dict[str, Any], want: demand.Ask | str | None) -> None:
    got = demand.from_claims([_claim("c", request_)])
    if isinstance(want, str):
        assert isinstance(got, str) and want in got and "claim c" in got
    else:
        assert got == want
    assert demand.from_claims([_claim("c", request_, allocated=True)]) is None


def test_pods_asking_several_kinds_are_said_not_understood(catalog: Any) -> None:
    c = _pool(catalog, "gpu-a")
    _pending(c, "both", **{"nvidia.com_mig-3g.40gb": 1, "nvidia.com_mig-1g.10gb": 1})
    report = ops_advise.run(c, catalog)
    assert report.unserved[0][0] == "team/both"
    assert "several GPU device kinds" in report.unserved[0][1]


def test_scheduling_constraints_read_from_real_shaped_objects() -> None:
    pod = _pod(
        {
            "metadata": {"name": "p", "namespace": "team"},
            "spec": {
                "nodeSelector": {"pool": "gpu"},
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {"key": "gen", "operator": "Gt", "values": ["8"]}
                                    ]
                                },
                                {
                                    "matchFields": [
                                        {"key": "metadata.name", "operator": "In", "values": ["n2"]}
                                    ]
                                },
                            ]
                        }
                    }
                },
                "tolerations": [
                    {"key": "gpu", "operator": "Equal", "value": "yes", "effect": "NoSchedule"}
                ],
            },
        }
    )
    node = _node(
        {
            "metadata": {"name": "n1", "labels": {"pool": "gpu", "gen": "9"}},
            "spec": {"taints": [{"key": "gpu", "value": "yes", "effect": "NoSchedule"}]},
        }
    )
    k = pod.constraints
    assert node.taints == (Taint("gpu", "yes", "NoSchedule"),)
    assert k.refusal("n1", node.labels, node.taints) == ""
    assert k.refusal("n1", {"pool": "gpu", "gen": "7"}, ()) == "required node affinity"
    assert k.refusal("n2", {"pool": "gpu"}, ()) == ""
    assert k.refusal("n2", {}, ()) == "nodeSelector pool=gpu"
    assert k.refusal("n1", node.labels, (Taint("other", "", "NoExecute"),)).startswith("taint")
    assert k.refusal("n1", node.labels, (Taint("other", "", "PreferNoSchedule"),)) == ""
    assert k.describe() == "nodeSelector pool=gpu and required node affinity"
    selector = label_selector_of(
        {
            "matchLabels": {"app": "a"},
            "matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["x"]}],
        }
    )
    assert selector is not None and selector.matches({"app": "a"})
    assert not selector.matches({"app": "a", "tier": "x"})


def test_json_has_the_documented_fields(catalog: Any) -> None:
    c = _pool(catalog, "gpu-a")
    _ask_3g(c, "wants-3g")
    _pending(c, "huge", **{"nvidia.com_mig-7g.80gb": 1})
    data = ops_advise.report_json(ops_advise.run(c, catalog))
    assert set(data["proposals"][0]) >= {"node", "from", "to", "gpus_changed", "serves", "evicts"}
    assert data["proposals"][0]["serves"] == ["team/wants-3g"]
    assert data["unserved"] == [
        {"pod": "team/huge", "reason": "no approved layout offers mig-7g.80gb on any GPU node"}
    ]


class _Now:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_apply_goes_through_the_rollout_and_reports_the_pods_scheduled(catalog: Any) -> None:
    c = _pool(catalog, "gpu-a")
    ref = _ask_3g(c, "wants-3g")

    def agent(cluster: FakeCluster) -> None:  # the agent and the scheduler, at once
        node = cluster.nodes["gpu-a"]
        if node.labels.get(S.config_label) == "one-3g" and S.state_label not in node.labels:
            cluster.nodes["gpu-a"] = dataclasses.replace(
                node, labels={**node.labels, S.state_label: "success"}
            )
            cluster.pods[ref] = dataclasses.replace(cluster.pods[ref], node="gpu-a")

    c.on_change = agent
    report = ops_advise.run(c, catalog)
    lines: list[str] = []
    t = _Now()
    applied = ops_advise.apply(
        c, catalog, report, clock=Clock(now=t.now, sleep=t.sleep), out=lines.append, poll_s=0.1
    )
    assert applied.exit_code == 0
    assert c.nodes["gpu-a"].labels[S.config_label] == "one-3g"
    assert "  team/wants-3g: scheduled on gpu-a" in lines


def test_apply_with_verify_fails_a_node_that_fails_it_and_follows_no_pods(catalog: Any) -> None:
    from mig_agent.ops.verify import Check, NodeVerdict

    c = _pool(catalog, "gpu-a")
    _ask_3g(c, "wants-3g")

    def agent(cluster: FakeCluster) -> None:
        node = cluster.nodes["gpu-a"]
        if node.labels.get(S.config_label) == "one-3g" and S.state_label not in node.labels:
            cluster.nodes["gpu-a"] = dataclasses.replace(
                node, labels={**node.labels, S.state_label: "success"}
            )

    c.on_change = agent
    report = ops_advise.run(c, catalog)
    checked: list[str] = []

    def verify(node: str) -> NodeVerdict:
        checked.append(node)
        return NodeVerdict(node, (Check("pod nvidia.com/mig-3g.40gb", False, "no device"),))

    lines: list[str] = []
    t = _Now()
    applied = ops_advise.apply(
        c,
        catalog,
        report,
        clock=Clock(now=t.now, sleep=t.sleep),
        out=lines.append,
        poll_s=0.1,
        verify=verify,
    )
    assert checked == ["gpu-a"]
    assert applied.exit_code == 1
    assert any("did not succeed everywhere" in line for line in lines), lines
    assert "  team/wants-3g: not followed: gpu-a failed" in lines, lines


class _Closable(FakeCluster):
    def close(self) -> None:
        pass


def test_the_commands_parse_their_flags_and_print_json_and_yaml(
    catalog: Any, tmp_path: Path
) -> None:
    from mig_agent import cli
    from mig_agent.cli import advise_command, kubectl

    c = _pool(catalog, "gpu-a")
    pool = _Closable(nodes=c.nodes, pods=c.pods)
    _ask_3g(pool, "wants-3g")
    (tmp_path / "layouts.yaml").write_text(CONFIG)
    args = cli.build_parser().parse_args(
        ["advise", "-l", "x=y", "-f", str(tmp_path / "layouts.yaml"), "-o", "json"]
    )
    assert (args.selector, args.allow_evict, args.max_nodes, args.apply) == (
        "x=y",
        False,
        None,
        False,
    )
    args.selector = ""
    lines: list[str] = []
    assert advise_command.run(args, lambda _a: pool, lines.append) == 0
    assert '"to": "one-3g"' in lines[0]

    args = kubectl.build_parser().parse_args(
        ["advise", "--allow-evict", "--max-nodes", "2", "-o", "yaml", "-f", str(tmp_path)]
    )
    assert args.allow_evict and args.max_nodes == 2
    lines = []
    assert advise_command.run(args, lambda _a: pool, lines.append, dump=kubectl.dump_yaml) == 0
    assert "to: one-3g" in lines[0]
    with pytest.raises(SystemExit):
        kubectl.build_parser().parse_args(["advise", "--max-nodes", "0"])


def test_proposals_together_evict_no_more_of_a_budget_than_it_allows(catalog: Any) -> None:
    c = _pool(catalog, "gpu-a", "gpu-b")
    for n in ("gpu-a", "gpu-b"):
        c.add_pod("team", f"busy-{n}", n, gpu={MIG_1G: 1}, labels={"app": "busy"})
        _ask_3g(c, f"pinned-{n}", nodeSelector={"kubernetes.io/hostname": n})
    c.pdbs.append(PdbView("team", "busy-pdb", LabelSelector({"app": "busy"}), 1))
    report = ops_advise.run(c, catalog, allow_evict=True)
    assert [(p.node, p.option.evicts) for p in report.proposals] == [
        ("gpu-a", ("team/busy-gpu-a",))
    ]
    assert report.optimal
    assert dict(report.unserved) == {
        "team/pinned-gpu-b": "the layouts that offer mig-3g.40gb on the node(s) its nodeSelector "
        "kubernetes.io/hostname=gpu-b allows evict pods of PodDisruptionBudgets (team/busy-pdb) "
        "whose disruptions the proposals' evictions already take"
    }


def test_pods_of_a_pod_group_are_a_gang_served_all_or_none(catalog: Any) -> None:
    c = _pool(catalog, "gpu-a")
    group = {"scheduling.x-k8s.io/pod-group": "trainer"}
    for i in range(5):  # one node's all-3g offers four 3g.40gb: the gang of five cannot fit
        ref = _ask_3g(c, f"trainer-{i}")
        c.pods[ref] = dataclasses.replace(c.pods[ref], labels=group)
    report = ops_advise.run(c, catalog)
    assert report.proposals == ()
    reasons = dict(report.unserved)
    assert reasons["team/trainer-0"] == (
        "its gang team/trainer is served all or none, and the approved layouts cannot serve all "
        "of its pods"
    )
    _ask_3g(c, "solo")
    assert [p.serves for p in ops_advise.run(c, catalog).proposals] == [("team/solo",)]
