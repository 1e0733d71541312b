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
from typing import Any

from confluent_kafka import KafkaException

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
    "Emit",
    "Produce",
    "REFUSED",
    "REFUSED_WITH_HEADERS",
    "ResultEmitters",
    "buffer_output",
    "produce_in_order",
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


# -- producing what a handler returned, in its transaction ---------------------------------------------------------
#
# The produce-or-buffer rule: a record that needs no encoding goes straight to confluent-kafka's ``produce`` when
# its topic was looked up and nothing is buffered before it (order is kept); otherwise, or when confluent-kafka
# refuses it, it waits in the buffer (buffer_output) for the runner's buffered produce (ResultEmitters.flush_to). Each emit
# function, and send(), calls ``produce`` itself, in its own ``try``: a Python call costs up to a tenth of a
# record's handling (bench/micro_hot_path.py --callgrind), so the fast path calls no helper.

#: confluent-kafka's ``Producer.produce`` (for a topic that exists, in an open transaction).
Produce = Callable[..., Any]
#: Produces (or buffers) one handler result of a given shape; returns how many records it produced now.
Emit = Callable[[Any], int]

#: What confluent-kafka's ``produce`` raises for a record the buffered produce can still handle: it waits for
#: queue space (BufferError) and classifies the error (KafkaException).
REFUSED = (BufferError, KafkaException)
#: The same, plus what confluent-kafka raises for a key, value or header value it cannot take as is: anything but
#: bytes, str and None (TypeError), or a str that is not valid UTF-8 (ValueError). Such a record is then encoded by
#: kafkatx (the serializer, or an error naming the problem). confluent-kafka encodes a str as UTF-8, as
#: :func:`encode` does, so the emit functions pass keys and values to it unchecked.
REFUSED_WITH_HEADERS = (BufferError, KafkaException, TypeError, ValueError)


def produce_in_order(
    outputs: Iterable[tuple[str, bytes | None, bytes | None, Any, int | None]],
    direct: Callable[[str], Produce | None],
    produce: Callable[[Any], None],
) -> int:
    """Produce encoded ``outputs`` in order; returns how many went straight to confluent-kafka.

    Each goes to the topic's ``direct`` produce when there is one and it takes
    the record, else to ``produce`` (the transactional producer's, which waits
    for queue space or raises an OutputError naming the problem), so that a
    full queue or a refusal never reorders them.
    """
    directs: dict[str, Produce | None] = {}
    sent = 0
    for out in outputs:
        topic, value, key, headers, partition = out
        fast = directs[topic] if topic in directs else directs.setdefault(topic, direct(topic))
        if fast is not None:
            try:
                if headers is None and partition is None:
                    fast(topic, value, key)
                else:
                    fast(topic, value, key, -1 if partition is None else partition, headers=headers)
                sent += 1
                continue
            except REFUSED:
                pass  # produce() waits for queue space, or classifies the error
        produce(out)
    return sent


def buffer_output(
    pending: list[PendingOutput], topic: str, value: bytes | None, key: bytes | None = None, headers: Any = None
) -> int:
    """The rule's fallback, shared by every emit function and ``send()``: the record waits in ``pending``.

    Returns 0, the records produced now. ``headers`` (None or a dict with
    str names) are encoded here, after the ``except`` block that caught
    confluent-kafka's refusal, so a bad header's OutputError names the
    header and does not chain to the refusal.
    """
    encoded = None if headers is None else encode_headers(headers)
    pending.append((topic, value, key, encoded, None))
    return 0


class PartlyProducedError(Exception):
    """Internal: an output was refused after the same record's earlier outputs went into the transaction."""

    def __init__(self, error: OutputError) -> None:
        super().__init__(error)
        self.error = error


class ResultEmitters:
    """Produces what a handler returned, by one small function per result shape, for one transaction.

    :meth:`emitter` picks the function for a result's type the first time
    the type is seen (:func:`result_kind`, cached per listener in ``kinds``)
    and keeps it in ``by_type``; each one produces what needs no encoding by
    the produce-or-buffer rule (see :func:`buffer_output`) and encodes the
    rest into ``pending`` with :func:`to_pending` (a bad result fails its
    record with an OutputError). An iterable's items wait in ``pending``
    until the handler returned (a failing handler's items are dropped with
    it), as what it ``send()``\\ s does; :meth:`flush_to` makes the function that produces
    them. ``directs`` (topic -> confluent-kafka's ``produce``, or None)
    holds the topics looked up so far.
    """

    __slots__ = (
        "_default_topic",
        "_serializer",
        "_listener",
        "_direct_for",
        "_kinds",
        "pending",
        "directs",
        "by_type",
    )

    def __init__(
        self,
        default_topic: str | None,
        serializer: Serializer | None,
        listener: str,
        pending: list[PendingOutput],
        direct_for: Callable[[str], Produce | None],
        *,
        kinds: dict[type, int],
    ) -> None:
        self._default_topic, self._serializer, self._listener = default_topic, serializer, listener
        self._direct_for, self._kinds = direct_for, kinds
        self.pending = pending
        self.directs: dict[str, Produce | None] = {}
        self.by_type: dict[type, Emit] = {}
        if default_topic is not None:
            self.direct(default_topic)

    def direct(self, topic: str) -> Produce | None:
        """confluent-kafka's ``produce`` for ``topic`` (None if it cannot take it), looked up once."""
        directs = self.directs
        if topic in directs:
            return directs[topic]
        produce = directs[topic] = self._direct_for(topic)
        return produce

    def emitter(self, cls: type) -> Emit:
        """The function producing a result of type ``cls`` (chosen once per type, then kept in ``by_type``)."""
        known = self.by_type.get(cls)
        if known is not None:
            return known
        kind = self._kinds.get(cls)
        if kind is None:
            kind = self._kinds[cls] = result_kind(cls, self._serializer)
        topic = self._default_topic or ""  # "" when the listener has no output topic: never looked up
        produce, pending, fallback = self.directs.get(topic), self.pending, self._buffer_encoded
        emit: Emit
        if produce is not None and cls is bytes:
            emit = _value_emitter(produce, pending, topic)
        elif produce is not None and cls is tuple:
            emit = _pair_emitter(produce, pending, topic, fallback)
        elif kind == OUTPUT:
            emit = _output_emitter(topic, produce, self.directs, self.direct, pending, fallback)
        elif kind == MANY:
            emit = _many_holder(pending, topic, fallback)
        elif kind == SERIALIZE and produce is not None:
            emit = _serialized_emitter(produce, pending, topic, self._serializer)  # type: ignore[arg-type]
        else:  # str, other tuples, an output topic not taken directly, unsupported: as collect_outputs() documents
            emit = functools.partial(_collect, pending, self._default_topic, self._serializer, self._listener)
        self.by_type[cls] = emit
        return emit

    def close(self) -> None:
        """The transaction is over: drop the emit functions, which refer back to this object (its ``direct`` and
        fall-back). Left to the garbage collector, that cycle would hold the transaction's unit and every
        consumed Message of it until the next full enough collection."""
        self.by_type.clear()
        self.directs.clear()

    def _buffer_encoded(self, item: Any) -> int:
        """The shapes' fall-back: encode ``item`` into the buffer (or fail with an OutputError naming the problem)."""
        self.pending.append(to_pending(item, self._default_topic, self._serializer, self._listener))
        return 0

    def flush_to(self, produce: Callable[[PendingOutput], None]) -> Callable[[], int]:
        """The function producing the buffered outputs, in order, then clearing them; it returns how many.

        The runner calls it after each handler call that buffered something.
        Each output goes straight to confluent-kafka when it takes it, else
        through ``produce`` (the transactional producer's, which waits for
        queue space or raises an OutputError naming the problem), so that a
        full queue or a refusal never reorders them. The topics looked up
        stay in ``directs``.
        """
        pending, directs, direct = self.pending, self.directs, self.direct

        def flush() -> int:
            for out in pending:
                topic, value, key, headers, partition = out
                fast = directs[topic] if topic in directs else direct(topic)
                if fast is not None:
                    try:
                        if headers is None and partition is None:
                            fast(topic, value, key)
                        else:
                            fast(topic, value, key, -1 if partition is None else partition, headers=headers)
                        continue
                    except REFUSED:
                        pass  # produce() waits for queue space, or classifies the error
                try:
                    produce(out)
                except OutputError as exc:
                    if out is not pending[0]:  # the record's outputs before it are in the transaction already
                        raise PartlyProducedError(exc) from exc
                    raise
            count = len(pending)
            pending.clear()
            return count

        return flush


def _collect(
    pending: list[PendingOutput], default_topic: str | None, serializer: Serializer | None, listener: str, result: Any
) -> int:
    collect_outputs(result, default_topic, serializer, listener, pending)
    return 0


def _value_emitter(produce: Produce, pending: list[PendingOutput], topic: str) -> Emit:
    def emit_value(value: bytes) -> int:
        """Bytes for the listener's output topic."""
        if not pending:
            try:
                produce(topic, value)
                return 1
            except REFUSED:
                pass
        return buffer_output(pending, topic, value)

    return emit_value


def _pair_emitter(produce: Produce, pending: list[PendingOutput], topic: str, fallback: Emit) -> Emit:
    def emit_pair(result: tuple[Any, ...]) -> int:
        """A ``(key, value)`` tuple for the listener's output topic; encoded by ``fallback`` unless confluent-kafka takes it."""
        if not pending:
            try:
                key, value = result  # ValueError unless a pair: fallback() names the problem
                produce(topic, value, key)
                return 1
            except REFUSED_WITH_HEADERS:
                pass
        return fallback(result)

    return emit_pair


def _output_emitter(
    default_topic: str,
    default_produce: Produce | None,
    directs: dict[str, Produce | None],
    direct: Callable[[str], Produce | None],
    pending: list[PendingOutput],
    fallback: Emit,
) -> Emit:
    def emit_output(result: Output) -> int:
        """An Output; as it is when it names no partition and its headers are None or a dict with str names.

        confluent-kafka encodes keys, values and a dict's header values as
        kafkatx would (bytes, str as UTF-8, None) and refuses others, which
        ``fallback`` then encodes into the buffer (naming the problem); but it
        would turn a header name 1 into "1", and pairs are checked by
        kafkatx's encoding. An Output for the listener's own topic
        (``topic=None``, the usual case) finds its ``produce`` at hand.
        """
        topic, value, key, headers = result.topic, result.value, result.key, result.headers
        if not topic:
            topic, produce = default_topic, default_produce
        else:
            produce = directs[topic] if topic in directs else direct(topic)
        if produce is None or pending or result.partition is not None:
            return fallback(result)
        if headers is not None:
            if type(headers) is not dict:
                return fallback(result)
            for name in headers:
                if type(name) is not str:
                    return fallback(result)
        try:
            if headers is None:
                produce(topic, value, key)
            else:
                produce(topic, value, key, headers=headers)
            return 1
        except REFUSED_WITH_HEADERS:
            pass
        return fallback(result)  # outside the except block: kafkatx's error does not chain to confluent-kafka's

    return emit_output


def _many_holder(pending: list[PendingOutput], topic: str, fallback: Emit) -> Emit:
    append = pending.append

    def hold_many(result: Iterable[Any]) -> int:
        """An iterable's items, held in the buffer until the handler returned (dropped if it raises): bytes and
        ``(key, value)`` of bytes as they are, anything else encoded by ``fallback``."""
        for item in result:
            itype = type(item)
            if itype is bytes and topic:
                append((topic, item, None, None, None))
                continue
            if itype is tuple and topic and len(item) == 2:
                key, value = item
                if (type(value) is bytes or value is None) and (type(key) is bytes or key is None):
                    append((topic, value, key, None, None))
                    continue
            if item is not None:
                fallback(item)
        return 0

    return hold_many


def _serialized_emitter(produce: Produce, pending: list[PendingOutput], topic: str, serializer: Serializer) -> Emit:
    def emit_serialized(result: Any) -> int:
        """Anything else, encoded by the listener's serializer."""
        value = serialize(result, "value", serializer)
        if not pending:
            try:
                produce(topic, value)
                return 1
            except REFUSED:
                pass
        return buffer_output(pending, topic, value)

    return emit_serialized
