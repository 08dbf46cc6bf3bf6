"""``mig-agent``: the command line. One engine, three ways in.

``run`` is the node agent (DaemonSet); ``apply|plan|assert|export|validate|profiles`` work on one
node by hand without Kubernetes; ``repartition|status`` are the ops commands. This module wires
real or simulated backends and prints; the work happens elsewhere.

Exit codes: 0 ok, 1 runtime failure (or assert: not applied), 2 usage or config error,
3 changes needed (``plan --exit-code``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from mig_agent import __version__
from mig_agent.errors import ConfigError, MigAgentError, PlanError
from mig_agent.layout import Layout, LayoutCatalog
from mig_agent.models import MODELS, GpuModel, parse_gpu_spec
from mig_agent.ops import register_commands
from mig_agent.planner import (
    CreateComputeInstance,
    CreateGpuInstance,
    DestroyComputeInstance,
    DestroyGpuInstance,
    Plan,
    SetMigMode,
    Step,
)
from mig_agent.settings import PROFILES

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CHANGES = 0, 1, 2, 3


def default_config() -> str:
    """``MIG_AGENT_CONFIG``, else the profiles shipped in the package."""
    return os.environ.get("MIG_AGENT_CONFIG", str(PROFILES))


def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def _err(text: str) -> None:
    sys.stderr.write(f"mig-agent: {text}\n")


# ---------------------------------------------------------------------------------------------
# Shared arguments


def _add_config_args(p: argparse.ArgumentParser, *, layout: bool = True) -> None:
    p.add_argument(
        "-f",
        "--config-file",
        action="append",
        metavar="FILE",
        help="profile config file or folder (repeatable; default $MIG_AGENT_CONFIG or the "
        "profiles shipped in the package)",
    )
    if layout:
        p.add_argument(
            "-c",
            "--layout",
            "--selected-config",
            dest="layout",
            metavar="LAYOUT",
            default=os.environ.get("MIG_AGENT_LAYOUT"),
            help="layout name (optional when the config holds exactly one)",
        )


def _add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=["nvml", "simulated"],
        default=os.environ.get("MIG_AGENT_BACKEND", "nvml"),
        help="GPU library: the real NVML or the simulator (env MIG_AGENT_BACKEND)",
    )
    p.add_argument(
        "--sim-state",
        default=os.environ.get("MIG_AGENT_SIM_STATE"),
        help="simulated node state file (env MIG_AGENT_SIM_STATE)",
    )
    p.add_argument(
        "--sim-gpus",
        default=os.environ.get("MIG_AGENT_SIM_GPUS"),
        help="create the simulated node with these GPUs if the state file is new, "
        "e.g. 8xH100-80GB (env MIG_AGENT_SIM_GPUS)",
    )


def _add_destroy_in_use(p: argparse.ArgumentParser) -> None:
    p.add_argument("--destroy-in-use", action="store_true",
                   help="allow destroying instances that processes use")


def _load(args: argparse.Namespace) -> LayoutCatalog:
    from mig_agent.catalog import load_catalog

    return load_catalog(args.config_file or [default_config()])


def _select(catalog: LayoutCatalog, name: str | None) -> Layout:
    if name is None:
        if len(catalog.layouts) == 1:
            return next(iter(catalog.layouts.values()))
        raise ConfigError(
            f"choose a layout with -c; the config has {len(catalog.layouts)}: "
            f"{', '.join(catalog.names())}"
        )
    return catalog.get(name)


def _open_gpus(args: argparse.Namespace) -> Any:
    from mig_agent.gpu.nvml import open_backend

    if args.backend == "simulated":
        state = args.sim_state or str(Path.home() / ".cache" / "mig-agent" / "sim-node.json")
        return simulated_backend()(state, create_gpus=args.sim_gpus or "8xH100-80GB")
    return open_backend()


def simulated_backend() -> Callable[..., Any]:
    """The simulated GPUs' backend, from the package that registers it (the repository's
    simulated world, not shipped with the agent)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="mig_agent.gpu_backends", name="simulated"):
        opener: Callable[..., Any] = ep.load()
        return opener
    raise ConfigError("--backend simulated needs the simulated GPUs, which are not installed: "
                      "from a checkout of mig-agent, pip install -e ./sim")


# ---------------------------------------------------------------------------------------------
# Rendering


def _step_text(step: Step) -> str:
    match step:
        case SetMigMode(enabled=on):
            return f"set MIG mode {'enabled' if on else 'disabled'}"
        case DestroyComputeInstance(gi_id=gi, ci_id=ci, profile=p):
            return f"destroy compute instance {ci} ({p}) in GPU instance {gi}"
        case DestroyGpuInstance(gi_id=gi, profile=p, placement=pl):
            return f"destroy GPU instance {gi} ({p}) at {pl}"
        case CreateGpuInstance(profile=p, placement=pl):
            return f"create GPU instance {p} at {pl}"
        case CreateComputeInstance(profile=p, gi_placement=gpl, placement=pl):
            return f"create compute instance {p} at {pl} in the GPU instance at {gpl}"
    raise AssertionError(step)


def _step_json(step: Step) -> dict[str, Any]:
    def pl(p: Any) -> dict[str, int]:
        return {"start": p.start, "size": p.size}

    match step:
        case SetMigMode(enabled=on):
            return {"op": "set_mig_mode", "enabled": on}
        case DestroyComputeInstance(gi_id=gi, ci_id=ci, profile=p):
            return {"op": "destroy_compute_instance", "gi_id": gi, "ci_id": ci, "profile": p}
        case DestroyGpuInstance(gi_id=gi, profile=p, placement=x):
            return {"op": "destroy_gpu_instance", "gi_id": gi, "profile": p, "placement": pl(x)}
        case CreateGpuInstance(profile=p, profile_id=pid, placement=x):
            return {
                "op": "create_gpu_instance",
                "profile": p,
                "profile_id": pid,
                "placement": pl(x),
            }
        case CreateComputeInstance(profile=p, profile_id=pid, gi_placement=g, placement=x):
            return {
                "op": "create_compute_instance",
                "profile": p,
                "profile_id": pid,
                "gi_placement": pl(g),
                "placement": pl(x),
            }
    raise AssertionError(step)


def plan_json(plan: Plan) -> dict[str, Any]:
    return {
        "layout": plan.layout,
        "changes": not plan.is_empty,
        "untouched_gpus": list(plan.untouched),
        "gpus": [
            {
                "gpu": g.gpu,
                "model": g.model,
                "desired": str(g.desired),
                "steps": [_step_json(s) for s in g.steps],
                "destroyed_gpu_instances": g.destroyed_gpu_instances,
                "created_gpu_instances": g.created_gpu_instances,
                "devices": [
                    {
                        "profile": d.profile,
                        "placement": {"start": d.gi_placement.start, "size": d.gi_placement.size},
                        "compute_placement": {
                            "start": d.ci_placement.start,
                            "size": d.ci_placement.size,
                        },
                        "kept": d.kept,
                    }
                    for d in g.devices
                ],
            }
            for g in plan.gpus
        ],
    }


def print_plan(plan: Plan) -> None:
    changed = len(plan.changed_gpus)
    _out(f"layout {plan.layout}: {changed} of {len(plan.gpus)} GPU(s) change")
    for g in plan.gpus:
        if g.is_empty:
            _out(f"GPU {g.gpu} ({g.model}): already {g.desired}, nothing to do")
            continue
        _out(
            f"GPU {g.gpu} ({g.model}): {g.desired} -- {len(g.steps)} step(s), "
            f"{g.destroyed_gpu_instances} GPU instance(s) destroyed, "
            f"{g.created_gpu_instances} created"
        )
        for s in g.steps:
            _out(f"  {_step_text(s)}")
        if g.devices:
            _out(
                "  result: "
                + ", ".join(
                    f"{d.profile}@{d.gi_placement}{' (kept)' if d.kept else ''}" for d in g.devices
                )
            )
    for i in plan.untouched:
        _out(f"GPU {i}: not selected by the layout, left as it is")


# ---------------------------------------------------------------------------------------------
# Commands


def cmd_validate(args: argparse.Namespace) -> int:
    from mig_agent.catalog import fit_report

    catalog = _load(args)
    _out(f"{len(catalog.layouts)} layout(s) valid: {', '.join(catalog.names())}")
    if not args.gpu:
        return EXIT_OK
    bad = 0
    for key in args.gpu:
        gpu_model = _model_arg(key)
        _out(f"\n{gpu_model.key} (0x{gpu_model.pci_device_id:08X}):")
        other = []
        for r in fit_report(catalog, gpu_model):
            if not r.applies:
                continue
            if not r.fits and r.unknown_profiles and not r.by_filter:
                other.append(r.layout)  # written for other models, selects all GPUs
                continue
            _out(f"  {r.layout:<32} {'fits' if r.fits else 'DOES NOT FIT: ' + str(r.reason)}")
            bad += not r.fits
        if other:
            _out(f"  (for other models, profiles unknown here: {', '.join(other)})")
    return EXIT_FAILED if bad else EXIT_OK


def _model_arg(key: str) -> GpuModel:
    try:
        return parse_gpu_spec(key)[0]
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def print_profiles(models: dict[int, GpuModel] | dict[str, GpuModel], *, as_json: bool) -> None:
    seen: dict[str, GpuModel] = {}
    for m in models.values():
        seen.setdefault(m.key, m)
    if as_json:
        _out(
            json.dumps(
                {
                    k: [
                        {
                            "name": p.name,
                            "index": p.index,
                            "id": p.id,
                            "slices": p.slices,
                            "memory_mib": p.memory_mib,
                            "instances": p.instance_count,
                            "multiprocessors": p.multiprocessors,
                            "engines": {
                                "copy": p.engines.copy,
                                "decoder": p.engines.decoder,
                                "encoder": p.engines.encoder,
                                "jpeg": p.engines.jpeg,
                                "ofa": p.engines.ofa,
                            },
                            "placements": [
                                {"start": x.start, "size": x.size} for x in p.placements
                            ],
                        }
                        for p in m.gi_profiles
                    ]
                    for k, m in seen.items()
                },
                indent=2,
            )
        )
        return
    for m in seen.values():
        _out(f"{m.name} ({m.key}, 0x{m.pci_device_id:08X}, {m.memory_total_mib} MiB)")
        if not m.mig_capable:
            _out("  no MIG support")
            continue
        _out(
            f"  {'profile':<14}{'id':>4}{'idx':>5}{'inst':>6}{'MiB':>8}{'SM':>5}"
            f"  CE/DEC/ENC/JPG/OFA  placements"
        )
        for p in m.gi_profiles:
            e = p.engines
            starts = ",".join(str(x.start) for x in p.placements)
            _out(
                f"  {p.name:<14}{p.id:>4}{p.index:>5}{p.instance_count:>6}{p.memory_mib:>8}"
                f"{p.multiprocessors:>5}  {e.copy}/{e.decoder}/{e.encoder}/{e.jpeg}/{e.ofa:<10}"
                f"  {{{starts}}}:{p.memory_slices}"
            )


def cmd_profiles(args: argparse.Namespace) -> int:
    if args.gpu:
        print_profiles(
            {str(i): _model_arg(k) for i, k in enumerate(args.gpu)}, as_json=args.output == "json"
        )
        return EXIT_OK
    gpus = _open_gpus(args)
    try:
        print_profiles(dict(gpus.models()), as_json=args.output == "json")
    finally:
        gpus.close()
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from mig_agent import planner, snapshot

    layout = _select(_load(args), args.layout)
    if args.from_file:
        try:
            node, models = snapshot.from_json(json.loads(Path(args.from_file).read_text()))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{args.from_file}: {exc}") from None
    elif args.gpus:
        try:
            node, models = snapshot.empty_node(list(parse_gpu_spec(args.gpus)))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    else:
        gpus = _open_gpus(args)
        try:
            node, models = gpus.observe(), dict(gpus.models())
        finally:
            gpus.close()
    the_plan = planner.plan(layout, node, models, destroy_in_use=args.destroy_in_use)
    if args.output == "json":
        _out(json.dumps(plan_json(the_plan), indent=2))
    else:
        print_plan(the_plan)
    return EXIT_CHANGES if args.exit_code and not the_plan.is_empty else EXIT_OK


def cmd_apply(args: argparse.Namespace) -> int:
    from mig_agent.executor import apply_layout

    layout = _select(_load(args), args.layout)
    gpus = _open_gpus(args)
    try:
        report = apply_layout(
            layout,
            gpus,
            destroy_in_use=args.destroy_in_use,
            reset=not args.skip_reset,
            dry_run=args.dry_run,
        )
    finally:
        gpus.close()
    if args.dry_run:
        print_plan(report.plan)
        return EXIT_OK
    if not report.changed:
        _out(f"layout {layout.name} already applied; nothing changed")
        return EXIT_OK
    for r in sorted(report.gpus.values(), key=lambda r: r.gpu):
        _out(
            f"GPU {r.gpu}: destroyed {r.destroyed_gpu_instances} GPU instance(s), created "
            f"{r.created_gpu_instances}"
            + (", MIG mode set" if r.mig_mode_set else "")
            + (", reset" if r.reset else "")
        )
    _out(f"layout {layout.name} applied in {report.duration_s:.2f} s")
    return EXIT_OK


def cmd_assert(args: argparse.Namespace) -> int:
    from mig_agent import planner

    layout = _select(_load(args), args.layout)
    gpus = _open_gpus(args)
    try:
        the_plan = planner.plan(layout, gpus.observe(), gpus.models(), destroy_in_use=True)
    finally:
        gpus.close()
    if the_plan.is_empty:
        _out(f"layout {layout.name} is applied")
        return EXIT_OK
    _err(
        f"layout {layout.name} is not applied: GPU(s) "
        f"{', '.join(map(str, the_plan.changed_gpus))} differ"
    )
    return EXIT_FAILED


def cmd_export(args: argparse.Namespace) -> int:
    from mig_agent import snapshot

    gpus = _open_gpus(args)
    try:
        node, models = gpus.observe(), dict(gpus.models())
    finally:
        gpus.close()
    if args.output == "json":
        _out(json.dumps(snapshot.to_json(node, models), indent=2))
    else:
        import yaml

        _out(
            yaml.safe_dump(
                snapshot.export_config(node, models, name=args.config_label), sort_keys=False
            ).rstrip()
        )
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    """The node agent: watch the own Node and reconcile until SIGTERM."""
    import signal
    import threading

    from mig_agent.agent import Agent
    from mig_agent.catalog import load_catalog
    from mig_agent.health import HealthServer
    from mig_agent.kube.client import KubernetesCluster
    from mig_agent.kube.podresources import list_pod_devices
    from mig_agent.logs import bind_process
    from mig_agent.metrics import InstrumentedGpus, Metrics
    from mig_agent.settings import Settings

    settings = Settings.from_env(
        node_name=args.node,
        config=(args.config_file or [None])[0],
        kubeconfig=args.kubeconfig,
        backend=args.backend,
        sim_state=args.sim_state,
        metrics_port=args.metrics_port,
        mig_strategy=args.mig_strategy,
    )
    if not settings.node_name:
        raise ConfigError("no node name: pass --node or set NODE_NAME")
    bind_process(node=settings.node_name)  # on every log line, from any thread or library
    log = structlog.get_logger("mig_agent.run")
    stop = threading.Event()
    metrics = Metrics()
    gpus = InstrumentedGpus(_open_gpus(args), metrics)
    cluster = KubernetesCluster.connect(
        settings.kubeconfig, on_request=lambda call: metrics.api_requests.labels(call=call).inc())
    agent = Agent(settings, cluster, gpus, lambda path: load_catalog([path]), metrics=metrics,
                  pod_devices=lambda: list_pod_devices(settings.pod_resources_socket))

    def on_signal(*_: object) -> None:  # finish the current pass, then stop at once
        stop.set()
        agent.wake()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    server = None
    if settings.metrics_port:

        def healthz() -> str:
            return agent.liveness_problem()

        def readyz() -> str:
            if agent.catalog is None:
                return f"profile configs not loaded: {agent.catalog_error}"
            try:
                gpus.observe()
            except MigAgentError as exc:
                return f"NVML unreachable: {exc}"
            return ""

        server = HealthServer(
            settings.metrics_address,
            settings.metrics_port,
            metrics.registry,
            healthz=healthz,
            readyz=readyz,
        ).start()
    log.info(
        "agent.started",
        node=settings.node_name,
        config=settings.config,
        backend=settings.backend,
        metrics_port=server.port if server else 0,
    )
    try:
        agent.run(stop)
    finally:
        if server:
            server.stop()
        gpus.close()
        cluster.close()
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# Parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mig-agent", description="Partition NVIDIA GPUs into MIG instances from a layout."
    )
    parser.add_argument("--version", action="version", version=f"mig-agent {__version__}")
    parser.add_argument(
        "--log-format",
        choices=["auto", "json", "console"],
        default=os.environ.get("MIG_AGENT_LOG_FORMAT", "auto"),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("validate", help="check profile configs; with --gpu, which layouts fit")
    _add_config_args(p, layout=False)
    p.add_argument(
        "--gpu",
        action="append",
        metavar="MODEL",
        help=f"GPU model to check against ({', '.join(MODELS)}); repeatable",
    )
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser(
        "profiles", help="MIG profiles and placements of a GPU model or the GPUs present"
    )
    p.add_argument("--gpu", action="append", metavar="MODEL", help="a catalog model")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    _add_backend_args(p)
    p.set_defaults(func=cmd_profiles)

    p = sub.add_parser("plan", help="the steps a layout needs, per GPU; changes nothing")
    _add_config_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--gpus", metavar="MODEL[xN]", help="plan for empty GPUs, e.g. 8xH200")
    src.add_argument(
        "--from",
        dest="from_file",
        metavar="FILE",
        help="plan from a state snapshot (mig-agent export -o json)",
    )
    p.add_argument("-o", "--output", choices=["text", "json"], default="text")
    p.add_argument("--exit-code", action="store_true", help="exit 3 when changes are needed")
    _add_destroy_in_use(p)
    _add_backend_args(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("apply", help="apply a layout to this node's GPUs (no Kubernetes)")
    _add_config_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--skip-reset", action="store_true", help="never reset a GPU")
    _add_destroy_in_use(p)
    _add_backend_args(p)
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("assert", help="exit 0 only if the layout is applied")
    _add_config_args(p)
    _add_backend_args(p)
    p.set_defaults(func=cmd_assert)

    p = sub.add_parser("export", help="the GPUs' current partition as a v1 config")
    p.add_argument(
        "-o",
        "--output",
        choices=["yaml", "json"],
        default="yaml",
        help="yaml: a v1 config; json: every instance with its placement",
    )
    p.add_argument("-l", "--config-label", default="current", help="layout name in the output")
    _add_backend_args(p)
    p.set_defaults(func=cmd_export)

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
    _add_config_args(p, layout=False)
    _add_backend_args(p)
    p.set_defaults(func=cmd_run)

    for register in _EXTRA_COMMANDS:
        register(sub)
    return parser


# Commands defined in other modules (agent, ops) add themselves here.
_EXTRA_COMMANDS: list[Callable[[Any], None]] = [register_commands]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from mig_agent.logs import configure_logging

    configure_logging(args.log_format, level=10 if args.verbose else 20)
    try:
        return int(args.func(args))
    except (ConfigError, PlanError) as exc:
        _err(str(exc))
        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILED
    except MigAgentError as exc:
        _err(str(exc))
        return EXIT_FAILED
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except Exception as exc:  # the one catch-all: log with traceback, exit non-zero
        structlog.get_logger(__name__).exception("cli.crashed", error=str(exc))
        return EXIT_FAILED
