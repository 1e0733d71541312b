"""Plain functions to set up and inspect a Kafka cluster from tests.

They take ``bootstrap_servers`` explicitly so they work against the local
broker and against any external cluster alike. :class:`KafkaTestKit` binds
them to one cluster for convenience.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from kafkatx.client.log import client_log
from kafkatx.client.topics import create_topic as _create_topic
from kafkatx.record import Record

__all__ = [
    "KafkaTestKit",
    "create_topic",
    "delete_topics",
    "produce",
    "read_topic",
    "committed_offsets",
    "end_offsets",
    "unique_name",
    "wait_for",
    "running",
]

Isolation = Literal["read_committed", "read_uncommitted"]
#: Every helper client logs through ``logging`` (``kafkatx.librdkafka``, as an App's clients do), never
#: librdkafka's raw ``%3|...`` lines on stderr: a broker that is down would print hundreds of them.
_QUIET: dict[str, Any] = {"logger": client_log()}


def unique_name(prefix: str = "t") -> str:
    """A name that no other test uses: ``<prefix>-<10 hex digits>``."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def wait_for(predicate: Any, timeout: float = 30.0, interval: float = 0.05, message: str = "condition") -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {message}")
        time.sleep(interval)


def create_topic(
    bootstrap_servers: str,
    name: str | None = None,
    partitions: int = 1,
    config: Mapping[str, str] | None = None,
    timeout: float = 15.0,
) -> str:
    """Create a topic (unique name by default) and wait until metadata shows it."""
    name = name or unique_name()
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, **_QUIET})
    if not _create_topic(admin, name, partitions, replication_factor=1, config=config, timeout=timeout):
        raise AssertionError(f"timed out after {timeout:.1f}s waiting for topic {name} to show {partitions} partitions")
    return name


def delete_topics(bootstrap_servers: str, names: Iterable[str], timeout: float = 10.0) -> None:
    """Delete ``names`` (missing ones are ignored)."""
    names = list(names)
    if not names:
        return
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, **_QUIET})
    for fut in admin.delete_topics(names, operation_timeout=timeout).values():
        try:
            fut.result(timeout)
        except KafkaException:
            pass


def produce(
    bootstrap_servers: str,
    topic: str,
    records: Iterable[Any],
    *,
    partition: int | None = None,
    config: Mapping[str, Any] | None = None,
) -> int:
    """Produce records and flush. Each item is a value, a ``(key, value)`` tuple,
    or a dict with ``value`` and optional ``key``, ``partition`` and ``headers``.
    Returns the number produced; raises if any delivery failed."""
    producer = Producer({"bootstrap.servers": bootstrap_servers, "linger.ms": 5, **_QUIET, **dict(config or {})})
    errors: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            errors.append(err)

    count = 0
    for item in records:
        kwargs: dict[str, Any] = {}
        if isinstance(item, dict):
            kwargs = {k: item[k] for k in ("key", "headers", "partition") if item.get(k) is not None}
            value = item.get("value")
        elif isinstance(item, tuple):
            kwargs["key"], value = item
        else:
            value = item
        if partition is not None:
            kwargs.setdefault("partition", partition)
        while True:
            try:
                producer.produce(topic, value=value, on_delivery=on_delivery, **kwargs)
                break
            except BufferError:
                producer.poll(0.05)
        count += 1
    remaining = producer.flush(30)
    producer.close()
    if remaining or errors:
        raise AssertionError(f"produce to {topic}: {remaining} undelivered, errors: {errors[:3]}")
    return count


def _to_record(msg: Any) -> Record:
    ts_type, ts = msg.timestamp()
    return Record(
        topic=msg.topic(),
        partition=msg.partition(),
        offset=msg.offset(),
        key=msg.key(),
        value=msg.value(),
        headers=[(k, v) for k, v in (msg.headers() or [])],
        timestamp=ts,
        timestamp_type={0: "NoTimestampType", 1: "CreateTime", 2: "LogAppendTime"}.get(ts_type, "CreateTime"),
    )


def read_topic(
    bootstrap_servers: str,
    topic: str,
    *,
    isolation: Isolation = "read_committed",
    timeout: float = 30.0,
    config: Mapping[str, Any] | None = None,
) -> list[Record]:
    """Read a whole topic from the beginning to its current end.

    With ``read_committed`` the end is the last stable offset: aborted records
    are skipped and an open transaction's records are not returned.
    Records come back ordered by (partition, offset). ``config`` adds
    consumer properties.
    """
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap_servers,
            "group.id": unique_name("kafkatx-reader"),
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": isolation,
            **_QUIET,
            **(config or {}),
        }
    )
    try:
        meta = consumer.list_topics(topic, timeout=10).topics[topic]
        if meta.error is not None:
            raise AssertionError(f"cannot read topic {topic}: {meta.error}")
        parts = sorted(meta.partitions)
        consumer.assign([TopicPartition(topic, p, -2) for p in parts])  # OFFSET_BEGINNING
        pending = set(parts)
        out: list[Record] = []
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out reading {topic}: partitions {sorted(pending)} never reached their end")
            for msg in consumer.consume(1000, 0.2):
                err = msg.error()
                if err is None:
                    out.append(_to_record(msg))
                elif err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(msg.partition())
                else:
                    raise KafkaException(err)
        out.sort(key=lambda r: (r.partition, r.offset))
        return out
    finally:
        consumer.close()


def committed_offsets(
    bootstrap_servers: str,
    group: str,
    topic: str,
    *,
    timeout: float = 15.0,
) -> dict[int, int]:
    """The group's committed offsets for ``topic``, as ``{partition: offset}``.

    Partitions without a committed offset are left out. Pending transactional
    offsets are not returned until their transaction ends.
    """
    consumer = Consumer(
        {"bootstrap.servers": bootstrap_servers, "group.id": group, "enable.auto.commit": False, **_QUIET}
    )
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        tps = consumer.committed([TopicPartition(topic, p) for p in sorted(parts)], timeout=timeout)
        return {tp.partition: tp.offset for tp in tps if tp.offset >= 0}
    finally:
        consumer.close()


def end_offsets(bootstrap_servers: str, topic: str, *, timeout: float = 10.0) -> dict[int, int]:
    """The high watermark of each partition of ``topic``."""
    consumer = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": unique_name("kafkatx-wm"), **_QUIET})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)[1] for p in sorted(parts)}
    finally:
        consumer.close()


class KafkaTestKit:
    """The helpers above, bound to one cluster. Topics it creates are deleted by :meth:`cleanup`."""

    def __init__(self, bootstrap_servers: str) -> None:
        self.bootstrap_servers = bootstrap_servers
        self._created: list[str] = []

    def topic(self, partitions: int = 1, name: str | None = None, config: Mapping[str, str] | None = None) -> str:
        """Create a topic (a unique name unless ``name``) that is deleted after the test; return its name."""
        name = create_topic(self.bootstrap_servers, name or unique_name(), partitions, config)
        self._created.append(name)
        return name

    def produce(self, topic: str, records: Iterable[Any], **kwargs: Any) -> int:
        """Write ``records`` (values, ``(key, value)`` pairs, or dicts with key/value/headers/partition); the count."""
        return produce(self.bootstrap_servers, topic, records, **kwargs)

    def read(self, topic: str, *, isolation: Isolation = "read_committed", timeout: float = 30.0) -> list[Record]:
        """Every record of ``topic`` up to its end, as :class:`~kafkatx.Record` (``read_committed`` by default)."""
        return read_topic(self.bootstrap_servers, topic, isolation=isolation, timeout=timeout)

    def values(self, topic: str, *, isolation: Isolation = "read_committed") -> list[bytes | None]:
        """The values of :meth:`read`."""
        return [r.value for r in self.read(topic, isolation=isolation)]

    def committed(self, group: str, topic: str, *, timeout: float = 15.0) -> dict[int, int]:
        """``{partition: next offset}`` committed by ``group`` (partitions without a commit are left out)."""
        return committed_offsets(self.bootstrap_servers, group, topic, timeout=timeout)

    def end_offsets(self, topic: str) -> dict[int, int]:
        """``{partition: high watermark}`` of ``topic``."""
        return end_offsets(self.bootstrap_servers, topic)

    def caught_up(self, group: str, topic: str) -> bool:
        """True when ``group`` has committed every partition of ``topic`` up to its end.

        Empty partitions count as caught up (they have no committed offset to compare).
        """
        committed = self.committed(group, topic)
        return all(committed.get(p, 0) >= end for p, end in self.end_offsets(topic).items())

    create_topic = topic  # the name a newcomer reaches for first

    def cleanup(self) -> None:
        """Delete the topics this kit created (the ``kafka`` fixture calls it after each test)."""
        names, self._created = self._created, []
        delete_topics(self.bootstrap_servers, names)


@contextlib.contextmanager
def running(app: Any, kafka: KafkaTestKit | str | None = None, *, timeout: float = 30.0) -> Iterator[Any]:
    """Run ``app`` in the background for the duration of a ``with`` block.

    ``kafka`` (the ``kafka`` fixture, or a bootstrap address) points the App
    at that broker first: an App made at module level, for
    ``kafkatx run``, needs no environment variable to run against the
    test's broker (``with running(app, kafka): ...``). On exit the App is
    stopped gracefully; if a container failed, its error is raised (unless
    the block itself raised).
    """
    if kafka is not None:
        app.bootstrap_servers = kafka if isinstance(kafka, str) else kafka.bootstrap_servers
    app.start()
    try:
        yield app
    except BaseException:
        app.stop(timeout=timeout)
        raise
    app.stop(timeout=timeout)
    if app.failure is not None:
        raise app.failure
