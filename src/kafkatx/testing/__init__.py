"""Test support for kafkatx and for applications built on it.

The pytest plugin (fixtures ``kafka_broker``, ``bootstrap_servers``, ``kafka``
and ``make_topic``) loads automatically once kafkatx is installed.
:class:`MockCluster` gives fault injection through librdkafka's mock cluster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kafkatx.testing.helpers import (
    KafkaTestKit,
    committed_offsets,
    create_topic,
    delete_topics,
    end_offsets,
    produce,
    read_topic,
    running,
    unique_name,
    wait_for,
)

if TYPE_CHECKING:
    from kafkatx.testing.mock_cluster import MockCluster

__all__ = [
    "KafkaTestKit",
    "MockCluster",
    "committed_offsets",
    "create_topic",
    "delete_topics",
    "end_offsets",
    "produce",
    "read_topic",
    "running",
    "unique_name",
    "wait_for",
]


def __getattr__(name: str) -> Any:
    if name == "MockCluster":
        from kafkatx.testing.mock_cluster import MockCluster

        return MockCluster
    raise AttributeError(name)
