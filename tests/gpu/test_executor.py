"""We test these aspects of apply, assert and export on one node (issue 3), through the executor
over the simulated NVML library beneath pynvml's real wrappers:

* every layout of NVIDIA's GPU Operator default config that fits one of our six MIG models
  applies to a fresh node of two such GPUs, gives each GPU exactly the layout's devices, asserts
  (a second plan is empty, a second apply makes no mutating NVML call), and its export reads back
  through the loader as a layout with the same per-GPU devices whose apply is a no-op;
* from any present state (random MIG modes, GPU instances with or without compute instances,
  split compute instances, an Ampere mode change left pending) apply reaches a random layout,
  destroys exactly as many GPU instances as the plan says, and that is the minimum (checked
  against an independent brute force); a second apply makes zero mutating calls;
* a busy GPU (a process on an instance that must go, or on a GPU whose MIG mode must change) is
  refused with GpuBusy naming the pid, before any NVML call: the node stays exactly as it was;
  a layout that keeps the busy instance goes ahead around it;
* a failure injected at each mutating call of a reference apply (NVML UNKNOWN and
  INSUFFICIENT_RESOURCES) makes that apply raise GpuError right there, and the next apply
  converges with no GPU instance left without a compute instance;
* Ampere: a mode change resets only the GPUs that needed it, Hopper resets none; where reset is
  impossible (pass-through VM) apply raises GpuResetRequired naming the GPU, every GPU that needs
  the change is left pending, and after one reboot the next apply converges.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from migsim.nvml import library as simlib
from migsim.nvml import open_node
from migsim.nvml.state import INSUFFICIENT_RESOURCES, RESET, UNKNOWN

from mig_agent.config.profiles import fit_report, load_catalog, load_text
from mig_agent.core import planner, snapshot
from mig_agent.core.errors import GpuBusy, GpuError, GpuResetRequired, PlanError
from mig_agent.core.gpu_models import MODELS, GiProfile, GpuModel
from mig_agent.core.layout import GpuLayout, Layout
from mig_agent.core.observed import GpuInstance, GpuState, NodeState
from mig_agent.core.placement import Placement
from mig_agent.core.planner import (
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    Plan,
    SetMigMode,
    observed_devices,
)
from mig_agent.gpu.nvml import NvmlGpuBackend
from mig_agent.node.apply import apply_layout, split

from .conftest import REPO, MakeNode

OpenSim = Callable[[str], NvmlGpuBackend]

OPERATOR = load_catalog(
    [REPO / "tests" / "data" / "compat" / "gpu-operator-default-mig-config.yaml"]
)
MIG_MODELS = sorted(k for k, m in MODELS.items() if m.mig_capable)
DESTROY_GI = "nvmlGpuInstanceDestroy"


def operator_cases() -> list[tuple[str, str]]:
    """(model, layout) for every operator layout that applies to and fits a catalog model."""
    return [
        (key, r.layout)
        for key in MIG_MODELS
        for r in fit_report(OPERATOR, MODELS[key])
        if r.applies and r.fits
    ]


def layout_from(entries: list[dict[str, Any]], name: str = "test") -> Layout:
    """A layout built the way users write them: a v1 document read by the loader."""
    text = yaml.safe_dump({"version": "v1", "mig-configs": {name: entries}})
    (layout,) = load_text(text, f"<{name}>")
    return layout


def target_of(layout: Layout, gpu: GpuState) -> GpuLayout:
    target = layout.target_for(gpu.index, gpu.info.pci_device_id, gpu.info.pci_subsystem_id)
    assert target is not None, gpu.index
    return target


def empty_gpu_instances(node: NodeState) -> list[tuple[int, int]]:
    return [
        (g.index, gi.id) for g in node.gpus for gi in g.gpu_instances if not gi.compute_instances
    ]


def assert_reached(layout: Layout, gpus: NvmlGpuBackend) -> None:
    """What ``mig-agent assert`` checks, and what it means: each GPU holds the layout's devices."""
    node, models = gpus.observe(), gpus.models()
    assert planner.plan(layout, node, models, destroy_in_use=True).is_empty
    for g in node.gpus:
        target = target_of(layout, g)
        assert g.mig_current == g.mig_pending == target.mig_enabled, g.index
        assert observed_devices(models[g.index], g) == Counter(target.counts), g.index
    assert empty_gpu_instances(node) == []


# -- the GPU Operator's default layouts -------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "name"), operator_cases(), ids=[f"{k}:{n}" for k, n in operator_cases()]
)
def test_operator_layout_applies_asserts_and_exports(
    key: str, name: str, make_node: MakeNode, open_sim: OpenSim
) -> None:
    layout = OPERATOR.get(name)
    path = make_node(f"2x{key}")
    gpus = open_sim(path)

    report = apply_layout(layout, gpus)
    assert report.layout == name
    assert_reached(layout, gpus)

    simlib.reset_call_counts(path)
    again = apply_layout(layout, gpus)
    assert again.plan.is_empty and not again.changed
    assert simlib.call_counts(path).total == 0

    node, models = gpus.observe(), gpus.models()
    text = yaml.safe_dump(snapshot.export_config(node, models, name="exported"), sort_keys=False)
    (exported,) = load_text(text, "<export>")
    assert exported.name == "exported"
    for g in node.gpus:
        assert target_of(exported, g) == target_of(layout, g), g.index
    assert apply_layout(exported, gpus).plan.is_empty
    assert simlib.call_counts(path).total == 0


# The operator layouts that fit each model, counted from the config file without fit_report
# (all-disabled, all-enabled, all-balanced and the all-<profile> ones of the model's profiles):
# fit_report chooses the cases above, so one that wrongly rejects a layout must fail here rather
# than leave that layout untested.
OPERATOR_LAYOUTS_THAT_FIT = {
    "A100-40GB": 10,
    "A100-80GB": 10,
    "A30": 8,
    "B200": 10,
    "B300": 10,
    "GB200": 10,
    "GB300": 10,
    "H100-80GB": 10,
    "H100-NVL": 10,
    "H200": 10,
    "RTX-PRO-6000": 14,
}


def test_every_mig_model_has_operator_layouts() -> None:
    # Guards the parametrization above against silently testing nothing for a model.
    by_model = Counter(key for key, _ in operator_cases())
    assert sorted(by_model) == MIG_MODELS and len(MIG_MODELS) == 11
    assert all(n >= 8 for n in by_model.values()), by_model
    assert by_model == OPERATOR_LAYOUTS_THAT_FIT


# -- from any present state -------------------------------------------------------------------


def _fits_from_empty(m: GpuModel, gis: Sequence[GiProfile]) -> bool:
    try:
        planner.check_fits(m, gis)
    except PlanError:
        return False
    return True


def _place_all(gis: Sequence[GiProfile], taken: int) -> bool:
    """Depth-first, independent of the planner: can ``gis`` all go on free memory slices?

    (The compute slices a target needs do not depend on which instances are kept.)"""
    failed: set[tuple[int, int]] = set()

    def go(i: int, mask: int) -> bool:
        if i == len(gis):
            return True
        if (i, mask) in failed:
            return False
        for pl in gis[i].placements:
            if not pl.mask & mask and go(i + 1, mask | pl.mask):
                return True
        failed.add((i, mask))
        return False

    return go(0, taken)


def _keepable(m: GpuModel, gi: GpuInstance) -> bool:
    """A present GI can serve a whole-GI demand only with no CI or one CI spanning it. Compared
    by device name, as the planner does: on Hopper a 1-slice GI's REV1 CI profile makes the
    same device as its full CI profile."""
    profile = m.gi_profile_by_id(gi.profile_id)
    if profile is None:
        return False
    cis = [profile.ci_profile_by_id(c.profile_id) for c in gi.compute_instances]
    return len(cis) <= 1 and all(c is not None and profile.ci_name(c) == profile.name for c in cis)


def _min_destroyed(m: GpuModel, gpu: GpuState, target: GpuLayout) -> int:
    """The fewest GPU instances any plan must destroy to turn ``gpu`` into ``target``."""
    present = list(gpu.gpu_instances) if gpu.mig_current else []
    if not target.mig_enabled:
        return len(present)
    demand: Counter[int] = Counter()
    by_id: dict[int, GiProfile] = {}
    for p in target.flatten():
        resolved = m.resolve(str(p))
        assert resolved is not None
        demand[resolved[0].id] += 1
        by_id[resolved[0].id] = resolved[0]
    keepable = [gi for gi in present if _keepable(m, gi)]
    for r in range(len(keepable), -1, -1):
        for kept in itertools.combinations(keepable, r):
            have = Counter(gi.profile_id for gi in kept)
            if have - demand:
                continue
            rest = [by_id[i] for i in (demand - have).elements()]
            taken = 0
            for gi in kept:
                taken |= gi.placement.mask
            if _place_all(sorted(rest, key=lambda p: -p.placement_size), taken):
                return len(present) - r
    raise AssertionError("the target does not fit even an empty GPU")


def _draw_present(data: st.DataObject, gpus: NvmlGpuBackend, m: GpuModel, gpu: int) -> None:
    """Put the GPU (created with MIG on) into a random state, only through NVML calls."""
    mode = data.draw(
        st.sampled_from(["instances", "instances", "instances", "off", "pending-off"]),
        label=f"gpu{gpu} mode",
    )
    if mode != "instances":
        gpus.set_mig_mode(gpu, enabled=False)
        if mode == "off" and gpus.observe().gpu(gpu).mig_current:
            gpus.reset_gpu(gpu)  # Ampere: make the change take effect
        return
    for _ in range(data.draw(st.integers(0, 6), label=f"gpu{gpu} GIs")):
        p = data.draw(st.sampled_from(m.gi_profiles), label="GI profile")
        pl = data.draw(st.sampled_from(p.placements), label="GI placement")
        try:
            gi = gpus.create_gpu_instance(gpu, p.id, pl)
        except GpuError:  # overlaps or the profile is used up: not a state we can reach
            continue
        cis = data.draw(st.sampled_from(["none", "full", "full", "split"]), label="CIs")
        if cis == "full":
            gpus.create_compute_instance(gpu, gi, p.full_ci.id, p.full_ci.placements[0])
        elif cis == "split":
            for _ in range(data.draw(st.integers(1, 3), label="split CIs")):
                ci = data.draw(st.sampled_from(p.ci_profiles), label="CI profile")
                ci_pl = data.draw(st.sampled_from(ci.placements), label="CI placement")
                try:
                    gpus.create_compute_instance(gpu, gi, ci.id, ci_pl)
                except GpuError:
                    continue


def _draw_target(
    data: st.DataObject, m: GpuModel, gpu: int, present: Sequence[GpuInstance]
) -> dict[str, Any]:
    """A random layout entry for GPU ``gpu`` that fits the model (whole-GI devices), often
    reusing profiles present on the GPU so that keeping instances is worth something."""
    if data.draw(st.integers(0, 9), label=f"gpu{gpu} target mode") == 0:
        return {"devices": [gpu], "mig-enabled": False}
    pool = list(m.gi_profiles)
    pool += [p for gi in present if (p := m.gi_profile_by_id(gi.profile_id)) is not None]
    chosen: list[GiProfile] = []
    for _ in range(data.draw(st.integers(0, 7), label=f"gpu{gpu} target size")):
        p = data.draw(st.sampled_from(pool), label="target profile")
        if _fits_from_empty(m, [*chosen, p]):
            chosen.append(p)
    counts = Counter(p.name for p in chosen)
    return {"devices": [gpu], "mig-enabled": True, "mig-devices": dict(counts)}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), key=st.sampled_from(["H200", "A30", "A100-40GB"]))
def test_apply_from_any_state_destroys_the_minimum_and_then_nothing(
    data: st.DataObject, key: str
) -> None:
    m = MODELS[key]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "node.json")
        simlib.create_node(path, f"2x{key}", mig_enabled=True)
        gpus = open_node(path)
        try:
            for gpu in (0, 1):
                _draw_present(data, gpus, m, gpu)
            before, models = gpus.observe(), gpus.models()
            layout = layout_from(
                [_draw_target(data, m, g.index, g.gpu_instances) for g in before.gpus]
            )
            the_plan = planner.plan(layout, before, models)
            planned = {g.gpu: g.destroyed_gpu_instances for g in the_plan.gpus}
            for g in before.gpus:
                assert planned[g.index] == _min_destroyed(m, g, target_of(layout, g)), g.index

            simlib.reset_call_counts(path)
            report = apply_layout(layout, gpus)
            counts = simlib.call_counts(path).by_gpu_function
            for gpu in (0, 1):
                assert counts.get(gpu, {}).get(DESTROY_GI, 0) == planned[gpu], gpu
                done = report.gpus.get(gpu)
                assert (done.destroyed_gpu_instances if done else 0) == planned[gpu]
            assert_reached(layout, gpus)
            after = gpus.observe()
            for g in before.gpus:  # every MIG device not destroyed keeps its UUID
                uuids = {c.uuid for gi in g.gpu_instances for c in gi.compute_instances}
                now = {
                    c.uuid for gi in after.gpu(g.index).gpu_instances for c in gi.compute_instances
                }
                gone = counts.get(g.index, {}).get("nvmlComputeInstanceDestroy", 0)
                assert len(uuids - now) == gone, g.index
                kept = len(g.gpu_instances) - planned[g.index] if g.mig_current else 0
                event(f"kept {min(kept, 2)}+, destroyed {min(planned[g.index], 2)}+")

            simlib.reset_call_counts(path)
            again = apply_layout(layout, gpus)
            assert again.plan.is_empty and not again.changed
            assert simlib.call_counts(path).total == 0
        finally:
            gpus.close()


def test_minimum_oracle_sees_a_cheaper_keep_than_destroying_everything() -> None:
    # The oracle above must not be trivially "destroy all": on a 1g + 2g + 3g H200, moving to
    # 2 x 3g keeps the 3g at 4 and destroys two instances, not three.
    m = MODELS["H200"]
    node, _ = snapshot.empty_node([m])
    gpu = node.gpus[0]
    gis = (
        GpuInstance(7, 19, Placement(0, 1)),
        GpuInstance(4, 14, Placement(2, 2)),
        GpuInstance(2, 9, Placement(4, 4)),
    )
    gpu = GpuState(gpu.info, True, True, True, gis)
    target = layout_from([{"devices": "all", "mig-enabled": True, "mig-devices": {"3g.71gb": 2}}])
    assert _min_destroyed(m, gpu, target_of(target, gpu)) == 2
    plan = planner.plan_gpu(m, gpu, target_of(target, gpu))
    assert plan.destroyed_gpu_instances == 2


# -- busy GPUs ----------------------------------------------------------------------------------


def test_busy_instance_that_must_go_is_refused_and_nothing_changes(
    make_node: MakeNode, open_sim: OpenSim
) -> None:
    path = make_node("2xH200")
    gpus = open_sim(path)
    apply_layout(OPERATOR.get("all-1g.18gb"), gpus)
    gi = next(x for x in gpus.observe().gpu(1).gpu_instances if x.placement == Placement(0, 1))
    simlib.add_process(path, 1, 4242, gi=gi.id, ci=gi.compute_instances[0].id)
    before = gpus.observe()
    simlib.reset_call_counts(path)

    with pytest.raises(GpuBusy, match=r"GPU 1 .*4242") as refused:
        apply_layout(OPERATOR.get("all-7g.141gb"), gpus)
    assert refused.value.context["pids"] == [4242]
    assert gpus.observe() == before
    assert simlib.call_counts(path).total == 0

    # A layout that keeps the busy instance goes ahead around it.
    balanced = OPERATOR.get("all-balanced")
    report = apply_layout(balanced, gpus)
    assert_reached(balanced, gpus)
    assert report.gpus[1].destroyed_gpu_instances == 5  # all but 1g@0 (busy) and 1g@1
    still = next(x for x in gpus.observe().gpu(1).gpu_instances if x.id == gi.id)
    assert still.placement == gi.placement and still.compute_instances == gi.compute_instances


def test_busy_gpu_whose_mig_mode_must_change_is_refused(
    make_node: MakeNode, open_sim: OpenSim
) -> None:
    path = make_node("2xA100-40GB")
    gpus = open_sim(path)
    simlib.add_process(path, 0, 777)
    before = gpus.observe()
    simlib.reset_call_counts(path)
    with pytest.raises(GpuBusy, match="MIG mode change.*777"):
        apply_layout(OPERATOR.get("all-1g.5gb"), gpus)
    assert gpus.observe() == before
    assert simlib.call_counts(path).total == 0


# -- a failure at each mutating step ----------------------------------------------------------

FAULT_CASES = [
    # destroys (CI, GI), creates (GI, CI) on two Hopper GPUs
    ("2xH200", "all-balanced", "all-2g.35gb"),
    # MIG mode change with a reset per GPU, then creates, on two Ampere GPUs
    ("2xA100-40GB", None, "all-balanced"),
]
_FUNCTION = {
    SetMigMode: "nvmlDeviceSetMigMode",
    DestroyComputeInstance: "nvmlComputeInstanceDestroy",
    DestroyGpuInstance: DESTROY_GI,
    CreateGpuInstance: "nvmlDeviceCreateGpuInstanceWithPlacement",
    CreateComputeInstance: "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
}


def expected_calls(the_plan: Plan, models: Mapping[int, GpuModel]) -> list[tuple[int, str]]:
    """The mutating calls (GPU, function) a plan makes, in order: as mig-parted applies, every
    GPU's destroys and mode change first, then the instances; Ampere mode changes reset."""
    calls: list[tuple[int, str]] = []
    mode, config = split(the_plan)
    for step in (*mode.steps, *config.steps):
        calls.append((step.gpu, _FUNCTION[type(step)]))
        if isinstance(step, SetMigMode) and models[step.gpu].architecture.mig_mode_needs_reset:
            calls.append((step.gpu, RESET))
    return calls


def counted(path: str) -> Counter[tuple[int, str]]:
    return Counter(
        {
            (g, f): n
            for g, per in simlib.call_counts(path).by_gpu_function.items()
            for f, n in per.items()
            if n
        }
    )


def prepared(
    make_node: MakeNode, open_sim: OpenSim, spec: str, start: str | None
) -> tuple[str, NvmlGpuBackend]:
    """A new simulated node of ``spec`` at layout ``start`` (None: as created), its NVML call
    counters reset."""
    path = make_node(spec)
    gpus = open_sim(path)
    if start is not None:
        apply_layout(OPERATOR.get(start), gpus)
    simlib.reset_call_counts(path)
    return path, gpus


@pytest.mark.parametrize("code", [UNKNOWN, INSUFFICIENT_RESOURCES], ids=["UNKNOWN", "INSUF"])
@pytest.mark.parametrize(("spec", "start", "target"), FAULT_CASES, ids=["H200", "A100"])
def test_a_failed_step_stops_the_apply_and_the_next_apply_converges(
    spec: str, start: str | None, target: str, code: int, make_node: MakeNode, open_sim: OpenSim
) -> None:
    layout = OPERATOR.get(target)

    path, gpus = prepared(make_node, open_sim, spec, start)
    reference = apply_layout(layout, gpus)
    calls = expected_calls(reference.plan, gpus.models())
    assert counted(path) == Counter(calls)  # the plan's steps are exactly the calls made
    assert len(calls) >= 16
    for n, (gpu, _function) in enumerate(calls, start=1):
        path, gpus = prepared(make_node, open_sim, spec, start)
        simlib.inject_failure(path, code, nth=n)
        with pytest.raises(GpuError, match=f"GPU {gpu}") as failed:
            apply_layout(layout, gpus)
        assert not isinstance(failed.value, GpuBusy | GpuResetRequired), (n, failed.value)
        made = calls[:n]
        assert counted(path) == Counter(made), n  # nothing after the failed call
        apply_layout(layout, gpus)
        assert_reached(layout, gpus)
        gpus.close()


def test_injected_reset_fault_fires_once_and_is_counted(make_node: MakeNode) -> None:
    path = make_node("A100-40GB")
    simlib.inject_failure(path, UNKNOWN, function=RESET)
    with pytest.raises(simlib.SimError):
        simlib.reset_gpu(path, 0)
    simlib.reset_gpu(path, 0)  # the rule said once
    assert simlib.call_counts(path).by_function == {RESET: 2}


# -- Ampere: mode changes and resets ----------------------------------------------------------


def test_ampere_mode_change_resets_only_the_gpus_that_need_it(
    make_node: MakeNode, open_sim: OpenSim
) -> None:
    path = make_node("3xA100-40GB")
    gpus = open_sim(path)
    apply_layout(layout_from([{"devices": [0], "mig-enabled": True, "mig-devices": {}}]), gpus)
    simlib.reset_call_counts(path)

    layout = OPERATOR.get("all-1g.5gb")
    report = apply_layout(layout, gpus)
    assert_reached(layout, gpus)
    counts = simlib.call_counts(path).by_gpu_function
    assert {g for g, f in counts.items() if f.get("reset")} == {1, 2}
    assert counts[1]["reset"] == counts[2]["reset"] == 1
    assert "nvmlDeviceSetMigMode" not in counts[0]
    assert [(g, r.mig_mode_set, r.reset) for g, r in sorted(report.gpus.items())] == [
        (0, False, False),
        (1, True, True),
        (2, True, True),
    ]


def test_hopper_mode_change_needs_no_reset(make_node: MakeNode, open_sim: OpenSim) -> None:
    path = make_node("2xH100-80GB")
    gpus = open_sim(path)
    report = apply_layout(OPERATOR.get("all-3g.40gb"), gpus)
    assert_reached(OPERATOR.get("all-3g.40gb"), gpus)
    assert simlib.call_counts(path).by_function.get("reset", 0) == 0
    assert not any(r.reset for r in report.gpus.values())


@pytest.mark.parametrize("reset", [True, False], ids=["reset-impossible", "skip-reset"])
def test_ampere_without_reset_raises_reset_required_and_leaves_the_gpus_pending(
    reset: bool, make_node: MakeNode, open_sim: OpenSim
) -> None:
    path = make_node("2xA100-40GB", passthrough=True, reset_supported=not reset)
    gpus = open_sim(path)
    layout = OPERATOR.get("all-1g.5gb")
    with pytest.raises(GpuResetRequired, match="GPU 0") as pending:
        apply_layout(layout, gpus, reset=reset)
    assert pending.value.context["gpu"] == 0 and pending.value.context["gpus"] == [0, 1]
    assert "GPU 1" in str(pending.value)
    node = gpus.observe()
    # Every GPU that needs the change is left pending, so that one reboot finishes them all.
    assert [(g.mig_current, g.mig_pending) for g in node.gpus] == [(False, True)] * 2
    assert empty_gpu_instances(node) == []

    simlib.reboot_node(path)
    apply_layout(layout, gpus, reset=reset)
    assert_reached(layout, gpus)


def test_pending_change_blocks_nothing_else(make_node: MakeNode, open_sim: OpenSim) -> None:
    # GPU 0 needs a reset that is impossible; GPU 1 is already in MIG mode and still gets its
    # instances, so the node needs one reboot and no second pass.
    path = make_node("2xA100-40GB", reset_supported=False)
    simlib.set_reset_supported(path, True, gpu=1)
    gpus = open_sim(path)
    apply_layout(layout_from([{"devices": [1], "mig-enabled": True, "mig-devices": {}}]), gpus)
    layout = OPERATOR.get("all-3g.20gb")
    with pytest.raises(GpuResetRequired, match="GPU 0"):
        apply_layout(layout, gpus)
    gpu1 = gpus.observe().gpu(1)
    assert observed_devices(MODELS["A100-40GB"], gpu1) == Counter({"3g.20gb": 2})


def test_plan_error_touches_nothing(make_node: MakeNode, open_sim: OpenSim) -> None:
    path = make_node("2xA30")
    gpus = open_sim(path)
    with pytest.raises(PlanError, match="A30"):
        apply_layout(OPERATOR.get("all-1g.18gb"), gpus)
    assert simlib.call_counts(path).total == 0
