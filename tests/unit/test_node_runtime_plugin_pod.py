"""The node runtime runs NVIDIA's device plugin while its pod runs, as a kubelet runs a container:
whatever the API says of the pod's readiness.

Issue 15's fault matrix: after an API server restart the node-lifecycle controller, having missed
the node's heartbeats, set the device plugin pod's Ready condition False. A kubelet sets it True
again on its next status sync; kwok plays a pod's stages once and never did, and the node runtime,
which ran the plugin only while its pod was Ready, stopped it for good: the node advertised 0 of
every MIG device until the agent's device_plugin_timeout_s ran out.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from migsim.node_runtime import PLUGIN_NS, PLUGIN_SELECTOR, Child, Options, Runtime, plugin_pods

from mig_agent.kube.cluster import PodRef, PodView

LABELS = {"app": "nvidia-device-plugin-daemonset"}


def _pod(
    name: str = "dp",
    *,
    phase: str = "Running",
    ready: bool = True,
    terminating: bool = False,
    namespace: str = PLUGIN_NS,
) -> PodView:
    return PodView(
        PodRef(namespace, name, f"uid-{name}"),
        "node",
        phase,
        ready,
        terminating,
        LABELS,
        {},
        ("DaemonSet",),
        {},
        {},
    )


def test_a_running_plugin_pod_counts_whatever_its_ready_condition() -> None:
    running, not_ready = _pod("a"), _pod("b", ready=False)
    assert plugin_pods([running, not_ready], PLUGIN_NS, PLUGIN_SELECTOR) == [running, not_ready]
    for gone in (
        _pod(terminating=True),
        _pod(phase="Pending"),
        _pod(phase="Succeeded"),
        _pod(namespace="other"),
    ):
        assert plugin_pods([gone], PLUGIN_NS, PLUGIN_SELECTOR) == []


def test_the_plugin_keeps_running_when_its_pod_is_marked_not_ready(tmp_path: Path) -> None:
    opts = Options(
        node="node",
        cluster_dir=tmp_path,
        sim_state=str(tmp_path / "state.json"),
        nvidia_bin=tmp_path,
        log_dir=tmp_path,
        plugin_dir=str(tmp_path),
    )
    runtime = Runtime(opts, None, None)  # type: ignore[arg-type]  # no API calls here
    # the plugin: a process that runs until stopped
    runtime.plugin = Child(
        "plugin", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "plugin.log"
    )
    pod = _pod()
    try:
        runtime._plugin_lifecycle([pod])
        assert runtime.plugin.running() and runtime.plugin.starts == 1
        # the node-lifecycle controller marks the pod not Ready: its container runs on
        runtime._plugin_lifecycle([dataclasses.replace(pod, ready=False)])
        assert runtime.plugin.running() and runtime.plugin.starts == 1
        # deleted: the plugin stops; a new pod starts it afresh
        runtime._plugin_lifecycle([dataclasses.replace(pod, terminating=True)])
        assert not runtime.plugin.running()
        runtime._plugin_lifecycle([_pod("dp2")])
        assert runtime.plugin.running() and runtime.plugin.starts == 2
    finally:
        runtime.plugin.stop()
