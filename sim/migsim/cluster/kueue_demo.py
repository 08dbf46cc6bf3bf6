"""A queued Job admitted after a relabel, on the local cluster: Kueue's queue objects, the MIG
layout AdmissionCheck, Jobs queued as Kueue's Job webhook would make them, and the reads of what
Kueue made of them. The e2e test of the check (tests/e2e/test_admission_check.py), Kueue's own
tests (tests/cluster/test_kueue.py) and `scripts/demo --kueue` share them.

``python3 -m migsim.cluster.kueue_demo --dir DIR`` (scripts/demo --kueue) runs the demo on a
cluster whose GPU nodes (H100s, an agent on each) and Kueue run (``scripts/local-cluster up
--kueue``): the nodes put at all-1g.10gb, a ClusterQueue with quota for two
nvidia.com/mig-3g.40gb naming the check, one round of ``mig-agent admission-check --once`` (the
check marked Active), a Job of two pods asking one 3g.40gb each, which waits on the check; then
``mig-agent admission-check`` in the background, which relabels a node; the node's agent
reaches success, the check is marked Ready, Kueue admits the Workload and unsuspends the Job,
and its pods run on the node's new 3g.40gb devices. It prints each step, and stops the
controller at the end.

No webhook of Kueue's is registered (see migsim.cluster.kueue): Jobs are made suspended, with
the queue label.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Final

from . import kueue as kueue_sim
from .api import ApiError
from .cluster import Cluster
from .nodes import SIMULATED_IMAGE
from .waiting import wait_until

KUEUE: Final = f"/apis/{kueue_sim.API_VERSION}"
MIG_1G: Final = "nvidia.com/mig-1g.10gb"
MIG_3G: Final = "nvidia.com/mig-3g.40gb"
CONFIG: Final = "nvidia.com/mig.config"
STATE: Final = "nvidia.com/mig.config.state"
# the approved layouts: as the packaged profiles make them on an H100
LAYOUTS: Final = """
version: v1
mig-configs:
  all-1g.10gb:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
  all-3g.40gb:
    - devices: all
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
"""


class Queue:
    """A ResourceFlavor, a ClusterQueue (quota per resource, admission checks) and a LocalQueue
    in ``namespace``, all named after it; the cluster-wide ones deleted by ``delete``."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.cluster, self.namespace, self.name = cluster, namespace, namespace
        self.made: list[str] = []

    def create(self, quota: Mapping[str, int], checks: tuple[str, ...] = ()) -> None:
        self._post("/resourceflavors", {"metadata": {"name": self.name}, "spec": {}})
        resources = [{"name": r, "nominalQuota": n} for r, n in quota.items()]
        spec: dict[str, Any] = {
            "namespaceSelector": {},
            "resourceGroups": [
                {
                    "coveredResources": list(quota),
                    "flavors": [{"name": self.name, "resources": resources}],
                }
            ],
        }
        if checks:
            spec["admissionChecksStrategy"] = {"admissionChecks": [{"name": c} for c in checks]}
        self._post("/clusterqueues", {"metadata": {"name": self.name}, "spec": spec})
        self._post(
            f"/namespaces/{self.namespace}/localqueues",
            {"metadata": {"name": "lq"}, "spec": {"clusterQueue": self.name}},
        )

    def check(self, name: str, controller: str) -> None:
        """An AdmissionCheck of ``controller``, marked Active as its controller would: Kueue
        keeps a ClusterQueue naming an inactive check inactive, reserving no quota. Nothing
        else of the check is served: its workloads stay Pending on it."""
        self._post(
            "/admissionchecks", {"metadata": {"name": name}, "spec": {"controllerName": controller}}
        )
        active = {
            "type": "Active",
            "status": "True",
            "reason": "Active",
            "message": "marked by the test",
            "lastTransitionTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        self.cluster.api.request(
            "PATCH",
            f"{KUEUE}/admissionchecks/{name}/status",
            {"status": {"conditions": [active]}},
            content_type="application/merge-patch+json",
        )

    def _post(self, path: str, body: dict[str, Any]) -> None:
        kind = path.rsplit("/", 1)[1]
        self.cluster.api.request(
            "POST",
            KUEUE + path,
            {"apiVersion": kueue_sim.API_VERSION, **body, "kind": KINDS[kind]},
        )
        if not path.startswith("/namespaces/"):
            self.made.append(f"{KUEUE}{path}/{body['metadata']['name']}")

    def delete(self) -> None:
        """The namespace's Jobs and Workloads, then the queues, flavor and checks, each gone
        before the next: while Kueue still runs to take its finalizers off them. A Workload
        left behind would be demand to every later advise on this cluster."""
        api, ns = self.cluster.api, self.namespace
        api.request("DELETE", f"/apis/batch/v1/namespaces/{ns}/jobs?propagationPolicy=Background")
        api.request("DELETE", f"{KUEUE}/namespaces/{ns}/workloads")
        wait_until(
            lambda: not api.get(f"{KUEUE}/namespaces/{ns}/workloads")["items"],
            timeout=60,
            what=f"the Workloads of {ns} deleted",
        )
        for path in reversed(self.made):
            try:
                api.request("DELETE", path)
            except ApiError as e:
                if e.status != 404:
                    raise
            wait_until(partial(gone, api, path), timeout=60, what=f"{path} deleted")


def gone(api: Any, path: str) -> bool:
    try:
        api.get(path)
    except ApiError as e:
        if e.status == 404:
            return True
        raise
    return False


KINDS = {
    "resourceflavors": "ResourceFlavor",
    "clusterqueues": "ClusterQueue",
    "localqueues": "LocalQueue",
    "admissionchecks": "AdmissionCheck",
}


def workload(cluster: Cluster, namespace: str, job: str) -> dict[str, Any] | None:
    """The Workload Kueue made for ``job`` (owned by it), or None while there is none."""
    items = cluster.api.get(f"{KUEUE}/namespaces/{namespace}/workloads")["items"]
    for w in items:
        if any(o.get("name") == job for o in w["metadata"].get("ownerReferences") or ()):
            return dict(w)
    return None


def condition(workload: Mapping[str, Any] | None, kind: str) -> Mapping[str, Any]:
    for c in ((workload or {}).get("status") or {}).get("conditions") or ():
        if c["type"] == kind:
            return dict(c)
    return {}


def suspended(cluster: Cluster, namespace: str, job: str) -> bool:
    got = cluster.api.get(f"/apis/batch/v1/namespaces/{namespace}/jobs/{job}")
    return bool(got["spec"].get("suspend"))


def check_entry(cluster: Cluster, namespace: str, job: str) -> dict[str, Any]:
    """The first admission check entry of ``job``'s Workload ({} while there is none)."""
    w = workload(cluster, namespace, job)
    entries = ((w or {}).get("status") or {}).get("admissionChecks") or [{}]
    return dict(entries[0])


def job(
    cluster: Cluster,
    namespace: str,
    name: str,
    pods: int,
    resource: str,
    *,
    image: str = SIMULATED_IMAGE,
) -> None:
    """A Job of ``pods`` pods asking one ``resource`` each, queued to the LocalQueue ``lq`` as
    Kueue's webhook would (default image: the one the nodes' runtime has, no registry is
    reached)."""
    container = {
        "name": "work",
        "image": image,
        "resources": {"requests": {resource: "1"}, "limits": {resource: "1"}},
    }
    body = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {kueue_sim.QUEUE_LABEL: "lq"}},
        "spec": {
            "suspend": True,
            "parallelism": pods,
            "completions": pods,
            "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
        },
    }
    cluster.api.request("POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", body)


def layout_check(
    cluster: Cluster, queue: Queue, check: str, controller: str, quota: Mapping[str, int]
) -> None:
    """An AdmissionCheck ``check`` of ``controller`` (mig-agent's, left for it to mark Active),
    and ``queue`` made with ``quota``, naming it."""
    cluster.api.request(
        "POST",
        f"{KUEUE}/admissionchecks",
        {
            "apiVersion": kueue_sim.API_VERSION,
            "kind": "AdmissionCheck",
            "metadata": {"name": check},
            "spec": {"controllerName": controller},
        },
    )
    queue.made.append(f"{KUEUE}/admissionchecks/{check}")
    queue.create(quota, checks=(check,))


def admission_check_argv(
    controller: str, selector: str, layouts: Path, kubeconfig: Path, *extra: str
) -> list[str]:
    """``mig-agent admission-check`` serving ``controller`` over the nodes of ``selector``."""
    return [
        sys.executable,
        "-m",
        "mig_agent",
        "admission-check",
        "--controller-name",
        controller,
        "-l",
        selector,
        "-f",
        str(layouts),
        "--kubeconfig",
        str(kubeconfig),
        *extra,
    ]


# The demo (scripts/demo --kueue)
NAMESPACE: Final = "kueue-demo"
CHECK: Final = "mig-layout"
CONTROLLER: Final = "mig-agent.dev/mig-layout"
POOL: Final = "nvidia.com/gpu.present=true"
JOB: Final = "train"
START, TARGET = "all-1g.10gb", "all-3g.40gb"


def say(line: str) -> None:
    print(line, flush=True)


def _labels(cluster: Cluster, node: str) -> dict[str, str]:
    return dict(cluster.api.get(f"/api/v1/nodes/{node}")["metadata"].get("labels") or {})


def _devices(cluster: Cluster, node: str) -> dict[str, str]:
    """The node's allocatable GPU resources (those not 0)."""
    got = cluster.api.get(f"/api/v1/nodes/{node}")["status"].get("allocatable") or {}
    return {k: v for k, v in sorted(got.items()) if k.startswith("nvidia.com/") and v != "0"}


def _gpu_nodes(cluster: Cluster) -> list[str]:
    got = cluster.api.get(f"/api/v1/nodes?labelSelector={POOL.replace('=', '%3D')}")
    return sorted(n["metadata"]["name"] for n in got["items"])


def _ready_at_start(cluster: Cluster, node: str) -> bool:
    return _labels(cluster, node).get(STATE) == "success" and (
        _devices(cluster, node).get(MIG_1G) == "7"
    )


def _at_start(cluster: Cluster, nodes: Sequence[str]) -> None:
    """Every node of the pool at all-1g.10gb, its agent at success, its devices advertised."""
    for node in nodes:
        cluster.api.request(
            "PATCH",
            f"/api/v1/nodes/{node}",
            {"metadata": {"labels": {CONFIG: START}}},
            content_type="application/merge-patch+json",
        )
    for node in nodes:
        wait_until(
            partial(_ready_at_start, cluster, node),
            timeout=180,
            interval=0.5,
            what=f"{node} at {START}: success, 7 {MIG_1G} advertised",
        )
        say(f"{node}: {CONFIG}={START} {STATE}=success; devices {_devices(cluster, node)}")


class PodWatch:
    """The phases the pods of a Job go through, from a watch (kwok completes a Job's pods at
    once: polling could miss Running)."""

    def __init__(self, cluster: Cluster, namespace: str, job_name: str) -> None:
        self.path = (
            f"/api/v1/namespaces/{namespace}/pods"
            f"?labelSelector=batch.kubernetes.io/job-name%3D{job_name}"
        )
        self.cluster = cluster
        self.phases: dict[str, list[str]] = {}
        self.nodes: dict[str, str] = {}
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()
        time.sleep(1.0)  # the watch opened before the Job makes its pods

    def _run(self) -> None:
        try:
            for event in self.cluster.api.watch(self.path, timeout=600):
                pod = event.get("object") or {}
                name = pod.get("metadata", {}).get("name", "")
                phase = (pod.get("status") or {}).get("phase", "")
                with self._lock:
                    seen = self.phases.setdefault(name, [])
                    if phase and (not seen or seen[-1] != phase):
                        seen.append(phase)
                    if (pod.get("spec") or {}).get("nodeName"):
                        self.nodes[name] = pod["spec"]["nodeName"]
        except BaseException as e:  # reported by ran()
            self.error = e

    def ran(self, pods: int) -> dict[str, tuple[str, list[str]]]:
        """Each pod's node and phases once ``pods`` pods were seen Running; {} before."""
        if self.error is not None:
            raise self.error
        with self._lock:
            running = [p for p, seen in self.phases.items() if "Running" in seen]
            if len(running) < pods:
                return {}
            return {p: (self.nodes.get(p, ""), list(self.phases[p])) for p in sorted(running)}


def _controller_lines(log: Path) -> list[str]:
    """The decisions the background controller printed, each once, in order."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    out: list[str] = []
    for line in text.splitlines():
        if line and not line.startswith("{") and line not in out:
            out.append(line)
    return out


def _queued(cluster: Cluster, argv: list[str]) -> None:
    """The check marked Active by one round; the Job queued, waiting on the check."""
    once = subprocess.run(
        [*argv, "--once"], capture_output=True, text=True, timeout=120, check=False
    )
    if once.returncode != 0:
        raise SystemExit(f"mig-agent admission-check --once failed:\n{once.stderr}")
    say("== one round of mig-agent admission-check --once")
    for line in once.stdout.splitlines():
        say(f"  {line}")
    job(cluster, NAMESPACE, JOB, 2, MIG_3G)
    say(f"\n== Job {JOB}: 2 pods asking one {MIG_3G} each, queued to LocalQueue lq")

    def waiting() -> bool:
        w = workload(cluster, NAMESPACE, JOB)
        reserved = condition(w, "QuotaReserved").get("status") == "True"
        return reserved and check_entry(cluster, NAMESPACE, JOB).get("state") == "Pending"

    wait_until(waiting, timeout=120, interval=0.25, what=f"{JOB}'s Workload waiting on {CHECK}")
    w = workload(cluster, NAMESPACE, JOB) or {}
    say(f"job/{JOB}: suspended={str(suspended(cluster, NAMESPACE, JOB)).lower()}")
    say(
        f"workload/{w['metadata']['name']}: QuotaReserved=True, "
        f"Admitted={condition(w, 'Admitted').get('status', 'False')}; "
        f"check {CHECK}: {check_entry(cluster, NAMESPACE, JOB).get('state')}"
    )


def _admitted(cluster: Cluster, nodes: Sequence[str], log: Path, pods: PodWatch) -> None:
    """What the background controller, the agent and Kueue do, as they do it."""

    def relabelled() -> str:
        return next((n for n in nodes if _labels(cluster, n).get(CONFIG) != START), "")

    node = wait_until(relabelled, timeout=120, interval=0.2, what="a node relabelled")
    say(f"\n== the check relabelled {node}")
    shown = _controller_lines(log)
    for line in shown:
        say(f"  controller: {line}")
    states: list[str] = []

    def success() -> bool:
        labels = _labels(cluster, node)
        state = labels.get(STATE, "")
        if not states or states[-1] != state:
            states.append(state)
        return state == "success" and _devices(cluster, node).get(MIG_3G) == "2"

    wait_until(success, timeout=180, interval=0.2, what=f"{node} at success with {MIG_3G}")
    say(f"{node}: {CONFIG}={_labels(cluster, node)[CONFIG]}; {STATE}: {' -> '.join(states)}")
    say(f"{node}: devices {_devices(cluster, node)}")

    def admitted() -> bool:
        w = workload(cluster, NAMESPACE, JOB)
        return condition(w, "Admitted").get("status") == "True"

    wait_until(admitted, timeout=120, interval=0.25, what=f"{JOB} admitted")
    w = workload(cluster, NAMESPACE, JOB) or {}
    say(f"\n== Kueue admitted workload/{w['metadata']['name']}")
    entry = check_entry(cluster, NAMESPACE, JOB)
    say(f"check {CHECK}: {entry.get('state')}: {entry.get('message', '')}")
    wait_until(
        lambda: not suspended(cluster, NAMESPACE, JOB), timeout=60, what=f"{JOB} unsuspended"
    )
    say(f"job/{JOB}: suspended=false")
    ran = wait_until(lambda: pods.ran(2), timeout=120, interval=0.2, what=f"{JOB}'s pods Running")
    for pod, (on, phases) in ran.items():
        say(f"pod/{pod} on {on} ({MIG_3G}: 1): {' -> '.join(phases)}")
    for line in _controller_lines(log)[len(shown) :]:
        say(f"  controller: {line}")


def run(cluster: Cluster) -> None:
    nodes = _gpu_nodes(cluster)
    if not nodes:
        raise SystemExit(f"no node labelled {POOL}: scripts/local-cluster up --nodes 1")
    say(f"== the GPU nodes at {START}")
    _at_start(cluster, nodes)
    layouts = cluster.dir / "kueue-demo" / "layouts.yaml"
    layouts.parent.mkdir(parents=True, exist_ok=True)
    layouts.write_text(LAYOUTS)
    try:
        cluster.api.request("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
    except ApiError as e:
        if e.status != 409:
            raise
    layout_check(cluster, Queue(cluster, NAMESPACE), CHECK, CONTROLLER, {MIG_3G: 2})
    say(
        f"\n== ClusterQueue {NAMESPACE}: quota for 2 {MIG_3G}, AdmissionCheck {CHECK} "
        f"(controller {CONTROLLER}); LocalQueue {NAMESPACE}/lq"
    )
    argv = admission_check_argv(CONTROLLER, POOL, layouts, cluster.kubeconfig)
    _queued(cluster, argv)
    log = cluster.dir / "logs" / "admission-check.log"
    pods = PodWatch(cluster, NAMESPACE, JOB)
    pods.start()
    say(f"\n== mig-agent admission-check in the background (its log: {log})")
    with log.open("a") as out:
        proc = subprocess.Popen(
            [*argv, "--interval", "1"], stdout=out, stderr=subprocess.STDOUT, text=True
        )
    try:
        _admitted(cluster, nodes, log, pods)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        say("\n== mig-agent admission-check stopped")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m migsim.cluster.kueue_demo", description=__doc__)
    p.add_argument("--dir", type=Path, required=True, help="the local cluster's folder")
    args = p.parse_args(argv)
    run(Cluster.load(args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
