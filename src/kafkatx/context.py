"""What code running inside a kafkatx transaction can reach: ``send()`` and the recovery context.

The worker thread points a context variable at the current record's output
sink, and a thread-local at its :class:`RecoveryContext` while a recoverer
runs. ``send`` adds
to the sink; outside a handler or ``app.transaction()`` there is none, and
``send`` says so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from kafkatx.errors import NotInTransactionError
from kafkatx.outputs import PendingOutput, encode, encode_headers
from kafkatx.serde import RegistrySerializer

__all__ = [
    "OutputSink",
    "RecoveryContext",
    "bind_recovery",
    "bind_sink",
    "current_recovery",
    "send",
]


class OutputSink(Protocol):
    """Where ``send()`` puts records: a record's buffer or a producer transaction."""

    serializer: Any

    def add(self, output: PendingOutput) -> None: ...


@dataclass(slots=True)
class RecoveryContext:
    """Set by the container around a recoverer call.

    - ``partition_count(topic)`` answers from cluster metadata (None if the
      topic does not exist);
    - ``deliver(output)`` produces one record in the recovery's transaction
      and returns its own delivery error (None when it was delivered, or when
      the enclosing batch's commit will confirm it), so a recoverer is never
      blamed for another record's failure;
    - ``flush()`` waits for every record sent in the transaction so far and
      returns their delivery errors;
    - ``is_retryable(exc)`` is the listener's classifier (a recoverer may
      treat not-retryable failures differently, e.g. never route them back to
      their own topic).
    """

    listener: str
    group_id: str
    partition_count: Callable[[str], int | None]
    deliver: Callable[[PendingOutput], str | None]
    flush: Callable[[], list[str]]
    is_retryable: Callable[[BaseException], bool]


class _State(threading.local):
    recovery: RecoveryContext | None = None


_state = _State()
# A context variable rather than a thread-local: send() reads it once per call, and ContextVar.get is
# a few times cheaper. Each thread starts with its own context, so it is per thread all the same.
_sink: ContextVar[OutputSink | None] = ContextVar("kafkatx_sink", default=None)
_current_sink = _sink.get


def bind_sink(sink: OutputSink | None) -> OutputSink | None:
    """Make ``sink`` the target of ``send()`` on this thread; return the previous one."""
    previous = _current_sink()
    _sink.set(sink)
    return previous


def current_recovery() -> RecoveryContext | None:
    """The context of the recoverer running on this thread, or None."""
    return _state.recovery


def bind_recovery(ctx: RecoveryContext | None) -> RecoveryContext | None:
    """Make ``ctx`` the current recovery context on this thread; return the previous one."""
    previous, _state.recovery = _state.recovery, ctx
    return previous


def send(
    topic: str,
    value: Any,
    key: Any = None,
    headers: Any = None,
    partition: int | None = None,
) -> None:
    """Produce a record in the current transaction.

    Call it from a listener handler (the record joins the handler's Kafka
    transaction and is discarded if the handler fails), from a recoverer, or
    inside ``with app.transaction():``. ``value`` and ``key`` are bytes, str,
    or anything the listener's serializer accepts; ``headers`` a mapping or
    ``(name, value)`` pairs.
    """
    sink = _current_sink()
    if sink is None:
        raise NotInTransactionError(
            "kafkatx.send() was called outside a transaction: call it from a listener handler, "
            "or inside `with app.transaction() as tx:` (or use tx.send())"
        )
    if type(topic) is not str or not topic:
        if not isinstance(topic, str) or not topic:
            raise ValueError(f"send() needs a topic name, got {topic!r}")
    if (
        headers is None
        and partition is None
        and (type(value) is bytes or value is None)
        and (type(key) is bytes or key is None)
    ):
        sink.add((topic, value, key, None, None))
        return
    serializer = key_serializer = sink.serializer
    registry = serializer
    if isinstance(registry, RegistrySerializer):  # its subject names come from the topic sent to, and the part
        serializer, key_serializer = registry.to(topic, "value"), registry.to(topic, "key")
    sink.add(
        (
            topic,
            encode(value, "value", serializer),
            encode(key, "key", key_serializer),
            encode_headers(headers),
            partition,
        )
    )
