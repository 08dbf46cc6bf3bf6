"""The simulated world mig-agent is tested and demonstrated in (not shipped with the agent):

* ``migsim.gpus``: the simulated GPU models, as data written from the reference documents;
* ``migsim.nvml``: simulated GPUs -- a node's state in a file and the NVML library pynvml calls;
* ``migsim.device_plugin``: a simulated device plugin and kubelet device manager for one node
  (advertising, device assignment, the kubelet's PodResources API, GPU processes of pods);
* ``migsim.cluster``: the local Kubernetes (real control plane, kwok nodes) with agents on it.

``python -m migsim device-plugin ...`` runs a node's device plugin; ``python -m migsim.nvml``
and ``python -m migsim.cluster`` are the GPU and cluster command lines.
"""
