"""The batch runner: a handler called with a list of records, its outputs and their offsets in one transaction.

``handler(records: list[Record])`` returns what a record handler may return
(an iterable of bytes, str, ``(key, value)``, ``Output``; or None) and may
``send()``; an ``async def`` handler is awaited on the runner's event loop.
A call's outputs are held until it returns, so a failed call leaves nothing
in the transaction. Per unit, in one transaction:

1. Typed payloads (``value_type=``...): each record is decoded first; one
   that cannot be is settled alone (:func:`~kafkatx.listener.failure.failed_record.settle_failure`:
   a decoding error is never retried, so it is recovered) and the handler
   gets the others.
2. ``raise RecordFailedError(record) from err``: the records before it are
   called again without it and commit; the failed record goes through
   ``settle_failure`` alone, judged on ``err`` (called again at once with its
   ``attempt`` one higher, held for the back-off, or recovered); the records
   after it are called afterwards.
3. Any other exception fails the call: it is counted on its first record
   (:func:`~kafkatx.rollback.decision.decide_failure`) and retried
   (``max_attempts``; a back-off ends the transaction before the call and is
   waited in memory, the consumer not polled meanwhile); then the poison
   records are isolated by halves
   (:func:`~kafkatx.listener.failure.poison_isolation.isolate`, shared with
   the Spark runner, bounded by ``max_bisect_jobs``): only the records that
   fail on their own are recovered, and the outputs of one run over all the
   others commit (no half-batch output is ever kept).

A failed record's count ends when its offset commits; a failed recovery is
held by the failed-record procedure (``recovery_backoff``, then the stop at
``max_recovery_failures``), and the record's next delivery recovers it
without calling the handler. A dependency outage (``outages=``) counts
nothing: the unit is rewound and the listener waits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from kafkatx.client.offsets import TP
from kafkatx.context import bind_sink
from kafkatx.errors import RecordFailedError
from kafkatx.events import TransactionCommitted
from kafkatx.listener.failure.failed_record import (
    CallAgain,
    Hold,
    recover_record,
    retry_recovery,
    settle_failure,
)
from kafkatx.listener.failure.poison_isolation import IsolationStopped, RunFailed, isolate
from kafkatx.listener.host import (
    ContainerIdentity,
    ContainerLiveness,
    ContainerTransactions,
    HandlerFailure,
    RecordUnit,
    Unit,
)
from kafkatx.listener.runners.batch_outputs import CallOutputs, SendBuffer, bytes_values, produce_call_outputs
from kafkatx.outputs import collect_outputs, unproducible_stop
from kafkatx.record import ConsumedMessage, Record
from kafkatx.rollback.classifier import exception_name
from kafkatx.rollback.decision import decide_failure
from kafkatx.rollback.policy import Action

if TYPE_CHECKING:
    from kafkatx.database.session import DatabaseSession
    from kafkatx.listener.spec import ListenerSpec

__all__ = ["BatchHost", "BatchRunner", "failed_index"]

log = logging.getLogger("kafkatx.container")


@dataclass(slots=True)
class _Cut:
    """The transaction ends before message ``index``; what becomes of the messages from there."""

    index: int
    #: A failed record held for its back-off (its partition's messages wait; the others come next).
    hold: Hold | None = None
    #: A failed call's back-off: the rest waits this long, in memory, then comes next.
    wait: float = 0.0
    #: The container stops: the rest is fetched again.
    rewind: bool = False


#: A record settled once the calls are done: (index, error or None for a recovery to retry, already counted).
_Later = tuple[int, BaseException | None, bool]
#: What comes next in a transaction: ("call", the records' indices, None) or ("settle", [index], its error).
_Step = tuple[str, Sequence[int], BaseException | None]


class _Outage(Exception):
    """Internal: a dependency is down (the listener's ``outages``): abort, rewind, the listener waits."""

    def __init__(self, exc: BaseException, record: Record) -> None:
        super().__init__(exc)
        self.exc, self.record = exc, record


class _Aborted(Exception):
    """Internal: a recovery in the batch's transaction failed: abort it all, hold the record's partition."""

    def __init__(self, hold: Hold) -> None:
        super().__init__(hold)
        self.hold = hold


def failed_index(exc: RecordFailedError, records: Sequence[Record]) -> int | None:
    """Where the record ``exc`` names is in ``records`` (the very object, else the same coordinates), or None."""
    named = exc.record
    for i, record in enumerate(records):
        if record is named:
            return i
    coords = (getattr(named, "topic", None), getattr(named, "partition", None), getattr(named, "offset", None))
    for i, record in enumerate(records):
        if (record.topic, record.partition, record.offset) == coords:
            return i
    return None


def _pick(records: list[Record], indices: Sequence[int]) -> list[Record]:
    """The records at ``indices`` in a new list (the handler may change it): a slice when they are consecutive (as
    a batch's first call's are: all of them)."""
    if type(indices) is range and indices.step == 1:
        return records[indices.start : indices.stop]
    return [records[i] for i in indices]


def _next_offsets(records: Sequence[Record]) -> dict[TP, int]:
    """The offset after each partition's last record, read once per run of one partition's records (messages come
    in such runs) instead of once per record."""
    offsets: dict[TP, int] = {}
    topic, partition, last = "", -1, -1
    for record in records:
        if record.partition != partition or record.topic != topic:
            _end_run(offsets, topic, partition, last)
            topic, partition = record.topic, record.partition
        last = record.offset
    _end_run(offsets, topic, partition, last)
    return offsets


def _end_run(offsets: dict[TP, int], topic: str, partition: int, last: int) -> None:
    """A run of one partition's records ended at ``last`` (none yet: ``partition`` -1)."""
    if partition >= 0 and last + 1 > offsets.get((topic, partition), -1):
        offsets[(topic, partition)] = last + 1


def _coords(record: Record) -> tuple[str, int, int]:
    return (record.topic, record.partition, record.offset)


def _cause(exc: RecordFailedError) -> BaseException:
    """What a named record failed with: the error it was raised ``from`` (itself without one)."""
    return exc.__cause__ if exc.__cause__ is not None else exc


class BatchHost(ContainerIdentity, ContainerLiveness, ContainerTransactions, Protocol):
    """What the batch runner uses of its container: its handler as it runs it (traced, with tracing on), the last
    poll's time and the time budget, the database."""


class _Probe:
    """An isolation run with ``database=``: each in a savepoint of its own, the work of the run that passed before
    it undone first, so that only the work of the run whose result is kept (the last that passed) commits.

    Savepoints share one name (the record savepoint's), so they are ended strictly in the reverse order of their
    making: the handler's inside each run, then the run's."""

    def __init__(self, call: Callable[[list[Record]], CallOutputs], database: DatabaseSession | None) -> None:
        self._call, self._database = call, database
        self._passed: list[Any] = []  # the savepoint of the last run, if it passed (still open)

    def __call__(self, records: list[Record]) -> CallOutputs:
        database = self._database
        if database is None:
            return self._call(records)
        self.undo()
        point = database.savepoint()
        try:
            outputs = self._call(records)
        except RunFailed:
            database.roll_back_to(point)
            raise
        self._passed.append(point)
        return outputs

    def undo(self) -> None:
        """Undo the database work of the last run, if it passed."""
        if self._database is not None and self._passed:
            self._database.roll_back_to(self._passed.pop())

    def keep(self) -> None:
        """Keep the database work of the last run (it passed: its result commits)."""
        if self._database is not None and self._passed:
            self._database.release(self._passed.pop())


class BatchRunner:
    """``runner(unit)`` for batch listeners (``@app.batch_listener``): see the module."""

    def __init__(self, spec: ListenerSpec, container: BatchHost, max_bisect_jobs: int) -> None:
        self.spec = spec
        self._c = container
        #: ``database=``: one unit of work per transaction, each call's work in a savepoint of its own (undone
        #: with the call if it fails), its outputs stored under its first record's partition.
        self._database = container.database
        handler = container.spec.handler  # the declared one, or tracing's wrapper of it (App._traced)
        self._handler = handler if self._database is None else self._database.attributing(handler, batch=True)
        self.max_bisect_jobs = max_bisect_jobs
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Records held after a named failure (RecordFailedError): called alone when they come back.
        self._held: set[tuple[str, int, int]] = set()
        #: The last clean transaction's records, refilled by the next one where the handler did not keep them.
        self._spare: list[Record] = []
        #: Handler calls so far (first calls, retries, isolation probes), for logs and tests.
        self.calls = 0

    def close(self) -> None:
        """The container is closing: close the event loop of an ``async def`` handler, if any."""
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    # -- the unit ----------------------------------------------------------------------
    def __call__(self, unit: RecordUnit) -> None:
        msgs = unit.messages
        refused: BaseException | None = None
        while msgs:
            current = unit.with_messages(msgs)
            started = time.perf_counter()
            cut: list[_Cut | None] = [None]

            def work(current: RecordUnit = current, msgs: list[ConsumedMessage] = msgs, failed: Any = refused) -> None:
                cut[0] = self._handle(current, msgs, failed)

            try:
                if not current.transact(work, what="batch's transaction"):
                    return  # the producer was replaced and the unit rewound to the committed offsets
            except HandlerFailure as failure:  # the broker refused an output of this one-record unit (the crash
                refused = failure.exc  # guard ran its batch one record per transaction to find it): settle it
                continue
            except _Outage as outage:  # nothing counted: the unit waits for the listener's outage to end
                current.rewind()
                current.outage.report(current.worker, outage.exc, outage.record)
                return
            except _Aborted as aborted:
                record = aborted.hold.record
                current.rewind()
                if aborted.hold.delay > 0:
                    current.pause((record.topic, record.partition), aborted.hold.delay)
                return
            msgs, refused = self._committed(current, msgs, cut[0], started), None

    def _committed(self, unit: Unit, msgs: list[ConsumedMessage], cut: _Cut | None, started: float) -> list[Any]:
        """The transaction committed ``msgs`` (or those before ``cut``): the messages to run next, from memory."""
        handled = len(msgs) if cut is None else cut.index
        unit.publish(
            TransactionCommitted(unit.listener, unit.worker, handled, unit.outputs, time.perf_counter() - started)
        )
        if cut is None:
            return []
        rest = msgs[cut.index :]
        if cut.rewind or unit.stopping:
            unit.rewind(rest)
            return []
        in_memory = time.monotonic() - self._c.polled_at < self._c.transaction_budget
        hold = cut.hold
        if hold is not None and hold.delay > 0:
            tp = (hold.record.topic, hold.record.partition)
            held = [m for m in rest if (m.topic(), m.partition()) == tp]
            rest = [m for m in rest if (m.topic(), m.partition()) != tp]
            if in_memory:
                unit.defer(held, hold.delay)
            else:
                unit.seek(tp, hold.record.offset)
                unit.pause(tp, hold.delay)
        if cut.wait > 0 and unit.wait(cut.wait):
            unit.rewind(rest)  # stopping during the back-off: fetched again on restart
            return []
        if not in_memory and cut.wait <= 0:
            unit.rewind(rest)
            return []
        return rest

    # -- one transaction -----------------------------------------------------------------
    def _handle(self, unit: RecordUnit, msgs: list[ConsumedMessage], refused: BaseException | None) -> _Cut | None:
        """Handle ``msgs`` in the open transaction: outputs produced, failures settled, offsets sent. Returns where
        the transaction ends before the last message, if it does. ``refused``: the broker refused an output of
        this one-record unit before: its record is settled with that error, not called."""
        spare, self._spare = self._spare, []
        records = unit.records(msgs, spare)
        del spare
        calls = self.calls
        later: list[_Later] = []  # settled once the calls are done, if before the cut
        todo: deque[_Step] = deque()
        candidates = self._callable(unit, records, later) if refused is None else ()
        cut: _Cut | None = None
        todo.extend(("call", part, None) for part in self._split_at_held(records, candidates))
        if refused is not None:
            todo.append(("settle", range(1), refused))
        while todo and cut is None:
            step, indices, failure = todo.popleft()
            if not indices:
                continue
            if step == "settle":
                cut = self._settle(unit, records, indices[0], failure, todo)
                continue
            try:
                outputs = self._call(_pick(records, indices))
            except RunFailed as failed:
                cut = self._call_failed(unit, records, indices, failed.exc, todo, later)
                continue
            produce_call_outputs(unit, outputs, self.spec.output)
            if len(indices) == 1:
                self._held.discard(_coords(records[indices[0]]))
        end = len(msgs) if cut is None else cut.index
        self._settle_later(unit, records, [item for item in later if item[0] < end])
        offsets = _next_offsets(records) if end == len(msgs) else unit.next_offsets(msgs[:end])
        if cut is not None and cut.hold is not None:  # the held record's own offset commits, with its count
            record = cut.hold.record
            offsets[(record.topic, record.partition)] = record.offset
        if offsets:
            unit.send_offsets(offsets)
        if cut is None and not later and self.calls == calls + 1:  # nothing failed: no error holds these records
            self._spare = records
        return cut

    def _split_at_held(self, records: list[Record], candidates: Sequence[int]) -> list[Sequence[int]]:
        """The calls to make: ``candidates`` in order, each record held after a named failure in a call of its own
        (its retry is its own; the records after it wait for it, so that they are called once)."""
        if not self._held:
            return [candidates] if candidates else []
        parts: list[list[int]] = [[]]
        for i in candidates:
            if _coords(records[i]) in self._held:
                parts += [[i], []]
            else:
                parts[-1].append(i)
        return [part for part in parts if part]

    def _callable(self, unit: Unit, records: list[Record], later: list[_Later]) -> Sequence[int]:
        """The records the handler gets (decoded, with typed payloads); the others go to ``later``: a recovery to
        retry, or a record that cannot be decoded (an outage of the decoder's service raises :class:`_Outage`)."""
        tracker, decoding = unit.tracker, self.spec.decoding
        failing = tracker.failing
        if decoding is None and not failing:  # the clean path: every record, nothing to look at per record
            return range(len(records))
        candidates: list[int] = []
        for i, record in enumerate(records):
            state = tracker.state(record) if (record.topic, record.partition) in failing else None
            if state is not None and state.pending_recovery:  # its recoverer failed before: recover, not call
                later.append((i, None, False))
                continue
            if decoding is not None:
                error: Exception | None = None
                try:
                    decoding.decode(record)
                except Exception as exc:  # noqa: BLE001 - the record's own failure, or an outage
                    error = exc
                if error is not None and unit.outage.matches(error):  # a service the decoder needs is down
                    raise _Outage(error, record)
                if error is not None:
                    later.append((i, error, False))
                    continue
            candidates.append(i)
        return candidates

    def _call(self, records: list[Record]) -> CallOutputs:
        """Call the handler with ``records``; its outputs, or :class:`RunFailed`."""
        spec = self.spec
        self.calls += 1
        sent = SendBuffer(spec.serializer)
        previous = bind_sink(sent)
        try:
            result = self._handler(records)
            if spec.is_async:
                result = self._event_loop().run_until_complete(result)
            values = bytes_values(result) if spec.output is not None else None
            if values is None:
                collect_outputs(result, spec.output, spec.serializer, spec.name, sent)
        except Exception as exc:  # whatever the call raised fails it, and only it: nothing of it was produced
            raise RunFailed(exc) from None
        finally:
            bind_sink(previous)
        return list(sent), values or []

    def _raise_lost_connection(self, failure: BaseException | None) -> None:
        """With ``database=``: a connection that died under the handler is an outage, no record's failure (the
        unit is fetched again once the database answers)."""
        unavailable = self._database.lost_connection(failure) if self._database and failure else None
        if unavailable is not None:
            raise unavailable

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop

    # -- failures --------------------------------------------------------------------------
    def _call_failed(
        self,
        unit: RecordUnit,
        records: list[Record],
        indices: Sequence[int],
        exc: BaseException,
        todo: deque[_Step],
        later: list[_Later],
    ) -> _Cut | None:
        """A call over ``indices`` raised ``exc``: split it at a named record, or retry it, or isolate its poison."""
        stop = unproducible_stop(unit.listener, exc)
        if stop is not None:  # a programming error, no record's: the container stops, nothing dead-lettered
            raise stop
        self._raise_lost_connection(exc)
        if isinstance(exc, RecordFailedError):
            k = failed_index(exc, [records[i] for i in indices])
            if k is not None:
                cause = _cause(exc)
                if unit.outage.matches(cause):
                    raise _Outage(cause, records[indices[k]])
                todo.extendleft(
                    reversed(
                        [("call", indices[:k], None), ("settle", [indices[k]], cause), ("call", indices[k + 1 :], None)]
                    )
                )
                return None
            log.warning(
                "listener %s: RecordFailedError names %s, which is not in the failed call: the call's failure is "
                "taken as the batch's",
                unit.listener,
                getattr(exc.record, "coordinates", exc.record),
            )
            exc = _cause(exc)
        first = records[indices[0]]
        if unit.outage.matches(exc):
            raise _Outage(exc, first)
        if len(indices) == 1:  # a call of one record is that record's failure
            todo.appendleft(("settle", indices, exc))
            return None
        verdict = decide_failure(unit, first, exc)  # counted on its first record, as a Spark job's
        if verdict.action is Action.ABANDON:
            return _Cut(indices[0], rewind=True)
        if verdict.action is Action.RETRY:
            if verdict.delay > 0:
                return _Cut(indices[0], wait=verdict.delay)
            records[indices[0]] = replace(first, attempt=verdict.attempt + 1)
            todo.appendleft(("call", indices, None))
            return None
        log.warning(
            "listener %s: the call over %d record(s) from %s failed (%s: %s), %s; isolating the records that make "
            "it fail",
            unit.listener,
            len(indices),
            first.coordinates,
            exception_name(exc),
            exc,
            verdict.reason,
        )
        return self._isolate(unit, records, indices, exc, verdict.attempt, later)

    def _isolate(
        self,
        unit: RecordUnit,
        records: list[Record],
        indices: Sequence[int],
        exc: BaseException,
        attempts: int,
        later: list[_Later],
    ) -> _Cut | None:
        """The call over ``indices`` failed its attempts: find its poison records (the Spark runner's search), produce
        the outputs of one call over all the others, and leave the poison to be recovered."""
        started, calls = time.perf_counter(), self.calls
        probe = _Probe(self._call, self._database)
        try:
            found = isolate(
                lambda part: probe([records[indices[j]] for j in part]),
                list(range(len(indices))),
                exc,
                max_runs=self.max_bisect_jobs,
                stopping=lambda: unit.stopping,
                label=f"listener {unit.listener}",
            )
        except IsolationStopped:
            probe.undo()
            return _Cut(indices[0], rewind=True)
        if found.result is None:  # every record poison: no run's work is kept
            probe.undo()
        else:
            probe.keep()
        self._raise_lost_connection(found.last_failure)
        poison = [indices[j] for j in found.poison]
        log.warning(
            "listener %s: %d poison record(s) out of %d isolated in %d call(s) (%.2fs): %s",
            unit.listener,
            len(poison),
            len(indices),
            self.calls - calls,
            time.perf_counter() - started,
            ", ".join(records[i].coordinates for i in poison[:10]) + (" ..." if len(poison) > 10 else ""),
        )
        if found.result is not None:
            produce_call_outputs(unit, found.result, self.spec.output)
        for j, error in found.poison.items():
            i = indices[j]
            records[i] = replace(records[i], attempt=attempts)
            later.append((i, error, True))
        return None

    def _settle(
        self,
        unit: Unit,
        records: list[Record],
        i: int,
        exc: BaseException | None,
        todo: deque[_Step],
    ) -> _Cut | None:
        """Record ``i`` failed alone with ``exc``: the failed-record procedure decides, in the open transaction."""
        assert exc is not None
        outcome = settle_failure(unit, records[i], exc)
        if isinstance(outcome, CallAgain):
            records[i] = outcome.record
            todo.appendleft(("call", [i], None))
            return None
        if isinstance(outcome, Hold):
            self._held.add(_coords(records[i]))
            return _Cut(i, hold=outcome)
        self._held.discard(_coords(records[i]))
        return None  # recovered: its dead letter commits with its offset

    def _settle_later(self, unit: Unit, records: list[Record], items: list[_Later]) -> None:
        """Recover the records that need no call (undecodable, isolated poison, a recovery to retry). A recovery
        that fails aborts the whole transaction (:class:`_Aborted`): outputs over other records went out with it."""
        for i, error, counted in items:
            record = records[i]
            if error is None:
                hold = retry_recovery(unit, record)
            elif not counted:  # failed to decode: settled alone, without the handler
                outcome = settle_failure(unit, record, error)  # a DecodeError is never retried: recovered, or held
                hold = outcome if isinstance(outcome, Hold) else None
                if isinstance(outcome, CallAgain):  # declared retryable: it cannot be called undecoded
                    hold = recover_record(unit, outcome.record, error)
            else:  # isolated poison: counted and decided with its call
                hold = recover_record(unit, record, error)
            if hold is not None:
                raise _Aborted(hold)
