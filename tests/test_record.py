"""Record: the container's lazy records behave exactly like plain ones (pure logic, no broker)."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
from confluent_kafka import Message

from kafkatx import Record
from kafkatx.record import to_record


def message() -> Message:
    return Message(
        topic="orders",
        partition=3,
        offset=42,
        key=b"k",
        value=b"v",
        headers=[("h", b"1"), ("h", b"2")],
        timestamp=(2, 1_700_000_000_000),
    )


PLAIN = Record("orders", 3, 42, b"k", b"v", [("h", b"1"), ("h", b"2")], 1_700_000_000_000, "LogAppendTime", 2)


def test_a_record_over_a_message_reads_every_field() -> None:
    record = to_record(message(), attempt=2)
    assert isinstance(record, Record)
    assert (record.topic, record.partition, record.offset, record.attempt) == ("orders", 3, 42, 2)
    assert (record.key, record.value, record.timestamp, record.timestamp_type) == (
        b"k",
        b"v",
        1_700_000_000_000,
        "LogAppendTime",
    )
    assert record.headers == [("h", b"1"), ("h", b"2")]
    assert record.header("h") == b"2" and record.header("x", b"d") == b"d"
    assert record.coordinates == "orders/3@42"


def test_it_compares_prints_copies_and_pickles_as_a_plain_record() -> None:
    record = to_record(message(), attempt=2)
    assert record == PLAIN and PLAIN == record and record != dataclasses.replace(PLAIN, offset=43)
    assert repr(record) == repr(PLAIN)
    for clone in (dataclasses.replace(record), copy.copy(record), pickle.loads(pickle.dumps(record))):
        assert type(clone) is Record and clone == PLAIN
    again = dataclasses.replace(record, attempt=3)
    assert type(again) is Record and again.attempt == 3 and again.value == b"v"
    with pytest.raises(TypeError):
        hash(record)


def test_its_message_views_are_read_only_and_its_stored_fields_behave_as_a_plain_records() -> None:
    record = to_record(message())
    with pytest.raises(AttributeError):
        record.headers = []  # type: ignore[misc]
    with pytest.raises(AttributeError):
        record.timestamp = 0  # type: ignore[misc]
    record.attempt = 5  # the container's own field stays writable, as on a plain Record
    record.value = b"changed"  # key and value are stored fields (read once from the Message), as on a plain Record
    assert (record.attempt, record.value) == (5, b"changed")
    assert record == Record(
        record.topic,
        record.partition,
        record.offset,
        record.key,
        b"changed",
        record.headers,
        record.timestamp,
        record.timestamp_type,
        5,
    )


def test_a_message_without_headers_or_timestamp() -> None:
    record = to_record(Message(topic="t", partition=0, offset=0, value=None))
    assert record.headers == [] and record.value is None and record.key is None
    assert record.timestamp_type in ("NoTimestampType", "CreateTime")
