"""The ``process`` spans of one listener's record attempts: begun before its handler, ended after it.

Also where a sampled root record's handler runs under a stand-in span whose
SDK span is made while its transaction commits (:mod:`kafkatx.tracing._deferred`),
and where the spans a container's next transaction span links to are kept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from random import getrandbits
from typing import TYPE_CHECKING, Any

from kafkatx.context import bind_sink
from kafkatx.outputs import PendingOutput
from kafkatx.record import Output, Record
from kafkatx.tracing._headers import Headers, carries_trace, extract_context, trace_headers, with_trace
from kafkatx.tracing._links import AttemptLinks
from kafkatx.tracing._sampling import HeadSampler, RootCountdown, head_sampler

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import SpanContext, Tracer

    from kafkatx.tracing._deferred import DeferredSpans, PendingSpan

__all__ = ["MAX_TRANSACTION_LINKS", "RecordSpans", "Sink", "traced_outputs"]

#: At most this many record spans are linked from a transaction's span (OpenTelemetry's default limit of links).
MAX_TRANSACTION_LINKS = 128


class Sink(list[PendingOutput]):
    """Where ``send()`` puts a traced record's outputs until the wrapper adds the trace to them."""

    __slots__ = ("serializer",)

    def __init__(self, serializer: Any) -> None:
        super().__init__()
        self.serializer = serializer

    add = list.append


class RecordSpans:
    """The ``process`` spans of one listener's record attempts: begun before the handler, ended after it.

    Its per-record work is what the span needs and no more: the record's
    headers are extracted only when they carry a trace, the attributes that
    are the same for a partition are built once, links are looked up only
    while some record is failing; and a record :attr:`head` samples out gets
    no span at all (:mod:`kafkatx.tracing._sampling`).
    """

    def __init__(self, tracer: Tracer, attempts: AttemptLinks, listener: str, group_id: str) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry.trace import Link, SpanKind, Status, StatusCode, set_span_in_context

        self.tracer, self.attempts, self.group_id, self.listener = tracer, attempts, group_id, listener
        self._link, self._status, self._error, self._in_context = Link, Status, StatusCode.ERROR, set_span_in_context
        self._attach, self._detach, self._empty = otel_context.attach, otel_context.detach, otel_context.Context()
        self._consumer = SpanKind.CONSUMER
        self._by_partition: dict[tuple[str, int], dict[str, Any]] = {}
        #: kafkatx's own sampling decision, when the tracer's sampler allows one; None: the SDK decides per record.
        self.head: HeadSampler | None = head_sampler(tracer)
        self._unpin = self.head.ids.unpin if self.head is not None else None
        self._carried: Callable[[Headers | None], list[tuple[str, Any]] | None] = (
            self.head.carried if self.head is not None else _always_traced
        )
        #: The spans of the records handled since the container's last transaction ended, wherever they ran.
        self._recent: list[SpanContext] = []
        self._recent_lock = threading.Lock()
        #: The sampled root records' attempts whose SDK spans are made later (see :meth:`defer`); None: at once.
        self.deferred: DeferredSpans | None = None
        #: The root records sampled out next (a plain handler's wrapper, sampled at a ratio); else None.
        self.countdown: RootCountdown | None = None
        self._pending_span: type[PendingSpan] | None = None

    def defer(self) -> DeferredSpans | None:
        """From now on, a sampled root record's SDK span is made after its handler ran (kafkatx.tracing._deferred).

        Only where kafkatx samples root records itself (the record wrapper's shortcut: the SDK's samplers, W3C
        propagation, random ids): their spans' ids are then known before the SDK makes them. None where not.
        """
        head = self.head
        if head is None or not head.random_ids:
            return None
        if self.deferred is None:
            from kafkatx.tracing._deferred import DeferredSpans, PendingSpan, Pins

            self._pending_span = PendingSpan
            ids = head.ids
            self.deferred = DeferredSpans(self.tracer, Pins(ids.pin, ids.pin_span, ids.unpin), head.random_ids)
        return self.deferred

    def run_deferred(self, record: Record, call: Callable[[Record, Sink], Any], serializer: Any) -> Any:
        """Handle a sampled root record under a :class:`~kafkatx.tracing._deferred.PendingSpan`; its SDK span is
        made later. ``call(record, sink)`` runs the handler and collects its outputs into ``sink``; it returns
        None, or the handler's result when that is one value for the listener's output (bytes), or an
        awaitable the handler returned (for the runner to refuse)."""
        deferred, head, pending_span = self.deferred, self.head, self._pending_span
        assert deferred is not None and head is not None and pending_span is not None
        pending = pending_span(deferred.context(head.sampled_trace_id(), getrandbits(64) or 1))
        token = self._attach(self._in_context(pending, self._empty))
        sink = Sink(serializer)
        error: BaseException | None = None
        start = time.time_ns()
        previous = bind_sink(sink)
        try:
            result = call(record, sink)
        except BaseException as exc:
            error = exc
            raise
        finally:
            bind_sink(previous)
            end = time.time_ns()
            self._detach(token)
            key = (self.group_id, record.topic, record.partition, record.offset)
            self._attempt_ended(key, pending.get_span_context(), error)
            deferred.add(pending, f"process {record.topic}", self.attributes(record), start, end, error)
            error = None  # the exception's traceback holds this frame: kept, the two would be a reference cycle
        if result is None:
            return traced_outputs(sink, head.headers_of(pending, None)) if sink else None
        if type(result) is bytes:  # the common case: one value, encoded once, with the trace
            return Output(result, None, None, head.headers_of(pending, None))
        return result

    def _attempt_ended(self, key: tuple[str, str, int, int], span: SpanContext, error: BaseException | None) -> None:
        """An attempt's span joins its transaction's links; a failure is linked from the record's next attempt,
        a success ends the record's links."""
        if len(self._recent) < MAX_TRANSACTION_LINKS:
            with self._recent_lock:  # the container's thread, or one of its pool's, or its event loop's
                self._recent.append(span)
        if error is not None:
            self.attempts.failed(key, span)
        elif self.attempts:
            self.attempts.done(key)

    def sampled_out(self, record: Record) -> list[tuple[str, Any]] | None:
        """None if the record gets a span; else the trace headers its outputs carry on (maybe none).

        A record with a traced earlier attempt is traced again, whatever the draw: its attempts stay linked.
        """
        attempts = self.attempts
        if attempts and attempts.holds((self.group_id, record.topic, record.partition, record.offset)):
            if self.head is not None:
                self.head.pin_sampled()
            return None
        return self._carried(record.headers)

    def take_recent(self) -> list[SpanContext]:
        """The spans of the records handled since the last call (the container's transaction has ended)."""
        with self._recent_lock:
            recent, self._recent = self._recent, []
        return recent

    def attributes(self, record: Record) -> dict[str, Any]:
        """The span's attributes (messaging semantic conventions): those of its partition, built once, and its own."""
        fixed = self._by_partition.get((record.topic, record.partition))
        if fixed is None:
            fixed = self._by_partition[(record.topic, record.partition)] = {
                "messaging.system": "kafka",
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.consumer.group.name": self.group_id,
                "kafkatx.listener": self.listener,
                "messaging.destination.name": record.topic,
                "messaging.destination.partition.id": str(record.partition),
            }
        attributes = fixed.copy()
        attributes["messaging.kafka.offset"] = record.offset
        attributes["kafkatx.attempt"] = record.attempt
        return attributes

    def start(self, record: Record) -> tuple[Any, tuple[str, str, int, int], Any, Context]:
        """Begin the attempt's span and make it the current one; return it, the record's key, the token, its context."""
        key = (self.group_id, record.topic, record.partition, record.offset)
        headers = record.headers
        # Never the worker thread's own context: a record without a trace starts one.
        parent = extract_context(headers) if headers and carries_trace(headers) else self._empty
        attempts = self.attempts
        earlier = attempts.earlier(key) if attempts else None  # nothing is failing: no lock taken
        span = self.tracer.start_span(
            f"process {record.topic}",
            context=parent,
            kind=self._consumer,
            links=[self._link(c) for c in earlier] if earlier else None,
            attributes=self.attributes(record),
        )
        if self._unpin is not None:
            self._unpin()  # a trace id pinned for this span and not used (a disabled tracer) is not the next span's
        context = self._in_context(span, parent)
        # The span is the current one while the handler runs (contextvars: per thread and per asyncio task).
        return span, key, self._attach(context), context

    def finish(
        self,
        span: Any,
        key: tuple[str, str, int, int],
        token: Any,
        context: Context,
        record: Record,
        sink: Sink,
        error: BaseException | None,
    ) -> Any:
        """End the span; the handler's outputs with its trace (None if it has none, or failed)."""
        self._attempt_ended(key, span.get_span_context(), error)
        try:
            if error is not None:
                span.record_exception(error)
                span.set_status(self._status(self._error, f"{type(error).__name__}: {error}"))
                return None
            if not sink:
                return None
            head = self.head  # the span's context, with the record's baggage
            trace = trace_headers(context) if head is None else head.headers_of(span, record.headers)
            return traced_outputs(sink, trace)
        finally:
            self._detach(token)
            span.end()

    # -- batch listeners: a span per call ---------------------------------------------------------
    def start_batch(self, records: list[Record]) -> tuple[Any, Any, Context]:
        """Begin a batch call's span, linked to the traces its records carry (at most MAX_TRANSACTION_LINKS: a
        batch has no one parent), and make it the current one; return it, the token and its context."""
        from opentelemetry.trace import get_current_span

        links = []
        for record in records:
            headers = record.headers
            if headers and carries_trace(headers):
                linked = get_current_span(extract_context(headers)).get_span_context()
                if linked.is_valid:
                    links.append(self._link(linked))
                    if len(links) >= MAX_TRANSACTION_LINKS:
                        break
        first = records[0]
        attributes: dict[str, Any] = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.consumer.group.name": self.group_id,
            "kafkatx.listener": self.listener,
            "messaging.destination.name": first.topic,
            "messaging.batch.message_count": len(records),
            "messaging.kafka.offset": first.offset,
            "kafkatx.attempt": max(r.attempt for r in records),
        }
        span = self.tracer.start_span(
            f"process {first.topic}", context=self._empty, kind=self._consumer, links=links, attributes=attributes
        )
        if self._unpin is not None:
            self._unpin()
        context = self._in_context(span, self._empty)
        return span, self._attach(context), context

    def finish_batch(self, span: Any, token: Any, context: Context, sink: Sink, error: BaseException | None) -> Any:
        """End a batch call's span; the call's outputs with its trace (None if it has none, or failed)."""
        if len(self._recent) < MAX_TRANSACTION_LINKS:
            with self._recent_lock:
                self._recent.append(span.get_span_context())
        try:
            if error is not None:
                span.record_exception(error)
                span.set_status(self._status(self._error, f"{type(error).__name__}: {error}"))
                return None
            return traced_outputs(sink, trace_headers(context)) if sink else None
        finally:
            self._detach(token)
            span.end()


def _always_traced(headers: Headers | None) -> None:
    """No sampling decision of kafkatx's own: the SDK decides (a sampler kafkatx does not know)."""
    return None


def traced_outputs(sink: Sink, trace: list[tuple[str, bytes]]) -> list[Output]:
    """The outputs in ``sink``, each carrying ``trace`` instead of any trace headers of its own."""
    return [
        Output(value, key, topic, with_trace(headers, trace) if headers else trace, partition)
        for topic, value, key, headers, partition in sink
    ]
