"""``mig-agent run``: the node agent the DaemonSet runs, with its health and metrics server."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import structlog

from mig_agent.cli.common import (
    EXIT_OK,
    add_backend_args,
    add_config_args,
    open_gpus,
)
from mig_agent.core.errors import ConfigError

if TYPE_CHECKING:
    from mig_agent.config.settings import Settings


def cmd_run(args: argparse.Namespace) -> int:
    """The node agent: watch the own Node and reconcile until SIGTERM."""
    import signal
    import threading

    from mig_agent.agent import Agent
    from mig_agent.config.profiles import load_catalog
    from mig_agent.config.settings import Settings
    from mig_agent.kube.client import KubernetesCluster
    from mig_agent.kube.podresources import list_allocatable_devices, list_pod_devices
    from mig_agent.observability.health import HealthServer
    from mig_agent.observability.logs import bind_process
    from mig_agent.observability.metrics import InstrumentedGpus, Metrics

    settings = Settings.from_env(
        node_name=args.node,
        config=(args.config_file or [None])[0],
        kubeconfig=args.kubeconfig,
        backend=args.backend,
        sim_state=args.sim_state,
        metrics_port=args.metrics_port,
        mig_strategy=args.mig_strategy,
        observe=args.observe or None,  # the flag turns it on; MIG_AGENT_OBSERVE otherwise
    )
    if not settings.node_name:
        raise ConfigError("no node name: pass --node or set NODE_NAME")
    bind_process(node=settings.node_name)  # on every log line, from any thread or library
    stop = threading.Event()
    metrics = Metrics()
    # observe mode: the NVML adapter itself refuses every change (mig_agent.gpu.nvml._mutate)
    gpus = InstrumentedGpus(open_gpus(args, read_only=settings.observe), metrics)
    cluster = KubernetesCluster.connect(
        settings.kubeconfig, on_request=lambda call: metrics.api_requests.labels(call=call).inc()
    )
    agent = Agent(
        settings,
        cluster,
        gpus,
        lambda path: load_catalog([path]),
        metrics=metrics,
        pod_devices=lambda: list_pod_devices(settings.pod_resources_socket),
        allocatable_devices=lambda: list_allocatable_devices(settings.pod_resources_socket),
    )

    def on_signal(*_: object) -> None:  # finish the current pass, then stop at once
        stop.set()
        agent.wake()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    server = None
    if settings.metrics_port:

        def healthz() -> str:
            return agent.liveness_problem()

        def readyz() -> str:  # from what the loop last saw: a GPU reset holds NVML for minutes
            return agent.readiness_problem()

        server = HealthServer(
            settings.metrics_address,
            settings.metrics_port,
            metrics.registry,
            healthz=healthz,
            readyz=readyz,
        ).start()
    _log_started(settings, server.port if server else 0)
    try:
        agent.run(stop)
    finally:
        if server:
            server.stop()
        gpus.close()
        cluster.close()
    return EXIT_OK


def register(sub: Any) -> None:
    """``run``: the node agent."""
    p = sub.add_parser("run", help="the node agent: watch this node's layout label and apply it")
    p.add_argument("--node", default=None, help="node name (env NODE_NAME)")
    p.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig (default: in-cluster credentials, else $KUBECONFIG)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="port of /metrics, /healthz, /readyz (env MIG_AGENT_METRICS_PORT; 0: off)",
    )
    p.add_argument("--mig-strategy", choices=["mixed", "single"], default=None)
    p.add_argument(
        "--observe",
        action="store_true",
        help="observe only: plan, and say what a change would do (an Event and the annotation "
        "mig-agent.dev/observed-plan), changing nothing: no cordon, eviction, pause, plugin "
        "restart or state label, GPUs opened read-only (env MIG_AGENT_OBSERVE)",
    )
    add_config_args(p, layout=False)
    add_backend_args(p)
    p.set_defaults(func=cmd_run)


def _log_started(settings: Settings, metrics_port: int) -> None:
    structlog.get_logger("mig_agent.run").info(
        "agent.started",
        node=settings.node_name,
        config=settings.config,
        backend=settings.backend,
        metrics_port=metrics_port,
        # observe only: an Event and its annotation, nothing else written, GPUs read-only
        observe=settings.observe,
        # DRA nodes handled (claims listed cluster-wide): the chart's dra.enabled decided
        dra=(
            f"{settings.dra_plugin_namespace}, {settings.dra_plugin_selector}"
            if settings.dra
            else "off"
        ),
    )
