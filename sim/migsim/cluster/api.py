"""A minimal JSON client for the local API server: bearer token, TLS checked against the cluster CA.

Only what the dev cluster itself needs (health probes, creating nodes, TokenRequest, reading nodes).
It exists because nothing under `mig_agent/` but `mig_agent.kube.client` may import the `kubernetes`
package, and spawning `kubectl` for every readiness poll would cost ~100 ms of CPU each time.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class ApiError(RuntimeError):
    """The API server answered with an HTTP error status."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        try:
            message = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            message = body
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status


class Api:
    """JSON requests against `server` (https://127.0.0.1:PORT) with `token`."""

    def __init__(self, server: str, ca_cert: Path, token: str) -> None:
        self.server = server
        self._token = token
        self._tls = ssl.create_default_context(cafile=str(ca_cert))

    def request(
        self,
        method: str,
        path: str,
        body: object = None,
        *,
        content_type: str = "application/json",
        timeout: float = 10.0,
    ) -> Any:
        """Send `body` as JSON; return the decoded JSON answer. Raises ApiError on HTTP errors."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self._token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=self._tls, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise ApiError(method, path, e.code, e.read().decode(errors="replace")) from None
        return json.loads(raw) if raw else None

    def get(self, path: str, *, timeout: float = 10.0) -> Any:
        return self.request("GET", path, timeout=timeout)

    def watch(self, path: str, *, timeout: float) -> Iterator[dict[str, Any]]:
        """The events of a watch of the list `path` (``{"type": ..., "object": ...}``), each as
        the API server sends it, until it ends the watch after `timeout` seconds."""
        sep = "&" if "?" in path else "?"
        url = f"{self.server}{path}{sep}watch=1&timeoutSeconds={max(1, int(timeout))}"
        req = urllib.request.Request(url)
        req.add_header("Authorization", f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(req, context=self._tls, timeout=timeout + 10) as resp:
                for line in resp:
                    if line.strip():
                        yield dict(json.loads(line))
        except urllib.error.HTTPError as e:
            raise ApiError("GET", path, e.code, e.read().decode(errors="replace")) from None

    def ok(self, path: str, *, timeout: float = 2.0) -> bool:
        """Whether GET `path` (a health endpoint) answers 200; any failure is just "not yet"."""
        req = urllib.request.Request(self.server + path)
        req.add_header("Authorization", f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(req, context=self._tls, timeout=timeout) as resp:
                return bool(resp.status == 200)
        except (OSError, ssl.SSLError):  # URLError, HTTPError and timeouts are OSErrors
            return False


def probe(url: str, ca_cert: Path | None, *, timeout: float = 2.0) -> bool:
    """Whether an unauthenticated GET of a health URL answers 200 (TLS checked with `ca_cert`)."""
    tls = ssl.create_default_context(cafile=str(ca_cert)) if ca_cert is not None else None
    try:
        with urllib.request.urlopen(url, context=tls, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except (OSError, ssl.SSLError):
        return False
