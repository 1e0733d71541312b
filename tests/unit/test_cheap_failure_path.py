"""The failed-record procedure made cheaper per failure gives the same answers (no broker): the policy's verdict
without tenacity's call state, the classifier's answers kept per class, a traceback's frames formatted once per path,
and the INFO lines about retries held to a budget."""

from __future__ import annotations

import logging
import threading
import traceback
from typing import Any

import pytest
import tenacity

from kafkatx.dlq.headers import format_stacktrace
from kafkatx.errors import DeserializationError
from kafkatx.events import Event
from kafkatx.record import Record
from kafkatx.rollback import decision
from kafkatx.rollback.classifier import ExceptionClassifier
from kafkatx.rollback.decision import decide_failure
from kafkatx.rollback.log_budget import LogBudget
from kafkatx.rollback.policy import Action, FailurePolicy, Verdict
from kafkatx.rollback.tracker import FailureTracker


class Transient(Exception):
    pass


def _slow_verdict(policy: FailurePolicy, failures: int, exc: BaseException, stopping: threading.Event) -> Verdict:
    """The verdict through tenacity's call state (the path taken for strategies kafkatx does not know)."""
    retry, policy.retry = policy.retry, policy.retry | tenacity.retry_never  # another type: the general path
    try:
        return policy.decide(failures, exc, stopping)
    finally:
        policy.retry = retry


@pytest.mark.parametrize(
    "backoff", [None, 0, 1.5, tenacity.wait_exponential(multiplier=1, max=8), tenacity.wait_random(0, 0)]
)
@pytest.mark.parametrize("exc", [Transient("t"), TypeError("bad"), DeserializationError("x")])
def test_the_policy_answers_as_tenacitys_parts_do(backoff: Any, exc: BaseException) -> None:
    policy = FailurePolicy(max_attempts=3, backoff=backoff)
    for stopping in (threading.Event(), threading.Event()):
        for failures in (1, 2, 3, 4):
            assert policy.decide(failures, exc, stopping) == _slow_verdict(policy, failures, exc, stopping)
        stopping.set()


def test_the_classifier_keeps_its_answer_per_class_until_its_lists_change() -> None:
    classifier = ExceptionClassifier()
    assert classifier.is_retryable(Transient("a")) and not classifier.is_retryable(TypeError("b"))
    wrapped = Transient("outer")
    wrapped.__cause__ = TypeError("inner")
    assert not classifier.is_retryable(wrapped), "a cause classified not retryable decides"
    classifier.not_retryable += (Transient,)
    assert not classifier.is_retryable(Transient("a")), "a list changed: the kept answers go"


def _fail(message: str) -> BaseException:
    try:
        raise Transient(message)
    except Transient as exc:
        return exc


def test_a_traceback_is_formatted_as_the_standard_formatter_does_once_per_path() -> None:
    first, second = _fail("the first failure"), _fail("the second failure")  # words no file path holds
    for exc in (first, second):
        expected = "".join(traceback.format_exception(exc)).replace("    ^^^^^^^^^^^^^^^^^^^^^^^\n", "")
        assert format_stacktrace(exc) == expected
    assert format_stacktrace(first).replace("first", "second") == format_stacktrace(second)
    chained = Transient("outer")
    chained.__cause__ = first
    text = format_stacktrace(chained)
    assert text.startswith(format_stacktrace(first)) and "direct cause" in text


def test_a_log_budget_writes_a_few_lines_per_window_and_counts_the_rest() -> None:
    budget = LogBudget(lines=2, window=10.0)
    assert [budget.take("a", t)[0] for t in (0.0, 1.0, 2.0, 3.0)] == [True, True, False, False]
    assert budget.take("b", 3.0) == (True, 0, 0.0), "per listener"
    assert budget.take("a", 12.5) == (True, 2, 12.5), "the next window says how many the last one held back"
    assert budget.take("a", 13.0) == (True, 0, 0.0)


class _Books:
    listener, worker = "orders", 0

    def __init__(self) -> None:
        self.tracker = FailureTracker()
        self.policy = FailurePolicy(max_attempts=3, backoff=1.0)
        self.stop_event = threading.Event()
        self.events: list[Event] = []

    def publish(self, event: Event) -> None:
        self.events.append(event)


def test_retries_are_logged_at_info_within_the_budget_then_at_debug_with_a_summary(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [0.0]
    monkeypatch.setattr(decision, "RETRY_LINES", LogBudget(lines=3, window=10.0))
    monkeypatch.setattr(decision.time, "monotonic", lambda: clock[0])
    books = _Books()
    with caplog.at_level(logging.DEBUG, logger="kafkatx.rollback"):
        for offset in range(5):
            verdict = decide_failure(books, Record("in", 0, offset, None, b"v"), Transient("t"))
            assert verdict.action is Action.RETRY
        clock[0] = 11.0
        decide_failure(books, Record("in", 0, 9, None, b"v"), Transient("t"))
    levels = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in levels] == [logging.INFO] * 3 + [logging.DEBUG] * 2 + [logging.INFO] * 2
    assert "2 more failed call(s) to be retried in the last 11s were logged at DEBUG only" in levels[5][1]
    assert len(books.events) == 12, "every failure's events all the same"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kafkatx.rollback"):
        decide_failure(books, Record("in", 0, 20, None, b"v"), TypeError("bad"))
    assert [r.levelno for r in caplog.records] == [logging.WARNING], "a recovery is always said"
