"""We test that the histogram `mig_agent_reconfiguration_phase_seconds` accounts for a
reconfiguration up to the node advertising its layout, so that an operator reads from Prometheus
where the time went:

* every API request and NVML call of a pass, from the start of its first phase (`plan`) to the end
  of the device plugin's (the node advertises the layout), is made inside a named phase: the
  checks before anything changes, `pending` and the cordon too (`prepare`), and the drain's look
  at the label before the GPUs change (`drain`);
* the phases come in the order `metrics.PHASES` lists them, each observed once per pass.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from mig_agent.agent import Outcome
from mig_agent.observability.metrics import PHASES
from tests.unit.fake_cluster import FakeCluster

from .fake_gpus import FakeGpus
from .test_agent import NODE, label, make

CLUSTER_CALLS = (
    "get_node",
    "list_nodes",
    "patch_node",
    "set_node_condition",
    "watch_node",
    "list_pods",
    "watch_pods",
    "get_pod",
    "evict",
    "delete_pod",
    "emit_event",
    "list_resource_slices",
    "list_resource_claims",
    "list_pod_disruption_budgets",
)
GPU_CALLS = (
    "observe",
    "models",
    "set_mig_mode",
    "reset_gpu",
    "create_gpu_instance",
    "create_compute_instance",
    "destroy_compute_instance",
    "destroy_gpu_instance",
)


class Trace:
    """What a pass did, in order: ("start"/"end", phase) and ("call", name, the open phases)."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, ...]] = []
        self.open: list[str] = []
        self.world = 0  # > 0 while the fake device plugin (not the agent) acts

    def timed(self, phase: Callable[[str], Any]) -> Callable[[str], Any]:
        @contextlib.contextmanager
        def traced(name: str) -> Iterator[None]:
            self.steps.append(("start", name))
            self.open.append(name)
            try:
                with phase(name):
                    yield
            finally:
                self.open.pop()
                self.steps.append(("end", name))

        return traced

    def calls(self, target: object, names: tuple[str, ...]) -> None:
        for name in names:
            method = getattr(target, name)

            @functools.wraps(method)
            def traced(*a: Any, _m: Any = method, _n: str = name, **kw: Any) -> Any:
                if not self.world:
                    self.steps.append(("call", _n, ",".join(self.open)))
                return _m(*a, **kw)

            setattr(target, name, traced)

    def acting(self, world: Callable[[FakeCluster], None]) -> Callable[[FakeCluster], None]:
        def traced(c: FakeCluster) -> None:
            self.world += 1
            try:
                world(c)
            finally:
                self.world -= 1

        return traced


def traced_pass(layout: str) -> Trace:
    agent, cluster, gpus = make()
    cluster.add_pod("work", "train", NODE, gpu={"nvidia.com/gpu": 1})
    label(cluster, layout)
    trace = Trace()
    agent.metrics.phase = trace.timed(agent.metrics.phase)  # type: ignore[method-assign]
    trace.calls(cluster, CLUSTER_CALLS)
    assert isinstance(gpus, FakeGpus)
    trace.calls(gpus, GPU_CALLS)
    assert cluster.on_change is not None
    cluster.on_change = trace.acting(cluster.on_change)
    assert agent.reconcile_once().outcome is Outcome.APPLIED
    return trace


def test_every_call_up_to_the_advertised_layout_is_inside_a_phase() -> None:
    steps = traced_pass("all-1g.10gb").steps
    first = steps.index(("start", "plan"))
    last = steps.index(("end", "device_plugin"))
    outside = [s[1] for s in steps[first:last] if s[0] == "call" and not s[2]]
    assert not outside, f"calls outside every phase: {outside}"


def test_the_phases_come_in_their_listed_order_once_each() -> None:
    trace = traced_pass("all-balanced")
    started = [s[1] for s in trace.steps if s[0] == "start"]
    assert started == ["plan", "prepare", "drain", "apply", "verify", "device_plugin"]
    assert [p for p in PHASES if p in started] == started
