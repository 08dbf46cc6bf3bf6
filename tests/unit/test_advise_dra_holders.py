"""On a DRA node, advise knows which devices a running pod holds (its claims' allocated
devices, by UUID through the ResourceSlice), so a layout evicts it only where one of them does
not outlive the plan (mig_agent.core.planner.staying_uuids): a pod on GPU 0 stays through a
change of GPU 1, even one that destroys devices of the kind it holds. A pod whose devices are
not known that way (its claim reserved by nobody) is judged by kind, as on a device-plugin
node, and the agent's drain (agent/phases/holders.py) reads the same staying UUIDs.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from mig_agent.core.gpu_models import MODELS
from mig_agent.core.planner import plan
from mig_agent.core.snapshot import compact
from mig_agent.node.apply import execute
from mig_agent.ops import advise as ops_advise
from tests.unit.fake_cluster import FakeCluster
from tests.unit.fake_gpus import FakeGpus
from tests.unit.test_advise_ops import S, _claim, _mig_request
from tests.unit.test_advise_ops import catalog as catalog  # the fixture
from tests.unit.test_agent import NODE
from tests.unit.test_agent_dra import slice_of

__all__ = ["catalog"]


def _dra_node(catalog: Any) -> FakeCluster:
    """One DRA node of 2 H100s at all-1g.10gb, its slice as NVIDIA's plugin writes it; a pod
    on it holding one 1g.10gb of GPU 0 by an allocated claim; one pending asking 3g.40gb."""
    gpus = FakeGpus([MODELS["H100-80GB"]] * 2)
    execute(plan(catalog.get("all-1g.10gb"), gpus.observe(), gpus.models()), gpus)
    c = FakeCluster()
    c.add_node(NODE, {S.config_label: "all-1g.10gb", S.state_label: "success"}, {})
    state = compact(gpus.observe(), gpus.models())
    c.nodes[NODE] = dataclasses.replace(c.nodes[NODE], annotations={S.gpu_state_annotation: state})
    c.slices.append(slice_of(gpus, 1))
    held = _claim(
        "busy-gpu", _mig_request('device.attributes["gpu.nvidia.com"].profile == "1g.10gb"')
    )
    result = {"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0-mig-0", "request": "mig"}
    held["status"] = {
        "allocation": {"devices": {"results": [result]}},
        "reservedFor": [{"resource": "pods", "name": "busy", "uid": "u1"}],
    }
    c.claims.append(held)
    c.add_pod("team", "busy", NODE, claims=("busy-gpu",))
    c.claims.append(_claim("wants-3g-claim", _mig_request()))
    ref = c.add_pod("team", "wants-3g", "", claims=("wants-3g-claim",))
    c.pods[ref] = dataclasses.replace(c.pods[ref], phase="Pending")
    return c


def test_a_pod_on_a_gpu_that_stays_is_not_evicted_by_a_change_of_another(catalog: Any) -> None:
    c = _dra_node(catalog)
    report = ops_advise.run(c, catalog)
    [proposal] = report.proposals
    # one-3g changes GPU 1 only (destroying its 1g.10gb): the pod on GPU 0 keeps its device
    assert (proposal.node, proposal.option.layout, proposal.option.evicts) == (
        NODE,
        "one-3g",
        (),
    )
    assert proposal.serves == ("team/wants-3g",)


def test_a_pod_whose_devices_are_unknown_is_judged_by_kind(catalog: Any) -> None:
    c = _dra_node(catalog)
    [held] = [x for x in c.claims if x["metadata"]["name"] == "busy-gpu"]
    unreserved = copy.deepcopy(held)
    del unreserved["status"]["reservedFor"]
    c.claims = [unreserved if x is held else x for x in c.claims]
    report = ops_advise.run(c, catalog)
    assert report.proposals == ()  # every layout destroys a 1g.10gb: would evict it
    report = ops_advise.run(c, catalog, allow_evict=True)
    assert [p.option.evicts for p in report.proposals] == [("team/busy",)]
