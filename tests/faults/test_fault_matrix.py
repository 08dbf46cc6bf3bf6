"""The fault matrix on the real local cluster (harness.py): each fault at each point of a real
agent's pass, then the invariants. By default a quick subset (a few points of the label faults,
one trial of each other family, about four minutes); `MIG_AGENT_FAULTS=full pytest tests/faults`
runs every point x fault, and
`python benchmarks/fault_matrix.py` prints the table."""

from __future__ import annotations

import pytest
from migsim.cluster import Cluster, agents

from . import harness
from .conftest import full_matrix

pytestmark = [pytest.mark.faults, pytest.mark.cluster]

# What each fault must end in: the layout the label names at the end, or the typo's failure.
EXPECTED: dict[str, set[str]] = {
    "kill": {"converged"},
    "relabel-other": {"converged"},
    "relabel-typo": {"failed"},
    "relabel-removed": {"converged"},
    "repartition-other": {"converged"},
    # an API fault is transient: retried, the pass ends as the label asks
    **{f: {"converged"} for f in harness.API_FAULTS},
    "apiserver-restart": {"converged"},
    # an NVML call that fails (or half succeeds) is retried from what NVML then says; a config
    # made invalid leaves the last good one in force, a changed one is applied
    "nvml-error": {"converged"},
    "nvml-half": {"converged"},
    "config-invalid": {"converged"},
    "config-changed": {"converged"},
    # lasting: failed naming the cause (checked by the harness), retried meanwhile; a busy GPU
    # is no obstacle once what it holds is no longer to be destroyed
    "gpu-busy": {"failed", "converged"},
    "reset-fails": {"failed"},
    "plugin-gone": {"failed"},
    "plugin-wrong": {"failed"},
    # the GPUs changed, then the hook failed: failed naming it, the plugin re-advertising
    "post-apply-fails": {"failed"},
    # a reboot command that never returns: killed at its time limit, failed naming it (the
    # harness checks the guard is not armed and nothing of the command is left)
    "reboot-hangs": {"failed"},
}
QUICK = {
    "kill": ("drain.pod_evicted", "gpu.instance_destroyed#3", "phase.started(device_plugin)"),
    "relabel-other": ("gpu.compute_instance_created#1",),
    "relabel-typo": ("drain.pod_evicted",),
    "relabel-removed": ("gpu.instance_destroyed#3",),
    "repartition-other": ("node.resumed",),
    # one per family of faults, and the trials of the bugs they found
    "api-409": ("drain.pod_evicted",),
    "watch-expired": ("drain.pod_evicted",),
    "apiserver-restart": ("gpu.instance_created#1",),
    "nvml-half": ("phase.started(apply)",),
    "post-apply-fails": ("gpu.instance_created#1",),
    "plugin-gone": ("phase.started(device_plugin)",),
}


QUICK_A100 = {"kill": ("gpu.reset",), "reboot-hangs": ("node.paused",)}
# a DRA node: the agent killed as it restarts the DRA plugin, an API fault in the wait for the
# slice, the API server restarted as the plugin's pod is replaced (the node once passed for one
# of no plugin then), and a plugin that never republishes
QUICK_DRA = {
    "kill": ("gpu.instance_created#1", "dra_plugin.restarted"),
    "api-500x3": ("dra_plugin.restarted",),
    "apiserver-restart": ("dra_plugin.restarted",),
    "plugin-gone": ("phase.started(dra_plugin)",),
}


def _cases() -> list[tuple[harness.Scenario, harness.Point, str]]:
    if full_matrix():
        return [
            (sc, p, f)
            for sc in harness.SCENARIOS
            if sc is not harness.DRA
            for f in harness.FAULTS
            for p in harness.fault_points(f, sc)
        ]
    return [(harness.H100, p, f) for f, names in QUICK.items() for p in harness.points(names)] + [
        (harness.A100, p, f)
        for f, names in QUICK_A100.items()
        for p in harness.points(names, harness.A100)
    ]


def _dra_cases() -> list[tuple[harness.Point, str]]:
    if full_matrix():
        return [(p, f) for f in harness.FAULTS for p in harness.fault_points(f, harness.DRA)]
    return [(p, f) for f, names in QUICK_DRA.items() for p in harness.points(names, harness.DRA)]


def _id(value: object) -> str:
    return getattr(value, "name", str(value))


@pytest.mark.parametrize(("scenario", "point", "fault"), _cases(), ids=_id)
def test_fault_at_point_ends_as_the_label_asks_and_the_node_clean(
    fault_cluster: Cluster, scenario: harness.Scenario, point: harness.Point, fault: str
) -> None:
    result = harness.run_trial(fault_cluster, point, fault, scenario=scenario)
    assert result.outcome in EXPECTED[fault], (
        f"{fault} at {point.name}: {result.outcome}: {result.detail}\n{result.log}"
    )
    if fault == "relabel-typo":
        assert f"unknown layout '{scenario.typo}'" in result.detail
    elif fault == "relabel-removed":
        assert result.detail.startswith("no layout asked for")
    elif result.outcome == "failed":
        assert result.detail == result.detail.strip() and result.detail, result
    else:
        want = (
            scenario.other
            if fault.endswith("-other") or fault == "watch-silent"
            else scenario.target
        )
        assert result.detail == f"{want} applied"
    if fault in harness.API_FAULTS:  # the fault was answered to the agent, not lost
        assert result.hits, f"{fault} at {point.name}: the proxy answered nothing"


@pytest.mark.parametrize(("point", "fault"), _dra_cases(), ids=_id)
def test_fault_on_a_dra_node_ends_as_the_label_asks_and_the_slice_true(
    dra_fault_cluster: Cluster, point: harness.Point, fault: str
) -> None:
    """The same invariants, and on success the node's ResourceSlice lists what the GPUs hold."""
    test_fault_at_point_ends_as_the_label_asks_and_the_node_clean(
        dra_fault_cluster, harness.DRA, point, fault
    )


def test_the_eviction_check_tells_a_kept_device_from_a_destroyed_one(
    fault_cluster: Cluster,
) -> None:
    """What the trials that keep the label are held to, on a pass without a fault: each pod
    evicted held a device that the pass destroyed; and a pod whose devices all stay, evicted
    by hand, is caught."""
    node = harness.FaultNode(fault_cluster, harness.H100)
    try:
        node.prepare()
        node.patch_labels({harness.CONFIG: harness.H100.target})
        assert harness.settle_and_check(node, "none", 90)[0] == "converged"
        assert len(node.pods_left()) < len(node.pods_at_start)  # the drain evicted some
        drain = [
            line
            for line in node.lines
            if str(line.get("event", "")).startswith(("drain.", "gpu.waiting"))
        ]
        assert node.evicted_though_kept() == [], (node.held_at_start, drain)
        # the pass kept some instances: a pod on one of them (the first pod, where its device
        # stayed and it was rightly left alone; else one made now); gone, it is caught
        node.pods_at_start, node.held_at_start = {}, {}
        if node.stay_pod not in node.pods_left():
            node._run_pod(node.stay_pod, {"nvidia.com/mig-1g.10gb": "1"})
        node.wait("the new pod's process on its device", node.held_devices, 30)
        node.pods_at_start, node.held_at_start = node.pods_left(), node.held_devices()
        fault_cluster.api.request(
            "DELETE",
            f"/api/v1/namespaces/{harness.NAMESPACE}/pods/{node.stay_pod}",
            {"gracePeriodSeconds": 0},
        )
        node.wait("the pod to go", lambda: node.stay_pod not in node.pods_left(), 60)
        assert node.evicted_though_kept() == [node.stay_pod]
    finally:
        node.close()


def test_a_killed_agent_is_restarted_by_the_cluster_and_converges(fault_cluster: Cluster) -> None:
    """No test restarts it: the node's supervisor does, as a kubelet would."""
    node = harness.FaultNode(fault_cluster)
    try:
        node.prepare()
        first = agents.running(fault_cluster.dir)[node.name]["agent"]
        node.patch_labels({harness.CONFIG: harness.TARGET})
        node.wait(
            "the apply to start",
            lambda: any(
                line.get("event") == "phase.started" and line.get("phase") == "apply"
                for line in node.log_lines()
            ),
            60,
        )
        killed = agents.kill_agent(fault_cluster.dir, node.name)
        assert killed is not None and not killed.alive()
        outcome, detail = harness.settle_and_check(node, "kill", 90)
        record = agents.running(fault_cluster.dir)[node.name]
        assert record["restarts"] == 1 and record["last_exit"] == "killed by SIGKILL"
        assert record["agent"] != first
        assert (outcome, detail) == ("converged", f"{harness.TARGET} applied")
    finally:
        node.close()
