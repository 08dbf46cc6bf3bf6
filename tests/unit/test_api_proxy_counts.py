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
