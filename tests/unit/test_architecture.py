"""We test these aspects of the code's layering: each outside library is imported by one
boundary module only, the pure core imports nothing that does I/O, and importing the package
loads neither pynvml nor kubernetes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "mig_agent"
ONLY_HERE = {  # third-party import -> the modules allowed to use it
    "pynvml": {"gpu/nvml.py"},
    "kubernetes": {"kube/client.py"},
    "grpc": {"kube/podresources.py"},
    "google": {"kube/podresources.py"},
    "yaml": {"catalog.py", "cli/node.py"},  # export prints a config as YAML
    "tenacity": {"kube/client.py"},
    "prometheus_client": {"metrics.py", "health.py"},
}
PURE = {"layout.py", "state.py", "placement.py", "models.py", "planner.py", "labels.py",
        "resources.py", "snapshot.py", "errors.py"}
STDLIB_OK_IN_PURE = {"__future__", "dataclasses", "enum", "re", "typing", "collections",
                     "itertools", "functools", "math", "difflib", "json"}


def _imports(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_outside_libraries_stay_at_their_boundary(path: Path) -> None:
    rel = str(path.relative_to(PKG))
    for lib, allowed in ONLY_HERE.items():
        assert lib not in _imports(path) or rel in allowed, f"{rel} imports {lib}; only {allowed}"
    if rel in PURE:
        extra = _imports(path) - STDLIB_OK_IN_PURE - {"mig_agent"}
        assert not extra, f"{rel} must stay pure but imports {extra}"
    # the simulated world is a separate package the shipped agent never imports
    assert "migsim" not in _imports(path), f"{rel} imports the simulated world (migsim)"


def test_importing_the_package_loads_no_hardware_or_cluster_library() -> None:
    code = ("import sys, mig_agent, mig_agent.planner, mig_agent.layout, mig_agent.agent; "
            "print(sorted(m for m in ('pynvml', 'kubernetes', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=PKG.parent)
    assert out.stdout.strip() == "[]"
