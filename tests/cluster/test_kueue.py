"""We test Kueue on the local cluster (Kueue's own controller, v0.17.0, started by
migsim.cluster.kueue; Kubernetes' Job controller), and ``advise`` reading its queue:

* a suspended Job labelled for a LocalQueue whose ClusterQueue has quota for
  ``nvidia.com/mig-1g.10gb``: Kueue makes its Workload, admits it, unsuspends the Job, and the
  Job controller makes its pods;
* a Job asking more than the quota: its Workload stays without quota (QuotaReserved False,
  reason ``Pending`` in v0.17, the message naming the quota) and the Job suspended;
* a Job whose ClusterQueue names an AdmissionCheck nobody serves (but for its Active condition,
  which the test sets as its controller would): its Workload reserves quota and waits on the
  check; ``advise`` reads it as demand (two pods asking 3g.40gb each) and proposes the relabel
  of the node at all-1g.10gb to all-3g, which serves both; a Job beyond the quota, read at the
  same time, is counted as left out for quota;
* a Job whose pods each get a claim from a ResourceClaimTemplate (DeviceClass mig.nvidia.com,
  profile 3g.40gb), waiting on that check: Kueue (its DRA gate off) reserves quota and keeps
  the pod set's resourceClaims in the Workload; ``advise`` reads the template and proposes the
  relabel of a DRA node (its devices in a ResourceSlice written here, as the driver would) to
  all-3g.

No webhook of Kueue's is registered (see migsim.cluster.kueue): the tests create their Jobs
suspended, with the queue label, as Kueue's Job webhook would have made them. The node advise
looks at has its GPU state annotation written here, as its agent would publish it (no agent
runs in this module).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from migsim.cluster import Cluster, wait_until
from migsim.cluster import kueue as kueue_sim
from migsim.cluster.kueue_demo import Queue, job
from migsim.cluster.kueue_demo import condition as _condition
from migsim.cluster.kueue_demo import suspended as _suspended
from migsim.cluster.kueue_demo import workload as _workload

from mig_agent.config.profiles import load_catalog
from mig_agent.config.settings import Settings
from mig_agent.core import dra_devices
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.planner import plan
from mig_agent.core.snapshot import compact
from mig_agent.kube.client import KubernetesCluster
from mig_agent.node.apply import execute
from mig_agent.ops import advise as ops_advise
from tests.unit.fake_gpus import FakeGpus
from tests.unit.test_kueue_demand import CONFIG  # the two approved layouts

if TYPE_CHECKING:
    from tests.conftest import GpuNodeFactory

MIG_1G, MIG_3G = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"
S = Settings()


@pytest.fixture(scope="module")
def kueue(cluster: Cluster) -> Iterator[kueue_sim.Kueue]:
    """Kueue's controller on the session's cluster, stopped after the module."""
    running = kueue_sim.start(cluster)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def queue(cluster: Cluster, namespace: str, kueue: kueue_sim.Kueue) -> Iterator[Queue]:
    q = Queue(cluster, namespace)
    try:
        yield q
    finally:
        q.delete()


def test_a_queued_job_is_admitted_and_unsuspended_and_its_pods_made(
    cluster: Cluster, namespace: str, queue: Queue
) -> None:
    queue.create({MIG_1G: 2})
    job(cluster, namespace, "fits", 2, MIG_1G, image="busybox")
    wait_until(
        lambda: (
            _condition(_workload(cluster, namespace, "fits"), "Admitted").get("status") == "True"
        ),
        timeout=60,
        what="the Workload of job fits admitted",
    )
    wait_until(
        lambda: not _suspended(cluster, namespace, "fits"), timeout=60, what="fits unsuspended"
    )

    def pods() -> int:
        got = cluster.api.get(
            f"/api/v1/namespaces/{namespace}/pods?labelSelector=batch.kubernetes.io/job-name=fits"
        )
        return len(got["items"])

    assert wait_until(lambda: pods() == 2, timeout=60, what="the Job's two pods")


def test_a_job_beyond_the_quota_stays_suspended_waiting_for_quota(
    cluster: Cluster, namespace: str, queue: Queue
) -> None:
    queue.create({MIG_1G: 2})
    job(cluster, namespace, "too-big", 3, MIG_1G, image="busybox")
    reserved = wait_until(
        lambda: _condition(_workload(cluster, namespace, "too-big"), "QuotaReserved"),
        timeout=60,
        what="the Workload of job too-big to say whether it reserved quota",
    )
    assert reserved["status"] == "False", reserved
    assert reserved["reason"] in ("Pending", "WaitingForQuota", "ExceedsMaxQuota"), reserved
    assert MIG_1G in reserved["message"] and "quota" in reserved["message"], reserved
    assert _suspended(cluster, namespace, "too-big")


def _published_node(cluster: Cluster, catalog: Any, node: str, selector: tuple[str, str]) -> None:
    """``node`` at all-1g.10gb with its GPU state published, as its agent would (one H100)."""
    gpus = FakeGpus([MODELS["H100-80GB"]])
    execute(plan(catalog.get("all-1g.10gb"), gpus.observe(), gpus.models()), gpus)
    meta = {
        "labels": {
            S.config_label: "all-1g.10gb",
            S.state_label: "success",
            selector[0]: selector[1],
        },
        "annotations": {S.gpu_state_annotation: compact(gpus.observe(), gpus.models())},
    }
    cluster.api.request(
        "PATCH",
        f"/api/v1/nodes/{node}",
        {"metadata": meta},
        content_type="application/merge-patch+json",
    )


def test_advise_reads_a_workload_waiting_on_its_check_and_proposes_the_relabel(
    cluster: Cluster,
    namespace: str,
    queue: Queue,
    gpu_node_factory: GpuNodeFactory,
    tmp_path: Path,
) -> None:
    check = f"{namespace}-layout"
    queue.check(check, "example.com/nobody-serves-this")
    queue.create({MIG_3G: 2, MIG_1G: 2}, checks=(check,))
    (tmp_path / "layouts.yaml").write_text(CONFIG)
    catalog = load_catalog([tmp_path / "layouts.yaml"])
    node = gpu_node_factory("1xH100-80GB")
    label = ("kueue-test", namespace)
    _published_node(cluster, catalog, node, label)
    job(cluster, namespace, "train", 2, MIG_3G, image="busybox")
    job(cluster, namespace, "too-big", 3, MIG_1G, image="busybox")

    def waits_on_check() -> bool:
        w = _workload(cluster, namespace, "train")
        states = [
            c.get("state") for c in ((w or {}).get("status") or {}).get("admissionChecks") or ()
        ]
        return _condition(w, "QuotaReserved").get("status") == "True" and states == ["Pending"]

    wait_until(
        waits_on_check, timeout=60, what="train's Workload to reserve quota and wait on its check"
    )
    wait_until(
        lambda: (
            _condition(_workload(cluster, namespace, "too-big"), "QuotaReserved").get("status")
            == "False"
        ),
        timeout=60,
        what="too-big's Workload to wait for quota",
    )
    assert _suspended(cluster, namespace, "train")

    kube = KubernetesCluster.connect(str(cluster.kubeconfig))
    try:
        report = ops_advise.run(kube, catalog, settings=S, selector="=".join(label))
    finally:
        kube.close()
    train = _workload(cluster, namespace, "train")
    assert train is not None
    name = f"{namespace}/{train['metadata']['name']}"
    # every namespace's workloads are read; other tests' may still be there (namespaces go
    # slowly), so only this one's are looked at
    assert [w for w in report.workloads if w.startswith(f"{namespace}/")] == [name]
    [proposal] = report.proposals
    assert (proposal.node, proposal.from_layout, proposal.option.layout) == (
        node,
        "all-1g.10gb",
        "all-3g",
    )
    assert sorted(proposal.serves) == [f"{name}[main/0]", f"{name}[main/1]"]
    assert proposal.option.evicts == ()
    too_big = _workload(cluster, namespace, "too-big")
    assert too_big is not None
    held = f"{namespace}/{too_big['metadata']['name']}"
    assert [w for w in report.workloads_for_quota if w.startswith(f"{namespace}/")] == [held]
    lines = ops_advise.report_lines(report)
    n = len(report.workloads_for_quota)
    assert f"left out: {n} workload(s) wait for quota, not devices" in lines
    assert any(line.startswith(f"  {held}: Pending: ") for line in lines), lines


RESOURCE = "/apis/resource.k8s.io/v1"
PROFILE_3G = 'device.attributes["gpu.nvidia.com"].profile == "3g.40gb"'


def _dra_node(cluster: Cluster, catalog: Any, node: str, selector: tuple[str, str]) -> None:
    """``node`` (no GPU resource) at all-1g.10gb, its GPU state published and its seven 1g.10gb
    devices in a ResourceSlice of NVIDIA's DRA driver, as its agent and the driver would."""
    cluster.add_cpu_node(node)
    _published_node(cluster, catalog, node, selector)
    devices = [
        {
            "name": f"gpu-0-mig-1g10gb-19-{i}",
            "attributes": {"type": {"string": "mig"}, "profile": {"string": "1g.10gb"}},
        }
        for i in range(7)
    ]
    spec = {
        "driver": dra_devices.DRIVER,
        "nodeName": node,
        "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
        "devices": devices,
    }
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice"}
    body |= {"metadata": {"name": f"{node}-gpu"}, "spec": spec}
    cluster.api.request("POST", f"{RESOURCE}/resourceslices", body)


def _claims_job(cluster: Cluster, namespace: str, name: str, pods: int, template: str) -> None:
    """A Job of ``pods`` pods, each with its own claim made from ``template``, queued to
    ``lq`` as Kueue's webhook would (suspended, the queue label)."""
    spec = {
        "restartPolicy": "Never",
        "containers": [
            {"name": "work", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}
        ],
        "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
    }
    body = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {kueue_sim.QUEUE_LABEL: "lq"}},
        "spec": {
            "suspend": True,
            "parallelism": pods,
            "completions": pods,
            "template": {"spec": spec},
        },
    }
    cluster.api.request("POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", body)


def test_advise_reads_a_workload_asking_by_claim_template_on_a_dra_node(
    cluster: Cluster, namespace: str, queue: Queue, tmp_path: Path
) -> None:
    check = f"{namespace}-layout"
    queue.check(check, "example.com/nobody-serves-this")
    # Kueue's DRA gate is off: the claims take no quota, and pods asking nothing else reserve
    queue.create({MIG_3G: 2}, checks=(check,))
    (tmp_path / "layouts.yaml").write_text(CONFIG)
    catalog = load_catalog([tmp_path / "layouts.yaml"])
    node, label = f"dra-{namespace}"[:63], ("kueue-test", namespace)
    request = {
        "name": "mig",
        "exactly": {
            "deviceClassName": "mig.nvidia.com",
            "selectors": [{"cel": {"expression": PROFILE_3G}}],
        },
    }
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-3g"},
        "spec": {"spec": {"devices": {"requests": [request]}}},
    }
    cluster.api.request(
        "POST", f"{RESOURCE}/namespaces/{namespace}/resourceclaimtemplates", template
    )
    try:
        _dra_node(cluster, catalog, node, label)
        _claims_job(cluster, namespace, "train", 2, "one-3g")
        wait_until(
            lambda: (
                _condition(_workload(cluster, namespace, "train"), "QuotaReserved").get("status")
                == "True"
            ),
            timeout=60,
            what="train's Workload to reserve quota and wait on its check",
        )
        train = _workload(cluster, namespace, "train")
        assert train is not None
        [pod_set] = train["spec"]["podSets"]
        assert pod_set["template"]["spec"]["resourceClaims"] == [
            {"name": "gpu", "resourceClaimTemplateName": "one-3g"}
        ]
        kube = KubernetesCluster.connect(str(cluster.kubeconfig))
        try:
            report = ops_advise.run(kube, catalog, settings=S, selector="=".join(label))
        finally:
            kube.close()
    finally:
        cluster.api.request("DELETE", f"{RESOURCE}/resourceslices/{node}-gpu")
        cluster.delete_node(node)
    name = f"{namespace}/{train['metadata']['name']}"
    assert [w for w in report.workloads if w.startswith(f"{namespace}/")] == [name]
    [proposal] = report.proposals
    assert (proposal.node, proposal.option.layout) == (node, "all-3g")
    assert sorted(proposal.serves) == [f"{name}[main/0]", f"{name}[main/1]"]
