"""W3C trace context in Kafka headers: OpenTelemetry's carrier getter and setter over ``(name, bytes)`` pairs.

Kafka headers are a list of pairs in which a name may repeat; the last value
of a name wins, and a trace written onto an output replaces any it carried.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context

__all__ = [
    "TRACE_HEADERS",
    "HeaderGetter",
    "HeaderSetter",
    "carries_trace",
    "extract_context",
    "trace_headers",
    "with_trace",
]

#: The headers of W3C trace context and baggage: replaced, never duplicated, on an output that carries a trace.
TRACE_HEADERS = frozenset({"traceparent", "tracestate", "baggage"})

#: A record's headers: ``(name, value)`` pairs.
Headers = Sequence[tuple[str, Any]]


class HeaderGetter:
    """OpenTelemetry's ``Getter`` over Kafka headers: ``(name, bytes)`` pairs, the last value of a name wins."""

    def get(self, carrier: Headers | None, key: str) -> list[str] | None:
        if not carrier:
            return None
        for name, value in reversed(carrier):
            if name == key and value is not None:
                return [value.decode("utf-8", "replace") if isinstance(value, bytes | bytearray) else str(value)]
        return None

    def keys(self, carrier: Headers | None) -> list[str]:
        return [name for name, _ in carrier or ()]


class HeaderSetter:
    """OpenTelemetry's ``Setter`` into a list of Kafka headers, replacing an earlier value of the name."""

    def set(self, carrier: list[tuple[str, bytes]], key: str, value: str) -> None:
        carrier[:] = [(name, v) for name, v in carrier if name != key]
        carrier.append((key, value.encode()))


_GETTER = HeaderGetter()
_SETTER = HeaderSetter()


def extract_context(headers: Headers | None) -> Context:
    """The trace context (and baggage) a record's headers carry; an empty context when they carry none."""
    from opentelemetry import propagate

    return propagate.extract(headers or [], getter=_GETTER)  # type: ignore[arg-type]


def trace_headers(context: Context | None = None) -> list[tuple[str, bytes]]:
    """The W3C headers of ``context`` (the current one by default), ready for a Kafka record."""
    from opentelemetry import propagate

    carrier: list[tuple[str, bytes]] = []
    propagate.inject(carrier, context=context, setter=_SETTER)  # type: ignore[arg-type]
    return carrier


def with_trace(headers: Iterable[tuple[str, Any]] | None, trace: list[tuple[str, bytes]]) -> list[tuple[str, Any]]:
    """``headers`` without any earlier trace headers, plus ``trace``."""
    kept = [(k, v) for k, v in headers or () if k not in TRACE_HEADERS]
    return kept + trace


def carries_trace(headers: Headers) -> bool:
    """True if ``headers`` hold any W3C trace context or baggage (checked before extracting it costs more)."""
    for name, _ in headers:
        if name in TRACE_HEADERS:
            return True
    return False
