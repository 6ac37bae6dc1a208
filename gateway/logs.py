"""Structured logs: one JSON object per line, carrying the current request's id, tenant and tier.

The request fields live in a contextvar, so every log line written while a
request is handled (in its task, or code it awaits) carries them without being
passed around. ``configure_logging`` is for the process entry point (the CLI);
tests attach ``JsonFormatter`` and ``RequestContextFilter`` to their own handler.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import IO, Any

# Fields of the request being handled: request_id, tenant, tier, trace_id ...
_request_fields: ContextVar[dict[str, Any] | None] = ContextVar("tiergate_request_fields", default=None)

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


@contextlib.contextmanager
def request_context(request_id: str, **fields: Any) -> Iterator[None]:
    """Log lines inside this block carry ``request_id`` and ``fields`` (tenant=..., tier=...)."""
    token = _request_fields.set({"request_id": request_id, **fields})
    try:
        yield
    finally:
        _request_fields.reset(token)


def bind(**fields: Any) -> None:
    """Add fields to the current request context (e.g. the tier, once the key is resolved)."""
    current = _request_fields.get()
    if current is None:
        raise RuntimeError("bind() outside request_context()")
    _request_fields.set({**current, **fields})


def current_request_id() -> str | None:
    fields = _request_fields.get()
    return None if fields is None else fields.get("request_id")


class RequestContextFilter(logging.Filter):
    """Copies the current request's fields onto each record (on the handler, so every logger gets them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in (_request_fields.get() or {}).items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """ts, level, logger, msg, then request fields and any `extra=` fields, then the exception if any."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def json_handler(stream: IO[str] | None = None) -> logging.Handler:
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestContextFilter())
    return handler


def configure_logging(level: str = "INFO", stream: IO[str] | None = None) -> None:
    """Route every logger of the process (ours, uvicorn's, the engine's) to one JSON handler.

    Run uvicorn with ``log_config=None`` afterwards, or it installs its own handlers again.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(json_handler(stream))
    root.setLevel(level.upper())
    # uvicorn installs its own plain-text handlers; send its records to the root instead.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
