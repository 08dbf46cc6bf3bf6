"""The world the guard model (tests/unit/test_guard_model.py) drives the real agent through:
the in-memory cluster and GPUs of tests/unit, the device plugin's DaemonSet and the kubelet's
device manager, GPU pods that hold devices, and faults armed to strike in the middle of a pass;
or, ``World(dra=True)``, a DRA node: NVIDIA's DRA plugin and the ResourceSlice it publishes,
DeviceTaintRules served.

Everything an invariant reads is held here, outside the agent: the node as the API server has
it, the GPUs as NVML has them, the devices the plugin registered with the kubelet, which pod
holds which device, what the agent wrote and when. The agent itself is only ever built
(Agent(...)) and asked for one pass (reconcile_once), as the loop does; a kill or a stop ends
the Agent object, and the next pass is a new one's, so only what is on the node survives.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from mig_agent.agent import Agent
from mig_agent.agent.outcome import Outcome, PassResult
from mig_agent.config.settings import Settings
from mig_agent.core import device_taints
from mig_agent.core.dra_devices import DRIVER as DRA_DRIVER
from mig_agent.core.errors import GpuError
from mig_agent.core.gpu_models import MODELS, resource_name
from mig_agent.core.layout import LayoutCatalog
from mig_agent.core.observed import NodeState
from mig_agent.kube.cluster import NodeCondition, NodeView, PodRef, PodsSeen
from mig_agent.node.waits import Clock
from tests.unit.fake_cluster import FakeCluster
from tests.unit.fake_gpus import FakeGpus
from tests.unit.model_answers import Answer, EvictionAnswers

PROFILES = str(Path(__file__).resolve().parents[2] / "profiles")
NODE = "gpu-node-0"
DP_NS = "gpu-operator"
DP_SEL = {"app": "nvidia-device-plugin-daemonset"}
DP_LABEL = "nvidia.com/gpu.deploy.device-plugin"
CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
GPU_MODEL = "H100-80GB"
GPU_COUNT = 2
DRA_NS, DRA_APP = "gpu-operator", "nvidia-dra-driver-kubelet-plugin"


class Crash(BaseException):
    """The agent's process killed: no handler of the agent's may catch it."""


@dataclass(frozen=True, slots=True)
class Device:
    """One device NVIDIA's plugin would list: a whole GPU, or a MIG device."""

    resource: str
    uuid: str
    gpu: int
    gi_id: int | None = None
    ci_id: int | None = None


def held_devices(gpus: FakeGpus, state: NodeState | None = None) -> dict[str, Device]:
    """uuid -> Device, for every device the GPUs hold (now, or in ``state``) under the mixed
    strategy: what an honest plugin started then would list. Read past the world's hooks:
    the world's own look is no call of the agent's."""
    out: dict[str, Device] = {}
    for gpu in (state or FakeGpus.observe(gpus)).gpus:
        if not gpu.mig_current:
            out[gpu.info.uuid] = Device("nvidia.com/gpu", gpu.info.uuid, gpu.index)
            continue
        model = gpus.models()[gpu.index]
        for gi in gpu.gpu_instances:
            profile = model.gi_profile_by_id(gi.profile_id)
            for ci in gi.compute_instances:
                ci_profile = profile.ci_profile_by_id(ci.profile_id) if profile else None
                name = profile.ci_name(ci_profile) if profile and ci_profile else ""
                res = resource_name(name) if name else None
                if res and ci.uuid:
                    out[ci.uuid] = Device(res, ci.uuid, gpu.index, gi.id, ci.id)
    return out


def by_resource(devices: Mapping[str, Device]) -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {}
    for d in devices.values():
        out.setdefault(d.resource, set()).add(d.uuid)
    return {r: frozenset(u) for r, u in out.items()}


def gpu_layout(gpus: FakeGpus) -> tuple[object, ...]:
    """What of the GPUs a plugin lists: MIG modes and instances (not processes)."""
    return tuple(
        (g.mig_current, g.mig_pending, g.gpu_instances) for g in FakeGpus.observe(gpus).gpus
    )


class ModelTime:
    """The model's clock: a pass's sleeps move it and let the world go on (pods leave, the
    plugin starts, an armed fault strikes). The client's retries, made on the eviction
    threads, only move it."""

    def __init__(self, world: World) -> None:
        self.t = 0.0
        self.world = world
        self.lock = threading.Lock()

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.advance(s)
        if threading.current_thread() is threading.main_thread():
            self.world.tick("sleep")

    def advance(self, s: float) -> None:
        with self.lock:
            self.t += s

    def wait(self, event: threading.Event, timeout: float) -> bool:
        if not event.is_set():
            self.sleep(timeout)
        return event.is_set()


@dataclass
class ModelCluster(FakeCluster):
    """FakeCluster whose calls pass through the world: a dead agent's calls fail as a kill
    would end them, evictions are answered as the API server would (model_answers), every
    write the agent makes is recorded with the pass it came in."""

    world: World | None = None

    def _check(self, call: str) -> None:
        if self.world is not None:
            self.world.api_call(call)
        super()._check(call)

    def patch_node(self, name: str, **kw: object) -> NodeView:  # type: ignore[override]
        node = super().patch_node(name, **kw)  # type: ignore[arg-type]
        if self.world is not None:
            self.world.wrote(kw)
        return node

    def set_node_condition(self, name: str, condition: NodeCondition) -> None:
        super().set_node_condition(name, condition)
        if self.world is not None:
            self.world.said("condition", condition.message)

    def emit_event(
        self, node: NodeView, *, reason: str, message: str, warning: bool = False
    ) -> None:
        super().emit_event(node, reason=reason, message=message, warning=warning)
        if self.world is not None:
            self.world.said(f"event {reason}", message)

    def evict(self, ref: PodRef) -> None:
        self._check("evict")
        assert self.world is not None
        self.world.evict(ref)

    def delete_device_taint(self, name: str) -> None:
        # the agent deletes its rules only to lift them all: a DRA node's uncordon, decided for
        # the label now (one rule at a time: the decision stands from the first)
        if self.world is not None:
            self.world.uncordoned_for = self.nodes[NODE].labels.get(CONFIG)
        super().delete_device_taint(name)

    def watch_pods(self, node: str, *, timeout_s: float, seen: PodsSeen | None = None):  # type: ignore[override]
        pods = self.list_pods(node=node)
        if self.world is not None:
            self.world.looked()  # a bind in flight lands after this look
        yield pods


class ModelGpus(FakeGpus):
    """FakeGpus whose mutations pass through the world (a fault may strike before one), and
    whose GPUs in ``pending`` keep a MIG mode change pending until a reboot (as an A100's
    without a reset)."""

    def __init__(self, world: World) -> None:
        super().__init__([MODELS[GPU_MODEL]] * GPU_COUNT)
        self.world = world
        self.pending: set[int] = set()

    def observe(self) -> NodeState:
        self.world.gpu_read()
        return super().observe()

    def truth(self) -> NodeState:
        """The GPUs as they are, read by the model (no call of the agent's)."""
        return super().observe()

    def _mutate(self, gpu: int, op: str) -> None:
        self.world.gpu_call(op)
        super()._mutate(gpu, op)

    def set_mig_mode(self, gpu: int, *, enabled: bool) -> None:
        if gpu not in self.pending:
            super().set_mig_mode(gpu, enabled=enabled)
            return
        self._mutate(gpu, "set_mig_mode")
        g = self.gpus[gpu]
        if g.gpu_instances:
            raise GpuError("GPU instances present")
        self.gpus[gpu] = replace(g, mig_pending=enabled)

    def reboot(self) -> None:
        """Pending mode changes take effect; every process ends."""
        for i, g in self.gpus.items():
            self.gpus[i] = replace(g, mig_current=g.mig_pending, processes=())


@dataclass
class PodFacts:
    """What the model knows of a GPU pod beyond its PodView: the devices the kubelet gave it,
    its process, how it leaves once evicted."""

    ref: PodRef
    devices: frozenset[str]
    pid: int | None  # its process on its device (None: not started, or no device left)
    stuck: bool = False  # once evicted it terminates for ever (a CUDA process hung in the driver)
    slow_s: float = 0.0  # once evicted it takes this long to go
    leaves_at: float | None = None
    bound_alive: bool = True  # every device it was given existed then
    told: bool = False  # its device destroyed under it: said once


@dataclass
class DevicePluginModel:
    """NVIDIA's device plugin DaemonSet, the plugin, and the kubelet's device manager.

    modes: honest (a new pod registers what the GPUs hold at once), slow (after ``delay_s``),
    partial (one device fewer), crashing (its pods never become Ready nor register), stale (a
    new pod registers what the previous one read)."""

    mode: str = "honest"
    delay_s: float = 0.0
    # its pods carry the labels the agent's selector looks for (else: a chart's other labels)
    found: bool = True
    pod: PodRef | None = None
    ready_at: float | None = None
    registered: dict[str, frozenset[str]] = field(default_factory=dict)
    healthy: bool = False  # the registration is live (its pod runs)
    last_read: dict[str, frozenset[str]] | None = None
    names: itertools.count = field(default_factory=itertools.count)  # type: ignore[type-arg]

    def settle(self, w: World) -> None:
        c = w.cluster
        wanted = not w.operands or c.nodes[NODE].labels.get(DP_LABEL, "true") == "true"
        if self.pod is not None and self.pod not in c.pods:
            self._gone(w)  # deleted: the agent's restart
        if self.pod is not None and not wanted:
            c.pods.pop(self.pod, None)
            self._gone(w)
        if self.pod is None and wanted:
            selector = {DP_LABEL: "true"} if w.operands else {}
            name = f"nvidia-device-plugin-daemonset-{next(self.names)}"
            self.pod = c.add_pod(
                DP_NS,
                name,
                NODE,
                labels=DP_SEL if self.found else {"app": "nvidia-device-plugin-mig"},
                owner="DaemonSet",
                node_selector=selector,
                ready=False,
            )
            delay = self.delay_s if self.mode == "slow" else 0.0
            self.ready_at = None if self.mode == "crashing" else w.time.now() + delay
        if self.pod is not None and self.ready_at is not None and w.time.now() >= self.ready_at:
            self.ready_at = None
            self._register(w)

    def _gone(self, w: World) -> None:
        """The kubelet marks a stopped plugin's devices unhealthy: allocatable 0, capacity
        kept for its grace period."""
        self.pod, self.ready_at, self.healthy = None, None, False
        node = w.cluster.nodes[NODE]
        alloc = {**node.allocatable, **{r: "0" for r in self.registered}}
        w.cluster.nodes[NODE] = replace(node, allocatable=alloc)

    def _register(self, w: World) -> None:
        read = by_resource(held_devices(w.gpus))
        if self.mode == "stale" and self.last_read is not None:
            read = self.last_read
        elif self.mode == "partial" and read:
            biggest = max(sorted(read), key=lambda r: len(read[r]))
            read = {**read, biggest: frozenset(sorted(read[biggest])[:-1])}
        else:
            self.last_read = read
        node = w.cluster.nodes[NODE]
        old = {r: 0 for r in node.gpu_capacity()}
        w.cluster.patch_node_resources(NODE, {**old, **{r: len(u) for r, u in read.items()}})
        self.registered, self.healthy = dict(read), True
        assert self.pod is not None
        w.cluster.pods[self.pod] = replace(w.cluster.pods[self.pod], ready=True)

    def crash(self, w: World) -> None:
        """The running pod crashes: its registration goes, and it never comes back Ready."""
        self.mode = "crashing"
        if self.pod is not None:
            w.cluster.pods[self.pod] = replace(w.cluster.pods[self.pod], ready=False)
            node = w.cluster.nodes[NODE]
            alloc = {**node.allocatable, **{r: "0" for r in self.registered}}
            w.cluster.nodes[NODE] = replace(node, allocatable=alloc)
            self.healthy, self.ready_at = False, None

    def advertised(self, node: NodeView) -> dict[str, frozenset[str]]:
        """The devices the scheduler may hand out now: registered and allocatable."""
        if not self.healthy:
            return {}
        alloc = node.gpu_resources()
        return {r: u for r, u in self.registered.items() if alloc.get(r, 0) > 0}


def slice_devices(gpus: FakeGpus) -> tuple[dict[str, object], ...]:
    """The devices NVIDIA's DRA plugin started now would list in the node's ResourceSlice: a
    whole GPU by its UUID, a MIG device by its own and its parent's. Read past the world's
    hooks (no call of the agent's)."""
    out: list[dict[str, object]] = []
    for gpu in FakeGpus.observe(gpus).gpus:
        uuid = {"string": gpu.info.uuid}
        if not gpu.mig_current:
            attrs = {"type": {"string": "gpu"}, "uuid": uuid}
            out.append({"name": f"gpu-{gpu.index}", "attributes": attrs})
            continue
        model = gpus.models()[gpu.index]
        for gi in gpu.gpu_instances:
            profile = next(p for p in model.gi_profiles if p.id == gi.profile_id)
            for ci in gi.compute_instances:
                attrs = {
                    "type": {"string": "mig"},
                    "profile": {"string": profile.name},
                    "uuid": {"string": ci.uuid},
                    "parentUUID": uuid,
                }
                # named as NVIDIA's plugin names them, by profile and placement: a GPU
                # instance kept through a change keeps its name, a layout made again reuses them
                place = f"{profile.name.replace('.', '')}-{gi.profile_id}-{gi.placement.start}"
                out.append({"name": f"gpu-{gpu.index}-mig-{place}", "attributes": attrs})
    return tuple(out)


@dataclass
class DraPluginModel:
    """NVIDIA's DRA kubelet plugin DaemonSet on a DRA node, and the node's ResourceSlice it
    publishes (the scheduler allocates claims from it; the agent's DeviceTaintRules take its
    devices out). Modes as DevicePluginModel's: honest, slow, partial (one device fewer),
    crashing (never Ready, publishes nothing), stale (publishes what the previous pod read).
    A slice stays as last published while no pod runs: the scheduler may still allocate from
    it."""

    mode: str = "honest"
    delay_s: float = 0.0
    found: bool = True  # its pods carry the agent's selector (always, on a DRA node)
    pod: PodRef | None = None
    ready_at: float | None = None
    devices: tuple[dict[str, object], ...] = ()  # as the slice lists them now
    last_read: tuple[dict[str, object], ...] | None = None
    generation: int = 0
    names: itertools.count = field(default_factory=itertools.count)  # type: ignore[type-arg]

    def settle(self, w: World) -> None:
        c = w.cluster
        if self.pod is not None and self.pod not in c.pods:
            self.pod, self.ready_at = None, None  # deleted: the agent's restart
        if self.pod is None:
            name = f"nvidia-dra-driver-kubelet-plugin-{next(self.names)}"
            self.pod = c.add_pod(
                DRA_NS, name, NODE, labels={"app": DRA_APP}, owner="DaemonSet", ready=False
            )
            delay = self.delay_s if self.mode == "slow" else 0.0
            self.ready_at = None if self.mode == "crashing" else w.time.now() + delay
        if self.pod is not None and self.ready_at is not None and w.time.now() >= self.ready_at:
            self.ready_at = None
            self._publish(w)

    def _publish(self, w: World) -> None:
        read = slice_devices(w.gpus)
        if self.mode == "stale" and self.last_read is not None:
            read = self.last_read
        elif self.mode == "partial" and read:
            read = read[:-1]
        else:
            self.last_read = read
        self.devices, self.generation = read, self.generation + 1
        pool = {"name": NODE, "generation": self.generation, "resourceSliceCount": 1}
        spec = {"driver": DRA_DRIVER, "nodeName": NODE, "pool": pool, "devices": list(read)}
        name = f"{NODE}-{DRA_DRIVER}-{self.generation}"
        w.cluster.slices = [{"metadata": {"name": name}, "spec": spec}]
        assert self.pod is not None
        w.cluster.pods[self.pod] = replace(w.cluster.pods[self.pod], ready=True)

    def crash(self, w: World) -> None:
        """The running pod crashes and never comes back Ready; its slice stays."""
        self.mode = "crashing"
        if self.pod is not None:
            w.cluster.pods[self.pod] = replace(w.cluster.pods[self.pod], ready=False)
            self.ready_at = None

    def listed(self) -> dict[str, tuple[str, str]]:
        """The slice's devices: name -> (its UUID, its GPU's UUID)."""
        out = {}
        for d in self.devices:
            attrs = d["attributes"]
            assert isinstance(attrs, dict)
            uuid = attrs["uuid"]["string"]
            out[str(d["name"])] = (uuid, attrs.get("parentUUID", {"string": uuid})["string"])
        return out


def claim_name(pod: str) -> str:
    """The name of the one ResourceClaim a GPU pod of the DRA world holds."""
    return f"{pod}-gpu"


def _claim(pod: PodRef, device: str) -> dict[str, object]:
    """The ResourceClaim (from the pod's template) the scheduler allocated ``device`` of the
    node's pool and reserved for ``pod``."""
    result = {"request": "gpu", "driver": DRA_DRIVER, "pool": NODE, "device": device}
    return {
        "metadata": {"namespace": pod.namespace, "name": claim_name(pod.name)},
        "status": {
            "allocation": {"devices": {"results": [result]}},
            "reservedFor": [{"resource": "pods", "name": pod.name, "uid": pod.uid}],
        },
    }


@dataclass(frozen=True, slots=True)
class Armed:
    """A fault that strikes inside the next pass: at the ``nth`` event of ``at`` (a GPU
    mutation, a sleep, a patch of the node, the drain's look at the pods)."""

    at: str  # "gpu" | "sleep" | "patch" | "look"
    nth: int
    action: str  # "kill" | "sigterm" | "relabel" | "nvml" | "bind"
    arg: str = ""


@dataclass
class Written:
    """One thing the agent wrote, with the pass it came in and the node's state then."""

    pass_no: int
    what: str  # "reason", "condition", "event <Reason>", "state"
    text: str
    cordoned_by_agent: bool  # the agent's cordon stood when it was written
    gpus_changed: bool  # a GPU had changed in this pass by then
    layout: str | None = None  # the layout label then (a relabel may follow the write)


@dataclass(frozen=True, slots=True)
class Eviction:
    """An eviction the API server granted: the pod, the devices it held (PodResources), the
    layout label and the GPUs when it was granted."""

    ref: PodRef
    devices: frozenset[str]
    layout: str | None
    gpus: NodeState
    # on a DRA node, whether the slice then named the device of the pod's claim by the UUID it
    # holds: a stale or partial slice can name another, or none, and the claim tells no more
    named_true: bool = True


SETTINGS = {
    "drain_timeout_s": 30.0,
    "drain_give_up_s": 120.0,
    "eviction_retry_s": 5.0,
    "device_plugin_timeout_s": 60.0,
    "operand_timeout_s": 60.0,
    "gpu_release_timeout_s": 10.0,
    "backoff_s": 5.0,
    "backoff_max_s": 60.0,
    "poll_s": 1.0,
}


class World:
    """One node of the model: cluster, GPUs, plugin, pods, the agent of the moment, and what
    the invariants need (what was written and evicted, the violations seen mid-pass)."""

    def __init__(
        self,
        catalog: LayoutCatalog,
        *,
        operands: bool,
        podresources: bool,
        reboot: bool,
        plugin_found: bool = True,
        dra: bool = False,
    ) -> None:
        """``dra``: a DRA node on Kubernetes 1.37 (NVIDIA's DRA plugin, DeviceTaintRules
        served); no operands and no PodResources there: its GPU pods hold their devices by
        ResourceClaim."""
        self.dra = dra
        operands, podresources = operands and not dra, podresources and not dra
        self.catalog, self.operands, self.podresources = catalog, operands, podresources
        self.reboot_command = "/sbin/reboot" if reboot else ""
        self.lock = threading.RLock()
        self.time = ModelTime(self)
        self.cluster = ModelCluster()
        self.gpus = ModelGpus(self)
        self.plugin: DevicePluginModel | DraPluginModel = (
            DraPluginModel() if dra else DevicePluginModel(found=plugin_found)
        )
        self.answers = EvictionAnswers()
        self.pods: dict[PodRef, PodFacts] = {}
        self.armed: list[Armed] = []
        self.counts: dict[str, int] = {}
        self.dead = False
        self.agent: Agent | None = None
        self.pass_no = 0
        self.pass_start: tuple[object, ...] = ()
        self.gpu_calls = 0
        # the label when the agent last uncordoned (on a DRA node: began to lift its taints)
        self.uncordoned_for: str | None = None
        self.pass_label: str | None = None
        self.written: list[Written] = []
        self.evictions: list[tuple[int, Eviction]] = []
        self.violations: list[str] = []
        self.seen_problems: set[str] = set()
        self.results: list[PassResult | None] = []
        # (label, since): a failed drain's tries, inside drain_give_up_s of since
        self.drain_failing: tuple[str | None, float] | None = None
        # (label, pods): a drain given up on, as the node's reason said it
        self.given_up: tuple[str | None, frozenset[str]] | None = None
        self.pass_began_at = 0.0
        self.evictions_asked, self.evictions_refused, self.two_budgets_asked = 0, 0, False
        self.names = itertools.count(1)
        self.pids = itertools.count(1000)
        self.reboot_asked = False
        self.boots = 1  # the node's boot: the reboot guard tells a reboot by its id
        self.cluster.add_node(NODE, {DP_LABEL: "true"} if operands else {}, {})
        self.cluster.taints_served = dra
        self.cluster.world = self
        self.cluster.on_change = lambda _c: self.on_change()
        self.plugin.settle(self)

    # -- the agent -----------------------------------------------------------------------

    def new_agent(self) -> Agent:
        """A fresh agent process: nothing of the last one's memory, only what the node says."""
        s = Settings(
            node_name=NODE, config=PROFILES, reboot_command=self.reboot_command, **SETTINGS
        )  # type: ignore[arg-type]
        t = self.time
        agent = Agent(
            s,
            self.cluster,
            self.gpus,
            lambda _p: self.catalog,
            clock=Clock(t.now, t.sleep, t.wait, t.now),
        )
        agent.reboot = self._reboot_asked
        agent.boot_id = lambda: f"boot-{self.boots}"
        if self.podresources:
            agent.pod_devices = self.pod_devices
            agent.allocatable_devices = self.allocatable_devices
        agent.reload_config()
        return agent

    def _reboot_asked(self, command: str) -> None:
        self.reboot_asked = True  # the node reboots once the pass returns

    def run_pass(self, armed: Armed | None = None) -> PassResult | None:
        """One pass of the agent of the moment (a new one after a kill, a stop or a reboot);
        None when it was killed."""
        if self.agent is None:
            self.agent = self.new_agent()
        agent = self.agent
        self.pass_no += 1
        self.counts, self.armed = {}, [armed] if armed else []
        self.pass_start = gpu_layout(self.gpus)
        self.gpu_calls = 0  # the agent's GPU changes asked in this pass
        self.pass_label = self.cluster.nodes[NODE].labels.get(CONFIG)
        self.pass_began_at = self.time.now()
        self.evictions_asked, self.evictions_refused, self.two_budgets_asked = 0, 0, False
        result: PassResult | None = None
        try:
            result = agent.reconcile_once()
        except Crash:
            self.agent = None
        finally:
            self.dead, self.armed = False, []
        if agent.stopping.is_set():
            self.agent = None  # the process exits; its DaemonSet starts another
        if self.reboot_asked:
            self.reboot()
        self.results.append(result)
        self._drain_window(result)
        self.check_always("after the pass")
        return result

    def _drain_window(self, result: PassResult | None) -> None:
        """When the tries of a failed drain began for the label (the start of the first pass
        that failed with the GPUs untouched, no change asked of them, and an eviction refused
        or a pod it evicted still there; no later than the agent's own reckoning), until the
        label changes or a pass succeeds. A pod under two budgets is refused for good, not
        retried: no window."""
        label = self.cluster.nodes[NODE].labels.get(CONFIG)
        if self.drain_failing is not None and self.drain_failing[0] not in (label, self.pass_label):
            self.drain_failing = None  # relabelled since: the window ends
        if self.drain_failing is not None and self.pass_label != label:
            self.drain_failing = None
        if result is None:
            return
        if result.outcome is Outcome.APPLIED or label != self.pass_label:
            self.drain_failing = None
            return
        evicted = {ev.ref for n, ev in self.evictions if n == self.pass_no}
        still_going = any(str(f.ref) for f in self.live_pods() if f.ref in evicted)
        failed_drain = (
            result.outcome is Outcome.FAILED
            and (self.evictions_refused > 0 or still_going)
            and not self.two_budgets_asked
            and gpu_layout(self.gpus) == self.pass_start
            and not self.gpu_calls  # a drain that fails ends the pass before the GPUs
        )
        if failed_drain and (self.drain_failing is None or self.drain_failing[0] != label):
            self.drain_failing = (label, self.pass_began_at)

    def note_give_up(self) -> None:
        """A give-up the node's reason says ("no new try until <pods> are gone or the layout
        label ... changes"): the label and the live pods it names, for the next passes."""
        node = self.cluster.nodes[NODE]
        reason = node.annotations.get("mig-agent.dev/reason", "")
        label = node.labels.get(CONFIG)
        if self.given_up is not None and self.given_up[0] != label:
            self.given_up = None
        if "no new try until" not in reason:
            return
        named = {str(f.ref) for f in self.live_pods() if str(f.ref) in reason}
        if named and self.given_up is None:
            self.given_up = (label, frozenset(named))

    def reboot(self) -> None:
        """The node reboots: pending MIG modes take effect, processes and the plugin start
        again, the agent is a new process."""
        self.reboot_asked, self.agent = False, None
        self.boots += 1
        self.gpus.reboot()
        for facts in self.pods.values():
            facts.pid = None
        if self.plugin.pod is not None:
            self.cluster.pods.pop(self.plugin.pod, None)
        self.plugin.settle(self)
        self.start_processes()

    # -- hooks the fakes call ------------------------------------------------------------

    def api_call(self, call: str) -> None:
        if self.dead:
            raise Crash()

    def gpu_read(self) -> None:
        if self.dead:
            raise Crash()

    def gpu_call(self, op: str) -> None:
        if self.dead:
            raise Crash()
        self.gpu_calls += 1
        self.fire("gpu", op)

    def looked(self) -> None:
        self.fire("look")

    def tick(self, why: str) -> None:
        """Time moved inside a pass (or between passes): the world goes on."""
        self.fire(why)
        with self.lock:
            for ref, facts in list(self.pods.items()):
                if facts.leaves_at is not None and self.time.now() >= facts.leaves_at:
                    self.remove_pod(ref)
            self.plugin.settle(self)
            self.start_processes()
            self.check_always(why)

    def on_change(self) -> None:
        with self.lock:
            self.plugin.settle(self)
            self.check_always("a change of the node or its pods")

    def wrote(self, patch: Mapping[str, object]) -> None:
        """After each node patch of the agent's: what it said, and a fault due after it."""
        labels = patch.get("labels") or {}
        annotations = patch.get("annotations") or {}
        assert isinstance(labels, Mapping) and isinstance(annotations, Mapping)
        if patch.get("unschedulable") is False:  # the agent's uncordon: for the label now
            self.uncordoned_for = self.cluster.nodes[NODE].labels.get(CONFIG)
        if labels.get(STATE):
            self.said("state", str(labels[STATE]))
        reason = annotations.get("mig-agent.dev/reason")
        if reason:
            self.said("reason", str(reason))
        self.fire("patch")

    def said(self, what: str, text: str) -> None:
        node = self.cluster.nodes[NODE]
        ours = node.unschedulable and "mig-agent.dev/cordoned" in node.annotations
        changed = gpu_layout(self.gpus) != self.pass_start
        layout = node.labels.get(CONFIG)
        self.written.append(Written(self.pass_no, what, text, ours, changed, layout))

    def fire(self, at: str, op: str = "") -> None:
        """The armed fault due at this event, if any."""
        self.counts[at] = self.counts.get(at, 0) + 1
        due = [a for a in self.armed if a.at == at and a.nth == self.counts[at]]
        for a in due:
            self.armed.remove(a)
            self.strike(a, op)

    def strike(self, a: Armed, op: str) -> None:
        if a.action == "kill":
            self.dead = True
            raise Crash()
        if a.action == "sigterm" and self.agent is not None:
            self.agent.stopping.set()
        elif a.action == "relabel":
            self.relabel(a.arg or None)
        elif a.action == "nvml" and a.at == "gpu":
            raise GpuError(f"injected NVML failure in {op}", nvml_code=999)
        elif a.action == "bind":
            self.bind_pod(0, late=True, ignore_cordon=True)

    # -- the cluster's other actors ------------------------------------------------------

    def relabel(self, layout: str | None) -> None:
        """Someone sets (None: removes) the layout label: a write of the API server's own, no
        call of the agent's."""
        node = self.cluster.nodes[NODE]
        labels = {k: v for k, v in node.labels.items() if k != CONFIG}
        if layout is not None:
            labels[CONFIG] = layout
        rv = str(int(node.resource_version) + 1)
        self.cluster.nodes[NODE] = replace(node, labels=labels, resource_version=rv)

    def live_pods(self) -> list[PodFacts]:
        out = []
        for ref, facts in self.pods.items():
            pod = self.cluster.pods.get(ref)
            if pod is not None and not pod.finished:
                out.append(facts)
        return out

    def bind_pod(
        self,
        pick: int,
        *,
        owner: str = "ReplicaSet",
        late: bool = False,
        ignore_cordon: bool = False,
        stuck: bool = False,
        slow_s: float = 0.0,
    ) -> PodRef | None:
        """The scheduler and the kubelet place a pod asking one GPU device on the node: one
        of the devices the node advertises (on a DRA node: a ResourceClaim allocated one the
        slice lists and no DeviceTaintRule of the agent's takes out) and no pod holds
        (``pick`` chooses which). None when none is free, or the node is cordoned (a
        DaemonSet's pod tolerates that, and a bind in flight, ``ignore_cordon``, lands all the
        same, taints too). ``late``: its process has not started yet (its container is
        starting)."""
        node = self.cluster.nodes[NODE]
        if node.unschedulable and not ignore_cordon and owner != "DaemonSet":
            return None
        used = {u for f in self.live_pods() for u in f.devices}
        free = self._free_devices(used, ignore_taints=ignore_cordon)
        if not free:
            return None
        device, uuid = free[pick % len(free)]
        kind = {"": "bare", "DaemonSet": "ds"}.get(owner, "train")
        name = f"{kind}-{next(self.names)}"
        if self.dra:
            ref = self.cluster.add_pod(
                "work", name, NODE, labels={"app": name}, owner=owner, claims=(claim_name(name),)
            )
            self.cluster.claims.append(_claim(ref, device))
        else:
            ref = self.cluster.add_pod(
                "work", name, NODE, gpu={device: 1}, labels={"app": name}, owner=owner
            )
        alive = uuid in held_devices(self.gpus)
        facts = PodFacts(ref, frozenset({uuid}), None, stuck, slow_s, bound_alive=alive)
        self.pods[ref] = facts
        if not late:
            self.start_process(facts)
        return ref

    def _free_devices(self, used: set[str], *, ignore_taints: bool) -> list[tuple[str, str]]:
        """(resource, UUID) the node advertises that no pod holds; on a DRA node (device
        name, UUID) of the slice, less those the agent's rules take out."""
        if isinstance(self.plugin, DevicePluginModel):
            advertised = self.plugin.advertised(self.cluster.nodes[NODE])
            return sorted((r, u) for r, us in advertised.items() for u in us if u not in used)
        rules = device_taints.rules_of_node(self.cluster.taint_rules.values(), NODE)
        tainted = set() if ignore_taints else set(rules)
        listed = self.plugin.listed()
        return sorted((n, u) for n, (u, _) in listed.items() if u not in used and n not in tainted)

    def start_process(self, facts: PodFacts) -> None:
        """The pod's CUDA process starts on its device, if the device is there."""
        held = held_devices(self.gpus)
        devices = [held[u] for u in facts.devices if u in held]
        if facts.pid is not None or not devices:
            return
        d = devices[0]
        facts.pid = next(self.pids)
        self.gpus.add_process(d.gpu, facts.pid, d.gi_id, d.ci_id if d.gi_id is not None else None)

    def start_processes(self) -> None:
        for facts in self.live_pods():
            if facts.pid is None and facts.bound_alive:
                self.start_process(facts)

    def stop_process(self, facts: PodFacts) -> None:
        if facts.pid is None:
            return
        for i, g in self.gpus.gpus.items():
            self.gpus.gpus[i] = replace(
                g, processes=tuple(p for p in g.processes if p.pid != facts.pid)
            )
        facts.pid = None

    def remove_pod(self, ref: PodRef) -> None:
        facts = self.pods.pop(ref, None)
        if facts is not None:
            self.stop_process(facts)
        self.cluster.pods.pop(ref, None)
        self._release_claims(ref)

    def _release_claims(self, ref: PodRef) -> None:
        """The pod gone or finished: its claim is reserved for it no more (and deleted, as a
        claim made from a template is)."""
        self.cluster.claims = [
            c for c in self.cluster.claims if c["metadata"]["name"] != claim_name(ref.name)
        ]

    def finish_pod(self, pick: int) -> None:
        """A GPU pod's work ends: it succeeds, its process ends, its object stays."""
        live = [f for f in self.live_pods() if not self.cluster.pods[f.ref].terminating]
        if not live:
            return
        facts = live[pick % len(live)]
        self.stop_process(facts)
        self.cluster.pods[facts.ref] = replace(self.cluster.pods[facts.ref], phase="Succeeded")
        self._release_claims(facts.ref)

    def evict(self, ref: PodRef) -> None:
        """One eviction, answered as its script says (model_answers) through the real client."""
        facts = self.pods.get(ref)

        def granted() -> None:
            with self.lock:
                pod = self.cluster.pods.get(ref)
                if pod is None:
                    return  # the API server's 404: the client takes it as gone
                devices = facts.devices if facts else frozenset()
                layout = self.cluster.nodes[NODE].labels.get(CONFIG)
                state = FakeGpus.observe(self.gpus)
                named = self._claim_named_true(ref, devices)
                self.evictions.append((self.pass_no, Eviction(ref, devices, layout, state, named)))
                if facts is not None and (facts.stuck or facts.slow_s):
                    self.cluster.pods[ref] = replace(pod, terminating=True)
                    facts.leaves_at = None if facts.stuck else self.time.now() + facts.slow_s
                else:
                    self.remove_pod(ref)
                self.cluster.evicted.append(ref)
                self.on_change()

        self.evictions_asked += 1
        script = self.answers.scripts.get(ref) or [Answer.GRANTED]
        self.two_budgets_asked |= Answer.TWO_BUDGETS in script
        before = len(self.evictions)
        try:
            self.answers.evict(ref, self.cluster.pods.get(ref), granted, self.time.advance)
        finally:
            self.evictions_refused += len(self.evictions) == before

    def _claim_named_true(self, ref: PodRef, devices: frozenset[str]) -> bool:
        """Not a DRA node, or its slice names the device of ``ref``'s claim by a UUID the pod
        holds."""
        if isinstance(self.plugin, DevicePluginModel):
            return True
        listed = self.plugin.listed()
        for c in self.cluster.claims:
            if c["metadata"]["name"] == claim_name(ref.name):
                [result] = c["status"]["allocation"]["devices"]["results"]
                return listed.get(result["device"], ("", ""))[0] in devices
        return False

    def pod_devices(self) -> Mapping[tuple[str, str], frozenset[str]]:
        """The kubelet's PodResources List: the devices each pod on the node was given."""
        with self.lock:
            return {(f.ref.namespace, f.ref.name): f.devices for f in self.live_pods()}

    def allocatable_devices(self) -> Mapping[str, frozenset[str]]:
        """The kubelet's GetAllocatableResources: the devices its live registration offers."""
        with self.lock:
            return dict(self.plugin.registered) if self.plugin.healthy else {}

    # -- invariants seen mid-pass --------------------------------------------------------

    def check_always(self, where: str) -> None:
        from tests.unit.model_invariants import always

        for problem in always(self):
            self.violated(problem, where)

    def violated(self, problem: str, where: str) -> None:
        """Record ``problem`` once, where and when it was first seen."""
        if problem not in self.seen_problems:
            self.seen_problems.add(problem)
            self.violations.append(
                f"pass {self.pass_no}, t={self.time.now():.1f} s, {where}: {problem}"
            )

    # -- once the faults stop ------------------------------------------------------------

    def calm(self) -> None:
        """The transient faults stop: the API server answers evictions but for budgets, the
        plugin is honest again (a crash-looping pod replaced by one that starts), nothing is
        armed. What the operator must fix stays: the label, budgets, bare and DaemonSet GPU
        pods, pods stuck terminating, a MIG mode change that needs a reboot."""
        self.answers.calm()
        self.armed = []
        crashed = self.plugin.mode == "crashing"
        self.plugin.mode, self.plugin.delay_s = "honest", 0.0
        if crashed and self.plugin.pod is not None:
            self.cluster.pods.pop(self.plugin.pod, None)
        self.plugin.settle(self)

    def standing(self) -> list[tuple[str, ...]]:
        """What the operator must fix for the label to be applied, each as the words a reason
        must name (all of one tuple): a label no layout of these GPUs answers, a GPU pod of
        no controller or of a DaemonSet, a pod stuck terminating, a budget that never allows
        the eviction (both budgets and the pod, where two cover it), a MIG mode change
        without a reboot command, a device plugin the agent's selector does not find."""
        from tests.unit.model_invariants import changing_gpus

        out: list[tuple[str, ...]] = []
        label = self.cluster.nodes[NODE].labels.get(CONFIG)
        if label and label not in self.catalog:
            out.append((label,))  # "unknown layout ...; did you mean ..."
        elif label and changing_gpus(self, label) is None:
            out.append(("GPU",))  # which GPU cannot hold what
        for facts in self.live_pods():
            pod = self.cluster.pods[facts.ref]
            name = facts.ref.name
            if not pod.owner_kinds or "DaemonSet" in pod.owner_kinds:
                out.append((name,))
            if facts.stuck and pod.terminating:
                out.append((name,))
            script = self.answers.scripts.get(facts.ref) or [Answer.GRANTED]
            budgets = self.answers.budgets.get(facts.ref, ())
            if script[-1] is Answer.BUDGET:
                out.append(budgets[:1])
            elif script[-1] is Answer.TWO_BUDGETS:
                out.append((name, *budgets))
        # a drain given up on tries no more until its pods go or the label changes (as the
        # node's record keeps it), though a budget may allow the eviction by now: the pod
        # named, unless what blocks it stands (named above: its budgets)
        given_up = self._given_up()
        for facts in self.live_pods():
            script = self.answers.scripts.get(facts.ref) or [Answer.GRANTED]
            standing = script[-1] in (Answer.BUDGET, Answer.TWO_BUDGETS)
            if str(facts.ref) in given_up and not standing:
                out.append((facts.ref.name,))
        if self.gpus.pending and not self.reboot_command:
            out.append(("reboot",))
        if not self.plugin.found:
            # the plugin's pods, where the agent looks for them (the selector named)
            out.append(("app=nvidia-device-plugin-daemonset",))
        return out

    def _given_up(self) -> set[str]:
        """The pods the node's record says a drain gave up on."""
        text = self.cluster.nodes[NODE].annotations.get("mig-agent.dev/guard")
        return set(json.loads(text).get("givenUp", [])) if text else set()

    def settle(self, passes: int = 6) -> list[str]:
        """The faults stopped, up to ``passes`` passes as the loop runs them (each after the
        back-off the last asked for); the violations seen on the way."""
        from tests.unit.model_invariants import after_pass

        self.calm()
        problems: list[str] = []
        for _ in range(passes):
            result = self.run_pass()
            problems += after_pass(self)
            if result is not None and result.retry_after_s is None:
                break
            self.time.sleep(result.retry_after_s if result is not None else 0.5)
        return problems
