"""We test mig-agent's own image, built from the project's Containerfile here (scripts/agent-image:
a base made from Debian's packages, buildah), as a container the real kubelet runs: the agent in
it reads the node's GPUs through pynvml and libnvidia-ml.so.1 -- here the simulated library and
the node's GPU simulator, mounted where NVIDIA's container runtime would inject the driver's."""

from __future__ import annotations

from typing import Any

import yaml
from kubernetes import client
from migsim.cluster import images, real_node

from .conftest import REAL_NODE, pod_log, wait_phase


def agent_pod(node: real_node.RealNode, name: str, *args: str) -> dict[str, Any]:
    lib = real_node.sim_nvml()
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": REAL_NODE,
            "hostNetwork": True,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "mig-agent",
                    "image": images.AGENT,
                    "imagePullPolicy": "Never",
                    "args": list(args),
                    "env": [
                        {"name": "LD_LIBRARY_PATH", "value": "/driver"},
                        {"name": "MIG_AGENT_SIM_NVML_SOCKET", "value": str(node.nvml_socket)},
                        {"name": "MIG_AGENT_LOG_FORMAT", "value": "console"},
                    ],
                    "volumeMounts": [
                        {"name": "driver", "mountPath": "/driver", "readOnly": True},
                        {"name": "sim", "mountPath": str(node.nvml_socket.parent)},
                    ],
                }
            ],
            "volumes": [
                {"name": "driver", "hostPath": {"path": str(lib), "type": "Directory"}},
                {"name": "sim", "hostPath": {"path": str(node.nvml_socket.parent)}},
            ],
        },
    }


def test_the_agents_image_runs_on_the_real_node_and_reads_its_gpus_through_nvml(
    kubelet_node: real_node.RealNode, core: client.CoreV1Api, namespace: str
) -> None:
    real_node.import_image(kubelet_node, images.agent())
    core.create_namespaced_pod(namespace, agent_pod(kubelet_node, "version", "--version"))
    wait_phase(core, namespace, "version", "Succeeded", timeout=90)
    assert pod_log(core, namespace, "version").strip().startswith("mig-agent ")

    # through the real NVML bindings in the image: the node's two H100s, MIG disabled
    core.create_namespaced_pod(
        namespace, agent_pod(kubelet_node, "export", "export", "--backend", "nvml", "-l", "now")
    )
    pod = wait_phase(core, namespace, "export", "Succeeded", "Failed", timeout=90)
    text = pod_log(core, namespace, "export")
    assert pod.status.phase == "Succeeded", text
    config = yaml.safe_load(text)
    assert config["version"] == "v1", text
    [entry] = config["mig-configs"]["now"]
    assert entry["mig-enabled"] is False and entry["devices"] in ("all", [0, 1]), text
