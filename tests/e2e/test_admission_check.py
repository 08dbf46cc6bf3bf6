"""We test the MIG layout AdmissionCheck end to end: Kueue v0.17.0's own controller on the local
cluster (migsim.cluster.kueue), one simulated H100 node with a real agent and device plugin at
all-1g.10gb, and mig-agent's check controller (``mig-agent admission-check``: its first round
through the CLI with ``--once``, the later ones in process, each a fresh call: all its state is
on the objects):

* a ClusterQueue with quota for nvidia.com/mig-3g.40gb naming the check; a Job of two pods
  asking one 3g.40gb each: the controller marks the check Active, relabels the node to
  all-3g.40gb, the agent reaches success, the controller marks the check Ready, Kueue admits the
  workload and unsuspends the Job, and both pods run on the node (the only one with 3g.40gb
  devices, two since the relabel: the scheduler placed them on the new devices), pinned there
  by the check's podSetUpdates (a hostname node selector and the workload's label, which
  Kueue put on the pods); nothing
  was evicted (no pod of the test was deleted, the agent evicted none);
* a Job asking mig-7g.80gb, which no approved layout offers, keeps waiting (suspended, its
  check Pending) with a message that says so, and an Event on its Workload;
* a Job whose devices only a relabel evicting a running pod can give (a pod holds one of the
  node's 1g.10gb devices) keeps waiting, the check saying evictions are not allowed; the node
  keeps its layout and the pod runs on;
* a check asking verify (mig-agent.dev/verify) whose relabelled node fails verify's pod
  check makes the workload Retry, naming the check, and it is not admitted;
* the controller runs under the chart's rights (its ServiceAccount, ClusterRole and node
  admission policy, applied to the cluster): enough for all of it, and no node label but the
  layout's may be set by it; the chart renders the controller only when enabled.

No webhook of Kueue's is registered (see migsim.cluster.kueue): Jobs are made suspended, with
the queue label, as Kueue's Job webhook would have made them.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes import config as kube_config
from migsim.cluster import Cluster, kueue_demo, wait_until
from migsim.cluster import kueue as kueue_sim
from migsim.cluster.kueue_demo import LAYOUTS, Queue, check_entry, condition, suspended, workload
from migsim.cluster.kueue_demo import job as _job

from mig_agent.config.profiles import load_catalog
from mig_agent.config.settings import Settings
from mig_agent.kube.client import KubernetesCluster
from mig_agent.ops.admission_check import run_round
from mig_agent.ops.verify import NodeVerdict, verify_node
from mig_agent.ops.verify_pods import PodSpec
from tests.conftest import GpuPodFactory, SaKubeconfig

from .conftest import AgentNode, NodeFactory, wait_running
from .test_helm import CHART, Doc, helm, run, template

__all__ = ["helm"]  # the fixture, used by the tests here

MIG_1G, MIG_3G, MIG_7G = (
    "nvidia.com/mig-1g.10gb",
    "nvidia.com/mig-3g.40gb",
    "nvidia.com/mig-7g.80gb",
)
S = Settings()


@pytest.fixture(scope="module")
def kueue(installed: Cluster) -> Iterator[kueue_sim.Kueue]:
    """Kueue's controller on the session's cluster, stopped after the module."""
    running = kueue_sim.start(installed)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def queue(installed: Cluster, namespace: str, kueue: kueue_sim.Kueue) -> Iterator[Queue]:
    q = Queue(installed, namespace)
    try:
        yield q
    finally:
        q.delete()


def _chart(helm: str, release: str, namespace: str, *sets: str) -> list[Doc]:
    """The controller's objects as the chart renders them with admissionCheck.enabled (and
    ``sets``, each a ``--set`` value)."""
    extra = [a for s in sets for a in ("--set", s)]
    out = run(
        helm,
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--set",
        "admissionCheck.enabled=true",
        *extra,
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    return [d for d in docs if d["metadata"]["name"].startswith(f"{release}-admission-check")]


_CREATE = {
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "ValidatingAdmissionPolicy": (
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
    ),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"
    ),
}


@pytest.fixture
def controller_rights(
    helm: str, installed: Cluster, namespace: str, sa_kubeconfig: SaKubeconfig
) -> Iterator[Path]:
    """The chart's ServiceAccount, ClusterRole, binding and node admission policy of the
    controller on the session's cluster (release named after the test's namespace); the
    kubeconfig acting as that account. The cluster-wide objects are deleted after."""
    release = "r" + hashlib.sha256(namespace.encode()).hexdigest()[:12]
    docs = _chart(helm, release, namespace, "admissionCheck.verify.enabled=true")
    made: list[str] = []
    try:
        for d in docs:
            if d["kind"] in _CREATE:
                path = _CREATE[d["kind"]].format(ns=namespace)
                installed.api.request("POST", path, d)
                made.append(f"{path}/{d['metadata']['name']}")
        yield sa_kubeconfig(namespace, f"{release}-admission-check")
    finally:
        for path in reversed(made):
            installed.api.request("DELETE", path)


def test_the_chart_renders_the_controller_only_when_enabled(helm: str) -> None:
    assert not [d for d in template(helm) if "admission-check" in d["metadata"]["name"]]
    docs = _chart(helm, "mig-agent", "mig-agent")
    assert {(d["kind"], d["metadata"]["name"]) for d in docs} == {
        ("ServiceAccount", "mig-agent-admission-check"),
        ("ClusterRole", "mig-agent-admission-check"),
        ("ClusterRoleBinding", "mig-agent-admission-check"),
        ("Role", "mig-agent-admission-check-lease"),
        ("RoleBinding", "mig-agent-admission-check-lease"),
        ("ValidatingAdmissionPolicy", "mig-agent-admission-check-layout-label-only"),
        ("ValidatingAdmissionPolicyBinding", "mig-agent-admission-check-layout-label-only"),
        ("Deployment", "mig-agent-admission-check"),
    }
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert container["args"] == [
        "admission-check",
        "--controller-name=mig-agent.dev/mig-layout",
        "--interval=10",
        "--lease=mig-agent/mig-agent-admission-check",
        "--pod-namespace=mig-agent",
        "--image=nvcr.io/nvidia/cuda:12.8.1-base-ubuntu24.04",
        "--runtime-class=nvidia",
        "--pod-timeout=180",
    ]
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    verbs = {v for r in role["rules"] for v in r["verbs"]}
    assert verbs == {"get", "list", "patch", "create"}
    (lease,) = [d for d in docs if d["kind"] == "Role"]
    assert lease["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "update"],
        }
    ]
    resources = {res for r in role["rules"] for res in r["resources"]}
    assert not resources & {"secrets", "pods/eviction", "nodes/status"}
    assert [r["resources"] for r in role["rules"] if "create" in r["verbs"]] == [["events"]]
    # verify's pods: a Role in one namespace, only with verify enabled
    docs = _chart(
        helm,
        "mig-agent",
        "mig-agent",
        "admissionCheck.verify.enabled=true",
        "admissionCheck.verify.podNamespace=gpu-checks",
    )
    verifying = {
        d["kind"]: d for d in docs if d["metadata"]["name"] == "mig-agent-admission-check-verify"
    }
    assert set(verifying) == {"Role", "RoleBinding"}
    pods, binding = verifying["Role"], verifying["RoleBinding"]
    assert pods["metadata"]["namespace"] == binding["metadata"]["namespace"] == "gpu-checks"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "mig-agent-admission-check", "namespace": "mig-agent"}
    ]
    assert pods["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list", "delete"]},
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},
    ]
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert "--pod-namespace=gpu-checks" in container["args"]


def _wait_policy_denies(kubeconfig: Path, node: str) -> None:
    """Until the chart's admission policy is in force: the controller's account may not set
    any node label but the layout's (a policy takes effect a moment after it is made)."""
    api = client.CoreV1Api(kube_config.new_client_from_config(str(kubeconfig)))

    def denied() -> bool:
        try:
            api.patch_node(node, {"metadata": {"labels": {"probe": "x"}}})
        except client.ApiException as e:
            if e.status in (403, 422) and "only the layout label" in str(e.body):
                return True
            raise
        return False

    try:
        wait_until(denied, timeout=30, what="the controller's node policy in force")
    finally:
        api.api_client.close()


def _pods(core: client.CoreV1Api, namespace: str, job: str) -> list[Any]:
    return list(
        core.list_namespaced_pod(
            namespace, label_selector=f"batch.kubernetes.io/job-name={job}"
        ).items
    )


def _ran_on(core: client.CoreV1Api, namespace: str, job: str) -> list[str]:
    """The nodes the Job's two pods ran on, once both run or ran (the simulated image's
    command exits at once); [] before."""
    pods = _pods(core, namespace, job)
    if len(pods) != 2 or any(p.status.phase not in ("Running", "Succeeded") for p in pods):
        return []
    return sorted(p.spec.node_name for p in pods)


def _cli(tmp_path: Path, kubeconfig: Path, controller: str, pool: str, me: str) -> str:
    """One round of ``mig-agent admission-check --once`` as replica ``me``; its stdout."""
    namespace = pool.partition("=")[2]
    argv = kueue_demo.admission_check_argv(
        controller, pool, tmp_path / "layouts.yaml", kubeconfig, "--once"
    )
    res = subprocess.run(
        [*argv, "--lease", f"{namespace}/controller"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "POD_NAME": me},
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def _pool_of_one(
    tmp_path: Path, agent_node: NodeFactory, core: client.CoreV1Api, namespace: str
) -> tuple[Any, AgentNode, str]:
    """The approved layouts, and a pool of one H100 node at all-1g.10gb (its selector)."""
    (tmp_path / "layouts.yaml").write_text(LAYOUTS)
    catalog = load_catalog([tmp_path / "layouts.yaml"])
    node = agent_node("1xH100-80GB")
    core.patch_node(node.name, {"metadata": {"labels": {"admission-check": namespace}}})
    node.label("all-1g.10gb")
    node.wait_state("success", timeout=90)
    return catalog, node, f"admission-check={namespace}"


def _check(
    installed: Cluster, queue: Queue, namespace: str, quota: dict[str, int]
) -> tuple[str, str]:
    """An AdmissionCheck of a controller name of the test's own, and the queue naming it."""
    check, controller = f"{namespace}-mig", f"mig-agent.dev/{namespace}"
    kueue_demo.layout_check(installed, queue, check, controller, quota)
    return check, controller


def test_the_check_relabels_a_node_for_a_queued_gang_and_kueue_admits_it(
    installed: Cluster,
    core: client.CoreV1Api,
    namespace: str,
    queue: Queue,
    agent_node: NodeFactory,
    tmp_path: Path,
    controller_rights: Path,
) -> None:
    catalog, node, pool = _pool_of_one(tmp_path, agent_node, core, namespace)
    _wait_policy_denies(controller_rights, node.name)
    check, controller = _check(installed, queue, namespace, {MIG_3G: 2, MIG_7G: 1})

    # the first round by the CLI: the check marked Active, so Kueue reserves quota; a second
    # replica, the Lease held by the first, does nothing
    first = _cli(tmp_path, controller_rights, controller, pool, "first")
    assert f"check {check}: marked Active" in first, first
    second = _cli(tmp_path, controller_rights, controller, pool, "second")
    assert second == f"not the leader: {namespace}/controller is held by another\n", second
    _job(installed, namespace, "train", 2, MIG_3G)
    _job(installed, namespace, "huge", 1, MIG_7G)

    kube = KubernetesCluster.connect(str(controller_rights))  # the chart's rights only
    rounds: list[str] = []

    def one_round() -> None:
        r = run_round(kube, catalog, S, controller_name=controller, selector=pool)
        rounds.extend(f"{d.workload}: {d.verdict.value}: {d.message}" for d in r.decisions)

    def admitted() -> bool:
        one_round()
        w = workload(installed, namespace, "train")
        return condition(w, "Admitted").get("status") == "True"

    try:
        wait_until(
            admitted,
            timeout=240,
            interval=1.0,
            what=f"train admitted after the relabel; rounds: {rounds[-6:]}; "
            f"agent log:\n{node.log_tail()}",
        )
        for _ in range(3):  # the unservable one, looked at again: still waiting, same message
            one_round()
    finally:
        kube.close()

    labels = node.labels()
    assert (labels[S.config_label], labels[S.state_label]) == ("all-3g.40gb", "success")
    assert any("relabelling" in line and node.name in line for line in rounds), rounds
    assert check_entry(installed, namespace, "train")["state"] == "Ready"
    assert wait_until(
        lambda: not suspended(installed, namespace, "train"), timeout=60, what="train unsuspended"
    )
    on = wait_until(
        lambda: _ran_on(core, namespace, "train"), timeout=120, what="train's two pods to run"
    )
    assert on == [node.name, node.name]
    # pinned where its devices were made: Kueue put the check's node selector on the pods
    ready = check_entry(installed, namespace, "train")
    pin = {"kubernetes.io/hostname": node.name}
    train = workload(installed, namespace, "train")
    assert train is not None
    label = {
        "mig-agent.dev/admission-workload": train["metadata"]["uid"],
        "mig-agent.dev/admission-pod-set": "main",
    }
    assert ready["podSetUpdates"] == [{"name": "main", "labels": label, "nodeSelector": pin}]
    # its promise on the Workload, kept there until its pods hold the devices
    notes = train["metadata"].get("annotations") or {}
    assert json.loads(notes["mig-agent.dev/admission-promise"]) == {"main": {node.name: 2}}
    pods = _pods(core, namespace, "train")
    assert all((p.spec.node_selector or {}).items() >= pin.items() for p in pods)
    assert all((p.metadata.labels or {}).items() >= label.items() for p in pods)
    assert node.gpu_resources() == {MIG_3G: 2}
    assert '"drain.evict' not in node.log_tail(2000) and "evicted" not in node.log_tail(2000)

    huge = check_entry(installed, namespace, "huge")
    assert huge["state"] == "Pending", huge
    assert huge["message"] == (
        "1 pod(s) asking mig-7g.80gb: no approved layout can serve all of its pods"
    ), huge
    assert suspended(installed, namespace, "huge")
    w = workload(installed, namespace, "huge")
    assert w is not None
    events = core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={w['metadata']['name']}"
    ).items
    ours = [e for e in events if e.reason.startswith("MIGLayout")]
    assert [e.reason for e in ours] == ["MIGLayoutWaiting"], [e.message for e in ours]


def test_a_workload_that_needs_an_eviction_is_not_served_without_the_permission(
    installed: Cluster,
    core: client.CoreV1Api,
    namespace: str,
    queue: Queue,
    agent_node: NodeFactory,
    tmp_path: Path,
    controller_rights: Path,
    gpu_pod: GpuPodFactory,
) -> None:
    catalog, node, pool = _pool_of_one(tmp_path, agent_node, core, namespace)
    busy = gpu_pod(namespace, "busy", resources={MIG_1G: 1}, node=node.name)
    wait_running(core, namespace, "busy")
    _, controller = _check(installed, queue, namespace, {MIG_3G: 2})
    kube = KubernetesCluster.connect(str(controller_rights))
    try:
        run_round(kube, catalog, S, controller_name=controller, selector=pool)  # Active
        _job(installed, namespace, "train", 2, MIG_3G)
        want = (
            "2 pod(s) asking mig-3g.40gb: only layouts that evict running pods serve it, and "
            "the check does not allow evictions"
        )

        def says_why() -> bool:
            run_round(kube, catalog, S, controller_name=controller, selector=pool)
            return check_entry(installed, namespace, "train").get("message") == want

        wait_until(
            says_why,
            timeout=120,
            interval=1.0,
            what=f"train's check to say why: {check_entry(installed, namespace, 'train')}",
        )
    finally:
        kube.close()
    assert check_entry(installed, namespace, "train")["state"] == "Pending"
    assert suspended(installed, namespace, "train")
    assert node.labels()[S.config_label] == "all-1g.10gb"
    now = core.read_namespaced_pod("busy", namespace)
    assert (now.metadata.uid, now.status.phase) == (busy.metadata.uid, "Running")


def test_a_check_asking_verify_retries_a_workload_whose_new_node_fails_it(
    installed: Cluster,
    core: client.CoreV1Api,
    namespace: str,
    queue: Queue,
    agent_node: NodeFactory,
    tmp_path: Path,
    controller_rights: Path,
) -> None:
    """verify's tiny pod never ends on this node (kwok runs no container: it stays Running),
    so the relabelled node fails verify's pod check: the check says Retry naming it, with an
    Event, the workload is not admitted and its Job stays suspended, and verify's pods are
    deleted. Run under the chart's rights, verify's Role included."""
    catalog, node, pool = _pool_of_one(tmp_path, agent_node, core, namespace)
    check, controller = _check(installed, queue, namespace, {MIG_3G: 2})
    installed.api.request(
        "PATCH",
        f"/apis/kueue.x-k8s.io/v1beta2/admissionchecks/{check}",
        {"metadata": {"annotations": {"mig-agent.dev/verify": "true"}}},
        content_type="application/merge-patch+json",
    )
    kube = KubernetesCluster.connect(str(controller_rights))
    lines: list[str] = []
    spec = PodSpec(image="busybox", runtime_class="", namespace=namespace, timeout_s=5)

    def verify(name: str) -> NodeVerdict:
        return verify_node(kube, name, pods=spec, settings=S, out=lines.append)

    retried: list[str] = []

    def retry() -> bool:
        r = run_round(kube, catalog, S, controller_name=controller, selector=pool, verify=verify)
        retried.extend(d.message for d in r.decisions if d.verdict.value == "Retry")
        return bool(retried)

    try:
        run_round(kube, catalog, S, controller_name=controller, selector=pool)  # Active
        _job(installed, namespace, "train", 2, MIG_3G)
        wait_until(retry, timeout=240, interval=1.0, what=f"a Retry; verify said: {lines}")
    finally:
        kube.close()
    assert node.labels()[S.config_label] == "all-3g.40gb"
    assert retried[0] == (
        f"{node.name} failed verify after its relabel: pod {MIG_3G}: not ended after 5 s: "
        "the pod is Running; kept off it for 10 min"
    ), retried
    w = workload(installed, namespace, "train")
    assert w is not None
    events = core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={w['metadata']['name']}"
    ).items
    assert any(e.reason == "MIGLayoutRetry" and e.message == retried[0] for e in events)
    assert condition(w, "Admitted").get("status") != "True"
    assert suspended(installed, namespace, "train")

    def verify_pods() -> list[Any]:
        return [
            p
            for p in core.list_namespaced_pod(namespace).items
            if p.metadata.name.startswith("mig-agent-verify")
        ]

    assert all(p.metadata.deletion_timestamp for p in verify_pods())  # deleted by verify
    wait_until(lambda: not verify_pods(), timeout=60, what="verify's pods gone")
