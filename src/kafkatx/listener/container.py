"""The listener container: one consumer thread running a handler inside Kafka transactions.

Threading: each listener runs ``concurrency`` containers, each on its own
thread with its own Consumer and transactional Producer(s); nothing is shared
between them but the App's event bus. confluent-kafka releases the GIL while
it waits on the network, so threads overlap their I/O.

Per poll, a container takes up to ``max_batch_records`` records (waiting at
most ``max_batch_ms``) and, for each transaction unit (the whole batch with
``fencing="group"``, each partition's slice with ``fencing="partition"``):
begin; run the handler per record and produce its outputs; send the next
offsets with the consumer's group metadata; commit. A transaction is never
open while the consumer polls, so a rebalance never finds one half done.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from kafkatx.errors import (
    ApplicationRecoverableError,
    ErrorClass,
    InvalidConfigurationError,
    KafkaTxError,
    TransactionAbortableError,
    classify,
)
from kafkatx.events import (
    ContainerIdle,
    ContainerStarted,
    ContainerStopped,
    Event,
    HandlerFailed,
    KafkaErrorHandled,
    PartitionsAssigned,
    PartitionsRevoked,
    ProducerRecreated,
    RecordRecovered,
    RecordRetryScheduled,
    RecoveryFailed,
    TransactionAborted,
    TransactionCommitted,
)
from kafkatx.listener.context import bind_sink
from kafkatx.listener.outputs import OutputError, PendingOutput, collect_outputs
from kafkatx.listener.producer import TransactionalProducer
from kafkatx.record import Record, _MessageRecord, to_record
from kafkatx.recoverers import Recoverer
from kafkatx.recoverers._context import RecoveryContext, bind_recovery
from kafkatx.rollback.backoff import delay_for
from kafkatx.rollback.processor import DefaultAfterRollbackProcessor, RecoveryError
from kafkatx.rollback.tracker import FailureTracker

if TYPE_CHECKING:
    from kafkatx.app import Runtime
    from kafkatx.listener.spec import ListenerSpec

__all__ = ["ListenerContainer", "ContainerError", "RecoveryExhaustedError", "FencedTooOftenError"]

log = logging.getLogger("kafkatx.container")

TP = tuple[str, int]
_FENCE_WINDOW_S = 60.0
_IDLE_FIXUP_S = 0.5  # idle time before committing positions past transaction markers


class ContainerError(RuntimeError):
    """A container stopped because it could not go on safely."""


class RecoveryExhaustedError(ContainerError):
    """The recoverer failed ``max_recovery_failures`` times for one record (last-resort stop)."""


class FencedTooOftenError(ContainerError):
    """The producer kept being fenced: another process is probably using the same transactional.id."""


class _HandlerFailure(Exception):
    """Internal: the handler (or its outputs) failed for record ``index`` of a unit."""

    def __init__(self, index: int, exc: BaseException, record: Record) -> None:
        self.index, self.exc, self.record = index, exc, record


class GroupMembershipChanged(Exception):
    """The consumer left or rejoined its group while a transaction was open.

    Its partitions may already belong to another member, so committing would
    risk duplicates; the transaction is aborted instead (the zombie check).
    """


class _RecordBuffer(list[PendingOutput]):
    """Outputs of the record being handled; ``send()`` appends here."""

    __slots__ = ("serializer",)

    def __init__(self, serializer: Any) -> None:
        super().__init__()
        self.serializer = serializer

    add = list.append


class _DirectSink:
    """``send()`` target inside recoverers: produces straight into the transaction."""

    def __init__(self, producer: TransactionalProducer, serializer: Any) -> None:
        self.producer, self.serializer = producer, serializer

    def add(self, output: PendingOutput) -> None:
        self.producer.produce(output)


class ListenerContainer:
    """Runs one listener's consumer loop on its own thread."""

    def __init__(self, spec: ListenerSpec, runtime: Runtime, worker: int, txn_index: int) -> None:
        self.spec = spec
        self.runtime = runtime
        self.worker = worker
        self.txn_index = txn_index
        self.group_id = spec.group_id or runtime.group_id
        self.name = spec.name if spec.concurrency == 1 else f"{spec.name}#{worker}"
        self.tracker = FailureTracker()
        self.arp = spec.after_rollback or DefaultAfterRollbackProcessor(
            spec.recoverer, max_attempts=spec.max_attempts, backoff=spec.backoff, classifier=spec.classifier
        )
        self.failure: BaseException | None = None
        self.stop_reason = "normal"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: Consumer | None = None
        self._group_producer: TransactionalProducer | None = None
        self._partition_producers: dict[TP, TransactionalProducer] = {}
        self._assigned: set[TP] = set()
        self._paused_until: dict[TP, float] = {}
        self._recreations: collections.deque[float] = collections.deque()
        self._committed: dict[TP, int] = {}  # next offset committed per partition, as far as we know
        self._membership: bytes | None = None  # group metadata verified by the last commit; None after a rebalance
        self._last_activity = time.monotonic()
        self._polled_at = self._last_activity
        self._positions_checked = True
        self._idle_interval: float | None = spec.idle_event_interval
        self._last_idle_event = self._last_activity
        self._buffer = _RecordBuffer(spec.serializer)
        self._consumer_config = runtime.consumer_config(spec, self.group_id, worker)
        self._txn_budget = _transaction_budget(spec, runtime.transaction_timeout_ms, self._consumer_config)
        self._fence_hold = _fence_hold(self._consumer_config)
        self.started = threading.Event()
        # Batch listeners (Spark jobs) plug in their own transaction-unit runner.
        factory = spec.options.get("unit_runner")
        self._unit_runner: Callable[[list[Message], TransactionalProducer], None] = (
            factory(self) if factory is not None else self._run_unit
        )

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name=f"kafkatx-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the loop to finish its current batch and close. Thread-safe, returns at once."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def assignment(self) -> set[TP]:
        return set(self._assigned)

    def publish(self, event: Event) -> None:
        if event.worker != self.worker or event.listener != self.name:
            event = replace(event, listener=self.name, worker=self.worker)
        self.runtime.events.publish(event)

    def _main(self) -> None:
        try:
            self._open()
            self.started.set()
            self.publish(ContainerStarted(self.name, self.worker, self.spec.topics))
            while not self._stop.is_set():
                self._poll_and_process()
        except InvalidConfigurationError as exc:
            self.failure, self.stop_reason = exc, "config"
            log.error("listener %s stopped: %s", self.name, exc)
        except FencedTooOftenError as exc:
            self.failure, self.stop_reason = exc, "fenced"
            log.error("listener %s stopped: %s", self.name, exc)
        except BaseException as exc:  # noqa: BLE001 - the thread must report, not vanish
            self.failure, self.stop_reason = exc, "error"
            log.exception("listener %s stopped by an unexpected error", self.name)
        finally:
            self.started.set()
            self._close()
            self.publish(ContainerStopped(self.name, self.worker, self.stop_reason, self.failure))
            self.runtime.container_exited(self)

    def _open(self) -> None:
        spec = self.spec
        if spec.fencing == "group":
            # init_transactions now: it fences a predecessor with the same id and
            # aborts the transaction it left open, before we fetch any offsets.
            self._group_producer = self._new_producer(self.runtime.group_transactional_id(self.group_id, self.txn_index))
            self._group_producer.ensure()
        self._consumer = Consumer(self._consumer_config)
        self._consumer.subscribe(
            list(spec.topics), on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )
        log.info(
            "listener %s consuming %s as group %r (fencing=%s, batch<=%d records/%d ms)",
            self.name, ",".join(spec.topics), self.group_id, spec.fencing, spec.max_batch_records, spec.max_batch_ms,
        )  # fmt: skip

    def _close(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            try:
                consumer.close()  # leaves the group; on_revoke runs and closes partition producers
            except Exception:
                log.debug("consumer close failed", exc_info=True)
        for producer in [*self._partition_producers.values(), *filter(None, [self._group_producer])]:
            producer.close()
        self._partition_producers.clear()

    def _new_producer(self, transactional_id: str) -> TransactionalProducer:
        return TransactionalProducer(
            self.runtime.producer_config(self.spec, transactional_id),
            transactional_id,
            retry_timeout=self.runtime.transaction_retry_timeout,
            on_retry=self._on_kafka_retry,
        )

    def _producer_for(self, tp: TP) -> TransactionalProducer:
        if self._group_producer is not None:
            return self._group_producer
        producer = self._partition_producers.get(tp)
        if producer is None:
            producer = self._new_producer(self.runtime.partition_transactional_id(self.group_id, *tp))
            self._partition_producers[tp] = producer
        return producer

    # -- rebalance callbacks (run inside consume()) --------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._membership = None
        tps = [(p.topic, p.partition) for p in partitions]
        self._assigned.update(tps)
        log.info("listener %s assigned %s", self.name, _fmt_tps(tps))
        if self.spec.fencing == "partition":
            for tp in tps:
                # KIP-98: the partition's fixed transactional.id fences its previous owner
                # and aborts whatever that owner left open.
                self._producer_for(tp).ensure()
        self.publish(PartitionsAssigned(self.name, self.worker, tuple(tps)))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition], lost: bool = False) -> None:
        self._membership = None
        tps = [(p.topic, p.partition) for p in partitions]
        self._assigned.difference_update(tps)
        self.tracker.clear_partitions(tps)
        for tp in tps:
            self._paused_until.pop(tp, None)
            self._committed.pop(tp, None)
            producer = self._partition_producers.pop(tp, None)
            if producer is not None:
                producer.close()
        log.info("listener %s %s %s", self.name, "lost" if lost else "revoked", _fmt_tps(tps))
        self.publish(PartitionsRevoked(self.name, self.worker, tuple(tps), lost))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._on_revoke(consumer, partitions, lost=True)

    # -- the loop -------------------------------------------------------------
    def _poll_and_process(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        if self._paused_until:
            self._resume_due()
        spec = self.spec
        timeout = min(max(spec.max_batch_ms, 10), 500) / 1000.0
        msgs = consumer.consume(spec.max_batch_records, timeout)
        self._polled_at = time.monotonic()
        if msgs and spec.kind == "batch" and len(msgs) < spec.max_batch_records:
            # Batch (Spark) listeners pay per batch, not per record: fill it for up to max_batch_ms.
            deadline = time.monotonic() + spec.max_batch_ms / 1000.0
            while len(msgs) < spec.max_batch_records and not self._stop.is_set():
                left = deadline - time.monotonic()
                more = consumer.consume(spec.max_batch_records - len(msgs), min(left, 0.5)) if left > 0 else []
                if not more:
                    break
                msgs.extend(more)
        if not msgs:
            if not self._positions_checked and time.monotonic() - self._last_activity > _IDLE_FIXUP_S:
                self._commit_positions_past_markers()
            if self._idle_interval is not None:
                self._check_idle(self._idle_interval)
            return
        batch = [m for m in msgs if m.error() is None]
        if len(batch) != len(msgs):
            for m in msgs:
                if m.error() is not None:
                    self._consumer_error(m)
        if self._paused_until:
            held = _first_offsets([m for m in batch if (m.topic(), m.partition()) in self._paused_until])
            if held:  # fetched before the pause took effect: rewind so they come back after it
                batch = [m for m in batch if (m.topic(), m.partition()) not in held]
                for tp, offset in held.items():
                    self._seek(tp, offset)
        if spec.kind == "batch":  # a rebalance during the extra consume() calls may have revoked some
            batch = [m for m in batch if (m.topic(), m.partition()) in self._assigned]
        if not batch:
            return
        self._last_activity = time.monotonic()
        self._positions_checked = False
        if spec.fencing == "partition":
            units: dict[TP, list[Message]] = {}
            for m in batch:
                units.setdefault((m.topic(), m.partition()), []).append(m)
            for tp, unit in units.items():
                if tp in self._assigned:
                    self._unit_runner(unit, self._producer_for(tp))
        else:
            assert self._group_producer is not None
            self._unit_runner(batch, self._group_producer)

    def _check_idle(self, interval: float) -> None:
        """Spring's idleEventInterval: publish ContainerIdle every ``interval`` while no records arrive."""
        now = time.monotonic()
        if now - max(self._last_idle_event, self._last_activity) >= interval:
            self._last_idle_event = now
            self.publish(ContainerIdle(self.name, self.worker, now - self._last_activity))

    def _commit_positions_past_markers(self) -> None:
        """When idle, commit positions that moved past transaction markers or aborted records.

        A read_committed consumer skips those control records, so without this
        the committed offset stays one (or more) short of the end and lag never
        reaches zero (Spring's ``fixTxOffsets``, on by default here).
        """
        self._positions_checked = True
        consumer = self._consumer
        if consumer is None or not self._committed:
            return
        tps = [TopicPartition(t, p) for (t, p) in self._committed if (t, p) in self._assigned and (t, p) not in self._paused_until]
        if not tps:
            return
        ahead: dict[TP, int] = {}
        for tp in consumer.position(tps):
            key = (tp.topic, tp.partition)
            if tp.offset > self._committed.get(key, tp.offset):
                ahead[key] = tp.offset
        by_producer: dict[int, tuple[TransactionalProducer, dict[TP, int]]] = {}
        for tp, offset in ahead.items():
            producer = self._producer_for(tp)
            by_producer.setdefault(id(producer), (producer, {}))[1][tp] = offset
        for producer, offsets in by_producer.values():
            try:
                producer.begin()
                membership = consumer.consumer_group_metadata()
                producer.send_offsets([TopicPartition(t, p, o) for (t, p), o in offsets.items()], membership)
                producer.commit(guard=self._membership_guard(membership))
            except (KafkaTxError, GroupMembershipChanged) as exc:
                log.debug("offset fix-up skipped: %s", exc)
                try:
                    producer.abort()
                except KafkaTxError:
                    producer.discard()
                continue
            self._committed.update(offsets)
            log.debug("listener %s committed positions past transaction markers: %s", self.name, offsets)

    def _consumer_error(self, msg: Message) -> None:
        err: KafkaError = msg.error()
        code = err.code()
        if code == KafkaError._PARTITION_EOF:
            return
        if code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
            raise InvalidConfigurationError(
                f"listener {self.name!r}: input topic {msg.topic()!r} does not exist ({err.str()}); "
                "create it, or fix the topic name",
                error=err,
                operation="consume",
            )
        cls = classify(err)
        if cls is ErrorClass.INVALID_CONFIGURATION or err.fatal():
            raise KafkaTxError.from_kafka(err, operation="consume")
        log.warning("listener %s: consumer error %s: %s (librdkafka retries)", self.name, err.name(), err.str())

    def _resume_due(self) -> None:
        now = time.monotonic()
        due = [tp for tp, until in self._paused_until.items() if until <= now]
        if due and self._consumer is not None:
            for tp in due:
                del self._paused_until[tp]
            try:
                self._consumer.resume([TopicPartition(t, p) for t, p in due])
            except Exception:
                log.debug("resume of %s failed (revoked?)", due, exc_info=True)

    # -- one transaction unit ---------------------------------------------------
    def _run_unit(self, msgs: list[Message], producer: TransactionalProducer) -> None:
        abortable = 0
        while True:
            try:
                self._transact(msgs, producer)
                return
            except _HandlerFailure as failure:
                if self._abort(producer, len(msgs), f"handler failed on {failure.record.coordinates}", msgs):
                    rest = self._after_rollback(msgs, failure, producer)
                    if rest:  # the records the after-rollback transaction did not commit, from memory
                        msgs, abortable = rest, 0
                        continue
                return
            except (TransactionAbortableError, ApplicationRecoverableError, GroupMembershipChanged) as exc:
                abortable += isinstance(exc, TransactionAbortableError)
                if self._react(exc, producer, msgs, abortable, "abort and reprocess the batch"):
                    continue  # reprocess the same records from memory: same outcome as seek + poll
                return

    def _react(
        self,
        exc: TransactionAbortableError | ApplicationRecoverableError | GroupMembershipChanged,
        producer: TransactionalProducer,
        msgs: list[Message],
        abortable: int,
        action: str,
    ) -> bool:
        """The KIP-1050 reaction to a Kafka error inside a transaction. True: redo the transaction.

        Abortable: abort and redo, up to ``max_abortable_retries`` in a row, then
        escalate. Application-recoverable (fencing): replace the producer and
        rewind to the committed offsets; the after-rollback processor is not
        involved. Membership lost: abort and rewind.
        """
        if isinstance(exc, TransactionAbortableError):
            self._note_kafka_error(exc, action)
            if not self._abort(producer, len(msgs), f"abortable error: {exc}", msgs):
                return False
            if abortable > self.spec.max_abortable_retries:
                self._recreate_producer(producer, exc, msgs, escalated=True)
                return False
            return True
        if isinstance(exc, ApplicationRecoverableError):
            self._recreate_producer(producer, exc, msgs)
        else:
            self._membership_changed(producer, exc, msgs)
        return False

    def _membership_guard(self, membership: bytes) -> Callable[[], None]:
        """A pre-commit check that this consumer is still the group member that sent the offsets.

        A worker that stalled past max.poll.interval.ms has left the group by
        the time it wakes up; its partitions may be someone else's. Brokers
        with KIP-447 also make the new owner wait for our pending offsets, but
        checking here costs nothing and protects on brokers that do not.
        """

        def guard() -> None:
            consumer = self._consumer
            current = consumer.consumer_group_metadata() if consumer is not None else membership
            if current == membership:
                self._membership = current  # verified just now: the next transaction may send offsets with it
                return
            self._membership = None
            raise GroupMembershipChanged(
                f"listener {self.name!r}: group membership changed while the transaction was open "
                "(max.poll.interval.ms exceeded or a rebalance); aborting instead of committing"
            )

        return guard

    def _membership_changed(self, producer: TransactionalProducer, exc: GroupMembershipChanged, msgs: list[Message]) -> None:
        log.warning("%s", exc)
        if self._abort(producer, len(msgs), str(exc), msgs):
            self._rewind_to_committed(msgs)

    def _transact(self, msgs: Sequence[Message], producer: TransactionalProducer) -> None:
        spec = self.spec
        handler = spec.handler
        default_topic = spec.output
        serializer = spec.serializer
        name = spec.name
        tracker = self.tracker
        failing = tracker.failing  # non-empty only while a record is failing
        buf = self._buffer
        buf.clear()
        produce = producer.produce
        offsets: dict[TP, int] = {}
        run_topic, run_partition, run_next = None, -1, -1  # the current run of one partition's records
        outputs = 0
        started = time.perf_counter()
        deadline = started + self._txn_budget
        check_at, stopped_at = 1, -1
        new_record = object.__new__
        producer.begin()
        direct = producer.direct(default_topic) if default_topic is not None else None
        previous = bind_sink(buf)
        try:
            for i, msg in enumerate(msgs):
                if i == check_at:  # the transaction's time budget, checked often enough, cheaply
                    now = time.perf_counter()
                    if now >= deadline:
                        stopped_at = i
                        break
                    per_record = (now - started) / i
                    check_at = i + max(1, min(256, int((deadline - now) / (4 * per_record)) if per_record > 0 else 256))
                topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
                attempt = 1
                if failing:
                    state = tracker.state_at(topic, partition, offset)
                    if state is not None:
                        attempt = state.failures + 1
                        if state.pending_recovery:
                            raise _HandlerFailure(i, state.last_exception or RuntimeError("recovery pending"), to_record(msg, attempt))
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
                except Exception as exc:
                    if spec.retry != "in_place" or not self._retry_in_place(record, exc, producer):
                        raise _HandlerFailure(i, exc, record) from None
                if value is not None:
                    try:
                        direct(default_topic, value)  # type: ignore[misc]
                        outputs += 1
                    except (BufferError, KafkaException):  # queue full, or an error: produce() below waits or classifies it
                        buf.append(PendingOutput(default_topic, value, None, None, None))  # type: ignore[arg-type]
                if buf:
                    try:
                        for out in buf:
                            produce(out)
                    except OutputError as exc:
                        raise _HandlerFailure(i, exc, record) from None
                    outputs += len(buf)
                    buf.clear()
                if partition != run_partition or topic != run_topic:
                    if run_topic is not None:
                        offsets[(run_topic, run_partition)] = run_next
                    run_topic, run_partition = topic, partition
                run_next = offset + 1
            if run_topic is not None:
                offsets[(run_topic, run_partition)] = run_next
            assert self._consumer is not None
            # The membership the last commit's guard verified, unless a rebalance callback has run since;
            # this commit's guard checks it is still current, so one metadata round trip per transaction.
            membership = self._membership or self._consumer.consumer_group_metadata()
            producer.send_offsets([TopicPartition(t, p, o) for (t, p), o in offsets.items()], membership)
            producer.commit(guard=self._membership_guard(membership))
        finally:
            bind_sink(previous)
        self._committed.update(offsets)
        handled = len(msgs) if stopped_at < 0 else stopped_at
        self.publish(TransactionCommitted(self.name, self.worker, handled, outputs, time.perf_counter() - started))
        if stopped_at >= 0:  # the rest of the poll is fetched again for the next transaction
            log.debug(
                "listener %s: transaction time budget (%.3gs) used after %d of %d records",
                self.name, self._txn_budget, stopped_at, len(msgs),
            )  # fmt: skip
            self._seek_to_start(msgs[stopped_at:])

    def _retry_in_place(self, record: Record, exc: BaseException, producer: TransactionalProducer) -> bool:
        """``retry="in_place"``: retry or recover a failed record without aborting the batch.

        Its outputs are discarded on each failure (they were only buffered), so
        the Kafka transaction never sees a failed attempt. Returns False to fall
        back to the rollback path (recoverer failed, or the container stops).
        """
        spec, tracker, buf = self.spec, self.tracker, self._buffer
        first = exc  # the exception our caller is handling: Python makes it every retry's __context__
        while True:
            buf.clear()
            state = tracker.record_failure(record, exc)
            self.publish(HandlerFailed(self.name, self.worker, record, exc, state.failures))
            if spec.classifier.is_retryable(exc) and state.failures < spec.max_attempts:
                delay = delay_for(spec.backoff, state.failures)
                self.publish(RecordRetryScheduled(self.name, self.worker, record, state.failures + 1, delay))
                if delay and self._stop.wait(delay):
                    return False
                record = replace(record, attempt=state.failures + 1)
                try:
                    result = spec.handler(record)
                    collect_outputs(result, spec.output, spec.serializer, spec.name, buf)
                except Exception as again:
                    if again.__context__ is first:  # attempts are not "during handling" of each other
                        again.__context__ = None
                    exc = again
                    continue
                tracker.clear(record)
                return True
            try:
                self._recover(spec.recoverer, replace(record, attempt=state.failures), exc, producer, confirm_delivery=False)
            except RecoveryError:
                log.warning("in-place recovery of %s failed; falling back to the rollback path", record.coordinates)
                return False
            tracker.clear(record)
            self.publish(RecordRecovered(self.name, self.worker, record, exc, spec.recoverer.name))
            return True

    def _recover(
        self,
        recoverer: Recoverer,
        record: Record,
        exc: BaseException,
        producer: TransactionalProducer,
        *,
        confirm_delivery: bool = True,
    ) -> None:
        """Run a recoverer inside the open transaction, with ``send()`` producing directly.

        ``confirm_delivery=False`` (in-place recovery inside a big batch
        transaction) makes the recoverer's ``flush()`` a no-op: the batch's
        commit confirms delivery, and a failed dead letter fails that commit.
        """
        prev_sink = bind_sink(_DirectSink(producer, self.spec.serializer))
        prev_ctx = bind_recovery(
            RecoveryContext(self.name, self.group_id, producer.partition_count,
                            producer.flush if confirm_delivery else list)
        )  # fmt: skip
        try:
            recoverer(record, exc)
        except (KafkaTxError, _HandlerFailure):
            raise
        except Exception as failure:
            raise RecoveryError(record, failure, recoverer.name) from failure
        finally:
            bind_recovery(prev_ctx)
            bind_sink(prev_sink)

    # -- after rollback -----------------------------------------------------------
    def _after_rollback(
        self, msgs: list[Message], failure: _HandlerFailure, producer: TransactionalProducer
    ) -> list[Message]:
        """Rollback processing in a new transaction. Returns the records to handle next, from memory.

        Those are the records the transaction did not commit on partitions
        that are not held for a back-off (Spring seeks back and polls them
        again; the result is the same without the round trip). Records of a
        held partition are rewound instead, and so is everything when the
        consumer has not polled for a transaction budget (max.poll.interval.ms).
        """
        attempts = 0
        while True:
            scope = _RollbackScope(self, msgs, failure, producer)
            started = time.perf_counter()
            try:
                producer.begin()
                previous = bind_sink(self._buffer)
                try:
                    self.arp.process(scope)
                finally:
                    bind_sink(previous)
                membership = scope.send_offsets()
                producer.commit(guard=self._membership_guard(membership) if membership is not None else None)
            except _HandlerFailure as again:  # a replayed batch-mate failed this time
                if not self._abort(producer, again.index + 1, f"replay failed on {again.record.coordinates}", msgs):
                    return []
                failure = again
                continue
            except RecoveryError as exc:
                if self._abort(producer, 1, str(exc), msgs):
                    self._recovery_failed(msgs, failure, exc, producer)
                return []
            except (TransactionAbortableError, ApplicationRecoverableError, GroupMembershipChanged) as exc:
                attempts += isinstance(exc, TransactionAbortableError)
                if self._react(exc, producer, msgs, attempts, "abort the after-rollback transaction"):
                    continue
                return []
            in_memory = not self._stop.is_set() and time.monotonic() - self._polled_at < self._txn_budget
            rest = scope.apply(keep_in_memory=in_memory)
            self.publish(
                TransactionCommitted(self.name, self.worker, scope.committed_records, scope.outputs,
                                     time.perf_counter() - started, "after_rollback")
            )  # fmt: skip
            return rest

    def _recovery_failed(
        self, msgs: list[Message], failure: _HandlerFailure, exc: RecoveryError, producer: TransactionalProducer
    ) -> None:
        record = exc.record
        state = self.tracker.record_recovery_failure(record)
        if state.last_exception is None:
            state.last_exception = exc.exception if failure.exc is None else failure.exc
        self.publish(RecoveryFailed(self.name, self.worker, record, failure.exc, exc.exception, state.recovery_failures))
        limit = self.spec.max_recovery_failures
        if limit is not None and state.recovery_failures >= limit:
            raise RecoveryExhaustedError(
                f"listener {self.name!r}: recovery of {record.coordinates} failed {state.recovery_failures} time(s) "
                f"(max_recovery_failures={limit}); last error: {type(exc.exception).__name__}: {exc.exception}. "
                "The container stopped; the record was not committed and will be delivered again on restart."
            ) from exc.exception
        delay = delay_for(self.spec.recovery_backoff, state.recovery_failures)
        log.error(
            "recovery of %s failed (%d time(s)): %s: %s; keeping the record, retrying recovery in %.3gs",
            record.coordinates, state.recovery_failures, type(exc.exception).__name__, exc.exception, delay,
            extra={"topic": record.topic, "partition": record.partition, "offset": record.offset},
        )  # fmt: skip
        if not self._commit_processed(msgs, failure, producer):
            self._seek_to_start(msgs)
        self._pause((record.topic, record.partition), delay)

    def _commit_processed(self, msgs: list[Message], failure: _HandlerFailure, producer: TransactionalProducer) -> bool:
        """Commit the batch-mates before a record whose recovery failed, keeping only that record.

        Without this, every failed recovery (a dead-letter topic that is down)
        would roll the healthy records back with it, over and over.
        """
        scope = _RollbackScope(self, msgs, failure, producer)
        try:
            producer.begin()
            previous = bind_sink(self._buffer)
            try:
                scope.replay_processed()
            finally:
                bind_sink(previous)
            membership = scope.send_offsets()
            producer.commit(guard=self._membership_guard(membership) if membership is not None else None)
        except (_HandlerFailure, TransactionAbortableError, GroupMembershipChanged) as exc:
            log.debug("could not commit the batch-mates of %s: %s", failure.record.coordinates, exc)
            return self._abort(producer, failure.index, "batch-mates not committed", msgs) and False
        except ApplicationRecoverableError as exc:
            self._recreate_producer(producer, exc, msgs)  # rewinds to the committed offsets
            return True
        scope.apply()
        return True

    # -- Kafka error reactions ------------------------------------------------------
    def _abort(self, producer: TransactionalProducer, records: int, reason: str, msgs: list[Message]) -> bool:
        """Abort; False if the abort itself failed (the producer was then replaced)."""
        try:
            producer.abort()
        except ApplicationRecoverableError as exc:
            self._recreate_producer(producer, exc, msgs)
            return False
        self.publish(TransactionAborted(self.name, self.worker, records, reason))
        log.debug("listener %s aborted a transaction of %d record(s): %s", self.name, records, reason)
        return True

    def _recreate_producer(
        self, producer: TransactionalProducer, exc: KafkaTxError, msgs: list[Message], *, escalated: bool = False
    ) -> None:
        """Application-recoverable: drop the producer, rewind to the committed offsets, carry on.

        The after-rollback processor is not called: after fencing the
        partitions may belong to another consumer already.
        """
        now = time.monotonic()
        self._recreations.append(now)
        while self._recreations and self._recreations[0] < now - _FENCE_WINDOW_S:
            self._recreations.popleft()
        log.warning(
            "listener %s: %s%s; replacing producer %s and rewinding to the committed offsets",
            self.name, "escalated: " if escalated else "", exc, producer.transactional_id,
        )  # fmt: skip
        producer.discard()
        self.publish(ProducerRecreated(self.name, self.worker, producer.transactional_id, exc))
        self._note_kafka_error(exc, "recreate producer")
        if len(self._recreations) > self.runtime.max_producer_recreations:
            raise FencedTooOftenError(
                f"listener {self.name!r}: producer {producer.transactional_id} had to be replaced "
                f"{len(self._recreations)} times within {_FENCE_WINDOW_S:.0f}s (last error: {exc}). Another process "
                "is probably using the same transactional.id: give each instance a unique instance_id."
            ) from exc
        self._rewind_to_committed(msgs)
        if self.spec.fencing == "partition" and not escalated and exc.fenced:
            # KIP-98 mode: the transactional.id belongs to the partition, so a newer producer with
            # it means the partition was most likely given to another consumer, and this one has
            # not heard yet (it was dropped from the group while busy). Starting a new producer now
            # would fence that owner in turn, and both would commit the same records. So hold the
            # partition until the group says whose it is: a revoke ends the hold, and if it is
            # still ours after a couple of heartbeats, the next transaction takes the id back.
            for tp in _first_offsets(msgs):
                log.warning("listener %s: holding %s[%d] for %.0fs after fencing (was it reassigned?)",
                            self.name, tp[0], tp[1], self._fence_hold)  # fmt: skip
                self._pause(tp, self._fence_hold)

    def _rewind_to_committed(self, msgs: list[Message]) -> None:
        consumer = self._consumer
        assert consumer is not None
        starts = _first_offsets(msgs)
        wanted = [TopicPartition(t, p) for (t, p) in starts if (t, p) in self._assigned]
        if not wanted:
            return
        try:
            committed = consumer.committed(wanted, timeout=10)
        except Exception:
            log.warning("could not read committed offsets; rewinding to the batch start", exc_info=True)
            committed = [TopicPartition(tp.topic, tp.partition, starts[(tp.topic, tp.partition)]) for tp in wanted]
        for tp in committed:
            offset = tp.offset if tp.offset >= 0 else starts[(tp.topic, tp.partition)]
            self._seek((tp.topic, tp.partition), offset)

    def _note_kafka_error(self, exc: KafkaTxError, action: str) -> None:
        self.publish(
            KafkaErrorHandled(self.name, self.worker, exc.operation or "", exc.error_class.name, exc, action)
        )

    def _on_kafka_retry(self, cls: ErrorClass, err: KafkaError, attempt: int) -> None:
        self.publish(KafkaErrorHandled(self.name, self.worker, "", cls.name, None, f"retry #{attempt}", {"code": err.name()}))

    # -- seeking and pausing ----------------------------------------------------------
    def _seek(self, tp: TP, offset: int) -> None:
        assert self._consumer is not None
        try:
            self._consumer.seek(TopicPartition(tp[0], tp[1], offset))
        except Exception as exc:  # revoked meanwhile: its new owner starts from the committed offset
            log.debug("seek %s to %d skipped: %s", tp, offset, exc)

    def _seek_to_start(self, msgs: list[Message]) -> None:
        for tp, offset in _first_offsets(msgs).items():
            self._seek(tp, offset)

    def _pause(self, tp: TP, seconds: float) -> None:
        """Hold a partition while the consumer keeps polling (no rebalance, other partitions flow)."""
        if seconds <= 0 or self._consumer is None or tp not in self._assigned:
            return
        try:
            self._consumer.pause([TopicPartition(*tp)])
        except Exception:
            log.debug("pause of %s failed", tp, exc_info=True)
            return
        self._paused_until[tp] = time.monotonic() + seconds


class _RollbackScope:
    """The :class:`~kafkatx.rollback.processor.RollbackContext` the container hands to the processor."""

    def __init__(
        self, container: ListenerContainer, msgs: list[Message], failure: _HandlerFailure, producer: TransactionalProducer
    ) -> None:
        self._c = container
        self._msgs = msgs
        self._producer = producer
        self._index = failure.index
        self.listener = container.name
        self.group_id = container.group_id
        self.tracker = container.tracker
        self.failed = failure.record
        self.exception = failure.exc
        self.processed = [to_record(m) for m in msgs[: failure.index]]
        self._offsets: dict[TP, int] = {}
        self._recovered: list[Record] = []
        self._pauses: dict[TP, float] = {}
        self.outputs = 0
        self.committed_records = 0

    @functools.cached_property
    def records(self) -> list[Record]:
        """The unprocessed records, failed one first (built on demand: the default processor never needs them)."""
        return [self.failed, *(to_record(m) for m in self._msgs[self._index + 1 :])]

    @property
    def stopping(self) -> bool:
        return self._c._stop.is_set()

    def publish(self, event: Event) -> None:
        self._c.publish(event)

    def replay_processed(self) -> None:
        if not self.processed:
            return
        spec, buf = self._c.spec, self._c._buffer
        for i, record in enumerate(self.processed):
            buf.clear()
            try:
                collect_outputs(spec.handler(record), spec.output, spec.serializer, spec.name, buf)
                for out in buf:
                    self._producer.produce(out)
            except (KafkaTxError, _HandlerFailure):
                raise
            except Exception as exc:
                raise _HandlerFailure(i, exc, record) from None
            self.outputs += len(buf)
            self._offsets[(record.topic, record.partition)] = record.offset + 1
            self.committed_records += 1
        buf.clear()

    def recover(self, recoverer: Recoverer, record: Record, exception: BaseException) -> None:
        self._c._recover(recoverer, record, exception, self._producer)

    def commit_offset(self, record: Record) -> None:
        tp = (record.topic, record.partition)
        self._offsets[tp] = max(self._offsets.get(tp, -1), record.offset + 1)
        self._recovered.append(record)
        self.committed_records += 1

    def seek_unprocessed(self, *, include_failed: bool = True) -> None:
        """Seeks are derived from what this transaction commits; see :meth:`apply`."""

    def backoff(self, record: Record, seconds: float) -> None:
        if seconds > 0:
            self._pauses[(record.topic, record.partition)] = seconds

    def send_offsets(self) -> bytes | None:
        """Send this transaction's offsets; returns the group membership they were sent with."""
        if not self._offsets:
            return None
        consumer = self._c._consumer
        assert consumer is not None
        membership: bytes = consumer.consumer_group_metadata()
        self._producer.send_offsets([TopicPartition(t, p, o) for (t, p), o in self._offsets.items()], membership)
        return membership

    def apply(self, *, keep_in_memory: bool = False) -> list[Message]:
        """After the commit: rewind every partition to its first record not committed, and pause.

        With ``keep_in_memory``, partitions not held for a back-off are not
        rewound: their uncommitted records are returned, to be handled next.
        """
        self._c._committed.update(self._offsets)
        for record in self._recovered:
            self.tracker.clear(record)
        last: dict[TP, int] = {}
        for m in self._msgs:
            last[(m.topic(), m.partition())] = m.offset()
        kept: dict[TP, int] = {}
        for tp, first in _first_offsets(self._msgs).items():
            target = self._offsets.get(tp, first)
            if last[tp] >= target:  # some of this partition's records were not committed
                if keep_in_memory and tp not in self._pauses:
                    kept[tp] = target
                else:
                    self._c._seek(tp, target)
        for tp, seconds in self._pauses.items():
            self._c._pause(tp, seconds)
        if not kept:
            return []
        return [m for m in self._msgs if m.offset() >= kept.get((m.topic(), m.partition()), _NEVER)]


def _transaction_budget(spec: ListenerSpec, transaction_timeout_ms: int, consumer_config: dict[str, Any]) -> float:
    """Seconds of handling after which a transaction takes no more records (``max_transaction_ms``).

    By default a third of the smaller of the transaction timeout and
    max.poll.interval.ms: slow handlers then split a big poll over several
    transactions instead of outliving the broker's transaction timeout or
    being thrown out of the group.
    """
    if spec.max_transaction_ms is not None:
        return spec.max_transaction_ms / 1000.0
    max_poll = int(consumer_config.get("max.poll.interval.ms", 300_000))
    return min(transaction_timeout_ms, max_poll) / 3000.0


_NEVER = 2**63  # an offset no record reaches


def _fence_hold(consumer_config: dict[str, Any]) -> float:
    """Seconds to hold a partition after fencing: two heartbeats (a consumer dropped from its
    group learns it from the next heartbeat response), plus a second, at most a session timeout."""
    heartbeat = int(consumer_config.get("heartbeat.interval.ms", 3000)) / 1000.0
    session = int(consumer_config.get("session.timeout.ms", 45_000)) / 1000.0
    return min(session, 2 * heartbeat + 1.0)


def _first_offsets(msgs: Sequence[Message]) -> dict[TP, int]:
    first: dict[TP, int] = {}
    for m in msgs:
        first.setdefault((m.topic(), m.partition()), m.offset())
    return first


def _fmt_tps(tps: list[TP]) -> str:
    return ", ".join(f"{t}[{p}]" for t, p in sorted(tps)) or "nothing"

