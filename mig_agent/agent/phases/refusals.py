"""What refuses a change before anything is touched (no cordon, no pause, no GPU step):
malformed hook or host GPU client files, processes on the GPUs that no drain would end, and GPU
pods the drain must not evict. Each refusal names what to fix; the agent retries."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from mig_agent.agent import host_clients, marks
from mig_agent.agent.change import Change, Holds, Tools
from mig_agent.agent.phases.holders import Holders
from mig_agent.core import planner
from mig_agent.core.errors import DrainGivenUp, DrainRefused, GpuBusy, MigAgentError
from mig_agent.kube.cluster import PodView
from mig_agent.node import hooks
from mig_agent.node.waits import poll_delays

log = structlog.get_logger(__name__)

_BEFORE_APPLY = (hooks.APPLY_START, hooks.PRE_APPLY_MODE, hooks.PRE_APPLY_CONFIG)


@dataclass(frozen=True)
class Refusals:
    tools: Tools
    holders: Holders

    def check(self, change: Change) -> tuple[hooks.HookRunner, list[int]]:
        """The hooks to run and the GPUs to reset, once nothing refuses the change."""
        s = self.tools.settings
        # the files of the hooks and host GPU clients, read before anything changes
        hook_run = hooks.HookRunner(
            hooks.load(s),
            self.tools.run_command,
            s.command_timeout_s,
            hooks.context(s, change.desired, change.plan, change.observed),
        )
        reset_gpus = host_clients.reset_gpus(change.plan, change.models)
        if reset_gpus and s.stop_host_gpu_clients:
            host_clients.services(s)
        self._refuse_a_drain_given_up(change)
        if self._may_tell_holders(change, hook_run):
            self._refuse_what_no_drain_ends(change, reset_gpus)
        self._refuse_what_the_drain_must_not_evict(change)
        return hook_run, reset_gpus

    def _refuse_a_drain_given_up(self, change: Change) -> None:
        """DrainGivenUp again, before anything is touched, while the pods a drain of this
        layout gave up on are still on the node (the node's record names them): a give-up ends
        the retries until they go or the label changes."""
        t = self.tools
        record = marks.record(t.settings, change.node)
        if record is None or record.layout != change.desired or not record.given_up:
            return
        # a pod that completed holds no device, though its object stays
        here = _names(
            [p for p in change.node_pods(t.cluster, t.settings.node_name) if not p.finished]
        )
        left = sorted(p for p in record.given_up if p in here)
        if left:
            cause = f" ({record.given_up_why})" if record.given_up_why else ""
            raise DrainGivenUp(
                f"the drain of layout {change.desired} was given up on{cause}: "
                + ", ".join(left)
                + " still on the node; no new try until they are gone or the layout label or "
                "the config changes",
                given_up=tuple(left),
                cause=record.given_up_why,
            )

    def _may_tell_holders(self, change: Change, hook_run: hooks.HookRunner) -> bool:
        """Left to the re-plan after the drain when the kubelet cannot tell who holds what, or
        when the site's hooks before the apply may end the processes themselves."""
        knows = self.tools.pod_devices is not None or change.dra
        return knows and not any(hook_run.hooks.of(h) for h in _BEFORE_APPLY)

    def _refuse_what_no_drain_ends(self, change: Change, reset_gpus: list[int]) -> None:
        """GpuBusy when the plan would end processes on devices no pod holds (a host process, a
        container outside Kubernetes): the drain cannot end them, so cordoning and evicting
        would only cost the pods and the wait. Those of a pod just deleted may linger a moment
        (container teardown): looked at again until ``gpu_release_timeout_s``. The host GPU
        clients the agent stops for a reset are not counted."""
        t = self.tools
        s = t.settings
        stopped = set(reset_gpus) if s.stop_host_gpu_clients else set()
        deadline = t.clock.now() + s.gpu_release_timeout_s
        delays = poll_delays(s.poll_s)
        observed, holds = change.observed, _Asked(self.holders, change)
        while True:
            ended = [
                p
                for p in planner.ended_processes(change.plan, observed)
                if p.devices and p.gpu not in stopped
            ]
            known = holds.for_pids(frozenset(p.pid for p in ended)) if ended else None
            if known is None:
                return  # nothing ended, or who holds what cannot be told: the re-plan decides
            held = frozenset().union(*known.values())
            foreign = [p for p in ended if not p.devices & held]
            if not foreign:
                return
            if t.clock.now() >= deadline:
                raise _busy(t, foreign, reset_gpus)
            log.info("gpu.waiting_for_processes", pids=_pids(foreign), held_by="no pod")
            t.clock.sleep(next(delays))
            observed = t.gpus.observe()

    def _refuse_what_the_drain_must_not_evict(self, change: Change) -> None:
        """DrainRefused, before the cordon, for GPU pods the drain would evict but must not: a
        DaemonSet's that no paused operand label stops (it would come back at once and take
        its device again: GpuBusy at every retry), a static pod, or one no controller owns
        (gone for good: kubectl drain's default), naming each."""
        if change.plan.is_empty:
            return
        _, refusals = self.holders.drain_plan(change)
        if refusals:
            raise DrainRefused("; ".join(refusals) + "; nothing was touched")


class _Asked:
    """Who holds what, asked again only for processes not there before (a pod that started
    since): the processes of pods just deleted linger on devices their pods no longer hold."""

    def __init__(self, holders: Holders, change: Change) -> None:
        self.holders, self.change = holders, change
        self.asked_for: frozenset[int] | None = None
        self.holds: Holds | None = None

    def for_pids(self, pids: frozenset[int]) -> Holds | None:
        if self.asked_for is None or not pids <= self.asked_for:
            t = self.holders.tools
            fresh = None
            try:
                if self.asked_for is not None:
                    fresh = self.change.pods = t.cluster.list_pods(node=t.settings.node_name)
                self.holds = self.holders.holds(self.change, fresh)
            except MigAgentError:
                self.holds = None
            self.asked_for = pids
        return self.holds


def _pids(processes: list[planner.EndedProcess]) -> list[int]:
    return sorted({p.pid for p in processes})


def _busy(t: Tools, foreign: list[planner.EndedProcess], reset_gpus: list[int]) -> GpuBusy:
    busy = GpuBusy(
        f"{planner.describe_in_use(foreign)}, which no pod holds: no drain would end them, so "
        "nothing was touched (stop them, and the agent retries)",
        pids=_pids(foreign),
    )
    # where a reset waits on them: name the host GPU clients that may be theirs
    resets = sorted({p.gpu for p in foreign} & set(reset_gpus))
    host_clients.name_blockers(t.settings, t.run_command, busy, resets)
    return busy


def _names(pods: list[PodView]) -> set[str]:
    return {str(p.ref) for p in pods}
