"""Dead-letter records as the tools see them, and the filters that select them."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kafkatx.dlq.headers import DeadLetterInfo, parse_dead_letter_headers
from kafkatx.errors import KafkaTxError
from kafkatx.record import ConsumedMessage, Headers

__all__ = ["FILTER_FIELDS", "DeadLetterEntry", "DlqFilter", "DlqToolError", "EntryFilter", "parse_filter"]


class DlqToolError(KafkaTxError, RuntimeError):
    """A dead-letter tool cannot go on: unknown topic, no bootstrap servers, a record with nowhere to go."""


@dataclass(frozen=True, slots=True)
class DeadLetterEntry:
    """One record of a dead-letter topic: its own coordinates plus what its headers say."""

    topic: str
    partition: int
    offset: int
    timestamp: int | None  # the DLT record's timestamp, ms since the epoch
    key: bytes | None
    value: bytes | None
    headers: Headers
    info: DeadLetterInfo
    #: Already replayed by the default replay group of the topic (``kafkatx dlq replay``): its offset is behind
    #: that group's committed offset.
    replayed: bool = False

    @property
    def coordinates(self) -> str:
        """``topic/partition@offset`` of the dead-letter record."""
        return f"{self.topic}/{self.partition}@{self.offset}"

    @property
    def original_coordinates(self) -> str | None:
        """``topic/partition@offset`` of the record that failed, if the headers say."""
        i = self.info
        if i.original_topic is None:
            return None
        return f"{i.original_topic}/{_dash(i.original_partition)}@{_dash(i.original_offset)}"

    def to_dict(self, *, stacktrace: bool = False) -> dict[str, Any]:
        """A JSON-ready view; times are ms since the epoch, key and value UTF-8 text."""
        i = self.info
        out: dict[str, Any] = {
            "dlt_topic": self.topic,
            "dlt_partition": self.partition,
            "dlt_offset": self.offset,
            "dlt_timestamp": self.timestamp,
            "original_topic": i.original_topic,
            "original_partition": i.original_partition,
            "original_offset": i.original_offset,
            "original_timestamp": i.original_timestamp,
            "consumer_group": i.consumer_group,
            "exception": i.exception_fqcn,
            "exception_cause": i.exception_cause_fqcn,
            "exception_message": i.exception_message,
            "attempts": i.attempts,
            "replayed": self.replayed,
            "key": _text(self.key),
            "value": _text(self.value),
        }
        if stacktrace:
            out["exception_stacktrace"] = i.exception_stacktrace
        return out


def _dash(v: object) -> str:
    return "-" if v is None else str(v)


def _text(data: bytes | None) -> str | None:
    # backslashreplace keeps undecodable bytes visible (and distinguishable) instead of dropping them
    return None if data is None else data.decode("utf-8", "backslashreplace")


def entry_from_message(msg: ConsumedMessage) -> DeadLetterEntry:
    """The entry for a record read from a dead-letter topic."""
    headers: Headers = [(k, v) for k, v in (msg.headers() or []) if v is not None]
    ts_type, ts = msg.timestamp()
    return DeadLetterEntry(
        topic=msg.topic(),
        partition=msg.partition(),
        offset=msg.offset(),
        timestamp=ts if ts_type != 0 and ts >= 0 else None,
        key=msg.key(),
        value=msg.value(),
        headers=headers,
        info=parse_dead_letter_headers(headers),
    )


_TEXT_FIELDS = ("exception", "message", "topic", "key", "group")
_NUMBER_FIELDS = ("partition", "offset", "attempts")
#: Filter fields: what they look at in a dead-letter record.
FILTER_FIELDS: Mapping[str, str] = {
    "exception": "exception class (fully qualified) or its root cause's; '=' matches a substring",
    "message": "exception message; '=' matches a substring",
    "topic": "original topic; '=' matches exactly",
    "key": "record key as UTF-8; '=' matches exactly",
    "group": "consumer group that dead-lettered it; '=' matches exactly",
    "partition": "original partition: N or a range A..B (either end may be left out)",
    "offset": "original offset: N or a range A..B",
    "attempts": "failed deliveries before dead-lettering: N or a range A..B",
}
_FILTER_SYNTAX = re.compile(r"^\s*([A-Za-z_]+)\s*(!=|~=|=)(.*)$", re.S)
_NUMBER = re.compile(r"^\s*(\d+)\s*$")
_RANGE = re.compile(r"^\s*(\d+)?\s*\.\.\s*(\d+)?\s*$")


def _parse_range(value: str, what: str) -> tuple[int | None, int | None]:
    """``N`` -> (N, N); ``A..B``, ``A..``, ``..B`` -> inclusive bounds, None for an open end."""
    single = _NUMBER.match(value)
    if single:
        return int(single.group(1)), int(single.group(1))
    r = _RANGE.match(value)
    if r is None or r.group(1) is r.group(2) is None:
        raise ValueError(f"{what} takes an integer N or a range A..B, got {value!r}")
    return (None if r.group(1) is None else int(r.group(1))), (None if r.group(2) is None else int(r.group(2)))


def _filter_help() -> str:
    return "FIELD=VALUE, FIELD!=VALUE or FIELD~=REGEX with FIELD one of " + ", ".join(FILTER_FIELDS)


@dataclass(frozen=True)
class DlqFilter:
    """One ``FIELD=VALUE`` / ``FIELD!=VALUE`` / ``FIELD~=REGEX`` condition (build it with :func:`parse_filter`).

    A record whose header for FIELD is missing never matches ``=`` or ``~=``
    and always matches ``!=``.
    """

    field: str
    op: str
    value: str
    _pattern: re.Pattern[str] | None = None
    _range: tuple[int | None, int | None] | None = None

    def __str__(self) -> str:
        return f"{self.field}{self.op}{self.value}"

    def __call__(self, entry: DeadLetterEntry) -> bool:
        hit = self._test(entry)
        return not hit if self.op == "!=" else hit

    def _test(self, entry: DeadLetterEntry) -> bool:
        i = entry.info
        if self.field in _NUMBER_FIELDS:
            number = {"partition": i.original_partition, "offset": i.original_offset, "attempts": i.attempts}[
                self.field
            ]
            if number is None:
                return False
            assert self._range is not None
            low, high = self._range
            return (low is None or number >= low) and (high is None or number <= high)
        texts = {
            "exception": [i.exception_fqcn, i.exception_cause_fqcn],
            "message": [i.exception_message],
            "topic": [i.original_topic],
            "key": [None if entry.key is None else entry.key.decode("utf-8", "replace")],
            "group": [i.consumer_group],
        }[self.field]
        present = [t for t in texts if t is not None]
        if self._pattern is not None:
            return any(self._pattern.search(t) for t in present)
        if self.field in ("exception", "message"):
            return any(self.value in t for t in present)
        return any(self.value == t for t in present)


def parse_filter(text: str) -> DlqFilter:
    """Parse ``FIELD=VALUE``, ``FIELD!=VALUE`` or ``FIELD~=REGEX``; a ValueError names what is wrong."""
    m = _FILTER_SYNTAX.match(text)
    if m is None:
        raise ValueError(f"bad filter {text!r}: expected {_filter_help()}")
    name, op, value = m.group(1).lower(), m.group(2), m.group(3)
    if name not in FILTER_FIELDS:
        raise ValueError(f"bad filter {text!r}: unknown field {name!r}; fields are {', '.join(FILTER_FIELDS)}")
    if value == "":
        raise ValueError(f"bad filter {text!r}: the value is empty")
    if op == "~=":
        if name in _NUMBER_FIELDS:
            raise ValueError(f"bad filter {text!r}: {name} is a number; use {name}=N or {name}=A..B")
        try:
            return DlqFilter(name, op, value, _pattern=re.compile(value))
        except re.error as exc:
            raise ValueError(f"bad filter {text!r}: invalid regular expression: {exc}") from None
    if name in _NUMBER_FIELDS:
        return DlqFilter(name, op, value, _range=_parse_range(value, f"bad filter {text!r}: {name}"))
    return DlqFilter(name, op, value)


EntryFilter = Callable[[DeadLetterEntry], bool]


def compile_filters(filters: Iterable[str | EntryFilter] | None) -> list[EntryFilter]:
    """Filter strings parsed (a DlqToolError names a bad one); functions kept as they are."""
    out: list[EntryFilter] = []
    for f in filters or ():
        if isinstance(f, str):
            try:
                out.append(parse_filter(f))
            except ValueError as exc:
                raise DlqToolError(str(exc)) from None
        elif callable(f):
            out.append(f)
        else:
            raise TypeError(f"a filter must be a 'FIELD=VALUE' string or a function (entry) -> bool, got {f!r}")
    return out


def matches_all(entry: DeadLetterEntry, filters: Sequence[EntryFilter]) -> bool:
    """Whether ``entry`` passes every filter."""
    return all(f(entry) for f in filters)
