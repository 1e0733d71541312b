"""The failure policy: the one place that decides what happens when a record fails.

Every path that handles a failed record asks it: the after-rollback
processor, in-place retries and the Spark runner. It is built from
tenacity's own parts, the way a ``tenacity.Retrying`` is:

- ``retry``: :class:`~kafkatx.rollback.classifier.retry_if_retryable`, which
  asks the exception classifier (a not-retryable failure is recovered at once);
- ``stop``: ``stop_after_attempt(max_attempts)``, then ``stop_when_event_set(stopping)``;
- ``wait``: the listener's back-off (any tenacity wait strategy).

A stop because the container is stopping is not a decision about the
record: it is *abandoned* (its transaction aborted and its partition
rewound), never recovered, so a rolling restart cannot dead-letter records
that failed once.
"""

from __future__ import annotations

import enum
import threading
from typing import Any, NamedTuple, TypedDict

import tenacity
from tenacity import RetryCallState, Retrying, stop_after_attempt, stop_when_event_set
from tenacity.wait import wait_base

from kafkatx.recoverers import LoggingRecoverer, Recoverer, as_recoverer
from kafkatx.rollback.backoff import as_wait
from kafkatx.rollback.classifier import ExceptionClassifier, retry_if_retryable

__all__ = ["Action", "FailurePolicy", "PolicyOptions", "Verdict"]

_DEFAULT_RECOVERY_WAIT = tenacity.wait_exponential(multiplier=0.5, max=30)


class Action(enum.Enum):
    RETRY = "retry"  # deliver the record again after ``delay``
    RECOVER = "recover"  # hand it to the recoverer and commit its offset
    ABANDON = "abandon"  # the container is stopping: abort, rewind, decide nothing


class Verdict(NamedTuple):
    """What to do with a record that failed its ``attempt``-th delivery (a named tuple: one is made per failure, and
    a frozen dataclass took several times as long to make)."""

    action: Action
    attempt: int
    delay: float = 0.0
    reason: str = ""


class PolicyOptions(TypedDict, total=False):
    """The keyword options of :class:`FailurePolicy` (for the classes that forward them to it)."""

    max_attempts: int
    backoff: wait_base | float | None
    classifier: ExceptionClassifier | None
    max_recovery_failures: int | None
    recovery_backoff: wait_base | float | None


class FailurePolicy:
    """Classifier, attempts, back-off and recoverer of one listener.

    ``max_attempts`` counts every delivery, the first included (1 = no retry).
    ``max_recovery_failures`` bounds how often a failing recoverer is retried
    (None: forever, backing off with ``recovery_backoff``) before the
    container stops.
    """

    def __init__(
        self,
        recoverer: Any = None,
        *,
        max_attempts: int = 3,
        backoff: wait_base | float | None = None,
        classifier: ExceptionClassifier | None = None,
        max_recovery_failures: int | None = None,
        recovery_backoff: wait_base | float | None = None,
    ) -> None:
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        if max_recovery_failures is not None and (
            isinstance(max_recovery_failures, bool)
            or not isinstance(max_recovery_failures, int)
            or max_recovery_failures < 1
        ):
            raise ValueError(f"max_recovery_failures must be an integer >= 1, got {max_recovery_failures!r}")
        self.recoverer: Recoverer = as_recoverer(recoverer) if recoverer is not None else LoggingRecoverer()
        self.max_attempts = max_attempts
        self.classifier = classifier or ExceptionClassifier()
        self.wait = as_wait(backoff)
        self.max_recovery_failures = max_recovery_failures
        self.recovery_wait = as_wait(recovery_backoff) if recovery_backoff is not None else _DEFAULT_RECOVERY_WAIT
        self.retry = retry_if_retryable(self.classifier)
        self.stop_after = stop_after_attempt(max_attempts)
        self._retrying = Retrying(retry=self.retry, stop=self.stop_after, wait=self.wait or tenacity.wait_none())

    def is_retryable(self, exc: BaseException) -> bool:
        """The classifier's answer for ``exc``."""
        return self.classifier.is_retryable(exc)

    def decide(self, failures: int, exc: BaseException, stopping: threading.Event | None = None) -> Verdict:
        """The verdict for a record that has now failed ``failures`` times, the last with ``exc``."""
        if type(self.retry) is retry_if_retryable and type(self.stop_after) is stop_after_attempt:
            return self._decide_plain(failures, exc, stopping)
        state = self._state(failures, exc)
        if not self.retry(state):
            return Verdict(Action.RECOVER, failures, reason="not retryable")
        if self.stop_after(state):
            return Verdict(Action.RECOVER, failures, reason=f"attempts exhausted ({failures}/{self.max_attempts})")
        if stopping is not None and stop_when_event_set(stopping)(state):
            return Verdict(Action.ABANDON, failures, reason="the container is stopping")
        return Verdict(Action.RETRY, failures, delay=_seconds(self.wait, state))

    def _decide_plain(self, failures: int, exc: BaseException, stopping: threading.Event | None) -> Verdict:
        """:meth:`decide` with the policy's own retry and stop parts, asked without building tenacity's call state
        (and its Future) for them: the same answers, in the same order, at a fraction of the cost per failure. The
        wait is asked with a state unless it is a fixed one, or none."""
        if not self.classifier.is_retryable(exc):  # retry_if_retryable
            return Verdict(Action.RECOVER, failures, reason="not retryable")
        if failures >= self.stop_after.max_attempt_number:  # stop_after_attempt
            return Verdict(Action.RECOVER, failures, reason=f"attempts exhausted ({failures}/{self.max_attempts})")
        if stopping is not None and stopping.is_set():  # stop_when_event_set
            return Verdict(Action.ABANDON, failures, reason="the container is stopping")
        wait = self.wait
        if wait is None:
            return Verdict(Action.RETRY, failures)
        if type(wait) is tenacity.wait_fixed:
            return Verdict(Action.RETRY, failures, delay=max(0.0, float(wait.wait_fixed)))
        return Verdict(Action.RETRY, failures, delay=_seconds(wait, self._state(failures, exc)))

    def nominal_delay(self, attempt: int) -> float:
        """The back-off after the ``attempt``-th failure as the wait gives it for no particular exception.

        What retry topics are laid out by (one topic per delay, :mod:`kafkatx.retry_topics.plan`).
        """
        return _seconds(self.wait, self._state(attempt, None))

    def recovery_delay(self, recovery_failures: int) -> float | None:
        """Seconds before retrying a failed recovery, or None once ``max_recovery_failures`` is reached."""
        limit = self.max_recovery_failures
        if limit is not None and recovery_failures >= limit:
            return None
        return _seconds(self.recovery_wait, self._state(recovery_failures, None))

    def _state(self, attempt: int, exc: BaseException | None) -> RetryCallState:
        state = RetryCallState(retry_object=self._retrying, fn=None, args=(), kwargs={})
        state.attempt_number = attempt
        if exc is not None:
            state.set_exception((type(exc), exc, exc.__traceback__))
        return state

    def __repr__(self) -> str:
        return (
            f"FailurePolicy(max_attempts={self.max_attempts}, backoff={self.wait!r}, "
            f"recoverer={self.recoverer.name}, max_recovery_failures={self.max_recovery_failures})"
        )


def _seconds(wait: Any, state: RetryCallState) -> float:
    return 0.0 if wait is None else max(0.0, float(wait(state)))
