"""The node runtime of one simulated GPU node: what the kubelet and NFD do there, with NVIDIA's own
device plugin and GPU Feature Discovery (GFD) running over the node's simulated GPUs.

Run it inside ``scripts/with-sim-gpus --host-view STATE`` (root: a private mount namespace), so
that it and NVIDIA's binaries share a private ``/var/lib/kubelet/device-plugins`` and the
simulated libnvidia-ml.so.1 answers for the node in STATE. It

* serves the kubelet's device-plugin Registration API on ``kubelet.sock`` (migsim.kubelet) and
  consumes ListAndWatch from the plugins that register;
* watches the node's device-plugin DaemonSet pod and runs ``nvidia-device-plugin`` (with the
  node's MIG strategy and optional config file) while one runs (phase Running, not being
  deleted; its Ready condition aside, as a kubelet runs a container whatever the API says of
  its readiness): a new pod (new UID)
  starts it afresh, no pod stops it; a plugin that exits while its pod runs is restarted with a
  back-off, as a kubelet restarts a container;
* writes the node's capacity and allocatable of what the plugins advertise, as the kubelet does:
  capacity = devices listed, allocatable = healthy devices; a stopped plugin's resource stays with
  allocatable 0 for the stop grace period, then goes; other resources of the node are kept;
* gives the GPU pods kwok runs on the node devices (free healthy ones, all of a pod's or none),
  calls the plugin's Allocate for them, starts a simulated GPU process on each device while the
  pod runs, and serves the kubelet's PodResources API (List, GetAllocatableResources) from those
  allocations (migsim.device_plugin's Allocations and PodProcesses);
* with ``--gfd``, runs ``gpu-feature-discovery --oneshot`` writing a features file at start and
  each time the plugin starts (after every repartition the agent restarts the plugin: the only
  time the GPUs' labels change), and, as NFD does, puts its labels on the Node (and takes away
  the ones it put there that GFD no longer writes). One-shot runs cost nothing between them, where
  GFD's own loop would read every GPU every interval on every node.

``python -m migsim.node_runtime --node NAME --cluster-dir DIR --sim-state STATE --nvidia-bin DIR
[--pod-resources-socket PATH] [--mig-strategy mixed|single] [--config-file FILE] [--gfd]``

Must not: change GPUs (the simulated processes aside), or touch pods other than reading them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog

from mig_agent.core.errors import MigAgentError
from mig_agent.kube.client import KubernetesCluster
from mig_agent.kube.cluster import PodRef, PodView, is_gpu_resource
from mig_agent.observability.logs import configure_logging
from migsim import podresources_server
from migsim.cluster.api import Api, ApiError
from migsim.cluster.cluster import Cluster as LocalCluster
from migsim.device_plugin import Allocations, Device, PodProcesses, sync_pods
from migsim.kubelet import DEFAULT_DIR, HEALTHY, DeviceManager
from migsim.nvml import state as simstate

log = structlog.get_logger(__name__)

PLUGIN_NS: Final = "gpu-operator"
PLUGIN_SELECTOR: Final = "app=nvidia-device-plugin-daemonset"
# NFD's record of the labels it put on a node (it removes those, and only those, that go away).
FEATURE_LABELS_ANNOTATION: Final = "nfd.node.kubernetes.io/feature-labels"
# A crashing plugin container is restarted after this back-off (first, cap), doubling.
RESTART_BACKOFF: Final = (2.0, 30.0)


# -- the plugin process -------------------------------------------------------------------------


class Child:
    """A process the runtime runs (the plugin, GFD), its output appended to ``log_file``."""

    def __init__(self, name: str, argv: Sequence[str], log_file: Path) -> None:
        self.name, self.argv, self.log_file = name, list(argv), log_file
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.starts = 0

    def start(self) -> None:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,  # noqa: S603
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.started_at = time.monotonic()
        self.starts += 1
        log.info("node_runtime.started", process=self.name, pid=self.proc.pid)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        """The exit code of a process that ran and ended; None while it runs or never ran."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        log.info("node_runtime.stopped", process=self.name, code=self.proc.returncode)
        self.proc = None


# -- devices ------------------------------------------------------------------------------------


def device_places(sim_state: str) -> dict[str, tuple[int, int, int]]:
    """GPU UUID or MIG device UUID -> (GPU index, GI, CI) (-1, -1 for a whole GPU)."""
    node = simstate.load_node(sim_state)
    out: dict[str, tuple[int, int, int]] = {}
    for index, gpu in enumerate(node.gpus):
        out[gpu.uuid] = (index, -1, -1)
        for gi in gpu.gpu_instances:
            for ci in gi.compute_instances:
                out[ci.uuid] = (index, gi.id, ci.id)
    return out


def offered(
    listed: Mapping[str, Mapping[str, str]], places: Mapping[str, tuple[int, int, int]]
) -> tuple[Device, ...]:
    """The devices the plugins list, as the device table offers them: ordered by GPU, GI, CI,
    then id (a time-sliced replica ``<uuid>::<n>`` sits on its device). A device whose UUID the
    GPUs no longer have (a stopped plugin's, after a repartition) is offered unhealthy."""
    out = []
    for resource, devices in listed.items():
        for device_id, health in devices.items():
            place = places.get(device_id.split("::", 1)[0])
            gpu, gi, ci = place if place is not None else (-1, -1, -1)
            out.append(
                Device(
                    resource,
                    device_id,
                    gpu,
                    gi,
                    ci,
                    healthy=health == HEALTHY and place is not None,
                )
            )
    return tuple(sorted(out, key=lambda d: (d.gpu, d.gi_id, d.ci_id, _replica(d.id), d.id)))


def _replica(device_id: str) -> int:
    _, _, n = device_id.partition("::")
    return int(n) if n.isdigit() else -1


# -- node status and labels ---------------------------------------------------------------------


def status_patch(
    node_status: Mapping[str, Any], capacity: Mapping[str, int], allocatable: Mapping[str, int]
) -> dict[str, Any] | None:
    """The merge patch that makes the node's status say ``capacity``/``allocatable`` for the
    device plugins' resources: GPU resources no plugin lists any more are removed, others kept.
    None when nothing would change."""
    patch: dict[str, dict[str, str | None]] = {}
    for key, want in (("capacity", capacity), ("allocatable", allocatable)):
        have = dict(node_status.get(key) or {})
        diff: dict[str, str | None] = {r: str(n) for r, n in want.items() if have.get(r) != str(n)}
        diff |= {r: None for r in have if is_gpu_resource(r) and r not in want}
        if diff:
            patch[key] = diff
    return {"status": patch} if patch else None


def read_features(path: Path) -> dict[str, str] | None:
    """The labels of an NFD features file (``name=value`` lines, ``#`` comments); None when
    there is no file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            name, value = line.split("=", 1)
            out[name] = value
    return out


def label_patch(
    labels: Mapping[str, str], annotations: Mapping[str, str], features: Mapping[str, str]
) -> tuple[dict[str, str | None], str]:
    """(label changes, new annotation value) that make the node carry ``features`` as NFD does:
    set them, and remove the ones NFD set before (named in its annotation) that are gone."""
    before = {n for n in annotations.get(FEATURE_LABELS_ANNOTATION, "").split(",") if n}
    changes: dict[str, str | None] = {k: v for k, v in features.items() if labels.get(k) != v}
    changes |= {k: None for k in before - features.keys() if k in labels}
    return changes, ",".join(sorted(features))


# -- the runtime --------------------------------------------------------------------------------


@dataclass
class Options:
    node: str
    cluster_dir: Path
    sim_state: str
    nvidia_bin: Path
    log_dir: Path
    pod_resources_socket: str = ""
    mig_strategy: str = "mixed"
    config_file: str = ""
    gfd: bool = False
    features_file: Path | None = None
    allocations_file: Path | None = None
    plugin_dir: str = DEFAULT_DIR
    namespace: str = PLUGIN_NS
    selector: str = PLUGIN_SELECTOR
    stop_grace_s: float = 300.0
    poll_s: float = 0.5
    kubeconfig: str = ""
    extra_plugin_args: list[str] = field(default_factory=list)


class Runtime:
    def __init__(self, opts: Options, cluster: KubernetesCluster, api: Api) -> None:
        self.o, self.cluster, self.api = opts, cluster, api
        self.manager = DeviceManager(opts.plugin_dir, stop_grace_s=opts.stop_grace_s)
        self.table = Allocations()
        self.processes = PodProcesses(opts.sim_state)
        self.plugin = Child(
            "nvidia-device-plugin",
            self._plugin_argv(),
            opts.log_dir / f"nvidia-device-plugin-{opts.node}.log",
        )
        self.gfd: Child | None = None
        if opts.gfd:
            self.gfd = Child(
                "gpu-feature-discovery",
                self._gfd_argv(),
                opts.log_dir / f"gpu-feature-discovery-{opts.node}.log",
            )
        self.pod_uid: str | None = None  # the plugin pod the running plugin belongs to
        self.backoff = RESTART_BACKOFF[0]
        self.restart_at: float | None = None
        self.envs: dict[PodRef, dict[str, str]] = {}  # what Allocate answered, per pod
        self.features_text: str | None = None
        self.written: dict[str, Any] | None = None
        self.registered_at: float | None = None
        self.gfd_due = True  # a one-shot GFD run is wanted (at start, on every plugin start)
        self.gfd_retry_at = 0.0

    def _plugin_argv(self) -> list[str]:
        argv = [
            str(self.o.nvidia_bin / "nvidia-device-plugin"),
            f"--mig-strategy={self.o.mig_strategy}",
        ]
        if self.o.config_file:
            argv.append(f"--config-file={self.o.config_file}")
        return argv + self.o.extra_plugin_args

    def _gfd_argv(self) -> list[str]:
        assert self.o.features_file is not None
        argv = [
            str(self.o.nvidia_bin / "gpu-feature-discovery"),
            "--oneshot",
            "--use-node-feature-api=false",
            "--no-timestamp",
            f"--mig-strategy={self.o.mig_strategy}",
            f"--output-file={self.o.features_file}",
        ]
        if self.o.config_file:
            argv.append(f"--config-file={self.o.config_file}")
        return argv

    # one pass
    def step(self) -> None:
        pods = self.cluster.list_pods(node=self.o.node)
        self._plugin_lifecycle(pods)
        listed = self.manager.devices()
        self._write_status(listed)
        if self.o.pod_resources_socket:
            self._allocate(listed, pods)
        if self.gfd is not None:
            self._gfd()

    def _plugin_lifecycle(self, pods: list[PodView]) -> None:
        running = plugin_pods(pods, self.o.namespace, self.o.selector)
        uid = running[0].ref.uid if running else None
        now = time.monotonic()
        if uid != self.pod_uid:
            if self.plugin.proc is not None:
                self.plugin.stop()
            self.pod_uid, self.backoff, self.restart_at = uid, RESTART_BACKOFF[0], None
            if uid is not None:
                log.info("node_runtime.plugin_pod", node=self.o.node, pod=running[0].ref.name)
                self.plugin.start()
                self.registered_at = None
                self.gfd_due = True
            return
        if uid is None or self.plugin.running():
            return
        if self.restart_at is None:  # it exited while its pod runs: restart after a back-off
            log.warning(
                "node_runtime.plugin_exited",
                node=self.o.node,
                code=self.plugin.exit_code(),
                restart_in_s=self.backoff,
                log=str(self.plugin.log_file),
            )
            self.restart_at = now + self.backoff
            self.backoff = min(self.backoff * 2, RESTART_BACKOFF[1])
        elif now >= self.restart_at:
            self.restart_at = None
            self.plugin.start()

    def _write_status(self, listed: Mapping[str, Mapping[str, str]]) -> None:
        capacity = {r: len(d) for r, d in listed.items()}
        allocatable = {r: sum(h == HEALTHY for h in d.values()) for r, d in listed.items()}
        want = {"capacity": capacity, "allocatable": allocatable}
        if want == self.written:
            return
        node = self.api.get(f"/api/v1/nodes/{self.o.node}")
        patch = status_patch(node.get("status") or {}, capacity, allocatable)
        if patch is not None:
            self.api.request(
                "PATCH",
                f"/api/v1/nodes/{self.o.node}/status",
                patch,
                content_type="application/merge-patch+json",
            )
            if self.registered_at is None and allocatable and self.plugin.running():
                self.registered_at = time.monotonic()
                log.info(
                    "node_runtime.advertised",
                    node=self.o.node,
                    resources=allocatable,
                    after_s=round(self.registered_at - self.plugin.started_at, 3),
                )
            else:
                log.info(
                    "node_runtime.resources",
                    node=self.o.node,
                    capacity=capacity,
                    allocatable=allocatable,
                )
        self.written = want

    def _allocate(self, listed: Mapping[str, Mapping[str, str]], pods: list[PodView]) -> None:
        devices = offered(listed, device_places(self.o.sim_state))
        for ref, device in self.table.offer(devices):
            log.info(
                "node_runtime.device_gone",
                node=self.o.node,
                pod=str(ref),
                device=device.id,
                resource=device.resource,
            )
        sync_pods(self.o.node, self.table, self.processes, pods, admit=self._admit)
        held = self.table.held()
        for ref in [r for r in self.envs if r not in held]:
            del self.envs[ref]
        if self.o.allocations_file is not None:
            _write_json(
                self.o.allocations_file,
                {
                    f"{ref.namespace}/{ref.name}": {
                        "uid": ref.uid,
                        "devices": {
                            r: [d.id for d in got if d.resource == r]
                            for r in sorted({d.resource for d in got})
                        },
                        "env": self.envs.get(ref, {}),
                    }
                    for ref, got in sorted(held.items(), key=lambda kv: str(kv[0]))
                },
            )

    def _admit(self, ref: PodRef, devices: tuple[Device, ...]) -> bool:
        """The kubelet's Allocate call, one per resource the pod gets."""
        env: dict[str, str] = {}
        for resource in sorted({d.resource for d in devices}):
            ids = [d.id for d in devices if d.resource == resource]
            try:
                env |= self.manager.allocate(resource, ids)
            except Exception as exc:  # noqa: BLE001 - grpc errors, a plugin gone: admission fails
                log.warning(
                    "node_runtime.allocate_failed",
                    node=self.o.node,
                    pod=str(ref),
                    resource=resource,
                    error=str(exc),
                )
                return False
        self.envs[ref] = env
        log.info(
            "node_runtime.allocate",
            node=self.o.node,
            pod=str(ref),
            visible=env.get("NVIDIA_VISIBLE_DEVICES", ""),
        )
        return True

    def _gfd(self) -> None:
        assert self.gfd is not None and self.o.features_file is not None
        if self.gfd.running():
            return
        code = self.gfd.exit_code()
        if code is not None:  # a run ended
            self.gfd.proc = None
            if code != 0:
                log.warning(
                    "node_runtime.gfd_failed",
                    node=self.o.node,
                    code=code,
                    log=str(self.gfd.log_file),
                )
                self.gfd_due, self.gfd_retry_at = True, time.monotonic() + 10
                return
            self._publish_features()
        if self.gfd_due and time.monotonic() >= self.gfd_retry_at:
            self.gfd_due = False
            self.gfd.start()

    def _publish_features(self) -> None:
        """Put GFD's labels on the Node, as NFD does (only when the file says something new)."""
        assert self.o.features_file is not None
        try:
            text = self.o.features_file.read_text()
        except FileNotFoundError:
            return
        if text == self.features_text:
            return
        features = read_features(self.o.features_file) or {}
        node = self.cluster.get_node(self.o.node)
        changes, owned = label_patch(node.labels, node.annotations, features)
        if changes or node.annotations.get(FEATURE_LABELS_ANNOTATION) != owned:
            self.cluster.patch_node(
                self.o.node, labels=changes, annotations={FEATURE_LABELS_ANNOTATION: owned}
            )
            log.info("node_runtime.labels", node=self.o.node, changed=changes)
        self.features_text = text

    def run(self, stop: threading.Event) -> None:
        self.manager.start()
        server = None
        if self.o.pod_resources_socket:
            server = podresources_server.serve(
                self.o.pod_resources_socket, self.table.by_pod, allocatable=self.table.allocatable
            )
        log.info(
            "node_runtime.serving",
            node=self.o.node,
            kubelet=self.manager.socket_path,
            pod_resources=self.o.pod_resources_socket,
        )
        try:
            while not stop.is_set():
                try:
                    self.step()
                except (MigAgentError, ApiError, OSError) as exc:
                    log.warning("node_runtime.error", node=self.o.node, error=str(exc))
                    self.written = None
                with self.manager.changed:  # a plugin's update wakes the loop at once
                    self.manager.changed.wait(self.o.poll_s)
        finally:
            self.plugin.stop()
            if self.gfd is not None:
                self.gfd.stop()
            self.manager.stop()
            if server is not None:
                server.stop()


def plugin_pods(pods: Sequence[PodView], namespace: str, selector: str) -> list[PodView]:
    """The device plugin pods whose container runs on the node, as a kubelet sees it: the pod
    is Running and not being deleted. Its Ready condition is no part of that: it is a report in
    the API, which the node-lifecycle controller sets False when it misses the node's heartbeats
    (after an API server restart, say) and a kubelet sets True again; kwok plays a pod's stages
    once and never does, so a plugin stopped on it would stay stopped for good."""
    return [
        p
        for p in pods
        if p.ref.namespace == namespace
        and _selected(p, selector)
        and p.phase == "Running"
        and not p.terminating
    ]


def _selected(pod: PodView, selector: str) -> bool:
    """Whether the pod's labels match an equality selector (``k=v,k2=v2``)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, _, value = term.partition("=")
        if pod.labels.get(key.strip()) != value.strip().lstrip("="):
            return False
    return True


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


# -- command line -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m migsim.node_runtime",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--node", required=True)
    p.add_argument("--cluster-dir", required=True, type=Path, help="the local cluster's folder")
    p.add_argument("--kubeconfig", default="", help="default: the cluster's admin kubeconfig")
    p.add_argument("--sim-state", required=True, help="the node's simulated GPU state file")
    p.add_argument(
        "--nvidia-bin",
        required=True,
        type=Path,
        help="folder of nvidia-device-plugin and gpu-feature-discovery",
    )
    p.add_argument("--log-dir", type=Path, default=None, help="default: <cluster-dir>/logs")
    p.add_argument("--pod-resources-socket", default="")
    p.add_argument(
        "--allocations-file",
        type=Path,
        default=None,
        help="write each pod's devices and Allocate environment there (JSON)",
    )
    p.add_argument("--mig-strategy", choices=["mixed", "single", "none"], default="mixed")
    p.add_argument("--config-file", default="", help="the device plugin's (and GFD's) config")
    p.add_argument("--gfd", action="store_true", help="run gpu-feature-discovery, label the node")
    p.add_argument(
        "--features-file",
        type=Path,
        default=None,
        help="GFD's output (default: <log-dir>/../nodes/<node>/features.d/gfd)",
    )
    p.add_argument("--namespace", default=PLUGIN_NS)
    p.add_argument("--selector", default=PLUGIN_SELECTOR)
    p.add_argument(
        "--stop-grace",
        type=float,
        default=300.0,
        help="seconds a stopped plugin's resource stays (the kubelet's 5 min)",
    )
    p.add_argument("--log-format", choices=["json", "console"], default="json")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format)
    local = LocalCluster.load(args.cluster_dir)
    node_dir = local.node_dir(args.node)
    opts = Options(
        node=args.node,
        cluster_dir=local.dir,
        sim_state=args.sim_state,
        nvidia_bin=args.nvidia_bin,
        log_dir=args.log_dir or local.dir / "logs",
        pod_resources_socket=args.pod_resources_socket,
        mig_strategy=args.mig_strategy,
        config_file=args.config_file,
        gfd=args.gfd,
        features_file=args.features_file or node_dir / "features.d" / "gfd",
        allocations_file=args.allocations_file,
        namespace=args.namespace,
        selector=args.selector,
        stop_grace_s=args.stop_grace,
    )
    assert opts.features_file is not None
    opts.features_file.parent.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    cluster = KubernetesCluster.connect(
        args.kubeconfig or str(local.kubeconfig), component="sim-node-runtime"
    )
    try:
        Runtime(opts, cluster, local.api).run(stop)
    finally:
        cluster.close()
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
