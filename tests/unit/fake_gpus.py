"""An in-memory GpuBackend for unit tests of the planner and executor.

It enforces what matters for them (valid placement, no overlap, instance counts, IN_USE for
processes) and counts mutating calls. The real-behaviour simulator is migsim.nvml.library.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import replace

from mig_agent.core.errors import GpuBusy, GpuError
from mig_agent.core.gpu_models import GpuModel
from mig_agent.core.observed import (
    ComputeInstance,
    GpuInfo,
    GpuInstance,
    GpuProcess,
    GpuState,
    NodeState,
)
from mig_agent.core.placement import Placement


class FakeGpus:
    def __init__(self, models: list[GpuModel], *, mig_enabled: bool = False) -> None:
        self._models = {i: m for i, m in enumerate(models)}
        self.gpus: dict[int, GpuState] = {
            i: GpuState(
                GpuInfo(
                    i,
                    m.name,
                    f"GPU-{i:08d}",
                    f"00000000:{0x18 + i:02X}:00.0",
                    m.pci_device_id,
                    m.pci_subsystem_id,
                    m.memory_total_mib,
                ),
                m.mig_capable,
                mig_enabled and m.mig_capable,
                mig_enabled and m.mig_capable,
            )
            for i, m in self._models.items()
        }
        self.calls: Counter[int] = Counter()
        self.serial = 0
        self.fail_on: str | None = None

    # GpuBackend
    def observe(self) -> NodeState:
        return NodeState(tuple(self.gpus[i] for i in sorted(self.gpus)))

    def models(self) -> Mapping[int, GpuModel]:
        return self._models

    def set_mig_mode(self, gpu: int, *, enabled: bool) -> None:
        self._mutate(gpu, "set_mig_mode")
        g = self.gpus[gpu]
        if g.gpu_instances:
            raise GpuBusy("GPU instances present")
        self.gpus[gpu] = replace(g, mig_current=enabled, mig_pending=enabled)

    def reset_gpu(self, gpu: int) -> None:
        self._mutate(gpu, "reset_gpu")

    def create_gpu_instance(self, gpu: int, profile_id: int, placement: Placement) -> int:
        self._mutate(gpu, "create_gpu_instance")
        g, m = self.gpus[gpu], self._models[gpu]
        profile = m.gi_profile_by_id(profile_id)
        if not g.mig_current or profile is None or placement not in profile.placements:
            raise GpuError(f"bad create {profile_id} {placement}")
        if any(gi.placement.overlaps(placement) for gi in g.gpu_instances):
            raise GpuError("overlap")
        if sum(gi.profile_id == profile_id for gi in g.gpu_instances) >= profile.instance_count:
            raise GpuError("count")
        new_id = min(set(range(32)) - {gi.id for gi in g.gpu_instances})
        self.gpus[gpu] = replace(
            g, gpu_instances=(*g.gpu_instances, GpuInstance(new_id, profile_id, placement))
        )
        return new_id

    def create_compute_instance(
        self, gpu: int, gi_id: int, profile_id: int, placement: Placement
    ) -> int:
        self._mutate(gpu, "create_compute_instance")
        g = self.gpus[gpu]
        gi = next(x for x in g.gpu_instances if x.id == gi_id)
        profile = self._models[gpu].gi_profile_by_id(gi.profile_id)
        assert profile is not None
        ci_profile = next(c for c in profile.ci_profiles if c.id == profile_id)
        if placement not in ci_profile.placements or any(
            c.placement.overlaps(placement) for c in gi.compute_instances
        ):
            raise GpuError("bad CI placement")
        ci_id = min(set(range(8)) - {c.id for c in gi.compute_instances})
        self.serial += 1  # MIG UUIDs are unique over the fake's life, as real ones are
        new_gi = replace(
            gi,
            compute_instances=(
                *gi.compute_instances,
                ComputeInstance(
                    ci_id, profile_id, placement, f"MIG-{gpu}-{gi_id}-{ci_id}-{self.serial}"
                ),
            ),
        )
        self.gpus[gpu] = replace(
            g, gpu_instances=tuple(new_gi if x.id == gi_id else x for x in g.gpu_instances)
        )
        return ci_id

    def destroy_compute_instance(self, gpu: int, gi_id: int, ci_id: int) -> None:
        self._mutate(gpu, "destroy_compute_instance")
        g = self.gpus[gpu]
        if any(p.gi_id == gi_id and p.ci_id == ci_id for p in g.processes):
            raise GpuBusy("in use")
        self.gpus[gpu] = replace(
            g,
            gpu_instances=tuple(
                replace(x, compute_instances=tuple(c for c in x.compute_instances if c.id != ci_id))
                if x.id == gi_id
                else x
                for x in g.gpu_instances
            ),
        )

    def destroy_gpu_instance(self, gpu: int, gi_id: int) -> None:
        self._mutate(gpu, "destroy_gpu_instance")
        g = self.gpus[gpu]
        gi = next(x for x in g.gpu_instances if x.id == gi_id)
        if gi.compute_instances or any(p.gi_id == gi_id for p in g.processes):
            raise GpuBusy("in use")
        self.gpus[gpu] = replace(
            g, gpu_instances=tuple(x for x in g.gpu_instances if x.id != gi_id)
        )

    def close(self) -> None:
        pass

    # test helpers
    def add_process(self, gpu: int, pid: int, gi_id: int | None, ci_id: int | None = 0) -> None:
        """A process on MIG device (gi_id, ci_id), or on the whole GPU with gi_id None."""
        if gi_id is None:
            ci_id = None
        g = self.gpus[gpu]
        self.gpus[gpu] = replace(g, processes=(*g.processes, GpuProcess(pid, gi_id, ci_id)))

    def _mutate(self, gpu: int, op: str) -> None:
        self.calls[gpu] += 1
        if self.fail_on == op:
            self.fail_on = None
            raise GpuError(f"injected failure in {op}")
