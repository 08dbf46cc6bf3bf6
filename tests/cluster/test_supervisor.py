"""The supervisor plays the kubelet for an agent process (no cluster needed): a process that
exits is restarted with the kubelet's back-off, doubling to a cap; one stopped on purpose (its
supervisor told to stop) stays stopped, and nothing is left behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from migsim.cluster import Cluster, agents
from migsim.cluster.processes import Proc, kill, spawn, stop
from migsim.cluster.supervisor import backoff_delay

REPO = Path(__file__).resolve().parents[2]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_backoff_doubles_from_the_first_delay_to_the_cap() -> None:
    assert [backoff_delay(n, 10, 300) for n in range(7)] == [10, 20, 40, 80, 160, 300, 300]
    assert backoff_delay(10_000, 0.5, 5) == 5


def _status(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, ValueError):
        return {}


def _wait(path: Path, pred: Any, timeout: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status = _status(path)
        if pred(status):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.02)


def test_a_killed_process_is_restarted_with_back_off_and_a_stopped_one_is_not(
    tmp_path: Path,
) -> None:
    status_file = tmp_path / "status.json"
    sup = spawn(
        "supervisor",
        [
            sys.executable,
            "-m",
            "migsim.cluster.supervisor",
            "--name",
            "sleeper",
            "--log",
            str(tmp_path / "sleeper.log"),
            "--status",
            str(status_file),
            "--backoff",
            "0.3",
            "--backoff-max",
            "0.6",
            "--",
            *SLEEPER,
        ],
        tmp_path / "sup.log",
    )
    try:
        first = _wait(status_file, lambda s: s.get("state") == "running")
        assert first["restarts"] == 0
        delays = []
        agent = Proc(**first["agent"])
        for n in (1, 2, 3):
            kill(agent)
            backoff = _wait(status_file, lambda s: s.get("state") == "back-off")
            assert backoff["last_exit"] == "killed by SIGKILL"
            delays.append(backoff["restart_at"] - time.time())
            again = _wait(
                status_file, lambda s, n=n: s.get("state") == "running" and s["restarts"] == n
            )
            agent = Proc(**again["agent"])
            assert agent.alive() and agent.pid != first["agent"]["pid"]
        # 0.3, then 0.6, then capped at 0.6 (less the moments between exit and this read)
        assert 0.1 < delays[0] <= 0.3 and 0.4 < delays[1] <= 0.6 and 0.4 < delays[2] <= 0.6
        # stopped on purpose: the supervisor stops its process and does not restart it
        sup_log = tmp_path / "sup.log"
        assert stop([sup]) == []
        assert not agent.alive() and not sup.alive()
        final = _status(status_file)
        assert final["state"] == "stopped" and final["restarts"] == 3
        time.sleep(0.8)
        assert not Proc(**_status(status_file)["agent"]).alive()
        events = [json.loads(line)["event"] for line in sup_log.read_text().splitlines()]
        assert events.count("process.started") == 4 and events[-1] == "supervisor.stopped"
    finally:
        stop([sup])


def test_a_process_that_exits_by_itself_is_restarted_too(tmp_path: Path) -> None:
    status_file = tmp_path / "status.json"
    sup = spawn(
        "supervisor",
        [
            sys.executable,
            "-m",
            "migsim.cluster.supervisor",
            "--name",
            "quitter",
            "--log",
            str(tmp_path / "q.log"),
            "--status",
            str(status_file),
            "--backoff",
            "0.1",
            "--backoff-max",
            "0.2",
            "--",
            sys.executable,
            "-c",
            "import sys, time; time.sleep(0.2); sys.exit(3)",
        ],
        tmp_path / "sup.log",
    )
    try:
        status = _wait(status_file, lambda s: s.get("restarts", 0) >= 2)
        assert status["last_exit"] == "exit status 3"
    finally:
        assert stop([sup]) == []


def test_cli_up_status_and_down_agree_on_a_killed_agent(tmp_path: Path, cluster: Cluster) -> None:
    """`up` on a running cluster and `status` tell the truth about the agents: a killed agent is
    restarted by the cluster itself, `status` counts the restart, `down` leaves nothing behind."""
    directory = tmp_path / "cli"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(REPO / "scripts" / "local-cluster"), *args, "--dir", str(directory)],
            capture_output=True,
            text=True,
            check=False,
            timeout=240,
        )

    up = cli("up", "--nodes", "1", "--restart-backoff", "0.5", "--restart-backoff-max", "2")
    try:
        assert up.returncode == 0, up.stderr
        assert "running on 1 of 1 node(s)" in up.stderr
        record = agents.running(directory)["gpu-node-0"]
        supervisor, first = Proc(**record["supervisor"]), Proc(**record["agent"])
        status = cli("status")
        assert status.returncode == 0, status.stdout
        line = next(ln for ln in status.stdout.splitlines() if ln.startswith("mig-agent@"))
        assert line.split()[2:] == ["running", line.split()[3], "0"], line

        assert agents.kill_agent(directory, "gpu-node-0") == first
        deadline = time.monotonic() + 20
        while agents.agent_state(record := agents.running(directory)["gpu-node-0"]) != "running":
            assert time.monotonic() < deadline, record
            time.sleep(0.05)
        assert record["restarts"] == 1 and record["last_exit"] == "killed by SIGKILL"
        assert Proc(**record["agent"]) != first and not first.alive()
        status = cli("status")
        assert status.returncode == 0, status.stdout
        line = next(ln for ln in status.stdout.splitlines() if ln.startswith("mig-agent@"))
        assert "running" in line and line.endswith("1 (last: killed by SIGKILL)"), line

        # the supervisor itself gone (as after a reboot of the machine): status says STOPPED,
        # and `up` says so and starts the node's agents again instead of calling them running
        kill(supervisor)
        kill(Proc(**record["agent"]))
        status = cli("status")
        assert status.returncode == 1
        assert "STOPPED" in next(
            ln for ln in status.stdout.splitlines() if ln.startswith("mig-agent@")
        )
        again = cli("up", "--nodes", "1", "--restart-backoff", "0.5")
        assert again.returncode == 0, again.stderr
        assert "gpu-node-0: restarting mig-agent" in again.stderr
        assert "running on 1 of 1 node(s)" in again.stderr
        status = cli("status")
        assert status.returncode == 0, status.stdout
        record = agents.running(directory)["gpu-node-0"]
        procs = [Proc(**record[k]) for k in ("supervisor", "agent", "device_plugin")]
        assert all(p.alive() for p in procs)
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert not any(p.alive() for p in procs)
    assert agents.running(directory) == {}
    time.sleep(1.0)  # longer than the back-off: nothing was restarted after `down`
    assert not any(p.alive() for p in procs)
    log = (directory / "logs" / "supervisor-gpu-node-0.log").read_text().splitlines()
    assert json.loads(log[-1])["event"] == "supervisor.stopped"


def _record_many(directory: str, worker: int) -> None:
    for i in range(25):
        proc = Proc(f"agent-{worker}-{i}", 1, 1)
        agents._record(
            Path(directory),
            agents.NodeAgents(
                f"node-{worker}-{i}", proc, proc, metrics_port=0, sim_state="", kubeconfig=""
            ),
        )


def test_nodes_started_side_by_side_all_keep_their_record(tmp_path: Path) -> None:
    """Processes starting nodes at once (parallel tests, benchmarks) each update agents.json; a
    record lost there leaves its node's agent running after stop_node."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_record_many, args=(str(tmp_path), w)) for w in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert all(w.exitcode == 0 for w in workers)
    assert len(agents.running(tmp_path)) == 6 * 25
