"""A listener's handler wrapped in its record's span: what it returns and ``send()``\\ s carries the trace.

Two wrappers, one per kind of handler (plain, ``async def``). A plain one
decides a root record's sampling itself first, for as little as a countdown
per record (:class:`~kafkatx.tracing._sampling.RootCountdown`).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kafkatx.context import bind_sink
from kafkatx.outputs import collect_outputs
from kafkatx.record import Output, Record
from kafkatx.tracing._records import RecordSpans, Sink, traced_outputs
from kafkatx.tracing._sampling import ALWAYS_SAMPLED, RootCountdown, root_gap

__all__ = ["TracedListener", "wrap_async_handler", "wrap_batch_handler", "wrap_handler"]


#: What a plain handler returns when it is an ``async def`` in disguise: handed on as it is, for the runner to refuse.
_AWAITABLES = (types.CoroutineType, types.AsyncGeneratorType)


class TracedListener(Protocol):
    """What the wrapper needs of a listener's declaration (a ``ListenerSpec``)."""

    @property
    def name(self) -> str: ...
    @property
    def handler(self) -> Callable[..., Any]: ...
    @property
    def output(self) -> str | None: ...
    @property
    def serializer(self) -> Any: ...
    @property
    def is_async(self) -> bool: ...
    @property
    def concurrency(self) -> int: ...


def wrap_handler(spec: TracedListener, spans: RecordSpans) -> Callable[[Record], Any]:
    """A plain handler in its record's span: what it returns and sends comes back as outputs with the trace."""
    handler, output, serializer, listener = spec.handler, spec.output, spec.serializer, spec.name
    start, finish = spans.start, spans.finish
    carried = spans.sampled_out if spans.head is not None else None
    bound, pin_sampled, failing = _root_shortcut(spans)
    countdown = RootCountdown(handler, failing, root_gap(bound) if bound is not None else 0)
    if bound is not None and bound < ALWAYS_SAMPLED:  # the record runner may hold the countdown (UntracedRoots)
        spans.countdown = countdown

    collect = _collector(spec)
    sampled_out = _sampled_out_runner(spec)

    def traced(record: Record) -> Any:
        """The record wrapper: its first test is all a root record the ratio samples out costs (most records,
        unless the record runner holds the countdown and calls the handler itself)."""
        if countdown.skip and not record.headers and not failing:
            countdown.skip -= 1
            return handler(record)  # sampled out: tracing off for this record
        return decided(record)

    def decided(record: Record) -> Any:
        if carried is not None:
            if bound is not None and not failing and not record.headers:  # a root record the ratio samples in
                countdown.skip = root_gap(bound)
                if spans.deferred is not None:  # its SDK span is made while its transaction commits
                    return spans.run_deferred(record, collect, serializer)
                pin_sampled()  # the SDK's span gets a trace id the ratio samples: its sampler agrees
            else:
                trace = carried(record)
                if trace is not None:  # sampled out: nothing to carry on is tracing off for this record
                    return sampled_out(record, trace) if trace else handler(record)
        span, key, token, context = start(record)
        sink = Sink(serializer)
        error: BaseException | None = None
        previous = bind_sink(sink)
        try:
            result = handler(record)
            if isinstance(result, _AWAITABLES):
                return result
            collect_outputs(result, output, serializer, listener, sink)
        except BaseException as exc:
            error = exc
            raise
        finally:
            bind_sink(previous)
            outputs = finish(span, key, token, context, record, sink, error)
            error = None  # the exception's traceback holds this frame: kept, the two would be a reference cycle
        return outputs

    return traced


def _collector(spec: TracedListener) -> Callable[[Record, Sink], Any]:
    """The handler's call for a root record whose span is made later (RecordSpans.run_deferred): its own
    function, given to the spans, and built apart from the record wrapper that decides when it runs."""
    handler, output, serializer, listener = spec.handler, spec.output, spec.serializer, spec.name

    def collect(record: Record, sink: Sink) -> Any:
        """Run the handler; what it returns joins what it sent in ``sink``. Returned instead: one value for the
        listener's output (bytes, the common case, encoded once), or an awaitable (refused by the runner)."""
        result = handler(record)
        if type(result) is bytes and output is not None and not sink:
            return result
        if isinstance(result, _AWAITABLES):
            return result
        collect_outputs(result, output, serializer, listener, sink)
        return None

    return collect


def _sampled_out_runner(spec: TracedListener) -> Callable[[Record, list[tuple[str, bytes]]], Any]:
    """The handler's call for a record whose trace is sampled out but carried on: no span, only the trace
    headers on its outputs; built apart from the record wrapper, which calls it for such records only."""
    handler, output, serializer, listener = spec.handler, spec.output, spec.serializer, spec.name

    def sampled_out(record: Record, trace: list[tuple[str, bytes]]) -> Any:
        """No span: the outputs only carry the trace (and its decision) on."""
        sink = Sink(serializer)
        previous = bind_sink(sink)
        try:
            result = handler(record)
            if type(result) is bytes and output is not None and not sink:  # the common case, without the list
                return Output(result, None, None, trace)
            if isinstance(result, _AWAITABLES):  # an async def behind a def: the runner refuses it
                return result
            collect_outputs(result, output, serializer, listener, sink)
        finally:
            bind_sink(previous)
        return traced_outputs(sink, trace) if sink else None

    return sampled_out


def _root_shortcut(spans: RecordSpans) -> tuple[int | None, Callable[[], bool], Mapping[Any, Any]]:
    """What the record wrapper needs to decide a root record itself: the ratio's bound (None: it cannot, e.g.
    the ids are not the SDK's random ones), the pin of a sampled trace id, the failing records."""
    head = spans.head
    if head is None or not head.random_ids:
        return None, bool, spans.attempts.records  # bool(): False, nothing pinned
    return head.bound, head.pin_sampled, spans.attempts.records


def wrap_async_handler(spec: TracedListener, spans: RecordSpans) -> Callable[[Record], Any]:
    """An ``async def`` handler in its record's span (the span is the current one in the record's own task)."""
    handler, output, serializer, listener = spec.handler, spec.output, spec.serializer, spec.name
    start, finish = spans.start, spans.finish
    carried = spans.sampled_out if spans.head is not None else None

    async def sampled_out(record: Record, trace: list[tuple[str, bytes]]) -> Any:
        sink = Sink(serializer)
        previous = bind_sink(sink)
        try:
            collect_outputs(await handler(record), output, serializer, listener, sink)
        finally:
            bind_sink(previous)
        return traced_outputs(sink, trace) if sink else None

    async def traced_async(record: Record) -> Any:
        if carried is not None:
            trace = carried(record)
            if trace is not None:
                return await (sampled_out(record, trace) if trace else handler(record))
        span, key, token, context = start(record)
        sink = Sink(serializer)
        error: BaseException | None = None
        previous = bind_sink(sink)
        try:
            result = await handler(record)
            collect_outputs(result, output, serializer, listener, sink)
        except BaseException as exc:
            error = exc
            raise
        finally:
            bind_sink(previous)
            outputs = finish(span, key, token, context, record, sink, error)
            error = None  # the exception's traceback holds this frame: kept, the two would be a reference cycle
        return outputs

    return traced_async


def wrap_batch_handler(spec: TracedListener, spans: RecordSpans) -> Callable[[list[Record]], Any]:
    """A batch listener's handler in one span per call (a plain or an ``async def`` one: the batch runner awaits
    what it returns), linked to the traces of the call's records; what it returns and sends carries the call's
    trace."""
    handler, output, serializer, listener = spec.handler, spec.output, spec.serializer, spec.name

    def traced_batch(records: list[Record]) -> Any:
        with _BatchCall(spans, serializer, records) as call:
            collect_outputs(handler(records), output, serializer, listener, call.sink)
        return call.outputs

    async def traced_async_batch(records: list[Record]) -> Any:
        with _BatchCall(spans, serializer, records) as call:  # current across the await: the call's own task
            collect_outputs(await handler(records), output, serializer, listener, call.sink)
        return call.outputs

    return traced_async_batch if spec.is_async else traced_batch


class _BatchCall:
    """One call of a batch handler, plain or awaited alike: its span current and its sink bound while it runs,
    and once it returned (or raised) the outputs :meth:`RecordSpans.finish_batch` makes of what it returned and
    sent."""

    __slots__ = ("_spans", "_records", "_started", "_previous", "sink", "outputs")

    def __init__(self, spans: RecordSpans, serializer: Any, records: list[Record]) -> None:
        self._spans, self._records = spans, records
        self.sink = Sink(serializer)
        self.outputs: Any = None

    def __enter__(self) -> _BatchCall:
        self._started = self._spans.start_batch(self._records)
        self._previous = bind_sink(self.sink)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: types.TracebackType | None
    ) -> None:
        bind_sink(self._previous)
        span, token, context = self._started
        self.outputs = self._spans.finish_batch(span, token, context, self.sink, error)
