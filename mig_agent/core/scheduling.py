"""Which nodes the scheduler could put a pod on, as far as its ``nodeSelector``, its required
node affinity and its tolerations against the nodes' taints say (resources aside), and label
selectors (a PodDisruptionBudget's). Read from the objects as the API returns them.

Pure module: no I/O. Facts from the Kubernetes API (core/v1 NodeSelectorTerm,
NodeSelectorRequirement, Toleration, Taint; meta/v1 LabelSelector): terms are ORed and the
requirements of a term ANDed; an empty term list or a term without requirements matches no node;
``Gt``/``Lt`` compare integers; only ``NoSchedule`` and ``NoExecute`` taints keep pods off.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

KEEPS_PODS_OFF: Final = ("NoSchedule", "NoExecute")


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: str  # In, NotIn, Exists, DoesNotExist, Gt, Lt
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        op = self.operator
        if op == "In":
            return value in self.values
        if op == "NotIn":
            return value not in self.values
        if op == "Exists":
            return value is not None
        if op == "DoesNotExist":
            return value is None
        if op in ("Gt", "Lt") and value is not None and self.values:
            try:
                have, bound = int(value), int(self.values[0])
            except ValueError:
                return False
            return have > bound if op == "Gt" else have < bound
        return False

    def __str__(self) -> str:
        if self.operator in ("Exists", "DoesNotExist"):
            return f"{self.key} {self.operator}"
        return f"{self.key} {self.operator} ({','.join(self.values)})"


@dataclass(frozen=True, slots=True)
class Term:
    """One node selector term: label requirements and ``metadata.name`` field requirements."""

    expressions: tuple[Requirement, ...] = ()
    fields: tuple[Requirement, ...] = ()

    def matches(self, node: str, labels: Mapping[str, str]) -> bool:
        if not self.expressions and not self.fields:
            return False
        return all(r.matches(labels) for r in self.expressions) and all(
            r.matches({"metadata.name": node}) for r in self.fields
        )


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"

    def __str__(self) -> str:
        return f"{self.key}{'=' + self.value if self.value else ''}:{self.effect}"


@dataclass(frozen=True, slots=True)
class Toleration:
    key: str = ""  # "" with Exists: every taint
    operator: str = "Equal"
    value: str = ""
    effect: str = ""  # "": every effect

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.operator == "Exists":
            return not self.key or self.key == taint.key
        return self.key == taint.key and self.value == taint.value


@dataclass(frozen=True, slots=True)
class PodConstraints:
    node_selector: Mapping[str, str] = field(default_factory=dict)
    affinity: tuple[Term, ...] | None = None  # required node affinity; None: none given
    tolerations: tuple[Toleration, ...] = ()

    def refusal(self, node: str, labels: Mapping[str, str], taints: Sequence[Taint]) -> str:
        """Why the pod may not go on ``node`` ("" when it may): the constraint that says no."""
        if any(labels.get(k) != v for k, v in self.node_selector.items()):
            return f"nodeSelector {_pairs(self.node_selector)}"
        if self.affinity is not None and not any(t.matches(node, labels) for t in self.affinity):
            return "required node affinity"
        for taint in taints:
            if taint.effect in KEEPS_PODS_OFF and not any(
                t.tolerates(taint) for t in self.tolerations
            ):
                return f"taint {taint} (not tolerated)"
        return ""

    def describe(self) -> str:
        """The pod's own narrowing constraints, for messages ("" when it has none)."""
        parts = []
        if self.node_selector:
            parts.append(f"nodeSelector {_pairs(self.node_selector)}")
        if self.affinity is not None:
            parts.append("required node affinity")
        return " and ".join(parts)


NO_CONSTRAINTS: Final = PodConstraints()


def _pairs(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _requirements(raw: Any) -> tuple[Requirement, ...]:
    return tuple(
        Requirement(
            str(r.get("key", "")),
            str(r.get("operator", "")),
            tuple(str(v) for v in r.get("values") or ()),
        )
        for r in raw or ()
    )


def constraints_of(spec: Mapping[str, Any]) -> PodConstraints:
    """A pod's constraints from its ``spec``."""
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or None
    affinity = None
    if required is not None:
        affinity = tuple(
            Term(_requirements(t.get("matchExpressions")), _requirements(t.get("matchFields")))
            for t in required.get("nodeSelectorTerms") or ()
        )
    return PodConstraints(
        dict(spec.get("nodeSelector") or {}),
        affinity,
        tuple(
            Toleration(
                str(t.get("key") or ""),
                str(t.get("operator") or "Equal"),
                str(t.get("value") or ""),
                str(t.get("effect") or ""),
            )
            for t in spec.get("tolerations") or ()
        ),
    )


def taints_of(spec: Mapping[str, Any]) -> tuple[Taint, ...]:
    """A node's taints from its ``spec``."""
    return tuple(
        Taint(str(t.get("key", "")), str(t.get("value") or ""), str(t.get("effect", "")))
        for t in spec.get("taints") or ()
    )


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """meta/v1 LabelSelector: ``match_labels`` and ``expressions`` ANDed; empty: everything."""

    match_labels: Mapping[str, str] = field(default_factory=dict)
    expressions: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels.items()) and all(
            r.matches(labels) for r in self.expressions
        )


def label_selector_of(raw: Mapping[str, Any] | None) -> LabelSelector | None:
    """None for a missing selector (a PodDisruptionBudget without one selects no pod)."""
    if raw is None:
        return None
    return LabelSelector(
        dict(raw.get("matchLabels") or {}), _requirements(raw.get("matchExpressions"))
    )


_SET_OPS: Final = {"in": "In", "notin": "NotIn"}


def parse_selector(text: str) -> LabelSelector:
    """A label selector as a list request takes it (``a=b,c!=d,e in (f,g),h,!i``), to pick pods
    out of a list already read: one list of the node's pods serves every selector. ValueError
    for text the API server would refuse too."""
    out: list[Requirement] = []
    for part in _split_top(text):
        words = part.split(None, 1)
        if len(words) == 2 and words[1].split(None, 1)[0].lower() in _SET_OPS:
            op, _, values = words[1].partition(" ")
            values = values.strip()
            if not (values.startswith("(") and values.endswith(")")):
                raise ValueError(f"selector {text!r}: {part!r} needs (values)")
            vals = tuple(v.strip() for v in values[1:-1].split(",") if v.strip())
            out.append(Requirement(words[0], _SET_OPS[op.lower()], vals))
        elif "!=" in part:
            key, value = (s.strip() for s in part.split("!=", 1))
            out.append(Requirement(key, "NotIn", (value,)))
        elif "=" in part:
            key, value = (s.strip() for s in part.replace("==", "=", 1).split("=", 1))
            out.append(Requirement(key, "In", (value,)))
        elif part.startswith("!"):
            out.append(Requirement(part[1:].strip(), "DoesNotExist"))
        else:
            out.append(Requirement(part, "Exists"))
        if not out[-1].key or " " in out[-1].key:
            raise ValueError(f"selector {text!r}: no key in {part!r}")
    return LabelSelector(expressions=tuple(out))


def _split_top(text: str) -> list[str]:
    """``text``'s comma-separated parts, but commas inside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]
