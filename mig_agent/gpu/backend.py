"""GpuBackend: what the executor and the agent need from this node's GPUs.

Implemented by mig_agent.gpu.nvml.NvmlGpuBackend, over the real NVML library or the simulated one
(migsim.nvml.library) placed beneath pynvml. Unit tests may use in-memory fakes of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from mig_agent.core.gpu_models import GpuModel
from mig_agent.core.observed import NodeState
from mig_agent.core.placement import Placement


class GpuBackend(Protocol):
    """GPUs are addressed by NVML index; instances by their NVML ids. Errors are GpuError."""

    def observe(self) -> NodeState:
        """MIG mode (current, pending), every GPU and compute instance, and running processes."""
        ...

    def models(self) -> Mapping[int, GpuModel]:
        """Each GPU's MIG geometry as the hardware reports it (profiles, ids, placements)."""
        ...

    def set_mig_mode(self, gpu: int, *, enabled: bool) -> None:
        """Request MIG on or off. A change that stays pending (needs a reset) is not an error:
        re-observe to see it. Raises GpuBusy when clients hold the GPU."""
        ...

    def reset_gpu(self, gpu: int) -> None:
        """Reset one GPU so a pending MIG mode takes effect. GpuResetRequired when impossible
        (pass-through VM), GpuBusy when processes hold it."""
        ...

    def create_gpu_instance(self, gpu: int, profile_id: int, placement: Placement) -> int:
        """Create a GPU instance at an explicit placement; returns its id."""
        ...

    def create_compute_instance(
        self, gpu: int, gi_id: int, profile_id: int, placement: Placement
    ) -> int:
        """Create a compute instance in GPU instance ``gi_id`` at ``placement``; returns its id."""
        ...

    def destroy_compute_instance(self, gpu: int, gi_id: int, ci_id: int) -> None: ...

    def destroy_gpu_instance(self, gpu: int, gi_id: int) -> None: ...

    def close(self) -> None:
        """Release the library (nvmlShutdown)."""
        ...
