"""The pins a Ready workload gets (mig_agent.core.kueue_demand.pod_set_updates): Kueue's
``podSetUpdates`` that send each pod set to the node its pods were placed on.

* a pod set whose pods all go to one node is pinned to that node's hostname label (not its
  name: the two may differ), one update per pod set;
* a pod set spread over several nodes, one whose template selects a host itself (Kueue would
  refuse a second value for the key), and one on a node without the label are not pinned,
  each saying why;
* every pod set placed gets the workload's UID as a label, pinned or not, by which the check
  finds its pods once admitted;
* the pod set of a want's name is read back whatever the workload's name holds.
"""

from __future__ import annotations

from typing import Any

from mig_agent.core.demand import Ask
from mig_agent.core.kueue_demand import (
    HOSTNAME,
    POD_SET_LABEL,
    WORKLOAD_LABEL,
    PodSetDemand,
    pod_set_of,
    pod_set_updates,
    pods_selector,
)
from mig_agent.core.scheduling import constraints_of


def _workload(*pod_sets: tuple[str, dict[str, str]], uid: str = "") -> dict[str, Any]:
    return {
        "metadata": {"uid": uid},
        "spec": {
            "podSets": [
                {"name": n, "count": 2, "template": {"spec": {"nodeSelector": sel}}}
                for n, sel in pod_sets
            ]
        },
    }


HOSTS = {"gpu-a": "host-a", "gpu-b": "host-b", "bare": ""}


def test_a_pod_set_on_one_node_is_pinned_to_its_hostname() -> None:
    w = _workload(("workers", {}), ("driver", {"pool": "x"}))
    placed = {
        "team/train[workers/0]": "gpu-a",
        "team/train[workers/1]": "gpu-a",
        "team/train[driver/0]": "gpu-b",
    }
    pins = pod_set_updates(w, placed, HOSTS)
    assert list(pins.updates) == [
        {"name": "driver", "nodeSelector": {HOSTNAME: "host-b"}},
        {"name": "workers", "nodeSelector": {HOSTNAME: "host-a"}},
    ]
    assert pins.not_pinned == {}
    assert pins.describe() == "pod set driver pinned to host-b; pod set workers pinned to host-a"


def test_pod_sets_that_cannot_be_pinned_say_why() -> None:
    w = _workload(("spread", {}), ("fixed", {HOSTNAME: "host-a"}), ("odd", {}))
    placed = {
        "team/t[spread/0]": "gpu-a",
        "team/t[spread/1]": "gpu-b",
        "team/t[fixed/0]": "gpu-a",
        "team/t[odd/0]": "bare",
    }
    pins = pod_set_updates(w, placed, HOSTS)
    assert pins.updates == ()  # a workload without a UID (never so in the API): no label
    assert pins.not_pinned == {
        "fixed": f"its template selects {HOSTNAME}=host-a itself",
        "odd": f"bare has no {HOSTNAME} label",
        "spread": "its pods go to 2 nodes (gpu-a, gpu-b)",
    }


def test_the_pod_set_of_a_wants_name() -> None:
    ps = PodSetDemand(
        "team/a[b]/c", "main", 2, Ask("nvidia.com/mig-1g.10gb", 1), constraints_of({})
    )
    assert [pod_set_of(p) for p in ps.pods()] == ["main", "main"]


def test_every_placed_pod_set_gets_the_workloads_label_pinned_or_not() -> None:
    w = _workload(("workers", {}), ("spread", {}), uid="uid-1")
    placed = {
        "team/t[workers/0]": "gpu-a",
        "team/t[spread/0]": "gpu-a",
        "team/t[spread/1]": "gpu-b",
    }
    label = {WORKLOAD_LABEL: "uid-1"}
    entry = {"podSetUpdates": list(pod_set_updates(w, placed, HOSTS).updates)}
    assert entry["podSetUpdates"] == [  # each pod also says its pod set
        {"name": "spread", "labels": {**label, POD_SET_LABEL: "spread"}},
        {
            "name": "workers",
            "labels": {**label, POD_SET_LABEL: "workers"},
            "nodeSelector": {HOSTNAME: "host-a"},
        },
    ]
    assert pods_selector(entry) == f"{WORKLOAD_LABEL}=uid-1"
    assert pods_selector({}) == ""
