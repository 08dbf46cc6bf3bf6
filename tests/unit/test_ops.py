"""We test these aspects of the ops commands (repartition, status) against FakeCluster, with
agents played by the fake clock (the real API server and agents are in tests/e2e):

* a pool rollout never has more than K nodes in flight, and every node ends in the summary;
* the first failure (or the failure budget) stops new starts; those started are still followed;
* a node past its timeout is reported as timed out and no longer waited for; its agent goes on;
* Ctrl-C returns a summary naming the nodes still in progress; nothing else is started;
* a typo, a layout that does not fit a node, or a node busy with another layout is refused
  before any node is patched, naming the known layouts or the reason;
* dry run patches nothing and reports per node which GPUs change and how many GPU pods go;
* nodes already at the layout are reported as such, not relabelled;
* status: the table and JSON of GPU nodes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mig_agent import cli, ops
from mig_agent.cli import ops_commands
from mig_agent.config.profiles import load_catalog
from mig_agent.config.settings import Settings
from mig_agent.core.errors import ConfigError, UnknownLayout
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.snapshot import compact, empty_node
from mig_agent.kube.cluster import NodeView
from mig_agent.node.waits import Clock
from mig_agent.ops import Action, Result, RolloutRefused
from tests.unit.fake_cluster import FakeCluster

CATALOG = load_catalog([Path(__file__).resolve().parents[2] / "profiles"])
S = Settings()
CONFIG, STATE = S.config_label, S.state_label
REASON, GPU_STATE = S.reason_annotation, S.gpu_state_annotation
OLD, NEW = "all-disabled", "all-1g.10gb"
PDB_REASON = (
    "eviction of pod team-a/train-0 refused: PodDisruptionBudget team-a/train-pdb does not allow it"
)


@dataclass
class Pool(FakeCluster):
    """FakeCluster whose nodes have agents: a relabelled node goes pending on the next tick and
    ends after its duration (success, or failed with a reason). Records the script's patches and
    the most nodes in flight (relabelled, not yet done) at any moment."""

    now: float = 0.0
    duration_s: dict[str, float] = field(default_factory=dict)
    fails: dict[str, str] = field(default_factory=dict)
    stuck: set[str] = field(default_factory=set)
    started: dict[str, float] = field(default_factory=dict)
    script_patches: list[str] = field(default_factory=list)
    max_in_flight: int = 0
    max_pending: int = 0
    interrupt_at: float | None = None

    def add_gpu_node(
        self, name: str, *, labels: Mapping[str, str] | None = None, gpus: int = 2
    ) -> None:
        node = self.add_node(name, {CONFIG: OLD, STATE: "success", **(labels or {})})
        state, models = empty_node([MODELS["H100-80GB"]] * gpus)
        self.nodes[name] = _with_annotations(node, {GPU_STATE: compact(state, models)})

    def patch_node(
        self,
        name: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
        unschedulable: bool | None = None,
    ) -> NodeView:
        if labels and CONFIG in labels:  # only the script sets the layout label
            self.script_patches.append(name)
        node = super().patch_node(
            name, labels=labels, annotations=annotations, unschedulable=unschedulable
        )
        in_flight = [
            n
            for n in self.nodes.values()
            if CONFIG in n.labels and n.labels.get(STATE) not in ("success", "failed")
        ]
        self.max_in_flight = max(self.max_in_flight, len(in_flight))
        pending = [n for n in in_flight if n.labels.get(STATE) == "pending"]
        self.max_pending = max(self.max_pending, len(pending))
        return node

    # the clock
    def clock_now(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        if self.interrupt_at is not None and self.now >= self.interrupt_at:
            raise KeyboardInterrupt
        self.now += s
        self.tick()

    def tick(self) -> None:
        for name, node in list(self.nodes.items()):
            state = node.labels.get(STATE)
            if CONFIG in node.labels and state is None:
                self.started[name] = self.now
                self.patch_node(name, labels={STATE: "pending"})
            elif state == "pending" and name not in self.stuck:
                if self.now - self.started[name] < self.duration_s.get(name, 5.0):
                    continue
                if name in self.fails:
                    self.patch_node(
                        name, labels={STATE: "failed"}, annotations={REASON: self.fails[name]}
                    )
                else:
                    self.patch_node(name, labels={STATE: "success"})


def _with_annotations(node: NodeView, annotations: Mapping[str, str]) -> NodeView:
    return dataclasses.replace(node, annotations={**node.annotations, **annotations})


def pool(n: int = 6, **kw: object) -> Pool:
    p = Pool(**kw)  # type: ignore[arg-type]
    for i in range(n):
        p.add_gpu_node(f"gpu-node-{i}")
    return p


def run(p: Pool, nodes: list[str] | None = None, **kw: object) -> tuple[ops.Summary, list[str]]:
    lines: list[str] = []
    args: dict[str, object] = {"max_parallel": 2, "timeout_s": 600.0, "heartbeat_s": 30.0}
    args.update(kw)
    summary = ops.repartition(
        p,
        CATALOG,
        str(args.pop("layout", NEW)),
        nodes if nodes is not None else sorted(p.nodes),
        clock=Clock(p.clock_now, p.sleep),
        out=lines.append,
        **args,  # type: ignore[arg-type]
    )
    return summary, lines


# ---------------------------------------------------------------------------------------------
# Rollout


def test_pool_rollout_keeps_at_most_k_nodes_in_flight_and_all_succeed() -> None:
    p = pool(6, duration_s={"gpu-node-0": 3, "gpu-node-1": 9, "gpu-node-2": 4})
    summary, lines = run(p, max_parallel=2)

    assert p.max_in_flight == 2 and p.max_pending == 2
    assert summary.ok and summary.exit_code == 0
    assert [r.result for r in summary.results] == [Result.SUCCESS] * 6
    assert all(r.elapsed_s is not None and r.elapsed_s > 0 for r in summary.results)
    assert sorted(p.script_patches) == sorted(p.nodes)  # one label change per node
    assert all(n.labels[CONFIG] == NEW and n.labels[STATE] == "success" for n in p.nodes.values())
    # node-0 is quick, so node-2 starts before the slow node-1 ends
    assert p.started["gpu-node-2"] < p.started["gpu-node-1"] + 9
    assert any("gpu-node-3  pending" in line for line in lines)
    assert lines[-1] == f"layout {NEW}: done (6 node(s): 6 success)"
    assert lines[-8].split() == ["NODE", "RESULT", "ELAPSED", "REASON"]


def test_one_node_at_a_time_by_default() -> None:
    p = pool(3)
    summary, _ = run(p, max_parallel=1)
    assert p.max_in_flight == 1
    assert summary.ok


def test_first_failure_stops_new_starts_and_names_the_node_and_reason() -> None:
    p = pool(6, duration_s={"gpu-node-0": 10, "gpu-node-1": 4}, fails={"gpu-node-1": PDB_REASON})
    summary, lines = run(p, max_parallel=2)

    assert summary.exit_code == 1 and not summary.ok
    assert summary.result_of("gpu-node-0").result is Result.SUCCESS  # started, followed to the end
    failed = summary.result_of("gpu-node-1")
    assert failed.result is Result.FAILED and failed.reason == PDB_REASON
    assert summary.with_result(Result.NOT_STARTED) == tuple(f"gpu-node-{i}" for i in range(2, 6))
    assert sorted(p.script_patches) == ["gpu-node-0", "gpu-node-1"]
    assert p.nodes["gpu-node-2"].labels[CONFIG] == OLD
    assert any("stopping: 1 node(s) failed (budget 0)" in line for line in lines)
    assert lines[-1].startswith(f"layout {NEW}: FAILED on gpu-node-1 (")
    table_row = next(line for line in lines if line.startswith("gpu-node-1 ") and "s  " in line)
    assert "failed" in table_row and "PodDisruptionBudget team-a/train-pdb" in table_row


def test_failure_budget_tolerates_that_many_failures() -> None:
    p = pool(5, fails={"gpu-node-0": "boom", "gpu-node-2": "bang"})
    summary, _ = run(p, max_parallel=1, failure_budget=1)

    assert [r.result for r in summary.results] == [
        Result.FAILED,
        Result.SUCCESS,
        Result.FAILED,
        Result.NOT_STARTED,
        Result.NOT_STARTED,
    ]
    assert summary.exit_code == 1


def test_a_node_past_its_timeout_is_no_longer_waited_for() -> None:
    p = pool(3, stuck={"gpu-node-0"})
    summary, lines = run(p, max_parallel=1, timeout_s=60.0, failure_budget=5)

    timed_out = summary.result_of("gpu-node-0")
    assert timed_out.result is Result.TIMEOUT
    assert timed_out.elapsed_s == pytest.approx(60.0, abs=1.0)
    assert "no result after 60 s (state pending); its agent carries on" in timed_out.reason
    assert p.nodes["gpu-node-0"].labels[STATE] == "pending"  # left to its agent
    assert summary.result_of("gpu-node-1").result is Result.SUCCESS
    assert summary.exit_code == 1
    assert any("in progress: gpu-node-0 pending" in line for line in lines)  # heartbeat


def test_a_timeout_counts_as_a_failure_and_stops_new_starts() -> None:
    p = pool(3, stuck={"gpu-node-0"})
    summary, _ = run(p, max_parallel=1, timeout_s=60.0)
    assert summary.with_result(Result.NOT_STARTED) == ("gpu-node-1", "gpu-node-2")


def test_ctrl_c_reports_started_nodes_in_progress_and_starts_nothing_else() -> None:
    p = pool(6, interrupt_at=3.0)
    summary, lines = run(p, max_parallel=2)

    assert summary.interrupted and summary.exit_code == 130
    assert summary.with_result(Result.IN_PROGRESS) == ("gpu-node-0", "gpu-node-1")
    assert summary.with_result(Result.NOT_STARTED) == tuple(f"gpu-node-{i}" for i in range(2, 6))
    assert sorted(p.script_patches) == ["gpu-node-0", "gpu-node-1"]
    assert any(
        "still in progress, finishing on their own: gpu-node-0, gpu-node-1" in line
        for line in lines
    )
    assert lines[-1].startswith(f"layout {NEW}: INTERRUPTED")
    # the agents carry on by themselves
    p.interrupt_at = None
    for _ in range(10):
        p.sleep(1.0)
    assert p.nodes["gpu-node-0"].labels[STATE] == "success"


def test_state_seen_afterwards_is_fresh_not_the_old_success() -> None:
    # The old layout's success must not end the rollout: the patch clears it with the label.
    p = pool(1, stuck={"gpu-node-0"})
    summary, _ = run(p, timeout_s=30.0)
    assert summary.result_of("gpu-node-0").result is Result.TIMEOUT


def test_patch_failure_fails_that_node() -> None:
    p = pool(2)
    p.fail_patch_after = 0
    summary, _ = run(p, max_parallel=1)
    assert summary.result_of("gpu-node-0").result is Result.FAILED
    assert "could not set the layout label" in summary.result_of("gpu-node-0").reason
    assert summary.result_of("gpu-node-1").result is Result.NOT_STARTED


def test_api_outage_while_following_is_tolerated() -> None:
    p = pool(1)

    def flaky_tick() -> None:
        p.down = 2.0 <= p.now < 4.0
        if not p.down:
            Pool.tick(p)

    p.tick = flaky_tick  # type: ignore[method-assign]
    summary, _ = run(p)
    assert summary.ok


def test_label_changed_by_someone_else_fails_the_node() -> None:
    p = pool(1, stuck={"gpu-node-0"})

    def meddle() -> None:
        Pool.tick(p)
        if p.now >= 3:
            FakeCluster.patch_node(p, "gpu-node-0", labels={CONFIG: "all-balanced"})

    p.tick = meddle  # type: ignore[method-assign]
    summary, _ = run(p)
    assert summary.result_of("gpu-node-0").result is Result.FAILED
    assert "changed to 'all-balanced'" in summary.result_of("gpu-node-0").reason


# ---------------------------------------------------------------------------------------------
# Refused before anything is touched


def test_layout_typo_is_refused_before_any_patch_naming_the_known_layouts() -> None:
    p = pool(3)
    with pytest.raises(UnknownLayout) as exc:
        run(p, layout="all-1g.10gbb")
    assert "did you mean all-1g.10gb" in str(exc.value)
    # the close matches, and a count of the rest (before: all 60 names after them)
    known = len(CATALOG.layouts)
    assert f"({known} known layouts; `mig-agent validate` lists them all)" in str(exc.value)
    assert "all-balanced" not in str(exc.value)
    assert p.script_patches == []


def test_typo_exits_2_from_the_command_line_before_connecting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["repartition", "all-1g.10gbb", "gpu-node-0"]) == 2
    assert "unknown layout 'all-1g.10gbb'" in capsys.readouterr().err


def test_layout_that_does_not_fit_a_node_is_refused_up_front() -> None:
    p = pool(3)
    with pytest.raises(RolloutRefused) as exc:
        run(p, layout="all-1g.18gb")  # H200 profiles, H100 nodes
    assert set(exc.value.context["nodes"]) == set(p.nodes)  # type: ignore[arg-type]
    assert "no node was changed" in str(exc.value)
    assert "gpu-node-0: layout 'all-1g.18gb' selects none" in str(exc.value)
    assert p.script_patches == []


def test_force_goes_ahead_where_the_layout_does_not_fit() -> None:
    p = pool(1, fails={"gpu-node-0": "layout 'all-1g.18gb' selects none of this node's GPUs"})
    summary, _ = run(p, layout="all-1g.18gb", force=True)
    assert p.script_patches == ["gpu-node-0"]
    assert summary.result_of("gpu-node-0").reason.startswith("layout 'all-1g.18gb' selects none")


def test_node_busy_with_another_layout_is_refused() -> None:
    p = pool(2)
    FakeCluster.patch_node(p, "gpu-node-1", labels={CONFIG: "all-balanced", STATE: "pending"})
    with pytest.raises(RolloutRefused, match="applying layout 'all-balanced'"):
        run(p)
    assert p.script_patches == []


def test_bad_limits_are_refused() -> None:
    p = pool(1)
    for bad in ({"max_parallel": 0}, {"failure_budget": -1}, {"timeout_s": 0.0}):
        with pytest.raises(ConfigError):
            run(p, **bad)
    assert p.script_patches == []


# ---------------------------------------------------------------------------------------------
# Already applied, in flight, dry run


def test_nodes_already_at_the_layout_are_not_relabelled() -> None:
    p = pool(3)
    FakeCluster.patch_node(p, "gpu-node-1", labels={CONFIG: NEW, STATE: "success"})
    summary, lines = run(p)
    assert summary.result_of("gpu-node-1").result is Result.ALREADY_APPLIED
    assert "gpu-node-1" not in p.script_patches
    assert summary.ok
    assert any(line.endswith("gpu-node-1  already applied") for line in lines)


def test_a_failed_node_at_the_layout_is_relabelled_so_its_agent_retries() -> None:
    p = pool(1)
    FakeCluster.patch_node(
        p, "gpu-node-0", labels={CONFIG: NEW, STATE: "failed"}, annotations={REASON: "old"}
    )
    summary, _ = run(p)
    assert p.script_patches == ["gpu-node-0"]
    assert summary.ok


def test_a_node_already_applying_the_layout_is_followed_without_a_patch() -> None:
    p = pool(1)
    FakeCluster.patch_node(p, "gpu-node-0", labels={CONFIG: NEW, STATE: "pending"})
    p.started["gpu-node-0"] = 0.0
    summary, lines = run(p)
    assert p.script_patches == []
    assert summary.ok
    assert any("following: the agent is already applying this layout" in x for x in lines)


def test_dry_run_patches_nothing_and_shows_gpus_and_pods_per_node() -> None:
    p = pool(3)
    p.add_pod("team-a", "train-0", "gpu-node-0", gpu={"nvidia.com/gpu": 1})
    p.add_pod("team-a", "train-1", "gpu-node-0", gpu={"nvidia.com/gpu": 1})
    p.add_pod("team-a", "web", "gpu-node-0")  # no GPU
    FakeCluster.patch_node(p, "gpu-node-1", labels={CONFIG: NEW, STATE: "success"})
    FakeCluster.patch_node(p, "gpu-node-2", annotations={GPU_STATE: None})
    versions = {n: v.resource_version for n, v in p.nodes.items()}
    lines: list[str] = []

    previews = ops.dry_run(p, CATALOG, NEW, sorted(p.nodes), out=lines.append)

    assert {n: v.resource_version for n, v in p.nodes.items()} == versions
    assert [x.action for x in previews] == [Action.APPLY, Action.SKIP, Action.APPLY]
    assert previews[0].changed_gpus == (0, 1) and previews[0].gpu_pods == 2
    assert previews[0].created_gpu_instances == 14
    assert lines == [
        f"layout {NEW} on 3 node(s) (dry run, nothing changed):",
        "  gpu-node-0: GPU(s) 0-1 of 2 change (0 GPU instance(s) destroyed, 14 created); "
        "2 GPU pod(s) would be evicted",
        "  gpu-node-1: already applied",
        "  gpu-node-2: no GPU state published, no plan ahead; 0 GPU pod(s) would be evicted",
    ]


def test_dry_run_of_a_layout_that_changes_no_gpu_evicts_nothing() -> None:
    p = pool(1)
    p.add_pod("team-a", "train-0", "gpu-node-0", gpu={"nvidia.com/gpu": 1})
    FakeCluster.patch_node(p, "gpu-node-0", labels={CONFIG: "all-balanced"})
    (preview,) = ops.dry_run(p, CATALOG, OLD, ["gpu-node-0"], out=lambda _: None)
    assert preview.changed_gpus == () and preview.gpu_pods == 0


def test_dry_run_on_a_dra_node_counts_the_pods_that_hold_its_gpus_by_claim() -> None:
    p = pool(1)
    p.add_pod("team-a", "train-0", "gpu-node-0")  # requests no GPU: its claim holds one
    p.add_pod("team-a", "web", "gpu-node-0")
    p.slices = [_dra_slice("gpu-node-0", 1, "", "")]
    result = {"driver": "gpu.nvidia.com", "pool": "gpu-node-0", "device": "d0", "request": "r"}
    p.claims = [
        {
            "metadata": {"namespace": "team-a", "name": "c"},
            "status": {
                "allocation": {"devices": {"results": [result]}},
                "reservedFor": [{"resource": "pods", "name": "train-0", "uid": "u"}],
            },
        }
    ]
    (preview,) = ops.dry_run(p, CATALOG, NEW, ["gpu-node-0"], out=lambda _: None)
    assert preview.gpu_pods == 1


def test_dry_run_shows_refusals() -> None:
    p = pool(1)
    lines: list[str] = []
    (preview,) = ops.dry_run(p, CATALOG, "all-1g.18gb", ["gpu-node-0"], out=lines.append)
    assert preview.action is Action.REFUSE
    assert lines[1].startswith("  gpu-node-0: REFUSED: layout 'all-1g.18gb' selects none")


# ---------------------------------------------------------------------------------------------
# Selecting nodes


def test_select_nodes_by_selector_names_or_neither() -> None:
    p = pool(3)
    FakeCluster.patch_node(p, "gpu-node-1", labels={"pool": "a"})
    FakeCluster.patch_node(p, "gpu-node-2", labels={"pool": "a"})
    assert ops.select_nodes(p, selector="pool=a") == ["gpu-node-1", "gpu-node-2"]
    assert ops.select_nodes(p, ["gpu-node-2", "gpu-node-0", "gpu-node-2"]) == [
        "gpu-node-2",
        "gpu-node-0",
    ]
    with pytest.raises(ConfigError, match="no such node"):
        ops.select_nodes(p, ["gpu-node-9"])
    with pytest.raises(ConfigError, match="no node matches"):
        ops.select_nodes(p, selector="pool=b")
    with pytest.raises(ConfigError, match="not both"):
        ops.select_nodes(p, ["gpu-node-0"], "pool=a")
    with pytest.raises(ConfigError, match="name the nodes"):
        ops.select_nodes(p)


# ---------------------------------------------------------------------------------------------
# Summary and status


def test_summary_exit_codes() -> None:
    ok = ops.Summary("x", (ops.NodeResult("a", Result.SUCCESS, 1.0),))
    assert ok.exit_code == 0
    assert ops.Summary("x", (ops.NodeResult("a", Result.ALREADY_APPLIED),)).exit_code == 0
    assert ops.Summary("x", (ops.NodeResult("a", Result.TIMEOUT, 1.0),)).exit_code == 1
    assert ops.Summary("x", ok.results, interrupted=True).exit_code == 130


def _status_pool() -> Pool:
    p = pool(2)
    p.add_node("cpu-node")
    FakeCluster.patch_node(
        p, "gpu-node-1", labels={CONFIG: NEW, STATE: "failed"}, annotations={REASON: PDB_REASON}
    )
    p.patch_node_resources("gpu-node-0", {"nvidia.com/gpu": 2})
    p.patch_node_resources("gpu-node-1", {"nvidia.com/mig-1g.10gb": 7, "nvidia.com/gpu": 1})
    return p


def test_status_table_lists_gpu_nodes_only() -> None:
    lines = ops.status_table(ops.status(_status_pool()))
    assert lines[0].split() == ["NODE", "LAYOUT", "STATE", "GPUS", "RESOURCES", "REASON"]
    assert lines[1].split() == ["gpu-node-0", OLD, "success", "2xH100-80GB", "gpu=2", "-"]
    assert lines[2].split()[:5] == [
        "gpu-node-1",
        NEW,
        "failed",
        "2xH100-80GB",
        "gpu=1,mig-1g.10gb=7",
    ]
    assert lines[2].endswith(PDB_REASON)
    assert len(lines) == 3  # no cpu-node


def test_status_json() -> None:
    data = json.loads(json.dumps(ops.status_json(ops.status(_status_pool()))))
    assert [d["node"] for d in data] == ["gpu-node-0", "gpu-node-1"]
    row = data[1]
    assert row["layout"] == NEW and row["state"] == "failed" and row["reason"] == PDB_REASON
    assert row["mig_resources"] == {"nvidia.com/mig-1g.10gb": 7}
    assert row["gpus"][0] == {"index": 0, "model": "H100-80GB", "mig_enabled": False, "devices": {}}


def _dra_slice(node: str, generation: int, *profiles: str) -> dict[str, object]:
    devices = [
        {"name": f"d{i}", "attributes": {"type": {"string": "mig"}, "profile": {"string": p}}}
        if p
        else {"name": f"d{i}", "attributes": {"type": {"string": "gpu"}}}
        for i, p in enumerate(profiles)
    ]
    pool = {"name": node, "generation": generation, "resourceSliceCount": 1}
    return {
        "spec": {"driver": "gpu.nvidia.com", "nodeName": node, "pool": pool, "devices": devices}
    }


def test_status_shows_the_devices_of_a_dra_nodes_slice() -> None:
    p = _status_pool()
    p.add_node("dra-node", {CONFIG: "all-balanced", STATE: "success"})
    p.add_node("dra-only")  # no label, no GPU state: its slice makes it a GPU node
    p.slices = [
        _dra_slice("dra-node", 1, "", ""),  # stale: the plugin restarted since
        _dra_slice("dra-node", 2, "1g.10gb", "1g.10gb", "2g.20gb"),
        _dra_slice("dra-only", 1, ""),
        _dra_slice("gpu-node-0", 1, ""),  # a node with GPU resources is not asked
    ]
    rows = {r.node: r for r in ops.status(p)}
    assert rows["dra-node"].dra_devices == {"1g.10gb": 2, "2g.20gb": 1}
    assert rows["dra-only"].dra_devices == {"gpu": 1}
    assert rows["gpu-node-0"].dra_devices == {}
    lines = {line.split()[0]: line.split() for line in ops.status_table(list(rows.values()))}
    assert lines["dra-node"][3:5] == ["-", "dra:1g.10gb=2,dra:2g.20gb=1"]
    data = {d["node"]: d for d in ops.status_json(list(rows.values()))}
    assert data["dra-only"]["dra_devices"] == {"gpu": 1}


def test_status_without_the_dra_api_shows_no_dra_devices() -> None:
    from mig_agent.core.errors import KubeError

    class OldCluster(FakeCluster):
        def list_resource_slices(self, node: str = "") -> list[dict[str, object]]:
            raise KubeError("list resourceslices: 404 the server could not find it", status=404)

    p = OldCluster()
    FakeCluster.add_node(p, "gpu-node-0", {CONFIG: NEW})
    assert [r.dra_devices for r in ops.status(p)] == [{}]


def test_status_of_no_gpu_nodes() -> None:
    p = FakeCluster()
    p.add_node("cpu-node")
    assert ops.status_table(ops.status(p)) == ["no GPU nodes found"]


def test_commands_are_registered_with_the_cli() -> None:
    args = cli.build_parser().parse_args(
        ["repartition", NEW, "-l", "pool=a", "-p", "2", "--dry-run"]
    )
    assert (args.func, args.selector, args.max_parallel, args.dry_run) == (
        ops_commands.cmd_repartition,
        "pool=a",
        2,
        True,
    )
    args = cli.build_parser().parse_args(["status", "-o", "json"])
    assert args.func is ops_commands.cmd_status


def test_kube_unavailable_while_reading_state_is_bounded_by_the_timeout() -> None:
    p = pool(1, stuck={"gpu-node-0"})

    def down_tick() -> None:
        Pool.tick(p)
        p.down = p.now >= 2.0

    p.tick = down_tick  # type: ignore[method-assign]
    summary, _ = run(p, timeout_s=20.0)
    r = summary.result_of("gpu-node-0")
    assert r.result is Result.TIMEOUT and "node unreadable" in r.reason
    assert "API server unreachable" in r.reason
