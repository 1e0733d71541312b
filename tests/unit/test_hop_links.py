"""The failed attempts' span contexts a retry hop carries (kafkatx.tracing._hops), without a broker: written from
the attempts remembered, read back into them unless they are remembered already, a bad header ignored."""

from __future__ import annotations

import pytest

from kafkatx.record import Record
from kafkatx.retry_topics import hop_headers, parse_hop
from kafkatx.retry_topics.headers import ATTEMPT_SPANS

pytest.importorskip("opentelemetry.trace")

from opentelemetry.trace import SpanContext, TraceFlags  # noqa: E402

from kafkatx.tracing._hops import HopLinks  # noqa: E402
from kafkatx.tracing._links import AttemptLinks  # noqa: E402

RECORD = Record("orders", 1, 7, b"k", b"v", [("own", b"1")], 5)
KEY = ("grp", "orders", 1, 7)


def _context(span_id: int, sampled: bool = True) -> SpanContext:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    return SpanContext(0xABC, span_id, is_remote=False, trace_flags=flags)


def test_a_hop_carries_every_failed_attempt_and_a_reader_elsewhere_remembers_them() -> None:
    here = AttemptLinks()
    assert HopLinks(here).carried("grp", RECORD) is None, "nothing failed: no header"
    here.failed(KEY, _context(1))
    here.failed(KEY, _context(2, sampled=False))
    value = HopLinks(here).carried("grp", RECORD)
    assert value == b"00-%032x-%016x-01,00-%032x-%016x-00" % (0xABC, 1, 0xABC, 2)
    elsewhere = AttemptLinks()
    HopLinks(elsewhere).arrived("grp", RECORD, value or b"")
    assert [(c.trace_id, c.span_id, int(c.trace_flags), c.is_remote) for c in elsewhere.earlier(KEY)] == [
        (0xABC, 1, 1, True),
        (0xABC, 2, 0, True),
    ]
    HopLinks(here).arrived("grp", RECORD, value or b"")
    assert [c.span_id for c in here.earlier(KEY)] == [1, 2], "remembered here already: not twice"


def test_a_header_that_does_not_parse_is_left_out() -> None:
    attempts = AttemptLinks()
    HopLinks(attempts).arrived("grp", RECORD, b"garbage,00-zz-11-01,00-%032x-%016x-01,00-0-0-01" % (5, 6))
    assert [(c.trace_id, c.span_id) for c in attempts.earlier(KEY)] == [(5, 6)]


def test_the_handler_never_sees_the_header() -> None:
    headers = hop_headers(RECORD, TimeoutError("t"), group_id="grp", next_attempt=2, due_ms=1)
    headers.append((ATTEMPT_SPANS, b"00-%032x-%016x-01" % (5, 6)))
    msg = Record("orders-retry", 1, 0, b"k", b"v", headers, 9)
    hop = parse_hop(msg)
    assert hop is not None and hop.record.headers == [("own", b"1")]
