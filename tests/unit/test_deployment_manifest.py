"""We test these aspects of the deployment manifest (daemonset.yaml), without a cluster:

* it is up to date: `scripts/sync-daemonset --check` passes, and the ConfigMap mig-agent-profiles
  holds exactly the files of profiles/, each of whose layouts loads with the catalog
  loader;
* the DaemonSet: one agent per GPU node at a time (maxSurge 0, maxUnavailable 1), GPU nodes only,
  tolerates the GPU taint, node name from the downward API, probes on /healthz and /readyz of the
  metrics port the agent listens on, requests and limits, system-node-critical, privileged (and
  says why), the profiles mounted where MIG_AGENT_CONFIG points;
* RBAC is least privilege: no wildcards, nothing on secrets, no node deletion or creation, no pod
  writes but eviction cluster-wide, pod deletion only in gpu-operator; every binding names the
  agent's ServiceAccount and a role of this manifest;
* the admission policies (own node, own device plugin pod, own Events) are bound, deny on failure
  and on violation, and match the agent only;
* they are rendered from the agent's settings (deploy/policies.py): the manifest names exactly the
  default label keys, annotations, condition type and device plugin namespace and selector; other
  settings render another policy; the condition and Event reasons the policy allows are exactly
  those the agent's code sets (read from its source), so a new reason fails here, not in a
  cluster.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import policies
from mig_agent.config.profiles import load_text
from mig_agent.config.settings import Settings
from mig_agent.core import errors
from mig_agent.core.labels import PAUSED, State

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "daemonset.yaml"
TAIL = REPO / "charts" / "mig-agent" / "templates" / "daemonset.yaml"  # the DaemonSet's source
PROFILES = REPO / "profiles"
SA = {"kind": "ServiceAccount", "name": "mig-agent", "namespace": "mig-agent"}

Doc = dict[str, Any]


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def one(docs: list[Doc], kind: str, name: str, namespace: str | None = None) -> Doc:
    found = [
        d
        for d in docs
        if d["kind"] == kind
        and d["metadata"]["name"] == name
        and d["metadata"].get("namespace") == namespace
    ]
    assert len(found) == 1, f"{kind} {namespace}/{name}: {len(found)} documents"
    return found[0]


@pytest.fixture(scope="module")
def pod_spec(docs: list[Doc]) -> Doc:
    spec: Doc = one(docs, "DaemonSet", "mig-agent", "mig-agent")["spec"]["template"]["spec"]
    return spec


@pytest.fixture(scope="module")
def container(pod_spec: Doc) -> Doc:
    (c,) = pod_spec["containers"]
    return dict(c)


def env_of(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


# ---- generated parts -------------------------------------------------------------------------


def test_sync_daemonset_check_passes() -> None:
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "sync-daemonset"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr


def test_configmap_holds_exactly_the_profile_files(docs: list[Doc]) -> None:
    data = one(docs, "ConfigMap", "mig-agent-profiles", "mig-agent")["data"]
    files = {f.name: f.read_text() for f in PROFILES.glob("*.yaml")}
    assert sorted(data) == sorted(files)
    for name, text in files.items():
        # a YAML block scalar ends with one newline; trailing spaces on lines are dropped
        want = "\n".join(line.rstrip() for line in text.splitlines()) + "\n"
        assert data[name] == want, name


def _configmap_files() -> Iterator[tuple[str, str]]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    cm = one(docs, "ConfigMap", "mig-agent-profiles", "mig-agent")
    yield from sorted(cm["data"].items())


@pytest.mark.parametrize(("name", "text"), list(_configmap_files()))
def test_every_configmap_layout_loads(name: str, text: str) -> None:
    layouts = load_text(text, f"configmap:{name}")
    assert layouts, f"{name} defines no layout"


def test_configmap_layouts_are_unique_across_files() -> None:
    seen: dict[str, str] = {}
    for name, text in _configmap_files():
        for layout in load_text(text, name):
            assert layout.name not in seen, f"{layout.name} in {seen.get(layout.name)} and {name}"
            seen[layout.name] = name


# ---- the DaemonSet ---------------------------------------------------------------------------


def test_rolling_update_never_runs_two_agents_on_a_node(docs: list[Doc]) -> None:
    strategy = one(docs, "DaemonSet", "mig-agent", "mig-agent")["spec"]["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxSurge"] == 0
    assert strategy["rollingUpdate"]["maxUnavailable"] == 1


def test_selector_matches_template_and_service_account_exists(
    docs: list[Doc], pod_spec: Doc
) -> None:
    ds = one(docs, "DaemonSet", "mig-agent", "mig-agent")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pod_spec["serviceAccountName"] == "mig-agent"
    one(docs, "ServiceAccount", "mig-agent", "mig-agent")
    one(docs, "Namespace", "mig-agent")


def test_runs_on_gpu_nodes_only_and_tolerates_the_gpu_taint(pod_spec: Doc) -> None:
    terms = pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms == [
        {
            "matchExpressions": [
                {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}
            ]
        }
    ]
    gpu = [t for t in pod_spec["tolerations"] if t["key"] == "nvidia.com/gpu"]
    assert gpu and all(t["operator"] == "Exists" for t in gpu)
    # the agent cordons its node and must stay (and be re-created) there while cordoned
    assert any(t["key"] == "node.kubernetes.io/unschedulable" for t in pod_spec["tolerations"])


def test_priority_class_is_system_node_critical(pod_spec: Doc) -> None:
    assert pod_spec["priorityClassName"] == "system-node-critical"


def test_node_name_comes_from_the_downward_api(container: Doc) -> None:
    assert env_of(container)["NODE_NAME"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "spec.nodeName"}
    }


def test_probes_hit_healthz_and_readyz_on_the_agents_port(container: Doc) -> None:
    env = env_of(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == int(env["MIG_AGENT_METRICS_PORT"]["value"])
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path
        assert ports.get(get["port"], get["port"]) == ports["metrics"]


def test_resources_have_requests_and_limits(container: Doc) -> None:
    res = container["resources"]
    assert {"cpu", "memory"} <= set(res["requests"])
    assert "memory" in res["limits"]


def test_profiles_mounted_where_the_agent_reads_them(container: Doc, pod_spec: Doc) -> None:
    where = env_of(container)["MIG_AGENT_CONFIG"]["value"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    (name,) = [n for n, m in mounts.items() if m["mountPath"] == where]
    assert mounts[name].get("readOnly") is True
    assert volumes[name]["configMap"]["name"] == "mig-agent-profiles"


def test_privileged_and_the_manifest_says_why(container: Doc) -> None:
    assert container["securityContext"]["privileged"] is True
    lines = TAIL.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip() == "privileged: true")
    assert lines[at - 1].strip().startswith("#"), "privileged: true needs a comment above it"


# ---- RBAC --------------------------------------------------------------------------------------


def rules_of(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    for d in docs:
        if d["kind"] in ("ClusterRole", "Role"):
            where = d["metadata"].get("namespace", "cluster-wide")
            for rule in d["rules"]:
                yield f"{d['kind']} {where}/{d['metadata']['name']}", rule


def test_no_wildcards_and_nothing_on_secrets(docs: list[Doc]) -> None:
    assert list(rules_of(docs))
    for who, rule in rules_of(docs):
        for key in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
            assert not any("*" in v for v in rule.get(key, [])), f"{who}: {key} {rule[key]}"
        assert "secrets" not in rule["resources"], who
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), who


def test_cluster_role_grants_exactly_what_the_agent_needs(docs: list[Doc]) -> None:
    granted = {
        (r, v)
        for rule in one(docs, "ClusterRole", "mig-agent")["rules"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert granted == {
        ("nodes", "get"),
        ("nodes", "list"),
        ("nodes", "watch"),
        ("nodes", "patch"),
        ("nodes/status", "patch"),
        ("pods", "get"),
        ("pods", "list"),
        ("pods", "watch"),  # the drain's waits watch the node's pods
        ("pods/eviction", "create"),
        # to name the budgets of a pod several cover, whose eviction the API refuses for good
        ("poddisruptionbudgets", "list"),
        # no resource.k8s.io: dra.enabled is auto, and the one-file install saw no cluster
        # with NVIDIA's DRA driver (tests/e2e/test_helm.py renders it on)
    }


def test_namespaced_roles_delete_device_plugin_pods_and_create_events(docs: list[Doc]) -> None:
    plugin = one(docs, "Role", "mig-agent-device-plugin", "gpu-operator")
    assert plugin["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["delete"]}]
    events = one(docs, "Role", "mig-agent-events", "default")
    assert events["rules"] == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]


def test_every_binding_names_the_agent_and_a_role_of_this_manifest(docs: list[Doc]) -> None:
    bindings = [d for d in docs if d["kind"] in ("ClusterRoleBinding", "RoleBinding")]
    assert len(bindings) == 3
    for b in bindings:
        assert b["subjects"] == [SA], b["metadata"]["name"]
        ref = b["roleRef"]
        namespace = b["metadata"].get("namespace") if ref["kind"] == "Role" else None
        one(docs, ref["kind"], ref["name"], namespace)


# ---- admission policy ----------------------------------------------------------------------------


POLICIES = (
    "mig-agent-own-node",
    "mig-agent-own-device-plugin",
    "mig-agent-own-events",
    "mig-agent-own-device-taints",
)


@pytest.mark.parametrize("name", POLICIES)
def test_policy_is_bound_and_denies(docs: list[Doc], name: str) -> None:
    policy = one(docs, "ValidatingAdmissionPolicy", name)["spec"]
    binding = one(docs, "ValidatingAdmissionPolicyBinding", name)["spec"]
    assert binding["policyName"] == name
    assert binding["validationActions"] == ["Deny"]
    assert "matchResources" not in binding  # every namespace, every object
    assert policy["failurePolicy"] == "Fail"
    (cond,) = policy["matchConditions"]
    assert "system:serviceaccount:mig-agent:mig-agent" in cond["expression"]
    assert all(v.get("reason") == "Forbidden" for v in policy["validations"])


def test_policies_cover_every_write_rbac_grants(docs: list[Doc]) -> None:
    covered = {
        (r, o)
        for name in POLICIES
        for rule in one(docs, "ValidatingAdmissionPolicy", name)["spec"]["matchConstraints"][
            "resourceRules"
        ]
        for r in rule["resources"]
        for o in rule["operations"]
    }
    assert {
        ("nodes", "UPDATE"),
        ("nodes/status", "UPDATE"),
        ("pods", "DELETE"),
        ("events", "CREATE"),
    } <= covered
    # eviction is the one write no policy can scope (docs/security.md): an Eviction names no node
    writes = {
        (r, v)
        for _, rule in rules_of(docs)
        for r in rule["resources"]
        for v in rule["verbs"]
        if v not in ("get", "list", "watch")
    }
    assert writes == {
        ("nodes", "patch"),
        ("nodes/status", "patch"),
        ("pods/eviction", "create"),
        ("pods", "delete"),
        ("events", "create"),
    }


# ---- the policies follow the settings --------------------------------------------------------


def _variables(docs: list[Doc], name: str) -> dict[str, str]:
    spec = one(docs, "ValidatingAdmissionPolicy", name)["spec"]
    return {v["name"]: v["expression"] for v in spec["variables"]}


def _text(docs: list[Doc], name: str) -> str:
    return yaml.safe_dump(one(docs, "ValidatingAdmissionPolicy", name), width=10**6)


def test_own_node_policy_names_the_default_settings(docs: list[Doc]) -> None:
    s = Settings()
    v = _variables(docs, "mig-agent-own-node")
    assert v["stateLabel"] == f"'{s.state_label}'"
    assert v["states"] == "[" + ", ".join(f"'{x}'" for x in State) + "]"
    assert v["operandLabels"] == "[" + ", ".join(f"'{k}'" for k in s.operand_labels) + "]"
    assert (
        v["ourAnnotations"]
        == "["
        + ", ".join(
            f"'{k}'"
            for k in (
                s.cordon_annotation,
                s.paused_annotation,
                s.reason_annotation,
                s.gpu_state_annotation,
                s.reboot_annotation,
                s.post_apply_annotation,
                s.host_services_annotation,
                s.observe_annotation,
                s.guard_annotation,
            )
        )
        + "]"
    )
    text = _text(docs, "mig-agent-own-node")
    assert f"c.type != '{s.condition_type}'" in text
    assert f"'{PAUSED}'" in text
    assert "gpu.deploy.'" not in text and "startsWith" not in text  # no prefix: exact keys


def test_device_plugin_policy_and_role_name_the_default_namespace(docs: list[Doc]) -> None:
    s = Settings()
    one(docs, "Role", "mig-agent-device-plugin", s.device_plugin_namespace)
    text = _text(docs, "mig-agent-own-device-plugin")
    assert f"request.namespace == '{s.device_plugin_namespace}'" in text
    key, value = s.device_plugin_selector.split("=")
    assert f"variables.labels['{key}'] == '{value}'" in text
    # the GPU Operator's validators (restart_validators is on by default), and no other app
    assert (
        "variables.labels.?app.orValue('') in ['nvidia-cuda-validator', "
        "'nvidia-device-plugin-validator', 'nvidia-operator-validator']"
    ) in text


def test_other_settings_render_another_policy() -> None:
    s = Settings(
        state_label="example.com/mig.state",
        operand_labels=("example.com/op",),
        annotation_prefix="mig.example.com",
        condition_type="MIGExample",
        device_plugin_namespace="plugins",
        device_plugin_selector="app=dp,!legacy",
        dra_plugin_namespace="dra-driver-nvidia-gpu",
        dra_plugin_selector="dra-driver-nvidia-gpu-component=kubelet-plugin",
    )
    text = policies.render(s)
    docs = [d for d in yaml.safe_load_all(text) if d]
    v = _variables(docs, "mig-agent-own-node")
    assert v["stateLabel"] == "'example.com/mig.state'"
    assert v["operandLabels"] == "['example.com/op']"
    assert "'mig.example.com/reason'" in v["ourAnnotations"]
    for default in (
        "nvidia.com/mig.config.state",
        "nvidia.com/gpu.deploy.",
        "mig-agent.dev/",
        "type != 'MIGConfigApplied'",
        '"type":"MIGConfigApplied"',
        "gpu-operator",
        "nvidia-device-plugin-daemonset",
    ):
        assert default not in text, default
    assert "c.type != 'MIGExample'" in text and '"type":"MIGExample"' in text
    assert (
        "(request.namespace == 'dra-driver-nvidia-gpu' && ('dra-driver-nvidia-gpu-component' in "
        "variables.labels && variables.labels['dra-driver-nvidia-gpu-component'] == "
        "'kubelet-plugin'))"
    ) in text
    off = policies.render(Settings(dra=False))
    assert "nvidia-dra-driver-kubelet-plugin" not in off and "|| false" in off
    assert (
        "request.namespace == 'plugins' && ((('app' in variables.labels && "
        "variables.labels['app'] == 'dp') && !('legacy' in variables.labels)) || "
        "variables.labels.?app.orValue('') in ['nvidia-cuda-validator', "
    ) in text
    # without restart_validators the policy allows the device plugin's pod only
    off = policies.render(s.replace(restart_validators=False))
    assert "nvidia-cuda-validator'" not in off
    assert "variables.labels['app'] == 'dp') && !('legacy' in variables.labels)) || false)" in off


@pytest.mark.parametrize(
    "bad",
    [
        Settings(state_label="x'y"),
        Settings(operand_labels=("a) || true || (",)),
        Settings(device_plugin_selector="app in (a,b)"),
        Settings(device_plugin_selector=""),
    ],
)
def test_settings_the_policy_cannot_express_are_refused(bad: Settings) -> None:
    with pytest.raises(policies.PolicyError):
        policies.render(bad)


AGENT_CODE = REPO / "mig_agent" / "agent"


def _calls(name: str, module: str = "") -> Iterator[ast.Call]:
    """Calls of `name` (of `module`.`name` if given) in the agent's code."""
    for path in sorted(AGENT_CODE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if module:
                if (
                    isinstance(f, ast.Attribute)
                    and f.attr == name
                    and isinstance(f.value, ast.Name)
                    and f.value.id == module
                ):
                    yield node
            elif (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")) == name:
                yield node


def _argument(call: ast.Call, position: int, keyword: str) -> ast.expr:
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    return call.args[position]


def test_condition_reasons_are_those_the_agent_sets() -> None:
    literal: set[str] = set()
    calls = list(_calls("NodeCondition"))
    assert calls
    for call in calls:
        reason = _argument(call, 2, "reason")
        if isinstance(reason, ast.Constant) and isinstance(reason.value, str):
            literal.add(reason.value)
        else:  # a failed pass: the error's class, type(exc).__name__
            assert ast.unparse(reason) == "type(exc).__name__", ast.unparse(reason)
    assert literal == set(policies.CONDITION_REASONS)
    leaves = {
        name
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, errors.MigAgentError)
    }
    assert leaves == set(policies.error_names())
    assert set(policies.condition_reasons()) == literal | leaves


def test_event_reasons_are_those_the_agent_emits() -> None:
    emitted: set[str] = set()
    # reporting's own, and the pass's phases through Tools.phase (node, name, reason, ...)
    for name, module, position in (
        ("event", "reporting", 2),
        ("event_on_node", "reporting", 2),
        ("phase", "t", 2),
    ):
        calls = list(_calls(name, module))
        assert calls, name
        for call in calls:
            reason = _argument(call, position, "reason")
            assert isinstance(reason, ast.Constant), ast.unparse(reason)
            emitted.add(reason.value)
    assert emitted == set(policies.EVENT_REASONS)


def test_event_component_is_the_clients_default() -> None:
    import inspect

    from mig_agent.kube.client import KubernetesCluster

    default = inspect.signature(KubernetesCluster.__init__).parameters["component"].default
    assert default == policies.COMPONENT


def test_sync_daemonset_renders_the_policies_for_the_environments_settings() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIG_AGENT_")}
    env.update(
        {
            "MIG_AGENT_STATE_LABEL": "example.com/mig.state",
            "MIG_AGENT_OPERAND_LABELS": "example.com/op-a,example.com/op-b",
        }
    )
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "sync-daemonset"), "--policies"],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    docs = [d for d in yaml.safe_load_all(res.stdout) if d]
    v = _variables(docs, "mig-agent-own-node")
    assert v["stateLabel"] == "'example.com/mig.state'"
    assert v["operandLabels"] == "['example.com/op-a', 'example.com/op-b']"
    assert {d["kind"] for d in docs} == {
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
