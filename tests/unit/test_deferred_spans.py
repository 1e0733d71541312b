"""A sampled root record's SDK span made after its handler, while its transaction commits (kafkatx.tracing._deferred):
the same span, ids, times and what the handler did to it, as if it had been made at once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kafkatx import Record
from kafkatx.events import TransactionCommitted
from kafkatx.tracing import Tracing, dead_letter_trace_headers

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402

#: A ratio under 1 (kafkatx samples root records itself, so their spans can be deferred) that samples them all.
ALMOST_ALL = 1 - 1e-12


def _provider(ratio: float = ALMOST_ALL) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _deferred(
    handler: Any, ratio: float = ALMOST_ALL, made: tuple[TracerProvider, InMemorySpanExporter] | None = None
) -> tuple[Tracing, Any, Any, InMemorySpanExporter]:
    provider, exporter = made or _provider(ratio)
    tracing = Tracing(provider)
    spec = SimpleNamespace(name="l", handler=handler, output="out", serializer=None, is_async=False, concurrency=1)
    traced = tracing.wrap(spec, "g")
    make = tracing.defer_spans(spec)
    assert make is not None
    return tracing, traced, make, exporter


def _outputs(result: Any) -> list[Any]:
    """The outputs a traced handler's result holds: a single ``Output`` (the common case) or a list of them."""
    return result if isinstance(result, list) else [result]


def _ids(output: Any) -> tuple[int, int, str]:
    (value,) = [v for k, v in output.headers if k == "traceparent"]
    _, trace_id, span_id, flags = bytes(value).decode().split("-")
    return int(trace_id, 16), int(span_id, 16), flags


def test_the_span_is_made_later_with_the_ids_its_outputs_carry_and_what_the_handler_did_to_it() -> None:
    seen: dict[str, Any] = {}
    provider, exporter = _provider()

    def handler(record: Record) -> bytes:
        span = trace.get_current_span()
        seen["recording"] = span.is_recording()
        span.set_attribute("order.id", "o-1")
        span.add_event("looked up", {"rows": 2})
        with provider.get_tracer("user").start_as_current_span("child"):
            pass
        return b"out"

    _, traced, make, _ = _deferred(handler, made=(provider, exporter))
    record = Record("in", 3, 42, b"k", b"v")
    (output,) = _outputs(traced(record))
    (child,) = exporter.get_finished_spans()  # the handler's own span is made at once, as always
    trace_id, span_id, flags = _ids(output)
    assert seen["recording"] and child.parent is not None and child.parent.span_id == span_id
    assert child.context.trace_id == trace_id

    make()
    child, span = exporter.get_finished_spans()
    assert (span.context.trace_id, span.context.span_id) == (trace_id, span_id)
    assert f"{span.context.trace_flags:02x}" == flags, "the outputs carry the flags of the span exported"
    assert span.name == "process in" and span.kind is trace.SpanKind.CONSUMER and span.parent is None
    attributes = dict(span.attributes or {})
    assert attributes["messaging.destination.partition.id"] == "3" and attributes["messaging.kafka.offset"] == 42
    assert attributes["order.id"] == "o-1" and [e.name for e in span.events] == ["looked up"]
    assert span.start_time is not None and span.end_time is not None
    assert span.start_time <= child.start_time <= child.end_time <= span.end_time, "the attempt's own times"
    make()
    assert len(exporter.get_finished_spans()) == 2, "made once"


def test_a_failed_attempt_records_its_exception_and_its_dead_letter_carries_the_span() -> None:
    def handler(record: Record) -> bytes:
        raise ValueError("bad order")

    tracing, traced, make, exporter = _deferred(handler)
    record = Record("in", 0, 7, None, b"v")
    with pytest.raises(ValueError):
        traced(record)
    headers = dead_letter_trace_headers("g", record)  # before the span is made: its context is known already
    assert headers is not None
    make()
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR and "ValueError: bad order" in (span.status.description or "")
    assert [e.name for e in span.events] == ["exception"]
    assert _ids(SimpleNamespace(headers=headers))[:2] == (span.context.trace_id, span.context.span_id)


def test_a_transaction_span_comes_after_its_records_spans_and_links_them() -> None:
    tracing, traced, _, exporter = _deferred(lambda r: r.value)
    callbacks: dict[type, Any] = {}
    tracing.subscribe(lambda kind, callback: callbacks.__setitem__(kind, callback))
    outputs = [traced(Record("in", 0, offset, None, b"v")) for offset in range(3)]
    assert exporter.get_finished_spans() == ()
    callbacks[TransactionCommitted](TransactionCommitted("l", 0, records=3))  # made now at the latest
    *records, transaction = exporter.get_finished_spans()
    assert [s.context.span_id for s in records] == [_ids(o)[1] for o in outputs]
    assert transaction.name == "kafkatx transaction"
    assert [link.context.span_id for link in transaction.links] == [s.context.span_id for s in records]


def test_the_app_stopping_makes_what_is_left() -> None:
    tracing, traced, _, exporter = _deferred(lambda r: r.value)
    traced(Record("in", 0, 0, None, b"v"))
    tracing.flush()
    assert [s.name for s in exporter.get_finished_spans()] == ["process in"]


def test_records_sampled_out_or_with_a_parent_are_not_deferred() -> None:
    _, traced, make, exporter = _deferred(lambda r: r.value, ratio=1e-12)
    assert traced(Record("in", 0, 0, None, b"v")) == b"v", "sampled out: tracing off for it"
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    traced(Record("in", 0, 1, None, b"v", [("traceparent", parent.encode())]))
    (span,) = exporter.get_finished_spans()
    assert f"{span.context.trace_id:032x}" == parent.split("-")[1], "a record with a parent: made at once"
    make()
    assert len(exporter.get_finished_spans()) == 1


def test_a_span_the_sdk_cannot_take_never_fails_the_commit_it_is_made_during(caplog: pytest.LogCaptureFixture) -> None:
    """Spans are made while a transaction commits: an exporter that raises is logged, not raised."""
    from opentelemetry.sdk.trace import SpanProcessor

    class Raising(SpanProcessor):
        def on_end(self, span: Any) -> None:
            raise RuntimeError("exporter down")

    provider, exporter = _provider()
    provider.add_span_processor(Raising())
    _, traced, make, _ = _deferred(lambda r: r.value, made=(provider, exporter))
    traced(Record("in", 0, 0, None, b"v"))
    traced(Record("in", 0, 1, None, b"v"))
    make()  # does not raise
    assert len(exporter.get_finished_spans()) == 2, "the other processors still get every span"
    assert caplog.text.count("could not be made") == 1
