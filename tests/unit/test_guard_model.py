"""A model of the cluster, as the test that finds the next way out of the node's promise
(issue 42, item 4). We test these aspects of the real agent, driven by hypothesis's rule-based
state machine through random sequences of what a production cluster does to it:

* relabels (layouts that fit, misspelt ones, ones these GPUs cannot hold, the label removed),
  in a pass's middle too;
* GPU pods arriving on devices, finishing, stuck terminating or slow to go, bound after the
  drain's look, pods of no controller and of a DaemonSet;
* the API server's answers to evictions (granted, a budget's 429, throttling, the 500 of two
  budgets, a webhook's 403, 409, 5xx), through the agent's real client (model_answers);
* the device plugin stale, partial, crashing or slow (model_world.DevicePluginModel);
* NVML failing mid-apply, a MIG mode change that stays pending until a reboot;
* SIGTERM and a kill at a GPU step, a sleep or a node patch, then a new agent from the node's
  record alone; time passing.

After every step the invariants (model_invariants) are checked from what the fakes hold: never
schedulable over a device NVML no longer holds, nor while a pod the agent evicted still runs on a
GPU that changes, nor between the tries of a failed drain inside drain_give_up_s; no device
destroyed under a pod; no words that say uncordoned under the agent's cordon or "nothing was
touched" after a GPU changed; ``success`` only with the layout in place and listed; no operand
left paused; no pod evicted off a GPU that stays; a give-up kept (no eviction asked while its
pods and the label stay). At the end the faults stop and six passes must end in ``success`` or
in a ``failed`` whose reason names what the operator must fix.

DraGuardModel runs the same over a DRA node on Kubernetes 1.37 (NVIDIA's DRA plugin publishing
the node's ResourceSlice, DeviceTaintRules served: the guard taints the changing GPUs' devices
instead of the cordon), its GPU pods holding their devices by ResourceClaims the scheduler
allocates from the slice (past the agent's taints only for a bind in flight).

The default run holds a fixed, derandomized budget (CI_EXAMPLES examples of up to STEPS
steps, DRA_EXAMPLES in the DRA world; ``MIG_AGENT_MODEL=0`` leaves them out);
docs/reliability.md, "The node guard", says which of the guard's fixes, reverted, it finds
within that budget, and which the sequences it found before (test_guard_model_cases) hold
instead. More:
``MIG_AGENT_MODEL_EXAMPLES=10000 pytest tests/unit/test_guard_model.py`` (still derandomized;
``MIG_AGENT_MODEL_RANDOM=1`` for fresh random sequences, ``MIG_AGENT_MODEL_STEPS`` for longer
ones, ``MIG_AGENT_MODEL_SHRINK=0`` to report a failure unshrunk).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from structlog.testing import capture_logs

from mig_agent.config.profiles import load_catalog
from mig_agent.core.layout import DeviceSelector, GpuLayout, Layout, LayoutCatalog, MigProfile, Rule
from mig_agent.core.scheduling import LabelSelector
from mig_agent.kube.cluster import PdbView, PodRef
from tests.unit.model_answers import Answer
from tests.unit.model_invariants import after_pass, settled
from tests.unit.model_world import PROFILES, Armed, World

CI_EXAMPLES = 2000  # 22 s here; each reverted fix was found within it (docs/reliability.md)
DRA_EXAMPLES = 500  # the DRA world (DraGuardModel): 16 s here; each of its reverted fixes found
STEPS = 12
SETTLE_PASSES = 6

FITTING = ["all-1g.10gb", "all-balanced", "all-3g.40gb", "all-7g.80gb", "all-disabled"]
MISSPELT = "all-1g.10gbb"
NOT_FITTING = ["all-1g.18gb", "three-3g.40gb"]  # an H200 layout; more 3g.40gb than fit
LABELS = [*FITTING, MISSPELT, *NOT_FITTING, None]

G, B, T, TWO, F, C, S = (
    Answer.GRANTED,
    Answer.BUDGET,
    Answer.THROTTLED,
    Answer.TWO_BUDGETS,
    Answer.FORBIDDEN,
    Answer.CONFLICT,
    Answer.SERVER_ERROR,
)
# the API server's answers to one pod's evictions, one per request (the last for the rest)
SCRIPTS: list[tuple[Answer, ...]] = [
    (G,),
    (B,),  # a budget that never allows it
    (B, B, G),  # a budget that allows it after two retries
    (T, G),  # throttled once: the client's retry absorbs it
    (T,) * 6 + (G,),  # throttled past the client's retries once
    (TWO,),  # two budgets cover the pod
    (F, G),  # a webhook refuses once
    (F,),  # a webhook refuses until the faults stop
    (C, G),  # a conflict
    (S,) * 6 + (G,),  # 5xx past the client's retries once
]


def _catalog() -> LayoutCatalog:
    """The shipped profiles, and one layout that asks more of an H100 than it holds."""
    catalog = load_catalog([PROFILES])
    too_many = GpuLayout.of(True, {MigProfile.parse("3g.40gb"): 3})
    extra = Layout("three-3g.40gb", (Rule(DeviceSelector(), too_many),))
    return LayoutCatalog.of([*catalog.layouts.values(), extra])


CATALOG = _catalog()

# faults that strike inside the next pass
ARMED = st.one_of(
    st.none(),
    st.builds(
        Armed,
        at=st.sampled_from(["gpu", "sleep", "patch"]),
        nth=st.integers(1, 8),
        action=st.sampled_from(["kill", "sigterm", "relabel", "nvml"]),
        arg=st.sampled_from([*FITTING, MISSPELT, ""]),
    ),
    st.builds(Armed, at=st.just("look"), nth=st.just(1), action=st.just("bind")),
)


class GuardModel(RuleBasedStateMachine):
    """The agent over one node of two H100s, and the world around it."""

    world: World

    @initialize(
        operands=st.booleans(),
        podresources=st.booleans(),
        reboot=st.booleans(),
        pending=st.booleans(),
        found=st.sampled_from([True, True, True, False]),
    )
    def start(
        self, operands: bool, podresources: bool, reboot: bool, pending: bool, found: bool
    ) -> None:
        """``operands``: the GPU Operator's labels (pausing brings a new plugin pod);
        ``podresources``: the kubelet tells who holds what; ``reboot``: a reboot command is
        set; ``pending``: GPU 1's MIG mode changes stay pending until a reboot; ``found``:
        the plugin's pods carry the labels the agent's selector looks for."""
        self.logs = capture_logs()
        self.logs.__enter__()  # the agent's log lines kept in memory, not rendered
        self.world = World(
            CATALOG,
            operands=operands,
            podresources=podresources,
            reboot=reboot,
            plugin_found=found,
        )
        if pending:
            self.world.gpus.pending.add(1)

    def teardown(self) -> None:
        try:
            if hasattr(self, "world"):
                problems = self.world.settle(SETTLE_PASSES)
                problems += list(settled(self.world, SETTLE_PASSES))
                for problem in problems:
                    self.world.violated(problem, "once the faults stopped")
                assert not self.world.violations, "\n".join(self.world.violations)
        finally:
            if hasattr(self, "logs"):
                self.logs.__exit__(None, None, None)

    # -- the operator ----------------------------------------------------------------------

    @rule(layout=st.sampled_from(LABELS), fault=ARMED)
    def relabel(self, layout: str | None, fault: Armed | None) -> None:
        """The label set (or removed); the agent's node watch starts a pass at once, with a
        fault armed inside it."""
        self.world.relabel(layout)
        self._pass(fault)

    # -- the workloads ---------------------------------------------------------------------

    @rule(
        pick=st.integers(0, 60),
        owner=st.sampled_from(["ReplicaSet", "ReplicaSet", "", "DaemonSet"]),
        leaving=st.sampled_from(["at once", "slowly", "stuck"]),
        script=st.sampled_from(SCRIPTS),
    )
    def pod_arrives(self, pick: int, owner: str, leaving: str, script: tuple[Answer, ...]) -> None:
        w = self.world
        ref = w.bind_pod(
            pick, owner=owner, stuck=leaving == "stuck", slow_s=40.0 if leaving == "slowly" else 0.0
        )
        if ref is not None and script != (G,):
            self._answers(ref, script)

    def _answers(self, ref: PodRef, script: tuple[Answer, ...]) -> None:
        """The pod's eviction script, and the budgets that cover it where it names some."""
        w = self.world
        w.answers.scripts[ref] = list(script)
        count = 2 if TWO in script else 1 if B in script else 0
        names = tuple(f"{ref.name}-pdb-{i}" for i in range(count))
        w.answers.budgets[ref] = names
        selector = LabelSelector({"app": ref.name})
        w.cluster.pdbs += [PdbView(ref.namespace, n, selector, 0) for n in names]

    @rule(pick=st.integers(0, 60))
    def pod_finishes(self, pick: int) -> None:
        self.world.finish_pod(pick)

    # -- the device plugin -----------------------------------------------------------------

    @rule(mode=st.sampled_from(["honest", "slow", "partial", "crashing", "stale"]))
    def plugin_behaves(self, mode: str) -> None:
        """How the plugin's next pods behave (crashing: the running one too). A stale
        listing only where PodResources or the slice's UUIDs can tell it from the GPUs'
        devices: by counts alone no agent could."""
        w = self.world
        if mode == "stale" and not (w.podresources or w.dra):
            return
        if mode == "crashing":
            w.plugin.crash(w)
        else:
            w.plugin.mode, w.plugin.delay_s = mode, 90.0 if mode == "slow" else 0.0

    # -- the agent ---------------------------------------------------------------------------

    @rule(wait=st.sampled_from([0.0, 5.0, 30.0, 120.0, 600.0]), fault=ARMED)
    def a_pass(self, wait: float, fault: Armed | None) -> None:
        """Time passes (a back-off, a resync), then a pass, with a fault armed inside it."""
        self.world.time.sleep(wait)
        self._pass(fault)

    def _pass(self, fault: Armed | None) -> None:
        w = self.world
        w.run_pass(fault)
        for problem in after_pass(w):
            w.violated(problem, "after the pass")

    @rule()
    def agent_restarts(self) -> None:
        """The agent's pod is deleted between passes: a new one knows only the node."""
        self.world.agent = None

    @precondition(lambda self: hasattr(self, "world"))
    @invariant()
    def promise_kept(self) -> None:
        assert not self.world.violations, "\n".join(self.world.violations)


class DraGuardModel(GuardModel):
    """The agent over one DRA node of two H100s on Kubernetes 1.37: NVIDIA's DRA plugin
    publishes the node's ResourceSlice and DeviceTaintRules are served, so the guard holds the
    node back by tainting the changing GPUs' devices, not by the cordon. The same faults, the
    same invariants read for a slice (model_invariants: while a GPU is not as the slice lists
    it, its listed devices carry the agent's taint or the node is cordoned; at ``success`` no
    rule of the agent's is left; between a failed drain's tries, the changing GPUs' devices
    stay tainted). Its GPU pods hold devices by claim: the drain goes by the claims."""

    @initialize(reboot=st.booleans(), pending=st.booleans())
    def start(self, reboot: bool, pending: bool) -> None:  # type: ignore[override]
        """``reboot``: a reboot command is set; ``pending``: GPU 1's MIG mode changes stay
        pending until a reboot."""
        self.logs = capture_logs()
        self.logs.__enter__()
        self.world = World(CATALOG, operands=False, podresources=False, reboot=reboot, dra=True)
        if pending:
            self.world.gpus.pending.add(1)


def _settings(examples: int) -> settings:
    # MIG_AGENT_MODEL_SHRINK=0: report the first failing sequence as found, unshrunk (a search
    # of many reverted fixes in a row; shrinking one takes minutes)
    shrink = os.environ.get("MIG_AGENT_MODEL_SHRINK") != "0"
    return settings(
        phases=list(Phase) if shrink else [Phase.explicit, Phase.reuse, Phase.generate],
        max_examples=int(os.environ.get("MIG_AGENT_MODEL_EXAMPLES", examples)),
        stateful_step_count=int(os.environ.get("MIG_AGENT_MODEL_STEPS", STEPS)),
        derandomize=os.environ.get("MIG_AGENT_MODEL_RANDOM") != "1",
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        database=None,
        print_blob=True,
    )


GuardModel.TestCase.settings = _settings(CI_EXAMPLES)
DraGuardModel.TestCase.settings = _settings(DRA_EXAMPLES)
# MIG_AGENT_MODEL=0 leaves them out (a quick local run); CI runs them
_off = pytest.mark.skipif(
    os.environ.get("MIG_AGENT_MODEL") == "0", reason="MIG_AGENT_MODEL=0 leaves the guard model out"
)
test_guard_model = _off(GuardModel.TestCase)
test_guard_model_dra = _off(DraGuardModel.TestCase)
