"""Simulated GPUs: one node's GPUs in a state file (``state``), and the NVML C library that
pynvml calls in place of libnvidia-ml (``library``), both shared by every process on the node.

``open_node`` hands mig-agent's NVML adapter this library, so that the agent's real pynvml code
runs on simulated GPUs; mig-agent finds it through the ``mig_agent.gpu_backends`` entry point.
"""

from __future__ import annotations

import os
from pathlib import Path

from mig_agent.core.errors import GpuBusy, GpuError, GpuResetRequired, GpuUnavailable
from mig_agent.gpu.nvml import NvmlGpuBackend, open_backend

from . import state
from .library import SimulatedNvmlLibrary

__all__ = ["open_node", "state"]


def open_node(
    path: str | os.PathLike[str] | None = None,
    *,
    create_gpus: str | None = None,
    read_only: bool = False,
) -> NvmlGpuBackend:
    """The NVML backend over the simulated node in ``path`` (default $MIG_AGENT_SIM_STATE);
    with ``create_gpus`` (e.g. "8xH100-80GB") a missing node is created first; ``read_only``
    as open_backend's (observe mode)."""
    where = str(path or os.environ.get(state.ENV_STATE, ""))
    if not where:
        raise GpuUnavailable(
            f"the simulated backend needs a node state file: pass --sim-state "
            f"FILE or set {state.ENV_STATE}"
        )
    if not os.path.exists(where):
        if not create_gpus:
            raise GpuUnavailable(
                f"no simulated node at {where}; create one with "
                f"python -m migsim.nvml --state {where} create --gpus 8xH100-80GB"
            )
        Path(where).parent.mkdir(parents=True, exist_ok=True)
        state.create_node(where, gpus=create_gpus)
    library = SimulatedNvmlLibrary(where)

    def reset(gpu: int) -> None:
        try:
            library.reset_gpu(gpu)
        except state.SimError as exc:
            cls = {
                state.IN_USE: GpuBusy,
                state.NOT_SUPPORTED: GpuResetRequired,
                state.RESET_REQUIRED: GpuResetRequired,
            }.get(exc.code, GpuError)
            op = f"reset GPU {gpu}"
            raise cls(f"{op}: {exc}", op=op, gpu=gpu, nvml_code=exc.code) from exc

    return open_backend(library, reset=reset, read_only=read_only)
