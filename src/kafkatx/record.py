"""The values handlers receive (:class:`Record`) and may return (:class:`Output`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from sys import getrefcount
from typing import Any, Protocol

__all__ = ["Record", "Output", "Headers", "ConsumedMessage"]

Headers = list[tuple[str, bytes]]


class ConsumedMessage(Protocol):
    """A ``confluent_kafka.Message`` the consumer returned without an error.

    confluent-kafka's stubs type ``topic()``, ``partition()`` and
    ``offset()`` as optional because error events are Messages too; a
    consumed record always has all three. kafkatx narrows to this type once,
    where it drops the error events, instead of at every use.
    """

    def topic(self) -> str: ...
    def partition(self) -> int: ...
    def offset(self) -> int: ...
    def key(self) -> bytes | None: ...
    def value(self) -> bytes | None: ...
    def headers(self) -> list[tuple[str, bytes]] | None: ...
    def timestamp(self) -> tuple[int, int]: ...
    def error(self) -> Any: ...


@dataclass(slots=True)
class Record:
    """One consumed Kafka record, as a handler sees it.

    ``attempt`` is 1 on first delivery and counts redeliveries after handler
    failures (see the after-rollback processor). ``timestamp`` is milliseconds
    since the epoch, and ``timestamp_type`` is ``"CreateTime"``,
    ``"LogAppendTime"`` or ``"NoTimestampType"``.

    ``raw_key`` and ``raw_value`` are the bytes as consumed. On a typed
    listener (``value_type=``, ``deserializer=``...) ``key`` and ``value``
    are the decoded objects and these keep the bytes (dead letters carry
    them, byte for byte); otherwise they are the same bytes as ``key`` and
    ``value``. A Record built by hand takes them from its bytes ``key`` and
    ``value`` unless given.
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers = field(default_factory=list)
    timestamp: int = -1
    timestamp_type: str = "CreateTime"
    attempt: int = 1
    raw_key: bytes | None = field(default=None, repr=False, compare=False)
    raw_value: bytes | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.raw_key is None and type(self.key) is bytes:
            self.raw_key = self.key
        if self.raw_value is None and type(self.value) is bytes:
            self.raw_value = self.value

    def header(self, name: str, default: bytes | None = None) -> bytes | None:
        """The last value of header ``name``, or ``default``."""
        for key, value in reversed(self.headers):
            if key == name:
                return value
        return default

    @property
    def coordinates(self) -> str:
        """``topic/partition@offset``, for logs and error messages."""
        return f"{self.topic}/{self.partition}@{self.offset}"


_TS_TYPES = ("NoTimestampType", "CreateTime", "LogAppendTime")


class MessageRecord(Record):
    """A :class:`Record` that reads headers and timestamp from the Message on demand.

    The container builds one per consumed record, so its construction is on
    the hot path: a few attribute stores instead of a nine-field ``__init__``
    and Message getters for fields most handlers never read. Key and value
    are stored when the record is built (almost every handler reads them,
    and a slot reads several times faster than a property); like a plain
    ``Record``'s fields they can be reassigned. Headers and timestamp are
    read-only views of the Message, and so are ``raw_key`` and ``raw_value``
    (what a typed listener decodes from). It compares, prints, pickles and
    ``dataclasses.replace()`` calls as a plain ``Record``. The record runner
    refills one for the next message when nothing but the runner holds it
    (see ``UNSHARED_REFCOUNT``): a record a handler keeps is never changed.
    """

    __slots__ = ("message",)
    #: The consumed Message the record reads from (the record runner refills it); handlers read the fields.
    message: ConsumedMessage

    def __new__(cls, *args: Any, **kwargs: Any) -> Record:  # type: ignore[misc]
        # dataclasses.replace() and copy() call the class with every field: give them a plain Record.
        return Record(*args, **kwargs)

    @property
    def headers(self) -> Headers:  # type: ignore[override]  # read-only view of the field
        return self.message.headers() or []

    @property
    def timestamp(self) -> int:  # type: ignore[override]  # read-only view of the field
        return self.message.timestamp()[1]

    @property
    def raw_key(self) -> bytes | None:  # type: ignore[override]  # read-only view of the field
        return self.message.key()

    @property
    def raw_value(self) -> bytes | None:  # type: ignore[override]  # read-only view of the field
        return self.message.value()

    @property
    def timestamp_type(self) -> str:  # type: ignore[override]  # read-only view of the field
        ts_type = self.message.timestamp()[0]
        return _TS_TYPES[ts_type] if 0 <= ts_type < 3 else "CreateTime"

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in fields(Record))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Record):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in _COMPARED)

    __hash__ = None  # type: ignore[assignment]  # as Record's: mutable dataclass, not hashable

    def __repr__(self) -> str:
        return repr(Record(*self._fields()))

    def __reduce__(self) -> tuple[type[Record], tuple[Any, ...]]:
        return Record, self._fields()

    def __copy__(self) -> Record:
        return Record(*self._fields())


_new_message_record = object.__new__
#: The fields a Record's equality compares (not the raw bytes: a decoded record equals one built with its objects).
_COMPARED = tuple(f.name for f in fields(Record) if f.compare)


def _unshared_refcount() -> int:
    record = _new_message_record(MessageRecord)
    return getrefcount(record)


#: ``sys.getrefcount(record)`` of a record that only the caller's local variable holds, measured the way the
#: record runner checks it. A handler that did not keep its record leaves it at this count, and the runner
#: refills the same object for the next message instead of allocating one (an allocation and a deallocation
#: per record: as much as the rest of the record's build). -1 (never reuse) where that is not verified: other
#: interpreters, and CPython from 3.14, whose compiler may pass a local as a borrowed reference in one place
#: and not in another (verified on 3.11, 3.12 and 3.13).
UNSHARED_REFCOUNT = _unshared_refcount() if sys.implementation.name == "cpython" and sys.version_info < (3, 14) else -1


def message_record(msg: ConsumedMessage, topic: str, partition: int, offset: int, attempt: int) -> Record:
    """A :class:`Record` over ``msg`` whose coordinates the caller has already read."""
    record: MessageRecord = _new_message_record(MessageRecord)
    record.message = msg
    record.topic, record.partition, record.offset, record.attempt = topic, partition, offset, attempt
    record.key, record.value = msg.key(), msg.value()
    return record


def to_record(msg: ConsumedMessage, attempt: int = 1) -> Record:
    """A :class:`Record` over a consumed Message."""
    return message_record(msg, msg.topic(), msg.partition(), msg.offset(), attempt)


def message_records(msgs: Sequence[ConsumedMessage], spare: Sequence[Record] = ()) -> list[Record]:
    """Records over ``msgs``, all at attempt 1: a batch's, built in one loop (a batch listener builds one per
    message in its transaction, so a call per message would be a good part of its cost).

    ``spare``: an earlier batch's records, refilled instead of allocating new ones when nothing but ``spare``
    holds them (``UNSHARED_REFCOUNT``, as the record runner refills its record): thousands of objects made and
    freed per batch also cost the garbage collector's passes over them. A record a handler kept is never changed.
    """
    records: list[Record] = []
    append, new, cls, unshared = records.append, _new_message_record, MessageRecord, UNSHARED_REFCOUNT + 1
    reusable = len(spare) if UNSHARED_REFCOUNT > 0 else 0
    record: Any
    for i, msg in enumerate(msgs):
        record = spare[i] if i < reusable else None
        if type(record) is not cls or getrefcount(record) > unshared:  # held elsewhere (or none): a new one
            record = new(cls)
        record.message = msg
        record.topic, record.partition, record.offset, record.attempt = msg.topic(), msg.partition(), msg.offset(), 1
        record.key, record.value = msg.key(), msg.value()
        append(record)
    return records


@dataclass(slots=True)
class Output:
    """A record for a handler to produce inside its transaction.

    ``topic=None`` sends it to the listener's ``output`` topic. ``value`` and
    ``key`` may be ``bytes``, ``str`` (UTF-8 encoded), or anything the
    listener's serializer accepts.

    A plain slotted record, compared by its fields. It is deliberately not
    frozen: a handler may build one per record, and a frozen dataclass costs
    about twice as much to build (every field set through
    ``object.__setattr__``). kafkatx reads it once, when the handler returns
    it or passes it to ``send()``; changing it afterwards changes nothing
    already produced.
    """

    value: Any
    key: Any = None
    topic: str | None = None
    headers: Sequence[tuple[str, bytes | str | None]] | dict[str, bytes | str | None] | None = None
    partition: int | None = None
