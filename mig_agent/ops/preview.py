"""Which nodes a rollout touches and what it would do there: node selection, the up-front layout
check, and dry runs planned against the GPU state each agent publishes on its node (no NVML
needed).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace

from mig_agent.config.settings import Settings
from mig_agent.core.errors import ConfigError, PlanError
from mig_agent.core.labels import State, is_valid_label_value
from mig_agent.core.layout import Layout, LayoutCatalog
from mig_agent.core.planner import plan
from mig_agent.core.snapshot import from_json
from mig_agent.kube.cluster import Cluster
from mig_agent.node.drain import gpu_pods
from mig_agent.ops.dra_view import DraView
from mig_agent.ops.dra_view import read as dra_view_of
from mig_agent.ops.values import _BUSY, DEFAULT_SETTINGS, Action, NodePreview, Writer


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
    # on DRA nodes a pod holds a GPU by ResourceClaim, requesting no GPU resource
    dra = dra_view_of(cluster, claims=True) if count_pods and settings.dra else DraView()
    return [_preview(cluster, layout, n, settings, count_pods, dra) for n in nodes]


def _preview(
    cluster: Cluster, layout: Layout, name: str, s: Settings, count_pods: bool, dra: DraView
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
    pods = len(gpu_pods(cluster, name, claimed=dra.claimed(name))) if count_pods else None
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
