"""``advise --apply`` looks at a Kueue workload again before the relabel made for it
(mig_agent.ops.advise): the workload its proposal serves must still be the one read (by UID)
and still wait on its admission checks; one admitted meanwhile (served elsewhere), deleted,
made again under another UID, or held back by quota now, leaves the node as it is, the
summary naming the workload and why. A workload still waiting is relabelled for, as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from mig_agent.node.waits import Clock
from mig_agent.ops import advise as ops_advise
from tests.unit.fake_cluster import FakeCluster
from tests.unit.test_kueue_demand import (
    ADMITTED,
    FOR_QUOTA,
    MIG_3G,
    RESERVED,
    S,
    _pool,
    _workload,
    catalog,
)

__all__ = ["catalog"]  # the fixture


def _train(uid: str = "uid-1", conditions: list[dict[str, str]] = RESERVED) -> dict[str, Any]:
    w = _workload("train", ("main", 2, {MIG_3G: 1}), conditions=conditions)
    w["metadata"]["uid"] = uid
    return w


def _apply(c: FakeCluster, catalog: Any, report: Any) -> tuple[Any, list[str]]:
    t = [0.0]
    clock = Clock(now=lambda: t[0], sleep=lambda s: t.__setitem__(0, t[0] + s))
    lines: list[str] = []
    applied = ops_advise.apply(c, catalog, report, clock=clock, out=lines.append, poll_s=0.1)
    return applied, lines


@pytest.mark.parametrize(
    ("now", "why"),
    [
        (
            [_train(conditions=ADMITTED)],
            "workload team/train no longer waits on its admission checks (admitted)",
        ),
        ([], "workload team/train is gone (deleted, or made again under another UID)"),
        (
            [_train("uid-2")],
            "workload team/train is gone (deleted, or made again under another UID)",
        ),
        ([_train(conditions=FOR_QUOTA)], "workload team/train no longer waits on its admission"),
    ],
    ids=["admitted", "deleted", "made-again", "for-quota"],
)
def test_a_workload_that_no_longer_waits_is_not_relabelled_for(
    catalog: Any, now: list[dict[str, Any]], why: str
) -> None:
    c = _pool(catalog, "gpu-a")
    c.kueue["workloads"] = [_train()]
    report = ops_advise.run(c, catalog, settings=S)
    assert [p.node for p in report.proposals] == ["gpu-a"]
    c.kueue["workloads"] = now  # meanwhile
    applied, lines = _apply(c, catalog, report)
    assert c.nodes["gpu-a"].labels[S.config_label] == "all-1g.10gb"
    [(_, result)] = applied.nodes
    assert result.result.value == "not started", lines
    assert why in result.reason, result.reason


def test_a_workload_still_waiting_is_relabelled_for(catalog: Any) -> None:
    c = _pool(catalog, "gpu-a")
    c.kueue["workloads"] = [_train()]

    def agent(cluster: FakeCluster) -> None:
        node = cluster.nodes["gpu-a"]
        if node.labels.get(S.config_label) == "all-3g" and S.state_label not in node.labels:
            cluster.nodes["gpu-a"] = dataclasses.replace(
                node, labels={**node.labels, S.state_label: "success"}
            )

    c.on_change = agent
    report = ops_advise.run(c, catalog, settings=S)
    applied, lines = _apply(c, catalog, report)
    assert c.nodes["gpu-a"].labels[S.config_label] == "all-3g"
    assert applied.exit_code == 0, lines
