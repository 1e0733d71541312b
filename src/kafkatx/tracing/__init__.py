"""OpenTelemetry tracing of record processing: ``App(tracing=True)``; off by default, and then nothing is added.

With tracing on, ``App.start`` gives its containers a copy of each listener
whose handler is wrapped once (:meth:`Tracing.wrap`): with tracing off the
record runner's hot path pays one test per record. At a ratio, the runner
itself runs the root records the sampler leaves out with the listener's own
handler (:class:`RootCountdown`, which it holds while it handles a unit).
The wrapper, per record attempt:

- extracts the W3C ``traceparent`` (``tracestate``, ``baggage``) of the
  record's headers: the parent of its ``process`` span (OpenTelemetry's
  messaging semantic conventions), a root span when it has none;
- links the span to the spans of the record's earlier attempts (kept in
  memory per record by :class:`AttemptLinks` until the record succeeds or is
  recovered: across a restart the links are lost, the trace is not, as its
  parent comes from the record's header; with ``retry="topics"`` a hop
  carries them, ``_hops.py``, so they survive a restart there);
- collects what the handler returns and ``send()``\\ s and writes the span's
  context into each output's headers, so outputs carry the record's trace.

A dead-letter record gets the context of the record's last attempt
(:meth:`Tracing.dead_letter_headers`, which the App hands to the DLQ
publisher when it starts: no registry between them), so the dead letter,
and a later ``kafkatx dlq replay`` of it (which keeps headers), stay in the
same trace. A span per transaction (records, outcome: committed,
aborted or recovered) is made from the container's events.

With a sampler of the SDK's standard ones, kafkatx decides a record's
sampling itself before any OpenTelemetry call (``_sampling.py``):
a record sampled out costs next to nothing, which is what makes tracing
affordable on a busy listener (``ParentBased(TraceIdRatioBased(0.01))``).
The SDK span of a root record it sampled in is made while the record's
transaction commits, when the container thread waits on the broker
(``_deferred.py``); the handler runs under a stand-in with the span's context
meanwhile.

The span context is carried by ``contextvars`` (OpenTelemetry's context),
never a thread-local: concurrent handlers (``in_flight > 1``, ``async def``)
each see their own record's span.

The package, one concept a module, each private (this module is the public
API): ``_headers.py`` (W3C context in Kafka headers), ``_links.py`` (failed
attempts' span links), ``_hops.py`` (those links carried through retry topics), ``_sampling.py`` (kafkatx's own sampling decision),
``_records.py`` (a listener's record spans), ``_handler.py`` (the handler
wrappers), ``_deferred.py`` (SDK spans made while a transaction commits),
``_sdk.py`` (the one adapter to the SDK's internals, with its version gate:
outside it, the public API only).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kafkatx.errors import InvalidConfigurationError
from kafkatx.events import Event, RecordRecovered, TransactionAborted, TransactionCommitted
from kafkatx.record import Record
from kafkatx.tracing._handler import TracedListener, wrap_async_handler, wrap_batch_handler, wrap_handler
from kafkatx.tracing._headers import (
    TRACE_HEADERS,
    HeaderGetter,
    HeaderSetter,
    extract_context,
    trace_headers,
    with_trace,
)
from kafkatx.tracing._headers import Headers as Headers
from kafkatx.tracing._headers import carries_trace as carries_trace
from kafkatx.tracing._hops import HopLinks
from kafkatx.tracing._links import AttemptLinks
from kafkatx.tracing._records import MAX_TRANSACTION_LINKS as MAX_TRANSACTION_LINKS
from kafkatx.tracing._records import RecordSpans
from kafkatx.tracing._sampling import ALWAYS_SAMPLED, RootCountdown
from kafkatx.tracing._sampling import HeadSampler as HeadSampler
from kafkatx.tracing._sampling import head_sampler as head_sampler
from kafkatx.tracing._sampling import root_gap as root_gap

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer, TracerProvider

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
# The ``name as name`` imports above: names importable from here before tracing was a package, not in __all__.


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


class Tracing:
    """The tracer of one App, its attempt links, and the spans it makes from the containers' events."""

    def __init__(self, provider: TracerProvider | None = None) -> None:
        require_opentelemetry()
        from opentelemetry import trace

        from kafkatx._version import __version__

        self.tracer: Tracer = trace.get_tracer("kafkatx", __version__, tracer_provider=provider)
        self.attempts = AttemptLinks()
        #: The attempts' contexts as retry hops carry them (``retry="topics"``: a hop's header, read back).
        self.hop_links = HopLinks(self.attempts)
        #: (listener, worker) whose last after-rollback transaction recovered a record: its commit is "recovered".
        self._recovered: set[tuple[str, int]] = set()
        #: The consumer group of each traced listener, by name (to end a recovered record's links).
        self._groups: dict[str, str] = {}
        #: The record spans of each container, by its name (for its transaction spans' links).
        self._containers: dict[str, RecordSpans] = {}
        _active.add(self)  # for dead_letter_trace_headers only: kafkatx's own publisher is handed this Tracing

    # -- record attempts ----------------------------------------------------------------------
    def wrap(self, spec: TracedListener, group_id: str, worker: int = 0) -> Callable[[Record], Any]:
        """``spec``'s handler as its container ``worker`` runs it, each call in a ``process`` span."""
        spans = self._spans(spec, group_id, worker)
        return wrap_async_handler(spec, spans) if spec.is_async else wrap_handler(spec, spans)

    def wrap_batch(self, spec: TracedListener, group_id: str, worker: int = 0) -> Callable[[list[Record]], Any]:
        """A batch listener's handler as its container ``worker`` runs it: each call in one ``process`` span,
        linked to the traces its records carry; its outputs carry the call's trace."""
        return wrap_batch_handler(spec, self._spans(spec, group_id, worker))

    def _spans(self, spec: TracedListener, group_id: str, worker: int) -> RecordSpans:
        """The spans of ``spec``'s container ``worker``, kept under the container's name, as its events give it:
        its transactions link the spans of its handler's calls."""
        self._groups[spec.name] = group_id
        spans = RecordSpans(self.tracer, self.attempts, spec.name, group_id)
        self._containers[_container_name(spec, worker)] = spans
        return spans

    def defer_spans(self, spec: TracedListener, worker: int = 0) -> Callable[[], None] | None:
        """Make the SDK spans of the sampled root records of ``spec``'s container ``worker`` after their handler
        ran (``_deferred.py``); returns what makes them, for the container to call while each
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
        """The trace headers of ``record``'s last attempt (for its dead letter); None if this tracer has none.

        What the App hands the dead-letter publisher when it sets it up (``DeadLetterTrace``, kafkatx.dlq.publisher).
        """
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


def _container_name(spec: TracedListener, worker: int) -> str:
    """A container's name as its events give it: ``<listener>#<worker>`` when the listener has several."""
    return spec.name if spec.concurrency == 1 else f"{spec.name}#{worker}"


#: The Tracing of every App started with tracing on (weakly: a stopped, dropped App leaves). Only for
#: :func:`dead_letter_trace_headers`, the public lookup a recoverer of the user's may call; kafkatx's own
#: dead-letter publisher is handed its App's :meth:`Tracing.dead_letter_headers` instead.
_active: weakref.WeakSet[Tracing] = weakref.WeakSet()


def dead_letter_trace_headers(group_id: str, record: Record) -> list[tuple[str, bytes]] | None:
    """The trace headers for ``record``'s dead letter: its last attempt's span context; None with tracing off.

    Looks through every App's tracing in the process, for a recoverer that has no App at hand; kafkatx's
    ``DeadLetterPublishingRecoverer`` asks its own App's tracing, handed to it at start.
    """
    if not _active:
        return None
    for tracing in list(_active):
        headers = tracing.dead_letter_headers(group_id, record)
        if headers is not None:
            return headers
    return None
