"""Turn whatever a handler returns into records to produce, with clear errors.

A handler may return None, bytes/str (a value), a ``(key, value)`` tuple, an
:class:`~kafkatx.Output`, or an iterable/generator of those. Everything is
encoded before anything is produced, so a bad return value fails its record
without leaving half its outputs in the transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from kafkatx.errors import OutputError
from kafkatx.record import Output

__all__ = ["PendingOutput", "collect_outputs", "encode", "encode_headers", "Serializer"]

Serializer = Callable[[Any], bytes]


class PendingOutput(NamedTuple):
    """One encoded record waiting to be produced in the transaction."""

    topic: str
    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes]] | None
    partition: int | None


def encode(obj: Any, what: str, serializer: Serializer | None = None) -> bytes | None:
    """Encode a key or value: bytes as is, str as UTF-8, else the serializer."""
    if obj is None or type(obj) is bytes:
        return obj
    if isinstance(obj, str):
        return obj.encode("utf-8")
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    if serializer is not None:
        try:
            data = serializer(obj)
        except Exception as exc:
            raise OutputError(f"the serializer failed to encode the {what} ({type(obj).__name__}): {exc}") from exc
        if not isinstance(data, (bytes, bytearray)):
            raise OutputError(f"the serializer returned {type(data).__name__} for the {what}; it must return bytes")
        return bytes(data)
    raise OutputError(
        f"cannot encode the {what} of type {type(obj).__name__} to bytes: return bytes or str, "
        "or give the listener a serializer (for example serializer=lambda v: json.dumps(v).encode())"
    )


def encode_headers(headers: Any) -> list[tuple[str, bytes]] | None:
    if headers is None:
        return None
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
    if isinstance(item, Output):
        topic = item.topic or default_topic
        if topic is None:
            raise OutputError(f"listener {listener!r} returned an Output without a topic and has no output topic")
        if item.partition is not None and (type(item.partition) is not int or item.partition < 0):
            raise OutputError(f"Output.partition must be a non-negative int, got {item.partition!r}")
        return PendingOutput(
            topic,
            encode(item.value, "value", serializer),
            encode(item.key, "key", serializer),
            encode_headers(item.headers),
            item.partition,
        )
    if default_topic is None:
        raise OutputError(
            f"listener {listener!r} returned a {type(item).__name__} but has no output topic: "
            "declare output= on the listener, return Output(..., topic=...), or call send()"
        )
    if isinstance(item, tuple):
        if len(item) != 2:
            raise OutputError(f"a returned tuple must be (key, value), got a tuple of {len(item)} items")
        key, value = item
        return PendingOutput(default_topic, encode(value, "value", serializer), encode(key, "key", serializer), None, None)
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
