"""Handing a node over between NVIDIA's MIG Manager and mig-agent, both ways, on a simulated
2xH100-80GB node of the local cluster with GPU pods on every MIG device.

We test these aspects: (a) a node MIG Manager configured (label -> success), MIG Manager removed
and mig-agent started in its place: mig-agent reports `success` for the same layout without a
single mutating NVML call (the simulator's call counters), without evicting or deleting a pod,
without cordoning the node or emitting a reconfiguring Event; then a new label (all-balanced ->
all-1g.10gb): mig-agent applies it keeping every 1g.10gb instance (same GPU instance ids) and the
pods on them, destroying only the 2g and 3g instances. (b) a node mig-agent configured, mig-agent
removed and MIG Manager started in its place: what MIG Manager does is recorded as observed (it
asserts the layout, finds it applied and reports `success`: no mutating NVML call, the pods
untouched); then a new layout applied by MIG Manager (after the pods are deleted by hand: MIG
Manager does not drain) reaches `success` with the GPUs holding it.
"""

from __future__ import annotations

import os
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client
from migsim.cluster import Cluster, agents, mig_manager
from migsim.nvml import state as simstate
from prometheus_client.parser import text_string_to_metric_families

from .conftest import CONFIG, REPO, RESTART_BACKOFF, STATE

LAYOUTS = REPO / "profiles" / "all.yaml"  # one file: what MIG Manager reads
GPU_STATE = "mig-agent.dev/gpu-state"
NS = "handover"
POD_LABEL = "handover.mig-agent.dev/node"
BALANCED = {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
ALL_1G = {"1g.10gb": 7}
RECONFIGURING = {
    "MIGReconfiguring",
    "MIGDraining",
    "MIGApplying",
    "MIGVerifying",
    "MIGDevicePluginRestart",
}

pytestmark = pytest.mark.native

if os.geteuid() != 0:  # said out loud in the summary (-ra), never a silent pass
    pytest.skip(
        "nvidia-mig-manager runs in a private mount namespace (unshare -m): run as root",
        allow_module_level=True,
    )


def wait(what: str, ready: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not after {timeout:g} s"
        time.sleep(0.1)


class Node:
    def __init__(self, cluster: Cluster, core: client.CoreV1Api, name: str) -> None:
        self.cluster, self.core, self.name = cluster, core, name
        self.sim_state = str(agents.sim_state_path(cluster, name))

    def labels(self) -> dict[str, str]:
        return dict(self.core.read_node(self.name).metadata.labels or {})

    def label(self, layout: str) -> None:
        self.core.patch_node(self.name, {"metadata": {"labels": {CONFIG: layout}}})

    def wait_state(self, state: str, timeout: float = 120.0) -> None:
        wait(
            f"{self.name} {state} (log: {self.logs()})",
            lambda: self.labels().get(STATE) == state,
            timeout,
        )

    def wait_all_1g(self) -> None:
        """Waits for `success` at all-1g.10gb with both GPUs holding it."""
        wait(
            "success at all-1g.10gb",
            lambda: self.labels().get(STATE) == "success" and self.layout() == [ALL_1G, ALL_1G],
        )

    def logs(self) -> str:
        return ", ".join(str(p) for p in (self.cluster.dir / "logs").glob(f"*{self.name}*"))

    def advertised(self) -> Counter[str]:
        alloc = self.core.read_node(self.name).status.allocatable or {}
        return Counter(
            {k: int(v) for k, v in alloc.items() if k.startswith("nvidia.com/mig-") and int(v)}
        )

    def layout(self) -> list[dict[str, int]]:
        """Per GPU: its GPU instances by profile name."""
        return [
            dict(
                Counter(
                    g.model.gi_profile_by_id(gi.profile_id).name  # type: ignore[union-attr]
                    for gi in g.gpu_instances
                )
            )
            for g in simstate.load_node(self.sim_state).gpus
        ]

    def instances(self, profile: str) -> set[tuple[int, int, int]]:
        """(GPU, GI id, placement start) of the instances of `profile`."""
        return {
            (g.index, gi.id, gi.placement.start)
            for g in simstate.load_node(self.sim_state).gpus
            for gi in g.gpu_instances
            if g.model.gi_profile_by_id(gi.profile_id).name == profile
        }  # type: ignore[union-attr]

    def fill_with_pods(self) -> dict[str, str]:
        """A GPU pod on every MIG device the node advertises; pod UID -> its resource, once
        each runs and holds its device."""
        want = self.advertised()
        made: dict[str, str] = {}
        for resource, count in sorted(want.items()):
            for _ in range(count):
                limits = {resource: "1"}
                pod = self.core.create_namespaced_pod(
                    NS,
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {
                            "generateName": f"{self.name}-",
                            "labels": {POD_LABEL: self.name},
                        },
                        "spec": {
                            "nodeSelector": {"kubernetes.io/hostname": self.name},
                            "tolerations": [{"operator": "Exists"}],
                            "terminationGracePeriodSeconds": 1,
                            "containers": [
                                {
                                    "name": "cuda",
                                    "image": "registry.invalid/sim:1",
                                    "resources": {"limits": limits, "requests": limits},
                                }
                            ],
                        },
                    },
                )
                made[pod.metadata.uid] = resource
        wait(
            "every pod holds its device",
            lambda: (
                set(made)
                <= {
                    o[4:]
                    for o in simstate.processes_by_owner(self.sim_state)
                    if o.startswith("pod/")
                }
            ),
        )
        return made

    def live_pods(self) -> set[str]:
        """UIDs of the node's pods that are neither gone nor being deleted."""
        return {
            p.metadata.uid
            for p in self.core.list_namespaced_pod(
                NS, label_selector=f"{POD_LABEL}={self.name}"
            ).items
            if not p.metadata.deletion_timestamp
        }

    def delete_pods(self) -> None:
        self.core.delete_collection_namespaced_pod(
            NS, label_selector=f"{POD_LABEL}={self.name}", grace_period_seconds=0
        )
        wait(
            "pods gone",
            lambda: (
                not self.live_pods()
                and not any(
                    o.startswith("pod/") for o in simstate.processes_by_owner(self.sim_state)
                )
            ),
        )

    def event_reasons(self) -> set[str]:
        events = self.core.list_event_for_all_namespaces(
            field_selector=f"involvedObject.name={self.name}"
        ).items
        return {e.reason for e in events}

    def mutations(self) -> dict[str, int]:
        return dict(simstate.call_counts(self.sim_state).by_function)


@pytest.fixture
def handover_node(installed: Cluster, core: client.CoreV1Api) -> Iterator[Node]:
    """A fresh 2xH100-80GB node; whatever runs on it (MIG Manager, mig-agent) stopped after."""
    cluster = installed
    try:
        core.create_namespace({"metadata": {"name": NS}})
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    name = f"handover-{int(time.time() * 1000) % 100000}"
    cluster.add_gpu_node(name, "2xH100-80GB")
    try:
        yield Node(cluster, core, name)
    finally:
        mig_manager.stop_node(cluster.dir, name)
        agents.stop_node(cluster.dir, name)
        core.delete_collection_namespaced_pod(
            NS, label_selector=f"{POD_LABEL}={name}", grace_period_seconds=0
        )
        cluster.delete_node(name)


def start_agent(node: Node) -> agents.NodeAgents:
    return agents.start_node(
        node.cluster,
        node.name,
        profiles=LAYOUTS,
        device_plugin="simulated",
        restart_backoff=RESTART_BACKOFF,
    )


def last_success(port: int) -> float:
    """The agent's mig_agent_last_success_timestamp_seconds: set when a pass ends in success
    (a layout applied, or found applied with nothing to change); 0 before, or unreachable."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:  # noqa: S310
            text = r.read().decode()
    except OSError:
        return 0.0
    return next(
        (
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "mig_agent_last_success_timestamp_seconds"
        ),
        0.0,
    )


def test_mig_manager_to_mig_agent_touches_nothing_then_keeps_what_fits(handover_node: Node) -> None:
    node = handover_node
    mig_manager.start_node(node.cluster, node.name, LAYOUTS)
    node.label("all-balanced")
    node.wait_state("success")
    assert node.layout() == [BALANCED, BALANCED]
    wait(
        "MIG devices advertised",
        lambda: (
            node.advertised()
            == Counter(
                {
                    "nvidia.com/mig-1g.10gb": 4,
                    "nvidia.com/mig-2g.20gb": 2,
                    "nvidia.com/mig-3g.40gb": 2,
                }
            )
        ),
    )
    pods = node.fill_with_pods()
    kept_1g = node.instances("1g.10gb")

    mig_manager.stop_node(node.cluster.dir, node.name)  # MIG Manager removed from the node
    simstate.reset_call_counts(node.sim_state)
    port = start_agent(node).metrics_port
    # the agent's first pass has ended in success: it looked, and found nothing to change (or
    # changed something, which the counters below would show)
    wait(
        f"mig-agent's first pass to end in success (log: {node.logs()})",
        lambda: last_success(port) > 0,
    )
    assert GPU_STATE in (node.core.read_node(node.name).metadata.annotations or {})
    assert node.mutations() == {}, "mig-agent changed GPUs that already held the layout"
    assert node.labels().get(STATE) == "success"
    assert node.live_pods() == set(pods), "a pod was evicted or deleted"
    assert not node.core.read_node(node.name).spec.unschedulable
    assert not node.event_reasons() & RECONFIGURING, node.event_reasons()
    assert node.layout() == [BALANCED, BALANCED]

    # a new layout: the 1g.10gb instances (and the pods on them) stay
    node.label("all-1g.10gb")
    node.wait_all_1g()
    assert kept_1g <= node.instances("1g.10gb"), "a 1g.10gb instance was not kept"
    assert node.mutations().get("nvmlGpuInstanceDestroy") == 4  # the 2g and 3g of each GPU
    on_1g = {uid for uid, resource in pods.items() if resource == "nvidia.com/mig-1g.10gb"}
    assert node.live_pods() == on_1g, "pods on kept devices must stay; the others go"


def test_mig_agent_to_mig_manager_is_left_as_it_is_then_reconfigured(handover_node: Node) -> None:
    node = handover_node
    start_agent(node)
    node.label("all-balanced")
    node.wait_state("success")
    assert node.layout() == [BALANCED, BALANCED]
    wait("MIG devices advertised", lambda: sum(node.advertised().values()) == 8)
    pods = node.fill_with_pods()
    before = node.instances("1g.10gb") | node.instances("2g.20gb") | node.instances("3g.40gb")

    agents.stop_node(node.cluster.dir, node.name)  # mig-agent removed from the node
    simstate.reset_call_counts(node.sim_state)
    record = mig_manager.start_node(node.cluster, node.name, LAYOUTS)
    log = Path(record.log)
    wait(
        "MIG Manager's first pass",
        lambda: (
            "Waiting for change to 'nvidia.com/mig.config' "
            "label" in log.read_text().split("Updating to MIG config: all-balanced", 1)[-1]
            if "Updating to MIG config: all-balanced" in log.read_text()
            else False
        ),
    )
    # observed: it asserts the layout, finds it applied and says success, touching nothing
    assert node.labels().get(STATE) == "success"
    assert node.mutations() == {}, f"MIG Manager's NVML mutations: {node.mutations()}"
    assert node.live_pods() == set(pods)
    assert before == (
        node.instances("1g.10gb") | node.instances("2g.20gb") | node.instances("3g.40gb")
    )

    # a new layout by MIG Manager: it does not drain, so the pods go by hand first
    node.delete_pods()
    node.label("all-1g.10gb")
    node.wait_all_1g()
    wait(
        "1g devices advertised",
        lambda: node.advertised() == Counter({"nvidia.com/mig-1g.10gb": 14}),
    )
