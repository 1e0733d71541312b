"""A finished record span handed straight to the SDK's span processors, when that is all the SDK would do with it.

A deferred record span (:mod:`kafkatx.trace_deferred`) is made after its
handler ran, and a transaction's span once it ended: their ids, times,
attributes and links are known, the sampler has agreed. Through ``Tracer.start_span`` and ``Span.end`` the SDK still spends
~12 us on it (the sampler again, a lock, each attribute checked one by one,
a mutable span then a read-only copy), for a span that nothing will change.
When the tracer's span processors are the SDK's exporting ones (batch or
simple: they do nothing when a span starts), its internal metrics are off
and its limits cannot cut these attributes, the result of ``start_span`` and
``end`` is the read-only span given to the processors' ``on_end``; kafkatx
makes that span itself (~2 us), with the resource and instrumentation scope
of a span the SDK made first.

Any other setting (a processor of the user's, a length limit on attribute
values, an SDK version kafkatx was not tested with) keeps ``start_span``.
tests/unit/test_direct_spans.py holds the two paths' exported spans equal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode

__all__ = ["TESTED_SDK", "DirectRecorder", "direct_recorder"]

#: The OpenTelemetry SDK minor versions whose internals the direct path was checked against (major 1).
TESTED_SDK = range(27, 46)

#: Records a finished root span: (name, context, kind, attributes, linked span contexts, start ns, end ns).
DirectRecorder = Callable[[str, SpanContext, SpanKind, dict[str, Any], Sequence[SpanContext], int, int], None]

#: Enough room for a kafkatx span's own attributes (nine at most) under the span's attribute limit.
_ROOM = 16
#: The links a transaction span may have (tracing.MAX_TRANSACTION_LINKS), under the span's link limit.
_LINKS = 128


def direct_recorder(tracer: Any, made: Any) -> DirectRecorder | None:
    """What records a finished span as ``tracer.start_span`` then ``end`` would; None if that is not all they do.

    ``made`` is a span ``tracer`` made through ``start_span``: its resource and instrumentation scope are the
    ones every span of the tracer gets.
    """
    try:
        from opentelemetry.attributes import BoundedAttributes
        from opentelemetry.sdk.trace import ReadableSpan, SynchronousMultiSpanProcessor
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.version import __version__
    except ImportError:  # pragma: no cover - the tracer is then no SDK tracer
        return None
    major, minor = (__version__.split(".") + ["0"])[:2]
    if major != "1" or not minor.isdigit() or int(minor) not in TESTED_SDK or not isinstance(made, ReadableSpan):
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
