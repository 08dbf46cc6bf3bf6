"""The rollout: set the layout label on nodes, at most K at a time, follow each node's state label
to success or failed, stop starting nodes once failures exceed the budget. Time and output are
injected.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from mig_agent.config.settings import Settings
from mig_agent.core.errors import ConfigError, LabelsChanged, MigAgentError
from mig_agent.core.labels import State
from mig_agent.core.layout import LayoutCatalog
from mig_agent.kube.cluster import Cluster, NodeView
from mig_agent.node.waits import Clock
from mig_agent.ops.preview import check_layout, preview
from mig_agent.ops.values import (
    _GOOD,
    DEFAULT_SETTINGS,
    REAL_CLOCK,
    Action,
    NodePreview,
    NodeResult,
    Result,
    RolloutRefused,
    Summary,
    Writer,
    table,
)
from mig_agent.ops.verify import NodeVerdict


@dataclass(frozen=True, slots=True)
class Precondition:
    """What a node's relabel is conditional on: the labels it expects (the patch is written
    only while they hold) and the node as the caller last read it (spares the patch a read)."""

    labels: Mapping[str, str | None]
    known: NodeView | None = None


# asked just before a node's patch: its precondition, or why the node is skipped
Gate = Callable[[str], Precondition | str]


def repartition(
    cluster: Cluster,
    catalog: LayoutCatalog,
    layout: str,
    nodes: Sequence[str],
    *,
    max_parallel: int = 1,
    failure_budget: int = 0,
    timeout_s: float = 1800.0,
    poll_s: float = 1.0,
    heartbeat_s: float = 30.0,
    force: bool = False,
    settings: Settings = DEFAULT_SETTINGS,
    clock: Clock = REAL_CLOCK,
    out: Writer = print,
    verify: Callable[[str], NodeVerdict] | None = None,
    gate: Gate | None = None,
) -> Summary:
    """Set ``layout`` on ``nodes``, at most ``max_parallel`` at a time, following each to the end.

    New nodes stop being started once more than ``failure_budget`` nodes failed or timed out;
    those already started are followed to their end. A node not done after ``timeout_s`` counts
    as timed out (its agent carries on). Ctrl-C (KeyboardInterrupt) stops at once and returns a
    summary naming the nodes still in progress; nothing is half-done, as a node's only change is
    one patch. Progress lines and the summary table go to ``out``. With ``verify`` (the checks of
    mig_agent.ops.verify, bound to their options), a node counts as a success only once it passed
    them after its agent's ``success``; one that fails them counts as failed.

    With ``gate`` (advise's look again), each node is asked of it just before its patch, which
    is then conditional on the labels it names: a node the gate turns down, whose labels changed
    before the patch, or that the preview refuses is skipped (not started, with the reason) and
    stops nothing; the others go on.

    Raises, before touching any node: UnknownLayout for a typo, RolloutRefused when the layout
    does not fit a node by its published GPU state or its agent is busy with another layout
    (unless ``force``), ConfigError for bad limits.
    """
    if max_parallel < 1:
        raise ConfigError(f"max parallel must be at least 1, got {max_parallel}")
    if failure_budget < 0:
        raise ConfigError(f"failure budget must not be negative, got {failure_budget}")
    if timeout_s <= 0 or poll_s <= 0:
        raise ConfigError("timeout and poll interval must be positive")
    the_layout = check_layout(catalog, layout)
    previews = preview(cluster, the_layout, nodes, settings=settings, count_pods=False)
    refused = {p.node: p.reason for p in previews if p.action is Action.REFUSE}
    if refused and not force and gate is None:
        lines = "".join(f"\n  {n}: {r}" for n, r in refused.items())
        raise RolloutRefused(
            f"layout {layout} refused on {len(refused)} node(s), no node was changed "
            f"(--force to go ahead anyway):{lines}",
            nodes=refused,
        )
    rollout = _Rollout(
        cluster,
        layout,
        settings,
        clock,
        out,
        max_parallel=max_parallel,
        failure_budget=failure_budget,
        timeout_s=timeout_s,
        poll_s=poll_s,
        heartbeat_s=heartbeat_s,
        width=max((len(n) for n in nodes), default=0),
        verify=verify,
        gate=gate,
    )
    summary = rollout.run(previews)
    for line in summary_table(summary):
        out(line)
    return summary


@dataclass
class _Active:
    started_at: float
    state: str | None


@dataclass
class _Rollout:
    """The mutable bookkeeping of one rollout; ``run`` is the loop."""

    cluster: Cluster
    layout: str
    settings: Settings
    clock: Clock
    out: Writer
    max_parallel: int
    failure_budget: int
    timeout_s: float
    poll_s: float
    heartbeat_s: float
    width: int
    verify: Callable[[str], NodeVerdict] | None = None
    gate: Gate | None = None
    t0: float = 0.0
    failures: int = 0
    active: dict[str, _Active] = field(default_factory=dict)
    results: dict[str, NodeResult] = field(default_factory=dict)

    def run(self, previews: Sequence[NodePreview]) -> Summary:
        self.t0 = self.clock.now()
        order = [p.node for p in previews]
        queue: list[NodePreview] = []
        for p in previews:
            if p.action is Action.SKIP:
                self.results[p.node] = NodeResult(p.node, Result.ALREADY_APPLIED)
                self._line(p.node, "already applied")
                continue
            if p.action is Action.REFUSE and self.gate is not None:
                self._skip(p.node, p.reason)
                continue
            if p.action is Action.APPLY and p.reason:
                self._line(p.node, f"note: {p.reason}")
            queue.append(p)  # with --force, refused nodes too
        interrupted = False
        next_beat = self.t0 + self.heartbeat_s
        try:
            while queue or self.active:
                while queue and len(self.active) < self.max_parallel and not self._stopping:
                    self._start(queue.pop(0))
                self._poll()
                if self._stopping and queue and not self.active:
                    break
                if not self.active:
                    continue
                if self.clock.now() >= next_beat:
                    self._heartbeat(len(queue))
                    next_beat = self.clock.now() + self.heartbeat_s
                self.clock.sleep(self.poll_s)
        except KeyboardInterrupt:
            interrupted = True
            now = self.clock.now()
            for name, a in self.active.items():
                self.results[name] = NodeResult(
                    name, Result.IN_PROGRESS, now - a.started_at, f"state {a.state or '-'}"
                )
            started = ", ".join(self.active) or "none"
            self.out(
                f"{self._stamp()} interrupted: no new node is started; still in progress, "
                f"finishing on their own: {started} (see mig-agent status)"
            )
        for p in queue:
            why = "interrupted" if interrupted else "rollout stopped after a failure"
            self.results[p.node] = NodeResult(p.node, Result.NOT_STARTED, reason=why)
        return Summary(self.layout, tuple(self.results[n] for n in order), interrupted=interrupted)

    @property
    def _stopping(self) -> bool:
        return self.failures > self.failure_budget

    def _stamp(self) -> str:
        return f"[{self.clock.now() - self.t0:7.1f}s]"

    def _line(self, node: str, text: str) -> None:
        self.out(f"{self._stamp()} {node:<{self.width}}  {text}")

    def _start(self, p: NodePreview) -> None:
        s = self.settings
        following = p.action is Action.FOLLOW
        if following:
            self.active[p.node] = _Active(self.clock.now(), p.state)
            self._line(p.node, f"following: {p.reason} (state {p.state})")
            return
        # what a Ctrl-C during the gate leaves it: started by nobody
        self.results[p.node] = NodeResult(p.node, Result.NOT_STARTED, reason="interrupted")
        try:
            pre = self.gate(p.node) if self.gate is not None else None
        except MigAgentError as exc:  # unread is not as read: skipped, the others go on
            pre = f"could not look at it again: {exc}"
        if isinstance(pre, str):
            self._skip(p.node, pre)
            return
        # Registered first: a Ctrl-C during the patch reports the node as possibly in progress.
        self.active[p.node] = _Active(self.clock.now(), None)
        labels = {s.config_label: self.layout, s.state_label: None}
        annotations: dict[str, str | None] = {s.reason_annotation: None}
        try:
            if pre is None:
                self.cluster.patch_node(p.node, labels=labels, annotations=annotations)
            else:
                self.cluster.patch_node(
                    p.node,
                    labels=labels,
                    annotations=annotations,
                    expect_labels=pre.labels,
                    known=pre.known,
                )
        except LabelsChanged as exc:
            del self.active[p.node]
            self._skip(p.node, f"{_changed(exc, s)} meanwhile, not overwritten")
            return
        except MigAgentError as exc:
            self._finish(p.node, Result.FAILED, f"could not set the layout label: {exc}")
            return
        self._line(p.node, f"started: {s.config_label}={self.layout}")

    def _skip(self, node: str, reason: str) -> None:
        """Not started, and no failure: what the node is now is no one's fault."""
        self.results[node] = NodeResult(node, Result.NOT_STARTED, reason=reason)
        self._line(node, f"skipped: {reason}")

    def _poll(self) -> None:
        s = self.settings
        for name, a in list(self.active.items()):
            elapsed = self.clock.now() - a.started_at
            try:
                node = self.cluster.get_node(name)
            except MigAgentError as exc:  # transient; the timeout bounds it
                if elapsed >= self.timeout_s:
                    self._finish(name, Result.TIMEOUT, f"node unreadable: {exc}")
                continue
            state = node.labels.get(s.state_label)
            label = node.labels.get(s.config_label)
            if label != self.layout:
                self._finish(name, Result.FAILED, f"layout label changed to {label!r} meanwhile")
                continue
            if state != a.state:
                a.state = state
                if state not in (State.SUCCESS, State.FAILED):
                    self._line(name, state or "(state cleared)")
            if state == State.SUCCESS:
                problem = self._verified(name)
                self._finish(name, Result.FAILED if problem else Result.SUCCESS, problem)
            elif state == State.FAILED:
                self._finish(name, Result.FAILED, _reason(node, s))
            elif elapsed >= self.timeout_s:
                self._finish(
                    name,
                    Result.TIMEOUT,
                    f"no result after {self.timeout_s:.0f} s (state {state or '-'}); "
                    "its agent carries on",
                )

    def _verified(self, name: str) -> str:
        """What the node failed of ``verify``'s checks ("" when it passed them, or without)."""
        if self.verify is None:
            return ""
        self._line(name, "success; verifying")
        verdict = self.verify(name)
        failed = verdict.failed
        if failed is None:
            self._line(name, "verified: " + ", ".join(c.name for c in verdict.checks))
            return ""
        return f"verify: {failed.name}: {failed.detail}"

    def _finish(self, name: str, result: Result, reason: str = "") -> None:
        a = self.active.pop(name)
        elapsed = self.clock.now() - a.started_at
        self.results[name] = NodeResult(name, result, elapsed, reason)
        self._line(name, f"{result}{': ' + reason if reason else ''}")
        if result not in _GOOD:
            was_stopping = self._stopping
            self.failures += 1
            if self._stopping and not was_stopping:
                self.out(
                    f"{self._stamp()} stopping: {self.failures} node(s) failed "
                    f"(budget {self.failure_budget}); no new node is started, waiting for "
                    "those in progress"
                )

    def _heartbeat(self, queued: int) -> None:
        now = self.clock.now()
        busy = ", ".join(
            f"{n} {a.state or '-'} {now - a.started_at:.0f}s" for n, a in self.active.items()
        )
        rest = f"{queued} not to be started" if self._stopping else f"{queued} waiting"
        self.out(f"{self._stamp()} in progress: {busy}; {len(self.results)} done, {rest}")


def _changed(exc: LabelsChanged, s: Settings) -> str:
    labels = exc.context.get("labels")
    if not isinstance(labels, Mapping) or not labels:
        return "labels changed"
    if s.config_label in labels:  # what someone changed; the state follows it as the agent goes
        labels = {s.config_label: labels[s.config_label]}
    return "relabelled (" + ", ".join(f"{k}={v or '(none)'}" for k, v in labels.items()) + ")"


def _reason(node: NodeView, s: Settings) -> str:
    return node.annotations.get(s.reason_annotation, "") or "(the agent gave no reason)"


def summary_table(summary: Summary) -> list[str]:
    """The final table (node, result, elapsed, reason) and a one-line verdict."""
    rows = [
        (
            r.node,
            str(r.result),
            "-" if r.elapsed_s is None else f"{r.elapsed_s:.1f}s",
            r.reason.replace("\n", " "),
        )
        for r in summary.results
    ]
    lines = table(("NODE", "RESULT", "ELAPSED", "REASON"), rows, right={2})
    counts = Counter(r.result for r in summary.results)
    tally = ", ".join(f"{n} {res}" for res, n in counts.items())
    if summary.interrupted:
        verdict = "INTERRUPTED"
    elif summary.ok:
        verdict = "done"
    else:
        bad = [r.node for r in summary.results if r.result in (Result.FAILED, Result.TIMEOUT)]
        skipped = [r.node for r in summary.results if r.result is Result.NOT_STARTED]
        verdict = f"FAILED on {', '.join(bad)}" if bad else f"not done on {', '.join(skipped)}"
    lines.append(f"layout {summary.layout}: {verdict} ({len(rows)} node(s): {tally})")
    return lines
