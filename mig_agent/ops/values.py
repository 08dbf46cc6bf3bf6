"""What the ops commands report: per-node results, the rollout's summary, dry-run previews, the
pool's status rows, and their exit codes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from mig_agent.config.settings import Settings
from mig_agent.core.errors import ConfigError
from mig_agent.core.labels import State
from mig_agent.node.waits import Clock

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
    # a DRA node: the devices its ResourceSlice lists by kind (gpu, 1g.10gb): {} elsewhere
    dra_devices: Mapping[str, int] = field(default_factory=dict)


def table(
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
