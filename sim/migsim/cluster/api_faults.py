"""A fault-injecting HTTPS proxy between one client (an agent) and the local cluster's API server.

The client's kubeconfig names the proxy instead of the API server; the proxy presents the
cluster's own serving certificate (so the client's CA check passes), forwards each request to the
API server over a connection of its own, and, on command, answers instead of it:

* ``status``: an HTTP error (500, 503, ...) with a Kubernetes Status body;
* ``throttle``: 429 Too Many Requests with ``Retry-After: N``;
* ``hang``: no answer at all, the connection held open (the client's timeout must end it);
* ``reset``: the connection reset (TCP RST) without an answer;
* ``conflict``: 409 Conflict on a node PATCH, as when the node changed since it was read;
* ``watch-end``: every open watch ends now (a clean end of its chunked stream), as the API
  server ends a watch at its timeout or when it restarts;
* ``watch-silent``: the watches open now get no more events, nor their end, while their
  connections stay open: dead connections that nobody closed (later watches work).
* ``watch-expired``: a watch answered as the API server answers one from a resource version it
  no longer holds: 200, then one ``ERROR`` event (a Status, 410 Expired) and the stream's end.

A fault matches requests by method, path (a regular expression) and whether they are watches; it
applies ``times`` times (None: until cleared) and/or for ``seconds``; one with ``after`` (a
request kind) only once the client has asked such a request since the fault was added, so that
a fault lands right after a request of the client's (its first eviction, say) however soon the
client asks the next. `hits` counts the requests
each fault answered; `requests` counts every request, and `counts` every request by verb and
resource as the API server's audit names them (`request_kind`: "get nodes", "watch nodes",
"patch nodes", "create pods/eviction", ...), answered by a fault or forwarded: put the proxy
between a client and the API server with no fault to count what the client asks. One request
per upstream connection (``Connection: close``), so a response is relayed as the bytes come, a
watch chunk by chunk.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

KINDS = (
    "status",
    "throttle",
    "hang",
    "reset",
    "conflict",
    "watch-end",
    "watch-silent",
    "watch-expired",
)
_REASONS = {
    409: "Conflict",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


@dataclass(slots=True)
class Fault:
    kind: str
    status: int = 503
    retry_after: int = 1
    method: str = ""  # "" matches every method
    path: str = ""  # a regular expression searched in the request's path ("" matches all)
    watch: bool | None = None  # True: watches only; False: no watches; None: both
    times: int | None = None  # None: until cleared (or `seconds` pass)
    until: float | None = None  # time.monotonic() deadline
    after: str = ""  # a request_kind(): armed once one is asked after the adding ("" at once)
    after_base: int = 0  # counts[after] when the fault was added (set by ApiFaultProxy.add)

    def matches(self, method: str, path: str, is_watch: bool) -> bool:
        if self.until is not None and time.monotonic() > self.until:
            return False
        if self.times is not None and self.times <= 0:
            return False
        if self.method and self.method != method:
            return False
        if self.watch is not None and self.watch != is_watch:
            return False
        return not self.path or re.search(self.path, path) is not None


class _Closed(Exception):
    pass


class ApiFaultProxy:
    """Listens on 127.0.0.1 (a free port) and forwards to `upstream` (https://host:port)."""

    def __init__(self, upstream: str, *, cert: Path, key: Path, ca: Path) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 443)
        self._server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._server_ctx.load_cert_chain(str(cert), str(key))
        self._client_ctx = ssl.create_default_context(cafile=str(ca))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"https://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._stop = threading.Event()
        self._watches: list[_Watch] = []
        self._sockets: set[socket.socket] = set()
        self.hits: Counter[str] = Counter()
        self.requests = 0
        self.counts: Counter[str] = Counter()  # request_kind() -> requests
        self._thread = threading.Thread(
            target=self._accept, daemon=True, name=f"api-fault-proxy:{self.port}"
        )
        self._thread.start()

    # ---- commands ----------------------------------------------------------------------------

    def add(self, fault: Fault, *, seconds: float | None = None) -> Fault:
        if fault.kind not in KINDS:
            raise ValueError(f"unknown fault {fault.kind!r}; one of {', '.join(KINDS)}")
        if seconds is not None:
            fault.until = time.monotonic() + seconds
        with self._lock:
            if fault.kind == "watch-end":
                for w in self._watches:
                    w.end()
                self.hits["watch-end"] += len(self._watches)
                return fault
            if fault.kind == "watch-silent":
                for w in self._watches:
                    w.silent = True
                self.hits["watch-silent"] += len(self._watches)
                return fault
            fault.after_base = self.counts[fault.after] if fault.after else 0
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    def snapshot(self) -> Counter[str]:
        """A copy of `counts` (taken under the lock): subtract two to count a stretch of time."""
        with self._lock:
            return Counter(self.counts)

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() under way
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for s in list(self._sockets):
                with contextlib.suppress(OSError):
                    s.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> ApiFaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- serving -----------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                raw, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._sockets.add(s)

    def _untrack(self, s: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(s)
        with contextlib.suppress(OSError):
            s.close()

    def _serve(self, raw: socket.socket) -> None:
        self._track(raw)
        conn: socket.socket = raw
        try:
            conn = self._server_ctx.wrap_socket(raw, server_side=True)
            self._track(conn)
            while not self._stop.is_set():
                head, body = _read_request(conn)
                if not head:
                    return
                if not self._handle(conn, raw, head, body):
                    return
        except (OSError, _Closed, ssl.SSLError, ValueError):
            return
        finally:
            self._untrack(conn)
            self._untrack(raw)

    def _match(self, method: str, path: str, is_watch: bool) -> Fault | None:
        kind = request_kind(method, path, is_watch)
        with self._lock:
            self.requests += 1
            try:
                for f in self._faults:
                    armed = not f.after or self.counts[f.after] > f.after_base
                    if armed and f.matches(method, path, is_watch):
                        if f.times is not None:
                            f.times -= 1
                        self.hits[f.kind if f.kind != "status" else f"status-{f.status}"] += 1
                        return f
            finally:  # counted after the look: the arming request is not its own fault's
                self.counts[kind] += 1
        return None

    def _handle(self, conn: socket.socket, raw: socket.socket, head: bytes, body: bytes) -> bool:
        """Answer one request; False when the connection is done."""
        request_line, _, rest = head.partition(b"\r\n")
        method, target, _version = request_line.decode("latin-1").split(" ", 2)
        path = target.split("?", 1)[0]
        query = target.partition("?")[2]
        is_watch = bool(re.search(r"(^|&)watch=(true|1)(&|$)", query, re.IGNORECASE))
        fault = self._match(method, path, is_watch)
        if fault is not None:
            if fault.kind == "hang":
                self._stop.wait()
                return False
            if fault.kind == "reset":
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return False
            if fault.kind == "throttle":
                _answer(
                    conn,
                    429,
                    "Too many requests, please try again later.",
                    {"Retry-After": str(fault.retry_after)},
                )
                return True
            if fault.kind == "conflict":
                _answer(
                    conn,
                    409,
                    "Operation cannot be fulfilled on nodes: the object has "
                    "been modified; please apply your changes to the latest "
                    "version and try again",
                )
                return True
            if fault.kind == "watch-expired":
                _answer_expired_watch(conn)
                return False
            _answer(conn, fault.status, f"injected {fault.status}")
            return True
        self._forward(conn, method, target, rest, body, is_watch)
        return False

    def _forward(
        self,
        conn: socket.socket,
        method: str,
        target: str,
        headers: bytes,
        body: bytes,
        is_watch: bool,
    ) -> None:
        lines = [
            h
            for h in headers.split(b"\r\n")
            if h and not h.lower().startswith((b"connection:", b"keep-alive:"))
        ]
        request = (
            f"{method} {target} HTTP/1.1\r\n".encode()
            + b"\r\n".join(lines)
            + b"\r\nConnection: close\r\n\r\n"
            + body
        )
        up_raw = socket.create_connection(self._upstream, timeout=30)
        self._track(up_raw)
        up = up_raw
        try:
            up = self._client_ctx.wrap_socket(up_raw, server_hostname=self._upstream[0])
            self._track(up)
            up.settimeout(None)
            up.sendall(request)
            if not is_watch:
                while chunk := up.recv(65536):
                    conn.sendall(chunk)
                return
            self._relay_watch(conn, up)
        finally:
            self._untrack(up)
            self._untrack(up_raw)

    def _relay_watch(self, conn: socket.socket, up: socket.socket) -> None:
        reader = up.makefile("rb")
        status_and_headers = b""
        while True:
            line = reader.readline()
            if not line:
                return
            status_and_headers += line
            if line in (b"\r\n", b"\n"):
                break
        conn.sendall(status_and_headers)
        if b"transfer-encoding: chunked" not in status_and_headers.lower():
            while chunk := reader.read1(65536):
                conn.sendall(chunk)
            return
        watch = _Watch(conn, up)
        with self._lock:
            self._watches.append(watch)
        try:
            while True:
                size_line = reader.readline()
                if not size_line:
                    if watch.silent:  # a dead connection: nothing more, and no end either
                        _hold(conn)
                    return
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                data = reader.read(size + 2) if size else reader.readline()
                with watch.lock:
                    if watch.done:
                        return
                    if watch.silent:
                        continue  # the event is lost; the connection stays open
                    conn.sendall(size_line + data)
                if size == 0:
                    return
        except (OSError, ValueError):
            return
        finally:
            with self._lock:
                self._watches.remove(watch)


def request_kind(method: str, path: str, is_watch: bool) -> str:
    """ "VERB RESOURCE" of a request as the API server's audit log names it: verbs get, list,
    watch, create, update, patch, delete, deletecollection; the resource with its subresource
    ("nodes/status", "pods/eviction"). A path that is no resource: "METHOD PATH"."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 2:
        rest = parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        rest = parts[3:]
    else:
        return f"{method} {path}"
    if rest[:1] == ["watch"]:  # the old /api/v1/watch/... paths
        rest, is_watch = rest[1:], True
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        rest = rest[2:]  # a namespaced resource
    if not rest:
        return f"{method} {path}"
    named = len(rest) >= 2
    resource = rest[0] + (f"/{rest[2]}" if len(rest) >= 3 else "")
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method)
    if verb is None and method == "GET":
        verb = "watch" if is_watch else "get" if named else "list"
    elif verb is None and method == "DELETE":
        verb = "delete" if named else "deletecollection"
    return f"{verb or method} {resource}"


class _Watch:
    """An open watch: `end` finishes its chunked stream cleanly and stops the relay."""

    def __init__(self, conn: socket.socket, up: socket.socket) -> None:
        self.conn, self.up = conn, up
        self.lock = threading.Lock()
        self.done = False
        self.silent = False  # the connection went dead: events and the end are dropped

    def end(self) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
            with contextlib.suppress(OSError):
                self.conn.sendall(b"0\r\n\r\n")
        with contextlib.suppress(OSError):
            self.up.shutdown(socket.SHUT_RDWR)


def _hold(conn: socket.socket) -> None:
    """Keep a connection open, answering nothing, until the client closes it."""
    with contextlib.suppress(OSError, ssl.SSLError):
        while conn.recv(4096):
            pass


def _read_request(conn: socket.socket) -> tuple[bytes, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            if buf:
                raise _Closed()
            return b"", b""
        buf += chunk
        if len(buf) > 1 << 20:
            raise ValueError("request head too long")
    head, _, body = buf.partition(b"\r\n\r\n")
    m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    length = int(m.group(1)) if m else 0
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            raise _Closed()
        body += chunk
    return head, body[:length]


def _answer_expired_watch(conn: socket.socket) -> None:
    """A watch's stream as the API server sends it for an expired resource version."""
    event = json.dumps(
        {
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": "too old resource version: 1 (2322)",
                "reason": "Expired",
                "code": 410,
            },
        }
    ).encode()
    line = event + b"\n"
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        + f"{len(line):x}\r\n".encode()
        + line
        + b"\r\n0\r\n\r\n"
    )


def _answer(
    conn: socket.socket, status: int, message: str, headers: dict[str, str] | None = None
) -> None:
    reason = _REASONS.get(status, "Error")
    body = json.dumps(
        {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": reason.replace(" ", ""),
            "code": status,
        }
    ).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    conn.sendall(
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n".encode()
        + body
    )
