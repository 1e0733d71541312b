"""Which Kafka log a topic is: the cluster's id and, where the broker has them (KIP-516), the topic's id.

Offsets mean something only in the log they were read from. A database that
keeps consumed positions (``database=``) stores this identity beside them, so
that a position written for another cluster (a new temporary local broker) or
for an earlier topic of the same name is recognised instead of trusted.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import TopicCollection
from confluent_kafka.admin import AdminClient

from kafkatx.client.brokers import EMBEDDED_CLUSTER_ID, REIDENTIFIED_CLUSTER_ID_PREFIX
from kafkatx.client.retry import retry_call

__all__ = ["LogIdentity", "cluster_id_of", "log_identity", "succeeds_shared_id"]

log = logging.getLogger("kafkatx.client")

#: A broker without topic ids (before Kafka 2.8, or the embedded noida-db 0.2.3) answers with the zero UUID.
_NO_TOPIC_ID = "AAAAAAAAAAAAAAAAAAAAAA"
#: Settings of a transactional producer an AdminClient must not get.
_PRODUCER_ONLY = ("transactional.id", "on_delivery", "delivery.report.only.error")


@dataclass(frozen=True)
class LogIdentity:
    """The cluster id and the topic id of one topic (None where the broker gives none)."""

    cluster_id: str | None
    topic_id: str | None


def log_identity(
    client: Any, config: Mapping[str, Any], topic: str, timeout: float = 10.0, *, retry_timeout: float = 0.0
) -> LogIdentity:
    """The identity of ``topic``: its cluster's id from ``client``'s metadata, its topic id from an AdminClient.

    ``client`` is a live confluent-kafka client of the cluster (its metadata
    carries the cluster id); ``config`` its settings, for the AdminClient that
    asks for the topic id (KIP-516; a broker without topic ids, or an answer
    that does not come, leaves it None: the cluster id is still checked).

    It is asked inside a Kafka transaction just begun, so a broker that does
    not answer is a Kafka error of the transaction path, as a producer call's
    would be: retried for up to ``retry_timeout`` seconds, then a
    :class:`~kafkatx.TransactionAbortableError` (abort and reprocess); an
    error retrying cannot help raises its own :class:`~kafkatx.KafkaClientError`.
    """
    cluster_id = retry_call(
        functools.partial(_cluster_id, client, topic, timeout),
        operation=f"list_topics({topic!r}) (the cluster id database= checks its stored positions against)",
        timeout=retry_timeout,
    )
    return LogIdentity(cluster_id, _topic_id(config, topic, timeout))


def succeeds_shared_id(stored_cluster_id: str | None, cluster_id: str | None) -> bool:
    """True if ``cluster_id`` is the id kafkatx gave, once, the embedded broker that reported ``stored_cluster_id``.

    noida-db reported one shared cluster id from every fresh start; a kept
    data dir that still carries it gets an id of its own when kafkatx starts
    it (:mod:`kafkatx.local`), recognisable by its prefix. A position stored
    for the shared id is then that broker's (or, as before, any other broker
    that carried the shared id: kafkatx cannot tell them apart).
    """
    return (
        stored_cluster_id == EMBEDDED_CLUSTER_ID
        and cluster_id is not None
        and cluster_id.startswith(REIDENTIFIED_CLUSTER_ID_PREFIX)
    )


def _cluster_id(client: Any, topic: str, timeout: float) -> str | None:
    return client.list_topics(topic, timeout=timeout).cluster_id or None


def cluster_id_of(client: Any, timeout: float = 10.0) -> str | None:
    """The id of the cluster ``client`` (a live confluent-kafka client) talks to, None if the broker gives none."""
    return client.list_topics(timeout=timeout).cluster_id or None


def _topic_id(config: Mapping[str, Any], topic: str, timeout: float) -> str | None:
    admin_config = {k: v for k, v in config.items() if k not in _PRODUCER_ONLY}
    try:
        admin = AdminClient(admin_config)
        future = admin.describe_topics(TopicCollection([topic]), request_timeout=timeout)[topic]
        topic_id = str(future.result(timeout=timeout + 1).topic_id)
    except Exception as exc:  # noqa: BLE001 - an identity without a topic id still has the cluster's
        log.debug("topic id of %s unknown (%s: %s)", topic, type(exc).__name__, exc)
        return None
    return None if not topic_id or topic_id == _NO_TOPIC_ID else topic_id
