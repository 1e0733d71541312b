"""A Structured Streaming pipeline through kafkatx: orders in, invoices out exactly once, bad orders dead-lettered.

``readStream.format("kafkatx")`` reads ``orders`` read_committed; :func:`kafkatx.spark.streaming.map_records`
runs an ordinary kafkatx handler on the executors (retried in place; a record that still fails becomes a
dead letter for ``orders-dlt`` with Spring's headers); ``writeStream.format("kafkatx")`` commits each micro-batch's
invoices and dead letters in one Kafka transaction with the batch id, so a restarted query writes nothing twice.

The whole demo (embedded broker, sample orders, prints the check, exits; needs ``pip install -e '.[local,spark]'``
in a clone, and Java 17+)::

    python examples/spark_streaming.py
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from typing import Any

from kafkatx import Output, Record
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.spark import streaming


class BadOrder(Exception):
    """An order no retry can fix (dead-lettered at its first failure)."""


def invoice(record: Record) -> Any:
    """One invoice per order, keyed by customer; a malformed order fails (not retryable: dead-lettered)."""
    order = json.loads(record.value or b"")  # malformed JSON: JSONDecodeError, not retryable by default
    if order["amount"] <= 0:
        raise BadOrder(f"order {order['id']}: amount {order['amount']}")
    total = round(order["amount"] * 1.2, 2)
    return Output({"order": order["id"], "total": total}, key=order["customer"], headers={"source": "spark"})


def pipeline(spark: Any, servers: str, checkpoint: str) -> Any:
    """orders -> invoice() on the executors -> invoices and orders-dlt, exactly once; started, availableNow."""
    streaming.register(spark)
    orders = (
        spark.readStream.format("kafkatx")
        .option("kafka.bootstrap.servers", servers)
        .option("subscribe", "orders")
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", 500)
        .load()
    )
    invoices = streaming.map_records(
        orders,
        invoice,
        output="invoices",
        serializer=lambda v: json.dumps(v).encode(),
        not_retryable=[BadOrder],
        max_attempts=3,
        backoff=0.1,
    )
    return (
        invoices.writeStream.format("kafkatx")
        .option("kafka.bootstrap.servers", servers)
        .option("markerTopic", "invoices")  # rows name their topics (invoices or orders-dlt)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )


def _orders(count: int) -> list[dict[str, Any]]:
    orders: list[dict[str, Any]] = []
    for i in range(count):
        value = json.dumps({"id": i, "customer": f"c{i % 7}", "amount": 10 + i % 50}).encode()
        if i % 97 == 13:
            value = b"{not json"
        elif i % 101 == 42:
            value = json.dumps({"id": i, "customer": "c0", "amount": -5}).encode()
        orders.append({"key": f"c{i % 7}".encode(), "value": value})
    return orders


def main() -> int:
    """Start a local broker, produce orders, run the query once over them, check and print."""
    from pyspark.sql import SparkSession

    from kafkatx.local import LocalBroker
    from kafkatx.testing import create_topic, produce, read_topic

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    orders = _orders(1000)
    with LocalBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        servers = broker.bootstrap_servers
        for topic in ("orders", "invoices", "orders-dlt"):
            create_topic(servers, topic, partitions=2)
        produce(servers, "orders", orders)
        print(f"produced {len(orders)} orders on {servers}; starting Spark (a few seconds)...", flush=True)
        builder = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
        spark = builder.config("spark.ui.showConsoleProgress", "false").getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        try:
            query = pipeline(spark, servers, os.path.join(tmp, "checkpoint"))
            query.awaitTermination()
            if query.exception() is not None:
                print(f"the query failed: {query.exception()}", file=sys.stderr)
                return 1
        finally:
            spark.stop()
        invoices, letters = read_topic(servers, "invoices"), read_topic(servers, "orders-dlt")
    ids = sorted(json.loads(r.value or b"")["order"] for r in invoices)
    reasons = sorted({parse_dead_letter_headers(r.headers).exception_fqcn or "?" for r in letters})
    print(f"{len(invoices)} invoices, {len(letters)} dead-lettered records ({', '.join(reasons)})")
    exact = len(ids) == len(set(ids)) and len(ids) + len(letters) == len(orders)
    print("exactly-once check: OK" if exact else "exactly-once check: FAILED")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
