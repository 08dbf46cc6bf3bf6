"""We test these aspects of ``verify`` (mig_agent.ops.verify) against FakeCluster with pods played
by the test (the real kubelet, runtime and device plugin are in tests/kubelet/test_verify.py):

* a node whose published GPUs, allocatable and pods agree passes every check, and its pods are
  deleted afterwards;
* allocatable lacking a resource fails the ``allocatable`` check, naming it; no pod is made;
* a pod that the runtime could not start fails its ``pod <resource>`` check with the pod's and its
  events' words and where to look; one still Pending at the timeout fails naming the wait;
* Ctrl-C while the pods run deletes them;
* no GPU state, or a layout left pending, fails ``gpu-state``;
* ``repartition --verify`` stops the rollout at the first node that fails the checks;
* the command's exit codes and JSON.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from mig_agent.config.profiles import load_catalog
from mig_agent.config.settings import Settings
from mig_agent.core.dra_devices import DRIVER
from mig_agent.core.gpu_models import MODELS, GpuModel
from mig_agent.core.observed import ComputeInstance, GpuInstance, NodeState
from mig_agent.core.placement import Placement
from mig_agent.core.snapshot import compact, empty_node
from mig_agent.kube.cluster import PodRef
from mig_agent.node.waits import Clock
from mig_agent.ops import Result, repartition
from mig_agent.ops.verify import verify, verify_node
from mig_agent.ops.verify_pods import PodSpec, outcome
from tests.unit.fake_cluster import FakeCluster

S = Settings()
H100 = MODELS["H100-80GB"]
MIG = "nvidia.com/mig-1g.10gb"
Play = Callable[[Mapping[str, Any]], tuple[dict[str, Any], str, list[dict[str, Any]]]]


def _mig_node(uuids: bool = True) -> tuple[NodeState, dict[int, GpuModel]]:
    """One H100 with MIG on and two 1g.10gb devices."""
    state, models = empty_node([H100])
    resolved = H100.resolve("1g.10gb")
    assert resolved is not None
    gi, ci = resolved
    instances = tuple(
        GpuInstance(
            i + 1,
            gi.id,
            Placement(i, 1),
            (ComputeInstance(0, ci.id, Placement(0, 1), f"MIG-dev-{i}" if uuids else ""),),
        )
        for i in range(2)
    )
    gpu = state.gpus[0]
    info = replace(gpu.info, uuid="GPU-parent-0")
    return NodeState((replace(gpu, info=info, mig_current=True, gpu_instances=instances),)), models


def _ran(log: str) -> Play:
    return lambda _pod: ({"status": {"phase": "Succeeded"}}, log, [])


GOOD_LOG = (
    "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-parent-0)\n"
    "  MIG 1g.10gb     Device  0: (UUID: MIG-dev-1)\n"
)


@dataclass
class PodsCluster(FakeCluster):
    """FakeCluster that runs pods: ``play`` says, per manifest, the pod's status, log and
    events; ``sleeps`` (seconds) go on the fake clock, ``interrupt_after`` sleeps raise Ctrl-C."""

    play: Play = field(default_factory=lambda: _ran(GOOD_LOG))
    made: dict[PodRef, tuple[dict[str, Any], str, list[dict[str, Any]]]] = field(
        default_factory=dict
    )
    manifests: list[Mapping[str, Any]] = field(default_factory=list)
    deleted: list[PodRef] = field(default_factory=list)
    now: float = 0.0
    interrupt_after: int | None = None

    def create_pod(self, namespace: str, manifest: Mapping[str, Any]) -> PodRef:
        ref = PodRef(namespace, manifest["metadata"]["name"], f"uid-{len(self.made)}")
        self.manifests.append(manifest)
        self.made[ref] = self.play(manifest)
        return ref

    def read_pod(self, ref: PodRef) -> dict[str, Any] | None:
        return None if ref in self.deleted else self.made[ref][0]

    def pod_log(self, ref: PodRef) -> str:
        return self.made[ref][1]

    def pod_events(self, ref: PodRef) -> list[dict[str, Any]]:
        return self.made[ref][2]

    def delete_pod(self, ref: PodRef) -> None:
        self.deleted.append(ref)

    def sleep(self, s: float) -> None:
        if self.interrupt_after is not None:
            self.interrupt_after -= 1
            if self.interrupt_after < 0:
                raise KeyboardInterrupt
        self.now += s

    @property
    def clock(self) -> Clock:
        return Clock(now=lambda: self.now, sleep=self.sleep, wall=lambda: 1_000_000.0 + self.now)


def _cluster(
    allocatable: Mapping[str, str] | None = None, labels: Mapping[str, str] | None = None
) -> PodsCluster:
    c = PodsCluster()
    state, models = _mig_node()
    node = c.add_node("n1", labels, allocatable if allocatable is not None else {MIG: "2"})
    c.nodes["n1"] = replace(
        node,
        annotations={S.gpu_state_annotation: compact(state, models)},
        annotations_written={S.gpu_state_annotation: "1970-01-12T13:40:00Z"},  # 400 s before wall()
    )
    return c


def _check(c: PodsCluster, out: list[str] | None = None) -> Any:
    lines = out if out is not None else []
    return verify_node(c, "n1", settings=S, clock=c.clock, out=lines.append)


def test_a_node_that_makes_what_it_publishes_passes_and_its_pods_are_deleted() -> None:
    c = _cluster()
    lines: list[str] = []
    verdict = _check(c, lines)
    assert verdict.ok, lines
    assert [ch.name for ch in verdict.checks] == ["gpu-state", "allocatable", f"pod {MIG}"]
    assert "1x H100-80GB; MIG on GPU 0: 2x 1g.10gb" in verdict.checks[0].detail
    assert "published by the agent (its last write to the node 6 min ago)" in (
        verdict.checks[0].detail
    )
    [pod] = c.manifests
    spec = pod["spec"]
    assert spec["nodeName"] == "n1" and spec["runtimeClassName"] == "nvidia"
    assert spec["containers"][0]["command"] == ["nvidia-smi", "-L"]
    assert spec["containers"][0]["resources"] == {"limits": {MIG: 1}}
    assert c.deleted == list(c.made)
    assert "MIG-dev-1" in verdict.checks[2].detail


def test_allocatable_lacking_the_layouts_resource_fails_naming_it_and_makes_no_pod() -> None:
    c = _cluster(allocatable={})
    verdict = _check(c)
    assert verdict.failed is not None and verdict.failed.name == "allocatable"
    assert f"allocatable lacks {MIG}: 0 of 2" in verdict.failed.detail
    assert "device plugin" in verdict.failed.hint
    assert c.manifests == []


def test_a_pod_the_runtime_could_not_start_fails_with_its_words_and_where_to_look() -> None:
    c = _cluster()
    status = {
        "phase": "Failed",
        "containerStatuses": [
            {
                "state": {
                    "terminated": {
                        "reason": "StartError",
                        "exitCode": 128,
                        "message": "unresolvable CDI devices nvidia.com/gpu=MIG-dev-1",
                    }
                }
            }
        ],
    }
    event = {"type": "Warning", "reason": "Failed", "message": "Error: failed to create task"}
    dns = {"type": "Warning", "reason": "MissingClusterDNS", "message": "no ClusterDNS IP"}
    said = {"type": "Warning", "reason": "Failed", "message": "unresolvable CDI devices"}
    c.play = lambda _pod: ({"status": status}, "", [event, dns, said])
    verdict = _check(c)
    failed = verdict.failed
    assert failed is not None and failed.name == f"pod {MIG}"
    assert "StartError: unresolvable CDI devices" in failed.detail
    assert "event Failed: Error: failed to create task" in failed.detail
    # an event that repeats the status, or says nothing of the devices, is left out
    assert "ClusterDNS" not in failed.detail and failed.detail.count("unresolvable") == 1
    assert "CDI spec" in failed.hint
    assert c.deleted == list(c.made)


def test_a_pod_pending_past_the_timeout_fails_naming_the_wait() -> None:
    c = _cluster()
    event = {"type": "Warning", "reason": "UnexpectedAdmissionError", "message": "Allocate failed"}
    c.play = lambda _pod: ({"status": {"phase": "Pending"}}, "", [event])
    verdict = verify_node(
        c, "n1", pods=PodSpec(timeout_s=5), settings=S, clock=c.clock, out=lambda _l: None
    )
    failed = verdict.failed
    assert failed is not None and "not ended after 5 s" in failed.detail, failed
    assert "UnexpectedAdmissionError" in failed.detail and "Allocate" in failed.hint
    assert c.deleted == list(c.made)


def test_ctrl_c_while_the_pods_run_deletes_them() -> None:
    c = _cluster({MIG: "2", "nvidia.com/gpu": "0"})
    c.play = lambda _pod: ({"status": {"phase": "Pending"}}, "", [])
    c.interrupt_after = 2
    with pytest.raises(KeyboardInterrupt):
        _check(c)
    assert c.made and c.deleted == list(c.made)


def test_no_published_state_or_a_pending_layout_fails_the_gpu_state_check() -> None:
    c = PodsCluster()
    c.add_node("n1", {}, {MIG: "2"})
    failed = _check(c).failed
    assert failed.name == "gpu-state" and "no GPU state published" in failed.detail
    c = _cluster(labels={S.config_label: "all-1g.10gb", S.state_label: "pending"})
    failed = _check(c).failed
    assert failed.name == "gpu-state" and "layout all-1g.10gb is pending" in failed.detail


def test_a_wrong_device_in_the_pod_fails_naming_it() -> None:
    c = _cluster()
    c.play = _ran(GOOD_LOG.replace("MIG-dev-1", "MIG-elsewhere"))
    failed = _check(c).failed
    assert failed is not None and "MIG-elsewhere is not one the node's GPU state" in failed.detail


def test_outcomes_of_pods_that_do_not_start() -> None:
    pull = {
        "status": {
            "phase": "Pending",
            "containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff"}}}],
        }
    }
    o = outcome(pull, [])
    assert o.done and not o.ran and "image" in o.hint
    sandbox = {"type": "Warning", "reason": "FailedCreatePodSandBox", "message": "no network"}
    o = outcome({"status": {"phase": "Pending"}}, [sandbox])
    assert not o.done and "CNI" in o.hint
    admission = {
        "status": {"phase": "Failed", "reason": "UnexpectedAdmissionError", "message": "x"}
    }
    assert "device plugin" in outcome(admission, []).hint
    crashed = {
        "status": {
            "phase": "Failed",
            "containerStatuses": [{"state": {"terminated": {"reason": "Error", "exitCode": 9}}}],
        }
    }
    o = outcome(crashed, [])
    assert o.ran and "exit code 9" in o.why


def test_repartition_with_verify_stops_at_the_first_node_that_fails_it() -> None:
    catalog = load_catalog([Path(__file__).resolve().parents[2] / "profiles"])
    c = _cluster()
    c.add_node("n2", {}, {})
    calls: list[str] = []

    def verifier(node: str) -> Any:
        calls.append(node)
        return verify_node(c, node, settings=S, clock=c.clock, out=lambda _l: None)

    # the agents: a relabelled node succeeds at once; n1's plugin lost its resource
    def patched(c2: FakeCluster) -> None:
        for name, n in c2.nodes.items():
            if n.labels.get(S.config_label) and S.state_label not in n.labels:
                c2.nodes[name] = replace(
                    n, labels={**n.labels, S.state_label: "success"}, allocatable={}
                )

    c.on_change = patched
    summary = repartition(
        c,
        catalog,
        "all-1g.10gb",
        ["n1", "n2"],
        settings=S,
        clock=c.clock,
        verify=verifier,
        out=lambda _l: None,
        force=True,
    )
    results = {r.node: r for r in summary.results}
    assert calls == ["n1"]
    assert results["n1"].result is Result.FAILED
    assert results["n1"].reason.startswith("verify: allocatable: allocatable lacks"), results
    assert results["n2"].result is Result.NOT_STARTED
    assert summary.exit_code == 1
    assert S.config_label not in c.nodes["n2"].labels


def test_the_command_exits_1_on_a_failed_check_and_writes_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mig_agent.cli.ops_commands import run_verify

    c = _cluster(allocatable={})
    args = argparse.Namespace(
        nodes=["n1"],
        selector="",
        output="json",
        image="img",
        runtime_class="",
        pod_namespace="default",
        pod_timeout_s=10.0,
    )
    out: list[str] = []
    assert run_verify(c, args, out.append) == 1
    [data] = json.loads(out[-1])
    assert data["node"] == "n1" and data["ok"] is False and data["failed_check"] == "allocatable"
    c = _cluster()
    assert run_verify(c, args, out.append) == 0
    assert "runtimeClassName" not in c.manifests[0]["spec"]  # '' : the default runtime
    assert c.manifests[0]["spec"]["containers"][0]["image"] == "img"
    assert verify(c, ["n1"], settings=S, clock=c.clock, out=lambda _l: None)[0].ok


def test_a_dra_node_is_checked_by_its_resource_slice() -> None:
    def dra_slice(*kinds: tuple[str, str]) -> dict[str, Any]:
        devices = [
            {"name": f"d{i}", "attributes": {"type": {"string": t}, "profile": {"string": p}}}
            for i, (t, p) in enumerate(kinds)
        ]
        spec = {"driver": DRIVER, "pool": {"name": "n1", "generation": 1}, "devices": devices}
        return {"spec": spec}

    c = _cluster(allocatable={})
    c.slices = [dra_slice(("mig", "1g.10gb"), ("mig", "1g.10gb"))]
    verdict = _check(c)
    assert verdict.ok, verdict
    assert verdict.checks[-1].name == "resourceslice" and c.manifests == []
    c.slices = [dra_slice(("mig", "1g.10gb"))]
    failed = _check(c).failed
    assert failed is not None and failed.name == "resourceslice", failed
    assert "missing" in failed.detail and "1g.10gb" in failed.detail, failed


def test_kubectl_mig_has_verify_and_repartition_verify_with_the_same_options() -> None:
    from mig_agent.cli import kubectl

    args = kubectl.build_parser().parse_args(["verify", "n1", "-o", "json", "--pod-timeout", "9"])
    assert (args.nodes, args.output, args.pod_timeout_s) == (["n1"], "json", 9.0)
    assert args.func is kubectl.cmd_verify and args.runtime_class == "nvidia"
    args = kubectl.build_parser().parse_args(["repartition", "L", "n1", "--verify"])
    assert args.verify and args.image.startswith("nvcr.io/nvidia/cuda:")


def test_a_pod_the_api_server_refuses_fails_its_check_naming_the_options() -> None:
    from mig_agent.core.errors import KubeError

    c = _cluster()

    def refuse(_namespace: str, _manifest: Mapping[str, Any]) -> PodRef:
        raise KubeError('create pod: 403 pod rejected: RuntimeClass "nvidia" not found')

    c.create_pod = refuse  # type: ignore[method-assign]
    failed = _check(c).failed
    assert failed is not None and failed.name == f"pod {MIG}", failed
    assert "RuntimeClass" in failed.detail and "--runtime-class" in failed.hint
