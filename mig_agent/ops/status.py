"""The pool's state: per GPU node its layout, state, reason, GPUs and advertised MIG resources
(on a DRA node, the devices its ResourceSlice lists), as a table or JSON.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from mig_agent.config.settings import Settings
from mig_agent.core.planner import observed_devices
from mig_agent.core.snapshot import from_json
from mig_agent.kube.cluster import MIG_RESOURCE_PREFIX, Cluster
from mig_agent.ops.dra_view import DraView
from mig_agent.ops.dra_view import read as dra_view_of
from mig_agent.ops.values import DEFAULT_SETTINGS, GpuSummary, NodeStatus, table


def status(
    cluster: Cluster, *, settings: Settings = DEFAULT_SETTINGS, selector: str = ""
) -> list[NodeStatus]:
    """GPU nodes (with GPU resources, DRA devices, a layout or state label, or published GPU
    state) by name."""
    s = settings
    dra_view = dra_view_of(cluster) if s.dra else DraView()
    rows = []
    for node in sorted(cluster.list_nodes(selector), key=lambda n: n.name):
        resources = node.gpu_resources()
        marks = (s.config_label in node.labels, s.state_label in node.labels)
        published = node.annotations.get(s.gpu_state_annotation)
        dra = {} if resources else dra_view.devices(node.name)
        if not (resources or any(marks) or published or dra):
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
                dra,
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


def resources_text(st: NodeStatus) -> str:
    """``gpu=1,mig-1g.10gb=7``; a DRA node's devices as ``dra:1g.10gb=4``; ``-`` for none."""
    short = {k.removeprefix("nvidia.com/"): v for k, v in st.resources.items()}
    short |= {f"dra:{k}": v for k, v in st.dra_devices.items()}
    return ",".join(f"{k}={v}" for k, v in sorted(short.items())) or "-"


def status_table(rows: Sequence[NodeStatus]) -> list[str]:
    def gpus(st: NodeStatus) -> str:
        if st.gpus is None:
            return "-"
        by_model = Counter(g.model for g in st.gpus)
        return ",".join(f"{n}x{m}" for m, n in sorted(by_model.items()))

    rows_text = [
        (
            st.node,
            st.layout or "-",
            (st.state or "-") + (",cordoned" if st.unschedulable else ""),
            gpus(st),
            resources_text(st),
            st.reason.replace("\n", " ") or "-",
        )
        for st in rows
    ]
    if not rows_text:
        return ["no GPU nodes found"]
    return table(("NODE", "LAYOUT", "STATE", "GPUS", "RESOURCES", "REASON"), rows_text)


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
            "dra_devices": dict(st.dra_devices),
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
