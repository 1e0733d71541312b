"""Spark listeners against the local broker and a local[1] SparkSession."""

from __future__ import annotations

import random
import sys
import threading
from collections import Counter
from typing import Any

import pytest
from helpers import summed_counts

pytest.importorskip("pyspark")

from pyspark.errors import ArithmeticException  # noqa: E402
from pyspark.sql import DataFrame  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql.types import IntegerType, StringType  # noqa: E402

import kafkatx.spark  # noqa: E402
from kafkatx import App  # noqa: E402
from kafkatx.dlq.headers import parse_dead_letter_headers  # noqa: E402
from kafkatx.errors import InvalidConfigurationError  # noqa: E402
from kafkatx.events import (  # noqa: E402
    HandlerFailed,
    RecordRecovered,
    RecoveryFailed,
    TransactionAborted,
    TransactionCommitted,
)
from kafkatx.rollback.classifier import ExceptionClassifier  # noqa: E402
from kafkatx.spark import SparkJobError, SparkSessionError, as_job_error  # noqa: E402
from kafkatx.spark._errors import parse_python_traceback  # noqa: E402
from kafkatx.spark.testing import ship_module_by_value, spark_session  # noqa: E402,F401
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for  # noqa: E402

pytestmark = pytest.mark.spark

# The UDFs below live in this module, which Spark's Python workers cannot import.
ship_module_by_value(sys.modules[__name__])

WORDS = ["kafka", "spark", "exactly", "once", "poison", "transaction", "offset", "batch", "arrow", "python"]


class PoisonError(Exception):
    """What the test UDF raises for a poison record."""


def _check(value):  # type: ignore[no-untyped-def]  (type hints would make PySpark guess a UDF kind)
    text = bytes(value).decode()
    if text.startswith("poison"):
        raise PoisonError(f"poison record {text!r}")
    return text


_checked = F.udf(_check, StringType())


def word_count(df: DataFrame) -> DataFrame:
    """The KIP-1050 demo app: count the words of each batch."""
    words = df.select(F.explode(F.split(F.col("value").cast("string"), r"\s+")).alias("word")).where(
        F.col("word") != ""
    )
    return (
        words.groupBy("word").count().select(F.col("word").alias("key"), F.col("count").cast("string").alias("value"))
    )


def checked_count(df: DataFrame) -> DataFrame:
    """Count values per distinct value; the UDF fails the whole job on any poison record."""
    counted = df.select(_checked("value").alias("word")).groupBy("word").count()
    return counted.select(F.col("word").alias("key"), F.col("count").cast("string").alias("value"))


def _app(kafka: KafkaTestKit, spark: Any, **kwargs: Any) -> App:
    app = App(
        unique_name("spark-app"), bootstrap_servers=kafka.bootstrap_servers, instance_id=unique_name("i"), **kwargs
    )
    kafkatx.spark.configure(app, session=spark)
    return app


def _events(app: App, *types: type) -> dict[type, list[Any]]:
    seen: dict[type, list[Any]] = {t: [] for t in types}
    lock = threading.Lock()
    for t in types:

        def on(event: Any, t: type = t) -> None:
            with lock:
                seen[t].append(event)

        app.events.subscribe(t, on)
    return seen


def _done(kafka: KafkaTestKit, group: str, topic: str) -> bool:
    return kafka.caught_up(group, topic)


# -- end to end ---------------------------------------------------------------------
@pytest.mark.parametrize("fencing", ["group", "partition"])
def test_word_count_is_exact_and_committed_once(kafka: KafkaTestKit, spark_session: Any, fencing: str) -> None:
    lines_topic, counts_topic = kafka.topic(partitions=3), kafka.topic(partitions=2)
    rng = random.Random(7)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))) for _ in range(1200)]
    kafka.produce(lines_topic, [{"value": line, "partition": i % 3} for i, line in enumerate(lines)])
    expected = Counter(word for line in lines for word in line.split())

    app = _app(kafka, spark_session)
    calls = {"n": 0}

    @app.spark_listener(
        lines_topic,
        output=counts_topic,
        fencing=fencing,
        max_batch_records=400,
        max_batch_ms=200,
        max_attempts=3,
        backoff=0,
    )
    def count(df: DataFrame) -> DataFrame:
        calls["n"] += 1
        if calls["n"] == 2:  # one transient failure: the retry must not duplicate anything
            raise ConnectionError("executor lost (simulated)")
        return word_count(df)

    events = _events(app, TransactionCommitted, HandlerFailed)
    with running(app):
        wait_for(lambda: _done(kafka, app.group_id, lines_topic), timeout=60, message="all lines committed")

    out = kafka.read(counts_topic)
    assert summed_counts(out) == expected  # exact: nothing lost, nothing counted twice
    assert len(out) == sum(e.outputs for e in events[TransactionCommitted])  # each output produced once
    assert len(kafka.read(counts_topic, isolation="read_uncommitted")) == len(out)  # no aborted attempts at all
    assert len(events[TransactionCommitted]) >= 3  # several batches, not one
    assert [e.attempt for e in events[HandlerFailed]] == [1]
    assert isinstance(events[HandlerFailed][0].exception, ConnectionError)


def test_poison_records_are_isolated_and_the_rest_commits_once(kafka: KafkaTestKit, spark_session: Any) -> None:
    topic, out_topic = kafka.topic(), kafka.topic()
    rng = random.Random(11)
    values = [rng.choice(WORDS[:4]) for _ in range(2000)]
    poison_at = {137, 1024, 1999}
    for i in poison_at:
        values[i] = f"poison-{i}"
    kafka.produce(topic, values)  # all before the app starts: one batch, closed as soon as it holds all 2000

    app = _app(kafka, spark_session)
    jobs = {"n": 0}

    @app.spark_listener(
        topic, output=out_topic, dlq=True, max_attempts=2, backoff=0, max_batch_records=2000, max_batch_ms=2000
    )
    def count(df: DataFrame) -> DataFrame:
        jobs["n"] += 1
        return checked_count(df)

    events = _events(app, TransactionCommitted, HandlerFailed, RecordRecovered)
    with running(app):
        # 2 attempts and about 36 isolating jobs: 57 s on an idle machine, 75 s next to the other worker's tests
        # on a loaded one; the wait ends as soon as the batch is committed.
        wait_for(lambda: _done(kafka, app.group_id, topic), timeout=160, message="the batch committed")

    assert [e.records for e in events[TransactionCommitted]] == [2000], "the records did not arrive as one batch"
    dead = kafka.read(f"{topic}-dlt")
    assert sorted(r.value.decode() for r in dead) == sorted(f"poison-{i}" for i in poison_at)
    for r in dead:
        info = parse_dead_letter_headers(r.headers)
        assert info.exception_fqcn == f"{__name__}.PoisonError"
        assert info.exception_cause_fqcn == f"{__name__}.PoisonError"
        assert info.exception_message == f"poison record {r.value.decode()!r}"
        assert info.original_offset == int(r.value.decode().split("-")[1])
        assert info.attempts == 2
    # One job over all the good records: every word once, with its full count.
    out = kafka.read(out_topic)
    good = Counter(v for i, v in enumerate(values) if i not in poison_at)
    assert sorted(r.key.decode() for r in out) == sorted(good)
    assert summed_counts(out) == good
    assert [e.attempt for e in events[HandlerFailed]] == [1, 2]
    assert {e.record.offset for e in events[RecordRecovered]} == poison_at
    # Isolation cost: 2 attempts, then about k·(log2(n) + 1) jobs for k poison records.
    assert jobs["n"] <= 2 + 3 * (11 + 1), jobs["n"]


def test_bisection_budget_dead_letters_the_suspects(kafka: KafkaTestKit, spark_session: Any) -> None:
    topic, out_topic = kafka.topic(), kafka.topic()
    values = [f"w{i % 2}" for i in range(16)]
    values[5] = "poison-5"
    kafka.produce(topic, values)
    app = _app(kafka, spark_session)
    app.spark_listener(topic, output=out_topic, dlq=True, not_retryable=[PoisonError], max_bisect_jobs=2)(checked_count)
    with running(app):
        wait_for(lambda: _done(kafka, app.group_id, topic), timeout=60, message="the batch committed")
    # Probes: [0, 8) fails, [0, 4) passes, budget spent: [4, 8) is the suspect set.
    dead = kafka.read(f"{topic}-dlt")
    assert [r.value.decode() for r in dead] == values[4:8]
    info = parse_dead_letter_headers(dead[0].headers)
    assert info.exception_fqcn == f"{__name__}.PoisonError"
    assert "max_bisect_jobs=2" in (info.exception_stacktrace or "")
    assert summed_counts(kafka.read(out_topic)) == Counter(values[:4] + values[8:])


class _SessionThatDies:
    """Jobs fail and even a trivial job fails: what a dead JVM looks like."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def createDataFrame(self, table: Any) -> Any:  # noqa: N802 - SparkSession's name
        return self.real.createDataFrame(table)

    def range(self, *args: Any) -> Any:
        raise ConnectionRefusedError("[Errno 111] Connection refused (simulated dead JVM)")


def test_dead_spark_stops_the_container_instead_of_dead_lettering(kafka: KafkaTestKit, spark_session: Any) -> None:
    topic = kafka.topic()
    kafka.produce(topic, [f"v{i}" for i in range(8)])
    app = App(unique_name("spark-app"), bootstrap_servers=kafka.bootstrap_servers, instance_id=unique_name("i"))
    kafkatx.spark.configure(app, session=_SessionThatDies(spark_session), warm_up=False)

    @app.spark_listener(topic, output=kafka.topic(), dlq=True, max_attempts=1, max_bisect_jobs=0)
    def job(df: DataFrame) -> DataFrame:
        raise ConnectionRefusedError("[Errno 111] Connection refused (simulated)")

    with pytest.raises(SparkSessionError, match="not blamed on its records"):
        with running(app):
            wait_for(lambda: app.failure is not None, timeout=60, message="the container to stop")
    assert kafka.read(f"{topic}-dlt") == []
    assert kafka.committed(app.group_id, topic) == {}


def test_wrong_output_schema_dead_letters_the_batch_without_bisecting(kafka: KafkaTestKit, spark_session: Any) -> None:
    topic = kafka.topic()
    kafka.produce(topic, [f"v{i}" for i in range(12)])
    app = _app(kafka, spark_session)
    jobs = {"n": 0}

    @app.spark_listener(topic, output=kafka.topic(), dlq=True, max_attempts=3)
    def no_value(df: DataFrame) -> DataFrame:
        jobs["n"] += 1
        return df.select(F.col("value").cast("string").alias("text"))

    with running(app):
        wait_for(lambda: _done(kafka, app.group_id, topic), timeout=60, message="the batch committed")
    dead = kafka.read(f"{topic}-dlt")
    assert len(dead) == 12
    info = parse_dead_letter_headers(dead[0].headers)
    assert info.exception_fqcn == "kafkatx.spark._errors.SparkOutputError"
    assert "without a 'value' column" in (info.exception_message or "")
    assert jobs["n"] == 1  # not retryable, and no subset of the batch can fix a schema


def test_not_retryable_poison_and_failed_recovery(kafka: KafkaTestKit, spark_session: Any) -> None:
    """not_retryable skips the retries; a failing recoverer aborts everything and is retried later."""
    topic, out_topic, parked = kafka.topic(), kafka.topic(), kafka.topic()
    values = [f"w{i % 2}" for i in range(10)]
    values[3] = "poison-3"
    kafka.produce(topic, values)
    app = _app(kafka, spark_session)
    tries = {"n": 0}
    jobs = {"n": 0, "at_failure": 0}

    def park(record: Any, exc: BaseException) -> None:
        tries["n"] += 1
        if tries["n"] == 1:
            raise RuntimeError("parking lot unavailable")
        kafkatx.send(parked, record.value)

    @app.spark_listener(
        topic, output=out_topic, dlq=park, max_attempts=5, backoff=30, not_retryable=[PoisonError], recovery_backoff=0.2
    )
    def count(df: DataFrame) -> DataFrame:
        jobs["n"] += 1
        return checked_count(df)

    events = _events(app, HandlerFailed, RecoveryFailed, TransactionAborted, TransactionCommitted)
    app.events.subscribe(RecoveryFailed, lambda e: jobs.__setitem__("at_failure", jobs["n"]))
    with running(app):
        wait_for(lambda: _done(kafka, app.group_id, topic), timeout=60, message="the batch committed")

    assert [r.value for r in kafka.read(parked)] == [b"poison-3"]
    committed = kafka.read(out_topic)
    assert summed_counts(committed) == Counter(v for v in values if v != "poison-3")
    assert len(events[HandlerFailed]) == 1  # not retryable: no retry, and no 30 s back-off
    # The first transaction (outputs + failed recovery) was aborted, not half-committed.
    assert len(events[RecoveryFailed]) == 1 and len(events[TransactionAborted]) == 1
    assert len(events[TransactionCommitted]) == 1
    assert jobs["n"] - jobs["at_failure"] == 1  # redelivered: the known poison record skips the job


# -- error unwrapping -----------------------------------------------------------------
def test_udf_exception_is_unwrapped_to_the_users_class(spark_session: Any) -> None:
    df = spark_session.createDataFrame([(b"ok",), (b"poison-x",)], "value binary")
    with pytest.raises(Exception) as info:
        df.select(_checked("value")).toArrow()
    error = as_job_error(info.value)
    assert isinstance(error, SparkJobError) and isinstance(error, PoisonError)
    assert error.original_fqcn == f"{__name__}.PoisonError"
    assert error.original_type is PoisonError
    assert str(error) == "poison record 'poison-x'"
    assert "raise PoisonError" in (error.worker_traceback or "")
    assert not ExceptionClassifier([PoisonError]).is_retryable(error)
    assert ExceptionClassifier().is_retryable(error)

    to_int = F.udf(lambda v: int(bytes(v).decode()), IntegerType())

    with pytest.raises(Exception) as info:
        df.select(to_int("value")).toArrow()
    error = as_job_error(info.value)
    assert isinstance(error, ValueError) and error.original_fqcn == "builtins.ValueError"
    assert "invalid literal for int()" in str(error)

    with pytest.raises(Exception) as info:
        df.select("no_such_column")
    error = as_job_error(info.value)
    assert isinstance(error, SparkJobError) and error.data_independent  # no subset of the records can fix it
    assert error.original_fqcn.endswith("AnalysisException")

    # A Spark-side error that depends on the data: chained, so PySpark's classes classify it.
    with pytest.raises(Exception) as info:
        spark_session.createDataFrame([(0,)], "x int").select((F.lit(1) / F.col("x")).alias("y")).toArrow()
    error = as_job_error(info.value)
    assert type(error) is SparkJobError and not error.data_independent
    assert "DIVIDE_BY_ZERO" in str(error) and isinstance(error.__cause__, ArithmeticException)
    assert not ExceptionClassifier([ArithmeticException]).is_retryable(error)


def test_parse_python_traceback() -> None:
    text = (
        "An exception was thrown from the Python worker:\nTraceback (most recent call last):\n"
        "  File \"/x/a.py\", line 3, in f\n    raise KeyError(k)\nKeyError: 'k'\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        'Traceback (most recent call last):\n  File "/x/a.py", line 5, in f\n    raise app.errors.Bad(msg)\n'
        "app.errors.Bad: first line\nsecond line\n SQLSTATE: 38000"
    )
    assert parse_python_traceback(text) == ("app.errors.Bad", "first line\nsecond line")
    assert parse_python_traceback('Traceback:\n  File "x", line 1\nStopIteration') == ("builtins.StopIteration", "")
    assert parse_python_traceback("no traceback here") is None


# -- configuration errors ---------------------------------------------------------------
def test_spark_listener_options() -> None:
    app = App("cfg")
    with pytest.raises(InvalidConfigurationError, match=r"configure\(app, master="):
        app.spark_listener("in", master="local[2]")
    with pytest.raises(InvalidConfigurationError, match="after_rollback"):
        app.spark_listener("in", after_rollback=object())
    with pytest.raises(InvalidConfigurationError, match="max_bisect_jobs"):
        app.spark_listener("in", max_bisect_jobs=-1)
    with pytest.raises(InvalidConfigurationError, match="unknown option.*outptu"):
        app.spark_listener("in", outptu="x")(word_count)
    with pytest.raises(InvalidConfigurationError, match="either session= or master="):
        kafkatx.spark.configure(
            app, session=object.__new__(type("S", (), {"createDataFrame": lambda self: None})), master="local"
        )
    app.spark_listener("in", output="out")(word_count)
    spec = app.listeners[0]
    assert (spec.kind, spec.max_batch_records, spec.max_batch_ms) == ("batch", 50_000, 2_000)
    assert callable(spec.runner)
