"""KIP-890's safety where librdkafka lacks it: an abort that may leave a produce request in flight replaces the
producer, so that the next transaction has a new epoch and a late request cannot land in it."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError

import kafkatx.client.producer as producer_module
from kafkatx.client.producer import TransactionalProducer


class _StubProducer:
    """confluent-kafka's Producer, answering at once; ``undelivered``: what flush() says is still in flight."""

    made: list[_StubProducer] = []

    def __init__(self, config: Any = None) -> None:
        self.undelivered = 0
        _StubProducer.made.append(self)

    def init_transactions(self, *args: Any) -> None:
        pass

    def begin_transaction(self, *args: Any) -> None:
        pass

    def abort_transaction(self, *args: Any) -> None:
        pass

    def flush(self, *args: Any) -> int:
        return self.undelivered

    def purge(self, *args: Any) -> None:
        pass

    def close(self, *args: Any) -> None:
        pass

    def poll(self, *args: Any) -> int:
        return 0


@pytest.fixture
def producer(monkeypatch: pytest.MonkeyPatch) -> TransactionalProducer:
    _StubProducer.made.clear()
    monkeypatch.setattr(producer_module, "Producer", _StubProducer)
    made = TransactionalProducer({"transactional.id": "t"}, "t", retry_timeout=2.0)
    made.ensure()
    return made


def test_an_abort_with_records_still_in_flight_makes_the_next_transaction_use_a_new_producer(
    producer: TransactionalProducer,
) -> None:
    producer.begin()
    _StubProducer.made[0].undelivered = 1  # flush() could not wait them out: a request may still land
    producer.abort()
    producer.begin()
    assert len(_StubProducer.made) == 2, "a new producer (a new epoch) for the next transaction"


def test_an_abort_after_a_record_timed_out_makes_the_next_transaction_use_a_new_producer(
    producer: TransactionalProducer,
) -> None:
    producer.begin()
    producer._delivery_failures.append((KafkaError(KafkaError._MSG_TIMED_OUT), "out", 0))
    producer.abort()
    producer.begin()
    assert len(_StubProducer.made) == 2


def test_an_abort_with_everything_answered_keeps_the_producer(producer: TransactionalProducer) -> None:
    producer.begin()
    producer.abort()
    producer.begin()
    assert len(_StubProducer.made) == 1, "no replacement (an init_transactions round trip) when none is needed"
