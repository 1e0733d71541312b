"""The values handlers receive (:class:`Record`) and may return (:class:`Output`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

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
