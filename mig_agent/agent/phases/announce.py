"""The state label as the pass moves it, and the announcement that a change starts: `pending`
(and the post-apply mark), the node condition and the Event."""

from __future__ import annotations

import structlog

from mig_agent.agent import reporting
from mig_agent.agent.change import Change, Memory, Tools
from mig_agent.core.labels import State
from mig_agent.kube.cluster import NodeCondition, NodeView
from mig_agent.node import hooks

log = structlog.get_logger(__name__)


def set_state(t: Tools, memory: Memory, node: NodeView, state: State, desired: str) -> NodeView:
    """The state label ``state``, written only while the layout label still asks for
    ``desired``; the node as written (``node`` when it said so already)."""
    s = t.settings
    t.metrics.set_state(state)
    if node.labels.get(s.state_label) == state:
        return node
    log.info("labels.patched", state=str(state))
    # before the patch: the watch must not take our own label for someone else's change
    memory.seen = (desired, str(state))
    return t.cluster.patch_node(
        s.node_name,
        labels={s.state_label: str(state)},
        expect_labels={s.config_label: desired},
        known=node,
    )


def announce(t: Tools, memory: Memory, change: Change, hook_run: hooks.HookRunner) -> None:
    """``pending`` (and the post-apply mark), the condition and the Event: the change starts."""
    s, desired = t.settings, change.desired
    changed = list(change.plan.changed_gpus)
    log.info("reconcile.started", changed_gpus=changed, interrupted=change.interrupted)
    change.node = set_state(t, memory, change.node, State.PENDING, desired)
    if hook_run.hooks.of(hooks.POST_APPLY):
        # until the post-apply hooks succeed, a pass has work left (crash, failure)
        change.node = t.cluster.patch_node(
            s.node_name, annotations={s.post_apply_annotation: desired}
        )
    reporting.condition(
        t.cluster,
        s,
        NodeCondition(
            s.condition_type,
            "False",
            "Reconfiguring",
            f"applying layout {desired} to GPU(s) {changed}",
        ),
    )
    reporting.event(
        t.cluster,
        change.node,
        "MIGReconfiguring",
        f"applying layout {desired}: GPU(s) {changed} change"
        if changed
        else f"finishing layout {desired} after an interrupted pass",
    )
