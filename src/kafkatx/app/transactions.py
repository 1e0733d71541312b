"""Producer-initiated transactions: ``with app.transaction() as tx`` (one producer per thread)."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kafkatx.client.producer import TransactionalProducer
from kafkatx.context import bind_sink
from kafkatx.database.backend import Backend, backend_for
from kafkatx.database.producer_outbox import ProducerOutbox
from kafkatx.errors import KafkaClientError
from kafkatx.outputs import PendingOutput, encode, encode_headers

if TYPE_CHECKING:
    from kafkatx.app.config import ClientConfig

__all__ = ["ProducerTransactions", "Transaction"]

log = logging.getLogger("kafkatx.app")


class ProducerTransactions:
    """An App's producer-initiated transactions: a transactional producer per thread, outboxes per database."""

    def __init__(self, client: ClientConfig) -> None:
        self._client = client
        self._lock = threading.Lock()  # guards the backends and the producer counter
        self._local = threading.local()
        self._backends: dict[object, Backend] = {}  # transaction(database=...): one per database given
        self._counter = 0
        #: Every live thread's producer (each keeps a helper thread and a librdkafka handle until closed).
        self._producers: weakref.WeakSet[TransactionalProducer] = weakref.WeakSet()
        #: The producers inside ``transaction()``: only their own thread closes them (when it leaves).
        self._busy: set[TransactionalProducer] = set()
        #: Bumped by :meth:`close`: a transaction under way then closes its producer when it ends.
        self._closings = 0
        #: Guards the three above: a producer is either busy or closed by :meth:`close`, never both at once.
        self._closing = threading.Lock()

    def close(self) -> None:
        """Close every thread's producer (the App stops); a producer in a transaction is closed when it ends.

        A thread's next ``app.transaction()`` opens its producer again (same transactional id).
        """
        with self._closing:
            self._closings += 1
            for producer in list(self._producers):
                if producer not in self._busy:
                    producer.close()

    @contextmanager
    def transaction(self, *, database: Any = None) -> Iterator[Transaction]:
        """The transaction behind :meth:`kafkatx.App.transaction` (documented there)."""
        producer = self._thread_producer()
        with self._closing:
            self._busy.add(producer)
            closings = self._closings
        try:
            yield from self._in_transaction(producer, database)
        finally:
            with self._closing:
                self._busy.discard(producer)
                stopped = closings != self._closings  # the App stopped meanwhile
            if stopped:
                producer.close()

    def _in_transaction(self, producer: TransactionalProducer, database: Any) -> Iterator[Transaction]:
        outbox = self._producer_outbox(database, producer) if database is not None else None
        tx = Transaction(producer)
        with outbox.unit() if outbox is not None else _begun(producer):
            previous = bind_sink(tx)
            try:
                yield tx
            except BaseException:
                try:
                    producer.abort()
                except KafkaClientError:
                    producer.discard()
                    log.warning("abort failed; the producer was replaced", exc_info=True)
                raise
            finally:
                bind_sink(previous)
        if outbox is None:
            try:
                producer.commit()
            except KafkaClientError:
                try:
                    producer.abort()
                except KafkaClientError:
                    producer.discard()
                raise

    def _producer_outbox(self, database: Any, producer: TransactionalProducer) -> ProducerOutbox:
        with self._lock:
            key = database if isinstance(database, str) else id(database)
            backend = self._backends.get(key)
            if backend is None:
                backend = self._backends[key] = backend_for(database)
        outboxes: dict[int, ProducerOutbox] = self._local.__dict__.setdefault("outboxes", {})
        outbox = outboxes.get(id(backend))
        if outbox is None or outbox.producer is not producer:
            outbox = outboxes[id(backend)] = ProducerOutbox(backend, producer, self._client.base_config())
        return outbox

    def _thread_producer(self) -> TransactionalProducer:
        producer: TransactionalProducer | None = getattr(self._local, "producer", None)
        if producer is None:
            with self._lock:
                self._counter += 1
                n = self._counter
            txn_id = self._client.producer_transactional_id(n)
            producer = TransactionalProducer(
                self._client.producer_config(None, txn_id), txn_id, retry_timeout=self._client.transaction_retry_timeout
            )
            self._local.producer = producer
            # The thread's end drops its locals: then this closes its producer, which nothing can use any more.
            self._local.thread_end = _ThreadEnd()
            weakref.finalize(self._local.thread_end, self._thread_ended, producer).atexit = False  # exit: no need
            with self._closing:
                self._producers.add(producer)
        return producer

    def _thread_ended(self, producer: TransactionalProducer) -> None:
        with self._closing:
            self._producers.discard(producer)
            producer.close()


class _ThreadEnd:
    """Kept in a thread's locals only: dropped when the thread ends (its producer's close is finalised on it)."""


@contextmanager
def _begun(producer: TransactionalProducer) -> Iterator[None]:
    producer.begin()
    yield


class Transaction:
    """A producer-initiated transaction (see :meth:`App.transaction`)."""

    serializer = None

    def __init__(self, producer: TransactionalProducer) -> None:
        self._producer = producer
        self.sent = 0

    def add(self, output: PendingOutput) -> None:
        """Produce an already encoded record in the transaction (what ``kafkatx.send()`` calls)."""
        self._producer.produce(output)
        self.sent += 1

    def send(self, topic: str, value: Any, key: Any = None, headers: Any = None, partition: int | None = None) -> None:
        """Produce a record in the transaction: ``value``/``key`` as bytes or str, ``headers`` a mapping or pairs."""
        self.add((topic, encode(value, "value"), encode(key, "key"), encode_headers(headers), partition))
