"""What the client sends again after a lost answer, against the local cluster's real API server
behind a proxy that forwards a request and then resets the connection instead of relaying the
answer: the request's work done, its answer lost.

* a pod create is sent again, meets its own pod (409 AlreadyExists) and takes it for made when
  it carries the manifest's labels (verify's run); a pod of that name without them is another's;
* an Event (made by generateName) is not sent again: a second try would be a second Event;
* a node patch conditional on the label it changes is sent again, meets 409 (its own write), and
  is taken for written when the node holds what it writes.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from migsim.cluster import SIMULATED_IMAGE, Cluster
from migsim.cluster.api_faults import ApiFaultProxy, request_kind

from mig_agent.core.errors import KubeError, KubeUnavailable
from mig_agent.kube.client import KubernetesCluster
from mig_agent.kube.cluster import NodeView


class _Sink:
    """Where a lost answer goes."""

    def sendall(self, _data: bytes) -> None:
        return None


class LosingProxy(ApiFaultProxy):
    """The API proxy, but the first ``times`` requests of ``method`` on a path ending in
    ``suffix`` reach the API server and their answers are dropped: the client's connection is
    reset (counted as hits["lost"])."""

    def __init__(
        self, *args: Any, method: str = "", suffix: str = "", times: int = 1, **kw: Any
    ) -> None:
        super().__init__(*args, **kw)
        self.arm(method, suffix, times)

    def arm(self, method: str, suffix: str, times: int = 1) -> None:
        with self._lock:
            self.lose, self.left = (method, suffix), times if method else 0
            self.counts.clear()
            self.hits.clear()

    def _handle(self, conn: socket.socket, raw: socket.socket, head: bytes, body: bytes) -> bool:
        request_line, _, rest = head.partition(b"\r\n")
        method, target, _version = request_line.decode("latin-1").split(" ", 2)
        path = target.split("?", 1)[0]
        with self._lock:
            lose = self.left > 0 and method == self.lose[0] and path.endswith(self.lose[1])
            if lose:
                self.left -= 1
                self.requests += 1
                self.counts[request_kind(method, path, False)] += 1
                self.hits["lost"] += 1
        if not lose:
            return super()._handle(conn, raw, head, body)
        self._forward(_Sink(), method, target, rest, body, False)  # type: ignore[arg-type]
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return False


@pytest.fixture(scope="module")
def _losing_proxy(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LosingProxy, Path]]:
    # one per module: ApiFaultProxy.stop() closes sockets its serving threads still read,
    # whose file descriptors the next connections reuse (a TLS record now and then lost)
    proxy = LosingProxy(
        cluster.server,
        cert=cluster.dir / "pki" / "serving.crt",
        key=cluster.dir / "pki" / "serving.key",
        ca=cluster.ca_cert,
    )
    via = tmp_path_factory.mktemp("losing") / "via-proxy.kubeconfig"
    via.write_text(cluster.kubeconfig.read_text().replace(cluster.server, proxy.url))
    try:
        yield proxy, via
    finally:
        proxy.stop()


@pytest.fixture
def losing(_losing_proxy: tuple[LosingProxy, Path]) -> Iterator[Any]:
    """``make(method, suffix)``: a client whose next such request's answer is lost, and its
    proxy (its counts from then on)."""
    proxy, via = _losing_proxy
    made: list[KubernetesCluster] = []

    def make(method: str, suffix: str) -> tuple[LosingProxy, KubernetesCluster]:
        proxy.arm(method, suffix)
        made.append(KubernetesCluster.connect(str(via), sleep=lambda _s: None))
        return proxy, made[-1]

    yield make
    proxy.arm("", "")
    for k in made:
        k.close()


def _pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": SIMULATED_IMAGE}]},
    }


def test_a_pod_create_whose_answer_was_lost_is_the_pod_made(
    losing: Any, namespace: str, core: client.CoreV1Api
) -> None:
    """Before: the create was sent again into 409 AlreadyExists and raised, the pod made by
    the first try unknown to the caller (verify said "could not be made" and never deleted
    it)."""
    proxy, k = losing("POST", "/pods")
    ref = k.create_pod(namespace, _pod("v-0", {"run": "a1b2c3"}))
    assert proxy.hits["lost"] == 1
    assert proxy.counts["create pods"] == 2  # the lost one and its repeat
    assert proxy.counts["get pods"] == 1  # the pod it met, read for its labels
    assert ref.uid == core.read_namespaced_pod("v-0", namespace).metadata.uid


def test_a_pod_of_the_name_without_the_runs_labels_is_anothers(
    losing: Any, namespace: str, core: client.CoreV1Api
) -> None:
    core.create_namespaced_pod(namespace, _pod("v-0", {"run": "someone-else"}))
    # the repeat of a create whose answer was lost: its own try refused (the name is taken)
    proxy, k = losing("POST", "/pods")
    with pytest.raises(KubeError, match="create pod: 409") as caught:
        k.create_pod(namespace, _pod("v-0", {"run": "a1b2c3"}))
    assert caught.value.context["status"] == 409
    assert proxy.counts["create pods"] == 2


def test_an_event_whose_answer_was_lost_is_not_sent_again(
    losing: Any, namespace: str, core: client.CoreV1Api
) -> None:
    """Before: sent again after the lost answer, so the node got the same Event twice."""
    proxy, k = losing("POST", "/events")
    node = NodeView(f"node-{namespace}"[:63], "uid-1", "", {}, {}, False, {})
    with pytest.raises(KubeUnavailable, match="create event"):
        k.emit_event(node, reason="MIGTest", message="once")
    assert proxy.counts["create events"] == 1
    events = core.list_namespaced_event(
        "default", field_selector=f"involvedObject.name={node.name}"
    ).items
    assert [e.message for e in events] == ["once"]


def test_a_conditional_node_patch_whose_answer_was_lost_is_written(
    losing: Any, namespace: str, core: client.CoreV1Api
) -> None:
    """A relabel conditional on the label it changes (advise --apply: only while the layout is
    still the one read). Before: the repeat met 409 (its own write moved the resourceVersion),
    the node read again showed the new label, and the patch, written, was reported as "labels
    changed, patch not written"."""
    name = f"node-{namespace}"[:63]
    core.create_node({"metadata": {"name": name, "labels": {"layout": "a"}}})
    try:
        proxy, k = losing("PATCH", f"/nodes/{name}")
        node = k.patch_node(name, labels={"layout": "b"}, expect_labels={"layout": "a"})
        assert proxy.hits["lost"] == 1 and proxy.counts["patch nodes"] == 2
        assert node.labels["layout"] == "b"
        assert core.read_node(name).metadata.labels["layout"] == "b"
    finally:
        core.delete_node(name)
