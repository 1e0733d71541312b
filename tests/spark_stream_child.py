"""A Structured Streaming query source -> sink in a process of its own, for the failure tests of test_spark_streaming.

A test starts it, kills it or makes a Python worker die, starts it again from the same checkpoint, and counts the
output. Options:

- ``--hang-after-batch N --signal FILE``: the sink's driver-side commit of batch N writes its Kafka transaction,
  touches FILE and then waits (never returning to Spark, so batch N is not in the checkpoint's ``commits/``):
  the test SIGKILLs the process group there, the worst moment for a driver to die.
- ``--die-on VALUE --marker FILE``: a Python UDF upstream of the sink exits its worker (``os._exit``) at the
  record VALUE, once (FILE says it happened): the task is retried under ``local[N,F]``.
- ``--slow-on VALUE --slow-dir DIR``: the UDF's first attempt of the task holding VALUE waits there until a
  speculative copy of the task (``--conf spark.speculation=true``) reaches it too (files ``attempt-N`` in DIR).
- ``--conf KEY=VALUE``: a Spark setting of the session (not for ``sc://``, whose settings are the server's).
- ``--map-records``: the middle of the query is map_records (values starting ``bad`` are dead-lettered to
  ``<src>-dlt``), whose handler is the one that dies.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
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


def _wait_for_copy(slow: str) -> None:
    """At the record --slow-on: attempt 0 of the task waits for a speculative copy (attempt 1) to reach it too."""
    from pyspark import TaskContext

    context = TaskContext.get()
    attempt = context.attemptNumber() if context is not None else 0
    Path(slow, f"attempt-{attempt}").touch()
    deadline = time.monotonic() + 120
    while attempt == 0 and not Path(slow, "attempt-1").exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def _upper(args: argparse.Namespace) -> Any:
    """A Python UDF: the value upper-cased; its worker exits at ``--die-on`` the first time only."""
    from pyspark.sql.functions import udf

    die_on, marker, slow_on, slow = args.die_on, args.marker, args.slow_on, args.slow_dir

    def upper(value: bytes | None) -> str | None:
        if value is None:
            return None
        text = value.decode()
        if die_on is not None and marker is not None and text == die_on and not os.path.exists(marker):
            Path(marker).touch()
            os._exit(1)
        if slow_on is not None and text == slow_on:
            _wait_for_copy(slow)
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
    return df.select("key", _upper(args)("value").alias("value")), "topic"


def _session(master: str, conf: list[str]) -> Any:
    """A local or standalone session as the tests make them, or a Spark Connect client (``sc://``)."""
    if not master.startswith("sc://"):
        return create_test_session(master, **dict(c.split("=", 1) for c in conf))
    from pyspark.sql import SparkSession

    return SparkSession.builder.remote(master).getOrCreate()


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
    parser.add_argument("--slow-on")
    parser.add_argument("--slow-dir")
    parser.add_argument("--conf", action="append", default=[])
    args = parser.parse_args()

    spark = _session(args.master, args.conf)
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
    writer = (
        staged.writeStream.format("kafkatx")
        .option("kafka.bootstrap.servers", args.bootstrap)
        .option(topic_option, args.dst)
        .option("checkpointLocation", args.checkpoint)
        .trigger(availableNow=True)
    )
    for start in range(3):  # Spark gives a Python worker 10 s to start: restart from the checkpoint if it was slower
        query = writer.start()
        print("started", flush=True)
        try:
            query.awaitTermination()
            failure = query.exception()
        except Exception as died:  # awaitTermination raises what the query died of
            failure = died
        if failure is None or "Python worker failed to connect back" not in str(failure) or start == 2:
            break
        print(f"restarting after a slow Python worker start: {failure}", flush=True)
    spark.stop()
    if failure is not None:
        print(f"failed: {failure}", flush=True)
        sys.exit(1)
    print("done", flush=True)


if __name__ == "__main__":
    main()
