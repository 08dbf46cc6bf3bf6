"""The agent's loop: a pass on start, on a label or config change (the node watch wakes it),
after a retryable failure's backoff, and every resync. Its time and waits come from the agent's
clock, so it runs in tests without real sleeping; the node watch runs in a thread of its own.
"""

from __future__ import annotations

import threading
from typing import Protocol

import structlog

from mig_agent.agent import marks
from mig_agent.agent.advertisers import device_plugin
from mig_agent.agent.outcome import Outcome, PassResult
from mig_agent.config.settings import Settings
from mig_agent.core.errors import MigAgentError, Stopping
from mig_agent.core.labels import State
from mig_agent.kube.cluster import Cluster, NodeView
from mig_agent.node.waits import Clock

log = structlog.get_logger("mig_agent.agent")


class Agent(Protocol):
    """What the loop needs of the agent (mig_agent.agent.reconcile.Agent)."""

    settings: Settings
    cluster: Cluster
    clock: Clock
    wake_event: threading.Event
    seen: tuple[str | None, str | None]
    seen_plugin_labels: tuple[str | None, ...]
    failures: int
    loop_alive_at: float
    watch_alive_at: float
    # the node as the open watch last delivered it; None while the watch is not open
    watched_node: NodeView | None
    pass_running: bool

    def reconcile_once(self, *, node: NodeView | None = None) -> PassResult: ...

    def reload_config(self) -> bool: ...

    def report_gpu_problem(self) -> None: ...

    def gpu_problem(self) -> str: ...

    def refresh_holders(self) -> None: ...


def watch_forever(agent: Agent, stop: threading.Event) -> None:
    """Wake the loop when someone else changes the layout or state label; reconnects."""
    s = agent.settings
    delay = 1.0
    woken_for: dict[str, str] = {}
    while not stop.is_set():
        try:
            for node in agent.cluster.watch_node(s.node_name, timeout_s=s.watch_timeout_s):
                agent.watch_alive_at = agent.clock.now()
                agent.watched_node = node
                # our annotations holding what we never write there: someone else wrote them,
                # and a pass corrects them now rather than at the next resync (once per forgery)
                odd = marks.foreign_marks(s, node)
                forged = bool(odd) and odd != woken_for and not agent.pass_running
                if forged:
                    log.warning("node.foreign_marks", annotations=sorted(odd))
                    woken_for = odd
                delay = 1.0
                seen = (node.labels.get(s.config_label), node.labels.get(s.state_label))
                # "pending" or "rebooting" for the layout we saw is only ever our own patch,
                # arriving late (a busy node's status updates can hold it back past our
                # "failed"; a failed reboot's clean-up is written under "rebooting"): no change
                own = seen[0] == agent.seen[0] and seen[1] in (State.PENDING, State.REBOOTING)
                # a fixed strategy or plugin-config label is worth a pass as a layout is
                if (
                    (seen != agent.seen and not own)
                    or device_plugin.plugin_labels(agent.settings, node) != agent.seen_plugin_labels
                    or forged
                ):
                    agent.wake_event.set()
                if stop.is_set():
                    return
            agent.watched_node = None  # closed: re-opened at once
            agent.watch_alive_at = agent.clock.now()
        except Exception as exc:  # noqa: BLE001 (whatever ends it, the watch is opened again)
            # a cut connection or a line that is no JSON as much as the API's refusal: the
            # cached node is no longer current, and a dead thread would leave it so until the
            # liveness probe restarted the pod
            agent.watched_node = None
            agent.watch_alive_at = agent.clock.now()  # alive, retrying: a restart won't help
            log.warning(
                "watch.failed", error=str(exc), error_type=type(exc).__name__, retry_in_s=delay
            )
            stop.wait(delay)
            delay = min(delay * 2, 30.0)


def run(agent: Agent, stop: threading.Event, *, config_poll_s: float = 5.0) -> None:
    """Reconcile on start, on label and config changes, after backoff, and every resync."""
    # Opened once the first pass is over: its first event is the node as it is then, compared
    # with what that pass saw and wrote. Opened beside the first pass, it delivered the node as
    # it was before the pass wrote its state, which woke a second pass at once (a failed first
    # pass was repeated without its back-off).
    watcher = threading.Thread(
        target=watch_forever, args=(agent, stop), daemon=True, name="node-watch"
    )
    agent.reload_config()
    agent.report_gpu_problem()
    next_due, resync_due = 0.0, False
    gpus_looked_at = agent.clock.now()
    while not stop.is_set():
        now = agent.loop_alive_at = agent.clock.now()
        if agent.wake_event.is_set() or now >= next_due:
            # a resync with the watch open reads the node from the watch: an idle agent makes
            # no request but the watch (a wake-up or a retry reads it afresh)
            cached = agent.watched_node if resync_due and not agent.wake_event.is_set() else None
            agent.wake_event.clear()
            try:
                result = agent.reconcile_once(node=cached)
            except MigAgentError as exc:  # could not even read the node
                log.error("reconcile.failed", error=str(exc), error_type=type(exc).__name__)
                result = PassResult(Outcome.FAILED, agent.settings.backoff_s, str(exc))
            except Stopping:
                break
            except Exception as exc:  # noqa: BLE001 (a bug outside the pass's own catch)
                log.exception("reconcile.crashed", error_type=type(exc).__name__)
                result = PassResult(Outcome.FAILED, agent.settings.backoff_s, str(exc))
            if watcher.ident is None:  # not started yet: the first pass is over
                watcher.start()
            resync_due = result.retry_after_s is None
            if result.outcome is Outcome.FAILED and result.retry_after_s is None:
                next_due = float("inf")  # wait for a label or config change
            else:
                # 0.0 means at once (a superseded pass), not "no retry": only None waits a resync
                retry = result.retry_after_s
                next_due = agent.clock.now() + (agent.settings.resync_s if retry is None else retry)
        timeout = max(0.05, min(config_poll_s, next_due - agent.clock.now()))
        agent.clock.wait(agent.wake_event, timeout)
        if agent.clock.now() - gpus_looked_at >= config_poll_s:
            # /readyz answers from this look, taken here between passes: a probe never waits
            # on NVML (a reset holds it for minutes), yet a driver gone shows within seconds
            gpus_looked_at = agent.clock.now()
            agent.gpu_problem()
            agent.refresh_holders()  # advise's view of who holds what, kept as pods come and go
        if agent.reload_config():
            agent.failures = 0
            agent.wake_event.set()
    log.info("agent.stopping")
