"""KubernetesCluster: the Cluster protocol over the API server.

The only module that imports kubernetes.

Transient failures (5xx, throttling, connection errors) are retried here, in one place, with
jittered capped backoff; callers see mig_agent.core.errors only. Each request says whether it may
be sent again (_REPEAT): a failure may have lost its answer, not its effect. An eviction's 429 is
not throttling: it means a PodDisruptionBudget forbids it now, so it is never retried here; nor is
its 500 for a pod more than one budget covers, which no retry ends.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import json
import math
import re
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, Final

import structlog
import tenacity
import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from mig_agent.core import device_taints
from mig_agent.core.errors import (
    ConfigError,
    EvictionBlocked,
    EvictionUnsupported,
    KubeError,
    KubeForbidden,
    KubeUnavailable,
    LabelsChanged,
    MigAgentError,
    PodReplaced,
)
from mig_agent.core.lease import LeaseSeen, may_hold
from mig_agent.core.scheduling import constraints_of, label_selector_of, taints_of
from mig_agent.kube.cluster import (
    AGENT_MANAGER,
    KUEUE_GROUP,
    KUEUE_VERSIONS,
    KueueCluster,
    Leases,
    NodeCondition,
    NodeView,
    ObjectRef,
    PdbView,
    PodRef,
    PodRunner,
    PodsSeen,
    PodView,
    is_gpu_resource,
)

log = structlog.get_logger(__name__)

_TRANSIENT: Final = frozenset({429, 500, 502, 503, 504})
RETRY_AFTER_MAX_S: Final = 60.0  # a Retry-After beyond this is not waited for in one go
# Every request but the node watch: a server that accepts a request and never answers (a hung
# API server, a dead connection) must cost one timeout and a retry, not the agent's loop.
REQUEST_TIMEOUT_S: Final = 30.0
# Connections kept open: as many as the drain's evictions in flight (drain.EVICTION_WORKERS);
# a smaller pool closes and reopens a TLS connection per eviction beyond it.
CONNECTIONS: Final = 16
_PDB_CAUSE = re.compile(r"disruption budget (\S+)")
# the eviction API's 500 for a pod more than one PodDisruptionBudget covers (kube-apiserver's
# pkg/registry/core/pod/storage/eviction.go): it lasts as long as the budgets do
_SEVERAL_BUDGETS = "more than one PodDisruptionBudget"


class Repeat(enum.Enum):
    """Whether a request may be sent again after a failure that may have come after the server
    acted on it (a reset or a timeout once it was sent, a 5xx): its answer lost, not its work."""

    SAFE = "safe"  # sent twice, the same as sent once
    NAMED = "named"  # a create of a named object: a repeat may meet it (409 AlreadyExists)
    ONCE = "once"  # sent twice, two objects: repeated only where it surely was not acted on


# Every request the client sends, by the client library's method (tests/unit/test_kube_retries
# holds each listed); one that is not is retried only where surely unsent, as ONCE.
_REPEAT: Final[Mapping[str, Repeat]] = {
    **dict.fromkeys(
        (
            "read_node",
            "list_node",
            "read_namespaced_pod",
            "read_namespaced_pod_log",
            "list_namespaced_pod",
            "list_pod_for_all_namespaces",
            "list_namespaced_event",
            "list_resource_slice",
            "list_namespaced_resource_claim",
            "list_resource_claim_for_all_namespaces",
            "list_namespaced_resource_claim_template",
            "list_resource_claim_template_for_all_namespaces",
            "list_namespaced_pod_disruption_budget",
            "list_pod_disruption_budget_for_all_namespaces",
            "list_cluster_custom_object",
            "read_namespaced_lease",
            "get_api_resources",
        ),
        Repeat.SAFE,
    ),
    # merge patches: sent again, the node ends the same; one carrying a resourceVersion meets
    # a 409 after its lost answer, and _patch_node_if reads the node: holding all the patch
    # writes, it has it
    "patch_node": Repeat.SAFE,
    "patch_node_status": Repeat.SAFE,
    # Kueue's objects: merge patches, the same sent again (the check's state with the
    # resourceVersion read: a repeat after a lost answer meets a 409, and the next round reads)
    "patch_namespaced_custom_object": Repeat.SAFE,
    "patch_namespaced_custom_object_status": Repeat.SAFE,
    "patch_cluster_custom_object_status": Repeat.SAFE,
    # a repeat meets the rule made (409, taken for made when it is the agent's for the same
    # device) or finds it gone (404, done)
    "create_cluster_custom_object": Repeat.SAFE,
    "delete_cluster_custom_object": Repeat.SAFE,
    # with the UID precondition: the repeat finds the pod going, or gone (404)
    "delete_namespaced_pod": Repeat.SAFE,
    # a repeat finds the pod terminating, which the API evicts again without a budget's say,
    # or gone (404)
    "create_namespaced_pod_eviction": Repeat.SAFE,
    # verify's pods: named, labelled with verify's run (create_pod)
    "create_namespaced_pod": Repeat.NAMED,
    # by generateName: a repeat after a lost answer would be a second Event
    "create_namespaced_event": Repeat.ONCE,
    # DeviceClasses (mig-agent dra-classes): a create or a replace (its resourceVersion) sent
    # again after a lost answer meets a 409, so neither is; the command's next run reads anew
    "list_device_class": Repeat.SAFE,
    "create_device_class": Repeat.ONCE,
    "replace_device_class": Repeat.ONCE,
    "delete_device_class": Repeat.SAFE,  # a repeat finds it gone (404)
}


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, ApiException):
        return exc.status in _TRANSIENT or exc.status == 0
    return isinstance(exc, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError)


def _surely_unsent(exc: BaseException) -> bool:
    """A failure that shows the server did not act: throttled (API Priority and Fairness
    answers 429 before a request is handled), or no connection made."""
    if isinstance(exc, ApiException):
        return bool(exc.status == 429)
    if isinstance(exc, urllib3.exceptions.MaxRetryError):
        exc = exc.reason or exc
    return isinstance(exc, urllib3.exceptions.ConnectTimeoutError | ConnectionRefusedError)


def _retry_after(exc: BaseException | None) -> float | None:
    """The seconds a 429 or 503 answer's Retry-After header asks for, if any."""
    if not isinstance(exc, ApiException) or exc.status not in (429, 503):
        return None
    value = (exc.headers or {}).get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


class _WaitHonouringRetryAfter(tenacity.wait.wait_base):
    """Jittered capped backoff, but never less than the server's Retry-After (capped)."""

    def __init__(self, backoff_s: float, backoff_max_s: float) -> None:
        self._backoff = tenacity.wait_random_exponential(multiplier=backoff_s, max=backoff_max_s)
        self._cap = max(backoff_max_s, RETRY_AFTER_MAX_S)

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        wait = float(self._backoff(retry_state))
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        asked = _retry_after(exc)
        return max(wait, min(asked, self._cap)) if asked is not None else wait


def _log_retry(state: tenacity.RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.warning(
        "kube.retrying",
        attempt=state.attempt_number,
        wait_s=round(state.next_action.sleep, 2) if state.next_action else None,
        error=_short(exc),
    )


def _short(exc: BaseException | None) -> str:
    if isinstance(exc, ApiException):
        return f"{exc.status} {exc.reason}"
    return type(exc).__name__ if exc else ""


@contextlib.contextmanager
def _kube(op: str, **context: object) -> Iterator[None]:
    """Translate the client's exceptions into ours, naming the operation."""
    try:
        yield
    except ApiException as exc:
        msg = _api_message(exc)
        cls = (
            KubeUnavailable
            if _is_transient(exc)
            else KubeForbidden
            if exc.status in (401, 403)
            else KubeError
        )
        raise cls(f"{op}: {exc.status} {msg}", op=op, status=exc.status, **context) from exc
    except (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError) as exc:
        raise KubeUnavailable(
            f"{op}: API server unreachable ({type(exc).__name__})", op=op, **context
        ) from exc


def _api_message(exc: ApiException) -> str:
    try:
        body = json.loads(exc.body or "{}")
        return str(body.get("message") or exc.reason)
    except (ValueError, AttributeError):
        return str(exc.reason)


class KubernetesCluster(KueueCluster, Leases, PodRunner):
    """The agent's client of the API server (kubeconfig or in-cluster credentials)."""

    def __init__(
        self,
        api: client.ApiClient,
        *,
        attempts: int = 5,
        backoff_s: float = 0.5,
        backoff_max_s: float = 10.0,
        component: str = AGENT_MANAGER,
        sleep: Callable[[float], None] = time.sleep,
        on_request: Callable[[str], None] | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self._api = api
        self._core = client.CoreV1Api(api)
        self._resource = client.ResourceV1Api(api)
        self._policy = client.PolicyV1Api(api)
        self._custom = client.CustomObjectsApi(api)
        self._coord = client.CoordinationV1Api(api)
        self._component = component
        self._conflict_attempts = 10
        self._watch_refused = False
        self._taints_served: bool | None = None  # a yes is kept; a no asked again
        # per (node, condition type), the condition this client last wrote: the next write of
        # that type needs no read first (only the agent writes its own condition type)
        self._written: dict[tuple[str, str], NodeCondition] = {}
        self._on_request = on_request or (lambda _op: None)
        self._timeout = (min(10.0, request_timeout_s), request_timeout_s)
        self._retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_is_transient),
            wait=_WaitHonouringRetryAfter(backoff_s, backoff_max_s),
            stop=tenacity.stop_after_attempt(attempts),
            before_sleep=_log_retry,
            reraise=True,
            sleep=sleep,
        )
        self._retrying_unsent = self._retrying.copy(
            retry=tenacity.retry_if_exception(lambda e: _is_transient(e) and _surely_unsent(e))
        )

    @classmethod
    def connect(
        cls, kubeconfig: str = "", *, context: str = "", **kwargs: Any
    ) -> KubernetesCluster:
        """In-cluster credentials when running in a pod and no kubeconfig is given;
        ``context`` picks a kubeconfig context (default: the current one)."""
        cfg = client.Configuration()
        try:
            if kubeconfig or context:
                config.load_kube_config(
                    config_file=kubeconfig or None,
                    context=context or None,
                    client_configuration=cfg,
                )
            else:
                try:
                    config.load_incluster_config(client_configuration=cfg)
                except config.ConfigException:
                    config.load_kube_config(client_configuration=cfg)
        except (config.ConfigException, OSError) as exc:
            raise ConfigError(f"kubeconfig: {exc}") from exc
        cfg.retries = 0  # retries happen in one place: here, with tenacity
        cfg.connection_pool_maxsize = CONNECTIONS
        return cls(client.ApiClient(cfg), **kwargs)

    def close(self) -> None:
        self._api.close()

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The answer as parsed JSON: the client's own models cost five times the request
        (a list of 48 pods: 75 ms into models, 14 ms as JSON), on every look of a wait.
        Retried as ``fn``'s entry in _REPEAT allows."""

        def counted(*a: Any, **kw: Any) -> Any:
            self._on_request(getattr(fn, "__name__", "request"))
            return _json(fn(*a, _request_timeout=self._timeout, _preload_content=False, **kw))

        return self._retrying_of(fn)(counted, *args, **kwargs)

    def _retrying_of(self, fn: Callable[..., Any]) -> tenacity.Retrying:
        repeat = _REPEAT.get(getattr(fn, "__name__", ""), Repeat.ONCE)
        return self._retrying_unsent if repeat is Repeat.ONCE else self._retrying

    def _create_named(
        self,
        fn: Callable[..., Any],
        namespace: str,
        body: Mapping[str, Any],
        read: Callable[[], Any],
    ) -> Any:
        """A create of a named object, retried as a read is: after a lost answer the repeat
        meets the object the first try made (409 AlreadyExists), taken for made when it carries
        every label of ``body`` (which must name the caller's run: a value no other run's
        object has). Not retrying creates at all would make a transient fault fail the caller
        while the object may exist; a 409 on the first try, or of an object without those
        labels, is someone else's, and raised."""
        sent = 0

        @functools.wraps(fn)
        def counting_tries(*a: Any, **kw: Any) -> Any:
            nonlocal sent
            sent += 1
            return fn(*a, **kw)

        try:
            return self._call(counting_tries, namespace, dict(body))
        except ApiException as exc:
            if exc.status != 409 or sent < 2:
                raise
            existing = read()
            want = (body.get("metadata") or {}).get("labels") or {}
            have = (existing.get("metadata") or {}).get("labels") or {}
            if not want or any(have.get(k) != v for k, v in want.items()):
                raise
            name = (existing.get("metadata") or {}).get("name", "")
            log.warning("kube.create_answer_lost", namespace=namespace, name=name, tries=sent)
            return existing

    # nodes --------------------------------------------------------------------------------

    def get_node(self, name: str) -> NodeView:
        with _kube("read node", node=name):
            return _node(self._call(self._core.read_node, name))

    def list_nodes(self, label_selector: str = "") -> list[NodeView]:
        with _kube("list nodes"):
            items = self._call(self._core.list_node, label_selector=label_selector)["items"]
        return [_node(n) for n in items]

    def patch_node(
        self,
        name: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
        unschedulable: bool | None = None,
        expect_labels: Mapping[str, str | None] | None = None,
        known: NodeView | None = None,
    ) -> NodeView:
        meta: dict[str, Any] = {}
        if labels:
            meta["labels"] = dict(labels)
        if annotations:
            meta["annotations"] = dict(annotations)
        body: dict[str, Any] = {"metadata": meta}
        if unschedulable is not None:
            body["spec"] = {"unschedulable": unschedulable or None}
        if expect_labels:
            return self._patch_node_if(name, body, expect_labels, known)
        return _node(
            self._unconditional(
                "patch node",
                name,
                self._core.patch_node,
                body,
                _content_type="application/merge-patch+json",
                field_manager=self._component,
            )
        )

    def _unconditional(
        self, op: str, name: str, fn: Callable[..., Any], body: Any, **kwargs: Any
    ) -> Any:
        """A patch with no precondition: a 409 Conflict (the object changed while the server
        applied it) is answered by sending the same patch again, which no change can spoil."""
        for attempt in range(1, self._conflict_attempts + 1):
            try:
                with _kube(op, node=name):
                    return self._call(fn, name, body, **kwargs)
            except KubeError as exc:
                if exc.context.get("status") != 409 or attempt == self._conflict_attempts:
                    raise
                log.warning("kube.conflict", op=op, node=name, attempt=attempt)
        raise AssertionError("unreachable")

    def _patch_node_if(
        self,
        name: str,
        body: dict[str, Any],
        expect: Mapping[str, str | None],
        known: NodeView | None = None,
    ) -> NodeView:
        """The patch carries the resourceVersion of the read its labels were checked against,
        so the server refuses it (409) if anything changed in between; then check again. The
        first try goes by ``known`` (the node as the caller last had it) where its labels
        agree: no read when nothing changed since. A 409 after a lost answer may be the
        patch's own write: a node that then holds all it writes has it."""
        maybe_written = False
        for _ in range(self._conflict_attempts):
            agrees = known is not None and all(known.labels.get(k) == v for k, v in expect.items())
            node = known if known is not None and agrees else self.get_node(name)
            known = None
            differ = {k: node.labels.get(k) for k, v in expect.items() if node.labels.get(k) != v}
            if differ and maybe_written and _holds(node, body):
                log.warning("kube.patch_answer_lost", node=name)
                return node
            if differ:
                now = ", ".join(f"{k}={v}" for k, v in differ.items())
                raise LabelsChanged(
                    f"node {name}: labels changed ({now}), patch not written",
                    node=name,
                    labels=differ,
                )
            body["metadata"]["resourceVersion"] = node.resource_version
            sent = 0

            @functools.wraps(self._core.patch_node)
            def patch(*a: Any, **kw: Any) -> Any:
                nonlocal sent
                sent += 1
                return self._core.patch_node(*a, **kw)

            try:
                with _kube("patch node", node=name):
                    return _node(
                        self._call(
                            patch,
                            name,
                            body,
                            _content_type="application/merge-patch+json",
                            field_manager=self._component,
                        )
                    )
            except KubeError as exc:
                if exc.context.get("status") != 409:
                    raise
                maybe_written = sent > 1
        raise KubeUnavailable(
            f"patch node: {name} changed under every one of {self._conflict_attempts} attempts",
            op="patch node",
            node=name,
        )

    def set_node_condition(self, name: str, condition: NodeCondition) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        previous = self._written.get((name, condition.type))
        if previous is None or previous == condition:
            # not written by this client yet, or the same again: whether it is there is read
            node = self.get_node(name)
            previous = next((c for c in node.conditions if c.type == condition.type), None)
            if previous == condition:
                self._written[(name, condition.type)] = condition
                return
        entry = {
            "type": condition.type,
            "status": condition.status,
            "reason": condition.reason,
            "message": condition.message[:1024],
            "lastHeartbeatTime": now,
        }
        if previous is None or previous.status != condition.status:
            entry["lastTransitionTime"] = now
        # strategic merge: conditions merge by type, other conditions stay untouched
        self._unconditional(
            "patch node status",
            name,
            self._core.patch_node_status,
            {"status": {"conditions": [entry]}},
        )
        self._written[(name, condition.type)] = condition

    def patch_node_resources(self, name: str, resources: Mapping[str, int]) -> None:
        values = {k: str(v) for k, v in resources.items()}
        body = {"status": {"capacity": values, "allocatable": values}}
        self._unconditional("patch node status", name, self._core.patch_node_status, body)

    def watch_node(self, name: str, *, timeout_s: int) -> Iterator[NodeView]:
        """The node as each change of it arrives, read from the watch's raw JSON (as the pod
        and slice watches are). A watch ended by the server's ERROR event raises KubeError: the
        caller drops the node it cached and opens the watch again."""
        self._on_request("watch_node")
        with _kube("watch node", node=name):
            events = watch_events(self._core.list_node, f"metadata.name={name}", "", timeout_s)
            try:
                for event in events:
                    if event["type"] == "ERROR":
                        status = event.get("object") or {}
                        raise KubeError(
                            f"watch of node {name} ended by the API server: "
                            f"{status.get('message') or status}",
                            node=name,
                        )
                    if event["type"] in ("ADDED", "MODIFIED"):
                        yield _node(event["object"])
            finally:
                events.close()

    # pods ---------------------------------------------------------------------------------

    def list_pods(
        self, *, node: str | None = None, namespace: str | None = None, label_selector: str = ""
    ) -> list[PodView]:
        field = f"spec.nodeName={node}" if node else ""
        with _kube("list pods", node=node or "", namespace=namespace or ""):
            if namespace:
                items = self._call(
                    self._core.list_namespaced_pod,
                    namespace,
                    field_selector=field,
                    label_selector=label_selector,
                )["items"]
            else:
                items = self._call(
                    self._core.list_pod_for_all_namespaces,
                    field_selector=field,
                    label_selector=label_selector,
                )["items"]
        return [_pod(p) for p in items]

    def watch_pods(
        self, node: str, *, timeout_s: float, seen: PodsSeen | None = None
    ) -> Iterator[list[PodView]]:
        field = f"spec.nodeName={node}"
        seen = seen if seen is not None else PodsSeen()
        if not seen.resource_version:
            with _kube("list pods", node=node):
                listed = self._call(self._core.list_pod_for_all_namespaces, field_selector=field)
            seen.pods = {(p.ref.namespace, p.ref.name): p for p in map(_pod, listed["items"])}
            seen.resource_version = (listed.get("metadata") or {}).get("resourceVersion") or ""
        pods = seen.pods
        yield list(pods.values())
        seconds = max(1, math.ceil(timeout_s))
        self._on_request("watch_pods")
        events = pod_events(self._core, field, seen.resource_version, seconds)
        try:
            for event in events:
                if event["type"] == "ERROR":  # 410 Gone, "too old resource version": list again
                    log.debug("watch_pods.expired", node=node, status=event["object"])
                    seen.resource_version = ""
                    return
                if event["type"] not in ("ADDED", "MODIFIED", "DELETED"):
                    continue  # a BOOKMARK, never asked for
                pod = _pod(event["object"])  # unparsed: the JSON object as sent
                key = (pod.ref.namespace, pod.ref.name)
                if event["type"] == "DELETED":
                    pods.pop(key, None)
                else:
                    pods[key] = pod
                version = (event["object"].get("metadata") or {}).get("resourceVersion")
                seen.resource_version = version or seen.resource_version
                yield list(pods.values())
        except (ApiException, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError) as exc:
            # the server was reached: a watch cut short only ends this slice, and the caller
            # looks again after a poll delay, with a list (what a watch that did not run missed
            # is not known). A refused one (RBAC without "watch" on pods: an older chart) is
            # said once, as each refusal costs a look and a watch
            seen.resource_version = ""
            if isinstance(exc, ApiException) and exc.status in (401, 403):
                if not self._watch_refused:
                    self._watch_refused = True
                    log.warning(
                        "watch_pods.refused",
                        node=node,
                        error=_short(exc),
                        hint="grant the agent's ClusterRole watch on pods",
                    )
            else:
                log.debug("watch_pods.ended", node=node, error=_short(exc))
        finally:
            events.close()

    def get_pod(self, ref: PodRef) -> PodView | None:
        try:
            with _kube("read pod", pod=str(ref)):
                pod = _pod(self._call(self._core.read_namespaced_pod, ref.name, ref.namespace))
        except KubeError as exc:
            if exc.context.get("status") == 404:
                return None
            raise
        return pod if not ref.uid or pod.ref.uid == ref.uid else None

    def evict(self, ref: PodRef) -> None:
        body = client.V1Eviction(
            metadata=client.V1ObjectMeta(name=ref.name, namespace=ref.namespace),
            delete_options=client.V1DeleteOptions(
                preconditions=client.V1Preconditions(uid=ref.uid) if ref.uid else None
            ),
        )
        try:
            self._call_but_not_past_a_budget(
                self._core.create_namespaced_pod_eviction, ref.name, ref.namespace, body
            )
        except ApiException as exc:
            if exc.status == 404:
                return  # already gone
            if exc.status == 409:  # the UID precondition: the name is another pod's now
                raise PodReplaced(
                    f"pod {ref} was replaced by another of its name before its eviction",
                    pod=str(ref),
                ) from exc
            if _is_budget_refusal(exc):
                raise EvictionBlocked(
                    _blocked_reason(ref, exc), pod=str(ref), pdb=_pdb_name(exc)
                ) from exc
            if _is_several_budgets(exc):
                raise self._several_budgets(ref, exc) from exc
            with _kube("evict pod", pod=str(ref)):  # throttled past every retry, or else
                raise
        except (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError):
            with _kube("evict pod", pod=str(ref)):
                raise

    def _call_but_not_past_a_budget(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Retried as any call (a throttling 429 after its Retry-After), but for a 429 from a
        PodDisruptionBudget (that one the drain retries at its own pace) and the 500 for a pod
        several budgets cover (no retry ends it)."""
        self._on_request(getattr(fn, "__name__", "request"))
        retrying = self._retrying_of(fn).copy(
            retry=tenacity.retry_if_exception(
                lambda e: (
                    _is_transient(e) and not _is_budget_refusal(e) and not _is_several_budgets(e)
                )
            )
        )
        return _json(retrying(fn, *args, _request_timeout=self._timeout, _preload_content=False))

    def _several_budgets(self, ref: PodRef, exc: ApiException) -> EvictionUnsupported:
        """The refusal of an eviction of a pod more than one budget covers, naming them (the
        API's answer does not): the budgets of its namespace whose selector matches its labels,
        as the eviction API finds them."""
        try:
            pdbs = self._budgets_over(ref)
            which = ", ".join(pdbs) if pdbs else "none found now"
        except MigAgentError as lookup:
            pdbs, which = (), f"they could not be listed: {lookup}"
        return EvictionUnsupported(
            f"eviction of pod {ref} refused: more than one PodDisruptionBudget covers it "
            f"({which}), and the eviction API evicts no such pod ({_api_message(exc)}); no "
            "retry ends it: delete all but one of those budgets, or narrow their selectors",
            pod=str(ref),
            pdbs=pdbs,
        )

    def _budgets_over(self, ref: PodRef) -> tuple[str, ...]:
        """The PodDisruptionBudgets (namespace/name) whose selector matches the pod's labels."""
        pod = self.get_pod(ref)
        if pod is None:
            return ()
        with _kube("list poddisruptionbudgets", namespace=ref.namespace):
            got = self._call(self._policy.list_namespaced_pod_disruption_budget, ref.namespace)
        budgets = [_pdb(p) for p in got["items"]]
        return tuple(
            sorted(
                f"{b.namespace}/{b.name}"
                for b in budgets
                if b.selector is not None and b.selector.matches(pod.labels)
            )
        )

    def delete_pod(self, ref: PodRef) -> None:
        opts = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid=ref.uid) if ref.uid else None
        )
        try:
            with _kube("delete pod", pod=str(ref)):
                self._call(self._core.delete_namespaced_pod, ref.name, ref.namespace, body=opts)
        except KubeError as exc:
            if exc.context.get("status") not in (404, 409):
                raise

    # events -------------------------------------------------------------------------------

    def emit_event(
        self, node: NodeView, *, reason: str, message: str, warning: bool = False
    ) -> None:
        event = self._event(
            client.V1ObjectReference(kind="Node", name=node.name, uid=node.uid, api_version="v1"),
            client.V1ObjectMeta(generate_name=f"{node.name}.{self._component}."),
            reason=reason,
            message=message,
            warning=warning,
            host=node.name,
            instance=f"{self._component}-{node.name}"[:128],
        )
        with _kube("create event", node=node.name):
            self._call(self._core.create_namespaced_event, "default", event)

    def _event(
        self,
        involved: client.V1ObjectReference,
        metadata: client.V1ObjectMeta,
        *,
        reason: str,
        message: str,
        warning: bool,
        host: str | None,
        instance: str,
    ) -> client.CoreV1Event:
        """An Event from this client's component, once, now (its message cut at 1024)."""
        now = datetime.now(UTC)
        return client.CoreV1Event(
            metadata=metadata,
            involved_object=involved,
            reason=reason,
            message=message[:1024],
            type="Warning" if warning else "Normal",
            source=client.V1EventSource(component=self._component, host=host),
            first_timestamp=now,
            last_timestamp=now,
            count=1,
            reporting_component=self._component,
            reporting_instance=instance,
        )

    # verify's pods --------------------------------------------------------------------------

    def create_pod(self, namespace: str, manifest: Mapping[str, Any]) -> PodRef:
        """Make the pod; the manifest's labels must name the caller's run (see _create_named:
        a pod whose create's answer was lost is then found, not refused as another's)."""
        name = str((manifest.get("metadata") or {}).get("name", ""))
        with _kube("create pod", pod=f"{namespace}/{name}"):
            pod = self._create_named(
                self._core.create_namespaced_pod,
                namespace,
                manifest,
                lambda: self._call(self._core.read_namespaced_pod, name, namespace),
            )
        meta = pod.get("metadata") or {}
        return PodRef(namespace, meta.get("name", name), meta.get("uid", ""))

    def read_pod(self, ref: PodRef) -> dict[str, Any] | None:
        try:
            with _kube("read pod", pod=str(ref)):
                pod: dict[str, Any] = self._call(
                    self._core.read_namespaced_pod, ref.name, ref.namespace
                )
        except KubeError as exc:
            if exc.context.get("status") == 404:
                return None
            raise
        return pod

    def pod_log(self, ref: PodRef) -> str:
        with _kube("read pod log", pod=str(ref)):
            resp = self._retrying_of(self._core.read_namespaced_pod_log)(
                self._core.read_namespaced_pod_log,
                ref.name,
                ref.namespace,
                _request_timeout=self._timeout,
                _preload_content=False,
            )
        try:
            return str(resp.data.decode(errors="replace"))
        finally:
            resp.release_conn()

    def pod_events(self, ref: PodRef) -> list[dict[str, Any]]:
        field = f"involvedObject.name={ref.name}"
        if ref.uid:
            field += f",involvedObject.uid={ref.uid}"
        with _kube("list events", pod=str(ref)):
            got = self._call(self._core.list_namespaced_event, ref.namespace, field_selector=field)
        return list(got["items"])

    # DRA ----------------------------------------------------------------------------------

    def list_resource_slices(self, node: str = "") -> list[dict[str, Any]]:
        selector = f"spec.nodeName={node}" if node else ""
        with _kube("list resourceslices", node=node):
            items = self._call(self._resource.list_resource_slice, field_selector=selector)["items"]
        return list(items)

    def watch_resource_slices(
        self, node: str, *, timeout_s: float
    ) -> Iterator[list[dict[str, Any]]]:
        field = f"spec.nodeName={node}"
        with _kube("list resourceslices", node=node):
            listed = self._call(self._resource.list_resource_slice, field_selector=field)
        slices = {(s.get("metadata") or {}).get("name", ""): s for s in listed["items"]}
        yield list(slices.values())
        self._on_request("watch_resource_slices")
        since = (listed.get("metadata") or {}).get("resourceVersion") or ""
        events = watch_events(
            self._resource.list_resource_slice, field, since, max(1, math.ceil(timeout_s))
        )
        try:
            for event in events:
                if event["type"] == "ERROR":  # 410 Gone: the caller's next watch lists again
                    return
                if event["type"] not in ("ADDED", "MODIFIED", "DELETED"):
                    continue
                name = (event["object"].get("metadata") or {}).get("name", "")
                if event["type"] == "DELETED":
                    slices.pop(name, None)
                else:
                    slices[name] = event["object"]
                yield list(slices.values())
        except (ApiException, urllib3.exceptions.HTTPError, ConnectionError, TimeoutError) as exc:
            # the list reached the server: a watch refused (a chart without "watch" on
            # resourceslices) or cut short ends this slice; the caller looks again
            log.debug("watch_resource_slices.ended", node=node, error=_short(exc))
        finally:
            events.close()

    def list_resource_claims(self, namespace: str = "") -> list[dict[str, Any]]:
        with _kube("list resourceclaims", namespace=namespace):
            if namespace:
                got = self._call(self._resource.list_namespaced_resource_claim, namespace)
            else:
                got = self._call(self._resource.list_resource_claim_for_all_namespaces)
        return list(got["items"])

    def list_resource_claim_templates(self, namespace: str = "") -> list[dict[str, Any]]:
        with _kube("list resourceclaimtemplates", namespace=namespace):
            if namespace:
                got = self._call(self._resource.list_namespaced_resource_claim_template, namespace)
            else:
                got = self._call(self._resource.list_resource_claim_template_for_all_namespaces)
        return list(got["items"])

    def list_device_classes(self) -> list[dict[str, Any]]:
        with _kube("list deviceclasses"):
            return list(self._call(self._resource.list_device_class)["items"])

    def create_device_class(self, manifest: Mapping[str, Any]) -> None:
        name = (manifest.get("metadata") or {}).get("name", "")
        with _kube("create deviceclass", name=name):
            self._call(self._resource.create_device_class, dict(manifest))

    def replace_device_class(self, manifest: Mapping[str, Any]) -> None:
        name = str((manifest.get("metadata") or {}).get("name", ""))
        with _kube("replace deviceclass", name=name):
            self._call(self._resource.replace_device_class, name, dict(manifest))

    def delete_device_class(self, name: str) -> None:
        try:
            with _kube("delete deviceclass", name=name):
                self._call(self._resource.delete_device_class, name)
        except KubeError as exc:
            if exc.context.get("status") != 404:
                raise

    def list_pod_disruption_budgets(self) -> list[PdbView]:
        with _kube("list poddisruptionbudgets"):
            items = self._call(self._policy.list_pod_disruption_budget_for_all_namespaces)["items"]
        return [_pdb(p) for p in items]

    # device taints (resource.k8s.io/v1 DeviceTaintRule) ------------------------------------

    def device_taints_served(self) -> bool:
        """Whether the API server serves DeviceTaintRules. Only a yes is kept: a no (a 404 in
        the seconds after an API server restarts, an aggregated API not ready) is asked again
        at the next change, not kept for the agent's life."""
        if not self._taints_served:
            with _kube("discover resource.k8s.io/v1"):
                found = self._call_unless_absent(self._resource.get_api_resources)
            names = {r.get("name") for r in (found or {}).get("resources") or []}
            self._taints_served = device_taints.PLURAL in names
        return bool(self._taints_served)

    def list_device_taints(self) -> list[dict[str, Any]]:
        group, version = device_taints.GROUP_VERSION
        selector = f"{device_taints.MANAGED_BY}={device_taints.MANAGER}"
        with _kube("list devicetaintrules"):
            got = self._call(
                self._custom.list_cluster_custom_object,
                group,
                version,
                device_taints.PLURAL,
                label_selector=selector,
            )
        return list(got["items"])

    def create_device_taint(self, rule: Mapping[str, Any]) -> None:
        group, version = device_taints.GROUP_VERSION
        name = (rule.get("metadata") or {}).get("name", "")
        with _kube("create devicetaintrule", name=name):
            try:
                self._call(
                    self._custom.create_cluster_custom_object,
                    group,
                    version,
                    device_taints.PLURAL,
                    dict(rule),
                )
            except ApiException as exc:
                if exc.status != 409:
                    raise
                met = self._same_rule(rule)
                if met is not None:
                    raise KubeError(
                        f"DeviceTaintRule {name} exists and is not this agent's rule for "
                        f"{(rule.get('spec') or {}).get('deviceSelector')}: it selects {met}; "
                        "delete or rename it (the agent names its rules "
                        "mig-agent.<device>.<node>)",
                        status=409,
                        name=name,
                    ) from None

    def _same_rule(self, rule: Mapping[str, Any]) -> str | None:
        """None where the rule of ``rule``'s name is the agent's, for the same device; else
        what the rule of that name selects ("not the agent's" where it is not labelled so)."""
        want = (rule.get("spec") or {}).get("deviceSelector")
        name = (rule.get("metadata") or {}).get("name")
        for r in self.list_device_taints():
            if (r.get("metadata") or {}).get("name") == name:
                got = (r.get("spec") or {}).get("deviceSelector")
                return None if got == want else str(got)
        return "a rule not labelled as the agent's"

    def delete_device_taint(self, name: str) -> None:
        group, version = device_taints.GROUP_VERSION
        with _kube("delete devicetaintrule", name=name):
            self._call_unless_absent(
                self._custom.delete_cluster_custom_object,
                group,
                version,
                device_taints.PLURAL,
                name,
            )

    def list_kueue(self, plural: str) -> list[dict[str, Any]]:
        for version in KUEUE_VERSIONS:
            try:
                with _kube(f"list {plural}.{KUEUE_GROUP}", version=version):
                    got = self._call(
                        self._custom.list_cluster_custom_object, KUEUE_GROUP, version, plural
                    )
            except KubeError as exc:
                if exc.context.get("status") == 404:  # not served: an older Kueue, or none
                    continue
                raise
            return list(got["items"])
        return []

    def patch_kueue(
        self,
        plural: str,
        name: str,
        body: Mapping[str, Any],
        *,
        namespace: str = "",
        status: bool = False,
    ) -> dict[str, Any]:
        """Merge-patch Kueue's object (v1beta2; ``status``: its status subresource); a body
        carrying ``metadata.resourceVersion`` is refused (KubeError, status 409) when the
        object changed since."""
        version = KUEUE_VERSIONS[0]
        c = self._custom
        if namespace:
            fn = (
                c.patch_namespaced_custom_object_status
                if status
                else c.patch_namespaced_custom_object
            )
            args: tuple[Any, ...] = (KUEUE_GROUP, version, namespace, plural, name, dict(body))
        else:
            fn = c.patch_cluster_custom_object_status if status else c.patch_cluster_custom_object
            args = (KUEUE_GROUP, version, plural, name, dict(body))
        where = f"{namespace}/{name}" if namespace else name
        with _kube(f"patch {plural}.{KUEUE_GROUP}", name=where, subresource=status):
            return dict(self._call(fn, *args))

    def emit_object_event(
        self, obj: ObjectRef, *, reason: str, message: str, warning: bool = False
    ) -> None:
        """An Event about ``obj`` (in its namespace; about a cluster-scoped object, such as an
        AdmissionCheck, in ``default``, as Kubernetes puts a Node's), from this client's
        component."""
        where = obj.namespace or "default"
        event = self._event(
            client.V1ObjectReference(
                kind=obj.kind,
                name=obj.name,
                namespace=obj.namespace or None,
                uid=obj.uid,
                api_version=obj.api_version,
            ),
            client.V1ObjectMeta(generate_name=f"{obj.name}.", namespace=where),
            reason=reason,
            message=message,
            warning=warning,
            host=None,
            instance=self._component,
        )
        with _kube("create event", object=f"{obj.kind} {obj.namespace}/{obj.name}"):
            self._call(self._core.create_namespaced_event, where, event)

    # leader election ---------------------------------------------------------------------

    def hold_lease(self, namespace: str, name: str, holder: str, duration_s: int) -> bool:
        """Take or renew the Lease for ``holder`` (mig_agent.core.lease decides); False while
        another holds it, or when another wrote it between the read and the write."""
        now = datetime.now(UTC)
        where = f"{namespace}/{name}"
        try:
            with _kube("read lease", lease=where):
                got = self._call_unless_absent(self._coord.read_namespaced_lease, name, namespace)
            seen = None if got is None else _lease_seen(got.get("spec") or {})
            if not may_hold(seen, holder, now.timestamp()):
                return False
            stamp = now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            spec: dict[str, Any] = {
                **((got or {}).get("spec") or {}),
                "holderIdentity": holder,
                "leaseDurationSeconds": duration_s,
                "renewTime": stamp,
            }
            if seen is None or seen.holder != holder:
                spec["acquireTime"] = stamp
                spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
            if got is None:
                body = {"metadata": {"name": name, "namespace": namespace}, "spec": spec}
                with _kube("create lease", lease=where):
                    self._call(self._coord.create_namespaced_lease, namespace, body)
            else:
                body = {"metadata": got["metadata"], "spec": spec}
                with _kube("renew lease", lease=where):
                    self._call(self._coord.replace_namespaced_lease, name, namespace, body)
        except KubeError as exc:
            if exc.context.get("status") == 409:  # another replica wrote it first
                return False
            raise
        return True

    def _call_unless_absent(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return self._call(fn, *args)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise


def _lease_seen(spec: Mapping[str, Any]) -> LeaseSeen:
    renewed = spec.get("renewTime")
    return LeaseSeen(
        str(spec.get("holderIdentity") or ""),
        datetime.fromisoformat(str(renewed).replace("Z", "+00:00")).timestamp()
        if renewed
        else None,
        int(spec.get("leaseDurationSeconds") or 0),
    )


def _is_budget_refusal(exc: BaseException) -> bool:
    """A 429 that a PodDisruptionBudget caused (its Status names a DisruptionBudget cause),
    not API Priority and Fairness throttling (a plain 429 with Retry-After)."""
    if not isinstance(exc, ApiException) or exc.status != 429:
        return False
    try:
        body = json.loads(exc.body or "{}")
    except ValueError:
        return False
    if not isinstance(body, dict):
        return False
    causes = (body.get("details") or {}).get("causes") or []
    said = [str(body.get("message", ""))]
    said += [f"{c.get('reason')} {c.get('message')}" for c in causes if isinstance(c, dict)]
    return any("DisruptionBudget" in text or "disruption budget" in text for text in said)


def _holds(node: NodeView, body: Mapping[str, Any]) -> bool:
    """Whether ``node`` holds every label, annotation and cordon a merge patch ``body`` writes
    (None: removed)."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    return (
        all(node.labels.get(k) == v for k, v in (meta.get("labels") or {}).items())
        and all(node.annotations.get(k) == v for k, v in (meta.get("annotations") or {}).items())
        and ("unschedulable" not in spec or node.unschedulable == bool(spec["unschedulable"]))
    )


def _is_several_budgets(exc: BaseException) -> bool:
    """The eviction API's 500 for a pod that more than one PodDisruptionBudget covers."""
    return (
        isinstance(exc, ApiException)
        and exc.status == 500
        and _SEVERAL_BUDGETS in _api_message(exc)
    )


def _blocked_reason(ref: PodRef, exc: ApiException) -> str:
    pdb = _pdb_name(exc)
    what = f"PodDisruptionBudget {ref.namespace}/{pdb}" if pdb else "a PodDisruptionBudget"
    return f"eviction of pod {ref} refused: {what} does not allow it ({_api_message(exc)})"


def _pdb_name(exc: ApiException) -> str:
    try:
        body = json.loads(exc.body or "{}")
    except ValueError:
        return ""
    for cause in (body.get("details") or {}).get("causes") or []:
        m = _PDB_CAUSE.search(str(cause.get("message", "")))
        if m:
            return m.group(1)
    return ""


def _json(resp: Any) -> Any:
    """The body of an answer asked for unparsed (``_preload_content=False``)."""
    try:
        data = resp.data
    finally:
        resp.release_conn()
    return json.loads(data) if data else None


def pod_events(core: Any, field: str, since: str, seconds: int) -> Generator[dict[str, Any]]:
    """The events of a watch of pods (``field`` their field selector) from resource version
    ``since``, each parsed from its JSON line, an ``ERROR`` one included (its object the
    server's Status). Read here, not through the client's Watch.stream: unparsed, that one
    reads a key plain JSON events lack and fails on the ``ERROR`` event an expired resource
    version brings."""
    return watch_events(core.list_pod_for_all_namespaces, field, since, seconds)


def watch_events(
    list_fn: Callable[..., Any], field: str, since: str, seconds: int
) -> Generator[dict[str, Any]]:
    """The events of a watch through ``list_fn`` (a list call of the client), as pod_events."""
    resp = list_fn(
        field_selector=field,
        resource_version=since,
        watch=True,
        timeout_seconds=seconds,
        # the server ends the watch at `seconds`; silence beyond that is a dead connection
        _request_timeout=(10, seconds + 10),
        _preload_content=False,  # the raw JSON: the client's models cost five times the read
    )
    try:
        for line in watch.watch.iter_resp_lines(resp):
            if line.strip():
                yield json.loads(line)
    finally:
        resp.close()
        resp.release_conn()


def _node(n: Mapping[str, Any]) -> NodeView:
    meta, spec, status = n.get("metadata") or {}, n.get("spec") or {}, n.get("status") or {}
    return NodeView(
        name=meta.get("name", ""),
        uid=meta.get("uid") or "",
        resource_version=meta.get("resourceVersion") or "",
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        unschedulable=bool(spec.get("unschedulable")),
        allocatable=dict(status.get("allocatable") or {}),
        capacity=dict(status.get("capacity") or {}),
        conditions=tuple(
            NodeCondition(
                c.get("type", ""),
                c.get("status", ""),
                c.get("reason") or "",
                c.get("message") or "",
            )
            for c in status.get("conditions") or []
        ),
        unschedulable_by=tuple(
            str(m.get("manager", ""))
            for m in meta.get("managedFields") or []
            if "f:unschedulable" in ((m.get("fieldsV1") or {}).get("f:spec") or {})
        ),
        taints=taints_of(spec),
        annotations_written={
            key.removeprefix("f:"): str(m.get("time") or "")
            for m in meta.get("managedFields") or []
            for key in (((m.get("fieldsV1") or {}).get("f:metadata") or {}).get("f:annotations"))
            or {}
            if key.startswith("f:") and m.get("time")
        },
    )


def _pod(p: Mapping[str, Any]) -> PodView:
    meta, spec, status = p.get("metadata") or {}, p.get("spec") or {}, p.get("status") or {}
    requests: dict[str, int] = {}
    for c in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        res = c.get("resources") or {}
        for source in (res.get("limits") or {}, res.get("requests") or {}):
            for k, v in source.items():
                if is_gpu_resource(k):
                    requests[k] = max(requests.get(k, 0), int(str(v)))
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    owners = meta.get("ownerReferences") or []
    controller = next(
        (f"{o.get('kind', '')}/{o.get('name', '')}" for o in owners if o.get("controller")), ""
    )
    grace = meta.get("deletionGracePeriodSeconds")
    if grace is None:
        grace = spec.get("terminationGracePeriodSeconds")
    return PodView(
        ref=PodRef(meta.get("namespace", ""), meta.get("name", ""), meta.get("uid") or ""),
        node=spec.get("nodeName") or "",
        phase=status.get("phase") or "",
        ready=ready,
        terminating=meta.get("deletionTimestamp") is not None,
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        owner_kinds=tuple(o.get("kind", "") for o in owners),
        node_selector=dict(spec.get("nodeSelector") or {}),
        gpu_requests=requests,
        runtime_class=spec.get("runtimeClassName") or "",
        controller=controller,
        grace_period_s=30.0 if grace is None else float(grace),
        feature_gates=_feature_gates(spec),
        empty_dirs=tuple(
            str(v.get("name", "")) for v in spec.get("volumes") or [] if "emptyDir" in v
        ),
        constraints=constraints_of(spec),
        claims=_claim_names(spec, status),
        started=str(status.get("startTime") or ""),
    )


def _claim_names(spec: Mapping[str, Any], status: Mapping[str, Any]) -> tuple[str, ...]:
    """The pod's ResourceClaims by name: named ones, those made from its templates (the
    pod's status names them once made), and the one the scheduler made for its extended
    resources that a DeviceClass serves (Kubernetes 1.37, KEP-5004)."""
    made = {
        c.get("name", ""): c.get("resourceClaimName")
        for c in status.get("resourceClaimStatuses") or []
    }
    out = []
    for c in spec.get("resourceClaims") or []:
        name = c.get("resourceClaimName") or made.get(c.get("name", ""))
        if name:
            out.append(str(name))
    extended = (status.get("extendedResourceClaimStatus") or {}).get("resourceClaimName")
    if extended:
        out.append(str(extended))
    return tuple(out)


def _pdb(p: Mapping[str, Any]) -> PdbView:
    meta, spec, status = p.get("metadata") or {}, p.get("spec") or {}, p.get("status") or {}
    return PdbView(
        meta.get("namespace", ""),
        meta.get("name", ""),
        label_selector_of(spec.get("selector")),
        int(status.get("disruptionsAllowed") or 0),
    )


def _feature_gates(spec: Mapping[str, Any]) -> tuple[str, ...]:
    out = []
    for c in spec.get("containers") or []:
        out += [
            str(e.get("value") or "")
            for e in c.get("env") or []
            if e.get("name") == "FEATURE_GATES"
        ]
        args = [str(a) for a in [*(c.get("command") or []), *(c.get("args") or [])]]
        for i, a in enumerate(args):
            if a.startswith("--feature-gates="):
                out.append(a.split("=", 1)[1])
            elif a == "--feature-gates" and i + 1 < len(args):
                out.append(args[i + 1])
    return tuple(out)
