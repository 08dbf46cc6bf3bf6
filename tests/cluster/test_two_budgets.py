"""An eviction of a pod that two PodDisruptionBudgets cover, against the local cluster's real API
server: it answers HTTP 500 ("This pod has more than one PodDisruptionBudget, which the eviction
subresource does not support") for as long as both budgets exist, so the client takes it for a
refusal at its first answer (EvictionUnsupported, a DrainRefused), naming the pod and both
budgets, and the drain stops there, naming the pods it had evicted in that round.

Requests are counted by the API proxy (migsim.cluster.api_faults) put between the client and the
API server with no fault.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from kubernetes import client
from migsim.cluster import Cluster, wait_until
from migsim.cluster.api_faults import ApiFaultProxy

from mig_agent.core.errors import DrainRefused, EvictionUnsupported
from mig_agent.kube.client import KubernetesCluster
from mig_agent.kube.cluster import PodRef
from mig_agent.node.drain import drain_gpu_pods
from mig_agent.node.waits import Clock

if TYPE_CHECKING:
    from tests.conftest import GpuNodeFactory, GpuPodFactory


@pytest.fixture(scope="module")
def counted(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ApiFaultProxy, Path]]:
    """The API proxy in front of the API server, and an admin kubeconfig that goes through it;
    one per module (ApiFaultProxy.stop() closes sockets its serving threads still read, whose
    file descriptors the next connections reuse)."""
    proxy = ApiFaultProxy(
        cluster.server,
        cert=cluster.dir / "pki" / "serving.crt",
        key=cluster.dir / "pki" / "serving.key",
        ca=cluster.ca_cert,
    )
    via = tmp_path_factory.mktemp("counted") / "via-proxy.kubeconfig"
    via.write_text(cluster.kubeconfig.read_text().replace(cluster.server, proxy.url))
    try:
        yield proxy, via
    finally:
        proxy.stop()


def _running(core: client.CoreV1Api, namespace: str, name: str) -> bool:
    # a Pending pod's eviction ignores budgets: the 500 comes only for a running one
    return bool(core.read_namespaced_pod(name, namespace).status.phase == "Running")


def _budget(policy: client.PolicyV1Api, namespace: str, name: str, match: dict[str, str]) -> None:
    spec = {"maxUnavailable": 1, "selector": {"matchLabels": match}}
    policy.create_namespaced_pod_disruption_budget(
        namespace, {"metadata": {"name": name}, "spec": spec}
    )


def _two_budgets_over_db(
    api_client: client.ApiClient, namespace: str, gpu_pod: GpuPodFactory, node: str | None
) -> PodRef:
    """Pod db-0 under budgets db-a (app=db) and db-b (tier=data); budget web over other pods."""
    core = client.CoreV1Api(api_client)
    pod = gpu_pod(namespace, "db-0", node=node, labels={"app": "db", "tier": "data"})
    policy = client.PolicyV1Api(api_client)
    _budget(policy, namespace, "db-a", {"app": "db"})
    _budget(policy, namespace, "db-b", {"tier": "data"})
    _budget(policy, namespace, "web", {"app": "web"})
    wait_until(lambda: _running(core, namespace, "db-0"), timeout=60, what="db-0 running")
    return PodRef(namespace, "db-0", pod.metadata.uid)


def test_a_pod_under_two_budgets_is_refused_at_once_naming_both(
    api_client: client.ApiClient,
    namespace: str,
    gpu_pod: GpuPodFactory,
    counted: tuple[ApiFaultProxy, Path],
) -> None:
    """Before: the 500 was retried as a server fault (5 evictions, backoffs between) and raised
    as KubeUnavailable, and the agent's pass failed and was retried for as long as both budgets
    existed."""
    ref = _two_budgets_over_db(api_client, namespace, gpu_pod, None)
    proxy, via = counted
    slept: list[float] = []
    k = KubernetesCluster.connect(str(via), sleep=slept.append)
    before = proxy.snapshot()
    try:
        with pytest.raises(EvictionUnsupported) as caught:
            k.evict(ref)
    finally:
        k.close()
    asked = proxy.snapshot() - before
    assert asked["create pods/eviction"] == 1, asked
    assert slept == []  # no backoff: the refusal is known at the first answer
    # the budgets are looked up for the message: the pod's labels, its namespace's budgets
    assert asked == {"create pods/eviction": 1, "get pods": 1, "list poddisruptionbudgets": 1}
    refusal = caught.value
    assert isinstance(refusal, DrainRefused)
    assert refusal.context["pdbs"] == (f"{namespace}/db-a", f"{namespace}/db-b")
    text = str(refusal)
    assert f"pod {namespace}/db-0" in text
    assert f"{namespace}/db-a" in text and f"{namespace}/db-b" in text
    assert "/web" not in text
    assert "more than one PodDisruptionBudget" in text  # the server's own words


def test_the_drain_stops_at_the_refusal_naming_what_it_had_evicted(
    api_client: client.ApiClient,
    namespace: str,
    gpu_node_factory: GpuNodeFactory,
    gpu_pod: GpuPodFactory,
    counted: tuple[ApiFaultProxy, Path],
) -> None:
    """Before: the refusal was a KubeUnavailable after the client's retries, and evict_all
    raised it without the pods evicted beside it, which were still terminating on the node."""
    node = gpu_node_factory()
    ref = _two_budgets_over_db(api_client, namespace, gpu_pod, node)
    other = gpu_pod(namespace, "train-0", node=node)
    core = client.CoreV1Api(api_client)
    wait_until(lambda: _running(core, namespace, "train-0"), timeout=60, what="train-0 running")
    proxy, via = counted
    k = KubernetesCluster.connect(str(via), sleep=lambda _s: None)
    before = proxy.snapshot()
    try:
        with pytest.raises(EvictionUnsupported) as caught:
            # the drain's own clock: a refusal raised at its first round never sleeps
            drain_gpu_pods(
                k, node, timeout_s=300, retry_s=5, poll_s=1, clock=Clock(sleep=_no_sleep)
            )
    finally:
        k.close()
    assert (proxy.snapshot() - before)["create pods/eviction"] == 2  # one round, once each
    assert caught.value.context["pod"] == str(ref)
    assert caught.value.context["refs"] == (PodRef(namespace, "train-0", other.metadata.uid),)


def _no_sleep(seconds: float) -> None:
    raise AssertionError(f"the drain slept {seconds} s before it raised")
