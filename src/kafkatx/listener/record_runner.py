"""The record runner: a handler called once per record, all of a unit's records in one transaction.

Per unit: begin; for each record, call the handler and produce what it
returns (and what it ``send()``\\ s); send the next offsets with the
consumer's group metadata; commit. A handler failure aborts the transaction
and hands the unit to the after-rollback path
(:mod:`kafkatx.listener.after_rollback`); with ``retry="in_place"`` the
failed record is retried (or recovered) inside the open transaction instead,
asking the same :class:`~kafkatx.rollback.policy.FailurePolicy`.

The loop in :meth:`RecordRunner._handle` is the hot path: it runs for every
record, so it keeps to local variables, reads the clock once per step of
records, and hands each result to the emit function of its type
(:class:`~kafkatx.outputs.ResultEmitters`, chosen once per type), which
produces whatever needs no encoding (bytes, ``(key, value)`` of bytes, an
``Output`` of bytes) straight through confluent-kafka. The emit function is
the one Python call per record kafkatx adds to the handler's: it calls
confluent-kafka itself, with no helper call on the fast path
(``bench/micro_hot_path.py --callgrind`` counts what each shape costs).

While some record is failing, a success on its first call ends a record's
count, commit or not (FailureTracker). ``send()`` and a generator's items are
produced as they come (a failure aborts the whole transaction), or, with
``retry="in_place"``, wait in the buffer until the handler returned. With
tracing on, the handler is tracing's wrapper, and the root records its
sampler leaves out (99 in 100 at the usual 1%) are run with the listener's
own handler by a countdown the runner holds (``listener.host.UntracedRoots``);
with tracing off that costs a test per record.
"""

from __future__ import annotations

import functools
import logging
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import replace
from sys import getrefcount
from typing import TYPE_CHECKING, Any

from kafkatx.client.offsets import TP
from kafkatx.context import bind_sink
from kafkatx.errors import OutputError, RecoveryError
from kafkatx.events import RecordRecovered, TransactionCommitted
from kafkatx.listener.after_rollback import Replay, after_rollback, recovery_failed
from kafkatx.listener.concurrent import (
    Abandoned,
    ConcurrentDispatch,
    InPlaceRecoveryFailed,
    NotAwaitedError,
    in_place_verdict,
    refuse_awaitable,
)
from kafkatx.listener.host import ContainerHost, HandlerFailure
from kafkatx.outputs import Emit, PendingOutput, Produce, ResultEmitters, collect_outputs, unproducible_stop
from kafkatx.record import UNSHARED_REFCOUNT, ConsumedMessage, Record, _MessageRecord, to_record
from kafkatx.rollback.policy import Action

if TYPE_CHECKING:
    from kafkatx.listener.unit import TransactionUnit
    from kafkatx.rollback.processor import AfterRollbackProcessor
    from kafkatx.rollback.tracker import FailureTracker

__all__ = ["RecordRunner"]

log = logging.getLogger("kafkatx.container")


class _RecordBuffer(list[PendingOutput]):
    """Outputs of the record being handled; ``send()`` appends here.

    While the runner handles a unit with ``retry="rollback"``, ``stream``
    maps the topics it has looked up to confluent-kafka's ``produce`` (or
    None), and ``send()`` produces through it by the produce-or-buffer rule
    (:func:`~kafkatx.outputs.buffer_output`), counting in ``produced``: a
    failing handler aborts the whole transaction, so there is nothing to
    hold back.
    """

    __slots__ = ("serializer", "stream", "produced")

    def __init__(self, serializer: Any) -> None:
        super().__init__()
        self.serializer = serializer
        self.stream: dict[str, Produce | None] | None = None
        self.produced = 0

    add = list.append


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
        #: ``in_flight > 1`` or an ``async def`` handler: the unit's records are handled concurrently.
        self._dispatch = ConcurrentDispatch(self.spec) if self.spec.in_flight > 1 or self.spec.is_async else None
        #: What re-runs the batch-mates after a rollback: the concurrent dispatch re-runs them together.
        self._replay: Replay = self.replay if self._dispatch is None else self._dispatch

    def __call__(self, unit: TransactionUnit, raised: BaseException | None = None) -> None:
        """Run ``unit``'s records in transactions. ``raised``: what handling them ahead of a commit raised
        (listener/overlap.py, nothing produced), taken as if its transaction had raised it."""
        msgs = unit.messages
        while msgs:
            current = unit.with_messages(msgs)
            started = time.perf_counter()
            failure: HandlerFailure | None = None
            recovery: InPlaceRecoveryFailed | None = None
            abandoned = False
            self._stopped_at = -1
            work = functools.partial(self._handle if self._dispatch is None else self._dispatched, current, msgs)
            try:
                if raised is not None:
                    ahead, raised = raised, None
                    raise ahead
                if not current.transact(work):
                    return
            except HandlerFailure as exc:
                failure = exc
            except InPlaceRecoveryFailed as exc:
                recovery = exc
            except Abandoned:
                abandoned = True
            # Outside the except blocks, so that nothing the handler raises from here on chains to them.
            if failure is not None:
                if type(failure.exc) is NotAwaitedError:  # a programming error, no record's: the container stops
                    raise failure.exc
                in_memory = time.monotonic() - self._c.polled_at < self._c.transaction_budget
                msgs = after_rollback(current, msgs, failure, self.processor, self._replay, keep_in_memory=in_memory)
                continue
            if recovery is not None:
                recovery_failed(current, msgs, recovery.failure, recovery.error, self._replay)
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

    def close(self) -> None:
        """The container is closing: stop the concurrent dispatch's event loop and threads, if any."""
        if self._dispatch is not None:
            self._dispatch.close()

    @property
    def handles_one_at_a_time(self) -> bool:
        """True unless records are handled concurrently (``in_flight > 1`` or an ``async def`` handler)."""
        return self._dispatch is None

    def handle_ahead(self, unit: TransactionUnit, msgs: Sequence[ConsumedMessage]) -> int:
        """Handle ``msgs`` into ``unit``, which holds their outputs (the overlapped commit, listener/overlap.py).

        Returns how many were handled before the transaction's time budget ran out. Called while another
        unit of this runner commits, so the state that unit reads afterwards is kept.
        """
        stopped_at = self._stopped_at
        try:
            self._stopped_at = -1
            self._handle(unit, msgs)
            return len(msgs) if self._stopped_at < 0 else self._stopped_at
        finally:
            self._stopped_at = stopped_at

    def _dispatched(self, unit: TransactionUnit, msgs: Sequence[ConsumedMessage]) -> None:
        """Handle ``msgs`` concurrently (listener/concurrent.py); a prefix of them may be all that commits."""
        assert self._dispatch is not None
        handled = self._dispatch.handle(unit, msgs, self._c.transaction_budget)
        self._stopped_at = handled if handled < len(msgs) else -1

    def replay(self, record: Record) -> list[PendingOutput]:
        """Run the handler for ``record`` and return its encoded outputs (returned and sent)."""
        if self._dispatch is not None:
            return self._dispatch.replay(record)
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
        """Handle ``msgs`` in the open transaction, producing each record's outputs, then send the offsets (per
        record: refill the record, call the handler, produce its result, then what it buffered: see the module)."""
        spec, buf, tracker = self.spec, self._buffer, unit.tracker
        handler, in_place, only_topic = spec.handler, spec.retry == "in_place", self._only_topic
        failing = bool(tracker)  # a bool tests cheaper per record; the unit adds slots only for records it handled
        roots, skip = spec.untraced_roots, 0  # tracing: the next ``skip`` root records run untraced
        untraced = roots.handler if roots is not None else handler
        emitters = self._emitters(unit, in_place)
        by_type, emitter_for = emitters.by_type, emitters.emitter
        shape: type = type(None)  # the type of the last result, and its emit function
        emit: Emit = _nothing
        offsets: dict[TP, int] = {}
        run_topic, run_partition, run_last = None, -1, -1  # the current run of one partition's records
        outputs = handled = 0
        started, step, budget, unshared = time.perf_counter(), 1, self._c.transaction_budget, UNSHARED_REFCOUNT
        record: Any = _fresh_record()
        previous = bind_sink(buf)
        try:
            while handled < len(msgs):
                step_msgs = msgs[handled : handled + step]
                for msg in step_msgs:
                    topic = msg.topic() if only_topic is None else only_topic
                    partition, offset = msg.partition(), msg.offset()
                    # record.message_record(), inlined: the last record is refilled unless held (UNSHARED_REFCOUNT)
                    if getrefcount(record) > unshared:
                        record = _fresh_record()
                    record._msg = msg
                    record.topic = topic
                    record.partition = partition
                    record.offset = offset
                    if failing:
                        record.attempt = _attempt(tracker, msg, step_msgs, handled)
                    record.key, record.value = msg.key(), msg.value()
                    error = None
                    try:
                        if roots is None:  # tracing off, or not sampling roots at a ratio
                            result = handler(record)
                        elif skip and not msg.headers():  # a root record (no headers) the sampler leaves out
                            skip -= 1
                            result = untraced(record)
                        else:
                            result = handler(record)
                            if not skip:  # the traced handler may have drawn the next count
                                skip = roots.take()
                        if result is not None:
                            if type(result) is not shape:  # a handler mostly returns one type: its emit is at hand
                                shape = type(result)
                                emit = by_type.get(shape) or emitter_for(shape)
                            outputs += emit(result)
                    except Exception as exc:
                        error = exc
                    if error is not None:  # outside the except block: no chained context
                        self._failed(unit, record, error, handled + _position(step_msgs, msg), in_place)
                    if buf:
                        outputs += _produce_buffered(emitters, unit.producer.produce, record, step_msgs, handled)
                    if failing and error is None:  # its first call succeeded: that ends its count (FailureTracker)
                        tracker.clear(record)
                    if partition != run_partition or topic != run_topic:
                        if run_topic is not None:
                            offsets[(run_topic, run_partition)] = run_last + 1
                        run_topic, run_partition = topic, partition
                    run_last = offset
                handled += len(step_msgs)
                if handled < len(msgs):
                    step = _records_to_next_check(started, budget, handled)
                    if not step:  # the transaction's time is up: the rest is fetched again
                        self._stopped_at = handled
                        break
            if run_topic is not None:
                offsets[(run_topic, run_partition)] = run_last + 1
            unit.outputs += outputs + buf.produced
            unit.send_offsets(offsets)
        finally:
            if skip:
                roots.give_back(skip)  # type: ignore[union-attr]  # skip is only ever set from roots
            buf.stream = None
            emitters.close()
            bind_sink(previous)

    def _failed(self, unit: TransactionUnit, record: Record, error: Exception, index: int, in_place: bool) -> None:
        """A record's handler raised: fail the transaction (HandlerFailure), or retry it in place."""
        if not in_place or unit.outage.matches(error):  # an outage pauses the listener instead
            raise HandlerFailure(index, error, record)
        self._retry_in_place(unit, record, error, index)

    def _emitters(self, unit: TransactionUnit, in_place: bool) -> ResultEmitters:
        """The transaction's emit functions, over an empty buffer that ``send()`` streams through unless ``in_place``."""
        buf = self._buffer
        buf.clear()
        buf.produced = 0
        emitters = ResultEmitters(
            self.spec.output,
            self.spec.serializer,
            self.spec.name,
            buf,
            unit.direct,
            stream_items=not in_place,
            kinds=self._kinds,
        )
        buf.stream = emitters.directs if not in_place else None
        refuse = functools.partial(refuse_awaitable, self.spec.name)
        emitters.by_type.update(dict.fromkeys(_AWAITABLES, refuse))
        return emitters

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
        if type(exc) is NotAwaitedError:
            raise exc
        while True:
            buf.clear()
            stop = unproducible_stop(unit.listener, exc)
            if stop is not None:  # a programming error: the container stops, the transaction is not committed
                raise stop
            verdict, failures = in_place_verdict(unit, record, exc)
            if verdict.action is Action.RETRY:
                if unit.wait(verdict.delay):
                    raise Abandoned
                record = replace(record, attempt=failures + 1)
                error = None
                try:
                    collect_outputs(spec.handler(record), spec.output, spec.serializer, spec.name, buf)
                except Exception as again:
                    error = again
                if error is None:
                    tracker.clear(record)  # a success ends its count, whether or not the batch commits
                    return
                if unit.outage.matches(error):  # a dependency went down meanwhile: not this record's failure
                    raise HandlerFailure(index, error, record)
                exc = error
                continue
            recovery: RecoveryError | None = None
            try:
                unit.recover(policy.recoverer, replace(record, attempt=failures), exc, confirm=False)
            except RecoveryError as err:
                recovery = err
            if recovery is not None:
                log.warning("in-place recovery of %s failed: %s", record.coordinates, recovery)
                raise InPlaceRecoveryFailed(HandlerFailure(index, exc, record), recovery)
            tracker.record_recovered(record)  # not a success: an abort of the batch leaves its count
            unit.publish(RecordRecovered(unit.listener, unit.worker, record, exc, policy.recoverer.name))
            return


#: What a handler returns when it is an ``async def`` hidden behind a plain function: never something to produce.
_AWAITABLES = (types.CoroutineType, types.AsyncGeneratorType)


def _nothing(result: object) -> int:
    """The emit function before the first result (never called: None results have nothing to emit)."""
    return 0


def _records_to_next_check(started: float, budget: float, handled: int) -> int:
    """How many records to handle before looking at the clock again; 0 once the transaction's time is up."""
    now = time.perf_counter()
    deadline = started + budget
    if now >= deadline:
        return 0
    per_record = (now - started) / handled
    return max(1, min(256, int((deadline - now) / (4 * per_record)) if per_record > 0 else 256))


def _fresh_record() -> Any:
    """A record for the runner to fill (``record.message_record()`` without a Message yet): attempt 1, as it stays
    unless some record is failing."""
    record = object.__new__(_MessageRecord)
    record.attempt = 1
    return record


def _position(step_msgs: Sequence[ConsumedMessage], msg: ConsumedMessage) -> int:
    """Where ``msg`` is in ``step_msgs`` (by identity: Messages compare equal by their fields)."""
    return next(i for i, m in enumerate(step_msgs) if m is msg)


def _attempt(tracker: FailureTracker, msg: ConsumedMessage, step_msgs: Sequence[ConsumedMessage], handled: int) -> int:
    """The attempt number of a record while some record is failing; its pending recovery fails the unit again."""
    state = tracker.state_at(msg.topic(), msg.partition(), msg.offset())
    if state is None:
        return 1
    if state.pending_recovery:  # its recovery failed: retry that, not the handler
        error = state.last_exception or RuntimeError("recovery pending")
        raise HandlerFailure(handled + _position(step_msgs, msg), error, to_record(msg, state.failures))
    return state.failures + 1


def _produce_buffered(
    emitters: ResultEmitters,
    produce: Callable[[PendingOutput], None],
    record: _MessageRecord,
    step_msgs: Sequence[ConsumedMessage],
    handled: int,
) -> int:
    """Produce what the record's handler buffered; a refused output fails the record."""
    output_error = None
    try:
        return emitters.produce_pending(produce)
    except OutputError as exc:
        output_error = exc
    index = handled + _position(step_msgs, record._msg)
    raise HandlerFailure(index, output_error, record)  # outside the except block: no chained context
