"""The Kubernetes resources a node advertises for its GPUs as they are partitioned now.

Pure module: the device plugin's naming rules applied to observed state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from mig_agent.models import GpuModel, resource_name
from mig_agent.planner import Plan, observed_devices
from mig_agent.state import NodeState


def expected_resources(
    node: NodeState, models: Mapping[int, GpuModel], strategy: str
) -> dict[str, int]:
    """What NVIDIA's device plugin advertises: a whole GPU per non-MIG GPU, else one resource
    per MIG device (``nvidia.com/mig-<profile>`` in mixed strategy, ``nvidia.com/gpu`` in single).
    """
    out: Counter[str] = Counter()
    for gpu in node.gpus:
        if not gpu.mig_current:
            out["nvidia.com/gpu"] += 1
            continue
        for name, n in observed_devices(models[gpu.index], gpu).items():
            res = resource_name(name, strategy=strategy)
            if res:
                out[res] += n
    return dict(out)


def format_resources(resources: Mapping[str, int]) -> str:
    if not resources:
        return "nothing"
    return "{" + ", ".join(f"{k}: {v}" for k, v in sorted(resources.items())) + "}"


def planned_devices(the_plan: Plan, node: NodeState, models: Mapping[int, GpuModel]
                    ) -> dict[int, Counter[str] | None]:
    """Per GPU, the MIG devices it will have once ``the_plan`` is applied (None: MIG off)."""
    out: dict[int, Counter[str] | None] = {}
    for gpu in node.gpus:
        out[gpu.index] = observed_devices(models[gpu.index], gpu) if gpu.mig_current else None
    for gp in the_plan.gpus:
        out[gp.gpu] = Counter(d.profile for d in gp.devices) if gp.desired.mig_enabled else None
    return out


def single_strategy_problem(devices: Mapping[int, Counter[str] | None]) -> str:
    """Why NVIDIA's device plugin in single strategy would advertise nothing for these GPUs, or
    "": it needs every GPU in the same MIG mode and every MIG device of one profile."""
    modes = {d is not None for d in devices.values()}
    if len(modes) > 1:
        off = sorted(i for i, d in devices.items() if d is None)
        return (f"the single MIG strategy needs MIG on every GPU or on none; GPU(s) "
                f"{', '.join(map(str, off))} would have MIG disabled")
    names = sorted({n for d in devices.values() if d for n in d})
    if len(names) > 1:
        return (f"the single MIG strategy needs one MIG profile on the whole node, the layout "
                f"makes {', '.join(names)}; use the mixed strategy or a single-profile layout")
    if modes == {True} and any(not d for d in devices.values()):
        empty = sorted(i for i, d in devices.items() if not d)
        return (f"the single MIG strategy needs at least one MIG device on every MIG GPU; GPU(s) "
                f"{', '.join(map(str, empty))} would have none")
    return ""
