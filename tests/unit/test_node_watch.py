"""We test the tests' node watch (tests/node_watch.py), the real kubernetes client's Watch over a
scripted API server: every version of the node after the first read comes out, in order, across
watches the server ends; a dropped connection watches again from the last version seen, a 410 Gone
reads the node again, another error is raised; and the versions end when the time is up."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from kubernetes import client

from tests.node_watch import node_versions

STATE = "nvidia.com/mig.config.state"


def _node(version: int, state: str) -> dict[str, Any]:
    return {"metadata": {"name": "n", "resourceVersion": str(version), "labels": {STATE: state}}}


def _event(version: int, state: str, kind: str = "MODIFIED") -> dict[str, Any]:
    return {"type": kind, "object": _node(version, state)}


def _error(code: int) -> dict[str, Any]:
    return {"type": "ERROR", "object": {"code": code, "reason": "Expired", "message": "too old"}}


class _Response:
    """A watch's HTTP answer: its events as JSON lines, then the end (or ``broken``)."""

    def __init__(self, events: list[dict[str, Any]], broken: Exception | None) -> None:
        self.events, self.broken = events, broken

    def stream(self, amt: Any = None, decode_content: bool = False) -> Iterator[bytes]:
        for e in self.events:
            yield json.dumps(e).encode() + b"\n"
        if self.broken is not None:
            raise self.broken

    def close(self) -> None: ...

    def release_conn(self) -> None: ...


class _Server:
    """list_node as the API server answers it, from a script: a read is (resourceVersion,
    state); a watch a list of events, maybe ending in an exception."""

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def list_node(self, **kw: Any) -> Any:
        """:rtype: V1NodeList"""
        self.calls.append(("watch" if kw.get("watch") else "list", kw))
        answer = self.script.pop(0) if self.script else []
        if isinstance(answer, Exception):
            raise answer
        if kw.get("watch"):
            broken = answer[-1] if answer and isinstance(answer[-1], Exception) else None
            return _Response([e for e in answer if isinstance(e, dict)], broken)
        version, state = answer
        meta = client.V1ObjectMeta(name="n", resource_version=str(version), labels={STATE: state})
        return client.V1NodeList(
            metadata=client.V1ListMeta(resource_version=str(version)),
            items=[client.V1Node(metadata=meta)],
        )

    def watched_from(self) -> list[str]:
        return [kw["resource_version"] for what, kw in self.calls if what == "watch"]


def _states(server: _Server, until: str, timeout: float = 10.0) -> list[str]:
    out = []
    for n in node_versions(server, "n", timeout):  # type: ignore[arg-type]
        out.append(n.metadata.labels[STATE])
        if out[-1] == until:
            break
    return out


def test_every_version_after_the_read_comes_out_in_order_across_watches_that_end() -> None:
    server = _Server(
        (10, "success"),
        [_event(11, "pending"), _event(12, "rebooting")],
        [_event(13, "failed")],
    )
    assert _states(server, "failed") == ["success", "pending", "rebooting", "failed"]
    assert server.watched_from() == ["10", "12"]  # each watch from the last version seen
    for what, kw in server.calls:
        assert kw["field_selector"] == "metadata.name=n", kw
        if what == "watch":
            assert kw["timeout_seconds"] >= 1 and kw["_request_timeout"] > kw["timeout_seconds"]


def test_a_dropped_connection_watches_again_from_the_last_version_seen() -> None:
    dropped = urllib3.exceptions.ProtocolError("Connection broken")
    server = _Server((10, "success"), [_event(11, "pending"), dropped], [_event(12, "failed")])
    assert _states(server, "failed") == ["success", "pending", "failed"]
    assert [what for what, _ in server.calls] == ["list", "watch", "watch"]
    assert server.watched_from() == ["10", "11"]


@pytest.mark.parametrize("how", ["event", "status"])
def test_a_410_gone_reads_the_node_again_and_watches_from_there(how: str) -> None:
    gone = [_error(410)] if how == "event" else client.ApiException(status=410)
    server = _Server((10, "success"), gone, (20, "pending"), [_event(21, "failed")])
    assert _states(server, "failed") == ["success", "pending", "failed"]
    assert [what for what, _ in server.calls] == ["list", "watch", "list", "watch"]
    assert server.watched_from() == ["10", "20"]


def test_another_error_is_raised() -> None:
    server = _Server((10, "success"), [_error(500)])
    with pytest.raises(client.ApiException) as got:
        _states(server, "failed")
    assert got.value.status == 500


def test_the_versions_end_when_the_time_is_up() -> None:
    server = _Server((10, "success"))  # then watches that end with nothing to tell
    started = time.monotonic()
    assert _states(server, "failed", timeout=0.3) == ["success"]
    assert 0.3 <= time.monotonic() - started < 2
    assert set(server.watched_from()) == {"10"}
