"""The one adapter to the OpenTelemetry SDK's internals, and its version gate.

Two of tracing's shortcuts lean on what the SDK does not promise to keep:

- kafkatx's own sampling decision (:mod:`kafkatx.tracing._sampling`) reads
  the SDK tracer's ``sampler`` and replaces its ``id_generator`` with
  :class:`PinnedTraceIds`, so that a trace id kafkatx drew (and a span id it
  handed to a deferred span's outputs) is the one the SDK's span gets;
- a finished span handed straight to the span processors
  (:func:`direct_recorder`) reads the tracer's ``span_processor`` and its
  ``_span_processors``, ``_span_limits``, ``_tracer_metrics`` and
  ``_is_enabled``, and builds the SDK's ``ReadableSpan`` itself.

Both are taken only on an SDK whose minor version is in :data:`TESTED_SDK`
(:func:`sdk_tested`). On any other version, and for a tracer that is not the
SDK's, every function here answers None: tracing then uses the public API
only (every record's span through ``Tracer.start_span``, the SDK samples
itself), which is correct on any SDK, only slower.
tests/unit/test_sdk_fallback.py holds the spans of that path right.

Why the direct path pays: through ``Tracer.start_span`` and ``Span.end`` the
SDK spends ~12 us on a span whose ids, times, attributes and links are known
and which nothing will change (the sampler again, a lock, each attribute
checked one by one, a mutable span then a read-only copy). When the tracer's
span processors are the SDK's exporting ones (batch or simple: they do
nothing when a span starts), its internal metrics are off and its limits
cannot cut kafkatx's attributes, the result of ``start_span`` and ``end`` is
the read-only span given to the processors' ``on_end``; kafkatx makes that
span itself (~2 us), with the resource and instrumentation scope of a span the
SDK made first. Any other setting (a processor of the user's, a length limit
on attribute values) keeps ``start_span``. tests/unit/test_direct_spans.py
holds the two paths' exported spans equal.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext, SpanKind

    #: Records a finished root span: (name, context, kind, attributes, linked span contexts, start ns, end ns).
    DirectRecorder = Callable[[str, SpanContext, SpanKind, dict[str, Any], Sequence[SpanContext], int, int], None]

__all__ = ["TESTED_SDK", "PinnedTraceIds", "direct_recorder", "pinned_ids", "sdk_tested", "tracer_sampler"]

#: The OpenTelemetry SDK minor versions whose internals this module was checked against (major 1).
TESTED_SDK = range(27, 46)

#: Enough room for a kafkatx span's own attributes (nine at most) under the span's attribute limit.
_ROOM = 16
#: The links a transaction span may have (MAX_TRANSACTION_LINKS), under the span's link limit.
_LINKS = 128


@cache
def _sdk_version() -> tuple[int, int] | None:
    """(major, minor) of the installed SDK; None without one, or with a version that does not parse."""
    try:
        from opentelemetry.sdk.version import __version__
    except ImportError:
        return None
    major, minor = (__version__.split(".") + ["0"])[:2]
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None


def sdk_tested() -> bool:
    """The version gate: whether the installed SDK is one whose internals kafkatx may read (:data:`TESTED_SDK`)."""
    version = _sdk_version()
    return version is not None and version[0] == 1 and version[1] in TESTED_SDK


def tracer_sampler(tracer: Any) -> Any | None:
    """The sampler of an SDK ``tracer``; None where kafkatx may not take it (nor pin its ids): not the SDK's
    tracer, or an SDK outside the gate. The SDK then samples every record itself."""
    if type(tracer).__module__ != "opentelemetry.sdk.trace" or not sdk_tested():
        return None
    if getattr(tracer, "id_generator", None) is None:
        return None
    return getattr(tracer, "sampler", None)


def pinned_ids(tracer: Any) -> PinnedTraceIds:
    """``tracer``'s id generator made pinnable, installed on it once (a tracer :func:`tracer_sampler` took).

    The tracer is kafkatx's own instrumentation scope: no one else's spans get these ids.
    """
    ids = tracer.id_generator
    if not isinstance(ids, PinnedTraceIds):
        ids = PinnedTraceIds(ids)
        tracer.id_generator = ids
    return ids


class PinnedTraceIds:
    """The tracer's id generator, except that the next trace id of this thread can be fixed in advance.

    kafkatx draws a root record's trace id to decide its sampling; when the
    record is sampled in, the SDK must make its span with that id.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._next = threading.local()

    def pin(self, trace_id: int) -> None:
        self._next.trace_id = trace_id

    def pin_span(self, span_id: int) -> None:
        """The next span id of this thread (a deferred span is made with the id its record's outputs carry)."""
        self._next.span_id = span_id

    def unpin(self) -> None:
        self._next.trace_id = 0
        self._next.span_id = 0

    def generate_trace_id(self) -> int:
        trace_id: int = getattr(self._next, "trace_id", 0)
        if trace_id:
            self._next.trace_id = 0
            return trace_id
        return int(self.inner.generate_trace_id())

    def generate_span_id(self) -> int:
        span_id: int = getattr(self._next, "span_id", 0)
        if span_id:
            self._next.span_id = 0
            return span_id
        return int(self.inner.generate_span_id())

    def is_trace_id_random(self) -> bool:
        random = getattr(self.inner, "is_trace_id_random", None)
        return bool(random()) if random is not None else False


def direct_recorder(tracer: Any, made: Any) -> DirectRecorder | None:
    """What records a finished span as ``tracer.start_span`` then ``end`` would; None if that is not all they do,
    or outside the version gate.

    ``made`` is a span ``tracer`` made through ``start_span``: its resource and instrumentation scope are the
    ones every span of the tracer gets.
    """
    try:
        from opentelemetry.attributes import BoundedAttributes
        from opentelemetry.sdk.trace import ReadableSpan, SynchronousMultiSpanProcessor
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace import Link, Status, StatusCode
    except ImportError:  # pragma: no cover - the tracer is then no SDK tracer
        return None
    if not sdk_tested() or not isinstance(made, ReadableSpan):
        return None
    processor = getattr(tracer, "span_processor", None)
    children = getattr(processor, "_span_processors", None)
    if type(processor) is not SynchronousMultiSpanProcessor or type(children) is not tuple:
        return None  # the concurrent processor runs its processors on threads of its own
    if not all(type(child) in (BatchSpanProcessor, SimpleSpanProcessor) for child in children):
        return None  # a processor of the user's may act when a span starts (e.g. one that adds baggage)
    metrics = getattr(tracer, "_tracer_metrics", None)
    if metrics is not None and type(metrics).__name__ != "NoOpTracerMetrics":
        return None  # the SDK counts the spans it starts
    limits = getattr(tracer, "_span_limits", None)
    if limits is None or not _roomy(limits):
        return None  # the SDK would cut or drop attributes or links
    enabled: Callable[[], bool] | None = getattr(tracer, "_is_enabled", None)
    resource, scope, info = made.resource, made.instrumentation_scope, getattr(tracer, "instrumentation_info", None)
    on_end, unset = processor.on_end, Status(StatusCode.UNSET)
    # What the SDK gives each link without attributes: an empty, read-only set of them.
    no_attributes = BoundedAttributes(limits.max_link_attributes, None, immutable=True)

    def record(
        name: str,
        context: SpanContext,
        kind: SpanKind,
        attributes: dict[str, Any],
        linked: Sequence[SpanContext],
        start: int,
        end: int,
    ) -> None:
        if enabled is not None and not enabled():
            return  # a disabled tracer's spans are not recorded
        links = tuple([Link(c, no_attributes) for c in linked]) if linked else ()
        on_end(ReadableSpan(name, context, None, resource, attributes, (), links, kind, info, unset, start, end, scope))

    return record


def _roomy(limits: Any) -> bool:
    """Whether span ``limits`` leave kafkatx's spans whole: no value length limit, room for attributes and links."""
    if getattr(limits, "max_span_attribute_length", 0) is not None:
        return False
    if getattr(limits, "max_attribute_length", 0) is not None:
        return False
    rooms = (getattr(limits, "max_span_attributes", 0), getattr(limits, "max_links", 0))
    return all(room is None or room >= need for room, need in zip(rooms, (_ROOM, _LINKS), strict=True))
