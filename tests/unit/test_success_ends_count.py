"""A success ends a record's failure count, even when its transaction is aborted by a batch-mate (no broker).

Issue 28, part 3: X fails twice, succeeds on its 3rd delivery, the batch is
aborted because Y after it fails, and X fails once more while re-run as a
batch-mate. That last failure starts a new episode (attempt 1), as in Spring,
which clears a record's state on success.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from fakes import FakeHost, listener, messages

from kafkatx import Record
from kafkatx.errors import TransactionAbortableError
from kafkatx.events import RecordRecovered
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


def test_a_batch_mate_that_succeeded_starts_again_at_attempt_1_when_it_fails_as_a_re_run() -> None:
    # X fails its 1st, 2nd and 4th deliveries (the 4th: re-run after Y's failure aborted the batch); Y always fails.
    handle, log = _scripted({b"x": {1, 2, 4}, b"y": set(range(1, 21))})
    recovered: list[tuple[bytes | None, int]] = []
    host = FakeHost(
        listener(handle, max_attempts=3, backoff=0, dlq=lambda r, e: recovered.append((r.value, r.attempt)))
    )

    host.runner()(host.unit(messages(b"x", b"y")))

    assert _attempts(log, b"x") == [(1, False), (2, False), (3, True), (1, False), (2, True), (1, True)]
    assert recovered == [(b"y", 3)], "only Y is dead-lettered, after its own three attempts"
    assert [(e.record.value, e.record.attempt) for e in host.events_of(RecordRecovered)] == [(b"y", 3)]
    assert Counter(host.producer.committed_values) == Counter({b"X": 1}), "X's output committed exactly once"
    assert host.producer.committed_offsets == {IN: 2}
    assert not host.tracker, "nothing left failing"


def test_the_commit_after_the_success_carries_the_new_count_not_the_old_one() -> None:
    handle, _ = _scripted({b"x": {1, 2, 4}, b"y": set(range(1, 21))})
    host = FakeHost(listener(handle, max_attempts=3, backoff=0))

    host.runner()(host.unit(messages(b"x", b"y")))

    # Each commit that keeps X (offset 0) for another delivery stores X's count with the offset.
    counts_at_x = []
    for txn in host.producer.committed:
        if txn.offsets.get(IN) == 0:
            state = decode(txn.metadata.get(IN), 0)
            counts_at_x.append(state.failures if state else 0)
    assert counts_at_x == [1, 2, 1], "after its success, X's stored count starts again (not 3)"


def test_an_in_place_success_ends_the_count_before_the_batch_commits() -> None:
    # retry="in_place": X fails, succeeds on its in-place retry, then the batch's commit is aborted by Kafka and the
    # batch runs again: X's next failure is a new episode (with max_attempts=2 the old count would dead-letter it).
    handle, log = _scripted({b"x": {1, 3}})
    recovered: list[bytes | None] = []
    host = FakeHost(
        listener(handle, retry="in_place", max_attempts=2, backoff=0, dlq=lambda r, e: recovered.append(r.value))
    )
    host.producer.fail_on("commit", TransactionAbortableError("abortable", operation="commit_transaction"))

    host.runner()(host.unit(messages(b"x", b"z")))

    assert _attempts(log, b"x") == [(1, False), (2, True), (1, False), (2, True)]
    assert recovered == []
    assert host.producer.committed_values == [b"X", b"Z"]
    assert not host.tracker


def test_a_record_recovered_in_place_keeps_its_count_when_its_batch_is_aborted() -> None:
    # R is dead-lettered in place (2 failed attempts); W after it is waiting to retry a failed recovery, which
    # aborts the batch. R did not succeed: when its re-run fails, that is its 3rd failure, not a new episode.
    handle, log = _scripted({b"r": set(range(1, 21))})
    recovered: list[tuple[bytes | None, int]] = []
    host = FakeHost(
        listener(
            handle, retry="in_place", max_attempts=2, backoff=0, dlq=lambda r, e: recovered.append((r.value, r.attempt))
        )
    )
    batch = messages(b"r", b"w")
    host.tracker.record_recovery_failure(to_record(batch[1]), ValueError("w failed"))

    host.runner()(host.unit(batch))

    assert _attempts(log, b"r") == [(1, False), (2, False), (3, False)]
    assert recovered == [(b"r", 2), (b"r", 3), (b"w", 1)], "R's in-place recovery was aborted; it is recovered again"
    assert host.producer.committed_offsets == {IN: 2} and host.producer.committed_values == []
    assert not host.tracker


# -- the tracker's rule ------------------------------------------------------------------------------------


def _failing(tracker: FailureTracker, record: Record, times: int = 1) -> None:
    for _ in range(times):
        tracker.record_failure(record, ConnectionError("down"))


def test_succeeded_ends_the_counts_of_the_given_records_and_keeps_the_others() -> None:
    tracker = FailureTracker()
    batch = messages(b"a", b"b", b"c") + messages(b"d", partition=1)
    a, b, c, d = (to_record(m) for m in batch)
    _failing(tracker, a, 2)
    _failing(tracker, c)
    _failing(tracker, d)

    tracker.succeeded([batch[0], batch[1], batch[3]], c)

    assert tracker.attempt("in", 0, 0) == 1, "a succeeded: its next failure is attempt 1"
    assert tracker.attempt("in", 0, 2) == 2, "c, the failed record, keeps its count"
    assert tracker.state_at("in", 1, 0) is None and ("in", 1) not in tracker.failing
    tracker.succeeded([batch[2]])
    assert not tracker, "the last slot gone, the hot path's check is empty again"


def test_succeeded_keeps_a_record_recovered_in_a_transaction_not_committed_yet() -> None:
    tracker = FailureTracker()
    batch = messages(b"a", b"b")
    a = to_record(batch[0])
    _failing(tracker, a, 3)
    tracker.record_recovered(a)

    tracker.succeeded(batch)
    state = tracker.state(a)
    assert state is not None and state.failures == 3

    _failing(tracker, a)  # a new failure: no longer the recovered one
    tracker.succeeded(batch)
    assert tracker.state(a) is None


def test_succeeded_needs_no_pass_over_the_records_when_only_the_failed_one_is_failing() -> None:
    tracker = FailureTracker()
    batch = messages(b"a", b"b", b"c")
    failed = to_record(batch[2])
    _failing(tracker, failed)

    class Untouchable:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"records before the failed one were looked at ({name})")

    tracker.succeeded([Untouchable(), Untouchable()], failed)  # type: ignore[list-item]
    assert tracker.attempt("in", 0, 2) == 2


def test_a_success_in_a_batch_kafka_aborts_ends_the_count_too() -> None:
    host: FakeHost
    handle, log = _scripted({b"x": {1, 2, 4}})

    def arm_then_handle(record: Record) -> bytes:
        result = handle(record)
        if len(log) == 3:  # X's success: the commit of its batch is aborted by Kafka, and the batch runs again
            host.producer.fail_on("commit", TransactionAbortableError("abortable", operation="commit_transaction"))
        return result

    recovered: list[bytes | None] = []
    host = FakeHost(listener(arm_then_handle, max_attempts=3, backoff=0, dlq=lambda r, e: recovered.append(r.value)))

    host.runner()(host.unit(messages(b"x")))

    assert _attempts(log, b"x") == [(1, False), (2, False), (3, True), (1, False), (2, True)]
    assert recovered == []
