"""We test the node guard's pure core (mig_agent.core.guard): the record as the node keeps it
(round trip, the annotation's size cap, what a bad annotation is told apart by), what a pass
adds to it, and the decision drawn from it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mig_agent.core.guard import (
    RECORD_CAP,
    BadRecord,
    Facts,
    Owed,
    Record,
    decide,
    drain_failing_for,
    merged,
    parse,
)

NAMES = st.lists(st.from_regex(r"[a-z]{1,8}/[a-z0-9-]{1,20}", fullmatch=True), max_size=5)
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=60)


def _facts(**kw: object) -> Facts:
    base: dict[str, object] = {
        "gpus_now": "d1",
        "proven": False,
        "present": frozenset(),
        "now": 1000.0,
        "give_up_s": 100.0,
        "advertiser": "the device plugin",
    }
    return Facts(**{**base, **kw})  # type: ignore[arg-type]


@given(
    layout=st.from_regex(r"[a-z0-9.-]{0,20}", fullmatch=True),
    gpus=st.sampled_from(["", "d0", "unknown"]),
    evicted=NAMES,
    since=st.none() | st.floats(0, 2e9),
    given_up=NAMES,
    why=TEXT,
    given_up_why=TEXT,
)
def test_a_record_reads_back_as_written(
    layout: str,
    gpus: str,
    evicted: list[str],
    since: float | None,
    given_up: list[str],
    why: str,
    given_up_why: str,
) -> None:
    record = Record(layout, gpus, tuple(evicted), since, tuple(given_up), why, given_up_why)
    back = parse(record.to_json())
    expected_since = None if since is None else round(since, 3)
    assert back == Record(
        layout, gpus, tuple(evicted), expected_since, tuple(given_up), why, given_up_why
    )


def test_a_record_of_long_words_fits_the_policys_cap_and_keeps_what_the_guard_decides_from() -> (
    None
):
    pods = tuple(f"team-{i:02d}/trainer-with-a-long-name-{i:03d}" for i in range(40))
    record = Record("all-1g.10gb", "d0", pods, 5.0, pods[:3], "w" * 5000, "c" * 5000)
    text = record.to_json()
    assert len(text) <= RECORD_CAP
    back = parse(text)
    assert (back.gpus, back.evicted, back.drain_since, back.given_up) == ("d0", pods, 5.0, pods[:3])
    short = parse(Record("x", "d0", (), None, ("a/b",), "w" * 5000, "c" * 5000).to_json())
    assert 0 < len(short.why) < 5000 and 0 < len(short.given_up_why) < 5000


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{", "not JSON"),
        ("[]", "not an object with a layout"),
        ('{"layout":"x","drainSince":"soon"}', "drainSince is not a number"),
        ('{"layout":"x","evicted":"a/b"}', "evicted is not a list of pod names"),
        ('{"layout":"x","givenUpWhy":3}', "givenUpWhy is not a string"),
    ],
)
def test_a_bad_record_is_told_by_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(BadRecord, match=words):
        parse(text)


def test_a_relabel_ends_the_drains_window_and_give_up_but_not_the_gpus_nor_evicted_pods() -> None:
    record = Record("a", "d0", ("w/p",), 10.0, ("w/q",), "", "a budget")
    after = merged(record, "b", Owed())
    assert after == Record("b", "d0", ("w/p",))


def test_a_pass_adds_its_evictions_its_first_failed_drain_and_a_give_ups_cause() -> None:
    record = Record("a", "", ("w/p",), 10.0)
    after = merged(record, "a", Owed(("w/q",), 50.0, ("w/q",), "blocked by w/budget"))
    assert after.evicted == ("w/p", "w/q") and after.drain_since == 10.0  # the first kept
    assert after.given_up == ("w/q",) and after.given_up_why == "blocked by w/budget"


def test_the_gpus_changed_keep_the_cordon_until_proven_or_as_listed() -> None:
    record = Record("a", gpus="d0")
    kept = decide(record, _facts(gpus_now="d1"))
    assert not kept.schedulable and "until the device plugin advertises" in kept.why
    assert kept.record is not None and kept.record.gpus == "d0"
    assert decide(record, _facts(gpus_now="d1", proven=True)).schedulable
    back = decide(record, _facts(gpus_now="d0"))  # the GPUs are as it listed them
    assert back.schedulable and back.record is None


def test_evicted_pods_keep_the_cordon_while_present() -> None:
    record = Record("a", evicted=("w/p", "w/q"))
    kept = decide(record, _facts(present=frozenset({"w/q"})))
    assert not kept.schedulable and kept.why.endswith("w/q")
    assert kept.record is not None and kept.record.evicted == ("w/q",)
    assert decide(record, _facts()).schedulable


def test_the_drains_window_keeps_the_cordon_until_it_ends_or_is_given_up() -> None:
    record = Record("a", drain_since=950.0)
    assert not decide(record, _facts(now=1049.0)).schedulable
    assert decide(record, _facts(now=1051.0)).schedulable
    gave_up = Record("a", drain_since=950.0, given_up=("w/p",), given_up_why="a budget")
    # given up once the window ended
    verdict = decide(gave_up, _facts(now=1100.0, present=frozenset({"w/p"})))
    assert verdict.schedulable and verdict.drain_given_up == ("w/p",)
    assert verdict.record == Record("a", given_up=("w/p",), given_up_why="a budget")
    assert decide(gave_up, _facts(now=1100.0)).record is None  # the pod went: nothing owed


def test_how_long_a_drain_has_failed_is_of_its_layout_only() -> None:
    record = Record("a", drain_since=100.0)
    assert drain_failing_for(record, "a", 130.0) == 30.0
    assert drain_failing_for(record, "b", 130.0) == 0.0
    assert drain_failing_for(Record("a"), "a", 130.0) == 0.0
