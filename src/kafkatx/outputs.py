"""Turn whatever a handler returns into records to produce, with clear errors.

A handler may return None, bytes/str (a value), a ``(key, value)`` tuple, an
:class:`~kafkatx.Output`, or an iterable/generator of those. Everything is
encoded before anything is produced, so a bad return value fails its record
without leaving half its outputs in the transaction.

The record runner calls this for every record, so the common cases come
first and cost a type check each: :func:`result_kind` classifies a returned
value by its type once (the runner caches the answer per type), and
:func:`encode`, :func:`encode_headers` and :func:`to_pending` take bytes,
``None`` and ``str``-keyed ``bytes`` headers without going further.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from kafkatx.errors import OutputError
from kafkatx.record import Output

__all__ = [
    "PendingOutput",
    "collect_outputs",
    "encode",
    "encode_headers",
    "result_kind",
    "serialize",
    "to_pending",
    "Serializer",
    "VALUE",
    "PAIR",
    "OUTPUT",
    "MANY",
    "SERIALIZE",
    "OTHER",
]

Serializer = Callable[[Any], bytes]


class PendingOutput(NamedTuple):
    """One encoded record waiting to be produced in the transaction."""

    topic: str
    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes]] | None
    partition: int | None


#: A new PendingOutput from a tuple of its fields, without NamedTuple's Python-level ``__new__`` (hot path).
new_pending: Callable[[type[PendingOutput], tuple[Any, ...]], PendingOutput] = tuple.__new__

# What a handler returned, by its type (see result_kind).
VALUE = 1  # bytes or str: one value for the listener's output topic
PAIR = 2  # a tuple: (key, value)
OUTPUT = 3  # an Output
MANY = 4  # an iterable (list, generator...) of those
SERIALIZE = 5  # anything else, for the listener's serializer
OTHER = 0  # the rest: collect_outputs() encodes it or names the problem


def result_kind(cls: type, serializer: Serializer | None) -> int:
    """How :func:`collect_outputs` treats a returned value of type ``cls`` (depends on the type only)."""
    if cls is bytes or issubclass(cls, str):
        return VALUE
    if issubclass(cls, tuple):
        return PAIR
    if issubclass(cls, Output):
        return OUTPUT
    if issubclass(cls, (bytes, bytearray, memoryview)):
        return OTHER
    if issubclass(cls, Iterable) and not issubclass(cls, Mapping):
        return MANY
    if serializer is not None:
        return SERIALIZE
    return OTHER


def encode(obj: Any, what: str, serializer: Serializer | None = None) -> bytes | None:
    """Encode a key or value: bytes as is, str as UTF-8, else the serializer."""
    if obj is None or type(obj) is bytes:
        return obj
    if isinstance(obj, str):
        return obj.encode("utf-8")
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    if serializer is not None:
        return serialize(obj, what, serializer)
    raise OutputError(
        f"cannot encode the {what} of type {type(obj).__name__} to bytes: return bytes or str, "
        "or give the listener a serializer (for example serializer=lambda v: json.dumps(v).encode())"
    )


def serialize(obj: Any, what: str, serializer: Serializer) -> bytes:
    """``serializer(obj)``, checked to be bytes; its failure is an OutputError naming the object's type."""
    try:
        data = serializer(obj)
    except Exception as exc:
        raise serializer_failure(obj, what, exc) from exc
    if type(data) is bytes:
        return data
    return serialized_bytes(data, what)


def serializer_failure(obj: Any, what: str, exc: Exception) -> OutputError:
    """The error for a serializer that raised ``exc`` encoding ``obj``."""
    return OutputError(f"the serializer failed to encode the {what} ({type(obj).__name__}): {exc}")


def serialized_bytes(data: Any, what: str) -> bytes:
    """A serializer's result that is not exactly ``bytes``: a bytearray copied, anything else refused."""
    if not isinstance(data, (bytes, bytearray)):
        raise OutputError(f"the serializer returned {type(data).__name__} for the {what}; it must return bytes")
    return bytes(data)


def encode_headers(headers: Any) -> list[tuple[str, bytes]] | None:
    """Headers as ``(name, bytes)`` pairs, from a mapping or pairs with str names and bytes/str values."""
    if headers is None:
        return None
    if type(headers) is dict:  # the usual form, checked without building anything first
        for name, value in headers.items():
            if type(name) is not str or type(value) is not bytes:
                break
        else:
            return list(headers.items())
    items = headers.items() if isinstance(headers, Mapping) else headers
    out: list[tuple[str, bytes]] = []
    try:
        for name, value in items:
            if not isinstance(name, str):
                raise OutputError(f"header names must be str, got {type(name).__name__}")
            out.append((name, value if isinstance(value, bytes) else encode(value, f"header {name!r}")))  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        if isinstance(exc, OutputError):
            raise
        raise OutputError(f"headers must be a mapping or (name, value) pairs, got {headers!r}") from exc
    return out


def to_pending(
    item: Any,
    default_topic: str | None,
    serializer: Serializer | None,
    listener: str,
) -> PendingOutput:
    """Encode one returned item (not an iterable of them)."""
    cls = type(item)
    if default_topic is not None:  # the common forms first: bytes, and (key, value) of bytes
        if cls is bytes:
            return new_pending(PendingOutput, (default_topic, item, None, None, None))
        if cls is tuple and len(item) == 2:
            key, value = item
            if (type(value) is bytes or value is None) and (type(key) is bytes or key is None):
                return new_pending(PendingOutput, (default_topic, value, key, None, None))
    if cls is Output or isinstance(item, Output):
        topic = item.topic or default_topic
        if topic is None:
            raise OutputError(f"listener {listener!r} returned an Output without a topic and has no output topic")
        partition = item.partition
        if partition is not None and (type(partition) is not int or partition < 0):
            raise OutputError(f"Output.partition must be a non-negative int, got {partition!r}")
        value, key, headers = item.value, item.key, item.headers
        if value is not None and type(value) is not bytes:
            value = encode(value, "value", serializer)
        if key is not None and type(key) is not bytes:
            key = encode(key, "key", serializer)
        if headers is not None:
            headers = encode_headers(headers)
        return new_pending(PendingOutput, (topic, value, key, headers, partition))
    if default_topic is None:
        raise OutputError(
            f"listener {listener!r} returned a {type(item).__name__} but has no output topic: "
            "declare output= on the listener, return Output(..., topic=...), or call send()"
        )
    if isinstance(item, tuple):
        if len(item) != 2:
            raise OutputError(f"a returned tuple must be (key, value), got a tuple of {len(item)} items")
        key, value = item
        return PendingOutput(
            default_topic, encode(value, "value", serializer), encode(key, "key", serializer), None, None
        )
    return PendingOutput(default_topic, encode(item, "value", serializer), None, None, None)


def collect_outputs(
    result: Any,
    default_topic: str | None,
    serializer: Serializer | None,
    listener: str,
    into: list[PendingOutput],
) -> None:
    """Append the encoded outputs of a handler's return value to ``into``."""
    if result is None:
        return
    if isinstance(result, (bytes, str, tuple, Output, bytearray, memoryview)):
        into.append(to_pending(result, default_topic, serializer, listener))
        return
    if isinstance(result, Iterable) and not isinstance(result, Mapping):
        for item in result:
            if item is not None:
                into.append(to_pending(item, default_topic, serializer, listener))
        return
    if serializer is not None:
        into.append(to_pending(result, default_topic, serializer, listener))
        return
    raise OutputError(
        f"listener {listener!r} returned an unsupported {type(result).__name__}: return None, bytes, str, "
        "a (key, value) tuple, an Output, or an iterable of those (or give the listener a serializer)"
    )
