"""FakeCluster: an in-memory Cluster for unit tests of the reconcile logic.

Nodes, pods, evictions blocked per pod (a stand-in for a PodDisruptionBudget), events, and a hook
that runs on every patch so tests can play the device plugin or inject failures. The real
behaviour is tested against a real API server (tests/cluster, tests/e2e).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from mig_agent.core.errors import (
    EvictionBlocked,
    KubeError,
    KubeUnavailable,
    LabelsChanged,
    PodReplaced,
)
from mig_agent.core.scheduling import parse_selector
from mig_agent.kube.cluster import (
    AGENT_MANAGER,
    Cluster,
    NodeCondition,
    NodeView,
    PdbView,
    PodRef,
    PodsSeen,
    PodView,
)

_uids = itertools.count(1)


@dataclass
class FakeCluster(Cluster):
    nodes: dict[str, NodeView] = field(default_factory=dict)
    pods: dict[PodRef, PodView] = field(default_factory=dict)
    blocked: dict[PodRef, str] = field(default_factory=dict)  # pod -> PDB name
    events: list[tuple[str, str, str, bool]] = field(default_factory=list)
    evicted: list[PodRef] = field(default_factory=list)
    on_change: Callable[[FakeCluster], None] | None = None
    down: bool = False  # every call raises KubeUnavailable
    fail_patch_after: int | None = None  # raise on the n-th patch from now
    # pods that, once evicted, only start terminating (a grace period, a checkpoint): the
    # test takes them away when it likes
    linger: set[PodRef] = field(default_factory=set)
    # DRA: the ResourceSlices, ResourceClaims and ResourceClaimTemplates as the API returns them
    slices: list[dict[str, Any]] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)
    claim_templates: list[dict[str, Any]] = field(default_factory=list)
    pdbs: list[PdbView] = field(default_factory=list)
    # Kueue's objects by plural (workloads, resourceflavors), as the API returns them
    kueue: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # DeviceTaintRules by name (served where taints_served, as on Kubernetes 1.37)
    taint_rules: dict[str, dict[str, Any]] = field(default_factory=dict)
    taints_served: bool = False
    # the requests the agent would make of the API server, by method (a watch: one request)
    requests: Counter[str] = field(default_factory=Counter)
    # DeviceClasses by name, as the API returns them (resourceVersion and creationTimestamp
    # set by create and replace)
    device_classes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add_node(
        self,
        name: str,
        labels: Mapping[str, str] | None = None,
        allocatable: Mapping[str, str] | None = None,
    ) -> NodeView:
        node = NodeView(
            name,
            f"uid-{name}",
            "1",
            dict(labels or {}),
            {},
            False,
            dict(allocatable or {}),
            capacity=dict(allocatable or {}),
        )
        self.nodes[name] = node
        return node

    def add_pod(
        self,
        namespace: str,
        name: str,
        node: str,
        *,
        gpu: Mapping[str, int] | None = None,
        labels: Mapping[str, str] | None = None,
        owner: str = "ReplicaSet",
        node_selector: Mapping[str, str] | None = None,
        ready: bool = True,
        grace_period_s: float = 30.0,
        claims: tuple[str, ...] = (),
        started: str = "",
    ) -> PodRef:
        """A running pod; ``owner`` is its controller's kind ("" for a bare pod; the default
        stands for a Deployment's pods); ``claims``, the names of its ResourceClaims;
        ``started``, its status.startTime."""
        ref = PodRef(namespace, name, f"pod-{next(_uids)}")
        self.pods[ref] = PodView(
            ref,
            node,
            "Running",
            ready,
            False,
            dict(labels or {}),
            {},
            (owner,) if owner else (),
            dict(node_selector or {}),
            dict(gpu or {}),
            controller=f"{owner}/{name}-owner" if owner else "",
            grace_period_s=grace_period_s,
            claims=claims,
            started=started,
        )
        return ref

    def _check(self, call: str) -> None:
        self.requests[call] += 1
        if self.down:
            raise KubeUnavailable("API server unreachable (fake)")

    def _changed(self) -> None:
        if self.on_change is not None:
            counted = Counter(self.requests)
            self.on_change(self)
            self.requests = counted  # what the test's hook asks is no request of the agent

    # Cluster
    def get_node(self, name: str) -> NodeView:
        self._check("get_node")
        return self.nodes[name]

    def list_nodes(self, label_selector: str = "") -> list[NodeView]:
        self._check("list_nodes")
        want = dict(kv.split("=", 1) for kv in label_selector.split(",") if "=" in kv)
        return [
            n for n in self.nodes.values() if all(n.labels.get(k) == v for k, v in want.items())
        ]

    def patch_node(
        self,
        name: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
        unschedulable: bool | None = None,
        expect_labels: Mapping[str, str | None] | None = None,
        known: NodeView | None = None,
    ) -> NodeView:
        self._check("patch_node")
        differ = {
            k: self.nodes[name].labels.get(k)
            for k, v in (expect_labels or {}).items()
            if self.nodes[name].labels.get(k) != v
        }
        if differ:
            raise LabelsChanged(f"node {name}: labels changed {differ}", labels=differ)
        if self.fail_patch_after is not None:
            self.fail_patch_after -= 1
            if self.fail_patch_after < 0:
                self.fail_patch_after = None
                raise KubeUnavailable("injected patch failure")
        node = self.nodes[name]
        new_labels = _merge(node.labels, labels or {})
        new_ann = _merge(node.annotations, annotations or {})
        node = dataclasses.replace(
            node,
            labels=new_labels,
            annotations=new_ann,
            unschedulable=node.unschedulable if unschedulable is None else unschedulable,
            unschedulable_by=node.unschedulable_by
            if unschedulable is None
            else (AGENT_MANAGER,)
            if unschedulable
            else (),
            resource_version=str(int(node.resource_version) + 1),
        )
        self.nodes[name] = node
        self._changed()
        return self.nodes[name]

    def set_node_condition(self, name: str, condition: NodeCondition) -> None:
        self._check("set_node_condition")
        node = self.nodes[name]
        conds = tuple(c for c in node.conditions if c.type != condition.type) + (condition,)
        self.nodes[name] = dataclasses.replace(node, conditions=conds)

    def patch_node_resources(self, name: str, resources: Mapping[str, int]) -> None:
        self._check("patch_node_resources")
        node = self.nodes[name]
        alloc = dict(node.allocatable)
        alloc.update({k: str(v) for k, v in resources.items()})
        self.nodes[name] = dataclasses.replace(node, allocatable=alloc, capacity=dict(alloc))

    def watch_node(self, name: str, *, timeout_s: int) -> Iterator[NodeView]:
        self._check("watch_node")
        yield self.nodes[name]

    def list_pods(
        self, *, node: str | None = None, namespace: str | None = None, label_selector: str = ""
    ) -> list[PodView]:
        self._check("list_pods")
        want = parse_selector(label_selector)
        return [
            p
            for p in self._pods_of(node)
            if (namespace is None or p.ref.namespace == namespace) and want.matches(p.labels)
        ]

    def _pods_of(self, node: str | None) -> list[PodView]:
        return [p for p in self.pods.values() if node is None or p.node == node]

    def watch_pods(
        self, node: str, *, timeout_s: float, seen: PodsSeen | None = None
    ) -> Iterator[list[PodView]]:
        # no watch: one look (a list), then the caller looks again after a poll delay
        yield self.list_pods(node=node)

    def get_pod(self, ref: PodRef) -> PodView | None:
        self._check("get_pod")
        for p in self.pods.values():
            if (
                p.ref.namespace == ref.namespace
                and p.ref.name == ref.name
                and (not ref.uid or p.ref.uid == ref.uid)
            ):
                return p
        return None

    def evict(self, ref: PodRef) -> None:
        self._check("evict")
        if ref.uid and ref not in self.pods and self.get_pod(PodRef(ref.namespace, ref.name)):
            # the API server's 409: the eviction's UID precondition names a pod gone since
            raise PodReplaced(f"pod {ref} was replaced (fake)", pod=str(ref))
        if ref in self.blocked:
            raise EvictionBlocked(
                f"eviction of pod {ref} refused: PodDisruptionBudget "
                f"{ref.namespace}/{self.blocked[ref]} does not allow it",
                pod=str(ref),
                pdb=self.blocked[ref],
            )
        if ref in self.linger and ref in self.pods:
            self.pods[ref] = dataclasses.replace(self.pods[ref], terminating=True)
        else:
            self.pods.pop(ref, None)
        self.evicted.append(ref)
        self._changed()

    def delete_pod(self, ref: PodRef) -> None:
        self._check("delete_pod")
        self.pods.pop(ref, None)
        self._changed()

    def emit_event(
        self, node: NodeView, *, reason: str, message: str, warning: bool = False
    ) -> None:
        self._check("emit_event")
        self.events.append((node.name, reason, message, warning))

    def list_resource_slices(self, node: str = "") -> list[dict[str, Any]]:
        self._check("list_resource_slices")
        return [s for s in self.slices if node in ("", s.get("spec", {}).get("nodeName"))]

    def watch_resource_slices(
        self, node: str, *, timeout_s: float
    ) -> Iterator[list[dict[str, Any]]]:
        # no watch: one look (a list), then the caller looks again after a poll delay
        yield self.list_resource_slices(node)

    def list_resource_claims(self, namespace: str = "") -> list[dict[str, Any]]:
        self._check("list_resource_claims")
        return [
            c
            for c in self.claims
            if namespace in ("", (c.get("metadata") or {}).get("namespace", ""))
        ]

    def list_resource_claim_templates(self, namespace: str = "") -> list[dict[str, Any]]:
        self._check("list_resource_claim_templates")
        return [
            t
            for t in self.claim_templates
            if namespace in ("", (t.get("metadata") or {}).get("namespace", ""))
        ]

    def list_pod_disruption_budgets(self) -> list[PdbView]:
        self._check("list_pod_disruption_budgets")
        return list(self.pdbs)

    def list_kueue(self, plural: str) -> list[dict[str, Any]]:
        self._check("list_kueue")
        return list(self.kueue.get(plural, []))

    def device_taints_served(self) -> bool:
        self._check("device_taints_served")
        return self.taints_served

    def list_device_taints(self) -> list[dict[str, Any]]:
        self._check("list_device_taints")
        return [dict(r) for r in self.taint_rules.values()]

    def create_device_taint(self, rule: Mapping[str, Any]) -> None:
        self._check("create_device_taint")
        self.taint_rules[rule["metadata"]["name"]] = dict(rule)
        self._changed()

    def delete_device_taint(self, name: str) -> None:
        self._check("delete_device_taint")
        self.taint_rules.pop(name, None)
        self._changed()

    def list_device_classes(self) -> list[dict[str, Any]]:
        self._check("list_device_classes")
        return [copy.deepcopy(c) for _, c in sorted(self.device_classes.items())]

    def create_device_class(self, manifest: Mapping[str, Any]) -> None:
        self._check("create_device_class")
        name = manifest["metadata"]["name"]
        if name in self.device_classes:
            raise KubeError(f"create deviceclass: 409 {name} already exists", status=409)
        made = copy.deepcopy(dict(manifest))
        made["metadata"]["resourceVersion"] = str(next(_uids))
        made["metadata"]["creationTimestamp"] = f"2026-12-04T10:00:{len(self.device_classes):02}Z"
        self.device_classes[name] = made

    def replace_device_class(self, manifest: Mapping[str, Any]) -> None:
        self._check("replace_device_class")
        meta = manifest["metadata"]
        have = self.device_classes.get(meta["name"])
        if have is None or have["metadata"]["resourceVersion"] != meta.get("resourceVersion"):
            raise KubeError(f"replace deviceclass: 409 {meta['name']} changed", status=409)
        made = copy.deepcopy(dict(manifest))
        made["metadata"]["resourceVersion"] = str(next(_uids))
        made["metadata"]["creationTimestamp"] = have["metadata"].get("creationTimestamp")
        self.device_classes[meta["name"]] = made

    def delete_device_class(self, name: str) -> None:
        self._check("delete_device_class")
        self.device_classes.pop(name, None)


def _merge(old: Mapping[str, str], patch: Mapping[str, str | None]) -> dict[str, str]:
    out = dict(old)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out
