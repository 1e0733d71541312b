"""A batch's cheap clean path (issue 41): records refilled only where nothing else holds them, offsets read once
per partition run, a list of bytes produced without a pending tuple each, in order, refusals falling back."""

from __future__ import annotations

from typing import Any

from confluent_kafka import KafkaException, Message

from kafkatx.listener.runners.batch_outputs import bytes_values, produce_values
from kafkatx.listener.runners.batch_runner import _next_offsets
from kafkatx.record import UNSHARED_REFCOUNT, MessageRecord, Record, message_records


def _msgs(coords: list[tuple[str, int, int]]) -> list[Any]:
    return [Message(topic=t, partition=p, offset=o, key=b"k%d" % o, value=b"v%d" % o) for t, p, o in coords]


def test_records_are_at_attempt_one_over_their_messages() -> None:
    records = message_records(_msgs([("a", 0, 5), ("b", 1, 7)]))
    assert [(r.topic, r.partition, r.offset, r.key, r.value, r.attempt) for r in records] == [
        ("a", 0, 5, b"k5", b"v5", 1),
        ("b", 1, 7, b"k7", b"v7", 1),
    ]
    assert all(type(r) is MessageRecord for r in records)


def test_a_spare_record_is_refilled_only_when_nothing_else_holds_it() -> None:
    first = message_records(_msgs([("a", 0, o) for o in range(6)]))
    kept, kept_list = first[1], first[3:5]
    first[2] = Record("a", 0, 2, None, b"replaced")  # a plain Record (a retried one) has no Message to refill
    second = message_records(_msgs([("a", 0, o) for o in range(100, 106)]), first)
    assert (kept.offset, kept.value) == (1, b"v1"), "a record the handler kept is never changed"
    assert [(r.offset, r.value) for r in kept_list] == [(3, b"v3"), (4, b"v4")], "nor a kept list's"
    assert [r.offset for r in second] == list(range(100, 106))
    reused = [i for i, (old, new) in enumerate(zip(first, second)) if old is new]
    assert reused == ([0, 5] if UNSHARED_REFCOUNT > 0 else []), "only the records nothing else held are reused"


def test_the_next_offsets_are_the_last_of_each_partitions_runs() -> None:
    records = message_records(_msgs([("a", 0, 1), ("a", 0, 2), ("a", 1, 9), ("b", 0, 4), ("a", 0, 3), ("a", 1, 8)]))
    assert _next_offsets(records) == {("a", 0): 4, ("a", 1): 10, ("b", 0): 5}
    assert _next_offsets([]) == {}


def test_only_a_list_of_bytes_skips_encoding() -> None:
    values = [b"a", b"b"]
    assert bytes_values(values) is values
    assert bytes_values([b"a", "b"]) is None
    assert bytes_values((b"a",)) is None
    assert bytes_values(b"a") is None


def test_values_go_straight_to_the_client_and_a_refused_one_through_the_producer_in_its_place() -> None:
    log: list[tuple[str, Any]] = []

    def fast(topic: str, value: bytes) -> None:
        if value == b"full":
            raise BufferError("queue full")
        if value == b"bad":
            raise KafkaException("refused")
        log.append(("fast", value))

    def produce(out: Any) -> None:
        log.append(("producer", out))

    sent = produce_values([b"1", b"full", b"2", b"bad"], "out", lambda topic: fast, produce)
    assert sent == 2
    assert log == [
        ("fast", b"1"),
        ("producer", ("out", b"full", None, None, None)),
        ("fast", b"2"),
        ("producer", ("out", b"bad", None, None, None)),
    ]
    log.clear()
    assert produce_values([b"1"], "out", lambda topic: None, produce) == 0
    assert log == [("producer", ("out", b"1", None, None, None))]
