"""Host GPU clients around a MIG mode change that needs a GPU reset (Ampere: A100, A30).

Services of the host (nvidia-dcgm, nvsm, ...: the GPU Operator's ``default-gpu-clients`` list)
hold the GPU, and a reset fails while they do. With ``stop_host_gpu_clients`` the agent stops
those that are active, through ``host_service_command`` (systemctl in the host's root), for the
apply and starts them again after, as MIG Manager does. The services it stopped are written on
the Node first, so that a restarted agent starts them again. Without it, a reset they block
fails with a reason that names the running services and the processes on the GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import structlog

from mig_agent.agent import reporting
from mig_agent.config.settings import Settings
from mig_agent.core import planner
from mig_agent.core.errors import GpuBusy, HostServiceFailed, MigAgentError
from mig_agent.core.gpu_models import GpuModel
from mig_agent.host.commands import Runner, load_gpu_clients, service_command
from mig_agent.kube.cluster import Cluster, NodeView

log = structlog.get_logger(__name__)


def reset_gpus(the_plan: planner.Plan, models: Mapping[int, GpuModel]) -> list[int]:
    """The GPUs whose MIG mode changes on a model that needs a reset for it (Ampere)."""
    return [
        g.gpu
        for g in the_plan.gpus
        if g.changes_mig_mode and models[g.gpu].architecture.mig_mode_needs_reset
    ]


def services(s: Settings) -> tuple[str, ...]:
    """The services of the GPU clients file (none without one); InvalidConfig if malformed."""
    return load_gpu_clients(s.host_gpu_clients_file) if s.host_gpu_clients_file else ()


STOPPED_STATES = frozenset({"inactive", "failed", "unknown", "dead", "deactivating"})
"""What ``systemctl is-active`` prints (exiting non-zero) for a unit that holds no GPU now."""


def active(s: Settings, run: Runner, names: tuple[str, ...]) -> tuple[list[str], str]:
    """Those of ``names`` that are running (``is-active`` exits 0), and why that could not be
    told ("" when it could): a non-zero exit counts as stopped only when the command printed
    a unit state, as systemctl does; else (no chroot, no systemctl) nothing is known."""
    running: list[str] = []
    for name in names:
        done = run(
            service_command(s.host_service_command, "is-active", name), {}, s.command_timeout_s
        )
        said = done.output.strip().splitlines()[-1:] if done.output.strip() else []
        if done.returncode == 0 and not done.error:
            running.append(name)
        elif done.error or not said or said[0].strip() not in STOPPED_STATES:
            return running, f"`{s.host_service_command} is-active {name}` {done.failure()}"
    return running, ""


@contextlib.contextmanager
def stopped(
    cluster: Cluster, s: Settings, run: Runner, gpus: list[int], node: NodeView
) -> Iterator[list[str]]:
    """Stop the active host GPU clients for the body, when ``gpus`` need a reset and
    stop_host_gpu_clients is on; start them again after. Yields the services stopped.

    A service that does not stop fails the pass (HostServiceFailed), after starting those
    already stopped. After a successful body, a service that does not start again fails it
    too (the Node keeps the list, and the next pass tries again); after a failed body that is
    only logged, so that the body's error is the reason."""
    if not gpus or not s.stop_host_gpu_clients:
        yield []
        return
    running, why = active(s, run, services(s))
    if why:
        raise HostServiceFailed(f"cannot tell which host GPU clients run: {why}")
    if not running:
        log.info("host_clients.none_active", gpus=gpus)
        yield []
        return
    # on the Node first: a crash from here on leaves the list for the next agent
    cluster.patch_node(s.node_name, annotations={s.host_services_annotation: ",".join(running)})
    done: list[str] = []
    try:
        for name in running:
            result = run(
                service_command(s.host_service_command, "stop", name), {}, s.command_timeout_s
            )
            if not result.ok:
                raise HostServiceFailed(
                    f"could not stop host GPU client {name} for the reset of GPU(s) {gpus}: "
                    f"{result.failure()}",
                    service=name,
                )
            done.append(name)
        log.info("host_clients.stopped", services=done, gpus=gpus)
        reporting.event(
            cluster,
            node,
            "MIGHostClientsStopped",
            f"stopped host GPU client(s) {', '.join(done)} for the reset of GPU(s) {gpus}",
        )
        yield done
    except Exception:  # a kill (not an exception) leaves the list for the next agent
        with contextlib.suppress(MigAgentError):
            failed = start(cluster, s, run, running)
            if failed:
                log.error("host_clients.start_failed", failed=failed)
        raise
    failed = start(cluster, s, run, running)
    if failed:
        raise HostServiceFailed(
            "host GPU client(s) not started again after the change: " + "; ".join(failed),
            services=running,
        )
    reporting.event(
        cluster,
        node,
        "MIGHostClientsStarted",
        f"started host GPU client(s) {', '.join(running)} again",
    )


def start(cluster: Cluster, s: Settings, run: Runner, names: list[str]) -> list[str]:
    """Start ``names`` again; clears the Node's list when all started. Returns the failures
    (service and why); the list stays on the Node then."""
    failed = []
    for name in names:
        result = run(
            service_command(s.host_service_command, "start", name), {}, s.command_timeout_s
        )
        if not result.ok:
            failed.append(f"{name}: {result.failure()}")
    if not failed:
        cluster.patch_node(s.node_name, annotations={s.host_services_annotation: None})
        log.info("host_clients.started", services=names)
    return failed


def start_leftover(
    cluster: Cluster, s: Settings, run: Runner, annotations: Mapping[str, str]
) -> None:
    """Start the services a previous pass (or agent) stopped and did not start again.

    Only services of the clients list: anyone who may patch the Node can write the
    annotation, and it must not make the agent start whatever unit it names."""
    if s.host_services_annotation not in annotations:
        return
    listed = set(services(s))
    names = [n for n in annotations[s.host_services_annotation].split(",") if n]
    foreign = [n for n in names if n not in listed]
    if foreign:
        log.warning(
            "host_clients.not_listed", services=foreign, annotation=s.host_services_annotation
        )
    names = [n for n in names if n in listed]
    failed = start(cluster, s, run, names)
    if failed:
        raise HostServiceFailed(
            "host GPU client(s) stopped by an earlier pass do not start "
            "again: " + "; ".join(failed),
            services=names,
        )


def blocking(s: Settings, run: Runner, gpus: list[int]) -> str:
    """For a reset of ``gpus`` that processes block: what of the host may hold them."""
    where = f"GPU(s) {gpus} need a reset for the MIG mode change"
    if s.stop_host_gpu_clients:
        return (
            f"{where}; the host GPU clients of {s.host_gpu_clients_file} were stopped, "
            "so other processes hold the GPU"
        )
    if not s.host_gpu_clients_file:
        return (
            f"{where}; host services may hold the GPU (nvidia-dcgm, nvsm, ...): name them "
            "in MIG_AGENT_HOST_GPU_CLIENTS_FILE and set MIG_AGENT_STOP_HOST_GPU_CLIENTS=true "
            "to have them stopped for the reset, or stop them by hand"
        )
    try:
        names = services(s)
    except MigAgentError as exc:
        return f"{where}; {exc}"
    running, why = active(s, run, names)
    if why:
        return (
            f"{where}; the host GPU clients of {s.host_gpu_clients_file} "
            f"({', '.join(names)}) may hold the GPU ({why})"
        )
    if not running:
        return (
            f"{where}; none of the host GPU clients of {s.host_gpu_clients_file} runs, so "
            "other processes hold the GPU"
        )
    return (
        f"{where}; host GPU client service(s) running: {', '.join(running)} (stopping them "
        "is off: set MIG_AGENT_STOP_HOST_GPU_CLIENTS=true, or stop them by hand)"
    )


def name_blockers(s: Settings, run: Runner, exc: GpuBusy, reset_gpus: list[int]) -> None:
    """A busy GPU that a reset needs: raise it with what of the host may hold it added to the
    reason; any other busy GPU is left to raise as it is."""
    if reset_gpus:
        raise GpuBusy(f"{exc}; {blocking(s, run, reset_gpus)}", **exc.context) from exc
