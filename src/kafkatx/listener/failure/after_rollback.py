"""The after-rollback path: what the container does once a unit's transaction was aborted for a handler failure.

:func:`after_rollback` runs the listener's after-rollback processor inside a
NEW transaction, through a :class:`RollbackScope` (the processor's
:class:`~kafkatx.rollback.processor.RollbackContext`). After the commit,
every record the transaction did not commit is rewound (or handed back to
be handled next from memory), so a processor cannot lose records by
forgetting to seek. :func:`recovery_failed` is what happens when the
recoverer itself fails: the batch-mates before the record are committed,
the record is kept, and its partition backs off before recovery is retried.

The public unit interface (:class:`~kafkatx.listener.host.Unit`) is the only
thing this module uses of the container; the decisions it carries out are
the processor's (:mod:`kafkatx.rollback`, which does no client I/O).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kafkatx.client.offsets import TP
from kafkatx.errors import KafkaClientError, OutputError, RecoveryError
from kafkatx.events import Event, TransactionCommitted
from kafkatx.listener.failure import failed_record
from kafkatx.listener.host import HandlerFailure, Unit
from kafkatx.outputs import PendingOutput, unproducible_stop
from kafkatx.record import ConsumedMessage, Record
from kafkatx.recoverers import Recoverer
from kafkatx.rollback.processor import AfterRollbackProcessor

if TYPE_CHECKING:
    import threading

__all__ = ["RollbackScope", "after_rollback", "recovery_failed", "Replay"]

log = logging.getLogger("kafkatx.rollback")

#: Runs the handler for one record and returns its encoded outputs (raising what the handler raised). One with a
#: ``replay_all(records)`` method too (a concurrent runner's) runs the records to re-run together: see
#: :meth:`RollbackScope.replay_processed`.
Replay = Callable[[Record], Sequence[PendingOutput]]


def after_rollback(
    unit: Unit,
    msgs: list[ConsumedMessage],
    failure: HandlerFailure,
    processor: AfterRollbackProcessor,
    replay: Replay,
    *,
    keep_in_memory: bool,
) -> list[ConsumedMessage]:
    """Run ``processor`` in a new transaction. Returns the records to handle next, from memory.

    Those are the records the transaction did not commit on partitions not
    held for a back-off (Spring seeks back and polls them again; the result
    is the same without the round trip). Records of partitions held for a
    back-off are kept in memory by the container until it ends
    (:meth:`~kafkatx.listener.host.Unit.defer`); everything is rewound
    instead when ``keep_in_memory`` is False.

    A failure that means a dependency is down (the listener's ``outages``)
    is no record's: nothing is counted, the processor is not called, the
    unit is rewound and the whole listener waits (:mod:`kafkatx.listener.failure.outage`).
    """
    while True:
        stop = unproducible_stop(unit.listener, failure.exc)
        if stop is not None:  # a programming error, not the record's: the container stops, dead-letters nothing
            raise stop
        if unit.outage.matches(failure.exc):
            unit.rewind(msgs)
            unit.outage.report(unit.worker, failure.exc, failure.record)
            return []
        scope = RollbackScope(unit.with_messages(msgs), msgs, failure, replay)
        started = time.perf_counter()
        again: HandlerFailure | None = None
        recovery: RecoveryError | None = None
        try:
            if not scope.unit.transact(
                functools.partial(_process, processor, scope), what="after-rollback transaction"
            ):
                return []
        except HandlerFailure as exc:  # a replayed batch-mate failed this time (the transaction was aborted)
            again = exc
        except RecoveryError as exc:
            recovery = exc
        if again is not None:
            failure = again
            continue
        if recovery is not None:
            _recovery_failed(unit, msgs, failure, recovery, replay)
            return []
        rest = scope.apply(keep_in_memory=keep_in_memory and not unit.stopping)
        unit.publish(
            TransactionCommitted(
                unit.listener,
                unit.worker,
                scope.committed_records,
                scope.unit.outputs,
                time.perf_counter() - started,
                "after_rollback",
            )
        )
        return rest


def _process(processor: AfterRollbackProcessor, scope: RollbackScope) -> None:
    processor.process(scope)
    scope.send_offsets()


def recovery_failed(
    unit: Unit, msgs: list[ConsumedMessage], failure: HandlerFailure, exc: RecoveryError, replay: Replay
) -> None:
    """The recoverer failed (the transaction was aborted): keep the record, commit its batch-mates, back off.

    The record's next delivery goes straight to recovery, not to the handler.
    After ``max_recovery_failures`` the container stops
    (:class:`~kafkatx.RecoveryExhaustedError`): the record was not committed
    and is delivered again on restart.
    """
    _recovery_failed(unit, msgs, failure, exc, replay)


def _recovery_failed(
    unit: Unit, msgs: list[ConsumedMessage], failure: HandlerFailure, exc: RecoveryError, replay: Replay
) -> None:
    record = exc.record
    delay = failed_record.recovery_failed(unit, record, failure.exc, exc).delay  # or RecoveryExhaustedError
    if not _commit_processed(unit, msgs, failure, replay):
        unit.with_messages(msgs).rewind()
    unit.pause((record.topic, record.partition), delay)


def _commit_processed(unit: Unit, msgs: list[ConsumedMessage], failure: HandlerFailure, replay: Replay) -> bool:
    """Commit the batch-mates before a record whose recovery failed, keeping only that record.

    Without this, every failed recovery (a dead-letter topic that is down)
    would roll the healthy records back with it, over and over.
    """
    scope = RollbackScope(unit.with_messages(msgs), msgs, failure, replay)
    scope.hold(failure.record)

    def work() -> None:
        scope.replay_processed()
        scope.send_offsets()

    try:
        if not scope.unit.transact(work, records=failure.index, what="commit of the batch-mates"):
            return True  # the producer was replaced and the unit rewound to the committed offsets
    except HandlerFailure as exc:
        log.debug("could not commit the batch-mates of %s: %s", failure.record.coordinates, exc.exc)
        return False
    scope.apply()
    return True


class RollbackScope:
    """The :class:`~kafkatx.rollback.processor.RollbackContext` of one after-rollback transaction."""

    def __init__(self, unit: Unit, msgs: list[ConsumedMessage], failure: HandlerFailure, replay: Replay) -> None:
        self.unit = unit
        self._msgs = msgs
        self._replay = replay
        self._index = failure.index
        self.listener = unit.listener
        self.group_id = unit.group_id
        self.tracker = unit.tracker
        self.stop_event: threading.Event = unit.stop_event
        self.failed = failure.record
        self.exception = failure.exc
        self.processed = unit.records(msgs[: failure.index])
        self._offsets: dict[TP, int] = {}
        self._held: dict[TP, Record] = {}
        self._pauses: dict[TP, float] = {}
        self.committed_records = 0
        #: The usual outcome, in any order of the processor's calls: the records before the failed one are
        #: committed (there are none, or they were re-run), and no other record but the failed one is;
        #: apply() then needs no pass over the records.
        self._replayed = failure.index == 0
        self._committed_other = False

    @functools.cached_property
    def records(self) -> list[Record]:
        """The unprocessed records, failed one first (built on demand: the default processor never needs them)."""
        return [self.failed, *self.unit.records(self._msgs[self._index + 1 :])]

    @property
    def stopping(self) -> bool:
        return self.unit.stopping

    def publish(self, event: Event) -> None:
        self.unit.publish(event)

    def replay_processed(self) -> None:
        unit = self.unit
        # A concurrent runner's replay handles the records together (listener/runners/concurrent.py), each key's
        # in order: their outcomes, in order, up to the first failure. Produced here one record after the other all
        # the same.
        replay_all = getattr(self._replay, "replay_all", None)
        prepared: list[Any] | None = replay_all(self.processed) if replay_all is not None else None
        for i, record in enumerate(self.processed):
            failure: HandlerFailure | None = None
            try:
                if prepared is None:
                    outputs = self._replay(record)
                elif isinstance(prepared[i], BaseException):
                    raise prepared[i]
                else:
                    outputs = prepared[i]
                for out in outputs:
                    unit.produce(out)
            except KafkaClientError:
                raise
            except OutputError as exc:  # an output the client refused: the record's failure
                failure = HandlerFailure(i, exc, record)
            except Exception as exc:
                failure = HandlerFailure(i, exc, record)
            if failure is not None:
                raise failure
            tp = (record.topic, record.partition)
            self._offsets[tp] = max(self._offsets.get(tp, -1), record.offset + 1)
            self.committed_records += 1
        self._replayed = True

    def recover(self, recoverer: Recoverer, record: Record, exception: BaseException) -> None:
        self.unit.recover(recoverer, record, exception)

    def commit_offset(self, record: Record) -> None:
        tp = (record.topic, record.partition)
        if record.offset != self.failed.offset or tp != (self.failed.topic, self.failed.partition):
            self._committed_other = True
        self._offsets[tp] = max(self._offsets.get(tp, -1), record.offset + 1)
        self._held.pop(tp, None)
        self.committed_records += 1

    def seek_unprocessed(self, *, include_failed: bool = True) -> None:
        """Seeks are derived from what this transaction commits; see :meth:`apply`."""
        if include_failed:
            self.hold(self.failed)

    def hold(self, record: Record) -> None:
        """Keep ``record`` for another delivery; its failure count is committed with its offset."""
        self._held[(record.topic, record.partition)] = record

    def backoff(self, record: Record, seconds: float) -> None:
        self.hold(record)
        if seconds > 0:
            self._pauses[(record.topic, record.partition)] = seconds

    def send_offsets(self) -> None:
        """Send this transaction's offsets. A held record's own offset is committed too (nothing past it):
        the commit's metadata then carries its failure count (see :mod:`kafkatx.rollback.durable`)."""
        offsets = dict(self._offsets)
        for tp, record in self._held.items():
            if offsets.get(tp, record.offset) <= record.offset:
                offsets[tp] = record.offset
        self.unit.send_offsets(offsets)
        self._offsets = offsets

    def apply(self, *, keep_in_memory: bool = False) -> list[ConsumedMessage]:
        """After the commit: rewind every partition to its first record not committed, and pause.

        With ``keep_in_memory``, partitions not held for a back-off are not
        rewound: their uncommitted records are returned, to be handled next
        (and those of held partitions handed to the container until the
        back-off ends). One pass over the unit's records: after each failure
        of a big batch, this runs over all of what is left of it.
        """
        offsets, pauses = self._offsets, self._pauses
        if keep_in_memory and not pauses and self._replayed and not self._committed_other:
            # The records before the failed one committed, those after it did not: no need to look.
            failed = self.failed
            if failed.offset < offsets.get((failed.topic, failed.partition), -1):
                return self._msgs[self._index + 1 :]
            return self._msgs[self._index :]
        rest: list[ConsumedMessage] = []
        held: dict[TP, list[ConsumedMessage]] = {}
        rewind: dict[TP, int] = {}
        for m in self._msgs:
            tp = (m.topic(), m.partition())
            offset = m.offset()
            if offset < offsets.get(tp, -1):
                continue  # committed by this transaction
            if not keep_in_memory:
                rewind.setdefault(tp, offset)  # a partition's records are in offset order
            elif tp in pauses:
                held.setdefault(tp, []).append(m)
            else:
                rest.append(m)
        for tp, offset in rewind.items():
            self.unit.seek(tp, offset)
        for tp, seconds in pauses.items():
            if tp in held:  # handled from memory when the back-off ends
                self.unit.defer(held[tp], seconds)
            else:
                self.unit.pause(tp, seconds)
        return rest
