"""Tracing with ``retry="topics"`` (issue 40): an attempt handled from a retry topic links to the spans of the
record's earlier, failed attempts, also when they ran in another process (the hop carries their span contexts in
a header of kafkatx's, which the handler never sees)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from helpers import make_app

from kafkatx import App, Record
from kafkatx.retry_topics.headers import ATTEMPT_SPANS
from kafkatx.testing import KafkaTestKit, running, wait_for

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
FIRST_BACKOFF_S = 10.0  # the first App's back-off: far longer than it takes to stop once its hop committed


class Transient(Exception):
    """A failure worth retrying."""


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _attempts(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    spans = [s for s in exporter.get_finished_spans() if (s.attributes or {}).get("messaging.operation.type")]
    return sorted(spans, key=lambda s: (s.attributes or {})["kafkatx.attempt"])


@pytest.mark.parametrize("ordering", ["none", "key"])
def test_an_attempt_from_a_retry_topic_links_to_the_failed_attempts_also_those_of_another_process(
    kafka: KafkaTestKit, ordering: str
) -> None:
    """Attempt 1 fails in a first App, which stops with the record in retry; a second App (another tracer, nothing
    in memory) runs attempt 2, which fails, and attempt 3, which works: 2 links to 1, 3 to 1 and 2; one trace."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [{"key": b"k", "value": b"flaky", "headers": [("traceparent", TRACEPARENT)]}])
    options: dict[str, Any] = {"retry": "topics", "ordering": ordering, "max_attempts": 3, "backoff": 0.2}
    # The first App's hop is due FIRST_BACKOFF_S after attempt 1 (a fixed back-off: the same retry topic at any
    # delay), and the App stops as soon as the hop has committed: it cannot run attempt 2 before it has stopped.
    # The second App runs attempt 2 once that hop is due, and attempt 3 after its own 0.2 s.
    first_options = {**options, "backoff": FIRST_BACKOFF_S}
    seen: list[Record] = []
    lock = threading.Lock()

    def handle(record: Record) -> bytes:
        with lock:
            seen.append(record)
        if record.attempt < 3:
            raise Transient("not yet")
        return b"done"

    first_provider, first_exporter = _provider()
    first = make_app(kafka, name="retry-trace", tracing=first_provider)
    first.listener(src, output=out, dlq=True, **first_options)(handle)
    with running(first):
        wait_for(lambda: kafka.caught_up(first.group_id, src), 30, message="the hop committed")
    assert [r.attempt for r in seen] == [1], "the first App stopped before the hop was due"
    [hop] = kafka.read(src + "-retry")
    [one] = _attempts(first_exporter)
    carried = dict(hop.headers)[ATTEMPT_SPANS]
    assert carried == b"00-%032x-%016x-01" % (one.context.trace_id, one.context.span_id)

    provider, exporter = _provider()
    second = App(first.name, bootstrap_servers=kafka.bootstrap_servers, group_id=first.group_id, tracing=provider)
    second.listener(src, output=out, dlq=True, **options)(handle)
    with running(second):
        wait_for(
            lambda: [r.value for r in kafka.read(out)] == [b"done"],
            FIRST_BACKOFF_S + 30,
            message="the third attempt's output",
        )
    two, three = _attempts(exporter)
    assert [(s.attributes or {})["kafkatx.attempt"] for s in (one, two, three)] == [1, 2, 3]
    assert [link.context.span_id for link in two.links] == [one.context.span_id]
    assert [link.context.span_id for link in three.links] == [one.context.span_id, two.context.span_id]
    assert {s.context.trace_id for s in (one, two, three)} == {TRACE_ID}, "the record's own trace, every attempt"
    assert [(r.topic, r.offset, r.attempt) for r in seen] == [(src, 0, 1), (src, 0, 2), (src, 0, 3)]
    assert all(not name.startswith(("kafkatx_", "retry_topic-")) for r in seen for name, _ in r.headers), (
        "the handler never sees the hop's headers"
    )


def test_concurrently_handled_attempts_from_a_retry_topic_link_to_their_own_records_failed_attempts(
    kafka: KafkaTestKit,
) -> None:
    """``in_flight=4``: several records fail at attempts 1-2 at the same time; each attempt 3 links to its own
    record's attempts 1 and 2, in that record's trace, whichever records ran beside it."""
    src, out = kafka.topic(), kafka.topic()
    parents = {b"r%d" % i: b"00-%032x-%016x-01" % (TRACE_ID + i, 0x1000 + i) for i in range(6)}
    kafka.produce(src, [{"key": v, "value": v, "headers": [("traceparent", p)]} for v, p in parents.items()])
    provider, exporter = _provider()
    app = make_app(kafka, tracing=provider)

    @app.listener(src, output=out, dlq=True, retry="topics", max_attempts=3, backoff=0.2, in_flight=4)
    async def handle(record: Record) -> bytes:
        if record.attempt < 3 and record.value in (b"r1", b"r2", b"r4"):
            raise Transient("not yet")
        return b"done-" + (record.value or b"")

    with running(app):
        wait_for(lambda: len(kafka.read(out)) == 6, 30, message="every record's output")
    spans = [s for s in exporter.get_finished_spans() if (s.attributes or {}).get("messaging.operation.type")]
    by_trace: dict[int, list[ReadableSpan]] = {}
    for span in spans:
        by_trace.setdefault(span.context.trace_id, []).append(span)
    for i, value in enumerate(parents):
        attempts = sorted(by_trace[TRACE_ID + i], key=lambda s: (s.attributes or {})["kafkatx.attempt"])
        numbers = [(s.attributes or {})["kafkatx.attempt"] for s in attempts]
        if value in (b"r1", b"r2", b"r4"):
            assert numbers == [1, 2, 3], value
            one, two, three = attempts
            assert [link.context.span_id for link in two.links] == [one.context.span_id], value
            assert [link.context.span_id for link in three.links] == [one.context.span_id, two.context.span_id]
        else:
            assert numbers == [1] and not attempts[0].links, value
