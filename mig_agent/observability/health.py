"""HTTP endpoints of the agent: /metrics (Prometheus), /healthz (alive), /readyz (ready).

/metrics answers in the format the scraper asks for in its Accept header (OpenMetrics or the
Prometheus text format, the latter by default).

/healthz answers 200 while the reconcile loop and the node watch are alive; /readyz answers 200
when the profile configs are loaded and NVML answers. Both say why when they answer 503; a check
that raises answers 503 with the exception rather than dropping the connection.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

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
                    # the format Prometheus asks for (OpenMetrics or text), as its own handler does
                    encoder, ctype = choose_encoder(self.headers.get("Accept", ""))
                    self._send(200, encoder(registry), ctype)
                elif path in checks:
                    try:
                        problem = checks[path]()
                    except Exception as exc:  # noqa: BLE001 (a probe answers, never hangs up)
                        problem = f"check failed: {type(exc).__name__}: {exc}"
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
