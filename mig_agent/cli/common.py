"""What the commands share: exit codes, output, the config, backend and layout arguments,
and opening the GPUs (real NVML, or the simulated GPUs where that package is installed)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from mig_agent.config.settings import PROFILES
from mig_agent.core.errors import ConfigError, MigAgentError, PlanError
from mig_agent.core.gpu_models import GpuModel, parse_gpu_spec
from mig_agent.core.layout import Layout, LayoutCatalog

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CHANGES = 0, 1, 2, 3


def default_config() -> str:
    """``MIG_AGENT_CONFIG``, else the profiles shipped in the package."""
    return os.environ.get("MIG_AGENT_CONFIG", str(PROFILES))


def out(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def err(text: str) -> None:
    sys.stderr.write(f"mig-agent: {text}\n")


def add_config_args(p: argparse.ArgumentParser, *, layout: bool = True) -> None:
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


def add_backend_args(p: argparse.ArgumentParser) -> None:
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


def add_destroy_in_use(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--destroy-in-use",
        action="store_true",
        help="allow destroying instances that processes use",
    )


def load_configs(args: argparse.Namespace) -> LayoutCatalog:
    from mig_agent.config.profiles import load_catalog

    return load_catalog(args.config_file or [default_config()])


def select_layout(catalog: LayoutCatalog, name: str | None) -> Layout:
    if name is None:
        if len(catalog.layouts) == 1:
            return next(iter(catalog.layouts.values()))
        raise ConfigError(
            f"choose a layout with -c; the config has {len(catalog.layouts)}: "
            f"{', '.join(catalog.names())}"
        )
    return catalog.get(name)


def open_gpus(args: argparse.Namespace, *, read_only: bool = False) -> Any:
    """The GPUs of ``--backend``; ``read_only``: every change refused (observe mode)."""
    from mig_agent.gpu.nvml import open_backend

    if args.backend == "simulated":
        state = args.sim_state or str(Path.home() / ".cache" / "mig-agent" / "sim-node.json")
        return simulated_backend()(
            state, create_gpus=args.sim_gpus or "8xH100-80GB", read_only=read_only
        )
    return open_backend(read_only=read_only)


def simulated_backend() -> Callable[..., Any]:
    """The simulated GPUs' backend, from the package that registers it (the repository's
    simulated world, not shipped with the agent)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="mig_agent.gpu_backends", name="simulated"):
        opener: Callable[..., Any] = ep.load()
        return opener
    raise ConfigError(
        "--backend simulated needs the simulated GPUs, which are not installed: "
        "from a checkout of mig-agent, pip install -e ./sim"
    )


def model_arg(key: str) -> GpuModel:
    try:
        return parse_gpu_spec(key)[0]
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def dispatch(
    args: argparse.Namespace, *, say: Callable[[str], None] = err, crashed: str = "cli.crashed"
) -> int:
    """Run the command ``args.func`` with the exit codes of every front end: 2 for a usage or
    config error, 1 for a failure, 130 on Ctrl-C; anything unexpected is logged with its
    traceback (``crashed`` names the log event)."""
    try:
        return int(args.func(args))
    except (ConfigError, PlanError) as exc:
        say(str(exc))
        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILED
    except MigAgentError as exc:
        say(str(exc))
        return EXIT_FAILED
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except Exception as exc:  # the one catch-all: log with traceback, exit non-zero
        structlog.get_logger(__name__).exception(crashed, error=str(exc))
        return EXIT_FAILED
