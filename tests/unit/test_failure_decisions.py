"""Pure logic of the after-rollback machinery: classification, attempt counting, back-off."""

from __future__ import annotations

import json
import threading

import pytest
import tenacity

from kafkatx import DeserializationError, OutputError, Record
from kafkatx.rollback.backoff import as_wait
from kafkatx.rollback.classifier import ExceptionClassifier, exception_fqcn, retry_if_retryable, root_cause
from kafkatx.rollback.policy import Action, FailurePolicy, Verdict
from kafkatx.rollback.tracker import FailureTracker


def rec(offset: int = 5, partition: int = 0, topic: str = "t") -> Record:
    return Record(topic, partition, offset, None, b"v")


class Custom(Exception):
    pass


class Narrow(ValueError):
    pass


def test_defaults_are_not_retryable_and_other_errors_are() -> None:
    c = ExceptionClassifier()
    defaults = [
        DeserializationError("x"),
        json.JSONDecodeError("m", "d", 0),
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"),
        OutputError("x"),
        TypeError("x"),
    ]
    for exc in defaults:
        assert not c.is_retryable(exc), exc
    assert c.is_retryable(RuntimeError("x")) and c.is_retryable(ValueError("x")) and c.is_retryable(ConnectionError())


def test_cause_chain_is_walked_and_retryable_carves_out_subclasses() -> None:
    c = ExceptionClassifier((ValueError,), retryable=(Narrow,))
    try:
        try:
            raise ValueError("inner")
        except ValueError as inner:
            raise RuntimeError("outer") from inner
    except RuntimeError as outer:
        assert not c.is_retryable(outer)
        assert root_cause(outer).args == ("inner",)
    assert c.is_retryable(Narrow("more specific wins"))
    assert ExceptionClassifier(include_defaults=False).is_retryable(TypeError("x"))
    with pytest.raises(TypeError, match="exception types"):
        ExceptionClassifier(("ValueError",))  # type: ignore[arg-type]


def test_exception_fqcn_and_wrapped_original() -> None:
    assert exception_fqcn(ValueError()) == "builtins.ValueError"
    assert exception_fqcn(Custom()) == f"{__name__}.Custom"
    wrapped = RuntimeError("spark")
    wrapped.original_fqcn = "mymodule.PoisonError"  # type: ignore[attr-defined]
    assert exception_fqcn(wrapped) == "mymodule.PoisonError"


def test_tracker_counts_per_record_and_resets_on_exception_type_change() -> None:
    t = FailureTracker()
    assert not t and t.attempt("t", 0, 5) == 1
    assert t.record_failure(rec(5), ValueError()).failures == 1
    assert t.attempt("t", 0, 5) == 2
    assert t.record_failure(rec(5), ValueError()).failures == 2
    assert t.record_failure(rec(5), KeyError()).failures == 1, "an unrelated exception type restarts the count"
    assert t.record_failure(rec(6), KeyError()).failures == 1, "another offset has its own count"
    assert t.attempt("t", 0, 5) == 2, "a batch-mate failing does not erase the first record's count"
    assert t.record_failure(rec(6, partition=1), KeyError()).failures == 1, "partitions are independent"
    t.clear_partitions([("t", 0)])
    assert t.attempt("t", 0, 6) == 1 and t.attempt("t", 1, 6) == 2
    t.clear(rec(6, partition=1))
    assert not t


class Base(Exception):
    pass


class Sub(Base):
    pass


def test_tracker_exception_change_follows_spring() -> None:
    """Spring keeps counting when the previous failure is an instance of the new one's class."""
    t = FailureTracker()
    assert t.record_failure(rec(), Sub()).failures == 1
    assert t.record_failure(rec(), Base()).failures == 2, "Sub is a Base: same kind"
    chained = Base("raised from another error")
    chained.__cause__ = KeyError()
    assert t.record_failure(rec(), chained).failures == 3, "what the handler raised is compared, not its cause"
    wrapped = RuntimeError("wrapper")
    wrapped.__cause__ = Base()
    assert t.record_failure(rec(), wrapped).failures == 1, "a Base is not a RuntimeError: Spring resets"
    assert t.record_failure(rec(), Sub()).failures == 1, "a RuntimeError is not a Sub: Spring resets"
    assert t.record_failure(rec(), ValueError()).failures == 1


def test_tracker_forgets_what_is_committed() -> None:
    t = FailureTracker()
    t.record_failure(rec(3), ValueError())
    t.record_failure(rec(7), ValueError())
    t.committed({("t", 0): 5})
    assert t.attempt("t", 0, 3) == 1, "offset 3 was committed: it succeeded or was recovered"
    assert t.attempt("t", 0, 7) == 2
    t.committed({("t", 0): 8})
    assert not t


def test_tracker_keeps_counting_when_reset_on_change_is_off() -> None:
    t = FailureTracker(reset_on_exception_change=False)
    t.record_failure(rec(), ValueError())
    assert t.record_failure(rec(), KeyError()).failures == 2


def test_recovery_failures_mark_the_record_for_recovery() -> None:
    t = FailureTracker()
    t.record_failure(rec(), ValueError("boom"))
    state = t.record_recovery_failure(rec())
    assert state.pending_recovery and state.recovery_failures == 1 and isinstance(state.last_exception, ValueError)


def test_policy_asks_the_classifier_then_the_attempts_then_waits() -> None:
    policy = FailurePolicy(
        max_attempts=3,
        backoff=tenacity.wait_exponential(multiplier=0.1, max=5),
        classifier=ExceptionClassifier([KeyError]),
    )
    assert policy.decide(1, ValueError()) == Verdict(Action.RETRY, 1, delay=0.1)
    assert policy.decide(2, ValueError()) == Verdict(Action.RETRY, 2, delay=0.2)
    verdict = policy.decide(3, ValueError())
    assert verdict.action is Action.RECOVER and "exhausted (3/3)" in verdict.reason
    verdict = policy.decide(1, KeyError())
    assert verdict.action is Action.RECOVER and verdict.reason == "not retryable"
    stopping = threading.Event()
    stopping.set()
    assert policy.decide(1, ValueError(), stopping).action is Action.ABANDON, "stopping decides nothing"
    assert policy.decide(3, ValueError(), stopping).action is Action.RECOVER, "exhausted is exhausted"


def test_policy_recovery_backoff_and_limit() -> None:
    policy = FailurePolicy(max_recovery_failures=2, recovery_backoff=2)
    assert policy.recovery_delay(1) == 2.0
    assert policy.recovery_delay(2) is None
    assert FailurePolicy().recovery_delay(1000) is not None, "unbounded by default"


def test_retry_if_retryable_is_a_tenacity_strategy() -> None:
    classifier = ExceptionClassifier([KeyError])
    attempts = []

    @tenacity.retry(retry=retry_if_retryable(classifier), stop=tenacity.stop_after_attempt(5), reraise=True)
    def flaky() -> None:
        attempts.append(1)
        raise (ValueError if len(attempts) < 3 else KeyError)()

    with pytest.raises(KeyError):
        flaky()
    assert len(attempts) == 3, "ValueError retried, KeyError not"


def test_backoff_accepts_tenacity_strategies_and_numbers() -> None:
    p = FailurePolicy(backoff=tenacity.wait_exponential(multiplier=0.1, max=5), max_attempts=10)
    assert [p.decide(i, ValueError()).delay for i in (1, 2, 3)] == [0.1, 0.2, 0.4]
    assert FailurePolicy(backoff=2, max_attempts=10).decide(7, ValueError()).delay == 2.0
    assert FailurePolicy(max_attempts=10).decide(1, ValueError()).delay == 0.0 and as_wait(0) is None
    combo = FailurePolicy(backoff=tenacity.wait_fixed(1) + tenacity.wait_random(0, 0.1))
    assert 1.0 <= combo.decide(1, ValueError()).delay <= 1.1
    with pytest.raises(ValueError, match=">= 0"):
        as_wait(-1)
    with pytest.raises(TypeError, match="tenacity wait strategy"):
        as_wait("5s")
