"""We test one leader at a time for as long as a round lasts (mig_agent.ops.leadership), the
fifth finding of the check's ledger issue: the Lease was renewed only between rounds, so a
round that waited minutes on verify's pods went on writing after a second replica had taken
the Lease over.

* the keeper says the Lease is held only within two thirds of its duration of the last
  renewal that succeeded; a renewal refused (another holds it) ends it at once; one
  unanswered leaves what was renewed to run out;
* a cluster wrapped by ``leading`` confirms before every write (reads pass);
* a round whose verify outlasts the Lease writes nothing after it: the leadership lost stops
  the round before the workload's state is written, and the next leader's round (a fresh
  call) verifies and writes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mig_agent.config.profiles import load_catalog
from mig_agent.core.errors import KubeUnavailable, LeadershipLost
from mig_agent.ops.admission_check import run_round
from mig_agent.ops.leadership import LeaseKeeper, leading
from tests.unit.test_admission_check_ops import (
    CONTROLLER,
    MIG_3G,
    S,
    _at,
    _entry,
    _pool,
    _verdict,
    _workload,
)
from tests.unit.test_kueue_demand import CONFIG


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def catalog(tmp_path: Path) -> Any:
    (tmp_path / "layouts.yaml").write_text(CONFIG)
    return load_catalog([tmp_path / "layouts.yaml"])


def test_the_lease_is_held_only_within_its_renew_deadline() -> None:
    clock, answers = Clock(), [True]

    def hold() -> bool:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return bool(answer)

    keeper = LeaseKeeper(hold, 30, clock)
    assert not keeper.holds()
    with pytest.raises(LeadershipLost):
        keeper.confirm()
    assert keeper.attempt()
    clock.t += 19.9
    keeper.confirm()
    clock.t += 0.2  # past 20 s (2/3 of 30) without a renewal
    assert not keeper.holds()
    answers += [True, KubeUnavailable("unreachable"), False]
    assert keeper.attempt()
    clock.t += 10
    assert keeper.attempt()  # unanswered: what was renewed 10 s ago still holds
    clock.t += 9
    assert keeper.holds()
    assert not keeper.attempt()  # refused: another replica holds it now
    assert not keeper.holds()


def test_a_leading_cluster_confirms_before_every_write(catalog: Any) -> None:
    c = _pool(catalog, _workload("train", 2, MIG_3G))
    held = [True]

    def confirm() -> None:
        if not held[0]:
            raise LeadershipLost("lost")

    lead = leading(c, confirm)
    held[0] = False
    assert lead.list_kueue("workloads") == c.kueue["workloads"]  # a read passes
    with pytest.raises(LeadershipLost):
        lead.patch_node("gpu-a", labels={S.config_label: "all-3g"})
    with pytest.raises(LeadershipLost):
        run_round(lead, catalog, S, controller_name=CONTROLLER)
    assert c.nodes["gpu-a"].labels[S.config_label] == "all-1g.10gb"


def test_a_round_whose_verify_outlasts_the_lease_writes_nothing_after(catalog: Any) -> None:
    c = _pool(catalog, _workload("train", 2, MIG_3G))
    c.kueue["admissionchecks"][0]["metadata"]["annotations"] = {"mig-agent.dev/verify": "true"}
    clock = Clock()
    keeper = LeaseKeeper(lambda: True, 30, clock)
    keeper.attempt()
    lead = leading(c, keeper.confirm)
    run_round(lead, catalog, S, controller_name=CONTROLLER)  # the relabel, as leader
    _at(c, catalog, "gpu-a", "all-3g")
    asked: list[str] = []

    def slow_verify(node: str) -> Any:  # its pods take longer than the Lease holds
        asked.append(node)
        clock.t += 45
        return _verdict(node, True)

    writes = c.writes
    with pytest.raises(LeadershipLost):
        run_round(lead, catalog, S, controller_name=CONTROLLER, verify=slow_verify)
    assert asked == ["gpu-a"] and c.writes == writes
    assert _entry(c, "train")["state"] == "Pending"
    # the next leader carries on from what is on the objects
    [d] = run_round(c, catalog, S, controller_name=CONTROLLER, verify=slow_verify).decisions
    assert d.verdict.value == "Ready" and asked == ["gpu-a", "gpu-a"]
    assert _entry(c, "train")["state"] == "Ready"
