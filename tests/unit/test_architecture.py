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
    "yaml": {"catalog.py"},
    "tenacity": {"kube/client.py"},
    "prometheus_client": {"metrics.py", "health.py"},
}
PURE = {"layout.py", "state.py", "placement.py", "models.py", "planner.py", "labels.py",
        "resources.py", "snapshot.py", "errors.py", "generated.py"}
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


# The layers of the shipped package, lowest first: a module imports only its own layer or lower.
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("core", frozenset({"errors", "placement", "models", "state", "layout", "labels", "planner",
                        "resources", "snapshot", "generated"})),
    ("boundaries", frozenset({"settings", "catalog", "gpu", "kube", "metrics", "health",
                              "logs", "hooks"})),
    ("executor/drain", frozenset({"executor", "drain"})),
    ("agent/ops", frozenset({"agent", "ops"})),
    ("cli", frozenset({"cli", "__main__"})),
)


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else module
    for i, (_, members) in enumerate(LAYERS):
        if top in members:
            return i
    raise AssertionError(f"mig_agent.{top} is in no layer of this test; add it to LAYERS")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _own_imports(path: Path) -> set[str]:
    """Every mig_agent module ``path`` imports, at any depth of the file (lazy imports too)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("mig_agent")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base.startswith("mig_agent"):
                for alias in node.names:  # "from mig_agent.agent import node_guard" is a module
                    sub = f"{base}.{alias.name}"
                    out.add(sub if (PKG.parent / (sub.replace(".", "/") + ".py")).exists()
                            or (PKG.parent / sub.replace(".", "/")).is_dir() else base)
    out.discard(me)
    return {m for m in out if m != "mig_agent"}


def test_modules_import_only_their_own_layer_or_lower() -> None:
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        me = _module_name(path)
        if me == "mig_agent":
            continue
        for dep in _own_imports(path):
            if _layer(dep) > _layer(me):
                wrong.append(f"{me} ({LAYERS[_layer(me)][0]}) imports {dep} "
                             f"({LAYERS[_layer(dep)][0]})")
    assert not wrong, "\n".join(wrong)


def test_no_import_circles() -> None:
    graph = {_module_name(p): _own_imports(p) for p in PKG.rglob("*.py")}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph.get(m, ())):
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path, m, dep]))
            if dep not in state:
                visit(dep, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
