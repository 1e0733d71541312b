"""The runner of a Spark listener: job, retries, poison isolation, commit.

Per transaction unit (a batch, or one partition's slice with ``fencing="partition"``):

1. Run the job over the unit's records, outside any transaction (a Spark job
   can take seconds; a transaction left open that long only risks its
   timeout). Outputs are collected in memory.
2. On failure, retry from memory after the listener's back-off (a
   stop-aware wait), counting attempts for the batch, up to ``max_attempts``
   (a not-retryable error skips the retries).
3. Still failing: isolate the poison records by bisection (see
   :mod:`kafkatx.listener.failure.poison_isolation`, shared with the batch listener), then run the job once more over all
   the other records; its outputs are the ones committed, because a job can
   aggregate and the union of half-batch outputs is not the job's output.
4. One transaction: the outputs, the poison records handed to the
   listener's recoverer (dead-letter topic), and the offsets of the whole
   unit, committed through :meth:`TransactionUnit.transact
   <kafkatx.listener.transaction.unit.TransactionUnit.transact>` like any other runner's:
   the membership check before the commit, abortable → abort and redo the
   transaction from memory, application-recoverable → replace the producer
   and rewind, without recovery.

Retry decisions come from the listener's
:class:`~kafkatx.rollback.policy.FailurePolicy`, the same object the record
runner and the after-rollback processor ask. This module uses only the
public unit interface of ``kafkatx.listener``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from kafkatx.client.offsets import first_offsets
from kafkatx.context import bind_sink
from kafkatx.errors import (
    ApplicationRecoverableError,
    ContainerError,
    OutputError,
    RecoveryError,
)
from kafkatx.events import RecordRecovered, TransactionCommitted
from kafkatx.listener.failure.failed_record import recovery_failed
from kafkatx.listener.failure.poison_isolation import IsolationStopped, RunFailed, isolate
from kafkatx.listener.host import Unit
from kafkatx.outputs import PendingOutput
from kafkatx.record import ConsumedMessage, to_record
from kafkatx.rollback.classifier import exception_name
from kafkatx.rollback.decision import decide_failure
from kafkatx.rollback.policy import Action
from kafkatx.spark._errors import SparkOutputError, as_job_error, is_data_independent
from kafkatx.spark._frames import messages_to_table, table_to_outputs

if TYPE_CHECKING:
    from kafkatx.listener.spec import ListenerSpec

__all__ = ["SparkUnitRunner", "SparkSessionError"]

log = logging.getLogger("kafkatx.spark")

Coords = tuple[str, int, int]


class SparkSessionError(ContainerError):
    """Spark itself is unusable (the JVM died, the Connect server is gone): the container stops."""


class _Stopping(Exception):
    """Internal: the container stops; give the batch up uncommitted."""


@dataclass(slots=True)
class _Poison:
    exc: BaseException
    attempts: int


@dataclass(slots=True)
class _Outcome:
    outputs: list[PendingOutput]
    poison: dict[int, _Poison] = field(default_factory=dict)
    failed: bool = False


class _SendBuffer(list[PendingOutput]):
    """``kafkatx.send()`` target while the handler runs: kept only if the run's outputs are."""

    def __init__(self, serializer: Any) -> None:
        super().__init__()
        self.serializer = serializer

    add = list.append


class _Batch:
    """One unit's messages and their Arrow table (built once, sliced per job)."""

    def __init__(self, msgs: Sequence[ConsumedMessage]) -> None:
        self.msgs = msgs
        self._table: pa.Table | None = None

    def table(self, indices: Sequence[int]) -> pa.Table:
        if self._table is None:
            self._table = messages_to_table(self.msgs)
        if len(indices) == len(self.msgs):
            return self._table
        return self._table.take(pa.array(indices, pa.int64()))

    def coords(self, i: int) -> Coords:
        m = self.msgs[i]
        return (m.topic(), m.partition(), m.offset())

    def describe(self, indices: Sequence[int]) -> str:
        shown = ", ".join(f"{t}/{p}@{o}" for t, p, o in (self.coords(i) for i in indices[:10]))
        return shown + (f" and {len(indices) - 10} more" if len(indices) > 10 else "")


class SparkUnitRunner:
    """``runner(unit)``: what a Spark listener's container calls for each transaction unit."""

    def __init__(self, spec: ListenerSpec, session: Any, max_bisect_jobs: int) -> None:
        self._spec = spec
        self._session = session
        self._handler: Callable[[Any], Any] = spec.handler
        self.max_bisect_jobs = max_bisect_jobs
        # Poison records whose recovery failed: on redelivery they go straight
        # to recovery instead of into the job (like the tracker's pending_recovery).
        self._known: dict[Coords, _Poison] = {}
        #: Jobs run so far (attempts, bisection probes, final runs), for logs and tests.
        self.jobs_run = 0

    # -- the unit ---------------------------------------------------------------
    def __call__(self, tx: Unit) -> None:
        msgs = tx.messages
        started = time.perf_counter()
        batch = _Batch(msgs)
        self._forget_stale(tx)
        known = {i: self._known[batch.coords(i)] for i in range(len(msgs)) if batch.coords(i) in self._known}
        candidates = [i for i in range(len(msgs)) if i not in known]
        try:
            outcome = self._process(batch, candidates, tx)
        except _Stopping:
            tx.rewind()  # nothing committed: the records come back on restart
            return
        except ApplicationRecoverableError as exc:  # the producer could not answer a metadata check
            tx.replace_producer(exc)
            return
        outcome.poison.update(known)
        self._commit(batch, outcome, tx, started)

    def _process(self, batch: _Batch, candidates: list[int], tx: Unit) -> _Outcome:
        if not candidates:
            return _Outcome([], failed=True)
        head = batch.coords(candidates[0])  # a job's failure is counted on its first record
        first = to_record(batch.msgs[candidates[0]], tx.tracker.attempt(*head))
        while True:
            try:
                return _Outcome(self._run(batch, candidates, tx))
            except RunFailed as failed:
                exc = failed.exc
            log.info("spark listener %s: the job over %d record(s) failed", tx.listener, len(candidates))
            verdict = decide_failure(tx, first, exc)  # the decision of every failed record (count, events, log)
            attempts = verdict.attempt
            if verdict.action is Action.ABANDON:
                raise _Stopping
            if verdict.action is Action.RETRY:
                if tx.wait(verdict.delay):
                    raise _Stopping
                first = to_record(batch.msgs[candidates[0]], attempts + 1)
                continue
            log.warning(
                "spark listener %s: job over %d record(s) from %s failed (%s: %s), %s; isolating the records that "
                "make it fail",
                tx.listener,
                len(candidates),
                first.coordinates,
                exception_name(exc),
                exc,
                verdict.reason,
            )
            return self._isolate(batch, candidates, exc, attempts, tx)

    # -- running the job -------------------------------------------------------------
    def _run(self, batch: _Batch, indices: Sequence[int], tx: Unit) -> list[PendingOutput]:
        """Run the handler over ``indices`` and return its encoded outputs; raises RunFailed."""
        self.jobs_run += 1
        sent = _SendBuffer(self._spec.serializer)
        previous = bind_sink(sent)
        try:
            df = self._session.createDataFrame(batch.table(indices))
            outputs = self._collect(self._handler(df))
        except Exception as exc:  # whatever the handler raises fails this run, as in the record path
            raise RunFailed(as_job_error(exc)) from None
        finally:
            bind_sink(previous)
        if sent:
            outputs = [*sent, *outputs]
        try:
            self._check_destinations(outputs, tx)
        except SparkOutputError as exc:
            raise RunFailed(exc) from None
        return outputs

    def _collect(self, result: Any) -> list[PendingOutput]:
        if result is None:
            return []
        spec = self._spec
        if isinstance(result, pa.Table):
            return table_to_outputs(result, spec.output, spec.name)
        from pyspark.sql import DataFrame

        if isinstance(result, DataFrame):
            return table_to_outputs(result.toArrow(), spec.output, spec.name)
        raise SparkOutputError(
            f"spark listener {spec.name!r} returned a {type(result).__name__}; return a DataFrame "
            "(with a 'value' column), a pyarrow Table, or None",
            data_independent=True,
        )

    def _check_destinations(self, outputs: list[PendingOutput], tx: Unit) -> None:
        """Missing topics and partitions fail the job now, so that bisection can find the rows' records."""
        wanted: dict[str, int] = {}
        for topic, _, _, _, partition in outputs:
            wanted[topic] = max(wanted.get(topic, -1), partition if partition is not None else -1)
        for topic, max_partition in wanted.items():
            count = tx.partition_count(topic)
            if count is None:
                raise SparkOutputError(
                    f"spark listener {self._spec.name!r}: output topic {topic!r} does not exist; create it first "
                    "(kafkatx never auto-creates output topics)",
                    data_independent=topic == self._spec.output,  # a 'topic' column may depend on the records
                )
            if max_partition >= count:
                raise SparkOutputError(
                    f"spark listener {self._spec.name!r}: output partition {max_partition} of {topic!r} does not "
                    f"exist (it has {count})"
                )

    # -- poison isolation ------------------------------------------------------------
    def _isolate(self, batch: _Batch, candidates: list[int], exc: BaseException, attempts: int, tx: Unit) -> _Outcome:
        """Find the records whose presence makes the job fail, and run it once over the rest: the shared search
        by halves (:func:`~kafkatx.listener.failure.poison_isolation.isolate`, bounded by ``max_bisect_jobs``);
        errors that cannot depend on the data dead-letter the whole set at once."""
        started = time.perf_counter()
        jobs_before = self.jobs_run
        try:
            found = isolate(
                lambda indices: self._run(batch, indices, tx),
                candidates,
                exc,
                max_runs=self.max_bisect_jobs,
                stopping=lambda: tx.stopping,
                data_independent=is_data_independent,
                label=f"spark listener {tx.listener}",
            )
        except IsolationStopped:
            raise _Stopping from None
        self._check_session(found.last_failure or exc, tx)
        ordered = list(found.poison)
        log.warning(
            "spark listener %s: %d poison record(s) out of %d isolated in %d job(s) (%.1fs): %s",
            tx.listener,
            len(ordered),
            len(candidates),
            self.jobs_run - jobs_before,
            time.perf_counter() - started,
            batch.describe(ordered),
        )
        poison = {i: _Poison(e, attempts) for i, e in found.poison.items()}
        return _Outcome(found.result or [], poison, failed=True)

    def _check_session(self, failure: BaseException, tx: Unit) -> None:
        """Blame records only if Spark itself works: a dead JVM or an unreachable
        Connect server fails every probe, and would dead-letter whole batches."""
        try:
            self._session.range(1).count()
        except Exception as exc:
            raise SparkSessionError(
                f"spark listener {tx.listener!r}: the SparkSession cannot run a trivial job ({type(exc).__name__}: "
                f"{exc}), so the batch's failure ({type(failure).__name__}: {failure}) is not blamed on its records. "
                "The container stops; nothing of the batch was committed."
            ) from exc

    # -- the transaction ---------------------------------------------------------------
    def _commit(self, batch: _Batch, outcome: _Outcome, tx: Unit, started: float) -> None:
        """One transaction: the job's outputs, the poison records recovered, the offsets of the whole unit."""
        msgs = batch.msgs
        offsets = tx.next_offsets()
        while True:
            poison = sorted(outcome.poison.items())
            records = {i: to_record(msgs[i], p.attempts) for i, p in poison}

            def work() -> None:
                for out in outcome.outputs:
                    tx.produce(out)
                for i, p in poison:
                    tx.recover(tx.policy.recoverer, records[i], p.exc)
                tx.send_offsets(offsets)

            recovery: RecoveryError | None = None
            rejected: OutputError | None = None
            try:
                if not tx.transact(work, what="batch's transaction"):
                    return  # the producer was replaced and the unit rewound to the committed offsets
            except RecoveryError as exc:
                recovery = exc
            except OutputError as exc:  # the client refused an output record
                rejected = exc
            if recovery is not None:
                self._recovery_failed(batch, outcome, recovery, tx)
                return
            if rejected is not None:
                log.error(
                    "spark listener %s: an output of the job over %d record(s) was rejected (%s); its rows cannot "
                    "be traced to records, so all of them go to the recoverer",
                    tx.listener,
                    len(msgs) - len(outcome.poison),
                    rejected,
                )
                rest = {i: _Poison(rejected, 1) for i in range(len(msgs)) if i not in outcome.poison}
                outcome = _Outcome([], {**outcome.poison, **rest}, failed=True)
                continue
            break
        for i, p in poison:
            self._known.pop(batch.coords(i), None)
            tx.publish(RecordRecovered(tx.listener, tx.worker, records[i], p.exc, tx.policy.recoverer.name))
        tx.publish(
            TransactionCommitted(
                tx.listener,
                tx.worker,
                len(msgs),
                len(outcome.outputs),
                time.perf_counter() - started,
                "after_rollback" if outcome.failed else "batch",
            )
        )

    def _recovery_failed(self, batch: _Batch, outcome: _Outcome, exc: RecoveryError, tx: Unit) -> None:
        """Keep every poison record (skip the job for them next time); the failed recovery counted and held by
        the failed-record procedure (a back-off, or the stop at ``max_recovery_failures``); nothing committed."""
        for i, p in outcome.poison.items():
            self._known[batch.coords(i)] = p
        record = exc.record
        original = self._known.get((record.topic, record.partition, record.offset))
        hold = recovery_failed(tx, record, original.exc if original else exc.exception, exc)
        tx.rewind()
        tx.pause((record.topic, record.partition), hold.delay)

    def _forget_stale(self, tx: Unit) -> None:
        """Drop remembered poison of partitions we lost, or offsets already committed by someone."""
        if not self._known:
            return
        assigned = tx.assignment
        first = first_offsets(tx.messages)
        for key in list(self._known):
            tp = (key[0], key[1])
            if tp not in assigned or (tp in first and key[2] < first[tp]):
                del self._known[key]
