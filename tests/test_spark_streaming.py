"""Structured Streaming through the "kafkatx" format: a read_committed source and an exactly-once sink (issue 44).

A local[1] SparkSession and the embedded broker. Each query runs with trigger(availableNow=True): it reads what
the input holds, writes it, and stops, so a test can read the output back under read_committed and count.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from kafkatx.spark import streaming  # noqa: E402
from kafkatx.spark.testing import spark_session  # noqa: E402,F401
from kafkatx.testing import KafkaTestKit  # noqa: E402

pytestmark = pytest.mark.spark


def _query(spark: Any, kit: KafkaTestKit, src: str, dst: str, checkpoint: Path, **source: str) -> None:
    streaming.register(spark)
    reader = spark.readStream.format("kafkatx").option("kafka.bootstrap.servers", kit.bootstrap_servers)
    for name, value in {"subscribe": src, "startingOffsets": "earliest", **source}.items():
        reader = reader.option(name, value)
    df = reader.load().selectExpr("key", "upper(CAST(value AS STRING)) AS value")
    query = (
        df.writeStream.format("kafkatx")
        .option("kafka.bootstrap.servers", kit.bootstrap_servers)
        .option("topic", dst)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert query.exception() is None, query.exception()


def test_a_query_from_the_source_to_the_sink_writes_every_record_once(
    spark_session: Any, kafka: KafkaTestKit, tmp_path: Path
) -> None:
    src, dst = kafka.topic(partitions=3), kafka.topic(partitions=3)
    values = [f"v{i}".encode() for i in range(300)]
    kafka.produce(src, [(f"k{i % 7}".encode(), v) for i, v in enumerate(values)])
    _query(spark_session, kafka, src, dst, tmp_path / "chk", maxOffsetsPerTrigger="100")
    out = Counter(kafka.values(dst))
    assert out == Counter(v.upper() for v in values), "each input record once in the output"
    committed = sorted(p.name for p in (tmp_path / "chk" / "commits").iterdir() if p.name.isdigit())
    assert len(committed) >= 3, f"maxOffsetsPerTrigger=100 over 300 records: several micro-batches, got {committed}"


def test_a_batch_spark_runs_again_after_its_rows_were_committed_is_not_written_twice(
    spark_session: Any, kafka: KafkaTestKit, tmp_path: Path
) -> None:
    src, dst = kafka.topic(partitions=2), kafka.topic(partitions=2)
    values = [f"r{i}".encode() for i in range(50)]
    kafka.produce(src, values)
    checkpoint = tmp_path / "chk"
    _query(spark_session, kafka, src, dst, checkpoint)
    assert Counter(kafka.values(dst)) == Counter(v.upper() for v in values)
    # As a driver killed between the Kafka commit and its checkpoint leaves it: the last batch not marked done.
    commits = sorted((p for p in (checkpoint / "commits").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    commits[-1].unlink()
    (checkpoint / "commits" / f".{commits[-1].name}.crc").unlink(missing_ok=True)
    _query(spark_session, kafka, src, dst, checkpoint)
    assert Counter(kafka.values(dst)) == Counter(v.upper() for v in values), "the re-run batch was skipped"


def test_the_source_reads_only_committed_records(spark_session: Any, kafka: KafkaTestKit, tmp_path: Path) -> None:
    from confluent_kafka import Producer

    src, dst = kafka.topic(partitions=1), kafka.topic(partitions=1)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "transactional.id": f"t-{src}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(src, b"aborted")
    producer.flush(10)
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(src, b"committed")
    producer.commit_transaction(30)
    _query(spark_session, kafka, src, dst, tmp_path / "chk")
    assert kafka.values(dst) == [b"COMMITTED"]
