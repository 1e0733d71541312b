"""docs/FAILURES.md's "Step by step", one rule per test, through the record runner and a fake host (no broker).

1. Nothing is aborted: a record's work is held until its handler returns, and the failed call's is dropped, so
   the records before it stay in the transaction and commit, once.
2. With attempts left and ``backoff=0``, the handler is called again at once, in the same transaction, with
   ``record.attempt`` one higher.
3. With a back-off, the transaction ends before the record: the records before it commit with the record's own
   offset (the commit's metadata carries its count); its partition waits for the back-off (its records held in
   memory, or sought back when the poll is old) while the other partitions' records are handled next.
4. Attempts exhausted, or not retryable: the recoverer runs in the same transaction, so the dead letter and the
   record's offset commit together, and the batch goes on with the next record.
5. A failing recoverer: what it sent is dropped, the transaction ends before the record (its offset committed
   with its count), its partition waits ``recovery_backoff``, the next delivery retries the recovery alone, and
   after ``max_recovery_failures`` the container stops with RecoveryExhaustedError.

Each rule has a real-broker test too (tests/test_after_rollback.py, test_attempt_counting.py, test_dead_letters.py,
test_spring_expectations.py); these take milliseconds and show the rule's mechanics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fakes import FakeHost, FakeProducer, listener, messages

import kafkatx
from kafkatx import Record
from kafkatx.errors import RecoveryExhaustedError
from kafkatx.events import HandlerFailed, RecordRecovered, RecordRetryScheduled, RecoveryFailed, TransactionAborted
from kafkatx.recoverers import as_recoverer
from kafkatx.rollback.durable import decode

IN = ("in", 0)
IN1 = ("in", 1)


def _poison(bad: bytes, seen: list[Record] | None = None, *, times: int = 1000) -> Callable[[Record], bytes]:
    """A handler that fails on the record whose value is ``bad`` (its first ``times`` calls) and upper-cases the
    others."""
    failures = [times]

    def handle(record: Record) -> bytes:
        if seen is not None:
            seen.append(record)
        if record.value == bad and failures[0]:
            failures[0] -= 1
            raise ValueError(f"poison {bad!r}")
        return (record.value or b"").upper()

    return handle


def _failures_committed_with(host: FakeHost, offset: int, tp: tuple[str, int] = IN) -> int:
    """The failure count the last commit of ``tp`` stored with ``offset`` (offset-commit metadata)."""
    txn = next(t for t in reversed(host.producer.committed) if tp in t.offsets)
    assert txn.offsets[tp] == offset
    state = decode(txn.metadata[tp], offset)
    assert state is not None
    return state.failures


def test_rule_1_nothing_is_aborted_and_the_records_before_the_failed_one_commit_once() -> None:
    """Rule 1: a failure aborts nothing; the records before the failed one commit in the transaction they ran in,
    and are never run again."""
    seen: list[Record] = []
    host = FakeHost(listener(_poison(b"c", seen), backoff=5.0))
    host.runner()(host.unit(messages(b"a", b"b", b"c", b"d")))
    assert [t.outcome for t in host.producer.transactions] == ["committed"]
    assert host.producer.committed_values == [b"A", b"B"], "committed once, in the transaction they ran in"
    assert [r.value for r in seen] == [b"a", b"b", b"c"], "the records before the failed one ran once"
    assert host.events_of(TransactionAborted) == []
    assert host.tracker.state_at("in", 0, 0) is None and host.tracker.state_at("in", 0, 1) is None


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("shape", ["send", "generator"])
def test_rule_1_what_a_failed_call_sent_or_yielded_is_produced_in_no_transaction(fast: bool, shape: str) -> None:
    """Rule 1: a record's send()s and a generator's items wait in its buffer until its handler returns; a call
    that raises leaves nothing of them with the producer, in no transaction, aborted or committed."""

    def sending(record: Record) -> bytes:
        kafkatx.send("out", b"sent " + (record.value or b""))
        if record.value == b"b":
            raise ValueError("poison after a send")
        return record.value or b""

    def yielding(record: Record) -> Iterator[bytes]:
        yield b"sent " + (record.value or b"")
        if record.value == b"b":
            raise ValueError("poison after a yield")
        yield record.value or b""

    host = FakeHost(listener(sending if shape == "send" else yielding, backoff=5.0), FakeProducer(fast=fast))
    host.runner()(host.unit(messages(b"a", b"b")))
    produced = [value for t in host.producer.transactions for _, value in t.produced]
    assert produced == [b"sent a", b"a"], "nothing of the failed call, in any transaction"
    assert host.producer.committed_values == [b"sent a", b"a"]
    assert host.producer.committed_offsets == {IN: 1} and _failures_committed_with(host, 1) == 1


def test_rule_2_with_no_back_off_the_handler_is_called_again_in_the_same_transaction() -> None:
    """Rule 2: backoff=0 with attempts left: the failed call's work is dropped and the handler is called again at
    once, in the same transaction, with record.attempt one higher; the count ends when the offset commits."""
    seen: list[Record] = []
    host = FakeHost(listener(_poison(b"b", seen, times=2), max_attempts=3, backoff=0))
    host.runner()(host.unit(messages(b"a", b"b", b"c")))
    assert [t.outcome for t in host.producer.transactions] == ["committed"], "one transaction, nothing aborted"
    assert host.producer.committed_values == [b"A", b"B", b"C"]
    assert [(r.value, r.attempt) for r in seen] == [(b"a", 1), (b"b", 1), (b"b", 2), (b"b", 3), (b"c", 1)]
    assert [(e.record.offset, e.attempt) for e in host.events_of(HandlerFailed)] == [(1, 1), (1, 2)]
    assert [(e.attempt, e.delay) for e in host.events_of(RecordRetryScheduled)] == [(2, 0.0), (3, 0.0)]
    assert host.producer.committed_offsets == {IN: 3} and not host.tracker, "its count ended with the commit"


def test_rule_3_a_back_off_holds_the_partition_and_the_other_partitions_go_on() -> None:
    """Rule 3: with a back-off, the records before the failed one commit with its own offset (its count in the
    metadata); its partition is held (its records kept in memory) and handed back when the back-off ends, with
    record.attempt one higher; the records after it on other partitions are handled next, in a new transaction."""
    seen: list[Record] = []
    host = FakeHost(listener(_poison(b"b", seen, times=1), max_attempts=3, backoff=2.5))
    batch = messages(b"a", b"b", b"c") + messages(b"x", b"y", partition=1)
    host.runner()(host.unit(batch))
    first, second = host.producer.transactions
    assert first.outcome == second.outcome == "committed"
    assert first.produced == [("out", b"A")] and first.offsets == {IN: 1}, "its own offset, nothing past it"
    assert decode(first.metadata[IN], 1).failures == 1  # type: ignore[union-attr]
    assert second.produced == [("out", b"X"), ("out", b"Y")] and second.offsets == {IN1: 2}, "from memory"
    assert host.pauses == {IN: 2.5} and host.seeks == []
    held, seconds = host.deferred[IN]
    assert [m.offset() for m in held] == [1, 2] and seconds == 2.5, "the failed record and the one after it"
    host.runner()(host.unit(held))  # the back-off ended: the container hands them back
    assert [r.attempt for r in seen if r.value == b"b"] == [1, 2]
    assert host.producer.committed_values == [b"A", b"X", b"Y", b"B", b"C"]
    assert host.producer.committed_offsets == {IN: 3, IN1: 2} and not host.tracker


def test_rule_3_a_partition_is_sought_back_instead_when_the_poll_is_too_old_to_keep_records_in_memory() -> None:
    """Rule 3 (its fallback): past the transaction budget, what was not committed is fetched again (sought back),
    and the failed record's partition is paused for the back-off."""
    host = FakeHost(listener(_poison(b"b"), max_attempts=3, backoff=2.5))
    host.polled_at -= 10 * host.transaction_budget
    host.runner()(host.unit(messages(b"a", b"b", b"c") + messages(b"x", partition=1)))
    assert host.seeks == [(IN, 1), (IN1, 0)] and host.deferred == {}
    assert host.pauses == {IN: 2.5}
    assert host.producer.committed_offsets == {IN: 1} and _failures_committed_with(host, 1) == 1
    assert host.producer.committed_values == [b"A"]


@pytest.mark.parametrize(("options", "exc"), [({"max_attempts": 2}, ValueError), ({}, TypeError)])
def test_rule_4_exhausted_or_not_retryable_the_recoverer_runs_in_the_same_transaction(
    options: dict[str, Any], exc: type[Exception]
) -> None:
    """Rule 4: when attempts run out, or the exception is not retryable, the recoverer runs inside the same
    transaction: the dead letter and the record's offset commit together, and the batch goes on with the next
    record."""
    recovered: list[tuple[int, int]] = []
    calls: list[tuple[bytes | None, int]] = []

    def recoverer(record: Record, error: BaseException) -> None:
        recovered.append((record.offset, record.attempt))
        kafkatx.send("out-dlt", b"dead:" + (record.value or b""))

    def handle(record: Record) -> bytes:
        calls.append((record.value, record.attempt))
        if record.value == b"b":
            raise exc("poison")
        return b"ok:" + (record.value or b"")

    host = FakeHost(listener(handle, dlq=recoverer, backoff=0, **options))
    host.runner()(host.unit(messages(b"a", b"b", b"c")))
    attempts = options.get("max_attempts", 1)
    assert recovered == [(1, attempts)]
    assert calls == [(b"a", 1), *((b"b", n) for n in range(1, attempts + 1)), (b"c", 1)]
    [txn] = host.producer.transactions
    assert txn.outcome == "committed"
    assert txn.produced == [("out", b"ok:a"), ("out-dlt", b"dead:b"), ("out", b"ok:c")]
    assert txn.offsets == {IN: 3}
    assert [e.record.offset for e in host.events_of(RecordRecovered)] == [1]
    assert not host.tracker, "the recovered record's count ended with the commit"


def test_rule_5_a_failing_recoverer_keeps_the_record_and_retries_recovery_without_the_handler() -> None:
    """Rule 5: if the recoverer fails, what it sent is dropped and the transaction ends before the record (its
    offset committed with its count); recovery is retried after recovery_backoff without calling the handler
    again, and after max_recovery_failures the container stops with RecoveryExhaustedError."""
    seen: list[Record] = []
    calls: list[tuple[int, int]] = []

    def recoverer(record: Record, error: BaseException) -> None:
        calls.append((record.offset, record.attempt))
        kafkatx.send("out-dlt", b"dead")  # held until it returns: it never does
        raise ConnectionError("the dead-letter topic is down")

    host = FakeHost(
        listener(_poison(b"b", seen), dlq=recoverer, max_attempts=1, max_recovery_failures=2, recovery_backoff=4.0)
    )
    host.runner()(host.unit(messages(b"a", b"b", b"c")))
    assert calls == [(1, 1)]
    assert [t.outcome for t in host.producer.transactions] == ["committed"]
    assert host.producer.committed_values == [b"A"], "its batch-mate before it commits, no dead letter"
    assert host.producer.committed_offsets == {IN: 1} and _failures_committed_with(host, 1) == 1
    assert host.pauses == {IN: 4.0}
    assert [e.failures for e in host.events_of(RecoveryFailed)] == [1]
    held, _ = host.deferred.pop(IN)
    handled = len(seen)
    with pytest.raises(RecoveryExhaustedError, match="max_recovery_failures=2"):
        host.runner()(host.unit(held))  # handed back after recovery_backoff
    assert calls == [(1, 1), (1, 1)] and len(seen) == handled, "recovery retried, the handler not called again"
    assert host.producer.committed_offsets == {IN: 1}, "never skipped"
    assert b"dead" not in [value for t in host.producer.transactions for _, value in t.produced]


def test_a_recovery_that_succeeds_on_its_retry_commits_the_dead_letter_and_goes_on() -> None:
    """Rule 5, the good end: the next delivery recovers the record (no handler call) and the batch goes on."""
    seen: list[Record] = []
    down = [1]

    def recoverer(record: Record, error: BaseException) -> None:
        if down:
            down.pop()
            raise ConnectionError("the dead-letter topic is down")
        kafkatx.send("out-dlt", b"dead:" + (record.value or b""))

    host = FakeHost(listener(_poison(b"b", seen), dlq=recoverer, max_attempts=1, recovery_backoff=4.0))
    host.runner()(host.unit(messages(b"a", b"b", b"c")))
    host.runner()(host.unit(host.deferred.pop(IN)[0]))
    assert [r.value for r in seen] == [b"a", b"b", b"c"], "each handled once"
    assert host.producer.committed_values == [b"A", b"dead:b", b"C"]
    assert host.producer.committed_offsets == {IN: 3} and not host.tracker


@pytest.mark.parametrize("backoff", [0, 0.01])
def test_in_place_retries_drop_the_failed_attempts_outputs_without_aborting(backoff: float) -> None:
    """retry="in_place": the failed record is retried inside the batch transaction (a back-off waited with it
    open), its buffered outputs dropped; no abort, no extra transaction."""
    failures = [1]

    def handle(record: Record) -> Any:
        kafkatx.send("side", b"attempt %d" % record.attempt)
        if record.value == b"b" and failures:
            failures.pop()
            raise ValueError("once")
        return record.value

    host = FakeHost(listener(handle, retry="in_place", backoff=backoff))
    host.runner()(host.unit(messages(b"a", b"b")))
    assert [t.outcome for t in host.producer.transactions] == ["committed"]
    assert host.producer.committed_values == [b"attempt 1", b"a", b"attempt 2", b"b"]
    assert host.pauses == {} and host.deferred == {}


def test_stopping_while_a_record_fails_commits_what_came_before_it_and_decides_nothing_about_it() -> None:
    """Stopping the App while a record would be retried decides nothing about it (never dead-lettered by a rolling
    restart): the records before it commit, it is sought back for the next owner, and its count is kept."""
    recovered: list[Record] = []
    host = FakeHost(listener(_poison(b"b"), dlq=lambda r, e: recovered.append(r), max_attempts=3, backoff=0))
    host.stop_event.set()
    host.runner()(host.unit(messages(b"a", b"b", b"c")))
    assert recovered == [] and host.pauses == {}
    assert [t.outcome for t in host.producer.transactions] == ["committed"]
    assert host.producer.committed_values == [b"A"]
    assert host.producer.committed_offsets == {IN: 1}
    assert host.seeks == [(IN, 1)], "the failed record and what follows come back on restart"
    assert host.tracker.attempt("in", 0, 1) == 2


def test_stopping_while_a_record_waits_in_place_aborts_and_rewinds() -> None:
    """retry="in_place" waits with the transaction open: a stop aborts it and rewinds the unit, deciding nothing."""
    recovered: list[Record] = []
    host = FakeHost(
        listener(_poison(b"b"), dlq=lambda r, e: recovered.append(r), max_attempts=3, backoff=0, retry="in_place")
    )
    host.stop_event.set()
    host.runner()(host.unit(messages(b"a", b"b", b"c")))
    assert recovered == [] and host.pauses == {}
    assert [t.outcome for t in host.producer.transactions] == ["aborted"]
    assert host.seeks == [(IN, 0)], "the unit comes back on restart"
    assert host.producer.committed_offsets == {}


def test_a_custom_processor_is_handed_the_failed_record_once_the_records_before_it_committed() -> None:
    """A custom after_rollback=: the records before the failed one commit first (the transaction ends before it),
    then the processor runs in a new transaction with the failed record first and nothing processed."""
    seen: list[tuple[int, int, list[int], list[int]]] = []

    def dead_letter(record: Record, error: BaseException) -> None:
        kafkatx.send("out-dlt", b"dead:" + (record.value or b""))

    class DeadLetterAtOnce:
        def process(self, context: Any) -> None:
            failed, processed, records = context.failed, context.processed, context.records
            seen.append((failed.offset, failed.attempt, [r.offset for r in processed], [r.offset for r in records]))
            context.replay_processed()
            context.recover(as_recoverer(dead_letter), failed, context.exception)
            context.commit_offset(failed)

    host = FakeHost(listener(_poison(b"b"), after_rollback=DeadLetterAtOnce()))
    host.runner()(host.unit(messages(b"a", b"b", b"c")))
    assert seen == [(1, 1, [], [1, 2])]
    first, second, third = host.producer.transactions
    assert first.produced == [("out", b"A")] and first.offsets == {IN: 1}
    assert second.produced == [("out-dlt", b"dead:b")] and second.offsets == {IN: 2}
    assert third.produced == [("out", b"C")] and third.offsets == {IN: 3}, "the rest, from memory"
    assert all(t.outcome == "committed" for t in host.producer.transactions)


def test_a_custom_processor_that_decides_nothing_loses_nothing() -> None:
    """A custom after_rollback: the container rewinds every record the new transaction did not commit."""

    class DoNothing:
        def process(self, context: Any) -> None:
            pass

    host = FakeHost(listener(_poison(b"b"), after_rollback=DoNothing()))
    host.polled_at -= 10 * host.transaction_budget  # (kept in memory, it would be handed straight back)
    host.runner()(host.unit(messages(b"a", b"b", b"c")))
    assert host.seeks == [(IN, 1)] and host.producer.committed_offsets == {IN: 1}
    assert host.producer.committed_values == [b"A"]
