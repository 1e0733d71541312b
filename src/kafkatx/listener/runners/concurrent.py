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
import heapq
import inspect
import logging
import threading
import time
import types
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
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
    "LaneSchedule",
    "NotAwaitedError",
    "lanes_of",
    "refuse_awaitable",
]


def lanes_of(msgs: Sequence[ConsumedMessage], ordering: str) -> list[Hashable]:
    """Each record's ordering lane: records of one lane are handled one at a time, in order.

    ``"key"``: its topic and key (a record without a key: its partition);
    ``"partition"``: its partition; ``"none"``: itself.
    """
    return _lanes(((m.topic(), m.partition(), m.key()) for m in msgs), ordering)


def _lanes(coordinates: Iterable[tuple[str, int, bytes | None]], ordering: str) -> list[Hashable]:
    """The lanes of records given as ``(topic, partition, key)``."""
    if ordering == "none":
        return list(range(len(list(coordinates))))
    if ordering == "partition":
        return [(topic, partition) for topic, partition, _ in coordinates]
    return [(topic, partition) if key is None else (topic, key) for topic, partition, key in coordinates]


class LaneSchedule:
    """Which record may start next: the lowest index whose lane is free, at most ``in_flight`` at once.

    ``cut`` is the first index that may not start (the batch's end, a
    failed record, or the first record not started when time ran out);
    records before it in a busy lane still start once their lane frees up.
    """

    def __init__(self, lanes: Sequence[Hashable], in_flight: int) -> None:
        self._lane_of = lanes
        self._in_flight = in_flight
        self._queues: dict[Hashable, deque[int]] = {}
        for index, lane in enumerate(lanes):
            queue = self._queues.get(lane)
            if queue is None:
                queue = self._queues[lane] = deque()
            queue.append(index)
        self._ready = sorted(q[0] for q in self._queues.values())  # a sorted list is a heap
        self._started = bytearray(len(lanes))
        self._lowest_unstarted = 0
        self.running = 0
        self.cut = len(lanes)

    def take(self) -> int | None:
        """The next record to start, or None (all lanes busy, ``in_flight`` reached, or nothing left)."""
        ready = self._ready
        if self.running >= self._in_flight or not ready or ready[0] >= self.cut:
            return None
        index = heapq.heappop(ready)
        self.running += 1
        self._started[index] = 1
        return index

    def finished(self, index: int) -> None:
        """Record ``index`` finished: the next record of its lane may start."""
        self.running -= 1
        queue = self._queues[self._lane_of[index]]
        queue.popleft()
        if queue:
            heapq.heappush(self._ready, queue[0])

    def stop_at(self, index: int) -> None:
        """Start no record at or past ``index``."""
        self.cut = min(self.cut, index)

    def stop_starting(self) -> None:
        """Start no record that has not started yet (time is up, or the container stops)."""
        started, low = self._started, self._lowest_unstarted
        while low < len(started) and started[low]:
            low += 1
        self._lowest_unstarted = low
        self.stop_at(low)

    @property
    def idle(self) -> bool:
        """Nothing runs and nothing more may start: the batch is over."""
        return self.running == 0 and (not self._ready or self._ready[0] >= self.cut)


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

    def __init__(self, spec: DispatchSettings) -> None:
        self.spec = spec
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: ThreadPoolExecutor | None = None

    # -- the runner's side ---------------------------------------------------------------
    def handle(
        self, unit: DispatchUnit, msgs: Sequence[ConsumedMessage], budget: float
    ) -> tuple[int, HandlerFailure | None]:
        """Handle ``msgs`` in the open transaction; return how many of them (a prefix) are done, and the failure
        of the record right after that prefix, if one failed (every record before it done and produced).

        Sends no offsets: the runner settles the failure first (listener/failure/failed_record.py).
        """
        run = _BatchRun(self, unit, msgs, budget)
        self.event_loop().run_until_complete(run.finished)
        failure, cut = run.failure, run.schedule.cut
        return cut, failure if failure is not None and failure.index == cut else None

    def replay(self, record: Record) -> list[PendingOutput]:
        """Run the handler for ``record`` (after a rollback) and return its encoded outputs."""
        if self.spec.is_async:
            return self.event_loop().run_until_complete(self.call_async(record))
        return self.call(record)

    __call__ = replay

    def replay_all(self, records: Sequence[Record]) -> list[list[PendingOutput] | BaseException | None]:
        """Re-run ``records`` (after a rollback) concurrently, each lane in order, up to the first failure.

        Returns each record's outputs or exception, in order: every record before the first failure has its
        outputs; what comes after it may not have run (None).
        """
        return self.event_loop().run_until_complete(self._replay_all(records))

    async def _replay_all(self, records: Sequence[Record]) -> list[list[PendingOutput] | BaseException | None]:
        lanes = _lanes(((r.topic, r.partition, r.key) for r in records), self.spec.ordering)
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
        """
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


def _name_thread(name: str) -> None:
    """A pool thread takes the container thread's name: log lines are attributed to the listener by it."""
    threading.current_thread().name = name


class _BatchRun:
    """One pass of a unit's records through a :class:`LaneSchedule`, driven by completions on the loop."""

    def __init__(
        self, dispatch: ConcurrentDispatch, unit: DispatchUnit, msgs: Sequence[ConsumedMessage], budget: float
    ) -> None:
        self._dispatch, self._unit, self._msgs = dispatch, unit, msgs
        self._deadline = time.perf_counter() + budget
        self.schedule = LaneSchedule(lanes_of(msgs, dispatch.spec.ordering), dispatch.spec.in_flight)
        self._records: dict[int, Record] = {}
        self._started = False
        self._running: dict[int, asyncio.Future[Any]] = {}
        self._done: dict[int, list[PendingOutput] | _Recover] = {}  # finished records past the produced prefix
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
        self.schedule.finished(index)
        try:
            self._settle(index, future)
        except BaseException as exc:  # noqa: BLE001 - as in _start_more
            self._error = self._error or exc
            self.schedule.stop_starting()
        self._start_more()

    def _settle(self, index: int, future: asyncio.Future[Any]) -> None:
        """Record ``index`` finished: count its success and produce what is due, or note its failure."""
        record = self._records.pop(index)
        error = asyncio.CancelledError() if future.cancelled() else future.exception()
        if error is None:
            outcome = future.result()
            self._done[index] = outcome  # a success's count ends when its offset commits
            self._produce_prefix()
        elif isinstance(error, Exception) and not (
            isinstance(error, (KafkaClientError, Abandoned)) and not isinstance(error, OutputError)
        ):
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
                if isinstance(outcome, _Recover):
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
