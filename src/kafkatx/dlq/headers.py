"""Dead-letter headers, with the names and binary encodings Spring for Apache Kafka uses.

Java and Python services can then read each other's dead-letter topics:
partition is a 4-byte big-endian int, offset and timestamp 8-byte big-endian
longs, everything else UTF-8.
"""

from __future__ import annotations

import linecache
import struct
import traceback
from dataclasses import dataclass
from types import CodeType, TracebackType

from kafkatx.record import Headers, Record
from kafkatx.rollback.classifier import cause_chain, exception_fqcn

__all__ = [
    "ORIGINAL_TOPIC",
    "ORIGINAL_PARTITION",
    "ORIGINAL_OFFSET",
    "ORIGINAL_TIMESTAMP",
    "ORIGINAL_TIMESTAMP_TYPE",
    "ORIGINAL_CONSUMER_GROUP",
    "EXCEPTION_FQCN",
    "EXCEPTION_CAUSE_FQCN",
    "EXCEPTION_MESSAGE",
    "EXCEPTION_STACKTRACE",
    "ATTEMPTS",
    "DeadLetterInfo",
    "dead_letter_headers",
    "parse_dead_letter_headers",
]

ORIGINAL_TOPIC = "kafka_dlt-original-topic"
ORIGINAL_PARTITION = "kafka_dlt-original-partition"
ORIGINAL_OFFSET = "kafka_dlt-original-offset"
ORIGINAL_TIMESTAMP = "kafka_dlt-original-timestamp"
ORIGINAL_TIMESTAMP_TYPE = "kafka_dlt-original-timestamp-type"
ORIGINAL_CONSUMER_GROUP = "kafka_dlt-original-consumer-group"
EXCEPTION_FQCN = "kafka_dlt-exception-fqcn"
EXCEPTION_CAUSE_FQCN = "kafka_dlt-exception-cause-fqcn"
EXCEPTION_MESSAGE = "kafka_dlt-exception-message"
EXCEPTION_STACKTRACE = "kafka_dlt-exception-stacktrace"
# kafkatx's own addition (Spring has no equivalent): how many deliveries failed.
ATTEMPTS = "kafkatx_dlt-attempts"

_EXCEPTION_PREFIX = "kafka_dlt-exception-"
_ORIGINAL_PREFIX = "kafka_dlt-original-"
_INT = struct.Struct(">i")
_LONG = struct.Struct(">q")


def _message(exc: BaseException, root: BaseException) -> str:
    msg = str(exc)
    if root is not exc and str(root) and str(root) not in msg:  # not when the message already quotes it
        msg = f"{msg}; {root}"
    return msg


def format_stacktrace(exc: BaseException, chain: list[BaseException] | None = None) -> str:
    """The exception's traceback, causes first, like ``traceback.format_exception``.

    Written out here because the standard formatter parses every source line
    (for its ``^^^`` anchors), which made it the main cost of dead-lettering:
    about 0.4 ms of 0.5 ms per record. A traceback's frames are formatted once
    per path through the code (:func:`_frames_text`): a handler failing the
    same way for many records pays for the source lines once. ``chain``: ``exc``'s cause chain, if the caller has it.
    """
    if chain is None:
        chain = cause_chain(exc)
    parts: list[str] = []
    for i, link in enumerate(reversed(chain)):
        if i:
            parts.append(
                "\nThe above exception was the direct cause of the following exception:\n\n"
                if link.__cause__ is not None
                else "\nDuring handling of the above exception, another exception occurred:\n\n"
            )
        if link.__traceback__ is not None:
            parts.append(_frames_text(link.__traceback__))
        parts.append(_exception_only(link))
    return "".join(parts)


#: The text of a traceback's frames, by the path through the code it took: each frame's code object (by identity:
#: hashing a code object hashes its constants, recursively) and instruction (``tb_lasti``: ``tb_lineno`` is worked
#: out from the code's line table, a scan that cost more than the rest of a failure in a long function), with the
#: code objects, which the entry keeps alive so that their ids cannot be reused while it is kept.
_FRAMES: dict[tuple[int, ...], tuple[tuple[CodeType, ...], str]] = {}
_FRAMES_KEPT = 512


def _frames_text(tb: TracebackType) -> str:
    """``Traceback (most recent call last):`` and a ``File ..., line ..., in ...`` line (and its source line) per
    frame: the same text for the same path, so it is kept by the path's code objects and instructions."""
    tbs: list[TracebackType] = []
    path: list[int] = []
    at: TracebackType | None = tb
    while at is not None:
        tbs.append(at)
        path += (id(at.tb_frame.f_code), at.tb_lasti)
        at = at.tb_next
    key = tuple(path)
    known = _FRAMES.get(key)
    if known is not None:
        return known[1]
    parts = ["Traceback (most recent call last):\n"]
    frames = [(at.tb_frame, at.tb_lineno) for at in tbs]
    for frame, lineno in frames:
        code = frame.f_code
        parts.append(f'  File "{code.co_filename}", line {lineno}, in {code.co_name}\n')
        line = linecache.getline(code.co_filename, lineno, frame.f_globals).strip()
        if line:
            parts.append(f"    {line}\n")
    text = "".join(parts)
    if len(_FRAMES) >= _FRAMES_KEPT:
        _FRAMES.clear()
    _FRAMES[key] = (tuple(frame.f_code for frame, _ in frames), text)
    return text


def _exception_only(exc: BaseException) -> str:
    """The last line(s) of a traceback, as ``traceback.format_exception_only`` writes them.

    Written out because that function builds a ``TracebackException``, which
    walks the tracebacks of the whole cause chain again, reading source lines.
    """
    if isinstance(exc, SyntaxError):  # its own multi-line layout; rare in a handler
        return "".join(traceback.format_exception_only(type(exc), exc))
    cls = type(exc)
    name = cls.__qualname__ if cls.__module__ in ("__main__", "builtins") else f"{cls.__module__}.{cls.__qualname__}"
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not break dead-lettering
        text = "<exception str() failed>"
    lines = [f"{name}: {text}\n" if text else f"{name}\n"]
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, (list, tuple)):
        lines.extend(f"{note}\n" for note in notes)
    return "".join(lines)


def dead_letter_headers(
    record: Record,
    exception: BaseException,
    *,
    group_id: str | None,
    attempts: int,
    keep_history: bool = False,
    max_stacktrace_bytes: int = 16_384,
) -> Headers:
    """The record's own headers plus the dead-letter headers.

    Earlier ``kafka_dlt-exception-*`` headers are always stripped, so repeated
    dead-lettering does not grow a record (Spring's default). Earlier
    ``kafka_dlt-original-*`` headers are replaced too unless ``keep_history``,
    which appends them as a hop history like Spring's default does.
    """
    kept = [
        (k, v)
        for k, v in record.headers
        if not k.startswith(_EXCEPTION_PREFIX)
        and k != ATTEMPTS
        and (keep_history or not k.startswith(_ORIGINAL_PREFIX))
    ]
    chain = cause_chain(exception)
    root = chain[-1]
    stack = format_stacktrace(exception, chain).encode("utf-8", "replace")
    if len(stack) > max_stacktrace_bytes:
        stack = stack[: max_stacktrace_bytes - 15] + b"\n...[truncated]"
    kept += [
        (ORIGINAL_TOPIC, record.topic.encode()),
        (ORIGINAL_PARTITION, _INT.pack(record.partition)),
        (ORIGINAL_OFFSET, _LONG.pack(record.offset)),
        (ORIGINAL_TIMESTAMP, _LONG.pack(record.timestamp)),
        (ORIGINAL_TIMESTAMP_TYPE, record.timestamp_type.encode()),
    ]
    if group_id:
        kept.append((ORIGINAL_CONSUMER_GROUP, group_id.encode()))
    kept += [
        (EXCEPTION_FQCN, exception_fqcn(exception).encode()),
        (EXCEPTION_CAUSE_FQCN, exception_fqcn(root).encode()),
        (EXCEPTION_MESSAGE, _message(exception, root).encode("utf-8", "replace")),
        (EXCEPTION_STACKTRACE, stack),
        (ATTEMPTS, _INT.pack(attempts)),
    ]
    return kept


@dataclass(frozen=True, slots=True)
class DeadLetterInfo:
    """The provenance decoded from a dead-lettered record's headers (the last hop)."""

    original_topic: str | None
    original_partition: int | None
    original_offset: int | None
    original_timestamp: int | None
    original_timestamp_type: str | None
    consumer_group: str | None
    exception_fqcn: str | None
    exception_cause_fqcn: str | None
    exception_message: str | None
    exception_stacktrace: str | None
    attempts: int | None


def parse_dead_letter_headers(headers: Headers | None) -> DeadLetterInfo:
    """Decode dead-letter headers (written by kafkatx or by Spring); the last value of each wins."""
    last: dict[str, bytes] = {}
    for k, v in headers or ():
        if v is not None:
            last[k] = v

    def text(name: str) -> str | None:
        v = last.get(name)
        return v.decode("utf-8", "replace") if v is not None else None

    def number(name: str, codec: struct.Struct) -> int | None:
        v = last.get(name)
        if v is None or len(v) != codec.size:
            return None
        return int(codec.unpack(v)[0])

    return DeadLetterInfo(
        original_topic=text(ORIGINAL_TOPIC),
        original_partition=number(ORIGINAL_PARTITION, _INT),
        original_offset=number(ORIGINAL_OFFSET, _LONG),
        original_timestamp=number(ORIGINAL_TIMESTAMP, _LONG),
        original_timestamp_type=text(ORIGINAL_TIMESTAMP_TYPE),
        consumer_group=text(ORIGINAL_CONSUMER_GROUP),
        exception_fqcn=text(EXCEPTION_FQCN),
        exception_cause_fqcn=text(EXCEPTION_CAUSE_FQCN),
        exception_message=text(EXCEPTION_MESSAGE),
        exception_stacktrace=text(EXCEPTION_STACKTRACE),
        attempts=number(ATTEMPTS, _INT),
    )
