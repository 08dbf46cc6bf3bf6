"""A failed reboot waits for a label or config change: the agent's own "rebooting" patches,
delivered late by the node watch, are no reason for a new pass.

Issue 15's fault matrix, reboot-hangs: on an A100 that cannot be reset, a reboot command that
never returned was killed at its time limit and the pass failed, naming it (not retryable);
yet a new pass began 0.14 s later and ran the command again, and again, the node cordoned and
`rebooting` for the whole time limit of every round. The patches that undo the failed reboot's
marks (the guard disarmed, operands resumed, uncordoned) are written while the label still says
`rebooting`; the watch delivered them after the agent had recorded its own `failed`, and took
them for someone else's change.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from mig_agent.agent import Outcome
from mig_agent.core.errors import GpuResetRequired, RebootFailed
from mig_agent.core.gpu_models import MODELS
from mig_agent.kube.cluster import NodeView
from tests.unit.fake_gpus import FakeGpus
from tests.unit.test_agent import CONFIG, NODE, STATE, assert_clean, make

COMMAND = "/sbin/reboot --now"


def test_the_own_rebooting_echoes_of_a_failed_reboot_start_no_new_pass() -> None:
    agent, cluster, gpus = make(FakeGpus([MODELS["A100-40GB"]] * 2), reboot_command=COMMAND)

    def stuck(gpu: int, *, enabled: bool) -> None:
        raise GpuResetRequired(f"GPU {gpu}: MIG mode change pending")

    def hangs(command: str) -> None:
        raise RebootFailed(
            f"reboot command {command!r} did not return within 120 s (killed)", command=command
        )

    gpus.set_mig_mode = stuck  # type: ignore[method-assign]
    agent.reboot = hangs
    history: list[NodeView] = []  # every version of the node the pass wrote, as a watch sees
    patch = cluster.patch_node

    def recorded(name: str, **kwargs: Any) -> NodeView:
        node = patch(name, **kwargs)
        history.append(node)
        return node

    cluster.patch_node = recorded  # type: ignore[method-assign]
    cluster.patch_node(NODE, labels={CONFIG: "all-1g.5gb"})
    agent.wake_event.clear()
    result = agent.reconcile_once()
    assert result.outcome is Outcome.FAILED and result.retry_after_s is None
    assert cluster.nodes[NODE].labels[STATE] == "failed"
    assert COMMAND in cluster.nodes[NODE].annotations["mig-agent.dev/reason"]
    assert "mig-agent.dev/reboot-attempted" not in cluster.nodes[NODE].annotations
    assert_clean(cluster)
    assert any(n.labels.get(STATE) == "rebooting" for n in history)
    stop = threading.Event()

    def late(name: str, *, timeout_s: int) -> Iterator[NodeView]:
        yield from history[1:]  # the pass's own writes (the relabel aside), all of them late
        stop.set()

    cluster.watch_node = late  # type: ignore[method-assign]
    agent.wake_event.clear()
    agent.watch_forever(stop)
    assert not agent.wake_event.is_set()  # before: a new pass, and the command run again
