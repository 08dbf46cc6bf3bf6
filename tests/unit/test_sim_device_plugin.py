"""We test these aspects of the simulated device plugin's device assignment
(migsim.device_plugin), with FakeCluster and a simulated node of two H100 80GB (MIG: one
4g.40gb and three 1g.10gb each) and one A100 40GB left whole:

* the devices offered are those advertised: same counts per resource, GPU and MIG UUIDs;
* assignment is deterministic: lowest GPU index first, then GI, then CI; all of a pod's requests
  or nothing;
* no device is given twice; a pod short of devices stays unallocated and gets them once freed;
* a pod's devices are released when it is gone, finished or replaced by a pod with another UID;
* re-advertising drops devices that no longer exist, without handing out replacements; while the
  plugin is withdrawn running pods keep their devices and new ones get none;
* run() serves the table on the kubelet's PodResources API; when the socket cannot be bound it
  still advertises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from migsim import device_plugin as sim_device_plugin
from migsim.device_plugin import Allocations, Device, offered_devices
from migsim.nvml import open_node
from migsim.nvml import state as simstate

from mig_agent.config.profiles import load_catalog
from mig_agent.core.advertised import expected_resources
from mig_agent.core.errors import KubeUnavailable
from mig_agent.core.layout import DeviceSelector, GpuLayout, Layout, MigProfile, Rule
from mig_agent.gpu.nvml import NvmlGpuBackend
from mig_agent.kube import podresources
from mig_agent.kube.cluster import PodRef, PodView
from mig_agent.node.apply import apply_layout
from tests.unit.fake_cluster import FakeCluster

CATALOG = load_catalog([Path(__file__).resolve().parents[2] / "profiles"])
NODE = "gpu-node-0"
G1, G4, GPU = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-4g.40gb", "nvidia.com/gpu"


@pytest.fixture
def sim_state(tmp_path: Path) -> str:
    path = str(tmp_path / "gpu-state.json")
    simstate.create_node(path, gpus="2xH100-80GB,1xA100-40GB", name=NODE)
    with open_node(path) as gpus:
        apply_layout(CATALOG.get("h100-80gb-1x4g-3x1g"), gpus)
    return path


@pytest.fixture
def gpus(sim_state: str) -> Iterator[NvmlGpuBackend]:
    with open_node(sim_state) as backend:
        yield backend


@pytest.fixture
def devices(gpus: NvmlGpuBackend) -> tuple[Device, ...]:
    return offered_devices(gpus, "mixed")


class LockedCluster(FakeCluster):
    """FakeCluster shared by the test and a run() thread: pod reads and deletes take turns."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def list_pods(self, **kwargs: Any) -> list[PodView]:
        with self.lock:
            return super().list_pods(**kwargs)

    def delete_pod(self, ref: PodRef) -> None:
        with self.lock:
            super().delete_pod(ref)


@pytest.fixture
def cluster() -> FakeCluster:
    fake = LockedCluster()
    fake.add_node(NODE)
    return fake


def of(devices: tuple[Device, ...], resource: str) -> list[Device]:
    return [d for d in devices if d.resource == resource]


def held(table: Allocations, ref: PodRef) -> dict[str, list[str]]:
    return table.by_pod().get((ref.namespace, ref.name), {})


# -- devices offered --------------------------------------------------------------------------


def test_offered_devices_are_the_advertised_ones(gpus: NvmlGpuBackend) -> None:
    for strategy in ("mixed", "single"):
        offered = offered_devices(gpus, strategy)
        assert Counter(d.resource for d in offered) == expected_resources(
            gpus.observe(), gpus.models(), strategy
        )
        assert len({d.id for d in offered}) == len(offered)
    offered = offered_devices(gpus, "mixed")
    assert Counter(d.resource for d in offered) == {G1: 6, G4: 2, GPU: 1}
    assert [(d.gpu, d.gi_id, d.ci_id) for d in offered] == sorted(
        (d.gpu, d.gi_id, d.ci_id) for d in offered
    )
    whole = of(offered, GPU)[0]
    assert (whole.gpu, whole.id) == (2, gpus.observe().gpus[2].info.uuid)
    assert whole.id.startswith("GPU-")
    assert all(d.id.startswith("MIG-") for d in offered if d.resource != GPU)


# -- assignment -------------------------------------------------------------------------------


def test_assignment_takes_lowest_gpu_then_gi_ci_and_is_deterministic(
    cluster: FakeCluster, devices: tuple[Device, ...]
) -> None:
    a = cluster.add_pod("ml", "a", NODE, gpu={G1: 2})
    b = cluster.add_pod("ml", "b", NODE, gpu={G1: 2, G4: 1})
    c = cluster.add_pod("ml", "c", NODE, gpu={GPU: 1})
    cluster.add_pod("ml", "web", NODE)
    cluster.add_pod("ml", "elsewhere", "gpu-node-1", gpu={G1: 1})
    ones, fours = [d.id for d in of(devices, G1)], [d.id for d in of(devices, G4)]

    tables = [Allocations() for _ in range(2)]
    for table in tables:
        table.offer(devices)
        result = table.sync(cluster.list_pods(node=NODE))
        assert set(result.allocated) == {a, b, c} and not result.waiting
    assert tables[0].by_pod() == tables[1].by_pod()
    table = tables[0]
    assert held(table, a) == {G1: ones[0:2]}
    assert held(table, b) == {G1: ones[2:4], G4: fours[:1]}
    assert held(table, c) == {GPU: [of(devices, GPU)[0].id]}
    assert {d.gpu for d in of(devices, G1)[:3]} == {0}  # GPU 0's three 1g first, then GPU 1's
    assert of(devices, G1)[3].gpu == 1


def test_no_device_is_given_twice(cluster: FakeCluster, devices: tuple[Device, ...]) -> None:
    table = Allocations()
    table.offer(devices)
    refs = [cluster.add_pod("ml", f"p{i}", NODE, gpu={G1: 1}) for i in range(7)]
    result = table.sync(cluster.list_pods(node=NODE))
    given = [i for ids in table.by_pod().values() for i in ids.get(G1, [])]
    assert sorted(given) == sorted(d.id for d in of(devices, G1))
    assert result.waiting == [refs[6]] and refs[6] not in result.allocated
    # a second pass changes nothing and does not report the waiting pod again
    before = table.by_pod()
    again = table.sync(cluster.list_pods(node=NODE))
    assert table.by_pod() == before and not again.allocated and not again.waiting
    # freed by the first pod, its device goes to the waiting one
    cluster.delete_pod(refs[0])
    freed = table.sync(cluster.list_pods(node=NODE))
    assert freed.released == [refs[0]] and list(freed.allocated) == [refs[6]]
    assert held(table, refs[6]) == {G1: [of(devices, G1)[0].id]}


def test_pod_short_of_devices_stays_unallocated_and_takes_nothing(
    cluster: FakeCluster, devices: tuple[Device, ...]
) -> None:
    table = Allocations()
    table.offer(devices)
    big = cluster.add_pod("ml", "a-big", NODE, gpu={G1: 1, G4: 3})  # only two 4g exist
    small = cluster.add_pod("ml", "b-small", NODE, gpu={G1: 1, G4: 2})
    result = table.sync(cluster.list_pods(node=NODE))
    assert result.waiting == [big]
    assert held(table, big) == {}
    assert held(table, small) == {G1: [of(devices, G1)[0].id], G4: [d.id for d in of(devices, G4)]}


def test_devices_are_released_when_the_pod_is_gone_finished_or_replaced(
    cluster: FakeCluster, devices: tuple[Device, ...]
) -> None:
    table = Allocations()
    table.offer(devices)
    first = of(devices, G4)[0].id
    gone = cluster.add_pod("ml", "gone", NODE, gpu={G4: 1})
    table.sync(cluster.list_pods(node=NODE))
    assert held(table, gone) == {G4: [first]}

    cluster.delete_pod(gone)
    done = cluster.add_pod("ml", "done", NODE, gpu={G4: 1})
    result = table.sync(cluster.list_pods(node=NODE))
    assert result.released == [gone] and held(table, done) == {G4: [first]}

    cluster.pods[done] = dataclasses.replace(cluster.pods[done], phase="Succeeded")
    result = table.sync(cluster.list_pods(node=NODE))
    assert result.released == [done] and table.by_pod() == {}

    same_name = cluster.add_pod("ml", "train", NODE, gpu={G4: 1})
    table.sync(cluster.list_pods(node=NODE))
    del cluster.pods[same_name]
    successor = cluster.add_pod("ml", "train", NODE, gpu={G4: 2})  # same name, new UID
    result = table.sync(cluster.list_pods(node=NODE))
    assert result.released == [same_name] and successor in result.allocated
    assert held(table, successor) == {G4: [d.id for d in of(devices, G4)]}


def test_terminating_pods_keep_their_devices_but_new_ones_get_none(
    cluster: FakeCluster, devices: tuple[Device, ...]
) -> None:
    table = Allocations()
    table.offer(devices)
    old = cluster.add_pod("ml", "old", NODE, gpu={GPU: 1})
    table.sync(cluster.list_pods(node=NODE))
    late = cluster.add_pod("ml", "late", NODE, gpu={G1: 1})
    for ref in (old, late):
        cluster.pods[ref] = dataclasses.replace(cluster.pods[ref], terminating=True)
    table.sync(cluster.list_pods(node=NODE))
    assert held(table, old) == {GPU: [of(devices, GPU)[0].id]}
    assert held(table, late) == {}


def test_withdrawn_plugin_keeps_allocations_and_gives_out_nothing(
    cluster: FakeCluster, devices: tuple[Device, ...]
) -> None:
    table = Allocations()
    table.offer(devices)
    running = cluster.add_pod("ml", "running", NODE, gpu={G1: 1})
    table.sync(cluster.list_pods(node=NODE))
    table.withdraw()
    new = cluster.add_pod("ml", "new", NODE, gpu={G1: 1})
    result = table.sync(cluster.list_pods(node=NODE))
    assert result.waiting == [new]
    assert held(table, running) == {G1: [of(devices, G1)[0].id]}
    assert table.allocatable() == {}
    table.offer(devices)
    assert held(table, new) == {}
    assert new in table.sync(cluster.list_pods(node=NODE)).allocated


def test_readvertising_drops_devices_that_are_gone_without_replacing_them(
    cluster: FakeCluster, gpus: NvmlGpuBackend, devices: tuple[Device, ...]
) -> None:
    table = Allocations()
    table.offer(devices)
    on_gpu0 = cluster.add_pod("ml", "a", NODE, gpu={G4: 1, G1: 1})
    on_gpu1 = cluster.add_pod("ml", "b", NODE, gpu={G4: 1})
    table.sync(cluster.list_pods(node=NODE))
    was, kept = held(table, on_gpu0), held(table, on_gpu1)

    whole_gpu0 = Layout(
        "gpu0-7g",
        (
            Rule(
                DeviceSelector(indices=frozenset({0})),
                GpuLayout.of(True, {MigProfile.parse("7g.80gb"): 1}),
            ),
        ),
    )
    apply_layout(whole_gpu0, gpus)
    now = offered_devices(gpus, "mixed")
    assert Counter(d.resource for d in now) == {G1: 3, G4: 1, "nvidia.com/mig-7g.80gb": 1, GPU: 1}

    dropped = table.offer(now)
    assert sorted(d.id for _, d in dropped) == sorted(i for ids in was.values() for i in ids)
    assert {ref for ref, _ in dropped} == {on_gpu0}
    assert {d.gpu for _, d in dropped} == {0}
    assert held(table, on_gpu0) == {} and held(table, on_gpu1) == kept
    result = table.sync(cluster.list_pods(node=NODE))
    assert not result.allocated and held(table, on_gpu0) == {}
    assert table.allocatable()["nvidia.com/mig-7g.80gb"] == [
        d.id for d in now if d.resource == "nvidia.com/mig-7g.80gb"
    ]


# -- run() ------------------------------------------------------------------------------------


def test_run_serves_the_allocations_on_pod_resources(
    cluster: FakeCluster, sim_state: str, tmp_path: Path
) -> None:
    sock = str(tmp_path / "pod-resources.sock")
    plugin = cluster.add_pod(
        "gpu-operator",
        "nvidia-device-plugin-abc",
        NODE,
        labels={"app": "nvidia-device-plugin-daemonset"},
    )
    train = cluster.add_pod("ml", "train", NODE, gpu={G4: 1})
    web = cluster.add_pod("ml", "web", NODE)
    stop = threading.Event()
    thread = threading.Thread(
        target=sim_device_plugin.run,
        args=(cluster, lambda: open_node(sim_state)),
        kwargs={
            "node": NODE,
            "namespace": plugin.namespace,
            "selector": "app=nvidia-device-plugin-daemonset",
            "strategy": "mixed",
            "stop": stop,
            "poll_s": 0.01,
            "pod_resources_socket": sock,
        },
    )
    thread.start()
    try:
        got = _poll(lambda: podresources.list_pod_devices(sock), until=bool)
        assert got is not None and list(got) == [("ml", "train")] and len(got[("ml", "train")]) == 1
        (mig_uuid,) = got[("ml", "train")]
        assert mig_uuid.startswith("MIG-")
        assert mig_uuid in podresources.list_allocatable_devices(sock)[G4]
        assert cluster.nodes[NODE].gpu_resources() == {G1: 6, G4: 2, GPU: 1}
        assert (web.namespace, web.name) not in got
        cluster.delete_pod(train)
        assert _poll(lambda: podresources.list_pod_devices(sock), until=lambda g: not g) == {}
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    assert not Path(sock).exists()


def _poll(
    read: Callable[[], dict[tuple[str, str], frozenset[str]]],
    until: Callable[[dict[tuple[str, str], frozenset[str]]], bool],
    timeout_s: float = 10.0,
) -> dict[tuple[str, str], frozenset[str]] | None:
    """What ``read`` returns once ``until`` holds; the server may not listen yet at first."""
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        with contextlib.suppress(KubeUnavailable):
            value = read()
            if until(value):
                break
        time.sleep(0.01)
    return value


def test_run_advertises_without_pod_resources_when_the_socket_cannot_be_bound(
    cluster: FakeCluster, sim_state: str, tmp_path: Path
) -> None:
    cluster.add_pod("gpu-operator", "plugin", NODE, labels={"app": "plugin"})
    stop = threading.Event()

    def open_gpus_once() -> NvmlGpuBackend:
        stop.set()  # this pass advertises, then the loop ends
        return open_node(sim_state)

    with structlog.testing.capture_logs() as logs:
        sim_device_plugin.run(
            cluster,
            open_gpus_once,
            node=NODE,
            namespace="gpu-operator",
            selector="app=plugin",
            strategy="mixed",
            stop=stop,
            pod_resources_socket=str(tmp_path / ("x" * 120)),
        )
    assert cluster.nodes[NODE].gpu_resources() == {G1: 6, G4: 2, GPU: 1}
    assert any(e["event"] == "device_plugin.pod_resources_error" for e in logs)


# -- GPU processes of GPU pods ------------------------------------------------------------------


def _run_plugin(
    cluster: FakeCluster, sim_state: str, sock: str, stop: threading.Event
) -> threading.Thread:
    thread = threading.Thread(
        target=sim_device_plugin.run,
        args=(cluster, lambda: open_node(sim_state)),
        kwargs={
            "node": NODE,
            "namespace": "gpu-operator",
            "selector": "app=nvidia-device-plugin-daemonset",
            "strategy": "mixed",
            "stop": stop,
            "poll_s": 0.01,
            "pod_resources_socket": sock,
            "processes": sim_device_plugin.PodProcesses(sim_state),
        },
    )
    thread.start()
    return thread


def _nvml_processes(sim_state: str) -> dict[int, list[tuple[int | None, int | None]]]:
    """GPU index -> (GI, CI) of each process, as NVML shows them."""
    with open_node(sim_state) as gpus:
        return {
            g.index: [(p.gi_id, p.ci_id) for p in g.processes]
            for g in gpus.observe().gpus
            if g.processes
        }


def _wait(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_running_gpu_pod_holds_a_process_on_its_device_until_it_is_gone(
    cluster: FakeCluster, sim_state: str, tmp_path: Path
) -> None:
    cluster.add_pod(
        "gpu-operator",
        "nvidia-device-plugin-abc",
        NODE,
        labels={"app": "nvidia-device-plugin-daemonset"},
    )
    whole = cluster.add_pod("ml", "whole", NODE, gpu={GPU: 1})
    mig = cluster.add_pod("ml", "mig", NODE, gpu={G4: 1})
    cluster.add_pod("ml", "web", NODE)
    stop = threading.Event()
    thread = _run_plugin(cluster, sim_state, str(tmp_path / "pr.sock"), stop)
    try:
        _wait(lambda: sum(map(len, _nvml_processes(sim_state).values())) == 2)
        procs = _nvml_processes(sim_state)
        assert procs[2] == [(None, None)]  # the A100 left whole: the process is on the GPU
        assert len(procs[0]) == 1 and procs[0][0][0] is not None  # on GPU 0's 4g.40gb
        # the MIG mode of a GPU with a pod's process cannot change (as on a real node)
        with pytest.raises(simstate.SimError, match="in use"):
            simstate.reset_gpu(sim_state, 2)
        cluster.delete_pod(whole)
        _wait(lambda: 2 not in _nvml_processes(sim_state))
        assert 0 in _nvml_processes(sim_state)
        cluster.delete_pod(mig)
        _wait(lambda: not _nvml_processes(sim_state))
    finally:
        stop.set()
        thread.join(10)


def test_a_restarted_plugin_gives_running_pods_their_devices_again(
    cluster: FakeCluster, sim_state: str, tmp_path: Path
) -> None:
    cluster.add_pod(
        "gpu-operator",
        "nvidia-device-plugin-abc",
        NODE,
        labels={"app": "nvidia-device-plugin-daemonset"},
    )
    pods = [cluster.add_pod("ml", f"p{i}", NODE, gpu={G1: 1}) for i in range(3)]
    sock = str(tmp_path / "pr.sock")
    stop = threading.Event()
    thread = _run_plugin(cluster, sim_state, sock, stop)
    try:
        before = _poll(lambda: podresources.list_pod_devices(sock), until=lambda g: len(g) == 3)
        assert before is not None and len(before) == 3
    finally:
        stop.set()
        thread.join(10)
    cluster.delete_pod(pods[0])  # gone while no plugin ran
    procs_before = _nvml_processes(sim_state)
    stop = threading.Event()
    thread = _run_plugin(cluster, sim_state, sock, stop)
    try:
        _wait(lambda: sum(map(len, _nvml_processes(sim_state).values())) == 2)
        after = _poll(lambda: podresources.list_pod_devices(sock), until=lambda g: len(g) == 2)
        assert after == {k: v for k, v in before.items() if k != ("ml", "p0")}
        # same processes for the pods still running, none started twice
        procs_after = _nvml_processes(sim_state)
        assert sum(map(len, procs_after.values())) == 2
        assert all(set(v) <= set(procs_before[g]) for g, v in procs_after.items())
    finally:
        stop.set()
        thread.join(10)


def test_adopted_pods_get_distinct_replicas_of_a_time_sliced_device() -> None:
    """Two pods held replicas of one MIG device before a restart: each gets its own back."""
    table = Allocations()
    replicas = [Device(G1 + ".shared", f"MIG-aaaa::{i}", 0, 7, 0) for i in range(4)]
    table.offer(replicas)
    a, b = PodRef("ml", "a", "uid-a"), PodRef("ml", "b", "uid-b")
    adopted = table.adopt({a: [(0, 7, 0)], b: [(0, 7, 0)]})
    assert adopted == [a, b]
    got = table.by_pod()
    assert got[("ml", "a")] != got[("ml", "b")]
    # a third pod holding the same device finds a free replica; a fourth key not offered: none
    c, d = PodRef("ml", "c", "uid-c"), PodRef("ml", "d", "uid-d")
    assert table.adopt({c: [(0, 7, 0)], d: [(1, 7, 0)]}) == [c]
