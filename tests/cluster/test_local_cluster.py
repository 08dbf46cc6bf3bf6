"""The local cluster behaves like a real one where the agent depends on it.

DaemonSets run on the simulated nodes, PodDisruptionBudgets are enforced by the real disruption
controller, the scheduler honours extended (MIG) resources, RBAC refuses what it should, pods take
time to go away, and admission policies work. Each test waits on the cluster's own signals; no
sleeps stand in for the cluster's work.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from kubernetes import client, config
from migsim.cluster import DELETE_DELAY_ANNOTATION, SIMULATED_IMAGE, Cluster, wait_until
from migsim.cluster.api_faults import ApiFaultProxy, Fault

if TYPE_CHECKING:
    from tests.cluster.conftest import GpuNodeFactory, GpuPodFactory, SaKubeconfig

REPO = Path(__file__).resolve().parents[2]


def _gone(core: client.CoreV1Api, namespace: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, namespace)
    except client.ApiException as e:
        if e.status == 404:
            return True
        raise
    return False


def _running_on(core: client.CoreV1Api, namespace: str, name: str) -> str | None:
    pod = core.read_namespaced_pod(name, namespace)
    ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
    return pod.spec.node_name if pod.status.phase == "Running" and ready else None


def test_simulated_gpu_nodes_carry_gpu_labels_and_resources(core: client.CoreV1Api) -> None:
    node = core.read_node("gpu-node-0")
    labels = node.metadata.labels
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels["nvidia.com/gpu.count"] == "8"
    assert labels["nvidia.com/gpu.present"] == "true"
    assert labels["nvidia.com/mig.capable"] == "true"
    assert labels["nvidia.com/gpu.deploy.device-plugin"] == "true"
    assert node.status.allocatable["nvidia.com/gpu"] == "8"
    assert not node.spec.taints
    assert any(c.type == "Ready" and c.status == "True" for c in node.status.conditions)


def test_daemonset_gets_a_pod_on_each_simulated_gpu_node(
    api_client: client.ApiClient, core: client.CoreV1Api, namespace: str
) -> None:
    apps = client.AppsV1Api(api_client)
    selector = {"nvidia.com/gpu.deploy.device-plugin": "true"}
    apps.create_namespaced_daemon_set(
        namespace,
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "device-plugin"},
            "spec": {
                "selector": {"matchLabels": {"app": "device-plugin"}},
                "template": {
                    "metadata": {"labels": {"app": "device-plugin"}},
                    "spec": {
                        "nodeSelector": selector,
                        "containers": [
                            {
                                "name": "plugin",
                                "image": SIMULATED_IMAGE,
                                "securityContext": {"privileged": True},
                            }
                        ],
                    },
                },
            },
        },
    )
    gpu_nodes = {
        n.metadata.name
        for n in core.list_node(label_selector="nvidia.com/gpu.deploy.device-plugin=true").items
    }
    assert {"gpu-node-0", "gpu-node-1"} <= gpu_nodes

    def ready_everywhere() -> bool:
        ds = apps.read_namespaced_daemon_set("device-plugin", namespace)
        return ds.status.desired_number_scheduled == len(
            gpu_nodes
        ) and ds.status.number_ready == len(gpu_nodes)

    wait_until(ready_everywhere, timeout=60, what="the DaemonSet to be ready on every GPU node")
    pods = core.list_namespaced_pod(namespace, label_selector="app=device-plugin").items
    assert sorted(p.spec.node_name for p in pods) == sorted(gpu_nodes)
    assert all(p.status.pod_ip for p in pods)


def test_pdb_gets_status_and_an_eviction_it_forbids_is_answered_429(
    api_client: client.ApiClient, core: client.CoreV1Api, namespace: str, gpu_pod: GpuPodFactory
) -> None:
    policy = client.PolicyV1Api(api_client)
    gpu_pod(namespace, "trainer", labels={"app": "trainer"})
    wait_until(lambda: _running_on(core, namespace, "trainer"), timeout=60, what="the pod to run")
    pdb = policy.create_namespaced_pod_disruption_budget(
        namespace,
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "trainer"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "trainer"}}},
        },
    )

    def observed() -> Any:
        got = policy.read_namespaced_pod_disruption_budget("trainer", namespace)
        st = got.status
        return (
            st is not None
            and st.observed_generation == pdb.metadata.generation
            and st.current_healthy == 1
        ) and st

    status = wait_until(observed, timeout=60, what="the disruption controller to fill PDB status")
    assert status.disruptions_allowed == 0
    assert status.desired_healthy == 1

    eviction = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": "trainer", "namespace": namespace},
    }
    with pytest.raises(client.ApiException) as refused:
        core.create_namespaced_pod_eviction("trainer", namespace, eviction)
    assert refused.value.status == 429
    assert "disruption budget" in str(refused.value.body)

    # Relaxing the budget makes the same eviction go through.
    policy.patch_namespaced_pod_disruption_budget(
        "trainer", namespace, {"spec": {"minAvailable": 0}}
    )
    wait_until(
        lambda: (
            policy.read_namespaced_pod_disruption_budget(
                "trainer", namespace
            ).status.disruptions_allowed
            == 1
        ),
        timeout=60,
        what="the PDB to allow a disruption",
    )
    core.create_namespaced_pod_eviction("trainer", namespace, eviction)
    wait_until(lambda: _gone(core, namespace, "trainer"), timeout=30, what="the evicted pod to go")


def test_pod_asking_for_a_mig_device_waits_until_a_node_advertises_it(
    core: client.CoreV1Api, namespace: str, gpu_node_factory: GpuNodeFactory, gpu_pod: GpuPodFactory
) -> None:
    node = gpu_node_factory("8xH200")
    gpu_pod(namespace, "mig-user", resources={"nvidia.com/mig-1g.18gb": 1})

    def unschedulable() -> bool:
        pod = core.read_namespaced_pod("mig-user", namespace)
        return any(
            c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
            for c in pod.status.conditions or []
        )

    wait_until(unschedulable, timeout=60, what="the scheduler to find no node for the pod")
    assert core.read_namespaced_pod("mig-user", namespace).spec.node_name is None

    # What the device plugin does once MIG devices exist: advertise them on the node.
    mig = {"nvidia.com/mig-1g.18gb": "7", "nvidia.com/gpu": "0"}
    core.patch_node_status(node, {"status": {"capacity": mig, "allocatable": mig}})

    scheduled = wait_until(
        lambda: _running_on(core, namespace, "mig-user"),
        timeout=60,
        what="the pod to be scheduled and run once the resource exists",
    )
    assert scheduled == node
    # kwok keeps the advertised resources (its heartbeat only refreshes conditions).
    assert core.read_node(node).status.allocatable["nvidia.com/mig-1g.18gb"] == "7"


def test_serviceaccount_without_rights_is_refused(
    api_client: client.ApiClient, namespace: str, sa_kubeconfig: SaKubeconfig
) -> None:
    as_sa = config.new_client_from_config(config_file=str(sa_kubeconfig(namespace, "nobody")))
    try:
        with pytest.raises(client.ApiException) as refused:
            client.CoreV1Api(as_sa).list_namespaced_pod(namespace)
        assert refused.value.status == 403
        assert f"system:serviceaccount:{namespace}:nobody" in str(refused.value.body)
        with pytest.raises(client.ApiException) as refused_nodes:
            client.CoreV1Api(as_sa).patch_node("gpu-node-0", {"metadata": {"labels": {"x": "y"}}})
        assert refused_nodes.value.status == 403

        # The same token works once RBAC grants the right: 403 above was authorisation, not a
        # broken credential.
        rbac = client.RbacAuthorizationV1Api(api_client)
        rbac.create_namespaced_role(
            namespace,
            {
                "metadata": {"name": "pod-reader"},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
            },
        )
        rbac.create_namespaced_role_binding(
            namespace,
            {
                "metadata": {"name": "nobody-reads-pods"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "pod-reader",
                },
                "subjects": [{"kind": "ServiceAccount", "name": "nobody", "namespace": namespace}],
            },
        )
        wait_until(
            lambda: _can_list_pods(as_sa, namespace),
            timeout=30,
            what="the RoleBinding to take effect",
        )
    finally:
        as_sa.close()


def _can_list_pods(api: client.ApiClient, namespace: str) -> bool:
    try:
        client.CoreV1Api(api).list_namespaced_pod(namespace)
    except client.ApiException as e:
        if e.status == 403:
            return False
        raise
    return True


def test_token_bound_to_a_pod_names_the_pods_node(
    cluster: Cluster,
    api_client: client.ApiClient,
    core: client.CoreV1Api,
    namespace: str,
    gpu_pod: GpuPodFactory,
) -> None:
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "agent"}})
    pod = core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": "agent"},
            "spec": {
                "serviceAccountName": "agent",
                "nodeSelector": {"kubernetes.io/hostname": "gpu-node-1"},
                "containers": [{"name": "agent", "image": SIMULATED_IMAGE}],
            },
        },
    )
    wait_until(lambda: _running_on(core, namespace, "agent"), timeout=60, what="the pod to run")
    token = cluster.token_for(namespace, "agent", bound_pod=(pod.metadata.name, pod.metadata.uid))
    cfg = client.Configuration()
    cfg.host = cluster.server
    cfg.ssl_ca_cert = str(cluster.ca_cert)
    cfg.api_key = {"authorization": f"Bearer {token}"}
    with client.ApiClient(cfg) as as_pod:
        review = client.AuthenticationV1Api(as_pod).create_self_subject_review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        )
    user = review.status.user_info
    assert user.username == f"system:serviceaccount:{namespace}:agent"
    assert user.extra["authentication.kubernetes.io/node-name"] == ["gpu-node-1"]


def test_deleted_pods_linger_like_a_kubelet_stopping_them(
    core: client.CoreV1Api, namespace: str, gpu_pod: GpuPodFactory
) -> None:
    gpu_pod(namespace, "default-delay", resources={})
    gpu_pod(namespace, "slow", resources={}, annotations={DELETE_DELAY_ANNOTATION: "6s"})
    gpu_pod(namespace, "short-grace", resources={}, grace_period=1)
    for name in ("default-delay", "slow", "short-grace"):
        wait_until(lambda n=name: _running_on(core, namespace, n), timeout=60, what=f"{name} runs")

    start = time.monotonic()
    for name in ("default-delay", "slow", "short-grace"):
        core.delete_namespaced_pod(name, namespace)
    gone_after: dict[str, float] = {}

    def all_gone() -> bool:
        for name in ("default-delay", "slow", "short-grace"):
            if name not in gone_after and _gone(core, namespace, name):
                gone_after[name] = time.monotonic() - start
        return len(gone_after) == 3

    wait_until(all_gone, timeout=30, interval=0.05, what="the deleted pods to go")
    # Default 2 s; the annotation overrides it; a grace period shorter than that wins (the
    # deletion timestamp has whole seconds, so "1 s" can end up to 1 s sooner).
    assert 1.5 <= gone_after["default-delay"] < 5
    assert 5.5 <= gone_after["slow"] < 10
    assert gone_after["short-grace"] < 1.9


def test_validating_admission_policy_is_enforced(
    api_client: client.ApiClient, core: client.CoreV1Api, namespace: str
) -> None:
    admission = client.AdmissionregistrationV1Api(api_client)
    name = f"deny-forbidden-{namespace}"
    admission.create_validating_admission_policy(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": ["configmaps"],
                        }
                    ]
                },
                "validations": [
                    {
                        "expression": "!has(object.data) || !('forbidden' in object.data)",
                        "message": "key 'forbidden' is not allowed",
                    }
                ],
            },
        }
    )
    admission.create_validating_admission_policy_binding(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {
                "policyName": name,
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
                },
            },
        }
    )
    try:

        def denied() -> bool:
            cm = {"metadata": {"generateName": "cm-"}, "data": {"forbidden": "1"}}
            try:
                core.create_namespaced_config_map(namespace, cm)
            except client.ApiException as e:
                assert e.status == 422, e.body
                assert "key 'forbidden' is not allowed" in e.body
                return True
            return False  # the policy is not loaded yet

        wait_until(denied, timeout=30, interval=0.2, what="the policy to deny")
        core.create_namespaced_config_map(
            namespace, {"metadata": {"name": "fine"}, "data": {"allowed": "1"}}
        )
    finally:
        admission.delete_validating_admission_policy_binding(name)
        admission.delete_validating_admission_policy(name)


def test_cli_status_and_env_describe_the_running_cluster(cluster: Cluster) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(REPO / "scripts" / "local-cluster"), *args, "--dir", str(cluster.dir)],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )

    status = cli("status")
    assert status.returncode == 0, status.stderr
    for component in (
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kwok",
    ):
        assert f"{component} " in status.stdout
    assert "UNHEALTHY" not in status.stdout and "STOPPED" not in status.stdout
    assert "gpu-node-0" in status.stdout and "NVIDIA-H100-80GB-HBM3" in status.stdout
    env = cli("env")
    assert env.returncode == 0, env.stderr
    assert f"export KUBECONFIG={cluster.kubeconfig}" in env.stdout.splitlines()


def test_up_then_down_leaves_no_process_behind(tmp_path: Path, cluster: Cluster) -> None:
    # A second, node-less cluster beside the session's: ports are picked free, folders differ.
    other = Cluster.up(tmp_path / "other", gpu_nodes=0)
    procs = other.state.procs
    assert {p.name for p in procs} == {
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kwok",
    }
    assert other.server != cluster.server
    assert Cluster.up(tmp_path / "other", gpu_nodes=0).state.procs == procs  # reused, not restarted
    assert other.down() == []  # all stopped by SIGTERM
    assert not any(p.alive() for p in procs)
    assert cluster.healthy()  # the session's cluster was not touched
    status = subprocess.run(
        [sys.executable, "-m", "migsim.cluster", "status", "--dir", str(other.dir)],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
    )
    assert status.returncode == 3, status.stdout


def test_the_agents_pod_watch_sees_a_deletion_as_it_happens(
    cluster: Cluster,
    core: client.CoreV1Api,
    namespace: str,
    gpu_pod: GpuPodFactory,
    gpu_node_factory: GpuNodeFactory,
) -> None:
    """The drain's waits watch the node's pods: one list and one watch per slice, and a pod's
    going is seen when the API server tells it, not at the next look."""
    from mig_agent.kube.client import KubernetesCluster

    node = gpu_node_factory()
    for name in ("stays", "goes"):
        gpu_pod(namespace, name, node=node, annotations={DELETE_DELAY_ANNOTATION: "1s"})
        wait_until(lambda n=name: _running_on(core, namespace, n), timeout=60, what=f"{name} runs")
    requests: list[str] = []
    k = KubernetesCluster.connect(str(cluster.kubeconfig), on_request=requests.append)
    try:
        watch = k.watch_pods(node, timeout_s=20)
        mine = lambda pods: {p.ref.name for p in pods if p.ref.namespace == namespace}  # noqa: E731
        first = mine(next(watch))  # (the node's DaemonSet pods beside them)
        assert first == {"stays", "goes"}
        start = time.monotonic()
        core.delete_namespaced_pod("goes", namespace)
        seen: list[tuple[set[str], bool]] = []
        for pods in watch:
            seen.append(
                (
                    mine(pods),
                    any(p.terminating for p in pods if p.ref.name == "goes"),
                )
            )
            if "goes" not in seen[-1][0]:
                break
        took = time.monotonic() - start
        watch.close()  # type: ignore[attr-defined]
    finally:
        k.close()
    assert seen[-1][0] == {"stays"}
    assert any(terminating for names, terminating in seen if "goes" in names)  # then deleted
    assert took < 10, took  # the deletion (after its 1 s linger), not the watch's 20 s end
    assert requests == ["list_pod_for_all_namespaces", "watch_pods"]


def test_the_agents_node_watch_delivers_each_change_from_the_raw_json(
    cluster: Cluster, core: client.CoreV1Api, gpu_node_factory: GpuNodeFactory
) -> None:
    """The loop's node watch (path 7 of issue 42): the node as it is, then each change of it,
    read from the watch's JSON lines as the pod and slice watches are; one request."""
    from mig_agent.kube.client import KubernetesCluster

    node = gpu_node_factory()
    requests: list[str] = []
    k = KubernetesCluster.connect(str(cluster.kubeconfig), on_request=requests.append)
    try:
        watch = k.watch_node(node, timeout_s=20)
        first = next(watch)
        assert first.name == node and first.labels.get("nvidia.com/mig.config") is None
        core.patch_node(node, {"metadata": {"labels": {"nvidia.com/mig.config": "all-1g.10gb"}}})
        for seen in watch:
            if seen.labels.get("nvidia.com/mig.config") == "all-1g.10gb":
                break
        watch.close()  # type: ignore[attr-defined]
    finally:
        k.close()
    assert seen.resource_version != first.resource_version and seen.capacity
    assert requests == ["watch_node"]


def test_a_pod_watch_the_api_server_ends_with_an_error_event_ends_quietly(
    cluster: Cluster, gpu_node_factory: GpuNodeFactory, tmp_path: Path
) -> None:
    """A watch from a resource version the API server no longer holds gets an `ERROR` event
    (410 Expired) in its stream, served here by the fault proxy in front of the real API server
    as that server sends it. Before: the kubernetes client's unparsed stream read a key such
    events lack, and the drain died of a KeyError ("internal error") while the pods it had
    evicted still terminated. Now the watch ends, and the drain's next look lists again."""
    from mig_agent.kube.client import KubernetesCluster
    from mig_agent.kube.cluster import PodsSeen

    node = gpu_node_factory()
    proxy = ApiFaultProxy(
        cluster.server,
        cert=cluster.dir / "pki" / "serving.crt",
        key=cluster.dir / "pki" / "serving.key",
        ca=cluster.ca_cert,
    )
    proxy.add(Fault("watch-expired", watch=True))
    via = tmp_path / "via-proxy.kubeconfig"  # the list passes through, the watch expires
    via.write_text(cluster.kubeconfig.read_text().replace(cluster.server, proxy.url))
    requests: list[str] = []
    k = KubernetesCluster.connect(str(via), on_request=requests.append)
    seen = PodsSeen()
    try:
        start = time.monotonic()
        looks = list(k.watch_pods(node, timeout_s=20, seen=seen))
        took = time.monotonic() - start
        assert seen.resource_version == ""  # expired: the next watch of the wait lists again
        next(k.watch_pods(node, timeout_s=20, seen=seen))
    finally:
        k.close()
        proxy.stop()
    assert proxy.hits["watch-expired"] == 1
    assert len(looks) == 1  # the list; the watch ended at its error event
    assert took < 10, took  # at the event, not at the watch's 20 s end
    assert requests == ["list_pod_for_all_namespaces", "watch_pods", "list_pod_for_all_namespaces"]


def test_a_pod_watch_goes_on_where_the_last_ended_without_a_list(
    cluster: Cluster,
    core: client.CoreV1Api,
    namespace: str,
    gpu_pod: GpuPodFactory,
    gpu_node_factory: GpuNodeFactory,
) -> None:
    """A wait's watches, slice after slice: the first lists, the next go on from where the last
    ended (what changed in between arrives as events), so a long drain or an eviction retry
    costs a watch, not a list more."""
    from mig_agent.kube.client import KubernetesCluster
    from mig_agent.kube.cluster import PodsSeen

    node = gpu_node_factory()
    for name in ("stays", "goes"):
        gpu_pod(namespace, name, node=node)
        wait_until(lambda n=name: _running_on(core, namespace, n), timeout=60, what=f"{name} runs")
    requests: list[str] = []
    k = KubernetesCluster.connect(str(cluster.kubeconfig), on_request=requests.append)
    mine = lambda pods: {p.ref.name for p in pods if p.ref.namespace == namespace}  # noqa: E731
    seen = PodsSeen()
    try:
        assert [mine(p) for p in k.watch_pods(node, timeout_s=1, seen=seen)] == [
            {"stays", "goes"}
        ]  # the list, then a watch that saw nothing in its second
        core.delete_namespaced_pod("goes", namespace, grace_period_seconds=0)
        looks = []
        for pods in k.watch_pods(node, timeout_s=20, seen=seen):
            looks.append(mine(pods))
            if "goes" not in looks[-1]:
                break
    finally:
        k.close()
    assert looks[0] == {"stays", "goes"}  # where the last watch ended
    assert looks[-1] == {"stays"}  # the deletion, as an event of the watch from there
    assert requests == ["list_pod_for_all_namespaces", "watch_pods", "watch_pods"]


def test_conditions_and_conditional_patches_read_the_node_only_when_they_must(
    cluster: Cluster, gpu_node_factory: GpuNodeFactory
) -> None:
    """A condition this client wrote is known without a read; a label patch that may be
    written only while the layout label holds goes by the node the caller has, and reads the
    node only when that one is no longer current (the server's 409), to find what changed."""
    from mig_agent.core.errors import LabelsChanged
    from mig_agent.kube.client import KubernetesCluster
    from mig_agent.kube.cluster import NodeCondition

    node = gpu_node_factory()
    requests: list[str] = []
    k = KubernetesCluster.connect(str(cluster.kubeconfig), on_request=requests.append)
    try:
        for status, reason in (("False", "Reconfiguring"), ("True", "Applied")):
            k.set_node_condition(node, NodeCondition("MIGTestApplied", status, reason, "m"))
        assert requests == ["read_node", "patch_node_status", "patch_node_status"]
        got = k.get_node(node)
        assert [c.reason for c in got.conditions if c.type == "MIGTestApplied"] == ["Applied"]
        requests.clear()
        known = k.patch_node(node, labels={"example.com/layout": "a"})
        k.patch_node(
            node,
            labels={"example.com/state": "x"},
            expect_labels={"example.com/layout": "a"},
            known=known,
        )
        assert requests == ["patch_node", "patch_node"]  # no read: the node as it was known
        k.patch_node(node, labels={"example.com/layout": "b"})  # someone relabels
        requests.clear()
        with pytest.raises(LabelsChanged):
            k.patch_node(
                node,
                labels={"example.com/state": "y"},
                expect_labels={"example.com/layout": "a"},
                known=known,
            )
        assert requests == ["patch_node", "read_node"]  # refused (409), then read: changed
        assert k.get_node(node).labels.get("example.com/state") == "x"
    finally:
        k.close()
