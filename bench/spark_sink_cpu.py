"""The "kafkatx" streaming sink's Python CPU per row, on each side, without Spark's JVM.

    PYTHONPATH=src python bench/spark_sink_cpu.py              # this checkout's sink
    PYTHONPATH=/old/src python bench/spark_sink_cpu.py         # another version's, for an A/B (alternate runs)

Calls the sink as pyspark 4.3's own workers do: on the executor, ``write()`` over the Arrow batches Spark hands a
Python writer (through pyspark's own Arrow -> Row conversion when the writer is a row writer, as
``pyspark.sql.worker.write_into_data_source`` does), then the commit message pickled; on the driver, the message
unpickled and its rows produced (into librdkafka's queue: the producer points at no broker and its queue is
purged, so the broker's share is left out). 100,000 rows (an 8-byte key, a 100-character string value, as
bench/spark_streaming.py's query gives), process CPU time, the median of 5 runs after one warm-up. It isolates
the part of the sink that its design decides; bench/spark_streaming.py measures the whole query.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from confluent_kafka import Producer
from pyspark.serializers import CPickleSerializer
from pyspark.sql.conversion import ArrowTableToRowsConversion
from pyspark.sql.datasource import DataSourceStreamArrowWriter
from pyspark.sql.types import BinaryType, StringType, StructField, StructType, _create_row

from kafkatx.spark import _stream_sink as sink

ROWS, PER_BATCH = 100_000, 10_000
SCHEMA = StructType([StructField("key", BinaryType()), StructField("value", StringType())])
BATCHES = [
    pa.RecordBatch.from_pydict(
        {"key": [b"k%07d" % i for i in range(start, start + PER_BATCH)], "value": ["X" * 100] * PER_BATCH},
        schema=pa.schema([("key", pa.binary()), ("value", pa.string())]),
    )
    for start in range(0, ROWS, PER_BATCH)
]


def _as_rows() -> Iterator[Any]:
    """What pyspark hands a row writer: each Arrow batch converted to Rows."""
    converters = [ArrowTableToRowsConversion._create_converter(f.dataType, binary_as_bytes=True) for f in SCHEMA]
    for batch in BATCHES:
        columns = [ArrowTableToRowsConversion._to_pylist(c) for c in batch.columns]
        for r in range(batch.num_rows):
            values = [converters[c](columns[c][r]) for c in range(batch.num_columns)]
            yield _create_row(fields=SCHEMA.fieldNames(), values=values)


def once(writer: Any) -> tuple[float, float]:
    """(executor us/row, driver us/row) of one batch of ROWS rows."""
    arrow = isinstance(writer, DataSourceStreamArrowWriter)
    serializer = CPickleSerializer()
    started = time.process_time()
    message = writer.write(iter(BATCHES)) if arrow else writer.write(_as_rows())
    blob = serializer.dumps(message)
    executor = time.process_time() - started
    producer = Producer({"bootstrap.servers": "127.0.0.1:1", "queue.buffering.max.messages": 2_000_000, "log_level": 0})
    started = time.process_time()
    received = serializer.loads(blob)
    if arrow:
        sink._produce(producer, [received], "out")
    else:  # the row writer's _produce (before the Arrow writer) took no topic argument
        sink._produce(producer, [received])
    driver = time.process_time() - started
    producer.purge()
    producer.flush(0)
    return executor / ROWS * 1e6, driver / ROWS * 1e6


def main() -> None:
    writer = sink.KafkaTxStreamWriter({"kafka.bootstrap.servers": "127.0.0.1:1", "topic": "out"})
    once(writer)
    runs = [once(writer) for _ in range(5)]
    kind = "Arrow writer" if isinstance(writer, DataSourceStreamArrowWriter) else "row writer"
    print(
        f"{kind}: executor {statistics.median(r[0] for r in runs):.2f} us/row, "
        f"driver {statistics.median(r[1] for r in runs):.2f} us/row (median of 5, process CPU)"
    )


if __name__ == "__main__":
    main()
