"""The agent's marks on its Node (annotations): what a pass left there for the next one, a
restarted agent or a new pod of the DaemonSet to finish or undo, and which of them someone else
wrote. mig_agent.agent.guard writes and clears the cordon's."""

from __future__ import annotations

import json
import re

import structlog

from mig_agent.config.settings import Settings
from mig_agent.core import guard
from mig_agent.core.labels import State
from mig_agent.kube.cluster import NodeView

log = structlog.get_logger(__name__)


class NodeRebooting(Exception):
    """Raised past the clean-up: the node is about to reboot and stays cordoned and paused."""


_LAYOUT = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_BOOT_ID = re.compile(r"^[0-9a-f-]{1,64}$")
_SERVICES = re.compile(r"^[A-Za-z0-9@._:-]+(,[A-Za-z0-9@._:-]+)*$")


def foreign_marks(s: Settings, node: NodeView) -> dict[str, str]:
    """The agent's own annotations on ``node`` holding what the agent never writes there:
    someone else wrote them (a pass rewrites or clears them). Pure."""
    prefix = s.annotation_prefix + "/"
    ours = {k: v for k, v in node.annotations.items() if k.startswith(prefix)}
    odd = {}
    for key, value in ours.items():
        if key == s.cordon_annotation:
            ok = value == "true"
        elif key == s.paused_annotation:
            ok = bool(value) and set(value.split(",")) <= set(s.operand_labels)
        elif key == s.reason_annotation:  # written only with the failed state
            ok = node.labels.get(s.state_label) == State.FAILED
        elif key == s.gpu_state_annotation:
            ok = _is_gpu_state(value)
        elif key == s.reboot_annotation:  # layout@boot-id, or the layout alone
            layout, _, boot = value.partition("@")
            ok = bool(_LAYOUT.match(layout)) and (not boot or bool(_BOOT_ID.match(boot)))
        elif key == s.post_apply_annotation:
            ok = bool(_LAYOUT.match(value))
        elif key == s.host_services_annotation:
            ok = bool(_SERVICES.match(value))
        elif key == s.observe_annotation:
            ok = _is_observe_report(value)
        elif key == s.guard_annotation:
            ok = record(s, node) is not None
        else:
            ok = False
        if not ok:
            odd[key] = value
    return odd


def _is_gpu_state(text: str) -> bool:
    try:
        data = json.loads(text)
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("gpus"), list)


def _is_observe_report(text: str) -> bool:
    try:
        data = json.loads(text)
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("layout"), str)


def interrupted(s: Settings, node: NodeView) -> bool:
    return node.labels.get(s.state_label) in (State.PENDING, State.REBOOTING) or marked(s, node)


def marked(s: Settings, node: NodeView) -> bool:
    """A pass left its marks: cordon, paused operands, a debt to the node or post-apply hooks
    still to run."""
    return any(
        a in node.annotations
        for a in (
            s.cordon_annotation,
            s.paused_annotation,
            s.guard_annotation,
            s.post_apply_annotation,
        )
    )


def record(s: Settings, node: NodeView) -> guard.Record | None:
    """What the node is owed, as its annotation says (None: none, or one the agent never
    wrote: logged, and the agent's own read of the GPUs decides)."""
    text = node.annotations.get(s.guard_annotation)
    if text is None:
        return None
    try:
        return guard.parse(text)
    except guard.BadRecord as exc:
        log.warning("guard.record_unreadable", error=str(exc))
        return None
