"""One pass of the agent over the node, as its phases: plan, announce, drain, apply, advertise,
finish. Each phase is its own module and takes what it needs; this class only orders them and
decides what a failure past the first GPU step still owes the node (the advertiser restarted,
the cordon kept while it may list devices that are gone). Any failure leaves by an exception:
the agent (mig_agent.agent.reconcile) reports it, and the guard settles the node."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import structlog

from mig_agent.agent import guard, host_clients
from mig_agent.agent.advertisers import advertiser as advertisers
from mig_agent.agent.advertisers.advertiser import Advertiser
from mig_agent.agent.change import Change, Memory, Prepared, Tools
from mig_agent.agent.outcome import Outcome
from mig_agent.agent.phases.advertise import AdvertisePhase
from mig_agent.agent.phases.announce import announce
from mig_agent.agent.phases.apply import ApplyPhase
from mig_agent.agent.phases.drain import DrainPhase
from mig_agent.agent.phases.finish import Finish
from mig_agent.agent.phases.holders import Holders
from mig_agent.agent.phases.planning import Planning
from mig_agent.agent.phases.refusals import Refusals
from mig_agent.core.errors import InternalError
from mig_agent.core.layout import Layout
from mig_agent.kube.cluster import NodeView
from mig_agent.node import hooks

log = structlog.get_logger(__name__)


class ChangePass:
    def __init__(self, tools: Tools, memory: Memory, still_wanted: Callable[[str], None]):
        self.tools, self.memory = tools, memory
        self.holders = Holders(tools, memory)
        self.planning = Planning(tools, memory)
        self.refusals = Refusals(tools, self.holders)
        self.drain = DrainPhase(tools, memory, self.holders, still_wanted)
        self.gpu_steps = ApplyPhase(tools, memory)
        self.finish = Finish(tools, memory)

    def run(self, node: NodeView, desired: str, layout: Layout) -> Outcome:
        """The pass's phases, in order: NOOP when the layout is in place, else APPLIED."""
        t = self.tools
        # services an earlier pass stopped for a reset run again before anything else
        host_clients.start_leftover(t.cluster, t.settings, t.run_command, node.annotations)
        change = self.planning.plan(node, desired, layout)
        advertiser = advertisers.for_change(t, change)
        if self.finish.in_place(change, advertiser):
            return Outcome.NOOP
        advertise = AdvertisePhase(t, advertiser)
        with contextlib.ExitStack() as marks:  # the cordon and the paused operands, undone
            ready = self._prepare(change, advertiser, marks)
            if ready.paused is None:
                advertised = advertise.only(change, ready.old_plugins)
            else:
                advertised = self._change_gpus(change, ready, advertise)
        self.finish.applied(change, advertised)
        return Outcome.APPLIED

    def _prepare(
        self, change: Change, advertiser: Advertiser, marks: contextlib.ExitStack
    ) -> Prepared:
        """What comes between the plan and the drain, timed as the phase ``prepare``: the
        refusals before anything changes, ``pending`` announced, the plugin's pods noted and,
        unless only its listing is wrong (``paused`` None), the node cordoned and its operands
        paused, undone when ``marks`` closes."""
        t = self.tools
        with t.metrics.phase("prepare"):
            hook_run, reset_gpus = self.refusals.check(change)
            announce(t, self.memory, change, hook_run)
            old_plugins = {p.ref.uid for p in advertiser.find(change.pods)}
            paused = None
            if not change.plan.is_empty or hook_run.hooks.of(hooks.POST_APPLY):
                paused = marks.enter_context(guard.paused(t, change))
            return Prepared(hook_run, reset_gpus, old_plugins, paused)

    def _change_gpus(
        self, change: Change, ready: Prepared, advertise: AdvertisePhase
    ) -> dict[str, int]:
        """Drain, apply, verify, post-apply hooks, then the advertiser: what the node then
        advertises. Whatever ends it early, the pass's exit settles the node (guard.settle):
        the advertiser restarted first where the GPUs changed."""
        self._gpu_steps(change, ready, ready.paused or [])
        return advertise.after_change(change, ready.paused or [], ready.old_plugins)

    def _gpu_steps(self, change: Change, ready: Prepared, paused: list[str]) -> None:
        t = self.tools
        if not change.plan.is_empty:
            self.drain.run(change, paused)
            with host_clients.stopped(
                t.cluster, t.settings, t.run_command, ready.reset_gpus, change.node
            ):
                self.gpu_steps.apply(change, ready.hook_run, ready.reset_gpus)
                self.gpu_steps.verify(change)
        self.gpu_steps.post_apply(change, ready.hook_run)


def crashed(exc: Exception) -> InternalError:
    """A bug, logged with its traceback, as the failure the node reports."""
    log.exception("reconcile.crashed", error_type=type(exc).__name__)
    return InternalError(
        f"unexpected {type(exc).__name__}: {exc} (a bug in "
        "mig-agent; the pass was undone and is retried)"
    )
