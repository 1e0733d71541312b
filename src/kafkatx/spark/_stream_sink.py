"""The ``"kafkatx"`` streaming sink: a micro-batch's rows visible to read_committed readers exactly once.

Spark's own Kafka sink writes each task's rows as the task runs, so a retried task, a re-run batch or a
restarted driver writes rows again (at least once). Writing a Kafka transaction per task is not enough
either: when an upstream Python worker dies, Spark can hand the writer an input that simply ends, and a task
that commits what it got commits a truncated partition. So here the executors only collect their rows
(:meth:`KafkaTxStreamWriter.write` returns them in its commit message, as the Arrow batches Spark hands an
Arrow writer: no per-row conversion on the executor) and the **driver** writes the batch,
where Spark tells it the batch succeeded (:meth:`KafkaTxStreamWriter.commit`), in one Kafka transaction that
also records the batch id:

- the transactional id is the query's (``transactionalId`` option, by default derived from the
  ``checkpointLocation`` and topic): ``init_transactions`` fences a driver still running an older attempt
  of the query (a zombie) and aborts what it left open;
- the batch id is committed in the same transaction, as the offset of a marker partition in a consumer group
  of the query's own (the group named like the transactional id; the marker partition is partition 0 of
  the sink's topic, offset ``batch id + 1``); a batch whose id is already committed is skipped, so a batch
  Spark runs again after its rows were committed (a driver killed between the Kafka commit and its
  checkpoint) is not written twice.

This assumes that a re-run batch gives the same rows (a deterministic plan, as Spark's own exactly-once sinks
do); a batch whose rows differ on a re-run keeps its first rows. The price is that every row travels to the
driver: the sink's throughput is the driver's.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage

from kafkatx.dlq.headers import EXCEPTION_FQCN
from kafkatx.errors import InvalidConfigurationError
from kafkatx.spark._stream_source import kafka_config, options_of

__all__ = ["KafkaTxStreamWriter", "batch_marker"]

log = logging.getLogger("kafkatx.spark")

_HEADERS = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
#: The columns the sink reads, each cast to the type it produces from (a string value or key becomes its UTF-8 bytes).
_SINK_COLUMNS = {
    "topic": pa.string(),
    "key": pa.binary(),
    "value": pa.binary(),
    "partition": pa.int32(),
    "headers": _HEADERS,
}


def _sink_batch(batch: pa.RecordBatch, topic_option: str | None) -> pa.RecordBatch:
    """The sink's columns of ``batch`` (others dropped), in the types :func:`_produce_batch` reads."""
    names = batch.schema.names
    if "value" not in names:
        raise InvalidConfigurationError('the "kafkatx" sink needs a "value" column (binary or string)')
    if topic_option is None and "topic" not in names:
        raise InvalidConfigurationError(
            'a row without a topic: give the "kafkatx" sink .option("topic", ...) or a "topic" column'
        )
    wanted = [n for n in _SINK_COLUMNS if n in names and not (n == "topic" and topic_option is not None)]
    columns = []
    for name in wanted:
        column = batch.column(names.index(name))
        try:
            columns.append(column if column.type == _SINK_COLUMNS[name] else column.cast(_SINK_COLUMNS[name]))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise InvalidConfigurationError(
                f"the {name!r} column must be {_SINK_COLUMNS[name]} (or string), got {column.type}"
            ) from e
    return pa.RecordBatch.from_arrays(columns, names=wanted)


@dataclass
class _Rows(WriterCommitMessage):
    """What one task collected, handed to the driver: Arrow batches (pickled as Arrow IPC, not row by row)."""

    batches: list[pa.RecordBatch] = field(default_factory=list)


def _produce_one(producer: Producer, topic: str, value: bytes | None, **kwargs: Any) -> None:
    while True:
        try:
            producer.produce(topic, value, **kwargs)
            return
        except BufferError:  # the local queue is full (a batch of more rows than it holds): drain some
            producer.poll(0.1)


def _produce_batch(producer: Producer, batch: pa.RecordBatch, topic: str | None) -> tuple[int, int]:
    """Produce one batch's rows into the open transaction; (rows, dead letters among them)."""
    n = batch.num_rows
    names = batch.schema.names

    def column(name: str) -> list[Any]:
        return batch.column(names.index(name)).to_pylist() if name in names else [None] * n

    topics = column("topic") if topic is None else [topic] * n
    if not all(topics):
        raise InvalidConfigurationError(
            'a row without a topic: give the "kafkatx" sink .option("topic", ...) or a "topic" column'
        )
    rows = zip(topics, column("key"), column("value"), strict=True)
    if "partition" not in names and "headers" not in names:  # the usual sink: one call a row, no dict built
        produce = producer.produce
        for row_topic, key, value in rows:
            try:
                produce(row_topic, value, key)
            except BufferError:
                _produce_one(producer, row_topic, value, key=key)
        return n, 0
    letters = 0
    for (row_topic, key, value), partition, headers in zip(rows, column("partition"), column("headers"), strict=True):
        pairs = [(h["key"], h["value"] or b"") for h in headers] if headers else None
        kwargs: dict[str, Any] = {"key": key, "headers": pairs}
        if partition is not None:
            kwargs["partition"] = partition
        _produce_one(producer, row_topic, value, **kwargs)
        if pairs and any(name == EXCEPTION_FQCN for name, _ in pairs):
            letters += 1
    return n, letters


def _produce(producer: Producer, messages: list[Any], topic: str | None) -> tuple[int, int]:
    """Produce the tasks' rows into the open transaction; (rows, dead letters among them)."""
    rows = letters = 0
    for message in messages:
        for batch in message.batches if message is not None else ():
            batch_rows, batch_letters = _produce_batch(producer, batch, topic)
            rows, letters = rows + batch_rows, letters + batch_letters
    return rows, letters


def batch_marker(topic: str) -> TopicPartition:
    """The partition whose committed offset (in the query's own group) is the last committed batch id + 1."""
    return TopicPartition(topic, 0)


class KafkaTxStreamWriter(DataSourceStreamArrowWriter):
    """Rows collected on the executors (as Arrow batches), written by the driver in one transaction per micro-batch."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self._options = options_of(options)
        kafka_config(self._options)  # refuses a missing kafka.bootstrap.servers now, not in a task
        #: As in Spark's sink, the topic option overrides the rows' topic column; without it each row names its own.
        self._topic = self._options.get("topic") or None
        self._marker_topic = self._topic or self._options.get("markertopic")
        if not self._marker_topic:
            raise InvalidConfigurationError(
                'the "kafkatx" sink needs .option("topic", ...), or, to write each row to its topic column (as '
                'map_records gives), .option("markerTopic", ...): an existing topic whose partition 0 keeps the '
                "query's last committed batch id (the main output topic will do)"
            )
        identity = self._options.get("transactionalid")
        if not identity:
            where = self._options.get("checkpointlocation") or self._options.get("path") or self._marker_topic
            identity = f"kafkatx-sink-{hashlib.sha256(str(where).encode()).hexdigest()[:16]}-{self._marker_topic}"
        self.transactional_id = identity

    # -- executors ------------------------------------------------------------
    def write(self, iterator: Iterator[pa.RecordBatch]) -> _Rows:
        """Collect this task's rows as Arrow batches; nothing is written to Kafka here (see the module's docstring)."""
        return _Rows([_sink_batch(batch, self._topic) for batch in iterator if batch.num_rows])

    # -- driver -----------------------------------------------------------------
    def commit(self, messages: list[Any], batchId: int) -> None:  # noqa: N803  (pyspark's name)
        """Write the batch's rows and its id in one transaction, unless that batch id is already committed."""
        config = kafka_config(self._options)
        producer = Producer({**config, "transactional.id": self.transactional_id, "linger.ms": 5})
        producer.init_transactions(60)  # fences an older driver of this query, aborts what it left open
        group = Consumer({**config, "group.id": self.transactional_id, "enable.auto.commit": False})
        try:
            marker = batch_marker(str(self._marker_topic))
            done = group.committed([marker], timeout=30)[0].offset
            if done > batchId:
                log.warning(
                    "kafkatx sink %s: batch %d is already committed; skipped (Spark ran it again)",
                    self.transactional_id,
                    batchId,
                    extra={"batch": batchId, "rows": 0, "dead_letters": 0, "transactions": 0},
                )
                return
            started = time.monotonic()
            producer.begin_transaction()
            rows, letters = _produce(producer, messages, self._topic)
            producer.send_offsets_to_transaction(
                [TopicPartition(marker.topic, marker.partition, batchId + 1)], group.consumer_group_metadata(), 60
            )
            producer.commit_transaction(120)
            took = time.monotonic() - started
            log.log(
                logging.WARNING if letters else logging.INFO,
                "kafkatx sink %s: batch %d committed in one transaction (%.2f s): %d row(s), %d of them dead letters",
                self.transactional_id,
                batchId,
                took,
                rows,
                letters,
                extra={"batch": batchId, "rows": rows, "dead_letters": letters, "transactions": 1},
            )
        except KafkaException:
            try:
                producer.abort_transaction(30)
            except KafkaException:
                pass
            raise
        finally:
            group.close()
            producer.flush(10)

    def abort(self, messages: list[Any], batchId: int) -> None:  # noqa: N803  (pyspark's name)
        """Nothing was written for a batch Spark aborts (rows reach Kafka only in :meth:`commit`)."""
