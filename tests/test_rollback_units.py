"""Pure logic of the after-rollback machinery: classification, attempt counting, back-off."""

from __future__ import annotations

import json

import pytest
import tenacity

from kafkatx import DeserializationError, OutputError, Record
from kafkatx.rollback.backoff import as_wait, delay_for
from kafkatx.rollback.classifier import ExceptionClassifier, exception_fqcn, root_cause
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


def test_tracker_counts_per_offset_and_resets_on_new_offset_or_exception_type() -> None:
    t = FailureTracker()
    assert not t and t.attempt("t", 0, 5) == 1
    assert t.record_failure(rec(5), ValueError()).failures == 1
    assert t.attempt("t", 0, 5) == 2
    assert t.record_failure(rec(5), ValueError()).failures == 2
    assert t.record_failure(rec(5), KeyError()).failures == 1, "a different exception type restarts the count"
    assert t.record_failure(rec(6), KeyError()).failures == 1, "another offset on the partition replaces the slot"
    assert t.attempt("t", 0, 5) == 1
    assert t.record_failure(rec(6, partition=1), KeyError()).failures == 1, "partitions are independent"
    t.clear_partitions([("t", 0)])
    assert t.attempt("t", 0, 6) == 1 and t.attempt("t", 1, 6) == 2
    t.clear(rec(6, partition=1))
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


def test_backoff_accepts_tenacity_strategies_and_numbers() -> None:
    w = as_wait(tenacity.wait_exponential(multiplier=0.1, max=5))
    assert [delay_for(w, i) for i in (1, 2, 3)] == [0.1, 0.2, 0.4]
    assert delay_for(as_wait(2), 7) == 2.0
    assert delay_for(as_wait(None), 1) == 0.0 and as_wait(0) is None
    combo = as_wait(tenacity.wait_fixed(1) + tenacity.wait_random(0, 0.1))
    assert 1.0 <= delay_for(combo, 1) <= 1.1
    with pytest.raises(ValueError, match=">= 0"):
        as_wait(-1)
    with pytest.raises(TypeError, match="tenacity wait strategy"):
        as_wait("5s")
