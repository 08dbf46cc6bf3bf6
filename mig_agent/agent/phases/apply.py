"""The GPU side of a change, once the drain is done: re-plan (what the evicted pods held is free
now), apply the steps with the hooks around them, re-read the GPUs to verify the layout, run
the post-apply hooks. A MIG mode change left pending needs a reboot: run the configured
command once, or fail saying so."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import structlog

from mig_agent.agent import host_clients, reporting
from mig_agent.agent.change import Change, Memory, Tools
from mig_agent.agent.marks import NodeRebooting
from mig_agent.agent.phases.reboot import asked_reboot, current_boot_id, parse_asked, run_reboot
from mig_agent.core import planner
from mig_agent.core.errors import GpuBusy, GpuResetRequired, MigAgentError, RebootFailed
from mig_agent.core.labels import State
from mig_agent.node import hooks
from mig_agent.node.apply import apply_plan, verify
from mig_agent.node.waits import poll_delays

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ApplyPhase:
    tools: Tools
    memory: Memory

    def apply(self, change: Change, hook_run: hooks.HookRunner, reset_gpus: list[int]) -> None:
        """Re-plan now that the pods are gone, and apply (mig_agent.node.apply.apply_plan: the
        hooks around the steps); a mode change left pending needs a reboot."""
        t = self.tools
        with t.phase(
            change.node,
            "apply",
            "MIGApplying",
            f"applying {len(change.plan.steps)} GPU step(s) to GPU(s) "
            f"{list(change.plan.changed_gpus)}",
        ):
            try:
                pending = apply_plan(self._plan_after_drain(change), t.gpus, hook_run)
            except GpuBusy as exc:
                host_clients.name_blockers(t.settings, t.run_command, exc, reset_gpus)
                raise
            if pending is not None:
                self._reboot_or_fail(change.desired, pending)

    def verify(self, change: Change) -> None:
        """Re-read the GPUs: the layout must be in place; the GPU state published."""
        t = self.tools
        with t.phase(
            change.node,
            "verify",
            "MIGVerifying",
            "re-reading the GPUs to check the layout is in place",
        ):
            verify(change.layout, t.gpus.observe(), change.models)
            # the GPU state published as the pass last had the node: new devices, a new text
            t.record_devices(self.memory.held, change.node)

    def post_apply(self, change: Change, hook_run: hooks.HookRunner) -> None:
        """The site's post-apply hooks, if any; their mark goes once they succeed."""
        if not hook_run.hooks.of(hooks.POST_APPLY):
            return
        t = self.tools
        s = t.settings
        with t.phase(
            change.node,
            "post_apply",
            "MIGPostApply",
            f"running the post-apply hooks ({hook_run.hooks.source})",
        ):
            hook_run.run(hooks.POST_APPLY)
            t.cluster.patch_node(s.node_name, annotations={s.post_apply_annotation: None})

    def _plan_after_drain(self, change: Change) -> planner.Plan:
        """Re-plan, now refusing what is in use. An evicted pod's processes can outlive its Pod
        object for a moment (container teardown), so a busy GPU is looked at again until
        ``gpu_release_timeout_s``; then it is a real busy GPU (GpuBusy, naming the pids)."""
        t = self.tools
        deadline = t.clock.now() + t.settings.gpu_release_timeout_s
        delays = poll_delays(t.settings.poll_s)
        while True:
            try:
                # the drain spared the pods on what the first plan keeps and evicted the
                # rest: keep the same instances, so no pod went for a device that stays
                return planner.plan(
                    change.layout, t.gpus.observe(), change.models, prefer=change.plan
                )
            except GpuBusy as exc:
                if t.clock.now() >= deadline:
                    raise
                log.info("gpu.waiting_for_processes", error=str(exc))
                t.clock.sleep(next(delays))

    def _reboot_or_fail(self, desired: str, exc: GpuResetRequired) -> None:
        t = self.tools
        s = t.settings
        node = t.cluster.get_node(s.node_name)
        if not s.reboot_command:
            raise GpuResetRequired(
                f"{exc}; no reboot command is configured, reboot the node to finish", **exc.context
            ) from exc
        boot = t.boot_id() if t.boot_id is not None else current_boot_id()
        refusal = self._no_second_reboot(node.annotations.get(s.reboot_annotation), desired, boot)
        if refusal:
            raise GpuResetRequired(f"{exc}; {refusal}", **exc.context) from exc
        self.memory.seen = (desired, State.REBOOTING)  # our own label: no wake-up for it
        t.cluster.patch_node(
            s.node_name,
            labels={s.state_label: State.REBOOTING},
            annotations={s.reboot_annotation: asked_reboot(desired, boot)},
            expect_labels={s.config_label: desired},
        )
        t.metrics.set_state(State.REBOOTING)
        reporting.event(t.cluster, node, "MIGRebooting", f"{exc}; rebooting the node", warning=True)
        log.warning("node.rebooting", error=str(exc))
        self.memory.rebooted_for = desired
        self._reboot()
        raise NodeRebooting()

    def _no_second_reboot(self, asked: str | None, desired: str, boot: str) -> str:
        """Why no reboot is run now ("": run it). One reboot per layout: a second would not
        help. But an ask in this very boot that this agent never ran (the agent that asked was
        killed before its command ran) has had no reboot yet, and gets it."""
        if asked is None:
            return ""
        layout, asked_in = parse_asked(asked)
        if layout != desired:
            return ""
        if asked_in and asked_in == boot:
            if self.memory.rebooted_for != desired:
                return ""
            return (
                f"the reboot command ran but the node did not reboot (its boot id is still "
                f"{boot}); MIG mode change did not take effect, not rebooting again"
            )
        return "MIG mode change did not take effect after rebooting once, not rebooting again"

    def _reboot(self) -> None:
        t = self.tools
        s = t.settings
        try:
            if t.reboot is not None:
                t.reboot(s.reboot_command)
            else:
                run_reboot(s.reboot_command, s.reboot_timeout_s)
        except RebootFailed:
            # No reboot happened: disarm the guard, so that a fixed command gets its one reboot.
            with contextlib.suppress(MigAgentError):
                t.cluster.patch_node(s.node_name, annotations={s.reboot_annotation: None})
            raise
