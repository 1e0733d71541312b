"""The clients the dead-letter tools read with: bounded, read_committed, never joining a group."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from kafkatx._suggest import closest_topic
from kafkatx.client.brokers import ENV_BOOTSTRAP, bootstrap_from_env, port_in_use
from kafkatx.dlq.entries import DlqToolError
from kafkatx.errors import KafkaClientError
from kafkatx.errors.classification import FENCING_CODES
from kafkatx.record import ConsumedMessage

log = logging.getLogger("kafkatx.dlq.tools")

_OFFSET_BEGINNING = -2
# Settings the tools own; a user override would break read_committed or exactly-once.
_OWNED = ("group.id", "enable.auto.commit", "isolation.level", "transactional.id", "enable.idempotence")


class _ClientLog:
    """librdkafka's own log lines, demoted to DEBUG: a tool's errors carry their cause, and a
    refused connection would otherwise print a line every few milliseconds (``-vv`` shows them)."""

    _log = logging.getLogger("kafkatx.dlq.librdkafka")

    def log(self, _level: int, msg: str, *args: Any) -> None:
        self._log.debug(msg, *args)


#: Client settings every tool client starts from.
QUIET = {"logger": _ClientLog()}


def resolve_bootstrap_servers(bootstrap_servers: str | None) -> str:
    """The given servers, else ``$KAFKATX_BOOTSTRAP_SERVERS``, else a DlqToolError saying how to give them."""
    servers = bootstrap_servers or bootstrap_from_env()
    if servers:
        return servers
    from kafkatx.local import DEFAULT_PORT  # read at call time: tests point it at their broker

    if port_in_use(DEFAULT_PORT):  # `kafkatx broker` runs on its default port: use it
        return f"127.0.0.1:{DEFAULT_PORT}"
    raise DlqToolError(
        f"no bootstrap servers: pass --bootstrap-servers HOST:PORT or set ${ENV_BOOTSTRAP} "
        f"(nothing listens on 127.0.0.1:{DEFAULT_PORT}, the default port of `kafkatx broker`)"
    )


def check_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The user's client settings, refusing those the tools own."""
    cfg = dict(config or {})
    owned = sorted(k for k in cfg if k in _OWNED)
    if owned:
        raise DlqToolError(f"the dead-letter tools set {', '.join(owned)} themselves; remove it from the client config")
    return cfg


def group_offsets(
    servers: str, group: str, topic: str, partitions: Iterable[int], config: Mapping[str, Any]
) -> dict[int, int]:
    """``group``'s committed offsets of ``topic`` (none for a group that never committed)."""
    consumer = tool_consumer(servers, group, config)
    try:
        got = kafka_call(
            lambda: consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=15),
            f"read the offsets of group {group!r}",
        )
    finally:
        consumer.close()
    return {tp.partition: tp.offset for tp in got if tp.offset >= 0}


def tool_consumer(servers: str, group: str, config: Mapping[str, Any]) -> Consumer:
    """A read_committed consumer that reports partition EOF and never commits on its own."""
    return Consumer(
        {
            **QUIET,
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 100,  # reach partition EOF quickly; the tools read bounded ranges
            **config,
            "bootstrap.servers": servers,
            "group.id": group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )


def topic_partitions(client: Any, servers: str, topic: str, what: str = "topic") -> list[int]:
    """The partitions of ``topic``; a DlqToolError if it does not exist or Kafka is unreachable."""
    try:
        meta = client.list_topics(topic, timeout=10).topics.get(topic)
    except KafkaException as exc:
        raise DlqToolError(
            f"cannot read metadata of {what} {topic!r} from {servers} (is the broker reachable?): {exc.args[0].str()}"
        ) from None
    if meta is None or meta.error is not None or not meta.partitions:
        reason = f" ({meta.error.str()})" if meta is not None and meta.error is not None else ""
        raise DlqToolError(f"{what} {topic!r} does not exist on {servers}{reason}{_closest_topic(client, topic)}")
    return sorted(meta.partitions)


def _closest_topic(client: Any, topic: str) -> str:
    """The did-you-mean of a missing topic, from every topic's name (asked for only then: a second call)."""
    try:
        return closest_topic(topic, client.list_topics(timeout=10).topics)
    except KafkaException:
        return ""


def watermarks(consumer: Consumer, topic: str, partitions: Iterable[int]) -> dict[int, tuple[int, int]]:
    """Low and high offsets of each partition, read from the broker."""
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False) for p in partitions
        }
    except KafkaException as exc:
        raise DlqToolError(f"cannot read the end offsets of {topic!r}: {exc.args[0].str()}") from None


class ReadEvent(NamedTuple):
    """A record to handle (``message`` set), or the end of a partition with everything before ``offset`` handled."""

    partition: int
    offset: int
    message: ConsumedMessage | None


def read_range(
    consumer: Consumer,
    topic: str,
    starts: Mapping[int, int],
    stops: Mapping[int, int],
    idle_timeout: float,
) -> Iterator[ReadEvent]:
    """Records of ``topic`` from ``starts`` up to (not including) ``stops``, in offset order per partition.

    A partition ends at the first record at or past its stop offset (records
    that arrived after the stop offsets were taken are left alone), or at
    partition EOF, which read_committed reports at the last stable offset:
    so an open transaction on the DLT does not make the reader wait for it,
    and trailing transaction markers are passed over. Each partition's end is
    reported once, as an event without a message.
    """
    pending = {p for p in starts if starts[p] < stops[p]}
    for p in sorted(set(starts) - pending):
        yield ReadEvent(p, starts[p], None)
    if not pending:
        return
    consumer.assign(
        [TopicPartition(topic, p, starts[p] if starts[p] >= 0 else _OFFSET_BEGINNING) for p in sorted(pending)]
    )
    last_progress = time.monotonic()
    while pending:
        batch = consumer.consume(500, 0.2)
        if batch:
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > idle_timeout:
            raise DlqToolError(
                f"no progress reading {topic!r} for {idle_timeout:g}s; partitions {sorted(pending)} "
                "did not reach their end (is the broker reachable?)"
            )
        for msg in batch:
            partition, offset = msg.partition(), msg.offset()
            if partition is None or offset is None or partition not in pending:
                continue
            p = partition
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(p)
                    consumer.pause([TopicPartition(topic, p)])
                    yield ReadEvent(p, offset, None)
                elif err.fatal() or not (
                    err.retriable() or err.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN)
                ):
                    raise DlqToolError(f"reading {topic!r} partition {p} failed: {err.str()}")
                else:
                    log.debug("transient error reading %s[%d]: %s", topic, p, err.str())
                continue
            if offset >= stops[p]:
                pending.discard(p)
                consumer.pause([TopicPartition(topic, p)])
                yield ReadEvent(p, offset, None)
                continue
            yield ReadEvent(p, offset, cast(ConsumedMessage, msg))  # no error: a consumed record


def why(exc: BaseException) -> str:
    """The error's text, plus what fencing means here: another replay of the same group took over."""
    error = exc.error if isinstance(exc, KafkaClientError) else exc.args[0] if isinstance(exc, KafkaException) else None
    if not isinstance(error, KafkaError):
        return str(exc)
    # the KafkaError's own text: KafkaClientError's message describes what a listener container would do
    text = f"{error.name()}: {error.str()}"
    if error.code() in FENCING_CODES:
        text += " (another replay with the same group started and took over; only one can run at a time)"
    return text


def kafka_call(fn: Callable[[], Any], what: str) -> Any:
    """``fn()``, a Kafka error turned into a DlqToolError saying what could not be done."""
    try:
        return fn()
    except (KafkaClientError, KafkaException) as exc:
        raise DlqToolError(f"cannot {what}: {why(exc)}") from exc
