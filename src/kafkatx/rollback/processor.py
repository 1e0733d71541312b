"""After-rollback processing: what happens once a handler's transaction is aborted.

The container aborts the failed transaction, then calls
:meth:`AfterRollbackProcessor.process` inside a NEW transaction, giving it a
:class:`RollbackContext`. The default processor follows Spring's
DefaultAfterRollbackProcessor (count, back off, seek, recover and commit the
offset in the same transaction), with three improvements:

- the batch-mates that were aborted with the failed record are re-run and
  committed in that same new transaction, so a poison record costs one abort
  and one extra transaction per attempt, not one transaction per record;
- back-off does not hold a transaction open or sleep through the poll
  interval: the failed record's partition is paused and the consumer keeps
  polling (and serving other partitions);
- a failing recoverer keeps the record, backs off, and retries recovery
  without calling the handler again, up to ``max_recovery_failures``, after
  which the container stops with a clear error. Nothing is ever skipped
  silently.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol, runtime_checkable

from tenacity.wait import wait_base

from kafkatx.events import Event, HandlerFailed, RecordRecovered, RecordRetryScheduled
from kafkatx.record import Record
from kafkatx.recoverers import LoggingRecoverer, Recoverer, as_recoverer
from kafkatx.rollback.backoff import as_wait, delay_for
from kafkatx.rollback.classifier import ExceptionClassifier
from kafkatx.rollback.tracker import FailureTracker

__all__ = ["AfterRollbackProcessor", "DefaultAfterRollbackProcessor", "RollbackContext", "RecoveryError"]

log = logging.getLogger("kafkatx.rollback")


class RecoveryError(Exception):
    """A recoverer failed; the record is kept (not committed) and recovery is retried."""

    def __init__(self, record: Record, exception: BaseException, recoverer: str) -> None:
        super().__init__(f"recoverer {recoverer} failed for {record.coordinates}: {type(exception).__name__}: {exception}")
        self.record = record
        self.exception = exception
        self.recoverer = recoverer


class RollbackContext(Protocol):
    """What an after-rollback processor can see and do. Provided by the container."""

    listener: str
    group_id: str
    failed: Record
    exception: BaseException
    records: Sequence[Record]  # the unprocessed records, failed one first
    processed: Sequence[Record]  # batch-mates before the failed one, aborted with it
    tracker: FailureTracker

    @property
    def stopping(self) -> bool: ...

    def replay_processed(self) -> None:
        """Re-run the handler for ``processed`` in this transaction (attempts not counted)."""

    def recover(self, recoverer: Recoverer, record: Record, exception: BaseException) -> None:
        """Call ``recoverer`` in this transaction; raises :class:`RecoveryError` if it fails."""

    def commit_offset(self, record: Record) -> None:
        """Commit ``record.offset + 1`` in this transaction: the record is done
        (its failure count is cleared when the transaction commits)."""

    def seek_unprocessed(self, *, include_failed: bool = True) -> None:
        """Rewind each partition to its first record still to process.

        The container does this anyway for every record this transaction does
        not commit, so a custom processor cannot lose records by forgetting."""

    def backoff(self, record: Record, seconds: float) -> None:
        """Hold ``record``'s partition for ``seconds`` while the consumer keeps polling."""

    def publish(self, event: Event) -> None: ...


@runtime_checkable
class AfterRollbackProcessor(Protocol):
    def process(self, context: RollbackContext) -> None: ...


class DefaultAfterRollbackProcessor:
    """Counts attempts per record, backs off, seeks back, and recovers when attempts run out.

    ``max_attempts`` counts every delivery, the first included (1 = no retry).
    A record whose exception the classifier marks not retryable is recovered
    at its first failure.
    """

    def __init__(
        self,
        recoverer: Recoverer | None = None,
        *,
        max_attempts: int = 3,
        backoff: wait_base | float | None = None,
        classifier: ExceptionClassifier | None = None,
    ) -> None:
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        self.recoverer = as_recoverer(recoverer) if recoverer is not None else LoggingRecoverer()
        self.max_attempts = max_attempts
        self.wait = as_wait(backoff)
        self.classifier = classifier or ExceptionClassifier()

    def process(self, context: RollbackContext) -> None:
        context.replay_processed()
        failed, exc, tracker = context.failed, context.exception, context.tracker
        state = tracker.state(failed)
        if state is not None and state.pending_recovery:
            # An earlier recovery of this record failed: retry the recovery, not the handler.
            exc = state.last_exception or exc
        else:
            state = tracker.record_failure(failed, exc)
            retryable = self.classifier.is_retryable(exc)
            context.publish(HandlerFailed(context.listener, 0, failed, exc, state.failures))
            if retryable and state.failures < self.max_attempts:
                delay = delay_for(self.wait, state.failures)
                log.info(
                    "%s failed on attempt %d/%d (%s: %s); retrying%s",
                    failed.coordinates, state.failures, self.max_attempts, type(exc).__name__, exc,
                    f" in {delay:.3g}s" if delay else "",
                    extra=_coords(failed, state.failures),
                )  # fmt: skip
                context.seek_unprocessed(include_failed=True)
                context.backoff(failed, delay)
                context.publish(RecordRetryScheduled(context.listener, 0, failed, state.failures + 1, delay))
                return
            why = "not retryable" if not retryable else f"attempts exhausted ({state.failures}/{self.max_attempts})"
            log.warning(
                "%s failed (%s: %s), %s; recovering with %s",
                failed.coordinates, type(exc).__name__, exc, why, self.recoverer.name,
                extra=_coords(failed, state.failures),
            )  # fmt: skip
        context.recover(self.recoverer, replace(failed, attempt=state.failures), exc)
        context.commit_offset(failed)  # the tracker slot is cleared once this transaction commits
        context.seek_unprocessed(include_failed=False)
        context.publish(RecordRecovered(context.listener, 0, failed, exc, self.recoverer.name))


def _coords(record: Record, attempt: int) -> dict[str, object]:
    return {"topic": record.topic, "partition": record.partition, "offset": record.offset, "attempt": attempt}
