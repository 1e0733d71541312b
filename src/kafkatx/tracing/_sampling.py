"""The sampling decision of a record's span, made by kafkatx before any OpenTelemetry call when it can be.

At the usual production setting, ``ParentBased(TraceIdRatioBased(0.01))``,
99 records in 100 are sampled out, and the SDK still costs several
microseconds for each of them (trace and span ids, the sampler, a
non-recording span, the propagator), more than kafkatx's own work per record.
When the tracer is the SDK's and its sampler one of the SDK's standard ones
(``ALWAYS_ON``, ``ALWAYS_OFF``, ``TraceIdRatioBased``, or ``ParentBased`` of one
of them with its default delegates) and the propagator writes only the W3C
headers, :class:`HeadSampler` makes the same decision from the record's
``traceparent`` and a trace id it draws itself:

- a record whose ``traceparent`` says *sampled* is traced (parent-based); one
  that says *not sampled* is not, and its outputs carry its trace headers on
  unchanged, so that the services downstream drop it as well;
- a record without one is a root: a trace id is drawn as the tracer's id
  generator does and the ratio applied to it as ``TraceIdRatioBased`` does.
  Sampled in, the SDK makes the span with that very trace id
  (:class:`~kafkatx.tracing._sdk.PinnedTraceIds`), so its sampler agrees. Sampled out, the handler
  runs as with tracing off: no context, and no trace header on its outputs
  (there is no recorded trace to continue; writing a fresh *not sampled*
  ``traceparent``, as the SDK's non-recording span would, costs more than
  kafkatx's whole per-record work). A downstream service decides for such a
  record as for any record without a trace.

Any other sampler or propagator, or an SDK outside the adapter's version
gate (:mod:`kafkatx.tracing._sdk`): ``head_sampler`` returns None and every
record goes through the SDK, as before.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from random import getrandbits, random
from typing import Any

from kafkatx.tracing._sdk import PinnedTraceIds, pinned_ids, tracer_sampler

__all__ = [
    "ALWAYS_SAMPLED",
    "TRACE_ID_LIMIT",
    "HeadSampler",
    "RootCountdown",
    "head_sampler",
    "parse_traceparent",
    "root_gap",
]

#: The bits of a trace id that ``TraceIdRatioBased`` compares with its bound (the low 64).
TRACE_ID_LIMIT = (1 << 64) - 1
#: A bound every trace id is under: every trace is sampled.
ALWAYS_SAMPLED = _ALWAYS = 1 << 64

# The W3C traceparent as OpenTelemetry's propagator reads it: version, trace id, parent id, flags.
_TRACEPARENT = re.compile(r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?[ \t]*$")
_DEFAULT_DELEGATES = (
    ",remoteParentSampled:AlwaysOnSampler,remoteParentNotSampled:AlwaysOffSampler,"
    "localParentSampled:AlwaysOnSampler,localParentNotSampled:AlwaysOffSampler}"
)
_W3C_FIELDS = frozenset({"traceparent", "tracestate", "baggage"})


def parse_traceparent(value: Any) -> tuple[int, bool] | None:
    """``(trace id, sampled)`` of a ``traceparent`` header value; None if it is not a valid one."""
    if isinstance(value, bytes | bytearray):
        value = value.decode("ascii", "replace")
    elif not isinstance(value, str):
        return None
    match = _TRACEPARENT.match(value)
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return int(trace_id, 16), bool(int(flags, 16) & 1)


def root_gap(bound: int) -> int:
    """How many root records the ratio of ``bound`` samples out before the next one it samples in.

    A geometric draw: the same distribution as one draw per record against
    the ratio, made once per sampled record instead (at 1%, a sampled-out
    record then costs a countdown, not a random number). The sampled record's
    trace id is drawn under the bound (:meth:`HeadSampler.pin_sampled`), so
    the SDK's ``TraceIdRatioBased`` samples it too.
    """
    if bound <= 0:
        return sys.maxsize  # a ratio of 0: never
    rate = bound / (1 << 64)
    if rate >= 1.0:
        return 0
    return min(sys.maxsize, int(math.log(1.0 - random()) / math.log1p(-rate)))


class RootCountdown:
    """The root records the ratio samples out before the next one it samples in, and the untraced handler that
    runs them. The record runner takes the count while it handles a unit (``listener.host.UntracedRoots``)."""

    __slots__ = ("handler", "skip", "_failing")

    def __init__(self, handler: Callable[[Any], Any], failing: Mapping[Any, Any], skip: int) -> None:
        self.handler, self._failing, self.skip = handler, failing, skip

    def take(self) -> int:
        """The count, now the caller's; 0 while some record's traced attempt failed (the wrapper decides each)."""
        if self._failing:
            return 0
        skip, self.skip = self.skip, 0
        return skip

    def give_back(self, left: int) -> None:
        self.skip += left


class HeadSampler:
    """The tracer's sampling decision for a record, from its headers, without calling OpenTelemetry.

    ``parent_based``: a valid ``traceparent`` decides by its sampled flag.
    Otherwise the trace id (the parent's, or a new one) is sampled when its low
    64 bits are under ``bound`` (0: never, ``1 << 64``: always).
    """

    def __init__(
        self, parent_based: bool, bound: int, ids: PinnedTraceIds, fields: frozenset[str] = _W3C_FIELDS
    ) -> None:
        self.parent_based, self.bound, self.ids = parent_based, bound, ids
        #: The headers the global propagator writes (all or some of the W3C ones).
        self.fields = fields
        self._baggage = "baggage" in fields
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        #: The ids are the SDK's random ones: a root's draw is ``getrandbits`` (what the record wrapper inlines).
        self.random_ids = type(ids.inner) is RandomIdGenerator

    def carried(self, headers: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]] | None:
        """None if the record is sampled in; else the trace headers its outputs carry on (maybe none)."""
        parent = None
        if headers:
            for name, value in reversed(headers):
                if name == "traceparent":
                    parent = parse_traceparent(value)
                    break
        if parent is not None:
            trace_id, sampled = parent
            if sampled if self.parent_based else (trace_id & TRACE_ID_LIMIT) < self.bound:
                return None
            fields = self.fields
            return [(k, v) for k, v in headers or () if k in fields and v is not None]
        bound = self.bound
        if bound >= _ALWAYS:
            return None
        if bound:
            # The SDK's RandomIdGenerator is getrandbits: its low 64 bits decide, drawn first (most records stop here).
            if self.random_ids:
                low = getrandbits(64)
                if low < bound:
                    self.ids.pin((getrandbits(64) << 64) | low or 1)  # the SDK's span gets this id: its sampler agrees
                    return None
            else:
                trace_id = self.ids.generate_trace_id()
                if (trace_id & TRACE_ID_LIMIT) < bound:
                    self.ids.pin(trace_id)
                    return None
        if headers and self._baggage:  # no trace to continue; the baggage still goes on
            return [(k, v) for k, v in headers if k == "baggage" and v is not None]
        return []

    def pin_sampled(self) -> bool:
        """Fix the next root trace id of this thread to one the ratio samples; False if none is (a ratio of 0).

        For a span kafkatx decided to record although no draw would: a transaction holding a traced record,
        a record whose earlier attempt was traced (a record with a parent is decided by it, as before).
        """
        bound = self.bound
        if bound >= _ALWAYS:
            return True
        if not bound:
            return False
        self.ids.pin(self.sampled_trace_id())
        return True

    def sampled_trace_id(self) -> int:
        """A random root trace id that the ratio samples (its low 64 bits under the bound); the bound is above 0."""
        bound = self.bound
        return (getrandbits(64) << 64) | (getrandbits(64) % bound if bound < _ALWAYS else getrandbits(64)) or 1

    def headers_of(self, span: Any, headers: Sequence[tuple[str, Any]] | None) -> list[tuple[str, bytes]]:
        """What the W3C propagators write for ``span``'s context with a record's baggage (without their overhead)."""
        context = span.get_span_context()
        out = [("traceparent", b"00-%032x-%016x-%02x" % (context.trace_id, context.span_id, context.trace_flags))]
        state = context.trace_state
        if state and "tracestate" in self.fields:
            out.append(("tracestate", state.to_header().encode()))
        if headers and self._baggage:
            out += [(k, v) for k, v in headers if k == "baggage" and v is not None]
        return out


def head_sampler(tracer: Any) -> HeadSampler | None:
    """The shortcut for ``tracer``'s sampler, or None if kafkatx cannot decide for it (then the SDK decides).

    The SDK's sampler and id generator come through the adapter (:mod:`kafkatx.tracing._sdk`): None outside its
    version gate, and the SDK samples every record itself.
    """
    sampler = tracer_sampler(tracer)
    if sampler is None:
        return None
    from opentelemetry import propagate

    fields = frozenset(propagate.get_global_textmap().fields)
    if not fields <= _W3C_FIELDS or "traceparent" not in fields:
        return None  # B3, Jaeger...: the shortcut writes the W3C headers only
    rule = _sampler_rule(sampler)
    if rule is None:
        return None
    return HeadSampler(rule[0], rule[1], pinned_ids(tracer), fields)


def _sampler_rule(sampler: Any) -> tuple[bool, int] | None:
    """(parent-based, bound) of one of the SDK's standard samplers; None for any other."""
    from opentelemetry.sdk.trace import sampling

    description = sampler.get_description()
    kind = type(sampler)
    if kind is sampling.ParentBased:
        if not description.startswith("ParentBased{root:") or not description.endswith(_DEFAULT_DELEGATES):
            return None
        root = _root_bound(description[len("ParentBased{root:") : -len(_DEFAULT_DELEGATES)])
        return None if root is None else (True, root)
    if kind in (sampling.StaticSampler, sampling.TraceIdRatioBased):
        root = _root_bound(description)
        return None if root is None else (False, root)
    return None


def _root_bound(description: str) -> int | None:
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    if description == "AlwaysOnSampler":
        return _ALWAYS
    if description == "AlwaysOffSampler":
        return 0
    if description.startswith("TraceIdRatioBased{") and description.endswith("}"):
        try:
            return int(TraceIdRatioBased.get_bound_for_rate(float(description[len("TraceIdRatioBased{") : -1])))
        except ValueError:
            return None
    return None
