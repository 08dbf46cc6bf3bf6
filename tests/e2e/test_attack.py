"""The attack table: what a compromised agent can and cannot do with its credentials, tried against
the deployed manifest (daemonset.yaml) on the local cluster, each row one attempt with the answer
it must get. A change that opens a hole (or closes a residual one) fails here.

The attacker holds the agent's ServiceAccount token: bound to the agent pod on node A (what the
agent's pod has), or bound to no pod (a token minted for the account elsewhere, which names no
node). Writes are server dry runs against objects that exist, so admission runs in full and
nothing changes. Changes to Node objects are the table in test_deployment.py (test_policy); this
one covers the rest:

* pod deletion: only the device plugin's pod on A, and NVIDIA's DRA kubelet plugin's pod on A
  (policy mig-agent-own-device-plugin);
* DRA: listing ResourceSlices and ResourceClaims, no more (no get, no writes); DeviceTaintRules
  of one device of A's pool, its own label and taint, NoSchedule (policy
  mig-agent-own-device-taints);
* Events: only about A, with the agent's reasons (policy mig-agent-own-events);
* what RBAC refuses: secrets, logs, exec, node proxy, pod writes, other namespaces, tokens;
* the residual rights (docs/security.md): evicting any pod on any node (no PDB: at once, grace
  period 0 allowed) and reading every pod and node in the cluster, env values included. They are
  rows here too, expected to succeed, so that the table says what an attacker can do.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from migsim.cluster import Cluster, wait_until
from migsim.cluster.api import Api, ApiError

from tests.e2e.test_deployment import (
    AGENT_NS,
    AGENT_SA,
    AGENT_USER,
    PLUGIN_NS,
    agent_pod_on,
    as_user,
)

DRY = "?dryRun=All"
TEAM_NS = "team-attack"
DELETE_POLICY = "mig-agent-own-device-plugin"
EVENT_POLICY = "mig-agent-own-events"
TAINT_POLICY = "mig-agent-own-device-taints"
PLUGIN_SELECTOR = "app%3Dnvidia-device-plugin-daemonset"
DRA_APP = "nvidia-dra-driver-kubelet-plugin"
RESOURCE = "/apis/resource.k8s.io/v1"
TAINTS = f"{RESOURCE}/devicetaintrules{DRY}"
SECRET_ENV = "not-for-the-agent"


@dataclass
class Targets:
    own: str
    other: str
    bound: Api  # token bound to the agent pod on `own`
    unbound: Api  # the same ServiceAccount, bound to no pod
    names: dict[str, str]  # placeholders of the table's paths and bodies


def _pod(name: str, namespace: str, node: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "nodeName": node,
            "tolerations": [{"operator": "Exists"}],
            "containers": [
                {
                    "name": "c",
                    "image": "registry.invalid/x:1",
                    "env": [{"name": "DB_PASSWORD", "value": SECRET_ENV}],
                }
            ],
        },
    }


def _plugin_pod(cluster: Cluster, node: str) -> str:
    path = (
        f"/api/v1/namespaces/{PLUGIN_NS}/pods?labelSelector={PLUGIN_SELECTOR}"
        f"&fieldSelector=spec.nodeName%3D{node}"
    )

    def found() -> str | None:
        items = [
            p for p in cluster.api.get(path)["items"] if not p["metadata"].get("deletionTimestamp")
        ]
        return str(items[0]["metadata"]["name"]) if items else None

    name = wait_until(found, timeout=60, what=f"the device plugin pod on {node}")
    assert name is not None
    return name


@pytest.fixture(scope="module")
def targets(installed: Cluster) -> Iterator[Targets]:
    stamp = int(time.time() * 1000) % 100000
    own, other = f"attack-a-{stamp}", f"attack-b-{stamp}"
    api = installed.api
    try:
        for name in (own, other):
            installed.add_gpu_node(name)
        pod = wait_until(
            lambda: agent_pod_on(installed, own), timeout=60, what=f"the mig-agent pod on {own}"
        )
        assert pod is not None
        meta = pod["metadata"]
        bound = as_user(
            installed,
            installed.token_for(AGENT_NS, AGENT_SA, bound_pod=(meta["name"], meta["uid"])),
        )
        unbound = as_user(installed, installed.token_for(AGENT_NS, AGENT_SA))
        installed.kubectl("create", "namespace", TEAM_NS, check=False)
        driver, workload = f"nvidia-driver-{stamp}", f"training-{stamp}"
        api.request(
            "POST",
            f"/api/v1/namespaces/{PLUGIN_NS}/pods",
            _pod(driver, PLUGIN_NS, own, {"app": "nvidia-driver-daemonset"}),
        )
        for node in (own, other):  # NVIDIA's DRA kubelet plugin's pods (GPUCluster's names)
            api.request(
                "POST",
                f"/api/v1/namespaces/{PLUGIN_NS}/pods",
                _pod(f"dra-{node}", PLUGIN_NS, node, {"app": DRA_APP}),
            )
        api.request(
            "POST",
            f"/api/v1/namespaces/{TEAM_NS}/pods",
            _pod(workload, TEAM_NS, other, {"app": "training"}),
        )
        names = {
            "own": own,
            "other": other,
            "own_plugin": _plugin_pod(installed, own),
            "other_plugin": _plugin_pod(installed, other),
            "own_driver": driver,
            "own_dra": f"dra-{own}",
            "other_dra": f"dra-{other}",
            "workload": workload,
        }
        t = Targets(own, other, bound, unbound, names)
        _wait_policies(t)
        yield t
    finally:
        for ns, name in (
            (PLUGIN_NS, f"nvidia-driver-{stamp}"),
            (TEAM_NS, f"training-{stamp}"),
            (PLUGIN_NS, f"dra-{own}"),
            (PLUGIN_NS, f"dra-{other}"),
        ):
            installed.kubectl(
                "delete",
                "pod",
                "-n",
                ns,
                name,
                "--grace-period=0",
                "--force",
                "--ignore-not-found",
                check=False,
            )
        for name in (own, other):
            installed.delete_node(name)


def _answered_as_expected(a: Attempt, t: Targets) -> bool:
    """Whether ``a`` is answered as the table says (test_attack's judgement, without asserting)."""
    status, message = a.send(t)
    if a.expect in (ALLOWED, RESIDUAL):
        return status == 200
    if a.expect == RBAC:
        return status == 403
    refused = f"ValidatingAdmissionPolicy '{a.expect}'" in message
    return status == 403 and refused and a.fragment.format(**t.names) in message


def _wait_policies(t: Targets) -> None:
    """The API server loads new policies asynchronously (and the session's may just have been
    replaced: daemonset.yaml's leave DRA off, the agents' DRA rights turn it on): wait until the
    policies answer as their newest version does, DRA plugin deletions included."""
    for name in (
        "delete-other-nodes-device-plugin",
        "event-about-other-node",
        "delete-own-dra-plugin",
        "delete-other-nodes-dra-plugin",
        "taint-other-nodes-device",
    ):
        attempt = ATTEMPTS[name]
        wait_until(
            lambda a=attempt: _answered_as_expected(a, t),  # type: ignore[misc]
            timeout=60,
            what=f"the admission policies to answer {name} as they should",
            interval=0.5,
        )


def _event(about: str = "{own}", reason: str = "MIGDraining", **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": "attack."},
        "involvedObject": {"kind": "Node", "name": about, "apiVersion": "v1"},
        "reason": reason,
        "message": "from the attack table",
        "type": "Normal",
        "source": {"component": "mig-agent", "host": "{own}"},
        **extra,
    }


def _taint(pool: str = "{own}", effect: str = "NoSchedule", device: str | None = "gpu-0") -> Any:
    """A DeviceTaintRule as the agent writes one (mig_agent.core.device_taints.rule)."""
    selector: dict[str, str] = {"driver": "gpu.nvidia.com", "pool": pool}
    if device is not None:
        selector["device"] = device
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": f"mig-agent.gpu-0.{pool}",
            "labels": {"app.kubernetes.io/managed-by": "mig-agent"},
        },
        "spec": {
            "deviceSelector": selector,
            "taint": {"key": "mig-agent.dev/mig-change", "value": "changing", "effect": effect},
        },
    }


def _eviction(name: str, namespace: str, grace: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": name, "namespace": namespace},
    }
    if grace is not None:
        body["deleteOptions"] = {"gracePeriodSeconds": grace}
    return body


ALLOWED, RESIDUAL, RBAC = "allowed", "residual", "rbac"


@dataclass(frozen=True)
class Attempt:
    token: str  # "bound" or "unbound"
    method: str
    path: str  # with {own}, {other}, {own_plugin}, ... from Targets.names
    body: object = None
    # ALLOWED: what the agent needs; RESIDUAL: allowed, a documented residual risk
    # (docs/security.md); RBAC: refused by RBAC; else the admission policy that must refuse it
    expect: str = RBAC
    fragment: str = ""  # a part of the refusal's message

    def send(self, t: Targets) -> tuple[int, str]:
        api: Api = getattr(t, self.token)
        text = json.dumps(self.body)
        for key, value in t.names.items():
            text = text.replace("{" + key + "}", value)
        body = json.loads(text) if self.body is not None else None
        try:
            answer = api.request(self.method, self.path.format(**t.names), body)
        except ApiError as exc:
            return exc.status, str(exc)
        return 200, json.dumps(answer)


EVENTS = f"/api/v1/namespaces/default/events{DRY}"
ATTEMPTS: dict[str, Attempt] = {
    # pods: the agent restarts the device plugin on its node, nothing else
    "delete-own-device-plugin": Attempt(
        "bound",
        "DELETE",
        f"/api/v1/namespaces/{PLUGIN_NS}/pods/{{own_plugin}}{DRY}",
        expect=ALLOWED,
    ),
    "delete-other-nodes-device-plugin": Attempt(
        "bound",
        "DELETE",
        f"/api/v1/namespaces/{PLUGIN_NS}/pods/{{other_plugin}}{DRY}",
        expect=DELETE_POLICY,
        fragment="may delete pods only on the node it runs on ({own}), not on {other}",
    ),
    "delete-own-nodes-driver": Attempt(
        "bound",
        "DELETE",
        f"/api/v1/namespaces/{PLUGIN_NS}/pods/{{own_driver}}{DRY}",
        expect=DELETE_POLICY,
        fragment="may delete only the device plugin's pod",
    ),
    "delete-device-plugin-unbound": Attempt(
        "unbound",
        "DELETE",
        f"/api/v1/namespaces/{PLUGIN_NS}/pods/{{own_plugin}}{DRY}",
        expect=DELETE_POLICY,
        fragment="(its token names no node)",
    ),
    "delete-workload": Attempt(
        "bound", "DELETE", f"/api/v1/namespaces/{TEAM_NS}/pods/{{workload}}{DRY}"
    ),
    "delete-all-gpu-operator-pods": Attempt(
        "bound", "DELETE", f"/api/v1/namespaces/{PLUGIN_NS}/pods{DRY}"
    ),
    "patch-device-plugin-pod": Attempt(
        "bound",
        "PATCH",
        f"/api/v1/namespaces/{PLUGIN_NS}/pods/{{own_plugin}}{DRY}",
        {"metadata": {"labels": {"x": "y"}}},
    ),
    "create-pod": Attempt(
        "bound",
        "POST",
        f"/api/v1/namespaces/{PLUGIN_NS}/pods{DRY}",
        _pod("sneaky", PLUGIN_NS, "{own}", {}),
    ),
    "exec-into-device-plugin": Attempt(
        "bound",
        "POST",
        f"/api/v1/namespaces/{PLUGIN_NS}/pods/{{own_plugin}}/exec?command=id&stdout=true",
    ),
    "read-device-plugin-log": Attempt(
        "bound", "GET", f"/api/v1/namespaces/{PLUGIN_NS}/pods/{{own_plugin}}/log"
    ),
    # DRA: the agent restarts NVIDIA's DRA kubelet plugin on its node, and reads who holds what
    "delete-own-dra-plugin": Attempt(
        "bound", "DELETE", f"/api/v1/namespaces/{PLUGIN_NS}/pods/{{own_dra}}{DRY}", expect=ALLOWED
    ),
    "delete-other-nodes-dra-plugin": Attempt(
        "bound",
        "DELETE",
        f"/api/v1/namespaces/{PLUGIN_NS}/pods/{{other_dra}}{DRY}",
        expect=DELETE_POLICY,
        fragment="may delete pods only on the node it runs on ({own}), not on {other}",
    ),
    "delete-dra-plugin-unbound": Attempt(
        "unbound",
        "DELETE",
        f"/api/v1/namespaces/{PLUGIN_NS}/pods/{{own_dra}}{DRY}",
        expect=DELETE_POLICY,
        fragment="(its token names no node)",
    ),
    "list-resource-slices": Attempt("bound", "GET", f"{RESOURCE}/resourceslices", expect=ALLOWED),
    "list-resource-claims": Attempt("bound", "GET", f"{RESOURCE}/resourceclaims", expect=ALLOWED),
    "get-a-resource-claim": Attempt(
        "bound", "GET", f"{RESOURCE}/namespaces/{TEAM_NS}/resourceclaims/x"
    ),
    "create-resource-slice": Attempt(
        "bound",
        "POST",
        f"{RESOURCE}/resourceslices{DRY}",
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "x"}},
    ),
    "delete-resource-slices": Attempt("bound", "DELETE", f"{RESOURCE}/resourceslices{DRY}"),
    "patch-resource-claim-status": Attempt(
        "bound",
        "PATCH",
        f"{RESOURCE}/namespaces/{TEAM_NS}/resourceclaims/x/status{DRY}",
        {"status": {}},
    ),
    # events: about its own node, with its own reasons
    "event-about-own-node": Attempt("bound", "POST", EVENTS, _event(), expect=ALLOWED),
    "event-failed-warning": Attempt(
        "bound", "POST", EVENTS, _event(reason="MIGConfigFailed", type="Warning"), expect=ALLOWED
    ),
    "event-about-other-node": Attempt(
        "bound",
        "POST",
        EVENTS,
        _event(about="{other}"),
        expect=EVENT_POLICY,
        fragment="only about the node it runs on ({own}), not about Node {other}",
    ),
    "event-node-not-ready-own-node": Attempt(
        "bound",
        "POST",
        EVENTS,
        _event(reason="NodeNotReady"),
        expect=EVENT_POLICY,
        fragment="may report only its own events",
    ),
    "event-about-a-pod": Attempt(
        "bound",
        "POST",
        EVENTS,
        _event(involvedObject={"kind": "Pod", "name": "x", "namespace": "default"}),
        expect=EVENT_POLICY,
        fragment="not about Pod x",
    ),
    "event-related-to-other-node": Attempt(
        "bound",
        "POST",
        EVENTS,
        _event(related={"kind": "Node", "name": "{other}", "apiVersion": "v1"}),
        expect=EVENT_POLICY,
        fragment="only about the node it runs on",
    ),
    "event-from-other-host": Attempt(
        "bound",
        "POST",
        EVENTS,
        _event(source={"component": "mig-agent", "host": "{other}"}),
        expect=EVENT_POLICY,
        fragment="only about the node it runs on",
    ),
    "event-as-kubelet": Attempt(
        "bound",
        "POST",
        EVENTS,
        _event(source={"component": "kubelet", "host": "{own}"}),
        expect=EVENT_POLICY,
        fragment="may report only its own events",
    ),
    "event-unbound": Attempt(
        "unbound",
        "POST",
        EVENTS,
        _event(),
        expect=EVENT_POLICY,
        fragment="(its token names no node)",
    ),
    "event-in-kube-system": Attempt(
        "bound", "POST", f"/api/v1/namespaces/kube-system/events{DRY}", _event()
    ),
    "event-through-events-api": Attempt(
        "bound",
        "POST",
        f"/apis/events.k8s.io/v1/namespaces/default/events{DRY}",
        {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"generateName": "x."},
            "regarding": {"kind": "Node", "name": "{other}"},
            "reason": "NodeNotReady",
            "action": "x",
            "reportingController": "x",
            "reportingInstance": "x",
            "eventTime": "2026-01-01T00:00:00.000000Z",
            "type": "Normal",
        },
    ),
    # residual (docs/security.md): RBAC cannot scope these to a node, an Eviction names no node
    "evict-pod-on-other-node": Attempt(
        "bound",
        "POST",
        f"/api/v1/namespaces/{TEAM_NS}/pods/{{workload}}/eviction{DRY}",
        _eviction("{workload}", TEAM_NS),
        expect=RESIDUAL,
    ),
    "evict-pod-grace-0": Attempt(
        "bound",
        "POST",
        f"/api/v1/namespaces/{TEAM_NS}/pods/{{workload}}/eviction{DRY}",
        _eviction("{workload}", TEAM_NS, grace=0),
        expect=RESIDUAL,
    ),
    "evict-pod-unbound": Attempt(
        "unbound",
        "POST",
        f"/api/v1/namespaces/{TEAM_NS}/pods/{{workload}}/eviction{DRY}",
        _eviction("{workload}", TEAM_NS),
        expect=RESIDUAL,
    ),
    "read-pod-on-other-node": Attempt(
        "bound",
        "GET",
        f"/api/v1/namespaces/{TEAM_NS}/pods/{{workload}}",
        expect=RESIDUAL,
        fragment=SECRET_ENV,
    ),
    "list-pods-everywhere": Attempt(
        "bound", "GET", "/api/v1/pods", expect=RESIDUAL, fragment=SECRET_ENV
    ),
    "list-nodes": Attempt("bound", "GET", "/api/v1/nodes", expect=RESIDUAL),
    # device taints (Kubernetes 1.37): one device of its own node's pool, NoSchedule only
    "taint-own-device": Attempt("bound", "POST", TAINTS, _taint(), expect=ALLOWED),
    "taint-other-nodes-device": Attempt(
        "bound",
        "POST",
        TAINTS,
        _taint(pool="{other}"),
        expect=TAINT_POLICY,
        fragment="in the pool of the node it runs on ({own})",
    ),
    "taint-own-whole-pool": Attempt(
        "bound",
        "POST",
        TAINTS,
        _taint(device=None),
        expect=TAINT_POLICY,
        fragment="one device a rule",
    ),
    "taint-no-execute": Attempt(
        "bound",
        "POST",
        TAINTS,
        _taint(effect="NoExecute"),
        expect=TAINT_POLICY,
        fragment="effect NoSchedule",
    ),
    "taint-unbound": Attempt(
        "unbound",
        "POST",
        TAINTS,
        _taint(),
        expect=TAINT_POLICY,
        fragment="(its token names no node)",
    ),
    # what RBAC refuses to any token of the account
    "list-secrets": Attempt("bound", "GET", "/api/v1/secrets"),
    "read-kube-system-configmaps": Attempt(
        "bound", "GET", "/api/v1/namespaces/kube-system/configmaps"
    ),
    "node-proxy": Attempt("bound", "GET", "/api/v1/nodes/{own}/proxy/pods"),
    "mint-a-token": Attempt(
        "bound",
        "POST",
        f"/api/v1/namespaces/{AGENT_NS}/serviceaccounts/{AGENT_SA}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}},
    ),
    "replace-own-node": Attempt(
        "bound",
        "PUT",
        f"/api/v1/nodes/{{own}}{DRY}",
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "{own}"}},
    ),
    "delete-own-node": Attempt("bound", "DELETE", f"/api/v1/nodes/{{own}}{DRY}"),
}


@pytest.mark.parametrize("attempt", list(ATTEMPTS.values()), ids=list(ATTEMPTS))
def test_attack(targets: Targets, attempt: Attempt) -> None:
    status, message = attempt.send(targets)
    fragment = attempt.fragment.format(**targets.names)
    if attempt.expect in (ALLOWED, RESIDUAL):
        assert status == 200, message
    elif attempt.expect == RBAC:
        assert status == 403, message
        assert AGENT_USER in message and "ValidatingAdmissionPolicy" not in message, message
    else:
        assert status == 403, message
        assert f"ValidatingAdmissionPolicy '{attempt.expect}'" in message, message
    assert fragment in message, message


def test_table_covers_both_tokens_and_every_answer() -> None:
    kinds = {a.expect for a in ATTEMPTS.values()}
    assert {ALLOWED, RESIDUAL, RBAC, DELETE_POLICY, EVENT_POLICY, TAINT_POLICY} <= kinds
    assert {a.token for a in ATTEMPTS.values()} == {"bound", "unbound"}
