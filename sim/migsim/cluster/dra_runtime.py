"""The kubelet's part for NVIDIA's DRA kubelet plugin on one kwok node: run gpu-kubelet-plugin
(dra_plugin.launch) while the node's DRA driver pod runs, as a kubelet runs its `gpus` container.

`python -m migsim.cluster.dra_runtime --cluster-dir DIR --node NODE --state STATE [--namespace NS]
[--selector app=...] [-- PLUGIN FLAGS...]` polls the node's pods (every --poll-s) and

* starts the plugin when a pod of the selector runs there (phase Running, not being deleted; its
  Ready condition aside, as in node_runtime.plugin_pods), with `--feature-gates=<value>` when the
  pod's `gpus` container has FEATURE_GATES in its env;
* restarts it afresh for a pod with a new UID: the plugin reads the GPUs only when it starts, so
  an agent that deletes the pod after a layout change gets slices of the new devices;
* stops it when no such pod is left (slices stay, as the plugin leaves them);
* restarts a plugin that exits while its pod runs, after a back-off (RESTART_BACKOFF, doubling).

An API server that does not answer changes nothing: a kubelet keeps its containers running.
`start` spawns the follower and records it (agent_records.DRA_RECORDS, `runtime`), beside the
plugin it records itself (`plugin`), so that `stop_dra_plugins` -- the cluster's `down`,
agents.stop_node -- stops both, even a plugin left by a follower that was killed. Logs (JSON) go
to <cluster-dir>/logs/dra-runtime-<node>.log, the plugin's to dra-plugin-<node>.log.

Must not: change GPUs, or touch pods other than reading them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import structlog

from mig_agent.observability.logs import configure_logging

from . import dra_plugin
from .agent_records import forget_dra, reap_group, record_dra, stop_dra_plugins
from .api import Api, ApiError
from .cluster import Cluster
from .errors import DevClusterError
from .processes import Proc, spawn, stop

log = structlog.get_logger(__name__)

SELECTOR: Final = f"app={dra_plugin.APP}"
POLL_S: Final = 0.3
# A plugin that exits while its pod runs is started again after this back-off (first, cap),
# doubling: shorter than a kubelet's 10 s to 5 min, so that tests see it.
RESTART_BACKOFF: Final = (1.0, 16.0)


@dataclass(frozen=True, slots=True)
class PluginPod:
    """The node's DRA driver pod whose container runs."""

    name: str
    uid: str
    feature_gates: str  # FEATURE_GATES of its `gpus` container; "" when it has none


def running_pod(pods: Sequence[Mapping[str, Any]]) -> PluginPod | None:
    """The pod (API objects of the node's pods of the selector) whose container runs, as a
    kubelet sees it: Running and not being deleted; the oldest if there are several."""
    live = [
        p
        for p in pods
        if (p.get("status") or {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
    ]
    if not live:
        return None
    pod = min(live, key=lambda p: str(p["metadata"].get("creationTimestamp", "")))
    return PluginPod(pod["metadata"]["name"], pod["metadata"]["uid"], _feature_gates(pod))


def _feature_gates(pod: Mapping[str, Any]) -> str:
    for container in pod["spec"].get("containers") or []:
        if container.get("name") == dra_plugin.CONTAINER:
            for env in container.get("env") or []:
                if env.get("name") == dra_plugin.FEATURE_GATES_ENV:
                    return str(env.get("value", ""))
    return ""


class Plugin(Protocol):
    """A started plugin, as the follower needs it."""

    def running(self) -> bool: ...

    def exit_code(self) -> int | None: ...

    def stop(self) -> None: ...


class Follower:
    """Decides when the node's plugin runs; `launch` starts one for a pod (raising
    DevClusterError, RuntimeError or OSError when it cannot, which counts as an exit)."""

    def __init__(
        self,
        node: str,
        launch: Callable[[PluginPod], Plugin],
        *,
        clock: Callable[[], float] = time.monotonic,
        backoff: tuple[float, float] = RESTART_BACKOFF,
    ) -> None:
        self.node, self._launch, self._clock, self._backoffs = node, launch, clock, backoff
        self.plugin: Plugin | None = None
        self.pod_uid: str | None = None  # the pod the plugin runs for
        self.backoff = backoff[0]
        self.restart_at: float | None = None
        self.starts = 0

    def step(self, pod: PluginPod | None) -> None:
        """One pass over what the API says runs on the node now."""
        uid = pod.uid if pod is not None else None
        if uid != self.pod_uid:
            if self.plugin is not None:
                self.stop("pod_replaced" if pod is not None else "pod_gone")
            self.pod_uid, self.backoff, self.restart_at = uid, self._backoffs[0], None
            if pod is not None:
                self._start(pod, "pod_running")
            return
        if pod is None or (self.plugin is not None and self.plugin.running()):
            return
        now = self._clock()
        if self.restart_at is None:  # it exited while its pod runs: restart after a back-off
            log.warning(
                "dra_runtime.plugin_exited",
                node=self.node,
                pod=pod.name,
                code=self.plugin.exit_code() if self.plugin is not None else None,
                restart_in_s=self.backoff,
            )
            self.restart_at = now + self.backoff
            self.backoff = min(self.backoff * 2, self._backoffs[1])
        elif now >= self.restart_at:
            self.restart_at = None
            self._start(pod, "restart_after_exit")

    def stop(self, reason: str) -> None:
        """Stop the plugin, if one was started (its process group, its record)."""
        if self.plugin is None:
            return
        was_running = self.plugin.running()
        self.plugin.stop()
        self.plugin = None
        if was_running:
            log.info("dra_runtime.plugin_stopped", node=self.node, reason=reason)

    def _start(self, pod: PluginPod, reason: str) -> None:
        if self.plugin is not None:  # one that exited: what is left of its group goes
            self.plugin.stop()
            self.plugin = None
        try:
            self.plugin = self._launch(pod)
        except (DevClusterError, RuntimeError, OSError) as exc:
            log.warning("dra_runtime.plugin_failed", node=self.node, pod=pod.name, error=str(exc))
            return  # the next step sees no plugin running: back-off, then another try
        self.starts += 1
        log.info(
            "dra_runtime.plugin_started",
            node=self.node,
            reason=reason,
            pod=pod.name,
            uid=pod.uid,
            feature_gates=pod.feature_gates,
        )


class LocalPlugin:
    """A gpu-kubelet-plugin this process started (a process group of its own, recorded)."""

    def __init__(self, plugin: dra_plugin.DraPlugin) -> None:
        self.plugin = plugin
        self.code: int | None = None

    def running(self) -> bool:
        if self.code is not None:
            return False
        try:  # our own child: collected here, so that its exit code is known
            pid, status = os.waitpid(self.plugin.proc.pid, os.WNOHANG)
        except ChildProcessError:
            self.code = -1
            return False
        if pid == 0:
            return True
        self.code = os.waitstatus_to_exitcode(status)
        return False

    def exit_code(self) -> int | None:
        self.running()
        return self.code

    def stop(self) -> None:
        proc = self.plugin.proc
        stop([proc])
        reap_group(proc)
        forget_dra(self.plugin.cluster_dir, self.plugin.node, "plugin", proc)


def node_pods(api: Api, node: str, namespace: str, selector: str) -> list[dict[str, Any]]:
    """The pods of `selector` in `namespace` bound to `node`, as the API has them."""
    query = urllib.parse.urlencode(
        {"fieldSelector": f"spec.nodeName={node}", "labelSelector": selector}
    )
    items: list[dict[str, Any]] = api.get(f"/api/v1/namespaces/{namespace}/pods?{query}")["items"]
    return items


def run(
    cluster: Cluster,
    node: str,
    state: Path,
    stopping: threading.Event,
    *,
    namespace: str = dra_plugin.NAMESPACE,
    selector: str = SELECTOR,
    plugin_args: Sequence[str] = (),
    poll_s: float = POLL_S,
) -> None:
    """Follow the node's DRA driver pod until `stopping` is set; the plugin stops with it."""
    bin_dir, hook = dra_plugin.dra_bin(), dra_plugin.cdi_hook_path()  # looked up once

    def launch(pod: PluginPod) -> Plugin:
        gates = [f"--feature-gates={pod.feature_gates}"] if pod.feature_gates else []
        started = dra_plugin.launch(
            cluster, node, state, args=[*gates, *plugin_args], bin_dir=bin_dir, cdi_hook=hook
        )
        return LocalPlugin(started)

    follower = Follower(node, launch)
    log.info("dra_runtime.started", node=node, namespace=namespace, selector=selector)
    try:
        while not stopping.is_set():
            try:
                pod = running_pod(node_pods(cluster.api, node, namespace, selector))
            except (ApiError, OSError) as exc:
                log.warning("dra_runtime.api_error", node=node, error=str(exc))
            else:
                follower.step(pod)
            stopping.wait(poll_s)
    finally:
        follower.stop("shutdown")
        log.info("dra_runtime.stopped", node=node)


def start(
    cluster: Cluster,
    node: str,
    state: Path,
    *,
    namespace: str = dra_plugin.NAMESPACE,
    selector: str = SELECTOR,
    plugin_args: Sequence[str] = (),
) -> Proc:
    """Spawn the follower of `node` over the simulated GPUs of `state` (root only: the plugin
    runs in a private mount namespace); any plugin or follower of the node is stopped first."""
    if os.geteuid() != 0:
        raise DevClusterError(
            "NVIDIA's DRA plugin runs in a private mount namespace (unshare -m): run as root"
        )
    stop_dra_plugins(cluster.dir, node)
    argv = [
        sys.executable,
        "-m",
        "migsim.cluster.dra_runtime",
        "--cluster-dir",
        str(cluster.dir),
        "--node",
        node,
        "--state",
        str(state),
        "--namespace",
        namespace,
        "--selector",
        selector,
        "--",
        *plugin_args,
    ]
    proc = spawn(f"dra-runtime@{node}", argv, cluster.dir / "logs" / f"dra-runtime-{node}.log")
    record_dra(cluster.dir, node, "runtime", proc)  # at once: `down` stops it whatever happens
    return proc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m migsim.cluster.dra_runtime",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cluster-dir", required=True, type=Path, help="the local cluster's folder")
    p.add_argument("--node", required=True)
    p.add_argument("--state", required=True, type=Path, help="the node's simulated GPU state")
    p.add_argument("--namespace", default=dra_plugin.NAMESPACE)
    p.add_argument("--selector", default=SELECTOR, help="label selector of the plugin's pods")
    p.add_argument("--poll-s", type=float, default=POLL_S)
    p.add_argument("--log-format", choices=["json", "console"], default="json")
    p.add_argument("plugin_args", nargs="*", help="more flags of gpu-kubelet-plugin (after --)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    run(
        Cluster.load(args.cluster_dir),
        args.node,
        args.state,
        stopping,
        namespace=args.namespace,
        selector=args.selector,
        plugin_args=args.plugin_args,
        poll_s=args.poll_s,
    )
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
