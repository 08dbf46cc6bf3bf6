"""We test that the local cluster's processes leave no zombies behind, without a cluster:

* a child killed as ``kill_agent`` kills an agent (SIGKILL, a crash) is reaped at once by the
  process that started it: no ``<defunct>`` entry stays until the test session ends;
* ``stop`` reaps a child that had already exited on its own (or was killed before), and one it
  has to stop;
* a child whose main thread has exited while other threads run (the leader then shows ``Z``, as
  a Go program's does for a moment while it exits) still counts as running: killed or stopped,
  and reaped once its last thread is gone;
* a process started by another process (``local-cluster up``, then ``down`` from another shell)
  is not ours to reap: killing and stopping it works all the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from migsim.cluster import agents
from migsim.cluster.processes import Proc, spawn, stop

SLEEPER = [sys.executable, "-c", "import time; time.sleep(30)"]
# The main thread exits (pthread_exit) and leaves a second thread running.
THREADED = [
    sys.executable,
    "-c",
    "import ctypes, threading, time\n"
    "threading.Thread(target=time.sleep, args=(30,)).start()\n"
    "ctypes.CDLL(None).pthread_exit(None)\n",
]


def _sleeper(tmp_path: Path, name: str = "sleeper") -> Proc:
    return spawn(name, SLEEPER, tmp_path / "logs" / f"{name}.log")


def _reaped(proc: Proc) -> bool:
    """Whether `proc` is gone for good: no zombie left, nothing left for us to wait for."""
    try:
        os.waitpid(proc.pid, os.WNOHANG)
    except ChildProcessError:
        return not proc.alive() and not _zombie(proc)
    return False


def _zombie(proc: Proc) -> bool:
    try:
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] == "Z"


def _record_agent(directory: Path, node: str, agent: Proc, plugin: Proc) -> None:
    """Record `agent` and `plugin` as the agents of `node`, as `agents.start_node` does."""
    started = agents.NodeAgents(node, agent, plugin, metrics_port=0, sim_state="", kubeconfig="")
    (directory / "agents.json").write_text(json.dumps({node: asdict(started)}))


def test_a_killed_agent_is_reaped_at_once(tmp_path: Path) -> None:
    agent, plugin = _sleeper(tmp_path, "agent"), _sleeper(tmp_path, "plugin")
    _record_agent(tmp_path, "gpu-node-0", agent, plugin)
    agents.kill_agent(tmp_path, "gpu-node-0")
    assert _reaped(agent)
    assert plugin.alive()
    agents.stop_node(tmp_path, "gpu-node-0")
    assert _reaped(plugin)


def test_stop_reaps_a_child_that_exited_before(tmp_path: Path) -> None:
    exited = spawn(
        "short", [sys.executable, "-c", "import time; time.sleep(0.3)"], tmp_path / "short.log"
    )
    running = _sleeper(tmp_path)
    deadline = time.monotonic() + 10
    while not _zombie(exited) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _zombie(exited), "the short-lived child should have exited by now"
    assert stop([running, exited]) == []
    assert _reaped(exited)
    assert _reaped(running)


def test_a_child_whose_leader_exited_before_its_threads_is_killed_and_reaped(
    tmp_path: Path,
) -> None:
    killed = spawn("agent", THREADED, tmp_path / "agent.log")
    stopped = spawn("plugin", THREADED, tmp_path / "plugin.log")
    deadline = time.monotonic() + 10
    while not (_zombie(killed) and _zombie(stopped)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _zombie(killed) and _zombie(stopped), "the main threads should have exited by now"
    _record_agent(tmp_path, "gpu-node-0", killed, stopped)
    agents.kill_agent(tmp_path, "gpu-node-0")
    assert _reaped(killed)
    assert stop([stopped]) == []
    assert _reaped(stopped)


def test_processes_of_another_parent_are_killed_and_stopped(tmp_path: Path) -> None:
    # A helper process spawns two sleepers and exits, as `local-cluster up` does: they are no
    # children of this process.
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from migsim.cluster.processes import spawn\n"
        f"argv = {SLEEPER!r}\n"
        "procs = [spawn(n, argv, Path(sys.argv[1]) / f'{n}.log') for n in ('a', 'b')]\n"
        "print(json.dumps([[p.name, p.pid, p.start_ticks] for p in procs]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], check=True, capture_output=True, text=True
    ).stdout
    first, second = (Proc(*p) for p in json.loads(out))
    for proc in (first, second):
        with pytest.raises(ChildProcessError):
            os.waitpid(proc.pid, os.WNOHANG)
        assert proc.alive()
    _record_agent(tmp_path, "gpu-node-0", first, second)
    agents.kill_agent(tmp_path, "gpu-node-0")
    assert not first.alive()
    assert stop([second]) == []
    assert not second.alive()
