"""A transactional producer with KIP-1050 error handling around every call.

Retriable errors are retried here (tenacity, bounded by the retry timeout)
and never reach handlers; everything else leaves as a typed
:class:`~kafkatx.errors.KafkaClientError` so the container can react by class.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer, TopicPartition

from kafkatx.client.bounded import BoundedCaller, CallInProgress
from kafkatx.client.retry import retry_call
from kafkatx.errors import (
    ApplicationRecoverableError,
    KafkaClientError,
    OutputRefusedError,
    RecordRejectedError,
    StuckCallError,
    TransactionAbortableError,
    UnknownTopicError,
)
from kafkatx.errors.classification import ErrorClass, classify
from kafkatx.outputs import PendingOutput

__all__ = ["TransactionalProducer"]

log = logging.getLogger("kafkatx.producer")


#: Delivery errors of records librdkafka purged: the consequence of a transaction's failure, never its cause.
_PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})


#: Beyond the two calls' own timeouts, how long the offsets-then-commit job may run before it is abandoned.
COMMIT_DEADLINE_MARGIN_S = 5.0


class TransactionalProducer:
    """One transactional.id and the confluent-kafka Producer currently holding it.

    The Producer is created lazily and replaced after application-recoverable
    errors (fencing): :meth:`discard` drops it and the next :meth:`begin`
    creates a new one with the same transactional.id and calls
    ``init_transactions``, which also aborts any transaction a predecessor
    left open.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        transactional_id: str,
        *,
        retry_timeout: float,
        on_retry: Callable[[ErrorClass, KafkaError, int], None] | None = None,
    ) -> None:
        self.transactional_id = transactional_id
        self._config = {**config, "transactional.id": transactional_id}
        self._config.setdefault("delivery.report.only.error", True)
        self._config["on_delivery"] = self._on_delivery
        self.retry_timeout = retry_timeout
        self._on_retry = on_retry
        self._producer: Producer | None = None
        self.in_transaction = False
        self.delivery_errors: list[str] = []
        self._delivery_failures: list[tuple[KafkaError, str, int]] = []  # the error, and the record's topic, partition
        self._known_topics: dict[str, int] = {}
        self.generation = 0  # bumped each time a new Producer takes over the id
        #: When set (a listener with ``database=``), every produced record is appended here for the outbox.
        self.recorder: list[PendingOutput] | None = None
        self._caller = BoundedCaller(transactional_id)  # one per librdkafka handle, see client/bounded.py
        #: Named by an error whose retries ran out (which cluster did not answer, for which id).
        self._where = (
            f"transactional.id {transactional_id!r}, bootstrap.servers {self._config.get('bootstrap.servers')}"
        )
        #: send_offsets_to_transaction calls not made yet: they go with the commit (see commit()).
        self._pending_offsets: list[tuple[list[TopicPartition], Any]] = []

    # -- lifecycle ----------------------------------------------------------
    @property
    def client_config(self) -> dict[str, Any]:
        """The settings this producer was created with (a copy: for another client of the same cluster)."""
        return dict(self._config)

    @property
    def ready(self) -> bool:
        return self._producer is not None

    def ensure(self) -> Producer:
        """The live Producer, creating and initialising one if needed."""
        if self._producer is None:
            producer = Producer(self._config)
            self._caller = BoundedCaller(self.transactional_id)
            try:
                self._call(
                    "init_transactions",
                    lambda: producer.init_transactions(self._api_timeout()),
                    refresh=lambda: producer.list_topics(timeout=5),  # self._producer is not set yet
                    bounded=True,
                )
            except BaseException:
                if not self._caller.abandoned:  # a stuck handle is left alone (see client/bounded.py)
                    try:
                        with warnings.catch_warnings():
                            # confluent-kafka warns that close() cannot abort while librdkafka still runs the
                            # init that timed out: there is no transaction to abort, and the error above says why.
                            warnings.simplefilter("ignore", RuntimeWarning)
                            producer.close(0)  # type: ignore[call-arg]  # the stubs miss close(timeout); confluent-kafka raises the producer's fatal error here again
                    except Exception:
                        log.debug("closing the failed producer %s failed", self.transactional_id, exc_info=True)
                self._caller.close()
                raise
            self._producer = producer
            self.generation += 1
            log.debug("transactional producer %s initialised (generation %d)", self.transactional_id, self.generation)
        return self._producer

    def discard(self) -> None:
        """Throw the Producer away (after fencing or at shutdown); purges unsent records."""
        producer, self._producer = self._producer, None
        self.in_transaction = False
        self._pending_offsets = []  # a new list: an abandoned helper thread may still hold the old one
        self._known_topics.clear()
        self._caller.close()
        if producer is not None and self._caller.abandoned:
            # A call on it never returned: its helper thread still uses it. The new producer's
            # init_transactions fences it (not on the embedded broker after a restart, so a commit job also
            # stops itself, see _commit_with_offsets); it is freed once that call returns.
            log.warning("abandoning producer %s, stuck in a client call", self.transactional_id)
        elif producer is not None:
            try:
                producer.purge()
            except Exception:
                pass
            try:
                with warnings.catch_warnings():
                    # confluent-kafka warns when close() cannot abort the open transaction; a
                    # discarded producer is typically fenced, and its transaction is dead anyway.
                    warnings.simplefilter("ignore", RuntimeWarning)
                    producer.close(1.0)  # type: ignore[call-arg]  # the stubs miss close(timeout)
            except Exception:
                log.debug("closing producer %s failed", self.transactional_id, exc_info=True)

    def close(self) -> None:
        """Abort any open transaction and close the Producer."""
        if self._producer is not None and self.in_transaction:
            try:
                self.abort()
            except KafkaClientError:
                log.warning("abort at close of %s failed", self.transactional_id, exc_info=True)
        self.discard()

    # -- transaction API ----------------------------------------------------
    def begin(self) -> None:
        producer = self.ensure()
        self.delivery_errors.clear()
        self._delivery_failures.clear()
        self._pending_offsets = []
        try:
            producer.begin_transaction()  # a local call that never blocks: the retry loop only once it failed
        except KafkaException as exc:
            self._call("begin_transaction", producer.begin_transaction, first_failure=exc)
        self.in_transaction = True

    def produce(self, out: PendingOutput, on_error: Callable[[KafkaError], None] | None = None) -> None:
        """Produce ``out`` in the open transaction. ``on_error`` receives this record's own delivery error."""
        producer = self._producer
        assert producer is not None and self.in_transaction, "produce outside a transaction"
        if self.recorder is not None:
            self.recorder.append(out)
        topic, value, key, headers, partition = out
        if topic not in self._known_topics and self.partition_count(topic) is None:
            raise UnknownTopicError(
                f"output topic {topic!r} does not exist; create it first (kafkatx never auto-creates output topics)"
            )
        while True:
            try:
                if on_error is not None:
                    producer.produce(
                        topic,
                        value,
                        key,
                        partition if partition is not None else -1,
                        headers=headers,  # type: ignore[arg-type]
                        on_delivery=self._own_delivery(on_error),
                    )
                elif partition is None:
                    producer.produce(topic, value, key, headers=headers)  # type: ignore[arg-type]
                else:
                    producer.produce(topic, value, key, partition, headers=headers)  # type: ignore[arg-type]
                return
            except BufferError:
                producer.poll(0.05)  # local queue full: let deliveries drain
            except KafkaException as exc:
                raise self._produce_error(exc, out) from exc

    def direct(self, topic: str) -> Callable[..., Any] | None:
        """confluent-kafka's own ``produce``, for the container's hot path: ``direct(topic, value)``.

        None outside a transaction or when ``topic`` does not exist (then use
        :meth:`produce`, which raises UnknownTopicError). On BufferError or
        KafkaException the caller falls back to :meth:`produce`, which waits
        for queue space and classifies the error.
        """
        producer = self._producer
        if producer is None or not self.in_transaction or self.recorder is not None:
            return None  # (records going to an outbox are produced through produce())
        if topic not in self._known_topics and self.partition_count(topic) is None:
            return None
        return producer.produce

    def send_offsets(self, offsets: list[TopicPartition], group_metadata: Any) -> None:
        """Add the consumer's next ``offsets`` to the transaction.

        The ``send_offsets_to_transaction`` call is made by :meth:`commit`, in
        the same hand-off to the helper thread as ``commit_transaction`` (one
        thread wake-up each way per transaction instead of two), or earlier by
        :meth:`flush_offsets`. Its errors are raised from there, retried and
        classified as ``send_offsets_to_transaction``'s.
        """
        self._pending_offsets.append((offsets, group_metadata))

    def flush_offsets(self) -> None:
        """Make the pending ``send_offsets_to_transaction`` calls now."""
        producer = self._producer
        assert producer is not None
        pending = self._pending_offsets
        while pending:
            offsets, group_metadata = pending[0]
            self._call(
                "send_offsets_to_transaction",
                lambda: producer.send_offsets_to_transaction(offsets, group_metadata, self._api_timeout()),
                bounded=True,
            )
            pending.pop(0)

    def commit(self, guard: Callable[[], None] | None = None, meanwhile: Callable[[], None] | None = None) -> None:
        """Commit the transaction, with the offsets sent to it. ``guard`` runs just before, and may raise to prevent it.

        ``meanwhile`` runs on this thread while the first commit attempt is under way on the helper thread
        (the overlapped commit, see :mod:`kafkatx.listener.loop.overlap`); it must not use this producer.
        """
        producer = self._producer
        assert producer is not None
        if guard is not None:
            guard()
        if self._pending_offsets:
            self._commit_with_offsets(producer, meanwhile)
        else:
            # A commit that times out is resumed by calling it again (librdkafka: "retry call to resume").
            self._call("commit_transaction", lambda: producer.commit_transaction(self._api_timeout()), bounded=True)
        self.in_transaction = False

    def _commit_with_offsets(self, producer: Producer, meanwhile: Callable[[], None] | None = None) -> None:
        """The pending offsets and the commit in one call on the helper thread.

        A Kafka error there continues on the usual path: the failed call is
        replayed as the first attempt of its own retry loop (so it is retried,
        or classified, under its own name), then the rest is done call by call.
        """
        pending, caller, timeout = self._pending_offsets, self._caller, self._api_timeout()

        def offsets_then_commit() -> None:
            while pending:
                offsets, group_metadata = pending[0]
                producer.send_offsets_to_transaction(offsets, group_metadata, timeout)
                pending.pop(0)
                if caller.abandoned:
                    # Given up while the call was stuck: a new producer redoes the batch from the committed offsets.
                    # Committing this one too relies on the broker having fenced it, which a broker that hands the
                    # new producer another producer id (the embedded one after a restart, docs/BROKERS.md) has not.
                    log.warning(
                        "the abandoned send_offsets_to_transaction of %s returned; its transaction is not committed",
                        self.transactional_id,
                    )
                    raise StuckCallError(
                        "abandoned: its batch is redone by a new producer", operation="send_offsets_to_transaction"
                    )
            job = caller.current
            if job is not None:
                job.operation = "commit_transaction"  # what a stuck call or a stop names from here on
            producer.commit_transaction(timeout)

        failure: KafkaException | None = None
        try:
            caller.call(
                "send_offsets_to_transaction", offsets_then_commit, 2 * timeout + COMMIT_DEADLINE_MARGIN_S, meanwhile
            )
            return
        except KafkaException as exc:
            failure = exc
        if self._producer is not producer:  # closed meanwhile (its partition revoked during an overlapped commit)
            raise ApplicationRecoverableError(
                f"the commit of {self.transactional_id} failed and its producer was closed meanwhile",
                error=failure.args[0] if failure.args else None,
                operation="commit_transaction",
            ) from failure
        if pending:  # send_offsets_to_transaction failed
            offsets, group_metadata = pending[0]
            self._call(
                "send_offsets_to_transaction",
                lambda: producer.send_offsets_to_transaction(offsets, group_metadata, self._api_timeout()),
                bounded=True,
                first_failure=failure,
            )
            pending.pop(0)
            self.flush_offsets()
            failure = None
        self._call(
            "commit_transaction",
            lambda: producer.commit_transaction(self._api_timeout()),
            bounded=True,
            first_failure=failure,
        )

    def wait_for_commit(self) -> bool | None:
        """From inside ``commit(meanwhile=...)``: wait for the commit under way to return (within its deadline).

        True if it committed, False if it failed (its caller still gets the error), None if no commit is under way.
        """
        returned = self._caller.wait_running()
        if returned:
            self.in_transaction = False  # committed: closing the producer now (a revoke) has nothing to abort
        return returned

    def commit_returned(self) -> bool:
        """From inside ``commit(meanwhile=...)``: True once the commit under way has returned (or none is)."""
        return self._caller.running_done()

    def knows_topic(self, topic: str) -> bool:
        """True if ``topic`` exists (looked up once, as :meth:`produce` does)."""
        return self.partition_count(topic) is not None

    def abort(self) -> None:
        """Abort the open transaction. Never raises an abortable error (KIP-1050):
        an abort that fails is application-recoverable, so the producer is replaced."""
        self._pending_offsets = []  # aborted with the transaction
        producer = self._producer
        if producer is None:
            self.in_transaction = False
            return
        # Let in-flight requests finish first. Aborting while an AddPartitionsToTxn is still
        # unanswered makes librdkafka skip EndTxn ("no partitions registered") although the
        # broker did register the partition: the broker-side transaction then stays open and
        # the next one can fail, or (seen on noida-db) commit records twice. ~1 ms per abort.
        undelivered = 0
        try:
            undelivered = producer.flush(self._api_timeout())
        except Exception:  # a fenced/fatal producer raises here; abort_transaction reports it properly
            log.debug("flush before abort of %s failed", self.transactional_id, exc_info=True)
        try:
            self._call("abort_transaction", lambda: producer.abort_transaction(self._api_timeout()), bounded=True)
        except KafkaClientError as exc:
            if isinstance(exc, ApplicationRecoverableError):
                raise
            raise ApplicationRecoverableError(
                f"abort_transaction failed for {self.transactional_id}: {exc}",
                error=exc.error,
                operation="abort_transaction",
            ) from exc
        finally:
            self.in_transaction = False
        if undelivered or any(err.code() == KafkaError._MSG_TIMED_OUT for err, _, _ in self._delivery_failures):
            # KIP-890's safety, which librdkafka lacks (its transactions keep one epoch; confluentinc/librdkafka
            # #5423): a produce request may still be on its way, and a broker appends it to whatever transaction
            # of this producer id and epoch is open when it lands: the next one. A new producer bumps the epoch,
            # and the broker refuses the late request. The next begin() creates it.
            log.info(
                "%s: replacing the producer after an abort with %s record(s) possibly in flight (KIP-890's epoch bump)",
                self.transactional_id,
                undelivered or "timed-out",
            )
            self.discard()
        elif any(OutputRefusedError.is_refusal(err) for err, _, _ in self._delivery_failures):
            # librdkafka does not take back the sequence numbers of records the broker refused for good, so
            # the next produce to that partition would fail OUT_OF_ORDER_SEQUENCE_NUMBER (seen on Kafka's
            # protocol and the mock cluster alike). A new producer (new epoch) starts its sequences afresh:
            # the next begin() creates it. Not counted as a replacement: no other process is involved.
            log.debug("%s: replacing the producer after an output refused by the broker", self.transactional_id)
            self.discard()

    def flush(self, timeout: float = 30.0) -> list[str]:
        """Wait for everything sent so far; return the delivery errors seen."""
        producer = self._producer
        if producer is not None:
            remaining = producer.flush(timeout)
            if remaining:
                return [*self.delivery_errors, f"{remaining} record(s) not delivered within {timeout:g}s"]
        return list(self.delivery_errors)

    def transaction_failure(self, *, besides: KafkaError | None = None) -> KafkaClientError | None:
        """The typed error of the first record of this transaction that failed delivery (other than ``besides``)."""
        for err, topic, partition in self._delivery_failures:
            if err is not besides:
                return _located(err, "produce", topic, partition)
        return None

    def wait_for_deliveries(self, timeout: float = 30.0) -> int:
        """Wait for every record sent so far; the number still undelivered after ``timeout``."""
        producer = self._producer
        return int(producer.flush(timeout)) if producer is not None else 0

    def partition_count(self, topic: str, *, refresh: bool = False) -> int | None:
        """Partitions of ``topic`` from metadata (cached), or None if it does not exist."""
        if not refresh and topic in self._known_topics:
            return self._known_topics[topic]
        producer = self.ensure()
        try:
            meta = producer.list_topics(topic, timeout=5).topics.get(topic)
        except KafkaException:
            return None
        if meta is None or meta.error is not None or not meta.partitions:
            self._known_topics.pop(topic, None)
            return None
        self._known_topics[topic] = len(meta.partitions)
        return self._known_topics[topic]

    # -- internals ----------------------------------------------------------
    def _api_timeout(self) -> float:
        # A fraction of the retry budget: a transactional call that times out ("retry call to
        # resume") is resumed by calling it again, which needs budget left for the next call.
        return max(0.5, min(self.retry_timeout / 4, 30.0))

    @property
    def blocked_in(self) -> CallInProgress | None:
        """The client call this producer is blocked in right now, if any (or that runs during an overlapped commit)."""
        return self._caller.in_progress

    def _call(
        self,
        operation: str,
        fn: Callable[[], Any],
        refresh: Callable[[], None] | None = None,
        *,
        bounded: bool = False,
        first_failure: KafkaException | None = None,
    ) -> Any:
        if bounded:  # a call that may block past its timeout runs under a deadline it cannot ignore
            deadline = 2 * self._api_timeout() + 5.0
            unbounded, caller = fn, self._caller
            fn = lambda: caller.call(operation, unbounded, deadline)  # noqa: E731
        try:
            return retry_call(
                fn,
                operation=operation,
                timeout=self.retry_timeout,
                refresh=refresh or self._refresh,
                on_retry=self._on_retry,
                first_failure=first_failure,
                where=self._where,
            )
        except KafkaClientError as exc:
            err = exc.error
            if (
                err is not None
                and err.txn_requires_abort()
                and self.in_transaction
                and (err.code() == KafkaError._STATE or OutputRefusedError.is_refusal(err))
            ):
                # A record of the transaction failed delivery: its own error decides (a commit reports the
                # refusal of a record under that record's code, a later call under _STATE).
                raise self._failed_delivery_error(err, operation) from exc
            raise

    def _failed_delivery_error(self, err: KafkaError, operation: str) -> KafkaClientError:
        """librdkafka answers _STATE once a record of the transaction failed delivery (the
        transaction is then abortable); that delivery error decides the reaction.

        A record purged from the queue did not fail on its own: librdkafka purges a transaction's
        records when the transaction failed for another reason (AddPartitionsToTxn refused, say).
        Then the transaction's own error decides, which is what :meth:`_transaction_error` asks for.
        """
        producer = self._producer
        if producer is not None and not self._delivery_failures:
            producer.poll(1.0)  # serve the delivery reports
        failures = self._delivery_failures
        own = [failure for failure in failures if failure[0].code() not in _PURGED]
        if not own and err.code() == KafkaError._STATE:
            stored = self._transaction_error()
            if stored is not None:
                return KafkaClientError.from_kafka(stored, operation=operation)
        if own or failures:
            failed, topic, partition = (own or failures)[0]
            return _located(failed, operation, topic, partition)
        if OutputRefusedError.is_refusal(err):
            return OutputRefusedError(error=err, operation=operation)
        return TransactionAbortableError(
            f"{operation} refused ({err.str()}): the transaction must be aborted", error=err, operation=operation
        )

    def _transaction_error(self) -> KafkaError | None:
        """The error that made the open transaction abortable, or None if it is not known.

        ``begin_transaction`` has no effect inside a transaction: librdkafka answers it with the
        transaction's stored error (code and text) once the transaction is abortable, _STATE otherwise.
        """
        producer = self._producer
        if producer is None:
            return None
        try:
            producer.begin_transaction()
        except KafkaException as exc:
            stored = exc.args[0] if exc.args else None
            if isinstance(stored, KafkaError) and stored.txn_requires_abort() and stored.code() != KafkaError._STATE:
                return stored
            return None
        return None  # it was not in a transaction after all: the caller's abort ends the one begun here

    def _refresh(self) -> None:
        if self._producer is not None:
            self._producer.list_topics(timeout=5)

    def _fatal_cause(self, err: KafkaError) -> KafkaError:
        """The error that made the producer fatal, for a bare ``_FATAL`` (e.g. from produce()).

        A fatal transactional producer answers every transactional call with
        its original error (``_FENCED``, OUT_OF_ORDER_SEQUENCE_NUMBER...), so
        asking it to abort (which it cannot do any more) tells why.
        """
        producer = self._producer
        if producer is None or err.code() != KafkaError._FATAL:
            return err
        try:
            producer.abort_transaction(0.1)
        except KafkaException as exc:
            cause = exc.args[0] if exc.args else None
            if isinstance(cause, KafkaError) and cause.code() != KafkaError._FATAL:
                return cause
        except Exception:
            log.debug("asking %s for its fatal error failed", self.transactional_id, exc_info=True)
        return err

    def _produce_error(self, exc: KafkaException, out: PendingOutput) -> BaseException:
        err: KafkaError = self._fatal_cause(exc.args[0])
        code = err.code()
        topic, value, key, _, partition = out
        if code == KafkaError._STATE and self.in_transaction and not err.fatal():
            return self._failed_delivery_error(err, "produce")
        if code in (KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART):
            return UnknownTopicError(f"output topic {topic!r} does not exist ({err.str()})")
        if code == KafkaError._UNKNOWN_PARTITION:
            return UnknownTopicError(f"output topic {topic!r} has no partition {partition}")
        cls = classify(err, path="produce")
        if cls in (ErrorClass.INVALID_CONFIGURATION, ErrorClass.HANDLER_FAILURE) or code in (
            KafkaError.MSG_SIZE_TOO_LARGE,
            KafkaError._MSG_TIMED_OUT,
            KafkaError._INVALID_ARG,
        ):
            size = len(value or b"") + len(key or b"")
            return RecordRejectedError(
                f"the client rejected an output record for {topic!r} ({size} bytes): {err.str()}"
            )
        return KafkaClientError.from_kafka(err, operation="produce", path="produce")

    def _own_delivery(self, on_error: Callable[[KafkaError], None]) -> Callable[[KafkaError | None, Message], None]:
        def report(err: KafkaError | None, msg: Message) -> None:
            self._on_delivery(err, msg)
            if err is not None:
                on_error(err)

        return report

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self._delivery_failures.append((err, msg.topic() or "", msg.partition() or 0))
            self.delivery_errors.append(f"{msg.topic()}[{msg.partition()}]: {err.name()} {err.str()}")


def _located(err: KafkaError, operation: str, topic: str, partition: int) -> KafkaClientError:
    """The typed error of a failed delivery, saying which topic and partition refused the record.

    A refusal of the record itself (:data:`~kafkatx.errors.classification.RECORD_REFUSAL_CODES`) is an
    :class:`~kafkatx.errors.OutputRefusedError`: the input record that produced it fails, not the App.
    """
    if OutputRefusedError.is_refusal(err):
        return OutputRefusedError(error=err, operation=operation, topic=topic, partition=partition)
    where = f"{topic}[{partition}]"
    exc = KafkaClientError.from_kafka(err, operation=operation, path="produce")
    return type(exc)(
        f"{exc.message} (a record for {where})", error=exc.error, error_class=exc.error_class, operation=exc.operation
    )
