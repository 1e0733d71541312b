"""database=: which stored positions are refused as another Kafka log's (the topic-id path needs Apache Kafka,
so it is pinned here; tests/test_database_identity.py runs the cluster-id path on two embedded brokers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from fakes import FakeHost, FakeProducer, listener, messages

from kafkatx import DatabaseUnavailableError, KafkaClientError, Record, TransactionAbortableError
from kafkatx.client.identity import LogIdentity
from kafkatx.database._store import StoredPosition, reset_statements
from kafkatx.database.session import DatabaseSession, log_mismatch
from kafkatx.errors.classification import ErrorClass, classify
from kafkatx.events import KafkaErrorHandled, OutageStarted, ProducerRecreated


def test_a_position_of_another_cluster_or_an_earlier_topic_is_a_mismatch() -> None:
    here = LogIdentity("cluster-B", "topic-2")
    assert "another Kafka cluster" in str(log_mismatch(StoredPosition(5, "cluster-A", "topic-2"), here))
    assert "deleted and created again" in str(log_mismatch(StoredPosition(5, "cluster-B", "topic-1"), here))
    assert log_mismatch(StoredPosition(5, "cluster-B", "topic-2"), here) is None


def test_unknown_identities_are_adopted_not_refused() -> None:
    """Rows of an earlier kafkatx (no columns) and brokers without topic ids (noida-db, Kafka before 2.8)."""
    assert log_mismatch(StoredPosition(5, None, None), LogIdentity("cluster-B", "topic-2")) is None
    assert log_mismatch(StoredPosition(5, "cluster-B", None), LogIdentity("cluster-B", "topic-2")) is None
    assert log_mismatch(StoredPosition(5, "cluster-B", "topic-1"), LogIdentity("cluster-B", None)) is None


def test_the_reset_statements_quote_the_names() -> None:
    assert reset_statements("o'brien", "in") == (
        "DELETE FROM kafkatx_offsets WHERE group_id = 'o''brien' AND topic = 'in'; "
        "DELETE FROM kafkatx_outbox WHERE group_id = 'o''brien' AND topic = 'in';"
    )


class _UnansweredClient:
    """A confluent-kafka client whose broker does not answer."""

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Local: Broker transport failure"))


class _KafkaDownProducer(FakeProducer):
    def ensure(self) -> Any:
        return _UnansweredClient()

    @property
    def client_config(self) -> dict[str, Any]:
        return {"bootstrap.servers": "127.0.0.1:9"}


def test_a_cluster_id_kafka_does_not_give_is_a_kafka_error_not_a_database_outage(tmp_path: Path) -> None:
    session = DatabaseSession(f"sqlite:///{tmp_path / 'app.db'}", "group", "handle")
    with pytest.raises(KafkaClientError) as caught:
        session.begin(_KafkaDownProducer(), messages(b"a"))
    error = caught.value
    assert not isinstance(error, DatabaseUnavailableError)
    assert isinstance(error, TransactionAbortableError), "inside the transaction just begun: abort and reprocess"
    assert classify(error) is ErrorClass.ABORTABLE
    assert (
        "list_topics('in')" in str(error) and "_TRANSPORT" in str(error) and "Check broker availability" in str(error)
    )


def test_a_listener_reacts_to_it_as_to_any_kafka_error_of_its_transaction(tmp_path: Path) -> None:
    handled: list[Record] = []
    spec = listener(handled.append, database=f"sqlite:///{tmp_path / 'app.db'}")
    host = FakeHost(spec, _KafkaDownProducer())
    host.database = DatabaseSession(spec.database, "group", spec.name)
    host.runner()(host.unit(messages(b"a")))
    assert handled == [] and host.producer.committed_offsets == {}
    assert host.events_of(OutageStarted) == [], "no database outage"
    assert {e.error_class for e in host.events_of(KafkaErrorHandled)} == {ErrorClass.ABORTABLE.name}
    assert host.events_of(ProducerRecreated), "aborted and retried, then the producer replaced, as KIP-1050 says"


def test_rows_of_noida_dbs_shared_cluster_id_belong_to_the_broker_kafkatx_gave_its_own_id() -> None:
    """A kept --local-data-dir made before kafkatx seeded cluster ids is given one of its own, once (kafkatx.local)."""
    from kafkatx.client.brokers import EMBEDDED_CLUSTER_ID, EMBEDDED_CLUSTER_ID_PREFIX, REIDENTIFIED_CLUSTER_ID_PREFIX
    from kafkatx.database.session import adopts

    shared = StoredPosition(5, EMBEDDED_CLUSTER_ID, None)
    reidentified = LogIdentity(REIDENTIFIED_CLUSTER_ID_PREFIX + "abc", None)
    assert log_mismatch(shared, reidentified) is None and adopts(shared, reidentified)
    fresh = LogIdentity(EMBEDDED_CLUSTER_ID_PREFIX + "abc", None)  # a new temporary broker: another log
    assert "another Kafka cluster" in str(log_mismatch(shared, fresh))
    assigned = StoredPosition(5, reidentified.cluster_id, None)  # once tied to the new id, only it matches
    assert "another Kafka cluster" in str(log_mismatch(assigned, LogIdentity(EMBEDDED_CLUSTER_ID, None)))
    assert log_mismatch(assigned, reidentified) is None and not adopts(assigned, reidentified)


def test_a_producer_transaction_with_a_database_gets_a_kafkatx_error_when_the_cluster_id_does_not_come(
    tmp_path: Path,
) -> None:
    """``app.transaction(database=...)`` asks the cluster id before it begins: retried, then a RetriableError
    naming the call (was confluent-kafka's raw KafkaException); nothing began, in Kafka or in the database."""
    from kafkatx import RetriableError
    from kafkatx.database.backend import backend_for
    from kafkatx.database.producer_outbox import ProducerOutbox

    producer = _KafkaDownProducer()
    outbox = ProducerOutbox(backend_for(f"sqlite:///{tmp_path / 'app.db'}"), producer, producer.client_config)
    ran = []
    with pytest.raises(KafkaClientError) as caught, outbox.unit():
        ran.append("the block")
    error = caught.value
    assert isinstance(error, RetriableError) and not isinstance(error, TransactionAbortableError)
    assert "cluster id" in str(error) and "_TRANSPORT" in str(error) and producer.transactional_id in str(error)
    assert isinstance(error.__cause__, KafkaException)
    assert ran == [] and producer.transactions == []


class _UnansweredAdmin:
    """An AdminClient whose broker does not answer the committed-offsets lookup."""

    def __init__(self, config: dict[str, Any]) -> None:
        pass

    def list_consumer_group_offsets(self, groups: list[Any]) -> dict[str, Any]:
        from concurrent.futures import Future

        future: Future[Any] = Future()
        future.set_exception(KafkaException(KafkaError(KafkaError._TRANSPORT, "Local: Broker transport failure")))
        return {"group": future}


class _AnsweringClient:
    def list_topics(self, topic: str | None = None, timeout: float = -1) -> Any:
        return type("Metadata", (), {"cluster_id": "cluster-A"})()


class _ClusterUpProducer(_KafkaDownProducer):
    def ensure(self) -> Any:
        return _AnsweringClient()


def test_a_producer_transaction_with_a_database_gets_a_kafkatx_error_when_its_committed_sequence_does_not_come(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first ``app.transaction(database=...)`` of a producer reads the sequence Kafka last committed for it:
    a broker that does not answer is retried, then a RetriableError naming the call (was the raw KafkaException)."""
    from kafkatx import RetriableError
    from kafkatx.database import producer_outbox
    from kafkatx.database.backend import backend_for

    monkeypatch.setattr(producer_outbox, "AdminClient", _UnansweredAdmin)
    producer = _ClusterUpProducer()
    outbox = producer_outbox.ProducerOutbox(
        backend_for(f"sqlite:///{tmp_path / 'app.db'}"), producer, producer.client_config
    )
    ran = []
    with pytest.raises(KafkaClientError) as caught, outbox.unit():
        ran.append("the block")
    error = caught.value
    assert isinstance(error, RetriableError) and not isinstance(error, TransactionAbortableError)
    assert "the sequence the outbox last committed" in str(error) and "_TRANSPORT" in str(error)
    assert ran == [] and producer.transactions == []
