"""The local cluster: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok; loopback.

Everything lives in one folder (default `$MIG_AGENT_CLUSTER_DIR` or `~/.cache/mig-agent/cluster`):

    cluster.json       ports, the processes started (PID + start time), binaries used
    admin.kubeconfig   system:masters, bearer token
    tokens.csv         the API server's static token file (the admin token)
    kwok.yaml          kwok's Stages (see kwok_stages)
    pki/               CA, serving certificate, service-account key pair
    etcd/              etcd data
    logs/<name>.log    one log per process
    nodes/<node>/      per simulated node (later: that node's simulated GPU state)

Every `up` starts an empty cluster (new keys, new etcd data) unless one is already running there, in
which case it is reused. `down` stops exactly the processes recorded in cluster.json and keeps the
folder, logs included, for a post-mortem; `down(purge=True)` removes it too.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import kubeconfig, kwok_stages, nodes, pki
from .agent_records import stop_all
from .api import Api, ApiError, probe
from .errors import BinariesMissing, ClusterNotRunning, DevClusterError, WaitTimeout
from .kueue_record import stop_recorded as stop_kueue
from .processes import Proc, free_ports, spawn, stop
from .waiting import wait_until

ADMIN_USER = "devcluster-admin"
_STATE_VERSION = 1
# Start order; `down` stops in reverse, so etcd outlives every client of it.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
_PORT_NAMES = (
    "etcd",
    "etcd-peer",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
)

# Controllers the tests and the agent rely on, and nothing heavier: no volume, CSR, cloud, IPAM,
# HPA or endpoint controllers. clusterrole-aggregation fills the built-in admin/edit/view roles;
# taint-eviction-controller and podgc clean up after nodes that die, as in a real cluster.
# The components that run with leader election in a real control plane (kubeadm's default,
# and every HA set-up): an API server gone longer than their renew deadline makes them lose
# their lease and exit, and the kubelet starts them again, with fresh informers. Here each runs
# alone with --leader-elect=false and would ride the outage out instead, its informers and work
# queues backing off (client-go) for up to a minute and more after the API server is back.
LEADER_ELECTED = ("kube-controller-manager", "kube-scheduler")
RENEW_DEADLINE_S = 10.0  # --leader-elect-renew-deadline's default

KCM_CONTROLLERS = (
    "clusterrole-aggregation-controller",
    "daemonset-controller",
    "deployment-controller",
    "disruption-controller",
    "garbage-collector-controller",
    "job-controller",
    "namespace-controller",
    "node-lifecycle-controller",
    "pod-garbage-collector-controller",
    "replicaset-controller",
    "root-ca-certificate-publisher-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "statefulset-controller",
    "taint-eviction-controller",
    "ttl-after-finished-controller",
    "validatingadmissionpolicy-status-controller",
)


# Node labels that DaemonSets select on (the device plugin's, as the GPU Operator deploys it).
DEFERRED_LABELS = ("nvidia.com/gpu.deploy.device-plugin",)


def default_dir() -> Path:
    env = os.environ.get("MIG_AGENT_CLUSTER_DIR")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "mig-agent" / "cluster"


def find_binaries() -> Path:
    """The folder holding the six binaries, as `scripts/k8s-binaries path` reports it.

    The script is the one place that knows versions and the cache layout; asking it keeps this
    module from growing a second copy of that knowledge. `MIG_AGENT_K8S_BIN` is honoured by the
    script, and used directly when the package runs outside the repository (no script at hand).
    """
    script = Path(__file__).resolve().parents[3] / "scripts" / "k8s-binaries"
    hint = "Kubernetes binaries not built; run: scripts/k8s-binaries build"
    if script.is_file():
        res = subprocess.run([str(script), "path"], capture_output=True, text=True, check=False)
        if res.returncode != 0:  # the script says what is missing and how to build it
            raise BinariesMissing(res.stderr.strip() or hint)
        return Path(res.stdout.strip())
    env = os.environ.get("MIG_AGENT_K8S_BIN")
    if env and all((Path(env) / c).is_file() for c in (*COMPONENTS, "kubectl")):
        return Path(env)
    raise BinariesMissing(f"{hint} (or set MIG_AGENT_K8S_BIN to a folder holding them)")


@dataclass
class State:
    """What cluster.json records: enough to find, probe and stop a running cluster."""

    bin_dir: str
    ports: dict[str, int]
    processes: list[dict[str, Any]] = field(default_factory=list)
    version: int = _STATE_VERSION

    @property
    def procs(self) -> list[Proc]:
        return [Proc(**p) for p in self.processes]


@dataclass(frozen=True, slots=True)
class ComponentStatus:
    name: str
    pid: int
    running: bool
    healthy: bool
    rss_bytes: int


class Cluster:
    """A running local cluster. Get one with `Cluster.up(...)` or `Cluster.attach(...)`."""

    def __init__(self, directory: Path, state: State) -> None:
        self.dir = directory
        self.state = state
        self.bin_dir = Path(state.bin_dir)
        self.api = Api(self.server, self.ca_cert, self.admin_token)
        self._deferred: dict[str, dict[str, str]] = {}  # node -> labels set once it is Ready

    # ---- files and addresses ---------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (user in system:masters)."""
        return self.dir / "admin.kubeconfig"

    @property
    def ca_cert(self) -> Path:
        return self.dir / "pki" / "ca.crt"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.state.ports['kube-apiserver']}"

    @property
    def admin_token(self) -> str:
        return (self.dir / "tokens.csv").read_text().split(",", 1)[0]

    def node_dir(self, node: str) -> Path:
        """The per-node folder (for that node's simulated GPU state)."""
        return self.dir / "nodes" / node

    # ---- lifecycle -------------------------------------------------------------------------

    @classmethod
    def up(
        cls,
        directory: Path | None = None,
        *,
        gpu_nodes: int = 2,
        gpus: str | Sequence[str] = nodes.DEFAULT_GPUS,
        cpu_nodes: int = 0,
        pod_delete_delay: float = 2.0,
        timeout: float = 120.0,
        log: Callable[[str], None] | None = None,
    ) -> Cluster:
        """Start a cluster in `directory` (or reuse the healthy one already running there).

        Registers `gpu_nodes` nodes `gpu-node-<i>`, each with the GPUs `gpus` names (`8xH100-80GB`,
        or `4xA100-40GB,4xA30` for a mixed node; a list gives node i its entry i, cycling), and
        `cpu_nodes` nodes `cpu-node-<i>`; returns once all are Ready and schedulable. Pods being
        deleted linger `pod_delete_delay` seconds (kwok_stages).
        """
        directory = (directory or default_dir()).resolve()
        say = log or (lambda _msg: None)
        specs = [gpus] if isinstance(gpus, str) else list(gpus)
        if gpu_nodes and not specs:
            raise ValueError("gpu_nodes > 0 but no GPU spec given")
        # Built before anything starts, so that a misspelt GPU model costs no cluster start.
        manifests = [
            nodes.gpu_node_manifest(f"gpu-node-{i}", specs[i % len(specs)])
            for i in range(gpu_nodes)
        ]
        manifests += [nodes.cpu_node_manifest(f"cpu-node-{i}") for i in range(cpu_nodes)]
        directory.mkdir(parents=True, exist_ok=True)
        with _locked(directory):
            existing = _load_state(directory)
            if existing is not None:
                cluster = cls(directory, existing)
                if cluster.healthy():
                    say(f"cluster already up in {directory}")
                    return cluster
                say("found a cluster that is not healthy; stopping what is left of it")
                stop(list(reversed(existing.procs)))
            bin_dir = find_binaries()
            cluster = cls._start(directory, bin_dir, pod_delete_delay, timeout, say)
            try:
                names = [cluster.add_node(m, wait=False) for m in manifests]
                cluster.wait_nodes_ready(names, timeout=timeout)
            except BaseException:
                stop(list(reversed(cluster.state.procs)))
                raise
            say(f"{len(names)} node(s) ready: {', '.join(names) or '-'}")
            return cluster

    @classmethod
    def load(cls, directory: Path | None = None) -> Cluster:
        """The cluster recorded in `directory`, healthy or not; ClusterNotRunning if none is."""
        directory = (directory or default_dir()).resolve()
        state = _load_state(directory)
        if state is None:
            raise ClusterNotRunning(f"no cluster in {directory}; run: scripts/local-cluster up")
        return cls(directory, state)

    @classmethod
    def attach(cls, directory: Path | None = None) -> Cluster:
        """The cluster running in `directory`; ClusterNotRunning if none is, or it is unhealthy."""
        cluster = cls.load(directory)
        directory = cluster.dir
        if not cluster.healthy():
            raise ClusterNotRunning(
                f"the cluster in {directory} is not healthy; see "
                f"`scripts/local-cluster status` and {directory / 'logs'}"
            )
        return cluster

    @classmethod
    def _start(
        cls,
        directory: Path,
        bin_dir: Path,
        pod_delete_delay: float,
        timeout: float,
        say: Callable[[str], None],
    ) -> Cluster:
        # A fresh cluster every time: stale keys or etcd data from an earlier run would only
        # confuse (old nodes, tokens signed by a key that no longer exists).
        for sub in ("pki", "etcd", "logs", "nodes"):
            shutil.rmtree(directory / sub, ignore_errors=True)
        ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES)), strict=True))
        state = State(bin_dir=str(bin_dir), ports=ports)
        keys = pki.generate(directory / "pki")
        token = secrets.token_urlsafe(32)
        tokens = directory / "tokens.csv"
        tokens.touch(mode=0o600)
        tokens.write_text(f'{token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        (directory / "kwok.yaml").write_text(kwok_stages.config(round(pod_delete_delay * 1000)))
        _save_state(directory, state)
        cluster = cls(directory, state)
        kubeconfig.write(
            cluster.kubeconfig,
            server=cluster.server,
            ca_cert=keys.ca_cert,
            user=ADMIN_USER,
            token=token,
        )
        started = time.monotonic()
        try:
            # etcd, then the API server, each healthy before the next; the API server's clients
            # (KCM, scheduler, kwok) start together.
            for group in (COMPONENTS[:1], COMPONENTS[1:2], COMPONENTS[2:]):
                for name in group:
                    cluster._launch(name, cluster._args(name, keys))
                for name in group:
                    cluster._wait_healthy(name, timeout)
        except BaseException:
            stop(list(reversed(cluster.state.procs)))
            raise
        say(f"control plane up in {time.monotonic() - started:.1f} s at {cluster.server}")
        return cluster

    def down(self, *, purge: bool = False) -> list[str]:
        """Stop this cluster's processes; the names of those that had to be killed (SIGKILL)."""
        return down(self.dir, purge=purge)

    # ---- processes -------------------------------------------------------------------------

    def _bin(self, name: str) -> str:
        return str(self.bin_dir / name)

    def _launch(self, name: str, args: Sequence[str]) -> None:
        proc = spawn(name, [self._bin(name), *args], self.dir / "logs" / f"{name}.log")
        # Recorded at once, so that `down` can stop it even if this `up` dies a moment later.
        self.state.processes.append(asdict(proc))
        _save_state(self.dir, self.state)

    def _wait_healthy(self, name: str, timeout: float) -> None:
        proc = next(p for p in self.state.procs if p.name == name)

        def ready_or_dead() -> bool:
            if not proc.alive():
                raise DevClusterError(f"{name} exited during start-up:\n{self._log_tail(name)}")
            return self._component_healthy(name)

        try:
            wait_until(ready_or_dead, timeout=timeout, what=f"{name} to become healthy")
        except DevClusterError as e:
            if proc.alive():  # a timeout: show what the process said meanwhile
                raise DevClusterError(f"{e}\n{self._log_tail(name)}") from None
            raise

    def _log_tail(self, name: str, lines: int = 15) -> str:
        path = self.dir / "logs" / f"{name}.log"
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {path})"
        return "\n".join(f"  {line}" for line in tail) + f"\n(full log: {path})"

    def _args(self, name: str, keys: pki.Pki) -> list[str]:
        if name == "etcd":
            return self._etcd_args()
        if name == "kube-apiserver":
            return self._apiserver_args(keys)
        return self._component_args(name, keys)

    def _etcd_args(self) -> list[str]:
        p = self.state.ports
        peer = f"http://127.0.0.1:{p['etcd-peer']}"
        client = f"http://127.0.0.1:{p['etcd']}"
        return [
            "--name=devcluster",
            f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=devcluster={peer}",
            # Throwaway data: no fsync (the biggest cost on slow disks), a small backend quota and
            # frequent compaction keep disk and memory small.
            "--unsafe-no-fsync=true",
            "--quota-backend-bytes=536870912",
            "--auto-compaction-mode=periodic",
            "--auto-compaction-retention=5m",
            "--snapshot-count=10000",
            "--log-level=warn",
        ]

    def _apiserver_args(self, keys: pki.Pki) -> list[str]:
        p = self.state.ports
        return [
            f"--etcd-servers=http://127.0.0.1:{p['etcd']}",
            # Without an explicit advertise address the API server looks for a routable host
            # interface, and fails on hosts that have none.
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={p['kube-apiserver']}",
            f"--tls-cert-file={keys.serving_cert}",
            f"--tls-private-key-file={keys.serving_key}",
            f"--client-ca-file={keys.ca_cert}",
            # The front-proxy settings kubeadm gives every cluster. Nothing here proxies, but
            # without them KCM and the scheduler, which read these settings to authenticate their
            # own callers, log "missing content for CA bundle" every few seconds.
            f"--requestheader-client-ca-file={keys.ca_cert}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--token-auth-file={self.dir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            # Service-account tokens (TokenRequest); the public key must be given explicitly,
            # it is not derived from the signing key.
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-signing-key-file={keys.sa_private_key}",
            f"--service-account-key-file={keys.sa_public_key}",
            f"--service-cluster-ip-range={pki.SERVICE_CIDR}",
            # Nothing runs inside pods that could dial the `kubernetes` Service, so its endpoints
            # are not maintained (kwokctl does the same).
            "--endpoint-reconciler-type=none",
            # Privileged DaemonSet pods (device plugin, the agent) must be admissible.
            "--allow-privileged=true",
            "--event-ttl=30m",
            # A real node's kubelet is reached at the InternalIP it reports (127.0.0.1): nothing
            # here resolves node names (kubectl logs, exec).
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            f"--kubelet-client-certificate={keys.kubelet_client_cert}",
            f"--kubelet-client-key={keys.kubelet_client_key}",
        ]

    def _component_args(self, name: str, keys: pki.Pki) -> list[str]:
        p = self.state.ports
        kc = str(self.kubeconfig)
        serving = [
            "--bind-address=127.0.0.1",
            f"--secure-port={p[name]}",
            f"--tls-cert-file={keys.serving_cert}",
            f"--tls-private-key-file={keys.serving_key}",
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--leader-elect=false",
        ]
        if name == "kube-controller-manager":
            return [
                *serving,
                f"--controllers={','.join(KCM_CONTROLLERS)}",
                f"--service-account-private-key-file={keys.sa_private_key}",
                f"--root-ca-file={keys.ca_cert}",
            ]
        if name == "kube-scheduler":
            return serving
        if name == "kwok":
            return [
                f"--kubeconfig={kc}",
                f"--config={self.dir / 'kwok.yaml'}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={'='.join(nodes.KWOK_ANNOTATION)}",
                "--node-lease-duration-seconds=40",
                "--cidr=10.244.0.0/16",
                f"--server-address=127.0.0.1:{p['kwok']}",
            ]
        raise ValueError(name)

    def _component_healthy(self, name: str) -> bool:
        port = self.state.ports[name]
        if name == "etcd":
            return probe(f"http://127.0.0.1:{port}/health", None)
        if name == "kube-apiserver":
            return self.api.ok("/readyz")
        if name == "kwok":
            return probe(f"http://127.0.0.1:{port}/healthz", None)
        return probe(f"https://127.0.0.1:{port}/healthz", self.ca_cert)

    def status(self) -> list[ComponentStatus]:
        """Per process: running (same PID and start time), healthy (its health endpoint), RSS."""
        statuses = []
        for p in self.state.procs:
            alive = p.alive()
            healthy = alive and self._component_healthy(p.name)
            statuses.append(ComponentStatus(p.name, p.pid, alive, healthy, p.rss_bytes()))
        return statuses

    def healthy(self) -> bool:
        statuses = self.status()
        return len(statuses) == len(COMPONENTS) and all(s.healthy for s in statuses)

    def restart(
        self,
        names: Sequence[str] = ("etcd", "kube-apiserver"),
        *,
        down_s: float = 0.0,
        timeout: float = 60.0,
        leader_election: bool = True,
    ) -> float:
        """Stop `names` (default: etcd and the API server; etcd keeps its data), wait `down_s`
        seconds, start them again in start order and wait until each is healthy: a control-plane
        restart as its clients see it. The seconds from the stop until all were healthy.

        With `leader_election`, as in a real control plane: when the API server was down longer
        than the renew deadline of the leader-elected components (LEADER_ELECTED, 10 s), those
        lost their lease and were restarted; here they are restarted once the API server is
        back (not counted in the seconds returned)."""
        if unknown := set(names) - set(COMPONENTS):
            raise ValueError(f"no component {sorted(unknown)}; one of {COMPONENTS}")
        ordered = [n for n in COMPONENTS if n in names]
        started = time.monotonic()
        stop([p for p in reversed(self.state.procs) if p.name in ordered])
        time.sleep(down_s)
        keys = self._keys()
        for name in ordered:
            self._respawn(name, keys, timeout)
        seconds = time.monotonic() - started
        if leader_election and "kube-apiserver" in ordered and seconds > RENEW_DEADLINE_S:
            lost = [n for n in LEADER_ELECTED if n not in ordered]
            stop([p for p in reversed(self.state.procs) if p.name in lost])
            for name in lost:
                self._respawn(name, keys, timeout)
        return seconds

    def _keys(self) -> pki.Pki:
        d = self.dir / "pki"
        return pki.Pki(
            ca_cert=d / "ca.crt",
            serving_cert=d / "serving.crt",
            serving_key=d / "serving.key",
            sa_private_key=d / "sa.key",
            sa_public_key=d / "sa.pub",
            kubelet_client_cert=d / "kubelet-client.crt",
            kubelet_client_key=d / "kubelet-client.key",
        )

    def _respawn(self, name: str, keys: pki.Pki, timeout: float) -> None:
        """Start component `name` again in place of its stopped process; wait until healthy."""
        proc = spawn(
            name, [self._bin(name), *self._args(name, keys)], self.dir / "logs" / f"{name}.log"
        )
        at = next(i for i, p in enumerate(self.state.processes) if p["name"] == name)
        self.state.processes[at] = asdict(proc)
        _save_state(self.dir, self.state)
        self._wait_healthy(name, timeout)

    def rss_bytes(self) -> int:
        """Resident memory of all the cluster's processes together."""
        return sum(p.rss_bytes() for p in self.state.procs)

    # ---- Kubernetes objects ----------------------------------------------------------------

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0
    ) -> str:
        """Run kubectl as the admin; its stdout. DevClusterError with stderr on failure."""
        res = subprocess.run(
            [self._bin("kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and res.returncode != 0:
            raise DevClusterError(f"kubectl {' '.join(args)}: {res.stderr.strip()}")
        return res.stdout

    def add_node(
        self, manifest: Mapping[str, Any], *, wait: bool = True, timeout: float = 60.0
    ) -> str:
        """Create a simulated node from `manifest` (see `nodes`); its name."""
        name = str(manifest["metadata"]["name"])
        self.node_dir(name).mkdir(parents=True, exist_ok=True)
        gpus = manifest["metadata"].get("annotations", {}).get(nodes.GPUS_ANNOTATION)
        if gpus:  # the node's GPU inventory, for whatever simulates this node's GPUs
            (self.node_dir(name) / "gpus").write_text(gpus + "\n")
        # Labels that bring DaemonSet pods are set once kwok manages the node: a pod bound to a
        # node kwok does not manage yet can be missed by it for good (its pod event seen before
        # the node, its re-list of the node's pods made before the binding), and would stay
        # Pending on a Ready node.
        labels = dict(manifest["metadata"].get("labels") or {})
        deferred = {k: labels.pop(k) for k in DEFERRED_LABELS if k in labels}
        body = {**manifest, "metadata": {**manifest["metadata"], "labels": labels}}
        self.api.request("POST", "/api/v1/nodes", body)
        if deferred:
            self._deferred[name] = deferred
        if wait:
            self.wait_nodes_ready([name], timeout=timeout)
        return name

    def add_gpu_node(
        self,
        name: str,
        gpus: str = nodes.DEFAULT_GPUS,
        *,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[Mapping[str, str]] = (),
        wait: bool = True,
        timeout: float = 60.0,
    ) -> str:
        """Register a simulated GPU node (`gpus` like `8xH100-80GB`); wait until schedulable."""
        manifest = nodes.gpu_node_manifest(name, gpus, extra_labels=labels, taints=taints)
        return self.add_node(manifest, wait=wait, timeout=timeout)

    def add_cpu_node(
        self,
        name: str,
        *,
        labels: Mapping[str, str] | None = None,
        wait: bool = True,
        timeout: float = 60.0,
    ) -> str:
        """Register a simulated node without GPUs."""
        return self.add_node(
            nodes.cpu_node_manifest(name, extra_labels=labels), wait=wait, timeout=timeout
        )

    def delete_node(self, name: str) -> None:
        """Remove a simulated node (its pods are then garbage-collected by KCM's pod GC)."""
        with contextlib.suppress(ApiError):
            self.api.request("DELETE", f"/api/v1/nodes/{name}")
        shutil.rmtree(self.node_dir(name), ignore_errors=True)

    def wait_nodes_ready(self, names: Sequence[str], *, timeout: float = 60.0) -> None:
        """Wait until each node is Ready and has no `node.kubernetes.io/*` taint left.

        A new Node is created with `node.kubernetes.io/not-ready:NoSchedule` (admission plugin
        TaintNodesByCondition); KCM's node-lifecycle controller removes it once kwok reports Ready.
        Until then the scheduler would not place pods there, so "Ready" alone is not enough.
        """
        pending = set(names)

        def all_schedulable() -> bool:
            for item in self.api.get("/api/v1/nodes")["items"]:
                if item["metadata"]["name"] in pending and _schedulable(item):
                    pending.discard(item["metadata"]["name"])
            return not pending

        try:
            wait_until(
                all_schedulable,
                timeout=timeout,
                interval=0.2,
                what="nodes to be Ready and untainted",
            )
        except WaitTimeout:
            raise WaitTimeout(
                f"nodes not Ready and untainted after {timeout:g} s: {', '.join(sorted(pending))}"
            ) from None
        for name in names:
            labels = self._deferred.pop(name, None)
            if labels:
                self.api.request(
                    "PATCH",
                    f"/api/v1/nodes/{name}",
                    {"metadata": {"labels": labels}},
                    content_type="application/merge-patch+json",
                )

    def token_for(
        self,
        namespace: str,
        serviceaccount: str,
        *,
        seconds: int = 86400,
        bound_pod: tuple[str, str] | None = None,
    ) -> str:
        """A token for the ServiceAccount (TokenRequest API); the account must exist.

        `bound_pod=(name, uid)` binds the token to that pod, as the kubelet does for a pod's
        projected token: it then dies with the pod, and the API server adds the pod's node name to
        the token's user info (`authentication.kubernetes.io/node-name`), which admission policies
        can check.
        """
        spec: dict[str, Any] = {"expirationSeconds": seconds}
        if bound_pod is not None:
            spec["boundObjectRef"] = {
                "kind": "Pod",
                "apiVersion": "v1",
                "name": bound_pod[0],
                "uid": bound_pod[1],
            }
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{serviceaccount}/token"
        return str(self.api.request("POST", path, body)["status"]["token"])

    def kubeconfig_for(
        self,
        namespace: str,
        serviceaccount: str,
        path: Path,
        *,
        seconds: int = 86400,
        bound_pod: tuple[str, str] | None = None,
    ) -> Path:
        """Write a kubeconfig at `path` that acts as the ServiceAccount (default namespace set)."""
        token = self.token_for(namespace, serviceaccount, seconds=seconds, bound_pod=bound_pod)
        return kubeconfig.write(
            path,
            server=self.server,
            ca_cert=self.ca_cert,
            user=f"system:serviceaccount:{namespace}:{serviceaccount}",
            token=token,
            namespace=namespace,
        )


class ViaProxy(Cluster):
    """The cluster, but the kubeconfigs it writes (an agent's, a manager's) name `url`: a proxy
    in front of the API server (migsim.cluster.api_faults) that counts requests or answers
    faults."""

    def __init__(self, cluster: Cluster, url: str) -> None:
        self.dir, self.state, self.bin_dir, self.api = (
            cluster.dir,
            cluster.state,
            cluster.bin_dir,
            cluster.api,
        )
        self._url = url
        self._deferred = cluster._deferred

    @property
    def server(self) -> str:
        return self._url


def _schedulable(node: Mapping[str, Any]) -> bool:
    conditions = node.get("status", {}).get("conditions") or []
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
    taints = node.get("spec", {}).get("taints") or []
    return ready and not any(t["key"].startswith("node.kubernetes.io/") for t in taints)


def down(directory: Path | None = None, *, purge: bool = False) -> list[str]:
    """Stop the cluster recorded in `directory` (only its own processes); names that needed SIGKILL.

    Safe to call when nothing runs. With `purge`, the folder is removed afterwards.
    """
    directory = (directory or default_dir()).resolve()
    if not directory.exists():
        return []
    agents_killed = stop_all(directory) + stop_kueue(directory)
    with _locked(directory):
        state = _load_state(directory)
        killed = agents_killed + (stop(list(reversed(state.procs))) if state is not None else [])
        if state is not None:
            state.processes = []
            _save_state(directory, state)
    if purge:
        shutil.rmtree(directory, ignore_errors=True)
    return killed


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Serialise `up` and `down` on one folder (two shells, or pytest workers, at the same time)."""
    with (directory / ".lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load_state(directory: Path) -> State | None:
    """The recorded state if it names at least one process, else None."""
    try:
        raw = json.loads((directory / "cluster.json").read_text())
    except (OSError, ValueError):
        return None
    if raw.get("version") != _STATE_VERSION or not raw.get("processes"):
        return None
    return State(**raw)


def _save_state(directory: Path, state: State) -> None:
    # Written to a temporary name and renamed: a reader (status, another up) never sees half a file.
    tmp = directory / "cluster.json.tmp"
    tmp.write_text(json.dumps(asdict(state), indent=2) + "\n")
    tmp.replace(directory / "cluster.json")
