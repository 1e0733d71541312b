"""The record runner: a handler called once per record, all of a unit's records in one transaction.

Per unit: begin; for each record, call the handler and produce what it
returns (and what it ``send()``\\ s); send the next offsets with the
consumer's group metadata; commit. A handler failure aborts the transaction
and hands the unit to the after-rollback path
(:mod:`kafkatx.rollback.after_rollback`); with ``retry="in_place"`` the
failed record is retried (or recovered) inside the open transaction instead,
asking the same :class:`~kafkatx.rollback.policy.FailurePolicy`.

The loop in :meth:`RecordRunner._handle` is the hot path: it runs for every
record, so it keeps to local variables and produces the common output (bytes
to the listener's topic) straight through confluent-kafka.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaException

from kafkatx.context import bind_sink
from kafkatx.errors import OutputError, RecoveryError
from kafkatx.events import HandlerFailed, RecordRecovered, RecordRetryScheduled, TransactionCommitted
from kafkatx.outputs import PendingOutput, collect_outputs
from kafkatx.record import ConsumedMessage, Record, to_record, _MessageRecord
from kafkatx.rollback.after_rollback import HandlerFailure, after_rollback, recovery_failed
from kafkatx.rollback.policy import Action

if TYPE_CHECKING:
    from kafkatx.listener.container import ListenerContainer
    from kafkatx.listener.unit import TransactionUnit
    from kafkatx.rollback.processor import AfterRollbackProcessor

__all__ = ["RecordRunner"]

log = logging.getLogger("kafkatx.container")

TP = tuple[str, int]


class _RecordBuffer(list[PendingOutput]):
    """Outputs of the record being handled; ``send()`` appends here."""

    __slots__ = ("serializer",)

    def __init__(self, serializer: Any) -> None:
        super().__init__()
        self.serializer = serializer

    add = list.append


class _Abandoned(Exception):
    """Internal: the container stopped while a record waited for an in-place retry."""


class _InPlaceRecoveryFailed(Exception):
    """Internal: an in-place recovery failed; the unit goes to the recovery-failed path."""

    def __init__(self, failure: HandlerFailure, error: RecoveryError) -> None:
        super().__init__(failure, error)
        self.failure, self.error = failure, error


class RecordRunner:
    """``runner(unit)`` for record listeners (one handler call per record)."""

    def __init__(self, container: ListenerContainer, processor: AfterRollbackProcessor) -> None:
        self._c = container
        self.spec = container.spec
        self.processor = processor
        self._buffer = _RecordBuffer(self.spec.serializer)
        self._stopped_at = -1

    def __call__(self, unit: TransactionUnit) -> None:
        msgs = unit.messages
        while msgs:
            current = unit.with_messages(msgs)
            started = time.perf_counter()
            failure: HandlerFailure | None = None
            recovery: _InPlaceRecoveryFailed | None = None
            abandoned = False
            self._stopped_at = -1
            try:
                if not current.transact(functools.partial(self._handle, current, msgs)):
                    return
            except HandlerFailure as exc:
                failure = exc
            except _InPlaceRecoveryFailed as exc:
                recovery = exc
            except _Abandoned:
                abandoned = True
            # Outside the except blocks, so that nothing the handler raises from here on chains to them.
            if failure is not None:
                in_memory = time.monotonic() - self._c.polled_at < self._c.transaction_budget
                msgs = after_rollback(current, msgs, failure, self.processor, self.replay, keep_in_memory=in_memory)
                continue
            if recovery is not None:
                recovery_failed(current, msgs, recovery.failure, recovery.error, self.replay)
                return
            if abandoned:  # nothing was committed; the records come back on restart
                current.rewind()
                return
            stopped_at = self._stopped_at
            handled = len(msgs) if stopped_at < 0 else stopped_at
            current.publish(
                TransactionCommitted(current.listener, current.worker, handled, current.outputs,
                                     time.perf_counter() - started)
            )  # fmt: skip
            if stopped_at >= 0:  # the rest of the poll is fetched again for the next transaction
                log.debug(
                    "listener %s: transaction time budget (%.3gs) used after %d of %d records",
                    current.listener, self._c.transaction_budget, stopped_at, len(msgs),
                )  # fmt: skip
                current.rewind(msgs[stopped_at:])
            return

    def replay(self, record: Record) -> list[PendingOutput]:
        """Run the handler for ``record`` and return its encoded outputs (returned and sent)."""
        spec, buf = self.spec, self._buffer
        buf.clear()
        previous = bind_sink(buf)
        try:
            collect_outputs(spec.handler(record), spec.output, spec.serializer, spec.name, buf)
            return list(buf)
        finally:
            buf.clear()
            bind_sink(previous)

    # -- the hot path ------------------------------------------------------------------
    def _handle(self, unit: TransactionUnit, msgs: Sequence[ConsumedMessage]) -> None:
        spec = self.spec
        handler = spec.handler
        default_topic = spec.output
        serializer = spec.serializer
        name = spec.name
        in_place = spec.retry == "in_place"
        tracker = unit.tracker
        failing = tracker.failing  # non-empty only while a record is failing
        buf = self._buffer
        buf.clear()
        produce = unit._producer.produce
        offsets: dict[TP, int] = {}
        run_topic, run_partition, run_next = None, -1, -1  # the current run of one partition's records
        outputs = 0
        started = time.perf_counter()
        deadline = started + self._c.transaction_budget
        check_at = 1
        new_record = object.__new__
        direct = unit.direct(default_topic) if default_topic is not None else None
        previous = bind_sink(buf)
        try:
            for i, msg in enumerate(msgs):
                if i == check_at:  # the transaction's time budget, checked often enough, cheaply
                    now = time.perf_counter()
                    if now >= deadline:
                        self._stopped_at = i
                        break
                    per_record = (now - started) / i
                    check_at = i + max(1, min(256, int((deadline - now) / (4 * per_record)) if per_record > 0 else 256))
                topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
                attempt = 1
                if failing:
                    state = tracker.state_at(topic, partition, offset)
                    if state is not None:
                        attempt = state.failures + 1
                        if state.pending_recovery:  # its recovery failed before: retry the recovery, not the handler
                            raise HandlerFailure(i, state.last_exception or RuntimeError("recovery pending"),
                                                 to_record(msg, state.failures))  # fmt: skip
                record = new_record(_MessageRecord)  # record.message_record(), inlined (hot path)
                record._msg, record.topic, record.partition, record.offset, record.attempt = msg, topic, partition, offset, attempt
                value = None
                try:
                    result = handler(record)
                    if result is not None:
                        if type(result) is bytes and default_topic is not None:
                            if direct is not None and not buf:
                                value = result  # the common case: produced directly below
                            else:
                                buf.append(PendingOutput(default_topic, result, None, None, None))
                        else:
                            collect_outputs(result, default_topic, serializer, name, buf)
                    error = None
                except Exception as exc:
                    error = exc
                if error is not None:
                    if not in_place:
                        raise HandlerFailure(i, error, record)
                    self._retry_in_place(unit, record, error, i)  # outside the except block: no chained context
                if value is not None:
                    try:
                        direct(default_topic, value)  # type: ignore[misc]
                        outputs += 1
                    except (BufferError, KafkaException):  # queue full, or an error: produce() below waits or classifies it
                        buf.append(PendingOutput(default_topic, value, None, None, None))  # type: ignore[arg-type]
                if buf:
                    output_error = None
                    try:
                        for out in buf:
                            produce(out)
                    except OutputError as exc:
                        output_error = exc
                    if output_error is not None:
                        raise HandlerFailure(i, output_error, record)
                    outputs += len(buf)
                    buf.clear()
                if partition != run_partition or topic != run_topic:
                    if run_topic is not None:
                        offsets[(run_topic, run_partition)] = run_next
                    run_topic, run_partition = topic, partition
                run_next = offset + 1
            if run_topic is not None:
                offsets[(run_topic, run_partition)] = run_next
            unit.outputs += outputs
            unit.send_offsets(offsets)
        finally:
            bind_sink(previous)

    # -- retry="in_place" -----------------------------------------------------------------
    def _retry_in_place(self, unit: TransactionUnit, record: Record, exc: BaseException, index: int) -> None:
        """Retry or recover a failed record without aborting the batch's transaction.

        Its outputs are discarded on each failure (they were only buffered),
        so the Kafka transaction never sees a failed attempt. Returns once the
        record is done (its outputs are in the buffer, or it was recovered);
        raises to abandon the unit (the container stops during a back-off) or
        when the recoverer fails.
        """
        spec, policy, tracker, buf = self.spec, unit.policy, unit.tracker, self._buffer
        while True:
            buf.clear()
            state = tracker.record_failure(record, exc)
            unit.publish(HandlerFailed(unit.listener, unit.worker, record, exc, state.failures))
            verdict = policy.decide(state.failures, exc, unit.stop_event)
            if verdict.action is Action.ABANDON:
                raise _Abandoned
            if verdict.action is Action.RETRY:
                unit.publish(RecordRetryScheduled(unit.listener, unit.worker, record, state.failures + 1, verdict.delay))
                if unit.wait(verdict.delay):
                    raise _Abandoned
                record = replace(record, attempt=state.failures + 1)
                error = None
                try:
                    collect_outputs(spec.handler(record), spec.output, spec.serializer, spec.name, buf)
                except Exception as again:
                    error = again
                if error is None:
                    return  # its count is cleared when the batch commits
                exc = error
                continue
            recovery: RecoveryError | None = None
            try:
                unit.recover(policy.recoverer, replace(record, attempt=state.failures), exc, confirm=False)
            except RecoveryError as err:
                recovery = err
            if recovery is not None:
                log.warning("in-place recovery of %s failed: %s", record.coordinates, recovery)
                raise _InPlaceRecoveryFailed(HandlerFailure(index, exc, record), recovery)
            unit.publish(RecordRecovered(unit.listener, unit.worker, record, exc, policy.recoverer.name))
            return
