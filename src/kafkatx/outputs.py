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

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from confluent_kafka import KafkaException

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
    "Emit",
    "Produce",
    "ResultEmitters",
    "Send",
    "direct_or_buffer",
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


# -- producing what a handler returned, in its transaction ---------------------------------------------------------

#: confluent-kafka's ``Producer.produce`` (for a topic that exists, in an open transaction).
Produce = Callable[..., Any]
#: ``send(value, key=None, headers=None)`` for one topic: 1 when produced now, 0 when buffered (see direct_or_buffer).
Send = Callable[..., int]
#: Produces (or buffers) one handler result of a given shape; returns how many records it produced now.
Emit = Callable[[Any], int]


def direct_or_buffer(produce: Produce | None, pending: list[PendingOutput], topic: str) -> Send:
    """The one produce-or-buffer rule, bound to ``topic``: ``send(value, key=None, headers=None) -> int``.

    ``value`` and ``key`` are bytes or None, ``headers`` None or a dict with
    str names. The record goes straight to confluent-kafka's ``produce``
    when nothing is buffered before it (order is kept) and the topic exists;
    when confluent-kafka refuses it (queue full, an error, headers it cannot
    take), or otherwise, it is appended to ``pending`` for the runner's
    buffered produce, which waits for queue space, classifies errors and
    names bad headers. A closure rather than a function of the topic: the
    hot path pays one call per record for it, nothing more.
    """

    def send(value: bytes | None, key: bytes | None = None, headers: Any = None) -> int:
        if produce is not None and not pending:
            try:
                if headers is None:
                    produce(topic, value, key)
                else:
                    produce(topic, value, key, headers=headers)
                return 1
            except (BufferError, KafkaException, TypeError, ValueError):
                pass
        # Outside the except block: a header encoding error names the headers, not confluent-kafka's refusal.
        encoded = None if headers is None else encode_headers(headers)
        pending.append(new_pending(PendingOutput, (topic, value, key, encoded, None)))
        return 0

    return send


class ResultEmitters:
    """Produces what a handler returned, by one small function per result shape, for one transaction.

    :meth:`emitter` picks the function for a result's type the first time
    the type is seen (:func:`result_kind`, cached per listener in ``kinds``)
    and keeps it in ``by_type``; each one produces what needs no encoding
    through :func:`direct_or_buffer` and encodes the rest into ``pending``
    with :func:`to_pending` (a bad result fails its record with an
    OutputError). ``stream_items`` produces an iterable's items as they come
    (a failing handler aborts the whole transaction, so nothing need be held
    back); without it they wait in ``pending`` until the handler returned.
    ``senders`` (topic -> :data:`Send`) is what ``send()`` produces through.
    """

    __slots__ = (
        "_default_topic",
        "_serializer",
        "_listener",
        "_direct_for",
        "_kinds",
        "_stream_items",
        "pending",
        "directs",
        "senders",
        "by_type",
        "to_default",
    )

    def __init__(
        self,
        default_topic: str | None,
        serializer: Serializer | None,
        listener: str,
        pending: list[PendingOutput],
        direct_for: Callable[[str], Produce | None],
        *,
        stream_items: bool,
        kinds: dict[type, int],
    ) -> None:
        self._default_topic, self._serializer, self._listener = default_topic, serializer, listener
        self._direct_for, self._kinds, self._stream_items = direct_for, kinds, stream_items
        self.pending = pending
        self.directs: dict[str, Produce | None] = {}  # the topics looked up: confluent-kafka's produce, or None
        self.senders: dict[str, Send] = {}
        self.by_type: dict[type, Emit] = {}
        self.to_default = self.sender(default_topic) if default_topic is not None else None

    def direct(self, topic: str) -> Produce | None:
        """confluent-kafka's ``produce`` for ``topic`` (None if it cannot take it), looked up once."""
        if topic not in self.directs:
            self.sender(topic)
        return self.directs[topic]

    def sender(self, topic: str) -> Send:
        """The :func:`direct_or_buffer` of ``topic``, looked up once."""
        send = self.senders.get(topic)
        if send is None:
            fast = self.directs[topic] = self._direct_for(topic)
            send = self.senders[topic] = direct_or_buffer(fast, self.pending, topic)
        return send

    def emitter(self, cls: type) -> Emit:
        """The function producing a result of type ``cls`` (chosen once per type)."""
        kind = self._kinds.get(cls)
        if kind is None:
            kind = self._kinds[cls] = result_kind(cls, self._serializer)
        to_default, pending = self.to_default, self.pending
        fallback = self._buffer_encoded
        emit: Emit
        if to_default is not None and cls is bytes:
            emit = to_default
        elif to_default is not None and cls is tuple:
            emit = _pair_emitter(to_default, fallback)
        elif kind == OUTPUT:
            emit = _output_emitter(to_default, self.sender, self.senders, fallback)
        elif kind == MANY:
            emit = _many_emitter(to_default if self._stream_items else None, fallback)
        elif kind == SERIALIZE and to_default is not None:
            emit = _serialized_emitter(to_default, self._serializer)  # type: ignore[arg-type]
        else:  # str, other tuples, no output topic, unsupported: as collect_outputs() documents
            emit = functools.partial(_collect, pending, self._default_topic, self._serializer, self._listener)
        self.by_type[cls] = emit
        return emit

    def _buffer_encoded(self, item: Any) -> int:
        """The shapes' fall-back: encode ``item`` into the buffer (or fail with an OutputError naming the problem)."""
        self.pending.append(to_pending(item, self._default_topic, self._serializer, self._listener))
        return 0

    def produce_pending(self, produce: Callable[[PendingOutput], None]) -> int:
        """Produce the buffered outputs in order, then clear them; returns how many.

        Each goes straight to confluent-kafka when it takes it, else through
        ``produce`` (the transactional producer's, which waits for queue
        space or raises an OutputError naming the problem).
        """
        pending = self.pending
        for out in pending:
            topic, value, key, headers, partition = out
            fast = self.direct(topic)
            if fast is not None:
                try:
                    if headers is None and partition is None:
                        fast(topic, value, key)
                    else:
                        fast(topic, value, key, -1 if partition is None else partition, headers=headers)
                    continue
                except (BufferError, KafkaException):
                    pass  # produce() waits for queue space, or classifies the error
            produce(out)
        count = len(pending)
        pending.clear()
        return count


def _collect(
    pending: list[PendingOutput], default_topic: str | None, serializer: Serializer | None, listener: str, result: Any
) -> int:
    collect_outputs(result, default_topic, serializer, listener, pending)
    return 0


def _pair_emitter(to_default: Send, fallback: Emit) -> Emit:
    def emit_pair(result: tuple[Any, ...]) -> int:
        """A ``(key, value)`` tuple for the listener's output topic."""
        if len(result) == 2:
            key, value = result
            if (type(value) is bytes or value is None) and (type(key) is bytes or key is None):
                return to_default(value, key)
        return fallback(result)

    return emit_pair


def _output_emitter(
    to_default: Send | None, sender: Callable[[str], Send], senders: dict[str, Send], fallback: Emit
) -> Emit:
    def emit_output(result: Output) -> int:
        """An Output; straight through when it names no partition and its headers are a dict with str names."""
        target = result.topic
        send = to_default if not target else senders.get(target) or sender(target)
        value, key, headers = result.value, result.key, result.headers
        if (
            send is not None
            and result.partition is None
            and (type(value) is bytes or value is None)
            and (type(key) is bytes or key is None)
        ):
            if headers is None:
                return send(value, key)
            # confluent-kafka encodes a dict's values as kafkatx would (bytes, str as UTF-8, None) and refuses
            # others, which direct_or_buffer then encodes (naming the problem); but it would turn a name 1 into
            # "1", and pairs are checked by kafkatx's encoding.
            if type(headers) is dict:
                for name in headers:
                    if type(name) is not str:
                        break
                else:
                    return send(value, key, headers)
        return fallback(result)

    return emit_output


def _many_emitter(stream_to: Send | None, fallback: Emit) -> Emit:
    def emit_many(result: Iterable[Any]) -> int:
        """An iterable: with ``stream_to`` bytes and ``(key, value)`` items go out as they come."""
        produced = 0
        for item in result:
            if item is None:
                continue
            if stream_to is not None:
                itype = type(item)
                if itype is bytes:
                    produced += stream_to(item)
                    continue
                if itype is tuple and len(item) == 2:
                    key, value = item
                    if (type(value) is bytes or value is None) and (type(key) is bytes or key is None):
                        produced += stream_to(value, key)
                        continue
            fallback(item)
        return produced

    return emit_many


def _serialized_emitter(to_default: Send, serializer: Serializer) -> Emit:
    def emit_serialized(result: Any) -> int:
        """Anything else, encoded by the listener's serializer."""
        return to_default(serialize(result, "value", serializer))

    return emit_serialized
