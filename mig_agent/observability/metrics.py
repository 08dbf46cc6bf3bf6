"""Prometheus metrics of the agent, on a registry of its own, plus a GpuBackend wrapper that
counts NVML calls and errors.

Names follow the Prometheus conventions: counters are exposed as ``<name>_total``, durations and
timestamps in seconds with a ``_seconds`` suffix, everything under ``mig_agent_``. No ``_created``
series: they would double every counter and histogram for no use here. Label values are bounded:
results, phases, states, NVML and API call names, GPU indices and MIG profile names come from
fixed sets; layouts come from the node's label, so at most ``MAX_LAYOUTS`` distinct ones are kept
per process and any further one counts as ``OTHER_LAYOUT``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

from mig_agent.core.errors import GpuError
from mig_agent.core.gpu_models import GpuModel
from mig_agent.core.observed import NodeState
from mig_agent.core.placement import Placement
from mig_agent.gpu.backend import GpuBackend

T = TypeVar("T")
STATES = ("pending", "rebooting", "success", "failed")
# A reconfiguration's phases in their order, up to the node advertising the layout (each API
# request and NVML call of a pass until then falls in one): the plan against the GPUs as they
# are; the checks before anything changes, `pending`, the cordon and the operands paused; the
# drain, until the pods and paused operands are gone; the GPU steps; the re-read of the GPUs; the
# post-apply hooks (only where some are set); the device plugin's restart until the node lists
# the layout, or on a DRA node the DRA plugin's until its ResourceSlice does.
PHASES = (
    "plan",
    "prepare",
    "drain",
    "apply",
    "verify",
    "post_apply",
    "device_plugin",
    "dra_plugin",
)
RESULTS = ("success", "failed")
MAX_LAYOUTS = 32
OTHER_LAYOUT = "other"

# Process-wide switch of prometheus_client; it must be off before the metrics are created.
disable_created_metrics()  # type: ignore[no-untyped-call]


class LayoutCounter:
    """A Counter by ``result`` and ``layout`` that keeps at most ``limit`` layout values."""

    def __init__(self, counter: Counter, limit: int = MAX_LAYOUTS) -> None:
        self.counter = counter
        self._limit = limit
        self._layouts: set[str] = set()
        self._lock = threading.Lock()

    def labels(self, *, result: str, layout: str) -> Counter:
        with self._lock:
            if layout not in self._layouts:
                if len(self._layouts) >= self._limit:
                    layout = OTHER_LAYOUT
                else:
                    self._layouts.add(layout)
        return self.counter.labels(result=result, layout=layout)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reconfigurations = LayoutCounter(
            Counter(
                "mig_agent_reconfigurations",
                "Reconfiguration passes that changed or tried to change the node, by result "
                "and layout",
                ["result", "layout"],
                registry=r,
            )
        )
        self.phase_seconds = Histogram(
            "mig_agent_reconfiguration_phase_seconds",
            "Time spent per phase of a reconfiguration",
            ["phase"],
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.evictions = Counter("mig_agent_evictions", "Pods evicted from the node", registry=r)
        self.taint_fallbacks = Counter(
            "mig_agent_device_taint_fallbacks",
            "Changes of a DRA node that cordoned it whole: DeviceTaintRules not served or "
            "not listable",
            registry=r,
        )
        self.nvml_calls = Counter(
            "mig_agent_nvml_calls", "NVML operations by call", ["call"], registry=r
        )
        self.nvml_errors = Counter(
            "mig_agent_nvml_errors", "NVML operations that failed, by call", ["call"], registry=r
        )
        self.api_requests = Counter(
            "mig_agent_api_requests",
            "Requests to the Kubernetes API server, by call",
            ["call"],
            registry=r,
        )
        self.state = Gauge(
            "mig_agent_state", "1 for the node's current MIG config state", ["state"], registry=r
        )
        self.mig_devices = Gauge(
            "mig_agent_mig_devices",
            "MIG devices per GPU and profile",
            ["gpu", "profile"],
            registry=r,
        )
        self.unhealthy_devices = Gauge(
            "mig_agent_unhealthy_devices",
            "Devices the device plugin lists as unhealthy (kept out of allocatable), by resource",
            ["resource"],
            registry=r,
        )
        self.last_success = Gauge(
            "mig_agent_last_success_timestamp_seconds",
            "Unix time of the last successful reconfiguration or check",
            registry=r,
        )

    def set_state(self, state: str) -> None:
        for s in STATES:
            self.state.labels(state=s).set(1 if s == state else 0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.phase_seconds.labels(phase=name).observe(time.monotonic() - start)

    def set_unhealthy(self, unhealthy: Mapping[str, int]) -> None:
        self.unhealthy_devices.clear()
        for resource, n in unhealthy.items():
            self.unhealthy_devices.labels(resource=resource).set(n)

    def set_devices(self, devices: Mapping[int, Mapping[str, int]]) -> None:
        self.mig_devices.clear()
        for gpu, counts in devices.items():
            for profile, n in counts.items():
                self.mig_devices.labels(gpu=str(gpu), profile=profile).set(n)


class InstrumentedGpus(GpuBackend):
    """A GpuBackend that counts every call and error of the one it wraps."""

    def __init__(self, inner: GpuBackend, metrics: Metrics) -> None:
        self._inner = inner
        self._m = metrics

    def _count(self, call: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        self._m.nvml_calls.labels(call=call).inc()
        try:
            return fn(*args, **kwargs)
        except GpuError:
            self._m.nvml_errors.labels(call=call).inc()
            raise

    def observe(self) -> NodeState:
        return self._count("observe", self._inner.observe)

    def models(self) -> Mapping[int, GpuModel]:
        return self._count("models", self._inner.models)

    def set_mig_mode(self, gpu: int, *, enabled: bool) -> None:
        self._count("set_mig_mode", self._inner.set_mig_mode, gpu, enabled=enabled)

    def reset_gpu(self, gpu: int) -> None:
        self._count("reset_gpu", self._inner.reset_gpu, gpu)

    def create_gpu_instance(self, gpu: int, profile_id: int, placement: Placement) -> int:
        return self._count(
            "create_gpu_instance", self._inner.create_gpu_instance, gpu, profile_id, placement
        )

    def create_compute_instance(
        self, gpu: int, gi_id: int, profile_id: int, placement: Placement
    ) -> int:
        return self._count(
            "create_compute_instance",
            self._inner.create_compute_instance,
            gpu,
            gi_id,
            profile_id,
            placement,
        )

    def destroy_compute_instance(self, gpu: int, gi_id: int, ci_id: int) -> None:
        self._count(
            "destroy_compute_instance", self._inner.destroy_compute_instance, gpu, gi_id, ci_id
        )

    def destroy_gpu_instance(self, gpu: int, gi_id: int) -> None:
        self._count("destroy_gpu_instance", self._inner.destroy_gpu_instance, gpu, gi_id)

    def close(self) -> None:
        self._inner.close()
