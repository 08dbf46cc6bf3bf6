"""We test that pyproject.toml's package list names every package under mig_agent/: a folder
left out is missing from the wheel and the image (the agent's pod then fails to import it),
though every test run from the source tree passes."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_of_the_source_tree_is_in_the_wheels_list() -> None:
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "mig_agent").rglob("__init__.py")
    }
    assert found - listed == set(), "packages the wheel would leave out"
    assert listed - found == {"mig_agent.profiles"}  # profiles/, shipped under that name
