"""MockCluster: the ctypes binding itself, and what real confluent_kafka
clients observe when errors are injected (facts for librdkafka 2.16)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import confluent_kafka
import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from kafkatx.testing import MockCluster as LazyMockCluster
from kafkatx.testing import mock_cluster as mock_module
from kafkatx.testing.mock_cluster import ApiKey, MockCluster, MockClusterError, MockRequest

pytestmark = pytest.mark.timeout(30)

# Client logs at CRITICAL and above only: fatal errors are expected here.
_QUIET = {"log_level": 2}


@pytest.fixture
def mc() -> Iterator[MockCluster]:
    cluster = MockCluster()
    try:
        yield cluster
    finally:
        cluster.close()


def txn_producer(mc: MockCluster, **overrides: Any) -> Producer:
    config: dict[str, Any] = {
        "bootstrap.servers": mc.bootstrap_servers,
        "transactional.id": "kafkatx-mock-test",
        "transaction.timeout.ms": 10000,
        "message.timeout.ms": 5000,
        "socket.timeout.ms": 3000,
        "reconnect.backoff.ms": 50,
        "reconnect.backoff.max.ms": 200,
        **_QUIET,
    }
    config.update(overrides)
    return Producer(config)


def started_txn(mc: MockCluster, topic: str, value: bytes = b"v") -> Producer:
    producer = txn_producer(mc)
    producer.init_transactions(5)
    producer.begin_transaction()
    producer.produce(topic, value)
    return producer


def kafka_error(excinfo: pytest.ExceptionInfo[KafkaException]) -> KafkaError:
    err = excinfo.value.args[0]
    assert isinstance(err, KafkaError)
    return err


def consume(mc: MockCluster, topic: str, count: int, timeout: float = 10.0) -> list[Any]:
    consumer = Consumer(
        {
            "bootstrap.servers": mc.bootstrap_servers,
            "group.id": f"g-{topic}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            **_QUIET,
        }
    )
    try:
        consumer.subscribe([topic])
        messages: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(messages) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            messages.append(msg)
        return messages
    finally:
        consumer.close()


# --------------------------------------------------------------------------
# The binding
# --------------------------------------------------------------------------


def test_lazy_export_and_apikey_values() -> None:
    assert LazyMockCluster is MockCluster
    assert ApiKey.PRODUCE == 0
    assert ApiKey.INIT_PRODUCER_ID == 22
    assert ApiKey.END_TXN == 26
    assert ApiKey.TXN_OFFSET_COMMIT == 28


def test_bootstrap_servers_lists_each_broker() -> None:
    with MockCluster(3) as cluster:
        servers = cluster.bootstrap_servers.split(",")
        assert len(servers) == 3
        assert all(s.startswith("127.0.0.1:") and int(s.rsplit(":", 1)[1]) > 0 for s in servers)
        assert cluster.broker_count == 3


def test_create_topic_produce_consume_round_trip(mc: MockCluster) -> None:
    topic = mc.create_topic("round-trip", partitions=2)
    assert topic == "round-trip"
    producer = Producer({"bootstrap.servers": mc.bootstrap_servers, **_QUIET})
    metadata = producer.list_topics(topic, timeout=5).topics[topic]
    assert metadata.error is None
    assert sorted(metadata.partitions) == [0, 1]

    for i in range(4):
        producer.produce(topic, value=f"m{i}".encode(), partition=i % 2)
    assert producer.flush(5) == 0

    started = time.monotonic()
    messages = consume(mc, topic, 4)
    assert sorted(m.value() for m in messages) == [b"m0", b"m1", b"m2", b"m3"]
    assert {m.partition() for m in messages} == {0, 1}
    # initial_rebalance_delay_ms=0 by default: the mock's 3 s join delay is gone.
    assert time.monotonic() - started < 3.0


def test_create_existing_topic_names_the_error(mc: MockCluster) -> None:
    mc.create_topic("dup")
    with pytest.raises(MockClusterError, match="TOPIC_ALREADY_EXISTS"):
        mc.create_topic("dup")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: MockCluster(0), "brokers"),
        (lambda: MockCluster(-1), "brokers"),
        (lambda: MockCluster(initial_rebalance_delay_ms=-5), "initial_rebalance_delay_ms"),
    ],
)
def test_bad_constructor_arguments(call: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_bad_method_arguments(mc: MockCluster) -> None:
    with pytest.raises(ValueError, match="partitions"):
        mc.create_topic("t", partitions=0)
    with pytest.raises(ValueError, match="replication_factor"):
        mc.create_topic("t", replication_factor=0)
    with pytest.raises(ValueError, match="topic name"):
        mc.create_topic("")
    with pytest.raises(ValueError, match="api_key must be an ApiKey or an int, not str"):
        mc.push_request_errors("END_TXN", KafkaError.PRODUCER_FENCED)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="api_key must be between"):
        mc.push_request_errors(-1, KafkaError.PRODUCER_FENCED)
    with pytest.raises(ValueError, match="api_key"):
        mc.clear_request_errors(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one error"):
        mc.push_request_errors(ApiKey.END_TXN)
    with pytest.raises(ValueError, match="KafkaError codes"):
        mc.push_request_errors(ApiKey.END_TXN, "PRODUCER_FENCED")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ms must be >= 0"):
        mc.set_initial_rebalance_delay(-1)


def test_unknown_broker_is_a_mock_cluster_error(mc: MockCluster) -> None:
    with pytest.raises(MockClusterError, match="broker 7"):
        mc.broker_down(7)


def test_use_after_close_raises_and_close_is_idempotent() -> None:
    cluster = MockCluster()
    cluster.close()
    cluster.close()
    assert cluster.closed
    with pytest.raises(MockClusterError, match="closed"):
        _ = cluster.bootstrap_servers
    with pytest.raises(MockClusterError, match="closed"):
        cluster.create_topic("t")
    with pytest.raises(MockClusterError, match="closed"):
        cluster.push_request_errors(ApiKey.END_TXN, KafkaError.PRODUCER_FENCED)
    with pytest.raises(MockClusterError, match="closed"):
        cluster.broker_down()
    with pytest.raises(MockClusterError, match="closed"):
        cluster.requests()
    with pytest.raises(MockClusterError, match="closed"):
        with cluster:
            pass


def test_context_manager_closes() -> None:
    with MockCluster() as cluster:
        assert not cluster.closed
    assert cluster.closed


def test_missing_library_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_pkg = tmp_path / "confluent_kafka"
    fake_pkg.mkdir()
    monkeypatch.setattr(mock_module, "_lib", None)
    monkeypatch.setattr(confluent_kafka, "__file__", str(fake_pkg / "__init__.py"))
    with pytest.raises(MockClusterError, match="cannot find the librdkafka bundled with confluent-kafka"):
        MockCluster()


def test_missing_function_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mock_module, "_lib", None)
    required = dict(mock_module._REQUIRED)
    required["rd_kafka_mock_no_such_function"] = (None, [])
    monkeypatch.setattr(mock_module, "_REQUIRED", required)
    with pytest.raises(MockClusterError, match="no function rd_kafka_mock_no_such_function"):
        MockCluster()


def test_request_tracking_records_requests(mc: MockCluster) -> None:
    assert mc.supports_request_tracking
    topic = mc.create_topic("tracked")
    mc.start_request_tracking()
    producer = Producer({"bootstrap.servers": mc.bootstrap_servers, **_QUIET})
    producer.produce(topic, b"x")
    assert producer.flush(5) == 0

    recorded = mc.requests()
    assert recorded and all(isinstance(r, MockRequest) for r in recorded)
    produce_requests = mc.requests_for(ApiKey.PRODUCE)
    assert len(produce_requests) == 1
    assert produce_requests[0].broker_id == 1
    assert produce_requests[0].api_key is ApiKey.PRODUCE
    assert any(r.api_key == ApiKey.METADATA for r in recorded)

    mc.stop_request_tracking()
    assert mc.requests() == []  # librdkafka discards the record on stop


def test_push_and_clear_request_errors(mc: MockCluster) -> None:
    topic = mc.create_topic("errors")
    mc.start_request_tracking()
    producer = Producer(
        {"bootstrap.servers": mc.bootstrap_servers, "retry.backoff.ms": 10, "retry.backoff.max.ms": 20, **_QUIET}
    )
    # Two retriable errors: the client retries until the third attempt lands.
    mc.push_request_errors(ApiKey.PRODUCE, KafkaError.NOT_ENOUGH_REPLICAS, KafkaError.NOT_ENOUGH_REPLICAS)
    producer.produce(topic, b"a")
    assert producer.flush(5) == 0
    assert len(mc.requests_for(ApiKey.PRODUCE)) == 3

    # Cleared errors never reach the client.
    mc.clear_requests()
    mc.push_request_errors(ApiKey.PRODUCE, *[KafkaError.NOT_ENOUGH_REPLICAS] * 5)
    mc.clear_request_errors(ApiKey.PRODUCE)
    producer.produce(topic, b"b")
    assert producer.flush(5) == 0
    assert len(mc.requests_for(ApiKey.PRODUCE)) == 1


def test_push_broker_request_errors_with_rtt(mc: MockCluster) -> None:
    topic = mc.create_topic("broker-errors")
    mc.start_request_tracking()
    producer = Producer(
        {"bootstrap.servers": mc.bootstrap_servers, "retry.backoff.ms": 10, "retry.backoff.max.ms": 20, **_QUIET}
    )
    mc.push_broker_request_errors(1, ApiKey.PRODUCE, (KafkaError.NOT_ENOUGH_REPLICAS, 300))
    started = time.monotonic()
    producer.produce(topic, b"a")
    assert producer.flush(5) == 0
    assert time.monotonic() - started >= 0.3
    assert len(mc.requests_for(ApiKey.PRODUCE)) == 2
    with pytest.raises(MockClusterError, match="broker 9"):
        mc.push_broker_request_errors(9, ApiKey.PRODUCE, KafkaError.NOT_ENOUGH_REPLICAS)


# --------------------------------------------------------------------------
# Transactional fault injection: what the client sees
# --------------------------------------------------------------------------


def test_end_txn_producer_fenced_is_fatal(mc: MockCluster) -> None:
    topic = mc.create_topic("fenced")
    producer = started_txn(mc, topic)
    mc.push_request_errors(ApiKey.END_TXN, KafkaError.PRODUCER_FENCED)
    with pytest.raises(KafkaException) as excinfo:
        producer.commit_transaction(5)
    err = kafka_error(excinfo)
    assert err.fatal()
    assert err.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED)


def test_broker_down_during_commit_times_out_then_commit_retry_succeeds(mc: MockCluster) -> None:
    topic = mc.create_topic("down")
    producer = started_txn(mc, topic, b"survives")
    mc.broker_down()
    with pytest.raises(KafkaException) as excinfo:
        producer.commit_transaction(2)
    err = kafka_error(excinfo)
    assert err.code() == KafkaError._TIMED_OUT
    assert err.retriable()
    assert not err.fatal()
    assert not err.txn_requires_abort()

    mc.broker_up()
    producer.commit_transaction(10)
    assert [m.value() for m in consume(mc, topic, 1)] == [b"survives"]


def test_add_partitions_concurrent_transactions_is_retried_internally(mc: MockCluster) -> None:
    topic = mc.create_topic("concurrent")
    producer = txn_producer(mc)
    producer.init_transactions(5)
    mc.start_request_tracking()
    mc.push_request_errors(ApiKey.ADD_PARTITIONS_TO_TXN, *[KafkaError.CONCURRENT_TRANSACTIONS] * 3)
    producer.begin_transaction()
    producer.produce(topic, b"x")
    producer.commit_transaction(10)
    # Three refused attempts, then the one that succeeded.
    assert len(mc.requests_for(ApiKey.ADD_PARTITIONS_TO_TXN)) == 4
    assert len(mc.requests_for(ApiKey.END_TXN)) == 1


def test_txn_offset_commit_group_auth_failed_requires_abort(mc: MockCluster) -> None:
    topic = mc.create_topic("offsets")
    producer = started_txn(mc, topic)
    consumer = Consumer({"bootstrap.servers": mc.bootstrap_servers, "group.id": "g-offsets", **_QUIET})
    try:
        group_metadata = consumer.consumer_group_metadata()  # no group join needed
        mc.push_request_errors(ApiKey.TXN_OFFSET_COMMIT, KafkaError.GROUP_AUTHORIZATION_FAILED)
        with pytest.raises(KafkaException) as excinfo:
            producer.send_offsets_to_transaction([TopicPartition(topic, 0, 1)], group_metadata, 5)
        err = kafka_error(excinfo)
        assert err.code() == KafkaError.GROUP_AUTHORIZATION_FAILED
        assert err.txn_requires_abort()
        assert not err.fatal()

        # The transaction stays poisoned until aborted.
        with pytest.raises(KafkaException) as excinfo:
            producer.commit_transaction(5)
        assert kafka_error(excinfo).txn_requires_abort()

        producer.abort_transaction(5)
        producer.begin_transaction()
        producer.produce(topic, b"after-abort")
        producer.send_offsets_to_transaction([TopicPartition(topic, 0, 1)], group_metadata, 5)
        producer.commit_transaction(5)
    finally:
        consumer.close()


def test_init_producer_id_transactional_id_auth_failed_is_fatal(mc: MockCluster) -> None:
    mc.push_request_errors(ApiKey.INIT_PRODUCER_ID, KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED)
    producer = txn_producer(mc)
    with pytest.raises(KafkaException) as excinfo:
        producer.init_transactions(5)
    err = kafka_error(excinfo)
    assert err.code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
    assert err.fatal()
