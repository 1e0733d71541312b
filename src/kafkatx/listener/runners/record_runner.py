"""The record runner: a handler called once per record, all of a unit's records in one transaction.

Per unit: begin; for each record, call the handler and produce what it
returns (and what it ``send()``\\ s); send the next offsets with the
consumer's group metadata; commit. A handler failure aborts nothing (see
below); only what must be undone whole (a dependency outage, an output the
client refused half-way, a Kafka error) aborts and goes to the after-rollback
path (:mod:`kafkatx.listener.failure.after_rollback`), as does every failure of a
listener with a custom ``after_rollback=`` processor, once the records before
it committed.

The loop in :meth:`RecordRunner._handle` is the hot path: it runs for every
record, so it keeps to local variables, reads the clock once per step of
records, and hands each result to the emit function of its type
(:class:`~kafkatx.result_emitters.ResultEmitters`, chosen once per type), which
produces whatever needs no encoding (bytes, ``(key, value)`` of bytes, an
``Output`` of bytes) straight through confluent-kafka. The emit function is
the one Python call per record kafkatx adds to the handler's: it calls
confluent-kafka itself, with no helper call on the fast path
(``bench/micro_hot_path.py --callgrind`` counts what each shape costs).

A record's work is held until its handler returns: ``send()`` and a
generator's items wait in a per-record buffer (returned values are produced
after the return anyway), so a failed call is undone by dropping that buffer
and the transaction goes on. The failure is settled in the open transaction
(:mod:`kafkatx.listener.failure.failed_record`): called again at once, recovered
(the dead letter commits with the offset), or held: the transaction ends
before the record, the records before it commit, and its partition waits for
the back-off while the rest of the unit is handled next, from memory. A
record's count ends when its offset commits. With
tracing on, the handler is tracing's wrapper, and the root records its
sampler leaves out (99 in 100 at the usual 1%) are run with the listener's
own handler by a countdown the runner holds (``listener.host.UntracedRoots``);
with tracing off that costs a test per record.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import time
import types
from collections.abc import Callable, Iterator, Sequence
from sys import getrefcount
from typing import TYPE_CHECKING, Any, Protocol

from kafkatx.client.offsets import TP, next_offsets
from kafkatx.context import bind_sink
from kafkatx.errors import KafkaClientError
from kafkatx.events import TransactionCommitted
from kafkatx.listener.failure.after_rollback import Replay, after_rollback, recovery_failed
from kafkatx.listener.failure.failed_record import Abandoned, CallAgain, Hold, retry_recovery, settle_failure
from kafkatx.listener.host import (
    ContainerIdentity,
    ContainerLiveness,
    ContainerTransactions,
    HandlerFailure,
    RecordUnit,
    Unit,
    UnitContainerState,
    UnitProducer,
    UntracedRoots,
)
from kafkatx.listener.runners.concurrent import (
    ConcurrentDispatch,
    InPlaceRecoveryFailed,
    NotAwaitedError,
    refuse_awaitable,
)
from kafkatx.listener.runners.cut import Cut
from kafkatx.outputs import PendingOutput, collect_outputs
from kafkatx.record import UNSHARED_REFCOUNT, ConsumedMessage, MessageRecord, Record
from kafkatx.result_emitters import Emit, Flush, HeldOutputs, PartlyProducedError, ResultEmitters
from kafkatx.rollback.processor import DefaultAfterRollbackProcessor

if TYPE_CHECKING:
    from kafkatx.rollback.processor import AfterRollbackProcessor
    from kafkatx.rollback.tracker import FailureTracker

__all__ = ["RecordRunner", "RunnerHost"]

log = logging.getLogger("kafkatx.container")


class RunnerHost(ContainerIdentity, ContainerLiveness, ContainerTransactions, Protocol):
    """What the record runner uses of its container: the declaration, the time budget and the last poll's time,
    the database (a connection that died under a handler is an outage)."""


class RecordRunner:
    """``runner(unit)`` for record listeners (one handler call per record), on the unit and its producer
    (:class:`~kafkatx.listener.host.RecordUnit`: the hot path produces through it)."""

    def __init__(self, container: RunnerHost, processor: AfterRollbackProcessor) -> None:
        self._c = container
        self.spec = container.spec
        self.processor = processor
        #: The listener's own policy settles failures in the open transaction; a custom processor is handed them.
        self._settles = type(processor) is DefaultAfterRollbackProcessor
        self._buffer = HeldOutputs(self.spec.serializer)
        self._kinds: dict[type, int] = {}  # what each type a handler returns is (outputs.result_kind)
        #: ``retry="topics"``: a failed record hops to a retry topic (the container's, which feeds them back).
        self._hops = container.retry_hops
        #: The handler called per record; with retry topics it sees a hop's input record (one call more per
        #: record, for those listeners only).
        self._handler = self.spec.handler if self._hops is None else self._hops.viewing(self.spec.handler)
        # A listener of one topic gets that topic's records only (not with retry topics, whose records come in the
        # same units): the hot path need not ask each Message.
        self._only_topic = self.spec.topics[0] if len(self.spec.topics) == 1 and self._hops is None else None
        self._stopped_at = -1
        self._cut: Cut | None = None
        self._ahead = False  # handling ahead of a commit (listener/loop/overlap.py): a failure is left for later
        #: The concurrent dispatch's failed record settled in its turn, before which its transaction ends.
        self._turn_cut: Cut | None = None
        #: ``in_flight > 1`` or an ``async def`` handler: the unit's records are handled concurrently.
        #: With retry topics, each record passes their gate of key order first (on the loop's thread, in order).
        self._dispatch = (
            ConcurrentDispatch(self.spec, self._hops) if self.spec.in_flight > 1 or self.spec.is_async else None
        )
        #: What re-runs the batch-mates after a rollback: the concurrent dispatch re-runs them together.
        self._replay: Replay = self.replay if self._dispatch is None else self._dispatch

    def __call__(self, unit: RecordUnit, raised: BaseException | None = None) -> None:
        """Run ``unit``'s records in transactions. ``raised``: what handling them ahead of a commit raised
        (listener/loop/overlap.py, nothing produced), taken as if its transaction had raised it."""
        msgs = unit.messages
        while msgs:
            current = unit.with_messages(msgs)
            started = time.perf_counter()
            self._stopped_at, self._cut = -1, None
            work = functools.partial(self._handle if self._dispatch is None else self._dispatched, current, msgs)
            signal: HandlerFailure | InPlaceRecoveryFailed | Abandoned | None = None
            try:
                if raised is not None:
                    ahead, raised = raised, None
                    raise ahead
                if not current.transact(work):
                    return
            except (HandlerFailure, InPlaceRecoveryFailed, Abandoned) as exc:
                signal = exc
            # Outside the except block, so that nothing the handler raises from here on chains to it.
            msgs = self._committed(current, msgs, started) if signal is None else self._signalled(current, msgs, signal)
            signal = None  # its traceback holds this frame: kept here, the two would be a reference cycle

    def _signalled(
        self,
        unit: Unit,
        msgs: list[ConsumedMessage],
        signal: HandlerFailure | InPlaceRecoveryFailed | Abandoned,
    ) -> list[ConsumedMessage]:
        """The transaction was aborted for a failed record, or given up: the records to run next (none: the
        unit is done)."""
        if isinstance(signal, HandlerFailure):
            if type(signal.exc) is NotAwaitedError:  # a programming error, no record's: the container stops
                raise signal.exc
            return after_rollback(unit, msgs, signal, self.processor, self._replay, keep_in_memory=self._in_memory())
        if isinstance(signal, InPlaceRecoveryFailed):
            recovery_failed(unit, msgs, signal.failure, signal.error, self._replay)
        else:  # abandoned: nothing was committed; the records come back on restart
            unit.rewind()
        return []

    def _committed(self, unit: Unit, msgs: list[ConsumedMessage], started: float) -> list[ConsumedMessage]:
        """The transaction committed (all of ``msgs``, or those before a cut or the end of its time): the records to
        run next, from memory (none: the rest, if any, is fetched again)."""
        stopped_at, cut = self._stopped_at, self._taken_cut()
        handled = len(msgs) if stopped_at < 0 else stopped_at
        unit.publish(
            TransactionCommitted(unit.listener, unit.worker, handled, unit.outputs, time.perf_counter() - started)
        )
        if cut is not None:
            return self._after_cut(unit, msgs, cut)
        if stopped_at >= 0:  # the rest of the poll is fetched again for the next transaction
            log.debug(
                "listener %s: transaction time budget (%.3gs) used after %d of %d records",
                unit.listener,
                self._c.transaction_budget,
                stopped_at,
                len(msgs),
            )
            unit.rewind(msgs[stopped_at:])
        return []

    def _taken_cut(self) -> Cut | None:
        """Where the last transaction's work ended on a failure (set by the work, read once)."""
        cut, self._cut = self._cut, None
        return cut

    def _in_memory(self) -> bool:
        """True while the poll is recent enough for its records to be handled from memory (not fetched again)."""
        return time.monotonic() - self._c.polled_at < self._c.transaction_budget

    def _after_cut(self, unit: Unit, msgs: list[ConsumedMessage], cut: Cut) -> list[ConsumedMessage]:
        """The transaction before a failed record committed: hold its partition, or hand it over; the records to
        handle next, from memory (none: they were sought back)."""
        rest = msgs[cut.index :]
        if cut.handover is not None:
            return after_rollback(
                unit.with_messages(rest),
                rest,
                cut.handover,
                self.processor,
                self._replay,
                keep_in_memory=self._in_memory(),
            )
        in_memory = self._in_memory() and not unit.stopping
        hold = cut.hold
        if hold is not None and hold.delay > 0:
            topic, partition = hold.record.topic, hold.record.partition
            held = [m for m in rest if m.partition() == partition and m.topic() == topic]
            rest = [m for m in rest if m.partition() != partition or m.topic() != topic]
            if in_memory:  # handled from memory when the back-off ends
                unit.defer(held, hold.delay)
            else:
                unit.seek((topic, partition), hold.record.offset)
                unit.pause((topic, partition), hold.delay)
        if not in_memory:
            unit.rewind(rest)
            return []
        return rest

    def close(self) -> None:
        """The container is closing: stop the concurrent dispatch's event loop and threads, if any."""
        if self._dispatch is not None:
            self._dispatch.close()

    @property
    def handles_one_at_a_time(self) -> bool:
        """True unless records are handled concurrently (``in_flight > 1`` or an ``async def`` handler)."""
        return self._dispatch is None

    def handle_ahead(self, unit: RecordUnit, msgs: Sequence[ConsumedMessage]) -> int:
        """Handle ``msgs`` into ``unit``, which holds their outputs (the overlapped commit, listener/loop/overlap.py).

        Returns how many were handled before the transaction's time budget ran out, or before a record that
        failed (it is fetched again and fails in a transaction of its own, where it is counted). Called while
        another unit of this runner commits, so the state that unit reads afterwards is kept.
        """
        stopped_at, cut = self._stopped_at, self._cut
        try:
            self._stopped_at, self._ahead = -1, True
            self._handle(unit, msgs)
            return len(msgs) if self._stopped_at < 0 else self._stopped_at
        finally:
            self._stopped_at, self._cut, self._ahead = stopped_at, cut, False

    @contextlib.contextmanager
    def inside_another_commit(self) -> Iterator[None]:
        """Run a unit while another unit of this runner commits (listener/loop/partition_turns.py): the state that
        unit reads once its commit returned (where it stopped, where it was cut) is kept."""
        stopped_at, cut = self._stopped_at, self._cut
        try:
            yield
        finally:
            self._stopped_at, self._cut = stopped_at, cut

    def _dispatched(self, unit: Unit, msgs: Sequence[ConsumedMessage]) -> None:
        """Handle ``msgs`` concurrently (listener/runners/concurrent.py); a prefix of them may be all that commits.

        With retry topics each failed record is settled in its turn (a hop lets the transaction go on, as with one
        record at a time); otherwise the transaction ends at the first, settled here."""
        assert self._dispatch is not None
        settle = functools.partial(self._settle_in_turn, unit) if self._hops is not None else None
        self._turn_cut = None
        handled, failure = self._dispatch.handle(unit, msgs, self._c.transaction_budget, settle)
        offsets = next_offsets(msgs[:handled])
        if failure is not None:
            record = failure.record
            cut = self._taken_turn_cut()  # settled in its turn already, the transaction ending before it
            if cut is None:
                state = unit.tracker.state(record)
                if state is not None and state.pending_recovery:  # its recoverer failed before: not run, recovered
                    cut = Cut.after(retry_recovery(unit, record, self._hops))
                else:
                    cut = self._failed(unit, record, failure.exc, failure.index, False)
            if cut is None:  # recovered in this transaction: its offset commits, the records after it come next
                offsets[(record.topic, record.partition)] = record.offset + 1
                cut = Cut()
                cut.index = failure.index + 1
            else:
                offsets[(record.topic, record.partition)] = record.offset
                cut.index = failure.index
            self._cut, handled = cut, cut.index
        unit.send_offsets(offsets)
        self._stopped_at = handled if handled < len(msgs) else -1

    def _taken_turn_cut(self) -> Cut | None:
        """The cut :meth:`_settle_in_turn` kept (read once)."""
        cut, self._turn_cut = self._turn_cut, None
        return cut

    def _settle_in_turn(self, unit: Unit, index: int, record: Record, exc: BaseException) -> bool:
        """The concurrent dispatch's failed record ``index``, settled in the open transaction in its turn (retry
        topics): True if it was (hopped, or recovered), False if the transaction ends before it (kept for
        :meth:`_dispatched`). An abort raises, as in the one-at-a-time loop."""
        cut = self._failed(unit, record, exc, index, False)
        if cut is None:
            return True
        self._turn_cut = cut
        return False

    def replay(self, record: Record) -> list[PendingOutput]:
        """Run the handler for ``record`` and return its encoded outputs (returned and sent)."""
        if self._dispatch is not None:
            return self._dispatch.replay(record)
        spec, buf = self.spec, self._buffer
        buf.clear()
        previous = bind_sink(buf)
        try:
            collect_outputs(self._handler(record), spec.output, spec.serializer, spec.name, buf)
            return list(buf)
        finally:
            buf.clear()
            bind_sink(previous)

    # -- the hot path ------------------------------------------------------------------
    def _handle(self, unit: RecordUnit, msgs: Sequence[ConsumedMessage]) -> None:
        """Handle ``msgs`` in the open transaction, producing each record's outputs, then send the offsets."""
        buf = self._buffer
        emitters = self._emitters(unit)
        # The untraced roots' handler is the listener's own: with key order every record passes the gate first.
        roots = self.spec.untraced_roots if self._hops is None or self._hops.keys is None else None
        handler, handled = _transaction_handler(self._handler, roots)
        previous = bind_sink(buf)
        try:
            outputs, offsets = self._handle_records(unit, msgs, emitters, handler)
            unit.outputs += outputs
            unit.send_offsets(offsets)
        finally:
            handled()
            buf.clear()
            emitters.close()
            bind_sink(previous)

    def _handle_records(
        self,
        unit: RecordUnit,
        msgs: Sequence[ConsumedMessage],
        emitters: ResultEmitters,
        handler: Callable[[Record], Any],
    ) -> tuple[int, dict[TP, int]]:
        """Per record: refill the record, call the handler, produce its result, then what it buffered (see the module).
        Returns how many outputs it produced and the offsets to commit."""
        buf, tracker, in_place, only_topic = self._buffer, unit.tracker, self.spec.retry == "in_place", self._only_topic
        failing = bool(tracker)  # a bool tests cheaper per record; the unit adds slots only for records it handled
        emitter_for, flush = emitters.emitter, emitters.flush
        shape: type = type(None)  # the type of the last result, and its emit function
        emit: Emit = _nothing
        offsets: dict[TP, int] = {}
        run_topic, run_partition, run_last = None, -1, -1  # the current run of one partition's records
        outputs = handled = 0
        started, step, budget, unshared = time.perf_counter(), 1, self._c.transaction_budget, UNSHARED_REFCOUNT
        record: Any = _fresh_record()
        while step:  # a step of records between two looks at the clock
            step_msgs = msgs[handled : handled + step]
            walk = iter(step_msgs)  # what it has left says where a failed record is (_position), at no cost per record
            for msg in walk:
                topic = msg.topic() if only_topic is None else only_topic
                partition, offset = msg.partition(), msg.offset()
                # record.message_record(), inlined: the last record is refilled unless held (UNSHARED_REFCOUNT)
                if getrefcount(record) > unshared:
                    record = _fresh_record()
                record.message, record.offset = msg, offset
                record.topic, record.partition = topic, partition
                record.key, record.value = msg.key(), msg.value()
                error = cut = None
                if failing and _settled_before(tracker, record, msg):  # its recoverer failed before: recover it
                    cut = Cut.after(retry_recovery(unit, record, self._hops))
                else:
                    try:
                        result = handler(record)
                        if result is not None:
                            if type(result) is not shape:  # a handler mostly returns one type: its emit is at hand
                                shape = type(result)
                                emit = emitter_for(shape)
                            outputs += emit(result)
                        if buf:  # what it sent (or an iterable's items), held until it returned
                            outputs += flush()
                    except Exception as exc:
                        error = exc
                if error is not None:  # outside the except block: no chained context
                    cut = self._failed(unit, record, error, handled + _position(step_msgs, walk), in_place, flush)
                    # Its traceback holds this frame: left here, the two would be a cycle keeping the unit's
                    # messages (and the whole stack's frames) until the cyclic collector found it.
                    error = None
                if partition != run_partition or topic != run_topic:
                    run_topic, run_partition = _next_run(offsets, run_topic, run_partition, run_last, topic, partition)
                run_last = offset
                if cut is not None:  # the transaction ends before this record: its own offset commits (Cut)
                    run_last = offset - 1
                    cut.index = self._stopped_at = handled + _position(step_msgs, walk)
                    self._cut = cut
                    break
            else:
                handled += len(step_msgs)
                step = _records_to_next_check(started, budget, handled, len(msgs))
                self._stopped_at = (
                    handled if handled < len(msgs) else -1
                )  # if the time is up: the rest is fetched again
                continue
            break
        _next_run(offsets, run_topic, run_partition, run_last, None, -1)
        return outputs, offsets

    def _failed(
        self,
        unit: Unit,
        record: Record,
        error: BaseException,
        index: int,
        in_place: bool,
        flush: Flush | None = None,
    ) -> Cut | None:
        """A record's call raised: its held work is dropped, and the failure settled in the open transaction.

        None: it was called again and succeeded (its outputs produced through ``flush``), or recovered; a
        :class:`Cut`: the transaction ends before it. What must be undone whole raises :class:`HandlerFailure`
        (an abort): an outage (the listener waits, nothing is counted), a client error, a declaration error, an
        output refused after others of the record went out. Without ``flush`` (the concurrent dispatch) a retry
        is not called here: the record comes first in the next transaction.
        """
        buf = self._buffer
        buf.clear()
        if self._ahead:  # handled ahead of a commit: fetched again, it fails in a transaction of its own
            return Cut()  # (handle_ahead reports where it stopped; the rest is fetched again)
        again: Exception | None = None
        try:
            while True:
                if type(error) is PartlyProducedError:  # some of its outputs are in the transaction: only an abort
                    raise HandlerFailure(index, error.error, record)
                if isinstance(error, KafkaClientError) and type(error) is not NotAwaitedError:
                    raise error  # the client's or the transaction's state failed (producing its outputs): KIP-1050
                if self._aborts_for(unit, error):
                    raise HandlerFailure(index, error, record)
                if not self._settles:  # a custom after-rollback processor decides, once the records before it commit
                    return Cut(handover=HandlerFailure(0, error, record))
                outcome = settle_failure(unit, record, error, wait_in_transaction=in_place, hops=self._hops)
                if not isinstance(outcome, CallAgain):
                    return Cut.after(outcome)
                if flush is None:
                    return Cut(Hold(record, error, 0.0))
                record = outcome.record
                again = self._called_again(unit, record, flush)
                if again is None:
                    return None
                buf.clear()
                error = again
        finally:
            # A traceback holds the frames its exception passed through, and each frame its caller: this frame,
            # still holding the exception when it returns, would make a reference cycle of the whole stack.
            del error, again

    def _called_again(self, unit: Unit, record: Record, flush: Flush) -> Exception | None:
        """Call the handler for ``record`` again in the open transaction, its outputs produced through ``flush``;
        what it raised, if it did. (Caught here, the exception's traceback holds this frame, which lets go of it
        when it returns: held by the caller's frame it would make a reference cycle.)"""
        spec, buf = self.spec, self._buffer
        try:
            collect_outputs(self._handler(record), spec.output, spec.serializer, spec.name, buf)
            if buf:
                unit.outputs += flush()
        except Exception as exc:
            return exc
        return None

    def _aborts_for(self, unit: UnitContainerState, error: BaseException) -> bool:
        """True if ``error`` is no record's failure and must undo the whole transaction: an outage (the listener
        waits), a declaration error. With ``database=``, a connection that died under the handler raises the
        outage itself (:class:`~kafkatx.database.session.DatabaseUnavailableError`)."""
        if unit.outage.matches(error) or type(error) is NotAwaitedError:
            return True
        database = self._c.database
        unavailable = database.lost_connection(error) if database is not None else None
        if unavailable is not None:
            raise unavailable
        return False

    def _emitters(self, unit: UnitProducer) -> ResultEmitters:
        """The transaction's emit functions, over an empty buffer that holds a record's ``send()``\\ s and
        iterable's items until its handler returned."""
        buf = self._buffer
        buf.clear()
        emitters = ResultEmitters(
            self.spec.output,
            self.spec.serializer,
            self.spec.name,
            buf,
            unit.direct,
            unit.producer.produce,
            kinds=self._kinds,
        )
        refuse = functools.partial(refuse_awaitable, self.spec.name)
        emitters.by_type.update(dict.fromkeys(_AWAITABLES, refuse))
        return emitters


#: What a handler returns when it is an ``async def`` hidden behind a plain function: never something to produce.
_AWAITABLES = (types.CoroutineType, types.AsyncGeneratorType)


def _nothing(result: object) -> int:
    """The emit function before the first result (never called: None results have nothing to emit)."""
    return 0


def _records_to_next_check(started: float, budget: float, handled: int, total: int) -> int:
    """How many records to handle before looking at the clock again; 0 once all ``total`` are handled or the
    transaction's time is up."""
    if handled >= total:
        return 0
    now = time.perf_counter()
    deadline = started + budget
    if now >= deadline:
        return 0
    per_record = (now - started) / handled
    return max(1, min(256, int((deadline - now) / (4 * per_record)) if per_record > 0 else 256))


def _fresh_record() -> Any:
    """A record for the runner to fill (``record.message_record()`` without a Message yet): attempt 1, as it stays
    unless some record is failing."""
    record = object.__new__(MessageRecord)
    record.attempt = 1
    return record


def _position(step_msgs: Sequence[ConsumedMessage], walk: Iterator[ConsumedMessage]) -> int:
    """Where the record the loop is at is in ``step_msgs``: ``walk``, the loop's iterator over them, has the ones
    after it left (a search for it would cost a scan of the step per failure)."""
    return len(step_msgs) - operator.length_hint(walk) - 1


def _settled_before(tracker: FailureTracker, record: Any, msg: ConsumedMessage) -> bool:
    """While some record is failing: set ``record``'s attempt number (it is 1 otherwise); True if its recoverer
    failed before (its recovery is retried, not its handler: attempt 0)."""
    state = tracker.state_at(msg.topic(), msg.partition(), msg.offset())
    record.attempt = 1 if state is None else 0 if state.pending_recovery else state.failures + 1
    return not record.attempt


def _next_run(
    offsets: dict[TP, int], topic: str | None, partition: int, last: int, next_topic: str | None, next_partition: int
) -> tuple[str | None, int]:
    """A run of one partition's records ended at offset ``last`` (none yet: ``topic`` None): its next offset to
    commit; the next run is ``next_topic``'s ``next_partition``."""
    if topic is not None:
        offsets[(topic, partition)] = last + 1
    return next_topic, next_partition


def _transaction_handler(
    handler: Callable[[Record], Any], roots: UntracedRoots | None
) -> tuple[Callable[[Record], Any], Callable[[], None]]:
    """The handler a transaction's records are called with, and what to call once they were.

    With tracing sampling root records at a ratio (``roots``), the root records its sampler leaves out (99 in 100
    at the usual 1%) run with the listener's own handler, by a countdown taken from ``roots`` and given back at the
    end; otherwise the listener's handler itself, with nothing to give back."""
    if roots is None:
        return handler, _nothing_left
    untraced, skip = roots.handler, 0

    def sampled(record: Record) -> Any:
        nonlocal skip
        if skip and not record.message.headers():  # type: ignore[attr-defined]  # a root record the sampler leaves out
            skip -= 1
            return untraced(record)
        result = handler(record)
        skip = skip or roots.take()  # the traced handler may have drawn the next count
        return result

    def give_back() -> None:
        if skip:
            roots.give_back(skip)

    return sampled, give_back


def _nothing_left() -> None:
    """A transaction's handler without tracing's countdown: nothing to give back."""
