"""We test these aspects of the DeviceClasses mig-agent publishes on DRA clusters
(mig_agent.core.device_classes, mig_agent.ops.device_classes) and of their readers:

* a class per MIG profile the layouts create, named and serving the extended resource NVIDIA's
  device plugin advertises for it (``+me`` as ``.me``), selecting the DRA driver's devices of
  that profile; none for a profile that splits a GPU instance or a GPU with MIG off; over the
  packaged profiles every name and resource is valid, and no two classes serve one name;
* the changes: missing ones made, drifted ones put back (others' labels kept), ours no layout
  needs deleted, unchanged ones left; a class not ours is never changed or deleted, and a name
  it has or serves is refused, saying why (and ours for that name goes: two would serve it);
* applied in the order deletes, replaces, creates; a dry run writes nothing; ``--remove``
  wants none;
* what the cluster's classes serve (for advise and verify): ours and NVIDIA's demo class read as
  their profile, the newest class of a name as the scheduler takes it, a selector that picks
  something else read as nothing;
* advise counts a pod asking ``nvidia.com/mig-<profile>`` as demand a DRA node serves once a
  class serves it, and places a claim's pod on DRA nodes only; a claim naming one of the
  per-profile classes directly (no selector) asks that profile, for a pod and for a Kueue
  workload's pod set alike, and a selector of another profile beside it is not understood;
* verify makes, on a DRA node, a pod per resource a class serves, placed by the scheduler (node
  affinity, not nodeName), judged by what its nvidia-smi lists; with no class, none.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from mig_agent.cli.common import default_config
from mig_agent.config.profiles import load_catalog
from mig_agent.core import demand
from mig_agent.core import device_classes as dc
from mig_agent.core.dra_devices import DRIVER
from mig_agent.core.gpu_models import resource_name
from mig_agent.core.layout import MigProfile
from mig_agent.ops import advise as ops_advise
from mig_agent.ops.device_classes import sync
from tests.unit import test_kueue_demand as kueue_tests
from tests.unit.fake_cluster import FakeCluster
from tests.unit.test_advise_ops import MIG_1G, PROFILE_3G, S, _claim, _mig_request, _pool, _state
from tests.unit.test_advise_ops import catalog as catalog  # the fixture
from tests.unit.test_verify import GOOD_LOG, PodsCluster, _check, _cluster

CONFIG = """
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false
  mixed:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.10gb": 5, "1g.10gb+me": 1}
    - devices: [1]
      mig-enabled: true
      mig-devices: {"1c.3g.40gb": 2, "3g.40gb": 1}
  all-2g:
    - devices: all
      mig-enabled: true
      mig-devices: {"2g.20gb": 3}
"""
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _catalog(tmp_path: Path, text: str = CONFIG) -> Any:
    (tmp_path / "c.yaml").write_text(text)
    return load_catalog([tmp_path / "c.yaml"])


def _foreign(name: str, resource: str = "", expression: str = "true") -> dict[str, Any]:
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": expression}}]}
    if resource:
        spec["extendedResourceName"] = resource
    return {"metadata": {"name": name, "resourceVersion": "7"}, "spec": spec}


def test_a_class_per_profile_the_layouts_create_serving_the_device_plugins_name(
    tmp_path: Path,
) -> None:
    wanted = dc.wanted(_catalog(tmp_path))
    assert sorted(wanted) == ["mig-1g.10gb", "mig-1g.10gb.me", "mig-2g.20gb", "mig-3g.40gb"]
    me = wanted["mig-1g.10gb.me"]
    assert me["spec"]["extendedResourceName"] == resource_name("1g.10gb+me")
    assert me["metadata"]["labels"] == {dc.OWNER_LABEL: dc.OWNER}
    assert me["metadata"]["annotations"] == {dc.PROFILE_ANNOTATION: "1g.10gb+me"}
    (selector,) = me["spec"]["selectors"]
    assert selector["cel"]["expression"] == (
        f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'mig' && "
        f"device.attributes['{DRIVER}'].profile == '1g.10gb+me'"
    )
    assert dc.class_name(MigProfile.parse("1c.3g.40gb")) is None
    with pytest.raises(ValueError, match="splits a GPU instance"):
        dc.device_class(MigProfile.parse("1c.3g.40gb"))


def test_the_packaged_profiles_make_valid_classes_one_per_name() -> None:
    wanted = dc.wanted(load_catalog([default_config()]))
    assert len(wanted) > 20
    resources = [m["spec"]["extendedResourceName"] for m in wanted.values()]
    assert len(set(resources)) == len(resources)
    for name, m in wanted.items():
        assert DNS_SUBDOMAIN.fullmatch(name) and len(name) <= 253, name
        profile = m["metadata"]["annotations"][dc.PROFILE_ANNOTATION]
        assert m["spec"]["extendedResourceName"] == resource_name(profile)
        assert dc.served_profiles([m]) == {resource_name(profile): profile}
    assert {"mig-1g.24gb-me", "mig-2g.48gb.me.all", "mig-1g.24gb.gfx"} <= set(wanted)


def test_changes_make_ours_as_wanted_and_never_touch_anothers(tmp_path: Path) -> None:
    wanted = dc.wanted(_catalog(tmp_path))
    drifted = dict(wanted["mig-2g.20gb"], spec={"selectors": [{"cel": {"expression": "true"}}]})
    drifted["metadata"] = {
        **wanted["mig-2g.20gb"]["metadata"],
        "resourceVersion": "3",
        "labels": {dc.OWNER_LABEL: dc.OWNER, "team": "gpu"},
    }
    gone = dc.device_class(MigProfile.parse("7g.80gb"))
    existing = [
        wanted["mig-1g.10gb"],
        drifted,
        gone,
        _foreign("mig-3g.40gb"),  # an admin's class of our name
        _foreign("admins-me", "nvidia.com/mig-1g.10gb.me"),  # serves one of our names
        _foreign("other", "example.com/fpga"),
    ]
    got = dc.changes(wanted, existing)
    assert got.unchanged == ("mig-1g.10gb",)
    assert got.delete == ("mig-7g.80gb",)
    assert got.create == ()
    (update,) = got.update
    assert update["spec"] == wanted["mig-2g.20gb"]["spec"]
    assert update["metadata"]["resourceVersion"] == "3"
    assert update["metadata"]["labels"] == {dc.OWNER_LABEL: dc.OWNER, "team": "gpu"}
    refused = dict(got.refused)
    assert set(refused) == {"mig-3g.40gb", "mig-1g.10gb.me"}
    assert "not mig-agent's" in refused["mig-3g.40gb"]
    assert (
        "admins-me" in refused["mig-1g.10gb.me"] and "only one class" in refused["mig-1g.10gb.me"]
    )
    written = {m["metadata"]["name"] for m in (*got.create, *got.update)} | set(got.delete)
    assert not written & {"mig-3g.40gb", "admins-me", "other"}
    assert not got.in_step


def test_ours_of_a_name_another_class_serves_goes(tmp_path: Path) -> None:
    wanted = dc.wanted(_catalog(tmp_path))
    existing = [wanted["mig-2g.20gb"], _foreign("admins-2g", "nvidia.com/mig-2g.20gb")]
    got = dc.changes(wanted, existing)
    assert got.delete == ("mig-2g.20gb",) and "mig-2g.20gb" in dict(got.refused)
    assert {m["metadata"]["name"] for m in got.create} == {
        "mig-1g.10gb",
        "mig-1g.10gb.me",
        "mig-3g.40gb",
    }


def test_sync_deletes_first_writes_nothing_in_a_dry_run_and_removes_all_of_ours(
    tmp_path: Path,
) -> None:
    c = FakeCluster()
    c.device_classes["mig-7g.80gb"] = dc.device_class(MigProfile.parse("7g.80gb"))
    c.device_classes["other"] = _foreign("other", "example.com/fpga")
    catalog = _catalog(tmp_path)
    lines: list[str] = []
    got = sync(c, catalog, apply=False, out=lines.append)
    assert set(c.device_classes) == {"mig-7g.80gb", "other"} and not got.in_step
    assert lines[0] == "delete   mig-7g.80gb"
    assert "create   mig-1g.10gb.me: nvidia.com/mig-1g.10gb.me by MIG 1g.10gb+me devices" in lines
    assert lines[-1].startswith("dry run: nothing changed")

    c.requests.clear()
    lines.clear()
    sync(c, catalog, apply=True, out=lines.append)
    writes = [k for k in c.requests if k != "list_device_classes"]
    assert writes == ["delete_device_class", "create_device_class"]
    assert set(c.device_classes) == {"other", *dc.wanted(catalog)}
    assert lines[-1] == "applied: 4 created, 0 updated, 1 deleted"
    lines.clear()
    assert sync(c, catalog, apply=True, out=lines.append).in_step
    assert lines == ["in step  4 class(es) of mig-agent's"]

    sync(c, None, apply=True, out=lines.append)
    assert set(c.device_classes) == {"other"}


def test_served_profiles_read_ours_nvidias_demo_and_the_newest_of_a_name() -> None:
    demo = _foreign(
        "mig-1g-12gb",
        "nvidia.com/mig-1g.12gb",
        "device.attributes['gpu.nvidia.com'].type == 'mig' && "
        'device.attributes["gpu.nvidia.com"].profile == "1g.12gb"',
    )
    ours = dc.device_class(MigProfile.parse("3g.40gb"))
    older = _foreign(
        "older",
        "nvidia.com/mig-2g.20gb",
        "device.attributes['gpu.nvidia.com'].profile == '4g.40gb'",
    )
    newer = _foreign(
        "newer",
        "nvidia.com/mig-2g.20gb",
        "device.attributes['gpu.nvidia.com'].profile == '2g.20gb'",
    )
    older["metadata"]["creationTimestamp"] = "2026-12-01T10:00:00Z"
    newer["metadata"]["creationTimestamp"] = "2026-12-02T10:00:00Z"
    other_driver = _foreign(
        "x",
        "nvidia.com/mig-7g.80gb",
        "device.driver == 'example.com' && "
        "device.attributes['gpu.nvidia.com'].profile == '7g.80gb'",
    )
    not_one_profile = _foreign(
        "y", "nvidia.com/mig-4g.40gb", "device.attributes['gpu.nvidia.com'].profile != '1g.10gb'"
    )
    whole = _foreign("gpu.nvidia.com", "nvidia.com/gpu", f"device.driver == '{DRIVER}'")
    served = dc.served_profiles([demo, ours, older, newer, other_driver, not_one_profile, whole])
    assert served == {
        "nvidia.com/mig-1g.12gb": "1g.12gb",
        "nvidia.com/mig-3g.40gb": "3g.40gb",
        "nvidia.com/mig-2g.20gb": "2g.20gb",
    }


def _published(c: FakeCluster, *profiles: str) -> None:
    for p in profiles:
        m = dc.device_class(MigProfile.parse(p))
        c.device_classes[m["metadata"]["name"]] = m


def test_advise_counts_a_pod_asking_the_resource_as_demand_on_a_dra_node(catalog: Any) -> None:
    c = _pool(catalog, "dra-a", dra=True)  # at all-1g.10gb, its 14 devices free
    ref = c.add_pod("team", "wants-3g", "", gpu={"nvidia.com/mig-3g.40gb": 1})
    c.pods[ref] = dataclasses.replace(c.pods[ref], phase="Pending")
    report = ops_advise.run(c, catalog)
    assert report.proposals == ()  # no class: a DRA node serves no extended resource

    _published(c, "1g.10gb", "3g.40gb")
    report = ops_advise.run(c, catalog)
    [proposal] = report.proposals
    assert (proposal.node, proposal.serves) == ("dra-a", ("team/wants-3g",))
    assert proposal.option.resources.get("nvidia.com/mig-3g.40gb", 0) >= 1
    assert "dra:3g.40gb" not in proposal.option.resources  # one kind for either way of asking

    # one asking 1g.10gb fits today: the scheduler's, no proposal for it
    ref = c.add_pod("team", "wants-1g", "", gpu={MIG_1G: 1})
    c.pods[ref] = dataclasses.replace(c.pods[ref], phase="Pending")
    report = ops_advise.run(c, catalog)
    assert [p.serves for p in report.proposals] == [("team/wants-3g",)]


def test_a_claims_pod_renamed_to_the_resource_goes_to_dra_nodes_only(catalog: Any) -> None:
    c = _pool(catalog, "plugin-a")  # a device-plugin node with 3g.40gb devices free today
    c.nodes["plugin-a"] = dataclasses.replace(
        c.nodes["plugin-a"],
        labels={**c.nodes["plugin-a"].labels, S.config_label: "all-3g"},
        annotations={S.gpu_state_annotation: _state(catalog, "all-3g")[0]},
    )
    dra = _pool(catalog, "dra-b", dra=True)
    c.nodes.update(dra.nodes)
    c.slices = dra.slices
    _published(c, "1g.10gb", "3g.40gb")
    c.claims.append(_claim("wants-3g-claim", _mig_request(PROFILE_3G)))
    ref = c.add_pod("team", "wants-3g", "", claims=("wants-3g-claim",))
    c.pods[ref] = dataclasses.replace(c.pods[ref], phase="Pending")
    report = ops_advise.run(c, catalog)
    assert [(p.node, p.serves) for p in report.proposals] == [("dra-b", ("team/wants-3g",))]


def test_a_claim_naming_a_per_profile_class_asks_its_profile(catalog: Any) -> None:
    made = dc.device_class(MigProfile.parse("3g.40gb"))
    theirs = {**made, "metadata": {"name": "any-mig"}, "spec": {"selectors": []}}
    profiles = dc.class_profiles([made, theirs])
    assert profiles == {"mig-3g.40gb": "3g.40gb"}  # a class picking no one profile: none
    by_class = {"exactly": {"deviceClassName": "mig-3g.40gb", "count": 2}}
    claim = _claim("c", by_class)
    assert demand.from_claims([claim]) is None  # not read as NVIDIA's without the classes
    assert demand.from_claims([claim], profiles) == demand.Ask("dra:3g.40gb", 2)
    other = _mig_request('device.attributes["gpu.nvidia.com"].profile == "1g.10gb"')
    other["exactly"]["deviceClassName"] = "mig-3g.40gb"
    got = demand.from_claims([_claim("c", other)], profiles)
    assert isinstance(got, str) and "several profiles at once (1g.10gb, 3g.40gb)" in got

    c = _pool(catalog, "dra-b", dra=True)  # at all-1g.10gb
    _published(c, "1g.10gb", "3g.40gb")
    c.claims.append(_claim("wants-3g-claim", {"exactly": {"deviceClassName": "mig-3g.40gb"}}))
    ref = c.add_pod("team", "wants-3g", "", claims=("wants-3g-claim",))
    c.pods[ref] = dataclasses.replace(c.pods[ref], phase="Pending")
    c.claim_templates.append(
        kueue_tests._template(
            "one-3g", {"name": "g", "exactly": {"deviceClassName": "mig-3g.40gb"}}
        )
    )
    entry = {"name": "gpus", "resourceClaimTemplateName": "one-3g"}
    c.kueue["workloads"] = [kueue_tests._by_claim("train", 1, entry)]
    report = ops_advise.run(c, catalog)
    [proposal] = report.proposals
    assert proposal.node == "dra-b" and report.unserved == ()
    assert sorted(proposal.serves) == ["team/train[main/0]", "team/wants-3g"]


def test_verify_makes_a_scheduled_pod_per_resource_a_class_serves_on_a_dra_node() -> None:
    c = _cluster(allocatable={})
    devices = [
        {
            "name": f"gpu-0-mig-1g10gb-19-{i}",
            "attributes": {"type": {"string": "mig"}, "profile": {"string": "1g.10gb"}},
        }
        for i in range(2)
    ]
    c.slices = [{"spec": {"driver": DRIVER, "pool": {"name": "n1", "generation": 1},
                          "devices": devices}}]  # fmt: skip
    verdict = _check(c)
    assert verdict.ok and c.manifests == []
    assert "no DeviceClass serves" in verdict.checks[-1].detail

    assert isinstance(c, PodsCluster)
    _published(c, "1g.10gb")
    verdict = _check(c)
    assert verdict.ok, verdict
    assert [ch.name for ch in verdict.checks][-1] == f"pod {MIG_1G}"
    (pod,) = c.manifests
    spec = pod["spec"]
    assert "nodeName" not in spec
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
    ]
    assert spec["containers"][0]["resources"]["limits"] == {MIG_1G: 1}

    # a pod given another device than it asked fails its check
    c2 = _cluster(allocatable={})
    c2.slices, c2.device_classes = c.slices, c.device_classes
    c2.play = lambda _p: (
        {"status": {"phase": "Succeeded"}},
        GOOD_LOG.replace("1g.10gb", "2g.20gb"),
        [],
    )
    failed = _check(c2).failed
    assert failed is not None and failed.name == f"pod {MIG_1G}", failed
