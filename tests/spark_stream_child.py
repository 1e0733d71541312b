"""A Structured Streaming query source -> sink in a process of its own, for the failure tests of test_spark_streaming.

A test starts it, kills it or makes a Python worker die, starts it again from the same checkpoint, and counts the
output. Options:

- ``--hang-after-batch N --signal FILE``: the sink's driver-side commit of batch N writes its Kafka transaction,
  touches FILE and then waits (never returning to Spark, so batch N is not in the checkpoint's ``commits/``):
  the test SIGKILLs the process group there, the worst moment for a driver to die.
- ``--die-on VALUE --marker FILE``: a Python UDF upstream of the sink exits its worker (``os._exit``) at the
  record VALUE, once (FILE says it happened): the task is retried under ``local[N,F]``.
- ``--map-records``: the middle of the query is map_records (values starting ``bad`` are dead-lettered to
  ``<src>-dlt``), whose handler is the one that dies.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path
from typing import Any

from kafkatx.spark import streaming
from kafkatx.spark._stream_sink import KafkaTxStreamWriter
from kafkatx.spark.testing import create_test_session


def _hanging_source(batch: int, signal: str) -> type:
    """The "kafkatx" data source with a sink that stops dead after committing ``batch`` to Kafka."""

    class HangingWriter(KafkaTxStreamWriter):
        def commit(self, messages: list[Any], batchId: int) -> None:  # noqa: N803
            super().commit(messages, batchId)
            if batchId == batch:
                Path(signal).touch()
                threading.Event().wait(300)  # stopped dead: the test kills the process group long before

    class HangingSource(streaming.KafkaTxDataSource):
        def streamWriter(self, schema: Any, overwrite: bool) -> KafkaTxStreamWriter:  # noqa: N802
            return HangingWriter(dict(self.options))

    return HangingSource


def _upper(die_on: str | None, marker: str | None) -> Any:
    """A Python UDF: the value upper-cased; its worker exits at ``die_on`` the first time only."""
    from pyspark.sql.functions import udf

    def upper(value: bytes | None) -> str | None:
        if value is None:
            return None
        text = value.decode()
        if die_on is not None and marker is not None and text == die_on and not os.path.exists(marker):
            Path(marker).touch()
            os._exit(1)
        return text.upper()

    return udf(upper, "string")


def _handler(die_on: str | None, marker: str | None) -> Any:
    """A map_records handler: the value upper-cased, ``bad...`` values fail; its worker exits at ``die_on`` once."""

    def handle(record: Any) -> bytes:
        text = bytes(record.value or b"").decode()
        if die_on is not None and marker is not None and text == die_on and not os.path.exists(marker):
            Path(marker).touch()
            os._exit(1)
        if text.startswith("bad"):
            raise RuntimeError(f"{text} always fails")
        return text.upper().encode()

    return handle


def _stage(df: Any, args: argparse.Namespace) -> tuple[Any, str]:
    """The query's middle: a UDF, or map_records (its rows name their topics: the sink keeps the marker on dst)."""
    if args.map_records:
        mapped = streaming.map_records(df, _handler(args.die_on, args.marker), output=args.dst, backoff=0.01)
        return mapped, "markerTopic"
    return df.select("key", _upper(args.die_on, args.marker)("value").alias("value")), "topic"


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--bootstrap", "--src", "--dst", "--checkpoint"):
        parser.add_argument(name, required=True)
    parser.add_argument("--master", default="local[1]")
    parser.add_argument("--max-per-trigger", default="50")
    parser.add_argument("--hang-after-batch", type=int)
    parser.add_argument("--signal")
    parser.add_argument("--die-on")
    parser.add_argument("--marker")
    parser.add_argument("--map-records", action="store_true")
    args = parser.parse_args()

    spark = create_test_session(args.master)
    if args.hang_after_batch is not None:
        spark.dataSource.register(_hanging_source(args.hang_after_batch, args.signal))
    else:
        streaming.register(spark)
    df = (
        spark.readStream.format("kafkatx")
        .option("kafka.bootstrap.servers", args.bootstrap)
        .option("subscribe", args.src)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", args.max_per_trigger)
        .load()
    )
    staged, topic_option = _stage(df, args)
    query = (
        staged.writeStream.format("kafkatx")
        .option("kafka.bootstrap.servers", args.bootstrap)
        .option(topic_option, args.dst)
        .option("checkpointLocation", args.checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    print("started", flush=True)
    query.awaitTermination()
    failure = query.exception()
    spark.stop()
    if failure is not None:
        print(f"failed: {failure}", flush=True)
        sys.exit(1)
    print("done", flush=True)


if __name__ == "__main__":
    main()
