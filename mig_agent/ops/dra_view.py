"""What the ops commands read of DRA nodes (NVIDIA's DRA driver publishes their GPUs in
ResourceSlices; pods hold them by ResourceClaim): read once per command, and nothing where the
API does not serve them (a cluster before Kubernetes 1.34) or the caller may not read them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mig_agent.core import dra_devices
from mig_agent.core.errors import KubeError
from mig_agent.kube.cluster import Cluster


@dataclass(frozen=True)
class DraView:
    slices: list[dict[str, Any]] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)

    def devices(self, node: str) -> dict[str, int]:
        """The devices ``node``'s slices list, by kind name (``gpu``, ``1g.10gb``)."""
        return dra_devices.named(dra_devices.published_devices(self.slices, node))

    def claimed(self, node: str) -> frozenset[tuple[str, str]]:
        """(namespace, pod) of the pods that hold devices of ``node`` by claim."""
        return frozenset(dra_devices.claim_holders(self.claims, self.slices, node))


def read(cluster: Cluster, *, claims: bool = False) -> DraView:
    slices = tolerant(cluster.list_resource_slices)
    # no slice of the driver: no DRA node, and no claim of one to read
    wanted = claims and any(
        (s.get("spec") or {}).get("driver") == dra_devices.DRIVER for s in slices
    )
    return DraView(slices, tolerant(cluster.list_resource_claims) if wanted else [])


def tolerant(listing: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """What ``listing`` lists; nothing where the API does not serve it or the caller may not
    read it (403, 404)."""
    try:
        return listing()
    except KubeError as exc:
        if exc.context.get("status") in (403, 404):
            return []
        raise
