"""kafkatx's own sampling decision (kafkatx.tracing._sampling): the same as the SDK's, made before any SDK call."""

from __future__ import annotations

import random
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from kafkatx import Output, Record, send
from kafkatx.events import TransactionCommitted
from kafkatx.tracing import Tracing
from kafkatx.tracing._sampling import head_sampler, parse_traceparent

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import propagate  # noqa: E402
from opentelemetry.propagators.textmap import TextMapPropagator  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.sdk.trace.sampling import (  # noqa: E402
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)

SAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
UNSAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"


def _traced(sampler: Sampler, handler: Any = lambda r: r.value) -> tuple[Any, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spec = SimpleNamespace(name="l", handler=handler, output="out", serializer=None, is_async=False, concurrency=1)
    return Tracing(provider).wrap(spec, "g"), exporter


def _record(offset: int = 0, traceparent: str | None = None, **headers: bytes) -> Record:
    pairs = [("traceparent", traceparent.encode())] if traceparent else []
    return Record("in", 0, offset, None, b"v", pairs + list(headers.items()))


class _Custom(Sampler):
    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        return SamplingResult(Decision.RECORD_AND_SAMPLE)

    def get_description(self) -> str:
        return "custom"


def test_a_traceparent_is_read_as_opentelemetrys_propagator_reads_it() -> None:
    assert parse_traceparent(SAMPLED.encode()) == (0x4BF92F3577B34DA6A3CE929D0E0E4736, True)
    assert parse_traceparent(UNSAMPLED) == (0x4BF92F3577B34DA6A3CE929D0E0E4736, False)
    assert parse_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09-future") is not None
    for bad in (
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # version 00 has four fields
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "garbage",
        None,
    ):
        assert parse_traceparent(bad) is None, bad


@pytest.mark.parametrize(
    ("sampler", "rule"),
    [
        (ALWAYS_ON, (False, 1 << 64)),
        (ALWAYS_OFF, (False, 0)),
        (TraceIdRatioBased(0.5), (False, 1 << 63)),
        (ParentBased(ALWAYS_ON), (True, 1 << 64)),
        (ParentBased(TraceIdRatioBased(0.01)), (True, TraceIdRatioBased.get_bound_for_rate(0.01))),
    ],
)
def test_the_sdks_standard_samplers_are_decided_by_kafkatx(sampler: Sampler, rule: tuple[bool, int]) -> None:
    head = head_sampler(TracerProvider(sampler=sampler).get_tracer("t"))
    assert head is not None and (head.parent_based, head.bound) == rule


def test_any_other_sampler_or_propagator_is_left_to_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    assert head_sampler(TracerProvider(sampler=_Custom()).get_tracer("t")) is None
    assert (
        head_sampler(
            TracerProvider(sampler=ParentBased(ALWAYS_ON, remote_parent_not_sampled=ALWAYS_ON)).get_tracer("t")
        )
        is None
    )
    assert head_sampler(object()) is None, "not the SDK's tracer"

    class B3Like(TextMapPropagator):
        def extract(self, *args: Any, **kwargs: Any) -> Any: ...
        def inject(self, *args: Any, **kwargs: Any) -> None: ...

        @property
        def fields(self) -> set[str]:
            return {"x-b3-traceid"}

    monkeypatch.setattr(propagate, "get_global_textmap", lambda: B3Like())
    assert head_sampler(TracerProvider().get_tracer("t")) is None


def test_a_custom_sampler_still_traces_every_record_through_the_sdk() -> None:
    traced, exporter = _traced(_Custom())
    (output,) = traced(_record(traceparent=SAMPLED))
    assert len(exporter.get_finished_spans()) == 1
    assert bytes(dict(output.headers)["traceparent"]).split(b"-")[1] == SAMPLED.split("-")[1].encode()


def test_a_root_record_is_sampled_at_the_ratio_and_its_span_has_the_trace_id_kafkatx_drew() -> None:
    random.seed(7)
    bound = TraceIdRatioBased.get_bound_for_rate(0.25)
    traced, exporter = _traced(ParentBased(TraceIdRatioBased(0.25)))
    outputs = [traced(_record(offset)) for offset in range(400)]
    spans = exporter.get_finished_spans()
    # Were the SDK to draw a trace id of its own after kafkatx's draw, about 0.25 * 0.25 of them would be sampled.
    assert 60 < len(spans) < 140
    assert all((s.context.trace_id & ((1 << 64) - 1)) < bound for s in spans)
    traced_outputs = [o for o in outputs if isinstance(o, list)]
    assert len(traced_outputs) == len(spans), "a sampled record's outputs carry its trace"
    assert {bytes(dict(o[0].headers)["traceparent"]).split(b"-")[1] for o in traced_outputs} == {
        f"{s.context.trace_id:032x}".encode() for s in spans
    }
    assert outputs.count(b"v") == 400 - len(spans), "a sampled-out root record runs as with tracing off"


def test_a_parents_sampled_flag_decides_whatever_the_ratio() -> None:
    traced, exporter = _traced(ParentBased(TraceIdRatioBased(0.0)))
    (output,) = traced(_record(traceparent=SAMPLED))
    (span,) = exporter.get_finished_spans()
    assert f"{span.context.trace_id:032x}" == SAMPLED.split("-")[1], "a sampled parent is always traced"

    traced, exporter = _traced(ParentBased(ALWAYS_ON))
    out = traced(_record(traceparent=UNSAMPLED, tracestate=b"k=v", baggage=b"tenant=acme"))
    assert exporter.get_finished_spans() == ()
    assert isinstance(out, Output), "a plain value comes back as one output with the record's trace headers"
    assert out.headers == [("traceparent", UNSAMPLED.encode()), ("tracestate", b"k=v"), ("baggage", b"tenant=acme")]


def test_a_sampled_out_record_with_a_trace_passes_it_on_to_sent_and_returned_outputs() -> None:
    def handler(record: Record) -> list[Any]:
        send("side", b"s", headers={"traceparent": b"stale", "h": b"1"})
        return [b"r"]

    traced, exporter = _traced(ALWAYS_OFF, handler)
    outputs = traced(_record(traceparent=SAMPLED))
    assert exporter.get_finished_spans() == (), "ALWAYS_OFF drops even a sampled parent"
    assert [(o.topic, o.value) for o in outputs] == [("side", b"s"), ("out", b"r")]
    assert [dict(o.headers)["traceparent"] for o in outputs] == [SAMPLED.encode()] * 2
    assert ("h", b"1") in outputs[0].headers


def test_the_sampled_path_writes_what_the_w3c_propagators_write() -> None:
    traced, exporter = _traced(ALWAYS_ON)
    (output,) = traced(_record(traceparent=SAMPLED, tracestate=b"k=v", baggage=b"tenant=acme"))
    (span,) = exporter.get_finished_spans()
    context = span.context
    assert output.headers == [
        ("traceparent", f"00-{context.trace_id:032x}-{context.span_id:016x}-01".encode()),
        ("tracestate", b"k=v"),
        ("baggage", b"tenant=acme"),
    ]


def test_at_a_ratio_a_transaction_gets_a_span_only_when_it_holds_a_sampled_record() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(1e-9)))  # a root: as good as never
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)
    callbacks: dict[type, Any] = {}
    tracing.subscribe(lambda kind, callback: callbacks.__setitem__(kind, callback))
    spec = SimpleNamespace(
        name="l", handler=lambda r: r.value, output="out", serializer=None, is_async=False, concurrency=1
    )
    traced = tracing.wrap(spec, "g")

    traced(_record(0))  # a root record, sampled out
    callbacks[TransactionCommitted](TransactionCommitted("l", 0, records=1))
    assert exporter.get_finished_spans() == (), "no sampled record: no transaction span"

    traced(_record(1, traceparent=SAMPLED))
    callbacks[TransactionCommitted](TransactionCommitted("l", 0, records=1))
    record_span, transaction = exporter.get_finished_spans()
    assert transaction.name == "kafkatx transaction", "sampled, as the record it holds, whatever the ratio"
    assert [link.context.span_id for link in transaction.links] == [record_span.context.span_id]


def test_a_record_with_a_traced_earlier_attempt_is_traced_whatever_the_draw() -> None:
    from opentelemetry.trace import SpanContext, TraceFlags

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(1e-9)))  # a root: as good as never
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider)
    spec = SimpleNamespace(
        name="l", handler=lambda r: r.value, output="out", serializer=None, is_async=False, concurrency=1
    )
    traced = tracing.wrap(spec, "g")
    first = SpanContext(0x1234, 0x5678, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    tracing.attempts.failed(("g", "in", 0, 7), first)
    assert traced(Record("in", 0, 6, None, b"v", attempt=2)) == b"v", "another record: sampled out"
    (output,) = traced(Record("in", 0, 7, None, b"v", attempt=2))
    (span,) = exporter.get_finished_spans()
    assert [link.context.span_id for link in span.links] == [0x5678]
    assert span.attributes is not None and span.attributes["kafkatx.attempt"] == 2


def test_the_gap_between_sampled_root_records_has_the_ratios_distribution() -> None:
    """One geometric draw per sampled record instead of one draw per record: the same share sampled."""
    from kafkatx.tracing._sampling import root_gap

    random.seed(11)
    for rate in (0.5, 0.01):
        bound = TraceIdRatioBased.get_bound_for_rate(rate)
        gaps = [root_gap(bound) for _ in range(20_000)]
        sampled_share = len(gaps) / (len(gaps) + sum(gaps))
        assert abs(sampled_share - rate) < rate * 0.05, (rate, sampled_share)
        assert min(gaps) == 0, "a record right after a sampled one can be sampled too"
    assert root_gap(0) == sys.maxsize, "a ratio of 0 samples no root record"
    assert root_gap(1 << 64) == 0


@pytest.mark.parametrize(
    ("sampler", "held"),
    [(ParentBased(TraceIdRatioBased(0.01)), True), (ALWAYS_OFF, True), (ALWAYS_ON, False), (_Custom(), False)],
    ids=["ratio", "never", "always", "custom"],
)
def test_the_runner_holds_the_root_countdown_only_where_kafkatx_samples_roots_at_a_ratio(
    sampler: Sampler, held: bool
) -> None:
    provider = TracerProvider(sampler=sampler)
    spec = SimpleNamespace(name="l", handler=lambda r: r.value, output="out", serializer=None, is_async=False,
                           concurrency=1)  # fmt: skip
    tracing = Tracing(provider)
    tracing.wrap(spec, "g")
    roots = tracing.untraced_roots(spec)
    assert (roots is not None) is held
    if roots is not None:
        assert roots.handler is spec.handler, "the listener's own handler, untraced"


def test_the_root_countdown_is_the_runners_while_it_holds_it_and_the_wrappers_while_records_fail() -> None:
    calls: list[int] = []
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.01)))
    spec = SimpleNamespace(name="l", handler=lambda r: calls.append(r.offset), output=None, serializer=None,
                           is_async=False, concurrency=1)  # fmt: skip
    tracing = Tracing(provider)
    traced = tracing.wrap(spec, "g")
    roots = tracing.untraced_roots(spec)
    assert roots is not None
    random.seed(7)
    taken = roots.take()
    assert taken > 0 and roots.take() == 0, "taken: the wrapper's count is 0 until given back"
    traced(_record(1))  # the runner sends a root to the wrapper when its count ran out: sampled in
    drawn = roots.take()
    assert drawn >= 0 and calls == [1]
    roots.give_back(taken + drawn)
    failing = tracing.attempts
    failing.failed(("g", "in", 0, 9), SimpleNamespace())  # type: ignore[arg-type]
    assert roots.take() == 0, "a record's traced attempt failed: the wrapper decides every record"
    failing.done(("g", "in", 0, 9))
    assert roots.take() == taken + drawn
