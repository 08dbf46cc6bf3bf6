"""``verify`` deletes its pods by its run's label whatever ends the run, against the local
cluster's real API server (its pods run on a simulated node, kwok's: Running until deleted):

* a pod whose create's answer was lost (the proxy of tests/cluster/test_kube_retries.py forwards
  the create and resets the connection) is found by the create's repeat, judged, and deleted;
* ``mig-agent verify`` told SIGTERM while its pod runs deletes it and exits 130, as on Ctrl-C.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kubernetes import client, watch
from migsim.cluster import Cluster

from mig_agent.config.settings import Settings
from mig_agent.core.gpu_models import MODELS
from mig_agent.core.snapshot import compact, empty_node
from mig_agent.kube.client import KubernetesCluster
from mig_agent.node.waits import Clock
from mig_agent.ops.verify import verify_node
from mig_agent.ops.verify_pods import LABEL, LABEL_VALUE, PodSpec
from tests.cluster.test_kube_retries import LosingProxy

if TYPE_CHECKING:
    from tests.conftest import GpuNodeFactory

REPO = Path(__file__).resolve().parents[2]
S = Settings()
VERIFY_PODS = f"{LABEL}={LABEL_VALUE}"


def _published_node(core: client.CoreV1Api, gpu_node_factory: GpuNodeFactory) -> str:
    """A simulated node of 8 H100s without MIG, its GPU state published as its agent would."""
    node = gpu_node_factory("8xH100-80GB")
    state, models = empty_node([MODELS["H100-80GB"]] * 8)
    annotations = {S.gpu_state_annotation: compact(state, models)}
    core.patch_node(node, {"metadata": {"annotations": annotations}})
    return node


def _deleted(core: client.CoreV1Api, namespace: str) -> list[str]:
    """verify's pods in ``namespace`` not (yet) deleted: gone, or with a deletionTimestamp."""
    pods = core.list_namespaced_pod(namespace, label_selector=VERIFY_PODS).items
    return [p.metadata.name for p in pods if p.metadata.deletion_timestamp is None]


def test_a_pod_whose_create_answer_was_lost_is_judged_and_deleted(
    cluster: Cluster,
    core: client.CoreV1Api,
    namespace: str,
    gpu_node_factory: GpuNodeFactory,
    tmp_path: Path,
) -> None:
    """Before: the create's repeat met 409, the check said "the pod could not be made", and the
    pod, made by the first try, was never deleted: bound to the node, holding a device."""
    node = _published_node(core, gpu_node_factory)
    proxy = LosingProxy(
        cluster.server,
        cert=cluster.dir / "pki" / "serving.crt",
        key=cluster.dir / "pki" / "serving.key",
        ca=cluster.ca_cert,
        method="POST",
        suffix="/pods",
    )
    via = tmp_path / "via-proxy.kubeconfig"
    via.write_text(cluster.kubeconfig.read_text().replace(cluster.server, proxy.url))
    k = KubernetesCluster.connect(str(via), sleep=lambda _s: None)
    now = [0.0]
    clock = Clock(now=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    lines: list[str] = []
    spec = PodSpec(runtime_class="", namespace=namespace, timeout_s=1)
    try:
        verdict = verify_node(k, node, pods=spec, settings=S, clock=clock, out=lines.append)
    finally:
        k.close()
        proxy.stop()
    assert proxy.hits["lost"] == 1 and proxy.counts["create pods"] == 2
    [pod_check] = [c for c in verdict.checks if c.name == "pod nvidia.com/gpu"]
    # judged: kwok's pod runs until deleted, so it had not ended at the (fake) timeout
    assert "not ended after 1 s" in pod_check.detail, lines
    assert proxy.counts["delete pods"] == 1
    assert _deleted(core, namespace) == []


def test_sigterm_while_verifys_pod_runs_deletes_it(
    cluster: Cluster, core: client.CoreV1Api, namespace: str, gpu_node_factory: GpuNodeFactory
) -> None:
    """Before: SIGTERM ended the process at once, past verify's clean-up: the pod stayed."""
    node = _published_node(core, gpu_node_factory)
    args = ["verify", node, "--kubeconfig", str(cluster.kubeconfig), "--runtime-class", ""]
    args += ["--pod-namespace", namespace, "--pod-timeout", "300"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mig_agent", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        made = _first_pod(core, namespace)
        proc.send_signal(signal.SIGTERM)
        said, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert made.startswith("mig-agent-verify-gpu-")
    assert proc.returncode == 130, said
    assert "interrupted" in said
    assert _deleted(core, namespace) == []


def _first_pod(core: client.CoreV1Api, namespace: str) -> str:
    """The name of verify's first pod in ``namespace``, from a watch of its pods."""
    w = watch.Watch()
    for event in w.stream(
        core.list_namespaced_pod, namespace, label_selector=VERIFY_PODS, timeout_seconds=60
    ):
        if event["type"] == "ADDED":
            w.stop()
            return str(event["object"].metadata.name)
    raise AssertionError("verify made no pod within 60 s")
