"""We test ``kubectl mig`` through the real kubectl, which finds the plugin on PATH, against the
local cluster with agents running: status in every output, a plan from the node's published
GPU state, a repartition followed to success, kubectl's flags (--kubeconfig, --context) and exit
codes (0, 1, 2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from migsim.cluster import Cluster

from .conftest import STATE, NodeFactory


def kubectl_mig(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    plugin = shutil.which("kubectl-mig")
    assert plugin, "kubectl-mig is installed with the package (pip install -e .)"
    env = {
        **os.environ,
        "PATH": f"{Path(plugin).parent}:{os.environ.get('PATH', '')}",
        "KUBECONFIG": str(cluster.kubeconfig),
    }
    env.pop("NO_COLOR", None)
    return subprocess.run(
        [str(cluster.bin_dir / "kubectl"), "mig", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_status_plan_and_repartition_through_kubectl(
    agent_node: NodeFactory, installed: Cluster
) -> None:
    cluster = installed
    node = agent_node("2xH100-80GB")
    done = kubectl_mig(cluster, "status", "-o", "json")
    assert done.returncode == 0, done.stderr
    rows = {r["node"]: r for r in json.loads(done.stdout)}
    assert rows[node.name]["resources"] == {"nvidia.com/gpu": 2}

    done = kubectl_mig(cluster, "plan", node.name, "all-1g.10gb", "-o", "json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["action"] == "apply" and plan["changed_gpus"] == [0, 1]
    assert plan["created_gpu_instances"] == 14

    done = kubectl_mig(cluster, "repartition", "all-1g.10gb", node.name, "-p", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert node.labels()[STATE] == "success"
    assert "success" in done.stdout

    wide = kubectl_mig(cluster, "status", "-o", "wide", "-l", f"kubernetes.io/hostname={node.name}")
    assert wide.returncode == 0, wide.stderr
    header, line = wide.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "LAYOUT", "STATE", "GPUS", "RESOURCES", "REASON", "AGENT"]
    assert line.split()[:3] == [node.name, "all-1g.10gb", "success"]
    assert "mig-1g.10gb=14" in line and "(Ready)" in line
    assert "\033[" not in wide.stdout  # not a terminal: no colour

    yaml_out = kubectl_mig(cluster, "status", "-o", "yaml")
    assert yaml_out.returncode == 0 and f"node: {node.name}" in yaml_out.stdout


def test_kubectl_flags_and_exit_codes(agent_node: NodeFactory, installed: Cluster) -> None:
    cluster = installed
    node = agent_node("2xH100-80GB")
    context = json.loads(Path(cluster.kubeconfig).read_text())["current-context"]
    assert kubectl_mig(cluster, "status", "--context", context).returncode == 0
    wrong = kubectl_mig(cluster, "status", "--context", "no-such-context")
    assert wrong.returncode == 2 and "no-such-context" in wrong.stderr, wrong.stderr
    typo = kubectl_mig(cluster, "repartition", "all-1g.10gbx", node.name)
    assert typo.returncode == 2 and "unknown layout 'all-1g.10gbx'" in typo.stderr
    assert node.labels().get("nvidia.com/mig.config") is None  # nothing was touched
    missing = kubectl_mig(cluster, "plan", "no-such-node", "all-1g.10gb")
    assert missing.returncode != 0 and "no-such-node" in missing.stderr
    bad = kubectl_mig(cluster, "status", "-o", "xml")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
