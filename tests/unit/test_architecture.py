"""We test these aspects of the code's layering, which the folders show: each outside library is
imported by one boundary module only; everything in ``core/`` is pure (no import that does I/O);
a module imports only its own layer or lower (core < config, gpu, kube, host, observability <
node < agent, ops < cli); no import circles, in ``mig_agent/`` or in the simulated world
(``sim/migsim``); importing the package loads neither pynvml nor kubernetes; and no function or
method of ``mig_agent/`` runs over 80 lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "mig_agent"
SIM = Path(__file__).resolve().parents[2] / "sim" / "migsim"
ONLY_HERE = {  # third-party import -> the modules allowed to use it
    "pynvml": {"gpu/nvml.py"},
    "kubernetes": {"kube/client.py"},
    "grpc": {"kube/podresources.py"},
    "google": {"kube/podresources.py"},
    "yaml": {"config/yaml_files.py"},
    "tenacity": {"kube/client.py"},
    "prometheus_client": {"observability/metrics.py", "observability/health.py"},
}
STDLIB_OK_IN_PURE = {
    "__future__",
    "dataclasses",
    "enum",
    "re",
    "typing",
    "collections",
    "itertools",
    "functools",
    "math",
    "difflib",
    "json",
    "heapq",
    "hashlib",  # digests of names: no I/O
}


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
    if rel.startswith("core/"):
        extra = _imports(path) - STDLIB_OK_IN_PURE - {"mig_agent"}
        assert not extra, f"{rel} must stay pure but imports {extra}"
    # the simulated world is a separate package the shipped agent never imports
    assert "migsim" not in _imports(path), f"{rel} imports the simulated world (migsim)"


def test_importing_the_package_loads_no_hardware_or_cluster_library() -> None:
    code = (
        "import sys, mig_agent, mig_agent.core.planner, mig_agent.core.layout, "
        "mig_agent.agent; "
        "print(sorted(m for m in ('pynvml', 'kubernetes', 'grpc') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PKG.parent
    )
    assert out.stdout.strip() == "[]"


# The layers of the shipped package, lowest first, by folder: a module imports only its own
# layer or lower. A module outside these folders has no layer (the test says so).
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("core", frozenset({"core"})),
    ("boundaries", frozenset({"config", "gpu", "kube", "host", "observability"})),
    ("node", frozenset({"node"})),
    ("agent/ops", frozenset({"agent", "ops"})),
    ("cli", frozenset({"cli", "__main__"})),
)


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else module
    for i, (_, members) in enumerate(LAYERS):
        if top in members:
            return i
    raise AssertionError(
        f"mig_agent.{top} is in no layer's folder; move it into one (or add its folder to LAYERS)"
    )


def test_every_module_sits_in_a_layer_folder() -> None:
    loose = sorted(p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, f"modules at the top of mig_agent/, in no layer: {loose}"


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
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1]
                    + ([base] if base else [])
                )
            if base.startswith("mig_agent"):
                for alias in node.names:  # "from mig_agent.agent import guard" is a module
                    sub = f"{base}.{alias.name}"
                    out.add(
                        sub
                        if (PKG.parent / (sub.replace(".", "/") + ".py")).exists()
                        or (PKG.parent / sub.replace(".", "/")).is_dir()
                        else base
                    )
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
                wrong.append(
                    f"{me} ({LAYERS[_layer(me)][0]}) imports {dep} ({LAYERS[_layer(dep)][0]})"
                )
    assert not wrong, "\n".join(wrong)


def _sim_imports(path: Path) -> set[str]:
    """The migsim modules ``path`` imports, at any depth (lazy imports too)."""
    rel = path.relative_to(SIM.parent).with_suffix("")
    me = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        bases: list[str] = []
        if isinstance(node, ast.Import):
            bases = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            bases = [base] + [f"{base}.{a.name}" for a in node.names]
        for b in bases:
            file = SIM.parent / (b.replace(".", "/") + ".py")
            if b.startswith("migsim") and (
                file.exists() or (SIM.parent / b.replace(".", "/") / "__init__.py").exists()
            ):
                out.add(b)
    out.discard(me)
    # a package's __init__ re-exports its modules: importing them is no circle through it
    return {m for m in out if not me.startswith(m + ".")}


@pytest.mark.parametrize("tree", ["mig_agent", "migsim"])
def test_no_import_circles(tree: str) -> None:
    if tree == "mig_agent":
        graph = {_module_name(p): _own_imports(p) for p in PKG.rglob("*.py")}
    else:
        graph = {}
        for p in SIM.rglob("*.py"):
            rel = p.relative_to(SIM.parent).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            graph[name] = {m for m in _sim_imports(p) if not m.startswith(name + ".")}
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


# What the simulated world may not take from the agent: its GPU tables and model types, so that
# the simulated GPUs check the catalog instead of repeating it (issue 24).
AGENT_GPU_TABLES = ("mig_agent.core.gpu_models", "mig_agent.core.placement")


@pytest.mark.parametrize("path", sorted(SIM.rglob("*.py")), ids=lambda p: str(p.relative_to(SIM)))
def test_the_simulator_has_its_own_gpu_tables(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        taken = [n for n in names if n.startswith(AGENT_GPU_TABLES)]
        assert not taken, f"migsim/{path.relative_to(SIM)} imports {taken}; use migsim.gpus"


MAX_FUNCTION_LINES = 80


def test_no_function_runs_over_80_lines() -> None:
    long = sorted(
        f"{path.relative_to(PKG)}:{node.lineno} {node.name} ({length} lines)"
        for path in PKG.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (length := (node.end_lineno or node.lineno) - node.lineno + 1) > MAX_FUNCTION_LINES
    )
    assert not long, long
