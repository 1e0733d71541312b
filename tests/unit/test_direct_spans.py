"""A deferred record span handed straight to the SDK's span processors (kafkatx.tracing._sdk) is exported exactly as
the span ``start_span`` and ``end`` make; any setting where the SDK would do more keeps ``start_span``."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest

from kafkatx import Output, Record

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, SpanProcessor, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased  # noqa: E402

from kafkatx.tracing import Tracing  # noqa: E402
from kafkatx.tracing._deferred import DeferredSpans, PendingSpan, Pins  # noqa: E402
from kafkatx.tracing._sampling import HeadSampler, head_sampler  # noqa: E402
from kafkatx.tracing._sdk import direct_recorder  # noqa: E402

ATTRIBUTES = {
    "messaging.system": "kafka",
    "messaging.operation.type": "process",
    "messaging.operation.name": "process",
    "messaging.consumer.group.name": "g",
    "kafkatx.listener": "l",
    "messaging.destination.name": "in",
    "messaging.destination.partition.id": "3",
    "messaging.kafka.offset": 42,
    "kafkatx.attempt": 1,
}


def _provider(**options: Any) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(0.5)), resource=Resource.create({"service.name": "orders"}), **options
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _pinned(provider: TracerProvider) -> tuple[Any, HeadSampler, DeferredSpans]:
    """kafkatx's tracer of ``provider``, its sampler (whose ids can be pinned), and its deferred spans."""
    tracer = provider.get_tracer("kafkatx", "9.9")
    head = head_sampler(tracer)
    assert head is not None
    return tracer, head, DeferredSpans(tracer, Pins(head.ids.pin, head.ids.pin_span, head.ids.unpin), random_ids=True)


def _deferred(provider: TracerProvider) -> DeferredSpans:
    return _pinned(provider)[2]


def _same_attempt_twice(deferred: DeferredSpans, error: BaseException | None = None) -> None:
    """The same attempt, made twice: the first by ``start_span`` (its SDK span decides the path), then again."""
    for _ in range(2):
        pending = PendingSpan(deferred.context(0x0123456789ABCDEF0123456789ABCDEF, 0x1122334455667788))
        deferred.add(pending, "process in", dict(ATTRIBUTES), 1_000_000_000, 1_000_250_000, error)
        deferred.make()


def _exported(span: ReadableSpan) -> tuple[Any, ...]:
    """Everything an exporter reads of a span."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        info = span.instrumentation_info
    status = (span.status.status_code, span.status.description)
    dropped = (span.dropped_attributes, span.dropped_events, span.dropped_links)
    links = [(link.context, type(link.attributes), dict(link.attributes or {}), link.dropped_attributes)
             for link in span.links]  # fmt: skip
    events = [(e.name, e.timestamp, dict(e.attributes or {})) for e in span.events]
    return (span.name, span.context, span.parent, span.kind, dict(span.attributes or {}), events, links,
            status, span.start_time, span.end_time, span.resource, span.instrumentation_scope, info, dropped,
            span.to_json())  # fmt: skip


def test_a_span_recorded_directly_is_exported_as_the_sdk_makes_it() -> None:
    provider, exporter = _provider()
    deferred = _deferred(provider)
    _same_attempt_twice(deferred)
    assert deferred.records_directly
    made, direct = exporter.get_finished_spans()
    assert _exported(direct) == _exported(made)
    assert direct.attributes is not None and direct.attributes["messaging.kafka.offset"] == 42


def test_the_batch_span_processor_takes_spans_recorded_directly() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.5)))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    deferred = _deferred(provider)
    _same_attempt_twice(deferred)
    provider.force_flush()
    assert deferred.records_directly
    made, direct = exporter.get_finished_spans()
    assert _exported(direct) == _exported(made)


class _Enriching(SpanProcessor):
    """A processor of the user's that acts when a span starts (as a baggage processor does)."""

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        span.set_attribute("tenant", "acme")


def test_a_processor_that_acts_on_start_still_sees_every_span_start() -> None:
    provider, exporter = _provider()
    provider.add_span_processor(_Enriching())
    deferred = _deferred(provider)
    _same_attempt_twice(deferred)
    assert not deferred.records_directly
    assert [dict(s.attributes or {}).get("tenant") for s in exporter.get_finished_spans()] == ["acme", "acme"]
    assert not deferred.record_directly("kafkatx transaction", 1, {}, (), 1, 2), "nor a transaction's span"


@pytest.mark.parametrize(
    "limits", [SpanLimits(max_span_attribute_length=4), SpanLimits(max_span_attributes=8)], ids=["length", "count"]
)
def test_limits_that_would_cut_attributes_keep_the_sdk_path(limits: SpanLimits) -> None:
    provider, exporter = _provider(span_limits=limits)
    deferred = _deferred(provider)
    _same_attempt_twice(deferred)
    assert not deferred.records_directly
    made, again = exporter.get_finished_spans()
    assert _exported(again) == _exported(made)


def test_an_attempt_with_calls_to_replay_or_a_failure_is_made_by_the_sdk() -> None:
    provider, exporter = _provider()
    deferred = _deferred(provider)
    _same_attempt_twice(deferred)
    assert deferred.records_directly
    _same_attempt_twice(deferred, error=ValueError("bad order"))
    pending = PendingSpan(deferred.context(0xABC, 0xDEF))
    pending.set_attribute("order.id", "o-1")
    deferred.add(pending, "process in", dict(ATTRIBUTES), 1, 2, None)
    deferred.make()
    *_, failed, _, replayed = exporter.get_finished_spans()
    assert failed.status.status_code is trace.StatusCode.ERROR and failed.events[0].name == "exception"
    assert dict(replayed.attributes or {})["order.id"] == "o-1"


def test_an_other_tracer_gets_no_direct_path() -> None:
    provider, _ = _provider()
    tracer = provider.get_tracer("kafkatx")
    assert direct_recorder(tracer, trace.NonRecordingSpan(trace.INVALID_SPAN_CONTEXT)) is None
    assert direct_recorder(SimpleNamespace(span_processor=None), tracer.start_span("x")) is None


def test_every_sampled_record_gets_the_span_its_outputs_name() -> None:
    provider, exporter = _provider()
    tracing = Tracing(provider)
    spec = SimpleNamespace(name="l", handler=lambda r: b"out", output="out", serializer=None, is_async=False,
                           concurrency=1)  # fmt: skip
    traced = tracing.wrap(spec, "g")
    make = tracing.defer_spans(spec)
    assert make is not None
    named = set()
    for offset in range(400):  # half are sampled: the first span by start_span, the rest directly
        result = traced(Record("in", 0, offset, b"k", b"v"))
        for output in result if isinstance(result, list) else [result] if isinstance(result, Output) else []:
            (value,) = [v for k, v in output.headers if k == "traceparent"]
            _, trace_id, span_id, _ = bytes(value).decode().split("-")
            named.add((int(trace_id, 16), int(span_id, 16)))
    make()
    spans = exporter.get_finished_spans()
    assert len(named) > 100 and {(s.context.trace_id, s.context.span_id) for s in spans} == named
    assert all(s.name == "process in" and s.parent is None for s in spans)


def test_the_sdk_counting_its_spans_keeps_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    monkeypatch.setenv("OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED", "true")
    reader = InMemoryMetricReader()
    provider, exporter = _provider(meter_provider=MeterProvider(metric_readers=[reader]))
    deferred = _deferred(provider)
    _same_attempt_twice(deferred)
    assert not deferred.records_directly and len(exporter.get_finished_spans()) == 2


def test_a_transaction_span_recorded_directly_is_exported_as_the_sdk_makes_it() -> None:
    """A transaction's span, with its links to its records' spans, made by ``start_span`` and directly."""
    import random

    from opentelemetry.trace import Link, TraceFlags

    provider, exporter = _provider()
    tracer, head, deferred = _pinned(provider)
    _same_attempt_twice(deferred)  # its first span decides the path
    assert deferred.records_directly
    exporter.clear()
    linked = [trace.SpanContext(0xA1 + i, 0xB1 + i, False, TraceFlags(TraceFlags.SAMPLED)) for i in range(3)]
    attributes = {"messaging.system": "kafka", "messaging.batch.message_count": 3, "kafkatx.listener": "l",
                  "kafkatx.worker": 0, "kafkatx.transaction.outcome": "committed"}  # fmt: skip
    trace_id = head.sampled_trace_id()
    random.seed(5)  # the span id: drawn by the SDK's id generator, or by kafkatx, from the same random numbers
    head.ids.pin(trace_id)
    span = tracer.start_span(
        "kafkatx transaction", start_time=10, attributes=dict(attributes), links=[Link(c) for c in linked]
    )
    head.ids.unpin()
    span.end(end_time=20)
    random.seed(5)
    assert deferred.record_directly("kafkatx transaction", trace_id, dict(attributes), linked, 10, 20)
    made, direct = exporter.get_finished_spans()
    assert _exported(direct) == _exported(made)
    assert [link.context for link in direct.links] == linked
    assert [(dict(link.attributes or {}), link.dropped_attributes) for link in direct.links] == [({}, 0)] * 3
