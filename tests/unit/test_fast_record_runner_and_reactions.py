"""The record runner and the Kafka-error reactions over a fake host (no broker)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, Message
from fakes import FakeHost, FakeProducer, listener, messages

from kafkatx import Output, Record
from kafkatx.errors import ApplicationRecoverableError, InvalidConfigurationError, KafkaTxError
from kafkatx.events import TransactionCommitted

IN = ("in", 0)


@pytest.mark.parametrize("fast", [False, True], ids=["produce", "direct"])
def test_a_batch_is_handled_and_committed_in_one_transaction(fast: bool) -> None:
    def handle(record: Record) -> Any:
        if record.value == b"pair":
            return (b"k", b"pair!")
        if record.value == b"output":
            return Output(b"output!", topic="other")
        return (record.value or b"").upper()

    host = FakeHost(listener(handle), FakeProducer(fast=fast))
    host.runner()(host.unit(messages(b"a", b"pair", b"output", b"b")))
    (txn,) = host.producer.transactions
    assert txn.outcome == "committed"
    assert txn.produced == [("out", b"A"), ("out", b"pair!"), ("other", b"output!"), ("out", b"B")]
    assert txn.offsets == {IN: 4}
    (event,) = host.events_of(TransactionCommitted)
    assert (event.records, event.outputs) == (4, 4)


def test_records_of_several_partitions_commit_each_partitions_next_offset() -> None:
    host = FakeHost(listener(lambda r: r.value))
    host.assigned.add(("in", 1))
    batch = messages(b"a", b"b", start=5) + messages(b"c", partition=1, start=9)
    host.runner()(host.unit(batch))
    assert host.producer.committed_offsets == {IN: 7, ("in", 1): 10}


def test_a_failure_isolates_the_record_its_batch_mates_commit_without_it() -> None:
    recovered: list[int] = []

    def handle(record: Record) -> bytes:
        if record.value == b"poison":
            raise ValueError("poison")
        return record.value or b""

    host = FakeHost(listener(handle, max_attempts=1, dlq=lambda r, e: recovered.append(r.offset)))
    host.runner()(host.unit(messages(b"a", b"poison", b"c", b"d")))
    assert recovered == [1]
    assert host.producer.committed_values == [b"a", b"c", b"d"]
    assert host.producer.committed_offsets == {IN: 4}


def test_the_transaction_time_budget_splits_a_poll_and_rewinds_the_rest() -> None:
    host = FakeHost(listener(lambda r: r.value))
    host.transaction_budget = 0.0
    host.runner()(host.unit(messages(b"a", b"b", b"c")))
    assert host.producer.committed_offsets == {IN: 1}, "the budget is checked from the second record on"
    assert host.seeks == [(IN, 1)], "the rest is fetched again for the next transaction"


# -- the reactions that outlive a unit ------------------------------------------------------------


def test_rewind_to_committed_seeks_owned_partitions_to_their_committed_offsets_or_the_batch_start() -> None:
    host = FakeHost(listener(lambda r: None))
    host.assigned.add(("in", 1))
    host.fake_consumer.committed_offsets[IN] = 3
    batch = messages(b"a", start=4) + messages(b"b", partition=1, start=8) + messages(b"c", partition=2, start=1)
    host.reactions.rewind_to_committed(batch)
    assert host.seeks == [(IN, 3), (("in", 1), 8)], "no commit yet: the batch start; not owned: left alone"


def test_a_fenced_producer_in_partition_mode_holds_the_partition_for_the_fence_hold() -> None:
    host = FakeHost(listener(lambda r: None, fencing="partition"))
    fenced = ApplicationRecoverableError("fenced", error=KafkaError(KafkaError._FENCED))
    host.reactions.recreate_producer(host.producer, fenced, messages(b"a"))
    assert host.producer.discarded == 1 and host.pauses == {IN: host.fence_hold}


def _consumer_error(code: int, reason: str = "") -> Message:
    return Message(topic="in", partition=0, error=KafkaError(code, reason) if reason else KafkaError(code))


def test_another_process_with_the_same_instance_id_stops_the_container_with_a_clear_error() -> None:
    host = FakeHost(listener(lambda r: None))
    with pytest.raises(InvalidConfigurationError, match="'fake-instance'"):
        host.error_reactions.consumer_error(_consumer_error(KafkaError.FENCED_INSTANCE_ID))


def test_a_missing_input_topic_stops_the_container_and_an_end_of_partition_is_no_error() -> None:
    host = FakeHost(listener(lambda r: None))
    host.error_reactions.consumer_error(_consumer_error(KafkaError._PARTITION_EOF))
    with pytest.raises(InvalidConfigurationError, match="does not exist"):
        host.error_reactions.consumer_error(_consumer_error(KafkaError.UNKNOWN_TOPIC_OR_PART))


def test_a_retriable_consumer_error_is_left_to_librdkafka_and_a_fatal_one_stops_the_container() -> None:
    host = FakeHost(listener(lambda r: None))
    host.error_reactions.consumer_error(_consumer_error(KafkaError._TRANSPORT, "broker down"))
    fatal = Message(topic="in", partition=0, error=KafkaError(KafkaError._FATAL, "fatal", fatal=True))
    with pytest.raises(KafkaTxError):
        host.error_reactions.consumer_error(fatal)


def test_a_missing_input_topic_names_the_closest_existing_one() -> None:
    host = FakeHost(listener(lambda r: None))

    class _Cluster:
        def list_topics(self, timeout: float = -1) -> Any:
            return SimpleNamespace(topics={"orders": None, "payments": None, "__consumer_offsets": None})

    host.consumer = _Cluster()  # type: ignore[assignment]
    error = Message(topic="order", partition=0, error=KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
    with pytest.raises(InvalidConfigurationError, match=r"input topic 'order' does not exist.*did you mean 'orders'\?"):
        host.error_reactions.consumer_error(error)
