"""Records of one transaction handled concurrently: ``in_flight > 1``, or an ``async def`` handler.

The transaction stays the unit (docs/CONCURRENCY.md). Within it, up to
``in_flight`` records run at once, on an event loop the container thread
owns: an ``async def`` handler is awaited there, a plain one runs on a
thread pool of ``in_flight`` threads. :class:`LaneSchedule` decides which
record may start: the lowest index first, one at a time per ordering lane
(the record's key, its partition, or itself), so records of one lane are
handled in offset order.

Outputs are produced in input order, for the whole batch: a record's
outputs wait until every record before it finished (:class:`_BatchRun`).
That keeps each key's outputs in input order, and it makes what a
transaction commits a prefix of its records, exactly as the one-at-a-time
runner does:

- a failing record stops new records past it from starting; those in
  flight finish; the records before it all ran and commit, and the runner
  settles the failure in the same transaction
  (:mod:`kafkatx.listener.failure.failed_record`); the records after it are handled
  again in the next transaction;
- the transaction's time budget, or a stop, ends the batch at the first
  record not started yet: what is in flight finishes, the prefix commits,
  and the rest is fetched again.

With ``retry="topics"`` a gate (:class:`RecordGate`, the listener's retry
topics) stands before each record's call, asked on the loop's thread as the
record starts: a record read back becomes its input record, one that follows
its key's record in retry is not called (the hop that sends it is its
output), and a retry record takes its lane by its input topic. A failed record
is settled in its turn among the outputs (its hop, or its dead letter) and the
batch goes on past it; its lane waits until then, so that the next record of
its key is gated knowing what became of it.

With ``retry="in_place"`` a record's attempts run in its own task (the
decisions on the loop's thread, as the one-at-a-time runner takes them), and
a record the policy gives up is recovered inside the transaction in its turn
among the outputs.

``send()`` reaches the record's own buffer from its task or pool thread (a
context variable, bound per record), and the pool's threads carry the
container's thread name, which log lines are attributed by.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
import types
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Protocol

from kafkatx.context import bind_sink
from kafkatx.errors import InvalidConfigurationError, KafkaClientError, OutputError, RecoveryError
from kafkatx.events import RecordRecovered
from kafkatx.listener.failure.failed_record import Abandoned
from kafkatx.listener.host import (
    BatchSettings,
    FailureSettings,
    HandlerFailure,
    HandlerSettings,
    UnitBooks,
    UnitContainerState,
    UnitRecovery,
    UnitTransaction,
)
from kafkatx.listener.runners.lanes import LaneSchedule, lane_keys, lanes_of
from kafkatx.outputs import PendingOutput, collect_outputs, unproducible_stop
from kafkatx.record import ConsumedMessage, Record, to_record
from kafkatx.rollback.decision import decide_failure
from kafkatx.rollback.policy import Action, Verdict

log = logging.getLogger("kafkatx.container")

__all__ = [
    "Abandoned",
    "ConcurrentDispatch",
    "DispatchSettings",
    "DispatchUnit",
    "InPlaceRecoveryFailed",
    "NotAwaitedError",
    "RecordGate",
    "SettleInTurn",
    "refuse_awaitable",
]


#: ``settle(index, record, exc)``: settle record ``index``'s failure in the open transaction; True if it was (the
#: batch goes on past it), False if the transaction must end before it (the runner keeps how).
SettleInTurn = Callable[[int, Record, BaseException], bool]


class RecordGate(Protocol):
    """What stands before a record's handler (``retry="topics"``: kafkatx.retry_topics.hops): whether the record
    runs, with which view of it, and which lane it takes turns in."""

    def admit(self, record: Record) -> Record | list[PendingOutput]:
        """The record to call the handler with, or the outputs that stand for its handling (it is not called)."""
        ...

    def ran(self, record: Record, seen: Record) -> None:
        """The handler admitted for ``record`` returned, called with ``seen``."""
        ...

    def input_topic(self, topic: str) -> str:
        """The topic a record of ``topic`` takes its lane by."""
        ...


class DispatchSettings(HandlerSettings, BatchSettings, FailureSettings, Protocol):
    """What the dispatch reads of the listener's declaration: the handler and its outputs, ``in_flight``,
    ``ordering`` and ``is_async``, and ``retry``."""


class DispatchUnit(UnitBooks, UnitContainerState, UnitTransaction, UnitRecovery, Protocol):
    """What the dispatch uses of a unit: it produces the records' outputs in order, decides and recovers failures in
    place (``retry="in_place"``), and stops starting records when the container stops. No positions: the runner
    moves them."""


class _Sink(list[PendingOutput]):
    """One record's outputs: what it ``send()``\\ s, then what it returns (encoded, in that order)."""

    __slots__ = ("serializer",)
    stream = None  # send() produces through no stream: the record's outputs wait for their turn

    def __init__(self, serializer: Any) -> None:
        super().__init__()
        self.serializer = serializer

    add = list.append


class ConcurrentDispatch:
    """Handles a unit's records concurrently for the record runner (see the module's docstring).

    One per container, used by the container's thread only: its event loop
    and (for a plain handler) its thread pool live as long as the container.
    """

    def __init__(self, spec: DispatchSettings, gate: RecordGate | None = None) -> None:
        """``gate``: decides before each record's call whether it runs, and on which view (retry topics); it is
        asked on the loop's thread (the container's), in the order records start, one lane's in offset order."""
        self.spec = spec
        self.gate = gate
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: ThreadPoolExecutor | None = None

    # -- the runner's side ---------------------------------------------------------------
    def handle(
        self,
        unit: DispatchUnit,
        msgs: Sequence[ConsumedMessage],
        budget: float,
        settle: SettleInTurn | None = None,
    ) -> tuple[int, HandlerFailure | None]:
        """Handle ``msgs`` in the open transaction; return how many of them (a prefix) are done, and the failure
        of the record right after that prefix, if one failed (every record before it done and produced).

        Sends no offsets: the runner settles the failure first (listener/failure/failed_record.py), or, with
        ``settle``, each failed record is settled in its turn among the outputs, and the batch goes on past it
        unless ``settle`` says the transaction must end before it (that record is then the failure returned,
        settled already). Its lane waits for that: the next record of its key starts knowing what became of it.
        """
        run = _BatchRun(self, unit, msgs, budget, settle)
        self.event_loop().run_until_complete(run.finished)
        failure, cut = run.failure, run.schedule.cut
        return cut, failure if failure is not None and failure.index == cut else None

    def replay(self, record: Record) -> list[PendingOutput]:
        """Run the handler for ``record`` (after a rollback) and return its encoded outputs."""
        gate, seen = self.gate, record
        if gate is not None:
            admitted = gate.admit(record)
            if isinstance(admitted, list):
                return admitted
            seen = admitted
        if self.spec.is_async:
            outputs = self.event_loop().run_until_complete(self.call_async(seen))
        else:
            outputs = self.call(seen)
        if gate is not None:
            gate.ran(record, seen)
        return outputs

    __call__ = replay

    def replay_all(self, records: Sequence[Record]) -> list[list[PendingOutput] | BaseException | None]:
        """Re-run ``records`` (after a rollback) concurrently, each lane in order, up to the first failure.

        Returns each record's outputs or exception, in order: every record before the first failure has its
        outputs; what comes after it may not have run (None).
        """
        return self.event_loop().run_until_complete(self._replay_all(records))

    async def _replay_all(self, records: Sequence[Record]) -> list[list[PendingOutput] | BaseException | None]:
        topic_of = self.gate.input_topic if self.gate is not None else _same
        lanes = lane_keys(((topic_of(r.topic), r.partition, r.raw_key) for r in records), self.spec.ordering)
        schedule = LaneSchedule(lanes, self.spec.in_flight)
        outcomes: list[list[PendingOutput] | BaseException | None] = [None] * len(records)
        running: dict[asyncio.Future[list[PendingOutput]], int] = {}
        while True:
            index = schedule.take()
            while index is not None:
                running[self.start(records[index])] = index
                index = schedule.take()
            if not running:
                return outcomes
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = running.pop(future)
                schedule.finished(index)
                error = future.exception()
                outcomes[index] = future.result() if error is None else error
                if error is not None:
                    schedule.stop_at(index)

    def close(self) -> None:
        """Stop the thread pool and close the event loop (the container is closing; nothing is in flight)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        loop, self._loop = self._loop, None
        if loop is not None:
            try:  # what handlers left on the loop: async generators, the default executor's threads
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                loop.close()

    # -- one record ---------------------------------------------------------------------
    def call(self, record: Record) -> list[PendingOutput]:
        """A plain handler's call for ``record`` (on a pool thread), and its encoded outputs."""
        spec = self.spec
        sink = _Sink(spec.serializer)
        previous = bind_sink(sink)
        try:
            result = spec.handler(record)
            if result is not None:
                if inspect.isawaitable(result):
                    refuse_awaitable(spec.name, result)
                collect_outputs(result, spec.output, spec.serializer, spec.name, sink)
        finally:
            bind_sink(previous)
        return sink

    async def call_async(self, record: Record) -> list[PendingOutput]:
        """An ``async def`` handler awaited for ``record`` (in a task of its own: its own ``send()`` sink)."""
        spec = self.spec
        sink = _Sink(spec.serializer)
        bind_sink(sink)  # the task's own context: no other record's
        result = await spec.handler(record)
        if result is not None:
            collect_outputs(result, spec.output, spec.serializer, spec.name, sink)
        return sink

    def start(self, record: Record, unit: DispatchUnit | None = None) -> asyncio.Future[Any]:
        """Start handling ``record`` on the loop (a task) or the pool (a future of the loop).

        With ``unit`` and ``retry="in_place"``, a failed attempt is retried (or left to recover) in the task.
        With a :attr:`gate`, the handler is called with what it admits, or not at all (a future done already
        with the outputs that stand for the record's handling).
        """
        gate = self.gate
        if gate is None:
            return self._start(record, unit)
        admitted = gate.admit(record)
        if isinstance(admitted, list):  # not called: it passes, or follows its key's record in retry
            passed: asyncio.Future[list[PendingOutput]] = self.event_loop().create_future()
            passed.set_result(admitted)
            return passed
        future = self._start(admitted, unit)
        if admitted is not record:  # read back from a retry topic: noted handled once its call returned
            future.add_done_callback(functools.partial(_ran, gate, record, admitted))
        return future

    def _start(self, record: Record, unit: DispatchUnit | None) -> asyncio.Future[Any]:
        loop = self.event_loop()
        if unit is not None and self.spec.retry == "in_place":
            return loop.create_task(self._in_place(unit, record))
        if self.spec.is_async:
            task: asyncio.Future[list[PendingOutput]] = loop.create_task(self.call_async(record))
            return task
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                self.spec.in_flight, initializer=_name_thread, initargs=(threading.current_thread().name,)
            )
        future: asyncio.Future[list[PendingOutput]] = loop.run_in_executor(self._pool, self.call, record)
        return future

    async def _in_place(self, unit: DispatchUnit, record: Record) -> list[PendingOutput] | _Recover:
        """``retry="in_place"``: attempts of ``record`` until one succeeds, or the policy says to recover it.

        The decisions are taken on the loop's thread (the container's), as the
        one-at-a-time runner takes them; an attempt's outputs are discarded with it.
        """
        while True:
            error: Exception | None = None
            try:
                return await (self.call_async(record) if self.spec.is_async else self.start(record))
            except Exception as exc:
                error = exc
            if isinstance(error, KafkaClientError) and not isinstance(error, OutputError):
                raise error  # the client or a declaration error: no record's failure
            stop = unproducible_stop(unit.listener, error)
            if stop is not None:  # a programming error: the container stops, the transaction is not committed
                raise stop
            if unit.outage.matches(error):  # a dependency is down: the batch aborts and the listener pauses
                raise error
            verdict, failures = in_place_verdict(unit, record, error)
            if verdict.action is Action.RECOVER:
                return _Recover(replace(record, attempt=failures), error)
            deadline = time.monotonic() + verdict.delay
            while not unit.stopping and time.monotonic() < deadline:
                await asyncio.sleep(min(0.05, deadline - time.monotonic()))
            if unit.stopping:
                raise Abandoned
            record = replace(record, attempt=failures + 1)

    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The container's event loop, created on first use (on the container's thread: the one that uses it)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.new_event_loop()
        return loop


def in_place_verdict(unit: DispatchUnit, record: Record, error: BaseException) -> tuple[Verdict, int]:
    """A failed in-place attempt of ``record``: decided by :func:`~kafkatx.rollback.decision.decide_failure`,
    with the failures so far. Abandoned is raised when the container stops; on a retry the caller waits."""
    verdict = decide_failure(unit, record, error)
    if verdict.action is Action.ABANDON:
        raise Abandoned
    return verdict, verdict.attempt


class InPlaceRecoveryFailed(Exception):
    """Internal: an in-place recovery failed; the unit goes to the recovery-failed path."""

    def __init__(self, failure: HandlerFailure, error: RecoveryError) -> None:
        super().__init__(failure, error)
        self.failure, self.error = failure, error


class _Failed:
    """A record whose call failed, its failure settled when its turn to produce comes (``settle`` given)."""

    __slots__ = ("record", "exc")

    def __init__(self, record: Record, exc: BaseException) -> None:
        self.record, self.exc = record, exc


class _Recover:
    """An in-place record whose attempts are over: recovered when its turn to produce comes."""

    __slots__ = ("record", "exc")

    def __init__(self, record: Record, exc: BaseException) -> None:
        self.record, self.exc = record, exc


class NotAwaitedError(InvalidConfigurationError):
    """A plain handler returned a coroutine: a declaration error (it fails every record alike), no record's failure."""


def refuse_awaitable(listener: str, result: Any) -> int:
    """What a coroutine returned by a plain handler gets: the container stops, nothing is dead-lettered."""
    if type(result) is types.CoroutineType:
        result.close()  # never awaited, on purpose: no RuntimeWarning about it
    raise NotAwaitedError(
        f"listener {listener!r}: its handler returned a {type(result).__name__} (an async def behind a plain "
        "function or decorator?); kafkatx does not await it, so no record was handled or dead-lettered: "
        "declare the handler itself async def (kafkatx awaits it), or def"
    )


def _error_of(future: asyncio.Future[Any]) -> BaseException | None:
    return asyncio.CancelledError() if future.cancelled() else future.exception()


def _is_record_failure(error: BaseException | None) -> bool:
    """True if ``error`` is the record's own failure (not the client's, a declaration's, a stop's or an interrupt)."""
    return isinstance(error, Exception) and not (
        isinstance(error, (KafkaClientError, Abandoned)) and not isinstance(error, OutputError)
    )


def _ran(gate: RecordGate, record: Record, seen: Record, future: asyncio.Future[Any]) -> None:
    """A gated record's call ended: the gate is told if its handler returned."""
    if not future.cancelled() and future.exception() is None:
        gate.ran(record, seen)


def _same(topic: str) -> str:
    return topic


def _name_thread(name: str) -> None:
    """A pool thread takes the container thread's name: log lines are attributed to the listener by it."""
    threading.current_thread().name = name


class _BatchRun:
    """One pass of a unit's records through a :class:`LaneSchedule`, driven by completions on the loop."""

    def __init__(
        self,
        dispatch: ConcurrentDispatch,
        unit: DispatchUnit,
        msgs: Sequence[ConsumedMessage],
        budget: float,
        settle: SettleInTurn | None = None,
    ) -> None:
        self._dispatch, self._unit, self._msgs = dispatch, unit, msgs
        self._settle_in_turn = settle
        self._deadline = time.perf_counter() + budget
        gate = dispatch.gate
        lanes = lanes_of(msgs, dispatch.spec.ordering, gate.input_topic if gate is not None else None)
        self.schedule = LaneSchedule(lanes, dispatch.spec.in_flight)
        self._records: dict[int, Record] = {}
        self._started = False
        self._running: dict[int, asyncio.Future[Any]] = {}
        self._done: dict[int, list[PendingOutput] | _Recover | _Failed] = {}  # finished, past the produced prefix
        self._next_to_produce = 0
        self.failure: HandlerFailure | None = None
        self._error: BaseException | None = None  # a client error: the whole transaction fails with it
        self.finished: asyncio.Future[None] = dispatch.event_loop().create_future()
        self._start_more()

    def _start_more(self) -> None:
        schedule, unit, dispatch = self.schedule, self._unit, self._dispatch
        try:
            while True:
                if unit.stopping or (self._started and time.perf_counter() >= self._deadline):
                    schedule.stop_starting()  # what is in flight finishes; the rest is fetched again
                index = schedule.take()
                if index is None:
                    break
                record = self._record(index)
                if record is not None:
                    self._records[index] = record
                    self._started = True  # the time budget is checked once a record has started: progress, always
                    future = self._running[index] = dispatch.start(record, unit)  # the loop keeps tasks weakly
                    future.add_done_callback(functools.partial(self._finished_one, index))
        except BaseException as exc:  # noqa: BLE001 - a callback's error would otherwise leave the batch hanging
            self._error = self._error or exc
            schedule.stop_starting()
        if schedule.idle and not self.finished.done():
            if self._error is not None:
                self.finished.set_exception(self._error)
            else:
                self.finished.set_result(None)

    def _record(self, index: int) -> Record | None:
        """Record ``index`` with its attempt; None (and a failure) if its pending recovery must come first."""
        msg, tracker = self._msgs[index], self._unit.tracker
        if not tracker:
            return to_record(msg)
        state = tracker.state_at(msg.topic(), msg.partition(), msg.offset())
        if state is None:
            return to_record(msg)
        if state.pending_recovery:  # its recovery failed: retry that, not the handler
            error = state.last_exception or RuntimeError("recovery pending")
            self._failed(index, to_record(msg, state.failures), error)
            self.schedule.finished(index)
            return None
        return to_record(msg, state.failures + 1)

    def _finished_one(self, index: int, future: asyncio.Future[Any]) -> None:
        del self._running[index]
        # A failure settled in its turn holds its lane until then (_settle_failed).
        held = self._settle_in_turn is not None and _is_record_failure(_error_of(future))
        self.schedule.finished(index, hold_lane=held)
        try:
            self._settle(index, future)
        except BaseException as exc:  # noqa: BLE001 - as in _start_more
            self._error = self._error or exc
            self.schedule.stop_starting()
        self._start_more()

    def _settle(self, index: int, future: asyncio.Future[Any]) -> None:
        """Record ``index`` finished: count its success and produce what is due, or note its failure."""
        record = self._records.pop(index)
        error = _error_of(future)
        if error is None:
            outcome = future.result()
            self._done[index] = outcome  # a success's count ends when its offset commits
            self._produce_prefix()
        elif _is_record_failure(error):
            if self._settle_in_turn is not None:
                self._done[index] = _Failed(record, error)
                self._produce_prefix()
            else:
                self._failed(index, record, error)
        else:  # the client failed, a declaration error, a stop during a back-off, KeyboardInterrupt: no record's
            self._error = self._error or error
            self.schedule.stop_starting()

    def _failed(self, index: int, record: Record, error: BaseException) -> None:
        if self.failure is None or index < self.failure.index:
            self.failure = HandlerFailure(index, error, record)
        self.schedule.stop_at(index)

    def _produce_prefix(self) -> None:
        """Produce the outputs of the finished records that every earlier record of the batch precedes."""
        done, cut, unit = self._done, self.schedule.cut, self._unit
        index = self._next_to_produce
        while index < cut and index in done:
            outcome = done.pop(index)
            try:
                if isinstance(outcome, _Failed):
                    if not self._settle_failed(index, outcome):
                        return
                elif isinstance(outcome, _Recover):
                    if not self._recover(index, outcome):
                        return
                else:
                    for out in outcome:
                        unit.produce(out)  # counted in unit.outputs
            except OutputError as exc:  # an output the client refused: that record's failure
                self._failed(index, to_record(self._msgs[index]), exc)
                return
            except KafkaClientError as exc:
                self._error = self._error or exc
                self.schedule.stop_starting()
                return
            index += 1
        self._next_to_produce = index

    def _settle_failed(self, index: int, outcome: _Failed) -> bool:
        """Settle a failed record in the open transaction, in its turn, and free its lane. False if the
        transaction must end before it: it is then the batch's failure (settled already)."""
        settle = self._settle_in_turn
        assert settle is not None
        settled = settle(index, outcome.record, outcome.exc)
        self.schedule.release(index)
        if not settled:
            self.failure = HandlerFailure(index, outcome.exc, outcome.record)
            self.schedule.stop_at(index)
        return settled

    def _recover(self, index: int, outcome: _Recover) -> bool:
        """Recover an in-place record in the open transaction, in its turn. False if the recoverer failed."""
        unit = self._unit
        policy, record, exc = unit.policy, outcome.record, outcome.exc
        try:
            unit.recover(policy.recoverer, record, exc, confirm=False)
        except RecoveryError as error:
            log.warning("in-place recovery of %s failed: %s", record.coordinates, error)
            self._error = self._error or InPlaceRecoveryFailed(HandlerFailure(index, exc, record), error)
            self.schedule.stop_at(index)
            return False
        unit.tracker.record_recovered(record)  # not a success: an abort of the batch leaves its count
        unit.publish(RecordRecovered(unit.listener, unit.worker, record, exc, policy.recoverer.name))
        return True
