"""``mig-agent dra-classes``: the DeviceClasses that let pods written for the device plugin
(``nvidia.com/mig-<profile>``) run on DRA nodes, kept in step with the profile configs.

One look at the cluster's DeviceClasses, the changes of mig_agent.core.device_classes, said line
by line, then (``apply``) made: deletes first, so that no two classes ever serve one name, then
replaces, then creates. Nothing but classes labelled ours is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from mig_agent.core import device_classes
from mig_agent.core.device_classes import ClassChanges
from mig_agent.core.layout import LayoutCatalog
from mig_agent.kube.cluster import Cluster, DeviceClassWriter
from mig_agent.ops.values import Writer


class DeviceClassCluster(Cluster, DeviceClassWriter, Protocol):
    """The API ``dra-classes`` reads and writes classes through."""


def sync(
    cluster: DeviceClassCluster,
    catalog: LayoutCatalog | None,
    *,
    apply: bool,
    out: Writer,
) -> ClassChanges:
    """Our classes made as ``catalog``'s layouts want them (None: none wanted, ours all go);
    each change written to ``out``, and made with ``apply``."""
    wanted = device_classes.wanted(catalog) if catalog is not None else {}
    got = device_classes.changes(wanted, cluster.list_device_classes())
    for name in got.delete:
        out(f"delete   {name}")
    for manifest in got.update:
        out(f"update   {_described(manifest)}")
    for manifest in got.create:
        out(f"create   {_described(manifest)}")
    for name, why in got.refused:
        out(f"REFUSED  {name}: {why}")
    if got.unchanged:
        out(f"in step  {len(got.unchanged)} class(es) of mig-agent's")
    if not apply:
        if not got.in_step:
            out("dry run: nothing changed (--apply makes these changes)")
        return got
    for name in got.delete:
        cluster.delete_device_class(name)
    for manifest in got.update:
        cluster.replace_device_class(manifest)
    for manifest in got.create:
        cluster.create_device_class(manifest)
    if not got.in_step:
        out(
            f"applied: {len(got.create)} created, {len(got.update)} updated, "
            f"{len(got.delete)} deleted"
        )
    return got


def _described(manifest: Mapping[str, Any]) -> str:
    """``mig-1g.10gb: nvidia.com/mig-1g.10gb by MIG 1g.10gb devices``."""
    meta = manifest.get("metadata") or {}
    profile = (meta.get("annotations") or {}).get(device_classes.PROFILE_ANNOTATION, "")
    resource = (manifest.get("spec") or {}).get("extendedResourceName", "")
    return f"{meta.get('name', '')}: {resource} by MIG {profile} devices"


def changes_json(got: ClassChanges, *, applied: bool) -> dict[str, Any]:
    return {
        "applied": applied,
        "create": [m["metadata"]["name"] for m in got.create],
        "update": [m["metadata"]["name"] for m in got.update],
        "delete": list(got.delete),
        "unchanged": list(got.unchanged),
        "refused": [{"name": n, "reason": why} for n, why in got.refused],
    }
