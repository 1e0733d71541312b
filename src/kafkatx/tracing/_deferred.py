"""The span of a sampled root record, made by the SDK after its handler ran: while its transaction commits.

An SDK span costs the container thread tens of microseconds (ids, sampler,
nine attributes checked one by one, the span processor): ``start_span``
alone was measured at ~24 us per sampled record in a busy listener, most of
what tracing at 1% costs. While the handler runs, the record needs only the
span's *context*: as the current span (the parent of the handler's own
spans) and in its outputs' ``traceparent``. So for a root record kafkatx has
sampled itself (its trace id drawn under the ratio, :mod:`kafkatx.tracing._sampling`),
the handler runs under a :class:`PendingSpan`: a recording stand-in with the
context the SDK span will have, which keeps what the handler does to the
current span (attributes, events, exceptions, status, links, a new name).

:class:`DeferredSpans` makes the SDK spans afterwards, with the same ids
(:class:`~kafkatx.tracing._sdk.PinnedTraceIds`), the attempt's start and
end times, and what was kept replayed onto them. Its container calls
:meth:`DeferredSpans.make` while a transaction commits (the thread waits on
the broker then: ``ListenerSpec.while_committing``), and kafkatx again when
a transaction's outcome is known and when the App stops, so that no span is
left behind. The spans are exported as before, a few milliseconds later. A span
with nothing to replay goes straight to the span processors where that is all
the SDK would do and the SDK's version allows (:mod:`kafkatx.tracing._sdk`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from random import getrandbits
from typing import TYPE_CHECKING, Any, NamedTuple

from opentelemetry.context import Context
from opentelemetry.trace import Span as _ApiSpan
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from kafkatx.tracing._sdk import direct_recorder

if TYPE_CHECKING:
    from kafkatx.tracing._sdk import DirectRecorder

__all__ = ["DeferredSpans", "PendingSpan", "Pins"]

log = logging.getLogger("kafkatx.tracing")

#: What the handler did to its current span, replayed onto the SDK span: (method name, arguments).
_Call = tuple[str, tuple[Any, ...]]


class PendingSpan(_ApiSpan):
    """The current span while a deferred record span's handler runs: its context now, its calls kept for later."""

    def __init__(self, context: SpanContext) -> None:
        self._context = context
        self.calls: list[_Call] = []

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return True

    def end(self, end_time: int | None = None) -> None:
        """kafkatx ends the record's span when the handler returns; an earlier end is ignored."""

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.calls.append(("set_attributes", (dict(attributes),)))

    def set_attribute(self, key: str, value: Any) -> None:
        self.calls.append(("set_attribute", (key, value)))

    def add_event(self, name: str, attributes: Any = None, timestamp: int | None = None) -> None:
        self.calls.append(("add_event", (name, attributes, timestamp or time.time_ns())))

    def add_link(self, context: SpanContext, attributes: Any = None) -> None:
        self.calls.append(("add_link", (context, attributes)))

    def update_name(self, name: str) -> None:
        self.calls.append(("update_name", (name,)))

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        self.calls.append(("set_status", (status, description)))

    def record_exception(
        self, exception: BaseException, attributes: Any = None, timestamp: int | None = None, escaped: bool = False
    ) -> None:
        self.calls.append(("record_exception", (exception, attributes, timestamp or time.time_ns(), escaped)))


class _Attempt(NamedTuple):
    """A handled record attempt whose SDK span is still to be made."""

    pending: PendingSpan
    name: str
    attributes: dict[str, Any]
    start: int
    end: int
    error: BaseException | None


class Pins(NamedTuple):
    """The id generator's pins (``PinnedTraceIds``): the next trace id and span id of this thread, and unpin."""

    trace: Callable[[int], None]
    span: Callable[[int], None]
    unpin: Callable[[], None]


class DeferredSpans:
    """The record attempts of one container whose SDK spans are still to be made, and the making of them."""

    def __init__(self, tracer: Any, pins: Pins, random_ids: bool) -> None:
        self._tracer, self._pins = tracer, pins
        self._attempts: deque[_Attempt] = deque()  # appended by whichever thread ran the handler
        #: The flags the SDK gives a span it samples with a random root trace id (W3C level 2 "random" flag).
        self.flags = TraceFlags(TraceFlags.SAMPLED | (getattr(TraceFlags, "RANDOM_TRACE_ID", 0) if random_ids else 0))
        self._empty = Context()  # a root span: no parent, whatever is current where it is made
        #: Spans that could not be made (the SDK or an exporter raised): logged once.
        self.dropped = 0
        #: Records a span with nothing to replay straight to the span processors (kafkatx.tracing._sdk); None:
        #: not known yet (decided at the first span the SDK makes), or the SDK's own ``start_span`` is needed.
        self._direct: DirectRecorder | None = None
        self._direct_checked = False

    def context(self, trace_id: int, span_id: int) -> SpanContext:
        """The context the SDK span of a sampled root attempt will have."""
        return SpanContext(trace_id, span_id, is_remote=False, trace_flags=self.flags)

    def add(
        self,
        pending: PendingSpan,
        name: str,
        attributes: dict[str, Any],
        start: int,
        end: int,
        error: BaseException | None,
    ) -> None:
        self._attempts.append(_Attempt(pending, name, attributes, start, end, error))

    @property
    def records_directly(self) -> bool:
        """Whether a span with nothing to replay skips ``start_span`` (``kafkatx.tracing._sdk.direct_recorder``)."""
        return self._direct is not None

    def record_directly(
        self, name: str, trace_id: int, attributes: dict[str, Any], linked: Sequence[SpanContext], start: int, end: int
    ) -> bool:
        """Record a finished root span (a transaction's) straight to the span processors; False where only the
        SDK's ``start_span`` may (:attr:`records_directly`)."""
        if self._direct is None:
            return False
        context = self.context(trace_id, getrandbits(64) or 1)
        self._direct(name, context, SpanKind.INTERNAL, attributes, linked, start, end)
        return True

    def __len__(self) -> int:
        return len(self._attempts)

    def make(self) -> None:
        """Make the SDK span of every attempt added so far (thread-safe; spans added meanwhile are made too).

        Never raises: it runs while a transaction commits, and a span the SDK or an exporter failed to take must
        not look like a failed commit. Such a span is logged and dropped, as the SDK drops what it cannot export.
        """
        attempts = self._attempts
        while attempts:
            try:
                attempt = attempts.popleft()
            except IndexError:  # another thread took the last one
                return
            try:
                self._make(attempt)
            except Exception:  # noqa: BLE001 - see the docstring
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("the span of a traced record could not be made (logged once)", exc_info=True)

    def _make(self, attempt: _Attempt) -> None:
        """One attempt's SDK span: with its ids pinned, its times, and what its handler did to it replayed."""
        tracer, pins, empty = self._tracer, self._pins, self._empty
        context = attempt.pending.get_span_context()
        if self._direct is not None and not attempt.pending.calls and attempt.error is None:
            self._direct(attempt.name, context, SpanKind.CONSUMER, attempt.attributes, (), attempt.start, attempt.end)
            return
        pins.trace(context.trace_id)
        pins.span(context.span_id)
        try:
            span = tracer.start_span(
                attempt.name,
                context=empty,
                kind=SpanKind.CONSUMER,
                attributes=attempt.attributes,
                start_time=attempt.start,
            )
        finally:
            pins.unpin()
        _replay(span, attempt.pending.calls)
        error = attempt.error
        if error is not None:
            span.record_exception(error, timestamp=attempt.end)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end(end_time=attempt.end)
        if not self._direct_checked:
            self._direct_checked = True
            self._direct = direct_recorder(tracer, span)


def _replay(span: Any, calls: Sequence[_Call]) -> None:
    """What the handler did to its current span, done to the SDK span in the same order."""
    for method, args in calls:
        getattr(span, method)(*args)
