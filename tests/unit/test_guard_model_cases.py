"""The sequences the guard model (test_guard_model) found, each replayed as it was reported, so
that every run holds them, not only the model's own budget of examples:

* a kill right after the ``rebooting`` patch, before the reboot command ran: the next agent
  must reboot (the ask is of this boot), not say the change "did not take effect after
  rebooting once" (there was no reboot).
"""

from __future__ import annotations

from tests.unit.model_world import Armed
from tests.unit.test_guard_model import GuardModel


def _replay(steps: list[tuple[str, dict[str, object]]]) -> None:
    state = GuardModel()
    try:
        for name, args in steps:
            getattr(state, name)(**args)
            state.promise_kept()
    finally:
        state.teardown()


def test_a_kill_before_the_reboot_command_ran_gets_the_reboot() -> None:
    _replay(
        [
            (
                "start",
                {
                    "operands": False,
                    "podresources": False,
                    "reboot": True,
                    "pending": True,
                    "found": True,
                },
            ),
            (
                "relabel",
                {
                    "fault": Armed(at="patch", nth=3, action="kill", arg="all-1g.10gb"),
                    "layout": "all-1g.10gb",
                },
            ),
        ]
    )
