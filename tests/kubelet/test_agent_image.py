"""We test mig-agent's own image, built from the project's Containerfile here (scripts/agent-image:
a base made from Debian's packages, buildah), as a container the real kubelet runs under the
RuntimeClass `nvidia`: NVIDIA's container runtime (CDI mode) injects what the node's CDI spec
names -- the simulated libnvidia-ml.so.1 and the GPU simulator's socket, where a real node's spec
names the driver's library and device nodes -- and the agent reads the GPUs through pynvml."""

from __future__ import annotations

from typing import Any

import yaml
from kubernetes import client
from migsim.cluster import images, real_node

from .conftest import node_pod, pod_log, wait_phase


def agent_pod(name: str, *args: str) -> dict[str, Any]:
    """A pod of the agent's image under the RuntimeClass `nvidia`, given every GPU as the
    chart's DaemonSet is: NVIDIA's container runtime injects NVML from the node's CDI spec."""
    container = {
        "image": images.AGENT,
        "args": list(args),
        "env": [
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
            {"name": "MIG_AGENT_LOG_FORMAT", "value": "console"},
        ],
    }
    return node_pod(name, container, runtimeClassName="nvidia")


def test_the_agents_image_runs_on_the_real_node_and_reads_its_gpus_through_nvml(
    kubelet_node: real_node.RealNode, core: client.CoreV1Api, namespace: str
) -> None:
    real_node.import_image(kubelet_node, images.agent())
    core.create_namespaced_pod(namespace, agent_pod("version", "--version"))
    wait_phase(core, namespace, "version", "Succeeded", timeout=90)
    assert pod_log(core, namespace, "version").strip().startswith("mig-agent ")

    # through the real NVML bindings in the image: the node's two H100s, MIG disabled
    core.create_namespaced_pod(
        namespace, agent_pod("export", "export", "--backend", "nvml", "-l", "now")
    )
    pod = wait_phase(core, namespace, "export", "Succeeded", "Failed", timeout=90)
    text = pod_log(core, namespace, "export")
    assert pod.status.phase == "Succeeded", text
    config = yaml.safe_load(text)
    assert config["version"] == "v1", text
    [entry] = config["mig-configs"]["now"]
    assert entry["mig-enabled"] is False and entry["devices"] in ("all", [0, 1]), text
