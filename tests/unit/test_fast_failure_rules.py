"""docs/FAILURES.md's "Step by step", one rule per test, through the record runner and a fake host (no broker).

Each rule has a real-broker test too (tests/test_after_rollback.py, test_attempt_counting.py, test_dead_letters.py,
test_spring_expectations.py); these take milliseconds and show the rule's mechanics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fakes import FakeHost, listener, messages

import kafkatx
from kafkatx import Record
from kafkatx.errors import RecoveryExhaustedError
from kafkatx.events import RecordRecovered, RecoveryFailed
from kafkatx.rollback.durable import decode

IN = ("in", 0)


def _poison(bad: bytes, seen: list[Record] | None = None) -> Callable[[Record], bytes]:
    """A handler that fails on the record whose value is ``bad`` and upper-cases the others."""

    def handle(record: Record) -> bytes:
        if seen is not None:
            seen.append(record)
        if record.value == bad:
            raise ValueError(f"poison {bad!r}")
        return (record.value or b"").upper()

    return handle


def _failures_committed_with(host: FakeHost, offset: int) -> int:
    """The failure count the last commit of ``IN`` stored with ``offset`` (offset-commit metadata)."""
    txn = host.producer.committed[-1]
    assert txn.offsets[IN] == offset
    state = decode(txn.metadata[IN], offset)
    assert state is not None
    return state.failures


def test_rule_1_the_failed_transaction_is_aborted() -> None:
    """Rule 1: the transaction is aborted, so nothing the batch produced is visible to read_committed consumers."""
    host = FakeHost(listener(_poison(b"b"), backoff=5.0))
    host.runner()(host.unit(messages(b"a", b"b", b"c")))
    first = host.producer.transactions[0]
    assert first.outcome == "aborted" and first.produced == [("out", b"A")]
    assert b"C" not in host.producer.committed_values, "nothing after the failed record is committed"


def test_rule_2_batch_mates_before_the_failed_record_are_rerun_and_committed_in_one_new_transaction() -> None:
    """Rule 2: the after-rollback processor runs in a new transaction; the records before the failed one are
    re-run and committed there, and their attempts are not counted."""
    seen: list[Record] = []
    host = FakeHost(listener(_poison(b"c", seen), backoff=5.0))
    host.runner()(host.unit(messages(b"a", b"b", b"c", b"d")))
    assert [t.outcome for t in host.producer.transactions] == ["aborted", "committed"]
    assert host.producer.committed_values == [b"A", b"B"], "re-run once, committed once"
    assert [(r.value, r.attempt) for r in seen] == [(b"a", 1), (b"b", 1), (b"c", 1), (b"a", 1), (b"b", 1)]
    assert host.tracker.state_at("in", 0, 0) is None and host.tracker.state_at("in", 0, 1) is None


def test_rule_3_with_attempts_left_the_partition_is_paused_and_the_next_delivery_counts_one_higher() -> None:
    """Rule 3: attempts left, the failed record's partition is paused for the back-off and its offset committed
    with its count; the records not committed are kept in memory and handled when the back-off ends, with
    record.attempt one higher."""
    seen: list[Record] = []
    host = FakeHost(listener(_poison(b"b", seen), max_attempts=3, backoff=2.5))
    batch = messages(b"a", b"b", b"c")
    host.runner()(host.unit(batch))
    assert host.pauses == {IN: 2.5}
    held, seconds = host.deferred[IN]
    assert [m.offset() for m in held] == [1, 2] and seconds == 2.5, "the failed record and the one after it"
    assert _failures_committed_with(host, 1) == 1, "its own offset, with its count"
    host.runner()(host.unit(held))  # the back-off ended: the container hands them back
    assert [r.attempt for r in seen if r.value == b"b"] == [1, 2]


def test_rule_3_a_partition_rewinds_instead_when_the_poll_is_too_old_to_keep_records_in_memory() -> None:
    """Rule 3 (its fallback): past the transaction budget, what was not committed is fetched again (sought back)."""
    host = FakeHost(listener(_poison(b"b"), max_attempts=3, backoff=0))
    host.polled_at -= 10 * host.transaction_budget
    host.runner()(host.unit(messages(b"a", b"b", b"c")))
    assert host.seeks == [(IN, 1)] and host.deferred == {}
    assert host.producer.committed_offsets == {IN: 1}


@pytest.mark.parametrize(("options", "exc"), [({"max_attempts": 2}, ValueError), ({}, TypeError)])
def test_rule_4_exhausted_or_not_retryable_the_recoverer_runs_in_the_new_transaction_with_the_offset(
    options: dict[str, Any], exc: type[Exception]
) -> None:
    """Rule 4: when attempts run out, or the exception is not retryable, the recoverer runs inside the new
    transaction and the record's offset is committed with it."""
    recovered: list[tuple[int, int]] = []

    def recoverer(record: Record, error: BaseException) -> None:
        recovered.append((record.offset, record.attempt))
        kafkatx.send("out-dlt", b"dead:" + (record.value or b""))

    def handle(record: Record) -> bytes:
        if record.value == b"b":
            raise exc("poison")
        return b"ok"

    host = FakeHost(listener(handle, dlq=recoverer, backoff=0, **options))
    batch = messages(b"a", b"b", b"c")
    host.runner()(host.unit(batch))
    while host.deferred:  # the retries, handed back as the container would
        host.runner()(host.unit(host.deferred.pop(IN)[0]))
    attempts = options.get("max_attempts", 1)
    assert recovered == [(1, attempts)]
    recovery = next(t for t in host.producer.committed if ("out-dlt", b"dead:b") in t.produced)
    assert recovery.offsets[IN] >= 2, "the recovered record's offset commits with its dead letter"
    assert host.producer.committed_offsets == {IN: 3}
    assert [e.record.offset for e in host.events_of(RecordRecovered)] == [1]


def test_rule_5_a_failing_recoverer_keeps_the_record_and_retries_recovery_without_the_handler() -> None:
    """Rule 5: if the recoverer fails nothing is committed for the record: it is kept, recovery is retried
    after recovery_backoff without calling the handler again, and after max_recovery_failures the container
    stops with RecoveryExhaustedError."""
    seen: list[Record] = []
    calls: list[int] = []

    def recoverer(record: Record, error: BaseException) -> None:
        calls.append(record.offset)
        raise ConnectionError("the dead-letter topic is down")

    host = FakeHost(
        listener(_poison(b"b", seen), dlq=recoverer, max_attempts=1, max_recovery_failures=2, recovery_backoff=4.0)
    )
    host.runner()(host.unit(messages(b"a", b"b", b"c")))
    assert calls == [1]
    assert host.producer.committed_offsets == {IN: 1}, "its batch-mate before it commits, the record does not"
    assert host.pauses == {IN: 4.0}
    assert [e.failures for e in host.events_of(RecoveryFailed)] == [1]
    handled = len(seen)
    with pytest.raises(RecoveryExhaustedError, match="max_recovery_failures=2"):
        host.runner()(host.unit(messages(b"b", b"c", start=1)))  # fetched again after the pause
    assert calls == [1, 1] and len(seen) == handled, "recovery retried, the handler not called again"
    assert host.producer.committed_offsets == {IN: 1}, "never skipped"


def test_in_place_retries_drop_the_failed_attempts_outputs_without_aborting() -> None:
    """retry="in_place": the failed record is retried inside the batch transaction, its buffered outputs dropped;
    no abort, no extra transaction."""
    failures = [1]

    def handle(record: Record) -> Any:
        kafkatx.send("side", b"attempt %d" % record.attempt)
        if record.value == b"b" and failures:
            failures.pop()
            raise ValueError("once")
        return record.value

    host = FakeHost(listener(handle, retry="in_place", backoff=0))
    host.runner()(host.unit(messages(b"a", b"b")))
    assert [t.outcome for t in host.producer.transactions] == ["committed"]
    assert host.producer.committed_values == [b"attempt 1", b"a", b"attempt 2", b"b"]


def test_stopping_while_a_record_waits_for_a_retry_decides_nothing_about_it() -> None:
    """One failure policy: stopping the App while a record waits for a retry decides nothing about it (it is
    rewound, never dead-lettered by a rolling restart)."""
    recovered: list[Record] = []
    host = FakeHost(listener(_poison(b"b"), dlq=lambda r, e: recovered.append(r), max_attempts=3, backoff=1.0))
    host.stop_event.set()
    host.runner()(host.unit(messages(b"a", b"b", b"c")))
    assert recovered == [] and host.pauses == {}
    assert host.seeks == [(IN, 1)], "the failed record comes back on restart"
    assert host.producer.committed_offsets == {IN: 1}


def test_a_custom_processor_that_decides_nothing_loses_nothing() -> None:
    """A custom after_rollback: the container rewinds every record the new transaction did not commit."""

    class DoNothing:
        def process(self, context: Any) -> None:
            pass

    host = FakeHost(listener(_poison(b"a"), after_rollback=DoNothing()))
    host.polled_at -= 10 * host.transaction_budget  # (kept in memory, it would be handed straight back)
    host.runner()(host.unit(messages(b"a", b"b")))
    assert host.seeks == [(IN, 0)] and host.producer.committed_offsets == {}
