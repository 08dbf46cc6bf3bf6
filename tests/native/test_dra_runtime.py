"""NVIDIA's DRA kubelet plugin run as a kubelet runs the DRA driver's pod: a follower per kwok node
(migsim.cluster.dra_runtime), over the node's simulated GPUs, in a local cluster of its own with
the driver's DaemonSet as a GPUCluster renders it (dra_plugin.install_daemonset).

We test these aspects: the follower starts the plugin only once the node's DRA pod runs (no slice
before), and stops the process when the pod goes (the node label taken away); a new pod (new UID)
restarts it, so that after a layout change deleting the pod makes the slice list the new devices;
a plugin that exits while its pod runs is restarted; the pod's FEATURE_GATES reach the plugin as
--feature-gates (a second DaemonSet for another value of the node label); agents.stop_node, and
the cluster's `down` even after the follower was killed, leave no follower or plugin process.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from migsim.cluster import Cluster, agents, dra_plugin, dra_runtime
from migsim.cluster.agent_records import DRA_RECORDS, stop_all
from migsim.cluster.processes import Proc, kill
from migsim.cluster.waiting import wait_until
from migsim.nvml import state as st

from .test_dra_driver import GPUS, _build, apply

if os.geteuid() != 0:  # said out loud in the summary (-ra), never a silent pass
    pytest.skip(
        "the DRA plugin runs in a private mount namespace (unshare -m): run as root",
        allow_module_level=True,
    )

WHOLE_GPUS = {"gpu-0", "gpu-1"}
_ids = itertools.count()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster of its own with the DRA driver's DeviceClasses and default DaemonSet."""
    _build("dra-driver")
    _build("nvidia-binaries")  # nvidia-cdi-hook
    c = Cluster.up(tmp_path_factory.mktemp("dra-runtime"), gpu_nodes=0)
    try:
        agents.install_dra(c)
        yield c
    finally:
        c.down()


@pytest.fixture
def node(cluster: Cluster) -> Iterator[str]:
    """A new kwok node of 2 simulated H100s (not a DRA node yet); stopped and deleted after."""
    name = f"dra-{next(_ids)}"
    cluster.add_gpu_node(name, GPUS)
    agents.sim_state(cluster, name)
    yield name
    agents.stop_node(cluster.dir, name)
    cluster.delete_node(name)


def state_of(cluster: Cluster, node: str) -> Path:
    return agents.sim_state_path(cluster, node)


def follow(cluster: Cluster, node: str) -> Proc:
    return dra_runtime.start(cluster, node, state_of(cluster, node))


def recorded(cluster: Cluster, node: str, key: str = "plugin") -> Proc | None:
    record = DRA_RECORDS.load(cluster.dir).get(node, {}).get(key)
    return Proc(**record) if record else None


def live_plugin(cluster: Cluster, node: str, *, not_: Proc | None = None) -> Proc:
    """The node's plugin once one runs (another one than `not_`)."""

    def found() -> Proc | None:
        proc = recorded(cluster, node)
        return proc if proc is not None and proc.alive() and proc != not_ else None

    return wait_until(found, timeout=30, what=f"a DRA plugin on {node}\n{log(cluster, node)}")


def pod(cluster: Cluster, node: str) -> dra_runtime.PluginPod | None:
    pods = dra_runtime.node_pods(cluster.api, node, dra_plugin.NAMESPACE, dra_runtime.SELECTOR)
    return dra_runtime.running_pod(pods)


def wait_devices(
    cluster: Cluster, node: str, done: Callable[[set[str]], bool], timeout: float = 60
) -> dict[str, dict[str, object]]:
    def listed() -> dict[str, dict[str, object]] | None:
        devices = dra_plugin.devices(cluster, node)
        return devices if done(set(devices)) else None

    return wait_until(listed, timeout=timeout, what=f"{node}'s slice\n{log(cluster, node)}")


def pod_lists(cluster: Cluster) -> int:
    """The LISTs of pods in one namespace that the API server has answered: in this cluster only
    the followers' polls (node_pods) and `pod` make them; none come while nothing polls."""
    metrics = cluster.kubectl("get", "--raw", "/metrics")
    return sum(
        int(float(line.rpartition(" ")[2]))
        for line in metrics.splitlines()
        if line.startswith("apiserver_request_total{")
        and all(k in line for k in ('resource="pods"', 'scope="namespace"', 'verb="LIST"'))
    )


def looked_again(cluster: Cluster, since: int) -> None:
    """Return once the follower has acted on a poll answered after `since` (pod_lists): it sends
    its next poll only once it has acted on the last answer."""
    wait_until(
        lambda: pod_lists(cluster) >= since + 2,
        timeout=30,
        what="the follower to poll twice",
        interval=0.5,
    )


def log(cluster: Cluster, node: str) -> str:
    path = cluster.dir / "logs" / f"dra-runtime-{node}.log"
    return path.read_text() if path.exists() else ""


def events(cluster: Cluster, node: str) -> list[dict[str, object]]:
    """The follower's structured log lines."""
    return [json.loads(ln) for ln in log(cluster, node).splitlines() if ln.startswith("{")]


def cmdline(proc: Proc) -> list[str]:
    return Path(f"/proc/{proc.pid}/cmdline").read_text().split("\0")


def gone(proc: Proc) -> bool:
    """Whether nothing of `proc`'s process group is left."""
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return True
    return False


def label(cluster: Cluster, node: str, value: str | None) -> None:
    cluster.api.request(
        "PATCH",
        f"/api/v1/nodes/{node}",
        {"metadata": {"labels": {dra_plugin.NODE_LABEL: value}}},
        content_type="application/merge-patch+json",
    )


def test_the_plugin_runs_only_while_the_nodes_pod_runs(cluster: Cluster, node: str) -> None:
    before = pod_lists(cluster)
    follower = follow(cluster, node)
    looked_again(cluster, before)  # it found no pod: nothing to run
    assert follower.alive()
    assert recorded(cluster, node) is None
    assert dra_plugin.resource_slices(cluster, node) == []

    agents.make_dra_node(cluster, node)
    wait_until(lambda: pod(cluster, node), timeout=30, what="the DRA pod to run")
    wait_devices(cluster, node, lambda d: d == WHOLE_GPUS)
    plugin = live_plugin(cluster, node)
    assert not any(a.startswith("--feature-gates") for a in cmdline(plugin))

    label(cluster, node, None)  # the DaemonSet takes its pod away
    wait_until(lambda: gone(plugin), timeout=30, what="the plugin to stop")
    assert recorded(cluster, node) is None
    assert follower.alive()  # it waits for the next pod
    assert set(dra_plugin.devices(cluster, node)) == WHOLE_GPUS  # slices stay, as upstream
    said = [(e["event"], e.get("reason")) for e in events(cluster, node)]
    assert ("dra_runtime.plugin_started", "pod_running") in said
    assert ("dra_runtime.plugin_stopped", "pod_gone") in said


def test_a_new_pod_restarts_the_plugin_over_the_new_gpus(cluster: Cluster, node: str) -> None:
    agents.make_dra_node(cluster, node)
    follow(cluster, node)
    wait_devices(cluster, node, lambda d: d == WHOLE_GPUS)
    first, first_pod = live_plugin(cluster, node), pod(cluster, node)
    assert first_pod is not None

    state = state_of(cluster, node)
    apply(state, "all-balanced")
    mig_uuids = {ci.uuid for gpu in st.load_node(state).gpus for _gi, ci in gpu.mig_devices()}
    assert len(mig_uuids) == 8
    looked_again(cluster, pod_lists(cluster))  # same pod: the follower leaves the plugin be,
    # which read the GPUs when it started and does not see the change
    assert set(dra_plugin.devices(cluster, node)) == WHOLE_GPUS
    assert first.alive()

    cluster.api.request(
        "DELETE", f"/api/v1/namespaces/{dra_plugin.NAMESPACE}/pods/{first_pod.name}"
    )
    devices = wait_devices(cluster, node, lambda d: bool(d) and not d & WHOLE_GPUS)
    assert {str(d["uuid"]) for d in devices.values()} == mig_uuids
    assert all(d["type"] == "mig" for d in devices.values())
    second, second_pod = live_plugin(cluster, node, not_=first), pod(cluster, node)
    assert not first.alive() and second.alive()
    assert second_pod is not None and second_pod.uid != first_pod.uid
    started = [
        e["uid"] for e in events(cluster, node) if e["event"] == "dra_runtime.plugin_started"
    ]
    assert started == [first_pod.uid, second_pod.uid]


def test_a_plugin_that_exits_while_its_pod_runs_is_restarted(cluster: Cluster, node: str) -> None:
    agents.make_dra_node(cluster, node)
    follow(cluster, node)
    first = live_plugin(cluster, node)
    kill(first)  # SIGKILL to its group: a crash
    second = live_plugin(cluster, node, not_=first)
    assert second.alive()
    wait_devices(cluster, node, lambda d: d == WHOLE_GPUS)
    exited = [e for e in events(cluster, node) if e["event"] == "dra_runtime.plugin_exited"]
    assert exited and exited[0]["restart_in_s"] == dra_runtime.RESTART_BACKOFF[0]
    said = [(e["event"], e.get("reason")) for e in events(cluster, node)]
    assert ("dra_runtime.plugin_started", "restart_after_exit") in said


def test_the_pods_feature_gates_reach_the_plugin(cluster: Cluster, node: str) -> None:
    dra_plugin.install_daemonset(
        cluster,
        name=f"{dra_plugin.DAEMONSET}-dynamic",
        node_selector={dra_plugin.NODE_LABEL: "dynamic", "type": "kwok"},
        feature_gates="DynamicMIG=true",
    )
    agents.make_dra_node(cluster, node, label_value="dynamic")
    follow(cluster, node)
    plugin = live_plugin(cluster, node)
    running = pod(cluster, node)
    assert running is not None and running.name.startswith(f"{dra_plugin.DAEMONSET}-dynamic-")
    assert "--feature-gates=DynamicMIG=true" in cmdline(plugin)
    plugin_log = cluster.dir / "logs" / f"dra-plugin-{node}.log"
    wait_until(  # its map of feature gates, logged at start
        lambda: '"DynamicMIG":true' in plugin_log.read_text(errors="replace"),
        timeout=30,
        what="the plugin to say DynamicMIG is on",
    )


def test_stop_node_leaves_no_follower_or_plugin(cluster: Cluster, node: str) -> None:
    agents.make_dra_node(cluster, node)
    follower = follow(cluster, node)
    plugin = live_plugin(cluster, node)
    agents.stop_node(cluster.dir, node)
    assert gone(follower) and gone(plugin)
    assert node not in DRA_RECORDS.load(cluster.dir)


def test_down_stops_the_plugin_of_a_follower_that_was_killed(cluster: Cluster, node: str) -> None:
    agents.make_dra_node(cluster, node)
    follower = follow(cluster, node)
    plugin = live_plugin(cluster, node)
    kill(follower)  # no clean-up runs: its plugin stays, recorded
    assert plugin.alive()
    stop_all(cluster.dir)  # what Cluster.down and `scripts/local-cluster down` stop first
    assert gone(follower) and gone(plugin)
    assert DRA_RECORDS.load(cluster.dir) == {}
