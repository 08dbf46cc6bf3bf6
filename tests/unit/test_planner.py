"""We test these aspects of the planner:

* completeness: every multiset of GPU-instance profiles that fits a model (found here by a
  brute-force search over placements, independent of the planner) is planned from an empty GPU
  with valid, non-overlapping placements; every multiset that does not fit is refused with a reason;
* from random present states: kept instances never move, nothing in use is destroyed, and
  applying the plan's steps yields the desired devices; a second plan is empty;
* error messages name the GPU, the model and the cause.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mig_agent.core.errors import GpuBusy, PlanError
from mig_agent.core.gpu_models import MODELS, GiProfile, GpuModel
from mig_agent.core.layout import DeviceSelector, GpuLayout, Layout, MigProfile, Rule
from mig_agent.core.planner import (
    CreateGpuInstance,
    DestroyGpuInstance,
    observed_devices,
    plan,
    plan_gpu,
)
from mig_agent.node.apply import execute

from ..oracle import fitting_multisets
from .fake_gpus import FakeGpus

MIG_MODELS = [m for m in MODELS.values() if m.mig_capable]


def layout_of(counts: dict[str, int], name: str = "test") -> Layout:
    gl = GpuLayout.of(True, {MigProfile.parse(k): v for k, v in counts.items()})
    return Layout(name, (Rule(DeviceSelector(), gl),))


def all_multisets(model: GpuModel) -> list[dict[str, int]]:
    ranges = [range(gi.instance_count + 1) for gi in model.gi_profiles]
    out = []
    for counts in itertools.product(*ranges):
        out.append({gi.name: n for gi, n in zip(model.gi_profiles, counts, strict=True) if n})
    return out


def empty_gpu(model: GpuModel, *, mig: bool = True) -> FakeGpus:
    return FakeGpus([model], mig_enabled=mig)


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.key)
def test_planner_places_exactly_the_multisets_that_fit(model: GpuModel) -> None:
    fits = fitting_multisets(model)
    gi_by_name = {gi.name: gi for gi in model.gi_profiles}
    planned = refused = 0
    for counts in all_multisets(model):
        key = tuple(sorted(counts.items()))
        gpus = empty_gpu(model)
        layout = layout_of(counts)
        if key in fits:
            p = plan(layout, gpus.observe(), gpus.models())
            creates = [s for s in p.steps if isinstance(s, CreateGpuInstance)]
            assert Counter(s.profile for s in creates) == Counter(counts)
            mask = 0
            for s in creates:
                assert s.placement in gi_by_name[s.profile].placements
                assert not s.placement.mask & mask, f"overlap in {counts}"
                mask |= s.placement.mask
            planned += 1
        else:
            with pytest.raises(PlanError) as err:
                plan(layout, gpus.observe(), gpus.models())
            assert model.key in str(err.value)
            refused += 1
    assert planned == len(fits) and refused > 0


def test_h200_balanced_plan_uses_real_placements() -> None:
    model = MODELS["H200"]
    gpus = empty_gpu(model, mig=False)
    p = plan(layout_of({"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1}), gpus.observe(), gpus.models())
    creates = {(s.profile, str(s.placement)) for s in p.steps if isinstance(s, CreateGpuInstance)}
    # H200 table: 1g.18gb {0..6}:1, 2g.35gb {0,2,4}:2, 3g.71gb {0,4}:4
    assert creates == {
        ("3g.71gb", "4:4"),
        ("2g.35gb", "0:2"),
        ("1g.18gb", "2:1"),
        ("1g.18gb", "3:1"),
    }


def test_unknown_profile_names_the_profiles_of_the_model() -> None:
    gpus = empty_gpu(MODELS["H200"])
    with pytest.raises(PlanError, match=r"no MIG profile 1g\.10gb on NVIDIA H200.*1g\.18gb"):
        plan(layout_of({"1g.10gb": 7}), gpus.observe(), gpus.models())


def test_too_many_instances_says_the_limit() -> None:
    gpus = empty_gpu(MODELS["H100-80GB"])
    with pytest.raises(PlanError, match=r"8 x 1g\.10gb requested, but H100-80GB allows at most 7"):
        plan(layout_of({"1g.10gb": 8}), gpus.observe(), gpus.models())


def test_too_many_memory_slices_lists_the_profiles() -> None:
    gpus = empty_gpu(MODELS["H200"])
    with pytest.raises(PlanError, match=r"needs 9 memory slices \(4g\.71gb:4 \+ .*H200 has 8"):
        plan(layout_of({"4g.71gb": 1, "1g.35gb": 2, "1g.18gb": 1}), gpus.observe(), gpus.models())


def test_too_many_compute_slices_is_refused() -> None:
    gpus = empty_gpu(MODELS["H100-80GB"])
    with pytest.raises(PlanError, match="needs 8 compute slices, H100-80GB has 7"):
        plan(layout_of({"4g.40gb": 1, "2g.20gb": 2}), gpus.observe(), gpus.models())


def test_fragmented_gpu_is_repacked_by_moving_only_what_blocks() -> None:
    """1g instances at 0 and 4 block both 3g placements: exactly one of them must go."""
    model = MODELS["H200"]
    gpus = empty_gpu(model)
    pid = model.gi_by_name["1g.18gb"].id
    gpus.create_gpu_instance(0, pid, model.gi_by_name["1g.18gb"].placements[0])
    gpus.create_gpu_instance(0, pid, model.gi_by_name["1g.18gb"].placements[4])
    for gi in gpus.observe().gpu(0).gpu_instances:
        gpus.create_compute_instance(0, gi.id, 0, model.gi_by_name["1g.18gb"].full_ci.placements[0])
    p = plan(layout_of({"3g.71gb": 1, "1g.18gb": 2}), gpus.observe(), gpus.models())
    assert p.gpus[0].destroyed_gpu_instances == 1
    execute(p, gpus)
    assert observed_devices(model, gpus.observe().gpu(0)) == {"3g.71gb": 1, "1g.18gb": 2}


def test_layout_selecting_no_gpu_is_an_error() -> None:
    gpus = empty_gpu(MODELS["H200"])
    from mig_agent.core.layout import DeviceFilter

    only_a30 = Layout(
        "a30-only",
        (Rule(DeviceSelector(filters=(DeviceFilter(0x20B710DE),)), GpuLayout.of(True, {})),),
    )
    with pytest.raises(PlanError, match="selects none of this node's GPUs"):
        plan(only_a30, gpus.observe(), gpus.models())


def test_plan_is_empty_when_gpu_already_matches() -> None:
    gpus = empty_gpu(MODELS["A100-40GB"], mig=False)
    layout = layout_of({"1g.5gb": 7})
    execute(plan(layout, gpus.observe(), gpus.models()), gpus)
    before = gpus.calls[0]
    assert plan(layout, gpus.observe(), gpus.models()).is_empty
    assert gpus.calls[0] == before


def test_changing_one_profile_keeps_the_others_in_place() -> None:
    model = MODELS["H100-80GB"]
    gpus = empty_gpu(model)
    execute(plan(layout_of({"1g.10gb": 7}), gpus.observe(), gpus.models()), gpus)
    p = plan(layout_of({"1g.10gb": 5, "2g.20gb": 1}), gpus.observe(), gpus.models())
    assert sum(isinstance(s, DestroyGpuInstance) for s in p.steps) == 2
    kept = [d for d in p.gpus[0].devices if d.kept]
    assert len(kept) == 5


def test_in_use_instance_is_kept_when_possible_and_never_destroyed() -> None:
    model = MODELS["H200"]
    gpus = empty_gpu(model)
    execute(plan(layout_of({"1g.18gb": 7}), gpus.observe(), gpus.models()), gpus)
    busy = gpus.observe().gpu(0).gpu_instances[0]
    gpus.add_process(0, 4242, busy.id)
    # 3g.71gb needs 4 slices: the planner must pick the half without the busy instance
    p = plan(layout_of({"3g.71gb": 1, "1g.18gb": 3}), gpus.observe(), gpus.models())
    destroyed = {s.gi_id for s in p.steps if isinstance(s, DestroyGpuInstance)}
    assert busy.id not in destroyed and len(destroyed) == 4
    # all-7g needs the whole GPU: refused, naming the process
    with pytest.raises(GpuBusy, match="4242"):
        plan(layout_of({"7g.141gb": 1}), gpus.observe(), gpus.models())


def test_mode_change_with_processes_is_planned_for_the_drain_and_refused_after() -> None:
    """The pre-drain plan looks past processes (the drain ends them), on a whole GPU turning
    MIG on as on a MIG GPU turning it off; the post-drain plan refuses, naming the pids."""
    whole = empty_gpu(MODELS["H100-80GB"], mig=False)
    whole.add_process(0, 4242, None)
    to_mig = layout_of({"1g.10gb": 7})
    p = plan(to_mig, whole.observe(), whole.models(), destroy_in_use=True)
    assert p.gpus[0].changes_mig_mode and p.gpus[0].created_gpu_instances == 7
    with pytest.raises(GpuBusy, match="MIG mode change is in use by process.*4242"):
        plan(to_mig, whole.observe(), whole.models())

    mig = empty_gpu(MODELS["H100-80GB"])
    execute(plan(layout_of({"3g.40gb": 2}), mig.observe(), mig.models()), mig)
    gi = mig.observe().gpu(0).gpu_instances[0]
    mig.add_process(0, 5151, gi.id, gi.compute_instances[0].id)
    off = Layout("off", (Rule(DeviceSelector(), GpuLayout.of(False)),))
    p = plan(off, mig.observe(), mig.models(), destroy_in_use=True)
    assert p.gpus[0].changes_mig_mode and p.gpus[0].destroyed_gpu_instances == 2
    with pytest.raises(GpuBusy, match="5151"):
        plan(off, mig.observe(), mig.models())


def test_disabling_mig_destroys_everything_then_sets_mode() -> None:
    gpus = empty_gpu(MODELS["A30"])
    execute(plan(layout_of({"1g.6gb": 4}), gpus.observe(), gpus.models()), gpus)
    off = Layout("off", (Rule(DeviceSelector(), GpuLayout.of(False)),))
    execute(plan(off, gpus.observe(), gpus.models()), gpus)
    g = gpus.observe().gpu(0)
    assert not g.mig_current and not g.gpu_instances


def test_compute_instance_profiles_share_one_gpu_instance() -> None:
    gpus = empty_gpu(MODELS["A100-40GB"])
    p = plan(layout_of({"1c.3g.20gb": 3}), gpus.observe(), gpus.models())
    assert sum(isinstance(s, CreateGpuInstance) for s in p.steps) == 1
    execute(p, gpus)
    assert observed_devices(MODELS["A100-40GB"], gpus.observe().gpu(0)) == {"1c.3g.20gb": 3}


# ---------------------------------------------------------------------------------------------
# Property tests from random present states


@st.composite
def scenario(draw: st.DrawFn) -> tuple[GpuModel, dict[str, int], list[int], dict[str, int]]:
    model = draw(st.sampled_from(MIG_MODELS))
    fits = sorted(fitting_multisets(model))
    start = dict(draw(st.sampled_from(fits)))
    target = dict(draw(st.sampled_from(fits)))
    busy = draw(st.lists(st.integers(0, 6), max_size=3, unique=True))
    return model, start, busy, target


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_plans_from_random_states_keep_busy_and_reach_target(
    case: tuple[GpuModel, dict[str, int], list[int], dict[str, int]],
) -> None:
    model, start, busy, target = case
    gpus = empty_gpu(model)
    execute(plan(layout_of(start), gpus.observe(), gpus.models()), gpus)
    present = gpus.observe().gpu(0).gpu_instances
    busy_ids = {present[i].id for i in busy if i < len(present)}
    for gi_id in busy_ids:
        gpus.add_process(0, 1000 + gi_id, gi_id)
    before = {gi.id: gi.placement for gi in present}
    try:
        p = plan(layout_of(target), gpus.observe(), gpus.models())
    except GpuBusy:
        # refused only if no plan could keep every busy instance: check by brute force
        busy_gis: list[GiProfile] = []
        for gi in present:
            if gi.id in busy_ids:
                prof = model.gi_profile_by_id(gi.profile_id)
                assert prof is not None
                busy_gis.append(prof)
        need = Counter(target)
        have = Counter(g.name for g in busy_gis)
        assert have - need or not _fits_around(model, present, busy_ids, need - have)
        return
    destroyed = {s.gi_id for s in p.steps if isinstance(s, DestroyGpuInstance)}
    assert not destroyed & busy_ids
    execute(p, gpus)
    after = gpus.observe().gpu(0)
    for gi in after.gpu_instances:  # kept instances never move
        if gi.id in before and gi.id not in destroyed:
            assert gi.placement == before[gi.id]
    assert observed_devices(model, after) == Counter(target)
    assert plan(layout_of(target), gpus.observe(), gpus.models()).is_empty


def _fits_around(model: GpuModel, present: tuple, busy_ids: set[int], rest: Counter[str]) -> bool:
    from mig_agent.core.planner import place

    taken = 0
    for gi in present:
        if gi.id in busy_ids:
            taken |= gi.placement.mask
    gis = [model.gi_by_name[n] for n in rest.elements()]
    return place(model, gis, taken) is not None


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(MIG_MODELS), st.data())
def test_minimum_destruction_matches_brute_force(model: GpuModel, data: st.DataObject) -> None:
    """The planner destroys no more GPU instances than the best keep set found by brute force."""
    fits = sorted(fitting_multisets(model))
    start = dict(data.draw(st.sampled_from(fits)))
    target = dict(data.draw(st.sampled_from(fits)))
    gpus = empty_gpu(model)
    execute(plan(layout_of(start), gpus.observe(), gpus.models()), gpus)
    present = gpus.observe().gpu(0).gpu_instances
    p = plan_gpu(model, gpus.observe().gpu(0), layout_of(target).rules[0].gpu_layout)
    best = 0
    for r in range(len(present), -1, -1):
        for keep in itertools.combinations(present, r):
            names = Counter(model.gi_profile_by_id(g.profile_id).name for g in keep)  # type: ignore[union-attr]
            if names - Counter(target):
                continue
            if _fits_around(model, present, {g.id for g in keep}, Counter(target) - names):
                best = max(best, r)
        if best:
            break
    assert len(present) - p.destroyed_gpu_instances == best


def test_rev1_compute_instance_serves_the_same_device_name() -> None:
    """On Hopper a 1g.35gb GPU instance may hold the REV1 CI (whole GI, more SMs): same device."""
    model = MODELS["H200"]
    gpus = empty_gpu(model)
    gi = model.gi_by_name["1g.35gb"]
    rev1 = next(c for c in gi.ci_profiles if c.id == 7)
    gi_id = gpus.create_gpu_instance(0, gi.id, gi.placements[3])
    gpus.create_compute_instance(0, gi_id, rev1.id, rev1.placements[0])
    assert plan(layout_of({"1g.35gb": 1}), gpus.observe(), gpus.models()).is_empty
    p = plan(layout_of({"1g.35gb": 2}), gpus.observe(), gpus.models())
    assert p.gpus[0].destroyed_gpu_instances == 0 and p.gpus[0].created_gpu_instances == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(MIG_MODELS), st.data())
def test_a_node_plans_each_gpu_as_it_would_alone(model: GpuModel, data: st.DataObject) -> None:
    """``plan`` shares kept-set choices between alike GPUs of a node; GPUs that differ (another
    layout, a process on an instance) still get their own, the same as planned one by one."""
    fits = sorted(fitting_multisets(model))
    starts = [dict(data.draw(st.sampled_from(fits))) for _ in range(2)]
    gpus = FakeGpus([model] * 4, mig_enabled=True)
    for g in range(4):  # GPUs 0, 1 alike; 2, 3 another start
        single = FakeGpus([model], mig_enabled=True)
        execute(plan(layout_of(starts[g // 2]), single.observe(), single.models()), single)
        for gi in single.observe().gpu(0).gpu_instances:
            gpus.create_gpu_instance(g, gi.profile_id, gi.placement)
        for gi, mine in zip(
            single.observe().gpu(0).gpu_instances, gpus.observe().gpu(g).gpu_instances, strict=True
        ):
            for ci in gi.compute_instances:
                gpus.create_compute_instance(g, mine.id, ci.profile_id, ci.placement)
    busy = data.draw(st.sampled_from([None, 1, 3]))
    if busy is not None and gpus.observe().gpu(busy).gpu_instances:
        gpus.add_process(busy, 4242, gpus.observe().gpu(busy).gpu_instances[-1].id)
    target = layout_of(dict(data.draw(st.sampled_from(fits))))
    node = gpus.observe()
    try:
        together = plan(target, node, gpus.models(), destroy_in_use=True)
    except PlanError:
        return  # a target the model cannot hold: nothing to compare
    alone = tuple(
        plan_gpu(model, node.gpu(g), target.rules[0].gpu_layout, destroy_in_use=True)
        for g in range(4)
    )
    assert together.gpus == alone
    assert all(p.gpu == g for g, p in enumerate(together.gpus))


def test_the_plan_after_the_drain_keeps_what_the_plan_before_it_kept() -> None:
    """Before the drain, instances in use are kept first; the drain evicts the pods on the
    others; after it, with no process left, the same instances are kept (before: the re-plan
    kept the first ones it found, so a pod was evicted for an instance that then stayed)."""
    model = MODELS["H100-80GB"]
    gpus = FakeGpus([model], mig_enabled=True)
    execute(plan(layout_of({"1g.10gb": 7}), gpus.observe(), gpus.models()), gpus)
    target = layout_of({"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1})

    def kept(p: Any) -> list[int]:
        return sorted(d.gi_placement.start for g in p.gpus for d in g.devices if d.kept)

    idle = kept(plan(target, gpus.observe(), gpus.models()))
    # a pod on an instance the idle plan would not keep
    busy = next(gi for gi in gpus.observe().gpu(0).gpu_instances if gi.placement.start not in idle)
    gpus.add_process(0, 4242, busy.id)
    before = plan(target, gpus.observe(), gpus.models(), destroy_in_use=True)
    assert busy.placement.start in kept(before)
    # the drain evicted the pods on what `before` destroys; one's process lingers a moment:
    # the re-plan does not keep its instance for it, it waits (GpuBusy) until it is gone
    lingering = next(
        gi for gi in gpus.observe().gpu(0).gpu_instances if gi.placement.start not in kept(before)
    )
    gpus.gpus[0] = dataclasses.replace(gpus.gpus[0], processes=())
    gpus.add_process(0, 4343, lingering.id)
    with pytest.raises(GpuBusy, match="4343"):
        plan(target, gpus.observe(), gpus.models(), prefer=before)
    gpus.gpus[0] = dataclasses.replace(gpus.gpus[0], processes=())  # the drain: none left
    after = plan(target, gpus.observe(), gpus.models(), prefer=before)
    assert kept(after) == kept(before) != idle
    assert kept(plan(target, gpus.observe(), gpus.models())) == idle  # without the preference


def test_a_busy_gpu_keeps_its_busy_instance_though_alike_gpus_keep_others() -> None:
    """Eight H100s at 7 x 1g.10gb, two 1g.10gb of which stay (at slices 0-1 or 2-3, beside a
    2g.20gb, with the 3g.40gb at 4-7): GPU 5's instance at slice 2 runs a process, so GPU 5
    keeps that one; the idle GPUs keep their first two."""
    model = MODELS["H100-80GB"]
    gpus = FakeGpus([model] * 8, mig_enabled=True)
    execute(plan(layout_of({"1g.10gb": 7}), gpus.observe(), gpus.models()), gpus)
    busy = gpus.observe().gpu(5).gpu_instances[2]
    gpus.add_process(5, 4242, busy.id)
    p = plan(layout_of({"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}), gpus.observe(), gpus.models())
    kept = {g.gpu: sorted(d.gi_placement.start for d in g.devices if d.kept) for g in p.gpus}
    assert busy.placement.start in kept[5]
    assert all(busy.placement.start not in kept[g] for g in kept if g != 5)
