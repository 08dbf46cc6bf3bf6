"""Polling with a deadline, for start-up checks here and for tests against the cluster."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from .errors import WaitTimeout

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], *, timeout: float, what: str, interval: float = 0.1
) -> T:
    """Call `condition` until it returns something truthy; return that.

    Raises WaitTimeout naming `what` (and the last falsy value) after `timeout` seconds. Exceptions
    from `condition` propagate at once: a condition that can tell the wait is hopeless (a process
    died) says so by raising.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise WaitTimeout(
                f"timed out after {timeout:g} s waiting for {what} (last value: {result!r})"
            )
        time.sleep(interval)
