"""The admission policies of daemonset.yaml, rendered from deploy/policies.yaml and the agent's
own settings, so that a changed label key, annotation prefix or condition type changes the policy
with it (scripts/sync-daemonset calls this; tests/unit/test_deployment_manifest.py checks it).

Development tooling: the agent never imports this module.

What the policies allow is exactly what the agent writes:

* labels: the state label with the values of mig_agent.core.labels.State, the operand labels of the
  settings between ``true`` and mig_agent.core.labels.PAUSED;
* annotations: the eight keys the settings derive from ``annotation_prefix``, size-capped (the
  agent cuts its reason at REASON_CAP characters; the GPU state of 16 GPUs of 7 instances each
  is about 17,000);
* the node condition ``condition_type`` with the reasons of CONDITION_REASONS plus the name of
  every mig_agent.core.errors.MigAgentError class (the reason of a failed pass is the error's
  class);
* Events about its own Node with the reasons of EVENT_REASONS;
* pod deletion: the device plugin's pod (namespace and selector of the settings) on its node,
  and with ``restart_validators`` the GPU Operator's validator pods there (their ``app`` label
  one of mig_agent.agent.phases.validators.APPS).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from string import Template

from mig_agent.agent.phases.validators import APPS as VALIDATOR_APPS
from mig_agent.config.settings import Settings
from mig_agent.core import device_taints
from mig_agent.core.errors import MigAgentError
from mig_agent.core.labels import PAUSED, State

TEMPLATE = Path(__file__).resolve().parent / "policies.yaml"
AGENT_USER = "system:serviceaccount:mig-agent:mig-agent"
COMPONENT = "mig-agent"
"""The Event source component of the agent (mig_agent.kube.client.KubernetesCluster)."""

CONDITION_REASONS = ("Applied", "Reconfiguring", "GpuUnavailable", "DrainBlocked", "DrainWaiting")
"""Reasons of the node condition the agent sets by name (mig_agent/agent/), besides
the error class names of failed passes (GpuUnavailable is both: no NVML on start)."""
EVENT_REASONS = (
    "MIGReconfiguring",
    "MIGDraining",
    "MIGApplying",
    "MIGVerifying",
    "MIGDevicePluginRestart",
    "MIGDraPluginRestart",
    "MIGConfigApplied",
    "MIGConfigFailed",
    "MIGRebooting",
    "MIGPostApply",
    "MIGHostClientsStopped",
    "MIGHostClientsStarted",
    "MIGConfigInvalid",
    "MIGDrainBlocked",
    "MIGDrainWaiting",
    "MIGUnhealthyDevices",
    "MIGDevicesHealthy",
    "MIGDeviceOwnershipUnknown",
    "MIGObserved",
)
"""Reasons of the agent's Events (mig_agent/agent/ and its phases; MIGObserved: observe mode,
mig_agent/agent/observe.py)."""
MESSAGE_CAP = 1024
"""Event and condition messages: the client cuts them at this length."""
REASON_CAP = 4096
"""Annotations (the failure reason the agent writes is cut at this length)."""
GPU_STATE_CAP = 32768
"""The GPU state annotation: JSON of the node's GPUs, instances and placements."""

# label keys, label values, Event reasons and the like: nothing a CEL string needs to escape
_SAFE = re.compile(r"^[A-Za-z0-9._/:-]+$")
_REQUIREMENT = re.compile(r"^\s*(!?)\s*([A-Za-z0-9._/-]+)\s*(?:(==|=|!=)\s*([A-Za-z0-9._-]*))?\s*$")


class PolicyError(ValueError):
    """A setting the policies cannot express."""


def cel(value: str) -> str:
    """A CEL string literal; only characters that need no escaping are accepted."""
    if not _SAFE.match(value):
        raise PolicyError(f"cannot put {value!r} into an admission policy")
    return f"'{value}'"


def cel_list(values: Iterable[str]) -> str:
    return "[" + ", ".join(cel(v) for v in values) + "]"


def error_names() -> list[str]:
    """Every MigAgentError class, by name (the agent's condition reason for a failed pass)."""
    found: list[str] = []
    todo: list[type[MigAgentError]] = [MigAgentError]
    while todo:
        cls = todo.pop()
        if cls.__module__ == MigAgentError.__module__:  # not what other imports happen to add
            found.append(cls.__name__)
        todo.extend(cls.__subclasses__())
    return sorted(set(found))


def condition_reasons() -> list[str]:
    return [*CONDITION_REASONS, *(n for n in error_names() if n not in CONDITION_REASONS)]


def our_annotations(s: Settings) -> list[str]:
    return [
        s.cordon_annotation,
        s.paused_annotation,
        s.reason_annotation,
        s.gpu_state_annotation,
        s.reboot_annotation,
        s.post_apply_annotation,
        s.host_services_annotation,
        s.observe_annotation,
        s.guard_annotation,
    ]


def selector_match(selector: str, labels: str) -> str:
    """A CEL expression true when the map `labels` matches an equality-based label selector."""
    terms = []
    for part in selector.split(","):
        m = _REQUIREMENT.match(part)
        if not m or (m.group(1) and m.group(3)):
            raise PolicyError(
                f"device plugin selector {selector!r}: only key, !key, key=value "
                "and key!=value are supported in the policy"
            )
        negate, key, op, value = m.group(1), m.group(2), m.group(3), m.group(4) or ""
        if op is None:
            terms.append(f"{'!' if negate else ''}({cel(key)} in {labels})")
        elif op == "!=":
            terms.append(f"(!({cel(key)} in {labels}) || {labels}[{cel(key)}] != '{value}')")
        else:
            terms.append(f"({cel(key)} in {labels} && {labels}[{cel(key)}] == '{value}')")
    if not terms:
        raise PolicyError("the device plugin selector is empty")
    return " && ".join(terms)


def validator_match(s: Settings) -> str:
    """CEL true when the map `variables.labels` is a GPU Operator validator pod's that the agent
    deletes (restart_validators), else false."""
    if not s.restart_validators:
        return "false"
    return f"variables.labels.?app.orValue('') in {cel_list(VALIDATOR_APPS)}"


def dra_match(s: Settings) -> str:
    """CEL true when the pod deleted is NVIDIA's DRA kubelet plugin's (restarted after a change
    on a DRA node: request.namespace and the map `variables.labels`), false with dra off."""
    if not s.dra:
        return "false"
    ns = cel(s.dra_plugin_namespace)
    labels = selector_match(s.dra_plugin_selector, "variables.labels")
    return f"(request.namespace == {ns} && {labels})"


def _let(name: str, value: str) -> str:
    """CEL that binds `name` to `value` in what follows, to be closed with ")": CEL of
    Kubernetes 1.34 has no cel.bind, but a one-element list's all() binds its element."""
    return f"[{value}].all({name}, "


def _ours_beyond(x: str, y: str, allowed: str) -> str:
    """CEL: what the map `x` holds beyond the map `y` is among the keys `allowed` (or ".")."""
    return (
        f"{_let('x', x)}{_let('y', y)}"
        f"x.all(k, (k in y && y[k] == x[k]) || k == '.' || k in {allowed})))"
    )


def _covered(f: str, g: str) -> str:
    """CEL: what the fieldsV1 set `f` holds beyond the set `g` are fields the agent may write
    (its labels and annotations, spec.unschedulable, its node condition)."""
    return " ".join(
        [
            _let("f", f) + _let("g", g),
            "f.all(a, (a in g && g[a] == f[a])",
            "|| " + _let("fa", "f[a]") + _let("ga", "g[?a].orValue({})"),
            "(a == 'f:metadata' && fa.all(m, (m in ga && ga[m] == fa[m])",
            "|| (m == 'f:labels' && "
            + _ours_beyond("fa[m]", "ga[?m].orValue({})", "variables.labelFields")
            + ")",
            "|| (m == 'f:annotations' && "
            + _ours_beyond("fa[m]", "ga[?m].orValue({})", "variables.annotationFields")
            + ")))",
            "|| (a == 'f:spec' && " + _ours_beyond("fa", "ga", "['f:unschedulable']") + ")",
            "|| (a == 'f:status' && fa.all(m, (m in ga && ga[m] == fa[m])",
            "|| (m == 'f:conditions' && "
            + _ours_beyond("fa[m]", "ga[?m].orValue({})", "[variables.conditionField]")
            + "))))))))",
        ]
    )


_SAME_ENTRY = (
    "o.?manager.orValue('') == n.?manager.orValue('') "
    "&& o.?operation.orValue('') == n.?operation.orValue('') "
    "&& o.?subresource.orValue('') == n.?subresource.orValue('') "
    "&& o.?apiVersion.orValue('') == n.?apiVersion.orValue('')"
)
_FIELDS = "dyn({}).?fieldsV1.orValue({{}})"


def managed_fields_variables() -> dict[str, str]:
    """CEL of two variables, lists of managedFields entries: `unexplained`, the new entries that
    differ from the old entry of their manager (same manager, operation, subresource and
    apiVersion) in more than the agent's fields, or that are new and hold more than those;
    `lost`, the old entries gone that held more than the agent's fields."""
    o, n = _FIELDS.format("o"), _FIELDS.format("n")
    return {
        "unexplained": (
            f"variables.newManaged.filter(n, variables.oldManaged.exists(o, {_SAME_ENTRY})"
            f" ? !variables.oldManaged.exists(o, {_SAME_ENTRY} && {_covered(o, n)}"
            f" && {_covered(n, o)}) : !{_covered(n, '{}')})"
        ),
        "lost": (
            "variables.oldManaged.filter(o, !(variables.newManaged.exists(n, "
            f"{_SAME_ENTRY}) || {_covered(o, '{}')}))"
        ),
    }


CHART_VALUES = (
    "agent_user",
    "state_label",
    "operand_labels",
    "annotations",
    "gpu_state_annotation",
    "condition_type",
    "plugin_namespace",
    "plugin_selector",
    "taint_key",
    "label_fields",
    "annotation_fields",
    "condition_field",
    "plugin_match",
    "validator_match",
    "dra_match",
    "dra_selector",
)
"""What the chart's values decide (charts/mig-agent/templates/_helpers.tpl, mig-agent.policyValues
renders each from the values as `values` below does from the settings)."""


def render_chart() -> str:
    """The chart's template of the policies (charts/mig-agent/templates/admission-policies.yaml):
    the parts of CHART_VALUES left to Helm, the rest (the agent's reasons, states, caps, the
    managedFields CEL) filled here; names follow the release's."""
    values = {**_values(Settings()), **{k: "{{ $p." + k + " }}" for k in CHART_VALUES}}
    text = Template(TEMPLATE.read_text()).substitute(values)
    name = '{{ include "mig-agent.name" . }}'
    text = re.sub(
        r"^(\s*(?:policyName|name): )mig-agent-own-", rf"\g<1>{name}-own-", text, flags=re.M
    )
    text = re.sub(r"^(\s*app\.kubernetes\.io/name: )mig-agent$", rf"\g<1>{name}", text, flags=re.M)
    head = (
        "{{- /* Generated by scripts/sync-daemonset from deploy/policies.yaml and "
        "deploy/policies.py; edit those. */ -}}\n"
        '{{- $p := include "mig-agent.policyValues" . | fromJson }}\n'
    )
    return head + text


def render(s: Settings | None = None) -> str:
    """The policies and their bindings as YAML documents, for the settings `s` (default: the
    defaults the DaemonSet runs with)."""
    return Template(TEMPLATE.read_text()).substitute(_values(s or Settings()))


def _values(s: Settings) -> dict[str, str]:
    reasons = condition_reasons()
    values = {
        "agent_user": AGENT_USER,
        "component": cel(COMPONENT)[1:-1],
        "state_label": cel(s.state_label),
        "states": cel_list(str(v) for v in State),
        "operand_labels": cel_list(s.operand_labels),
        "paused": cel(PAUSED)[1:-1],
        "annotations": cel_list(our_annotations(s)),
        "gpu_state_annotation": cel(s.gpu_state_annotation)[1:-1],
        "gpu_state_cap": str(GPU_STATE_CAP),
        "annotation_cap": str(REASON_CAP),
        "message_cap": str(MESSAGE_CAP),
        "condition_type": cel(s.condition_type)[1:-1],
        "condition_reasons": cel_list(reasons),
        "condition_reason_text": ", ".join(reasons),
        "event_reasons": cel_list(EVENT_REASONS),
        "event_reason_text": ", ".join(EVENT_REASONS),
        "plugin_namespace": cel(s.device_plugin_namespace)[1:-1],
        "plugin_selector": s.device_plugin_selector,
        "taint_driver": device_taints.DRIVER,
        "taint_label": device_taints.MANAGED_BY,
        # a key with / and . is reached by CEL's optional index
        "taint_label_cel": f"[?'{device_taints.MANAGED_BY}']",
        "taint_manager": device_taints.MANAGER,
        "taint_key": cel(s.taint_key)[1:-1],
        "taint_effect": device_taints.EFFECT,
        "label_fields": cel_list("f:" + k for k in (s.state_label, *s.operand_labels)),
        "annotation_fields": cel_list("f:" + k for k in our_annotations(s)),
        "condition_field": '\'k:{"type":"' + cel(s.condition_type)[1:-1] + "\"}'",
        **managed_fields_variables(),
        "plugin_match": selector_match(s.device_plugin_selector, "variables.labels"),
        "validator_match": validator_match(s),
        "dra_match": dra_match(s),
        "dra_selector": (
            f"{s.dra_plugin_namespace}, {s.dra_plugin_selector}" if s.dra else "none: dra is off"
        ),
    }
    return values
