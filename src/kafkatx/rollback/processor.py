"""After-rollback processors: what decides about a failed record in a transaction of its own.

The record runner settles a failure in the open transaction itself
(:mod:`kafkatx.listener.failure.failed_record`, the same steps as
:class:`DefaultAfterRollbackProcessor`). A processor is called, with a
:class:`RollbackContext` in a NEW transaction, when the listener has a
custom one (once the records before the failed one committed), and after an
abort that had to undo a whole transaction (a dependency outage, a client
error), where the records before the failed one are re-run first. The
default processor asks the listener's
:class:`~kafkatx.rollback.policy.FailurePolicy` and does what Spring's
DefaultAfterRollbackProcessor does (count, back off, seek, recover and
commit the offset in the same transaction), with two improvements:

- back-off does not hold a transaction open or sleep through the poll
  interval: the failed record's partition is paused and the consumer keeps
  polling (and serving other partitions);
- a failing recoverer keeps the record, backs off, and retries recovery
  without calling the handler again, up to ``max_recovery_failures``, after
  which the container stops with a clear error. Nothing is ever skipped
  silently.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol, Unpack, runtime_checkable

from kafkatx.events import Event, RecordRecovered
from kafkatx.record import Record
from kafkatx.recoverers import Recoverer
from kafkatx.rollback.decision import decide_failure
from kafkatx.rollback.policy import Action, FailurePolicy, PolicyOptions
from kafkatx.rollback.tracker import FailureTracker

__all__ = ["AfterRollbackProcessor", "DefaultAfterRollbackProcessor", "RollbackContext"]


class FailureView(Protocol):
    """What an after-rollback processor can see: the failed record, its error, the records around it."""

    listener: str
    group_id: str
    failed: Record
    exception: BaseException
    tracker: FailureTracker
    stop_event: threading.Event

    @property
    def records(self) -> Sequence[Record]:
        """The unprocessed records, failed one first."""

    @property
    def processed(self) -> Sequence[Record]:
        """The batch-mates before the failed record, aborted with it."""

    @property
    def stopping(self) -> bool:
        """True once the container is stopping: decide nothing you cannot finish."""


class RollbackActions(Protocol):
    """What an after-rollback processor can do inside its new transaction."""

    def replay_processed(self) -> None:
        """Re-run the handler for ``processed`` in this transaction (their attempts are not counted)."""

    def recover(self, recoverer: Recoverer, record: Record, exception: BaseException) -> None:
        """Call ``recoverer`` in this transaction; raises :class:`~kafkatx.RecoveryError` if it fails."""

    def commit_offset(self, record: Record) -> None:
        """Commit ``record.offset + 1`` in this transaction: the record is done
        (its failure count is cleared when the transaction commits)."""

    def seek_unprocessed(self, *, include_failed: bool = True) -> None:
        """Rewind each partition to its first record still to process.

        The container does this anyway for every record this transaction does
        not commit, so a custom processor cannot lose records by forgetting."""

    def backoff(self, record: Record, seconds: float) -> None:
        """Hold ``record``'s partition for ``seconds`` while the consumer keeps polling."""

    def publish(self, event: Event) -> None:
        """Publish an event to the App's subscribers."""


class RollbackContext(FailureView, RollbackActions, Protocol):
    """What an after-rollback processor can see and do. Provided by the container.

    ``failed.attempt`` is the delivery attempt that failed; ``records`` are
    the unprocessed records, failed one first; ``processed`` the batch-mates
    before it, aborted with it (each with its true next ``attempt``).
    """


@runtime_checkable
class AfterRollbackProcessor(Protocol):
    """Anything with ``process(context)``; see :class:`RollbackContext`."""

    def process(self, context: RollbackContext) -> None:
        """Decide about ``context.failed`` inside the new transaction: re-run, back off, recover or keep it.

        Whatever it leaves uncommitted is delivered again (the container rewinds it), so a processor
        that decides nothing loses nothing.
        """
        ...


class DefaultAfterRollbackProcessor:
    """Counts attempts per record, backs off, seeks back, and recovers when attempts run out.

    ``max_attempts`` counts every delivery, the first included (1 = no retry).
    A record whose exception the classifier marks not retryable is recovered
    at its first failure. The settings (``recoverer`` and the keyword options
    of :class:`~kafkatx.rollback.policy.FailurePolicy`: ``max_attempts``,
    ``backoff``, ``classifier``, ``max_recovery_failures``,
    ``recovery_backoff``) form its ``.policy``, which a listener's in-place
    retries follow too; or pass a ready ``policy=``.
    """

    def __init__(
        self, recoverer: Any = None, *, policy: FailurePolicy | None = None, **options: Unpack[PolicyOptions]
    ) -> None:
        if policy is not None and (recoverer is not None or options):
            raise TypeError("DefaultAfterRollbackProcessor takes either policy= or the policy's settings, not both")
        self.policy = policy or FailurePolicy(recoverer, **options)

    @property
    def recoverer(self) -> Recoverer:
        """The policy's recoverer."""
        return self.policy.recoverer

    @property
    def max_attempts(self) -> int:
        """The policy's max_attempts."""
        return self.policy.max_attempts

    def process(self, context: RollbackContext) -> None:
        """Count the failure, then retry the record after the back-off or recover it (Spring's sequence).

        The batch-mates before it are re-run and committed in this transaction either way.
        """
        failed, exc, tracker, policy = context.failed, context.exception, context.tracker, self.policy
        state = tracker.state(failed)
        if state is not None and state.pending_recovery:
            # An earlier recovery of this record failed: retry the recovery, not the handler.
            exc = state.last_exception or exc
            failures = state.failures
            context.replay_processed()
        else:
            # Counted before the batch-mates are re-run: if one of them fails now, this failure still counts.
            verdict = decide_failure(_ContextBooks(context, policy), failed, exc)
            failures = verdict.attempt
            context.replay_processed()
            if verdict.action is Action.ABANDON:
                return
            if verdict.action is Action.RETRY:
                context.seek_unprocessed(include_failed=True)
                context.backoff(failed, verdict.delay)
                return
        context.recover(policy.recoverer, replace(failed, attempt=failures), exc)
        context.commit_offset(failed)
        context.seek_unprocessed(include_failed=False)
        context.publish(RecordRecovered(context.listener, 0, failed, exc, policy.recoverer.name))

    def __repr__(self) -> str:
        return f"DefaultAfterRollbackProcessor({self.policy!r})"


class _ContextBooks:
    """A :class:`RollbackContext` seen as the books :func:`~kafkatx.rollback.decision.decide_failure` keeps."""

    worker = 0

    def __init__(self, context: RollbackContext, policy: FailurePolicy) -> None:
        self.listener, self.tracker, self.policy = context.listener, context.tracker, policy
        self._context = context

    @property
    def stop_event(self) -> threading.Event:
        return self._context.stop_event

    def publish(self, event: Event) -> None:
        self._context.publish(event)
