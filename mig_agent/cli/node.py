"""The one-node commands, no Kubernetes needed: validate, profiles, plan, apply, assert,
export."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mig_agent.cli.common import (
    EXIT_CHANGES,
    EXIT_FAILED,
    EXIT_OK,
    add_backend_args,
    add_config_args,
    add_destroy_in_use,
    err,
    load_configs,
    model_arg,
    open_gpus,
    out,
    select_layout,
)
from mig_agent.cli.render import (
    plan_json,
    print_plan,
    print_profiles,
)
from mig_agent.core.errors import ConfigError

if TYPE_CHECKING:
    from mig_agent.core.layout import Layout
    from mig_agent.gpu.backend import GpuBackend
    from mig_agent.node.hooks import HookRunner
from mig_agent.core.gpu_models import MODELS, parse_gpu_spec


def cmd_validate(args: argparse.Namespace) -> int:
    from mig_agent.config.profiles import fit_report

    catalog = load_configs(args)
    out(f"{len(catalog.layouts)} layout(s) valid: {', '.join(catalog.names())}")
    if not args.gpu:
        return EXIT_OK
    bad = 0
    for key in args.gpu:
        gpu_model = model_arg(key)
        out(f"\n{gpu_model.key} (0x{gpu_model.pci_device_id:08X}):")
        other = []
        for r in fit_report(catalog, gpu_model):
            if not r.applies:
                continue
            if not r.fits and r.unknown_profiles and not r.by_filter:
                other.append(r.layout)  # written for other models, selects all GPUs
                continue
            out(f"  {r.layout:<32} {'fits' if r.fits else 'DOES NOT FIT: ' + str(r.reason)}")
            bad += not r.fits
        if other:
            out(f"  (for other models, profiles unknown here: {', '.join(other)})")
    return EXIT_FAILED if bad else EXIT_OK


def cmd_profiles(args: argparse.Namespace) -> int:
    if args.gpu:
        print_profiles(
            {str(i): model_arg(k) for i, k in enumerate(args.gpu)}, as_json=args.output == "json"
        )
        return EXIT_OK
    gpus = open_gpus(args)
    try:
        print_profiles(dict(gpus.models()), as_json=args.output == "json")
    finally:
        gpus.close()
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from mig_agent.core import planner, snapshot

    layout = select_layout(load_configs(args), args.layout)
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
        gpus = open_gpus(args)
        try:
            node, models = gpus.observe(), dict(gpus.models())
        finally:
            gpus.close()
    the_plan = planner.plan(layout, node, models, destroy_in_use=args.destroy_in_use)
    if args.output == "json":
        out(json.dumps(plan_json(the_plan), indent=2))
    else:
        print_plan(the_plan)
    return EXIT_CHANGES if args.exit_code and not the_plan.is_empty else EXIT_OK


def cmd_apply(args: argparse.Namespace) -> int:
    from mig_agent.node.apply import apply_layout

    layout = select_layout(load_configs(args), args.layout)
    gpus = open_gpus(args)
    try:
        report = apply_layout(
            layout,
            gpus,
            _hook_runner(args, layout, gpus) if args.hooks_file and not args.dry_run else None,
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
        out(f"layout {layout.name} already applied; nothing changed")
        return EXIT_OK
    for r in sorted(report.gpus.values(), key=lambda r: r.gpu):
        out(
            f"GPU {r.gpu}: destroyed {r.destroyed_gpu_instances} GPU instance(s), created "
            f"{r.created_gpu_instances}"
            + (", MIG mode set" if r.mig_mode_set else "")
            + (", reset" if r.reset else "")
        )
    out(f"layout {layout.name} applied in {report.duration_s:.2f} s")
    return EXIT_OK


def _hook_runner(args: argparse.Namespace, layout: Layout, gpus: GpuBackend) -> HookRunner:
    """``apply -k HOOKS``, as mig-parted's apply with a hooks file: the hooks of the one apply
    sequence (apply-exit also after a failure or when nothing changes; post-apply only when
    something changed), with the variables mig-parted gives them."""
    import socket

    from mig_agent.config.settings import PROFILES, Settings
    from mig_agent.core import planner
    from mig_agent.host.commands import run_command
    from mig_agent.node import hooks

    settings = Settings(
        node_name=os.environ.get("NODE_NAME") or socket.gethostname(),
        config=(args.config_file or [str(PROFILES)])[0],
        hooks_file=args.hooks_file,
    )
    hook_set = hooks.load(settings)
    observed = gpus.observe()
    the_plan = planner.plan(layout, observed, gpus.models(), destroy_in_use=args.destroy_in_use)
    env = {
        **hooks.context(settings, layout.name, the_plan, observed),
        "MIG_PARTED_SKIP_RESET": str(args.skip_reset).lower(),
    }
    return hooks.HookRunner(hook_set, run_command, settings.command_timeout_s, env)


def cmd_assert(args: argparse.Namespace) -> int:
    from mig_agent.core import planner

    layout = select_layout(load_configs(args), args.layout)
    gpus = open_gpus(args)
    try:
        the_plan = planner.plan(layout, gpus.observe(), gpus.models(), destroy_in_use=True)
    finally:
        gpus.close()
    if the_plan.is_empty:
        out(f"layout {layout.name} is applied")
        return EXIT_OK
    err(
        f"layout {layout.name} is not applied: GPU(s) "
        f"{', '.join(map(str, the_plan.changed_gpus))} differ"
    )
    return EXIT_FAILED


def cmd_export(args: argparse.Namespace) -> int:
    from mig_agent.core import snapshot

    gpus = open_gpus(args)
    try:
        node, models = gpus.observe(), dict(gpus.models())
    finally:
        gpus.close()
    if args.output == "json":
        out(json.dumps(snapshot.to_json(node, models), indent=2))
    else:
        from mig_agent.config.yaml_files import dump_yaml

        out(dump_yaml(snapshot.export_config(node, models, name=args.config_label)).rstrip())
    return EXIT_OK


def cmd_generate_config(args: argparse.Namespace) -> int:
    from mig_agent.config.yaml_files import dump_yaml
    from mig_agent.core.generated_layouts import model_layouts, to_config

    if args.gpu:
        models = [model_arg(k) for k in args.gpu]
    else:
        gpus = open_gpus(args)
        try:
            models = list(gpus.models().values())
        finally:
            gpus.close()
    unique = {m.pci_device_id: m for m in models if m.mig_capable}
    if not unique:
        raise ConfigError("no MIG-capable GPU model to generate layouts for")
    layouts = [g for m in unique.values() for g in model_layouts(m)]
    out(dump_yaml(to_config(layouts)).rstrip())
    return EXIT_OK


def register(sub: Any) -> None:
    """``validate``, ``profiles``, ``plan``, ``apply``, ``assert``, ``export``."""
    p = sub.add_parser("validate", help="check profile configs; with --gpu, which layouts fit")
    add_config_args(p, layout=False)
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
    add_backend_args(p)
    p.set_defaults(func=cmd_profiles)

    _register_plan_and_apply(sub)

    p = sub.add_parser("assert", help="exit 0 only if the layout is applied")
    add_config_args(p)
    add_backend_args(p)
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
    add_backend_args(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "generate-config",
        help="a v1 config generated from the GPUs' own MIG profiles (all-disabled, all-enabled, "
        "all-<profile>), for models without layouts",
    )
    p.add_argument(
        "--gpu",
        action="append",
        metavar="MODEL",
        help="a catalog model instead of the GPUs present; repeatable",
    )
    add_backend_args(p)
    p.set_defaults(func=cmd_generate_config)


def _register_plan_and_apply(sub: Any) -> None:
    """``plan`` and ``apply``."""
    p = sub.add_parser("plan", help="the steps a layout needs, per GPU; changes nothing")
    add_config_args(p)
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
    add_destroy_in_use(p)
    add_backend_args(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("apply", help="apply a layout to this node's GPUs (no Kubernetes)")
    add_config_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--skip-reset", action="store_true", help="never reset a GPU")
    p.add_argument(
        "-k",
        "--hooks-file",
        metavar="FILE",
        default=os.environ.get("MIG_AGENT_HOOKS_FILE") or None,
        help="mig-parted's hooks file: apply-start, pre-apply-mode, pre-apply-config, "
        "apply-exit (and post-apply) run around the apply (env MIG_AGENT_HOOKS_FILE)",
    )
    add_destroy_in_use(p)
    add_backend_args(p)
    p.set_defaults(func=cmd_apply)
