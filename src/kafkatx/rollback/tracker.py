"""Counts failed deliveries per record, per container thread.

Unlike Spring's FailedRecordTracker (one slot per partition, replaced when
another offset of the partition fails), kafkatx keeps a slot per record:
a batch transaction can fail on one record, then on an earlier batch-mate
while it is re-run, and neither count may be lost. A slot ends when its
record's offset is committed (success or recovery), when its partition is revoked, or when the exception
type changes the way Spring resets: the count goes on only if the previous
failure is an instance of the new one's class
(``SubError`` then ``BaseError`` keeps counting; ``BaseError`` then
``SubError``, or an unrelated class, starts again at 1).

What is compared is the exception the handler raised, not the causes it was
raised from. Spring compares what the listener threw: its ``findRootCause``
unwraps only the container's own wrappers (``ListenerExecutionFailedException``,
``TimestampedException``), and kafkatx wraps nothing. Comparing the last link
of the cause chain instead restarted the count whenever a ``ServiceError`` came
from a different low-level error (a reset, then a timeout...), so such a record
was retried for as long as its causes kept changing, never reaching
``max_attempts``.

Counts restored from committed offset metadata (see
:mod:`kafkatx.rollback.durable`) seed a slot with :meth:`FailureTracker.seed`.

A record's count ends when its offset commits, and only then: a record's
failure undoes its own work alone (the records before it in the transaction
commit), so a success is never rolled back by a batch-mate's failure, and a
record's attempt numbers only go up, within a process and across restarts.
A replay after an abort that must undo a whole transaction (a Kafka
abortable error, a fenced producer, a stop) keeps the counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kafkatx.client.offsets import TP
from kafkatx.record import Record
from kafkatx.rollback.classifier import exception_fqcn

__all__ = ["FailureTracker", "FailureState"]


@dataclass(slots=True)
class FailureState:
    """What kafkatx remembers of one failing record."""

    offset: int
    failures: int = 0
    recovery_failures: int = 0
    last_exception: BaseException | None = None
    # Set after a recoverer failed: the next delivery goes straight to recovery
    # instead of calling the handler again.
    pending_recovery: bool = False
    # Set once it was recovered inside a transaction that has not committed yet.
    recovered: bool = False


class FailureTracker:
    """Per-record failure state of one container (one consumer thread)."""

    def __init__(self, *, reset_on_exception_change: bool = True) -> None:
        self.reset_on_exception_change = reset_on_exception_change
        self._slots: dict[TP, dict[int, FailureState]] = {}
        #: The failing partitions' slots; empty in normal operation, so the hot path checks it once per record.
        self.failing = self._slots

    def __bool__(self) -> bool:
        return bool(self._slots)

    def attempt(self, topic: str, partition: int, offset: int) -> int:
        """The delivery attempt (1-based) that the next handler call of this record is."""
        state = self.state_at(topic, partition, offset)
        return 1 if state is None else state.failures + 1

    def record_failure(self, record: Record, exc: BaseException) -> FailureState:
        """Count one failed delivery of ``record`` and return its state."""
        slots = self._slots.setdefault((record.topic, record.partition), {})
        state = slots.get(record.offset)
        if state is None:
            state = slots[record.offset] = FailureState(record.offset)
        elif self.reset_on_exception_change and state.failures and not _same_kind(state.last_exception, exc):
            state.failures = 0
        state.failures += 1
        state.last_exception = exc
        state.pending_recovery = False
        state.recovered = False
        return state

    def record_recovered(self, record: Record) -> None:
        """``record`` was recovered in a transaction not committed yet (its count ends when that commits)."""
        state = self.state(record)
        if state is not None:
            state.recovered = True

    def record_recovery_failure(self, record: Record, exc: BaseException | None = None) -> FailureState:
        """Count a failed recovery; the record's next delivery retries the recovery, not the handler."""
        slots = self._slots.setdefault((record.topic, record.partition), {})
        state = slots.get(record.offset)
        if state is None:
            state = slots[record.offset] = FailureState(record.offset, failures=max(record.attempt, 1))
        if state.last_exception is None:
            state.last_exception = exc
        state.recovery_failures += 1
        state.pending_recovery = True
        return state

    def seed(self, topic: str, partition: int, offset: int, failures: int) -> None:
        """Restore a count found in committed offset metadata (a previous owner's)."""
        if failures > 0:
            slots = self._slots.setdefault((topic, partition), {})
            state = slots.get(offset)
            if state is None or state.failures < failures:
                slots[offset] = FailureState(offset, failures=failures)

    def state(self, record: Record) -> FailureState | None:
        return self.state_at(record.topic, record.partition, record.offset)

    def state_at(self, topic: str, partition: int, offset: int) -> FailureState | None:
        slots = self._slots.get((topic, partition))
        return slots.get(offset) if slots is not None else None

    def committed(self, offsets: Mapping[TP, int]) -> None:
        """Forget every record below the committed offsets: it succeeded or was recovered."""
        for tp, next_offset in offsets.items():
            slots = self._slots.get(tp)
            if slots is None:
                continue
            for offset in [o for o in slots if o < next_offset]:
                del slots[offset]
            if not slots:
                del self._slots[tp]

    def clear(self, record: Record) -> None:
        slots = self._slots.get((record.topic, record.partition))
        if slots is not None and slots.pop(record.offset, None) is not None and not slots:
            del self._slots[(record.topic, record.partition)]

    def clear_partitions(self, partitions: Iterable[TP]) -> None:
        for tp in partitions:
            self._slots.pop(tp, None)


def _same_kind(previous: BaseException | None, exc: BaseException) -> bool:
    """Spring's rule: keep counting when the previous failure is an instance of the new one's class.

    The handler's own exceptions are compared, never their ``__cause__``/``__context__``
    (see the module docstring).
    """
    if previous is None:
        return True
    if hasattr(previous, "original_fqcn") or hasattr(exc, "original_fqcn"):
        return exception_fqcn(previous) == exception_fqcn(exc)  # wrappers of errors that crossed a process (Spark)
    return isinstance(previous, type(exc))
