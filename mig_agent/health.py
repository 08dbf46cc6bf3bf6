"""HTTP endpoints of the agent: /metrics (Prometheus), /healthz (alive), /readyz (ready).

/healthz answers 200 while the reconcile loop and the node watch are alive; /readyz answers 200
when the profile configs are loaded and NVML answers. Both say why when they answer 503.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

Check = Callable[[], str]  # "" when fine, else the problem


class HealthServer:
    def __init__(
        self, address: str, port: int, registry: CollectorRegistry, *, healthz: Check, readyz: Check
    ) -> None:
        checks = {"/healthz": healthz, "/readyz": readyz}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?")[0]
                if path == "/metrics":
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path in checks:
                    problem = checks[path]()
                    self._send(
                        503 if problem else 200,
                        (problem or "ok").encode() + b"\n",
                        "text/plain; charset=utf-8",
                    )
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass  # probes every few seconds would flood the log

        self._server = ThreadingHTTPServer((address, port), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, daemon=True, name="health"
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
