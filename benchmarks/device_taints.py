"""Device taints against the cordon, on the local cluster (Kubernetes 1.37): a DRA node of 8
simulated H100s (NVIDIA's DRA kubelet plugin, the real scheduler) on all-1g.10gb changes 2 of its
GPUs to 3g.40gb, once with the agent's device taints (DeviceTaintRule: only the devices of the 2
GPUs out of scheduling) and once with them off (the node cordoned).

Figures per mode, from the label's change to ``success``: the change's wall time; device-minutes
and GPU-minutes out of scheduling (each look every 0.1 s: every device the slice lists while the
node is cordoned, else the tainted ones; a GPU counts while any device of it is held back); and
the Pending time of a pod whose claim asks a device of an unchanged GPU, made once the change holds
the node back (cordoned, or the first devices tainted).
One pod on a changing GPU is evicted in each run. Each mutating NVML call of the simulator takes
``--latency`` seconds (default 0.25: a change of 2 GPUs from 14 to 4 instances makes 36 calls).

Run: python benchmarks/device_taints.py [--latency 0.25] [--rounds 2] [--quick]
Starts its own cluster in a temporary folder and stops it at the end (needs root, as the DRA
tests do: the plugin runs in a private mount namespace).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from migsim.cluster import Cluster, agents, dra_plugin  # noqa: E402
from migsim.nvml import state as simstate  # noqa: E402

from mig_agent.core import device_taints  # noqa: E402

CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
NS = "bench"
RESOURCE = "/apis/resource.k8s.io/v1"
LAYOUT = """version: v1
mig-configs:
  two-change:
    - devices: [0, 1, 2, 3, 4, 5]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
    - devices: [6, 7]
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
"""


@dataclass
class Run:
    mode: str
    wall_s: float
    device_min: float
    gpu_min: float
    pending_s: float


def wait(what: str, done: Callable[[], bool], timeout: float = 120.0, step: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(step)


def state(cluster: Cluster, node: str) -> str:
    labels = cluster.api.get(f"/api/v1/nodes/{node}")["metadata"].get("labels") or {}
    return str(labels.get(STATE, ""))


def relabel(cluster: Cluster, node: str, layout: str) -> None:
    cluster.api.request(
        "PATCH",
        f"/api/v1/nodes/{node}",
        {"metadata": {"labels": {CONFIG: layout, STATE: None}}},
        content_type="application/merge-patch+json",
    )


def claimed_pod(cluster: Cluster, name: str, parent_uuid: str) -> None:
    """A ResourceClaim of one MIG device of the GPU ``parent_uuid``, and a pod holding it."""
    cel = f"device.attributes['gpu.nvidia.com'].parentUUID == '{parent_uuid}'"
    request = {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {"expression": cel}}]}
    cluster.api.request(
        "POST",
        f"{RESOURCE}/namespaces/{NS}/resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "mig", "exactly": request}]}},
        },
    )
    container = {"name": "cuda", "image": "registry.invalid/cuda:1"}
    container["resources"] = {"claims": [{"name": "gpu"}]}  # type: ignore[assignment]
    cluster.api.request(
        "POST",
        f"/api/v1/namespaces/{NS}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": "bench"}},
            "spec": {
                "terminationGracePeriodSeconds": 1,
                "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                "containers": [container],
            },
        },
    )


def running(cluster: Cluster, name: str) -> bool:
    pod = cluster.api.get(f"/api/v1/namespaces/{NS}/pods/{name}")
    return (pod.get("status") or {}).get("phase") == "Running"


def held_back(cluster: Cluster, node: str, parents: dict[str, str]) -> tuple[int, int]:
    """(devices, GPUs) out of scheduling now: all listed while cordoned, else the tainted."""
    listed = dra_plugin.devices(cluster, node)
    spec = cluster.api.get(f"/api/v1/nodes/{node}").get("spec") or {}
    if spec.get("unschedulable"):
        held = set(listed)
    else:
        rules = cluster.api.get(f"{RESOURCE}/{device_taints.PLURAL}")["items"]
        held = set(device_taints.rules_of_node(rules, node)) & set(listed)
    gpus = {parents.get(d) or str(listed[d].get("parentUUID", d)) for d in held}
    return len(held), len(gpus)


def one_run(cluster: Cluster, node: str, mode: str, latency: float, n: int) -> Run:
    """The node at all-1g.10gb, then two-change, measured."""
    relabel(cluster, node, "all-1g.10gb")
    wait("all-1g.10gb", lambda: state(cluster, node) == "success")
    gpus = simstate.load_node(agents.sim_state_path(cluster, node)).gpus
    parents = {
        d: str(a.get("parentUUID", "")) for d, a in dra_plugin.devices(cluster, node).items()
    }
    claimed_pod(cluster, f"{mode}-{n}-evicted", gpus[6].uuid)
    wait("the pod on GPU 6", lambda: running(cluster, f"{mode}-{n}-evicted"))
    simstate.set_latency(agents.sim_state_path(cluster, node), latency)
    start = time.monotonic()
    relabel(cluster, node, "two-change")
    device_s = gpu_s = 0.0
    last = start
    while (held := held_back(cluster, node, parents))[0] == 0:  # the change holds the node back
        time.sleep(0.05)
    now = time.monotonic()
    device_s, gpu_s, last = held[0] * (now - last), held[1] * (now - last), now
    pod = f"{mode}-{n}-unchanged"  # new work for an unchanged GPU, once the change is under way
    claimed_pod(cluster, pod, gpus[0].uuid)
    made = time.monotonic()
    pending_s: float | None = None
    while state(cluster, node) not in ("success", "failed"):
        devices, held_gpus = held_back(cluster, node, parents)
        now = time.monotonic()
        device_s, gpu_s, last = (
            device_s + devices * (now - last),
            gpu_s + held_gpus * (now - last),
            now,
        )
        if pending_s is None and running(cluster, pod):
            pending_s = now - made
        time.sleep(0.1)
    wall = time.monotonic() - start
    assert state(cluster, node) == "success", f"{mode}: the change failed"
    if pending_s is None:
        wait(f"{pod} running", lambda: running(cluster, pod))
        pending_s = time.monotonic() - made
    simstate.set_latency(agents.sim_state_path(cluster, node), 0.0)
    cluster.api.request("DELETE", f"/api/v1/namespaces/{NS}/pods?labelSelector=app%3Dbench")
    return Run(mode, wall, device_s / 60, gpu_s / 60, pending_s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latency", type=float, default=0.25, help="seconds per mutating NVML call")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="CI: one round, 0.05 s latency")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.latency = 1, 0.05
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="mig-agent-bench-") as tmp:
        cluster = Cluster.up(Path(tmp), gpu_nodes=0)
        try:
            agents.install(cluster)
            agents.install_dra(cluster)
            cluster.kubectl("create", "namespace", NS)
            profiles = Path(tmp) / "profiles"
            profiles.mkdir()
            for f in agents.PROFILES.glob("*.yaml"):
                (profiles / f.name).write_text(f.read_text())
            (profiles / "bench.yaml").write_text(LAYOUT)
            for mode, on in (("taints", "true"), ("cordon", "false")):
                node = f"dra-{mode}"
                cluster.add_gpu_node(node, "8xH100-80GB")
                agents.start_node(
                    cluster,
                    node,
                    device_plugin="dra",
                    profiles=profiles,
                    settings={"MIG_AGENT_DEVICE_TAINTS": on},
                )
                wait(f"{node}'s slice", lambda n=node: bool(dra_plugin.resource_slices(cluster, n)))
                runs += [one_run(cluster, node, mode, args.latency, r) for r in range(args.rounds)]
                agents.stop_node(cluster.dir, node)
        finally:
            cluster.down()
    report(runs, args.latency, args.rounds)
    return 0


def report(runs: list[Run], latency: float, rounds: int) -> None:
    print(
        f"\n## A DRA node of 8xH100-80GB changing 2 GPUs (all-1g.10gb -> 6 x 1g.10gb x 7 + "
        f"2 x 3g.40gb x 2), {latency:g} s a mutating NVML call, median of {rounds}\n"
    )
    print("| mode | change s | device-min out | GPU-min out | Pending s, pod on an unchanged GPU |")
    print("|---|---:|---:|---:|---:|")
    for mode in ("taints", "cordon"):
        mine = [r for r in runs if r.mode == mode]

        def med(f: Callable[[Run], float], rs: list[Run] = mine) -> float:
            return statistics.median(f(r) for r in rs)

        print(
            f"| {mode} | {med(lambda r: r.wall_s):.1f} | {med(lambda r: r.device_min):.2f} | "
            f"{med(lambda r: r.gpu_min):.2f} | {med(lambda r: r.pending_s):.1f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
