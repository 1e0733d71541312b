"""A record's count ends when its offset commits, and only then: its attempt numbers only go up (no broker).

A failure undoes the failed call's work alone (the records before it commit), so a success is never rolled back
by a batch-mate's failure, and a success no longer ends a count by itself: the count ends with the commit of
the record's offset (a success's or a recovery's). A transaction aborted as a whole (a Kafka abortable error,
a fenced producer, a stop) keeps the counts, so what runs again is handed a higher attempt, never attempt 1
again, and a record is never dead-lettered for fewer failures than it had, nor retried for ever.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from fakes import FakeHost, listener, messages

import kafkatx
from kafkatx import Record
from kafkatx.errors import TransactionAbortableError
from kafkatx.events import HandlerFailed, RecordRecovered
from kafkatx.record import to_record
from kafkatx.rollback.durable import decode
from kafkatx.rollback.tracker import FailureTracker

IN = ("in", 0)


class _Runaway(BaseException):
    """Raised by a handler called far more often than the scenario allows: the test fails instead of hanging."""


def _scripted(
    failing_deliveries: dict[bytes, set[int]],
) -> tuple[Callable[[Record], bytes], list[tuple[bytes, int, bool]]]:
    """A handler that fails a record's n-th delivery when n is in ``failing_deliveries[value]``
    (a value missing from it never fails). Returns it and the log of (value, attempt, succeeded)."""
    deliveries: Counter[bytes] = Counter()
    log: list[tuple[bytes, int, bool]] = []

    def handle(record: Record) -> bytes:
        value = record.value or b""
        deliveries[value] += 1
        if deliveries[value] > 20:
            raise _Runaway(value)
        fails = deliveries[value] in failing_deliveries.get(value, set())
        log.append((value, record.attempt, not fails))
        if fails:
            raise TimeoutError(f"{value!r} cannot reach its service")
        return value.upper()

    return handle, log


def _attempts(log: list[tuple[bytes, int, bool]], value: bytes) -> list[tuple[int, bool]]:
    return [(attempt, ok) for v, attempt, ok in log if v == value]


def _abort_once_after(hosts: list[FakeHost], handle: Callable[[Record], bytes]) -> Callable[[Record], bytes]:
    """``handle``, arming a Kafka abortable error of the next commit (of ``hosts[0]``) after its first success."""
    armed = [False]

    def arm_then_handle(record: Record) -> bytes:
        result = handle(record)
        if not armed[0]:
            armed[0] = True
            hosts[0].producer.fail_on("commit", TransactionAbortableError("abortable", operation="commit_transaction"))
        return result

    return arm_then_handle


def test_a_record_that_fails_then_succeeds_commits_once_and_its_count_ends_with_the_commit() -> None:
    """X fails, is called again in the same transaction (backoff=0) and succeeds: its output commits once, and its
    count ends when its offset commits (not when its handler succeeded)."""
    handle, log = _scripted({b"x": {1}})
    hosts: list[FakeHost] = []
    tracker_at_success: list[int] = []

    def watching(record: Record) -> bytes:
        result = handle(record)
        state = hosts[0].tracker.state(record)
        tracker_at_success.append(state.failures if state else 0)
        return result

    host = FakeHost(listener(watching, max_attempts=3, backoff=0))
    hosts.append(host)
    host.runner()(host.unit(messages(b"w", b"x", b"z")))

    assert _attempts(log, b"x") == [(1, False), (2, True)]
    assert tracker_at_success == [0, 1, 0], "X's count is still there when its handler succeeds"
    assert host.producer.committed_values == [b"W", b"X", b"Z"]
    assert host.producer.committed_offsets == {IN: 3}
    assert not host.tracker, "its count ended with the commit"


def test_a_success_in_a_transaction_kafka_aborts_keeps_the_count_and_the_next_attempt_is_higher() -> None:
    """X fails twice and succeeds on its 3rd attempt; Kafka aborts that transaction (abortable error), which runs
    again: X is handed attempt 3 (its count was kept), and failing then, it is dead-lettered at attempt 3, as
    max_attempts says, not started again at attempt 1."""
    handle, log = _scripted({b"x": {1, 2, 4}})
    recovered: list[tuple[bytes | None, int]] = []
    hosts: list[FakeHost] = []
    host = FakeHost(
        listener(
            _abort_once_after(hosts, handle),
            max_attempts=3,
            backoff=0,
            dlq=lambda r, e: recovered.append((r.value, r.attempt)),
        )
    )
    hosts.append(host)

    host.runner()(host.unit(messages(b"x")))

    assert _attempts(log, b"x") == [(1, False), (2, False), (3, True), (3, False)]
    assert recovered == [(b"x", 3)]
    assert [e.attempt for e in host.events_of(HandlerFailed)] == [1, 2, 3]
    assert [t.outcome for t in host.producer.transactions] == ["aborted", "committed"]
    assert host.producer.committed_values == [] and host.producer.committed_offsets == {IN: 1}
    assert not host.tracker


def test_an_in_place_success_in_a_transaction_kafka_aborts_keeps_the_count_too() -> None:
    """retry="in_place": X fails, succeeds on its in-place retry, then Kafka aborts the batch's commit and the batch
    runs again: X is handed attempt 2, not 1, and its next failure is its 2nd (with max_attempts=2: recovered)."""
    handle, log = _scripted({b"x": {1, 3}})
    recovered: list[tuple[bytes | None, int]] = []
    host = FakeHost(
        listener(
            handle,
            retry="in_place",
            max_attempts=2,
            backoff=0,
            dlq=lambda r, e: recovered.append((r.value, r.attempt)),
        )
    )
    host.producer.fail_on("commit", TransactionAbortableError("abortable", operation="commit_transaction"))

    host.runner()(host.unit(messages(b"x", b"z")))

    assert _attempts(log, b"x") == [(1, False), (2, True), (2, False)]
    assert recovered == [(b"x", 2)]
    assert host.producer.committed_values == [b"Z"] and host.producer.committed_offsets == {IN: 2}
    assert not host.tracker


def test_a_recovered_records_count_ends_at_commit_and_a_kafka_abort_keeps_it() -> None:
    """R is dead-lettered in the transaction (2 failed attempts). Kafka aborts that transaction: R did not commit,
    so it keeps its count, and run again it is handed attempt 3 and recovered with it; the dead letter commits
    once, with R's offset, and only then does its count end."""
    handle, log = _scripted({b"r": set(range(1, 21))})
    recovered: list[tuple[bytes | None, int]] = []

    def dead_letter(record: Record, error: BaseException) -> None:
        recovered.append((record.value, record.attempt))
        kafkatx.send("in-dlt", b"dead:%d" % record.attempt)

    host = FakeHost(listener(handle, max_attempts=2, backoff=0, dlq=dead_letter))
    host.producer.fail_on("commit", TransactionAbortableError("abortable", operation="commit_transaction"))

    host.runner()(host.unit(messages(b"r", b"w")))

    assert _attempts(log, b"r") == [(1, False), (2, False), (3, False)]
    assert recovered == [(b"r", 2), (b"r", 3)]
    assert [e.record.attempt for e in host.events_of(RecordRecovered)] == [2, 3]
    aborted, committed = host.producer.transactions
    assert aborted.outcome == "aborted" and committed.outcome == "committed"
    assert committed.produced == [("in-dlt", b"dead:3"), ("out", b"W")], "the dead letter commits once"
    assert host.producer.committed_offsets == {IN: 2}
    assert not host.tracker, "its count ended with the commit of its offset"


def test_the_offset_metadata_carries_the_held_records_count_until_its_offset_commits() -> None:
    """X is held for a back-off twice: each commit before it stores its own offset with its count (1, then 2),
    which a new owner reads back to go on counting; the commit past it stores no count."""
    handle, log = _scripted({b"x": {1, 2}})
    host = FakeHost(listener(handle, max_attempts=5, backoff=1.0))

    host.runner()(host.unit(messages(b"w", b"x", b"z")))
    counts_at_x = []
    while host.deferred:  # each back-off ended: the container hands the records back
        txn = host.producer.committed[-1]
        assert txn.offsets == {IN: 1}
        state = decode(txn.metadata.get(IN), 1)
        counts_at_x.append(state.failures if state else 0)
        host.runner()(host.unit(host.deferred.pop(IN)[0]))

    assert counts_at_x == [1, 2]
    assert _attempts(log, b"x") == [(1, False), (2, False), (3, True)]
    last = host.producer.committed[-1]
    past = decode(last.metadata.get(IN), 3)
    assert last.offsets == {IN: 3} and (past is None or past.failures == 0), "no count past it"
    assert host.producer.committed_values == [b"W", b"X", b"Z"] and not host.tracker

    # A new owner of the partition (a restart, a rebalance) seeds its count from the committed metadata.
    restarted = FailureTracker()
    first_hold = decode(host.producer.committed[0].metadata[IN], 1)
    assert first_hold is not None
    restarted.seed("in", 0, first_hold.offset, first_hold.failures)
    assert restarted.attempt("in", 0, 1) == 2, "it goes on at attempt 2, not 1"


# -- the tracker's rule ------------------------------------------------------------------------------------


def _failing(tracker: FailureTracker, record: Record, times: int = 1) -> None:
    for _ in range(times):
        tracker.record_failure(record, ConnectionError("down"))


def test_a_commit_ends_the_counts_below_its_offset_only() -> None:
    tracker = FailureTracker()
    batch = messages(b"a", b"b", b"c") + messages(b"d", partition=1)
    a, b, c, d = (to_record(m) for m in batch)
    _failing(tracker, a, 2)
    _failing(tracker, b)
    _failing(tracker, d)

    tracker.committed({IN: 1})  # a committed; b held: its own offset committed, with its count

    assert tracker.attempt("in", 0, 0) == 1, "a's count ended with its commit"
    assert tracker.attempt("in", 0, 1) == 2, "b, at the committed offset, keeps its count"
    assert tracker.attempt("in", 1, 0) == 2, "another partition's count is not touched"
    tracker.committed({IN: 2, ("in", 1): 1})
    assert not tracker, "the last slot gone, the hot path's check is empty again"


def test_a_recovery_keeps_the_count_until_the_commit() -> None:
    tracker = FailureTracker()
    a = to_record(messages(b"a")[0])
    _failing(tracker, a, 3)
    tracker.record_recovered(a)
    state = tracker.state(a)
    assert state is not None and state.failures == 3 and state.recovered

    _failing(tracker, a)  # the transaction was aborted and it failed again: its 4th failure, no longer recovered
    state = tracker.state(a)
    assert state is not None and state.failures == 4 and not state.recovered
    tracker.committed({IN: 1})
    assert tracker.state(a) is None
