"""Structured Streaming through kafkatx: the exactly-once sink against what people write today.

    python bench/spark_streaming.py                       # 100,000 records, local[1] and local[2]
    python bench/spark_streaming.py --records 20000 --masters local[2] --repeat 1

Preloads ``--records`` records (100 B, 8 partitions) on the embedded broker, then, per Spark master, in one
SparkSession, runs two queries over the same input with ``trigger(availableNow=True)`` (read it all, write it,
stop), alternating ``--repeat`` times:

- **kafkatx**: ``readStream.format("kafkatx")`` -> upper-case the value -> ``writeStream.format("kafkatx")``:
  each micro-batch's rows committed in one Kafka transaction (read_committed readers see them once).
- **foreachBatch**: the same source and transform, written with ``foreachBatch`` + ``foreachPartition`` and a
  plain confluent-kafka Producer per task (no transaction, flushed at the end of each task): at least once, the
  usual hand-written sink.

Prints records/s of each (query start to termination, the median of ``--repeat`` runs; the source is the same, so
the difference is the sink), the ratio (the median of the alternations' own ratios, and their spread: on a shared
machine the ratio of two queries run back to back is steadier than either figure; issue 44's goal: the kafkatx
sink >= 0.5x), and checks the kafkatx output holds every record once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PARTITIONS = 8


def _plain_sink(bootstrap: str, topic: str) -> Any:
    """foreachBatch's function: each task produces its rows with a plain Producer (no transaction)."""

    def write_partition(rows: Any) -> None:
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
        for row in rows:
            producer.produce(topic, row["value"], row["key"])
            producer.poll(0)
        producer.flush(60)

    def write_batch(df: Any, batch_id: int) -> None:
        df.foreachPartition(write_partition)

    return write_batch


def _run_query(spark: Any, bootstrap: str, src: str, dst: str, checkpoint: str, sink: str) -> float:
    reader = (
        spark.readStream.format("kafkatx")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", src)
        .option("startingOffsets", "earliest")
    )
    df = reader.load().selectExpr("key", "CAST(upper(CAST(value AS STRING)) AS BINARY) AS value")
    writer = df.writeStream.option("checkpointLocation", checkpoint).trigger(availableNow=True)
    if sink == "kafkatx":
        writer = writer.format("kafkatx").option("kafka.bootstrap.servers", bootstrap).option("topic", dst)
    else:
        writer = writer.foreachBatch(_plain_sink(bootstrap, dst))
    started = time.perf_counter()
    query = writer.start()
    query.awaitTermination()
    if query.exception() is not None:
        raise SystemExit(f"{sink} query failed: {query.exception()}")
    return time.perf_counter() - started


def inner(args: argparse.Namespace) -> None:
    """One master: a SparkSession, the two queries alternated; prints a JSON line."""
    from kafkatx.spark import streaming
    from kafkatx.spark.testing import create_test_session
    from kafkatx.testing import create_topic, read_topic

    spark = create_test_session(args.inner, **{"spark.default.parallelism": "2", "spark.sql.shuffle.partitions": "2"})
    streaming.register(spark)
    times: dict[str, list[float]] = {"kafkatx": [], "foreachBatch": []}
    exact = True
    try:
        for rep in range(args.repeat):
            for sink in ("kafkatx", "foreachBatch"):
                dst = f"bench-spark-out-{uuid.uuid4().hex[:8]}"
                create_topic(args.bootstrap, dst, PARTITIONS)
                checkpoint = tempfile.mkdtemp(prefix="kafkatx-bench-chk-")
                times[sink].append(_run_query(spark, args.bootstrap, args.src, dst, checkpoint, sink))
                if sink == "kafkatx" and rep == 0:
                    got = read_topic(args.bootstrap, dst, timeout=60)
                    keys = {r.key for r in got}  # every input key is unique: once each, none missing
                    exact = exact and len(got) == args.records == len(keys)
    finally:
        spark.stop()
    print("RESULT " + json.dumps({"master": args.inner, "times": times, "exactly_once": exact}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--masters", default="local[1],local[2]")
    ap.add_argument("--repeat", type=int, default=3, help="alternations of the two queries per master")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        inner(args)
        return

    from kafkatx.local import LocalBroker
    from kafkatx.testing import create_topic, produce

    with LocalBroker() as broker:
        bootstrap = broker.bootstrap_servers
        src = "bench-spark-in"
        create_topic(bootstrap, src, PARTITIONS)
        value = b"x" * 100
        for start in range(0, args.records, 10_000):
            batch = range(start, min(start + 10_000, args.records))
            produce(bootstrap, src, [{"key": b"k%d" % i, "value": value, "partition": i % PARTITIONS} for i in batch])
        print(f"# {args.records:,} records of 100 B over {PARTITIONS} partitions; queries alternated x{args.repeat}")
        print(
            f"{'master':10s} {'kafkatx rec/s':>14s} {'foreachBatch rec/s':>19s} {'ratio':>6s}  exactly-once "
            "ratio min-max"
        )
        for master in args.masters.split(","):
            command = [sys.executable, __file__, "--inner", master, "--bootstrap", bootstrap, "--src", src]
            command += ["--records", str(args.records), "--repeat", str(args.repeat)]
            proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                raise SystemExit(f"{master} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            res = json.loads(line[7:])
            rates = {sink: args.records / statistics.median(ts) for sink, ts in res["times"].items()}
            # each alternation's ratio (the two queries back to back, under the same load), then their spread
            ratios = sorted(b / a for a, b in zip(res["times"]["kafkatx"], res["times"]["foreachBatch"], strict=True))
            print(
                f"{master:10s} {rates['kafkatx']:14,.0f} {rates['foreachBatch']:19,.0f} "
                f"{statistics.median(ratios):6.2f}  {'yes' if res['exactly_once'] else 'NO':12s} "
                f"{ratios[0]:.2f}-{ratios[-1]:.2f}"
            )


if __name__ == "__main__":
    main()
