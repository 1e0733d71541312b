"""OpenTelemetry tracing of record processing: ``App(tracing=True)``; off by default, and then nothing is added.

With tracing on, ``App.start`` gives its containers a copy of each listener
whose handler is wrapped once (:meth:`Tracing.wrap`): with tracing off the
record runner's hot path pays one test per record. At a ratio, the runner
itself runs the root records the sampler leaves out with the listener's own
handler (:class:`~kafkatx.trace_sampling.RootCountdown`, which it holds while
it handles a unit). The wrapper, per record attempt:

- extracts the W3C ``traceparent`` (``tracestate``, ``baggage``) of the
  record's headers: the parent of its ``process`` span (OpenTelemetry's
  messaging semantic conventions), a root span when it has none;
- links the span to the spans of the record's earlier attempts (kept in
  memory per record by :class:`AttemptLinks` until the record succeeds or is
  recovered: across a restart the links are lost, the trace is not, as its
  parent comes from the record's header);
- collects what the handler returns and ``send()``\\ s and writes the span's
  context into each output's headers, so outputs carry the record's trace.

A dead-letter record gets the context of the record's last attempt
(:func:`dead_letter_trace_headers`, called by the DLQ publisher), so the
dead letter, and a later ``kafkatx dlq replay`` of it (which keeps headers),
stay in the same trace. A span per transaction (records, outcome: committed,
aborted or recovered) is made from the container's events.

With a sampler of the SDK's standard ones, kafkatx decides a record's
sampling itself before any OpenTelemetry call (:mod:`kafkatx.trace_sampling`):
a record sampled out costs next to nothing, which is what makes tracing
affordable on a busy listener (``ParentBased(TraceIdRatioBased(0.01))``).
The SDK span of a root record it sampled in is made while the record's
transaction commits, when the container thread waits on the broker
(:mod:`kafkatx.trace_deferred`); the handler runs under a stand-in with the
span's context meanwhile.

The span context is carried by ``contextvars`` (OpenTelemetry's context),
never a thread-local: concurrent handlers (``in_flight > 1``, ``async def``)
each see their own record's span.
"""

from __future__ import annotations

import threading
import time
import types
import weakref
from collections.abc import Callable, Mapping
from random import getrandbits
from typing import TYPE_CHECKING, Any, Protocol

from kafkatx.context import bind_sink
from kafkatx.errors import InvalidConfigurationError
from kafkatx.events import Event, RecordRecovered, TransactionAborted, TransactionCommitted
from kafkatx.outputs import PendingOutput, collect_outputs
from kafkatx.record import Output, Record
from kafkatx.trace_headers import (
    TRACE_HEADERS,
    HeaderGetter,
    Headers,
    HeaderSetter,
    carries_trace,
    extract_context,
    trace_headers,
    with_trace,
)
from kafkatx.trace_links import AttemptLinks
from kafkatx.trace_sampling import ALWAYS_SAMPLED, HeadSampler, RootCountdown, head_sampler, root_gap

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import SpanContext, Tracer, TracerProvider

    from kafkatx.trace_deferred import DeferredSpans, PendingSpan

__all__ = [
    "TRACE_HEADERS",
    "AttemptLinks",
    "HeaderGetter",
    "HeaderSetter",
    "RootCountdown",
    "TracedListener",
    "check_tracing_option",
    "Tracing",
    "dead_letter_trace_headers",
    "extract_context",
    "require_opentelemetry",
    "trace_headers",
    "with_trace",
]


def require_opentelemetry() -> None:
    """Raise a clear error naming the extra when ``opentelemetry-api`` is not installed."""
    try:
        import opentelemetry.trace  # noqa: F401
    except ImportError as exc:
        raise InvalidConfigurationError(
            "App(tracing=...) needs OpenTelemetry: pip install 'kafkatx[otel]' (opentelemetry-api), "
            "and an OpenTelemetry SDK configured by your application"
        ) from exc


def check_tracing_option(tracing: object) -> None:
    """``App(tracing=...)``: False, True, or an OpenTelemetry ``TracerProvider``; the API installed unless False."""
    if tracing is False:
        return
    if tracing is not True and not callable(getattr(tracing, "get_tracer", None)):
        raise InvalidConfigurationError(
            f"tracing= takes True, False or an OpenTelemetry TracerProvider, got {type(tracing).__name__} {tracing!r}"
        )
    require_opentelemetry()


#: What a plain handler returns when it is an ``async def`` in disguise: handed on as it is, for the runner to refuse.
_AWAITABLES = (types.CoroutineType, types.AsyncGeneratorType)


class TracedListener(Protocol):
    """What the wrapper needs of a listener's declaration (a ``ListenerSpec``)."""

    @property
    def name(self) -> str: ...
    @property
    def handler(self) -> Callable[..., Any]: ...
    @property
    def output(self) -> str | None: ...
    @property
    def serializer(self) -> Any: ...
    @property
    def is_async(self) -> bool: ...
    @property
    def concurrency(self) -> int: ...


class _Sink(list[PendingOutput]):
    """Where ``send()`` puts a traced record's outputs until the wrapper adds the trace to them."""

    __slots__ = ("serializer",)

    def __init__(self, serializer: Any) -> None:
        super().__init__()
        self.serializer = serializer

    add = list.append


class Tracing:
    """The tracer of one App, its attempt links, and the spans it makes from the containers' events."""

    def __init__(self, provider: TracerProvider | None = None) -> None:
        require_opentelemetry()
        from opentelemetry import trace

        from kafkatx._version import __version__

        self.tracer: Tracer = trace.get_tracer("kafkatx", __version__, tracer_provider=provider)
        self.attempts = AttemptLinks()
        #: (listener, worker) whose last after-rollback transaction recovered a record: its commit is "recovered".
        self._recovered: set[tuple[str, int]] = set()
        #: The consumer group of each traced listener, by name (to end a recovered record's links).
        self._groups: dict[str, str] = {}
        #: The record spans of each container, by its name (for its transaction spans' links).
        self._containers: dict[str, _RecordSpans] = {}
        _active.add(self)

    # -- record attempts ----------------------------------------------------------------------
    def wrap(self, spec: TracedListener, group_id: str, worker: int = 0) -> Callable[[Record], Any]:
        """``spec``'s handler as its container ``worker`` runs it, each call in a ``process`` span."""
        self._groups[spec.name] = group_id
        spans = _RecordSpans(self.tracer, self.attempts, spec.name, group_id)
        # The container's name, as its events give it: its transactions link the spans of its records.
        self._containers[_container_name(spec, worker)] = spans
        return _traced_async(spec, spans) if spec.is_async else _traced(spec, spans)

    def defer_spans(self, spec: TracedListener, worker: int = 0) -> Callable[[], None] | None:
        """Make the SDK spans of the sampled root records of ``spec``'s container ``worker`` after their handler
        ran (:mod:`kafkatx.trace_deferred`); returns what makes them, for the container to call while each
        transaction commits. None when kafkatx does not decide the sampling itself (the SDK then decides, per
        record, as before)."""
        spans = self._containers.get(_container_name(spec, worker))
        if spans is None:
            return None
        deferred = spans.defer()
        return deferred.make if deferred is not None else None

    def untraced_roots(self, spec: TracedListener, worker: int = 0) -> RootCountdown | None:
        """The countdown of the root records that ``spec``'s container ``worker`` runs untraced, for its record
        runner to hold (``ListenerSpec.untraced_roots``); None where kafkatx does not sample roots at a ratio."""
        spans = self._containers.get(_container_name(spec, worker))
        return spans.countdown if spans is not None else None

    def flush(self) -> None:
        """Make the SDK spans of every record attempt still waiting for its transaction (the App stops)."""
        for spans in list(self._containers.values()):
            if spans.deferred is not None:
                spans.deferred.make()

    def dead_letter_headers(self, group_id: str, record: Record) -> list[tuple[str, bytes]] | None:
        """The trace headers of ``record``'s last attempt (for its dead letter); None if this tracer has none."""
        key = (group_id, record.topic, record.partition, record.offset)
        last = self.attempts.last(key)
        if last is None:
            return None
        from opentelemetry.trace import NonRecordingSpan, set_span_in_context

        parent = extract_context(record.headers)  # keeps the record's baggage
        # The links end with the RecordRecovered event, not here: a dead letter whose publication fails is tried again.
        return trace_headers(set_span_in_context(NonRecordingSpan(last), parent))

    # -- transactions -------------------------------------------------------------------------
    def subscribe(self, subscribe: Callable[[type[Any], Callable[[Any], None]], None]) -> None:
        """Make a span of each transaction from the containers' events (``app.events.subscribe``)."""
        subscribe(RecordRecovered, self._on_recovered)
        subscribe(TransactionCommitted, self._on_committed)
        subscribe(TransactionAborted, self._on_aborted)

    def _on_recovered(self, event: RecordRecovered) -> None:
        self._recovered.add((event.listener, event.worker))
        record = event.record
        # A container of a listener with concurrency > 1 is named "<listener>#<worker>".
        group = self._groups.get(event.listener) or self._groups.get(event.listener.rpartition("#")[0])
        if record is not None and group is not None:  # whatever the recoverer was, nothing links to it any more
            self.attempts.done((group, record.topic, record.partition, record.offset))

    def _on_committed(self, event: TransactionCommitted) -> None:
        key = (event.listener, event.worker)
        outcome = "committed"
        if key in self._recovered:
            self._recovered.discard(key)
            outcome = "recovered"
        self._transaction_span(event, outcome, event.records, event.seconds, kind=event.kind)

    def _on_aborted(self, event: TransactionAborted) -> None:
        self._transaction_span(event, "aborted", event.records, 0.0, reason=event.reason)

    def _transaction_span(self, event: Event, outcome: str, records: int, seconds: float, **extra: str) -> None:
        end = time.time_ns()
        spans = self._containers.get(event.listener)
        deferred = spans.deferred if spans is not None else None
        if deferred is not None:
            deferred.make()  # its records' spans first (most were made while it committed)
        recent = spans.take_recent() if spans is not None else None  # its records' spans since its last transaction
        head = spans.head if spans is not None else None
        if head is not None and head.bound < ALWAYS_SAMPLED and not (recent and head.bound):
            return  # sampled at a ratio and none of its records was: no span, no SDK call
        attributes: dict[str, Any] = {
            "messaging.system": "kafka",
            "messaging.batch.message_count": records,
            "kafkatx.listener": event.listener,
            "kafkatx.worker": event.worker,
            "kafkatx.transaction.outcome": outcome,
        }
        attributes.update({f"kafkatx.transaction.{k}": v for k, v in extra.items() if v})
        start, name = end - int(seconds * 1e9), "kafkatx transaction"
        if deferred is not None and head is not None:  # where its records' spans go straight to the processors
            if deferred.record_directly(name, head.sampled_trace_id(), attributes, recent or (), start, end):
                return
        from opentelemetry.trace import Link

        if head is not None:
            head.pin_sampled()  # its trace id is one the ratio samples: the SDK's sampler agrees
        links = [Link(c) for c in recent] if recent else None
        span = self.tracer.start_span(name, start_time=start, attributes=attributes, links=links)
        if head is not None:
            head.ids.unpin()
        span.end(end_time=end)


class _RecordSpans:
    """The ``process`` spans of one listener's record attempts: begun before the handler, ended after it.

    Its per-record work is what the span needs and no more: the record's
    headers are extracted only when they carry a trace, the attributes that
    are the same for a partition are built once, links are looked up only
    while some record is failing; and a record :attr:`head` samples out gets
    no span at all (:mod:`kafkatx.trace_sampling`).
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
        """From now on, a sampled root record's SDK span is made after its handler ran (kafkatx.trace_deferred).

        Only where kafkatx samples root records itself (the record wrapper's shortcut: the SDK's samplers, W3C
        propagation, random ids): their spans' ids are then known before the SDK makes them. None where not.
        """
        head = self.head
        if head is None or not head.random_ids:
            return None
        if self.deferred is None:
            from kafkatx.trace_deferred import DeferredSpans, PendingSpan, Pins

            self._pending_span = PendingSpan
            ids = head.ids
            self.deferred = DeferredSpans(self.tracer, Pins(ids.pin, ids.pin_span, ids.unpin), head.random_ids)
        return self.deferred

    def run_deferred(self, record: Record, call: Callable[[Record, _Sink], Any], serializer: Any) -> Any:
        """Handle a sampled root record under a :class:`~kafkatx.trace_deferred.PendingSpan`; its SDK span is
        made later. ``call(record, sink)`` runs the handler and collects its outputs into ``sink``; it returns
        None, or the handler's result when that is one value for the listener's output (bytes), or an
        awaitable the handler returned (for the runner to refuse)."""
        deferred, head, pending_span = self.deferred, self.head, self._pending_span
        assert deferred is not None and head is not None and pending_span is not None
        pending = pending_span(deferred.context(head.sampled_trace_id(), getrandbits(64) or 1))
        token = self._attach(self._in_context(pending, self._empty))
        sink = _Sink(serializer)
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
        if result is None:
            return _traced_outputs(sink, head.headers_of(pending, None)) if sink else None
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
        sink: _Sink,
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
            return _traced_outputs(sink, trace)
        finally:
            self._detach(token)
            span.end()


def _container_name(spec: TracedListener, worker: int) -> str:
    """A container's name as its events give it: ``<listener>#<worker>`` when the listener has several."""
    return spec.name if spec.concurrency == 1 else f"{spec.name}#{worker}"


def _always_traced(headers: Headers | None) -> None:
    """No sampling decision of kafkatx's own: the SDK decides (a sampler kafkatx does not know)."""
    return None


def _traced_outputs(sink: _Sink, trace: list[tuple[str, bytes]]) -> list[Output]:
    """The outputs in ``sink``, each carrying ``trace`` instead of any trace headers of its own."""
    return [
        Output(o.value, o.key, o.topic, with_trace(o.headers, trace) if o.headers else trace, o.partition) for o in sink
    ]


def _traced(spec: TracedListener, spans: _RecordSpans) -> Callable[[Record], Any]:
    """A plain handler in its record's span: what it returns and sends comes back as outputs with the trace."""
    handler, output, serializer, listener = spec.handler, spec.output, spec.serializer, spec.name
    start, finish = spans.start, spans.finish
    carried = spans.sampled_out if spans.head is not None else None
    bound, pin_sampled, failing = _root_shortcut(spans)
    countdown = RootCountdown(handler, failing, root_gap(bound) if bound is not None else 0)
    if bound is not None and bound < ALWAYS_SAMPLED:  # the record runner may hold the countdown (UntracedRoots)
        spans.countdown = countdown

    def collect(record: Record, sink: _Sink) -> Any:
        """Run the handler; what it returns joins what it sent in ``sink``. Returned instead: one value for the
        listener's output (bytes, the common case, encoded once), or an awaitable (refused by the runner)."""
        result = handler(record)
        if type(result) is bytes and output is not None and not sink:
            return result
        if isinstance(result, _AWAITABLES):
            return result
        collect_outputs(result, output, serializer, listener, sink)
        return None

    def sampled_out(record: Record, trace: list[tuple[str, bytes]]) -> Any:
        """No span: the outputs only carry the trace (and its decision) on."""
        sink = _Sink(serializer)
        previous = bind_sink(sink)
        try:
            result = handler(record)
            if type(result) is bytes and output is not None and not sink:  # the common case, without the list
                return Output(result, None, None, trace)
            if isinstance(result, _AWAITABLES):  # an async def behind a def: the runner refuses it
                return result
            collect_outputs(result, output, serializer, listener, sink)
        finally:
            bind_sink(previous)
        return _traced_outputs(sink, trace) if sink else None

    def traced(record: Record) -> Any:
        """The record wrapper: its first test is all a root record the ratio samples out costs (most records,
        unless the record runner holds the countdown and calls the handler itself)."""
        if countdown.skip and not record.headers and not failing:
            countdown.skip -= 1
            return handler(record)  # sampled out: tracing off for this record
        return decided(record)

    def decided(record: Record) -> Any:
        if carried is not None:
            if bound is not None and not failing and not record.headers:  # a root record the ratio samples in
                countdown.skip = root_gap(bound)
                if spans.deferred is not None:  # its SDK span is made while its transaction commits
                    return spans.run_deferred(record, collect, serializer)
                pin_sampled()  # the SDK's span gets a trace id the ratio samples: its sampler agrees
            else:
                trace = carried(record)
                if trace is not None:  # sampled out: nothing to carry on is tracing off for this record
                    return sampled_out(record, trace) if trace else handler(record)
        span, key, token, context = start(record)
        sink = _Sink(serializer)
        error: BaseException | None = None
        previous = bind_sink(sink)
        try:
            result = handler(record)
            if isinstance(result, _AWAITABLES):
                return result
            collect_outputs(result, output, serializer, listener, sink)
        except BaseException as exc:
            error = exc
            raise
        finally:
            bind_sink(previous)
            outputs = finish(span, key, token, context, record, sink, error)
        return outputs

    return traced


def _root_shortcut(spans: _RecordSpans) -> tuple[int | None, Callable[[], bool], Mapping[Any, Any]]:
    """What the record wrapper needs to decide a root record itself: the ratio's bound (None: it cannot, e.g.
    the ids are not the SDK's random ones), the pin of a sampled trace id, the failing records."""
    head = spans.head
    if head is None or not head.random_ids:
        return None, bool, spans.attempts.records  # bool(): False, nothing pinned
    return head.bound, head.pin_sampled, spans.attempts.records


def _traced_async(spec: TracedListener, spans: _RecordSpans) -> Callable[[Record], Any]:
    """An ``async def`` handler in its record's span (the span is the current one in the record's own task)."""
    handler, output, serializer, listener = spec.handler, spec.output, spec.serializer, spec.name
    start, finish = spans.start, spans.finish
    carried = spans.sampled_out if spans.head is not None else None

    async def sampled_out(record: Record, trace: list[tuple[str, bytes]]) -> Any:
        sink = _Sink(serializer)
        previous = bind_sink(sink)
        try:
            collect_outputs(await handler(record), output, serializer, listener, sink)
        finally:
            bind_sink(previous)
        return _traced_outputs(sink, trace) if sink else None

    async def traced_async(record: Record) -> Any:
        if carried is not None:
            trace = carried(record)
            if trace is not None:
                return await (sampled_out(record, trace) if trace else handler(record))
        span, key, token, context = start(record)
        sink = _Sink(serializer)
        error: BaseException | None = None
        previous = bind_sink(sink)
        try:
            result = await handler(record)
            collect_outputs(result, output, serializer, listener, sink)
        except BaseException as exc:
            error = exc
            raise
        finally:
            bind_sink(previous)
            outputs = finish(span, key, token, context, record, sink, error)
        return outputs

    return traced_async


#: At most this many record spans are linked from a transaction's span (OpenTelemetry's default limit of links).
MAX_TRANSACTION_LINKS = 128

#: The Tracing of every App started with tracing on (weakly: a stopped, dropped App leaves).
_active: weakref.WeakSet[Tracing] = weakref.WeakSet()


def dead_letter_trace_headers(group_id: str, record: Record) -> list[tuple[str, bytes]] | None:
    """The trace headers for ``record``'s dead letter: its last attempt's span context; None with tracing off."""
    if not _active:
        return None
    for tracing in list(_active):
        headers = tracing.dead_letter_headers(group_id, record)
        if headers is not None:
            return headers
    return None
