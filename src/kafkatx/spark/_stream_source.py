"""The ``"kafkatx"`` streaming source: Kafka records read_committed, on the executors, offsets in the checkpoint.

An offset is ``{topic: {partition: next offset}}`` (JSON, as Spark stores it). The driver asks the cluster for
each partition's last stable offset (the end a read_committed reader may read to) and plans one Spark partition
per Kafka partition range; an executor reads its range with a consumer of its own, assigned (no group), and
stops at the range's end: a replayed batch reads the same records. Options as Spark's Kafka connector:
``kafka.bootstrap.servers``, ``subscribe`` (comma-separated topics), ``startingOffsets`` (``earliest`` or
``latest``), ``maxOffsetsPerTrigger``, ``includeHeaders``, and any ``kafka.<librdkafka property>``.
"""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, TopicPartition
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from kafkatx.errors import InvalidConfigurationError

__all__ = ["SOURCE_SCHEMA", "KafkaTxStreamReader", "kafka_config", "options_of", "source_schema"]

_HEADERS = ArrayType(StructType([StructField("key", StringType()), StructField("value", BinaryType())]))

#: Spark's Kafka source columns (``headers`` only with ``includeHeaders=true``, as there).
SOURCE_SCHEMA = StructType(
    [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("timestampType", IntegerType()),
    ]
)

Offsets = dict[str, dict[str, int]]

#: How long a range's reader waits for records the end offset says exist before it fails the task.
_READ_TIMEOUT_S = 60.0


def options_of(options: Mapping[str, str]) -> dict[str, str]:
    """The options with lower-case names: Spark's option names are case-insensitive (it may pass them either way)."""
    return {key.lower(): value for key, value in options.items()}


def _flag(options: Mapping[str, str], name: str) -> bool:
    return str(options_of(options).get(name.lower(), "false")).strip().lower() == "true"


def source_schema(options: Mapping[str, str]) -> StructType:
    """The source's columns for ``options``."""
    if _flag(options, "includeHeaders"):
        return StructType([*SOURCE_SCHEMA.fields, StructField("headers", _HEADERS)])
    return SOURCE_SCHEMA


def kafka_config(options: Mapping[str, str], **extra: Any) -> dict[str, Any]:
    """The librdkafka configuration from the ``kafka.*`` options (``kafka.bootstrap.servers`` required)."""
    config = {key[len("kafka.") :]: value for key, value in options_of(options).items() if key.startswith("kafka.")}
    if not config.get("bootstrap.servers"):
        raise InvalidConfigurationError('the "kafkatx" format needs .option("kafka.bootstrap.servers", "host:port")')
    return {**config, **extra}


@dataclass(frozen=True)
class _Range(InputPartition):
    """One Spark partition: the records of ``topic[partition]`` from ``start`` to ``end`` (exclusive)."""

    topic: str
    partition: int
    start: int
    end: int


class KafkaTxStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans ranges on the driver, reads them on the executors."""

    def __init__(self, given: dict[str, str]) -> None:
        options = options_of(given)
        topics = [t.strip() for t in str(options.get("subscribe", "")).split(",") if t.strip()]
        if not topics:
            raise InvalidConfigurationError('the "kafkatx" source needs .option("subscribe", "topic[,topic...]")')
        starting = str(options.get("startingoffsets", "latest")).strip().lower()
        if starting not in ("earliest", "latest"):
            raise InvalidConfigurationError(
                f'startingOffsets must be "earliest" or "latest", got {options.get("startingoffsets")!r}'
            )
        max_per_trigger = options.get("maxoffsetspertrigger")
        if max_per_trigger is not None and (not str(max_per_trigger).isdigit() or int(max_per_trigger) < 1):
            raise InvalidConfigurationError(
                f"maxOffsetsPerTrigger must be a whole number >= 1, got {max_per_trigger!r}"
            )
        self._options, self._topics, self._starting = options, topics, starting
        self._max_per_trigger = int(max_per_trigger) if max_per_trigger is not None else None
        self._headers = _flag(options, "includeHeaders")
        self._consumer: Consumer | None = None
        #: With trigger(availableNow=True): the ends at the query's start; batches stop there.
        self._available_now: dict[tuple[str, int], tuple[int, int]] | None = None

    # -- driver ---------------------------------------------------------------
    def _driver_consumer(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer(
                kafka_config(
                    self._options,
                    **{"group.id": f"kafkatx-source-{uuid.uuid4().hex}", "isolation.level": "read_committed"},
                )
            )
        return self._consumer

    def _bounds(self) -> dict[tuple[str, int], tuple[int, int]]:
        """Per partition of the subscribed topics: (low watermark, last stable offset)."""
        consumer = self._driver_consumer()
        bounds: dict[tuple[str, int], tuple[int, int]] = {}
        for topic in self._topics:
            meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
            if meta is None or meta.error is not None:
                raise InvalidConfigurationError(f"the subscribed topic {topic!r} does not exist")
            for partition in meta.partitions:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10, cached=False)
                bounds[(topic, partition)] = (low, high)
        return bounds

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802  (pyspark's name)
        """trigger(availableNow=True): what is there now, read in batches of maxOffsetsPerTrigger."""
        self._available_now = self._bounds()

    def initialOffset(self) -> Offsets:  # noqa: N802  (pyspark's name)
        pick = 0 if self._starting == "earliest" else 1
        offsets: Offsets = {}
        for (topic, partition), bound in self._bounds().items():
            offsets.setdefault(topic, {})[str(partition)] = bound[pick]
        return offsets

    def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802  (pyspark's name)
        return ReadAllAvailable() if self._max_per_trigger is None else ReadMaxRows(self._max_per_trigger)

    def latestOffset(self, start: Offsets, limit: ReadLimit) -> Offsets:  # noqa: N802  (pyspark's name)
        ends: Offsets = {}
        budget = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        bounds = self._available_now if self._available_now is not None else self._bounds()
        for (topic, partition), (low, high) in sorted(bounds.items()):
            begin = start.get(topic, {}).get(str(partition), low)  # a partition added since: from its start
            end = high
            if budget is not None:
                end = min(high, begin + budget)
                budget -= max(0, end - begin)
            ends.setdefault(topic, {})[str(partition)] = max(begin, end)
        return ends

    def partitions(self, start: Offsets, end: Offsets) -> list[_Range]:
        ranges = []
        for topic, by_partition in end.items():
            for partition, stop in by_partition.items():
                begin = start.get(topic, {}).get(partition, stop)
                if stop > begin:
                    ranges.append(_Range(topic, int(partition), begin, stop))
        return ranges

    def commit(self, end: Offsets) -> None:
        """Nothing to do: the offsets live in the query's checkpoint."""

    def stop(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    # -- executors ------------------------------------------------------------
    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        """The records of one range, read_committed (aborted records and transaction markers are skipped)."""
        consumer = Consumer(
            kafka_config(
                self._options,
                **{
                    "group.id": f"kafkatx-source-{uuid.uuid4().hex}",
                    "isolation.level": "read_committed",
                    "enable.auto.commit": False,
                    "enable.partition.eof": True,
                },
            )
        )
        try:
            assert isinstance(partition, _Range)
            yield from self._read_range(consumer, partition)
        finally:
            consumer.close()

    def _read_range(self, consumer: Consumer, r: _Range) -> Iterator[tuple[Any, ...]]:
        tp = TopicPartition(r.topic, r.partition, r.start)
        consumer.assign([tp])
        deadline = time.monotonic() + _READ_TIMEOUT_S
        while True:
            for msg in consumer.consume(500, 1.0):
                if msg.error() is not None:
                    continue  # end of partition (enable.partition.eof) or a transient error: the position decides
                if (msg.offset() or 0) >= r.end:
                    return
                yield self._row(msg)
                deadline = time.monotonic() + _READ_TIMEOUT_S
            position = consumer.position([TopicPartition(r.topic, r.partition)])[0].offset or 0
            if position >= r.end:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{r.topic}[{r.partition}]: no record between {position} and {r.end}")

    def _row(self, msg: Any) -> tuple[Any, ...]:
        ts_type, ts = msg.timestamp()
        stamp = datetime.datetime.fromtimestamp(ts / 1000.0, tz=datetime.timezone.utc) if ts >= 0 else None
        row: tuple[Any, ...] = (msg.key(), msg.value(), msg.topic(), msg.partition(), msg.offset(), stamp, ts_type - 1)
        if self._headers:
            row += ([(k, v) for k, v in (msg.headers() or [])],)
        return row
