"""A way out of a hanging transaction: abort what an App's own transactional ids left open.

A read_committed reader stops at a partition's last stable offset, so one
transaction left open holds back everything written after it. A producer that
dies with a transaction open leaves it so until the transaction times out:
after ``transaction.timeout.ms`` on Apache Kafka, never on the embedded broker
(docs/BROKERS.md). KIP-664's admin calls (list, describe and abort
transactions) are not in librdkafka, but re-initialising a transactional id
(``init_transactions``) aborts what that id left open and fences its producer.
So kafkatx re-initialises the ids it knows: its own, as the App would use them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from confluent_kafka.admin import AdminClient

from kafkatx.client.producer import TransactionalProducer

if TYPE_CHECKING:
    from kafkatx.app.application import App

__all__ = ["abort_open_transactions", "app_transactional_ids"]


def app_transactional_ids(app: App, partition_counts: Mapping[str, int], producers: int) -> list[str]:
    """Every transactional id ``app`` may use: each container's with ``fencing="group"``, each input partition's
    with ``fencing="partition"`` (both, whatever the fencing resolves to), and the first ``producers`` of
    ``app.transaction()``'s threads."""
    client = app.client_config
    ids: list[str] = []
    index = 0
    for spec in app.listeners:
        group = spec.group_id or app.group_id
        for _ in range(spec.concurrency):
            ids.append(client.group_transactional_id(group, index))
            index += 1
        for topic in spec.topics:
            ids += [client.partition_transactional_id(group, topic, p) for p in range(partition_counts.get(topic, 0))]
    ids += [client.producer_transactional_id(n) for n in range(1, producers + 1)]
    return list(dict.fromkeys(ids))


def abort_open_transactions(app: App, *, producers: int = 4) -> list[str]:
    """Re-initialise each of ``app``'s transactional ids, aborting any transaction it left open; returns the ids.

    Run it while the App is stopped: a running App's producers would be fenced (they replace themselves, and
    what they had open is aborted and handled again, so nothing is lost, but it costs a round of reprocessing).
    """
    topics = sorted({topic for spec in app.listeners for topic in spec.topics})
    client = app.client_config
    ids = app_transactional_ids(app, _partition_counts(app, topics), producers)
    for txn_id in ids:
        producer = TransactionalProducer(
            client.producer_config(None, txn_id), txn_id, retry_timeout=client.transaction_retry_timeout
        )
        try:
            producer.ensure()  # init_transactions: the id's open transaction is aborted, its producer fenced
        finally:
            producer.close()
    return ids


def _partition_counts(app: App, topics: list[str]) -> dict[str, int]:
    """How many partitions each of ``topics`` has (a missing topic: none, so no id of it)."""
    if not topics:
        return {}
    metadata = AdminClient(app.client_config.base_config()).list_topics(timeout=10).topics
    return {t: len(metadata[t].partitions) for t in topics if t in metadata and metadata[t].error is None}
