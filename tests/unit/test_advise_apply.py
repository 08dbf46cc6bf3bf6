"""We test that ``advise --apply`` acts on the cluster as it is at each relabel, not as advise
read it (mig_agent.ops.advise.apply, against FakeCluster):

* a pod that lands, between the read and the relabel, on a device the change destroys skips
  the node with a reason naming the pod, the label untouched; with --allow-evict the eviction
  the proposal showed goes ahead, a PodDisruptionBudget that now forbids it skips the node;
* a relabel by someone else, before the look again or between it and the patch, is never
  overwritten;
* a served pod deleted and made again under its name (another UID) is another pod: before the
  relabel the node is skipped, after it the pod is gone, not "scheduled" as the new one is;
* the summary (lines, JSON, and the command's single JSON document) says per proposal what was
  done and what was not, and the other nodes go on.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

from mig_agent.config.profiles import load_catalog
from mig_agent.core.errors import KubeUnavailable
from mig_agent.core.scheduling import LabelSelector
from mig_agent.kube.cluster import PdbView, PodRef
from mig_agent.node.waits import Clock
from mig_agent.ops import advise as ops_advise
from mig_agent.ops.values import Result
from tests.unit.fake_cluster import FakeCluster
from tests.unit.test_advise_ops import CONFIG, MIG_1G, S, _ask_3g, _Now, _pool

CONFIG_LABEL = S.config_label


@pytest.fixture
def catalog(tmp_path: Path) -> Any:
    (tmp_path / "layouts.yaml").write_text(CONFIG)
    return load_catalog([tmp_path / "layouts.yaml"])


def _agent(
    bind: dict[str, PodRef], then: Callable[[FakeCluster, str], None] | None = None
) -> Callable[[FakeCluster], None]:
    """The agents and the scheduler at once: a node relabelled (state cleared) reaches
    success, and the pod ``bind`` names for it is scheduled there; ``then`` runs after."""

    def on_change(cluster: FakeCluster) -> None:
        for name, node in list(cluster.nodes.items()):
            if S.state_label in node.labels or node.labels.get(CONFIG_LABEL) == "all-1g.10gb":
                continue
            cluster.nodes[name] = dataclasses.replace(
                node, labels={**node.labels, S.state_label: "success"}
            )
            ref = bind.get(name)
            if ref is not None and ref in cluster.pods:
                cluster.pods[ref] = dataclasses.replace(cluster.pods[ref], node=name)
            if then is not None:
                then(cluster, name)

    return on_change


def _apply(c: FakeCluster, catalog: Any, report: ops_advise.Report) -> tuple[Any, list[str]]:
    lines: list[str] = []
    t = _Now()
    applied = ops_advise.apply(
        c, catalog, report, clock=Clock(now=t.now, sleep=t.sleep), out=lines.append, poll_s=0.1
    )
    return applied, lines


def _result(applied: Any, node: str) -> Any:
    return next(r for _, r in applied.nodes if r.node == node)


def test_a_pod_landing_on_a_device_the_change_destroys_skips_the_relabel(catalog: Any) -> None:
    c = _pool(catalog, "gpu-a", "gpu-b")
    c.add_pod("team", "busy", "gpu-a", gpu={MIG_1G: 1})
    ref = _ask_3g(c, "wants-3g")
    report = ops_advise.run(c, catalog, settings=S)
    assert [(p.node, p.option.evicts) for p in report.proposals] == [("gpu-b", ())]
    c.add_pod("team", "landed", "gpu-b", gpu={MIG_1G: 1})  # after the read
    c.on_change = _agent({"gpu-b": ref})

    applied, lines = _apply(c, catalog, report)
    assert c.nodes["gpu-b"].labels[CONFIG_LABEL] == "all-1g.10gb"
    skipped = _result(applied, "gpu-b")
    assert skipped.result is Result.NOT_STARTED
    assert skipped.reason == (
        "would now evict team/landed: bound since advise read, on a device one-3g destroys "
        "(--allow-evict)"
    )
    assert applied.exit_code == 1
    assert f"[    0.0s] gpu-b  skipped: {skipped.reason}" in lines, lines


def test_with_allow_evict_the_eviction_shown_goes_ahead_and_a_budget_now_against_it_skips(
    catalog: Any,
) -> None:
    c = _pool(catalog, "gpu-a")
    c.add_pod("team", "busy", "gpu-a", gpu={MIG_1G: 1}, labels={"app": "busy"})
    ref = _ask_3g(c, "pinned", nodeSelector={"kubernetes.io/hostname": "gpu-a"})
    report = ops_advise.run(c, catalog, settings=S, allow_evict=True)
    assert [p.option.evicts for p in report.proposals] == [("team/busy",)]

    c.pdbs.append(PdbView("team", "busy-pdb", LabelSelector({"app": "busy"}), 0))
    applied, _ = _apply(c, catalog, report)
    assert c.nodes["gpu-a"].labels[CONFIG_LABEL] == "all-1g.10gb"
    assert _result(applied, "gpu-a").reason == "PodDisruptionBudgets now forbid its evictions"

    c.pdbs.clear()
    c.on_change = _agent({"gpu-a": ref})
    applied, lines = _apply(c, catalog, report)
    assert c.nodes["gpu-a"].labels[CONFIG_LABEL] == "one-3g"
    assert _result(applied, "gpu-a").result is Result.SUCCESS, lines
    assert applied.exit_code == 0


def test_a_relabel_by_someone_else_before_the_look_again_is_not_overwritten(
    catalog: Any,
) -> None:
    c = _pool(catalog, "gpu-a")
    _ask_3g(c, "wants-3g")
    report = ops_advise.run(c, catalog, settings=S)
    c.patch_node("gpu-a", labels={CONFIG_LABEL: "all-3g"})  # someone, after the read

    applied, _ = _apply(c, catalog, report)
    assert c.nodes["gpu-a"].labels[CONFIG_LABEL] == "all-3g"
    assert _result(applied, "gpu-a").reason == (
        f"relabelled ({CONFIG_LABEL}=all-3g) meanwhile, not overwritten"
    )


class _RelabelledInTheWindow(FakeCluster):
    """Someone relabels gpu-a once advise has looked at it again, before its patch: when the
    look asks after the pod it serves."""

    also: ClassVar[Mapping[str, str]] = {}  # written with the relabel

    def get_pod(self, ref: PodRef) -> Any:
        if self.nodes["gpu-a"].labels.get(CONFIG_LABEL) == "all-1g.10gb":
            self.patch_node("gpu-a", labels={CONFIG_LABEL: "all-3g", **self.also})
        return super().get_pod(ref)


class _RelabelledAndStarted(_RelabelledInTheWindow):
    """As above, and the node's agent has taken up the new layout (state ``pending``) before
    advise's patch reaches the server."""

    also = {S.state_label: "pending"}


@pytest.mark.parametrize("world", [_RelabelledInTheWindow, _RelabelledAndStarted])
def test_a_relabel_between_the_look_again_and_the_patch_is_not_overwritten(
    catalog: Any, world: type[_RelabelledInTheWindow]
) -> None:
    """The reason is the same however far the node's agent got: the layout label is what
    someone changed, the state label only follows it."""
    pool = _pool(catalog, "gpu-a")
    c = world(nodes=pool.nodes, pods=pool.pods)
    c.patch_node("gpu-a", labels={S.state_label: "success"})
    _ask_3g(c, "wants-3g")
    report = ops_advise.run(c, catalog, settings=S)

    applied, _ = _apply(c, catalog, report)
    assert c.nodes["gpu-a"].labels[CONFIG_LABEL] == "all-3g"
    assert _result(applied, "gpu-a").reason == (
        f"relabelled ({CONFIG_LABEL}=all-3g) meanwhile, not overwritten"
    )


def test_a_served_pod_made_again_before_the_relabel_skips_it(catalog: Any) -> None:
    c = _pool(catalog, "gpu-a", "gpu-b")
    old = _ask_3g(c, "wants-3g")
    report = ops_advise.run(c, catalog, settings=S)
    del c.pods[old]
    _ask_3g(c, "wants-3g")  # made again: the same name, another UID, pending too

    applied, _ = _apply(c, catalog, report)
    assert c.nodes["gpu-a"].labels[CONFIG_LABEL] == "all-1g.10gb"
    assert "team/wants-3g is gone (deleted, or made again under another UID)" in (
        _result(applied, "gpu-a").reason
    )


def test_a_served_pod_made_again_after_the_relabel_is_gone_not_scheduled(catalog: Any) -> None:
    c = _pool(catalog, "gpu-a", "gpu-b")
    old = _ask_3g(c, "wants-3g")
    report = ops_advise.run(c, catalog, settings=S)

    def made_again(cluster: FakeCluster, _node: str) -> None:
        if old in cluster.pods:
            del cluster.pods[old]
            new = _ask_3g(cluster, "wants-3g")
            cluster.pods[new] = dataclasses.replace(cluster.pods[new], node="gpu-b")

    c.on_change = _agent({}, then=made_again)
    applied, lines = _apply(c, catalog, report)
    assert "  team/wants-3g: scheduled on gpu-b" not in lines, lines
    assert [(p.pod, p.uid, p.node, p.result) for p in applied.pods] == [
        ("team/wants-3g", old.uid, "", "gone (deleted, or made again)")
    ]


def test_a_partial_apply_ends_with_what_was_done_and_what_was_not(catalog: Any) -> None:
    c = _pool(catalog, "gpu-a", "gpu-b", "gpu-c")
    refs = {n: _ask_3g(c, f"for-{n}", nodeSelector={"kubernetes.io/hostname": n}) for n in c.nodes}
    report = ops_advise.run(c, catalog, settings=S)
    assert [p.node for p in report.proposals] == ["gpu-a", "gpu-b", "gpu-c"]
    c.add_pod("team", "landed", "gpu-a", gpu={MIG_1G: 1})
    c.patch_node("gpu-b", labels={CONFIG_LABEL: "all-3g"})
    c.on_change = _agent(refs)

    applied, lines = _apply(c, catalog, report)
    assert c.nodes["gpu-c"].labels[CONFIG_LABEL] == "one-3g"
    summary = lines[lines.index("advise --apply: 1 of 3 relabel(s) done") :]
    text = "\n".join(summary)
    assert "gpu-a" in text and "would now evict team/landed" in text
    assert f"gpu-b  one-3g  not started  relabelled ({CONFIG_LABEL}=all-3g)" in text, text
    assert "gpu-c  one-3g  success" in text, text
    assert "  team/for-gpu-a: not followed: gpu-a not started" in summary
    assert "  team/for-gpu-c: scheduled on gpu-c" in summary
    data = ops_advise.applied_json(applied)
    assert [(n["node"], n["result"]) for n in data["nodes"]] == [
        ("gpu-a", "not started"),
        ("gpu-b", "not started"),
        ("gpu-c", "success"),
    ]
    assert data["done"] == 1 and data["ok"] is False
    assert [(p["pod"], p["node"]) for p in data["pods"]] == [
        ("team/for-gpu-a", None),
        ("team/for-gpu-b", None),
        ("team/for-gpu-c", "gpu-c"),
    ]


class _Closable(FakeCluster):
    def close(self) -> None:
        pass


def test_the_command_prints_one_json_document_with_the_apply_and_progress_on_stderr(
    catalog: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mig_agent import cli
    from mig_agent.cli import advise_command

    pool = _pool(catalog, "gpu-a", "gpu-b")
    c = _Closable(nodes=pool.nodes, pods=pool.pods)
    refs = {n: _ask_3g(c, f"for-{n}", nodeSelector={"kubernetes.io/hostname": n}) for n in c.nodes}
    c.on_change = _agent(refs)
    real_run = ops_advise.run

    def run_then_relabel(*a: Any, **kw: Any) -> ops_advise.Report:
        report = real_run(*a, **kw)
        c.patch_node("gpu-a", labels={CONFIG_LABEL: "all-3g"})  # someone, after the read
        return report

    (tmp_path / "layouts.yaml").write_text(CONFIG)
    args = cli.build_parser().parse_args(
        ["advise", "--apply", "-f", str(tmp_path / "layouts.yaml"), "-o", "json"]
    )
    lines: list[str] = []
    monkeypatch.setattr(ops_advise, "run", run_then_relabel)
    assert advise_command.run(args, lambda _a: c, lines.append) == 1
    [doc] = lines
    data = json.loads(doc)
    assert [p["to"] for p in data["proposals"]] == ["one-3g", "one-3g"]
    assert [(n["node"], n["result"]) for n in data["apply"]["nodes"]] == [
        ("gpu-a", "not started"),
        ("gpu-b", "success"),
    ]
    assert "skipped: relabelled" in capsys.readouterr().err
    assert c.nodes["gpu-a"].labels[CONFIG_LABEL] == "all-3g"


def test_a_generated_layout_proposed_is_applied_with_the_layouts_searched(
    catalog: Any, tmp_path: Path
) -> None:
    c = _pool(catalog, "gpu-a")  # H100s at all-1g.10gb
    ref = _ask_3g(c, "wants-3g")
    (tmp_path / "a100.yaml").write_text(
        "version: v1\nmig-configs:\n  a100-only:\n    - device-filter: '0x20B010DE'\n"
        "      devices: all\n      mig-enabled: true\n      mig-devices: {'1g.5gb': 7}\n"
    )
    a100_only = load_catalog([tmp_path / "a100.yaml"])
    report = ops_advise.run(c, a100_only, settings=S, generated=True)
    [proposal] = report.proposals
    assert proposal.option.layout not in a100_only.layouts
    c.on_change = _agent({"gpu-a": ref})

    applied, lines = _apply(c, a100_only, report)
    assert c.nodes["gpu-a"].labels[CONFIG_LABEL] == proposal.option.layout, lines
    assert applied.exit_code == 0


class _OnePodUnreadable(FakeCluster):
    def get_pod(self, ref: PodRef) -> Any:
        if ref.name == "for-gpu-a":
            raise KubeUnavailable("read pod: 503 (fake)")
        return super().get_pod(ref)


def test_a_node_that_cannot_be_looked_at_again_is_skipped_and_the_others_go_on(
    catalog: Any,
) -> None:
    pool = _pool(catalog, "gpu-a", "gpu-b")
    c = _OnePodUnreadable(nodes=pool.nodes, pods=pool.pods)
    refs = {n: _ask_3g(c, f"for-{n}", nodeSelector={"kubernetes.io/hostname": n}) for n in c.nodes}
    report = ops_advise.run(c, catalog, settings=S)
    c.on_change = _agent(refs)

    applied, lines = _apply(c, catalog, report)
    assert c.nodes["gpu-a"].labels[CONFIG_LABEL] == "all-1g.10gb"
    assert _result(applied, "gpu-a").reason == "could not look at it again: read pod: 503 (fake)"
    assert c.nodes["gpu-b"].labels[CONFIG_LABEL] == "one-3g"
    assert _result(applied, "gpu-b").result is Result.SUCCESS, lines
