"""Canary: the broker under test keeps the transactional promises kafkatx relies on.

If one of these fails, kafkatx's other tests cannot be trusted on that broker.
"""

from __future__ import annotations

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from kafkatx.testing import KafkaTestKit, unique_name


def _txn_producer(bootstrap: str, txn_id: str) -> Producer:
    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": txn_id, "log_level": 3})
    p.init_transactions(10)
    return p


def test_aborted_transaction_hidden_from_read_committed(kafka: KafkaTestKit) -> None:
    topic = kafka.topic(partitions=2)
    p = _txn_producer(kafka.bootstrap_servers, unique_name("txn"))
    p.begin_transaction()
    for i in range(4):
        p.produce(topic, b"aborted-%d" % i, partition=i % 2)
    assert p.flush(10) == 0  # abort_transaction purges unsent records; make them reach the log
    p.abort_transaction(10)
    p.begin_transaction()
    for i in range(4):
        p.produce(topic, b"committed-%d" % i, partition=i % 2)
    p.commit_transaction(10)

    committed = sorted(kafka.values(topic, isolation="read_committed"))
    uncommitted = sorted(kafka.values(topic, isolation="read_uncommitted"))
    assert committed == sorted(b"committed-%d" % i for i in range(4))
    assert uncommitted == sorted([b"aborted-%d" % i for i in range(4)] + [b"committed-%d" % i for i in range(4)])


def test_send_offsets_stored_on_commit_only(kafka: KafkaTestKit) -> None:
    topic = kafka.topic()
    group = unique_name("grp")
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": group, "log_level": 3})
    try:
        p = _txn_producer(kafka.bootstrap_servers, unique_name("txn"))
        p.begin_transaction()
        p.send_offsets_to_transaction([TopicPartition(topic, 0, 7)], consumer.consumer_group_metadata(), 10)
        p.abort_transaction(10)
        assert kafka.committed(group, topic) == {}

        p.begin_transaction()
        p.send_offsets_to_transaction([TopicPartition(topic, 0, 11)], consumer.consumer_group_metadata(), 10)
        p.commit_transaction(10)
        assert kafka.committed(group, topic) == {0: 11}
    finally:
        consumer.close()


def test_same_transactional_id_fences_the_first_producer(kafka: KafkaTestKit) -> None:
    topic = kafka.topic()
    txn_id = unique_name("txn")
    zombie = _txn_producer(kafka.bootstrap_servers, txn_id)
    zombie.begin_transaction()
    zombie.produce(topic, b"zombie")
    zombie.flush(10)

    successor = _txn_producer(kafka.bootstrap_servers, txn_id)  # aborts the zombie's open transaction
    successor.begin_transaction()
    successor.produce(topic, b"successor")
    successor.commit_transaction(10)

    with pytest.raises(KafkaException) as info:
        zombie.commit_transaction(10)
    err: KafkaError = info.value.args[0]
    assert err.fatal(), err
    assert err.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH), err
    assert kafka.values(topic) == [b"successor"]


def test_live_read_committed_consumer_sees_commits_after_an_abort(request: pytest.FixtureRequest, kafka: KafkaTestKit) -> None:
    """A consumer that is caught up while a producer aborts must still get the later commits.

    noida-db 0.2.3 fails this: after an aborted transaction whose records
    reached the log, a live read_committed consumer skips every later
    committed record of the same producer (its position moves to the end),
    while a fresh reader sees them. Real Kafka passes. Consequence: on the
    local broker, do not chain a read_committed consumer behind a
    transactional producer that aborts; read outputs with a fresh reader.
    """
    import threading
    import time

    if not request.config.getoption("--kafka-bootstrap"):
        request.applymarker(pytest.mark.xfail(strict=True, reason="noida-db 0.2.3: live read_committed skips after aborts"))
    topic = kafka.topic()
    consumer = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": unique_name("live"), "log_level": 3,
                         "isolation.level": "read_committed", "auto.offset.reset": "earliest"})  # fmt: skip
    consumer.subscribe([topic])
    got: list[bytes] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            got.extend(m.value() for m in consumer.consume(100, 0.1) if m.error() is None)

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        time.sleep(1.5)  # joined and caught up
        p = _txn_producer(kafka.bootstrap_servers, unique_name("txn"))
        for i, action in enumerate(["commit", "abort", "commit"]):
            p.begin_transaction()
            p.produce(topic, f"{action}-{i}".encode())
            p.flush(10)
            p.commit_transaction(10) if action == "commit" else p.abort_transaction(10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(got) < 2:
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join()
        consumer.close()
    assert got == [b"commit-0", b"commit-2"]
