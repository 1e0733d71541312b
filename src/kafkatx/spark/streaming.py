"""Spark Structured Streaming on Kafka through kafkatx: a read_committed source and an exactly-once sink.

``register(spark)`` registers the Python data source ``"kafkatx"``; then::

    df = (spark.readStream.format("kafkatx")
          .option("kafka.bootstrap.servers", "broker:9092").option("subscribe", "orders").load())
    query = (df.selectExpr("key", "upper(CAST(value AS STRING)) AS value")
             .writeStream.format("kafkatx").option("kafka.bootstrap.servers", "broker:9092")
             .option("topic", "invoices").option("checkpointLocation", "/chk/invoices").start())

The option names and the columns are those of Spark's own Kafka connector, so a query moves between the two by
changing the format name. The difference is the sink: Spark's writes each task's rows as it goes (at least
once); this one makes a micro-batch's rows visible to read_committed readers exactly once (see
:mod:`kafkatx.spark._stream_sink`). The source (:mod:`kafkatx.spark._stream_source`) reads on the executors,
one Spark partition per Kafka partition range, read_committed, with its offsets in the query's checkpoint.

:func:`map_records` runs a kafkatx record handler between the two, on the executors, with retries in place and
dead-letter rows the sink commits in the same transaction as the outputs (:mod:`kafkatx.spark._map_records`).
"""

from __future__ import annotations

from typing import Any

from pyspark.sql.datasource import DataSource

from kafkatx.spark._map_records import OUTPUT_SCHEMA, map_records
from kafkatx.spark._stream_sink import KafkaTxStreamWriter
from kafkatx.spark._stream_source import KafkaTxStreamReader, source_schema

__all__ = ["FORMAT", "OUTPUT_SCHEMA", "KafkaTxDataSource", "map_records", "register"]

#: The short name queries use: ``.format("kafkatx")``.
FORMAT = "kafkatx"


class KafkaTxDataSource(DataSource):
    """The ``"kafkatx"`` format: a streaming source and an exactly-once streaming sink."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> Any:
        return source_schema(self.options)

    def streamReader(self, schema: Any) -> KafkaTxStreamReader:  # noqa: N802  (pyspark's name)
        return KafkaTxStreamReader(dict(self.options))

    def streamWriter(self, schema: Any, overwrite: bool) -> KafkaTxStreamWriter:  # noqa: N802  (pyspark's name)
        return KafkaTxStreamWriter(dict(self.options))


def register(spark: Any) -> None:
    """Register the ``"kafkatx"`` format with ``spark`` (a SparkSession); calling it again changes nothing."""
    spark.dataSource.register(KafkaTxDataSource)
