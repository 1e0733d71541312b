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
from typing import Any

from kafkatx.errors import InvalidConfigurationError, OutputError, UnproducibleTypeError
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
    "unproducible_stop",
]

Serializer = Callable[[Any], bytes]


#: One encoded record waiting to be produced in the transaction: ``(topic, value, key, headers, partition)``.
#: A plain tuple, not a NamedTuple: a tuple subclass costs more to make and free, and the hot path makes one per
#: output a handler sends or yields (read them by unpacking).
PendingOutput = tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]] | None, int | None]

# What a handler returned, by its type (see result_kind).
VALUE = 1  # bytes or str: one value for the listener's output topic
PAIR = 2  # a tuple: (key, value)
OUTPUT = 3  # an Output
MANY = 4  # an iterable (list, generator...) of those
SERIALIZE = 5  # anything else, for the listener's serializer
OTHER = 0  # the rest: collect_outputs() encodes it or names the problem


#: How to make a value producible: what an UnproducibleTypeError tells the user.
_FIX = (
    "bytes, str, a (key, value) tuple, an Output, or an iterable of those, "
    "or give the listener serializer= (for example serializer=lambda v: json.dumps(v).encode())"
)


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
    if _is_model(cls):  # a pydantic model iterates over its fields, yet is one value
        return SERIALIZE if serializer is not None else OTHER
    if issubclass(cls, Iterable) and not issubclass(cls, Mapping):
        return MANY
    if serializer is not None:
        return SERIALIZE
    return OTHER


def _is_model(cls: type) -> bool:
    """A pydantic model: iterable (over its fields), yet one value for the serializer."""
    return hasattr(cls, "model_dump_json")


def encode(obj: Any, what: str, serializer: Serializer | None = None) -> bytes | None:
    """Encode a key or value: bytes as is, str as UTF-8, else the serializer."""
    if obj is None or type(obj) is bytes:
        return obj
    if isinstance(obj, str):
        return obj.encode("utf-8")
    if isinstance(obj, (bytes, bytearray, memoryview)):  # a bytes subclass too: its bytes, as confluent-kafka takes it
        return bytes(obj)
    if serializer is not None:
        return serialize(obj, what, serializer)
    fix = "header values must be bytes or str" if what.startswith("header") else f"return {_FIX}"
    raise UnproducibleTypeError(
        f"cannot encode the {what} of type {type(obj).__name__} to bytes: {fix}", type(obj).__name__
    )


def serialize(obj: Any, what: str, serializer: Serializer) -> bytes:
    """``serializer(obj)``, checked to be bytes; its failure is an OutputError naming the object's type."""
    failure: Exception | None = None
    try:
        data = serializer(obj)
    except Exception as exc:
        failure = exc
    if failure is not None:  # outside the except block: only the serializer's error is chained
        raise serializer_failure(obj, what, failure) from failure
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
            return (default_topic, item, None, None, None)
        if cls is tuple and len(item) == 2:
            key, value = item
            if (type(value) is bytes or value is None) and (type(key) is bytes or key is None):
                return (default_topic, value, key, None, None)
    if cls is Output or isinstance(item, Output):
        return _output_pending(item, default_topic, serializer, listener)
    if default_topic is None:
        raise OutputError(
            f"listener {listener!r} returned a {type(item).__name__} but has no output topic: "
            "declare output= on the listener, return Output(..., topic=...), or call send()"
        )
    if isinstance(item, tuple):
        if len(item) != 2:
            raise OutputError(f"a returned tuple must be (key, value), got a tuple of {len(item)} items")
        key, value = item
        return (default_topic, encode(value, "value", serializer), encode(key, "key", serializer), None, None)
    return (default_topic, encode(item, "value", serializer), None, None, None)


def _output_pending(
    item: Output, default_topic: str | None, serializer: Serializer | None, listener: str
) -> PendingOutput:
    """Encode a returned :class:`Output`: its own topic and partition are checked, and each part that is not
    already bytes goes through the serializer (kept apart from to_pending, whose common forms come first)."""
    topic = item.topic or default_topic
    if topic is None:
        raise OutputError(f"listener {listener!r} returned an Output without a topic and has no output topic")
    partition = item.partition
    if partition is not None and (type(partition) is not int or partition < 0):
        raise OutputError(f"Output.partition must be a non-negative int, got {partition!r}")
    value, key = item.value, item.key
    if value is not None and type(value) is not bytes:
        value = encode(value, "value", serializer)
    if key is not None and type(key) is not bytes:
        key = encode(key, "key", serializer)
    return (topic, value, key, encode_headers(item.headers), partition)


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
    if isinstance(result, Iterable) and not isinstance(result, Mapping) and not _is_model(type(result)):
        append = into.append
        for item in result:  # a batch listener returns one item per record: bytes for the output topic, mostly
            if type(item) is bytes and default_topic is not None:
                append((default_topic, item, None, None, None))
            elif item is not None:
                append(to_pending(item, default_topic, serializer, listener))
        return
    if serializer is not None:
        into.append(to_pending(result, default_topic, serializer, listener))
        return
    raise UnproducibleTypeError(
        f"listener {listener!r} returned an unsupported {type(result).__name__}: return None, {_FIX}",
        type(result).__name__,
    )


def unproducible_stop(listener: str, exc: BaseException) -> InvalidConfigurationError | None:
    """The error that stops ``listener``'s container when ``exc`` says its handler returned an unencodable type.

    Such a result is a programming error: every record would fail alike, so
    rather than dead-letter them all the container stops, committing nothing
    for the record (a restart after the fix handles it). Called only once a
    record failed, so the check costs the hot path nothing.
    """
    if not isinstance(exc, UnproducibleTypeError):
        return None
    where = "" if str(exc).startswith("listener") else f"listener {listener!r}: "
    return InvalidConfigurationError(
        f"{where}{exc}. A programming error, not the record's: the container stopped before committing the "
        "record and dead-lettered nothing; restart after the fix"
    )
