"""structlog set-up shared by the services: JSON in containers, console locally.

Request ids are bound through contextvars (see common.interceptor), so every event logged
while serving an RPC carries the caller's request id.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, json: bool = False, level: str = "info") -> None:
    """Configure structlog once per process; `service` is bound to every event."""
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
