"""Per-record cost of kafkatx tracing, without a broker: the traced handler against the bare one.

Run: ``PYTHONPATH=src python bench/tracing_cost.py``. Prints CPU microseconds
per record (the span processor's thread included) for a bare OpenTelemetry
SDK span (``start_span``/``end``, batch span processor, spans dropped), and
the extra cost of kafkatx's traced handler over the same handler untraced, at
0% (``ALWAYS_OFF``), 1% (``ParentBased(TraceIdRatioBased(0.01))``, the usual
production setting) and 100% sampling. Each handler's result is collected as
the record runner does; the measures are interleaved, best of several passes,
as the machine may be shared.
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
from kafkatx.outputs import collect_outputs
from kafkatx.tracing import Tracing

SETTINGS = (
    ("0% (ALWAYS_OFF)", ALWAYS_OFF),
    ("1% (ParentBased(TraceIdRatioBased(0.01)))", ParentBased(TraceIdRatioBased(0.01))),
    ("100% (ALWAYS_ON)", ALWAYS_ON),
)


class _Drop(SpanExporter):
    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _provider(sampler: Sampler) -> TracerProvider:
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(_Drop()))
    return provider


def _per_record(call: Any, records: list[Record]) -> float:
    """CPU microseconds per record of ``call`` with its result collected as the runner does (one pass)."""
    into: list[Any] = []
    t0 = time.process_time()
    for r in records:
        collect_outputs(call(r), "out", None, "l", into)
        into.clear()
    return (time.process_time() - t0) / len(records) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    records = [Record("in", i % 8, i, b"k", b"value-%d" % i) for i in range(args.records)]

    def handler(record: Record) -> bytes | None:
        return record.value

    spec = SimpleNamespace(name="l", handler=handler, output="out", serializer=None, is_async=False, concurrency=1)
    providers = [_provider(sampler) for _, sampler in SETTINGS]
    traced = [Tracing(p).wrap(spec, "g") for p in providers]
    sdk = [p.get_tracer("bench") for p in providers]
    bare: list[float] = []
    extra: list[list[float]] = [[] for _ in SETTINGS]
    spans: list[list[float]] = [[] for _ in SETTINGS]
    for _ in range(args.passes):
        for i, provider in enumerate(providers):
            bare.append(_per_record(handler, records))
            extra[i].append(_per_record(traced[i], records) - bare[-1])
            provider.force_flush()  # the span processor's thread is idle again before the next measure
            tracer = sdk[i]
            spans[i].append(_per_record(lambda r, tracer=tracer: tracer.start_span("process in").end(), records))
            provider.force_flush()
    print(f"untraced handler: {min(bare):.2f} us/record")
    for (label, _), e, s in zip(SETTINGS, extra, spans, strict=True):
        cost = min(e)
        print(
            f"{label}: kafkatx traced handler +{cost:.2f} us/record ({cost / 10:.2f}% of a 1 ms handler); "
            f"a bare SDK start_span+end {min(s):.2f} us"
        )
    for provider in providers:
        provider.shutdown()


if __name__ == "__main__":
    main()
