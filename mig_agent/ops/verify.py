"""``verify``: the operator's checks of GPU nodes, from the operator's machine.

Per node, in order (a failed check stops the node's later ones, which would only repeat it):

1. ``gpu-state``: the node's GPUs as NVML reports them there, as its agent publishes them on the
   node, with the age of that publication; its layout state, if any, is not pending or failed;
2. ``allocatable``: the node advertises what those GPUs make under its MIG strategy (NVIDIA's
   device plugin's rules, mig_agent.core.advertised), or on a DRA node its ResourceSlice lists
   those devices;
3. ``pod <resource>``: per advertised resource kind a tiny pod (verify_pods), pinned to the node,
   given one device; its ``nvidia-smi -L`` must show exactly one device of that kind, one the
   node's GPU state lists. On a DRA node, per MIG profile its slice lists whose extended
   resource a DeviceClass serves (``mig-agent dra-classes``): the same pod, asking that resource
   as a pod written for the device plugin does, placed by the scheduler (which makes its
   claim). The pods are deleted afterwards by their run's label, whatever happened (an error,
   Ctrl-C, SIGTERM; a pod whose create's answer was lost too).

Time and output are injected; the Kubernetes side is the Cluster and PodRunner interfaces.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Final, Protocol

from mig_agent.config.settings import Settings
from mig_agent.core import device_classes, dra_devices
from mig_agent.core.advertised import (
    expected_resources,
    format_resources,
    node_mig_strategy,
    plugin_devices,
)
from mig_agent.core.device_listing import (
    age_text,
    allocatable_problem,
    listing_problem,
    published_devices,
)
from mig_agent.core.errors import ConfigError, MigAgentError
from mig_agent.core.gpu_models import GpuModel
from mig_agent.core.labels import State
from mig_agent.core.observed import NodeState
from mig_agent.core.snapshot import from_json
from mig_agent.kube.cluster import Cluster, NodeView, PodRef, PodRunner
from mig_agent.node.waits import Clock
from mig_agent.ops.dra_view import read as dra_view_of
from mig_agent.ops.values import DEFAULT_SETTINGS, REAL_CLOCK, Writer
from mig_agent.ops.verify_pods import RUN_LABEL, PodSpec, manifest, outcome, pod_name

POLL_S = 0.5
DEFAULT_PODS: Final = PodSpec()


class VerifyCluster(Cluster, PodRunner, Protocol):
    """The API ``verify`` reads and makes its pods through."""


@dataclass(frozen=True, slots=True)
class Check:
    name: str  # gpu-state, allocatable, pod nvidia.com/mig-1g.10gb
    ok: bool
    detail: str
    hint: str = ""  # where a failed one's cause is to be looked for


@dataclass(frozen=True, slots=True)
class NodeVerdict:
    node: str
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failed(self) -> Check | None:
        return next((c for c in self.checks if not c.ok), None)


@dataclass(frozen=True, slots=True)
class _Gpus:
    """The node's published GPUs, read back."""

    node: NodeState
    models: dict[int, GpuModel]
    has_uuids: bool
    strategy: str
    dra: bool = False  # a DRA node: its pods placed by the scheduler through DeviceClasses


def verify(
    cluster: VerifyCluster,
    nodes: Sequence[str],
    *,
    pods: PodSpec = DEFAULT_PODS,
    settings: Settings = DEFAULT_SETTINGS,
    clock: Clock = REAL_CLOCK,
    out: Writer = print,
) -> list[NodeVerdict]:
    """Check ``nodes`` one after the other, writing each check's line to ``out``."""
    if pods.timeout_s <= 0:
        raise ConfigError(f"the pods' timeout must be positive, got {pods.timeout_s}")
    verdicts = []
    for name in nodes:
        out(name)
        verdict = verify_node(cluster, name, pods=pods, settings=settings, clock=clock, out=out)
        out(f"  {'ok' if verdict.ok else 'FAILED'}: {name}")
        verdicts.append(verdict)
    return verdicts


def verify_node(
    cluster: VerifyCluster,
    name: str,
    *,
    pods: PodSpec = DEFAULT_PODS,
    settings: Settings = DEFAULT_SETTINGS,
    clock: Clock = REAL_CLOCK,
    out: Writer = print,
) -> NodeVerdict:
    """The checks of one node (see the module's docstring), each written to ``out`` once made."""
    checks: list[Check] = []

    def add(check: Check) -> bool:
        checks.append(check)
        out(check_line(check))
        return check.ok

    try:
        node = cluster.get_node(name)
        check, gpus = _gpu_state(node, settings, clock)
        if add(check) and gpus is not None:
            check, resources, gpus = _allocatable(cluster, node, gpus, settings)
            if add(check) and resources:
                for c in _pods(cluster, name, resources, gpus, pods, clock, out):
                    add(c)
    except MigAgentError as exc:
        add(Check("api", False, str(exc), "the API server, the kubeconfig's rights"))
    return NodeVerdict(name, tuple(checks))


def check_line(c: Check) -> str:
    line = f"  {'ok  ' if c.ok else 'FAIL'}  {c.name}: {c.detail}"
    return line if c.ok or not c.hint else f"{line}\n        look at: {c.hint}"


def _gpu_state(node: NodeView, s: Settings, clock: Clock) -> tuple[Check, _Gpus | None]:
    name = "gpu-state"
    text = node.annotations.get(s.gpu_state_annotation)
    if text is None:
        return Check(
            name,
            False,
            f"no GPU state published on the node ({s.gpu_state_annotation})",
            "whether mig-agent runs on the node (its pod, its log)",
        ), None
    try:
        raw = json.loads(text)
        state, models = from_json(raw)
        strategy = node_mig_strategy(
            node.labels, label=s.mig_strategy_label, fallback=s.mig_strategy
        )
    except (ValueError, MigAgentError) as exc:
        return Check(name, False, f"the published GPU state is unreadable: {exc}"), None
    has_uuids = all("uuid" in g for g in raw.get("gpus", ()))
    gpus = _Gpus(state, models, has_uuids, strategy)
    detail = f"{_describe(state, models)}; published by the agent{_age(node, s, clock)}"
    layout, st = node.labels.get(s.config_label), node.labels.get(s.state_label)
    if st is not None and st != State.SUCCESS:
        reason = node.annotations.get(s.reason_annotation, "")
        return Check(
            name,
            False,
            f"layout {layout} is {st}{': ' + reason if reason else ''} ({detail})",
            "mig-agent status; the agent's log on the node",
        ), gpus
    return Check(name, True, detail + (f"; layout {layout}" if layout else "")), gpus


def _describe(state: NodeState, models: Mapping[int, GpuModel]) -> str:
    by_model = Counter(models[g.index].key for g in state.gpus)
    text = ", ".join(f"{n}x {m}" for m, n in sorted(by_model.items())) or "no GPU"
    devices = plugin_devices(state, models)
    mig = sorted(i for i, d in devices.items() if d is not None)
    if mig:
        made: Counter[str] = Counter()
        for i in mig:
            made.update(devices[i] or {})
        each = ", ".join(f"{n}x {p}" for p, n in sorted(made.items())) or "no MIG device"
        text += f"; MIG on GPU {','.join(map(str, mig))}: {each}"
    return text


def _age(node: NodeView, s: Settings, clock: Clock) -> str:
    written = node.annotations_written.get(s.gpu_state_annotation, "")
    try:
        at = datetime.fromisoformat(written.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return " (its age unknown)"
    return f" (its last write to the node {age_text(clock.wall() - at)} ago)"


def _allocatable(
    cluster: VerifyCluster, node: NodeView, gpus: _Gpus, s: Settings
) -> tuple[Check, dict[str, int], _Gpus]:
    """The check, the resources to make a pod of each, and the GPUs as their pods judge them
    (a DRA node's: as the mixed strategy's resources, which its DeviceClasses serve)."""
    name = "allocatable"
    expected = expected_resources(gpus.node, gpus.models, gpus.strategy)
    has = node.gpu_resources()
    if not has and s.dra:
        slices = dra_view_of(cluster).slices
        if dra_devices.publishes(slices, node.name):
            check, served = _slice_check(cluster, slices, node.name, gpus)
            return check, served, replace(gpus, strategy="mixed", dra=True)
    problem = allocatable_problem(expected, has)
    how = f"the {gpus.strategy} MIG strategy"
    if problem:
        return (
            Check(
                name,
                False,
                f"{problem} (under {how})",
                "the device plugin's pod on the node (its log, its MIG strategy, its config), "
                "the node's capacity (unhealthy devices)",
            ),
            has,
            gpus,
        )
    return Check(name, True, f"{format_resources(has)}, as the GPUs make under {how}"), has, gpus


def _slice_check(
    cluster: VerifyCluster, slices: Sequence[Mapping[str, Any]], node: str, gpus: _Gpus
) -> tuple[Check, dict[str, int]]:
    """A DRA node: its ResourceSlice lists the devices its GPUs make; and the extended
    resources DeviceClasses serve its MIG devices as (a pod of each is made)."""
    want = dra_devices.expected_devices(plugin_devices(gpus.node, gpus.models))
    published = dra_devices.published_devices(slices, node)
    problem = dra_devices.difference(want, published)
    if problem:
        return Check(
            "resourceslice",
            False,
            f"the node's ResourceSlice differs from its GPUs: {problem}",
            "NVIDIA's DRA kubelet plugin on the node (its pod, its log)",
        ), {}
    listed = format_resources(dra_devices.named(published))
    by_profile = {p: r for r, p in _served_profiles(cluster).items()}
    served = {
        by_profile[kind[1]]: n
        for kind, n in published.items()
        if kind[0] == "mig" and kind[1] in by_profile
    }
    if not served:
        return Check(
            "resourceslice",
            True,
            f"{listed}; no pod made (no DeviceClass serves these devices as an extended "
            "resource: mig-agent dra-classes)",
        ), {}
    through = ", ".join(sorted(served))
    return Check("resourceslice", True, f"{listed}; a pod each through DeviceClasses: {through}"), (
        served
    )


def _served_profiles(cluster: VerifyCluster) -> dict[str, str]:
    """Extended resource -> MIG profile, as the cluster's DeviceClasses serve them; none where
    they may not be read (a pod of each is then not made)."""
    try:
        return device_classes.served_profiles(cluster.list_device_classes())
    except MigAgentError as exc:
        if exc.context.get("status") in (403, 404):
            return {}
        raise


def _pods(
    cluster: VerifyCluster,
    node: str,
    resources: Mapping[str, int],
    gpus: _Gpus,
    spec: PodSpec,
    clock: Clock,
    out: Writer,
) -> list[Check]:
    """A pod per resource, run at once; each judged once it ended; all deleted in the end by
    the run's label, whatever ends the run (SIGTERM too: _sigterm_interrupts)."""
    run = secrets.token_hex(3)
    made: dict[str, PodRef] = {}
    with _sigterm_interrupts():
        try:
            refused = _make_pods(cluster, node, resources, spec, run, made, scheduled=gpus.dra)
            judged = {**refused, **_judge_pods(cluster, made, gpus, spec, clock)}
            return [judged[r] for r in sorted(resources)]
        finally:
            _delete_run(cluster, spec.namespace, run, made.values(), out)


def _make_pods(
    cluster: VerifyCluster,
    node: str,
    resources: Mapping[str, int],
    spec: PodSpec,
    run: str,
    made: dict[str, PodRef],
    *,
    scheduled: bool = False,
) -> dict[str, Check]:
    """Make the run's pods, into ``made`` as each is made; the checks of those refused."""
    refused: dict[str, Check] = {}
    for resource in sorted(resources):
        name = pod_name(node, resource, run)
        body = manifest(name, node, resource, spec, run, scheduled=scheduled)
        try:
            made[resource] = cluster.create_pod(spec.namespace, body)
        except MigAgentError as exc:  # noqa: PERF203 - each pod gets its try
            refused[resource] = Check(
                f"pod {resource}",
                False,
                f"the pod could not be made: {exc}",
                "--runtime-class (a RuntimeClass the cluster has), --pod-namespace (one that "
                "exists, its quotas and policies), your rights to make pods there",
            )
    return refused


def _delete_run(
    cluster: VerifyCluster, namespace: str, run: str, made: Iterable[PodRef], out: Writer
) -> None:
    """Delete the run's pods: those its label finds (one whose create failed after the server
    made it, too) and those made (should the list fail). A pod left would hold its device, and
    every later change of the node would be refused for a pod no controller owns: said."""
    pods = {(r.namespace, r.name): r for r in made}
    selector = f"{RUN_LABEL}={run}"
    try:
        listed = cluster.list_pods(namespace=namespace, label_selector=selector)
        pods.update(((p.ref.namespace, p.ref.name), p.ref) for p in listed)
    except MigAgentError as exc:
        out(f"  WARN  verify's pods could not be listed ({exc}): deleting those it knows")
    for ref in pods.values():
        try:
            cluster.delete_pod(ref)
        except MigAgentError as exc:  # noqa: PERF203 - each pod gets its try
            out(
                f"  WARN  pod {ref} was not deleted ({exc}): "
                f"kubectl delete pod -n {namespace} -l {selector}"
            )


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while verify's pods exist, so that their deletion runs
    (by default SIGTERM ends Python at once, past every finally); a second one is not let cut
    the deletion short. Only in the main thread, over the default disposition: a program with
    a handler of its own keeps it."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
    ):
        yield
        return
    told = False

    def interrupt(_signum: int, _frame: object) -> None:
        nonlocal told
        if not told:
            told = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _judge_pods(
    cluster: VerifyCluster,
    made: Mapping[str, PodRef],
    gpus: _Gpus,
    spec: PodSpec,
    clock: Clock,
) -> dict[str, Check]:
    published = published_devices(gpus.node, gpus.models) if gpus.has_uuids else {}
    deadline = clock.now() + spec.timeout_s
    checks: dict[str, Check] = {}
    while True:
        for resource, ref in made.items():
            if resource in checks:
                continue
            pod = cluster.read_pod(ref)
            events = [] if pod and _phase(pod) == "Succeeded" else cluster.pod_events(ref)
            o = outcome(pod, events)
            name = f"pod {resource}"
            if not o.done and clock.now() < deadline:
                continue
            if not o.done:
                why = f"not ended after {spec.timeout_s:.0f} s: {o.why}"
                checks[resource] = Check(name, False, why, o.hint)
            elif not o.ran or o.why:
                checks[resource] = Check(name, False, f"{ref.name}: {o.why}", o.hint)
            else:
                checks[resource] = _listing_check(cluster, ref, resource, gpus, published)
        if len(checks) == len(made):
            return checks
        clock.sleep(POLL_S)


def _listing_check(
    cluster: VerifyCluster,
    ref: PodRef,
    resource: str,
    gpus: _Gpus,
    published: Mapping[str, Any],
) -> Check:
    log = cluster.pod_log(ref)
    problem = listing_problem(resource, gpus.strategy, log, gpus.node, published)
    name = f"pod {resource}"
    if problem:
        return Check(
            name,
            False,
            f"{ref.name}: {problem}",
            "the device plugin's Allocate (the device it names) and the runtime's CDI spec "
            "(the devices it injects for that name)",
        )
    lines = [ln.strip() for ln in log.splitlines() if ln.strip().startswith(("GPU ", "MIG "))]
    return Check(name, True, f"{ref.name} saw {lines[-1] if lines else 'its device'}")


def _phase(pod: Mapping[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase", ""))


def verdicts_json(verdicts: Sequence[NodeVerdict]) -> list[dict[str, Any]]:
    return [
        {
            "node": v.node,
            "ok": v.ok,
            "failed_check": v.failed.name if v.failed else None,
            "checks": [
                {"name": c.name, "ok": c.ok, "detail": c.detail, "hint": c.hint} for c in v.checks
            ],
        }
        for v in verdicts
    ]
