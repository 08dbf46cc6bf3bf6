"""When the fault harness takes the node's labels as the agent's verdict (no cluster needed)."""

from __future__ import annotations

from typing import Any

from . import harness

TARGET = "all-1g.5gb"


def _line(event: str, layout: str, **fields: Any) -> dict[str, Any]:
    return {"event": event, "layout": layout, **fields}


def test_a_state_label_from_before_the_layout_was_asked_for_is_no_verdict() -> None:
    # the label was set a moment ago; the agent has not begun its pass: `success` is still its
    # word on the layout before (a CI run once took it for the new layout's)
    assert not harness.verdict_due(TARGET, "success", [])
    assert not harness.verdict_due(
        TARGET, "success", [_line("reconcile.succeeded", "all-disabled")]
    )
    assert not harness.verdict_due(TARGET, "success", [_line("reconcile.started", TARGET)])


def test_the_end_of_a_pass_for_the_layout_is_a_verdict() -> None:
    assert harness.verdict_due(
        TARGET,
        "success",
        [_line("reconcile.started", TARGET), _line("reconcile.succeeded", TARGET)],
    )
    assert harness.verdict_due(
        TARGET, "failed", [_line("reconcile.failed", TARGET, retry_in_s=None)]
    )
    assert not harness.verdict_due(TARGET, "pending", [_line("reconcile.succeeded", TARGET)])


def test_a_failure_with_a_retry_due_waits_for_the_retry() -> None:
    first = _line("reconcile.failed", TARGET, retry_in_s=5.0)
    assert not harness.verdict_due(TARGET, "failed", [first])
    assert harness.verdict_due(TARGET, "failed", [first, dict(first)])


def test_no_layout_asked_for_is_settled_once_the_state_is_gone() -> None:
    assert harness.verdict_due(None, None, [])
    assert not harness.verdict_due(None, "success", [])
