"""Retry topics' layout and hop headers (kafkatx/retry_topics/): pure rules, no broker.

The layout decides which topic a record waits in for its n-th retry (one topic per delay, Spring's names),
and the hop headers must read back as the input record, byte for byte, with the attempt and due time, in the
encodings Spring writes so that Java services can share the topics.
"""

from __future__ import annotations

import struct

import pytest
import tenacity

from kafkatx import Record
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.retry_topics import RetryTopicPlan, hop_headers, parse_hop
from kafkatx.retry_topics.headers import ATTEMPTS, BACKOFF_TIMESTAMP, ORIGINAL_TIMESTAMP
from kafkatx.rollback.policy import FailurePolicy


def plan(**options: object) -> RetryTopicPlan:
    return RetryTopicPlan(FailurePolicy(**options))  # type: ignore[arg-type]


def test_a_fixed_back_off_waits_in_one_topic_named_as_spring_names_it() -> None:
    p = plan(max_attempts=4, backoff=1.5)
    assert p.topics("orders") == ("orders-retry",)
    assert [p.level_for(n) for n in (1, 2, 3)] == [p.by_retry[0]] * 3
    assert p.by_retry[0].delay == 1.5
    assert p.level_for(4) is None, "the last attempt has no retry left: it is recovered"


def test_a_growing_back_off_has_a_topic_per_delay_and_shares_the_capped_one() -> None:
    p = plan(max_attempts=5, backoff=tenacity.wait_exponential(multiplier=1, max=4))
    assert p.topics("orders") == ("orders-retry-1000", "orders-retry-2000", "orders-retry-4000")
    assert [level.suffix for level in p.by_retry] == ["-retry-1000", "-retry-2000", "-retry-4000", "-retry-4000"]
    assert [level.delay for level in p.by_retry] == [1.0, 2.0, 4.0, 4.0]


def test_a_random_back_off_has_a_topic_per_attempt() -> None:
    p = plan(max_attempts=3, backoff=tenacity.wait_random(0, 1))
    assert p.topics("orders") == ("orders-retry-0", "orders-retry-1")


def test_no_retry_no_topic() -> None:
    assert plan(max_attempts=1).topics("orders") == ()


def test_a_retry_topic_is_traced_back_to_its_input_topic_and_nothing_else_is() -> None:
    p = plan(max_attempts=3, backoff=tenacity.wait_exponential(multiplier=1))
    inputs = ("orders", "orders-eu")
    assert p.origin_of("orders-retry-1000", inputs) == "orders"
    assert p.origin_of("orders-eu-retry-2000", inputs) == "orders-eu"
    assert p.origin_of("orders-retry-3000", inputs) is None
    assert p.origin_of("orders-dlt", inputs) is None


def _input_record() -> Record:
    return Record(
        "orders", 3, 1234, b"k", b"v", [("trace", b"t1"), ("x", b"")], 1_700_000_000_123, "CreateTime", attempt=1
    )


def test_a_hop_reads_back_as_the_input_record_with_the_next_attempt_and_its_due_time() -> None:
    record = _input_record()
    headers = hop_headers(record, ValueError("boom"), group_id="g", next_attempt=2, due_ms=1_700_000_005_000)
    consumed = Record("orders-retry", 3, 7, b"k", b"v", headers, 1_700_000_001_000, "CreateTime")
    hop = parse_hop(consumed)
    assert hop is not None
    assert hop.due_ms == 1_700_000_005_000
    assert hop.record == Record(
        "orders", 3, 1234, b"k", b"v", [("trace", b"t1"), ("x", b"")], 1_700_000_000_123, "CreateTime", attempt=2
    ), "the handler sees the input record: its coordinates, timestamp and own headers only"


def test_a_second_hop_still_names_the_input_record_and_its_last_failure() -> None:
    first = hop_headers(_input_record(), ValueError("one"), group_id="g", next_attempt=2, due_ms=5)
    again = parse_hop(Record("orders-retry", 3, 7, b"k", b"v", first, 99))
    assert again is not None
    second = hop_headers(again.record, KeyError("two"), group_id="g", next_attempt=3, due_ms=9)
    info = parse_dead_letter_headers(second)
    assert (info.original_topic, info.original_partition, info.original_offset) == ("orders", 3, 1234)
    assert info.exception_fqcn == "builtins.KeyError"
    assert [k for k, _ in second].count(ATTEMPTS) == 1, "a hop replaces the retry headers, it does not pile them"
    last = parse_hop(Record("orders-retry", 3, 8, b"k", b"v", second, 100))
    assert last is not None and last.record.attempt == 3 and last.due_ms == 9


def test_the_retry_headers_use_springs_encodings() -> None:
    headers = dict(
        hop_headers(_input_record(), ValueError("x"), group_id=None, next_attempt=2, due_ms=1_786_864_805_192)
    )
    assert headers[ATTEMPTS] == struct.pack(">i", 2)
    # Java's BigInteger.toByteArray(): as few big-endian bytes as the value needs (6 for epoch milliseconds today).
    assert headers[BACKOFF_TIMESTAMP] == bytes.fromhex("01A009712548")
    assert int.from_bytes(headers[ORIGINAL_TIMESTAMP], "big", signed=True) == 1_700_000_000_123


@pytest.mark.parametrize("raw", [bytes.fromhex("01A009712548"), struct.pack(">q", 1_786_864_805_192)])
def test_a_due_time_written_by_java_reads_in_either_length(raw: bytes) -> None:
    headers = hop_headers(_input_record(), ValueError("x"), group_id=None, next_attempt=2, due_ms=0)
    headers = [(k, raw if k == BACKOFF_TIMESTAMP else v) for k, v in headers]
    hop = parse_hop(Record("orders-retry", 3, 7, b"k", b"v", headers, 0))
    assert hop is not None and hop.due_ms == 1_786_864_805_192


def test_a_record_without_hop_headers_is_not_a_hop() -> None:
    assert parse_hop(_input_record()) is None
