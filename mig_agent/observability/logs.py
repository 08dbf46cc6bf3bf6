"""Logging setup: structlog for our events, stdlib records from libraries routed the same way.

JSON lines when stderr is not a terminal (in a pod), readable console output at a terminal.
Keys bound with `bind_process` (the node) are on every line, from any thread or library.
Tracebacks never show frame locals, which could hold client configs or tokens.
The only structlog.configure() call in the codebase.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

# Like dict_tracebacks but without frame locals, which could carry client config or tokens.
_TRACEBACKS = structlog.processors.ExceptionRenderer(
    structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
)

LogFormat = Literal["auto", "json", "console"]

_process_context: dict[str, Any] = {}


def bind_process(**values: Any) -> None:
    """Put ``values`` (e.g. ``node=...``) on every line from now on, whatever the thread."""
    _process_context.update(values)


def _add_process_context(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    for key, value in _process_context.items():
        event_dict.setdefault(key, value)
    return event_dict


def configure_logging(
    fmt: LogFormat = "auto", *, level: int = logging.INFO, stream: object = None, cache: bool = True
) -> None:
    """Route structlog and stdlib logging to one handler on ``stream`` (stderr by default)."""
    out = stream if stream is not None else sys.stderr
    json_out = fmt == "json" or (fmt == "auto" and not getattr(out, "isatty", lambda: False)())
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        _add_process_context,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=cache,
    )
    tail: list[Processor] = (
        [_TRACEBACKS, structlog.processors.JSONRenderer()]
        if json_out
        # plain_traceback: without it, ConsoleRenderer uses rich (locals shown) when installed
        else [
            structlog.dev.ConsoleRenderer(
                colors=False, exception_formatter=structlog.dev.plain_traceback
            )
        ]
    )
    handler = logging.StreamHandler(out)  # type: ignore[arg-type]
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("urllib3", "kubernetes"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
