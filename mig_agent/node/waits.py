"""Time and waiting, injected so that tests run without real sleeping: the Clock every wait of a
pass uses, the delays between looks, and waits on watches in slices."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TypeVar

# the longest one watch of a wait stays open: between two, the wait sees a stop (SIGTERM) and
# tells the loop it is alive
WATCH_SLICE_S = 5.0

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Clock:
    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    # wait until the event is set or the timeout passes (True if set): the agent loop's wait
    wait: Callable[[threading.Event, float], bool] = threading.Event.wait
    wall: Callable[[], float] = time.time  # epoch seconds, to age the API server's stamps


def poll_delays(poll_s: float, fast_s: float = 0.1, fast_for_s: float = 3.0) -> Iterator[float]:
    """Delays between looks at something about to happen. Every ``fast_s`` for the first
    ``fast_for_s``: a pod's termination or a device plugin's start mostly ends within that, and
    each look that comes late adds to the pass. Then doubling up to ``poll_s``, so that a long
    wait (a PodDisruptionBudget, a slow plugin) costs few requests."""
    delay, spent = min(fast_s, poll_s), 0.0
    while True:
        yield delay
        spent += delay
        if spent >= fast_for_s:
            delay = min(delay * 2, poll_s)


def watch_slices(
    open_watch: Callable[[float], Iterator[T]],
    clock: Clock,
    *,
    due: Callable[[], float],
    poll_s: float,
) -> Generator[T, None, None]:
    """What ``open_watch(seconds)`` yields (the state now, then after every change), watch
    after watch, for as long as the caller reads: a wait costs a watch per slice (and a look
    where the watch cannot go on from the last one's end) rather than a look every
    ``poll_s``. Each watch ends by ``due()`` (clock time: when the caller must look whatever
    happens, e.g. its deadline) and within WATCH_SLICE_S. A watch that ends early (closed by
    the server, or a cluster without watches) is opened again after a poll delay."""
    delays = poll_delays(poll_s)
    while True:
        opened = clock.now()
        span = max(1.0, min(WATCH_SLICE_S, due() - opened))
        watch = open_watch(span)
        try:
            for item in watch:
                yield item
                clock.sleep(0)  # a stop ends the wait here; the loop is alive
        finally:
            if isinstance(watch, Generator):
                watch.close()  # the caller has what it waited for: the connection goes
        if clock.now() - opened < span - 0.5:
            clock.sleep(next(delays))
