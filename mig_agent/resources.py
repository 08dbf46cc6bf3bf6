"""The Kubernetes resources a node advertises for its GPUs as they are partitioned now.

Pure module: the device plugin's naming rules applied to observed state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from mig_agent.models import GpuModel, resource_name
from mig_agent.planner import observed_devices
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
