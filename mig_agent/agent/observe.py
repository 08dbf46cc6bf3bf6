"""Observe mode (``mig-agent run --observe``): the agent plans as a pass would and says what it
would do, an Event and its annotation (mig_agent.core.observe_report), and nothing else.

Beside NVIDIA's MIG Manager, which owns the state label and the changes, so the cluster the
agent is given is wrapped in ObserveOnlyCluster: every write but an Event and the observe
annotation is refused there (ObserveOnlyRefused), as the NVML adapter opened read-only refuses
every change of a GPU, whatever code asks."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import structlog

from mig_agent.agent import reporting
from mig_agent.config.settings import Settings
from mig_agent.core import observe_report
from mig_agent.core.errors import MigAgentError, ObserveOnlyRefused
from mig_agent.core.observe_report import ObserveReport
from mig_agent.kube.cluster import (
    Cluster,
    NodeCondition,
    NodeView,
    PdbView,
    PodRef,
    PodsSeen,
    PodView,
)

log = structlog.get_logger(__name__)


class ObserveOnlyCluster(Cluster):
    """``inner`` for reading; of its writes only Events and the node patch of nothing but the
    observe annotation pass, the rest is refused before any request."""

    def __init__(self, inner: Cluster, settings: Settings) -> None:
        self._inner, self._settings = inner, settings

    def _refuse(self, what: str) -> ObserveOnlyRefused:
        return ObserveOnlyRefused(f"{what}: refused, the agent only observes (observe mode)")

    def get_node(self, name: str) -> NodeView:
        return self._inner.get_node(name)

    def list_nodes(self, label_selector: str = "") -> list[NodeView]:
        return self._inner.list_nodes(label_selector)

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
        s = self._settings
        other = set(annotations or {}) - {s.observe_annotation}
        if labels or other or unschedulable is not None or name != s.node_name:
            what = ", ".join([*(labels or {}), *sorted(other)]) or "spec.unschedulable"
            raise self._refuse(f"patch node {name} ({what})")
        return self._inner.patch_node(
            name, annotations=annotations, expect_labels=expect_labels, known=known
        )

    def set_node_condition(self, name: str, condition: NodeCondition) -> None:
        raise self._refuse(f"set node condition {condition.type} on {name}")

    def patch_node_resources(self, name: str, resources: Mapping[str, int]) -> None:
        raise self._refuse(f"patch the resources of node {name}")

    def watch_node(self, name: str, *, timeout_s: int) -> Iterator[NodeView]:
        return self._inner.watch_node(name, timeout_s=timeout_s)

    def list_pods(
        self, *, node: str | None = None, namespace: str | None = None, label_selector: str = ""
    ) -> list[PodView]:
        return self._inner.list_pods(node=node, namespace=namespace, label_selector=label_selector)

    def watch_pods(
        self, node: str, *, timeout_s: float, seen: PodsSeen | None = None
    ) -> Iterator[list[PodView]]:
        return self._inner.watch_pods(node, timeout_s=timeout_s, seen=seen)

    def get_pod(self, ref: PodRef) -> PodView | None:
        return self._inner.get_pod(ref)

    def evict(self, ref: PodRef) -> None:
        raise self._refuse(f"evict pod {ref}")

    def delete_pod(self, ref: PodRef) -> None:
        raise self._refuse(f"delete pod {ref}")

    def emit_event(
        self, node: NodeView, *, reason: str, message: str, warning: bool = False
    ) -> None:
        self._inner.emit_event(node, reason=reason, message=message, warning=warning)

    def list_resource_slices(self, node: str = "") -> list[dict[str, Any]]:
        return self._inner.list_resource_slices(node)

    def list_resource_claims(self, namespace: str = "") -> list[dict[str, Any]]:
        return self._inner.list_resource_claims(namespace)

    def list_resource_claim_templates(self, namespace: str = "") -> list[dict[str, Any]]:
        return self._inner.list_resource_claim_templates(namespace)

    def list_device_classes(self) -> list[dict[str, Any]]:
        return self._inner.list_device_classes()

    def list_kueue(self, plural: str) -> list[dict[str, Any]]:
        return self._inner.list_kueue(plural)

    def watch_resource_slices(
        self, node: str, *, timeout_s: float
    ) -> Iterator[list[dict[str, Any]]]:
        return self._inner.watch_resource_slices(node, timeout_s=timeout_s)

    def list_pod_disruption_budgets(self) -> list[PdbView]:
        return self._inner.list_pod_disruption_budgets()

    def device_taints_served(self) -> bool:
        return self._inner.device_taints_served()

    def list_device_taints(self) -> list[dict[str, Any]]:
        return self._inner.list_device_taints()

    def create_device_taint(self, rule: Mapping[str, Any]) -> None:
        name = (rule.get("metadata") or {}).get("name", "")
        raise self._refuse(f"create devicetaintrule {name}")

    def delete_device_taint(self, name: str) -> None:
        raise self._refuse(f"delete devicetaintrule {name}")


def publish(cluster: Cluster, s: Settings, node: NodeView, report: ObserveReport) -> bool:
    """Say ``report`` on the node: its annotation, and an Event when it differs from what the
    annotation said (a resync that finds the same says nothing again). False when the
    annotation could not be written (the API away): the pass is retried."""
    text = observe_report.annotation(report)
    log.info(
        "observe.planned",
        changes=report.changes,
        changed_gpus=list(report.plan.changed_gpus) if report.plan else [],
        evict=len(report.evict),
        error=report.error or None,
    )
    if node.annotations.get(s.observe_annotation) == text:
        return True
    try:
        node = cluster.patch_node(
            s.node_name,
            annotations={s.observe_annotation: text},
            expect_labels={s.config_label: report.layout},
        )
    except MigAgentError as exc:  # LabelsChanged: the watch wakes a pass for the new label
        log.warning("observe.not_reported", error=str(exc))
        return False
    reporting.event(
        cluster,
        node,
        "MIGObserved",
        observe_report.message(report),
        warning=bool(report.error or report.refused),
    )
    return True


def clear(cluster: Cluster, s: Settings, node: NodeView) -> None:
    """No layout asked for: nothing to say; an earlier report goes."""
    if s.observe_annotation in node.annotations:
        with reporting.best_effort("observe annotation"):
            cluster.patch_node(s.node_name, annotations={s.observe_annotation: None})
