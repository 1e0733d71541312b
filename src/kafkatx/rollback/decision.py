"""The first step of every failed record: count the failure, publish it, ask the policy, say what it decided.

Whatever runs the handler (the record runner, its concurrent dispatch, the
after-rollback processor) calls :func:`decide_failure` once per failed call,
so a record's count, its ``HandlerFailed`` and ``RecordRetryScheduled``
events and the log line about it are the same on every path. Carrying the
verdict out (call again, hold the partition, recover) is the caller's: it
is client I/O, which this package does not do.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from kafkatx.events import Event, HandlerFailed, RecordRetryScheduled
from kafkatx.record import Record
from kafkatx.rollback.classifier import exception_name
from kafkatx.rollback.log_budget import LogBudget
from kafkatx.rollback.policy import Action, FailurePolicy, Verdict
from kafkatx.rollback.tracker import FailureTracker

__all__ = ["FailureBooks", "decide_failure", "log_fields"]

log = logging.getLogger("kafkatx.rollback")

#: The INFO lines about failures to be retried: 10 per listener per 10 s, the rest at DEBUG and counted
#: (the events and metrics count every one). Warnings (a record recovered) are never held back.
RETRY_LINES = LogBudget(lines=10, window=10.0)


class FailureBooks(Protocol):
    """What deciding about a failed record needs: its listener's names, counts, policy and events."""

    listener: str
    worker: int
    tracker: FailureTracker
    policy: FailurePolicy

    @property
    def stop_event(self) -> threading.Event: ...

    def publish(self, event: Event) -> None: ...


def decide_failure(books: FailureBooks, record: Record, exc: BaseException, *, counted: bool = False) -> Verdict:
    """Count ``record``'s failed call (``exc``), publish it, and return the policy's verdict.

    ``verdict.attempt`` is the number of failures so far: the next call is attempt ``verdict.attempt + 1``.
    With ``counted``, the record carries its own count (``record.attempt``, a retry-topic hop's header: another
    member may have counted the earlier attempts), and the tracker is not asked.
    """
    failures = record.attempt if counted else books.tracker.record_failure(record, exc).failures
    books.publish(HandlerFailed(books.listener, books.worker, record, exc, failures))
    policy = books.policy
    verdict = policy.decide(failures, exc, books.stop_event)
    if verdict.action is Action.RETRY:
        books.publish(RecordRetryScheduled(books.listener, books.worker, record, failures + 1, verdict.delay))
    if verdict.action is Action.RECOVER or log.isEnabledFor(logging.INFO):  # (DEBUG is enabled only if INFO is)
        _log_verdict(books.listener, record, exc, verdict, policy)
    return verdict


def _log_verdict(listener: str, record: Record, exc: BaseException, verdict: Verdict, policy: FailurePolicy) -> None:
    """The log line about a failed call's verdict; a retry's at INFO within :data:`RETRY_LINES`, else at DEBUG."""
    failures = verdict.attempt
    fields = log_fields(record, failures)
    if verdict.action is Action.ABANDON:
        log.info(
            "%s failed on attempt %d; the container is stopping, so it is left for the next start",
            record.coordinates,
            failures,
            extra=fields,
        )
    elif verdict.action is Action.RETRY:
        level = logging.INFO
        if log.isEnabledFor(logging.INFO):
            # by the listener's policy too: one per listener declared, two Apps' "orders" are two
            allowed, held, span = RETRY_LINES.take((listener, id(policy)), time.monotonic())
            if held:
                log.info(
                    "listener %s: %d more failed call(s) to be retried in the last %.0fs were logged at DEBUG only "
                    "(the HandlerFailed and RecordRetryScheduled events count every one)",
                    listener,
                    held,
                    span,
                )
            level = logging.INFO if allowed else logging.DEBUG
        log.log(
            level,
            "%s failed on attempt %d/%d (%s: %s); retrying%s",
            record.coordinates,
            failures,
            policy.max_attempts,
            exception_name(exc),
            exc,
            f" in {verdict.delay:.3g}s" if verdict.delay else "",
            extra=fields,
        )
    else:
        log.warning(
            "%s failed (%s: %s), %s; recovering with %s",
            record.coordinates,
            exception_name(exc),
            exc,
            verdict.reason,
            policy.recoverer.name,
            extra=fields,
        )


def log_fields(record: Record, attempt: int) -> dict[str, object]:
    """The structured fields of a log line about ``record`` at ``attempt``."""
    return {"topic": record.topic, "partition": record.partition, "offset": record.offset, "attempt": attempt}
