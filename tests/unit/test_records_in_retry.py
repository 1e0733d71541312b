"""The records in retry with either ordering, the pure rules (no broker): their count and earliest due time follow
what the transactions commit, and a retry record is told handled only once its offset committed without a new hop."""

from __future__ import annotations

from typing import Any, cast

import pytest
from confluent_kafka import Message

from kafkatx.context import bind_sink
from kafkatx.events import Event, RecordsInRetry, RetryHandled
from kafkatx.outputs import PendingOutput
from kafkatx.record import ConsumedMessage, Record
from kafkatx.retry_topics import RetryTopicPlan, hop_headers
from kafkatx.retry_topics.due import DueTimes
from kafkatx.retry_topics.hops import RetryHops
from kafkatx.retry_topics.keys import Place
from kafkatx.rollback.policy import FailurePolicy

TXN = object()
NOW_S = 1000.0


def _hops(events: list[Event], *, key_order: bool) -> RetryHops:
    plan = RetryTopicPlan(FailurePolicy(max_attempts=3, backoff=1.0))
    return RetryHops(plan, ["orders"], "grp", clock=lambda: NOW_S, key_order=key_order, publish=events.append)


def _input(offset: int, key: bytes | None = b"k") -> Record:
    return Record("orders", 0, offset, key, b"v%d" % offset, [], 5)


def _read_back(original: Record, retry_offset: int, due_ms: int) -> Message:
    headers = hop_headers(original, TimeoutError("t"), group_id="grp", next_attempt=2, due_ms=due_ms)
    return Message(
        topic="orders-retry", partition=0, offset=retry_offset, key=original.key, value=b"v", headers=headers
    )


def _as_record(msg: Message) -> Record:
    return Record(msg.topic() or "", msg.partition() or 0, msg.offset() or 0, msg.key(), msg.value(), msg.headers())


class _Sink(list[PendingOutput]):
    serializer = None
    add = list.append


def _call(hops: RetryHops, handler: Any, record: Record) -> None:
    previous = bind_sink(_Sink())
    try:
        hops.viewing(handler)(record)
    finally:
        bind_sink(previous)


def _told(events: list[Event]) -> list[tuple[int, float | None]]:
    return [(e.records, e.oldest_due) for e in events if isinstance(e, RecordsInRetry)]


def test_due_times_answer_their_earliest_as_they_come_and_go() -> None:
    due = DueTimes()
    assert due.earliest() is None
    for ms in (30, 10, 10, 20):
        due.add(ms)
    due.remove(10)
    assert due.earliest() == 10, "one of the two 10s is left"
    due.remove(10)
    assert due.earliest() == 20
    due.add(10)
    assert due.earliest() == 10, "back after it had gone"
    for ms in (10, 20, 30):
        due.remove(ms)
    assert due.earliest() is None


@pytest.mark.parametrize("key_order", [False, True])
def test_the_count_and_oldest_due_change_when_a_transaction_commits_never_before(key_order: bool) -> None:
    events: list[Event] = []
    hops = _hops(events, key_order=key_order)
    assert (hops.keys is hops.book) is key_order, "the book gates key order only with ordering='key'"
    hops.book.began(TXN)
    hops.hop(_input(0), TimeoutError("t"), 1, 1.0)
    hops.hop(_input(1, None), TimeoutError("t"), 1, 2.0)
    assert _told(events) == [], "nothing committed yet"
    hops.book.began(TXN)  # aborted: begun again, its hops are dropped
    hops.hop(_input(0), TimeoutError("t"), 1, 1.0)
    hops.hop(_input(1, None), TimeoutError("t"), 1, 2.0)
    hops.committed(TXN, {("orders", 0): 2})
    assert _told(events) == [(2, NOW_S + 1.0)]
    assert hops.book.oldest_due_ms() == 1_001_000


@pytest.mark.parametrize("key_order", [False, True])
def test_a_retry_handled_is_told_once_its_offset_committed_and_a_failed_one_hops_again(key_order: bool) -> None:
    events: list[Event] = []
    hops = _hops(events, key_order=key_order)
    first, second = _input(0), _input(1, b"j")
    hops.book.rebuilt(
        ("orders", 0), [(b"k", 0, Place("orders-retry", 1_001_000)), (b"j", 1, Place("orders-retry", 1_002_000))]
    )
    assert _told(events) == [(2, NOW_S + 1.0)], "rebuilt at assignment"
    msgs = [_read_back(first, 10, 1_001_000), _read_back(second, 11, 1_002_000)]
    hops.delivered(cast("list[ConsumedMessage]", msgs))  # by the retry feed, to the container
    hops.book.began(TXN)
    _call(hops, lambda record: b"ok", _as_record(msgs[0]))
    _call(hops, lambda record: b"ok", _as_record(msgs[1]))
    hops.hop(second, TimeoutError("its outputs failed"), 2, 1.0)  # handled, then failed: it hops again
    hops.committed(TXN, {("orders-retry", 0): 12})
    assert [(r.topic, r.offset, r.attempt) for r in _handled(events)] == [("orders", 0, 2)]
    assert _told(events)[-1] == (1, NOW_S + 1.0), "the first left; the second is in retry again, due anew"
    again = _read_back(second, 12, 1_001_000)
    hops.delivered([cast("ConsumedMessage", again)])
    hops.book.began(TXN)
    _call(hops, lambda record: b"ok", _as_record(again))
    hops.committed(TXN, {("orders-retry", 0): 12})  # its offset not committed
    assert len(_handled(events)) == 1 and _told(events)[-1] == (1, NOW_S + 1.0), "not handled until it commits"
    hops.delivered([cast("ConsumedMessage", again)])  # fetched again after an abort: the same record, once
    hops.book.began(TXN)
    _call(hops, lambda record: b"ok", _as_record(again))
    hops.committed(TXN, {("orders-retry", 0): 13})
    assert [(r.offset, r.attempt) for r in _handled(events)] == [(0, 2), (1, 2)]
    assert _told(events)[-1] == (0, None)


def _handled(events: list[Event]) -> list[Record]:
    return [e.record for e in events if isinstance(e, RetryHandled) and e.record is not None]


def test_the_records_in_retry_of_a_listeners_containers_add_up_with_concurrency() -> None:
    """Two containers of one listener (``concurrency=2``) each count their own partitions' records in retry: the
    gauge is their sum (each container's events carry its own name and worker, as its other events do)."""
    from kafkatx import App
    from kafkatx.listener.loop.container import ListenerContainer
    from kafkatx.metrics import instrument
    from kafkatx.retry_topics.keys import Place

    app = App("in-retry", bootstrap_servers="127.0.0.1:1", instance_id="unit")
    metrics = instrument(app)
    spec = app.add_listener(lambda record: None, "orders", name="orders", retry="topics", concurrency=2)
    containers = [ListenerContainer(spec, app, worker, worker) for worker in (0, 1)]
    for worker, container in enumerate(containers):
        hops = container.retry_hops
        assert hops is not None
        hops.book.rebuilt(("orders", worker), [(b"k%d" % i, i, Place("orders-retry", 5)) for i in range(worker + 2)])
    labels = {"app": "in-retry", "listener": "orders"}
    assert metrics.registry.get_sample_value("kafkatx_records_in_retry", labels) == 2 + 3
