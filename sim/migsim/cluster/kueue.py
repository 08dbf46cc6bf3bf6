"""Kueue's own controller (sigs.k8s.io/kueue, the version `scripts/kueue-binary` pins) on the
local cluster, on request: `start(cluster)` applies Kueue's CRDs, runs the `kueue` binary against
the API server with a config file of its own, and returns once Kueue is ready; `Kueue.stop()`
(or the cluster's `down`) stops it. Kueue's scheduler and admission, and Kubernetes' Job
controller, do the work; nothing here stands in for them.

Webhooks: none is registered with the API server (no Mutating- or ValidatingWebhookConfiguration),
so the API server never calls Kueue. What that changes for a test:

- a Job is not suspended for Kueue on creation (that is the Job webhook's work): tests create
  their Jobs with `spec.suspend: true` and the label `kueue.x-k8s.io/queue-name` themselves;
  Kueue's Job reconciler then makes the Workload, and unsuspends the Job once it is admitted;
- objects are neither defaulted nor validated by Kueue's webhooks: tests write them in full;
- every client speaks `kueue.x-k8s.io/v1beta2`, Kueue v0.17's storage version: the CRDs name a
  conversion webhook (Kueue's internal certificate management refuses to start without one to
  put its CA into), which nobody serves, so a read or write in v1beta1 of a converted kind
  (Workload, ClusterQueue, LocalQueue, Cohort, MultiKueueCluster) fails here.

Why internal certificate management stays on: turned off, Kueue reads its metrics server's
certificate from the fixed path /etc/kueue/metrics/certs and exits without one there. On, it
writes its CA into the Secret `kueue-webhook-server-cert` (made empty here, as Kueue's manifests
do) and into the CRDs' conversion webhooks, and waits for the webhook certificate in its cert
folder, which is given the cluster's serving certificate beforehand (out of a pod, no kubelet
mounts the Secret there). The webhook server listens on 127.0.0.1 all the same, answering no one.

Files, under the cluster's folder: `kueue/config.yaml`, `kueue/certs/`, `logs/kueue.log`, and
`kueue.json` (the process, for `down` and for another shell to stop it).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import yaml

from .api import ApiError, probe
from .errors import BinariesMissing, DevClusterError
from .kueue_record import KEY as _KEY
from .kueue_record import RECORDS, stop_recorded
from .processes import Proc, free_ports, spawn
from .waiting import wait_until

if TYPE_CHECKING:
    from .cluster import Cluster

API_VERSION: Final = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
NAMESPACE: Final = "kueue-system"
SECRET: Final = "kueue-webhook-server-cert"  # Kueue's default webhookSecretName
SERVICE: Final = "kueue-webhook-service"  # Kueue's default webhookServiceName
# the CRDs whose conversion webhook Kueue's certificate rotator fills in (pkg/util/cert)
CONVERTED: Final = (
    "localqueues.kueue.x-k8s.io",
    "clusterqueues.kueue.x-k8s.io",
    "workloads.kueue.x-k8s.io",
    "cohorts.kueue.x-k8s.io",
    "multikueueclusters.kueue.x-k8s.io",
)


def find_kueue() -> Path:
    """The folder `scripts/kueue-binary path` reports (bin/kueue, crd/*.yaml); BinariesMissing
    with the script's hint when it is not built. `MIG_AGENT_KUEUE` is honoured by the script,
    and used directly when the package runs outside the repository."""
    script = Path(__file__).resolve().parents[3] / "scripts" / "kueue-binary"
    hint = "kueue is not built: scripts/kueue-binary build"
    if script.is_file():
        res = subprocess.run([str(script), "path"], capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise BinariesMissing(res.stderr.strip() or hint)
        return Path(res.stdout.strip())
    env = os.environ.get("MIG_AGENT_KUEUE")
    if env and (Path(env) / "bin" / "kueue").is_file():
        return Path(env)
    raise BinariesMissing(f"{hint} (or set MIG_AGENT_KUEUE to a folder holding bin/kueue, crd/)")


@dataclass(frozen=True, slots=True)
class Kueue:
    """A running Kueue controller of the cluster in `directory`."""

    directory: Path
    proc: Proc
    health_port: int

    @property
    def log(self) -> Path:
        return self.directory / "logs" / "kueue.log"

    def ready(self) -> bool:
        return probe(f"http://127.0.0.1:{self.health_port}/readyz", None)

    def stop(self) -> list[str]:
        """Stop the controller (the CRDs and Kueue's objects stay); names needing SIGKILL."""
        return stop_recorded(self.directory)


def crd_manifests(crd_dir: Path) -> list[dict[str, Any]]:
    """Kueue's CRDs as the module ships them, those Kueue converts given a conversion webhook
    (the Service named in Kueue's own kustomize patches), so that its CA has somewhere to go."""
    out = []
    for path in sorted(crd_dir.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["metadata"]["name"] in CONVERTED:
            crd = copy.deepcopy(crd)
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": {
                        "service": {"namespace": NAMESPACE, "name": SERVICE, "path": "/convert"}
                    },
                    "conversionReviewVersions": ["v1"],
                },
            }
        out.append(crd)
    return out


def config(health_port: int, webhook_port: int, cert_dir: Path) -> dict[str, Any]:
    """Kueue's Configuration: no leader election, no metrics server, only batch/job managed."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": SERVICE,
            "webhookSecretName": SECRET,
        },
        "integrations": {"frameworks": ["batch/job"]},
    }


def start(cluster: Cluster, *, timeout: float = 120.0) -> Kueue:
    """Apply the CRDs, start Kueue against `cluster`, wait until it is ready; the controller.
    A Kueue this cluster already runs is stopped first."""
    home = find_kueue()
    stop_recorded(cluster.dir)
    _apply_crds(cluster, home / "crd", timeout)
    _prepare_namespace(cluster)
    work = cluster.dir / "kueue"
    certs = work / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cluster.dir / "pki" / "serving.crt", certs / "tls.crt")
    shutil.copyfile(cluster.dir / "pki" / "serving.key", certs / "tls.key")
    health, webhook, visibility = free_ports(3)
    (work / "config.yaml").write_text(yaml.safe_dump(config(health, webhook, certs)))
    argv = [
        str(home / "bin" / "kueue"),
        f"--config={work / 'config.yaml'}",
        # the pending-workloads API is an aggregated API server: not registered here
        "--feature-gates=VisibilityOnDemand=false",
        f"--visibility-server-port={visibility}",
    ]
    log = cluster.dir / "logs" / "kueue.log"
    proc = spawn("kueue", argv, log, env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)})
    with RECORDS.locked(cluster.dir):
        RECORDS.save(cluster.dir, {_KEY: {_KEY: asdict(proc)}})
    kueue = Kueue(cluster.dir, proc, health)

    def ready_or_dead() -> bool:
        if not proc.alive():
            raise DevClusterError(f"kueue exited during start-up:\n{_tail(log)}")
        return kueue.ready()

    try:
        wait_until(ready_or_dead, timeout=timeout, interval=0.25, what="kueue to become ready")
    except BaseException:
        kueue.stop()
        raise
    return kueue


def _apply_crds(cluster: Cluster, crd_dir: Path, timeout: float) -> None:
    crds = crd_manifests(crd_dir)
    # server-side: the Workload CRD is too big for the last-applied annotation
    cluster.kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=migsim-kueue",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": crds}),
        timeout=timeout,
    )
    names = [str(c["metadata"]["name"]) for c in crds]

    def established() -> bool:
        for name in names:
            got = cluster.api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            conditions = (got.get("status") or {}).get("conditions") or []
            if not any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                return False
        return True

    wait_until(established, timeout=timeout, interval=0.2, what="Kueue's CRDs established")


def _prepare_namespace(cluster: Cluster) -> None:
    """Kueue's namespace and the empty Secret its certificate rotator fills."""
    for path, body in (
        ("/api/v1/namespaces", {"metadata": {"name": NAMESPACE}}),
        (f"/api/v1/namespaces/{NAMESPACE}/secrets", {"metadata": {"name": SECRET}}),
    ):
        try:
            cluster.api.request("POST", path, body)
        except ApiError as e:
            if e.status != 409:  # made by an earlier start: kept
                raise


def _tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {log})"
