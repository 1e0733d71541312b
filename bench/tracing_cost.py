"""Per-record cost of kafkatx tracing, without a broker: the traced handler against the bare one.

Run: ``PYTHONPATH=src python bench/tracing_cost.py``. Prints microseconds per
record for a bare OpenTelemetry SDK span (``start_span``/``end``, batch span
processor, spans dropped), and for kafkatx's traced handler at 100%, 1%
(``ParentBased(TraceIdRatioBased(0.01))``) and 0% sampling, each over the cost
of the same handler untraced. The handler returns its value (the default
benchmark run's shape).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased

from kafkatx import Record
from kafkatx.tracing import Tracing


class _Drop(SpanExporter):
    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _provider(sampler: Sampler) -> TracerProvider:
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(_Drop(), max_queue_size=1 << 20))
    return provider


def _per_record(call: Any, records: list[Record]) -> float:
    """CPU microseconds per call (the span processor's thread included), the best of three passes."""
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        for r in records:
            call(r)
        elapsed = time.process_time() - t0
        best = min(best, elapsed / len(records) * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=20_000)
    args = parser.parse_args()
    records = [Record("in", i % 8, i, b"k", b"value-%d" % i) for i in range(args.records)]

    def handler(record: Record) -> bytes | None:
        return record.value

    bare = _per_record(handler, records)
    print(f"untraced handler: {bare:.2f} us/record")
    for label, sampler in (
        ("0% (ALWAYS_OFF)", ALWAYS_OFF),
        ("1% (ParentBased(TraceIdRatioBased(0.01)))", ParentBased(TraceIdRatioBased(0.01))),
        ("100% (ALWAYS_ON)", ALWAYS_ON),
    ):
        provider = _provider(sampler)
        sdk = provider.get_tracer("bench")
        sdk_cost = _per_record(lambda record: sdk.start_span("process in").end(), records)
        provider.force_flush()  # the span processor's thread is idle again before the next measure
        spec = SimpleNamespace(name="l", handler=handler, output="out", serializer=None, is_async=False, concurrency=1)
        traced = Tracing(provider).wrap(spec, "g")
        cost = _per_record(traced, records) - bare
        provider.shutdown()
        print(
            f"{label}: bare SDK start_span+end {sdk_cost:.2f} us; kafkatx traced handler +{cost:.2f} us/record "
            f"({cost / 10:.2f}% of a 1 ms handler)"
        )


if __name__ == "__main__":
    main()
