"""OpenTelemetry tracing (issue 33): one trace from a record's producer through its attempts, outputs and dead letter.

Each test gives the App its own SDK TracerProvider with an in-memory exporter (``App(tracing=provider)``), so the
tests never touch the global provider.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import PoisonError, make_app
from process_helpers import read_until

from kafkatx import Record, send
from kafkatx.dlq import replay_dlq
from kafkatx.testing import KafkaTestKit, produce, read_topic, running, wait_for

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _trace_id(headers: Any) -> int | None:
    """The trace id of a record's ``traceparent`` header, if it has one."""
    for name, value in headers or ():
        if name == "traceparent":
            return int(value.decode().split("-")[1], 16)
    return None


def _process_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [
        s for s in exporter.get_finished_spans() if (s.attributes or {}).get("messaging.operation.type") == "process"
    ]


def test_outputs_and_sent_records_carry_the_input_records_trace(kafka: KafkaTestKit) -> None:
    src, out, side = kafka.topic(), kafka.topic(), kafka.topic()
    kafka.produce(src, [{"value": b"a", "headers": [("traceparent", TRACEPARENT)]}, {"value": b"b"}])
    provider, exporter = _provider()
    app = make_app(kafka, tracing=provider)

    @app.listener(src, output=out, sends_to=[side])
    def handle(record: Record) -> bytes:
        send(side, b"side-" + (record.value or b""))
        return (record.value or b"").upper()

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    outputs = {r.value: r for r in kafka.read(out)}
    sent = {r.value: r for r in kafka.read(side)}
    assert _trace_id(outputs[b"A"].headers) == TRACE_ID
    assert _trace_id(sent[b"side-a"].headers) == TRACE_ID
    spans = {s.attributes["messaging.kafka.offset"]: s for s in _process_spans(exporter) if s.attributes}
    assert spans[0].context.trace_id == TRACE_ID
    assert spans[0].parent is not None and spans[0].parent.span_id == 0x00F067AA0BA902B7
    # A record without a traceparent starts a trace of its own, which its outputs carry.
    assert spans[1].parent is None
    assert _trace_id(outputs[b"B"].headers) == spans[1].context.trace_id != TRACE_ID
    assert _trace_id(sent[b"side-b"].headers) == spans[1].context.trace_id
    attributes = spans[0].attributes or {}
    assert attributes["messaging.system"] == "kafka"
    assert attributes["messaging.destination.name"] == src
    assert attributes["messaging.destination.partition.id"] == "0"
    assert attributes["messaging.consumer.group.name"] == app.group_id
    assert attributes["kafkatx.attempt"] == 1


def test_a_record_failing_twice_then_dead_lettered_stays_in_one_trace_through_replay(kafka: KafkaTestKit) -> None:
    src = kafka.topic()
    dlt = kafka.topic(name=src + "-dlt")
    kafka.produce(src, [{"value": b"poison", "headers": [("traceparent", TRACEPARENT)]}])
    provider, exporter = _provider()
    app = make_app(kafka, tracing=provider)

    @app.listener(src, max_attempts=3, backoff=0.01, dlq=True)
    def handle(record: Record) -> None:
        raise PoisonError("poison")

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="dead-lettered")
    attempts = sorted(_process_spans(exporter), key=lambda s: (s.attributes or {})["kafkatx.attempt"])
    assert [(s.attributes or {})["kafkatx.attempt"] for s in attempts] == [1, 2, 3]
    assert {s.context.trace_id for s in attempts} == {TRACE_ID}
    assert all(s.status.status_code.name == "ERROR" for s in attempts)
    for n, span in enumerate(attempts):  # each attempt links to every earlier one, in order
        assert [link.context.span_id for link in span.links] == [a.context.span_id for a in attempts[:n]]
    outcomes = [
        (s.attributes or {}).get("kafkatx.transaction.outcome")
        for s in exporter.get_finished_spans()
        if s.name == "kafkatx transaction"
    ]
    assert "aborted" not in outcomes and "recovered" in outcomes, outcomes  # a handler failure aborts nothing
    (dead,) = kafka.read(dlt)
    assert _trace_id(dead.headers) == TRACE_ID
    assert [v for k, v in dead.headers if k == "traceparent"] == [
        f"00-{TRACE_ID:032x}-{attempts[-1].context.span_id:016x}-01".encode()
    ], "the dead letter's parent is the last attempt"

    replay_dlq(kafka.bootstrap_servers, dlt, idle_timeout=5)
    replayed = kafka.read(src)[-1]
    assert replayed.value == b"poison"
    assert _trace_id(replayed.headers) == TRACE_ID


def test_tracing_off_makes_no_span_and_adds_no_header(kafka: KafkaTestKit) -> None:
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"a"])
    provider, exporter = _provider()

    tracer = provider.get_tracer("test")
    app = make_app(kafka)

    @app.listener(src, output=out)
    def handle(record: Record) -> bytes:
        with tracer.start_as_current_span("user span"):  # a span of the user's own does not leak into outputs
            return record.value or b""

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="committed")
    (output,) = kafka.read(out)
    assert not output.headers
    assert [s.name for s in exporter.get_finished_spans()] == ["user span"]


@pytest.mark.parametrize("how", ["in_flight", "async"])
def test_concurrently_handled_records_each_carry_their_own_trace(kafka: KafkaTestKit, how: str) -> None:
    src, out = kafka.topic(), kafka.topic()
    parents = {f"r{n}".encode(): f"00-{n + 1:032x}-{n + 1:016x}-01".encode() for n in range(8)}
    kafka.produce(src, [{"key": v, "value": v, "headers": [("traceparent", tp)]} for v, tp in parents.items()])
    provider, exporter = _provider()
    app = make_app(kafka, tracing=provider)

    if how == "in_flight":

        @app.listener(src, output=out, in_flight=4)
        def handle(record: Record) -> bytes:
            return record.value or b""

    else:

        @app.listener(src, output=out, in_flight=4)
        async def handle_async(record: Record) -> bytes:
            await asyncio.sleep(0.001 * (8 - record.offset))  # the later records finish first
            return record.value or b""

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    outputs = kafka.read(out)
    assert len(outputs) == len(parents)
    for output in outputs:
        assert _trace_id(output.headers) == int(parents[output.value or b""].split(b"-")[1], 16)
    transactions = [s for s in exporter.get_finished_spans() if s.name == "kafkatx transaction"]
    linked = {link.context.span_id for t in transactions for link in t.links}
    assert {s.context.span_id for s in _process_spans(exporter)} == linked, "each record is linked by its transaction"


def test_in_place_retries_are_linked_and_the_dead_letter_is_in_the_records_trace(kafka: KafkaTestKit) -> None:
    src = kafka.topic()
    dlt = kafka.topic(name=src + "-dlt")
    kafka.produce(src, [{"value": b"poison", "headers": [("traceparent", TRACEPARENT)]}, {"value": b"fine"}])
    provider, exporter = _provider()
    app = make_app(kafka, tracing=provider)

    @app.listener(src, max_attempts=2, backoff=0.01, retry="in_place", dlq=True)
    def handle(record: Record) -> None:
        if record.value == b"poison":
            raise PoisonError("poison")

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="dead-lettered")
    attempts = [s for s in _process_spans(exporter) if (s.attributes or {})["messaging.kafka.offset"] == 0]
    attempts.sort(key=lambda s: (s.attributes or {})["kafkatx.attempt"])
    assert [(s.attributes or {})["kafkatx.attempt"] for s in attempts] == [1, 2]
    assert [link.context.span_id for link in attempts[1].links] == [attempts[0].context.span_id]
    (dead,) = kafka.read(dlt)
    assert [v for k, v in dead.headers if k == "traceparent"] == [
        f"00-{TRACE_ID:032x}-{attempts[-1].context.span_id:016x}-01".encode()
    ]


def test_kafkatx_run_tracing_passes_the_records_trace_on() -> None:
    """``--tracing`` with only the API installed globally (no SDK): nothing is recorded, the context still flows."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("KAFKATX_BOOTSTRAP_SERVERS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kafkatx", "run", "examples.orders:app", "--local", "--tracing", "--no-status"],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        bootstrap = read_until(proc, r"embedded broker at (127\.0\.0\.1:\d+)").group(1)
        read_until(proc, r"assigned orders\[")
        order = json.dumps({"id": 1, "qty": 2, "price": 3.5}).encode()
        produce(bootstrap, "orders", [{"key": b"1", "value": order, "headers": [("traceparent", TRACEPARENT)]}])
        enriched = wait_for(lambda: read_topic(bootstrap, "orders-enriched"), 30, message="the enriched order")
        assert [_trace_id(r.headers) for r in enriched] == [TRACE_ID]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_typed_listeners_model_output_and_undecodable_dead_letter_carry_the_trace(kafka: KafkaTestKit) -> None:
    pydantic = pytest.importorskip("pydantic")

    class Order(pydantic.BaseModel):  # type: ignore[misc, name-defined]
        id: int

    src, out = kafka.topic(), kafka.topic()
    dlt = kafka.topic(name=src + "-dlt")
    traced = [("traceparent", TRACEPARENT)]
    kafka.produce(src, [{"value": b'{"id": 7}', "headers": traced}, {"value": b"not json", "headers": traced}])
    provider, _ = _provider()
    app = make_app(kafka, tracing=provider)

    @app.listener(src, output=out, value_type=Order, dlq=True)
    def handle(record: Record) -> Any:
        return Order(id=record.value.id + 1)

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    (output,) = kafka.read(out)
    assert json.loads(output.value or b"") == {"id": 8}
    assert _trace_id(output.headers) == TRACE_ID
    (dead,) = kafka.read(dlt)
    assert dead.value == b"not json", "the dead letter holds the bytes as consumed"
    assert _trace_id(dead.headers) == TRACE_ID


def test_each_records_span_is_made_by_the_time_its_transaction_committed_with_the_ids_its_outputs_carry(
    kafka: KafkaTestKit,
) -> None:
    """The SDK spans of root records are made while their transaction commits (kafkatx.tracing._deferred): by the
    time a transaction has committed its records' spans are exported, with the ids their outputs carry, what the
    handler set on its current span, and a transaction span linking them."""
    from opentelemetry import trace

    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    n = 300
    kafka.produce(src, [b"v%d" % i for i in range(n)])
    provider, exporter = _provider()
    app = make_app(kafka, tracing=provider)

    @app.listener(src, output=out, max_batch_records=50)
    def handle(record: Record) -> bytes:
        trace.get_current_span().set_attribute("app.offset", record.offset)
        return record.value or b""

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
        wait_for(lambda: len(_process_spans(exporter)) >= n, 10, message="every record's span, before the App stops")
        spans = _process_spans(exporter)
    outputs = kafka.read(out)
    assert len(spans) == len(outputs) == n
    carried = set()
    for record in outputs:
        (value,) = [v for k, v in record.headers or () if k == "traceparent"]
        _, trace_id, span_id, _ = value.decode().split("-")
        carried.add((int(trace_id, 16), int(span_id, 16)))
    assert carried == {(s.context.trace_id, s.context.span_id) for s in spans}
    assert all((s.attributes or {}).get("app.offset") == (s.attributes or {})["messaging.kafka.offset"] for s in spans)
    linked = {
        link.context.span_id
        for s in exporter.get_finished_spans()
        if s.name == "kafkatx transaction"
        for link in s.links
    }
    assert linked == {s.context.span_id for s in spans}, "every record's span is linked from its transaction's"


def test_at_a_ratio_the_sampled_roots_and_every_sampled_parent_are_traced_and_nothing_else(kafka: KafkaTestKit) -> None:
    """At a ratio the record runner runs most root records with the untraced handler itself (a countdown it takes
    from tracing); a record whose parent is sampled is traced wherever it falls in that countdown, one whose parent
    is not is passed on untraced, and a sampled root's outputs carry the span exported for it."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    not_sampled = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    n = 800
    records: list[dict[str, Any]] = []
    for i in range(n):
        parent = TRACEPARENT if i % 10 == 3 else not_sampled if i % 10 == 7 else None
        records.append({"value": b"%d" % i, "headers": [("traceparent", parent)] if parent else None})
    kafka.produce(src, records)
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.25)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = make_app(kafka, tracing=provider)
    recording: dict[bytes, bool] = {}

    @app.listener(src, output=out, max_batch_records=100)
    def handle(record: Record) -> bytes:
        recording[record.value or b""] = trace.get_current_span().is_recording()
        return record.value or b""

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    spans = _process_spans(exporter)
    outputs = {int(r.value or b""): r for r in kafka.read(out)}
    assert len(outputs) == len(recording) == n
    traced = {i for i in range(n) if recording[b"%d" % i]}
    with_parent = {i for i in range(n) if i % 10 == 3}
    roots = {i for i in traced if i % 10 not in (3, 7)}
    assert with_parent <= traced and not any(i % 10 == 7 for i in traced)
    assert 0.1 * 480 < len(roots) < 0.45 * 480, f"{len(roots)} of 480 roots sampled at 25%"
    assert len(spans) == len(traced)
    ids = {(s.context.trace_id, s.context.span_id) for s in spans}
    for i, output in outputs.items():
        carried = _trace_id(output.headers)
        if i in roots:
            (value,) = [v for k, v in output.headers or () if k == "traceparent"]
            assert (carried, int(value.decode().split("-")[2], 16)) in ids
        elif i % 10 == 3:
            assert carried == TRACE_ID
        elif i % 10 == 7:
            assert carried == TRACE_ID and output.headers == [("traceparent", not_sampled)]
        else:
            assert carried is None, "a root sampled out gets no trace header"
