"""Eviction answers for the guard model (tests/unit/test_guard_model.py), as the API server
gives them and as the agent's own client turns them into errors.

The model's cluster is in memory, but what an eviction's refusal becomes is the real client's
business (mig_agent.kube.client: which answers it retries, which it calls a budget's refusal,
which a server fault): a fake that raised our errors itself would test the fake's opinion of
those answers, not the client's. So each refused eviction runs KubernetesCluster.evict over a
stub of the Kubernetes API that answers, attempt by attempt, from the pod's script of HTTP
answers; what it raises is what the drain sees. Its retries sleep in the model's time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from mig_agent.kube.client import KubernetesCluster
from mig_agent.kube.cluster import PodRef, PodView


class Answer(StrEnum):
    """What the API server answers one eviction request."""

    GRANTED = "granted"  # 201: the pod is deleted (gracefully)
    BUDGET = "budget"  # 429 with a DisruptionBudget cause: a PDB allows no disruption now
    THROTTLED = "throttled"  # 429 of API Priority and Fairness, with Retry-After
    TWO_BUDGETS = "two-budgets"  # 500: the eviction subresource cannot choose between PDBs
    FORBIDDEN = "forbidden"  # 403: an admission webhook or policy refuses evictions
    CONFLICT = "conflict"  # 409: the API server's conflict (the pod itself is not replaced)
    SERVER_ERROR = "server-error"  # 503: the API server cannot answer now


# what kube-apiserver v1.34's eviction subresource says for a pod that two PDBs cover
TWO_BUDGETS_MESSAGE = (
    "This pod has more than one PodDisruptionBudget, which the eviction subresource does not "
    "support."
)


def _status(code: int, reason: str, message: str, causes: list[dict[str, str]]) -> str:
    """A meta/v1 Status body, as the API server writes it."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if causes:
        body["details"] = {"causes": causes}
    return json.dumps(body)


def refusal(answer: Answer, ref: PodRef, budgets: tuple[str, ...]) -> ApiException:
    """The ApiException the Kubernetes client raises for ``answer`` to the eviction of
    ``ref`` (``budgets``: the names of the PDBs that cover it)."""
    headers: dict[str, str] = {}
    if answer is Answer.BUDGET:
        name = budgets[0] if budgets else "unnamed"
        code, reason = 429, "TooManyRequests"
        message = "Cannot evict pod as it would violate the pod's disruption budget."
        causes = [
            {
                "reason": "DisruptionBudget",
                "message": f"The disruption budget {name} needs 1 healthy pods and has 1 currently",
            }
        ]
    elif answer is Answer.THROTTLED:
        code, reason, causes = 429, "TooManyRequests", []
        message = "Too many requests, please try again later."
        headers["Retry-After"] = "1"
    elif answer is Answer.TWO_BUDGETS:
        code, reason = 500, "InternalError"
        message = f"Internal error occurred: {TWO_BUDGETS_MESSAGE}"
        causes = [{"message": TWO_BUDGETS_MESSAGE}]
    elif answer is Answer.FORBIDDEN:
        code, reason, causes = 403, "Forbidden", []
        message = (
            'admission webhook "evictions.policy.example.com" denied the request: '
            f"evictions of {ref} are frozen"
        )
    elif answer is Answer.CONFLICT:
        code, reason, causes = 409, "Conflict", []
        message = (
            f'Operation cannot be fulfilled on pods "{ref.name}": the object has been '
            "modified; please apply your changes to the latest version and try again"
        )
    elif answer is Answer.SERVER_ERROR:
        code, reason, causes = 503, "ServiceUnavailable", []
        message = "the server is currently unable to handle the request"
    else:
        raise ValueError(f"{answer} is no refusal")
    exc = ApiException(status=code, reason=reason)
    exc.body = _status(code, reason, message, causes)
    exc.headers = headers
    return exc


@dataclass(frozen=True)
class _Body:
    """An answer's body, as the client reads it unparsed (``_preload_content=False``)."""

    data: bytes

    def release_conn(self) -> None:
        pass


def _json(obj: object) -> _Body:
    return _Body(json.dumps(obj).encode())


@dataclass
class _Api:
    """Stands in for CoreV1Api and PolicyV1Api, for what an eviction asks: each eviction
    request takes the next answer of the script (the last one stays) and a granted one reaches
    the model's cluster; the pod and the budgets of its namespace, read to name what refused
    it, are the model's."""

    script: list[Answer]
    budgets: tuple[str, ...]
    granted: Callable[[], None]
    pod: PodView | None
    asked: int = 0

    def create_namespaced_pod_eviction(
        self, name: str, namespace: str, body: Any, **_: Any
    ) -> _Body:
        answer = self.script[min(self.asked, len(self.script) - 1)]
        self.asked += 1
        if answer is Answer.GRANTED:
            self.granted()
            return _json({"kind": "Status", "status": "Success", "code": 201})
        raise refusal(answer, PodRef(namespace, name), self.budgets)

    def read_namespaced_pod(self, name: str, namespace: str, **_: Any) -> _Body:
        if self.pod is None:
            raise ApiException(status=404, reason="NotFound")
        p = self.pod
        return _json(
            {
                "metadata": {
                    "name": p.ref.name,
                    "namespace": p.ref.namespace,
                    "uid": p.ref.uid,
                    "labels": dict(p.labels),
                },
                "spec": {"nodeName": p.node, "containers": []},
                "status": {"phase": p.phase},
            }
        )

    def list_namespaced_pod_disruption_budget(self, namespace: str, **_: Any) -> _Body:
        labels = dict(self.pod.labels) if self.pod else {}
        items = [
            {
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"selector": {"matchLabels": labels}},
                "status": {"disruptionsAllowed": 0},
            }
            for name in self.budgets
        ]
        return _json({"items": items})


@dataclass
class EvictionAnswers:
    """Per pod, the API server's answers to its eviction requests, one per request (the last
    one for every request after). A pod without a script is evicted at once."""

    scripts: dict[PodRef, list[Answer]] = field(default_factory=dict)
    budgets: dict[PodRef, tuple[str, ...]] = field(default_factory=dict)
    # requests answered so far, per pod: a script goes on across the client's retries
    asked: dict[PodRef, int] = field(default_factory=dict)

    def evict(
        self,
        ref: PodRef,
        pod: PodView | None,
        granted: Callable[[], None],
        sleep: Callable[[float], None],
    ) -> None:
        """One eviction of ``ref`` (``pod``: the pod now) as the agent's client makes it,
        retries and translation included; ``granted`` runs when the server grants it."""
        script = self.scripts.get(ref)
        if not script:
            granted()
            return
        api = _Api(script, self.budgets.get(ref, ()), granted, pod, self.asked.get(ref, 0))
        kube = KubernetesCluster(k8s.ApiClient(), sleep=sleep)
        kube._core = kube._policy = api  # all of the client an eviction uses
        try:
            kube.evict(ref)
        finally:
            self.asked[ref] = api.asked

    def calm(self) -> None:
        """The transient answers stop (the budgets stay: they are the cluster's, not a
        fault): every script that is not a budget's ends in a grant."""
        standing = (Answer.BUDGET, Answer.TWO_BUDGETS)
        for ref, script in list(self.scripts.items()):
            if script[-1] not in standing:
                del self.scripts[ref]
