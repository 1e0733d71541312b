"""Structured logging with the record's coordinates.

kafkatx logs a record's failure, retry and recovery with
``extra={"topic", "partition", "offset", "attempt"}``. The formatters here
put those fields where a reader (or a log pipeline) can find them:

- :class:`TextFormatter` appends ``[listener topic/partition@offset attempt=N]``;
- :class:`JsonFormatter` writes one JSON object per line.

``configure(level="INFO", json=False)`` sets up the root logger with one of
them on stderr, e.g. at the top of a script, or through
``kafkatx run --log-format json``.
"""

from __future__ import annotations

import datetime as _dt
import json as _json
import logging
import sys
from typing import Any, TextIO

__all__ = ["TextFormatter", "JsonFormatter", "configure", "COORDINATES"]

#: The ``extra=`` keys kafkatx uses for a record's position, in output order.
COORDINATES = ("topic", "partition", "offset", "attempt")

_THREAD_PREFIX = "kafkatx-"  # container threads are named kafkatx-<listener>
#: kafkatx's other threads: the status line, and the bounded-call workers (kafkatx-call-<client>, client/bounded.py),
#: which are named after a client (a transactional.id, say), not a listener.
_NOT_LISTENERS = ("kafkatx-status", "kafkatx-call-")
_TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
# Attributes every LogRecord has: anything else came from ``extra=``.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


def _listener(record: logging.LogRecord) -> str | None:
    """``extra={"listener": ...}``, else the listener whose container thread logged it.

    The thread name also attributes your handler's own log lines to their
    listener, with no per-record work.
    """
    listener = getattr(record, "listener", None)
    if listener is not None:
        return str(listener)
    thread = record.threadName or ""
    if thread.startswith(_THREAD_PREFIX) and not thread.startswith(_NOT_LISTENERS):
        return thread[len(_THREAD_PREFIX) :]
    return None


def _coordinates(record: logging.LogRecord) -> str:
    """``listener topic/partition@offset attempt=N``, from whatever fields are present."""
    parts: list[str] = []
    listener = _listener(record)
    topic = getattr(record, "topic", None)
    partition = getattr(record, "partition", None)
    offset = getattr(record, "offset", None)
    attempt = getattr(record, "attempt", None)
    if topic is not None:
        where = str(topic)
        if partition is not None:
            where += f"/{partition}"
            if offset is not None:
                where += f"@{offset}"
        if listener is not None:
            parts.append(listener)
        parts.append(where)
    if attempt is not None:
        parts.append(f"attempt={attempt}")
    return " ".join(parts)


class TextFormatter(logging.Formatter):
    """The usual one-line format, plus ``[listener topic/partition@offset attempt=N]`` when known."""

    def __init__(self, fmt: str | None = None, datefmt: str | None = None, *, instance: str | None = None) -> None:
        if fmt is None and instance is not None:  # a worker of `kafkatx run --workers`: say which one wrote it
            fmt = _TEXT_FORMAT.replace(" %(levelname)", f" [{instance.replace('%', '%%')}] %(levelname)", 1)
        super().__init__(fmt or _TEXT_FORMAT, datefmt)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        text = super().formatMessage(record)
        coords = _coordinates(record)
        return f"{text} [{coords}]" if coords else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log pipelines.

    Keys: ``timestamp`` (UTC, ISO 8601), ``level``, ``logger``, ``message``,
    then ``listener``, ``topic``, ``partition``, ``offset`` and ``attempt``
    when known, ``exception`` (the formatted traceback) when there is one,
    and any other ``extra=`` fields. Values JSON cannot hold are written as
    ``str(value)``.
    """

    def __init__(self, *, instance: str | None = None) -> None:
        super().__init__()
        self.instance = instance

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "timestamp": _dt.datetime.fromtimestamp(record.created, _dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.instance is not None:
            out["instance"] = self.instance
        listener = _listener(record)
        if listener is not None:
            out["listener"] = listener
        for key in COORDINATES:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exception"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in out and key != "listener":
                out[key] = value
        return _json.dumps(out, default=str, ensure_ascii=False)


_MARK = "_kafkatx_configured"


def configure(
    level: int | str = "INFO",
    json: bool = False,
    *,
    stream: TextIO | None = None,
    instance: str | None = None,
) -> logging.Handler:
    """Log everything at ``level`` and above to ``stream`` (stderr) with kafkatx's formatter.

    Like ``logging.basicConfig(force=True)``, it replaces the root logger's
    handlers, so calling it twice (or after basicConfig) does not print every
    line twice. Python warnings (``warnings.warn``, e.g. confluent-kafka's
    when a failed producer is closed) go through it too, as WARNING lines of
    the ``py.warnings`` logger, so that nothing reaches stderr past the
    formatter (``--log-format json`` included). ``instance`` names the
    process in every line (``kafkatx run --workers`` gives each worker its
    instance id, so that the workers' lines, all on one stderr, say which
    worker wrote them). Returns the handler it installed.
    """
    if isinstance(level, str):
        resolved = logging.getLevelName(level.upper())
        if not isinstance(resolved, int):
            raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL")
        level = resolved
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter(instance=instance) if json else TextFormatter(instance=instance))
    setattr(handler, _MARK, True)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()  # a StreamHandler does not close stderr itself
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    return handler
