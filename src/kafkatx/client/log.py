"""librdkafka's own log lines, through Python logging, at levels that mean something to a kafkatx user.

Without this, librdkafka writes raw ``%3|1795...|FAIL|...`` lines to stderr,
past any logging configuration (``--log-format json`` included): a broker
that is down produces hundreds of them. kafkatx gives every client it
creates a ``logger`` that sends them to the ``kafkatx.librdkafka`` logger
instead. Lines about conditions kafkatx handles and reports itself
(connection failures it retries, transaction errors it reacts to) go to
DEBUG; other warnings and errors stay warnings, since kafkatx's own message
says what it did about them.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["ClientLog", "client_log"]

# librdkafka facilities that describe something kafkatx retries, reacts to, or reports in its own words.
_HANDLED = frozenset({"FAIL", "REQTMOUT", "TXNERR", "PURGE", "TERMINATE", "ERROR", "FETCH", "BROKERFAIL"})


class ClientLog:
    """A ``logger`` for confluent-kafka clients (it calls ``log(level, fmt, facility, client, message)``)."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger("kafkatx.librdkafka")

    def log(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        facility = str(args[0]) if args else ""
        if facility in _HANDLED:
            level = logging.DEBUG
        elif level >= logging.WARNING:
            level = logging.WARNING
        else:
            level = logging.DEBUG
        if self.logger.isEnabledFor(level):
            self.logger.log(level, msg, *args)


_shared = ClientLog()


def client_log() -> ClientLog:
    return _shared
