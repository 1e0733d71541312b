"""The failed-record procedure: a record's handler failed inside an open transaction, and nothing is aborted.

The record's own work was held until its handler returned (its ``send()``
calls and returned outputs in a per-record buffer, its database statements
in a savepoint), so dropping that work undoes the failed call alone; the
records before it stay in the transaction and commit, never run again.
:func:`settle_failure` then carries out the policy's verdict
(:func:`~kafkatx.rollback.decision.decide_failure`):

- **retry now** (no back-off, or ``retry="in_place"`` after waiting it):
  :class:`CallAgain`, the caller calls the handler again in the same
  transaction with ``attempt`` one higher;
- **retry later**: :class:`Hold`, the caller ends the transaction before the
  record, commits the record's own offset (its count travels in the offset
  metadata, see :mod:`kafkatx.rollback.durable`), and holds its partition for
  the back-off while the other partitions flow;
- **recover**: the recoverer runs in the open transaction, so the dead letter
  and the record's offset commit together; None is returned and the caller
  goes on with the next record;
- **retry through a topic** (``retry="topics"``, a :class:`~kafkatx.retry_topics.hops.RetryHops` passed
  by the runner): the record's input view goes to the retry topic of its next attempt in the open
  transaction, so the hop and the record's offset commit together; None is returned and the partition goes
  on (no hold, whatever the back-off). Its count is the record's own (``attempt``, from the hop's header),
  and the recoverer gets its input view, so a dead letter names the original topic, partition and offset;
- **the recoverer fails**: :class:`Hold` for ``recovery_backoff``; the record's
  next delivery retries the recovery without calling the handler
  (:func:`retry_recovery`), and after ``max_recovery_failures`` the container
  stops with :class:`~kafkatx.RecoveryExhaustedError`.

Every runner uses this module: the record runner one record at a time and
concurrently, and the Spark runner (a job's failure counted on its first
record, a failed recovery held here); aborts are left to what really must be undone (KIP-1050
abortable errors, a fenced producer, a dependency outage, a stop).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Protocol

from kafkatx.errors import RecoveryError, RecoveryExhaustedError
from kafkatx.events import RecordRecovered, RecoveryFailed
from kafkatx.outputs import PendingOutput, unproducible_stop
from kafkatx.record import Record
from kafkatx.recoverers import Recoverer
from kafkatx.retry_topics.hops import RetryHops
from kafkatx.rollback.decision import FailureBooks, decide_failure, log_fields
from kafkatx.rollback.policy import Action

__all__ = [
    "Abandoned",
    "CallAgain",
    "FailureScope",
    "Hold",
    "recover_record",
    "recovery_failed",
    "retry_recovery",
    "settle_failure",
]

log = logging.getLogger("kafkatx.rollback")


class FailureScope(FailureBooks, Protocol):
    """What the procedure needs of a transaction unit (:class:`~kafkatx.listener.transaction.unit.TransactionUnit`
    is one): the books a decision keeps, a wait that a stop cuts short, and recovery in the open transaction."""

    def wait(self, seconds: float) -> bool: ...

    def recover(
        self, recoverer: Recoverer, record: Record, exception: BaseException, *, confirm: bool = True
    ) -> None: ...

    def produce(self, output: PendingOutput) -> None: ...


@dataclass(frozen=True, slots=True)
class CallAgain:
    """Call the handler again for ``record`` (its ``attempt`` is the next one), in the same transaction."""

    record: Record


@dataclass(frozen=True, slots=True)
class Hold:
    """End the transaction before ``record``, commit up to its offset, hold its partition ``delay`` seconds."""

    record: Record
    exc: BaseException
    delay: float


class Abandoned(Exception):
    """Internal: the container stopped while a record waited for a retry: the unit is given up, nothing decided."""


def settle_failure(
    scope: FailureScope,
    record: Record,
    exc: BaseException,
    *,
    wait_in_transaction: bool = False,
    hops: RetryHops | None = None,
) -> CallAgain | Hold | None:
    """``record``'s call failed with ``exc`` in ``scope``'s open transaction: count, decide and carry it out.

    With ``wait_in_transaction`` (``retry="in_place"``) a back-off is waited
    here, with the transaction open, and :class:`CallAgain` follows it;
    otherwise a back-off is a :class:`Hold`. When the container stops, the
    record is held too (the records before it commit; it is fetched again by
    the next owner, nothing decided), or, waiting in the transaction,
    :class:`Abandoned` is raised. A programming error (an unproducible type)
    raises the container's own stop: it is no record's failure. With ``hops`` (``retry="topics"``), a retry
    is a hop through a retry topic (:func:`_hop`).
    """
    stop = unproducible_stop(scope.listener, exc)
    if stop is not None:
        raise stop
    if hops is not None:
        return _hop(scope, record, exc, hops)
    verdict = decide_failure(scope, record, exc)
    if verdict.action is Action.ABANDON:  # stopping: decide nothing about it, but keep what came before it
        if wait_in_transaction:
            raise Abandoned
        return Hold(record, exc, 0.0)
    if verdict.action is Action.RETRY:
        if verdict.delay > 0 and not wait_in_transaction:
            return Hold(record, exc, verdict.delay)
        if scope.wait(verdict.delay):
            raise Abandoned
        return CallAgain(replace(record, attempt=verdict.attempt + 1))
    return recover_record(scope, replace(record, attempt=verdict.attempt), exc)


def _hop(scope: FailureScope, record: Record, exc: BaseException, hops: RetryHops) -> Hold | None:
    """``retry="topics"``: ``record`` (as consumed: from an input or a retry topic) failed. Decided on its input
    view and its own count; a retry is a hop to the next retry topic in the open transaction, whatever the
    back-off (0 too: the partition keeps flowing); the recoverer gets the input view."""
    view = hops.view(record)
    verdict = decide_failure(scope, view, exc, counted=True)
    if verdict.action is Action.ABANDON:  # stopping: the records before it commit; it comes again next start
        return Hold(record, exc, 0.0)
    if verdict.action is Action.RETRY:
        output = hops.hop(view, exc, verdict.attempt, verdict.delay, record)
        if output is not None:
            scope.produce(output)  # confirmed by the commit, as a dead letter sent in the batch's transaction
            return None
    return recover_record(scope, replace(view, attempt=verdict.attempt), exc, books=record)


def retry_recovery(scope: FailureScope, record: Record, hops: RetryHops | None = None) -> Hold | None:
    """``record``'s recoverer failed before: run it again (not the handler), in the open transaction. With
    ``hops``, the recoverer gets its input view (``record`` is as consumed, maybe from a retry topic)."""
    state = scope.tracker.state(record)
    failures = state.failures if state is not None else max(record.attempt, 1)
    exc = (state.last_exception if state is not None else None) or RuntimeError("recovery pending")
    view = record if hops is None else hops.view(record)
    return recover_record(scope, replace(view, attempt=failures), exc, books=record)


def recover_record(
    scope: FailureScope, record: Record, exc: BaseException, *, books: Record | None = None
) -> Hold | None:
    """Run the recoverer in the open transaction; a :class:`Hold` if it failed (what it sent is not produced).

    The last step of :func:`settle_failure`; a batch runner calls it directly for a record its poison isolation
    found (its failure was counted and decided on the batch). ``books``: the record as consumed, when the
    recoverer gets another view of it (a retry topic's input record): its count and a failed recovery's hold
    are the consumed record's."""
    recoverer = scope.policy.recoverer
    error: RecoveryError | None = None
    try:
        scope.recover(recoverer, record, exc, confirm=False)
    except RecoveryError as failed:
        error = failed
    consumed = record if books is None else replace(books, attempt=record.attempt)
    if error is None:
        scope.tracker.record_recovered(consumed)  # its count ends when the offset commits
        scope.publish(RecordRecovered(scope.listener, scope.worker, record, exc, recoverer.name))
        return None
    return recovery_failed(scope, consumed, exc, error)


def recovery_failed(scope: FailureBooks, record: Record, exc: BaseException, error: RecoveryError) -> Hold:
    """``record``'s recoverer failed: counted and published; a :class:`Hold` for ``recovery_backoff``, or
    :class:`~kafkatx.RecoveryExhaustedError` after ``max_recovery_failures``."""
    state = scope.tracker.record_recovery_failure(record, exc)
    scope.publish(RecoveryFailed(scope.listener, scope.worker, record, exc, error.exception, state.recovery_failures))
    policy = scope.policy
    delay = policy.recovery_delay(state.recovery_failures)
    if delay is None:
        raise RecoveryExhaustedError(
            f"listener {scope.listener!r}: recovery of {record.coordinates} failed {state.recovery_failures} "
            f"time(s) (max_recovery_failures={policy.max_recovery_failures}); last error: "
            f"{type(error.exception).__name__}: {error.exception}. The container stopped; the record was not "
            "committed and will be delivered again on restart."
        ) from error.exception
    log.error(
        "recovery of %s failed (%d time(s)): %s: %s; keeping the record, retrying recovery in %.3gs",
        record.coordinates,
        state.recovery_failures,
        type(error.exception).__name__,
        error.exception,
        delay,
        extra=log_fields(record, state.failures),
    )
    return Hold(record, exc, delay)
