"""The invariants of the guard model (tests/unit/test_guard_model.py), read from what the
fakes hold (the node as the API server has it, the GPUs as NVML has them, the plugin's
registration, the pods' devices, what the agent wrote), never from the agent's internals.
Each returns the violations it sees, as sentences; none raises: some run inside the agent's
pass, where an exception would be taken for the agent's own bug."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator

from mig_agent.core import device_taints, planner
from mig_agent.core.errors import MigAgentError
from mig_agent.core.labels import PAUSED, State
from mig_agent.core.observed import NodeState
from tests.unit.model_world import (
    CONFIG,
    NODE,
    SETTINGS,
    STATE,
    DraPluginModel,
    World,
    by_resource,
    held_devices,
)

REASON = "mig-agent.dev/reason"
CORDONED = "mig-agent.dev/cordoned"
PAUSED_OPERANDS = "mig-agent.dev/paused-operands"
CONDITION = "MIGConfigApplied"
# a claim that the node is schedulable again (not "stays cordoned until ... uncordoned")
UNCORDONED = re.compile(r"(?<!not )(?<!never )\b(is|was|been|now|node)\s+uncordoned\b")
NOTHING_TOUCHED = re.compile(r"nothing was touched|GPUs? (were |was )?untouched")


def always(w: World) -> list[str]:
    """What must hold at every moment, inside a pass too."""
    return [
        *_schedulable_over_gone_devices(w),
        *_devices_destroyed_under_pods(w),
        *_schedulable_while_evicted_pods_go(w),
    ]


def _schedulable_over_gone_devices(w: World) -> Iterator[str]:
    """Schedulable implies the node advertises no device NVML no longer holds: by UUID (the
    plugin's registration the scheduler hands out) and by count (the node's allocatable)."""
    node = w.cluster.nodes[NODE]
    if node.unschedulable:
        return
    if isinstance(w.plugin, DraPluginModel):
        yield from _untainted_over_changed_gpus(w, w.plugin)
        return
    held = held_devices(w.gpus)
    for resource, uuids in sorted(w.plugin.advertised(node).items()):
        gone = sorted(u for u in uuids if u not in held)
        if gone:
            yield (
                f"the node is schedulable and advertises {len(gone)} {resource} device(s) NVML "
                f"no longer holds ({', '.join(gone[:2])})"
            )
    have = Counter(d.resource for d in held.values())
    for resource, n in sorted(node.gpu_resources().items()):
        if n > have[resource]:
            yield (
                f"the node is schedulable with allocatable {resource}: {n} where NVML holds "
                f"{have[resource]}"
            )


def _untainted_over_changed_gpus(w: World, plugin: DraPluginModel) -> Iterator[str]:
    """On a DRA node, uncordoned: while a GPU is not as the slice lists it (the slice lists a
    device of it that NVML no longer holds), every device the slice lists of it carries a
    DeviceTaintRule of the agent's (the scheduler allocates from the slice). A listing that
    lacks devices the GPU holds, all it lists there, is no such GPU: nothing gone is handed
    out."""
    ours = device_taints.rules_of_node(w.cluster.taint_rules.values(), NODE)
    held = held_devices(w.gpus)
    listed = plugin.listed()
    for gpu in w.gpus.truth().gpus:
        names = {n for n, (_, parent) in listed.items() if parent == gpu.info.uuid}
        gone = sorted(n for n in names if listed[n][0] not in held)
        bare = sorted(names - ours.keys())
        if gone and bare:
            yield (
                f"the node is schedulable and the slice lists {len(gone)} device(s) of GPU "
                f"{gpu.index} that NVML no longer holds ({', '.join(gone[:2])}), yet "
                f"{len(bare)} of its listed devices carry no taint of the agent's "
                f"({', '.join(bare[:2])})"
            )


def _devices_destroyed_under_pods(w: World) -> Iterator[str]:
    """No pod still on the node (running, or terminating) holds a device that was destroyed
    since the kubelet gave it (a pod that got a device already gone is the listing's fault,
    said by the invariant above)."""
    held = held_devices(w.gpus)
    for facts in w.live_pods():
        gone = sorted(facts.devices - held.keys())
        if facts.bound_alive and gone and not facts.told:
            facts.told = True
            yield (
                f"pod {facts.ref} holds {gone[0]}, destroyed while the pod was on the node "
                "(neither evicted nor waited for)"
            )


def _schedulable_while_evicted_pods_go(w: World) -> Iterator[str]:
    """Schedulable implies no pod the agent evicted still terminates on a GPU that the layout
    it uncordoned for changes: new pods would land beside it, only to be evicted at the next
    try. That layout, not a relabel's since: until its next pass cordons, the agent has decided
    for the label it saw (a pod stuck on a GPU the other layout keeps is no reason)."""
    node = w.cluster.nodes[NODE]
    if node.unschedulable:
        return
    layout = w.uncordoned_for or node.labels.get(CONFIG)
    changing = changing_gpus(w, layout) or set()
    held = held_devices(w.gpus)
    evicted = {ev.ref for _, ev in w.evictions}
    open_gpus = _untainted_gpus(w) if isinstance(w.plugin, DraPluginModel) else None
    for facts in w.live_pods():
        on = {held[u].gpu for u in facts.devices if u in held} & changing
        if open_gpus is not None:  # a DRA node: held back by its devices' taints, per GPU
            on &= open_gpus
        if facts.ref in evicted and w.cluster.pods[facts.ref].terminating and on:
            yield (
                f"the node is schedulable while pod {facts.ref}, evicted, still terminates on "
                f"GPU(s) {sorted(on)} that layout {layout} changes"
            )


def _untainted_gpus(w: World) -> set[int]:
    """On a DRA node, the GPUs some device of which the slice lists with no DeviceTaintRule of
    the agent's: the scheduler may allocate it."""
    assert isinstance(w.plugin, DraPluginModel)
    ours = device_taints.rules_of_node(w.cluster.taint_rules.values(), NODE)
    index = {g.info.uuid: g.index for g in w.gpus.truth().gpus}
    return {
        index[parent]
        for name, (_, parent) in w.plugin.listed().items()
        if name not in ours and parent in index
    }


def after_pass(w: World) -> list[str]:
    """What must hold once a pass has returned (or was killed)."""
    return [
        *_words(w),
        *_success_is_true(w),
        *_operands_resumed(w),
        *_evicted_only_from_changing_gpus(w),
        *_cordoned_between_a_drains_tries(w),
        *_no_new_try_after_a_give_up(w),
    ]


def _no_new_try_after_a_give_up(w: World) -> Iterator[str]:
    """A give-up the node said ("no new try until ... are gone or the label changes") is kept:
    while the label and a pod it named stay, a pass asks for no eviction. Then this pass's
    words are noted for the next."""
    node = w.cluster.nodes[NODE]
    if w.given_up is not None:
        label, pods = w.given_up
        live = {str(f.ref) for f in w.live_pods()}
        if node.labels.get(CONFIG) == label and w.pass_label == label and pods & live:
            if w.evictions_asked:
                yield (
                    f"a drain of {label} given up on ({', '.join(sorted(pods))}) was tried "
                    f"again: {w.evictions_asked} eviction(s) asked"
                )
        else:
            w.given_up = None
    w.note_give_up()


def _cordoned_between_a_drains_tries(w: World) -> Iterator[str]:
    """Between the tries of a failed drain, inside drain_give_up_s from the first, the node
    stays cordoned (a DRA node: the devices of the GPUs that change stay tainted): pods that
    land between tries would only be evicted at the next."""
    node = w.cluster.nodes[NODE]
    if w.drain_failing is None or node.unschedulable:
        return
    label, since = w.drain_failing
    give_up_s = float(SETTINGS["drain_give_up_s"])
    if node.labels.get(CONFIG) != label or w.time.now() - since >= give_up_s:
        return
    where = ""
    if isinstance(w.plugin, DraPluginModel):  # held back by the changing GPUs' taints
        bare = (changing_gpus(w, label) or set()) & _untainted_gpus(w)
        if not bare:
            return
        where = f" (devices of GPU(s) {sorted(bare)} untainted)"
    yield (
        f"the node is schedulable{where} {w.time.now() - since:.0f} s after a drain of "
        f"{label} began to fail, inside drain_give_up_s ({give_up_s:g} s)"
    )


def _agent_cordon_stands(w: World) -> bool:
    node = w.cluster.nodes[NODE]
    return node.unschedulable and CORDONED in node.annotations


def _words(w: World) -> Iterator[str]:
    """Nothing the agent wrote in the pass (reason, condition, Event) says the node is
    uncordoned while its cordon stands, or that nothing was touched after a GPU changed in
    that pass; the reason and the condition on the node now neither."""
    cordoned = _agent_cordon_stands(w)
    node = w.cluster.nodes[NODE]
    now = [("reason", node.annotations.get(REASON, ""))]
    now += [("condition", c.message) for c in node.conditions if c.type == CONDITION]
    said = [(x.what, x.text, x.gpus_changed) for x in w.written if x.pass_no == w.pass_no]
    for what, text in now:
        if cordoned and UNCORDONED.search(text):
            yield (
                f"the node's {what} says it is uncordoned while the agent's cordon stands: {text!r}"
            )
    for what, text, changed in said:
        if cordoned and what.startswith("event") and UNCORDONED.search(text):
            yield (
                f"the {what} says the node is uncordoned while the agent's cordon stands: {text!r}"
            )
        if changed and NOTHING_TOUCHED.search(text):
            yield f"the {what} says nothing was touched after a GPU changed in the pass: {text!r}"


def _success_is_true(w: World) -> Iterator[str]:
    """``success``, written in this pass, only with the layout in place on the GPUs, the
    plugin listing exactly the devices they hold, and the agent's cordon gone."""
    node = w.cluster.nodes[NODE]
    wrote = [
        x
        for x in w.written
        if x.what == "state" and x.text == State.SUCCESS and x.pass_no == w.pass_no
    ]
    if not wrote or node.labels.get(STATE) != State.SUCCESS:
        return
    layout = wrote[-1].layout  # as the label was at the write: a relabel after it is news
    if not in_place(w, layout):
        yield f"state success, but the GPUs do not hold layout {layout}"
    if isinstance(w.plugin, DraPluginModel):
        yield from _dra_success_is_true(w, w.plugin)
        return
    # listed, healthy or not: a device an Xid made unhealthy is still the layout's (the
    # kubelet keeps a stopped plugin's listing in capacity, allocatable 0, for its grace period)
    held = by_resource(held_devices(w.gpus))
    listed = {r: u for r, u in w.plugin.registered.items() if u}
    capacity = node.gpu_capacity()
    if listed != held or capacity != _counts(held):
        yield (
            f"state success, but the plugin lists {_counts(listed)} (node capacity "
            f"{capacity}) where the GPUs hold {_counts(held)}"
        )
    if node.unschedulable and CORDONED in node.annotations:
        yield "state success with the agent's cordon still on the node"


def _dra_success_is_true(w: World, plugin: DraPluginModel) -> Iterator[str]:
    """``success`` on a DRA node: the slice lists exactly the devices the GPUs hold, no rule
    of the agent's is left, and no cordon of its own."""
    node = w.cluster.nodes[NODE]
    listed = {uuid for uuid, _ in plugin.listed().values()}
    held = set(held_devices(w.gpus))
    if listed != held:
        yield (
            f"state success, but the slice lists {len(listed)} device(s) "
            f"({len(listed - held)} NVML no longer holds) where the GPUs hold {len(held)}"
        )
    left = device_taints.rules_of_node(w.cluster.taint_rules.values(), NODE)
    if left:
        yield f"state success with {len(left)} DeviceTaintRule(s) of the agent's left"
    if node.unschedulable and CORDONED in node.annotations:
        yield "state success with the agent's cordon still on the node"


def in_place(w: World, layout: str | None, state: NodeState | None = None) -> bool:
    """The GPUs (now, or in ``state``) hold ``layout``: a plan to it is empty."""
    changing = changing_gpus(w, layout, state)
    return changing is not None and not changing


def changing_gpus(w: World, layout: str | None, state: NodeState | None = None) -> set[int] | None:
    """The GPUs a change to ``layout`` from the GPUs (now, or in ``state``) changes; None
    when it is no layout that can go on these GPUs."""
    if not layout or layout not in w.catalog:
        return None
    try:
        the_plan = planner.plan(
            w.catalog.get(layout),
            state or w.gpus.truth(),
            w.gpus.models(),
            destroy_in_use=True,
        )
    except MigAgentError:
        return None
    return set(the_plan.changed_gpus)


def _counts(devices: dict[str, frozenset[str]]) -> dict[str, int]:
    return {r: len(u) for r, u in sorted(devices.items()) if u}


def _operands_resumed(w: World) -> Iterator[str]:
    """No operand left paused once the state is success or failed."""
    node = w.cluster.nodes[NODE]
    if node.labels.get(STATE) not in (State.SUCCESS, State.FAILED):
        return
    paused = sorted(k for k, v in node.labels.items() if v == PAUSED)
    if paused or PAUSED_OPERANDS in node.annotations:
        yield f"state {node.labels[STATE]} with operands paused: {paused}"


def _evicted_only_from_changing_gpus(w: World) -> Iterator[str]:
    """With PodResources (or a DRA node's claims) telling who holds what, no pod evicted in the
    pass whose devices are all on GPUs that the layout asked for (at the pass's start, or when
    it was evicted) leaves as they are."""
    if not (w.podresources or w.dra):  # a DRA node's claims tell it
        return
    for pass_no, ev in w.evictions:
        if pass_no != w.pass_no or not ev.devices or not ev.named_true:
            continue
        held = held_devices(w.gpus, ev.gpus)
        if not ev.devices <= held.keys():
            continue  # it held a device already gone: nothing to spare
        on = {held[u].gpu for u in ev.devices}
        changing: set[int] = set()
        for layout in {w.pass_label, ev.layout}:
            changing |= changing_gpus(w, layout, ev.gpus) or set()
        if not on & changing:
            yield (
                f"pod {ev.ref} was evicted though its GPU(s) {sorted(on)} do not change "
                f"(layout {w.pass_label}; {ev.layout} when evicted)"
            )


def settled(w: World, passes: int) -> Iterator[str]:
    """Once the faults stop, ``passes`` passes end in ``success`` or in a ``failed`` whose
    reason names what the operator must fix (World.standing). No label: no state, and no
    cordon of the agent's unless the node says why, naming what to fix."""
    node = w.cluster.nodes[NODE]
    state, reason = node.labels.get(STATE), node.annotations.get(REASON, "")
    conditions = [c.message for c in node.conditions if c.type == CONDITION]
    needs = w.standing()

    def named(texts: list[str]) -> bool:
        return any(all(word in t for word in need) for need in needs for t in texts)

    if node.labels.get(CONFIG) is None:
        if state:
            yield f"no layout label, yet state {state!r}"
        if _agent_cordon_stands(w) and not named([reason, *conditions]):
            yield (
                f"no layout label, and the agent's cordon stands without a reason that names "
                f"what to fix (reason {reason!r}, condition {conditions}; what the operator "
                f"must fix: {needs or 'nothing'})"
            )
        return
    if state == State.SUCCESS or (state == State.FAILED and named([reason])):
        return
    yield (
        f"with the faults stopped, {passes} passes end in state {state!r} with reason "
        f"{reason!r}; what the operator must fix: {needs or 'nothing'}"
    )
