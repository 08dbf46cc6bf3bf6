"""scripts/real-gpu-node, the operator's checks that ran on the lent H200 (docs/real-gpu.md), run
here over simulated GPUs so that it cannot rot: its own local cluster and real node, NVIDIA's
device plugin, mig-agent with the layout the GPUs hold, `mig-agent verify`, the chart's agent in
a pod observing that layout, the agent in observe mode asked for a change (said, not made); its
guard, which refuses to start the agent when the layout asked for would change the GPUs; and
`--dra`, the node as a DRA node: NVIDIA's DRA kubelet plugin's slice listing the GPU by UUID,
mig-agent's `success` by it, a pod's ResourceClaim prepared by the real kubelet through the
plugin and released after, the slice the same."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from migsim.cluster import seed_checks

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "real-gpu-node"


def run_script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if os.geteuid() != 0:
        pytest.skip("the real node runs containerd and a kubelet: run as root")
    return subprocess.run(
        [str(SCRIPT), "--gpus", "1xH200", "--dir", str(tmp_path / "cluster"), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def build(script: str) -> None:
    subprocess.run([str(SCRIPT.parent / script), "build"], check=True, capture_output=True)


def observing_chart(tmp_path: Path) -> Path:
    """The chart rendered in observe mode with the image built here (what the GPU's machine,
    which has no helm, applies)."""
    helm = subprocess.run(
        [str(SCRIPT.parent / "helm-binary"), "build"], check=True, stdout=subprocess.PIPE, text=True
    ).stdout.strip()
    manifest = tmp_path / "mig-agent-observe.yaml"
    manifest.write_text(seed_checks.render_chart(helm, "observe=true"))
    return manifest


def test_the_script_passes_over_a_simulated_h200_and_changes_nothing(tmp_path: Path) -> None:
    done = run_script(tmp_path, "--chart", str(observing_chart(tmp_path)))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "NVIDIA H200" in out, out
    assert 'allocatable of kubelet-node-0: {"nvidia.com/gpu": "1"}' in out, out
    assert "GPU 0 (H200): already MIG disabled, nothing to do" in out, out
    assert "state: success" in out, out
    assert "  ok    pod nvidia.com/gpu: " in out and "ok: kubelet-node-0" in out, out
    # the chart's agent in a pod under the RuntimeClass nvidia, observing the layout held: Ready
    # (its NVML answered) and no change found; then the host's, asked for all-1g.18gb: the 7
    # instances it would make, said; none made
    assert "Ready on kubelet-node-0, runtimeClassName nvidia, image" in out, out
    [in_pod, report] = [
        line for line in out.splitlines() if line.startswith("mig-agent.dev/observed-plan")
    ]
    assert '"layout": "all-disabled", "changes": false' in in_pod, in_pod
    assert '"layout": "all-1g.18gb"' in report and report.count("1g.18gb@") == 7, report
    assert "state label: 'success' (before: 'success')" in out, out
    assert out.rstrip().endswith(
        "unchanged: MIG mode and instances read the same before and after"
    ), out


def test_the_script_starts_no_agent_when_the_layout_would_change_the_gpus(tmp_path: Path) -> None:
    done = run_script(tmp_path, "--held", "all-1g.18gb")
    assert done.returncode != 0, done.stdout
    assert "layout all-1g.18gb: 1 of 1 GPU(s) change" in done.stdout, done.stdout
    assert "mig-agent plan exited" in done.stderr, done.stderr
    assert "kubectl label node" not in done.stdout, done.stdout  # no layout asked of an agent
    assert not (tmp_path / "cluster" / "logs" / "mig-agent.log").exists()


def test_the_script_as_a_dra_node_prepares_a_claim_and_changes_nothing(tmp_path: Path) -> None:
    build("dra-driver")
    done = run_script(tmp_path, "--dra")
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    uuid = re.search(r"GPU 0: NVIDIA H200 \(UUID: (GPU-[0-9a-f-]+)\)", out)
    assert uuid, out
    # the plugin's slice lists the whole GPU by the UUID NVML reports; the agent, by it
    assert f"gpu-0: type=gpu, uuid={uuid[1]}, productName=NVIDIA H200" in out, out
    assert "GPU 0 (H200): already MIG disabled, nothing to do" in out, out
    assert "state: success" in out, out
    # allocated, then prepared by the kubelet: the plugin's checkpoint and the claim's CDI spec
    assert (
        "claim real-gpu: allocated ['kubelet-node-0/gpu-0'], reserved for ['real-gpu-claim']" in out
    )
    prepared = re.search(r"the plugin's checkpoint: prepared claims \['([0-9a-f-]+)'\]", out)
    assert prepared, out
    assert f"CDI specs of claims: ['k8s.gpu.nvidia.com-claim_{prepared[1]}.yaml']" in out, out
    assert "pod real-gpu-claim: Running on kubelet-node-0" in out, out
    # Debian's containerd 1.6 reads no CRI CDIDevices: the device is not injected, and said so
    if "the node's container runtime: containerd://1.6." in out:
        assert "not injected: containerd://1.6." in out, out
    else:
        assert "the pod saw the claimed GPU by its UUID" in out, out
    # the pod deleted: unprepared, released; the slice the same
    assert "claim real-gpu: allocated [], reserved for []" in out, out
    assert "the plugin's checkpoint: prepared claims []" in out, out
    assert "the slice after: ['gpu-0'], the same" in out, out
    assert out.rstrip().endswith(
        "unchanged: MIG mode and instances read the same before and after"
    ), out
