"""A simulated GPU node as NVIDIA's binaries see it, served from the test process: what
scripts/with-sim-gpus --host-view does per command, done once per session of several commands.

The node's simulator (migsim.nvml.server) runs in a thread of this process; the host view's files
(migsim.nvml.hostview) are written once per GPU set and reused, since they depend only on the GPUs'
models and indices; the commands of a session run one after the other in one private mount
namespace (``unshare -m`` + sim/native/enter-host-view), each with its own output and exit code.
A session costs one process start instead of a simulator, a host view and a shell per command."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from migsim.nvml import abi
from migsim.nvml import state as st
from migsim.nvml.hostview import write_host_view

from mig_agent.cli import build_parser
from mig_agent.cli.common import dispatch

from .conftest import REPO, NodeServer

ENTER = REPO / "sim" / "native" / "enter-host-view"


@dataclass(frozen=True)
class Ran:
    """One command's outcome: exit code, stdout, stderr."""

    returncode: int
    stdout: str
    stderr: str


class HostViews:
    """Host-view folders, one per GPU set (a state file's models and indices), written once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[str, Path] = {}

    def for_state(self, state_file: str) -> Path:
        node = st.load_node(state_file)
        key = ",".join(f"{g.index}:{g.model.key}:{g.bus_id}" for g in node.gpus)
        if key not in self.made:
            folder = self.root / f"view{len(self.made)}"
            write_host_view(state_file, folder)
            self.made[key] = folder
        return self.made[key]


def run_in_host_view(
    views: HostViews,
    native_dir: Path,
    state_file: str,
    commands: Sequence[Sequence[str]],
    work: Path,
) -> list[Ran]:
    """Run ``commands`` in order on the node of ``state_file`` as NVIDIA's binaries see a host
    (its simulator serving the C library, /proc and /sys showing its GPUs, the simulated
    nvidia-smi first on PATH); every command runs whatever the earlier ones returned."""
    work.mkdir(parents=True, exist_ok=True)
    bin_dir = work / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        (bin_dir / "nvidia-smi").symlink_to(native_dir / "nvidia-smi")
    script = "\n".join(
        f"{shlex.join(cmd)} >{work}/out.{i} 2>{work}/err.{i}; echo $? >{work}/rc.{i}"
        for i, cmd in enumerate(commands)
    )
    socket = str(work / "nvml.sock")
    server = NodeServer(os.path.abspath(state_file), socket)
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(native_dir),
        abi.ENV_SOCKET: socket,
        st.ENV_STATE: os.path.abspath(state_file),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }
    try:
        done = subprocess.run(
            ["unshare", "-m", "--propagation", "private", str(ENTER)]
            + [str(views.for_state(state_file)), "sh", "-c", script],
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
    finally:
        server.stop()
    assert done.returncode == 0, f"the host view did not run its commands: {done.stderr}"
    return [
        Ran(
            int((work / f"rc.{i}").read_text()),
            (work / f"out.{i}").read_text(),
            (work / f"err.{i}").read_text(),
        )
        for i in range(len(commands))
    ]


def mig_agent_in_process(*argv: str) -> Ran:
    """``mig-agent ARGV`` called in this process (the command line's parser and exit codes,
    without its logging set-up, which would reconfigure this process's logging)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = dispatch(build_parser().parse_args(argv))
    return Ran(code, stdout.getvalue(), stderr.getvalue())
