"""A record's failed attempts' span contexts carried through a retry topic (``retry="topics"``).

In one process the attempts of a record are linked from memory (:class:`~kafkatx.tracing._links.AttemptLinks`).
A record in a retry topic may be read back by another process (a restart, a rebalance), so its hop
carries them too: W3C ``traceparent`` values, comma-separated, in a header of kafkatx's that the handler
never sees (:mod:`kafkatx.retry_topics.headers`). Read back, they are remembered for the record as if its
attempts had run here, so its next attempt's span links to them as any retried attempt's does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kafkatx.record import Record
from kafkatx.tracing._links import AttemptLinks

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

__all__ = ["MAX_CARRIED", "HopLinks"]

#: At most this many attempts' contexts travel with a hop (the latest).
MAX_CARRIED = 32


class HopLinks:
    """The App's attempt links, as a listener's retry hops write them into a hop and read them back."""

    def __init__(self, attempts: AttemptLinks) -> None:
        self._attempts = attempts

    def carried(self, group_id: str, record: Record) -> bytes | None:
        """The contexts of ``record``'s failed attempts remembered (its hop's header value); None if none."""
        key = (group_id, record.topic, record.partition, record.offset)
        if not self._attempts.holds(key):
            return None
        contexts = self._attempts.earlier(key)[-MAX_CARRIED:]
        return ",".join(_traceparent(c) for c in contexts).encode() if contexts else None

    def arrived(self, group_id: str, record: Record, value: bytes) -> None:
        """``record`` was read back from a retry topic with ``value``: remembered for its next attempt's links,
        unless its attempts are remembered here already (they ran in this process)."""
        key = (group_id, record.topic, record.partition, record.offset)
        if self._attempts.holds(key):
            return
        for context in _contexts(value):
            self._attempts.failed(key, context)


def _traceparent(context: SpanContext) -> str:
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def _contexts(value: bytes) -> list[SpanContext]:
    """The span contexts of a hop's header; what does not parse is left out (a header is no reason to fail)."""
    from opentelemetry.trace import SpanContext, TraceFlags

    contexts = []
    for part in value.decode("ascii", "replace").split(",")[-MAX_CARRIED:]:
        fields = part.strip().split("-")
        if len(fields) != 4:
            continue
        try:
            trace_id, span_id, flags = int(fields[1], 16), int(fields[2], 16), int(fields[3], 16)
        except ValueError:
            continue
        if trace_id and span_id:
            contexts.append(SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags & 0xFF)))
    return contexts
