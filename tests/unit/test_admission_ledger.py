"""We test the MIG layout check's ledger (mig_agent.core.admission_ledger, kept on the Workload
and read back every round) against the findings it answers, each a test that failed before:

1. a Ready workload's promise stays where it was made: the next round does not place it again
   elsewhere and promise its devices to another;
2. an admitted workload's pods still to bind hold their own pod set's kind, not the kinds of
   the wants that come after the bound ones;
3. a relabel whose node write failed (503) is written again the next round;
4. a node relabelled away by someone else is dropped, the workload searched again (and kept
   off that node), the message saying so;
6. malformed check annotations refuse the check by name (inactive, an Event), never a default;
7. verify runs only on the relabelled nodes its pods are placed on, and a node that fails it
   does not hold the workload when another node serves it;
8. advise leaves alone the nodes the check promised.
(5, one leader at a time, is tested in test_admission_leadership.py.)
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from mig_agent.config.profiles import load_catalog
from mig_agent.core import admission_ledger as ledger
from mig_agent.core.errors import KubeError
from mig_agent.ops import advise as advise_ops
from mig_agent.ops.admission_check import run_round
from tests.unit.test_admission_check_ops import (
    CHECK,
    CONTROLLER,
    MIG_1G,
    MIG_3G,
    KueueFake,
    S,
    _at,
    _entry,
    _notes,
    _pool,
    _verdict,
    _workload,
)
from tests.unit.test_kueue_demand import CONFIG

HOST = "kubernetes.io/hostname"


@pytest.fixture
def catalog(tmp_path: Path) -> Any:
    (tmp_path / "layouts.yaml").write_text(CONFIG)
    return load_catalog([tmp_path / "layouts.yaml"])


def _second_node(c: KueueFake, catalog: Any, layout: str = "all-1g.10gb") -> None:
    c.add_node("gpu-b", {HOST: "host-b"}, {MIG_1G: "7"})
    _at(c, catalog, "gpu-b", layout)


def _pinned(c: KueueFake, name: str) -> dict[str, str]:
    """pod set -> the hostname the workload's podSetUpdates pin it to."""
    return {
        u["name"]: u["nodeSelector"][HOST]
        for u in _entry(c, name).get("podSetUpdates") or ()
        if "nodeSelector" in u
    }


def _round(c: KueueFake, catalog: Any, **kw: Any) -> Any:
    return run_round(c, catalog, S, controller_name=CONTROLLER, **kw)


def _pairs(name: str, pods: int) -> dict[str, Any]:
    """A workload of ``pods`` pods asking two 1g.10gb each."""
    w = _workload(name, pods, MIG_1G)
    two = {MIG_1G: "2"}
    w["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"] = {
        "requests": two,
        "limits": two,
    }
    return w


def test_a_ready_workloads_promise_is_kept_where_it_was_made(catalog: Any) -> None:
    c = _pool(catalog, _pairs("first", 1))
    _round(c, catalog)
    assert _pinned(c, "first") == {"main": "host-a"}
    assert json.loads(_notes(c, "first")[ledger.PROMISE]) == {"main": {"gpu-a": 1}}
    # another node joins and a pod outside Kueue takes a device of gpu-a: a search afresh
    # would now put first on gpu-b (the fullest) and count gpu-a's six left as free
    _second_node(c, catalog)
    c.add_pod("team", "other", "gpu-a", gpu={MIG_1G: 1})
    c.kueue["workloads"].append(_pairs("second", 5))  # ten devices: all there are
    r = _round(c, catalog)
    assert {d.workload: d.verdict.value for d in r.decisions} == {
        "team/first": "Ready",
        "team/second": "Ready",
    }
    assert r.decisions[0].placed == {"team/first[main/0]": "gpu-a"}
    assert _pinned(c, "first") == {"main": "host-a"}
    # four devices left on gpu-a beside first's two: two pods of second there, no more
    assert Counter(r.decisions[1].placed.values()) == {"gpu-a": 2, "gpu-b": 3}


def test_a_ready_workloads_promise_gone_with_its_node_is_placed_afresh(catalog: Any) -> None:
    c = _pool(catalog, _workload("first", 1, MIG_1G))
    _round(c, catalog)
    assert _pinned(c, "first") == {"main": "host-a"}
    _second_node(c, catalog)
    c.add_pod("team", "busy", "gpu-a", gpu={MIG_1G: 7})  # every device of gpu-a taken
    [d] = _round(c, catalog).decisions
    assert d.verdict.value == "Ready" and d.placed == {"team/first[main/0]": "gpu-b"}
    assert _pinned(c, "first") == {"main": "host-b"}
    assert json.loads(_notes(c, "first")[ledger.PROMISE]) == {"main": {"gpu-b": 1}}


def _two_sets(name: str) -> dict[str, Any]:
    """A workload of two pod sets: ``big`` (one pod, a 3g.40gb) and ``small`` (one, 1g.10gb)."""
    w = _workload(name, 1, MIG_3G)
    small = json.loads(json.dumps(w["spec"]["podSets"][0]))
    small["name"] = "small"
    small["template"]["spec"]["containers"][0]["resources"] = {
        "requests": {MIG_1G: "1"},
        "limits": {MIG_1G: "1"},
    }
    w["spec"]["podSets"][0]["name"] = "big"
    w["spec"]["podSets"].append(small)
    return w


def test_an_admitted_workloads_unbound_pods_hold_their_own_kinds(catalog: Any) -> None:
    first = _two_sets("first")
    c = _pool(catalog, first)
    _at(c, catalog, "gpu-a", "all-3g")
    _second_node(c, catalog)
    c.add_pod("team", "busy", "gpu-a", gpu={MIG_3G: 1})  # one 3g.40gb left, on gpu-a
    [d] = _round(c, catalog).decisions
    assert d.verdict.value == "Ready", d
    [w] = c.kueue["workloads"]
    w["status"]["conditions"][1] = {"type": "Admitted", "status": "True"}
    # its small pod is bound; its big pod is not, and holds the last 3g.40gb
    labels = {u["name"]: u["labels"] for u in _entry(c, "first")["podSetUpdates"]}
    c.add_pod("team", "first-small", "gpu-b", gpu={MIG_1G: 1}, labels=labels["small"])
    c.kueue["workloads"].append(_workload("second", 1, MIG_3G))
    [d] = _round(c, catalog).decisions
    assert (d.workload, d.verdict.value) == ("team/second", "Wait"), d
    assert _entry(c, "second")["state"] == "Pending"


def test_a_relabel_whose_node_write_failed_is_written_again(catalog: Any) -> None:
    c = _pool(catalog, _workload("train", 2, MIG_3G))
    real = c.patch_node
    refused: list[str] = []

    def once_503(name: str, **kw: Any) -> Any:
        if not refused:
            refused.append(name)
            raise KubeError("patch node: 503 Service Unavailable", status=503)
        return real(name, **kw)

    c.patch_node = once_503  # type: ignore[method-assign]
    r = _round(c, catalog)
    assert "team/train" in r.skipped and refused == ["gpu-a"]
    assert c.nodes["gpu-a"].labels[S.config_label] == "all-1g.10gb"
    [d] = _round(c, catalog).decisions
    assert d.verdict.value == "Relabel", d
    assert d.message == "relabelling gpu-a to all-3g again for it (the last write did not land)"
    assert c.nodes["gpu-a"].labels[S.config_label] == "all-3g"
    assert "landed" not in json.loads(_notes(c, "train")[ledger.RELABELS])["gpu-a"]


def test_a_node_relabelled_away_is_dropped_and_the_workload_searched_again(
    catalog: Any,
) -> None:
    c = _pool(catalog, _workload("train", 2, MIG_3G))
    _second_node(c, catalog)
    [d] = _round(c, catalog).decisions
    [first] = d.relabels
    other = "gpu-b" if first == "gpu-a" else "gpu-a"
    node = c.nodes[first]  # someone else relabels it to a layout of their own
    c.nodes[first] = dataclasses.replace(node, labels={**node.labels, S.config_label: "mine"})
    [d] = _round(c, catalog).decisions
    assert d.verdict.value == "Relabel" and set(d.relabels) == {other}, d
    assert d.message.startswith(
        f"{first} was relabelled to mine meanwhile, not by this check: searched again; "
    ), d.message
    assert c.nodes[other].labels[S.config_label] == "all-3g"
    assert c.nodes[first].labels[S.config_label] == "mine"  # never relabelled back
    assert set(json.loads(_notes(c, "train")[ledger.RELABELS])) == {other}
    assert first in json.loads(_notes(c, "train")[ledger.AVOID])


def test_a_deleted_node_is_dropped_and_the_workload_searched_again(catalog: Any) -> None:
    c = _pool(catalog, _workload("train", 2, MIG_3G))
    _round(c, catalog)
    del c.nodes["gpu-a"]
    _second_node(c, catalog)
    [d] = _round(c, catalog).decisions
    assert d.verdict.value == "Relabel" and set(d.relabels) == {"gpu-b"}, d
    assert "gpu-a left the pool (deleted, or no longer selected): searched again" in d.message


@pytest.mark.parametrize(
    ("notes", "named"),
    [
        ({"mig-agent.dev/max-nodes": "0"}, "mig-agent.dev/max-nodes: '0'"),
        ({"mig-agent.dev/max-nodes": "2.0"}, "mig-agent.dev/max-nodes: '2.0'"),
        ({"mig-agent.dev/max-nodes": "two"}, "mig-agent.dev/max-nodes: 'two'"),
        ({"mig-agent.dev/allow-evict": "yes"}, "mig-agent.dev/allow-evict: 'yes'"),
        ({"mig-agent.dev/verify": "1"}, "mig-agent.dev/verify: '1'"),
    ],
)
def test_a_malformed_check_annotation_refuses_the_check_by_name(
    catalog: Any, notes: dict[str, str], named: str
) -> None:
    c = _pool(catalog, _workload("train", 2, MIG_3G))
    c.kueue["admissionchecks"][0]["metadata"]["annotations"] = notes
    r = _round(c, catalog)
    assert r.decisions == () and r.activated == ()
    assert named in r.refused[CHECK]
    [active] = c.kueue["admissionchecks"][0]["status"]["conditions"]
    assert (active["status"], active["reason"]) == ("False", "InvalidParameters")
    assert named in active["message"]
    assert c.nodes["gpu-a"].labels[S.config_label] == "all-1g.10gb"  # nothing relabelled
    [(name, reason, message, warning)] = c.object_events
    assert (name, reason, warning) == (CHECK, "InvalidParameters", True) and named in message
    _round(c, catalog)
    assert len(c.object_events) == 1  # said once
    c.kueue["admissionchecks"][0]["metadata"]["annotations"] = {}  # mended
    r = _round(c, catalog)
    assert r.activated == (CHECK,) and r.decisions[0].verdict.value == "Relabel"


def test_verify_runs_only_where_the_pods_go(catalog: Any) -> None:
    w = _workload("train", 1, MIG_3G)
    target = {"layout": "all-3g", "resources": {MIG_3G: 2}, "before": "all-1g.10gb"}
    w["metadata"]["annotations"] = {ledger.RELABELS: json.dumps({"gpu-a": target, "gpu-b": target})}
    c = _pool(catalog, w)
    c.kueue["admissionchecks"][0]["metadata"]["annotations"] = {"mig-agent.dev/verify": "true"}
    _at(c, catalog, "gpu-a", "all-3g")
    _second_node(c, catalog, "all-3g")
    asked: list[str] = []

    def verify(node: str) -> Any:
        asked.append(node)
        return _verdict(node, True)

    [d] = _round(c, catalog, verify=verify).decisions
    assert d.verdict.value == "Ready", d
    assert asked == sorted(set(d.placed.values())) and len(asked) == 1


def test_a_node_failing_verify_does_not_hold_a_workload_another_node_serves(
    catalog: Any,
) -> None:
    w = _workload("train", 2, MIG_3G)
    target = {"layout": "all-3g", "resources": {MIG_3G: 2}, "before": "all-1g.10gb"}
    w["metadata"]["annotations"] = {ledger.RELABELS: json.dumps({"gpu-a": target})}
    c = _pool(catalog, w)
    c.kueue["admissionchecks"][0]["metadata"]["annotations"] = {"mig-agent.dev/verify": "true"}
    _at(c, catalog, "gpu-a", "all-3g")
    _second_node(c, catalog, "all-3g")
    c.add_pod("team", "busy", "gpu-b", gpu={MIG_3G: 2})  # gpu-b full for now
    asked: list[str] = []

    def verify(node: str) -> Any:
        asked.append(node)
        return _verdict(node, node != "gpu-a")

    [d] = _round(c, catalog, verify=verify).decisions
    assert d.verdict.value == "Retry" and asked == ["gpu-a"]
    [wl] = c.kueue["workloads"]  # Kueue queues it again; gpu-b is free meanwhile
    wl["status"]["admissionChecks"][0].update(state="Pending", retryCount=1)
    c.pods = {ref: p for ref, p in c.pods.items() if ref.name != "busy"}
    [d] = _round(c, catalog, verify=verify).decisions
    assert d.verdict.value == "Ready" and set(d.placed.values()) == {"gpu-b"}, d
    assert asked == ["gpu-a"]  # gpu-b was not relabelled for it: nothing to verify
    assert _pinned(c, "train") == {"main": "host-b"}


def test_retry_asks_kueue_to_wait_longer_each_time() -> None:
    assert [ledger.retry_after(n) for n in range(8)] == [15, 30, 60, 120, 240, 480, 600, 600]


def test_advise_leaves_alone_the_nodes_the_check_promised(catalog: Any) -> None:
    c = _pool(catalog, _workload("first", 1, MIG_1G))
    _round(c, catalog)
    assert _pinned(c, "first") == {"main": "host-a"}
    c.add_pod("team", "wants-3g", "", gpu={MIG_3G: 1})
    c.pods = {
        ref: dataclasses.replace(p, phase="Pending") if ref.name == "wants-3g" else p
        for ref, p in c.pods.items()
    }
    report = advise_ops.run(c, catalog, settings=S)
    assert report.proposals == ()
    assert "promised" in report.left_alone["gpu-a"] and "team/first" in report.left_alone["gpu-a"]
    # first is served where it was promised: no demand of advise's, nothing unserved
    assert [pod for pod, _ in report.unserved] == ["team/wants-3g"], report.unserved
    assert "team/first" not in report.workloads


def test_the_ledger_reads_what_it_writes() -> None:
    intents = {"n": ledger.Intent("all-3g", {MIG_3G: 2}, "all-1g.10gb", False)}
    w = {"metadata": {"annotations": {ledger.RELABELS: ledger.intents_value(intents)}}}
    assert ledger.intents_of(w) == intents
    assert ledger.intents_of({"metadata": {"annotations": {ledger.RELABELS: "[1]"}}}) == {}
    assert ledger.fate(intents["n"], "all-1g.10gb", True) is ledger.Fate.UNWRITTEN
    assert ledger.fate(intents["n"], "all-3g", True) is ledger.Fate.ONWARD
    assert ledger.fate(intents["n"], "other", True) is ledger.Fate.AWAY
    assert ledger.fate(intents["n"], "all-3g", False) is ledger.Fate.GONE
    landed = ledger.landed(intents, ["n"])["n"]
    assert ledger.fate(landed, "all-1g.10gb", True) is ledger.Fate.AWAY  # back by hand
    now = datetime(2026, 12, 7, tzinfo=UTC).timestamp()
    later = (datetime(2026, 12, 7, tzinfo=UTC) + timedelta(minutes=5)).timestamp()
    w = {"metadata": {"annotations": {ledger.AVOID: ledger.avoid_value({}, {"n": "why"}, later)}}}
    assert ledger.avoided(w, now) == {"n": "why"} and ledger.avoided(w, later) == {}
    assert ledger.failed_verify(w) == {"n"}


# found by the model (test_admission_model.py), each failing before its fix


def test_a_node_labelled_for_a_layout_its_gpus_do_not_hold_yet_serves_nothing(
    catalog: Any,
) -> None:
    """Relabelled by someone a moment ago, its agent not begun: its devices are about to go."""
    c = _pool(catalog, _workload("small", 1, MIG_1G))
    node = c.nodes["gpu-a"]
    c.nodes["gpu-a"] = dataclasses.replace(node, labels={**node.labels, S.config_label: "all-3g"})
    [d] = _round(c, catalog).decisions
    assert d.verdict.value == "Wait", d
    assert _entry(c, "small")["state"] == "Pending"


def test_an_admitted_workload_whose_promised_devices_are_gone_is_requeued(
    catalog: Any,
) -> None:
    c = _pool(catalog, _workload("first", 2, MIG_1G))
    _round(c, catalog)
    [w] = c.kueue["workloads"]
    w["status"]["conditions"][1] = {"type": "Admitted", "status": "True"}
    _at(c, catalog, "gpu-a", "all-3g")  # someone else's relabel: no 1g.10gb left
    r = _round(c, catalog)
    [d] = r.decisions
    assert (d.workload, d.verdict.value) == ("team/first", "Retry"), d
    assert _entry(c, "first")["state"] == "Retry"
    assert "the devices promised to its pods still to start are gone: gpu-a" in d.message
    assert ledger.PROMISE not in _notes(c, "first")


def test_a_check_whose_active_mark_fails_does_not_end_the_round(catalog: Any) -> None:
    c = _pool(catalog, _workload("small", 1, MIG_1G))
    real = c.patch_kueue
    refused: list[str] = []

    def once_503(plural: str, name: str, body: Any, **kw: Any) -> Any:
        if plural == "admissionchecks" and not refused:
            refused.append(name)
            raise KubeError("patch: 503 Service Unavailable", status=503)
        return real(plural, name, body, **kw)

    c.patch_kueue = once_503  # type: ignore[method-assign]
    r = _round(c, catalog)
    assert refused == [CHECK] and r.activated == ()
    assert [d.verdict.value for d in r.decisions] == ["Ready"]
    assert _round(c, catalog).activated == (CHECK,)  # marked on the next round


def test_a_promise_and_pins_written_apart_are_brought_together(catalog: Any) -> None:
    """Found by the model: the promise is written before the entry; a status write refused
    after it (409) left the promise on gpu-b and the pins on gpu-a, and the next rounds,
    finding the promise kept, never wrote the pins again."""
    c = _pool(catalog, _workload("first", 1, MIG_1G))
    _second_node(c, catalog)
    _round(c, catalog)
    assert _pinned(c, "first") == {"main": "host-a"}
    node = c.nodes["gpu-a"]  # someone relabels gpu-a: first's device is about to go
    c.nodes["gpu-a"] = dataclasses.replace(node, labels={**node.labels, S.config_label: "all-3g"})
    real = c.patch_kueue

    def status_409(plural: str, name: str, body: Any, **kw: Any) -> Any:
        if kw.get("status"):
            raise KubeError("patch workload status: 409 Conflict", status=409)
        return real(plural, name, body, **kw)

    c.patch_kueue = status_409  # type: ignore[method-assign]
    r = _round(c, catalog)
    assert "team/first" in r.skipped
    assert json.loads(_notes(c, "first")[ledger.PROMISE]) == {"main": {"gpu-b": 1}}
    assert _pinned(c, "first") == {"main": "host-a"}  # apart
    c.patch_kueue = real  # type: ignore[method-assign]
    _round(c, catalog)
    assert _pinned(c, "first") == {"main": "host-b"}
