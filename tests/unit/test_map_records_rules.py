"""map_records' per-task function without Spark: Arrow batches of the source's columns in, sink rows out."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from kafkatx import Output, Record  # noqa: E402
from kafkatx.dlq.headers import parse_dead_letter_headers  # noqa: E402
from kafkatx.errors import InvalidConfigurationError  # noqa: E402
from kafkatx.spark._map_records import RecordMapper  # noqa: E402


def _batch(values: list[bytes], topic: str = "in", headers: bool = True) -> Any:
    stamp = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    columns: dict[str, Any] = {
        "key": [b"k%d" % i for i in range(len(values))],
        "value": values,
        "topic": [topic] * len(values),
        "partition": [1] * len(values),
        "offset": list(range(10, 10 + len(values))),
        "timestamp": [stamp] * len(values),
        "timestampType": [0] * len(values),
    }
    if headers:
        columns["headers"] = [[{"key": "h", "value": b"1"}] for _ in values]
    return pa.RecordBatch.from_pydict(columns)


def _mapper(handler: Any, **options: Any) -> RecordMapper:
    settings: dict[str, Any] = {
        "output": "out",
        "dlq": True,
        "max_attempts": 3,
        "backoff": None,
        "not_retryable": (),
        "serializer": None,
        "group_id": None,
        **options,
    }
    return RecordMapper(handler=handler, name="h", **settings)


def _rows(mapper: RecordMapper, *batches: Any) -> list[dict[str, Any]]:
    return [row for out in mapper(iter(batches)) for row in out.to_pylist()]


def test_every_return_form_becomes_a_sink_row_with_the_record_as_the_handler_sees_it() -> None:
    seen: list[Record] = []

    def handle(record: Record) -> Any:
        seen.append(record)
        return [record.value, (b"key", "text"), Output(b"o", topic="other", headers={"x": "y"}, partition=2), None]

    rows = _rows(_mapper(handle), _batch([b"a"]))
    assert rows == [
        {"topic": "out", "key": None, "value": b"a", "headers": None, "partition": None},
        {"topic": "out", "key": b"key", "value": b"text", "headers": None, "partition": None},
        {"topic": "other", "key": None, "value": b"o", "headers": [{"key": "x", "value": b"y"}], "partition": 2},
    ]
    (record,) = seen
    assert (record.topic, record.partition, record.offset, record.key, record.attempt) == ("in", 1, 10, b"k0", 1)
    assert record.headers == [("h", b"1")] and record.timestamp == 1767225600000
    assert record.timestamp_type == "CreateTime"


def test_a_failing_record_is_retried_in_place_then_dead_lettered_with_its_bytes_and_springs_headers() -> None:
    attempts: list[int] = []

    def handle(record: Record) -> Any:
        attempts.append(record.attempt)
        if record.value == b"bad":
            raise RuntimeError("always")
        if record.attempt < 2:
            raise TimeoutError("once")
        return record.value

    rows = _rows(_mapper(handle, group_id="g"), _batch([b"good", b"bad"], headers=False))
    assert attempts == [1, 2, 1, 2, 3], "good: retried once; bad: max_attempts=3 calls"
    assert rows[0] == {"topic": "out", "key": None, "value": b"good", "headers": None, "partition": None}
    letter = rows[1]
    assert (letter["topic"], letter["key"], letter["value"]) == ("in-dlt", b"k1", b"bad")
    info = parse_dead_letter_headers([(h["key"], h["value"]) for h in letter["headers"]])
    assert (info.original_topic, info.original_partition, info.original_offset) == ("in", 1, 11)
    assert (info.attempts, info.exception_fqcn, info.consumer_group) == (3, "builtins.RuntimeError", "g")


def test_not_retryable_goes_at_once_and_the_dlq_option_names_the_topic_or_drops() -> None:
    calls: list[int] = []

    def handle(record: Record) -> Any:
        calls.append(record.attempt)
        raise KeyError("no")

    rows = _rows(_mapper(handle, not_retryable=(KeyError,), dlq="letters"), _batch([b"x"]))
    assert calls == [1] and [r["topic"] for r in rows] == ["letters"]
    assert _rows(_mapper(handle, not_retryable=(KeyError,), dlq=False), _batch([b"x"])) == []


def test_an_unencodable_return_type_fails_the_task_instead_of_dead_lettering_every_record() -> None:
    with pytest.raises(InvalidConfigurationError):
        _rows(_mapper(lambda record: 3.5), _batch([b"x"]))


def test_the_sink_writes_rows_to_their_topic_column_without_a_topic_option_and_needs_a_marker_topic_then() -> None:
    from kafkatx.spark._stream_sink import KafkaTxStreamWriter

    servers = {"kafka.bootstrap.servers": "localhost:1"}
    with pytest.raises(InvalidConfigurationError, match="markerTopic"):
        KafkaTxStreamWriter(servers)
    headers = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
    rows = pa.RecordBatch.from_arrays(
        [
            pa.array(["a", "b-dlt"]),
            pa.array(["1", "2"]),  # a string value column, cast to binary as Spark's sink does
            pa.array([None, [{"key": "h", "value": b"x"}]], type=headers),
        ],
        names=["topic", "value", "headers"],
    )
    own = KafkaTxStreamWriter({**servers, "markerTopic": "a"}).write(iter([rows])).batches
    collected = pa.Table.from_batches(own).to_pylist()
    assert [(r["topic"], r["value"], r["headers"]) for r in collected] == [
        ("a", b"1", None),
        ("b-dlt", b"2", [{"key": "h", "value": b"x"}]),
    ]
    overridden = KafkaTxStreamWriter({**servers, "topic": "t"}).write(iter([rows])).batches
    assert "topic" not in overridden[0].schema.names, "as in Spark's sink, the topic option overrides the column"
    without_topic = pa.RecordBatch.from_arrays([pa.array([b"1"])], names=["value"])
    with pytest.raises(InvalidConfigurationError, match="without a topic"):
        KafkaTxStreamWriter({**servers, "markerTopic": "a"}).write(iter([without_topic]))


def test_map_records_names_the_source_columns_a_dataframe_lacks_before_any_task_runs() -> None:
    from kafkatx.spark._map_records import map_records

    class Frame:
        columns = ["value", "topic"]

        def mapInArrow(self, *args: Any) -> None:  # noqa: N802  (pyspark's name)
            raise AssertionError("not reached")

    with pytest.raises(InvalidConfigurationError, match="key, partition, offset missing"):
        map_records(Frame(), lambda record: None, output="out")
    with pytest.raises(ValueError, match="max_attempts"):
        map_records(Frame(), lambda record: None, max_attempts=0)


def test_the_columns_of_sparks_own_kafka_source_are_the_contract_of_the_source_and_of_map_records() -> None:
    """A query moves between Spark's JVM Kafka source (a real cluster) and the "kafkatx" format by changing the
    format's name: the kafkatx source gives the columns Spark's integration guide lists, in its order and types,
    and map_records takes rows of exactly those columns, as Spark hands them to Python (Arrow: 32-bit partition and
    timestampType, microsecond timestamps in the session's time zone)."""
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import (
        ArrayType,
        BinaryType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
        TimestampType,
    )

    from kafkatx.spark._stream_source import source_schema

    documented = [  # "Each row in the source has the following schema" (Structured Streaming + Kafka guide)
        ("key", BinaryType()),
        ("value", BinaryType()),
        ("topic", StringType()),
        ("partition", IntegerType()),
        ("offset", LongType()),
        ("timestamp", TimestampType()),
        ("timestampType", IntegerType()),
    ]
    headers = ("headers", ArrayType(StructType([StructField("key", StringType()), StructField("value", BinaryType())])))
    for include, expected in (("false", documented), ("true", [*documented, headers])):
        schema = source_schema({"includeHeaders": include})
        assert [(f.name, f.dataType) for f in schema.fields] == expected, include

    arrow = to_arrow_schema(source_schema({"includeHeaders": "true"}), timezone="Europe/Paris")
    stamp = datetime.datetime(2026, 1, 1, 12, tzinfo=datetime.timezone.utc)
    jvm_rows = pa.RecordBatch.from_pylist(
        [
            {
                "key": b"k",
                "value": b"v",
                "topic": "in",
                "partition": 3,
                "offset": 7,
                "timestamp": stamp,
                "timestampType": 1,
                "headers": [{"key": "h", "value": b"1"}],
            }
        ],
        schema=arrow,
    )
    assert jvm_rows.schema.field("partition").type == pa.int32() and jvm_rows.schema.field("timestamp").type.tz
    seen: list[Record] = []
    rows = _rows(_mapper(lambda record: seen.append(record) or record.value), jvm_rows)
    [record] = seen
    assert (record.topic, record.partition, record.offset, record.key, record.value) == ("in", 3, 7, b"k", b"v")
    assert record.timestamp == int(stamp.timestamp() * 1000) and record.timestamp_type == "LogAppendTime"
    assert record.headers == [("h", b"1")]
    assert [(r["topic"], r["value"]) for r in rows] == [("out", b"v")]
