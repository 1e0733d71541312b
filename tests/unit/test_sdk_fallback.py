"""Tracing outside the SDK adapter's version gate (kafkatx.tracing._sdk): the public API only, the same spans.

An SDK version kafkatx was not tested with is simulated by emptying the gate:
then no SDK internal is read and the tracer's id generator is left alone,
every record's span goes through ``start_span`` (the SDK samples), and the
spans, their links, the outputs' and the dead letter's trace headers are what
they are inside the gate.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kafkatx import Record
from kafkatx.events import RecordRecovered, TransactionAborted, TransactionCommitted
from kafkatx.tracing import Tracing

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator  # noqa: E402
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

from kafkatx.tracing import _sdk  # noqa: E402

SAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
NOT_SAMPLED = "00-11111111111111111111111111111111-2222222222222222-00"
RATE = 0.5
BOUND = TraceIdRatioBased.get_bound_for_rate(RATE)


@pytest.fixture(params=["tested", "gate off"])
def gate(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs inside the gate and outside it (as on an SDK version kafkatx was not tested with)."""
    if request.param == "gate off":
        monkeypatch.setattr(_sdk, "TESTED_SDK", range(0))
    assert _sdk.sdk_tested() is (request.param == "tested")
    return str(request.param)


def _traced(handler: Any) -> tuple[Tracing, Any, dict[type, Any], InMemorySpanExporter, TracerProvider]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(RATE)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)
    callbacks: dict[type, Any] = {}
    tracing.subscribe(lambda kind, callback: callbacks.__setitem__(kind, callback))
    spec = SimpleNamespace(name="l", handler=handler, output="out", serializer=None, is_async=False, concurrency=1)
    return tracing, tracing.wrap(spec, "fallback-group"), callbacks, exporter, provider


def _traceparent(result: Any) -> tuple[int, int, bool] | None:
    """(trace id, span id, sampled) of the traceparent an output carries; None without one."""
    outputs = result if isinstance(result, list) else [result]
    values = [
        v for output in outputs if hasattr(output, "headers") for k, v in output.headers or () if k == "traceparent"
    ]
    if not values:
        return None
    _, trace_id, span_id, flags = bytes(values[-1]).decode().split("-")
    return int(trace_id, 16), int(span_id, 16), bool(int(flags, 16) & 1)


def _made(tracing: Tracing, make: Any) -> None:
    """What the container does while a transaction commits (inside the gate: the deferred spans are made)."""
    if make is not None:
        make()


def test_outside_the_gate_no_sdk_internal_is_touched(gate: str) -> None:
    tracing, traced, _, _, provider = _traced(lambda r: r.value)
    spec = SimpleNamespace(name="l", concurrency=1)
    tracer: Any = tracing.tracer
    pinned = isinstance(tracer.id_generator, _sdk.PinnedTraceIds)
    if gate == "tested":
        assert pinned and tracing.defer_spans(spec) is not None and tracing.untraced_roots(spec) is not None
    else:
        assert type(tracer.id_generator) is RandomIdGenerator, "the tracer's id generator is left alone"
        assert tracing.defer_spans(spec) is None and tracing.untraced_roots(spec) is None
        assert _sdk.tracer_sampler(tracer) is None
        assert _sdk.direct_recorder(tracer, provider.get_tracer("x").start_span("made")) is None


def test_root_records_are_sampled_as_the_sdk_samples_and_outputs_name_their_spans(gate: str) -> None:
    tracing, traced, callbacks, exporter, _ = _traced(lambda r: r.value)
    make = tracing.defer_spans(SimpleNamespace(name="l", concurrency=1))
    named = set()
    for offset in range(100):  # under the 128 links of a transaction span, sampled or not
        carried = _traceparent(traced(Record("in", 0, offset, None, b"v")))
        if carried is not None and carried[2]:
            named.add(carried[:2])
    _made(tracing, make)
    callbacks[TransactionCommitted](TransactionCommitted("l", 0, records=100))
    spans = [s for s in exporter.get_finished_spans() if s.name == "process in"]
    assert 25 < len(spans) < 75, "about half, at a ratio of 0.5"
    assert {(s.context.trace_id, s.context.span_id) for s in spans} == named, "each sampled output names its span"
    assert all((s.context.trace_id & (1 << 64) - 1) < BOUND for s in spans), "trace ids the SDK's ratio samples"
    assert all(s.kind is SpanKind.CONSUMER and s.parent is None for s in spans)
    transactions = [s for s in exporter.get_finished_spans() if s.name == "kafkatx transaction"]
    # Inside the gate kafkatx gives a transaction holding a traced record its span; outside, it is a root span
    # like any other, which the SDK's sampler keeps or drops (as with a sampler kafkatx does not know).
    assert len(transactions) == 1 if gate == "tested" else len(transactions) <= 1
    for transaction in transactions:
        linked = {link.context.span_id for link in transaction.links if link.context.trace_flags.sampled}
        assert linked == {s.context.span_id for s in spans}, "linked to each of its records' sampled spans"
        assert dict(transaction.attributes or {})["kafkatx.transaction.outcome"] == "committed"


def test_a_record_with_a_parent_follows_its_sampled_flag(gate: str) -> None:
    tracing, traced, _, exporter, _ = _traced(lambda r: r.value)
    in_trace = _traceparent(traced(Record("in", 0, 1, None, b"v", [("traceparent", SAMPLED.encode())])))
    (span,) = exporter.get_finished_spans()
    assert span.parent is not None and span.parent.span_id == 0x00F067AA0BA902B7
    assert in_trace == (span.context.trace_id, span.context.span_id, True)
    assert span.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    dropped = _traceparent(traced(Record("in", 0, 2, None, b"v", [("traceparent", NOT_SAMPLED.encode())])))
    assert len(exporter.get_finished_spans()) == 1, "a parent not sampled: no span"
    assert dropped is not None and dropped[0] == 0x11111111111111111111111111111111 and not dropped[2]


def test_failed_attempts_are_linked_and_the_dead_letter_continues_the_last(gate: str) -> None:
    def failing(record: Record) -> None:
        raise ValueError("poison")

    tracing, traced, callbacks, exporter, _ = _traced(failing)
    for attempt in (1, 2, 3):
        with pytest.raises(ValueError):
            traced(Record("in", 0, 7, None, b"v", [("traceparent", SAMPLED.encode())], attempt=attempt))
        callbacks[TransactionAborted](TransactionAborted("l", 0, records=1, reason="failed"))
    headers = tracing.dead_letter_headers(
        "fallback-group", Record("in", 0, 7, None, b"v", [("traceparent", SAMPLED.encode())])
    )
    callbacks[RecordRecovered](RecordRecovered("l", 0, record=Record("in", 0, 7, None, b"v"), exception=None))
    spans = [s for s in exporter.get_finished_spans() if s.name == "process in"]
    assert [dict(s.attributes or {})["kafkatx.attempt"] for s in spans] == [1, 2, 3]
    assert [[link.context.span_id for link in s.links] for s in spans] == [
        [],
        [spans[0].context.span_id],
        [spans[0].context.span_id, spans[1].context.span_id],
    ]
    assert all(s.status.status_code is StatusCode.ERROR for s in spans)
    assert headers is not None and _traceparent(SimpleNamespace(headers=headers)) == (
        spans[2].context.trace_id,
        spans[2].context.span_id,
        True,
    )
    assert len(tracing.attempts) == 0, "recovered: nothing links to its attempts any more"
