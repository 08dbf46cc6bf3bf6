"""We test these aspects of the package as users install it (a wheel, not this checkout):

* the default config is the profiles folder inside the package, for the one-node commands and
  the agent alike (``MIG_AGENT_CONFIG`` unset);
* the wheel holds every profile YAML file of ``profiles/`` (as ``mig_agent/profiles/``);
* installed from that wheel into a fresh virtual environment and run outside this checkout,
  ``mig-agent plan -c all-balanced --gpus 1xH200`` finds its layouts and prints the plan.

The wheel is built from a copy of the checkout, so that the build leaves nothing behind here.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import mig_agent
from mig_agent.cli import default_config
from mig_agent.config.profiles import load_catalog
from mig_agent.config.settings import Settings

REPO = Path(__file__).resolve().parents[2]
PROFILES = REPO / "profiles"
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
)


def test_the_default_config_is_the_packaged_profiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MIG_AGENT_CONFIG", raising=False)
    # from a checkout, the top-level profiles/ (the wheel maps it into the package: below)
    installed = Path(mig_agent.__file__).resolve().parent / "profiles"
    packaged = installed if installed.is_dir() else PROFILES
    assert Path(default_config()) == Path(Settings().config) == packaged
    assert "all-balanced" in load_catalog([default_config()]).names()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(REPO, source, ignore=_NOT_SOURCE)
    # Build isolation fetches the build backend pyproject.toml asks for, as `pip install .` does.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "-w",
            str(tmp / "dist"),
            str(source),
        ],
        check=True,
        cwd=tmp,
    )
    (built,) = (tmp / "dist").glob("mig_agent-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """A fresh virtual environment holding the wheel; the dependencies come from the system's."""
    home = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(home)],
        check=True,
    )
    # where the tests run in a virtual environment of their own, the dependencies are in its
    # site-packages, not the system's: listed after the venv's own (the wheel's) so that they
    # are found; a plain path entry, so the checkout's editable install there stays out
    own = Path(
        subprocess.run(
            [
                home / "bin" / "python",
                "-c",
                "import sysconfig; print(sysconfig.get_path('purelib'))",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (own / "_test_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # --force-reinstall: the editable install of this checkout is the same version.
    subprocess.run(
        [
            home / "bin" / "python",
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--force-reinstall",
            "--quiet",
            "--disable-pip-version-check",
            str(wheel),
        ],
        check=True,
        cwd=home,
        env=_outside_env(),
    )
    return home


def _outside_env() -> dict[str, str]:
    """This environment without anything that would point at the checkout or its profiles."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MIG_AGENT_CONFIG")}


@pytest.mark.slow
def test_the_wheel_ships_the_profiles(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        shipped = {n for n in z.namelist() if n.startswith("mig_agent/profiles/")}
    assert "mig_agent/profiles/h200.yaml" in shipped
    assert shipped == {f"mig_agent/profiles/{f.name}" for f in PROFILES.glob("*.yaml")}


@pytest.mark.slow
def test_the_wheel_holds_the_agent_only(wheel: Path) -> None:
    """The simulated world (sim/migsim) and the tests stay out of what operators install."""
    with zipfile.ZipFile(wheel) as z:
        tops = {n.split("/")[0] for n in z.namelist()}
    assert tops == {"mig_agent", wheel.name.split("-py3")[0] + ".dist-info"}, tops


@pytest.mark.slow
def test_the_installed_command_plans_with_its_own_profiles(venv: Path) -> None:
    where = subprocess.run(
        [
            venv / "bin" / "python",
            "-c",
            "import mig_agent.config.settings as s; print(s.__file__); print(s.Settings().config)",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=venv,
        env=_outside_env(),
    )
    module, config = where.stdout.split()
    assert Path(module).is_relative_to(venv), "the venv imported the checkout, not the wheel"
    assert Path(config).is_relative_to(venv)
    done = subprocess.run(
        [venv / "bin" / "mig-agent", "plan", "-c", "all-balanced", "--gpus", "1xH200"],
        capture_output=True,
        text=True,
        cwd=venv,
        env=_outside_env(),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("layout all-balanced: 1 of 1 GPU(s) change")
    assert "GPU 0 (H200): 3g.71gb x1, 2g.35gb x1, 1g.18gb x2" in done.stdout
