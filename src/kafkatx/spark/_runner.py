"""The transaction-unit runner of a Spark listener: job, retries, poison isolation, commit.

Per unit (a batch, or one partition's slice with ``fencing="partition"``):

1. Run the job over the unit's records, outside any transaction (a Spark job
   can take seconds; a transaction left open that long only risks its
   timeout). Outputs are collected in memory.
2. On failure, retry from memory after the listener's back-off (a
   stop-aware wait), counting attempts for the unit, up to ``max_attempts``
   (a not-retryable error skips the retries).
3. Still failing: isolate the poison records by bisection (see
   :meth:`_SparkUnitRunner._isolate`), then run the job once more over all
   the other records; its outputs are the ones committed, because a job can
   aggregate and the union of half-batch outputs is not the job's output.
4. One transaction: the outputs, the poison records handed to the
   listener's recoverer (dead-letter topic), and the offsets of the whole
   unit. Kafka errors follow the container's rules: abortable → abort and
   redo the transaction from memory; application-recoverable → replace the
   producer and rewind, without recovery.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from confluent_kafka import Message, TopicPartition

from kafkatx.errors import ApplicationRecoverableError, TransactionAbortableError
from kafkatx.events import HandlerFailed, RecordRecovered, RecordRetryScheduled, RecoveryFailed, TransactionCommitted
from kafkatx.listener.container import ContainerError, RecoveryExhaustedError, to_record
from kafkatx.listener.context import bind_sink
from kafkatx.listener.outputs import OutputError, PendingOutput
from kafkatx.listener.producer import TransactionalProducer
from kafkatx.rollback.backoff import delay_for
from kafkatx.rollback.processor import RecoveryError
from kafkatx.spark._errors import SparkOutputError, as_job_error, is_data_independent
from kafkatx.spark._frames import messages_to_table, table_to_outputs

if TYPE_CHECKING:
    from kafkatx.listener.container import ListenerContainer

__all__ = ["SparkUnitRunner", "SparkSessionError"]

log = logging.getLogger("kafkatx.spark")

TP = tuple[str, int]
Coords = tuple[str, int, int]


class SparkSessionError(ContainerError):
    """Spark itself is unusable (the JVM died, the Connect server is gone): the container stops."""


class _JobFailed(Exception):
    """Internal: one run of the job failed with ``exc`` (already unwrapped)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Stopping(Exception):
    """Internal: the container stops; give the unit up uncommitted."""


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


class _Budget:
    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    @property
    def exhausted(self) -> bool:
        return self.used >= self.limit


class _Unit:
    """One unit's messages and their Arrow table (built once, sliced per job)."""

    def __init__(self, msgs: Sequence[Message]) -> None:
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
    """``runner(msgs, producer)``: what the container calls for each transaction unit."""

    def __init__(self, container: ListenerContainer, session: Any, max_bisect_jobs: int) -> None:
        self._c = container
        self._spec = container.spec
        self._session = session
        self._handler: Callable[[Any], Any] = container.spec.handler
        self.max_bisect_jobs = max_bisect_jobs
        # Poison records whose recovery failed: on redelivery they go straight
        # to recovery instead of into the job (like the tracker's pending_recovery).
        self._known: dict[Coords, _Poison] = {}
        self._recovery_failures: dict[Coords, int] = {}
        #: Jobs run so far (attempts, bisection probes, final runs), for logs and tests.
        self.jobs_run = 0

    # -- the unit ---------------------------------------------------------------
    def __call__(self, msgs: list[Message], producer: TransactionalProducer) -> None:
        c = self._c
        started = time.perf_counter()
        unit = _Unit(msgs)
        self._forget_stale(msgs)
        known = {i: self._known[unit.coords(i)] for i in range(len(msgs)) if unit.coords(i) in self._known}
        candidates = [i for i in range(len(msgs)) if i not in known]
        try:
            outcome = self._process(unit, candidates, producer)
        except _Stopping:
            c._seek_to_start(msgs)  # nothing committed: the records come back on restart
            return
        except ApplicationRecoverableError as exc:  # the producer could not answer a metadata check
            c._recreate_producer(producer, exc, msgs)
            return
        outcome.poison.update(known)
        self._commit(unit, outcome, producer, started)

    def _process(self, unit: _Unit, candidates: list[int], producer: TransactionalProducer) -> _Outcome:
        if not candidates:
            return _Outcome([], failed=True)
        c, spec = self._c, self._spec
        attempts = 0
        while True:
            try:
                return _Outcome(self._run(unit, candidates, producer))
            except _JobFailed as failed:
                exc = failed.exc
            attempts += 1
            first = to_record(unit.msgs[candidates[0]], attempts)
            c.publish(HandlerFailed(c.name, c.worker, first, exc, attempts))
            retryable = spec.classifier.is_retryable(exc)
            if retryable and attempts < spec.max_attempts:
                delay = delay_for(spec.backoff, attempts)
                log.info(
                    "spark listener %s: job over %d record(s) from %s failed on attempt %d/%d (%s: %s); retrying%s",
                    c.name, len(candidates), first.coordinates, attempts, spec.max_attempts, type(exc).__name__, exc,
                    f" in {delay:.3g}s" if delay else "",
                )  # fmt: skip
                c.publish(RecordRetryScheduled(c.name, c.worker, first, attempts + 1, delay))
                if c._stop.wait(delay) if delay > 0 else c._stop.is_set():
                    raise _Stopping
                continue
            why = "not retryable" if not retryable else f"attempts exhausted ({attempts}/{spec.max_attempts})"
            log.warning(
                "spark listener %s: job over %d record(s) from %s failed (%s: %s), %s; isolating the records that "
                "make it fail", c.name, len(candidates), first.coordinates, type(exc).__name__, exc, why,
            )  # fmt: skip
            return self._isolate(unit, candidates, exc, attempts, producer)

    # -- running the job -------------------------------------------------------------
    def _run(self, unit: _Unit, indices: Sequence[int], producer: TransactionalProducer) -> list[PendingOutput]:
        """Run the handler over ``indices`` and return its encoded outputs; raises _JobFailed."""
        self.jobs_run += 1
        sent = _SendBuffer(self._spec.serializer)
        previous = bind_sink(sent)
        try:
            df = self._session.createDataFrame(unit.table(indices))
            outputs = self._collect(self._handler(df))
        except Exception as exc:  # whatever the handler raises fails this run, as in the record path
            raise _JobFailed(as_job_error(exc)) from None
        finally:
            bind_sink(previous)
        if sent:
            outputs = [*sent, *outputs]
        try:
            self._check_destinations(outputs, producer)
        except SparkOutputError as exc:
            raise _JobFailed(exc) from None
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

    def _check_destinations(self, outputs: list[PendingOutput], producer: TransactionalProducer) -> None:
        """Missing topics and partitions fail the job now, so that bisection can find the rows' records."""
        wanted: dict[str, int] = {}
        for out in outputs:
            top = wanted.get(out.topic, -1)
            wanted[out.topic] = max(top, out.partition if out.partition is not None else -1)
        for topic, max_partition in wanted.items():
            count = producer.partition_count(topic)
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
    def _isolate(
        self, unit: _Unit, candidates: list[int], exc: BaseException, attempts: int, producer: TransactionalProducer
    ) -> _Outcome:
        """Find the records whose presence makes the job fail; run it once over the rest.

        Rounds of binary search: run the job on the first half of the failing
        set; if it fails, keep that half, else the second half is the culprit;
        repeat down to one record, which is poison. Then run the job over all
        the other records: if it passes, its outputs are the ones committed;
        if it fails there is more poison, and the next round searches the
        records left. k poison records among n cost about k·(log2(n) + 1)
        jobs; for k = 1 that is the minimum a search by halves can do.

        ``max_bisect_jobs`` bounds the jobs. When it is reached, the set
        known to fail is dead-lettered as suspects (every record of it, with
        a note in the exception saying so): records are never skipped.
        Errors that cannot depend on the data (a schema error) dead-letter the
        whole set at once.
        """
        budget = _Budget(self.max_bisect_jobs)
        started = time.perf_counter()
        jobs_before = self.jobs_run
        poison: dict[int, BaseException] = {}
        remaining, failure = candidates, exc
        outputs: list[PendingOutput] = []
        while True:
            if is_data_independent(failure):
                found = {i: failure for i in remaining}
            else:
                found = self._find_one(unit, remaining, failure, budget, producer)
            poison.update(found)
            good = [i for i in remaining if i not in found]
            if not good:
                break
            if self._c._stop.is_set():
                raise _Stopping
            budget.used += 1
            try:
                outputs = self._run(unit, good, producer)
                break
            except _JobFailed as again:
                remaining, failure = good, again.exc
        self._check_session(failure)
        ordered = sorted(poison)
        log.warning(
            "spark listener %s: %d poison record(s) out of %d isolated in %d job(s) (%.1fs): %s",
            self._c.name, len(ordered), len(candidates), self.jobs_run - jobs_before, time.perf_counter() - started,
            unit.describe(ordered),
        )  # fmt: skip
        return _Outcome(outputs, {i: _Poison(poison[i], attempts) for i in ordered}, failed=True)

    def _check_session(self, failure: BaseException) -> None:
        """Blame records only if Spark itself works: a dead JVM or an unreachable
        Connect server fails every probe, and would dead-letter whole batches."""
        try:
            self._session.range(1).count()
        except Exception as exc:
            raise SparkSessionError(
                f"spark listener {self._c.name!r}: the SparkSession cannot run a trivial job ({type(exc).__name__}: "
                f"{exc}), so the batch's failure ({type(failure).__name__}: {failure}) is not blamed on its records. "
                "The container stops; nothing of the batch was committed."
            ) from exc

    def _find_one(
        self,
        unit: _Unit,
        failing: list[int],
        failure: BaseException,
        budget: _Budget,
        producer: TransactionalProducer,
    ) -> dict[int, BaseException]:
        """One poison record of ``failing`` (a set known to fail with ``failure``), with its error."""
        while len(failing) > 1:
            if budget.exhausted:
                return self._suspects(failing, failure, budget)
            mid = len(failing) // 2
            left_failure = self._probe(unit, failing[:mid], budget, producer)
            if left_failure is None:
                failing = failing[mid:]  # the first half passes: the failure came from the second
            else:
                failing, failure = failing[:mid], left_failure
        return {failing[0]: failure}

    def _probe(
        self, unit: _Unit, indices: list[int], budget: _Budget, producer: TransactionalProducer
    ) -> BaseException | None:
        if self._c._stop.is_set():
            raise _Stopping
        budget.used += 1
        try:
            self._run(unit, indices, producer)
        except _JobFailed as failed:
            return failed.exc
        return None

    def _suspects(self, failing: list[int], failure: BaseException, budget: _Budget) -> dict[int, BaseException]:
        note = (
            f"kafkatx: bisection stopped at max_bisect_jobs={budget.limit}; this record was dead-lettered as one "
            f"of {len(failing)} suspects whose job failed together"
        )
        if note not in getattr(failure, "__notes__", ()):
            failure.add_note(note)
        log.warning("spark listener %s: %s", self._c.name, note)
        return {i: failure for i in failing}

    # -- the transaction ---------------------------------------------------------------
    def _commit(self, unit: _Unit, outcome: _Outcome, producer: TransactionalProducer, started: float) -> None:
        c, spec, msgs = self._c, self._spec, unit.msgs
        offsets: dict[TP, int] = {}
        for m in msgs:
            tp = (m.topic(), m.partition())
            offsets[tp] = max(offsets.get(tp, -1), m.offset() + 1)
        abortable = 0
        while True:
            poison = sorted(outcome.poison.items())
            records = {i: to_record(msgs[i], p.attempts) for i, p in poison}
            try:
                producer.begin()
                for out in outcome.outputs:
                    producer.produce(out)
                for i, p in poison:
                    c._recover(spec.recoverer, records[i], p.exc, producer)
                assert c._consumer is not None
                producer.send_offsets(
                    [TopicPartition(t, p, o) for (t, p), o in offsets.items()], c._consumer.consumer_group_metadata()
                )
                producer.commit()
            except TransactionAbortableError as exc:
                abortable += 1
                c._note_kafka_error(exc, "abort and redo the batch's transaction")
                if not c._abort(producer, len(msgs), f"abortable error: {exc}", msgs):
                    return
                if abortable > spec.max_abortable_retries:
                    c._recreate_producer(producer, exc, msgs, escalated=True)
                    return
                continue  # same outputs from memory: the same outcome as re-running the job
            except ApplicationRecoverableError as exc:
                c._recreate_producer(producer, exc, msgs)
                return
            except RecoveryError as exc:
                if c._abort(producer, len(msgs), str(exc), msgs):
                    self._recovery_failed(unit, outcome, exc)
                return
            except OutputError as exc:  # the client refused an output record
                if not c._abort(producer, len(msgs), f"output rejected: {exc}", msgs):
                    return
                log.error(
                    "spark listener %s: an output of the job over %d record(s) was rejected (%s); its rows cannot "
                    "be traced to records, so all of them go to the recoverer",
                    c.name, len(msgs) - len(outcome.poison), exc,
                )  # fmt: skip
                rest = {i: _Poison(exc, 1) for i in range(len(msgs)) if i not in outcome.poison}
                outcome = _Outcome([], {**outcome.poison, **rest}, failed=True)
                continue
            break
        for i, p in poison:
            self._known.pop(unit.coords(i), None)
            self._recovery_failures.pop(unit.coords(i), None)
            c.publish(RecordRecovered(c.name, c.worker, records[i], p.exc, spec.recoverer.name))
        c.publish(
            TransactionCommitted(
                c.name, c.worker, len(msgs), len(outcome.outputs), time.perf_counter() - started,
                "after_rollback" if outcome.failed else "batch",
            )
        )  # fmt: skip

    def _recovery_failed(self, unit: _Unit, outcome: _Outcome, exc: RecoveryError) -> None:
        """Keep every poison record (skip the job for them next time), back off, rewind; stop at the limit."""
        c, spec = self._c, self._spec
        for i, p in outcome.poison.items():
            self._known[unit.coords(i)] = p
        record = exc.record
        key = (record.topic, record.partition, record.offset)
        failures = self._recovery_failures[key] = self._recovery_failures.get(key, 0) + 1
        original = self._known.get(key)
        c.publish(
            RecoveryFailed(c.name, c.worker, record, original.exc if original else None, exc.exception, failures)
        )
        limit = spec.max_recovery_failures
        if limit is not None and failures >= limit:
            raise RecoveryExhaustedError(
                f"listener {c.name!r}: recovery of {record.coordinates} failed {failures} time(s) "
                f"(max_recovery_failures={limit}); last error: {type(exc.exception).__name__}: {exc.exception}. "
                "The container stopped; the record was not committed and will be delivered again on restart."
            ) from exc.exception
        delay = delay_for(spec.recovery_backoff, failures)
        log.error(
            "spark listener %s: recovery of %s failed (%d time(s)): %s: %s; nothing committed, retrying in %.3gs",
            c.name, record.coordinates, failures, type(exc.exception).__name__, exc.exception, delay,
        )  # fmt: skip
        c._seek_to_start(list(unit.msgs))
        c._pause((record.topic, record.partition), delay)

    def _forget_stale(self, msgs: Sequence[Message]) -> None:
        """Drop remembered poison of partitions we lost, or offsets already committed by someone."""
        if not self._known and not self._recovery_failures:
            return
        assigned = self._c.assignment
        first: dict[TP, int] = {}
        for m in msgs:
            first.setdefault((m.topic(), m.partition()), m.offset())
        for table in (self._known, self._recovery_failures):
            for key in list(table):
                tp = (key[0], key[1])
                if tp not in assigned or (tp in first and key[2] < first[tp]):
                    del table[key]
