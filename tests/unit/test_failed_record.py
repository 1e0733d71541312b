"""The failed-record procedure (listener/failure/failed_record.py), one rule per test, through a small fake scope.

``settle_failure`` is what every runner calls once a record's handler raised in an open transaction: it counts
the failure and publishes it, asks the policy, and says what to do: call the handler again now (CallAgain, with
the next attempt), end the transaction before the record and hold its partition (Hold, with the back-off), or
recover it in the open transaction (None). ``retry_recovery`` runs a failed recovery again without the handler.
No runner, no unit, no broker: milliseconds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from kafkatx import Record
from kafkatx.errors import InvalidConfigurationError, RecoveryError, RecoveryExhaustedError, UnproducibleTypeError
from kafkatx.events import Event, HandlerFailed, RecordRecovered, RecordRetryScheduled, RecoveryFailed
from kafkatx.listener.failure.failed_record import Abandoned, CallAgain, Hold, retry_recovery, settle_failure
from kafkatx.recoverers import Recoverer
from kafkatx.rollback.policy import FailurePolicy
from kafkatx.rollback.tracker import FailureTracker


@dataclass
class FakeScope:
    """A :class:`~kafkatx.listener.failure.failed_record.FailureScope`: events, waits and recoveries recorded.

    ``recover`` runs the recoverer as a transaction unit does (a failure becomes a RecoveryError); ``stopping``
    is the container's stop event; ``stop_while_waiting`` makes a wait end with the container stopping.
    """

    policy: FailurePolicy
    listener: str = "orders"
    worker: int = 0
    tracker: FailureTracker = field(default_factory=FailureTracker)
    stopping: threading.Event = field(default_factory=threading.Event)
    events: list[Event] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    recoveries: list[tuple[int, int, bool]] = field(default_factory=list)  # (offset, attempt, confirm)
    stop_while_waiting: bool = False

    @property
    def stop_event(self) -> threading.Event:
        return self.stopping

    def publish(self, event: Event) -> None:
        self.events.append(event)

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        if self.stop_while_waiting:
            self.stopping.set()
        return self.stopping.is_set()

    def recover(self, recoverer: Recoverer, record: Record, exception: BaseException, *, confirm: bool = True) -> None:
        self.recoveries.append((record.offset, record.attempt, confirm))
        try:
            recoverer(record, exception)
        except Exception as exc:
            raise RecoveryError(record, exc, recoverer.name) from exc

    def of(self, kind: type[Event]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def _scope(recoverer: Any = None, **options: Any) -> FakeScope:
    return FakeScope(FailurePolicy(recoverer or (lambda record, exc: None), **options))


RECORD = Record("in", 0, 7, b"k", b"v")


def test_a_failure_is_counted_and_published() -> None:
    """Every failed call is counted in the tracker and published as HandlerFailed, whatever is decided."""
    scope = _scope(max_attempts=3, backoff=0)
    exc = ValueError("bad")
    settle_failure(scope, RECORD, exc)
    state = scope.tracker.state(RECORD)
    assert state is not None and state.failures == 1 and state.last_exception is exc
    [failed] = scope.of(HandlerFailed)
    assert (failed.listener, failed.record, failed.exception, failed.attempt) == ("orders", RECORD, exc, 1)


def test_with_no_back_off_the_handler_is_called_again_with_the_next_attempt() -> None:
    """Attempts left, backoff 0: CallAgain, the record's attempt one higher each time, in the same transaction."""
    scope = _scope(max_attempts=3, backoff=0)
    first = settle_failure(scope, RECORD, ValueError("bad"))
    assert isinstance(first, CallAgain) and first.record.attempt == 2
    second = settle_failure(scope, first.record, ValueError("bad"))
    assert isinstance(second, CallAgain) and second.record.attempt == 3
    assert second.record.offset == RECORD.offset and second.record.value == RECORD.value
    assert [(e.attempt, e.delay) for e in scope.of(RecordRetryScheduled)] == [(2, 0.0), (3, 0.0)]
    assert scope.recoveries == []


def test_a_back_off_is_a_hold_with_its_delay_and_no_wait() -> None:
    """Attempts left, a back-off: Hold (the transaction ends before the record and its partition waits), not a
    wait with the transaction open."""
    scope = _scope(max_attempts=3, backoff=2.5)
    exc = ValueError("bad")
    outcome = settle_failure(scope, RECORD, exc)
    assert outcome == Hold(RECORD, exc, 2.5)
    assert scope.waits == [] and scope.recoveries == []
    assert scope.tracker.attempt("in", 0, 7) == 2, "its count stays until its offset commits"


@pytest.mark.parametrize(("options", "exc"), [({"max_attempts": 2}, ValueError("bad")), ({}, TypeError("bad"))])
def test_exhausted_or_not_retryable_the_record_is_recovered_in_the_transaction(
    options: dict[str, Any], exc: Exception
) -> None:
    """Attempts exhausted, or not retryable: the recoverer runs in the open transaction (what it sends held until
    it returns: confirm=False), RecordRecovered is published, None is returned (the batch goes on), and the count
    ends only when the offset commits."""
    got: list[tuple[Record, BaseException]] = []
    scope = _scope(lambda record, error: got.append((record, error)), **options)
    record = RECORD
    outcome = settle_failure(scope, record, exc)
    while isinstance(outcome, CallAgain):
        record = outcome.record
        outcome = settle_failure(scope, record, exc)
    attempts = options.get("max_attempts", 1)
    assert outcome is None
    assert scope.recoveries == [(7, attempts, False)]
    assert [(r.offset, r.attempt, e) for r, e in got] == [(7, attempts, exc)]
    [recovered] = scope.of(RecordRecovered)
    assert recovered.record.attempt == attempts and recovered.exception is exc
    state = scope.tracker.state(RECORD)
    assert state is not None and state.recovered and state.failures == attempts, "kept until the commit"
    scope.tracker.committed({("in", 0): 8})
    assert not scope.tracker


def test_a_failing_recoverer_is_a_hold_for_the_recovery_back_off_and_its_recovery_is_pending() -> None:
    """The recoverer failed: RecoveryFailed is published and Hold is returned with the recovery back-off; the
    record's next delivery goes to recovery, not to the handler (pending_recovery)."""

    def down(record: Record, error: BaseException) -> None:
        raise ConnectionError("dead-letter topic down")

    scope = _scope(down, max_attempts=1, recovery_backoff=4.0)
    exc = ValueError("bad")
    outcome = settle_failure(scope, RECORD, exc)
    assert isinstance(outcome, Hold) and outcome.delay == 4.0 and outcome.exc is exc
    state = scope.tracker.state(RECORD)
    assert state is not None and state.pending_recovery and state.recovery_failures == 1 and state.failures == 1
    [failed] = scope.of(RecoveryFailed)
    assert failed.exception is exc and type(failed.recovery_error) is ConnectionError and failed.failures == 1
    assert scope.of(RecordRecovered) == []


def test_a_retried_recovery_runs_the_recoverer_alone_and_can_succeed() -> None:
    """retry_recovery: the recoverer again (with the record's count and last exception), no new failure counted."""
    calls: list[tuple[int, BaseException]] = []

    def recoverer(record: Record, error: BaseException) -> None:
        calls.append((record.attempt, error))
        if len(calls) == 1:
            raise ConnectionError("dead-letter topic down")

    scope = _scope(recoverer, max_attempts=2, backoff=0, recovery_backoff=4.0)
    exc = ValueError("bad")
    again = settle_failure(scope, RECORD, exc)
    assert isinstance(again, CallAgain)
    assert isinstance(settle_failure(scope, again.record, exc), Hold)
    assert retry_recovery(scope, RECORD) is None
    assert calls == [(2, exc), (2, exc)]
    assert [e.attempt for e in scope.of(HandlerFailed)] == [1, 2], "the retried recovery counts no failure"
    assert len(scope.of(RecordRecovered)) == 1


def test_recovery_exhausted_after_max_recovery_failures() -> None:
    """After max_recovery_failures failed recoveries the container stops with RecoveryExhaustedError."""

    def down(record: Record, error: BaseException) -> None:
        raise ConnectionError("dead-letter topic down")

    scope = _scope(down, max_attempts=1, max_recovery_failures=2, recovery_backoff=4.0)
    assert isinstance(settle_failure(scope, RECORD, ValueError("bad")), Hold)
    with pytest.raises(RecoveryExhaustedError, match=r"in/0@7 failed 2 time\(s\) \(max_recovery_failures=2\)"):
        retry_recovery(scope, RECORD)
    assert [e.failures for e in scope.of(RecoveryFailed)] == [1, 2]


def test_stopping_holds_a_record_that_would_be_retried_and_decides_nothing() -> None:
    """The container is stopping: a record with attempts left is held with no delay (the records before it commit;
    nothing is decided about it, never recovered); its failure is counted, so its attempts only go up."""
    scope = _scope(max_attempts=3, backoff=2.5)
    scope.stopping.set()
    outcome = settle_failure(scope, RECORD, ValueError("bad"))
    assert isinstance(outcome, Hold) and outcome.delay == 0.0
    assert scope.recoveries == [] and scope.of(RecordRetryScheduled) == []
    assert scope.tracker.attempt("in", 0, 7) == 2


def test_stopping_abandons_a_record_waiting_in_the_transaction() -> None:
    """retry="in_place" waits with the transaction open: a stop abandons the unit (aborted, rewound)."""
    scope = _scope(max_attempts=3, backoff=2.5)
    scope.stopping.set()
    with pytest.raises(Abandoned):
        settle_failure(scope, RECORD, ValueError("bad"), wait_in_transaction=True)
    assert scope.recoveries == []


def test_stopping_still_recovers_a_record_whose_attempts_ran_out() -> None:
    """A stop decides nothing about retries; a record out of attempts is recovered (the policy's verdict)."""
    scope = _scope(max_attempts=1)
    scope.stopping.set()
    assert settle_failure(scope, RECORD, ValueError("bad")) is None
    assert scope.recoveries == [(7, 1, False)]


def test_in_place_the_back_off_is_waited_in_the_transaction_then_the_handler_is_called_again() -> None:
    """retry="in_place" (wait_in_transaction): the back-off is waited with the transaction open, then CallAgain;
    a stop during the wait abandons the record."""
    scope = _scope(max_attempts=3, backoff=2.5)
    outcome = settle_failure(scope, RECORD, ValueError("bad"), wait_in_transaction=True)
    assert isinstance(outcome, CallAgain) and outcome.record.attempt == 2
    assert scope.waits == [2.5]

    scope.stop_while_waiting = True
    with pytest.raises(Abandoned):
        settle_failure(scope, outcome.record, ValueError("bad"), wait_in_transaction=True)
    assert scope.waits == [2.5, 2.5] and scope.recoveries == []


def test_an_unproducible_type_stops_the_container_and_counts_nothing() -> None:
    """A handler that returned a type kafkatx cannot encode made a programming error, no record's failure."""
    scope = _scope(max_attempts=3, backoff=0)
    with pytest.raises(InvalidConfigurationError, match="listener 'orders'"):
        settle_failure(scope, RECORD, UnproducibleTypeError("returned an unsupported dict", "dict"))
    assert not scope.tracker and scope.events == [] and scope.recoveries == []


class _WrappedJobError(Exception):
    """What a Spark job error looks like to kafkatx: a wrapper naming the original class it lost."""

    original_fqcn = "pyspark.errors.exceptions.captured.SparkRuntimeException"


def test_the_log_names_a_wrapped_failure_as_its_dead_letter_header_does(caplog: pytest.LogCaptureFixture) -> None:
    """One name for one failure: a wrapper's original class in the log line, as in kafka_dlt-exception-fqcn."""
    scope = _scope(max_attempts=2, backoff=0)
    with caplog.at_level("INFO", logger="kafkatx.rollback"):
        settle_failure(scope, RECORD, _WrappedJobError("division by zero"))
    assert "(pyspark.errors.exceptions.captured.SparkRuntimeException: division by zero)" in caplog.text
    assert "_WrappedJobError" not in caplog.text
