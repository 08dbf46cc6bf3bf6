"""We test what the agent asks of the API server, counted on the in-memory FakeCluster (what the
real API server serves is counted in benchmarks/vs_mig_manager.py and pool_rollout.py):

* a resync with nothing to do asks nothing, on a device-plugin node with DRA on and on a DRA
  node alike (the DRA lookup only when a change is planned or a state is to be written);
* a pass with a state to write (a restarted agent, a failed node) still looks;
* one list of the node's pods serves the device plugin's and the DRA plugin's lookups;
* who holds a device by claim is read from the claims the node's pods name, one list per
  namespace of theirs, never every claim of the cluster;
* the wait for a process no pod holds does not ask again at every look.
"""

from __future__ import annotations

from typing import Any

from mig_agent.agent import Agent, Outcome
from mig_agent.core.scheduling import parse_selector
from tests.unit.fake_cluster import FakeCluster

from . import test_agent_dra as dra
from .test_agent import NODE, STATE, label, make


def _resync(agent: Agent, cluster: FakeCluster) -> Outcome:
    """A resync as the loop runs it: the node from the open watch."""
    cluster.requests.clear()
    return agent.reconcile_once(node=cluster.nodes[NODE]).outcome


def test_a_resync_with_nothing_to_do_asks_nothing_on_a_device_plugin_node() -> None:
    agent, cluster, gpus = make()  # DRA on, as the setting's default
    label(cluster, "all-balanced")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    for _ in range(3):
        assert _resync(agent, cluster) is Outcome.NOOP
        assert not cluster.requests, cluster.requests


def test_a_resync_with_nothing_to_do_asks_nothing_on_a_dra_node() -> None:
    agent, cluster, gpus, plugin = dra.make_dra()
    dra.label(cluster, "all-balanced")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert _resync(agent, cluster) is Outcome.NOOP
    assert not cluster.requests, cluster.requests


def test_a_pass_with_a_state_to_write_still_looks_for_the_dra_plugin() -> None:
    """A fresh agent knows nothing yet, and a failed node must be told apart: a DRA node whose
    plugin runs DynamicMIG is refused even where the GPUs hold the layout."""
    agent, cluster, gpus, plugin = dra.make_dra(feature_gates=("DynamicMIG=true",))
    dra.label(cluster, "all-disabled")  # what the GPUs hold: nothing to change
    cluster.requests.clear()
    assert agent.reconcile_once().outcome is Outcome.FAILED
    assert cluster.requests["list_resource_slices"] == 1
    assert cluster.nodes[NODE].labels[STATE] == "failed"
    assert _resync(agent, cluster) is Outcome.FAILED  # "failed" to write again: looked
    assert cluster.requests["list_pods"] >= 1


def test_one_list_of_the_nodes_pods_serves_the_plugin_lookups() -> None:
    """The device plugin's and the DRA plugin's pods, and the pods the drain must not evict, out
    of one list of the node's pods: no list by namespace and selector before the cordon."""
    agent, cluster, gpus = make()
    lists: list[dict[str, Any]] = []
    original, hook = cluster.list_pods, cluster.on_change
    in_hook = [False]

    def list_pods(**kw: Any) -> Any:
        if not in_hook[0]:  # the agent's, not the test's device plugin's
            lists.append(kw)
        return original(**kw)

    def plays_the_plugin(c: FakeCluster) -> None:
        in_hook[0] = True
        try:
            if hook is not None:
                hook(c)
        finally:
            in_hook[0] = False

    cluster.list_pods = list_pods  # type: ignore[method-assign]
    cluster.on_change = plays_the_plugin
    cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1})
    label(cluster, "all-balanced")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    # before the cordon the pass's one list; then the drain's (a pod placed meanwhile), the
    # watches (the GPU pods, the paused device plugin), the look after the drain (a pod bound
    # after it: issue 42 path 6), the validators and the new device plugin once the node lists
    # its devices
    assert lists[:2] == [{"node": NODE}] * 2, lists
    assert len(lists) <= 7, lists


class ClaimsByNamespace(FakeCluster):
    """Remembers in which namespace each list of claims was asked ("": the whole cluster)."""

    def __init__(self) -> None:
        super().__init__()
        self.claim_lists: list[str] = []

    def list_resource_claims(self, namespace: str = "") -> list[dict[str, Any]]:
        self.claim_lists.append(namespace)
        return super().list_resource_claims(namespace)


def test_claim_holders_come_from_the_claims_the_nodes_pods_name() -> None:
    agent, _, gpus, plugin = dra.make_dra(cluster=(cluster := ClaimsByNamespace()))
    dra.label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.claim_lists == [], "no pod of the node holds a claim: none read"
    kept = cluster.add_pod("work", "on-gpu0", NODE, claims=("on-gpu0",))
    goes = cluster.add_pod("work", "on-gpu1", NODE, claims=("on-gpu1",))
    # a claim of another namespace, of a pod elsewhere: never read
    elsewhere = dra._claim("other", "far", dra._device_on(cluster, 1))
    cluster.claims = [
        dra._claim("work", "on-gpu0", dra._device_on(cluster, 0)),
        dra._claim("work", "on-gpu1", dra._device_on(cluster, 1)),
        elsewhere,
    ]
    dra._with_layout(agent, "gpu1-changes", {0: {"1g.10gb": 7}, 1: {"3g.40gb": 2}})
    dra.label(cluster, "gpu1-changes")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    assert cluster.evicted == [goes] and kept in cluster.pods
    assert cluster.claim_lists and set(cluster.claim_lists) == {"work"}, cluster.claim_lists


def test_the_wait_for_a_process_no_pod_holds_asks_once_not_at_every_look() -> None:
    """A process the plan would end, on a device no claim holds: looked at again every 0.1 s
    for gpu_release_timeout_s, but who holds what is asked once (its pids do not change)."""
    agent, _, gpus, plugin = dra.make_dra(cluster=(cluster := ClaimsByNamespace()))
    dra.label(cluster, "all-1g.10gb")
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    cluster.add_pod("work", "holder", NODE, claims=("holder",))
    cluster.claims = [dra._claim("work", "holder", dra._device_on(cluster, 0))]
    gi = gpus.observe().gpu(1).gpu_instances[0]
    gpus.add_process(1, 777, gi.id)  # a process outside Kubernetes
    cluster.requests.clear()
    dra.label(cluster, "all-7g.80gb")
    assert agent.reconcile_once().outcome is Outcome.FAILED
    assert "777, which no pod holds" in cluster.nodes[NODE].annotations[dra.REASON]
    assert cluster.claim_lists == ["work"], cluster.claim_lists
    assert cluster.requests["list_pods"] == 1, cluster.requests


def test_selectors_are_matched_as_the_api_server_matches_them() -> None:
    s = parse_selector("app=a, tier in (x, y),!gone,env!=prod,has")
    assert s.matches({"app": "a", "tier": "y", "has": ""})
    assert s.matches({"app": "a", "tier": "x", "env": "dev", "has": "1"})
    assert not s.matches({"app": "a", "tier": "z", "has": ""})
    assert not s.matches({"app": "a", "tier": "x", "gone": "1", "has": ""})
    assert not s.matches({"app": "a", "tier": "x", "env": "prod", "has": ""})
    assert not s.matches({"app": "a", "tier": "x"})
    assert parse_selector("").matches({"any": "thing"})
    assert parse_selector("app==b").matches({"app": "b"})
    for bad in ("app in x", "=b", "a b"):
        try:
            parse_selector(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} parsed")
