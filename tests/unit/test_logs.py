"""We test these aspects of the logging setup (`mig_agent.observability.logs.configure_logging`):

* JSON format: a structlog event, a stdlib record from a library (`kubernetes.client`) and an
  exception logged with `log.exception` are each one JSON line with the same fixed keys (event,
  level, logger, timestamp); the traceback is structured and carries no frame locals, so a secret
  held in a local variable never reaches the log;
* keys bound with `bind_process` (the node) are on every line: structlog, stdlib, other threads;
* console format: readable `key=value` lines, not JSON, and its tracebacks show no locals either;
* "auto" picks JSON for a stream that is not a terminal and the console for one that is;
* chatty libraries (urllib3, kubernetes) stay at WARNING even when the agent logs DEBUG, since the
  kubernetes client logs request headers (the bearer token) at DEBUG.
"""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from mig_agent.observability import logs

SECRET = "eyJhbGciOiJSUzI1NiJ9.c2VjcmV0LXRva2Vu.sig-4f1d"  # noqa: S105 (a fake token)


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {n: logging.getLogger(n).level for n in ("urllib3", "kubernetes")}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, lvl in levels.items():
        logging.getLogger(name).setLevel(lvl)
    logs._process_context.clear()
    structlog.contextvars.clear_contextvars()
    structlog.reset_defaults()


def configure(fmt: logs.LogFormat, stream: Any = None, level: int = logging.INFO) -> io.StringIO:
    out = stream if stream is not None else io.StringIO()
    logs.configure_logging(fmt, level=level, stream=out, cache=False)
    return out  # type: ignore[no-any-return]


def json_lines(out: io.StringIO) -> list[dict[str, Any]]:
    text = out.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def connect_with_token() -> None:
    token = SECRET  # a local a traceback with locals would print
    headers = {"authorization": f"Bearer {token}"}
    raise ConnectionError(f"API server refused the connection ({len(headers)} header)")


def test_json_lines_for_structlog_stdlib_and_exceptions_without_locals() -> None:
    out = configure("json")
    log = structlog.get_logger("mig_agent.agent")
    log.info("phase.finished", node="n1", layout="all-1g.10gb", phase="apply", duration_s=1.25)
    logging.getLogger("kubernetes.client").warning("Retrying (%d) after %s", 2, "a reset")
    try:
        connect_with_token()
    except ConnectionError:
        log.exception("reconcile.failed", node="n1", error="API server refused the connection")
    try:
        connect_with_token()
    except ConnectionError:
        logging.getLogger("urllib3.connectionpool").exception("connection failed")

    text = out.getvalue()
    assert SECRET not in text
    lines = json_lines(out)
    assert len(lines) == 4  # one line per record, tracebacks included
    ours, library, failed, library_failed = lines
    for line in lines:
        assert {"event", "level", "logger", "timestamp"} <= line.keys()
        assert line["timestamp"].endswith("Z")
    assert ours == {
        **ours,
        "event": "phase.finished",
        "level": "info",
        "node": "n1",
        "layout": "all-1g.10gb",
        "phase": "apply",
        "duration_s": 1.25,
        "logger": "mig_agent.agent",
    }
    assert library["event"] == "Retrying (2) after a reset"
    assert (library["level"], library["logger"]) == ("warning", "kubernetes.client")

    assert failed["event"] == "reconcile.failed" and failed["level"] == "error"
    assert failed["error"] == "API server refused the connection"
    (exc,) = failed["exception"]
    assert exc["exc_type"] == "ConnectionError"
    assert "refused the connection" in exc["exc_value"]
    assert [f["name"] for f in exc["frames"]][-1] == "connect_with_token"
    assert all("locals" not in f or not f["locals"] for f in exc["frames"])
    assert library_failed["exception"][0]["exc_type"] == "ConnectionError"
    assert "exc_info" not in failed and "exc_info" not in library_failed


def test_process_context_on_every_line_from_any_thread() -> None:
    out = configure("json")
    logs.bind_process(node="gpu-node-3")
    structlog.get_logger("mig_agent.agent").info("config.loaded", layouts=3)
    logging.getLogger("kubernetes.client.rest").warning("watch closed")
    t = threading.Thread(target=lambda: structlog.get_logger("x").warning("watch.failed"))
    t.start()
    t.join()
    structlog.contextvars.bind_contextvars(node="overridden-by-context", layout="all-7g.80gb")
    structlog.get_logger("mig_agent.agent").info("reconcile.started")

    lines = json_lines(out)
    assert [line["event"] for line in lines] == [
        "config.loaded",
        "watch closed",
        "watch.failed",
        "reconcile.started",
    ]
    assert [line["node"] for line in lines] == ["gpu-node-3"] * 3 + ["overridden-by-context"]
    assert lines[-1]["layout"] == "all-7g.80gb"


def test_console_format_is_readable_and_hides_locals() -> None:
    out = configure("console")
    log = structlog.get_logger("mig_agent.agent")
    log.info("phase.started", node="n1", phase="drain")
    logging.getLogger("kubernetes.client").warning("certificate expires soon")
    try:
        connect_with_token()
    except ConnectionError:
        log.exception("reconcile.failed", error="refused")

    text = out.getvalue()
    assert SECRET not in text
    first, second = text.splitlines()[:2]
    assert not first.startswith("{")
    assert "phase.started" in first and "node=n1" in first and "phase=drain" in first
    assert "[info" in first
    assert "certificate expires soon" in second and "[warning" in second
    assert "Traceback (most recent call last)" in text
    assert "ConnectionError: API server refused the connection" in text


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_picks_json_off_a_terminal_and_console_on_one() -> None:
    pipe = configure("auto")
    structlog.get_logger().info("agent.started", node="n1")
    assert json.loads(pipe.getvalue())["event"] == "agent.started"

    tty = configure("auto", Tty())
    structlog.get_logger().info("agent.started", node="n1")
    assert not tty.getvalue().startswith("{")
    assert "agent.started" in tty.getvalue() and "node=n1" in tty.getvalue()


def test_library_debug_logs_stay_hidden_when_the_agent_logs_debug() -> None:
    out = configure("json", level=logging.DEBUG)
    logging.getLogger("kubernetes.client.rest").debug("request headers: Bearer %s", SECRET)
    logging.getLogger("urllib3.connectionpool").debug("Starting new HTTPS connection")
    structlog.get_logger("mig_agent.agent").debug("plan.computed", steps=4)

    lines = json_lines(out)
    assert [line["event"] for line in lines] == ["plan.computed"]
    assert SECRET not in out.getvalue()
