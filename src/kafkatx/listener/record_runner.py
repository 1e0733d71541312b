"""The record runner: a handler called once per record, all of a unit's records in one transaction.

Per unit: begin; for each record, call the handler and produce what it
returns (and what it ``send()``\\ s); send the next offsets with the
consumer's group metadata; commit. A handler failure aborts the transaction
and hands the unit to the after-rollback path
(:mod:`kafkatx.listener.after_rollback`); with ``retry="in_place"`` the
failed record is retried (or recovered) inside the open transaction instead,
asking the same :class:`~kafkatx.rollback.policy.FailurePolicy`.

The loop in :meth:`RecordRunner._handle` is the hot path: it runs for every
record, so it keeps to local variables, classifies what a handler returned
by its type once per type, and produces whatever needs no encoding (bytes,
``(key, value)`` of bytes, an ``Output`` of bytes) straight through
confluent-kafka (see docs/BENCHMARKS.md for what each shape costs).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from sys import getrefcount
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaException

from kafkatx._offsets import TP
from kafkatx.context import bind_sink
from kafkatx.errors import OutputError, RecoveryError
from kafkatx.events import HandlerFailed, RecordRecovered, RecordRetryScheduled, TransactionCommitted
from kafkatx.listener.after_rollback import after_rollback, recovery_failed
from kafkatx.listener.host import ContainerHost, HandlerFailure
from kafkatx.outputs import (
    MANY,
    OUTPUT,
    SERIALIZE,
    PendingOutput,
    collect_outputs,
    new_pending,
    result_kind,
    serialized_bytes,
    serializer_failure,
    to_pending,
)
from kafkatx.record import UNSHARED_REFCOUNT, ConsumedMessage, Output, Record, _MessageRecord, to_record
from kafkatx.rollback.policy import Action

if TYPE_CHECKING:
    from kafkatx.listener.unit import TransactionUnit
    from kafkatx.rollback.processor import AfterRollbackProcessor

__all__ = ["RecordRunner"]

log = logging.getLogger("kafkatx.container")

_UNKNOWN: Any = object()  # a topic not looked up yet


class _RecordBuffer(list[PendingOutput]):
    """Outputs of the record being handled; ``send()`` appends here.

    While the runner handles a unit with ``retry="rollback"``, ``stream``
    maps the topics it has looked up to confluent-kafka's ``produce``, and
    ``send()`` produces through it directly when nothing is buffered
    (counting in ``produced``): a failing handler aborts the whole
    transaction, so there is nothing to hold back.
    """

    __slots__ = ("serializer", "stream", "produced")

    def __init__(self, serializer: Any) -> None:
        super().__init__()
        self.serializer = serializer
        self.stream: dict[str, Any] | None = None
        self.produced = 0

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

    def __init__(self, container: ContainerHost, processor: AfterRollbackProcessor) -> None:
        self._c = container
        self.spec = container.spec
        self.processor = processor
        self._buffer = _RecordBuffer(self.spec.serializer)
        self._kinds: dict[type, int] = {}  # what each type a handler returns is (outputs.result_kind)
        # A listener of one topic gets that topic's records only: the hot path need not ask each Message.
        self._only_topic = self.spec.topics[0] if len(self.spec.topics) == 1 else None
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
                TransactionCommitted(
                    current.listener, current.worker, handled, current.outputs, time.perf_counter() - started
                )
            )
            if stopped_at >= 0:  # the rest of the poll is fetched again for the next transaction
                log.debug(
                    "listener %s: transaction time budget (%.3gs) used after %d of %d records",
                    current.listener,
                    self._c.transaction_budget,
                    stopped_at,
                    len(msgs),
                )
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
        """Handle ``msgs`` in the open transaction, producing each record's outputs, then send the offsets.

        Outputs go straight to confluent-kafka's ``produce`` when they need
        nothing more: bytes (or ``(key, value)`` of bytes, an ``Output`` of
        bytes with ``str``->``bytes`` headers) for a topic that exists. With
        ``retry="rollback"`` a failing handler aborts the whole transaction,
        so a generator's items are produced as they come; with
        ``retry="in_place"`` the transaction goes on, so a record's outputs
        are buffered until its handler has returned. Anything else goes
        through :func:`~kafkatx.outputs.collect_outputs` and the producer's
        ``produce``, which waits for queue space and classifies errors.
        """
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
        produce = unit.producer.produce
        offsets: dict[TP, int] = {}
        run_topic, run_partition, run_last = None, -1, -1  # the current run of one partition's records
        outputs = 0
        started = time.perf_counter()
        deadline = started + self._c.transaction_budget
        # The time budget is checked at record index next_check, counting down to it: an index per record would
        # allocate an int per record past 256 (enumerate's), where the countdown's small ints are preallocated.
        next_check = left = 1
        only_topic = self._only_topic
        new_record = object.__new__
        unshared = UNSHARED_REFCOUNT
        record: Any = new_record(_MessageRecord)
        direct = unit.direct(default_topic) if default_topic is not None else None
        directs: dict[str, Any] = {} if default_topic is None else {default_topic: direct}
        stream = direct if not in_place else None  # produce a generator's items as they come
        kinds = self._kinds
        output_cls = Output
        target: Any = None  # an Output's topic
        buf.produced = 0
        buf.stream = directs if not in_place else None
        previous = bind_sink(buf)
        try:
            for msg in msgs:
                if not left:  # the transaction's time budget, checked often enough, cheaply
                    now = time.perf_counter()
                    if now >= deadline:
                        self._stopped_at = next_check
                        break
                    per_record = (now - started) / next_check
                    left = max(1, min(256, int((deadline - now) / (4 * per_record)) if per_record > 0 else 256))
                    next_check += left
                left -= 1  # this record's index is next_check - left - 1
                topic = msg.topic() if only_topic is None else only_topic
                partition = msg.partition()
                offset = msg.offset()
                # record.message_record(), inlined (hot path). The last record is refilled unless something still
                # holds it (the handler kept it, an event or a traceback refers to it): see UNSHARED_REFCOUNT.
                if getrefcount(record) > unshared:
                    record = new_record(_MessageRecord)
                record._msg = msg
                record.topic = topic
                record.partition = partition
                record.offset = offset
                if failing:
                    state = tracker.state_at(topic, partition, offset)
                    if state is not None and state.pending_recovery:  # its recovery failed: retry that, not the handler
                        raise HandlerFailure(
                            next_check - left - 1,
                            state.last_exception or RuntimeError("recovery pending"),
                            to_record(msg, state.failures),
                        )
                    record.attempt = 1 if state is None else state.failures + 1
                else:
                    record.attempt = 1
                record.key = msg.key()
                record.value = msg.value()
                error = None
                # The handler's outputs: produced here when they need nothing more (the inner try blocks catch
                # confluent-kafka's own refusals, which the buffer's produce() below waits out or classifies);
                # anything else is encoded into buf, or fails the record with an OutputError.
                try:
                    result = handler(record)
                    if result is not None:
                        cls = type(result)
                        if cls is bytes and direct is not None and not buf:
                            try:
                                direct(default_topic, result)
                                outputs += 1
                            except (BufferError, KafkaException):
                                buf.append(new_pending(PendingOutput, (default_topic, result, None, None, None)))
                        elif cls is tuple and direct is not None and not buf and len(result) == 2:
                            key, value = result
                            if (type(value) is bytes or value is None) and (type(key) is bytes or key is None):
                                try:
                                    direct(default_topic, value, key)
                                    outputs += 1
                                except (BufferError, KafkaException):
                                    buf.append(new_pending(PendingOutput, (default_topic, value, key, None, None)))
                            else:
                                buf.append(to_pending(result, default_topic, serializer, name))
                        else:
                            kind = OUTPUT if cls is output_cls else kinds.get(cls)
                            if kind is None:
                                kind = kinds[cls] = result_kind(cls, serializer)
                            if kind == OUTPUT:
                                target = result.topic
                                fast: Any
                                if not target:  # the listener's output topic, looked up already
                                    target, fast = default_topic, direct
                                else:
                                    fast = directs.get(target, _UNKNOWN)
                                    if fast is _UNKNOWN:
                                        fast = directs[target] = unit.direct(target)
                                value, key, headers = result.value, result.key, result.headers
                                if (
                                    fast is not None
                                    and not buf
                                    and result.partition is None
                                    and (type(value) is bytes or value is None)
                                    and (type(key) is bytes or key is None)
                                ):
                                    # A dict of headers with str names goes to confluent-kafka as given: it
                                    # encodes the values as kafkatx would (bytes, str as UTF-8, None) and refuses
                                    # others with TypeError, which falls back to kafkatx's encoding below (that
                                    # names the problem).
                                    refused = False
                                    if type(headers) is dict:  # (confluent-kafka would turn a name 1 into "1")
                                        for h_name in headers:
                                            if type(h_name) is not str:
                                                refused = True
                                                break
                                    elif headers is not None:  # pairs: names checked by kafkatx's encoding
                                        refused = True
                                    if not refused:
                                        try:
                                            if headers is None:
                                                fast(target, value, key)
                                            else:
                                                fast(target, value, key, headers=headers)
                                            outputs += 1
                                        except (BufferError, KafkaException, TypeError, ValueError):
                                            refused = True
                                    if refused:  # outside the except block: no chained context on an OutputError
                                        buf.append(to_pending(result, default_topic, serializer, name))
                                else:
                                    buf.append(to_pending(result, default_topic, serializer, name))
                            elif kind == MANY:
                                for item in result:
                                    if item is None:
                                        continue
                                    if stream is not None and not buf:  # produced as they come (see the docstring)
                                        itype = type(item)
                                        if itype is tuple and len(item) == 2:
                                            key, value = item
                                            if (type(value) is bytes or value is None) and (
                                                type(key) is bytes or key is None
                                            ):
                                                try:
                                                    stream(default_topic, value, key)
                                                    outputs += 1
                                                    continue
                                                except (BufferError, KafkaException):
                                                    pass
                                        elif itype is bytes:
                                            try:
                                                stream(default_topic, item)
                                                outputs += 1
                                                continue
                                            except (BufferError, KafkaException):
                                                pass
                                    buf.append(to_pending(item, default_topic, serializer, name))
                            elif kind == SERIALIZE and default_topic is not None:
                                failure: Exception | None = None
                                try:  # outputs.serialize(), inlined (hot path)
                                    value = serializer(result)  # type: ignore[misc]
                                except Exception as exc:
                                    failure = exc
                                if (
                                    failure is not None
                                ):  # outside the except block: only the serializer's error is chained
                                    raise serializer_failure(result, "value", failure) from failure
                                if type(value) is not bytes:
                                    value = serialized_bytes(value, "value")
                                if direct is not None and not buf:
                                    try:
                                        direct(default_topic, value)
                                        outputs += 1
                                    except (BufferError, KafkaException):
                                        buf.append(new_pending(PendingOutput, (default_topic, value, None, None, None)))
                                else:
                                    buf.append(new_pending(PendingOutput, (default_topic, value, None, None, None)))
                            else:  # str, bytes or a tuple after send()s, no output topic, unsupported: as documented
                                collect_outputs(result, default_topic, serializer, name, buf)
                except Exception as exc:
                    error = exc
                if error is not None:
                    if not in_place:
                        raise HandlerFailure(next_check - left - 1, error, record)
                    self._retry_in_place(
                        unit, record, error, next_check - left - 1
                    )  # outside the except block: no chained context
                if buf:
                    output_error = None
                    try:
                        for out in buf:
                            out_topic, out_value, out_key, out_headers, out_partition = out
                            fast = directs.get(out_topic, _UNKNOWN)
                            if fast is _UNKNOWN:
                                fast = directs[out_topic] = unit.direct(out_topic)
                            if fast is not None:
                                try:
                                    if out_headers is None and out_partition is None:
                                        fast(out_topic, out_value, out_key)
                                    else:
                                        fast(
                                            out_topic,
                                            out_value,
                                            out_key,
                                            -1 if out_partition is None else out_partition,
                                            headers=out_headers,
                                        )
                                    continue
                                except (BufferError, KafkaException):
                                    pass  # produce() waits for queue space, or classifies the error
                            produce(out)
                    except OutputError as exc:
                        output_error = exc
                    if output_error is not None:
                        raise HandlerFailure(next_check - left - 1, output_error, record)
                    outputs += len(buf)
                    buf.clear()
                if partition != run_partition or topic != run_topic:
                    if run_topic is not None:
                        offsets[(run_topic, run_partition)] = run_last + 1
                    run_topic, run_partition = topic, partition
                run_last = offset
            if run_topic is not None:
                offsets[(run_topic, run_partition)] = run_last + 1
            unit.outputs += outputs + buf.produced
            unit.send_offsets(offsets)
        finally:
            buf.stream = None
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
                unit.publish(
                    RecordRetryScheduled(unit.listener, unit.worker, record, state.failures + 1, verdict.delay)
                )
                if unit.wait(verdict.delay):
                    raise _Abandoned
                record = replace(record, attempt=state.failures + 1)
                error = None
                try:
                    collect_outputs(spec.handler(record), spec.output, spec.serializer, spec.name, buf)
                except Exception as again:
                    error = again
                if error is None:
                    tracker.clear(record)  # a success ends its count, whether or not the batch commits
                    return
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
            tracker.record_recovered(record)  # not a success: an abort of the batch leaves its count
            unit.publish(RecordRecovered(unit.listener, unit.worker, record, exc, policy.recoverer.name))
            return
