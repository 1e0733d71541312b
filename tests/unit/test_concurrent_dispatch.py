"""Key-ordered concurrency inside one transaction (listener/runners/concurrent.py), over the fake host: no broker."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, cast

import pytest
from confluent_kafka import Message
from fakes import FakeHost, listener

from kafkatx import InvalidConfigurationError, OutputError, Record, send
from kafkatx.events import HandlerFailed, TransactionCommitted
from kafkatx.listener.runners.lanes import LaneSchedule, lanes_of
from kafkatx.record import ConsumedMessage
from kafkatx.rollback.durable import decode

IN = ("in", 0)


def keyed(*keys: bytes | None, partition: int = 0, start: int = 0) -> list[ConsumedMessage]:
    """Records whose value is ``<key>:<offset>`` (keyless: ``-:<offset>``)."""
    return [
        cast(
            ConsumedMessage,
            Message(
                topic="in",
                partition=partition,
                offset=start + i,
                key=k,
                value=b"%s:%d" % (k or b"-", start + i),
            ),
        )
        for i, k in enumerate(keys)
    ]


# -- the ordering rule ---------------------------------------------------------------------------
def test_records_of_one_lane_start_one_at_a_time_lowest_index_first() -> None:
    schedule = LaneSchedule(["a", "b", "a", "c", "b"], in_flight=3)
    assert [schedule.take(), schedule.take(), schedule.take(), schedule.take()] == [0, 1, 3, None]
    schedule.finished(3)
    assert schedule.take() is None, "lanes a and b are busy: 2 and 4 wait for 0 and 1"
    schedule.finished(1)
    assert schedule.take() == 4
    schedule.finished(0)
    assert schedule.take() == 2
    for index in (2, 4):
        schedule.finished(index)
    assert schedule.take() is None and schedule.idle


def test_at_most_in_flight_records_run_at_once() -> None:
    schedule = LaneSchedule(list(range(10)), in_flight=4)
    assert [schedule.take() for _ in range(5)] == [0, 1, 2, 3, None]
    schedule.finished(2)
    assert schedule.take() == 4


def test_a_finished_record_may_hold_its_lane_until_released_without_holding_a_place_in_flight() -> None:
    """A failure settled in its turn (retry topics): its key's next record waits for that, the others do not."""
    schedule = LaneSchedule(["k", "k", "b", "c"], in_flight=2)
    assert [schedule.take(), schedule.take(), schedule.take()] == [0, 2, None]
    schedule.finished(0, hold_lane=True)  # record 0 failed: settled when its turn comes
    assert schedule.take() == 3, "a place in flight is free; lane k is held"
    schedule.finished(2)
    assert schedule.take() is None
    schedule.release(0)
    assert schedule.take() == 1


def test_a_cut_stops_new_records_past_it_but_not_those_before_it_in_a_busy_lane() -> None:
    schedule = LaneSchedule(["a", "a", "b", "c"], in_flight=4)
    assert [schedule.take(), schedule.take(), schedule.take()] == [0, 2, 3]
    schedule.stop_at(2)  # record 2 failed
    schedule.finished(0)
    assert schedule.take() == 1, "record 1 is before the failed one: it runs, so that a prefix commits"
    schedule.stop_starting()  # time is up: nothing more starts
    assert schedule.cut == 2


def test_time_running_out_cuts_at_the_first_record_not_started() -> None:
    schedule = LaneSchedule(["a", "a", "b", "c"], in_flight=4)
    assert [schedule.take(), schedule.take(), schedule.take()] == [0, 2, 3]
    schedule.stop_starting()
    assert schedule.cut == 1 and schedule.take() is None


def test_the_lanes_of_each_ordering() -> None:
    msgs = keyed(b"k1", None, b"k1", partition=3)
    assert lanes_of(msgs, "key") == [("in", b"k1"), ("in", 3), ("in", b"k1")]
    assert lanes_of(msgs, "partition") == [("in", 3)] * 3
    assert lanes_of(msgs, "none") == [0, 1, 2]


# -- the dispatch in a transaction ---------------------------------------------------------------


def test_async_handlers_run_concurrently_and_outputs_keep_the_input_order() -> None:
    started: list[int] = []
    running = {"now": 0, "max": 0}
    by_key: dict[bytes | None, list[int]] = {}

    async def enrich(record: Record) -> bytes:
        running["now"] += 1
        running["max"] = max(running["max"], running["now"])
        by_key.setdefault(record.key, []).append(record.offset)
        started.append(record.offset)
        await asyncio.sleep(0.002 * (record.offset % 5))  # later records often finish first
        running["now"] -= 1
        return record.value or b""

    keys = [b"k%d" % (i % 7) for i in range(60)]
    host = FakeHost(listener(enrich, in_flight=10))
    runner = host.runner()
    try:
        runner(host.unit(keyed(*keys)))
    finally:
        runner.close()
    assert 1 < running["max"] <= 10
    assert host.producer.committed_values == [b"%s:%d" % (k, i) for i, k in enumerate(keys)]
    assert all(offsets == sorted(offsets) for offsets in by_key.values())
    assert host.producer.committed_offsets == {("in", 0): 60}
    (event,) = host.events_of(TransactionCommitted)
    assert (event.records, event.outputs) == (60, 60)


def test_a_plain_handler_runs_on_a_pool_one_record_of_a_key_at_a_time() -> None:
    running: dict[bytes | None, int] = {}
    overlaps: list[bytes | None] = []
    lock = threading.Lock()
    peak = {"now": 0, "max": 0}

    def enrich(record: Record) -> bytes:
        with lock:
            running[record.key] = running.get(record.key, 0) + 1
            if running[record.key] > 1:
                overlaps.append(record.key)
            peak["now"] += 1
            peak["max"] = max(peak["max"], peak["now"])
        time.sleep(0.003)
        with lock:
            running[record.key] -= 1
            peak["now"] -= 1
        send("audit", b"saw %d" % record.offset)
        return (record.value or b"").upper()

    keys = [b"a", b"b", b"c", b"a", None, b"b", None, b"a"] * 5
    host = FakeHost(listener(enrich, in_flight=6))
    runner = host.runner()
    try:
        runner(host.unit(keyed(*keys)))
    finally:
        runner.close()
    assert overlaps == [] and peak["max"] > 1
    expected: list[bytes | None] = []
    for i, k in enumerate(keys):
        expected += [b"saw %d" % i, (b"%s:%d" % (k or b"-", i)).upper()]
    assert host.producer.committed_values == expected, "each record's send() and result, in input order"


def test_a_failing_record_among_concurrent_ones_is_isolated_and_the_others_commit_once() -> None:
    recovered: list[int] = []

    async def enrich(record: Record) -> bytes:
        await asyncio.sleep(0.001 * (record.offset % 3))
        if record.offset == 7:
            raise ValueError("poison")
        return record.value or b""

    host = FakeHost(listener(enrich, in_flight=5, max_attempts=1, dlq=lambda r, e: recovered.append(r.offset)))
    runner = host.runner()
    keys = [b"k%d" % (i % 3) for i in range(20)]
    try:
        runner(host.unit(keyed(*keys)))
    finally:
        runner.close()
    assert recovered == [7]
    assert host.producer.committed_values == [b"%s:%d" % (k, i) for i, k in enumerate(keys) if i != 7]
    assert host.producer.committed_offsets == {("in", 0): 20}


def test_time_running_out_commits_a_prefix_and_rewinds_the_rest() -> None:
    async def slow(record: Record) -> bytes:
        await asyncio.sleep(0.02)
        return record.value or b""

    host = FakeHost(listener(slow, in_flight=2))
    host.transaction_budget = 0.03
    runner = host.runner()
    try:
        runner(host.unit(keyed(*[b"k%d" % i for i in range(20)])))
    finally:
        runner.close()
    (committed,) = host.producer.committed
    done = committed.offsets[("in", 0)]
    # At least the first record: the budget is checked once a record has started. Two in flight make two likely,
    # but not certain: a loaded machine may let the 30 ms pass before the second one starts.
    assert 1 <= done < 20
    assert host.producer.committed_values == [b"k%d:%d" % (i, i) for i in range(done)]
    assert host.seeks == [(("in", 0), done)], "the rest is fetched again"


def test_a_stop_lets_what_is_in_flight_finish_and_commits_only_that() -> None:
    async def stopping(record: Record) -> bytes:
        host.stop_event.set()
        await asyncio.sleep(0.001)
        return record.value or b""

    host = FakeHost(listener(stopping, in_flight=3))
    runner = host.runner()
    try:
        runner(host.unit(keyed(*[b"k%d" % i for i in range(10)])))
    finally:
        runner.close()
    assert host.producer.committed_values == [b"k%d:%d" % (i, i) for i in range(3)]
    assert host.seeks == [(("in", 0), 3)]


def test_an_async_handler_with_in_flight_1_is_awaited() -> None:
    async def enrich(record: Record) -> Any:
        await asyncio.sleep(0)
        return [record.value, b"again"]

    host = FakeHost(listener(enrich))
    runner = host.runner()
    try:
        runner(host.unit(keyed(b"a", b"b")))
    finally:
        runner.close()
    assert host.producer.committed_values == [b"a:0", b"again", b"b:1", b"again"]


def test_combinations_that_cannot_be_made_right_are_refused_when_declared() -> None:
    async def enrich(record: Record) -> None: ...

    with pytest.raises(InvalidConfigurationError, match=r"database= cannot be combined with in_flight=4"):
        listener(lambda r: None, in_flight=4, database="sqlite://")
    with pytest.raises(InvalidConfigurationError, match=r"database= cannot be combined with an async def"):
        listener(enrich, database="sqlite://")
    with pytest.raises(InvalidConfigurationError, match=r"max_batch_records=10 is below in_flight=50"):
        listener(enrich, in_flight=50, max_batch_records=10)
    with pytest.raises(InvalidConfigurationError, match=r"ordering must be 'key', 'partition' or 'none'"):
        listener(enrich, in_flight=2, ordering="keys")
    with pytest.raises(InvalidConfigurationError, match=r"in_flight must be an integer >= 1"):
        listener(enrich, in_flight=0)


@pytest.mark.parametrize("max_attempts", [1, 2])
def test_the_records_before_a_failed_one_commit_once_and_the_rest_comes_next(max_attempts: int) -> None:
    """The prefix before the failed record commits with the failure settled in its transaction, never re-run.
    Recovered (attempts exhausted), its offset commits with that prefix; with backoff=0 and attempts left, the
    transaction ends before it (its offset committed with its count) and it comes first in the next one, from
    memory, at attempt 2: it is not called again inside the transaction."""
    calls: dict[int, list[int]] = {}
    recovered: list[tuple[int, int]] = []

    async def enrich(record: Record) -> bytes:
        calls.setdefault(record.offset, []).append(record.attempt)
        await asyncio.sleep(0.002)
        if record.offset == 30 and record.attempt == 1:
            raise ValueError("poison")
        return record.value or b""

    host = FakeHost(
        listener(
            enrich,
            in_flight=8,
            max_attempts=max_attempts,
            backoff=0,
            dlq=lambda r, e: recovered.append((r.offset, r.attempt)),
        )
    )
    runner = host.runner()
    keys = [b"k%d" % (i % 4) for i in range(40)]
    try:
        runner(host.unit(keyed(*keys)))
    finally:
        runner.close()
    assert all(calls[i] == [1] for i in range(30)), "the records before the failed one ran once"
    first = host.producer.transactions[0]
    assert first.outcome == "committed" and [v for _, v in first.produced] == [
        b"%s:%d" % (k, i) for i, k in enumerate(keys[:30])
    ]
    assert [t.outcome for t in host.producer.transactions] == ["committed", "committed"], "nothing aborted"
    assert [(e.record.offset, e.attempt) for e in host.events_of(HandlerFailed)] == [(30, 1)]
    if max_attempts == 1:
        assert recovered == [(30, 1)] and calls[30] == [1]
        assert first.offsets == {IN: 31}, "the recovered record's offset commits with the prefix"
        expected = [b"%s:%d" % (k, i) for i, k in enumerate(keys) if i != 30]
    else:
        assert recovered == [] and calls[30] == [1, 2]
        assert first.offsets == {IN: 30} and decode(first.metadata[IN], 30).failures == 1  # type: ignore[union-attr]
        expected = [b"%s:%d" % (k, i) for i, k in enumerate(keys)]
    assert host.producer.committed_values == expected
    assert host.producer.committed_offsets == {IN: 40} and not host.tracker


@pytest.mark.parametrize("retry", ["rollback", "topics"])
def test_a_retried_recovery_counts_no_new_failure_when_records_run_concurrently(retry: str) -> None:
    """Rule 4 of failed_record.py, concurrently: a record whose recoverer failed is recovered on its next delivery
    without calling the handler and without counting a failure: it is dead-lettered at the attempt it failed.
    With retry topics its failure is settled in its turn: the dead letter that could not be written ends the
    transaction before it, as it does when the transaction ends at the failure."""
    calls: list[int] = []
    recoveries: list[tuple[int, int]] = []

    def handle(record: Record) -> bytes:
        calls.append(record.offset)
        if record.value == b"-:1":
            raise ValueError("poison")
        return record.value or b""

    def recoverer(record: Record, error: BaseException) -> None:
        recoveries.append((record.offset, record.attempt))
        if len(recoveries) == 1:
            raise ConnectionError("the dead-letter topic is down")

    host = FakeHost(listener(handle, in_flight=2, max_attempts=1, recovery_backoff=4.0, dlq=recoverer, retry=retry))
    runner = host.runner()
    try:
        runner(host.unit(keyed(None, None, None)))
        assert host.producer.committed_offsets == {IN: 1}, "the record before it committed; it did not"
        runner(host.unit(host.deferred.pop(IN)[0]))  # handed back after recovery_backoff
    finally:
        runner.close()
    assert calls == [0, 1, 2], "the handler is not called again for the record"
    assert host.producer.committed_offsets == {IN: 3}
    assert recoveries == [(1, 1), (1, 1)]
    assert [e.attempt for e in host.events_of(HandlerFailed)] == [1]


def test_pool_threads_log_as_the_container_and_async_sends_stay_with_their_record() -> None:
    names: set[str] = set()

    def plain(record: Record) -> None:
        names.add(threading.current_thread().name)
        time.sleep(0.001)
        send("audit", record.value)

    async def awaited(record: Record) -> bytes:
        send("audit", b"before " + (record.value or b""))
        await asyncio.sleep(0.001 * (5 - record.offset % 5))  # the others' sends come in between
        return b"after " + (record.value or b"")

    for handler, expected in (
        (plain, [b"k%d:%d" % (i, i) for i in range(10)]),
        (awaited, [v for i in range(10) for v in (b"before k%d:%d" % (i, i), b"after k%d:%d" % (i, i))]),
    ):
        host = FakeHost(listener(handler, in_flight=4))
        runner = host.runner()
        container = threading.Thread(target=runner, args=(host.unit(keyed(*[b"k%d" % i for i in range(10)])),))
        container.name = "kafkatx-enricher"
        container.start()
        container.join(10)
        runner.close()
        assert host.producer.committed_values == expected
    assert names == {"kafkatx-enricher"}, "log lines are attributed to the listener by the thread's name"


@pytest.mark.parametrize("kind", ["async", "pool"])
def test_in_place_retries_keep_the_batch_in_one_transaction(kind: str) -> None:
    attempts: dict[int, list[int]] = {}
    recovered: list[tuple[int, int]] = []
    lock = threading.Lock()

    def check(record: Record) -> bytes:
        with lock:
            attempts.setdefault(record.offset, []).append(record.attempt)
        if record.offset == 3 and record.attempt == 1:
            raise ValueError("transient")
        if record.offset == 6:
            raise ValueError("poison")
        return record.value or b""

    async def awaited(record: Record) -> bytes:
        await asyncio.sleep(0.001)
        return check(record)

    handler = awaited if kind == "async" else check
    options: dict[str, Any] = {"in_flight": 4, "retry": "in_place", "max_attempts": 2, "backoff": 0.01}
    host = FakeHost(listener(handler, dlq=lambda r, e: recovered.append((r.offset, r.attempt)), **options))
    runner = host.runner()
    try:
        runner(host.unit(keyed(*[b"k%d" % (i % 3) for i in range(10)])))
    finally:
        runner.close()
    assert [t.outcome for t in host.producer.transactions] == ["committed"], "no abort: retried in place"
    assert attempts[3] == [1, 2] and attempts[6] == [1, 2] and recovered == [(6, 2)]
    assert host.producer.committed_values == [b"k%d:%d" % (i % 3, i) for i in range(10) if i != 6]
    assert host.producer.committed_offsets == {("in", 0): 10}


def test_a_stop_during_an_in_place_back_off_gives_the_batch_up() -> None:
    async def failing(record: Record) -> bytes:
        if record.offset == 1:
            host.stop_event.set()
            raise ValueError("fails, then the container stops during its back-off")
        return record.value or b""

    host = FakeHost(listener(failing, in_flight=2, retry="in_place", max_attempts=5, backoff=10.0))
    runner = host.runner()
    try:
        runner(host.unit(keyed(b"a", b"b", b"c")))
    finally:
        runner.close()
    assert host.producer.committed == [] and host.seeks == [(("in", 0), 0)], "nothing committed, all fetched again"


def test_the_default_batch_holds_at_least_in_flight_records() -> None:
    assert listener(lambda r: None, in_flight=8000).max_batch_records == 8000
    assert listener(lambda r: None, in_flight=100).max_batch_records == 5000
    assert listener(lambda r: None, in_flight=100, max_batch_records=100).max_batch_records == 100


def test_a_transaction_whose_time_is_up_from_the_start_still_handles_a_record() -> None:
    async def enrich(record: Record) -> bytes:
        return record.value or b""

    host = FakeHost(listener(enrich, in_flight=4))
    host.transaction_budget = 0.0
    runner = host.runner()
    try:
        runner(host.unit(keyed(b"a", b"b", b"c")))
    finally:
        runner.close()
    assert host.producer.committed_values == [b"a:0"] and host.seeks == [(("in", 0), 1)]


def test_an_output_the_client_refuses_fails_its_own_record_only() -> None:
    recovered: list[int] = []

    async def enrich(record: Record) -> bytes:
        await asyncio.sleep(0.001 * (record.offset % 3))
        return record.value or b""

    host = FakeHost(listener(enrich, in_flight=4, max_attempts=1, dlq=lambda r, e: recovered.append(r.offset)))
    host.producer.fail_on("produce", OutputError("record too large"))  # the first output produced: record 0's
    runner = host.runner()
    try:
        runner(host.unit(keyed(b"a", b"b", b"c", b"d")))
    finally:
        runner.close()
    assert recovered == [0]
    assert host.producer.committed_values == [b"b:1", b"c:2", b"d:3"]
    assert host.producer.committed_offsets == {("in", 0): 4}


# -- retry="topics": the gate before each record ------------------------------------------------------------
def test_a_retry_record_takes_its_lane_by_its_input_topic() -> None:
    """Read back from a retry topic, a record takes turns with its key's input records (one lane)."""
    msgs = [*keyed(b"k1"), cast(ConsumedMessage, Message(topic="in-retry", partition=0, offset=5, key=b"k1"))]
    assert lanes_of(msgs, "key") == [("in", b"k1"), ("in-retry", b"k1")]
    origin = {"in-retry": "in"}
    assert lanes_of(msgs, "key", lambda topic: origin.get(topic, topic)) == [("in", b"k1")] * 2


@pytest.mark.parametrize("kind", ["async", "threads"])
def test_with_retry_topics_a_failed_record_hops_in_its_turn_and_its_keys_later_records_follow_it(kind: str) -> None:
    """Concurrently handled: the record that failed hops to the retry topic in its turn among the outputs, and the
    transaction goes on past it (as with one record at a time): its key's later records, which wait for that in
    its lane, follow it (not called, their attempt unchanged); the others run; each output once, in input order."""
    calls: list[tuple[int, int]] = []

    def body(record: Record) -> bytes:
        calls.append((record.offset, record.attempt))
        if record.offset == 2:
            raise TimeoutError("a dependency timed out")
        return record.value or b""

    async def enrich_async(record: Record) -> bytes:
        await asyncio.sleep(0.001 * (record.offset % 3))
        return body(record)

    def enrich(record: Record) -> bytes:
        time.sleep(0.001 * (record.offset % 3))
        return body(record)

    handler = enrich_async if kind == "async" else enrich
    host = FakeHost(listener(handler, in_flight=4, retry="topics", max_attempts=3, backoff=1.0))
    runner = host.runner()
    keys = [b"a", b"b", b"k", b"c", b"k", b"d", b"k"]
    try:
        runner(host.unit(keyed(*keys)))
    finally:
        runner.close()
    [only] = host.producer.transactions
    assert only.outcome == "committed"
    assert only.produced == [
        ("out", b"a:0"),
        ("out", b"b:1"),
        ("in-retry", b"k:2"),
        ("out", b"c:3"),
        ("in-retry", b"k:4"),
        ("out", b"d:5"),
        ("in-retry", b"k:6"),
    ], "in input order: the failed record's hop in its turn, its key's later records behind it, the others run"
    assert only.offsets == {IN: 7}
    assert sorted(calls) == [(0, 1), (1, 1), (2, 1), (3, 1), (5, 1)], "each called once; followers not at all"
    assert host.retry_hops is not None and host.retry_hops.book.keys_in_retry(IN) == {b"k": [2, 4, 6]}
    [failed] = host.events_of(HandlerFailed)
    assert failed.record is not None and (failed.record.offset, failed.attempt) == (2, 1)
