"""database=: which stored positions are refused as another Kafka log's (the topic-id path needs Apache Kafka,
so it is pinned here; tests/test_database_identity.py runs the cluster-id path on two embedded brokers)."""

from __future__ import annotations

from kafkatx.client.identity import LogIdentity
from kafkatx.database._store import StoredPosition, reset_statements
from kafkatx.database.session import log_mismatch


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
