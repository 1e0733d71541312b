"""Counts failed deliveries per record, in memory, per container thread.

One slot per (topic, partition), like Spring's FailedRecordTracker: a failure
at another offset of the same partition replaces the slot, a failure with a
different exception type restarts the count, and recovery or revocation
clears it. Counts are not shared across processes and restart at 1 after a
rebalance or a restart.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kafkatx.record import Record
from kafkatx.rollback.classifier import exception_fqcn, root_cause

__all__ = ["FailureTracker", "FailureState"]

TopicPartition = tuple[str, int]


@dataclass(slots=True)
class FailureState:
    offset: int
    failures: int = 0
    exception_type: str = ""
    recovery_failures: int = 0
    last_exception: BaseException | None = None
    # Set after a recoverer failed: the next delivery goes straight to recovery
    # instead of calling the handler again.
    pending_recovery: bool = False


class FailureTracker:
    def __init__(self, *, reset_on_exception_change: bool = True) -> None:
        self.reset_on_exception_change = reset_on_exception_change
        self._slots: dict[TopicPartition, FailureState] = {}
        #: The failing partitions' slots; empty in normal operation, so the hot path checks it once per record.
        self.failing = self._slots

    def __bool__(self) -> bool:
        return bool(self._slots)

    def attempt(self, topic: str, partition: int, offset: int) -> int:
        """The delivery attempt (1-based) that the next handler call of this record is."""
        slot = self._slots.get((topic, partition))
        if slot is None or slot.offset != offset:
            return 1
        return slot.failures + 1

    def record_failure(self, record: Record, exc: BaseException) -> FailureState:
        """Count one failed delivery of ``record`` and return its state."""
        key = (record.topic, record.partition)
        kind = exception_fqcn(root_cause(exc))
        slot = self._slots.get(key)
        if slot is None or slot.offset != record.offset or (
            self.reset_on_exception_change and slot.failures and slot.exception_type != kind
        ):
            recovery_failures = slot.recovery_failures if slot is not None and slot.offset == record.offset else 0
            slot = FailureState(record.offset, recovery_failures=recovery_failures)
            self._slots[key] = slot
        slot.failures += 1
        slot.exception_type = kind
        slot.last_exception = exc
        return slot

    def record_recovery_failure(self, record: Record) -> FailureState:
        key = (record.topic, record.partition)
        slot = self._slots.get(key)
        if slot is None or slot.offset != record.offset:
            slot = FailureState(record.offset)
            self._slots[key] = slot
        slot.recovery_failures += 1
        slot.pending_recovery = True
        return slot

    def state(self, record: Record) -> FailureState | None:
        return self.state_at(record.topic, record.partition, record.offset)

    def state_at(self, topic: str, partition: int, offset: int) -> FailureState | None:
        slot = self._slots.get((topic, partition))
        return slot if slot is not None and slot.offset == offset else None

    def clear(self, record: Record) -> None:
        slot = self._slots.get((record.topic, record.partition))
        if slot is not None and slot.offset == record.offset:
            del self._slots[(record.topic, record.partition)]

    def clear_partitions(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            self._slots.pop(tp, None)

    def clear_all(self) -> None:
        self._slots.clear()
