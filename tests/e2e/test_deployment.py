"""We test these aspects of the deployment (daemonset.yaml) on the local cluster:

* `kubectl apply --dry-run=server` accepts every object, and applying it for real puts one agent pod
  on every GPU node (label nvidia.com/gpu.present=true), including one added later, and none on a
  node without GPUs;
* RBAC of the agent's ServiceAccount, asked with its own token (SelfSubjectAccessReview) and by
  trying the calls (writes as dry runs): every right the agent needs is there, and reading secrets,
  deleting nodes, writing pods, deleting pods outside gpu-operator, reading kube-system ConfigMaps
  and granting itself RBAC are refused;
* the admission policy mig-agent-own-node: with a token bound to its pod on node A, the agent may
  change A's MIG state label (to its four values), the operand labels the settings name (between
  true and paused-for-mig-change), its five mig-agent.dev/ annotations (size-capped),
  spec.unschedulable and its MIGConfigApplied condition (with its own reasons), and nothing else
  -- not another node, not other labels, annotations, values, taints, conditions, resources or
  managedFields; a token bound to no pod (no node name) may change no node at all. The policies
  type-check without warnings. (Pods, Events, evictions and reads: tests/e2e/test_attack.py.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from kubernetes import client
from migsim.cluster import Cluster, agents, wait_until
from migsim.cluster.api import Api, ApiError

if TYPE_CHECKING:
    from tests.conftest import GpuNodeFactory

REPO = Path(__file__).resolve().parents[2]
DAEMONSET = REPO / "daemonset.yaml"
AGENT_NS = AGENT_SA = "mig-agent"
AGENT_USER = f"system:serviceaccount:{AGENT_NS}:{AGENT_SA}"
PLUGIN_NS = "gpu-operator"
AGENT_PODS = "app.kubernetes.io/name=mig-agent"
GPU_NODES = "nvidia.com/gpu.present=true"
STATE = "nvidia.com/mig.config.state"
DP_LABEL = "nvidia.com/gpu.deploy.device-plugin"
POLICY = "mig-agent-own-node"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


def agent_pod_on(cluster: Cluster, node: str) -> dict[str, Any] | None:
    """The live mig-agent pod scheduled on `node`, if any."""
    path = (
        f"/api/v1/namespaces/{AGENT_NS}/pods?labelSelector={AGENT_PODS}"
        f"&fieldSelector=spec.nodeName%3D{node}"
    )
    pods = [p for p in cluster.api.get(path)["items"] if not p["metadata"].get("deletionTimestamp")]
    assert len(pods) <= 1, f"{len(pods)} agent pods on {node}"
    return pods[0] if pods else None


def running_agent_on(cluster: Cluster, node: str) -> dict[str, Any] | None:
    pod = agent_pod_on(cluster, node)
    return pod if pod and pod.get("status", {}).get("phase") == "Running" else None


def as_user(cluster: Cluster, token: str) -> Api:
    return Api(cluster.server, cluster.ca_cert, token)


# ---- 1. the manifest applies and the DaemonSet lands on GPU nodes only ---------------------------


def test_dry_run_then_apply_runs_an_agent_on_every_gpu_node_only(
    cluster: Cluster, core: client.CoreV1Api, gpu_node_factory: GpuNodeFactory
) -> None:
    # A server-side dry run checks each object against the live API server (schemas, admission,
    # the CEL of the policy) but persists nothing, so it cannot create the Namespace first: every
    # namespaced object of the file would fail with "namespaces mig-agent not found". So the
    # Namespace documents of the file are applied for real first, and gpu-operator, which the
    # file does not create (it is the GPU Operator's), is ensured as a cluster has it.
    docs = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d]
    namespaces = [d for d in docs if d["kind"] == "Namespace"]
    namespaces.append({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": PLUGIN_NS}})
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": namespaces}),
    )

    out = cluster.kubectl("apply", "--dry-run=server", "-f", str(DAEMONSET))
    lines = out.strip().splitlines()
    assert len(lines) == len(docs), out
    assert all(line.endswith("(server dry run)") for line in lines), out

    cluster.kubectl("apply", "-f", str(DAEMONSET))

    cpu = f"cpu-deploy-{int(time.time() * 1000) % 100000}"
    try:
        cluster.add_cpu_node(cpu)
        # A GPU node added after the CPU node: once its agent pod exists, the DaemonSet
        # controller has synced after the CPU node appeared, so "no pod there" is not "not yet".
        late = gpu_node_factory()
        gpu_nodes = [
            n.metadata.name
            for n in core.list_node(label_selector=GPU_NODES).items
            if n.metadata.deletion_timestamp is None
        ]
        assert late in gpu_nodes and "gpu-node-0" in gpu_nodes and "gpu-node-1" in gpu_nodes
        for node in gpu_nodes:
            wait_until(
                partial(running_agent_on, cluster, node),
                timeout=60,
                what=f"a running mig-agent pod on {node}",
            )
        assert agent_pod_on(cluster, cpu) is None
        ds = client.AppsV1Api(core.api_client).read_namespaced_daemon_set(AGENT_SA, AGENT_NS)
        assert ds.status.desired_number_scheduled == len(gpu_nodes)
        pods = core.list_namespaced_pod(AGENT_NS, label_selector=AGENT_PODS).items
        assert cpu not in {p.spec.node_name for p in pods}
    finally:
        cluster.delete_node(cpu)
        # daemonset.yaml's admission policies leave DRA off; the session's agents run with it
        # on (their DRA plugin's pod deleted on a DRA node): what agents.install left, again
        agents.grant_dra(cluster)


# ---- 2. RBAC of the ServiceAccount ---------------------------------------------------------------


@pytest.fixture(scope="module")
def agent_sa(installed: Cluster) -> Api:
    """The API as the agent's ServiceAccount, with a plain (unbound) token: RBAC only."""
    return as_user(installed, installed.token_for(AGENT_NS, AGENT_SA))


def can(api: Api, verb: str, resource: str, namespace: str = "", group: str = "") -> bool:
    resource, _, sub = resource.partition("/")
    attrs = {
        "verb": verb,
        "group": group,
        "resource": resource,
        "subresource": sub,
        "namespace": namespace,
    }
    review = api.request(
        "POST",
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attrs},
        },
    )
    return bool(review["status"].get("allowed"))


def test_agent_token_is_the_daemonsets_service_account(agent_sa: Api) -> None:
    review = agent_sa.request(
        "POST",
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
    )
    assert review["status"]["userInfo"]["username"] == AGENT_USER


RBAC = "rbac.authorization.k8s.io"
NEEDED = [
    ("get", "nodes", ""),
    ("list", "nodes", ""),
    ("watch", "nodes", ""),
    ("patch", "nodes", ""),
    ("patch", "nodes/status", ""),
    ("get", "pods", ""),
    ("list", "pods", ""),
    ("get", "pods", "default"),
    ("list", "pods", "team-a"),
    ("create", "pods/eviction", ""),
    ("create", "pods/eviction", "team-a"),
    ("delete", "pods", PLUGIN_NS),
    ("create", "events", "default"),
]
REFUSED = [
    *[
        (verb, "secrets", ns)
        for verb in ("get", "list", "watch")
        for ns in ("", AGENT_NS, "kube-system", "default", PLUGIN_NS)
    ],
    ("delete", "nodes", ""),
    ("create", "nodes", ""),
    ("update", "nodes", ""),
    ("update", "nodes/status", ""),
    ("patch", "pods", ""),
    ("patch", "pods", "default"),
    ("update", "pods", "default"),
    ("patch", "pods/status", "default"),
    ("delete", "pods", ""),
    ("delete", "pods", "default"),
    ("delete", "pods", AGENT_NS),
    ("delete", "pods", "kube-system"),
    ("deletecollection", "pods", PLUGIN_NS),
    ("create", "pods", "default"),
    ("create", "pods", PLUGIN_NS),
    ("list", "configmaps", "kube-system"),
    ("get", "configmaps", "kube-system"),
    ("create", "events", "kube-system"),
    ("create", "serviceaccounts/token", AGENT_NS),
    ("impersonate", "users", ""),
]
REFUSED_RBAC = [
    ("create", "clusterrolebindings", ""),
    ("create", "rolebindings", PLUGIN_NS),
    ("create", "clusterroles", ""),
    ("escalate", "clusterroles", ""),
    ("bind", "clusterroles", ""),
    ("patch", "clusterroles", ""),
]


def _ids(rows: list[tuple[str, str, str]]) -> list[str]:
    return [f"{v}-{r}-{ns or 'all'}" for v, r, ns in rows]


@pytest.mark.parametrize(("verb", "resource", "namespace"), NEEDED, ids=_ids(NEEDED))
def test_agent_has_the_right(agent_sa: Api, verb: str, resource: str, namespace: str) -> None:
    assert can(agent_sa, verb, resource, namespace)


def test_agent_may_list_the_budgets_an_eviction_refusal_names(agent_sa: Api) -> None:
    # a pod several PodDisruptionBudgets cover is refused by name of its budgets, which the
    # API's answer does not give; listing them is read only and changes nothing
    assert can(agent_sa, "list", "poddisruptionbudgets", "team-a", group="policy")
    assert not can(agent_sa, "delete", "poddisruptionbudgets", "team-a", group="policy")


@pytest.mark.parametrize(("verb", "resource", "namespace"), REFUSED, ids=_ids(REFUSED))
def test_agent_lacks_the_right(agent_sa: Api, verb: str, resource: str, namespace: str) -> None:
    assert not can(agent_sa, verb, resource, namespace)


@pytest.mark.parametrize(("verb", "resource", "namespace"), REFUSED_RBAC, ids=_ids(REFUSED_RBAC))
def test_agent_cannot_grant_itself_rbac(
    agent_sa: Api, verb: str, resource: str, namespace: str
) -> None:
    assert not can(agent_sa, verb, resource, namespace, group=RBAC)


DRY = "?dryRun=All"
POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "sneaky"},
    "spec": {"containers": [{"name": "c", "image": "registry.invalid/x:1"}]},
}
ADMIN_BINDING = {
    "apiVersion": f"{RBAC}/v1",
    "kind": "ClusterRoleBinding",
    "metadata": {"name": "sneaky"},
    "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": "cluster-admin"},
    "subjects": [{"kind": "ServiceAccount", "name": AGENT_SA, "namespace": AGENT_NS}],
}
EVENT = {
    "apiVersion": "v1",
    "kind": "Event",
    "metadata": {"generateName": "deploy-test."},
    "involvedObject": {"kind": "Node", "name": "gpu-node-0", "apiVersion": "v1"},
    "reason": "Test",
    "message": "dry run",
    "type": "Normal",
}
EVICTION = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "nope"}}


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    body: object = None
    content_type: str = "application/json"
    # False: authorised (any answer but 403, e.g. 404 for a pod that does not exist)
    refused: bool = True
    policy: str = ""  # refused by this admission policy, not by RBAC


CALLS = {
    "list-nodes": Call("GET", "/api/v1/nodes", refused=False),
    "list-pods-everywhere": Call("GET", "/api/v1/pods", refused=False),
    "evict-pod": Call(
        "POST", f"/api/v1/namespaces/default/pods/nope/eviction{DRY}", EVICTION, refused=False
    ),
    "delete-device-plugin-pod": Call(
        "DELETE", f"/api/v1/namespaces/{PLUGIN_NS}/pods/nope{DRY}", refused=False
    ),
    # RBAC allows it, the policy mig-agent-own-events refuses it: this token names no node
    "create-node-event": Call(
        "POST", f"/api/v1/namespaces/default/events{DRY}", EVENT, policy="mig-agent-own-events"
    ),
    "list-secrets-everywhere": Call("GET", "/api/v1/secrets"),
    "list-secrets-kube-system": Call("GET", "/api/v1/namespaces/kube-system/secrets"),
    "list-secrets-own-namespace": Call("GET", f"/api/v1/namespaces/{AGENT_NS}/secrets"),
    "delete-node": Call("DELETE", f"/api/v1/nodes/gpu-node-0{DRY}"),
    "patch-pod": Call(
        "PATCH",
        f"/api/v1/namespaces/default/pods/nope{DRY}",
        {"metadata": {"labels": {"x": "y"}}},
        MERGE,
    ),
    "delete-pod-elsewhere": Call("DELETE", f"/api/v1/namespaces/default/pods/nope{DRY}"),
    "create-pod": Call("POST", f"/api/v1/namespaces/default/pods{DRY}", POD),
    "list-configmaps-kube-system": Call("GET", "/api/v1/namespaces/kube-system/configmaps"),
    "bind-cluster-admin": Call("POST", f"/apis/{RBAC}/v1/clusterrolebindings{DRY}", ADMIN_BINDING),
}


@pytest.mark.parametrize("call", list(CALLS.values()), ids=list(CALLS))
def test_calls_as_agent(agent_sa: Api, call: Call) -> None:
    try:
        agent_sa.request(call.method, call.path, call.body, content_type=call.content_type)
        status = 200
    except ApiError as exc:
        status = exc.status
        if call.refused:
            assert (call.policy or AGENT_USER) in str(exc)
    assert (status == 403) == call.refused, f"{call.method} {call.path}: HTTP {status}"


# ---- 3. the admission policy: own node, MIG parts only -----------------------------------------


@dataclass
class Nodes:
    own: str
    other: str
    own_agent: Api  # token bound to the agent pod on `own`
    unbound: Api  # the same ServiceAccount, token bound to no pod
    admin: Api
    names: dict[str, str]  # "own" and "other" -> node name


@pytest.fixture(scope="module")
def nodes(installed: Cluster) -> Iterator[Nodes]:
    stamp = int(time.time() * 1000) % 100000
    own, other = f"deploy-a-{stamp}", f"deploy-b-{stamp}"
    try:
        for name in (own, other):
            installed.add_gpu_node(name)
        pod = wait_until(
            lambda: agent_pod_on(installed, own), timeout=60, what=f"the mig-agent pod on {own}"
        )
        wait_until(
            lambda: agent_pod_on(installed, other), timeout=60, what=f"the mig-agent pod on {other}"
        )
        assert pod is not None
        meta = pod["metadata"]
        bound = installed.token_for(AGENT_NS, AGENT_SA, bound_pod=(meta["name"], meta["uid"]))
        n = Nodes(
            own,
            other,
            as_user(installed, bound),
            as_user(installed, installed.token_for(AGENT_NS, AGENT_SA)),
            installed.api,
            {"own": own, "other": other},
        )
        wait_policy_active(n)
        yield n
    finally:
        for name in (own, other):
            installed.delete_node(name)


def wait_policy_active(n: Nodes) -> None:
    """The API server loads a new policy asynchronously; wait until it refuses a foreign change."""

    def refused() -> bool:
        try:
            n.own_agent.request(
                "PATCH",
                f"/api/v1/nodes/{n.other}",
                {"metadata": {"labels": {STATE: "probe"}}},
                content_type=MERGE,
            )
        except ApiError as exc:
            if exc.status in (403, 422) and POLICY in str(exc):
                return True
            raise
        return False

    wait_until(refused, timeout=60, what=f"the policy {POLICY} to be enforced", interval=0.5)


def condition(
    kind: str, status: str = "True", reason: str = "Applied", message: str = "from the test"
) -> dict[str, str]:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }


@dataclass(frozen=True)
class Change:
    token: str  # "own_agent" or "unbound"
    node: str  # "own" or "other"
    patch: Mapping[str, Any]
    status: bool = False  # the nodes/status subresource (strategic merge patch)
    denied: str | None = None  # a fragment of the policy's message; None: allowed
    before: Mapping[str, Any] | None = None  # merge patch applied as admin first

    def url(self, n: Nodes) -> str:
        return f"/api/v1/nodes/{n.names[self.node]}" + ("/status" if self.status else "")


OTHER_NODE = "may change only the node it runs on ({own}), not {other}"
NO_NODE = "may change only the node it runs on (its token names no node)"
LABELS = "may change only the MIG state and operand labels, not: "
ANNOTATIONS = (
    "may change only its own annotations (mig-agent.dev/cordoned, "
    "mig-agent.dev/paused-operands, mig-agent.dev/reason, mig-agent.dev/gpu-state, "
    "mig-agent.dev/reboot-attempted, mig-agent.dev/post-apply-pending, "
    "mig-agent.dev/stopped-host-services, mig-agent.dev/observed-plan, mig-agent.dev/guard), "
    "not: "
)
STATE_VALUE = f"may set {STATE} only to pending, rebooting, success, failed, not "
OPERANDS = "may move an operand label only to true or paused-for-mig-change, "
SIZE = "annotations are capped at 4096 characters"
MANAGED = "may not write metadata.managedFields"
CONDITION = "may set its node condition (MIGConfigApplied) only to True or False, with one"
PAUSED = "paused-for-mig-change"
SPEC = "may change only spec.unschedulable of the node spec"
STATUS = "may change only its own node condition (MIGConfigApplied) in the status"

CHANGES = {
    # allowed: what the agent does to its own node
    "own-state-label": Change("own_agent", "own", {"metadata": {"labels": {STATE: "pending"}}}),
    "own-state-label-removed": Change(
        "own_agent",
        "own",
        {"metadata": {"labels": {STATE: None}}},
        before={"metadata": {"labels": {STATE: "failed"}}},
    ),
    "own-annotation": Change(
        "own_agent", "own", {"metadata": {"annotations": {"mig-agent.dev/reason": "test"}}}
    ),
    "own-cordon": Change(
        "own_agent",
        "own",
        {"spec": {"unschedulable": True}},
        before={"spec": {"unschedulable": None}},
    ),
    "own-uncordon": Change(
        "own_agent",
        "own",
        {"spec": {"unschedulable": None}},
        before={"spec": {"unschedulable": True}},
    ),
    "own-device-plugin-paused": Change(
        "own_agent",
        "own",
        {"metadata": {"labels": {DP_LABEL: PAUSED}}},
        before={"metadata": {"labels": {DP_LABEL: "true"}}},
    ),
    "own-device-plugin-resumed": Change(
        "own_agent",
        "own",
        {"metadata": {"labels": {DP_LABEL: "true"}}},
        before={"metadata": {"labels": {DP_LABEL: PAUSED}}},
    ),
    "own-state-failed": Change("own_agent", "own", {"metadata": {"labels": {STATE: "failed"}}}),
    "own-all-annotations": Change(
        "own_agent",
        "own",
        {
            "metadata": {
                "annotations": {
                    "mig-agent.dev/cordoned": "true",
                    "mig-agent.dev/paused-operands": DP_LABEL,
                    "mig-agent.dev/reason": "r" * 4096,
                    "mig-agent.dev/gpu-state": "{" * 30000,
                    "mig-agent.dev/reboot-attempted": "all-balanced",
                    "mig-agent.dev/observed-plan": "{" * 4096,
                }
            }
        },
    ),
    "own-condition-failed": Change(
        "own_agent",
        "own",
        {
            "status": {
                "conditions": [
                    condition("MIGConfigApplied", "False", "EvictionBlocked", "m" * 1024)
                ]
            }
        },
        status=True,
    ),
    "own-condition": Change(
        "own_agent", "own", {"status": {"conditions": [condition("MIGConfigApplied")]}}, status=True
    ),
    # denied: another node
    "other-state-label": Change(
        "own_agent", "other", {"metadata": {"labels": {STATE: "x"}}}, denied=OTHER_NODE
    ),
    "other-annotation": Change(
        "own_agent",
        "other",
        {"metadata": {"annotations": {"mig-agent.dev/reason": "x"}}},
        denied=OTHER_NODE,
    ),
    "other-foreign-annotation": Change(
        "own_agent",
        "other",
        {"metadata": {"annotations": {"example.com/x": "y"}}},
        denied=OTHER_NODE,
    ),
    "other-cordon": Change(
        "own_agent", "other", {"spec": {"unschedulable": True}}, denied=OTHER_NODE
    ),
    "other-condition": Change(
        "own_agent",
        "other",
        {"status": {"conditions": [condition("MIGConfigApplied")]}},
        status=True,
        denied=OTHER_NODE,
    ),
    # denied: non-MIG parts of its own node
    "own-team-label": Change(
        "own_agent", "own", {"metadata": {"labels": {"team": "x"}}}, denied=LABELS + "team"
    ),
    "own-layout-label": Change(
        "own_agent",
        "own",
        {"metadata": {"labels": {"nvidia.com/mig.config": "all-disabled"}}},
        denied=LABELS + "nvidia.com/mig.config",
    ),
    "own-gpu-present-removed": Change(
        "own_agent",
        "own",
        {"metadata": {"labels": {"nvidia.com/gpu.present": None}}},
        denied=LABELS + "nvidia.com/gpu.present",
    ),
    "own-foreign-annotation": Change(
        "own_agent",
        "own",
        {"metadata": {"annotations": {"example.com/x": "y"}}},
        denied=ANNOTATIONS + "example.com/x",
    ),
    "own-taint": Change(
        "own_agent",
        "own",
        {"spec": {"taints": [{"key": "x", "effect": "NoSchedule"}]}},
        denied=SPEC,
    ),
    "own-provider-id": Change(
        "own_agent", "own", {"spec": {"providerID": "kwok://x"}}, denied=SPEC
    ),
    # denied: inside the MIG parts, values the agent never writes
    "own-state-made-up": Change(
        "own_agent", "own", {"metadata": {"labels": {STATE: "x"}}}, denied=STATE_VALUE + "x"
    ),
    "own-driver-operand-disabled": Change(
        "own_agent",
        "own",
        {"metadata": {"labels": {"nvidia.com/gpu.deploy.driver": "false"}}},
        denied=LABELS + "nvidia.com/gpu.deploy.driver",
    ),
    "own-made-up-operand": Change(
        "own_agent",
        "own",
        {"metadata": {"labels": {"nvidia.com/gpu.deploy.x": PAUSED}}},
        denied=LABELS + "nvidia.com/gpu.deploy.x",
    ),
    "own-device-plugin-false": Change(
        "own_agent",
        "own",
        {"metadata": {"labels": {DP_LABEL: "false"}}},
        before={"metadata": {"labels": {DP_LABEL: "true"}}},
        denied=OPERANDS,
    ),
    "own-device-plugin-from-false": Change(
        "own_agent",
        "own",
        {"metadata": {"labels": {DP_LABEL: "true"}}},
        before={"metadata": {"labels": {DP_LABEL: "false"}}},
        denied=OPERANDS,
    ),
    "own-device-plugin-removed": Change(
        "own_agent",
        "own",
        {"metadata": {"labels": {DP_LABEL: None}}},
        before={"metadata": {"labels": {DP_LABEL: "true"}}},
        denied=OPERANDS,
    ),
    "own-operand-added": Change(
        "own_agent",
        "own",
        {"metadata": {"labels": {"nvidia.com/gpu.deploy.dcgm": PAUSED}}},
        denied=OPERANDS,
    ),
    "own-made-up-annotation": Change(
        "own_agent",
        "own",
        {"metadata": {"annotations": {"mig-agent.dev/anything": "x"}}},
        denied=ANNOTATIONS,
    ),
    "own-annotation-too-long": Change(
        "own_agent",
        "own",
        {"metadata": {"annotations": {"mig-agent.dev/reason": "r" * 4097}}},
        denied=SIZE,
    ),
    "own-observed-plan-too-long": Change(
        "own_agent",
        "own",
        {"metadata": {"annotations": {"mig-agent.dev/observed-plan": "{" * 4097}}},
        denied=SIZE,
    ),
    "own-gpu-state-too-long": Change(
        "own_agent",
        "own",
        {"metadata": {"annotations": {"mig-agent.dev/gpu-state": "{" * 32769}}},
        denied=SIZE,
    ),
    "own-managed-fields-cleared": Change(
        "own_agent", "own", {"metadata": {"managedFields": [{}]}}, denied=MANAGED
    ),
    "own-managed-fields-forged": Change(
        "own_agent",
        "own",
        {
            "metadata": {
                "managedFields": [
                    {
                        "manager": "forged",
                        "operation": "Apply",
                        "apiVersion": "v1",
                        "fieldsType": "FieldsV1",
                        "fieldsV1": {"f:spec": {"f:taints": {}}},
                    }
                ]
            }
        },
        denied=MANAGED,
    ),
    "own-condition-made-up-reason": Change(
        "own_agent",
        "own",
        {"status": {"conditions": [condition("MIGConfigApplied", "False", "NodeNotReady")]}},
        status=True,
        denied=CONDITION,
    ),
    "own-condition-unknown": Change(
        "own_agent",
        "own",
        {"status": {"conditions": [condition("MIGConfigApplied", "Unknown")]}},
        status=True,
        denied=CONDITION,
    ),
    "own-condition-long-message": Change(
        "own_agent",
        "own",
        {"status": {"conditions": [condition("MIGConfigApplied", message="m" * 1025)]}},
        status=True,
        denied=CONDITION,
    ),
    "own-ready-condition": Change(
        "own_agent",
        "own",
        {"status": {"conditions": [condition("Ready", "False")]}},
        status=True,
        denied=STATUS,
    ),
    "own-capacity": Change(
        "own_agent",
        "own",
        {
            "status": {
                "capacity": {"nvidia.com/mig-1g.10gb": "56"},
                "allocatable": {"nvidia.com/mig-1g.10gb": "56"},
            }
        },
        status=True,
        denied=STATUS,
    ),
    # where the API server reaches the kubelet (logs, exec): must stay the node's own
    "own-address": Change(
        "own_agent",
        "own",
        {"status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.66"}]}},
        status=True,
        denied=STATUS,
    ),
    "own-kubelet-port": Change(
        "own_agent",
        "own",
        {"status": {"daemonEndpoints": {"kubeletEndpoint": {"Port": 1}}}},
        status=True,
        denied=STATUS,
    ),
    # denied: a token bound to no pod names no node
    "unbound-state-label": Change(
        "unbound", "own", {"metadata": {"labels": {STATE: "x"}}}, denied=NO_NODE
    ),
    "unbound-annotation": Change(
        "unbound",
        "own",
        {"metadata": {"annotations": {"mig-agent.dev/reason": "x"}}},
        denied=NO_NODE,
    ),
    "unbound-cordon": Change("unbound", "own", {"spec": {"unschedulable": True}}, denied=NO_NODE),
    "unbound-condition": Change(
        "unbound",
        "own",
        {"status": {"conditions": [condition("MIGConfigApplied")]}},
        status=True,
        denied=NO_NODE,
    ),
}


def _read(n: Nodes, node: str) -> dict[str, Any]:
    got: dict[str, Any] = n.admin.get(f"/api/v1/nodes/{node}")
    return got


def _applied(patch: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """Whether `node` shows the merge patch `patch` (None: key absent); conditions by type."""
    for key, want in patch.items():
        have = node.get(key)
        if key == "conditions":
            by_type = {c["type"]: c for c in have or []}
            if not all(by_type.get(c["type"], {}).get("reason") == c["reason"] for c in want):
                return False
        elif isinstance(want, Mapping):
            if not _applied(want, have or {}):
                return False
        elif have != want and not (want is None and have is None):
            return False
    return True


@pytest.mark.parametrize("change", list(CHANGES.values()), ids=list(CHANGES))
def test_policy(nodes: Nodes, change: Change) -> None:
    api: Api = getattr(nodes, change.token)
    url = change.url(nodes)
    if change.before:
        nodes.admin.request(
            "PATCH", f"/api/v1/nodes/{nodes.names[change.node]}", change.before, content_type=MERGE
        )
    content = STRATEGIC if change.status else MERGE
    if change.denied is None:
        answer = api.request("PATCH", url, change.patch, content_type=content)
        assert _applied(change.patch, answer), answer
        return
    before = _read(nodes, nodes.names[change.node])
    with pytest.raises(ApiError) as refused:
        api.request("PATCH", url, change.patch, content_type=content)
    assert refused.value.status in (403, 422)
    message = str(refused.value)
    assert POLICY in message
    assert change.denied.format(**nodes.names) in message
    after = _read(nodes, nodes.names[change.node])
    assert after["metadata"].get("labels") == before["metadata"].get("labels")
    assert after["metadata"].get("annotations") == before["metadata"].get("annotations")
    assert after["spec"] == before["spec"]
    assert _managers(after) == _managers(before)


def _managers(node: Mapping[str, Any]) -> set[tuple[str, str]]:
    return {(m["manager"], m["operation"]) for m in node["metadata"].get("managedFields", [])}


def test_status_subresource_cannot_carry_label_changes(nodes: Nodes) -> None:
    # Whether the API server drops metadata changes sent to nodes/status or the policy refuses
    # them, the label must not land.
    patch = {
        "metadata": {"labels": {"team": "x"}},
        "status": {"conditions": [condition("MIGConfigApplied")]},
    }
    try:
        nodes.own_agent.request(
            "PATCH", f"/api/v1/nodes/{nodes.own}/status", patch, content_type=STRATEGIC
        )
    except ApiError as exc:
        assert exc.status in (403, 422) and POLICY in str(exc)
    assert "team" not in (_read(nodes, nodes.own)["metadata"].get("labels") or {})


@pytest.mark.parametrize("name", [POLICY, "mig-agent-own-device-plugin", "mig-agent-own-events"])
def test_policy_type_checks_without_warnings(installed: Cluster, name: str) -> None:
    path = f"/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/{name}"

    def checked() -> dict[str, Any] | None:
        # the status controller writes the type-check result with observedGeneration at once;
        # without warnings, typeChecking is left out
        policy: dict[str, Any] = installed.api.get(path)
        status: dict[str, Any] = policy.get("status", {})
        done = status.get("observedGeneration") == policy["metadata"]["generation"]
        return status if done else None

    status = wait_until(checked, timeout=60, what=f"type checking of {name}")
    assert status is not None
    assert not status.get("typeChecking", {}).get("expressionWarnings"), status
    assert not [c for c in status.get("conditions", []) if c.get("status") == "False"], status
