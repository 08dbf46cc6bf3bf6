"""We test the DeviceClasses of ``mig-agent dra-classes`` end to end, on the local cluster
(Kubernetes 1.37: DRA extended resources are GA) with NVIDIA's DRA kubelet plugin on DRA nodes
(agent_node(device_plugin="dra"); root only) and real agents; the command runs as the chart's
ServiceAccount, under the ClusterRole and admission policy the chart renders for it:

* a pod written for the device plugin (limits nvidia.com/mig-1g.10gb: 1, no ResourceClaim) stays
  Unschedulable on a DRA node at all-1g.10gb until the classes are published; then the real
  scheduler places it there through the class mig-1g.10gb: the claim it made for the pod holds a
  1g.10gb device of the node's pool; a change of the other GPU leaves the pod running (the agent
  knows, by that claim, which device it holds);
* the class set follows the configs: a class per profile, a removed layout's class deleted; a
  class not ours serving nvidia.com/mig-3g.40gb stays untouched and ours for that name is
  refused, saying so (exit 1); a second run changes nothing; an edited class of ours is put
  back; ``--remove`` takes ours away and nothing else; the ServiceAccount may not delete or take
  over a class not ours (the policy);
* ``advise`` counts a pod asking nvidia.com/mig-1g.10gb as demand on a DRA node with whole GPUs:
  unserved while no class serves the name, a relabel of that node proposed once one does, which
  ``--apply`` makes, the pod then running there;
* the chart renders the publisher (its Job a Helm hook, and one removing the classes at
  uninstall) only with dra.deviceClasses.

Classes are cluster-wide: each test deletes every class of ours it leaves (the fixture).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from migsim.cluster import Cluster, wait_until
from migsim.nvml import state as simstate

from mig_agent.core.device_classes import OWNER, OWNER_LABEL
from tests.conftest import GpuPodFactory, SaKubeconfig

from .conftest import REPO, NodeFactory, wait_running
from .test_agent import wait_unschedulable
from .test_dra import RESOURCE, allocated_device, change
from .test_helm import CHART, helm, run
from .test_ops import explain, mig_agent_cli

__all__ = ["helm"]  # the fixture, used by the tests here

MIG_1G = "nvidia.com/mig-1g.10gb"
CLASSES = f"{RESOURCE}/deviceclasses"
LAYOUTS = {
    "all-1g.10gb": '{"1g.10gb": 7}',
    "all-2g.20gb": '{"2g.20gb": 3}',
    "all-3g.40gb": '{"3g.40gb": 2}',
}
# a change of GPU 1 only: GPU 0 keeps its seven 1g.10gb devices
KEEP_GPU = """
  keep-gpu-{keep}:
    - devices: [{keep}]
      mig-enabled: true
      mig-devices: {{"1g.10gb": 7}}
    - devices: [{other}]
      mig-enabled: true
      mig-devices: {{"3g.40gb": 2}}
"""


def profiles(path: Path, *layouts: str, extra: str = "") -> Path:
    """A profile config of these of LAYOUTS (and ``extra`` layouts' YAML)."""
    body = "".join(
        f"  {n}:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {LAYOUTS[n]}\n"
        for n in layouts
    )
    path.write_text(f"version: v1\nmig-configs:\n{body}{extra}")
    return path


def _chart_rights(helm: str, release: str, namespace: str) -> list[dict[str, Any]]:
    """The publisher's ClusterRole, binding and admission policy, as the chart renders them."""
    out = run(
        helm,
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--set",
        "dra.deviceClasses=true",
        "--show-only",
        "templates/device-classes.yaml",
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d and d["kind"] not in ("Job", "ServiceAccount")]


_PATHS = {
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "ValidatingAdmissionPolicy": (
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
    ),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"
    ),
}


def ours(cluster: Cluster) -> dict[str, dict[str, Any]]:
    listed = cluster.api.get(f"{CLASSES}?labelSelector={OWNER_LABEL}%3D{OWNER}")["items"]
    return {c["metadata"]["name"]: c for c in listed}


@dataclass(frozen=True)
class Publish:
    """``mig-agent dra-classes --apply [-f config] ARGS`` acting as ``kubeconfig``'s account."""

    kubeconfig: Path

    def __call__(self, config: Path | None, *args: str) -> subprocess.CompletedProcess[str]:
        files = ["-f", str(config)] if config is not None else []
        kc = ["--kubeconfig", str(self.kubeconfig)]
        return mig_agent_cli("dra-classes", "--apply", *files, *kc, *args)


@pytest.fixture
def publish(
    helm: str, installed: Cluster, namespace: str, sa_kubeconfig: SaKubeconfig
) -> Iterator[Publish]:
    """The command as the chart's ServiceAccount (its rights made on the session's cluster for
    a release named after the test's namespace). Its rights and every class of ours are
    deleted after."""
    release = "r" + hashlib.sha256(namespace.encode()).hexdigest()[:12]
    made: list[str] = []
    try:
        for d in _chart_rights(helm, release, namespace):
            installed.api.request("POST", _PATHS[d["kind"]], d)
            made.append(f"{_PATHS[d['kind']]}/{d['metadata']['name']}")
        yield Publish(sa_kubeconfig(namespace, f"{release}-dra-classes"))
    finally:
        for name in ours(installed):
            installed.api.request("DELETE", f"{CLASSES}/{name}")
        for path in reversed(made):
            installed.api.request("DELETE", path)


def test_a_pod_asking_a_mig_resource_runs_on_a_dra_node_through_the_published_class(
    agent_node: NodeFactory,
    extra_profiles: Callable[[str], Path],
    publish: Publish,
    namespace: str,
    core: client.CoreV1Api,
    gpu_pod: GpuPodFactory,
) -> None:
    config = extra_profiles(
        "version: v1\nmig-configs:"
        + KEEP_GPU.format(keep=0, other=1)
        + KEEP_GPU.format(keep=1, other=0)
    )
    node = agent_node("2xH100-80GB", device_plugin="dra", profiles=config)
    assert change(node, "all-1g.10gb") == "success", node.log_tail()
    assert node.gpu_resources() == {}  # no device plugin: the node advertises no MIG resource
    gpu_pod(namespace, "written-for-the-plugin", resources={MIG_1G: 1}, node=node.name)
    wait_unschedulable(core, namespace, "written-for-the-plugin")

    res = publish(config)
    assert res.returncode == 0, explain(res, [node])
    assert "create   mig-1g.10gb: nvidia.com/mig-1g.10gb by MIG 1g.10gb devices" in res.stdout

    pod = wait_running(core, namespace, "written-for-the-plugin", timeout=60)
    assert pod.spec.node_name == node.name
    raw = node.cluster.api.get(f"/api/v1/namespaces/{namespace}/pods/written-for-the-plugin")
    claim_name = raw["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    device = allocated_device(node, namespace, claim_name)
    assert node.dra_devices()[device]["profile"] == "1g.10gb"

    # the other GPU changes: the pod's device stays, and so does the pod
    uuid = node.dra_devices()[device]["parentUUID"]
    (gpu,) = [g.index for g in simstate.load_node(node.sim_state).gpus if g.uuid == uuid]
    assert change(node, f"keep-gpu-{gpu}") == "success", node.log_tail()
    left = core.list_namespaced_pod(
        namespace, field_selector="metadata.name=written-for-the-plugin"
    ).items
    assert left, "the pod was evicted though its device stays"
    assert left[0].metadata.uid == pod.metadata.uid and left[0].status.phase == "Running"
    assert left[0].metadata.deletion_timestamp is None
    assert allocated_device(node, namespace, claim_name) == device


def _admins_class(name: str, resource: str, profile: str) -> dict[str, Any]:
    """A class an admin made, as NVIDIA's demo does (no label of ours)."""
    a = "device.attributes['gpu.nvidia.com']"
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {
            "selectors": [
                {"cel": {"expression": f"{a}.type == 'mig' && {a}.profile == '{profile}'"}}
            ],
            "extendedResourceName": resource,
        },
    }


def _json(res: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(res.stdout)
    return data


def test_the_classes_follow_the_configs_and_leave_a_class_not_ours_alone(
    installed: Cluster, publish: Publish, tmp_path: Path
) -> None:
    admins = _admins_class("admins-3g", "nvidia.com/mig-3g.40gb", "3g.40gb")
    installed.api.request("POST", CLASSES, admins)
    try:
        before = installed.api.get(f"{CLASSES}/admins-3g")
        three = profiles(tmp_path / "three.yaml", *LAYOUTS)
        res = publish(three, "-o", "json")
        assert res.returncode == 1, res  # one refused: said, the others made
        got = _json(res)
        assert got["create"] == ["mig-1g.10gb", "mig-2g.20gb"], got
        (refused,) = got["refused"]
        assert refused["name"] == "mig-3g.40gb" and "admins-3g" in refused["reason"], got
        assert set(ours(installed)) == {"mig-1g.10gb", "mig-2g.20gb"}
        made = ours(installed)["mig-2g.20gb"]["spec"]
        assert made["extendedResourceName"] == "nvidia.com/mig-2g.20gb"
        assert "profile == '2g.20gb'" in made["selectors"][0]["cel"]["expression"]

        # run again: in step, nothing written
        again = _json(publish(three, "-o", "json"))
        assert (again["create"], again["update"], again["delete"]) == ([], [], []), again
        assert again["unchanged"] == ["mig-1g.10gb", "mig-2g.20gb"]

        # an admin edits ours: put back; the layout all-2g.20gb removed: its class goes
        edited = ours(installed)["mig-1g.10gb"]
        edited["spec"]["selectors"] = [{"cel": {"expression": "true"}}]
        installed.api.request("PUT", f"{CLASSES}/mig-1g.10gb", edited)
        two = profiles(tmp_path / "two.yaml", "all-1g.10gb", "all-3g.40gb")
        got = _json(publish(two, "-o", "json"))
        assert (got["update"], got["delete"]) == (["mig-1g.10gb"], ["mig-2g.20gb"]), got
        assert set(ours(installed)) == {"mig-1g.10gb"}
        fixed = ours(installed)["mig-1g.10gb"]["spec"]["selectors"][0]["cel"]["expression"]
        assert "profile == '1g.10gb'" in fixed

        # the admin's class went through it all untouched
        after = installed.api.get(f"{CLASSES}/admins-3g")
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]

        # --remove: ours go, the admin's stays
        res = publish(None, "--remove")
        assert res.returncode == 0 and "delete   mig-1g.10gb" in res.stdout, res
        assert ours(installed) == {}
        assert installed.api.get(f"{CLASSES}/admins-3g")["metadata"]["name"] == "admins-3g"
    finally:
        installed.api.request("DELETE", f"{CLASSES}/admins-3g")


def test_the_publishers_account_may_write_only_classes_of_ours(
    installed: Cluster, publish: Publish
) -> None:
    kubeconfig = publish.kubeconfig
    installed.api.request("POST", CLASSES, _admins_class("admins-1g", MIG_1G, "1g.10gb"))
    try:

        def kubectl(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [str(installed.bin_dir / "kubectl"), f"--kubeconfig={kubeconfig}", *args],
                input=input,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )

        def denied() -> bool:  # a policy is in force a moment after it is made
            res = kubectl("delete", "deviceclass", "admins-1g", "--dry-run=server")
            assert res.returncode == 0 or "labelled app.kubernetes.io/managed-by" in res.stderr
            return res.returncode != 0

        wait_until(denied, timeout=30, what="the publisher's class policy in force")
        taken = _admins_class("admins-1g", MIG_1G, "1g.10gb")
        taken["metadata"]["labels"] = {OWNER_LABEL: OWNER}  # taking it over: refused too
        res = kubectl("replace", "-f", "-", input=json.dumps(taken))
        assert res.returncode != 0 and "managed-by=mig-agent" in res.stderr, res
        unlabelled = _admins_class("not-labelled", "example.com/x", "1g.10gb")
        res = kubectl("create", "-f", "-", input=json.dumps(unlabelled))
        assert res.returncode != 0 and "managed-by=mig-agent" in res.stderr, res
        # the RBAC: nothing but DeviceClasses
        res = kubectl("auth", "can-i", "list", "resourceslices.resource.k8s.io")
        assert res.stdout.strip() == "no", res
        assert installed.api.get(f"{CLASSES}/admins-1g").get("metadata", {}).get("labels") is None
    finally:
        installed.api.request("DELETE", f"{CLASSES}/admins-1g")


def test_advise_counts_a_pod_asking_a_mig_resource_as_demand_on_a_dra_node(
    agent_node: NodeFactory,
    installed: Cluster,
    publish: Publish,
    namespace: str,
    core: client.CoreV1Api,
    gpu_pod: GpuPodFactory,
) -> None:
    node = agent_node("2xH100-80GB", device_plugin="dra")  # MIG off: two whole GPUs
    gpu_pod(namespace, "wants-1g", resources={MIG_1G: 1}, node=node.name)
    wait_unschedulable(core, namespace, "wants-1g")
    selector = f"kubernetes.io/hostname={node.name}"

    def advise(*extra: str) -> subprocess.CompletedProcess[str]:
        kc = ["--kubeconfig", str(installed.kubeconfig)]
        return mig_agent_cli("advise", "-l", selector, *kc, *extra, timeout=240)

    res = advise("-o", "json")
    assert res.returncode == 0, explain(res, [node])
    data = json.loads(res.stdout)
    assert data["proposals"] == [], data  # no class: nothing on a DRA node serves the name
    assert [u["pod"] for u in data["unserved"]] == [f"{namespace}/wants-1g"], data

    assert publish(REPO / "profiles").returncode == 0
    res = advise("-o", "json")
    assert res.returncode == 0, explain(res, [node])
    [proposal] = json.loads(res.stdout)["proposals"]
    assert proposal["node"] == node.name and proposal["serves"] == [f"{namespace}/wants-1g"]
    assert proposal["resources_before"] == {"dra:gpu": 2}
    assert proposal["resources_after"].get(MIG_1G, 0) >= 1, proposal
    assert proposal["evicts"] == []

    res = advise("--apply")
    assert res.returncode == 0, explain(res, [node])
    assert f"{namespace}/wants-1g: scheduled on {node.name}" in res.stdout, res.stdout
    assert wait_running(core, namespace, "wants-1g", timeout=60).spec.node_name == node.name


def test_the_chart_renders_the_publisher_only_when_asked(
    helm: str, installed: Cluster, namespace: str
) -> None:
    def rendered(*values: str) -> list[dict[str, Any]]:
        out = run(helm, "template", "mig-agent", str(CHART), "-n", namespace, *values).stdout
        docs = [d for d in yaml.safe_load_all(out) if d]
        return [d for d in docs if d["metadata"]["name"].startswith("mig-agent-dra-classes")]

    assert rendered() == []
    docs = rendered("--set", "dra.deviceClasses=true")
    assert {(d["kind"], d["metadata"]["name"]) for d in docs} == {
        ("ServiceAccount", "mig-agent-dra-classes"),
        ("ClusterRole", "mig-agent-dra-classes"),
        ("ClusterRoleBinding", "mig-agent-dra-classes"),
        ("ValidatingAdmissionPolicy", "mig-agent-dra-classes-own-classes"),
        ("ValidatingAdmissionPolicyBinding", "mig-agent-dra-classes-own-classes"),
        ("Job", "mig-agent-dra-classes"),
        ("Job", "mig-agent-dra-classes-remove"),
    }
    by_kind = {d["kind"]: d for d in docs if not d["metadata"]["name"].endswith("-remove")}
    (remove,) = [d for d in docs if d["metadata"]["name"].endswith("-remove")]
    assert remove["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    (container,) = remove["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["dra-classes", "--remove", "--apply"]
    assert by_kind["ClusterRole"]["rules"] == [
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["deviceclasses"],
            "verbs": ["list", "create", "update", "delete"],
        }
    ]
    job = by_kind["Job"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "mig-agent-dra-classes"
    (container,) = pod["containers"]
    assert container["args"] == ["dra-classes", "--apply"]
    assert pod["volumes"][0]["configMap"]["name"] == "mig-agent-profiles"
    # the API server takes every object as rendered (a server-side dry run: nothing is made)
    installed.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": docs}
    ))  # fmt: skip
    theirs = rendered("--set", "dra.deviceClasses=true", "--set", "config.existingConfigMap=mine")
    job = next(d for d in theirs if d["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == "mine"
