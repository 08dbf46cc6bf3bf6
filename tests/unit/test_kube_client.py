"""KubernetesCluster against API faults: real sockets through the fault-injecting proxy
(migsim.cluster.api_faults) where the fault is on the wire, a stubbed API call where it is
the answer's header; no API server is needed."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from migsim.cluster import kubeconfig, pki
from migsim.cluster.api_faults import ApiFaultProxy, Fault

from mig_agent.core.errors import EvictionBlocked, KubeError, KubeUnavailable, PodReplaced
from mig_agent.kube.client import KubernetesCluster
from mig_agent.kube.cluster import PodRef


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[tuple[ApiFaultProxy, Path]]:
    keys = pki.generate(tmp_path / "pki")
    # no API server behind it: every test here is answered by a fault
    p = ApiFaultProxy(
        "https://127.0.0.1:9", cert=keys.serving_cert, key=keys.serving_key, ca=keys.ca_cert
    )
    config = kubeconfig.write(
        tmp_path / "kubeconfig", server=p.url, ca_cert=keys.ca_cert, user="agent", token="t"
    )
    try:
        yield p, config
    finally:
        p.stop()


class _Answer:
    """An unparsed answer, as the client hands it back with ``_preload_content=False``."""

    def __init__(self, body: object) -> None:
        self.data = json.dumps(body).encode()
        self.released = False

    def release_conn(self) -> None:
        self.released = True


def _node(name: str) -> Any:
    return _Answer({"metadata": {"name": name, "uid": "u", "resourceVersion": "1"}})


def test_a_hung_api_server_costs_a_timeout_per_attempt_not_the_agent(
    proxy: tuple[ApiFaultProxy, Path],
) -> None:
    """Before: no request timeout, so a request the server accepted and never answered blocked
    the agent's loop forever."""
    p, config = proxy
    p.add(Fault("hang"))
    k = KubernetesCluster.connect(str(config), attempts=2, backoff_s=0.01, request_timeout_s=0.5)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            k.get_node("n")
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)

    t = threading.Thread(target=read, daemon=True)
    started = time.monotonic()
    t.start()
    t.join(timeout=20)
    k.close()
    assert not t.is_alive(), "get_node still blocked on a server that never answers"
    assert isinstance(outcome[0], KubeUnavailable)
    assert "read node" in str(outcome[0])
    assert p.hits["hang"] == 2  # retried once, each attempt timed out
    assert time.monotonic() - started < 10


def test_throttling_waits_as_long_as_the_server_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a 429's Retry-After was ignored and the next attempt came after the jittered
    backoff's fraction of a second, throttled again."""
    slept: list[float] = []
    k = KubernetesCluster(client.ApiClient(), backoff_s=0.1, backoff_max_s=10.0, sleep=slept.append)
    answers: list[Any] = [ApiException(status=429, reason="Too Many Requests"), _node("n")]
    answers[0].headers = {"Retry-After": "3"}

    def read_node(name: str, **_: Any) -> Any:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(k._core, "read_node", read_node)
    assert k.get_node("n").name == "n"
    assert len(slept) == 1 and slept[0] >= 3.0


def test_retry_after_is_capped_and_garbage_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    k = KubernetesCluster(client.ApiClient(), backoff_s=0.1, backoff_max_s=10.0, sleep=slept.append)
    errors = [ApiException(status=429, reason="x"), ApiException(status=503, reason="y")]
    errors[0].headers = {"Retry-After": "86400"}
    errors[1].headers = {"Retry-After": "soon"}
    answers: list[Any] = [*errors, _node("n")]

    def read_node(name: str, **_: Any) -> Any:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(k._core, "read_node", read_node)
    k.get_node("n")
    assert slept[0] == 60.0  # a day is not waited for in one go
    assert slept[1] <= 10.0


def test_connection_resets_and_5xx_are_retried_then_named(
    proxy: tuple[ApiFaultProxy, Path],
) -> None:
    p, config = proxy
    p.add(Fault("reset", times=2))
    p.add(Fault("status", status=503))
    k = KubernetesCluster.connect(str(config), attempts=4, backoff_s=0.01)
    with pytest.raises(KubeUnavailable, match="read node: 503"):
        k.get_node("n")
    k.close()
    assert p.hits["reset"] == 2 and p.hits["status-503"] == 2


def test_a_conflict_on_a_plain_node_patch_sends_it_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a 409 on a merge patch without a precondition (cordon, pause, a label) failed the
    agent's pass for good, though sending the same patch again cannot spoil anything."""
    k = KubernetesCluster(client.ApiClient(), sleep=lambda _s: None)
    answers: list[Any] = [
        ApiException(status=409, reason="Conflict"),
        ApiException(status=409, reason="Conflict"),
        _node("n"),
    ]
    bodies: list[Any] = []

    def patch_node(name: str, body: Any, **_: Any) -> Any:
        bodies.append(body)
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(k._core, "patch_node", patch_node)
    assert k.patch_node("n", unschedulable=True).name == "n"
    assert bodies == [{"metadata": {}, "spec": {"unschedulable": True}}] * 3


def test_conflicts_without_end_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    k = KubernetesCluster(client.ApiClient(), sleep=lambda _s: None)
    calls: list[str] = []

    def patch_node_status(name: str, body: Any, **_: Any) -> Any:
        calls.append(name)
        raise ApiException(status=409, reason="Conflict")

    monkeypatch.setattr(k._core, "patch_node_status", patch_node_status)
    with pytest.raises(KubeError, match="patch node status: 409"):
        k.patch_node_resources("n", {"nvidia.com/gpu": 1})
    assert len(calls) == 10


@pytest.mark.parametrize("status", [401, 403])
def test_a_refusal_of_the_credentials_is_retryable_by_the_agent_not_in_the_request(
    monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    from mig_agent.core.errors import KubeForbidden

    k = KubernetesCluster(client.ApiClient(), sleep=lambda _s: None)
    calls: list[str] = []

    def read_node(name: str, **_: Any) -> Any:
        calls.append(name)
        raise ApiException(status=status, reason="Forbidden")

    monkeypatch.setattr(k._core, "read_node", read_node)
    with pytest.raises(KubeForbidden, match=f"{status}") as caught:
        k.get_node("n")
    assert caught.value.retryable and calls == ["n"]


def test_pods_and_nodes_are_read_from_the_servers_json() -> None:
    """Answers are parsed as JSON, not into the client's models (five times the cost): the
    fields the agent decides on come from the JSON names the API server writes."""
    pod = {
        "metadata": {
            "namespace": "ml",
            "name": "p",
            "uid": "u1",
            "labels": {"a": "b"},
            "deletionTimestamp": "2026-12-01T00:00:00Z",
            "ownerReferences": [{"kind": "ReplicaSet", "name": "r", "uid": "x"}],
        },
        "spec": {
            "nodeName": "n",
            "nodeSelector": {"k": "v"},
            "runtimeClassName": "nvidia",
            "initContainers": [
                {"name": "i", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "2"}}}
            ],
            "containers": [
                {
                    "name": "c",
                    "resources": {
                        "requests": {"nvidia.com/mig-1g.10gb": "1", "cpu": "1"},
                        "limits": {"nvidia.com/gpu": "1"},
                    },
                }
            ],
        },
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    node = {
        "metadata": {"name": "n", "uid": "nu", "resourceVersion": "7", "labels": {"l": "1"}},
        "spec": {"unschedulable": True},
        "status": {
            "allocatable": {"nvidia.com/mig-1g.10gb": "7"},
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ok"}
            ],
        },
    }
    answers = {"pods": _Answer({"items": [pod]}), "node": _Answer(node)}
    k = KubernetesCluster(client.ApiClient(), sleep=lambda _s: None)
    k._core.list_pod_for_all_namespaces = lambda **_: answers["pods"]  # type: ignore[method-assign]
    k._core.read_node = lambda name, **_: answers["node"]  # type: ignore[method-assign]

    (view,) = k.list_pods(node="n")
    assert (view.ref.namespace, view.ref.name, view.ref.uid) == ("ml", "p", "u1")
    assert view.terminating and view.ready and view.phase == "Running"
    assert view.gpu_requests == {"nvidia.com/mig-1g.10gb": 2, "nvidia.com/gpu": 1}
    assert view.owner_kinds == ("ReplicaSet",)
    assert view.node_selector == {"k": "v"} and view.runtime_class == "nvidia"
    n = k.get_node("n")
    assert (n.uid, n.resource_version, n.unschedulable) == ("nu", "7", True)
    assert n.gpu_resources() == {"nvidia.com/mig-1g.10gb": 7}
    assert n.conditions[0].reason == "KubeletReady"
    assert answers["pods"].released and answers["node"].released  # connections go back


def _evictions(monkeypatch: pytest.MonkeyPatch, k: KubernetesCluster, answers: list[Any]) -> None:
    def create_namespaced_pod_eviction(name: str, namespace: str, body: Any, **_: Any) -> Any:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(k._core, "create_namespaced_pod_eviction", create_namespaced_pod_eviction)


def _status(code: int, message: str, causes: list[dict[str, str]] | None = None) -> ApiException:
    exc = ApiException(status=code, reason=message)
    body: dict[str, Any] = {"kind": "Status", "code": code, "message": message}
    if causes is not None:
        body["details"] = {"causes": causes}
    exc.body = json.dumps(body)
    return exc


def test_an_eviction_answered_409_says_the_pod_was_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: the 409 of the eviction's UID precondition (a pod made again under its name)
    was a KubeError that failed the change for good."""
    k = KubernetesCluster(client.ApiClient(), sleep=lambda _s: None)
    conflict = _status(409, "Precondition failed: UID in precondition: a, UID in object meta: b")
    _evictions(monkeypatch, k, [conflict])
    with pytest.raises(PodReplaced, match="work/db-0"):
        k.evict(PodRef("work", "db-0", "a"))


def test_a_budgets_429_is_told_from_throttling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: every 429 was "a PodDisruptionBudget does not allow it", API Priority and
    Fairness throttling included; now throttling is waited out (its Retry-After) and retried."""
    slept: list[float] = []
    k = KubernetesCluster(client.ApiClient(), backoff_s=0.1, sleep=slept.append)
    budget = _status(
        429,
        "Cannot evict pod as it would violate the pod's disruption budget.",
        [
            {
                "reason": "DisruptionBudget",
                "message": "The disruption budget db needs 1 healthy pods",
            }
        ],
    )
    throttled = _status(429, "Too many requests, please try again later.")
    throttled.headers = {"Retry-After": "2"}
    _evictions(monkeypatch, k, [budget, throttled, _Answer({"kind": "Status", "code": 201})])
    with pytest.raises(EvictionBlocked, match="PodDisruptionBudget work/db does not allow it"):
        k.evict(PodRef("work", "db-0", "a"))
    assert slept == []  # a budget's refusal is the drain's to retry, at its own pace
    k.evict(PodRef("work", "db-0", "a"))  # throttled once, then evicted
    assert len(slept) == 1 and slept[0] >= 2.0


def test_a_pods_emptydir_volumes_are_read() -> None:
    from mig_agent.kube.client import _pod

    pod = _pod(
        {
            "metadata": {"name": "p", "namespace": "ml", "uid": "u"},
            "spec": {
                "volumes": [
                    {"name": "shm", "emptyDir": {"medium": "Memory"}},
                    {"name": "cfg", "configMap": {"name": "c"}},
                    {"name": "scratch", "emptyDir": {}},
                ]
            },
        }
    )
    assert pod.empty_dirs == ("shm", "scratch")


def test_device_taints_discovery_keeps_only_a_yes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 54, item 6: a 404 at discovery (the seconds after an API server restart) was kept
    for the agent's life, and every later change cordoned the whole node."""
    k = KubernetesCluster(client.ApiClient(), sleep=lambda _s: None)
    answers: list[Any] = [
        ApiException(status=404, reason="Not Found"),
        _Answer({"resources": [{"name": "resourceslices"}, {"name": "devicetaintrules"}]}),
    ]
    asked: list[int] = []

    def get_api_resources(**_: Any) -> Any:
        asked.append(1)
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(k._resource, "get_api_resources", get_api_resources)
    assert not k.device_taints_served()
    assert k.device_taints_served()  # asked again
    assert k.device_taints_served() and len(asked) == 2  # a yes is kept


def test_a_taint_rule_of_the_same_name_for_another_device_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 54, item 5: the second node's change failed with a bare 409."""
    from mig_agent.core import device_taints

    k = KubernetesCluster(client.ApiClient(), sleep=lambda _s: None)
    mine = device_taints.rule("node-b", "gpu-0", "mig-agent.dev/changing")
    other = device_taints.rule("node-a", "gpu-0", "mig-agent.dev/changing")
    other["metadata"]["name"] = mine["metadata"]["name"]

    def create(*_: Any, **__: Any) -> Any:
        raise ApiException(status=409, reason="AlreadyExists")

    monkeypatch.setattr(k._custom, "create_cluster_custom_object", create)
    monkeypatch.setattr(
        k._custom, "list_cluster_custom_object", lambda *_a, **_k: _Answer({"items": [other]})
    )
    with pytest.raises(KubeError) as got:
        k.create_device_taint(mine)
    message = str(got.value)
    assert mine["metadata"]["name"] in message and "'pool': 'node-a'" in message, message
    assert "delete or rename it" in message
    monkeypatch.setattr(
        k._custom, "list_cluster_custom_object", lambda *_a, **_k: _Answer({"items": [mine]})
    )
    k.create_device_taint(mine)  # its own rule, made before: nothing to do
