"""Word count (the KIP-1050 demo app) as a PySpark job inside Kafka transactions.

Each batch of lines becomes a DataFrame; the job's per-batch counts are
produced to ``word-counts`` in the same transaction as the batch's offsets,
so summing them gives exact totals even across crashes and retries.

The whole demo (embedded broker, sample input, prints the totals, exits)::

    python examples/spark_wordcount.py

Or run the App on its own, against the embedded broker, and feed ``lines``
yourself (it needs ``pip install -e '.[local,spark]'`` in a clone, and Java 17+)::

    kafkatx run examples.spark_wordcount:app --local --local-port 9092
    echo "the cat and the hat" | kafkatx produce lines     # from another terminal
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections import Counter

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

import kafkatx.spark
from kafkatx import App

WORD_SEPARATORS = r"[^a-z0-9']+"

app = App("spark-wordcount", create_topics=True, topic_partitions=3)
kafkatx.spark.configure(app, master="local[2]")


@app.spark_listener(
    "lines", output="word-counts", dlq=True, max_attempts=3, max_batch_records=50_000, max_batch_ms=2_000
)
def count_words(df: DataFrame) -> DataFrame:
    """One output record per word of the batch: key = the word, value = its count in the batch."""
    words = df.select(F.explode(F.split(F.lower(F.col("value").cast("string")), WORD_SEPARATORS)).alias("word"))
    counts = words.where(F.col("word") != "").groupBy("word").count()
    return counts.select(F.col("word").alias("key"), F.col("count").cast("string").alias("value"))


TEXT = """\
Exactly once is not a property of a system but of a pipeline.
A transaction commits the outputs of a batch together with the offsets of its inputs.
If the process crashes, the open transaction is aborted and the batch is read again.
Readers with read_committed isolation never see the outputs of an aborted transaction.
"""


def main() -> int:
    """Start a local broker, produce the text many times, count, print the totals."""
    from kafkatx.local import LocalBroker
    from kafkatx.testing import committed_offsets, create_topic, end_offsets, produce, read_topic

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    lines = [line for _ in range(250) for line in TEXT.splitlines()]
    with LocalBroker() as broker:
        servers = broker.bootstrap_servers
        app.bootstrap_servers = servers
        app.instance_id = "spark-wordcount-demo"
        create_topic(servers, "lines", partitions=3)
        produce(servers, "lines", [{"value": line, "partition": i % 3} for i, line in enumerate(lines)])
        print(f"produced {len(lines)} lines to 'lines' on {servers}; starting Spark (a few seconds)...", flush=True)
        started = time.monotonic()
        app.start()
        try:
            while committed_offsets(servers, app.group_id, "lines") != end_offsets(servers, "lines"):
                if app.failure is not None:
                    raise app.failure
                if time.monotonic() - started > 120:
                    print("timed out waiting for the job", file=sys.stderr)
                    return 1
                time.sleep(0.2)
        finally:
            app.stop()
        totals: Counter[str] = Counter()
        outputs = read_topic(servers, "word-counts")
        for record in outputs:
            totals[record.key.decode()] += int(record.value)  # type: ignore[union-attr,arg-type]
    expected = Counter(w for line in lines for w in re.split(WORD_SEPARATORS, line.lower()) if w)
    print(f"{len(outputs)} per-batch counts committed in {time.monotonic() - started:.1f}s; top words:")
    for word, count in totals.most_common(10):
        print(f"  {word:<14} {count}")
    exact = totals == expected
    print("totals match the input exactly" if exact else f"MISMATCH: {totals - expected} / {expected - totals}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
