"""Structured Streaming through the "kafkatx" format: a read_committed source and an exactly-once sink (issue 44).

A local[1] SparkSession and the embedded broker. Each query runs with trigger(availableNow=True): it reads what
the input holds, writes it, and stops, so a test can read the output back under read_committed and count.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from kafkatx.spark import streaming  # noqa: E402
from kafkatx.spark.testing import ship_module_by_value, spark_session  # noqa: E402,F401
from kafkatx.testing import KafkaTestKit  # noqa: E402

pytestmark = pytest.mark.spark

ship_module_by_value(sys.modules[__name__])  # map_records' handlers run on Spark's Python workers


def _query(spark: Any, kit: KafkaTestKit, src: str, dst: str, checkpoint: Path, **source: str) -> None:
    streaming.register(spark)
    reader = spark.readStream.format("kafkatx").option("kafka.bootstrap.servers", kit.bootstrap_servers)
    for name, value in {"subscribe": src, "startingOffsets": "earliest", **source}.items():
        reader = reader.option(name, value)
    df = reader.load().selectExpr("key", "upper(CAST(value AS STRING)) AS value")
    writer = (
        df.writeStream.format("kafkatx")
        .option("kafka.bootstrap.servers", kit.bootstrap_servers)
        .option("topic", dst)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
    )
    _run_to_the_end(writer, 120)


_SLOW_WORKER_START = "Python worker failed to connect back"


def _run_to_the_end(writer: Any, timeout: float) -> None:
    """Run an availableNow query to its end, started again from its checkpoint if a Python worker started too slowly.

    Spark gives a Python worker 10 s (hard-coded) to start and connect back; on a loaded 2-core machine the query
    can die of that before reading anything. Starting it again from the checkpoint is what a user does, and the
    exactly-once assertions after it hold across such a restart, so they still test the sink.
    """
    for start in range(3):
        query = writer.start()
        try:
            query.awaitTermination(timeout)
            failure = query.exception()
        except Exception as died:  # awaitTermination raises what the query died of
            failure = died
        if failure is None or _SLOW_WORKER_START not in str(failure) or start == 2:
            break
        logging.getLogger(__name__).warning("query %s died of a slow Python worker start; starting it again", query.id)
    assert failure is None, failure


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


def test_the_sink_commits_a_batch_once_and_logs_its_rows_and_dead_letters(
    kafka: KafkaTestKit, caplog: pytest.LogCaptureFixture
) -> None:
    """The driver's side of the sink without Spark: what Spark's commit calls do, and what they log per batch."""
    import pyarrow as pa

    from kafkatx.dlq.headers import EXCEPTION_FQCN
    from kafkatx.spark._stream_sink import KafkaTxStreamWriter

    out, dlt = kafka.topic(), kafka.topic()
    writer = KafkaTxStreamWriter({"kafka.bootstrap.servers": kafka.bootstrap_servers, "markerTopic": out})
    letter = {"topic": dlt, "value": "b", "headers": [{"key": EXCEPTION_FQCN, "value": b"E"}]}  # a string value too
    rows = [{"topic": out, "value": "a", "headers": None}, letter]

    def task(*batches: list[dict[str, Any]]) -> Any:  # what a task's write returns, from its Arrow batches
        return writer.write(iter([pa.RecordBatch.from_pylist(b) for b in batches]))

    caplog.set_level(logging.INFO, logger="kafkatx.spark")
    writer.commit([task(rows[:1], rows[1:]), None], 0)  # None: a task that failed (Spark passes its slot empty)
    writer.commit([task(rows)], 0)
    writer.commit([task(rows[:1])], 1)
    assert (kafka.values(out), kafka.values(dlt)) == ([b"a", b"a"], [b"b"]), "batch 0 once, then batch 1"
    logged = [(r.batch, r.rows, r.dead_letters, r.transactions) for r in caplog.records if hasattr(r, "batch")]
    assert logged == [(0, 2, 1, 1), (0, 0, 0, 0), (1, 1, 0, 1)], logged

    plain = KafkaTxStreamWriter({"kafka.bootstrap.servers": kafka.bootstrap_servers, "topic": dlt})  # key, value only
    keyed = pa.RecordBatch.from_pylist([{"key": b"k1", "value": b"c"}, {"key": None, "value": None}])
    plain.commit([plain.write(iter([keyed]))], 0)
    assert [(r.key, r.value) for r in kafka.read(dlt)][1:] == [(b"k1", b"c"), (None, None)], "the topic option's topic"


class _Poison(Exception):
    """Not retryable in the map_records test: dead-lettered at its first failure."""


def test_map_records_writes_outputs_once_retries_in_place_and_dead_letters_what_still_fails(
    spark_session: Any, kafka: KafkaTestKit, tmp_path: Path
) -> None:
    from kafkatx import Output, Record
    from kafkatx.dlq.headers import parse_dead_letter_headers

    src, dst = kafka.topic(partitions=2), kafka.topic(partitions=2)
    dlt = kafka.topic(partitions=2, name=f"{src}-dlt")
    records = [(f"k{i}".encode(), f"{kind}{i}".encode()) for i, kind in enumerate(["ok", "flaky", "bad", "fatal"] * 15)]
    kafka.produce(src, [{"key": k, "value": v, "headers": [("h", b"1")]} for k, v in records])

    def handle(record: Record) -> Any:
        value = bytes(record.value or b"")
        if value.startswith(b"flaky") and record.attempt < 3:
            raise TimeoutError(f"{value!r} not yet (attempt {record.attempt})")
        if value.startswith(b"bad"):
            raise RuntimeError(f"{value!r} always fails")
        if value.startswith(b"fatal"):
            raise _Poison(f"{value!r} is poison")
        return [value.upper() + f"@{record.attempt}".encode(), Output(b"extra", key=record.key, headers={"x": "y"})]

    streaming.register(spark_session)
    df = (
        spark_session.readStream.format("kafkatx")
        .option("kafka.bootstrap.servers", kafka.bootstrap_servers)
        .option("subscribe", src)
        .option("startingOffsets", "earliest")
        .option("includeHeaders", "true")
        .load()
    )
    mapped = streaming.map_records(df, handle, output=dst, max_attempts=3, backoff=0.01, not_retryable=[_Poison])
    writer = (
        mapped.writeStream.format("kafkatx")
        .option("kafka.bootstrap.servers", kafka.bootstrap_servers)
        .option("markerTopic", dst)
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
    )
    _run_to_the_end(writer, 180)

    out = Counter(kafka.values(dst))
    ok = [v for _, v in records if v.startswith(b"ok")]
    flaky = [v for _, v in records if v.startswith(b"flaky")]
    expected = Counter([v.upper() + b"@1" for v in ok] + [v.upper() + b"@3" for v in flaky] + [b"extra"] * 30)
    assert out == expected, "each output once; a flaky record succeeded on its third attempt"
    letters = kafka.read(dlt)
    by_value = {r.value: r for r in letters}
    assert len(letters) == len(by_value) == 30, "each failing record dead-lettered once"
    inputs = dict((v, k) for k, v in records)
    for value, letter in by_value.items():
        info = parse_dead_letter_headers(letter.headers)
        assert letter.key == inputs[value] and letter.header("h") == b"1", "the input's key, value and headers"
        assert info.original_topic == src and info.original_offset is not None
        if value.startswith(b"bad"):
            assert (info.attempts, info.exception_fqcn) == (3, "builtins.RuntimeError"), info
        else:
            assert value.startswith(b"fatal") and info.attempts == 1, f"not retryable: dead-lettered at once: {info}"
            assert info.exception_fqcn is not None and info.exception_fqcn.endswith("_Poison"), info


# ---------------------------------------------------------------------------------------------------------------
# Failures in a process of its own (tests/spark_stream_child.py): a driver SIGKILLed, a Python worker dying.

_CHILD = Path(__file__).with_name("spark_stream_child.py")


def _child(kit: KafkaTestKit, src: str, dst: str, checkpoint: Path, *extra: str) -> subprocess.Popen[str]:
    paths = [str(Path(streaming.__file__).parents[2]), str(_CHILD.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    command = [sys.executable, str(_CHILD), "--bootstrap", kit.bootstrap_servers, "--src", src, "--dst", dst]
    return subprocess.Popen(
        [*command, "--checkpoint", str(checkpoint), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: the JVM and Python workers are killed with it
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 420) -> None:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the query did not finish in {timeout:.0f} s:\n{out[-3000:]}") from None
    assert proc.returncode == 0 and "done" in out, out[-3000:]


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the query ended before {path.name} appeared:\n{proc.communicate()[0][-3000:]}")
        assert time.monotonic() < deadline, f"{path.name} did not appear in {timeout:.0f} s"
        time.sleep(0.2)


def _done_batches(checkpoint: Path) -> set[int]:
    return {int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit()}


def _kill_after_kafka_commit(kit: KafkaTestKit, src: str, dst: str, checkpoint: Path, *extra: str) -> None:
    """Run the query until batch 1's transaction is committed in Kafka, then SIGKILL the driver's process group."""
    stopped = checkpoint.with_name("stopped")
    proc = _child(kit, src, dst, checkpoint, *extra, "--hang-after-batch", "1", "--signal", str(stopped))
    try:
        _wait_for(stopped, proc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.stdout is not None and not proc.stdout.closed:  # _wait_for read it already when the query ended
            proc.communicate()
        proc.wait()
    assert 1 not in _done_batches(checkpoint), "killed before Spark recorded batch 1 as done"


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(900)
def test_a_driver_sigkilled_after_the_kafka_commit_and_restarted_writes_every_record_once(
    kafka: KafkaTestKit, tmp_path: Path
) -> None:
    """The worst moment: batch 1's transaction is committed, Spark's checkpoint does not know it yet."""
    src, dst = kafka.topic(partitions=2), kafka.topic(partitions=2)
    values = [f"v{i}".encode() for i in range(120)]
    kafka.produce(src, [(f"k{i % 5}".encode(), v) for i, v in enumerate(values)])
    checkpoint = tmp_path / "chk"
    _kill_after_kafka_commit(kafka, src, dst, checkpoint, "--max-per-trigger", "40")
    written = Counter(kafka.values(dst))
    assert 0 < sum(written.values()) < len(values), f"killed mid-stream: {sum(written.values())} written"
    _finish(_child(kafka, src, dst, checkpoint, "--max-per-trigger", "40"))
    assert Counter(kafka.values(dst)) == Counter(v.upper() for v in values), "each input record once"


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(900)
def test_a_driver_sigkilled_while_map_records_runs_and_restarted_writes_each_output_or_dead_letter_once(
    kafka: KafkaTestKit, tmp_path: Path
) -> None:
    """As above with map_records in the middle: outputs and dead letters of batch 1 committed, then the kill."""
    src, dst = kafka.topic(partitions=2), kafka.topic(partitions=2)
    dlt = kafka.topic(partitions=2, name=f"{src}-dlt")
    values = [(b"bad" if i % 10 == 3 else b"v") + str(i).encode() for i in range(120)]
    kafka.produce(src, [(f"k{i % 5}".encode(), v) for i, v in enumerate(values)])
    checkpoint = tmp_path / "chk"
    _kill_after_kafka_commit(kafka, src, dst, checkpoint, "--max-per-trigger", "40", "--map-records")
    written = len(kafka.values(dst)) + len(kafka.values(dlt))
    assert 0 < written < len(values), f"killed mid-stream: {written} outputs and dead letters written"
    _finish(_child(kafka, src, dst, checkpoint, "--max-per-trigger", "40", "--map-records"))
    assert Counter(kafka.values(dst)) == Counter(v.upper() for v in values if v.startswith(b"v")), "outputs once"
    assert Counter(kafka.values(dlt)) == Counter(v for v in values if v.startswith(b"bad")), "dead letters once"


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(900)
def test_a_python_worker_dying_mid_task_under_task_retries_writes_every_record_once(
    kafka: KafkaTestKit, tmp_path: Path
) -> None:
    """local[2,3]: the UDF's worker exits mid-task once; the sink's task saw a truncated input, the retry all of it."""
    src, dst = kafka.topic(partitions=2), kafka.topic(partitions=2)
    values = [f"v{i}".encode() for i in range(200)]
    kafka.produce(src, values, partition=0)
    kafka.produce(src, [f"w{i}".encode() for i in range(200)], partition=1)
    died = tmp_path / "died"
    extra = ("--master", "local[2,3]", "--max-per-trigger", "1000", "--die-on", "v120", "--marker", str(died))
    _finish(_child(kafka, src, dst, tmp_path / "chk", *extra))
    assert died.exists(), "the worker died once"
    expected = Counter(v.upper() for v in values) + Counter(f"W{i}".encode() for i in range(200))
    assert Counter(kafka.values(dst)) == expected, "each input record once"


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("cluster", ["local[2,3]", "spark_standalone", "spark_connect"])
def test_a_map_records_worker_dying_mid_task_under_task_retries_writes_outputs_and_dead_letters_once(
    cluster: str, request: pytest.FixtureRequest, kafka: KafkaTestKit, tmp_path: Path
) -> None:
    """The handler's worker exits mid-task once; the retried task runs the handler again from the start.

    Under local[2,3], on a standalone cluster (4 tries a task) and through Spark Connect (its server over
    local[2,3]): the fixtures of the section below."""
    master = cluster if cluster.startswith("local") else request.getfixturevalue(cluster)
    src, dst = kafka.topic(partitions=2), kafka.topic(partitions=2)
    dlt = kafka.topic(partitions=2, name=f"{src}-dlt")
    values = [(b"bad" if i % 50 == 7 else b"v") + str(i).encode() for i in range(300)]
    kafka.produce(src, values)
    died = tmp_path / "died"
    extra = ("--master", master, "--max-per-trigger", "1000", "--map-records", "--die-on", "v150")
    _finish(_child(kafka, src, dst, tmp_path / "chk", *extra, "--marker", str(died)))
    assert died.exists(), "the worker died once"
    assert Counter(kafka.values(dst)) == Counter(v.upper() for v in values if v.startswith(b"v")), "outputs once"
    assert Counter(kafka.values(dlt)) == Counter(v for v in values if v.startswith(b"bad")), "dead letters once"


# ---------------------------------------------------------------------------------------------------------------
# On a cluster: a standalone master and two workers (spark://) and a Spark Connect server (sc://), started by the
# session fixtures of conftest.py (tests/spark_servers.py). The query runs in the child process, a driver (or a
# Connect client) of its own; the "kafkatx" source and sink run on the cluster's executors and driver.


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("cluster", ["spark_standalone", "spark_connect"])
def test_on_a_cluster_the_source_and_sink_write_every_record_once(
    cluster: str, request: pytest.FixtureRequest, kafka: KafkaTestKit, tmp_path: Path
) -> None:
    master = request.getfixturevalue(cluster)
    src, dst = kafka.topic(partitions=3), kafka.topic(partitions=2)
    values = [f"v{i}".encode() for i in range(300)]
    kafka.produce(src, [(f"k{i % 7}".encode(), v) for i, v in enumerate(values)])
    checkpoint = tmp_path / "chk"
    _finish(_child(kafka, src, dst, checkpoint, "--master", master, "--max-per-trigger", "120"))
    assert Counter(kafka.values(dst)) == Counter(v.upper() for v in values), "each input record once"
    assert len(_done_batches(checkpoint)) >= 2, "several micro-batches"


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(900)
def test_a_speculative_copy_of_a_slow_task_does_not_write_its_rows_twice(
    spark_standalone: str, kafka: KafkaTestKit, tmp_path: Path
) -> None:
    """spark.speculation on, two 1-core workers (two hosts): the task of partition 0 stalls until Spark has started a
    speculative copy of it and the copy has reached the same record; both attempts run to the end."""
    src, dst = kafka.topic(partitions=2), kafka.topic(partitions=2)
    values = [f"v{i}".encode() for i in range(200)]
    kafka.produce(src, values, partition=0)
    kafka.produce(src, [f"w{i}".encode() for i in range(200)], partition=1)
    slow = tmp_path / "slow"
    slow.mkdir()
    speculation = {
        "spark.speculation": "true",
        "spark.speculation.interval": "200ms",
        "spark.speculation.quantile": "0.5",
        "spark.speculation.multiplier": "1.5",
        "spark.speculation.minTaskRuntime": "1s",
        "spark.speculation.efficiency.enabled": "false",
    }
    conf = [arg for key, value in speculation.items() for arg in ("--conf", f"{key}={value}")]
    extra = ("--master", spark_standalone, "--max-per-trigger", "1000", "--slow-on", "v120", "--slow-dir", str(slow))
    _finish(_child(kafka, src, dst, tmp_path / "chk", *extra, *conf))
    assert (slow / "attempt-0").exists() and (slow / "attempt-1").exists(), "a speculative copy reached the record"
    expected = Counter(v.upper() for v in values) + Counter(f"W{i}".encode() for i in range(200))
    assert Counter(kafka.values(dst)) == expected, "each input record once"
