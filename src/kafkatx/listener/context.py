"""``send()``: produce from inside a handler, joining its transaction.

The worker thread points a thread-local at the current record's output
buffer; ``send`` appends to it. Outside a handler or ``app.transaction()``
there is no buffer, and ``send`` says so.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from kafkatx.listener.outputs import PendingOutput, encode, encode_headers

__all__ = ["send", "OutputSink", "current_sink", "bind_sink"]


class OutputSink(Protocol):
    """Where ``send()`` puts records: a record's buffer or a producer transaction."""

    serializer: Any

    def add(self, output: PendingOutput) -> None: ...


class _State(threading.local):
    sink: OutputSink | None = None


_state = _State()


def current_sink() -> OutputSink | None:
    return _state.sink


def bind_sink(sink: OutputSink | None) -> OutputSink | None:
    """Make ``sink`` the target of ``send()`` on this thread; return the previous one."""
    previous = _state.sink
    _state.sink = sink
    return previous


class NotInTransactionError(RuntimeError):
    """``send()`` was called outside a handler and outside ``app.transaction()``."""


def send(
    topic: str,
    value: Any,
    key: Any = None,
    headers: Any = None,
    partition: int | None = None,
) -> None:
    """Produce a record in the current transaction.

    Call it from a listener handler (the record joins the handler's Kafka
    transaction and is discarded if the handler fails) or inside
    ``with app.transaction():``.
    """
    sink = _state.sink
    if sink is None:
        raise NotInTransactionError(
            "kafkatx.send() was called outside a transaction: call it from a listener handler, "
            "or inside `with app.transaction() as tx:` (or use tx.send())"
        )
    if not isinstance(topic, str) or not topic:
        raise ValueError(f"send() needs a topic name, got {topic!r}")
    serializer = sink.serializer
    sink.add(
        PendingOutput(topic, encode(value, "value", serializer), encode(key, "key", serializer), encode_headers(headers), partition)
    )
