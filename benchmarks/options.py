"""Command-line options the cluster benchmarks share (pool_rollout, vs_mig_manager)."""

from __future__ import annotations

import argparse


def add_cluster_options(p: argparse.ArgumentParser, *, quick: str) -> None:
    """Add `--device-plugin` (the kind every node runs, as agents.start_node takes it) and
    `--quick` (the benchmark's small run for CI; `quick` says what it runs)."""
    p.add_argument(
        "--device-plugin",
        choices=("simulated", "nvidia"),
        default="simulated",
        help="the device plugin of every node: the home-made model (default; light: "
        "50 nodes fit on a small machine) or NVIDIA's plugin and GFD (heavier)",
    )
    p.add_argument("--quick", action="store_true", help=f"CI: {quick}")
