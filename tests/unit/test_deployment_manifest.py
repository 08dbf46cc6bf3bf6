"""We test these aspects of the deployment manifest (daemonset.yaml), without a cluster:

* it is up to date: `scripts/sync-daemonset --check` passes, and the ConfigMap mig-agent-profiles
  holds exactly the files of mig_agent/profiles/, each of whose layouts loads with the catalog
  loader;
* the DaemonSet: one agent per GPU node at a time (maxSurge 0, maxUnavailable 1), GPU nodes only,
  tolerates the GPU taint, node name from the downward API, probes on /healthz and /readyz of the
  metrics port the agent listens on, requests and limits, system-node-critical, privileged (and
  says why), the profiles mounted where MIG_AGENT_CONFIG points;
* RBAC is least privilege: no wildcards, nothing on secrets, no node deletion or creation, no pod
  writes but eviction cluster-wide, pod deletion only in gpu-operator; every binding names the
  agent's ServiceAccount and a role of this manifest;
* the admission policy is bound, denies on failure and on violation, and matches the agent only.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mig_agent.catalog import load_text

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "daemonset.yaml"
TAIL = REPO / "deploy" / "daemonset.tail.yaml"
PROFILES = REPO / "mig_agent" / "profiles"
SA = {"kind": "ServiceAccount", "name": "mig-agent", "namespace": "mig-agent"}

Doc = dict[str, Any]


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def one(docs: list[Doc], kind: str, name: str, namespace: str | None = None) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name
             and d["metadata"].get("namespace") == namespace]
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
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "sync-daemonset"), "--check"],
                         capture_output=True, text=True, check=False)
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


def test_selector_matches_template_and_service_account_exists(docs: list[Doc],
                                                              pod_spec: Doc) -> None:
    ds = one(docs, "DaemonSet", "mig-agent", "mig-agent")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pod_spec["serviceAccountName"] == "mig-agent"
    one(docs, "ServiceAccount", "mig-agent", "mig-agent")
    one(docs, "Namespace", "mig-agent")


def test_runs_on_gpu_nodes_only_and_tolerates_the_gpu_taint(pod_spec: Doc) -> None:
    terms = pod_spec["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [
        {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]}]
    gpu = [t for t in pod_spec["tolerations"] if t["key"] == "nvidia.com/gpu"]
    assert gpu and all(t["operator"] == "Exists" for t in gpu)
    # the agent cordons its node and must stay (and be re-created) there while cordoned
    assert any(t["key"] == "node.kubernetes.io/unschedulable" for t in pod_spec["tolerations"])


def test_priority_class_is_system_node_critical(pod_spec: Doc) -> None:
    assert pod_spec["priorityClassName"] == "system-node-critical"


def test_node_name_comes_from_the_downward_api(container: Doc) -> None:
    assert env_of(container)["NODE_NAME"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "spec.nodeName"}}


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
    granted = {(r, v) for rule in one(docs, "ClusterRole", "mig-agent")["rules"]
               for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {
        ("nodes", "get"), ("nodes", "list"), ("nodes", "watch"), ("nodes", "patch"),
        ("nodes/status", "patch"), ("pods", "get"), ("pods", "list"),
        ("pods/eviction", "create"),
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


def test_policy_is_bound_and_denies(docs: list[Doc]) -> None:
    policy = one(docs, "ValidatingAdmissionPolicy", "mig-agent-own-node")["spec"]
    binding = one(docs, "ValidatingAdmissionPolicyBinding", "mig-agent-own-node")["spec"]
    assert binding["policyName"] == "mig-agent-own-node"
    assert binding["validationActions"] == ["Deny"]
    assert policy["failurePolicy"] == "Fail"
    rules = policy["matchConstraints"]["resourceRules"]
    assert {r for rule in rules for r in rule["resources"]} == {"nodes", "nodes/status"}
    assert {o for rule in rules for o in rule["operations"]} >= {"UPDATE"}
    (cond,) = policy["matchConditions"]
    assert "system:serviceaccount:mig-agent:mig-agent" in cond["expression"]
