"""One leader at a time, for as long as a round lasts: ``LeaseKeeper`` holds a Lease on a
thread of its own (renewing it every third of its duration, so that a round that waits
minutes on verify's pods keeps it), and ``leading`` wraps a cluster so that each of its
writes first confirms the Lease is surely held: renewed within two thirds of its duration,
the rest left as margin for the clocks of the replicas. A replica whose renewals fail stops
writing before another may take the Lease over (mig_agent.core.lease).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar, cast

import structlog

from mig_agent.core.errors import KubeError, LeadershipLost

log = structlog.get_logger(__name__)

WRITES: Final = ("patch_", "create_", "delete_", "replace_", "emit_", "evict", "set_")
T = TypeVar("T")


class LeaseKeeper:
    """Holds a Lease through ``hold`` (one take-or-renew; False while another holds it)."""

    def __init__(
        self,
        hold: Callable[[], bool],
        duration_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hold = hold
        self._duration = duration_s
        self._clock = clock
        self._valid_until = float("-inf")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attempt(self) -> bool:
        """One take-or-renew now; whether the Lease is held after it."""
        started = self._clock()
        try:
            ok = self._hold()
        except KubeError as exc:  # unanswered: what was renewed before runs out on its own
            log.warning("lease.renew_failed", error=str(exc))
            return self.holds()
        with self._lock:  # False: another holds it now
            self._valid_until = started + self._duration * 2 / 3 if ok else float("-inf")
        return ok

    def holds(self) -> bool:
        """Whether the Lease is surely held now."""
        with self._lock:
            return self._clock() < self._valid_until

    def confirm(self) -> None:
        """Raise LeadershipLost unless the Lease is surely held now."""
        if not self.holds():
            raise LeadershipLost("the lease is not surely held: not writing")

    def start(self) -> None:
        """Renew (or try to take) the Lease every third of its duration, until ``stop``."""

        def run() -> None:
            while not self._stop.wait(self._duration / 3):
                self.attempt()

        self._thread = threading.Thread(target=run, name="lease-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


class _Leading:
    """``cluster`` whose writing methods each call ``confirm`` first."""

    def __init__(self, cluster: Any, confirm: Callable[[], None]) -> None:
        self._cluster = cluster
        self._confirm = confirm

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._cluster, name)
        if not callable(attr) or not name.startswith(WRITES):
            return attr

        def guarded(*args: Any, **kwargs: Any) -> Any:
            self._confirm()
            return attr(*args, **kwargs)

        return guarded


def leading(cluster: T, confirm: Callable[[], None]) -> T:
    """``cluster`` as its own type, each write first confirming leadership."""
    return cast(T, _Leading(cluster, confirm))
