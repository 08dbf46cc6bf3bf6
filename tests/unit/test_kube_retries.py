"""The client's retry policy per request (mig_agent.kube.client._REPEAT): every request it sends
says whether it may be sent again after a failure that may have come after its work (a reset, a
timeout, a 5xx). Over real sockets through the API proxy (migsim.cluster.api_faults), with no
API server behind it: a fault answers each request. The lost answers themselves, against the
real API server, are in tests/cluster/test_kube_retries.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from migsim.cluster import kubeconfig, pki
from migsim.cluster.api_faults import ApiFaultProxy, Fault

import mig_agent.kube.client as kube_client
from mig_agent.core.errors import KubeError, KubeUnavailable
from mig_agent.kube.client import KubernetesCluster, Repeat
from mig_agent.kube.cluster import NodeView

NODE = NodeView("n1", "uid-1", "", {}, {}, False, {})


@pytest.fixture(scope="module")
def _proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiFaultProxy, Path]]:
    # one per module: ApiFaultProxy.stop() closes sockets its serving threads still read,
    # whose file descriptors the next connections reuse (a TLS record now and then lost)
    folder = tmp_path_factory.mktemp("retries")
    keys = pki.generate(folder / "pki")
    p = ApiFaultProxy(
        "https://127.0.0.1:9", cert=keys.serving_cert, key=keys.serving_key, ca=keys.ca_cert
    )
    config = kubeconfig.write(
        folder / "kubeconfig", server=p.url, ca_cert=keys.ca_cert, user="agent", token="t"
    )
    try:
        yield p, config
    finally:
        p.stop()


@pytest.fixture
def proxy(
    _proxy: tuple[ApiFaultProxy, Path],
) -> Iterator[tuple[ApiFaultProxy, KubernetesCluster]]:
    """The module's proxy, its faults and counts cleared, and a client of it."""
    p, config = _proxy
    p.clear()
    p.counts.clear()
    k = KubernetesCluster.connect(str(config), attempts=4, sleep=lambda _s: None)
    try:
        yield p, k
    finally:
        k.close()


def test_every_request_the_client_sends_says_whether_it_may_be_repeated() -> None:
    """A request missing from the table is never sent blindly again (as ONCE); listed, the
    decision is made once, where the request is written."""
    source = Path(kube_client.__file__).read_text()
    sent = set(re.findall(r"self\._(?:core|resource|policy)\.(\w+)", source))
    assert sent, "the pattern no longer finds the client's requests"
    assert sent <= set(kube_client._REPEAT), sorted(sent - set(kube_client._REPEAT))
    creates = {name: kube_client._REPEAT[name] for name in sent if name.startswith("create_")}
    assert creates == {
        "create_namespaced_pod": Repeat.NAMED,
        "create_namespaced_event": Repeat.ONCE,
        # a repeat finds the pod terminating (evicted again, no budget asked) or gone
        "create_namespaced_pod_eviction": Repeat.SAFE,
        # named, but a repeat's 409 is not read back: dra-classes' next run reads anew
        "create_device_class": Repeat.ONCE,
    }


@pytest.mark.parametrize("fault", [Fault("status", status=503), Fault("reset")])
def test_an_event_is_not_sent_again_after_a_failure_it_may_have_outlived(
    proxy: tuple[ApiFaultProxy, KubernetesCluster], fault: Fault
) -> None:
    """Before: an Event (made by generateName) was sent four times into a 503 or a reset; each
    one the server had acted on was one more Event on the node."""
    p, k = proxy
    p.add(fault)
    with pytest.raises(KubeUnavailable, match="create event") as caught:
        k.emit_event(NODE, reason="MIGTest", message="m")
    assert p.counts["create events"] == 1, repr(caught.value.__cause__)
    with pytest.raises(KubeUnavailable, match="read node"):
        k.get_node("n1")  # a read: sent again, up to the attempts
    assert p.counts["get nodes"] == 4


def test_a_throttled_event_is_sent_again(proxy: tuple[ApiFaultProxy, KubernetesCluster]) -> None:
    """API Priority and Fairness answers 429 before it handles the request: nothing was made."""
    p, k = proxy
    p.add(Fault("throttle", retry_after=0, times=1))
    p.add(Fault("status", status=201))  # the server's Event, as far as the client reads it
    k.emit_event(NODE, reason="MIGTest", message="m")
    assert p.counts["create events"] == 2


def test_a_pod_creates_409_on_its_first_try_is_anothers_pod(
    proxy: tuple[ApiFaultProxy, KubernetesCluster],
) -> None:
    """Only a repeat can meet the pod its own first try made: a 409 at once is not read."""
    p, k = proxy
    p.add(Fault("conflict", method="POST"))
    manifest = {"metadata": {"name": "v-0", "labels": {"run": "r1"}}, "spec": {}}
    with pytest.raises(KubeError, match="create pod: 409"):
        k.create_pod("default", manifest)
    assert p.counts == {"create pods": 1}
