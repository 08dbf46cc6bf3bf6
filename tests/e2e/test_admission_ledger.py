"""We test the MIG layout check's ledger end to end, with Kueue v0.17.0's own controller on the
local cluster, real agents on simulated H100 nodes and the check's rounds in process (each a
fresh call: all its state is on the objects):

* two Jobs racing for the devices of one GPU (four 1g.10gb pods each, seven devices): never
  both promised at once (while one is Ready or admitted with pods holding or promised its
  devices, the other is not Ready), and both end up Running, the second once the first's
  Job is gone;
* a relabel the API server refuses once (an admission policy that denies it while the node
  carries a label of the test's) is written again the next round, and the workload admitted;
* a node relabelled away by hand while a workload waits on it is dropped, never relabelled
  back, and the workload searched again and admitted on another node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from migsim.cluster import Cluster, wait_until
from migsim.cluster.kueue_demo import LAYOUTS, Queue, check_entry, condition, workload
from migsim.cluster.kueue_demo import job as _job

from mig_agent.config.profiles import load_catalog
from mig_agent.kube.client import KubernetesCluster
from mig_agent.ops.admission_check import run_round

from .conftest import AgentNode, NodeFactory
from .test_admission_check import MIG_1G, MIG_3G, S, _check, _pods, kueue, queue

__all__ = ["kueue", "queue"]  # the fixtures, used by the tests here

Round = Callable[[], list[str]]


def _pool(
    tmp_path: Path, agent_node: NodeFactory, core: client.CoreV1Api, namespace: str, n: int
) -> tuple[Any, list[AgentNode], str]:
    """The approved layouts, and a pool of ``n`` H100 nodes at all-1g.10gb (its selector)."""
    (tmp_path / "layouts.yaml").write_text(LAYOUTS)
    catalog = load_catalog([tmp_path / "layouts.yaml"])
    nodes = [agent_node("1xH100-80GB") for _ in range(n)]
    for node in nodes:
        core.patch_node(node.name, {"metadata": {"labels": {"admission-check": namespace}}})
        node.label("all-1g.10gb")
    for node in nodes:
        node.wait_state("success", timeout=90)
    return catalog, nodes, f"admission-check={namespace}"


@pytest.fixture
def rounds(installed: Cluster) -> Iterator[Callable[[Any, str, str], Round]]:
    """A round of the check, as a fresh call each time; what it decided, as lines."""
    kube = KubernetesCluster.connect(str(installed.kubeconfig))

    def make(catalog: Any, controller: str, pool: str) -> Round:
        def one() -> list[str]:
            r = run_round(kube, catalog, S, controller_name=controller, selector=pool)
            return [f"{d.workload}: {d.verdict.value}: {d.message}" for d in r.decisions]

        return one

    try:
        yield make
    finally:
        kube.close()


def _admitted(installed: Cluster, namespace: str, name: str) -> bool:
    w = workload(installed, namespace, name)
    return w is not None and condition(w, "Admitted").get("status") == "True"


def _running(core: client.CoreV1Api, namespace: str, job: str, n: int) -> list[str]:
    pods = [p for p in _pods(core, namespace, job) if p.metadata.deletion_timestamp is None]
    if len(pods) != n or any(p.status.phase not in ("Running", "Succeeded") for p in pods):
        return []
    return sorted(p.spec.node_name for p in pods)


def test_two_jobs_racing_for_one_gpu_are_never_promised_the_same_devices(
    installed: Cluster,
    core: client.CoreV1Api,
    namespace: str,
    queue: Queue,
    agent_node: NodeFactory,
    tmp_path: Path,
    rounds: Callable[[Any, str, str], Round],
) -> None:
    catalog, [node], pool = _pool(tmp_path, agent_node, core, namespace, 1)
    _, controller = _check(installed, queue, namespace, {MIG_1G: 8})
    one = rounds(catalog, controller, pool)
    one()  # the check marked Active: Kueue reserves quota from now on
    jobs = ("left", "right")
    for job in jobs:
        _job(installed, namespace, job, 4, MIG_1G)
    said: list[str] = []
    waited: list[str] = []

    def holders() -> list[str]:
        """The Jobs Ready or admitted whose four pods have not all ended (the simulated
        image's command exits at once: each Job's pods end soon after they run)."""
        out = []
        for job in jobs:
            pods = _pods(core, namespace, job)
            done = len(pods) == 4 and all(p.status.phase == "Succeeded" for p in pods)
            ready = check_entry(installed, namespace, job).get("state") == "Ready"
            if (ready or _admitted(installed, namespace, job)) and not done:
                out.append(job)
        return out

    def both_ran() -> bool:
        said.extend(one())
        holding = holders()
        assert len(holding) <= 1, (holding, said[-4:])  # 8 devices promised of 7
        waited.extend(line for line in said[-2:] if "go to workloads before it" in line)
        return all(_running(core, namespace, job, 4) for job in jobs)

    wait_until(both_ran, timeout=300, interval=1.0, what=f"both Jobs run: {said[-4:]}")
    assert waited, said  # they did race: one waited on the other's devices
    for job in jobs:
        assert _running(core, namespace, job, 4) == [node.name] * 4


def _refusing_policy(installed: Cluster, name: str) -> None:
    """An admission policy refusing any change of a node's layout label while the node
    carries the label ``refuse-relabel``."""
    api = "/apis/admissionregistration.k8s.io/v1"
    key = S.config_label
    installed.api.request(
        "POST",
        f"{api}/validatingadmissionpolicies",
        {
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["UPDATE"],
                            "resources": ["nodes"],
                        }
                    ]
                },
                "validations": [
                    {
                        "expression": (
                            "!has(oldObject.metadata.labels) || "
                            "!('refuse-relabel' in oldObject.metadata.labels) || "
                            f"object.metadata.labels['{key}'] == "
                            f"oldObject.metadata.labels['{key}']"
                        ),
                        "message": "refused by the test's policy",
                    }
                ],
            },
        },
    )
    installed.api.request(
        "POST",
        f"{api}/validatingadmissionpolicybindings",
        {
            "metadata": {"name": name},
            "spec": {"policyName": name, "validationActions": ["Deny"]},
        },
    )


def test_a_relabel_the_api_server_refuses_once_is_written_again(
    installed: Cluster,
    core: client.CoreV1Api,
    namespace: str,
    queue: Queue,
    agent_node: NodeFactory,
    tmp_path: Path,
    rounds: Callable[[Any, str, str], Round],
) -> None:
    catalog, [node], pool = _pool(tmp_path, agent_node, core, namespace, 1)
    name = f"{namespace}-refuse"
    _refusing_policy(installed, name)
    core.patch_node(node.name, {"metadata": {"labels": {"refuse-relabel": "yes"}}})
    api = "/apis/admissionregistration.k8s.io/v1"
    try:

        def refused() -> bool:  # a policy takes effect a moment after it is made
            try:
                core.patch_node(
                    node.name, {"metadata": {"labels": {S.config_label: "x"}}}, dry_run="All"
                )
            except client.ApiException as e:
                return "refused by the test's policy" in str(e.body)
            return False

        wait_until(refused, timeout=30, what="the test's policy in force")
        _, controller = _check(installed, queue, namespace, {MIG_3G: 2})
        one = rounds(catalog, controller, pool)
        one()
        _job(installed, namespace, "train", 2, MIG_3G)
        said: list[str] = []

        def relabel_tried() -> bool:
            said.extend(one())
            return any("relabelling" in line for line in said)

        wait_until(relabel_tried, timeout=60, interval=1.0, what=f"a relabel: {said}")
        assert node.labels()[S.config_label] == "all-1g.10gb"  # refused
        core.patch_node(node.name, {"metadata": {"labels": {"refuse-relabel": None}}})

        def admitted() -> bool:
            said.extend(one())
            return _admitted(installed, namespace, "train")

        wait_until(admitted, timeout=180, interval=1.0, what=f"train admitted: {said[-4:]}")
        assert any("again for it (the last write did not land)" in line for line in said), said
        assert node.labels()[S.config_label] == "all-3g.40gb"
    finally:
        installed.api.request("DELETE", f"{api}/validatingadmissionpolicybindings/{name}")
        installed.api.request("DELETE", f"{api}/validatingadmissionpolicies/{name}")


def test_a_node_relabelled_away_by_hand_is_dropped_and_the_workload_served_elsewhere(
    installed: Cluster,
    core: client.CoreV1Api,
    namespace: str,
    queue: Queue,
    agent_node: NodeFactory,
    tmp_path: Path,
    rounds: Callable[[Any, str, str], Round],
) -> None:
    catalog, nodes, pool = _pool(tmp_path, agent_node, core, namespace, 2)
    _, controller = _check(installed, queue, namespace, {MIG_3G: 2})
    one = rounds(catalog, controller, pool)
    one()
    _job(installed, namespace, "train", 2, MIG_3G)
    said: list[str] = []

    def relabelled() -> list[AgentNode]:
        said.extend(one())
        return [n for n in nodes if n.labels()[S.config_label] == "all-3g.40gb"]

    [first] = wait_until(relabelled, timeout=60, interval=1.0, what=f"a relabel: {said}")
    [other] = [n for n in nodes if n is not first]
    first.label("all-1g.10gb")  # by hand: the operator wants it back

    def admitted() -> bool:
        said.extend(one())
        return _admitted(installed, namespace, "train")

    wait_until(admitted, timeout=180, interval=1.0, what=f"train admitted: {said[-4:]}")
    assert any(
        f"{first.name} was relabelled to all-1g.10gb meanwhile, not by this check: searched "
        "again" in line
        for line in said
    ), said
    assert first.labels()[S.config_label] == "all-1g.10gb"  # never relabelled back
    assert other.labels()[S.config_label] == "all-3g.40gb"
    on = wait_until(
        lambda: _running(core, namespace, "train", 2), timeout=120, what="train's pods running"
    )
    assert on == [other.name, other.name]


def test_a_malformed_check_annotation_refuses_the_check_with_a_warning_event(
    installed: Cluster,
    core: client.CoreV1Api,
    namespace: str,
    queue: Queue,
    agent_node: NodeFactory,
    tmp_path: Path,
    rounds: Callable[[Any, str, str], Round],
) -> None:
    """`max-nodes: "0"` read as no cap before; now the check is inactive, saying why, with a
    Warning Event about it (an AdmissionCheck is cluster-scoped: its Events go to default)."""
    catalog, [node], pool = _pool(tmp_path, agent_node, core, namespace, 1)
    check, controller = _check(installed, queue, namespace, {MIG_3G: 2})
    path = f"/apis/kueue.x-k8s.io/v1beta2/admissionchecks/{check}"
    installed.api.request(
        "PATCH",
        path,
        {"metadata": {"annotations": {"mig-agent.dev/max-nodes": "0"}}},
        content_type="application/merge-patch+json",
    )
    rounds(catalog, controller, pool)()
    got = installed.api.request("GET", path)
    [active] = [c for c in got["status"]["conditions"] if c["type"] == "Active"]
    assert (active["status"], active["reason"]) == ("False", "InvalidParameters"), active
    assert "mig-agent.dev/max-nodes: '0' is not a whole number above 0" in active["message"]
    events = core.list_namespaced_event(
        "default", field_selector=f"involvedObject.name={check}"
    ).items
    assert [(e.reason, e.type) for e in events] == [("InvalidParameters", "Warning")], events
    assert node.labels()[S.config_label] == "all-1g.10gb"
