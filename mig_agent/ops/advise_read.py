"""What ``advise`` reads of the cluster: the pending pods no node can take today for want of GPU
devices, and Kueue's workloads that wait on admission checks (demand), and the GPU nodes with
what each approved layout would do there (supply). One look at nodes, pods, ResourceSlices,
ResourceClaims, PodDisruptionBudgets and Kueue's Workloads and ResourceFlavors (and the
ResourceClaimTemplates a workload's pod set names); no patch.
``read_node`` looks again at one node, for ``advise --apply`` just before its relabel.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mig_agent.config.settings import Settings
from mig_agent.core import admission_ledger, demand, device_classes, dra_devices, kueue_demand
from mig_agent.core.advertised import node_mig_strategy
from mig_agent.core.advise import Option, Supply
from mig_agent.core.advise_assign import Want
from mig_agent.core.advise_options import DRA, Holder, Memo, holds, node_supply, renamed
from mig_agent.core.errors import ConfigError, KubeError
from mig_agent.core.generated_layouts import with_generated
from mig_agent.core.gpu_models import GpuModel
from mig_agent.core.labels import State
from mig_agent.core.layout import LayoutCatalog
from mig_agent.core.snapshot import from_json, holders_of
from mig_agent.kube.cluster import Cluster, NodeView, PdbView, PodView
from mig_agent.ops.dra_view import DraView, tolerant
from mig_agent.ops.dra_view import read as dra_view_of


@dataclass(frozen=True, slots=True)
class Served:
    """What the cluster's DeviceClasses say: DRA kind -> the extended resource a class serves
    it as (``dra:1g.10gb`` -> ``nvidia.com/mig-1g.10gb``), the DRA nodes (the only ones where
    such a device is to be had), and class name -> the one MIG profile it picks (a claim may
    name such a class; demand.from_claims)."""

    names: Mapping[str, str] = field(default_factory=dict)
    nodes: frozenset[str] = frozenset()
    classes: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Pool:
    """Demand and supply, and what advise must say about what it leaves out."""

    wants: list[Want] = field(default_factory=list)
    supplies: list[Supply] = field(default_factory=list)
    # pods left out before the search (claim not understood...), with the reason
    not_understood: dict[str, str] = field(default_factory=dict)
    left_alone: dict[str, str] = field(default_factory=dict)  # node -> why
    # per pod, the GPU nodes its constraints allow (left alone or not)
    allowed: dict[str, list[str]] = field(default_factory=dict)
    # node -> kinds only options that evict offer (refused without --allow-evict or by PDBs)
    evicting_only: dict[str, set[str]] = field(default_factory=dict)
    # what a relabel checks again: per node its layout and state labels as read, per pod its
    # UID (a pod made again under the same name is another pod), the layouts searched
    seen: dict[str, dict[str, str | None]] = field(default_factory=dict)
    labels: dict[str, dict[str, str | None]] = field(default_factory=dict)  # every GPU node's
    uids: dict[str, str] = field(default_factory=dict)
    catalog: LayoutCatalog | None = None
    budgets: dict[str, int] = field(default_factory=dict)  # PDB -> evictions it allows now
    # Kueue: the workloads read as demand, those left out because quota holds them (-> why),
    # and the wants that stand for their pods (no pod exists yet)
    workloads: list[str] = field(default_factory=list)
    workloads_for_quota: dict[str, str] = field(default_factory=dict)
    workload_pods: set[str] = field(default_factory=set)
    hostnames: dict[str, str] = field(default_factory=dict)  # node -> kubernetes.io/hostname


def read_pool(
    cluster: Cluster,
    catalog: LayoutCatalog,
    settings: Settings,
    *,
    selector: str = "",
    allow_evict: bool = False,
    generated: bool = False,
    workloads: Sequence[Mapping[str, Any]] | None = None,
    keep_promises: bool = False,
) -> Pool:
    """Demand and supply of the GPU nodes ``selector`` picks; with ``generated``, the layouts
    generated for GPU models the catalog does not cover are candidates too; ``workloads``:
    Kueue's Workloads to read as demand (None: as listed now); ``keep_promises``: the nodes
    the MIG layout check's ledger holds are left alone (advise's read; the check keeps its
    promises itself)."""
    s = settings
    pool = Pool()
    dra = dra_view_of(cluster, claims=True) if s.dra else DraView()
    claims = _claims_by_name(dra)
    names, profiles = _classes(cluster, dra)
    pods = cluster.list_pods()
    running: dict[str, list[PodView]] = {}
    for p in pods:
        pool.uids[str(p.ref)] = p.ref.uid
        if p.node and not p.finished:
            running.setdefault(p.node, []).append(p)
    nodes = [
        n
        for n in sorted(cluster.list_nodes(selector), key=lambda n: n.name)
        if s.gpu_state_annotation in n.annotations
        or n.gpu_resources()
        or dra_devices.publishes(dra.slices, n.name)
    ]
    pdbs = _tolerant_pdbs(cluster) if allow_evict else []
    pool.budgets = budgets_of(pdbs)
    memo: Memo = {}  # nodes alike plan each layout once
    if generated:
        catalog = with_generated(catalog, _models(nodes, s))[0]
    pool.catalog = catalog
    for node in nodes:
        pool.labels[node.name] = {k: node.labels.get(k) for k in (s.config_label, s.state_label)}
        busy = _left_alone(node, s, dra)
        if busy:
            pool.left_alone[node.name] = busy
            continue
        supply = _supply(node, catalog, s, dra, claims, running.get(node.name, []), memo, names)
        if isinstance(supply, str):
            pool.left_alone[node.name] = supply
            continue
        supply, evicting = _allowed_options(supply, pdbs, running.get(node.name, []), allow_evict)
        pool.evicting_only[node.name] = evicting
        pool.supplies.append(supply)
        pool.seen[node.name] = pool.labels[node.name]
        pool.hostnames[node.name] = node.labels.get(kueue_demand.HOSTNAME, "")
    free = {sp.node: sp.free for sp in pool.supplies}
    served = Served(names, frozenset(n.name for n in nodes if _is_dra(n, dra)), profiles)
    for p in pods:
        if p.node or p.phase != "Pending" or p.terminating:
            continue
        _add_want(pool, p, nodes, free, claims, served)
    if workloads is None:
        workloads = _tolerant_kueue(cluster, "workloads")
    _add_workloads(pool, cluster, (nodes, workloads), free, claims, served)
    if keep_promises:
        _leave_promised_alone(pool, workloads, pods)
    return pool


def _leave_promised_alone(
    pool: Pool, workloads: Sequence[Mapping[str, Any]], pods: Sequence[PodView]
) -> None:
    """The nodes the MIG layout check's ledger holds (promised to a workload, or changing for
    one) taken out of the supply: left alone, saying for whom; the workloads promised their
    devices are no demand."""
    done: dict[str, int] = {}
    for p in pods:
        uid = p.labels.get(kueue_demand.WORKLOAD_LABEL)
        if uid and (p.node or p.finished):
            done[uid] = done.get(uid, 0) + 1
    held, promised = admission_ledger.held_nodes(workloads, done)
    for node, why in held.items():
        if any(s.node == node for s in pool.supplies):
            pool.left_alone[node] = f"{why} by the MIG layout check"
    pool.supplies = [s for s in pool.supplies if s.node not in held]
    gangs = {f"workload:{w}" for w in promised}
    pool.wants = [
        dataclasses.replace(w, nodes=w.nodes.difference(held))
        for w in pool.wants
        if w.gang not in gangs
    ]
    pool.workloads = [w for w in pool.workloads if w not in promised]


def _add_workloads(
    pool: Pool,
    cluster: Cluster,
    read: tuple[Sequence[NodeView], Sequence[Mapping[str, Any]]],
    free: Mapping[str, Mapping[str, int]],
    claims: Mapping[tuple[str, str], Mapping[str, Any]],
    served: Served,
) -> None:
    """Kueue's workloads that wait on admission checks (mig_agent.core.kueue_demand): each pod
    of a pod set one want, the workload's pods one gang; asks by claim renamed and kept to DRA
    nodes as a pending pod's are (``served``: see _add_want). Nothing where Kueue is not
    installed or its workloads may not be read. ``read``: the GPU nodes and the Workloads."""
    nodes, workloads = read
    if not workloads:
        return
    flavors = {
        str((f.get("metadata") or {}).get("name", "")): f
        for f in _tolerant_kueue(cluster, "resourceflavors")
    }
    templates, claims = _claimed(cluster, workloads, claims)
    got = kueue_demand.workload_demand(
        workloads, flavors, templates=templates, claims=claims, classes=served.classes
    )
    pool.workloads = got.workloads
    pool.workloads_for_quota = dict(got.waiting_for_quota)
    pool.not_understood.update({f"workload {w}": why for w, why in got.not_understood.items()})
    uid_of = {_workload_key(w): str((w.get("metadata") or {}).get("uid", "")) for w in workloads}
    for ps in got.pod_sets:
        allowed = [n.name for n in nodes if not ps.constraints.refusal(n.name, n.labels, n.taints)]
        ask, on = _on_dra(ps.ask, allowed, served)
        active = frozenset(n for n in on if n in free)
        for pod in ps.pods():
            pool.allowed[pod] = allowed
            pool.workload_pods.add(pod)
            pool.uids[pod] = uid_of.get(ps.workload, "")  # its workload's: no pod exists yet
            gang = f"workload:{ps.workload}"
            pool.wants.append(
                Want(pod, ask.kind, ask.count, active, ps.constraints.describe(), gang)
            )


def _workload_key(workload: Mapping[str, Any]) -> str:
    meta = workload.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def workloads_not_waiting(cluster: Cluster, keys: Mapping[str, str]) -> list[str]:
    """Of the workloads ``keys`` names (namespace/name -> UID as read), those that no longer
    wait on their admission checks, with why: gone, made again, admitted, held by quota."""
    now = {_workload_key(w): w for w in _tolerant_kueue(cluster, "workloads")}
    out = []
    for key, uid in sorted(keys.items()):
        w = now.get(key)
        if w is None or str((w.get("metadata") or {}).get("uid", "")) != uid:
            out.append(f"workload {key} is gone (deleted, or made again under another UID)")
        elif why := kueue_demand.not_waiting(w):
            out.append(f"workload {key} no longer waits on its admission checks ({why})")
    return out


def _claimed(
    cluster: Cluster,
    workloads: Sequence[Mapping[str, Any]],
    claims: Mapping[tuple[str, str], Mapping[str, Any]],
) -> tuple[kueue_demand.Objects, kueue_demand.Objects]:
    """The ResourceClaimTemplates and ResourceClaims (those read already where DRA nodes are,
    else listed) by (namespace, name), listed only where a pod set names one; none where they
    may not be read (such a pod set is then not understood, naming what was not found)."""
    entries = [
        e
        for w in workloads
        for ps in (w.get("spec") or {}).get("podSets") or ()
        for e in (((ps.get("template") or {}).get("spec") or {}).get("resourceClaims") or ())
    ]
    templates: kueue_demand.Objects = {}
    if any(e.get("resourceClaimTemplateName") for e in entries):
        templates = _by_key(tolerant(cluster.list_resource_claim_templates))
    if not claims and any(e.get("resourceClaimName") for e in entries):
        claims = _by_key(tolerant(cluster.list_resource_claims))
    return templates, claims


def _tolerant_kueue(cluster: Cluster, plural: str) -> list[dict[str, Any]]:
    """Kueue's ``plural``; none where the caller may not read them."""
    try:
        return cluster.list_kueue(plural)
    except KubeError as exc:
        if exc.context.get("status") in (403, 404):
            return []
        raise


@dataclass(frozen=True, slots=True)
class NodeNow:
    """One node as it is now: its options (those that evict included), the pods bound to it."""

    node: NodeView
    supply: Supply
    running: tuple[PodView, ...]


def read_node(
    cluster: Cluster,
    catalog: LayoutCatalog,
    settings: Settings,
    name: str,
    seen: Mapping[str, str | None],
) -> NodeNow | str:
    """``name`` read again (node, its pods, DRA slices and claims), or why it is no longer for
    advise to change: its labels differ from ``seen``, or it is left alone now."""
    s = settings
    node = cluster.get_node(name)
    differ = {k: node.labels.get(k) for k, v in seen.items() if node.labels.get(k) != v}
    if differ:
        now = ", ".join(f"{k}={v or '(none)'}" for k, v in differ.items())
        return f"relabelled ({now}) meanwhile, not overwritten"
    dra = dra_view_of(cluster, claims=True) if s.dra else DraView()
    busy = _left_alone(node, s, dra)
    if busy:
        return busy
    # bound is enough: a pod the scheduler placed holds its device before it runs
    running = tuple(p for p in cluster.list_pods(node=name) if not p.finished)
    claims = _claims_by_name(dra)
    supply = _supply(node, catalog, s, dra, claims, running, {}, _classes(cluster, dra)[0])
    if isinstance(supply, str):
        return supply
    return NodeNow(node, supply, running)


def within_budgets(cluster: Cluster, option: Option, running: Sequence[PodView]) -> bool:
    """Whether the PodDisruptionBudgets allow ``option``'s evictions now."""
    one = Supply("", None, {}, (option,))
    return bool(_allowed_options(one, _tolerant_pdbs(cluster), running, True)[0].options)


def _claims_by_name(dra: DraView) -> dict[tuple[str, str], Mapping[str, Any]]:
    return _by_key(dra.claims)


def _by_key(objects: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], Mapping[str, Any]]:
    """Namespaced objects by (namespace, name)."""
    return {
        (c.get("metadata", {}).get("namespace", ""), c.get("metadata", {}).get("name", "")): c
        for c in objects
    }


def _models(nodes: Sequence[NodeView], s: Settings) -> list[GpuModel]:
    out: list[GpuModel] = []
    for node in nodes:
        try:
            out += from_json(json.loads(node.annotations.get(s.gpu_state_annotation, "")))[
                1
            ].values()
        except ValueError:
            continue
    return out


def _left_alone(node: NodeView, s: Settings, dra: DraView) -> str:
    state = node.labels.get(s.state_label)
    if state in (State.PENDING, State.REBOOTING):
        return f"a change is under way (state {state})"
    if state == State.FAILED:
        return "its last change failed (state failed)"
    if node.unschedulable:
        return "cordoned"
    if dra_devices.partitionable(dra.slices, node.name):
        return "its DRA driver runs DynamicMIG and owns its MIG devices"
    if s.gpu_state_annotation not in node.annotations:
        return "no GPU state published by its agent"
    return ""


def _supply(
    node: NodeView,
    catalog: LayoutCatalog,
    s: Settings,
    dra: DraView,
    claims: Mapping[tuple[str, str], Mapping[str, Any]],
    running: Sequence[PodView],
    memo: Memo,
    names: Mapping[str, str],
) -> Supply | str:
    try:
        raw = json.loads(node.annotations[s.gpu_state_annotation])
        state, models = from_json(raw)
    except ValueError as exc:
        return f"unreadable GPU state ({exc})"
    is_dra = _is_dra(node, dra)
    try:
        strategy = (
            DRA
            if is_dra
            else node_mig_strategy(node.labels, label=s.mig_strategy_label, fallback=s.mig_strategy)
        )
    except ConfigError as exc:
        return str(exc)
    label = node.labels.get(s.config_label) or ""
    layout = catalog.layouts.get(label)
    if layout is not None and not holds(layout, state, models, strategy=strategy, memo=memo):
        return f"its GPUs do not hold its layout {label} yet: a change its agent has not begun"
    holders = _holders(node.name, running, claims, dra, is_dra, holders_of(raw))
    supply = node_supply(
        node.name,
        node.labels.get(s.config_label),
        catalog.layouts.values(),
        state,
        models,
        strategy=strategy,
        holders=holders,
        memo=memo,
    )
    return renamed(supply, names) if is_dra else supply


def _is_dra(node: NodeView, dra: DraView) -> bool:
    return not node.gpu_resources() and dra_devices.publishes(dra.slices, node.name)


def _classes(cluster: Cluster, dra: DraView) -> tuple[dict[str, str], dict[str, str]]:
    """From the DeviceClasses: DRA device kind -> the extended resource a class serves it as
    (``dra:1g.10gb`` -> ``nvidia.com/mig-1g.10gb``: pods asking that resource are served by DRA
    nodes too, the scheduler making their claims), and class name -> the one MIG profile it
    picks. None without DRA nodes, or where classes may not be read."""
    if not dra.slices:
        return {}, {}
    try:
        classes = cluster.list_device_classes()
    except KubeError as exc:
        if exc.context.get("status") in (403, 404):
            return {}, {}
        raise
    served = device_classes.served_profiles(classes)
    names = {demand.dra_kind(profile): resource for resource, profile in served.items()}
    return names, device_classes.class_profiles(classes)


def _holders(
    node: str,
    running: Sequence[PodView],
    claims: Mapping[tuple[str, str], Mapping[str, Any]],
    dra: DraView,
    is_dra: bool,
    published: Mapping[str, frozenset[str]],
) -> list[Holder]:
    """The node's running GPU pods, each with the devices it holds by kind and, where known, by
    UUID: a DRA node's claims, and the kubelet's PodResources as the agent published them
    (``published``: pod UID -> device ids)."""
    devices = {
        str(d.get("name", "")): d for d in dra_devices.node_devices(dra.slices, node) if is_dra
    }
    # a DRA node's pods by the UUIDs of the devices their claims were allocated
    uuids = dra_devices.claim_holders(dra.claims, dra.slices, node) if is_dra else {}
    out = []
    for p in sorted(running, key=lambda p: str(p.ref)):
        kinds: Counter[str] = Counter()
        if is_dra:
            for name in p.claims:
                claim = claims.get((p.ref.namespace, name))
                if claim is not None:
                    kinds.update(demand.held_kinds(claim, devices, node))
        else:
            kinds.update(p.gpu_requests)
        if kinds:
            held = uuids.get((p.ref.namespace, p.ref.name), frozenset())
            held |= published.get(p.ref.uid, frozenset())
            out.append(Holder(str(p.ref), dict(kinds), held))
    return out


def _allowed_options(
    supply: Supply, pdbs: Sequence[PdbView], running: Sequence[PodView], allow_evict: bool
) -> tuple[Supply, set[str]]:
    """The supply without the options it may not take: any eviction without ``allow_evict``,
    else more evictions of a PDB's pods than it allows now; the others say how many of each
    PDB's pods they evict (the search keeps their sum within it). Also the kinds only the
    options left out offer."""
    labels = {str(p.ref): (p.ref.namespace, p.labels) for p in running}
    allowed = budgets_of(pdbs)
    kept: list[Option] = []
    for o in supply.options:
        if o.evicts and not allow_evict:
            continue
        covered = _covered(o.evicts, pdbs, labels)
        if all(n <= allowed[b] for b, n in covered.items()):
            kept.append(dataclasses.replace(o, budgets=covered) if covered else o)
    offered = {k for o in kept for k, n in o.free.items() if n}
    layouts = {o.layout for o in kept}
    refused = {k for o in supply.options if o.layout not in layouts for k, n in o.free.items() if n}
    return Supply(supply.node, supply.layout, supply.free, tuple(kept), supply.resources), (
        refused - offered
    )


def _covered(
    evicts: Sequence[str],
    pdbs: Sequence[PdbView],
    labels: Mapping[str, tuple[str, Mapping[str, str]]],
) -> dict[str, int]:
    """PDB -> how many of ``evicts`` (pods by name: namespace and labels) it covers."""
    out: dict[str, int] = {}
    for pdb in pdbs:
        n = sum(
            1
            for pod in evicts
            if pod in labels
            and labels[pod][0] == pdb.namespace
            and pdb.selector is not None
            and pdb.selector.matches(labels[pod][1])
        )
        if n:
            out[_budget(pdb)] = n
    return out


def _budget(pdb: PdbView) -> str:
    return f"{pdb.namespace}/{pdb.name}"


def budgets_of(pdbs: Sequence[PdbView]) -> dict[str, int]:
    """The evictions each PodDisruptionBudget allows now, for the search."""
    return {_budget(p): p.disruptions_allowed for p in pdbs}


def _tolerant_pdbs(cluster: Cluster) -> list[PdbView]:
    """The PDBs; none where the caller may not read them (every eviction still honours them)."""
    try:
        return cluster.list_pod_disruption_budgets()
    except KubeError as exc:
        if exc.context.get("status") in (403, 404):
            return []
        raise


def _add_want(
    pool: Pool,
    pod: PodView,
    nodes: Sequence[NodeView],
    free: Mapping[str, Mapping[str, int]],
    claims: Mapping[tuple[str, str], Mapping[str, Any]],
    served: Served = Served(),
) -> None:
    """The pod as a want, unless a node can take it today. ``served``: what the DeviceClasses
    say (asks by claim renamed, kept to DRA nodes; the classes a claim may name)."""
    name = str(pod.ref)
    ask: demand.Ask | str | None
    if pod.gpu_requests:
        ask = demand.from_requests(pod.gpu_requests)
    elif pod.claims:
        found = [claims.get((pod.ref.namespace, c)) for c in pod.claims]
        if any(c is None for c in found):
            ask = None  # its claims are not made yet, or not NVIDIA's: nothing to read
        else:
            ask = demand.from_claims((c for c in found if c is not None), served.classes)
    else:
        return
    if ask is None:
        return
    if isinstance(ask, str):
        pool.not_understood[name] = ask
        return
    allowed = [n.name for n in nodes if not pod.constraints.refusal(n.name, n.labels, n.taints)]
    pool.allowed[name] = allowed
    ask, allowed = _on_dra(ask, allowed, served)
    if any(free.get(n, {}).get(ask.kind, 0) >= ask.count for n in allowed):
        return  # a node can take it today: the scheduler's to place
    active = frozenset(n for n in allowed if n in free)
    gang = demand.gang_of(pod.ref.namespace, pod.labels)
    pool.wants.append(Want(name, ask.kind, ask.count, active, pod.constraints.describe(), gang))


def _on_dra(ask: demand.Ask, allowed: list[str], served: Served) -> tuple[demand.Ask, list[str]]:
    """An ask by claim renamed to the resource a DeviceClass serves it as (so is a DRA node's
    supply), and the nodes allowed kept to DRA nodes: only there is such a device to be had."""
    if ask.kind not in served.names:
        return ask, allowed
    kind = served.names[ask.kind]
    return demand.Ask(kind, ask.count), [n for n in allowed if n in served.nodes]
