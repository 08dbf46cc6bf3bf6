"""We test these aspects of the ops commands end to end, on the local cluster with a real agent
and simulated device plugin per node, running `mig-agent repartition|status` as a subprocess with
the admin kubeconfig:

* a pool of 6 nodes rolled out with `-p 2`: a watch on the pool's nodes (running alongside the
  command) never sees more than 2 nodes pending, nor more than 2 relabelled and not yet done;
  every node goes through pending to success; the summary lists 6 x success and the exit code
  is 0; `status -o json` on the pool then shows the layout, state success, the advertised MIG
  resources and the GPUs' MIG devices;
* a node whose GPU pod is guarded by a PodDisruptionBudget fails: the rollout starts no further
  node (their layout labels are never set), the exit code is 1 and the summary names the node,
  the PDB and the nodes not started;
* a typo in the layout name is refused with exit code 2 before any node is touched (no label
  changes), naming the close match and every known layout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client, watch
from migsim.cluster import Cluster, agents, wait_until

from mig_agent.config.profiles import load_catalog

from .conftest import CONFIG, REPO, STATE, AgentNode, NodeFactory, wait_running

POOL_LABEL = "e2e.mig-agent.dev/pool"
SYNC = "e2e.mig-agent.dev/sync"  # a mark the test writes to learn that its watch caught up
RESULTS = ("success", "failed", "timeout", "not started", "in progress", "already applied")
_ROW = re.compile(rf"^(\S+)\s+({'|'.join(RESULTS)})\s+(\S+)\s*(.*)$")
_pools = iter(range(10**6))


# ---------------------------------------------------------------------------------------------
# Helpers


def make_pool(
    agent_node: NodeFactory,
    core: client.CoreV1Api,
    size: int,
    settings: Mapping[str, str] | None = None,
) -> tuple[str, list[AgentNode]]:
    """``size`` agent nodes carrying a label of their own; (label selector, nodes by name)."""
    pool = f"p{next(_pools)}-{int(time.time() * 1000) % 100000}"
    nodes = [agent_node("8xH100-80GB", settings=settings) for _ in range(size)]
    for n in nodes:
        core.patch_node(n.name, {"metadata": {"labels": {POOL_LABEL: pool}}})
    return f"{POOL_LABEL}={pool}", sorted(nodes, key=lambda n: n.name)


def mig_agent_cli(*args: str, timeout: float = 150.0) -> subprocess.CompletedProcess[str]:
    """``python -m mig_agent ARGS`` from the checkout, without the test process's MIG_AGENT_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIG_AGENT_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "mig_agent", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def repartition(
    cluster: Cluster, layout: str, selector: str, *extra: str, timeout: float = 150.0
) -> subprocess.CompletedProcess[str]:
    return mig_agent_cli(
        "repartition",
        layout,
        "-l",
        selector,
        "--poll",
        "0.2",
        "--kubeconfig",
        str(cluster.kubeconfig),
        *extra,
        timeout=timeout,
    )


def summary_rows(stdout: str) -> dict[str, tuple[str, str]]:
    """node -> (result, reason), from the table after the NODE/RESULT header."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("NODE ")) + 1
    rows: dict[str, tuple[str, str]] = {}
    for line in lines[start:]:
        if m := _ROW.match(line):
            rows[m.group(1)] = (m.group(2), m.group(4))
    return rows


def explain(res: subprocess.CompletedProcess[str], nodes: Iterable[AgentNode] = ()) -> str:
    logs = "".join(f"\n--- agent {n.name}:\n{n.log_tail(15)}" for n in nodes)
    return f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}{logs}"


@dataclass(frozen=True, slots=True)
class Transition:
    t: float  # monotonic seconds since the watch started
    node: str
    layout: str | None
    state: str | None


@dataclass
class PoolWatch:
    """Follows the pool's nodes with a watch (in resourceVersion order, as etcd committed the
    changes) and records each change of a node's (layout label, state label)."""

    core: client.CoreV1Api
    selector: str
    transitions: list[Transition] = field(default_factory=list)
    initial: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    errors: list[BaseException] = field(default_factory=list)
    synced: set[str] = field(default_factory=set)  # SYNC values the watch delivered
    _rv: str = ""
    _t0: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> PoolWatch:
        self._t0 = time.monotonic()
        listed = self.core.list_node(label_selector=self.selector)
        self._rv = listed.metadata.resource_version
        self.initial = {n.metadata.name: _marks(n) for n in listed.items}
        self._thread = threading.Thread(target=self._run, name="pool-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def _run(self) -> None:
        last = dict(self.initial)
        try:
            while not self._stop.is_set():
                w = watch.Watch()
                for event in w.stream(
                    self.core.list_node,
                    label_selector=self.selector,
                    resource_version=self._rv,
                    timeout_seconds=2,
                ):
                    node = event["object"]
                    self._rv = node.metadata.resource_version
                    name, marks = node.metadata.name, _marks(node)
                    if sync := (node.metadata.annotations or {}).get(SYNC):
                        self.synced.add(sync)
                    if event["type"] != "DELETED" and last.get(name) != marks:
                        last[name] = marks
                        self.transitions.append(
                            Transition(time.monotonic() - self._t0, name, *marks)
                        )
                    if self._stop.is_set():
                        w.stop()
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.errors.append(exc)

    def catch_up(self, node: str) -> None:
        """Return once the watch has delivered every change committed before this call: a watch
        delivers in commit order, so seeing a mark written on `node` now is enough."""
        mark = str(time.monotonic_ns())
        self.core.patch_node(node, {"metadata": {"annotations": {SYNC: mark}}})
        wait_until(
            lambda: mark in self.synced or self.errors, timeout=30, what="the watch to see the mark"
        )

    def states(self, node: str) -> list[str | None]:
        return [t.state for t in self.transitions if t.node == node]

    def max_concurrent(self, counts: Callable[[str | None, str | None], bool]) -> int:
        """The most nodes for which ``counts(layout, state)`` held at the same moment."""
        now = dict(self.initial)
        most = sum(counts(*m) for m in now.values())
        for t in self.transitions:
            now[t.node] = (t.layout, t.state)
            most = max(most, sum(counts(*m) for m in now.values()))
        return most

    def timeline(self) -> str:
        return "\n".join(
            f"{t.t:6.2f}s {t.node} layout={t.layout} state={t.state}" for t in self.transitions
        )


def _marks(node: Any) -> tuple[str | None, str | None]:
    labels = node.metadata.labels or {}
    return labels.get(CONFIG), labels.get(STATE)


def wait_pdb_observed(core: client.CoreV1Api, namespace: str, name: str) -> None:
    policy = client.PolicyV1Api(core.api_client)
    deadline = time.monotonic() + 20
    while True:
        st = policy.read_namespaced_pod_disruption_budget(name, namespace).status
        if st.observed_generation is not None and st.disruptions_allowed == 0:
            return
        assert time.monotonic() < deadline, f"PDB {name} not observed: {st}"
        time.sleep(0.1)


def labels_of(core: client.CoreV1Api, nodes: Sequence[AgentNode]) -> dict[str, dict[str, str]]:
    return {n.name: dict(core.read_node(n.name).metadata.labels or {}) for n in nodes}


# ---------------------------------------------------------------------------------------------
# Tests


def test_pool_of_six_rolls_out_two_at_a_time_and_status_shows_it(
    agent_node: NodeFactory, core: client.CoreV1Api, installed: Cluster
) -> None:
    layout = "all-1g.10gb"
    selector, nodes = make_pool(agent_node, core, 6)
    names = [n.name for n in nodes]

    with PoolWatch(core, selector) as seen:
        res = repartition(installed, layout, selector, "-p", "2")
        # the last state changes may still be on their way through the watch
        deadline = time.monotonic() + 10
        while (
            any(seen.states(n)[-1:] != ["success"] for n in names) and time.monotonic() < deadline
        ):
            time.sleep(0.1)
    assert not seen.errors, seen.errors
    assert res.returncode == 0, explain(res, nodes)

    # The summary: a success row per node, the verdict line, nothing on stderr.
    rows = summary_rows(res.stdout)
    assert rows == {n: ("success", "") for n in names}, res.stdout
    assert f"layout {layout}: done (6 node(s): 6 success)" in res.stdout
    assert res.stdout.count("started: ") == 6
    assert res.stderr == ""

    # What the watch saw: at most 2 at a time, and every node through pending to success.
    timeline = seen.timeline()
    assert seen.max_concurrent(lambda _, state: state == "pending") <= 2, timeline
    in_flight = seen.max_concurrent(
        lambda label, state: label == layout and state not in ("success", "failed")
    )
    assert in_flight == 2, timeline  # never more than 2, and the parallelism was used
    for name in names:
        states = seen.states(name)
        assert "pending" in states, timeline
        assert states[-1] == "success", timeline
        assert "failed" not in states, timeline
        assert states.index("pending") < len(states) - 1

    # status -o json on the pool after the rollout.
    st = mig_agent_cli(
        "status",
        "-l",
        selector,
        "-o",
        "json",
        "--kubeconfig",
        str(installed.kubeconfig),
        timeout=60,
    )
    assert st.returncode == 0, explain(st)
    report = json.loads(st.stdout)
    assert [r["node"] for r in report] == names
    for r in report:
        assert r["layout"] == layout
        assert r["state"] == "success"
        assert r["reason"] == ""
        assert r["unschedulable"] is False
        assert r["resources"] == {"nvidia.com/mig-1g.10gb": 56}, r
        assert r["mig_resources"] == {"nvidia.com/mig-1g.10gb": 56}
        assert len(r["gpus"]) == 8
        assert all(g["mig_enabled"] and g["devices"] == {"1g.10gb": 7} for g in r["gpus"]), r
    for n in nodes:  # what status reports is what the node advertises
        assert n.gpu_resources() == {"nvidia.com/mig-1g.10gb": 56}


def test_pdb_failure_stops_the_rollout_and_the_summary_names_node_and_pdb(
    agent_node: NodeFactory,
    core: client.CoreV1Api,
    installed: Cluster,
    namespace: str,
    gpu_pod: Any,
) -> None:
    selector, nodes = make_pool(agent_node, core, 3, settings={"MIG_AGENT_DRAIN_TIMEOUT_S": "4"})
    guarded, rest = nodes[0], nodes[1:]  # the rollout goes in name order: it is first
    gpu_pod(namespace, "guarded", node=guarded.name, labels={"app": "guarded"})
    wait_running(core, namespace, "guarded")
    client.PolicyV1Api(core.api_client).create_namespaced_pod_disruption_budget(
        namespace,
        {
            "metadata": {"name": "keep-guarded"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}},
        },
    )
    wait_pdb_observed(core, namespace, "keep-guarded")

    res = repartition(installed, "all-3g.40gb", selector, "-p", "1")
    assert res.returncode == 1, explain(res, nodes)

    rows = summary_rows(res.stdout)
    result, reason = rows[guarded.name]
    assert result == "failed", explain(res, nodes)
    assert f"{namespace}/keep-guarded" in reason
    assert f"PodDisruptionBudget {namespace}/keep-guarded" in reason, reason
    assert "guarded" in reason.split("PodDisruptionBudget")[0]  # and the pod it protects
    for n in rest:
        assert rows[n.name] == ("not started", "rollout stopped after a failure"), res.stdout
    assert f"FAILED on {guarded.name} " in res.stdout
    assert "stopping: 1 node(s) failed (budget 0)" in res.stdout
    # No node was started after the failure, and the others were never touched.
    assert res.stdout.count("started: ") == 1
    assert re.search(rf"{re.escape(guarded.name)}\s+started: ", res.stdout), res.stdout
    for name, labels in labels_of(core, rest).items():
        assert CONFIG not in labels and STATE not in labels, (name, labels)
    # The pod the PDB protects is still there.
    assert core.read_namespaced_pod("guarded", namespace).spec.node_name == guarded.name


def test_layout_typo_is_refused_before_any_node_is_touched(
    agent_node: NodeFactory, core: client.CoreV1Api, installed: Cluster
) -> None:
    selector, nodes = make_pool(agent_node, core, 2)
    before = labels_of(core, nodes)
    typo = "all-1g.10gbb"

    with PoolWatch(core, selector) as seen:
        res = repartition(installed, typo, selector, "-p", "2", timeout=60)
        seen.catch_up(nodes[0].name)  # a (wrong) label change has reached the watch by now
    assert not seen.errors, seen.errors
    assert res.returncode == 2, explain(res, nodes)
    assert res.stdout == ""
    assert f"unknown layout {typo!r}" in res.stderr
    assert "did you mean all-1g.10gb" in res.stderr
    known = sorted(load_catalog([agents.PROFILES]).layouts)
    assert len(known) > 5
    assert f"({len(known)} known layouts; `mig-agent validate` lists them all)" in res.stderr
    assert not seen.transitions, seen.timeline()
    assert labels_of(core, nodes) == before
    for labels in before.values():
        assert CONFIG not in labels and STATE not in labels
