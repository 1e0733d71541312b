"""Kafka records to an Arrow table (the handler's input), and Arrow rows back to records.

Arrow, not Python tuples: ``spark.createDataFrame(pa.Table)`` and
``df.toArrow()`` are the cheapest way across the Python/JVM boundary
(about half the per-batch cost of a list of tuples, see docs/SPARK.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from kafkatx.outputs import PendingOutput
from kafkatx.record import ConsumedMessage
from kafkatx.spark._errors import SparkOutputError

__all__ = ["INPUT_SCHEMA", "messages_to_table", "table_to_outputs", "OUTPUT_COLUMNS"]

HEADER_TYPE = pa.list_(pa.struct([("name", pa.string()), ("value", pa.binary())]))

#: The columns of the DataFrame a Spark handler receives.
INPUT_SCHEMA = pa.schema(
    [
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", pa.timestamp("ms", tz="UTC")),
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("headers", HEADER_TYPE),
    ]
)

#: The columns kafkatx reads from a returned DataFrame; others are ignored (as Spark's Kafka sink does).
OUTPUT_COLUMNS = ("value", "key", "topic", "partition", "headers")


def messages_to_table(msgs: Sequence[ConsumedMessage]) -> pa.Table:
    """The input table of a batch, one row per message, in batch order."""
    n = len(msgs)
    topics: list[str] = [""] * n
    partitions: list[int] = [0] * n
    offsets: list[int] = [0] * n
    timestamps: list[int | None] = [None] * n
    keys: list[bytes | None] = [None] * n
    values: list[bytes | None] = [None] * n
    headers: list[list[dict[str, Any]] | None] = [None] * n
    for i, m in enumerate(msgs):
        topics[i] = m.topic()
        partitions[i] = m.partition()
        offsets[i] = m.offset()
        ts_type, ts = m.timestamp()
        if ts_type != 0 and ts >= 0:  # 0 = TIMESTAMP_NOT_AVAILABLE
            timestamps[i] = ts
        keys[i] = m.key()
        values[i] = m.value()
        hs = m.headers()
        if hs:
            headers[i] = [{"name": k, "value": v} for k, v in hs]
    return pa.Table.from_arrays(
        [
            pa.array(topics, pa.string()),
            pa.array(partitions, pa.int32()),
            pa.array(offsets, pa.int64()),
            pa.array(timestamps, pa.timestamp("ms", tz="UTC")),
            pa.array(keys, pa.binary()),
            pa.array(values, pa.binary()),
            pa.array(headers, HEADER_TYPE),
        ],
        schema=INPUT_SCHEMA,
    )


def _is_text_or_binary(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_null(t)
    )


def _bytes_column(table: pa.Table, name: str, listener: str) -> list[bytes | None] | None:
    if name not in table.column_names:
        return None
    col = table.column(name)
    if not _is_text_or_binary(col.type):
        raise SparkOutputError(
            f"spark listener {listener!r}: output column {name!r} has type {col.type}; it must be a string or "
            f"binary column (cast it, e.g. F.col({name!r}).cast('string'), or F.to_json(...))",
            data_independent=True,
        )
    return [v.encode("utf-8") if isinstance(v, str) else v for v in col.to_pylist()]


def _headers_column(table: pa.Table, listener: str) -> list[list[tuple[str, bytes]] | None] | None:
    if "headers" not in table.column_names:
        return None
    col = table.column("headers")
    t = col.type
    ok = pa.types.is_null(t)
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_struct(t.value_type):
        fields = {t.value_type.field(i).name: t.value_type.field(i).type for i in range(t.value_type.num_fields)}
        name_field = "name" if "name" in fields else "key" if "key" in fields else None
        ok = (
            name_field is not None
            and "value" in fields
            and (pa.types.is_string(fields[name_field]) or pa.types.is_large_string(fields[name_field]))
            and _is_text_or_binary(fields["value"])
        )
    if not ok:
        raise SparkOutputError(
            f"spark listener {listener!r}: output column 'headers' has type {t}; it must be "
            "array<struct<name: string, value: binary or string>> (the input's headers column has that type)",
            data_independent=True,
        )
    out: list[list[tuple[str, bytes]] | None] = []
    for row in col.to_pylist():
        if row is None:
            out.append(None)
            continue
        hs = []
        for h in row:
            if h is None:
                continue
            name = h.get("name", h.get("key"))
            if name is None:
                raise SparkOutputError(f"spark listener {listener!r}: an output header has a null name")
            value = h["value"]
            hs.append((name, value.encode("utf-8") if isinstance(value, str) else value))
        out.append(hs)
    return out


def table_to_outputs(table: pa.Table, default_topic: str | None, listener: str) -> list[PendingOutput]:
    """Encode the rows of a handler's result; a wrong schema is a :class:`SparkOutputError`."""
    names = table.column_names
    if "value" not in names:
        raise SparkOutputError(
            f"spark listener {listener!r} returned a DataFrame without a 'value' column (columns: "
            f"{', '.join(names) or 'none'}); select or alias one, e.g. df.select(F.col('word').alias('key'), "
            "F.col('count').cast('string').alias('value')). Return None to produce nothing.",
            data_independent=True,
        )
    n = table.num_rows
    values = _bytes_column(table, "value", listener)
    keys = _bytes_column(table, "key", listener)
    headers = _headers_column(table, listener)
    topics: list[str | None] | None = None
    if "topic" in names:
        col = table.column("topic")
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_null(col.type)):
            raise SparkOutputError(
                f"spark listener {listener!r}: output column 'topic' has type {col.type}; it must be a string",
                data_independent=True,
            )
        topics = col.to_pylist()
    partitions: list[int | None] | None = None
    if "partition" in names:
        col = table.column("partition")
        if not (pa.types.is_integer(col.type) or pa.types.is_null(col.type)):
            raise SparkOutputError(
                f"spark listener {listener!r}: output column 'partition' has type {col.type}; it must be an integer",
                data_independent=True,
            )
        partitions = col.to_pylist()
    if n and topics is None and default_topic is None:
        raise SparkOutputError(
            f"spark listener {listener!r} returned rows but has no output topic: declare output= on the "
            "listener, or add a 'topic' column",
            data_independent=True,
        )
    out: list[PendingOutput] = []
    assert values is not None
    for i in range(n):
        topic = topics[i] if topics is not None and topics[i] is not None else default_topic
        if topic is None:
            raise SparkOutputError(
                f"spark listener {listener!r}: an output row has a null 'topic' and the listener has no output topic"
            )
        partition = partitions[i] if partitions is not None else None
        if partition is not None and partition < 0:
            raise SparkOutputError(f"spark listener {listener!r}: output partition must be >= 0, got {partition}")
        out.append(
            (
                topic,
                values[i],
                keys[i] if keys is not None else None,
                headers[i] if headers is not None else None,
                partition,
            )
        )
    return out
