"""We test the Helm chart (charts/mig-agent) with the real helm (scripts/helm-binary build):

* `helm lint` passes (strict);
* `helm template`: the objects of the install, runtimeClassName nvidia by default and omitted
  with `runtimeClassName=""`, the values reaching the agent's environment, the profile ConfigMap
  or an existing ConfigMap by name, a ServiceMonitor only where monitoring.coreos.com/v1 exists,
  observe mode's setting and its narrower RBAC;
* the admission policies the chart renders are those deploy/policies.py renders for the same
  settings (defaults and changed label keys, annotation prefix, condition type, device plugin
  namespace and selector), and a value the policy cannot express fails the render;
* on a cluster of its own (daemonset.yaml may be installed on the session's): `helm install`, the
  agent (started for the DaemonSet's pod as on the local cluster, with the environment the chart
  gave that pod) repartitions a node; `helm upgrade` with another state label key and drain
  timeout reaches the pod and the policy; the agent restarted with it on the node partitioned
  before (as by MIG Manager) reports success under the new key without a reconfiguring Event,
  cordon or GPU change, then repartitions again; `helm uninstall` leaves none of the chart's
  objects behind.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from migsim.cluster import Cluster, agents

from deploy import policies
from mig_agent.config.settings import Settings
from tests.node_watch import core_for, node_versions

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "mig-agent"
# as the GPU Operator creates it (tests/conftest.py adds it to the session's cluster)
NVIDIA_RUNTIME_CLASS = {
    "apiVersion": "node.k8s.io/v1",
    "kind": "RuntimeClass",
    "metadata": {"name": "nvidia"},
    "handler": "nvidia",
}
POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
Doc = dict[str, Any]


@pytest.fixture(scope="module")
def helm() -> str:
    return subprocess.run(
        [str(REPO / "scripts" / "helm-binary"), "build"],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout.strip()


def run(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)
    if check and res.returncode:
        raise AssertionError(f"helm {' '.join(args)}: {res.returncode}\n{res.stderr}")
    return res


def template(helm: str, *args: str) -> list[Doc]:
    out = run(helm, "template", "mig-agent", str(CHART), "--namespace", "mig-agent", *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def kinds(docs: list[Doc]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def pod_spec(docs: list[Doc]) -> Doc:
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    spec: Doc = ds["spec"]["template"]["spec"]
    return spec


def env(docs: list[Doc]) -> dict[str, str]:
    (c,) = pod_spec(docs)["containers"]
    return {e["name"]: e["value"] for e in c["env"] if "value" in e}


# ---- without a cluster ----------------------------------------------------------------------


def test_lint(helm: str) -> None:
    res = run(helm, "lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in res.stdout, res.stdout


def test_template_defaults(helm: str) -> None:
    docs = template(helm)
    assert kinds(docs) == {
        ("ServiceAccount", "mig-agent"),
        ("ClusterRole", "mig-agent"),
        ("ClusterRoleBinding", "mig-agent"),
        ("Role", "mig-agent-device-plugin"),
        ("RoleBinding", "mig-agent-device-plugin"),
        ("Role", "mig-agent-events"),
        ("RoleBinding", "mig-agent-events"),
        ("ConfigMap", "mig-agent-profiles"),
        ("ConfigMap", "mig-agent-gpu-clients"),
        ("DaemonSet", "mig-agent"),
        *(
            (k, f"mig-agent-own-{n}")
            for k in POLICY_KINDS
            for n in ("node", "device-plugin", "events", "device-taints")
        ),
    }
    spec = pod_spec(docs)
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["serviceAccountName"] == "mig-agent"
    e = env(docs)
    assert e["MIG_AGENT_STATE_LABEL"] == Settings().state_label
    assert e["MIG_AGENT_OPERAND_LABELS"] == ",".join(Settings().operand_labels)
    assert e["MIG_AGENT_MIG_STRATEGY"] == "mixed"
    assert "MIG_AGENT_REBOOT_COMMAND" not in e and "MIG_AGENT_DRAIN_TIMEOUT_S" not in e
    (cm,) = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "mig-agent-profiles"
    ]
    assert set(cm["data"]) == {f.name for f in (REPO / "profiles").glob("*.yaml")}
    # rendered from the chart's defaults, daemonset.yaml holds the same objects (and a Namespace)
    manifest = [d for d in yaml.safe_load_all((REPO / "daemonset.yaml").read_text()) if d]
    assert kinds(manifest) == kinds(docs) | {("Namespace", "mig-agent")}


def test_template_values(helm: str) -> None:
    docs = template(
        helm,
        "--set",
        "runtimeClassName=",
        "--set",
        "migStrategy=single",
        "--set",
        "rebootCommand=systemctl reboot",
        "--set",
        "timeouts.drain=42",
        "--set",
        "timeouts.reboot=600",
        "--set",
        "metrics.port=9500",
        "--set",
        "nodeSelector.pool=gpu",
        "--set",
        "config.existingConfigMap=default-mig-parted-config",
        "--set",
        "image.tag=9.9.9",
        "--set",
        "resources.limits.memory=1Gi",
        "--set",
        "extraEnv.backoff_max_s=120",
    )
    spec = pod_spec(docs)
    assert "runtimeClassName" not in spec
    assert spec["nodeSelector"] == {"pool": "gpu"}
    e = env(docs)
    assert (e["MIG_AGENT_MIG_STRATEGY"], e["MIG_AGENT_REBOOT_COMMAND"]) == (
        "single",
        "systemctl reboot",
    )
    assert (e["MIG_AGENT_DRAIN_TIMEOUT_S"], e["MIG_AGENT_METRICS_PORT"]) == ("42", "9500")
    assert e["MIG_AGENT_BACKOFF_MAX_S"] == "120"
    assert Settings.from_env(e).backoff_max_s == 120.0
    assert Settings.from_env(e).reboot_timeout_s == 600.0
    (c,) = spec["containers"]
    assert c["image"].endswith(":9.9.9") and c["resources"]["limits"]["memory"] == "1Gi"
    assert c["ports"] == [{"name": "metrics", "containerPort": 9500}]
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"] == [
        "mig-agent-gpu-clients"
    ]  # the profiles come from the existing ConfigMap
    (vol,) = [v for v in spec["volumes"] if v["name"] == "profiles"]
    assert vol["configMap"]["name"] == "default-mig-parted-config"
    renamed = template(helm, "--set", "runtimeClassName=nvidia-cdi")
    assert pod_spec(renamed)["runtimeClassName"] == "nvidia-cdi"


def test_operator_duties_values(helm: str) -> None:
    """Validators on, hooks and host GPU clients off by default; the values reach the agent's
    settings, the hooks ConfigMap and the host's root are mounted when asked for."""
    defaults = template(helm)
    e = env(defaults)
    s = Settings.from_env(e)
    assert s.restart_validators and not s.stop_host_gpu_clients
    assert (s.hooks_file, s.pre_apply_command, s.post_apply_command) == ("", "", "")
    assert s.host_gpu_clients_file == "/etc/mig-agent/gpu-clients/clients.yaml"
    (clients,) = [
        d
        for d in defaults
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "mig-agent-gpu-clients"
    ]
    listed = yaml.safe_load(clients["data"]["clients.yaml"])
    assert listed["version"] == "v1" and "nvidia-dcgm.service" in listed["systemd-services"]
    assert "host-root" not in {v["name"] for v in pod_spec(defaults)["volumes"]}

    cdi = (
        "chroot /host nvidia-ctk cdi generate --mode=management "
        "--output=/var/run/cdi/management.nvidia.com-gpu.yaml"
    )
    docs = template(
        helm,
        "--set",
        "gpuOperator.restartValidators=false",
        "--set",
        f"hooks.postApply={cdi}",
        "--set",
        "hooks.preApply=/bin/true",
        "--set",
        "hooks.existingConfigMap=site-hooks",
        "--set",
        "hooks.timeout=30",
        "--set",
        "hostGpuClients.stop=true",
        "--set",
        "hostGpuClients.existingConfigMap=default-gpu-clients",
        "--set",
        "hostGpuClients.command=chroot /host /bin/systemctl",
    )
    s = Settings.from_env(env(docs))
    assert not s.restart_validators and s.stop_host_gpu_clients
    assert (s.post_apply_command, s.pre_apply_command) == (cdi, "/bin/true")
    assert (s.hooks_file, s.command_timeout_s) == ("/etc/mig-agent/hooks/hooks.yaml", 30.0)
    assert s.host_service_command == "chroot /host /bin/systemctl"
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert volumes["hooks"]["configMap"]["name"] == "site-hooks"
    assert volumes["gpu-clients"]["configMap"]["name"] == "default-gpu-clients"
    assert volumes["host-root"]["hostPath"]["path"] == "/"
    (c,) = pod_spec(docs)["containers"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert (mounts["hooks"], mounts["host-root"]) == ("/etc/mig-agent/hooks", "/host")
    assert not [d for d in docs if d["metadata"]["name"] == "mig-agent-gpu-clients"]


def test_service_monitor_only_with_the_prometheus_operators_api(helm: str) -> None:
    assert not {k for k, _ in kinds(template(helm))} & {"ServiceMonitor", "Service"}
    docs = template(helm, "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor")
    (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert svc["spec"]["ports"][0]["port"] == 9400
    assert svc["spec"]["selector"] == {"app.kubernetes.io/name": "mig-agent"}
    off = template(
        helm,
        "--api-versions",
        "monitoring.coreos.com/v1/ServiceMonitor",
        "--set",
        "metrics.serviceMonitor.enabled=false",
    )
    assert "ServiceMonitor" not in {k for k, _ in kinds(off)}


def _rules(docs: list[Doc]) -> set[tuple[str, str]]:
    """(resource, verb) of every rule the ClusterRole and the Roles grant."""
    return {
        (r, v)
        for d in docs
        if d["kind"] in ("ClusterRole", "Role")
        for rule in d["rules"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def test_observe_value_reaches_the_agent_and_drops_the_rights_it_does_not_use(
    helm: str,
) -> None:
    """observe=true: MIG_AGENT_OBSERVE for the agent, and RBAC without evictions, node status
    or pod deletion (its reads, Events and the node patch of its annotation stay)."""
    assert env(template(helm))["MIG_AGENT_OBSERVE"] == "false"
    full = _rules(template(helm, "--set", "dra.enabled=true", "--set", "dra.namespace=dra"))
    docs = template(helm, "--set", "observe=true", "--set", "dra.enabled=true")
    assert env(docs)["MIG_AGENT_OBSERVE"] == "true"
    dropped = {
        ("pods/eviction", "create"),
        ("poddisruptionbudgets", "list"),  # only to name the budgets of a refused eviction
        ("nodes/status", "patch"),
        ("pods", "delete"),
    }
    assert dropped <= full
    assert _rules(docs) == full - dropped
    kept = {("nodes", "patch"), ("events", "create"), ("pods", "watch"), ("resourceclaims", "list")}
    assert kept <= _rules(docs)
    assert not {n for k, n in kinds(docs) if k == "Role" and n.endswith("-plugin")}
    dra_elsewhere = ("--set", "dra.enabled=true", "--set", "dra.namespace=dra")
    assert _rules(template(helm, "--set", "observe=true", *dra_elsewhere)) == full - dropped


OTHER = Settings(
    state_label="example.com/mig-state",
    operand_labels=("example.com/a", "b"),
    annotation_prefix="mig.example.com",
    condition_type="GpuLayout",
    device_plugin_namespace="nvidia",
    device_plugin_selector="app = dp, !legacy, tier!=canary, release==x",
    restart_validators=False,
)


def as_values(s: Settings) -> list[str]:
    selector = s.device_plugin_selector.replace(",", "\\,")  # --set splits at commas
    return [
        "--set",
        f"labels.state={s.state_label}",
        "--set",
        f"labels.operands={{{','.join(s.operand_labels)}}}",
        "--set",
        f"annotationPrefix={s.annotation_prefix}",
        "--set",
        f"conditionType={s.condition_type}",
        "--set",
        f"devicePlugin.namespace={s.device_plugin_namespace}",
        "--set-string",
        f"devicePlugin.selector={selector}",
        "--set",
        f"gpuOperator.restartValidators={str(s.restart_validators).lower()}",
    ]


@pytest.mark.parametrize("settings", [Settings(), OTHER], ids=["defaults", "other"])
def test_policies_are_those_of_deploy_policies(helm: str, settings: Settings) -> None:
    def by_name(docs: list[Doc]) -> dict[tuple[str, str], Doc]:
        return {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in POLICY_KINDS}

    # DRA on, as the settings have it (the chart's auto renders it off without a cluster)
    chart = by_name(template(helm, *as_values(settings), "--set", "dra.enabled=true"))
    ours = by_name([d for d in yaml.safe_load_all(policies.render(settings)) if d])
    assert len(chart) == 8 and chart.keys() == ours.keys()
    for key, doc in chart.items():
        assert doc == ours[key], key
    if settings != Settings():
        assert chart != by_name([d for d in yaml.safe_load_all(policies.render()) if d])


@pytest.mark.parametrize(
    "values",
    [
        ["--set", "labels.state=a'b"],
        ["--set-string", "devicePlugin.selector=app in (x)"],
        ["--set-string", "devicePlugin.selector=!a=b"],
        ["--set", "migStrategy=none"],
    ],
)
def test_values_the_agent_or_policy_cannot_take_fail(helm: str, values: list[str]) -> None:
    res = run(helm, "template", "x", str(CHART), *values, check=False)
    assert res.returncode != 0 and (
        "admission policy" in res.stderr
        or "supported in the policy" in res.stderr
        or "mixed or single" in res.stderr
    ), res.stderr


# ---- on a cluster ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster of its own with one GPU node: the session's may hold daemonset.yaml's objects,
    which Helm would refuse to take over."""
    c = Cluster.up(tmp_path_factory.mktemp("helm-cluster"), gpu_nodes=1)
    try:
        yield c
    finally:
        agents.stop_all(c.dir)
        c.down()


def kube_json(cluster: Cluster, *args: str) -> Any:
    return json.loads(cluster.kubectl(*args, "-o", "json"))


def agent_settings(cluster: Cluster, state_label: str) -> dict[str, str]:
    """The MIG_AGENT_* environment the chart gave the DaemonSet's pod, once the pod carries
    `state_label` (after an upgrade, the rolled pod), less what start_node sets itself."""
    deadline = time.monotonic() + 60
    while True:
        for pod in kube_json(cluster, "get", "pods", "-n", "mig-agent")["items"]:
            if pod["metadata"].get("deletionTimestamp"):
                continue
            (c,) = pod["spec"]["containers"]
            e = {v["name"]: v["value"] for v in c["env"] if "value" in v}
            if e.get("MIG_AGENT_STATE_LABEL") == state_label:
                assert pod["spec"]["runtimeClassName"] == "nvidia"
                return {
                    k: v
                    for k, v in e.items()
                    if k.startswith("MIG_AGENT_")
                    and k not in ("MIG_AGENT_CONFIG", "MIG_AGENT_METRICS_PORT")
                }
        assert time.monotonic() < deadline, f"no agent pod with {state_label}"
        time.sleep(0.3)


def wait_label(cluster: Cluster, node: str, key: str, value: str, timeout: float = 90) -> list[str]:
    """Wait for the node's label `key` to read `value`; every value it held on the way (a watch
    on the node: none is missed, however short)."""
    seen: list[str] = []
    labels: dict[str, str] = {}
    with core_for(cluster.kubeconfig) as core:
        for n in node_versions(core, node, timeout):
            labels = n.metadata.labels or {}
            if key in labels and (not seen or seen[-1] != labels[key]):
                seen.append(labels[key])
            if labels.get(key) == value:
                return seen
    log = cluster.dir / "logs" / f"agent-{node}.log"
    raise AssertionError(
        f"{key}={labels.get(key)!r}, not {value}\n"
        + ("\n".join(log.read_text().splitlines()[-20:]) if log.exists() else "")
    )


def mig_events(cluster: Cluster, node: str) -> dict[str, int]:
    """The agent's Events about `node`: reason -> count."""
    items = kube_json(
        cluster, "get", "events", "-n", "default", "--field-selector", f"involvedObject.name={node}"
    )["items"]
    counts: dict[str, int] = {}
    for e in items:
        if e["reason"].startswith("MIG"):
            counts[e["reason"]] = counts.get(e["reason"], 0) + (e.get("count") or 1)
    return counts


def gpu_instances(cluster: Cluster, node: str) -> list[int]:
    """GPU instances per GPU, as the agent published them."""
    meta = kube_json(cluster, "get", "node", node)["metadata"]
    state = json.loads(meta["annotations"]["mig-agent.dev/gpu-state"])
    return [len(g["gpu_instances"]) for g in state["gpus"]]


def test_install_upgrade_uninstall(helm: str, own_cluster: Cluster) -> None:
    c, node = own_cluster, "gpu-node-0"
    kc = ["--kubeconfig", str(c.kubeconfig)]
    # as the GPU Operator does: the nvidia RuntimeClass, and the device plugin in gpu-operator
    c.kubectl("apply", "-f", "-", input=json.dumps(NVIDIA_RUNTIME_CLASS))
    c.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": agents.PLUGIN_NS}}
        ),
    )
    c.kubectl("apply", "-f", "-", input=json.dumps(agents.DEVICE_PLUGIN))

    run(helm, *kc, "install", "mig-agent", str(CHART), "-n", "mig-agent", "--create-namespace")
    settings = agent_settings(c, Settings().state_label)
    agents.start_node(c, node, settings=settings, restart_backoff=(0.5, 5.0))
    c.kubectl("label", "node", node, "--overwrite", "nvidia.com/mig.config=all-1g.10gb")
    wait_label(c, node, Settings().state_label, "success")
    assert gpu_instances(c, node) == [7] * 8  # 1g.10gb: seven per H100

    # upgrade: another state label key and drain timeout reach the pod and the policy
    new_key = "example.com/mig-state"
    run(
        helm,
        *kc,
        "upgrade",
        "mig-agent",
        str(CHART),
        "-n",
        "mig-agent",
        "--reuse-values",
        "--set",
        f"labels.state={new_key}",
        "--set",
        "timeouts.drain=77",
    )
    policy = kube_json(c, "get", "validatingadmissionpolicy", "mig-agent-own-node")
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables["stateLabel"] == f"'{new_key}'"
    agents.stop_node(c.dir, node)
    settings = agent_settings(c, new_key)
    assert settings["MIG_AGENT_DRAIN_TIMEOUT_S"] == "77"
    before = kube_json(c, "get", "node", node)["metadata"]["annotations"]["mig-agent.dev/gpu-state"]
    events = mig_events(c, node)
    assert "MIGApplying" in events
    agents.start_node(c, node, settings=settings, restart_backoff=(0.5, 5.0))
    # a fresh agent on a node partitioned before (as by MIG Manager) under the label's layout:
    # success with nothing changed -- never pending, not cordoned, the same GPU instances
    seen = wait_label(c, node, new_key, "success")
    assert seen == ["success"], seen
    after = kube_json(c, "get", "node", node)
    assert not after["spec"].get("unschedulable")
    assert after["metadata"]["annotations"]["mig-agent.dev/gpu-state"] == before
    work = ("MIGReconfiguring", "MIGDraining", "MIGApplying", "MIGDevicePluginRestart")
    now = mig_events(c, node)
    assert [now.get(r, 0) for r in work] == [events.get(r, 0) for r in work], (events, now)
    # cleared with the relabel, as `mig-agent repartition` does: a stale `success` is no answer
    c.kubectl(
        "label", "node", node, "--overwrite", "nvidia.com/mig.config=all-2g.20gb", f"{new_key}-"
    )
    wait_label(c, node, new_key, "success")  # the policy lets the agent write the new key
    assert gpu_instances(c, node) == [3] * 8  # 2g.20gb: three per H100
    agents.stop_node(c.dir, node)

    # uninstall: none of the chart's objects remain
    run(helm, *kc, "uninstall", "mig-agent", "-n", "mig-agent", "--wait")
    chart_kinds = (
        "serviceaccounts,configmaps,daemonsets,roles,rolebindings,clusterroles,"
        "clusterrolebindings,validatingadmissionpolicies,"
        "validatingadmissionpolicybindings"
    )
    left = kube_json(c, "get", chart_kinds, "-A", "-l", "app.kubernetes.io/name=mig-agent")
    assert [(i["kind"], i["metadata"]["name"]) for i in left["items"]] == []
    named = c.kubectl("get", chart_kinds, "-A", "-o", "name")
    assert "mig-agent" not in named.replace("namespace/mig-agent", ""), named
    assert run(helm, *kc, "list", "-A", "-q").stdout.strip() == ""


def dra_rights(docs: list[Doc]) -> tuple[set[str], str]:
    """The resource.k8s.io resources the agent's ClusterRole grants, and its MIG_AGENT_DRA."""
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    granted = {
        r
        for rule in role["rules"]
        if "resource.k8s.io" in rule["apiGroups"]
        for r in rule["resources"]
    }
    return granted, env(docs)["MIG_AGENT_DRA"]


DRA_RIGHTS = {"resourceslices", "resourceclaims", "devicetaintrules"}
NVIDIA_DRIVER = "device.driver == 'gpu.nvidia.com'"


def test_dra_is_on_where_nvidias_device_class_is_or_when_asked(
    helm: str, own_cluster: Cluster, tmp_path: Path
) -> None:
    """dra.enabled auto (the default): the cluster-wide claim listing is granted only where
    NVIDIA's DRA driver is installed (its DeviceClass gpu.nvidia.com), looked up at install;
    without a cluster (`helm template`, daemonset.yaml) it is off; true and false force it."""
    assert dra_rights(template(helm)) == (set(), "false")
    assert dra_rights(template(helm, "--set", "dra.enabled=true")) == (DRA_RIGHTS, "true")
    assert dra_rights(template(helm, "--set", "dra.enabled=false")) == (set(), "false")
    server = ["--dry-run=server", "--kubeconfig", str(own_cluster.kubeconfig)]
    assert dra_rights(template(helm, *server)) == (set(), "false")
    device_class = tmp_path / "device-class.yaml"
    device_class.write_text(
        json.dumps(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": "gpu.nvidia.com"},
                "spec": {
                    "selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]
                },
            }
        )
    )
    own_cluster.kubectl("apply", "-f", str(device_class))
    try:
        assert dra_rights(template(helm, *server)) == (DRA_RIGHTS, "true")
        off = template(helm, *server, "--set", "dra.enabled=false")
        assert dra_rights(off) == (set(), "false")
    finally:
        own_cluster.kubectl("delete", "-f", str(device_class))
