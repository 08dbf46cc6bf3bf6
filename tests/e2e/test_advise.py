"""We test these aspects of ``mig-agent advise`` end to end, on the local cluster with a real
agent and simulated device plugin per node, running the command as a subprocess with the admin
kubeconfig:

* on a pool of two nodes at all-1g.10gb, nothing is proposed while no pod is pending;
* pods Pending for mig-3g.40gb, which no node offers, get a proposal on the node whose change
  evicts nobody, and a pod pinned by nodeSelector to the node where a running pod holds every
  1g.10gb device (published by the agent as its own) gets an unserved reason naming the
  selector (its only layouts would evict);
* ``--apply`` relabels through the rollout; the served pod then runs on the proposed node, and
  the running pod was never evicted (same UID, still Running).
* a relabel someone makes after ``apply`` looked at a node again, as its patch is on its way, is
  not overwritten (the real client's conditional patch against the real API server): that node is
  skipped with the reason, the other one relabelled and its pod run there.

* on a DRA node (NVIDIA's DRA kubelet plugin, no device plugin; root only), a pod whose
  ResourceClaim asks DeviceClass mig.nvidia.com for ``profile == '3g.40gb'`` gets a proposal
  offering that profile, and ``--apply`` runs it there.
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client
from migsim.cluster import Cluster

from mig_agent.config.profiles import load_catalog
from mig_agent.config.settings import PROFILES, Settings
from mig_agent.core.snapshot import holders_of
from mig_agent.kube.client import KubernetesCluster
from mig_agent.kube.cluster import NodeView
from mig_agent.ops import advise as ops_advise
from mig_agent.ops.values import Result
from tests.node_watch import node_versions

from .conftest import CONFIG, AgentNode, NodeFactory, wait_running
from .test_dra import claim, claiming_pod
from .test_ops import explain, make_pool, mig_agent_cli

MIG_1G, MIG_3G = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"


def advise(cluster: Cluster, selector: str, *extra: str) -> Any:
    return mig_agent_cli(
        "advise", "-l", selector, "--kubeconfig", str(cluster.kubeconfig), *extra, timeout=240
    )


def wait_holder(node: AgentNode, uid: str, timeout: float = 30.0) -> frozenset[str]:
    """The devices the node's agent published pod ``uid`` as holding (the gpu-state
    annotation's holders, as advise reads them), once it has (a watch on the node)."""
    published: dict[str, frozenset[str]] = {}
    for n in node_versions(node.core, node.name, timeout):
        raw = (n.metadata.annotations or {}).get(Settings().gpu_state_annotation)
        published = holders_of(json.loads(raw)) if raw else {}
        if uid in published:
            return published[uid]
    raise AssertionError(
        f"{node.name}: pod {uid} not among the holders published after {timeout} s "
        f"({sorted(published)}); agent log:\n{node.log_tail()}"
    )


def test_pending_profile_gets_a_proposal_that_applied_runs_it_evicting_nobody(
    agent_node: NodeFactory,
    core: client.CoreV1Api,
    installed: Cluster,
    namespace: str,
    gpu_pod: Any,
) -> None:
    selector, nodes = make_pool(agent_node, core, 2)
    for n in nodes:
        n.label("all-1g.10gb")
    for n in nodes:
        n.wait_state("success", timeout=90)
    busy_node, free_node = nodes
    # the busy pod holds every device of its node, so any relabel of it evicts the pod, whichever
    # devices the plugin gave it and whether advise reads them from the agent or judges by kind
    every = busy_node.gpu_resources()[MIG_1G]
    busy = gpu_pod(namespace, "busy", resources={MIG_1G: every}, node=busy_node.name)
    wait_running(core, namespace, "busy")
    # advise reads the pod's devices as the agent published them (never judged by kind alone)
    assert len(wait_holder(busy_node, busy.metadata.uid)) == every

    res = advise(installed, selector, "-o", "json")
    assert res.returncode == 0, explain(res, nodes)
    assert json.loads(res.stdout)["proposals"] == []

    gpu_pod(namespace, "wants-3g", resources={MIG_3G: 1})
    gpu_pod(namespace, "pinned", resources={MIG_3G: 1}, node=busy_node.name)
    res = advise(installed, selector, "-o", "json")
    assert res.returncode == 0, explain(res, nodes)
    data = json.loads(res.stdout)
    [proposal] = data["proposals"]
    assert proposal["node"] == free_node.name and proposal["from"] == "all-1g.10gb"
    assert proposal["serves"] == [f"{namespace}/wants-3g"] and proposal["evicts"] == []
    reasons = {u["pod"]: u["reason"] for u in data["unserved"]}
    pinned = reasons[f"{namespace}/pinned"]
    assert f"nodeSelector kubernetes.io/hostname={busy_node.name}" in pinned, data
    assert "--allow-evict" in pinned

    res = advise(installed, selector, "--apply", "-p", "1")
    assert res.returncode == 0, explain(res, nodes)
    assert f"{free_node.name}  all-1g.10gb -> {proposal['to']}" in res.stdout, res.stdout
    assert f"{namespace}/wants-3g: scheduled on {free_node.name}" in res.stdout, res.stdout
    assert free_node.labels().get("nvidia.com/mig.config") == proposal["to"]
    assert wait_running(core, namespace, "wants-3g").spec.node_name == free_node.name
    still = core.read_namespaced_pod("busy", namespace)
    assert still.metadata.uid == busy.metadata.uid and still.status.phase == "Running"
    assert busy_node.labels().get("nvidia.com/mig.config") == "all-1g.10gb"


def test_a_dra_claim_for_a_profile_gets_a_proposal_that_applied_runs_it(
    agent_node: NodeFactory, core: client.CoreV1Api, installed: Cluster, namespace: str
) -> None:
    node = agent_node("2xH100-80GB", device_plugin="dra")  # MIG off: two whole GPUs
    claim(node, namespace, "wants-3g", "device.attributes['gpu.nvidia.com'].profile == '3g.40gb'")
    claiming_pod(core, namespace, "wants-3g", "wants-3g")
    selector = f"kubernetes.io/hostname={node.name}"

    res = advise(installed, selector, "-o", "json")
    assert res.returncode == 0, explain(res, [node])
    data = json.loads(res.stdout)
    [proposal] = data["proposals"]
    assert proposal["node"] == node.name and proposal["serves"] == [f"{namespace}/wants-3g"]
    assert proposal["resources_before"] == {"dra:gpu": 2}
    assert proposal["resources_after"].get("dra:3g.40gb", 0) >= 1, data
    assert proposal["evicts"] == []

    res = advise(installed, selector, "--apply")
    assert res.returncode == 0, explain(res, [node])
    assert f"{namespace}/wants-3g: scheduled on {node.name}" in res.stdout, res.stdout
    assert node.labels().get("nvidia.com/mig.config") == proposal["to"]
    assert wait_running(core, namespace, "wants-3g", timeout=60).spec.node_name == node.name


class _RelabelledInTheWindow:
    """The real client, but someone relabels ``node`` once, just before apply's patch of it
    reaches the API server (after apply looked at the node again)."""

    def __init__(self, real: KubernetesCluster, core: client.CoreV1Api, node: str) -> None:
        self._real, self._core, self._node, self.done = real, core, node, False

    def patch_node(self, name: str, **kw: Any) -> NodeView:
        if name == self._node and not self.done:
            self.done = True
            self._core.patch_node(name, {"metadata": {"labels": {CONFIG: "all-disabled"}}})
        return self._real.patch_node(name, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def test_apply_never_overwrites_a_relabel_made_after_it_looked_again(
    agent_node: NodeFactory,
    core: client.CoreV1Api,
    installed: Cluster,
    namespace: str,
    gpu_pod: Any,
) -> None:
    selector, nodes = make_pool(agent_node, core, 2)
    for n in nodes:
        n.label("all-1g.10gb")
    for n in nodes:
        n.wait_state("success", timeout=90)
    raced, other = nodes
    for n in nodes:
        gpu_pod(namespace, f"for-{n.name}", resources={MIG_3G: 1}, node=n.name)
    catalog = load_catalog([PROFILES])
    real = KubernetesCluster.connect(str(installed.kubeconfig))
    try:
        report = ops_advise.run(real, catalog, selector=selector)
        assert sorted(p.node for p in report.proposals) == [raced.name, other.name], report
        lines: list[str] = []
        racing = _RelabelledInTheWindow(real, core, raced.name)
        applied = ops_advise.apply(racing, catalog, report, out=lines.append, poll_s=0.2)
    finally:
        real.close()
    text = "\n".join(lines)
    assert raced.labels().get(CONFIG) == "all-disabled", text
    [(_, skipped)] = [(la, r) for la, r in applied.nodes if r.node == raced.name]
    assert skipped.result is Result.NOT_STARTED, text
    assert skipped.reason == f"relabelled ({CONFIG}=all-disabled) meanwhile, not overwritten"
    [(to, done)] = [(la, r) for la, r in applied.nodes if r.node == other.name]
    assert done.result is Result.SUCCESS, text
    assert other.labels().get(CONFIG) == to
    assert f"{namespace}/for-{other.name}: scheduled on {other.name}" in text, text
    assert wait_running(core, namespace, f"for-{other.name}").spec.node_name == other.name
