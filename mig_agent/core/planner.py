"""The planner: from the GPUs as they are and a layout to the steps that get there, or why not.

It proves a layout fits before any GPU is touched and chooses every placement itself; nothing is
left to NVML's own placement choice or to trial and error. It keeps every instance that can stay
where it is, and never plans to destroy an instance in use unless told to.

Pure module: no I/O, no clock, no logging.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from mig_agent.core.errors import GpuBusy, PlanError
from mig_agent.core.gpu_models import CiProfile, GiProfile, GpuModel
from mig_agent.core.layout import GpuLayout, Layout
from mig_agent.core.observed import GpuInstance, GpuState, NodeState
from mig_agent.core.placement import Placement

# ---------------------------------------------------------------------------------------------
# Steps


@dataclass(frozen=True, slots=True)
class SetMigMode:
    gpu: int
    enabled: bool


@dataclass(frozen=True, slots=True)
class DestroyComputeInstance:
    gpu: int
    gi_id: int
    ci_id: int
    profile: str  # MIG device name, for logs


@dataclass(frozen=True, slots=True)
class DestroyGpuInstance:
    gpu: int
    gi_id: int
    profile: str
    placement: Placement


@dataclass(frozen=True, slots=True)
class CreateGpuInstance:
    gpu: int
    profile: str
    profile_id: int
    placement: Placement


@dataclass(frozen=True, slots=True)
class CreateComputeInstance:
    """Create a CI in the GPU instance at ``gi_placement``.

    The placement is unique per GPU and known before the GI exists, unlike its id."""

    gpu: int
    gi_placement: Placement
    profile: str  # MIG device name
    profile_id: int  # CI profile id
    placement: Placement  # compute slices within the GI


Step = (
    SetMigMode
    | DestroyComputeInstance
    | DestroyGpuInstance
    | CreateGpuInstance
    | CreateComputeInstance
)


@dataclass(frozen=True, slots=True)
class PlannedDevice:
    """One MIG device of the result: its name, where its GI sits, and whether it already existed."""

    profile: str
    gi_placement: Placement
    ci_placement: Placement
    kept: bool


@dataclass(frozen=True, slots=True)
class GpuPlan:
    gpu: int
    model: str
    desired: GpuLayout
    steps: tuple[Step, ...]
    devices: tuple[PlannedDevice, ...]  # the result, sorted by placement

    @property
    def is_empty(self) -> bool:
        return not self.steps

    @property
    def destroyed_gpu_instances(self) -> int:
        return sum(isinstance(s, DestroyGpuInstance) for s in self.steps)

    @property
    def created_gpu_instances(self) -> int:
        return sum(isinstance(s, CreateGpuInstance) for s in self.steps)

    @property
    def changes_mig_mode(self) -> bool:
        return any(isinstance(s, SetMigMode) for s in self.steps)


@dataclass(frozen=True, slots=True)
class Plan:
    layout: str
    gpus: tuple[GpuPlan, ...]
    untouched: tuple[int, ...] = ()  # GPUs no rule of the layout selects

    @property
    def is_empty(self) -> bool:
        return all(g.is_empty for g in self.gpus)

    @property
    def steps(self) -> tuple[Step, ...]:
        return tuple(s for g in self.gpus for s in g.steps)

    @property
    def changed_gpus(self) -> tuple[int, ...]:
        return tuple(g.gpu for g in self.gpus if not g.is_empty)


# ---------------------------------------------------------------------------------------------
# Node level


def plan(
    layout: Layout,
    node: NodeState,
    models: Mapping[int, GpuModel],
    *,
    destroy_in_use: bool = False,
    prefer: Plan | None = None,
) -> Plan:
    """Plan ``layout`` for every GPU of ``node``; ``models`` gives each GPU's MIG geometry.

    ``prefer``: an earlier plan whose kept instances are kept again where they still can be
    (after the drain: the pods it spared hold them, those it evicted held the others).

    Raises PlanError (layout unknown to these models, does not fit) or GpuBusy (an instance in
    use would have to go) for the first GPU where that happens; nothing is planned then.
    """
    plans: list[GpuPlan] = []
    untouched: list[int] = []
    memo: _KeptMemo = {}  # the GPUs of a node are mostly alike: choose their kept set once
    for gpu in node.gpus:
        target = layout.target_for(gpu.index, gpu.info.pci_device_id, gpu.info.pci_subsystem_id)
        if target is None:
            untouched.append(gpu.index)
            continue
        plans.append(
            plan_gpu(
                models[gpu.index],
                gpu,
                target,
                destroy_in_use=destroy_in_use,
                memo=memo,
                prefer=_kept_placements(prefer, gpu.index),
            )
        )
    present = {g.index for g in node.gpus}
    for n, rule in enumerate(layout.rules, start=1):
        beyond = sorted((rule.selector.indices or frozenset()) - present)
        if beyond:  # never a GPU skipped: the layout was written for another node
            have = (
                f"{len(present)} GPU(s), indices {min(present)}-{max(present)}"
                if len(present) > 1
                else f"GPU {min(present)} only"
                if present
                else "no GPU"
            )
            raise PlanError(
                f"layout {layout.name!r}, entry {n}: GPU index(es) "
                f"{', '.join(map(str, beyond))} not on this node (it has {have})",
                layout=layout.name,
                entry=n,
                indices=beyond,
            )
    if not plans:
        kinds = sorted({f"{g.info.name} (0x{g.info.pci_device_id:08X})" for g in node.gpus})
        raise PlanError(
            f"layout {layout.name!r} selects none of this node's GPUs ({', '.join(kinds)})",
            layout=layout.name,
        )
    return Plan(layout.name, tuple(plans), tuple(untouched))


# ---------------------------------------------------------------------------------------------
# GPU level


@dataclass(frozen=True, slots=True)
class _Demand:
    """One GPU instance the layout needs, with the CI profiles it must hold."""

    gi: GiProfile
    cis: tuple[CiProfile, ...]

    @property
    def ci_ids(self) -> Counter[int]:
        return Counter(c.id for c in self.cis)


@dataclass(slots=True)
class _Present:
    gi: GpuInstance
    profile: GiProfile | None
    in_use: bool
    pids: tuple[int, ...] = field(default_factory=tuple)
    preferred: bool = False  # kept by an earlier plan (``plan(prefer=...)``)


def plan_gpu(
    model: GpuModel,
    gpu: GpuState,
    desired: GpuLayout,
    *,
    destroy_in_use: bool = False,
    memo: _KeptMemo | None = None,
    prefer: frozenset[Placement] = frozenset(),
) -> GpuPlan:
    """The steps that turn ``gpu`` into ``desired``, keeping whatever can stay.

    ``memo`` carries kept-set choices between GPUs of one node (see ``plan``); the GPU
    instances at ``prefer`` are kept first, then those in use.
    """
    where = f"GPU {gpu.index} ({model.key})"
    if desired.mig_enabled and not model.mig_capable:
        raise PlanError(f"{where} does not support MIG", gpu=gpu.index)
    if not model.mig_capable:
        return GpuPlan(gpu.index, model.key, desired, (), ())

    present = (
        [_present(model, gpu, gi, prefer) for gi in gpu.gpu_instances] if gpu.mig_current else []
    )
    needs_mode = gpu.mig_current != desired.mig_enabled or gpu.mig_pending != desired.mig_enabled

    if not desired.mig_enabled:
        _refuse_in_use(where, present, destroy_in_use)
        if needs_mode:
            _refuse_mode_change_in_use(where, gpu, destroy_in_use)
        steps: list[Step] = [s for p in present for s in _destroy_steps(gpu.index, p, model)]
        if needs_mode:
            steps.append(SetMigMode(gpu.index, False))
        return GpuPlan(gpu.index, model.key, desired, tuple(steps), ())

    demands = demands_for(model, desired, where)
    check_fits(model, [d.gi for d in demands], where)

    # fits from empty (checked above) so only kept instances could block
    keep = _kept(model, present, demands, memo) or {}
    dropped = [p for i, p in enumerate(present) if i not in keep]
    _refuse_in_use(where, dropped, destroy_in_use)
    if needs_mode:
        _refuse_mode_change_in_use(where, gpu, destroy_in_use)

    kept_demands = set(keep.values())
    open_demands = [d for j, d in enumerate(demands) if j not in kept_demands]
    taken = 0
    for i in keep:
        taken |= present[i].gi.placement.mask
    placements = place(model, [d.gi for d in open_demands], taken)
    assert placements is not None  # _choose_kept only returns keep sets that leave room

    steps = [s for p in dropped for s in _destroy_steps(gpu.index, p, model)]
    if needs_mode:
        steps.append(SetMigMode(gpu.index, True))
    devices: list[PlannedDevice] = []
    ci_steps: list[Step] = []
    for d, pl in sorted(zip(open_demands, placements, strict=True), key=lambda dp: dp[1]):
        steps.append(CreateGpuInstance(gpu.index, d.gi.name, d.gi.id, pl))
        for ci, ci_pl in _place_cis(d.gi, list(d.cis), []) or []:
            ci_steps.append(CreateComputeInstance(gpu.index, pl, d.gi.ci_name(ci), ci.id, ci_pl))
            devices.append(PlannedDevice(d.gi.ci_name(ci), pl, ci_pl, kept=False))
    for i, j in keep.items():
        _finish_kept(gpu.index, present[i], demands[j], ci_steps, devices)
    steps.extend(ci_steps)
    devices.sort(key=lambda dv: (dv.gi_placement, dv.ci_placement))
    return GpuPlan(gpu.index, model.key, desired, tuple(steps), tuple(devices))


def _kept(
    model: GpuModel, present: list[_Present], demands: list[_Demand], memo: _KeptMemo | None
) -> dict[int, int] | None:
    """The kept set (present index -> demand index), chosen once per kind of GPU via ``memo``."""
    key = _kept_key(model, present, demands)
    if memo is not None and key in memo:
        return memo[key]
    keep = _choose_kept(model, present, demands)
    if memo is not None:
        memo[key] = keep
    return keep


def _finish_kept(
    gpu: int,
    gi: _Present,
    d: _Demand,
    ci_steps: list[Step],
    devices: list[PlannedDevice],
) -> None:
    """A kept GPU instance's devices, and the compute instances it still lacks for ``d``."""
    assert gi.profile is not None
    have = [(_ci_by_id(gi.profile, c.profile_id), c.placement) for c in gi.gi.compute_instances]
    for ci, ci_pl in have:
        devices.append(PlannedDevice(gi.profile.ci_name(ci), gi.gi.placement, ci_pl, kept=True))
    new = _missing_cis(gi, d)
    assert new is not None  # _choose_kept kept only GIs that can serve their demand
    for ci, ci_pl in new:
        ci_steps.append(
            CreateComputeInstance(gpu, gi.gi.placement, gi.profile.ci_name(ci), ci.id, ci_pl)
        )
        devices.append(PlannedDevice(gi.profile.ci_name(ci), gi.gi.placement, ci_pl, False))


def demands_for(model: GpuModel, desired: GpuLayout, where: str = "") -> list[_Demand]:
    """The GPU instances (with their CIs) ``desired`` needs; PlanError for unknown profiles."""
    where = where or model.key
    whole: list[_Demand] = []
    split: dict[str, list[CiProfile]] = {}
    split_gi: dict[str, GiProfile] = {}
    for profile, count in desired.devices:
        resolved = model.resolve(str(profile))
        if resolved is None:
            raise PlanError(
                f"{where}: no MIG profile {profile} on {model.name}; "
                f"profiles there: {', '.join(model.device_names())}",
                profile=str(profile),
            )
        gi, ci = resolved
        if ci.slices == gi.slices:
            whole.extend(_Demand(gi, (ci,)) for _ in range(count))
        else:
            split.setdefault(gi.name, []).extend([ci] * count)
            split_gi[gi.name] = gi
    out = list(whole)
    for name, cis in split.items():
        gi = split_gi[name]
        bins: list[list[tuple[CiProfile, Placement]]] = []
        for ci in sorted(cis, key=lambda c: -c.slices):  # first fit, largest first
            for b in bins:
                found = _place_cis(gi, [ci], b)
                if found:
                    b.extend(found)
                    break
            else:
                first = _place_cis(gi, [ci], [])
                assert first is not None
                bins.append(first)
        out.extend(_Demand(gi, tuple(c for c, _ in b)) for b in bins)
    out.sort(key=lambda d: (-d.gi.placement_size, -d.gi.slices, d.gi.id, sorted(d.ci_ids.items())))
    return out


def check_fits(model: GpuModel, gis: Sequence[GiProfile], where: str = "") -> None:
    """PlanError saying why these GPU instances cannot share one empty GPU, if they cannot."""
    where = where or model.key
    for gi, n in Counter(gis).items():
        if n > gi.instance_count:
            raise PlanError(
                f"{where}: {n} x {gi.name} requested, but {model.key} allows at most "
                f"{gi.instance_count}",
                profile=gi.name,
            )
    mem = sum(model.memory_slices_of(g) for g in gis)
    if mem > model.memory_slices:
        raise PlanError(
            f"{where}: layout needs {mem} memory slices "
            f"({' + '.join(f'{g.name}:{model.memory_slices_of(g)}' for g in gis)}), "
            f"{model.key} has {model.memory_slices}",
        )
    compute = sum(g.slices for g in gis)
    if compute > model.compute_slices:
        raise PlanError(
            f"{where}: layout needs {compute} compute slices, {model.key} has "
            f"{model.compute_slices}",
        )
    _check_media(gis, where)
    if place(model, list(gis), 0) is None:
        allowed = "; ".join(
            f"{g.name} at {{{','.join(str(p.start) for p in g.placements)}}}:{g.placement_size}"
            for g in sorted(set(gis), key=lambda g: -g.placement_size)
        )
        raise PlanError(
            f"{where}: no non-overlapping placement exists for "
            f"{', '.join(sorted(g.name for g in gis))} (allowed placements: {allowed})",
        )


def _check_media(gis: Sequence[GiProfile], where: str) -> None:
    """PlanError if a ``+me.all`` GI, which holds every media engine, shares the GPU with a GI
    other than ``-me`` ones (NVML would refuse to make the second)."""
    for gi in gis:
        if gi.takes_all_media:
            others = sorted({g.name for g in gis if g is not gi and not g.has_no_media})
            if others:
                raise PlanError(
                    f"{where}: {gi.name} takes every media engine of the GPU; beside it only "
                    f"-me profiles fit, not {', '.join(others)}",
                    profile=gi.name,
                )


def place(model: GpuModel, gis: Sequence[GiProfile], taken: int) -> list[Placement] | None:
    """Non-overlapping placements for ``gis`` (in their order) on grid units not in ``taken``.

    Exhaustive depth-first search, largest profiles first, lowest start first: it finds a
    placement whenever one exists, and always the same one.
    """
    order = sorted(range(len(gis)), key=lambda i: (-gis[i].placement_size, gis[i].id, i))
    width = model.placement_units
    chosen: dict[int, Placement] = {}
    failed: set[tuple[int, int]] = set()  # (depth, taken mask) known to lead nowhere

    def search(depth: int, mask: int) -> bool:
        if depth == len(order):
            return True
        if (depth, mask) in failed:
            return False
        i = order[depth]
        for pl in gis[i].placements:
            if pl.end <= width and not pl.mask & mask:
                chosen[i] = pl
                if search(depth + 1, mask | pl.mask):
                    return True
        failed.add((depth, mask))
        return False

    return [chosen[i] for i in range(len(gis))] if search(0, taken) else None


# ---------------------------------------------------------------------------------------------
# Helpers


def _present(
    model: GpuModel, gpu: GpuState, gi: GpuInstance, prefer: frozenset[Placement] = frozenset()
) -> _Present:
    pids = tuple(sorted({p.pid for p in gpu.processes_on(gi.id)}))
    return _Present(
        gi, model.gi_profile_by_id(gi.profile_id), bool(pids), pids, gi.placement in prefer
    )


def _kept_placements(earlier: Plan | None, gpu: int) -> frozenset[Placement]:
    if earlier is None:
        return frozenset()
    return frozenset(
        d.gi_placement for g in earlier.gpus if g.gpu == gpu for d in g.devices if d.kept
    )


def _ci_by_id(gi: GiProfile, ci_id: int) -> CiProfile:
    found = gi.ci_profile_by_id(ci_id)
    if found is not None:
        return found
    raise PlanError(f"compute instance profile {ci_id} is not valid in {gi.name}")


def _matches(model: GpuModel, p: _Present, d: _Demand) -> bool:
    """Can present GI ``p`` serve demand ``d`` (same GI profile, its CIs a subset of d's)?"""
    return _missing_cis(p, d) is not None


def _missing_cis(p: _Present, d: _Demand) -> list[tuple[CiProfile, Placement]] | None:
    """The CIs to add (with placements) so that present GI ``p`` serves ``d``; None if it can't.

    CIs are compared by device name, not profile id: on Hopper a 1-slice REV2 GI can hold either
    of two CI profiles that make the same device (``1g.35gb``); either one serves.
    """
    if p.profile is None or p.profile.id != d.gi.id:
        return None
    valid = {c.id for c in p.profile.ci_profiles}
    if any(c.profile_id not in valid for c in p.gi.compute_instances):
        return None
    placed = [(_ci_by_id(p.profile, c.profile_id), c.placement) for c in p.gi.compute_instances]
    have = Counter(p.profile.ci_name(ci) for ci, _ in placed)
    want = Counter(d.gi.ci_name(ci) for ci in d.cis)
    if have - want:
        return None
    by_name = {d.gi.ci_name(ci): ci for ci in d.cis}
    missing = [by_name[name] for name in (want - have).elements()]
    return _place_cis(p.profile, missing, placed)


_KeptKey = tuple[object, ...]
_KeptMemo = dict[_KeptKey, "dict[int, int] | None"]


def _kept_key(model: GpuModel, present: list[_Present], demands: list[_Demand]) -> _KeptKey:
    """What ``_choose_kept`` decides on, by value: two GPUs with equal keys keep the same set."""
    return (
        model.key,
        tuple(
            (
                p.gi.profile_id,
                p.gi.placement,
                tuple((c.profile_id, c.placement) for c in p.gi.compute_instances),
                p.in_use,
                p.preferred,
            )
            for p in present
        ),
        tuple((d.gi.id, tuple(c.id for c in d.cis)) for d in demands),
    )


def _choose_kept(
    model: GpuModel, present: list[_Present], demands: list[_Demand]
) -> dict[int, int] | None:
    """Which present GIs stay (present index -> demand index): preferred ones first, then
    those in use, then most.

    Tries keep sets from the best down; the first whose leftovers still fit wins.
    """
    # Demands repeat (seven 1g.10gb): decide each distinct one once per present GI.
    keys = [(d.gi.id, tuple(c.id for c in d.cis)) for d in demands]
    distinct = {k: d for k, d in zip(keys, demands, strict=True)}
    options = {}
    for i, p in enumerate(present):
        fits = {k: _matches(model, p, d) for k, d in distinct.items()}
        options[i] = [j for j, k in enumerate(keys) if fits[k]]
    candidates = [i for i, js in options.items() if js]
    # No keep set larger than a maximum matching can be assigned: skip those sizes (seven
    # present 1g GIs for two 1g demands would otherwise try every subset of three or more).
    largest = _max_matching(candidates, options)
    subsets: list[tuple[int, ...]] = []
    for r in range(largest, -1, -1):
        subsets.extend(itertools.combinations(candidates, r))
    # an earlier plan's choice first: the pods on the rest were evicted for it, and their
    # processes may linger a moment (the caller waits for them rather than keep their GIs)
    subsets.sort(
        key=lambda s: (
            -sum(present[i].preferred for i in s),
            -sum(present[i].in_use for i in s),
            -len(s),
        )
    )
    for subset in subsets:
        assignment = _assign(subset, options)
        if assignment is None:
            continue
        taken = 0
        for i in subset:
            taken |= present[i].gi.placement.mask
        rest = [d.gi for j, d in enumerate(demands) if j not in set(assignment.values())]
        if place(model, rest, taken) is not None:
            return assignment
    return None


def _max_matching(items: Sequence[int], options: Mapping[int, list[int]]) -> int:
    """The size of a maximum matching of ``items`` to distinct demands (augmenting paths)."""
    owner: dict[int, int] = {}

    def augment(i: int, seen: set[int]) -> bool:
        for j in options[i]:
            if j not in seen:
                seen.add(j)
                if j not in owner or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    return sum(augment(i, set()) for i in items)


def _assign(subset: Iterable[int], options: Mapping[int, list[int]]) -> dict[int, int] | None:
    """A matching of present GIs to distinct demands, or None."""
    items = list(subset)
    result: dict[int, int] = {}

    def go(k: int, used: frozenset[int]) -> bool:
        if k == len(items):
            return True
        for j in options[items[k]]:
            if j not in used:
                result[items[k]] = j
                if go(k + 1, used | {j}):
                    return True
        return False

    return dict(result) if go(0, frozenset()) else None


def _place_cis(
    gi: GiProfile, cis: Sequence[CiProfile], placed: Sequence[tuple[CiProfile, Placement]]
) -> list[tuple[CiProfile, Placement]] | None:
    """Placements in compute slices for new ``cis`` inside a GI that already holds ``placed``."""
    mask = 0
    counts: Counter[int] = Counter()
    for ci, pl in placed:
        mask |= pl.mask
        counts[ci.id] += 1
    out: list[tuple[CiProfile, Placement]] = []
    for ci in sorted(cis, key=lambda c: -c.slices):
        if counts[ci.id] >= ci.instance_count:
            return None
        spot = next((pl for pl in ci.placements if not pl.mask & mask), None)
        if spot is None:
            return None
        mask |= spot.mask
        counts[ci.id] += 1
        out.append((ci, spot))
    return out


def _destroy_steps(gpu: int, p: _Present, model: GpuModel) -> list[Step]:
    name = p.profile.name if p.profile else f"profile id {p.gi.profile_id}"
    steps: list[Step] = []
    for ci in p.gi.compute_instances:
        ci_name = name
        if p.profile is not None:
            ci_profile = p.profile.ci_profile_by_id(ci.profile_id)
            if ci_profile is not None:
                ci_name = p.profile.ci_name(ci_profile)
        steps.append(DestroyComputeInstance(gpu, p.gi.id, ci.id, ci_name))
    steps.append(DestroyGpuInstance(gpu, p.gi.id, name, p.gi.placement))
    return steps


def _refuse_in_use(where: str, doomed: Iterable[_Present], destroy_in_use: bool) -> None:
    if destroy_in_use:
        return
    for p in doomed:
        if p.in_use:
            name = p.profile.name if p.profile else f"profile id {p.gi.profile_id}"
            _raise_busy(
                where,
                f"{name} at {p.gi.placement} (GPU instance {p.gi.id}) must be destroyed but",
                list(p.pids),
            )


def _refuse_mode_change_in_use(where: str, gpu: GpuState, destroy_in_use: bool) -> None:
    # A mode change ends every process on the GPU, as destroying an instance ends its own:
    # the plan made before the drain looks past them both (the drain is what ends them).
    if gpu.processes and not destroy_in_use:
        _raise_busy(where, "MIG mode change", sorted({p.pid for p in gpu.processes}))


def _raise_busy(where: str, what: str, pids: Sequence[int]) -> None:
    raise GpuBusy(_in_use(where, what, pids), pids=list(pids))


def _in_use(where: str, what: str, pids: Iterable[int]) -> str:
    return f"{where}: {what} is in use by process(es) {', '.join(map(str, sorted(set(pids))))}"


@dataclass(frozen=True, slots=True)
class EndedProcess:
    """A process that a plan ends: on an instance it destroys, or on a GPU whose MIG mode it
    changes."""

    gpu: int
    where: str  # "GPU 3 (H100-80GB)"
    pid: int
    devices: frozenset[str]  # UUIDs of the devices it runs on (MIG devices, or the GPU)
    destroyed: str  # "1g.10gb at 2:1 (GPU instance 9)"; "" for a MIG mode change


def ended_processes(the_plan: Plan, node: NodeState) -> tuple[EndedProcess, ...]:
    """The processes ``the_plan`` would end, read from ``node`` (what NVML reports now)."""
    out: list[EndedProcess] = []
    for gp in the_plan.gpus:
        gpu = node.gpu(gp.gpu)
        gis = {gi.id: gi for gi in gpu.gpu_instances}
        gone_gis = {s.gi_id: s for s in gp.steps if isinstance(s, DestroyGpuInstance)}
        gone_cis = {(s.gi_id, s.ci_id) for s in gp.steps if isinstance(s, DestroyComputeInstance)}
        for proc in gpu.processes:
            if gp.changes_mig_mode:
                destroyed = ""
            elif proc.gi_id in gone_gis:
                step = gone_gis[proc.gi_id]
                destroyed = f"{step.profile} at {step.placement} (GPU instance {step.gi_id})"
            elif (proc.gi_id, proc.ci_id) in gone_cis:
                destroyed = f"compute instance {proc.ci_id} of GPU instance {proc.gi_id}"
            else:
                continue
            if proc.gi_id is None:
                devices = {gpu.info.uuid}
            else:
                cis = gis[proc.gi_id].compute_instances if proc.gi_id in gis else ()
                devices = {ci.uuid for ci in cis if proc.ci_id is None or ci.id == proc.ci_id}
            out.append(
                EndedProcess(
                    gp.gpu,
                    f"GPU {gp.gpu} ({gp.model})",
                    proc.pid,
                    frozenset(devices - {""}),
                    destroyed,
                )
            )
    return tuple(out)


def staying_uuids(the_plan: Plan, node: NodeState) -> frozenset[str]:
    """The device ids (GPU and MIG UUIDs) of ``node`` that outlive ``the_plan``: every device of
    an unchanged GPU, and the compute instances of the GPU instances it keeps. A pod holding
    only these keeps its devices through the change."""
    changed = {g.gpu: g for g in the_plan.gpus if not g.is_empty}
    staying: set[str] = set()
    for gpu in node.gpus:
        gp = changed.get(gpu.index)
        if gp is None and not gpu.mig_current:
            staying.add(gpu.info.uuid)
        kept = None if gp is None else {d.gi_placement for d in gp.devices if d.kept}
        for gi in gpu.gpu_instances:
            if kept is None or gi.placement in kept:
                staying.update(ci.uuid for ci in gi.compute_instances if ci.uuid)
    return frozenset(staying)


def describe_in_use(ended: Sequence[EndedProcess]) -> str:
    """ "GPU 0 (H100-80GB): 1g.10gb at 2:1 (GPU instance 9), ... must be destroyed but is in use
    by process(es) 7, 8", a GPU at a time, in the words of the planner's own refusals."""
    by_gpu: dict[int, list[EndedProcess]] = {}
    for p in ended:
        by_gpu.setdefault(p.gpu, []).append(p)
    parts = []
    for procs in (by_gpu[g] for g in sorted(by_gpu)):
        gone = list(dict.fromkeys(p.destroyed for p in procs))
        what = "MIG mode change" if gone == [""] else f"{', '.join(gone)} must be destroyed but"
        parts.append(_in_use(procs[0].where, what, (p.pid for p in procs)))
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# Reading observed state


def observed_devices(model: GpuModel, gpu: GpuState) -> Counter[str]:
    """MIG device names present on ``gpu`` now, with counts (a GI without CIs shows no device)."""
    out: Counter[str] = Counter()
    if not gpu.mig_current:
        return out
    for gi in gpu.gpu_instances:
        profile = model.gi_profile_by_id(gi.profile_id)
        if profile is None:
            continue
        for ci in gi.compute_instances:
            ci_profile = profile.ci_profile_by_id(ci.profile_id)
            if ci_profile is not None:
                out[profile.ci_name(ci_profile)] += 1
    return out
