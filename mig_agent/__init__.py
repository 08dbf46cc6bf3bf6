"""mig-agent: turns a node label into a MIG partition of the node's NVIDIA GPUs.

Importing this package imports neither pynvml nor kubernetes.
"""

__version__ = "0.1.0"
