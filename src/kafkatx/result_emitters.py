"""Producing what a handler returned, in its transaction: one emit function per result shape, and a record's
held outputs.

The produce-or-hold rule: a record that needs no encoding goes straight to
confluent-kafka's ``produce`` when its topic was looked up and nothing is held
before it (order is kept); otherwise, or when confluent-kafka refuses it, it
waits in the record's :class:`HeldOutputs` (buffer_output) for the runner's
buffered produce (ResultEmitters.flush_to). Each emit function calls
``produce`` itself, in its own ``try``: a Python call costs up to a tenth of a
record's handling (bench/micro_hot_path.py --callgrind), so the fast path
calls no helper. What a handler ``send()``\\ s, and an iterable's items, are
held until the handler returned (a failed call produces none of them); an
iterable read whole is produced in one pass where it can be (see
:func:`_many_emitter`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from operator import length_hint
from typing import Any, Protocol

from confluent_kafka import KafkaException

from kafkatx.errors import OutputError
from kafkatx.outputs import (
    MANY,
    OUTPUT,
    SERIALIZE,
    PendingOutput,
    Serializer,
    collect_outputs,
    encode_headers,
    result_kind,
    serialize,
    to_pending,
)
from kafkatx.record import Output

__all__ = [
    "Emit",
    "Flush",
    "HeldOutputs",
    "PartlyProducedError",
    "Produce",
    "REFUSED",
    "REFUSED_WITH_HEADERS",
    "ResultEmitters",
    "buffer_output",
    "produce_in_order",
]

#: confluent-kafka's ``Producer.produce`` (for a topic that exists, in an open transaction).
Produce = Callable[..., Any]


class Flush(Protocol):
    """Produces a record's held outputs, in order, then clears them; returns how many. ``partly``: outputs of
    the same record went out before these (a refused one then aborts the transaction)."""

    def __call__(self, partly: bool = False) -> int: ...


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


class HeldOutputs(list[PendingOutput]):
    """A record's outputs until its handler returned, produced then, dropped if it raised: what it ``send()``\\ s
    (``send()`` calls ``add``) and an iterable's items that could not go out at once, in order.

    ``add`` is an attribute, not a method: an iterable's emit function
    replaces it while it reads the items (:func:`_many_emitter`), so that what
    the handler sends meanwhile is told apart from the items (:class:`_Sent`)
    and keeps its place among them.
    """

    __slots__ = ("serializer", "add")

    def __init__(self, serializer: Serializer | None = None) -> None:
        super().__init__()
        self.serializer = serializer
        self.add: Callable[[PendingOutput], None] = self.append


class _Sent:
    """An output ``send()`` held while an iterable's items were read: not one of its items."""

    __slots__ = ("output",)

    def __init__(self, output: PendingOutput) -> None:
        self.output = output


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
    record with an OutputError). What the handler ``send()``\\ s waits in
    ``pending`` (a :class:`HeldOutputs`) until it returned, and so do an
    iterable's items that cannot go out in one pass; :attr:`flush` produces
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
        "flush",
    )

    def __init__(
        self,
        default_topic: str | None,
        serializer: Serializer | None,
        listener: str,
        pending: HeldOutputs,
        direct_for: Callable[[str], Produce | None],
        produce: Callable[[PendingOutput], None],
        *,
        kinds: dict[type, int],
    ) -> None:
        self._default_topic, self._serializer, self._listener = default_topic, serializer, listener
        self._direct_for, self._kinds = direct_for, kinds
        self.pending = pending
        self.directs: dict[str, Produce | None] = {}
        self.by_type: dict[type, Emit] = {}
        #: Produces the held outputs, in order, then clears them; returns how many (see :meth:`_flusher`).
        self.flush = self._flusher(produce)
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
            emit = _many_emitter(pending, topic, produce, fallback, self.flush)
        elif kind == SERIALIZE and produce is not None:
            emit = _serialized_emitter(produce, pending, topic, self._serializer)  # type: ignore[arg-type]
        else:  # str, other tuples, an output topic not taken directly, unsupported: as collect_outputs() documents
            emit = functools.partial(_collect, pending, self._default_topic, self._serializer, self._listener)
        self.by_type[cls] = emit
        return emit

    def close(self) -> None:
        """The transaction is over: drop the emit functions and the flush, which refer back to this object (its
        ``direct`` and fall-back). Left to the garbage collector, that cycle would hold the transaction's unit and
        every consumed Message of it until the next full enough collection."""
        self.by_type.clear()
        self.directs.clear()
        self.flush = _closed

    def _buffer_encoded(self, item: Any) -> int:
        """The shapes' fall-back: encode ``item`` into the buffer (or fail with an OutputError naming the problem)."""
        self.pending.append(to_pending(item, self._default_topic, self._serializer, self._listener))
        return 0

    def _flusher(self, produce: Callable[[PendingOutput], None]) -> Flush:
        """The function producing the held outputs, in order, then clearing them; it returns how many.

        The runner calls it after each handler call that held something;
        ``partly`` says that outputs of the same record went out before these.
        Each output goes straight to confluent-kafka when it takes it, else
        through ``produce`` (the transactional producer's, which waits for
        queue space or raises an OutputError naming the problem), so that a
        full queue or a refusal never reorders them. The topics looked up
        stay in ``directs``.
        """
        pending, directs, direct = self.pending, self.directs, self.direct

        def flush(partly: bool = False) -> int:
            for out in pending:
                topic, value, key, headers, partition = out
                fast = directs.get(topic) or direct(topic)
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
                    if partly or out is not pending[0]:  # the record's outputs before it are in the transaction
                        raise PartlyProducedError(exc) from exc
                    raise
            count = len(pending)
            pending.clear()
            return count

        return flush


def _closed(partly: bool = False) -> int:
    """The flush of a closed ResultEmitters: its transaction is over."""
    raise RuntimeError("the transaction's outputs were produced already")


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


def _many_emitter(held: HeldOutputs, topic: str, produce: Produce | None, fallback: Emit, flush: Flush) -> Emit:
    """The emit function of an iterable (a list, a generator...).

    Its items are read whole first (``list.extend`` in C), so that a generator
    failing half-way produces none of them; what the handler ``send()``\\ s
    meanwhile is marked (:class:`_Sent`) and keeps its place. When nothing was
    held before them, bytes and ``(key, value)`` items for the listener's
    topic then go to confluent-kafka in one pass; from the first other item,
    or the first it refuses (a key or value it cannot take, a full queue),
    the rest are encoded and produced at once. If one of those cannot be
    encoded, the record's earlier items are in the transaction already, so
    its failure aborts it (as an output the client refuses half-way does).
    """
    append, extend = held.append, held.extend

    def mark_sent(output: PendingOutput) -> None:
        append(_Sent(output))  # type: ignore[arg-type]

    def emit_many(result: Iterable[Any]) -> int:
        start = len(held)
        held.add = mark_sent
        try:
            extend(result)
        finally:
            held.add = append
        if start or produce is None:  # after what the handler sent before it, or no direct produce: held in order
            _hold_items(held, start, topic, fallback)
            return 0
        items: Iterator[Any] = iter(held)
        try:
            for item in items:
                if type(item) is tuple:
                    key, value = item  # ValueError unless a pair: refused, and named by the fall-back
                    produce(topic, value, key)
                elif type(item) is bytes:
                    produce(topic, item)
                else:
                    break
            else:
                count = len(held)
                held.clear()
                return count
        except REFUSED_WITH_HEADERS:
            pass
        done = len(held) - length_hint(items) - 1  # the items before this one went out
        return done + _produce_rest(held, done, topic, fallback, flush)

    return emit_many


def _hold_items(held: HeldOutputs, start: int, topic: str, fallback: Emit) -> None:
    """Turn what was read into ``held`` from ``start`` on into held outputs, in order: bytes and ``(key, value)``
    of bytes as they are, what ``send()`` added meanwhile unwrapped, anything else encoded by ``fallback`` (which
    appends to ``held``)."""
    items: list[Any] = held[start:]
    del held[start:]
    append = held.append
    for item in items:
        itype = type(item)
        if itype is bytes and topic:
            append((topic, item, None, None, None))
            continue
        if itype is tuple and topic and len(item) == 2:
            key, value = item
            if (type(value) is bytes or value is None) and (type(key) is bytes or key is None):
                append((topic, value, key, None, None))
                continue
        if itype is _Sent:
            append(item.output)
        elif item is not None:
            fallback(item)


def _produce_rest(held: HeldOutputs, done: int, topic: str, fallback: Emit, flush: Flush) -> int:
    """An iterable's item ``done`` was refused, after the items before it went out: the rest is encoded and
    produced now (the producer waits for queue space, or names the problem)."""
    del held[:done]
    try:
        _hold_items(held, 0, topic, fallback)
    except OutputError as exc:
        if done:
            raise PartlyProducedError(exc) from exc
        raise
    return flush(done > 0)


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
