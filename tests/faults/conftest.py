"""Fixtures of the fault matrix: the session's cluster with mig-agent installed and a namespace
for the trials' GPU pods. `MIG_AGENT_FAULTS=full` runs every point x fault; by default a quick
subset."""

from __future__ import annotations

import os

import pytest
from migsim.cluster import Cluster, agents

from . import harness


def full_matrix() -> bool:
    return os.environ.get("MIG_AGENT_FAULTS", "").lower() == "full"


@pytest.fixture(scope="session")
def fault_cluster(cluster: Cluster) -> Cluster:
    agents.install(cluster)
    harness.ensure_namespace(cluster)
    return cluster


@pytest.fixture(scope="session")
def dra_fault_cluster(fault_cluster: Cluster) -> Cluster:
    """The same cluster with NVIDIA's DRA driver installed (its DaemonSet, DeviceClasses)."""
    agents.install_dra(fault_cluster)
    return fault_cluster
