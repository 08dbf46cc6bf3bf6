"""What each approved layout would do on one node, for ``advise``: the devices it would
offer, the GPUs that change, and the running pods that would lose their device.

A pod of a device-plugin node is known by the kinds of device it holds only (its requests):
which of the node's devices of that kind it holds is the kubelet's to know. So it counts as
evicted when the plan destroys any device of a kind it holds (a GPU instance the planner keeps
in place is not destroyed): no pod can lose its device to an option that evicts nobody. On a
DRA node its claims name its devices (their UUIDs, through the ResourceSlice), so it counts as
evicted exactly when one of them does not outlive the plan (planner.staying_uuids). The
devices a pod holds that stay are not free for pending pods.

Pure module: no I/O. The device plugin's sharing (time-slicing, MPS) is not modelled.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from mig_agent.core import dra_devices
from mig_agent.core.advertised import Devices, advertised_resources, planned_devices, plugin_devices
from mig_agent.core.advise import Option, Supply
from mig_agent.core.demand import dra_kind
from mig_agent.core.errors import PlanError
from mig_agent.core.gpu_models import GpuModel, resource_name
from mig_agent.core.layout import Layout
from mig_agent.core.observed import NodeState
from mig_agent.core.planner import Plan, plan, staying_uuids

DRA: str = "dra"  # the "strategy" of a node whose GPUs NVIDIA's DRA driver publishes


@dataclass(frozen=True, slots=True)
class Holder:
    """A running pod on the node and the devices it holds, by kind, and by UUID where known
    (a DRA node's claims; empty: not known)."""

    pod: str
    kinds: Mapping[str, int]
    uuids: frozenset[str] = frozenset()


def resources(devices: Devices, strategy: str) -> dict[str, int]:
    """The devices offered, by kind: the device plugin's resources, or the DRA driver's."""
    if strategy != DRA:
        return advertised_resources(devices, strategy)
    if dra_devices.split_problem(devices):
        return {}
    return {
        dra_kind("" if k == dra_devices.GPU else k[1]): n
        for k, n in dra_devices.expected_devices(devices).items()
    }


def node_supply(
    node: str,
    current: str | None,
    layouts: Iterable[Layout],
    state: NodeState,
    models: Mapping[int, GpuModel],
    *,
    strategy: str,
    holders: Sequence[Holder] = (),
    memo: Memo | None = None,
) -> Supply:
    """The node now and an option per layout that fits it and changes a GPU (``current``
    aside). ``memo`` keeps each layout's effect on a GPU state for the next node alike."""
    seen = _seen(state, models, strategy, memo)
    held: Counter[str] = Counter()
    for h in holders:
        held.update(h.kinds)
    options = []
    for layout in sorted(layouts, key=lambda la: la.name):
        if layout.name == current:
            continue
        if layout.name not in seen.effects:
            seen.effects[layout.name] = _effect(layout, state, models, strategy)
        effect = seen.effects[layout.name]
        if effect is None:
            continue
        changed, after, lost, staying_ids = effect
        evicts = tuple(sorted(h.pod for h in holders if _loses(h, lost, staying_ids)))
        staying: Counter[str] = Counter()
        for h in holders:
            if h.pod not in evicts:
                staying.update(h.kinds)
        options.append(
            Option(layout.name, changed, _positive(Counter(after) - staying), after, evicts)
        )
    return Supply(node, current, _positive(Counter(seen.now) - held), tuple(options), seen.now)


def holds(
    layout: Layout,
    state: NodeState,
    models: Mapping[int, GpuModel],
    *,
    strategy: str,
    memo: Memo | None = None,
) -> bool:
    """Whether the GPUs hold ``layout`` already: a node labelled with another than its GPUs
    hold is about to change (its agent has not begun, or has not published yet). ``memo``
    keeps the answer for the next node alike."""
    seen = _seen(state, models, strategy, memo)
    if layout.name not in seen.holds:
        try:
            seen.holds[layout.name] = not plan(layout, state, models).changed_gpus
        except PlanError:
            seen.holds[layout.name] = False
    return seen.holds[layout.name]


def _seen(
    state: NodeState, models: Mapping[int, GpuModel], strategy: str, memo: Memo | None
) -> _Seen:
    """What ``memo`` knows of a GPU state (made and kept there the first time)."""
    model_keys = tuple(sorted((i, m.key) for i, m in models.items()))
    key = (state, model_keys, strategy)  # hashed once per node: a state is a deep tuple
    seen = None if memo is None else memo.get(key)
    if seen is None:
        seen = _Seen(resources(plugin_devices(state, models), strategy))
        if memo is not None:
            memo[key] = seen
    return seen


# GPUs changed, devices offered after, kinds of the devices destroyed, UUIDs that stay
Effect = tuple[tuple[int, ...], dict[str, int], frozenset[str], frozenset[str]]


def _loses(h: Holder, lost: frozenset[str], staying: frozenset[str]) -> bool:
    """Whether ``h`` loses a device: by UUID where its devices are known, else by kind."""
    if h.uuids:
        return not h.uuids <= staying
    return bool(lost & set(h.kinds))


@dataclass
class _Seen:
    """What a GPU state offers now, and each layout's effect on it."""

    now: dict[str, int]
    effects: dict[str, Effect | None] = field(default_factory=dict)
    holds: dict[str, bool] = field(default_factory=dict)  # layout -> the GPUs hold it


Memo = dict[tuple[object, ...], _Seen]


def _effect(
    layout: Layout, state: NodeState, models: Mapping[int, GpuModel], strategy: str
) -> Effect | None:
    """(GPUs changed, devices offered after, kinds of the devices destroyed, UUIDs that stay),
    or None where the layout does not fit, changes nothing, or leaves the plugin offering
    nothing."""
    try:
        the_plan = plan(layout, state, models, destroy_in_use=True)
    except PlanError:
        return None
    if not the_plan.changed_gpus:
        return None
    after = resources(planned_devices(the_plan, state, models), strategy)
    if not after:
        return None
    return (
        the_plan.changed_gpus,
        after,
        frozenset(_destroyed_kinds(the_plan, state, models, strategy)),
        staying_uuids(the_plan, state),
    )


def _positive(counts: Counter[str]) -> dict[str, int]:
    return {k: n for k, n in sorted(counts.items()) if n > 0}


def _destroyed_kinds(
    the_plan: Plan, state: NodeState, models: Mapping[int, GpuModel], strategy: str
) -> set[str]:
    """The kinds of the devices that ``the_plan`` destroys on the GPUs it changes."""
    before = plugin_devices(state, models)
    out: set[str] = set()
    for gp in the_plan.gpus:
        if gp.is_empty or gp.gpu not in before:
            continue
        had = before[gp.gpu]
        if had is None:  # a whole GPU: any change ends it
            out.add(_kind(None, strategy))
            continue
        kept = Counter(d.profile for d in gp.devices if d.kept)
        out.update(_kind(name, strategy) for name in had - kept)
    return out


def _kind(device: str | None, strategy: str) -> str:
    if strategy == DRA:
        return dra_kind(device or "")
    if device is None:
        return "nvidia.com/gpu"
    return resource_name(device, strategy=strategy) or device


def renamed(supply: Supply, names: Mapping[str, str]) -> Supply:
    """``supply`` with its device kinds renamed by ``names`` (``dra:1g.10gb`` -> the extended
    resource a DeviceClass serves those devices as, ``nvidia.com/mig-1g.10gb``): one kind for
    the devices that pods asking either way compete for. A DRA node's supply only."""
    if not names:
        return supply

    def kinds(counts: Mapping[str, int]) -> dict[str, int]:
        out: Counter[str] = Counter()
        for kind, n in counts.items():
            out[names.get(kind, kind)] += n
        return dict(sorted(out.items()))

    options = tuple(
        replace(o, free=kinds(o.free), resources=kinds(o.resources)) for o in supply.options
    )
    return replace(
        supply, free=kinds(supply.free), options=options, resources=kinds(supply.resources)
    )
