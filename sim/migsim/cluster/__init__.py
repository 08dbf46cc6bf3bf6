"""A local Kubernetes for tests and demos: a real control plane and kwok-simulated GPU nodes.

    from migsim.cluster import Cluster
    cluster = Cluster.up(tmp_dir, gpu_nodes=2, gpus="8xH100-80GB")
    cluster.kubeconfig            # admin kubeconfig
    cluster.add_gpu_node("gpu-node-9", "7xA30")
    cluster.kubeconfig_for("ns", "sa", path)
    cluster.down()

From a shell: `scripts/local-cluster up|down|status|env` (`python -m migsim.cluster`).
The binaries come from `scripts/k8s-binaries build`. This package never imports `kubernetes`: it
speaks to the API server through `api.Api` (urllib) and the built `kubectl`.
"""

from .cluster import Cluster, ComponentStatus, ViaProxy, default_dir, down, find_binaries
from .errors import BinariesMissing, ClusterNotRunning, DevClusterError, WaitTimeout
from .kwok_stages import DELETE_DELAY_ANNOTATION
from .nodes import DEFAULT_GPUS, GPU_RESOURCE, SIMULATED_IMAGE
from .waiting import wait_until

__all__ = [
    "DEFAULT_GPUS",
    "DELETE_DELAY_ANNOTATION",
    "GPU_RESOURCE",
    "SIMULATED_IMAGE",
    "BinariesMissing",
    "Cluster",
    "ClusterNotRunning",
    "ComponentStatus",
    "DevClusterError",
    "ViaProxy",
    "WaitTimeout",
    "default_dir",
    "down",
    "find_binaries",
    "wait_until",
]
