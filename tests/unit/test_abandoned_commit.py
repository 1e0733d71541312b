"""A commit kafkatx abandoned stays abandoned (issue 42, item 13).

kafkatx hands ``send_offsets_to_transaction`` and ``commit_transaction`` to a helper thread as one job. When the
first ignores its timeout, kafkatx abandons the producer, starts a new one with the same transactional.id and redoes
the batch from the committed offsets. The abandoned job must not go on to ``commit_transaction`` once its stuck call
returns: on Apache Kafka the new producer has fenced the old one and that commit fails, but a broker that gave the
new producer another producer id (the embedded broker after a restart, docs/BROKERS.md) would let the old producer
commit the batch the new one redoes, and its stale offsets with it. Seen on the embedded broker: the abandoned
producer's commit_transaction under way more than 30 s after kafkatx had given it up.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from confluent_kafka import TopicPartition

import kafkatx.client.producer as producer_module
from kafkatx.client.bounded import StuckCallError
from kafkatx.client.producer import TransactionalProducer
from kafkatx.testing import wait_for


class _StuckOffsetsProducer:
    """confluent-kafka's Producer whose send_offsets_to_transaction blocks until ``release`` is set."""

    made: list[_StuckOffsetsProducer] = []

    def __init__(self, config: Any = None) -> None:
        self.release = threading.Event()
        self.offsets_returned = threading.Event()
        self.calls: list[str] = []
        _StuckOffsetsProducer.made.append(self)

    def init_transactions(self, *args: Any) -> None:
        self.calls.append("init_transactions")

    def begin_transaction(self, *args: Any) -> None:
        self.calls.append("begin_transaction")

    def send_offsets_to_transaction(self, *args: Any) -> None:
        self.calls.append("send_offsets_to_transaction")
        self.release.wait(30)
        self.offsets_returned.set()

    def commit_transaction(self, *args: Any) -> None:
        self.calls.append("commit_transaction")

    def abort_transaction(self, *args: Any) -> None:
        self.calls.append("abort_transaction")

    def flush(self, *args: Any) -> int:
        return 0

    def purge(self, *args: Any) -> None:
        self.calls.append("purge")

    def close(self, *args: Any) -> None:
        pass

    def poll(self, *args: Any) -> int:
        return 0

    def list_topics(self, *args: Any, **kwargs: Any) -> None:
        pass


def test_an_abandoned_commit_is_not_made_when_its_stuck_call_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    _StuckOffsetsProducer.made.clear()
    monkeypatch.setattr(producer_module, "Producer", _StuckOffsetsProducer)
    monkeypatch.setattr(producer_module, "COMMIT_DEADLINE_MARGIN_S", 0.2)  # abandoned after 2 x 0.5 s + 0.2 s
    producer = TransactionalProducer({"transactional.id": "t"}, "t", retry_timeout=2.0)
    producer.begin()
    producer.send_offsets([TopicPartition("in", 0, 200)], object())
    with pytest.raises(StuckCallError):
        producer.commit()
    stuck = [t for t in threading.enumerate() if t.name == "kafkatx-call-t"]  # the thread running the abandoned job
    assert len(stuck) == 1
    producer.discard()  # what the container does next: a new producer takes over the id
    producer.begin()
    old, new = _StuckOffsetsProducer.made
    assert new is not old and new.calls == ["init_transactions", "begin_transaction"]

    old.release.set()  # the stuck call returns at last
    wait_for(old.offsets_returned.is_set, 10, message="the abandoned call returned")
    stuck[0].join(10)  # it ends once the abandoned job is done
    assert not stuck[0].is_alive()
    assert "commit_transaction" not in old.calls, f"the abandoned producer committed: {old.calls}"
