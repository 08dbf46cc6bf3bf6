"""The drain of a change, once the node is cordoned and its operands paused: the GPU pods whose
devices go are evicted (those on devices that stay are spared), the paused operands' pods
terminate meanwhile, and what the drain waits for is said on the node. A failed drain is retried
with the node kept cordoned, up to ``drain_give_up_s``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from mig_agent.agent import node_guard, reporting, validators
from mig_agent.agent.change import Change, Holds, Memory, Tools
from mig_agent.agent.holders import Holders, claimed
from mig_agent.core.errors import DrainGivenUp, DrainTimeout, EvictionBlocked, MigAgentError
from mig_agent.kube.cluster import NodeCondition, PodRef, PodsSeen, PodView
from mig_agent.node.drain import drain_gpu_pods, is_paused_operand, look, wait_pods_gone

log = structlog.get_logger(__name__)


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
            self._drain(change, paused)
            self.still_wanted(change.desired)  # not worth applying a layout no longer asked for

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
        except (EvictionBlocked, DrainTimeout) as exc:
            raise self._retried(exc, change.desired) from None
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
            on_waiting=self._waiting,
            still_wanted=lambda: self.still_wanted(change.desired),
            pods=pods,
            seen=seen,
        )

    def _retried(self, exc: MigAgentError, desired: str) -> MigAgentError:
        """A failed drain is retried with the node kept cordoned between tries (no pods land
        on it to be evicted again), until ``drain_give_up_s`` after its first failed try for
        this layout; then DrainGivenUp: uncordoned, failed until a new label or config."""
        s, now, memory = self.tools.settings, self.tools.clock.now(), self.memory
        if memory.drain_failing is None or memory.drain_failing[0] != desired:
            memory.drain_failing = (desired, now)
        elapsed = now - memory.drain_failing[1]
        if elapsed < s.drain_give_up_s:
            return node_guard.keep_cordon_for(
                exc,
                f"the drain is retried for up to {s.drain_give_up_s:g} s "
                "(drain_give_up_s): the node stays cordoned between tries",
            )
        memory.drain_failing = None
        return DrainGivenUp(
            f"{exc}; given up after {elapsed:.0f} s of retries (drain_give_up_s "
            f"{s.drain_give_up_s:g} s): the node is uncordoned; change the layout label or the "
            "config to try again",
            **exc.context,
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

    def _waiting(self, slowest: PodView, left: int, up_to_s: float) -> None:
        """Evicted pods take their time (a checkpoint, a long grace period): say what the drain
        waits for, so that a long drain does not look like a hung agent."""
        s = self.tools.settings
        message = (
            f"waiting for {left} evicted GPU pod(s) to stop; the slowest, {slowest.ref}, has a "
            f"grace period of {slowest.grace_period_s:g} s: the drain waits up to "
            f"{up_to_s:.0f} s, and the node stays cordoned while they run"
        )
        reporting.condition(
            self.tools.cluster,
            s,
            NodeCondition(s.condition_type, "False", "DrainWaiting", message),
        )
        reporting.event_on_node(self.tools.cluster, s, "MIGDrainWaiting", message)
