"""The values handlers receive (:class:`Record`) and may return (:class:`Output`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from confluent_kafka import Message

__all__ = ["Record", "Output", "Headers"]

Headers = list[tuple[str, bytes]]


@dataclass(slots=True)
class Record:
    """One consumed Kafka record, as a handler sees it.

    ``attempt`` is 1 on first delivery and counts redeliveries after handler
    failures (see the after-rollback processor). ``timestamp`` is milliseconds
    since the epoch, and ``timestamp_type`` is ``"CreateTime"``,
    ``"LogAppendTime"`` or ``"NoTimestampType"``.
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


class _MessageRecord(Record):
    """A :class:`Record` that reads key, value, headers and timestamp from the Message on demand.

    The container builds one per consumed record, so its construction is on
    the hot path: two attribute stores instead of a nine-field ``__init__``
    and six Message getters (most handlers read the value and little else).
    It compares, prints, pickles and ``dataclasses.replace()``s as a plain
    ``Record``; its fields are read-only.
    """

    __slots__ = ("_msg",)

    def __new__(cls, *args: Any, **kwargs: Any) -> Record:  # type: ignore[misc]
        # dataclasses.replace() and copy() call the class with every field: give them a plain Record.
        return Record(*args, **kwargs)

    @property  # type: ignore[override]
    def key(self) -> bytes | None:
        return self._msg.key()  # type: ignore[no-any-return]

    @property  # type: ignore[override]
    def value(self) -> bytes | None:
        return self._msg.value()  # type: ignore[no-any-return]

    @property  # type: ignore[override]
    def headers(self) -> Headers:
        return self._msg.headers() or []

    @property  # type: ignore[override]
    def timestamp(self) -> int:
        return self._msg.timestamp()[1]  # type: ignore[no-any-return]

    @property  # type: ignore[override]
    def timestamp_type(self) -> str:
        ts_type = self._msg.timestamp()[0]
        return _TS_TYPES[ts_type] if 0 <= ts_type < 3 else "CreateTime"

    def _fields(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in fields(Record))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Record):
            return NotImplemented
        return self._fields() == tuple(getattr(other, f.name) for f in fields(Record))

    __hash__ = None  # type: ignore[assignment]  # as Record's: mutable dataclass, not hashable

    def __repr__(self) -> str:
        return repr(Record(*self._fields()))

    def __reduce__(self) -> tuple[type[Record], tuple[Any, ...]]:
        return Record, self._fields()

    def __copy__(self) -> Record:
        return Record(*self._fields())


_new_message_record = object.__new__


def message_record(msg: Message, topic: str, partition: int, offset: int, attempt: int) -> Record:
    """A :class:`Record` over ``msg`` whose coordinates the caller has already read."""
    record = _new_message_record(_MessageRecord)
    record._msg = msg
    record.topic, record.partition, record.offset, record.attempt = topic, partition, offset, attempt
    return record  # type: ignore[no-any-return]


def to_record(msg: Message, attempt: int = 1) -> Record:
    """A :class:`Record` over a consumed Message."""
    return message_record(msg, msg.topic(), msg.partition(), msg.offset(), attempt)


@dataclass(slots=True, frozen=True)
class Output:
    """A record for a handler to produce inside its transaction.

    ``topic=None`` sends it to the listener's ``output`` topic. ``value`` and
    ``key`` may be ``bytes``, ``str`` (UTF-8 encoded), or anything the
    listener's serializer accepts.
    """

    value: Any
    key: Any = None
    topic: str | None = None
    headers: Sequence[tuple[str, bytes | str]] | dict[str, bytes | str] | None = None
    partition: int | None = None
