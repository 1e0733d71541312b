"""The after-rollback driver and RollbackScope over a fake host: retry, recover, a failing recoverer (no broker)."""

from __future__ import annotations

from typing import Any

import pytest
from fakes import FakeHost, listener, messages

from kafkatx import Record
from kafkatx.errors import RecoveryExhaustedError
from kafkatx.events import RecordRecovered, RecordRetryScheduled, RecoveryFailed
from kafkatx.listener.failure.after_rollback import RollbackScope, after_rollback
from kafkatx.listener.host import HandlerFailure
from kafkatx.outputs import PendingOutput
from kafkatx.record import to_record
from kafkatx.rollback.durable import decode
from kafkatx.rollback.processor import DefaultAfterRollbackProcessor

IN = ("in", 0)


def _replay(record: Record) -> list[PendingOutput]:
    return [("out", b"re-" + (record.value or b""), None, None, None)]


def _drive(failed_index: int, *, keep_in_memory: bool = False, **policy: Any) -> tuple[FakeHost, list[Any]]:
    """The record at ``failed_index`` of a batch of three failed: run the listener's after-rollback processor
    (``policy``: the listener's failure options) as the runner does once the transaction is aborted."""
    host = FakeHost(listener(lambda r: None, **policy))
    batch = messages(b"a", b"b", b"c")
    failure = HandlerFailure(failed_index, ValueError("poison"), to_record(batch[failed_index]))
    processor = host.spec.processor
    assert isinstance(processor, DefaultAfterRollbackProcessor)
    rest = after_rollback(host.unit(batch), batch, failure, processor, _replay, keep_in_memory=keep_in_memory)
    return host, rest


def test_retry_commits_the_failed_records_own_offset_with_its_count_and_seeks_back() -> None:
    host, rest = _drive(1, max_attempts=3, backoff=0)
    assert rest == []
    (txn,) = host.producer.committed
    assert txn.produced == [("out", b"re-a")], "the batch-mate before it re-run"
    assert txn.offsets == {IN: 1}, "up to the failed record, not past it"
    state = decode(txn.metadata[IN], 1)
    assert state is not None and state.failures == 1
    assert host.seeks == [(IN, 1)]
    assert [e.attempt for e in host.events_of(RecordRetryScheduled)] == [2]


def test_retry_with_a_back_off_pauses_the_partition_and_hands_its_records_to_the_container() -> None:
    host, rest = _drive(0, keep_in_memory=True, max_attempts=3, backoff=3.0)
    assert rest == [] and host.pauses == {IN: 3.0}
    assert [m.offset() for m in host.deferred[IN][0]] == [0, 1, 2]


def test_recover_calls_the_recoverer_and_commits_its_offset_in_the_same_transaction() -> None:
    recovered: list[tuple[int, str]] = []
    host, rest = _drive(1, keep_in_memory=True, dlq=lambda r, e: recovered.append((r.offset, str(e))), max_attempts=1)
    assert recovered == [(1, "poison")]
    (txn,) = host.producer.committed
    assert txn.offsets == {IN: 2} and txn.produced == [("out", b"re-a")]
    assert [m.offset() for m in rest] == [2], "the record after it is handled next, from memory"
    assert host.tracker.state_at("in", 0, 1) is None, "its count ends with the commit"
    assert [e.record.offset for e in host.events_of(RecordRecovered)] == [1]


def test_a_failing_recoverer_commits_the_batch_mates_keeps_the_record_and_pauses() -> None:
    def recoverer(record: Record, exc: BaseException) -> None:
        raise ConnectionError("down")

    host, rest = _drive(1, dlq=recoverer, max_attempts=1, recovery_backoff=2.0)
    assert rest == []
    assert [t.outcome for t in host.producer.transactions] == ["aborted", "committed"]
    assert host.producer.committed_offsets == {IN: 1}
    assert host.pauses == {IN: 2.0}
    state = host.tracker.state_at("in", 0, 1)
    assert state is not None and state.pending_recovery and state.recovery_failures == 1
    assert len(host.events_of(RecoveryFailed)) == 1


def test_a_recoverer_failing_max_recovery_failures_times_stops_the_container() -> None:
    def recoverer(record: Record, exc: BaseException) -> None:
        raise ConnectionError("down")

    with pytest.raises(RecoveryExhaustedError, match="max_recovery_failures=1"):
        _drive(0, dlq=recoverer, max_attempts=1, max_recovery_failures=1)


def test_the_scope_rewinds_whatever_the_transaction_did_not_commit() -> None:
    host = FakeHost(listener(lambda r: None))
    batch = messages(b"a", b"b", b"c", start=10) + messages(b"x", b"y", partition=1, start=20)
    host.assigned.add(("in", 1))
    failure = HandlerFailure(1, ValueError("poison"), to_record(batch[1]))
    scope = RollbackScope(host.unit(batch), batch, failure, _replay)
    scope.commit_offset(scope.failed)  # a custom processor recovered the failed record, and decided nothing more
    assert scope.apply() == []
    assert host.seeks == [(IN, 12), (("in", 1), 20)], "every record not committed is fetched again"


def test_the_default_processor_takes_the_policys_settings_or_a_ready_policy_not_both() -> None:
    def recoverer(record: Record, exc: BaseException) -> None:
        pass

    processor = DefaultAfterRollbackProcessor(recoverer=recoverer, max_attempts=4, backoff=2.0, max_recovery_failures=2)
    policy = processor.policy
    assert (processor.max_attempts, policy.max_recovery_failures) == (4, 2)
    assert processor.recoverer.name.endswith("recoverer")
    assert policy.decide(1, ValueError("x")).delay == 2.0
    assert DefaultAfterRollbackProcessor(policy=policy).policy is policy
    with pytest.raises(TypeError, match="not both"):
        DefaultAfterRollbackProcessor(policy=policy, max_attempts=2)
