"""The drain of a change, once the node is cordoned and its operands paused: the GPU pods whose
devices go are evicted (those on devices that stay are spared), the paused operands' pods
terminate meanwhile, and what the drain waits for is said on the node. A failed drain is retried
with the node kept cordoned, up to ``drain_give_up_s`` from its first failed try (the node's
record keeps when that was: a restart does not start the window again); then given up, with no
new try while the pods it gave up on are still there. Before the first GPU step the node's pods
are looked at once more: a pod bound after the drain's look is drained too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from mig_agent.agent import marks, reporting
from mig_agent.agent.change import Change, Holds, Memory, Tools
from mig_agent.agent.phases import validators
from mig_agent.agent.phases.holders import Holders, claimed
from mig_agent.core import guard
from mig_agent.core.errors import (
    DrainGivenUp,
    DrainTimeout,
    EvictionBlocked,
    KubeError,
    LabelsChanged,
    MigAgentError,
)
from mig_agent.kube.cluster import NodeCondition, PodRef, PodsSeen, PodView
from mig_agent.node.drain import (
    drain_gpu_pods,
    gpu_pods,
    is_paused_operand,
    look,
    wait_pods_gone,
)

log = structlog.get_logger(__name__)

ROUNDS = 3  # drains in a row while GPU pods keep arriving after the look, before failing


@dataclass(frozen=True)
class DrainPhase:
    tools: Tools
    memory: Memory
    holders: Holders
    # raises LabelsChanged when the layout label no longer names the layout
    still_wanted: Callable[[str], None]

    def run(self, change: Change, paused: list[str]) -> None:
        """Evict the GPU pods whose devices go and wait for them and the paused operands'."""
        t = self.tools
        with t.phase(
            change.node,
            "drain",
            "MIGDraining",
            "evicting the pods that use the GPUs that change",
        ):
            for _ in range(ROUNDS):
                try:
                    self._drain(change, paused)
                    self.still_wanted(change.desired)  # not worth applying a layout not asked for
                except LabelsChanged as exc:  # the pods evicted so far go on terminating
                    exc.context.setdefault("refs", self._going(change, paused))
                    raise
                late = self._arrived_since(change, paused)
                if not late:
                    return
                log.warning("drain.pods_arrived", pods=sorted(str(p.ref) for p in late))
            raise self._retried(
                DrainTimeout(
                    f"GPU pods kept arriving on the cordoned node during {ROUNDS} drains (bound "
                    "to it by name, or in flight at the cordon): "
                    + ", ".join(sorted(str(p.ref) for p in late)),
                    refs=tuple(p.ref for p in late if p.terminating),
                ),
                change,
            )

    def _arrived_since(self, change: Change, paused: list[str]) -> list[PodView]:
        """The GPU pods the drain would evict that are on the node now, after it: bound after
        its look (a pod naming the node, a bind in flight at the cordon). None may be left
        unaccounted for before the first GPU step."""
        t = self.tools
        pods = t.cluster.list_pods(node=t.settings.node_name)
        holds = self.holders.holds(change, pods)
        return gpu_pods(
            t.cluster,
            t.settings.node_name,
            exclude=[p.ref for p in pods if is_paused_operand(p, paused)],
            claimed=claimed(change, holds),
            pods=pods,
            may_stay=self.holders.may_stay(change.plan, holds),
        )

    def _drain(self, change: Change, paused: list[str]) -> None:
        t = self.tools
        s = t.settings
        # the node's pods now, after the cordon: a pod placed since the pass looked is known;
        # the drain's and the operands' waits watch on from this look
        seen = PodsSeen()
        pods = change.pods = look(t.cluster, s.node_name, seen)
        holds = self.holders.holds(change, pods)
        operand_pods = [p.ref for p in pods if is_paused_operand(p, paused)]
        # their results are of devices about to go; the operator reruns them after the change
        validators.delete(t.cluster, s, validators.BEFORE, pods)
        # the paused operands terminate while the GPU pods do: one termination to wait for,
        # not two in a row
        try:
            evicted = self._evict(change, operand_pods, holds, pods, seen)
        except LabelsChanged:
            raise  # with the pods going, by run()
        except (EvictionBlocked, DrainTimeout, KubeError) as exc:
            # any eviction error: the pods evicted before it may still run (a 403 from a
            # webhook, a 5xx past the retries), and the window applies to every failed drain
            if isinstance(exc, KubeError) and not isinstance(exc, EvictionBlocked):
                exc.context.setdefault("refs", self._going(change, paused))
            raise self._retried(exc, change) from None
        t.metrics.evictions.inc(len(evicted))
        if operand_pods:
            log.info("operands.waiting", pods=len(operand_pods))
            wait_pods_gone(
                t.cluster,
                s.node_name,
                operand_pods,
                timeout_s=s.operand_timeout_s,
                poll_s=s.poll_s,
                what="paused operand pods",
                clock=t.clock,
                seen=seen,
            )

    def _evict(
        self,
        change: Change,
        operand_pods: list[PodRef],
        holds: Holds | None,
        pods: list[PodView],
        seen: PodsSeen,
    ) -> list[PodRef]:
        t = self.tools
        s = t.settings
        return drain_gpu_pods(
            t.cluster,
            s.node_name,
            timeout_s=s.drain_timeout_s,
            retry_s=s.eviction_retry_s,
            poll_s=s.poll_s,
            clock=t.clock,
            exclude=operand_pods,
            may_stay=self.holders.may_stay(change.plan, holds),
            claimed=claimed(change, holds),
            on_blocked=self._blocked,
            on_waiting=lambda slowest, left, up_to_s: self._waiting(
                slowest, left, up_to_s, change.tainted
            ),
            still_wanted=lambda: self.still_wanted(change.desired),
            pods=pods,
            seen=seen,
        )

    def _going(self, change: Change, paused: list[str]) -> tuple[PodRef, ...]:
        """The GPU pods of the node terminating now: evicted, maybe still on their devices."""
        t = self.tools
        try:
            pods = t.cluster.list_pods(node=t.settings.node_name)
        except MigAgentError:
            return ()
        holds = self.holders.holds(change, pods)
        drained = gpu_pods(
            t.cluster, t.settings.node_name, claimed=claimed(change, holds), pods=pods
        )
        return tuple(p.ref for p in drained if p.terminating and not is_paused_operand(p, paused))

    def _retried(self, exc: MigAgentError, change: Change) -> MigAgentError:
        """A failed drain is retried with the node kept cordoned between tries (no pods land
        on it to be evicted again), until ``drain_give_up_s`` after its first failed try for
        this layout (as the node's record says: a restart keeps the window); then
        DrainGivenUp, naming the pods it waited on: no new try until they go or the label
        changes."""
        s, now = self.tools.settings, self.tools.clock.wall()
        record = marks.record(s, change.node) or guard.Record()
        elapsed = guard.drain_failing_for(record, change.desired, now)
        if elapsed == 0.0:
            exc.context["drain_failed_at"] = now
        if elapsed < s.drain_give_up_s:
            return exc
        waited = sorted(pod_names(exc.context.get("refs", ())))
        blocked = exc.context.get("pod")
        if isinstance(blocked, str) and blocked:
            waited = sorted({*waited, blocked})
        until = f"{', '.join(waited)} are gone or " if waited else ""
        return DrainGivenUp(
            f"{exc}; given up after {elapsed:.0f} s of retries (drain_give_up_s "
            f"{s.drain_give_up_s:g} s): no new try until {until}the layout label or the config "
            "changes",
            **{**exc.context, "given_up": tuple(waited), "cause": str(exc)},
        )

    def _blocked(self, pod: PodRef, exc: EvictionBlocked) -> None:
        """A PodDisruptionBudget refuses an eviction: say so while the drain keeps trying
        (state stays pending; the pass fails at the drain timeout as before)."""
        s = self.tools.settings
        message = (
            f"{exc}; retrying every {s.eviction_retry_s:g} s for up to {s.drain_timeout_s:g} s"
        )
        reporting.condition(
            self.tools.cluster,
            s,
            NodeCondition(s.condition_type, "False", "DrainBlocked", message),
        )
        reporting.event_on_node(self.tools.cluster, s, "MIGDrainBlocked", message, warning=True)

    def _waiting(self, slowest: PodView, left: int, up_to_s: float, tainted: bool) -> None:
        """Evicted pods take their time (a checkpoint, a long grace period): say what the drain
        waits for, so that a long drain does not look like a hung agent."""
        s = self.tools.settings
        message = (
            f"waiting for {left} evicted GPU pod(s) to stop; the slowest, {slowest.ref}, has a "
            f"grace period of {slowest.grace_period_s:g} s: the drain waits up to "
            f"{up_to_s:.0f} s, and {guard.held_back(tainted)} while they run"
        )
        reporting.condition(
            self.tools.cluster,
            s,
            NodeCondition(s.condition_type, "False", "DrainWaiting", message),
        )
        reporting.event_on_node(self.tools.cluster, s, "MIGDrainWaiting", message)


def pod_names(refs: object) -> set[str]:
    """The "namespace/name" of the pods an error's ``refs`` name."""
    return {str(r) for r in refs if isinstance(r, PodRef)} if isinstance(refs, tuple) else set()
