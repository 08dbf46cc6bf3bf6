"""The request counter of the API proxy (migsim.cluster.api_faults): every request is counted by
verb and resource, the ones a fault answers too, over real sockets; no API server is needed (a
fault answers each request here)."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from migsim.cluster import pki
from migsim.cluster.api_faults import ApiFaultProxy, Fault, request_kind


@pytest.mark.parametrize(
    ("method", "path", "watch", "kind"),
    [
        ("GET", "/api/v1/nodes/n1", False, "get nodes"),
        ("GET", "/api/v1/nodes", False, "list nodes"),
        ("GET", "/api/v1/nodes", True, "watch nodes"),
        ("GET", "/api/v1/watch/nodes", False, "watch nodes"),
        ("PATCH", "/api/v1/nodes/n1", False, "patch nodes"),
        ("PATCH", "/api/v1/nodes/n1/status", False, "patch nodes/status"),
        ("PUT", "/api/v1/nodes/n1", False, "update nodes"),
        ("POST", "/api/v1/namespaces/a/pods/p/eviction", False, "create pods/eviction"),
        ("GET", "/api/v1/namespaces/a/pods", False, "list pods"),
        ("DELETE", "/api/v1/namespaces/a/pods/p", False, "delete pods"),
        ("DELETE", "/api/v1/namespaces/a/pods", False, "deletecollection pods"),
        (
            "GET",
            "/apis/policy/v1/namespaces/a/poddisruptionbudgets",
            False,
            "list poddisruptionbudgets",
        ),
        ("POST", "/apis/events.k8s.io/v1/namespaces/default/events", False, "create events"),
        ("GET", "/api/v1/namespaces/a", False, "get namespaces"),
        ("GET", "/version", False, "GET /version"),
    ],
)
def test_request_kind_names_verb_and_resource(
    method: str, path: str, watch: bool, kind: str
) -> None:
    assert request_kind(method, path, watch) == kind


def test_every_request_is_counted_the_faulted_ones_too(tmp_path: Path) -> None:
    keys = pki.generate(tmp_path / "pki")
    proxy = ApiFaultProxy(
        "https://127.0.0.1:9", cert=keys.serving_cert, key=keys.serving_key, ca=keys.ca_cert
    )
    ctx = ssl.create_default_context(cafile=str(keys.ca_cert))
    try:
        proxy.add(Fault("status", status=503))
        before = proxy.snapshot()

        def call(method: str, path: str) -> int:
            req = urllib.request.Request(
                proxy.url + path, method=method, data=b"{}" if method in ("PATCH", "POST") else None
            )
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
                    return int(resp.status)
            except urllib.error.HTTPError as exc:
                return exc.code

        assert call("GET", "/api/v1/nodes/n1") == 503
        assert call("GET", "/api/v1/nodes?fieldSelector=metadata.name%3Dn1&watch=true") == 503
        assert call("PATCH", "/api/v1/nodes/n1") == 503
        assert call("PATCH", "/api/v1/nodes/n1") == 503
        assert proxy.snapshot() - before == Counter(
            {"get nodes": 1, "watch nodes": 1, "patch nodes": 2}
        )
        assert proxy.requests == 4
        assert proxy.hits == Counter({"status-503": 4})  # the fault's own count is unchanged
    finally:
        proxy.stop()


def test_a_fault_armed_by_a_request_answers_only_the_requests_after_it(tmp_path: Path) -> None:
    """A fault with `after` lands on the first matching request once the client has asked one
    of that kind since the fault was added (the fault matrix's "right after the first
    eviction"): not on those before it, nor on the arming request itself, and not on a request
    of that kind asked before the adding."""
    keys = pki.generate(tmp_path / "pki")
    proxy = ApiFaultProxy(
        "https://127.0.0.1:9", cert=keys.serving_cert, key=keys.serving_key, ca=keys.ca_cert
    )
    ctx = ssl.create_default_context(cafile=str(keys.ca_cert))

    def call(method: str, path: str) -> int:
        req = urllib.request.Request(
            proxy.url + path, method=method, data=b"{}" if method == "POST" else None
        )
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    evict = "/api/v1/namespaces/a/pods/p/eviction"
    try:
        proxy.add(Fault("status", status=503))  # what no armed fault answers
        assert call("POST", evict) == 503  # asked before the armed fault was added
        proxy.clear()
        armed = proxy.add(
            Fault("status", status=500, method="POST", after="create pods/eviction", times=1)
        )
        proxy.add(Fault("status", status=503))
        assert armed.after_base == 1
        assert call("POST", "/api/v1/namespaces/a/pods") == 503  # not armed yet
        assert call("POST", evict) == 503  # the arming request is not its own fault's
        assert call("POST", "/api/v1/namespaces/a/pods") == 500  # the first after it
        assert call("POST", "/api/v1/namespaces/a/pods") == 503  # its one time spent
        assert proxy.hits == Counter({"status-503": 4, "status-500": 1})
    finally:
        proxy.stop()
