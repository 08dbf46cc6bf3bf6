"""Ops commands: repartition nodes or a pool through the layout label, and show the pool's state.

This is the operator's side of the label protocol. It never touches a GPU: per node it sets the
layout label (clearing the state label and the reason in the same patch, so every state seen
afterwards is the agent's answer to this change) and follows the state label to ``success`` or
``failed``. A rollout over a pool runs at most K nodes at a time and stops starting new nodes once
the failures exceed a budget. Dry runs and the up-front fit check plan against the GPU state each
agent publishes on its node, so nothing here needs NVML.

Wiring layer, beside cli: uses kube.cluster, layout, planner, snapshot and drain. Time and output
are injected, so the whole rollout is unit-tested against FakeCluster without sleeping.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from mig_agent.drain import Clock, gpu_pods
from mig_agent.errors import ConfigError, MigAgentError, PlanError
from mig_agent.kube.cluster import MIG_RESOURCE_PREFIX, Cluster, NodeView
from mig_agent.labels import State, is_valid_label_value
from mig_agent.layout import Layout, LayoutCatalog
from mig_agent.planner import observed_devices, plan
from mig_agent.settings import Settings
from mig_agent.snapshot import from_json

Writer = Callable[[str], None]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_BUSY: Final = (State.PENDING, State.REBOOTING)
DEFAULT_SETTINGS: Final = Settings()  # the label keys compatible with NVIDIA's MIG Manager
REAL_CLOCK: Final = Clock()


class Result(enum.StrEnum):
    SUCCESS = "success"
    FAILED = "failed"
    TIMEOUT = "timeout"
    NOT_STARTED = "not started"
    IN_PROGRESS = "in progress"
    ALREADY_APPLIED = "already applied"


_GOOD: Final = (Result.SUCCESS, Result.ALREADY_APPLIED)


class RolloutRefused(ConfigError):
    """The layout cannot go on some selected nodes; nothing was touched.

    ``context["nodes"]`` maps each refused node to the reason.
    """


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True, slots=True)
class NodeResult:
    node: str
    result: Result
    elapsed_s: float | None = None  # since the label change; None when never started
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Summary:
    """The outcome of one rollout, a result per selected node in rollout order."""

    layout: str
    results: tuple[NodeResult, ...]
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not self.interrupted and all(r.result in _GOOD for r in self.results)

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_OK if self.ok else EXIT_FAILED

    def result_of(self, node: str) -> NodeResult:
        return next(r for r in self.results if r.node == node)

    def with_result(self, result: Result) -> tuple[str, ...]:
        return tuple(r.node for r in self.results if r.result is result)


class Action(enum.StrEnum):
    """What a rollout does with a node, decided before any node is touched."""

    APPLY = "apply"  # set the label and follow the node
    FOLLOW = "follow"  # the agent is already applying this layout: follow, do not relabel
    SKIP = "skip"  # already applied
    REFUSE = "refuse"  # the layout cannot go on this node (see ``reason``)


@dataclass(frozen=True, slots=True)
class NodePreview:
    """What setting the layout on one node would do, from its labels and published GPU state.

    ``changed_gpus`` is None when the agent has published no GPU state (no plan is possible
    then); ``gpu_pods`` is None when pods were not counted.
    """

    node: str
    action: Action
    current_layout: str | None
    state: str | None
    reason: str = ""  # why refused, or a note on the plan
    gpus: int | None = None
    changed_gpus: tuple[int, ...] | None = None
    destroyed_gpu_instances: int = 0
    created_gpu_instances: int = 0
    gpu_pods: int | None = None


@dataclass(frozen=True, slots=True)
class GpuSummary:
    index: int
    model: str
    mig_enabled: bool
    devices: Mapping[str, int]  # MIG device name -> count


@dataclass(frozen=True, slots=True)
class NodeStatus:
    node: str
    layout: str | None
    state: str | None
    reason: str
    unschedulable: bool
    resources: Mapping[str, int]  # allocatable nvidia.com/gpu and nvidia.com/mig-*
    gpus: tuple[GpuSummary, ...] | None  # None when the agent has published no GPU state


# ---------------------------------------------------------------------------------------------
# Selecting nodes and checking the layout


def select_nodes(cluster: Cluster, names: Sequence[str] = (), selector: str = "") -> list[str]:
    """The nodes to act on: the names given (all must exist) or those matching ``selector``.

    ConfigError when neither or both are given, a name is unknown, or nothing matches.
    """
    if names and selector:
        raise ConfigError("give node names or a label selector (-l), not both")
    if selector:
        found = sorted(n.name for n in cluster.list_nodes(selector))
        if not found:
            raise ConfigError(f"no node matches the selector {selector!r}")
        return found
    if not names:
        raise ConfigError("name the nodes or give a label selector (-l)")
    known = {n.name for n in cluster.list_nodes()}
    if missing := [n for n in names if n not in known]:
        raise ConfigError(f"no such node(s): {', '.join(missing)}")
    return list(dict.fromkeys(names))  # keep the order given, once each


def check_layout(catalog: LayoutCatalog, name: str) -> Layout:
    """The layout called ``name``; UnknownLayout (naming the known ones) for a typo."""
    layout = catalog.get(name)
    if not is_valid_label_value(name):
        raise ConfigError(f"layout name {name!r} cannot be a node label value")
    return layout


def preview(
    cluster: Cluster,
    layout: Layout,
    nodes: Sequence[str],
    *,
    settings: Settings,
    count_pods: bool = True,
) -> list[NodePreview]:
    """Per node: already applied, in flight, or the plan the agent would make; never patches."""
    return [_preview(cluster, layout, n, settings, count_pods) for n in nodes]


def _preview(
    cluster: Cluster, layout: Layout, name: str, s: Settings, count_pods: bool
) -> NodePreview:
    node = cluster.get_node(name)
    current = node.labels.get(s.config_label)
    state = node.labels.get(s.state_label)
    base = NodePreview(name, Action.APPLY, current, state)
    if current == layout.name and state == State.SUCCESS:
        return replace(base, action=Action.SKIP, reason="already applied")
    if state in _BUSY:
        if current == layout.name:
            return replace(
                base, action=Action.FOLLOW, reason="the agent is already applying this layout"
            )
        # Relabelling now could let the agent's answer for the old layout pass for ours.
        return replace(
            base,
            action=Action.REFUSE,
            reason=f"the agent is applying layout {current!r} (state {state}); "
            "wait until it finishes",
        )
    pods = len(gpu_pods(cluster, name)) if count_pods else None
    text = node.annotations.get(s.gpu_state_annotation)
    if text is None:
        return replace(base, gpu_pods=pods, reason="no GPU state published, no plan ahead")
    try:
        node_state, models = from_json(json.loads(text))
    except ValueError as exc:
        return replace(base, gpu_pods=pods, reason=f"unreadable GPU state ({exc})")
    try:
        the_plan = plan(layout, node_state, models, destroy_in_use=True)
    except PlanError as exc:
        return replace(
            base, action=Action.REFUSE, gpus=len(node_state.gpus), gpu_pods=pods, reason=str(exc)
        )
    changed = the_plan.changed_gpus
    return replace(
        base,
        gpus=len(node_state.gpus),
        changed_gpus=changed,
        destroyed_gpu_instances=sum(g.destroyed_gpu_instances for g in the_plan.gpus),
        created_gpu_instances=sum(g.created_gpu_instances for g in the_plan.gpus),
        # Without a GPU change the agent drains nothing.
        gpu_pods=pods if changed or pods is None else 0,
    )


def preview_text(p: NodePreview) -> str:
    """One line for ``--dry-run``."""
    if p.action is Action.REFUSE:
        return f"{p.node}: REFUSED: {p.reason}"
    if p.action is not Action.APPLY:
        return f"{p.node}: {p.reason}"
    pods = "" if p.gpu_pods is None else f"; {p.gpu_pods} GPU pod(s) would be evicted"
    if p.changed_gpus is None:
        return f"{p.node}: {p.reason}{pods}"
    if not p.changed_gpus:
        return f"{p.node}: no GPU changes (the agent only reports success){pods}"
    return (
        f"{p.node}: GPU(s) {_ranges(p.changed_gpus)} of {p.gpus} change "
        f"({p.destroyed_gpu_instances} GPU instance(s) destroyed, "
        f"{p.created_gpu_instances} created){pods}"
    )


def _ranges(ids: Sequence[int]) -> str:
    """``0-3,6`` for (0, 1, 2, 3, 6)."""
    parts: list[str] = []
    for i in sorted(ids):
        if parts and parts[-1].split("-")[-1] == str(i - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{i}"
        else:
            parts.append(str(i))
    return ",".join(parts)


def dry_run(
    cluster: Cluster,
    catalog: LayoutCatalog,
    layout: str,
    nodes: Sequence[str],
    *,
    settings: Settings = DEFAULT_SETTINGS,
    out: Writer = print,
) -> list[NodePreview]:
    """Print what ``repartition`` would do per node; no patch is made."""
    the_layout = check_layout(catalog, layout)
    previews = preview(cluster, the_layout, nodes, settings=settings)
    out(f"layout {layout} on {len(previews)} node(s) (dry run, nothing changed):")
    for p in previews:
        out(f"  {preview_text(p)}")
    return previews


# ---------------------------------------------------------------------------------------------
# The rollout


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
) -> Summary:
    """Set ``layout`` on ``nodes``, at most ``max_parallel`` at a time, following each to the end.

    New nodes stop being started once more than ``failure_budget`` nodes failed or timed out;
    those already started are followed to their end. A node not done after ``timeout_s`` counts
    as timed out (its agent carries on). Ctrl-C (KeyboardInterrupt) stops at once and returns a
    summary naming the nodes still in progress; nothing is half-done, as a node's only change is
    one patch. Progress lines and the summary table go to ``out``.

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
    if refused and not force:
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
        # Registered first: a Ctrl-C during the patch reports the node as possibly in progress.
        following = p.action is Action.FOLLOW
        self.active[p.node] = _Active(self.clock.now(), p.state if following else None)
        if following:
            self._line(p.node, f"following: {p.reason} (state {p.state})")
            return
        try:
            self.cluster.patch_node(
                p.node,
                labels={s.config_label: self.layout, s.state_label: None},
                annotations={s.reason_annotation: None},
            )
        except MigAgentError as exc:
            self._finish(p.node, Result.FAILED, f"could not set the layout label: {exc}")
            return
        self._line(p.node, f"started: {s.config_label}={self.layout}")

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
                self._finish(name, Result.SUCCESS)
            elif state == State.FAILED:
                self._finish(name, Result.FAILED, _reason(node, s))
            elif elapsed >= self.timeout_s:
                self._finish(
                    name,
                    Result.TIMEOUT,
                    f"no result after {self.timeout_s:.0f} s (state {state or '-'}); "
                    "its agent carries on",
                )

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
    lines = _table(("NODE", "RESULT", "ELAPSED", "REASON"), rows, right={2})
    counts = Counter(r.result for r in summary.results)
    tally = ", ".join(f"{n} {res}" for res, n in counts.items())
    if summary.interrupted:
        verdict = "INTERRUPTED"
    elif summary.ok:
        verdict = "done"
    else:
        bad = [r.node for r in summary.results if r.result in (Result.FAILED, Result.TIMEOUT)]
        verdict = f"FAILED on {', '.join(bad)}" if bad else "FAILED"
    lines.append(f"layout {summary.layout}: {verdict} ({len(rows)} node(s): {tally})")
    return lines


def _table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, right: set[int] | None = None
) -> list[str]:
    right = right or set()
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [fmt(header), *(fmt(r) for r in rows)]


# ---------------------------------------------------------------------------------------------
# Status


def status(
    cluster: Cluster, *, settings: Settings = DEFAULT_SETTINGS, selector: str = ""
) -> list[NodeStatus]:
    """GPU nodes (with GPU resources, a layout or state label, or published GPU state) by name."""
    s = settings
    rows = []
    for node in sorted(cluster.list_nodes(selector), key=lambda n: n.name):
        resources = node.gpu_resources()
        marks = (s.config_label in node.labels, s.state_label in node.labels)
        published = node.annotations.get(s.gpu_state_annotation)
        if not (resources or any(marks) or published):
            continue
        rows.append(
            NodeStatus(
                node.name,
                node.labels.get(s.config_label),
                node.labels.get(s.state_label),
                node.annotations.get(s.reason_annotation, ""),
                node.unschedulable,
                resources,
                _gpus(published),
            )
        )
    return rows


def _gpus(text: str | None) -> tuple[GpuSummary, ...] | None:
    if text is None:
        return None
    try:
        node, models = from_json(json.loads(text))
    except ValueError:
        return None
    return tuple(
        GpuSummary(
            g.index,
            models[g.index].key,
            g.mig_current,
            dict(sorted(observed_devices(models[g.index], g).items())),
        )
        for g in node.gpus
    )


def status_table(rows: Sequence[NodeStatus]) -> list[str]:
    def gpus(st: NodeStatus) -> str:
        if st.gpus is None:
            return "-"
        by_model = Counter(g.model for g in st.gpus)
        return ",".join(f"{n}x{m}" for m, n in sorted(by_model.items()))

    def resources(st: NodeStatus) -> str:
        short = {k.removeprefix("nvidia.com/"): v for k, v in st.resources.items()}
        return ",".join(f"{k}={v}" for k, v in sorted(short.items())) or "-"

    table = [
        (
            st.node,
            st.layout or "-",
            (st.state or "-") + (",cordoned" if st.unschedulable else ""),
            gpus(st),
            resources(st),
            st.reason.replace("\n", " ") or "-",
        )
        for st in rows
    ]
    if not table:
        return ["no GPU nodes found"]
    return _table(("NODE", "LAYOUT", "STATE", "GPUS", "RESOURCES", "REASON"), table)


def status_json(rows: Sequence[NodeStatus]) -> list[dict[str, Any]]:
    return [
        {
            "node": st.node,
            "layout": st.layout,
            "state": st.state,
            "reason": st.reason,
            "unschedulable": st.unschedulable,
            "resources": dict(sorted(st.resources.items())),
            "mig_resources": {
                k: v for k, v in sorted(st.resources.items()) if k.startswith(MIG_RESOURCE_PREFIX)
            },
            "gpus": None
            if st.gpus is None
            else [
                {
                    "index": g.index,
                    "model": g.model,
                    "mig_enabled": g.mig_enabled,
                    "devices": dict(g.devices),
                }
                for g in st.gpus
            ],
        }
        for st in rows
    ]


# ---------------------------------------------------------------------------------------------
# Command line (``mig-agent repartition|status``, ``scripts/repartition``, ``scripts/mig-status``)


def _write(line: str) -> None:
    # Flushed per line: the progress must show live through a pipe too.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _connect(args: argparse.Namespace) -> Any:
    from mig_agent.kube.client import KubernetesCluster

    return KubernetesCluster.connect(args.kubeconfig or "", component="mig-agent-ops")


def cmd_repartition(args: argparse.Namespace) -> int:
    from mig_agent.catalog import load_catalog
    from mig_agent.cli import default_config

    catalog = load_catalog(args.config_file or [default_config()])
    check_layout(catalog, args.layout)  # a typo is refused before even connecting
    settings = Settings.from_env()
    cluster = _connect(args)
    try:
        nodes = select_nodes(cluster, args.nodes, args.selector)
        if args.dry_run:
            previews = dry_run(cluster, catalog, args.layout, nodes, settings=settings, out=_write)
            refused = any(p.action is Action.REFUSE for p in previews)
            return EXIT_USAGE if refused and not args.force else EXIT_OK
        summary = repartition(
            cluster,
            catalog,
            args.layout,
            nodes,
            max_parallel=args.max_parallel,
            failure_budget=args.failure_budget,
            timeout_s=args.timeout_s,
            poll_s=args.poll_s,
            heartbeat_s=args.heartbeat_s,
            force=args.force,
            settings=settings,
            out=_write,
        )
        return summary.exit_code
    finally:
        cluster.close()


def cmd_status(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    cluster = _connect(args)
    try:
        rows = status(cluster, settings=settings, selector=args.selector)
    finally:
        cluster.close()
    if args.output == "json":
        _write(json.dumps(status_json(rows), indent=2))
    else:
        for line in status_table(rows):
            _write(line)
    return EXIT_OK


def register_commands(sub: Any) -> None:
    """Add ``repartition`` and ``status`` to the ``mig-agent`` subcommands."""
    from mig_agent.cli import _add_config_args

    p = sub.add_parser(
        "repartition",
        help="set a layout on nodes through the label and follow each to success or failed",
        description="Set the layout label on the nodes, at most --max-parallel at a time, and "
        "follow each node's state label. Exit 0 when every node succeeded, 1 on a failure or "
        "timeout, 2 when refused before any node was touched, 130 on Ctrl-C.",
    )
    p.add_argument("layout", metavar="LAYOUT", help="layout name from the profile configs")
    p.add_argument("nodes", nargs="*", metavar="NODE", help="node names (or use -l)")
    p.add_argument("-l", "--selector", default="", help="label selector of the nodes")
    p.add_argument(
        "-p",
        "--max-parallel",
        type=_positive_int,
        default=1,
        metavar="K",
        help="nodes changing at the same time (default 1)",
    )
    p.add_argument(
        "--failure-budget",
        type=int,
        default=0,
        metavar="N",
        help="failed nodes tolerated before no new node is started (default 0)",
    )
    p.add_argument(
        "--timeout",
        dest="timeout_s",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="per node; a node not done by then counts as a failure and is no longer "
        "waited for, its agent carries on (default 1800)",
    )
    p.add_argument(
        "--poll",
        dest="poll_s",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how often each node in progress is read (default 1)",
    )
    p.add_argument("--heartbeat", dest="heartbeat_s", type=float, default=30.0, metavar="SECONDS")
    p.add_argument("--dry-run", action="store_true", help="show the plan per node, change nothing")
    p.add_argument(
        "--force",
        action="store_true",
        help="go ahead on nodes where the layout does not fit by the published GPU state",
    )
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG)")
    _add_config_args(p, layout=False)
    p.set_defaults(func=cmd_repartition)

    p = sub.add_parser(
        "status", help="GPU nodes: layout, state, reason, GPUs and advertised MIG resources"
    )
    p.add_argument("-l", "--selector", default="", help="label selector of the nodes")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig (default: $KUBECONFIG)")
    p.set_defaults(func=cmd_status)
