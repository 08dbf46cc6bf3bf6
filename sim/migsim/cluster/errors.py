"""Errors of the local cluster tooling (a development aid, outside the agent's own errors,
mig_agent.core.errors)."""

from __future__ import annotations


class DevClusterError(RuntimeError):
    """The local cluster could not be started, found or used."""


class BinariesMissing(DevClusterError):
    """kube-apiserver & co. are not built (`scripts/k8s-binaries build`)."""


class ClusterNotRunning(DevClusterError):
    """No cluster is recorded in the folder, or it is not healthy."""


class WaitTimeout(DevClusterError, TimeoutError):
    """A condition did not hold before its deadline."""
