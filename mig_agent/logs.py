"""Logging setup: structlog for our events, stdlib records from libraries routed the same way.

JSON lines when stderr is not a terminal (in a pod), readable console output at a terminal.
The only structlog.configure() call in the codebase.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog
from structlog.typing import Processor

# Like dict_tracebacks but without frame locals, which could carry client config or tokens.
_TRACEBACKS = structlog.processors.ExceptionRenderer(
    structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
)

LogFormat = Literal["auto", "json", "console"]


def configure_logging(
    fmt: LogFormat = "auto", *, level: int = logging.INFO, stream: object = None, cache: bool = True
) -> None:
    """Route structlog and stdlib logging to one handler on ``stream`` (stderr by default)."""
    out = stream if stream is not None else sys.stderr
    json_out = fmt == "json" or (fmt == "auto" and not getattr(out, "isatty", lambda: False)())
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
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
        else [structlog.dev.ConsoleRenderer(colors=False)]
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
