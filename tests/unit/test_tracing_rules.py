"""kafkatx.tracing without a broker: Kafka header carriers, attempt links, and the traced handler's outputs."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from kafkatx import Output, Record, send
from kafkatx.context import bind_sink
from kafkatx.errors import InvalidConfigurationError
from kafkatx.tracing import (
    AttemptLinks,
    HeaderGetter,
    HeaderSetter,
    Tracing,
    dead_letter_trace_headers,
    extract_context,
    require_opentelemetry,
    trace_headers,
    with_trace,
)

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
OTHER = "00-11111111111111111111111111111111-2222222222222222-01"


def _tracing() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


def _spec(handler: Any, *, is_async: bool = False, output: str | None = "out") -> Any:
    return SimpleNamespace(name="l", handler=handler, output=output, serializer=None, is_async=is_async, concurrency=1)


def _record(traceparent: str | None = None, offset: int = 0, attempt: int = 1) -> Record:
    headers = [("traceparent", traceparent.encode())] if traceparent else []
    return Record("in", 0, offset, None, b"v", headers, attempt=attempt)


def _trace_of(headers: Any) -> str:
    (value,) = [v for k, v in headers if k == "traceparent"]
    return bytes(value).decode().split("-")[1]


def test_the_getter_reads_the_last_value_of_a_header_and_lists_the_names() -> None:
    headers = [("traceparent", b"old"), ("x", None), ("traceparent", b"new")]
    assert HeaderGetter().get(headers, "traceparent") == ["new"]
    assert HeaderGetter().get(headers, "missing") is None
    assert HeaderGetter().get(None, "traceparent") is None
    assert HeaderGetter().keys(headers) == ["traceparent", "x", "traceparent"]


def test_the_setter_replaces_a_header_instead_of_adding_a_second_one() -> None:
    carrier = [("a", b"1"), ("traceparent", b"old")]
    HeaderSetter().set(carrier, "traceparent", "new")
    assert carrier == [("a", b"1"), ("traceparent", b"new")]


def test_a_context_extracted_from_headers_is_injected_back_unchanged() -> None:
    context = extract_context([("traceparent", PARENT.encode()), ("baggage", b"tenant=acme")])
    injected = dict(trace_headers(context))
    assert injected["traceparent"] == PARENT.encode()
    assert injected["baggage"] == b"tenant=acme"
    assert trace_headers(extract_context(None)) == [], "no context, no header"


def test_with_trace_drops_the_earlier_trace_headers_and_keeps_the_rest() -> None:
    merged = with_trace([("a", b"1"), ("traceparent", b"x"), ("tracestate", b"y")], [("traceparent", b"z")])
    assert merged == [("a", b"1"), ("traceparent", b"z")]


def test_attempt_links_are_kept_in_order_until_the_record_is_done_and_bounded() -> None:
    links = AttemptLinks(max_records=2)
    first, second = object(), object()
    links.failed(("g", "t", 0, 5), first)  # type: ignore[arg-type]
    links.failed(("g", "t", 0, 5), second)  # type: ignore[arg-type]
    assert links.earlier(("g", "t", 0, 5)) == [first, second]
    assert links.last(("g", "t", 0, 5)) is second
    links.done(("g", "t", 0, 5))
    assert links.earlier(("g", "t", 0, 5)) == [] and links.last(("g", "t", 0, 5)) is None
    for offset in range(3):
        links.failed(("g", "t", 0, offset), first)  # type: ignore[arg-type]
    assert len(links) == 2 and links.earlier(("g", "t", 0, 0)) == [], "the oldest record is dropped first"


def test_a_traced_handler_puts_its_records_trace_on_returned_and_sent_outputs() -> None:
    tracing, exporter = _tracing()

    def handler(record: Record) -> list[Any]:
        send("side", b"s", headers={"traceparent": b"stale", "h": b"1"})
        return [b"r", Output(b"o", topic="other", headers={"traceparent": b"stale"})]

    traced = tracing.wrap(_spec(handler), "group")
    sink: list[Any] = []
    previous = bind_sink(SimpleNamespace(serializer=None, add=sink.append))  # type: ignore[arg-type]
    try:
        outputs = traced(_record(PARENT))
    finally:
        bind_sink(previous)
    assert sink == [], "send() went to the record's outputs, not around them"
    assert [(o.topic, o.value) for o in outputs] == [("side", b"s"), ("out", b"r"), ("other", b"o")]
    assert {_trace_of(o.headers) for o in outputs} == {PARENT.split("-")[1]}
    assert ("h", b"1") in outputs[0].headers
    (span,) = exporter.get_finished_spans()
    assert span.name == "process in" and span.kind is trace.SpanKind.CONSUMER
    assert span.attributes is not None and span.attributes["messaging.consumer.group.name"] == "group"


def test_a_handler_returning_nothing_gets_no_outputs() -> None:
    tracing, _ = _tracing()
    assert tracing.wrap(_spec(lambda r: None), "g")(_record(PARENT)) is None


def test_failed_attempts_are_linked_in_order_and_the_dead_letter_continues_the_last() -> None:
    tracing, exporter = _tracing()

    def failing(record: Record) -> None:
        raise ValueError("no")

    traced = tracing.wrap(_spec(failing), "group")
    for attempt in (1, 2, 3):
        with pytest.raises(ValueError):
            traced(_record(PARENT, attempt=attempt))
    spans = exporter.get_finished_spans()
    assert [[link.context.span_id for link in s.links] for s in spans] == [
        [],
        [spans[0].context.span_id],
        [spans[0].context.span_id, spans[1].context.span_id],
    ]
    headers = dead_letter_trace_headers("group", _record(PARENT, attempt=3))
    assert headers is not None
    assert dict(headers)["traceparent"] == f"00-{PARENT.split('-')[1]}-{spans[2].context.span_id:016x}-01".encode()
    assert dead_letter_trace_headers("group", _record(PARENT)) == headers, "a failed publication is tried again alike"


def test_concurrent_async_records_each_carry_their_own_trace() -> None:
    tracing, _ = _tracing()

    async def handler(record: Record) -> bytes:
        await asyncio.sleep(0)  # the other record's task runs here
        send("side", record.value)
        await asyncio.sleep(0)
        return record.value or b""

    traced = tracing.wrap(_spec(handler, is_async=True), "g")

    async def both() -> list[Any]:
        one = Record("in", 0, 0, None, b"one", [("traceparent", PARENT.encode())])
        two = Record("in", 0, 1, None, b"two", [("traceparent", OTHER.encode())])
        return list(await asyncio.gather(traced(one), traced(two)))

    first, second = asyncio.run(both())
    assert {_trace_of(o.headers) for o in first} == {PARENT.split("-")[1]}
    assert {_trace_of(o.headers) for o in second} == {OTHER.split("-")[1]}


def test_tracing_without_opentelemetry_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    monkeypatch.setitem(sys.modules, "opentelemetry.trace", None)
    with pytest.raises(InvalidConfigurationError, match=r"kafkatx\[otel\]"):
        require_opentelemetry()


def test_a_record_recovered_by_any_recoverer_ends_its_links() -> None:
    from kafkatx.events import EventBus, RecordRecovered

    tracing, _ = _tracing()
    bus = EventBus()
    tracing.subscribe(bus.subscribe)

    def failing(record: Record) -> None:
        raise ValueError("no")

    traced = tracing.wrap(_spec(failing), "group")
    with pytest.raises(ValueError):
        traced(_record(PARENT))
    assert len(tracing.attempts) == 1
    bus.publish(RecordRecovered("l#1", 1, _record(PARENT), ValueError("no"), "log"))
    assert len(tracing.attempts) == 0


@pytest.mark.parametrize("bad", ["yes", 1, object()])
def test_app_tracing_takes_a_bool_or_a_tracer_provider(bad: Any) -> None:
    from kafkatx import App

    with pytest.raises(InvalidConfigurationError, match="tracing= takes True, False or an OpenTelemetry"):
        App("t", bootstrap_servers="127.0.0.1:9", tracing=bad)
    App("t", bootstrap_servers="127.0.0.1:9", tracing=TracerProvider())
    App("t", bootstrap_servers="127.0.0.1:9", tracing=True)
