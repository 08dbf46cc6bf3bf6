"""A mutating NVML call that takes effect and still reports an error (an instance created, or
destroyed, though the caller is told it failed: state.inject_failure(after=True)), at each
mutating call of a reference apply: that apply raises GpuError, and the next apply, planning
from what NVML now reports, converges with no GPU instance left without a compute instance."""

from __future__ import annotations

import pytest
from migsim.nvml import library as simlib
from migsim.nvml.state import UNKNOWN

from mig_agent.core.errors import GpuError, GpuStepFailed
from mig_agent.node.apply import apply_layout

from .conftest import MakeNode
from .test_executor import (
    FAULT_CASES,
    OPERATOR,
    OpenSim,
    assert_reached,
    counted,
    expected_calls,
    prepared,
)


@pytest.mark.parametrize(("spec", "start", "target"), FAULT_CASES, ids=["H200", "A100"])
def test_a_call_that_half_succeeds_stops_the_apply_and_the_next_apply_converges(
    spec: str, start: str | None, target: str, make_node: MakeNode, open_sim: OpenSim
) -> None:
    layout = OPERATOR.get(target)

    path, gpus = prepared(make_node, open_sim, spec, start)
    calls = expected_calls(apply_layout(layout, gpus).plan, gpus.models())
    for n, (gpu, _function) in enumerate(calls, start=1):
        path, gpus = prepared(make_node, open_sim, spec, start)
        simlib.inject_failure(path, UNKNOWN, nth=n, after=True)
        with pytest.raises(GpuError, match=f"GPU {gpu}") as failed:
            apply_layout(layout, gpus)
        # the GPU may hold part of the change: the agent retries, and the retry re-plans
        assert isinstance(failed.value, GpuStepFailed) and failed.value.retryable, n
        assert sum(counted(path).values()) == n  # nothing after the call that half succeeded
        apply_layout(layout, gpus)
        assert_reached(layout, gpus)
        gpus.close()


def test_the_half_success_is_done_in_the_state(make_node: MakeNode, open_sim: OpenSim) -> None:
    path = make_node("H200")
    gpus = open_sim(path)
    apply_layout(OPERATOR.get("all-balanced"), gpus)
    before = len(gpus.observe().gpus[0].gpu_instances)
    simlib.inject_failure(path, UNKNOWN, function="nvmlGpuInstanceDestroy", after=True)
    with pytest.raises(GpuError):
        apply_layout(OPERATOR.get("all-disabled"), gpus)
    assert len(gpus.observe().gpus[0].gpu_instances) == before - 1  # destroyed, yet "failed"
    gpus.close()
