"""The headers of a record on its way through the retry topics, in Spring's names and encodings.

A hop carries the record's own headers, Spring's dead-letter provenance
(``kafka_dlt-original-*`` naming the **input** topic, partition, offset and
timestamp, and the last failure's ``kafka_dlt-exception-*``), and Spring's
retry-topic headers:

- ``retry_topic-attempts``: the attempt the next delivery is (4-byte big-endian int);
- ``retry_topic-backoff-timestamp``: when it is due, epoch milliseconds;
- ``retry_topic-original-timestamp``: the input record's timestamp, epoch milliseconds.

kafkatx's ``kafkatx_retry-hop`` (first, 16 bytes: which hop of the process that wrote it this is; that
process hands its own hops back to the handler from memory instead of parsing these headers again,
:class:`~kafkatx.retry_topics.hops.RetryHops`), and, with tracing on, kafkatx's
``kafkatx_retry-attempt-spans``: the span contexts of the record's failed attempts (W3C ``traceparent``
values, comma-separated), so that its next attempt links to them wherever it runs
(:mod:`kafkatx.tracing._hops`).

Spring writes the two timestamps as Java's ``BigInteger.toByteArray()`` (big-endian two's complement, as
few bytes as the value needs); so does kafkatx, and it reads any length. The handler never sees these
headers: :func:`parse_hop` gives back the input record's own.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kafkatx.dlq import headers as dlt
from kafkatx.dlq.headers import dead_letter_headers
from kafkatx.record import Headers, Record

__all__ = [
    "ATTEMPTS",
    "BACKOFF_TIMESTAMP",
    "ORIGINAL_TIMESTAMP",
    "ATTEMPT_SPANS",
    "HOP_ID",
    "RetryHop",
    "due_ms_of",
    "hop_headers",
    "hop_origin",
    "own_headers",
    "parse_hop",
]

ATTEMPTS = "retry_topic-attempts"
BACKOFF_TIMESTAMP = "retry_topic-backoff-timestamp"
ORIGINAL_TIMESTAMP = "retry_topic-original-timestamp"
ATTEMPT_SPANS = "kafkatx_retry-attempt-spans"
HOP_ID = "kafkatx_retry-hop"

_RETRY_PREFIXES = ("retry_topic-", "kafkatx_retry-")
_DLT_PREFIXES = ("kafka_dlt-", "kafkatx_dlt-")
_HIDDEN = _RETRY_PREFIXES + _DLT_PREFIXES
_ORIGINAL_PREFIX = "kafka_dlt-original-"
_INT = struct.Struct(">i")
_LONG = struct.Struct(">q")


def _java_big_integer(value: int) -> bytes:
    """``BigInteger.valueOf(value).toByteArray()``: big-endian two's complement, as few bytes as it needs."""
    return value.to_bytes(value.bit_length() // 8 + 1, "big", signed=True)


def _number(raw: bytes | None) -> int | None:
    return int.from_bytes(raw, "big", signed=True) if raw else None


@dataclass(frozen=True, slots=True)
class RetryHop:
    """A record read back from a retry topic: the input record as it was, and what the hop adds."""

    #: The input record (topic, partition, offset, timestamp, key, value, its own headers), ``attempt`` the
    #: delivery this is.
    record: Record
    #: When it is due, epoch milliseconds.
    due_ms: int
    #: The consumer group that wrote it (``kafka_dlt-original-consumer-group``); None when it names none.
    group: str | None = None


def hop_headers(
    record: Record, exception: BaseException | None, *, group_id: str | None, next_attempt: int, due_ms: int
) -> Headers:
    """The headers of ``record`` (the input record, as its handler saw it) sent to a retry topic after ``exception``;
    ``exception`` None: a record that follows its key's head (``ordering="key"``), no failure of its own to name."""
    if exception is None:
        headers = _provenance(record, group_id)
    else:
        headers = dead_letter_headers(record, exception, group_id=group_id, attempts=next_attempt - 1)
    headers += [
        (ATTEMPTS, _INT.pack(next_attempt)),
        (BACKOFF_TIMESTAMP, _java_big_integer(due_ms)),
        (ORIGINAL_TIMESTAMP, _java_big_integer(record.timestamp)),
    ]
    return headers


def own_headers(headers: Headers) -> Headers:
    """Of a record's ``headers``, those that are its own: what :func:`parse_hop` gives back of a hop of it."""
    return [(k, v) for k, v in headers if not k.startswith(_HIDDEN)]


def _provenance(record: Record, group_id: str | None) -> Headers:
    """``record``'s own headers and Spring's ``kafka_dlt-original-*`` (what :func:`parse_hop` reads back)."""
    headers: Headers = [(k, v) for k, v in record.headers if not k.startswith(_DLT_PREFIXES)]
    headers += [
        (dlt.ORIGINAL_TOPIC, record.topic.encode()),
        (dlt.ORIGINAL_PARTITION, _INT.pack(record.partition)),
        (dlt.ORIGINAL_OFFSET, _LONG.pack(record.offset)),
        (dlt.ORIGINAL_TIMESTAMP, _LONG.pack(record.timestamp)),
        (dlt.ORIGINAL_TIMESTAMP_TYPE, record.timestamp_type.encode()),
    ]
    if group_id:
        headers.append((dlt.ORIGINAL_CONSUMER_GROUP, group_id.encode()))
    return headers


def parse_hop(record: Record) -> RetryHop | None:
    """The input record behind ``record`` (consumed from a retry topic); None if it carries no hop headers.

    One pass over the headers (the last value of each wins, as :func:`~kafkatx.dlq.headers.parse_dead_letter_headers`
    reads them): every record read back from a retry topic is parsed, the exception headers are not needed here."""
    last: dict[str, bytes] = {}
    own: Headers = []
    for key, value in record.headers:
        if key.startswith(_HIDDEN):
            if value is not None:
                last[key] = value
        else:
            own.append((key, value))
    attempt_raw = last.get(ATTEMPTS)
    topic = last.get(dlt.ORIGINAL_TOPIC)
    partition = _fixed(last.get(dlt.ORIGINAL_PARTITION), _INT)
    if attempt_raw is None or topic is None or partition is None:
        return None
    offset = _fixed(last.get(dlt.ORIGINAL_OFFSET), _LONG)
    timestamp = _number(last.get(ORIGINAL_TIMESTAMP))
    if timestamp is None:
        timestamp = _fixed(last.get(dlt.ORIGINAL_TIMESTAMP), _LONG) or -1
    timestamp_type = _text(last.get(dlt.ORIGINAL_TIMESTAMP_TYPE)) or "CreateTime"
    original = Record(
        topic.decode("utf-8", "replace"),
        partition,
        offset if offset is not None else -1,
        record.key,
        record.value,
        own,
        timestamp,
        timestamp_type,
        attempt=_number(attempt_raw) or 1,
        raw_key=record.raw_key,
        raw_value=record.raw_value,
    )
    return RetryHop(original, _number(last.get(BACKOFF_TIMESTAMP)) or 0, _text(last.get(dlt.ORIGINAL_CONSUMER_GROUP)))


def hop_origin(headers: Headers | None) -> tuple[str, int, int, str | None] | None:
    """The input topic, partition and offset a hop with ``headers`` names, and the group that wrote it; None when it
    names no input record. What a commit reads of every retry record it covers: four headers, nothing decoded else."""
    topic = partition = offset = group = None
    for key, value in headers or ():
        if value is not None and key.startswith(_ORIGINAL_PREFIX):
            if key == dlt.ORIGINAL_TOPIC:
                topic = value
            elif key == dlt.ORIGINAL_PARTITION:
                partition = value
            elif key == dlt.ORIGINAL_OFFSET:
                offset = value
            elif key == dlt.ORIGINAL_CONSUMER_GROUP:
                group = value
    p, o = _fixed(partition, _INT), _fixed(offset, _LONG)
    if topic is None or p is None or o is None:
        return None
    return topic.decode("utf-8", "replace"), p, o, _text(group)


def _fixed(raw: bytes | None, codec: struct.Struct) -> int | None:
    """A number in Spring's fixed-size encoding; None when absent or of another size."""
    return int(codec.unpack(raw)[0]) if raw is not None and len(raw) == codec.size else None


def _text(raw: bytes | None) -> str | None:
    return raw.decode("utf-8", "replace") if raw is not None else None


def attempt_spans_of(headers: Headers | None) -> bytes | None:
    """The span contexts of the failed attempts a hop with ``headers`` carries (its last such header); None."""
    found = None
    for key, value in headers or ():
        if key == ATTEMPT_SPANS and value:
            found = value
    return found


def due_ms_of(headers: Headers | None) -> int:
    """When a hop with ``headers`` is due (epoch milliseconds; 0, due at once, when it says nothing): the due-time
    gate reads this of every record polled from a retry topic, without parsing the rest."""
    due = 0
    for key, value in headers or ():
        if key == BACKOFF_TIMESTAMP and value:
            due = int.from_bytes(value, "big", signed=True)
    return due
