"""The DeviceClasses mig-agent publishes on DRA clusters, and what a cluster's classes serve.

One class per MIG profile the approved layouts create: it selects the devices of that profile of
NVIDIA's DRA driver and names the extended resource NVIDIA's device plugin advertises for them
(``nvidia.com/mig-<profile>``, ``+`` as ``.``: mig_agent.core.gpu_models.resource_name), so that a
pod written for the device plugin (``nvidia.com/mig-1g.10gb: 1``, no ResourceClaim) runs
unchanged on a DRA node (Kubernetes 1.37: DRA extended resources, KEP-5004 GA).

Only one class may serve an extended resource name: the API server takes two, and the scheduler
serves pods by the one created last (then by the first name), so a class of ours made beside
another's would take that one's pods from it. Ours carry OWNER_LABEL; a class without it is never
changed or deleted, and a name such a class serves is not published (``changes`` says why).

Pure module. Facts: ``../shared/reference/field-2026-12.md`` section 8 (NVIDIA's demo class),
resource.k8s.io/v1 DeviceClassSpec.extendedResourceName.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from mig_agent.core.dra_devices import DRIVER
from mig_agent.core.gpu_models import resource_name
from mig_agent.core.layout import LayoutCatalog, MigProfile

API_VERSION: Final = "resource.k8s.io/v1"
OWNER_LABEL: Final = "app.kubernetes.io/managed-by"
OWNER: Final = "mig-agent"
PROFILE_ANNOTATION: Final = "mig-agent.dev/mig-profile"

# the terms of a selector this module reads (joined by &&): NVIDIA's demo class's, with the
# driver named first, as ours do
_DRIVER_TERM = re.compile(r"device\.driver\s*==\s*(['\"])(?P<v>[^'\"]+)\1")
_ATTRIBUTE_TERM = re.compile(
    r"device\.attributes\[\s*(['\"])gpu\.nvidia\.com\1\s*\]\.(?P<a>type|profile)"
    r"\s*==\s*(['\"])(?P<v>[^'\"]+)\3"
)


def class_name(profile: MigProfile) -> str | None:
    """``mig-1g.10gb``, ``mig-1g.10gb.me``: the extended resource's name without its domain; None
    for a profile that splits a GPU instance (``1c.3g.40gb``: no such resource, and NVIDIA's DRA
    plugin refuses to start on such a device)."""
    resource = resource_name(str(profile))
    return None if resource is None else resource.removeprefix("nvidia.com/")


def selector(profile: MigProfile) -> str:
    """The CEL selector of the driver's MIG devices of ``profile``; the driver first, so that a
    device of another driver (no such attributes) is not looked into."""
    a = f"device.attributes['{DRIVER}']"
    return f"device.driver == '{DRIVER}' && {a}.type == 'mig' && {a}.profile == '{profile}'"


def device_class(profile: MigProfile) -> dict[str, Any]:
    """Our class for ``profile`` (which must have a class_name)."""
    name = class_name(profile)
    if name is None:
        raise ValueError(f"{profile} splits a GPU instance: no extended resource names it")
    return {
        "apiVersion": API_VERSION,
        "kind": "DeviceClass",
        "metadata": {
            "name": name,
            "labels": {OWNER_LABEL: OWNER},
            "annotations": {PROFILE_ANNOTATION: str(profile)},
        },
        "spec": {
            "selectors": [{"cel": {"expression": selector(profile)}}],
            "extendedResourceName": f"nvidia.com/{name}",
        },
    }


def layout_profiles(catalog: LayoutCatalog) -> list[MigProfile]:
    """The MIG profiles the catalog's layouts create, on any GPU they select, largest first."""
    found = {
        p
        for layout in catalog.layouts.values()
        for rule in layout.rules
        if rule.gpu_layout.mig_enabled
        for p, _ in rule.gpu_layout.devices
    }
    return sorted(found, key=lambda p: p.sort_key)


def wanted(catalog: LayoutCatalog) -> dict[str, dict[str, Any]]:
    """Class name -> our class, for every profile the layouts create that a resource names."""
    return {
        name: device_class(p)
        for p in layout_profiles(catalog)
        if (name := class_name(p)) is not None
    }


def is_ours(cls: Mapping[str, Any]) -> bool:
    return bool(((cls.get("metadata") or {}).get("labels") or {}).get(OWNER_LABEL) == OWNER)


@dataclass(frozen=True, slots=True)
class ClassChanges:
    """What makes the cluster's classes ours as wanted: applied deletes first, so that no two
    classes serve one name even for a moment."""

    create: tuple[Mapping[str, Any], ...] = ()
    update: tuple[Mapping[str, Any], ...] = ()  # each with the existing one's resourceVersion
    delete: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    refused: tuple[tuple[str, str], ...] = ()  # (class name, why it is not published)

    @property
    def in_step(self) -> bool:
        return not (self.create or self.update or self.delete)


def changes(
    wanted: Mapping[str, Mapping[str, Any]], existing: Iterable[Mapping[str, Any]]
) -> ClassChanges:
    """The changes from the cluster's ``existing`` classes (all of them, as the API lists them)
    to ``wanted`` (class name -> our class). Ours not wanted go. A wanted one is refused when a
    class not ours has its name, or serves its extended resource (then ours of it goes too:
    two would serve one name)."""
    ours: dict[str, Mapping[str, Any]] = {}
    theirs: dict[str, Mapping[str, Any]] = {}
    for cls in existing:
        name = str((cls.get("metadata") or {}).get("name", ""))
        (ours if is_ours(cls) else theirs)[name] = cls
    serving = {_resource(c): n for n, c in sorted(theirs.items()) if _resource(c)}
    create, update, unchanged, refused = [], [], [], []
    for name, manifest in sorted(wanted.items()):
        resource = _resource(manifest)
        if name in theirs:
            refused.append(
                (
                    name,
                    f"DeviceClass {name} exists and is not mig-agent's (no label "
                    f"{OWNER_LABEL}={OWNER}): left as it is, {resource} not published",
                )
            )
        elif resource in serving:
            refused.append(
                (
                    name,
                    f"DeviceClass {serving[resource]} (not mig-agent's) serves "
                    f"{resource} already, and only one class may serve an extended "
                    "resource: none of mig-agent's is published for it",
                )
            )
        elif name not in ours:
            create.append(manifest)
        elif _differs(ours[name], manifest):
            update.append(_updated(ours[name], manifest))
        else:
            unchanged.append(name)
    kept = set(unchanged) | {str(m["metadata"]["name"]) for m in update}
    return ClassChanges(
        tuple(create),
        tuple(update),
        tuple(sorted(set(ours) - kept)),
        tuple(unchanged),
        tuple(refused),
    )


def _resource(cls: Mapping[str, Any]) -> str:
    return str((cls.get("spec") or {}).get("extendedResourceName") or "")


def _differs(have: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    meta, wanted_meta = have.get("metadata") or {}, want["metadata"]
    return (
        have.get("spec") != want["spec"]
        or any((meta.get("labels") or {}).get(k) != v for k, v in wanted_meta["labels"].items())
        or any(
            (meta.get("annotations") or {}).get(k) != v
            for k, v in wanted_meta["annotations"].items()
        )
    )


def _updated(have: Mapping[str, Any], want: Mapping[str, Any]) -> dict[str, Any]:
    """``want`` over ``have``: its spec whole, its labels and annotations beside others'."""
    meta = have.get("metadata") or {}
    return {
        **want,
        "metadata": {
            "name": want["metadata"]["name"],
            "resourceVersion": meta.get("resourceVersion", ""),
            "labels": {**(meta.get("labels") or {}), **want["metadata"]["labels"]},
            "annotations": {**(meta.get("annotations") or {}), **want["metadata"]["annotations"]},
        },
    }


def served_profiles(classes: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Extended resource -> the MIG profile of NVIDIA's DRA driver the cluster's classes serve
    it by: per name, the class the scheduler takes (the newest, then the first by name), where
    its selectors pick exactly that driver's devices of one profile."""
    chosen: dict[str, Mapping[str, Any]] = {}
    for cls in _newest_first(classes):
        chosen.setdefault(_resource(cls), cls)
    out = {}
    for resource, cls in chosen.items():
        profile = _profile_selected(cls)
        if resource and profile:
            out[resource] = profile
    return out


def class_profiles(classes: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """DeviceClass name -> the MIG profile of NVIDIA's DRA driver it picks, for the classes
    whose selectors pick exactly that driver's devices of one profile (ours among them): a
    claim naming one asks a device of that profile."""
    out = {}
    for cls in classes:
        profile = _profile_selected(cls)
        if profile:
            out[str((cls.get("metadata") or {}).get("name", ""))] = profile
    return out


def _newest_first(classes: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """By creation, newest first, then by name (a sort is stable, reversed too); RFC 3339 times
    of one format compare as strings."""

    def meta(cls: Mapping[str, Any], key: str) -> str:
        return str((cls.get("metadata") or {}).get(key) or "")

    by_name = sorted(classes, key=lambda c: meta(c, "name"))
    return sorted(by_name, key=lambda c: meta(c, "creationTimestamp"), reverse=True)


def _profile_selected(cls: Mapping[str, Any]) -> str:
    """The profile a class's selectors pick (every term one of driver, type == 'mig', profile),
    or "" when they pick something else or this module cannot tell."""
    found: dict[str, str] = {}
    for s in (cls.get("spec") or {}).get("selectors") or []:
        expression = str((s.get("cel") or {}).get("expression", ""))
        for term in expression.split("&&"):
            term = term.strip()
            if m := _DRIVER_TERM.fullmatch(term):
                key, value = "driver", m["v"]
            elif m := _ATTRIBUTE_TERM.fullmatch(term):
                key, value = m["a"], m["v"]
            else:
                return ""
            if found.setdefault(key, value) != value:
                return ""
    if found.get("driver", DRIVER) != DRIVER or found.get("type", "mig") != "mig":
        return ""
    return found.get("profile", "")
