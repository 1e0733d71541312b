"""Tracing of batch listeners (issue 41): one ``process`` span per handler call, linked to the traces its records
carry; what the call returns and sends carries the call's trace; a failed call's span says so."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import PoisonError, make_app

import kafkatx
from kafkatx import Record, send
from kafkatx.testing import KafkaTestKit, running, wait_for

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.trace import StatusCode  # noqa: E402
from test_tracing import _process_spans, _provider, _trace_id  # noqa: E402

TRACES = [0x4BF92F3577B34DA6A3CE929D0E0E4736 + n for n in range(3)]


def _traceparent(trace_id: int) -> bytes:
    return b"00-%032x-00f067aa0ba902b7-01" % trace_id


def test_one_span_per_call_linked_to_its_records_traces_and_carried_by_its_outputs(kafka: KafkaTestKit) -> None:
    src, out, side = kafka.topic(), kafka.topic(), kafka.topic()
    produced = [
        {"value": b"%d" % i, "headers": [("traceparent", _traceparent(TRACES[i % 3]))]}
        if i % 2
        else {"value": b"%d" % i}
        for i in range(30)
    ]
    kafka.produce(src, produced)
    provider, exporter = _provider()
    app = make_app(kafka, tracing=provider)
    calls: list[int] = []

    @app.batch_listener(src, output=out, sends_to=[side], max_batch_records=30, max_batch_ms=1000)
    def handle(records: list[Record]) -> list[bytes]:
        calls.append(len(records))
        for r in records:
            send(side, b"side-" + (r.value or b""))
        return [(r.value or b"").upper() for r in records]

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    spans = _process_spans(exporter)
    assert [s.attributes["messaging.batch.message_count"] for s in spans] == calls, "a span per call"  # type: ignore[index]
    assert sum(calls) == 30
    linked = {link.context.trace_id for s in spans for link in s.links}
    assert linked == set(TRACES), "each traced record's trace is linked from its call's span"
    by_value = {r.value: r for r in kafka.read(out)} | {r.value: r for r in kafka.read(side)}
    span_traces = {s.context.trace_id for s in spans}
    assert {_trace_id(r.headers) for r in by_value.values()} <= span_traces, "outputs carry their call's trace"
    assert len(by_value) == 60


def test_a_failed_calls_span_records_its_error_and_the_retry_has_a_span_of_its_own(kafka: KafkaTestKit) -> None:
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [{"value": b"%d" % i} for i in range(10)])
    provider, exporter = _provider()
    app = make_app(kafka, tracing=provider)

    @app.batch_listener(src, output=out, max_attempts=2, backoff=0, dlq=True, max_batch_records=10, max_batch_ms=1000)
    def handle(records: list[Record]) -> list[bytes]:
        for r in records:
            if r.value == b"4":
                raise kafkatx.RecordFailedError(r) from PoisonError("4")
        return [r.value or b"" for r in records]

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    spans = _process_spans(exporter)
    failed = [s for s in spans if s.status.status_code is StatusCode.ERROR]
    assert len(failed) == 2, "the call over the batch (4's first attempt), then 4 alone (its second, max_attempts=2)"
    assert all(any(e.name == "exception" for e in s.events) for s in failed)
    assert Counter(s.attributes["messaging.batch.message_count"] for s in failed) == {10: 1, 1: 1}  # type: ignore[index]
    assert Counter(kafka.values(out)) == Counter(b"%d" % i for i in range(10) if i != 4)
