"""Creating a topic so that the next client to look finds it: the App at startup, ``kafkatx topics``, tests.

A CreateTopics answer only says the controller accepted the topic; a
producer or consumer asking a broker for metadata right after can still be
told it does not exist. So creation here waits until metadata lists the
topic with all its partitions.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

__all__ = ["create_topic", "wait_until_listed"]


def create_topic(
    admin: AdminClient,
    name: str,
    partitions: int,
    *,
    replication_factor: int = -1,
    config: Mapping[str, str] | None = None,
    timeout: float = 15.0,
    exist_ok: bool = False,
) -> bool:
    """Create ``name`` and wait until metadata lists its ``partitions`` partitions; True once it does.

    Raises the ``KafkaException`` the broker answered the creation with
    (with ``exist_ok``, TOPIC_ALREADY_EXISTS is taken as success: another
    process created it first). ``replication_factor=-1`` is the broker's
    default. False means the topic was created but not listed within
    ``timeout``.
    """
    future = admin.create_topics(
        [NewTopic(name, num_partitions=partitions, replication_factor=replication_factor, config=dict(config or {}))],
        operation_timeout=timeout,
    )[name]
    try:
        future.result(timeout)
    except KafkaException as exc:
        if not (exist_ok and exc.args and exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS):
            raise
    return wait_until_listed(admin, name, partitions, timeout=timeout)


def wait_until_listed(admin: AdminClient, name: str, partitions: int | None = None, *, timeout: float = 15.0) -> bool:
    """Wait until metadata lists ``name`` (with ``partitions`` partitions, if given); False after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            topic = admin.list_topics(name, timeout=min(5.0, max(0.1, deadline - time.monotonic()))).topics.get(name)
        except KafkaException:
            topic = None
        listed = len(topic.partitions) if topic is not None and topic.error is None else 0
        if listed and (partitions is None or listed == partitions):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
