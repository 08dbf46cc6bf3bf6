"""Kueue's queued work as GPU demand for ``advise``: the Workloads (``kueue.x-k8s.io``, v1beta2
or v1beta1: the fields read here are the same in both, Kueue v0.17's CRDs) that reserved quota
but are not admitted yet, i.e. wait on their admission checks, and whose pod sets ask for MIG
devices (``nvidia.com/mig-*``) or whole GPUs (``nvidia.com/gpu``), or for devices of NVIDIA's
DRA driver by ResourceClaim (``dra:<profile>``, ``dra:gpu``, read by
mig_agent.core.demand.from_claims as a pending pod's claims are).

A suspended Job has no pods until Kueue admits its Workload, so this demand is nowhere else:
each pod set is ``count`` pods (the count its quota was reserved for, where the admission says
so: a partial admission reserves fewer), each asking what the pod template's containers ask,
placed by the template's nodeSelector, node affinity and tolerations, and those of the
ResourceFlavors assigned to the pod set (Kueue adds them all to its pods when it admits).
All pods of a workload are one gang: Kueue admits a workload whole.

A pod set's ResourceClaims (its template's ``spec.resourceClaims``, in the workload's
namespace):

- ``resourceClaimTemplateName``: each pod gets its own claim made from the template, so each of
  the ``count`` pods asks what the ResourceClaimTemplate's ``spec.spec`` requests ask;
- ``resourceClaimName``: one claim that all the pod set's pods share, its devices allocated
  once, on one node, where its pods then all run: unallocated, it is one ask for the pod set
  (``namespace/workload[pod-set/claim:<name>]``); allocated, it asks nothing more. A pod set
  with both a shared claim and per-pod ones is not understood: the per-pod devices would have
  to be on the shared claim's node, which the search cannot say.

What Kueue v0.17 itself does with them: nothing unless its ``DynamicResourceAllocation``
feature gate (alpha, off by default) is on. Then a workload naming a ``resourceClaimName`` is
inadmissible, and a template's requests count as quota by DeviceClass, mapped to a logical
resource by the configuration's ``resources.deviceClassMappings`` (per pod, times the pods);
CEL selectors, ``firstAvailable``, ``allocationMode: All``, constraints and device config make
the workload inadmissible. So with the gate on, a claim by profile (a CEL selector) never
reserves quota and only whole-GPU (``gpu.nvidia.com``) claims become demand here; with it off,
claims take no quota and Kueue reserves what the containers ask.

Left out, and counted, with the reason:

- workloads that have not reserved quota (``QuotaReserved`` False or not set yet: the reason
  is ``Pending`` in Kueue v0.17, ``WaitingForQuota`` / ``ExceedsMaxQuota`` / ``NoMatchingFlavor``
  later): quota holds them back, and no relabel gives quota;
- admitted workloads: their Jobs run pods, and pods that are Pending count as pods already
  (counting the workload too would count them twice);
- finished or deactivated workloads;
- pod sets that ask for no GPU device are not demand (a claim of another driver's class asks
  none); a workload whose GPU ask is not understood (several device kinds in one pod, by
  resource and by claim too; a claim request from_claims does not understand; a
  ResourceClaimTemplate or shared ResourceClaim not found) is left out naming why.

When the check marks a workload Ready, ``pod_set_updates`` pins each pod set whose pods were all
placed on one node to that node (Kueue's ``podSetUpdates``, a ``kubernetes.io/hostname`` node
selector Kueue adds to the pods when it admits the workload): its pods then take the devices
promised to them, not those promised to the next workload. A pod set spread over several nodes
cannot be pinned by one node selector, and is not; nor one whose template names a host itself.
Every pod set the check placed also gets the label ``mig-agent.dev/admission-workload: <the
workload's UID>``: the check finds the pods of an admitted workload by it (``pods_selector``),
whichever kind of job (Job, JobSet, RayJob, plain pods...) makes them.

Pure module: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from mig_agent.core import demand
from mig_agent.core.scheduling import PodConstraints, constraints_of

QUOTA_RESERVED: Final = "QuotaReserved"
HOSTNAME: Final = "kubernetes.io/hostname"
# on the pods of a workload the check marked Ready (through podSetUpdates): its UID, by which
# the check finds them, whatever kind of job made them
WORKLOAD_LABEL: Final = "mig-agent.dev/admission-workload"
POD_SET_LABEL: Final = "mig-agent.dev/admission-pod-set"  # which pod set a pod is of
ADMITTED: Final = "Admitted"
FINISHED: Final = "Finished"

# resource.k8s.io/v1 objects by (namespace, name): ResourceClaimTemplates, ResourceClaims
Objects = Mapping[tuple[str, str], Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class PodSetDemand:
    """``count`` pods of ``workload``'s pod set ``pod_set``, each asking ``ask``."""

    workload: str  # namespace/name
    pod_set: str
    count: int
    ask: demand.Ask
    constraints: PodConstraints
    shared_claim: str = ""  # the pod set's shared ResourceClaim that ``ask`` stands for

    def pods(self) -> list[str]:
        """A name per pod, for advise's tables: ``namespace/workload[pod-set/i]``; for a shared
        claim, its one ask: ``namespace/workload[pod-set/claim:<name>]``."""
        if self.shared_claim:
            return [f"{self.workload}[{self.pod_set}/claim:{self.shared_claim}]"]
        return [f"{self.workload}[{self.pod_set}/{i}]" for i in range(self.count)]


@dataclass(frozen=True, slots=True)
class WorkloadDemand:
    """What the workloads ask, and which were left out (workload -> why)."""

    pod_sets: tuple[PodSetDemand, ...] = ()
    waiting_for_quota: Mapping[str, str] = field(default_factory=dict)
    not_understood: Mapping[str, str] = field(default_factory=dict)

    @property
    def workloads(self) -> list[str]:
        """The workloads read as demand, in order."""
        return list(dict.fromkeys(p.workload for p in self.pod_sets))


def _condition(workload: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for c in (workload.get("status") or {}).get("conditions") or ():
        if c.get("type") == kind:
            return dict(c)
    return {}


def is_true(workload: Mapping[str, Any], kind: str) -> bool:
    return _condition(workload, kind).get("status") == "True"


def _requests(template: Mapping[str, Any]) -> dict[str, int]:
    """The GPU resources a pod of ``template`` asks (largest of requests and limits, any
    container or init container), as the kube boundary reads a pod's."""
    spec = template.get("spec") or {}
    out: dict[str, int] = {}
    for c in [*(spec.get("containers") or ()), *(spec.get("initContainers") or ())]:
        res = c.get("resources") or {}
        for source in (res.get("limits") or {}, res.get("requests") or {}):
            for k, v in source.items():
                if k == demand.GPU_RESOURCE or k.startswith(demand.MIG_PREFIX):
                    out[k] = max(out.get(k, 0), int(str(v)))
    return out


def _assignments(workload: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    admission = (workload.get("status") or {}).get("admission") or {}
    return {str(a.get("name", "")): a for a in admission.get("podSetAssignments") or ()}


def _with_flavors(
    spec: Mapping[str, Any], flavors: Sequence[Mapping[str, Any]]
) -> Mapping[str, Any]:
    """The pod spec with the flavors' node labels and tolerations added, as Kueue does."""
    if not flavors:
        return spec
    labels: dict[str, Any] = {}
    tolerations = list(spec.get("tolerations") or ())
    for flavor in flavors:
        fspec = flavor.get("spec") or {}
        labels.update(fspec.get("nodeLabels") or {})
        tolerations += fspec.get("tolerations") or ()
    return {
        **spec,
        "nodeSelector": {**labels, **(spec.get("nodeSelector") or {})},
        "tolerations": tolerations,
    }


@dataclass(frozen=True, slots=True)
class _Objects:
    """What pod sets name: ResourceFlavors by name, ResourceClaimTemplates and ResourceClaims
    by (namespace, name); ``by_claim``: whether the caller read those (else claims are not
    looked at, as before they were read)."""

    flavors: Mapping[str, Mapping[str, Any]]
    templates: Objects
    claims: Objects
    by_claim: bool
    classes: Mapping[str, str] = field(default_factory=dict)  # see demand.from_claims


# what a pod asks and, where a shared claim asks it for the pod set, the claim ("": each pod)
_Asked = tuple[demand.Ask, str]


def _claims_ask(namespace: str, spec: Mapping[str, Any], objects: _Objects) -> _Asked | str | None:
    """What the pod spec's ResourceClaims ask of NVIDIA's DRA driver, why that is not
    understood, or None: nothing."""
    per_pod: list[Mapping[str, Any]] = []
    shared: dict[str, Mapping[str, Any]] = {}
    for entry in spec.get("resourceClaims") or ():
        if template_name := entry.get("resourceClaimTemplateName"):
            template = objects.templates.get((namespace, str(template_name)))
            if template is None:
                return f"ResourceClaimTemplate {namespace}/{template_name} not found"
            # the claim a pod gets from it, named for the messages
            name = f"{entry.get('name', '')} (template {template_name})"
            spec_of = (template.get("spec") or {}).get("spec") or {}
            per_pod.append({"metadata": {"name": name}, "spec": spec_of})
        elif claim_name := entry.get("resourceClaimName"):
            claim = objects.claims.get((namespace, str(claim_name)))
            if claim is None:
                return f"ResourceClaim {namespace}/{claim_name} not found"
            shared[str(claim_name)] = claim
    each = demand.from_claims(per_pod, objects.classes)
    once = demand.from_claims(shared.values(), objects.classes)
    if isinstance(each, str) or isinstance(once, str):
        return each if isinstance(each, str) else str(once)
    if each is not None and once is not None:
        return "asks for devices per pod and a shared claim at once, which is not understood"
    if once is not None:
        asking = [
            n for n, c in shared.items() if demand.from_claims([c], objects.classes) is not None
        ]
        return once, ",".join(asking)
    return None if each is None else (each, "")


def _ask(namespace: str, template: Mapping[str, Any], objects: _Objects) -> _Asked | str | None:
    """What a pod of ``template`` asks, by resources or by claims; why that is not understood;
    None: no GPU device."""
    spec = template.get("spec") or {}
    by_claims = _claims_ask(namespace, spec, objects) if objects.by_claim else None
    requests = _requests(template)
    if isinstance(by_claims, str) or not requests:
        return by_claims
    ask = demand.from_requests(requests)
    if isinstance(ask, str):
        return ask
    if by_claims is not None:
        return f"asks for several GPU device kinds at once ({ask.kind}, {by_claims[0].kind})"
    return ask, ""


def _pod_set(
    workload: str,
    pod_set: Mapping[str, Any],
    assignment: Mapping[str, Any],
    objects: _Objects,
) -> PodSetDemand | str | None:
    """One pod set's demand, why it is not understood, or None when it asks for no GPU."""
    name = str(pod_set.get("name", ""))
    template = pod_set.get("template") or {}
    got = _ask(workload.split("/", 1)[0], template, objects)
    if got is None:
        return None
    if isinstance(got, str):
        return f"pod set {name!r}: {got}"
    ask, shared = got
    assigned = dict.fromkeys(str(f) for f in (assignment.get("flavors") or {}).values())
    flavors = [objects.flavors[f] for f in assigned if f in objects.flavors]
    spec = _with_flavors(template.get("spec") or {}, flavors)
    pods = int(assignment.get("count", pod_set.get("count", 1)))
    count = min(pods, 1) if shared else pods  # a shared claim's devices: once for them all
    return PodSetDemand(workload, name, count, ask, constraints_of(spec), shared)


def _skip(workload: Mapping[str, Any]) -> str | None:
    """Why ``workload`` is no demand at all (not even counted), or None."""
    if (workload.get("spec") or {}).get("active") is False:
        return "deactivated"
    if is_true(workload, FINISHED):
        return "finished"
    if is_true(workload, ADMITTED):
        return "admitted"
    return None


def _quota_wait(workload: Mapping[str, Any]) -> str:
    """Why quota holds ``workload`` back ("" when it has reserved quota)."""
    reserved = _condition(workload, QUOTA_RESERVED)
    if reserved.get("status") == "True":
        return ""
    if not reserved:
        return "no quota reserved yet"
    why = str(reserved.get("reason") or "quota not reserved")
    message = str(reserved.get("message") or "")
    return f"{why}: {message}" if message else why


def workload_demand(
    workloads: Iterable[Mapping[str, Any]],
    flavors: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    templates: Objects | None = None,
    claims: Objects | None = None,
    classes: Mapping[str, str] | None = None,
) -> WorkloadDemand:
    """The GPU demand of the Workloads that wait on admission checks (see the module);
    ``flavors`` are the ResourceFlavors by name, ``templates`` and ``claims`` the
    ResourceClaimTemplates and ResourceClaims by (namespace, name): with neither given, pod
    sets' claims are not read (a pod set asking by claim only is no demand); ``classes``: the
    DeviceClasses that pick one MIG profile (demand.from_claims)."""
    by_claim = templates is not None or claims is not None
    objects = _Objects(flavors or {}, templates or {}, claims or {}, by_claim, classes or {})
    out: list[PodSetDemand] = []
    quota: dict[str, str] = {}
    odd: dict[str, str] = {}
    for w in sorted(workloads, key=_name):
        name = _name(w)
        if _skip(w) is not None:
            continue
        found = _pod_sets(name, w, objects)
        if isinstance(found, str):
            odd[name] = found
        elif found:
            waits = _quota_wait(w)
            if waits:
                quota[name] = waits
            else:
                out += found
    return WorkloadDemand(tuple(out), quota, odd)


def _pod_sets(
    name: str, workload: Mapping[str, Any], objects: _Objects
) -> Sequence[PodSetDemand] | str:
    """The GPU pod sets of ``workload``, or why one of them is not understood."""
    assignments = _assignments(workload)
    found: list[PodSetDemand] = []
    for ps in (workload.get("spec") or {}).get("podSets") or ():
        got = _pod_set(name, ps, assignments.get(str(ps.get("name", ""))) or {}, objects)
        if isinstance(got, str):
            return got
        if got is not None and got.count > 0:
            found.append(got)
    return found


def _name(workload: Mapping[str, Any]) -> str:
    meta = workload.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def not_waiting(workload: Mapping[str, Any]) -> str:
    """Why ``workload`` is no longer demand: admitted, finished, deactivated, or held by quota
    ("" while it still waits on its admission checks)."""
    return _skip(workload) or _quota_wait(workload)


def pod_set_of(pod: str) -> str:
    """The pod set of one of ``PodSetDemand.pods``' names (``ns/workload[pod-set/i]``)."""
    return pod.rpartition("[")[2].rpartition("/")[0]


@dataclass(frozen=True, slots=True)
class Pins:
    """Kueue's ``podSetUpdates`` for a Ready workload, and the pod sets not pinned (-> why)."""

    updates: tuple[Mapping[str, Any], ...] = ()
    not_pinned: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """The pins for the check's message ("" for none)."""
        parts = [
            f"pod set {u['name']} pinned to {u['nodeSelector'][HOSTNAME]}"
            for u in self.updates
            if "nodeSelector" in u
        ]
        parts += [f"pod set {ps} not pinned: {why}" for ps, why in self.not_pinned.items()]
        return "; ".join(parts)


def pod_set_updates(
    workload: Mapping[str, Any], placed: Mapping[str, str], hostnames: Mapping[str, str]
) -> Pins:
    """The pins of a Ready workload (see the module): ``placed`` pod -> node, as the check
    placed its pods; ``hostnames`` node -> its ``kubernetes.io/hostname`` label."""
    by_set: dict[str, set[str]] = {}
    for pod, node in placed.items():
        by_set.setdefault(pod_set_of(pod), set()).add(node)
    templates = {
        str(ps.get("name", "")): ps.get("template") or {}
        for ps in (workload.get("spec") or {}).get("podSets") or ()
    }
    uid = str((workload.get("metadata") or {}).get("uid", ""))
    labels = {WORKLOAD_LABEL: uid} if uid else {}
    updates: list[Mapping[str, Any]] = []
    odd: dict[str, str] = {}
    for name, nodes in sorted(by_set.items()):
        selector = ((templates.get(name) or {}).get("spec") or {}).get("nodeSelector") or {}
        host = hostnames.get(next(iter(nodes)), "")
        if len(nodes) > 1:
            odd[name] = f"its pods go to {len(nodes)} nodes ({', '.join(sorted(nodes))})"
        elif HOSTNAME in selector:
            odd[name] = f"its template selects {HOSTNAME}={selector[HOSTNAME]} itself"
        elif not host:
            odd[name] = f"{next(iter(nodes))} has no {HOSTNAME} label"
        update: dict[str, Any] = {"name": name}
        if labels:
            update["labels"] = {**labels, POD_SET_LABEL: name}
        if name not in odd:
            update["nodeSelector"] = {HOSTNAME: host}
        if len(update) > 1:
            updates.append(update)
    return Pins(tuple(updates), odd)


def pods_selector(entry: Mapping[str, Any]) -> str:
    """The label selector of the pods of a workload the check marked Ready (the label its
    ``podSetUpdates`` put on them), or "" where they carry none (marked Ready before)."""
    for update in entry.get("podSetUpdates") or ():
        uid = (update.get("labels") or {}).get(WORKLOAD_LABEL)
        if uid:
            return f"{WORKLOAD_LABEL}={uid}"
    return ""
