"""Producer-initiated units with a database (``with app.transaction(database=...)``), exactly once.

There is no consumed input to replay, so the unit gets a sequence number of
its own: the database transaction stores the next number and the records
produced (the outbox, under the producer's transactional.id), the Kafka
transaction commits the same number as a consumer-group offset
(``kafkatx-outbox.<transactional.id>``) beside the records. A process that
died between the two commits left a number the database has and Kafka has
not; the next unit under the same transactional.id (the same instance id
and thread order) first produces those stored records with that number,
after ``init_transactions`` has aborted whatever the dead process left open.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from kafkatx.client.identity import LogIdentity, cluster_id_of
from kafkatx.client.retry import retry_call
from kafkatx.database._store import Store, reset_statements
from kafkatx.database.backend import Backend
from kafkatx.database.session import CRASH_AFTER_DB_COMMITS_ENV, adopts, bind_db, log_mismatch
from kafkatx.errors import InvalidConfigurationError
from kafkatx.errors.classification import CLUSTER_ID_OPERATION, OUTBOX_SEQUENCE_OPERATION
from kafkatx.outputs import PendingOutput

if TYPE_CHECKING:
    from kafkatx.client.producer import TransactionalProducer

__all__ = ["ProducerOutbox"]

log = logging.getLogger("kafkatx.database")

_GROUP = "kafkatx-producer"  # the outbox key's group: the transactional.id is its "topic", partition 0


class ProducerOutbox:
    """The database side of one transactional producer's units (one thread's ``app.transaction``)."""

    def __init__(self, backend: Backend, producer: TransactionalProducer, client_config: dict[str, Any]) -> None:
        self.backend = backend
        self.producer = producer
        self.key = (producer.transactional_id, 0)
        self.store = Store(backend, _GROUP)
        self.marker_group = f"kafkatx-outbox.{producer.transactional_id}"
        self._client_config = dict(client_config)  # (its logger sends librdkafka's lines through logging)
        self._group_metadata: Any = None
        self._committed: int | None = None  # the sequence Kafka is known to have committed
        self._tables_ready = False
        self._commits = 0
        self._cluster_id: str | None = None  # the cluster the units commit to ("" if the broker names none)

    def _metadata(self) -> Any:
        if self._group_metadata is None:
            consumer = Consumer({**self._client_config, "group.id": self.marker_group})
            try:
                self._group_metadata = consumer.consumer_group_metadata()
            finally:
                consumer.close()
        return self._group_metadata

    def _kafka_sequence(self) -> int:
        """The highest sequence committed in Kafka under this producer's marker group (-1: none).

        Asked before any transaction begins: a broker that does not answer is retried, then a RetriableError
        naming the call, as for the cluster id.
        """
        return retry_call(
            self._read_kafka_sequence,
            operation=OUTBOX_SEQUENCE_OPERATION,
            timeout=self.producer.retry_timeout,
            where=self.producer.transactional_id,
        )

    def _read_kafka_sequence(self) -> int:
        admin = AdminClient(self._client_config)
        futures = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(self.marker_group)])
        try:
            result = next(iter(futures.values())).result(30)
        except concurrent.futures.TimeoutError:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "no answer within 30 s")) from None
        return max((tp.offset for tp in result.topic_partitions or () if tp.offset >= 0), default=-1)

    @contextmanager
    def unit(self) -> Iterator[None]:
        """One unit: the database transaction around the caller's Kafka transaction (which begins inside)."""
        backend, producer = self.backend, self.producer
        self._learn_cluster_id()
        conn = backend.connect()
        try:
            self._ensure_tables(conn)
            token = backend.begin(conn)
            position = self._lock_checked(conn)
            if self._committed is None:
                self._finish_predecessor(conn, position)
            sequence = max(position, self._committed if self._committed is not None else -1) + 1
            outputs: list[PendingOutput] = []
            previous = bind_db(backend.user_handle(conn))
            producer.begin()
            producer.recorder = outputs
            try:
                yield
            except BaseException:
                producer.recorder = None
                _quietly(backend.rollback, conn)  # (the block's exception is the one to see)
                raise
            finally:
                bind_db(previous)
            producer.recorder = None
            try:
                if not backend.still_open(conn, token):
                    raise RuntimeError(
                        "the block ended kafkatx's database transaction (Session(db()).rollback(), or a rollback or "
                        "commit of db().get_transaction()): its records would commit without its rows; raise an "
                        "exception to roll both back instead"
                    )
                self.store.advance(conn, self.key, sequence, outputs)
                if self._committed is not None:
                    self.store.forget_before(conn, self.key, self._committed)
                backend.commit(conn)
            except BaseException:
                # Nothing may stay open: the Kafka transaction is aborted (the thread's next unit begins a new
                # one), and if the commit's outcome is unknown (the connection dropped during it) the next unit
                # compares the database with Kafka first and produces what is stored, as after a crash.
                self._committed = None
                _quietly(backend.rollback, conn)
                self._abort_kafka()
                raise
            self._after_database_commit()
        finally:
            backend.close(conn)
        try:
            if outputs:
                producer.send_offsets([TopicPartition(outputs[0][0], 0, sequence)], self._metadata())
            producer.commit()
        except BaseException:
            self._committed = None  # the next unit asks Kafka what committed and produces the rest first
            self._abort_kafka()
            raise
        if outputs:
            self._committed = sequence

    def _learn_cluster_id(self) -> None:
        """The cluster the units commit to, asked once, before any database lock is taken (_lock_checked
        compares it with the one the stored sequence was written for)."""
        if self._cluster_id is not None:
            return
        producer = self.producer
        client = producer.ensure()
        # Before the transaction begins: a broker that does not answer is retried, then a RetriableError
        # (a kafkatx error naming the call), as for init_transactions; never confluent-kafka's raw exception.
        self._cluster_id = (
            retry_call(
                functools.partial(cluster_id_of, client),
                operation=CLUSTER_ID_OPERATION,
                timeout=producer.retry_timeout,
                where=producer.transactional_id,
            )
            or ""
        )

    def _ensure_tables(self, conn: Any) -> None:
        """Create kafkatx's tables, in a transaction of their own, the first time this producer needs them."""
        if not self._tables_ready:
            self.backend.begin(conn)
            self.store.create_tables(conn)
            self.backend.commit(conn)
            self._tables_ready = True

    def _abort_kafka(self) -> None:
        """End the unit's Kafka transaction after a failure: nothing may stay open for the thread's next unit,
        so a producer that cannot abort is discarded (the next unit opens a new one)."""
        try:
            self.producer.abort()
        except Exception:
            self.producer.discard()

    def _lock_checked(self, conn: Any) -> int:
        """The producer's stored sequence, locked; refused if it was stored for another Kafka cluster.

        The stored records of a unit the database has and Kafka has not are
        produced by the next unit: on another cluster (a new temporary local
        broker) they would be old records published again.
        """
        kafka = LogIdentity(self._cluster_id or None, None)
        stored = self.store.lock(conn, self.key, kafka.cluster_id, None)
        problem = log_mismatch(stored, kafka)
        if problem is not None:
            raise InvalidConfigurationError(
                f"app.transaction(database=...) of {self.producer.transactional_id}: the sequence kafkatx keeps in "
                f"the database (table kafkatx_offsets, group {_GROUP!r}) was written for {problem}. kafkatx stops "
                "rather than publish the records stored for that other cluster. To start afresh here, delete its "
                f"rows: {reset_statements(_GROUP, self.producer.transactional_id)}"
            )
        if adopts(stored, kafka):
            self.store.adopt(conn, self.key, kafka.cluster_id, None)
        return stored.next_offset

    def _finish_predecessor(self, conn: Any, position: int) -> None:
        """First unit of this transactional.id in this process: produce what a predecessor left committed
        in the database only. ``init_transactions`` (in ensure) has aborted its open Kafka transaction."""
        self.producer.ensure()
        known = self._kafka_sequence()
        if position > known:
            outputs = self.store.outputs_between(conn, self.key, known, position)
            if outputs:
                log.warning(
                    "%s: %d record(s) of units committed in the database but not in Kafka (a crash between the "
                    "two commits?): producing them now",
                    self.producer.transactional_id,
                    len(outputs),
                )
                self.producer.begin()
                for out in outputs:
                    self.producer.produce(out)
                self.producer.send_offsets([TopicPartition(outputs[0][0], 0, position)], self._metadata())
                self.producer.commit()
                known = position
        self._committed = known

    def _after_database_commit(self) -> None:
        self._commits += 1
        limit = os.environ.get(CRASH_AFTER_DB_COMMITS_ENV)
        if limit and self._commits >= int(limit):
            os.kill(os.getpid(), signal.SIGKILL)


def _quietly(call: Any, conn: Any) -> None:
    try:
        call(conn)
    except Exception:
        log.debug("database rollback failed", exc_info=True)
