"""Things a container says about itself that look healthy from outside but are not.

An owned partition that fetches nothing, and a container that has had no
partition for a while: the group is stable and the process alive, so only
the container can tell.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from confluent_kafka import TopicPartition

from kafkatx.client.offsets import TP
from kafkatx.listener.host import ContainerIdentity, ContainerLiveness, ContainerMembership, ContainerPositions

if TYPE_CHECKING:
    from kafkatx.client.producer import TransactionalProducer

__all__ = [
    "STALL_CHECK_S",
    "StallCheck",
    "StallHost",
    "UnassignedHost",
    "UnassignedWatch",
    "no_partition_hint",
    "unassigned_grace",
]

log = logging.getLogger("kafkatx.container")

STALL_CHECK_S = 30.0  # how often to look for assigned partitions that fetch nothing


class StallHost(ContainerIdentity, ContainerMembership, ContainerPositions, Protocol):
    """What the stall check reads of its container: its consumer and the partitions it owns and holds."""


class StallCheck:
    """Says so when an assigned partition, not paused by kafkatx, fetches nothing while it has records.

    A partition that is owned but never fetched looks healthy from outside:
    the group is stable and the process is alive. Every 30 s the container
    compares each partition's position with the last one and with the
    high watermark librdkafka last saw (no network round trip). The container
    runs it once a poll returns at :attr:`due` or later.
    """

    def __init__(self, container: StallHost) -> None:
        self._c = container
        #: When the next check is due (``time.monotonic()``).
        self.due = time.monotonic() + STALL_CHECK_S
        self._positions: dict[TP, int] = {}
        self.stalled: set[TP] = set()

    def run(self, now: float) -> None:
        """Compare the positions with the last check's; the next check is due :data:`STALL_CHECK_S` from ``now``."""
        self.due = now + STALL_CHECK_S
        c = self._c
        consumer = c.consumer
        if consumer is None:
            return
        tps = [tp for tp in c.assigned if tp not in c.paused_until]
        if not tps:
            self._positions.clear()
            return
        try:
            positions = {
                (p.topic, p.partition): p.offset for p in consumer.position([TopicPartition(*tp) for tp in tps])
            }
        except Exception:
            return
        previous, self._positions = self._positions, positions
        for tp, position in positions.items():
            try:
                _low, high = consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)
            except Exception:
                continue
            stuck = position >= 0 and high > position and previous.get(tp) == position
            if stuck and tp not in self.stalled:
                self.stalled.add(tp)
                log.warning(
                    "listener %s owns %s[%d] but has fetched nothing from it for %.0fs although %d record(s) "
                    "are behind its position %d. Possible causes: an open transaction of a crashed producer "
                    "holds back the last stable offset (read_committed), or the partition is paused outside kafkatx.",
                    c.name,
                    tp[0],
                    tp[1],
                    STALL_CHECK_S,
                    high - position,
                    position,
                )
            elif not stuck and tp in self.stalled:
                self.stalled.discard(tp)
                log.info("listener %s: %s[%d] is fetching again", c.name, tp[0], tp[1])


def unassigned_grace(consumer_config: Mapping[str, Any]) -> float:
    """Seconds without any partition worth a warning: two session timeouts, at least 30 s."""
    return max(30.0, 2 * int(consumer_config.get("session.timeout.ms", 45_000)) / 1000.0)


class UnassignedHost(ContainerIdentity, ContainerMembership, ContainerLiveness, Protocol):
    """What the unassigned watch reads of its container: its consumer, its declaration, whether the cluster answers."""


class UnassignedWatch:
    """Says so when a container has had no partition for a while, and what usually causes it."""

    def __init__(self, container: UnassignedHost, consumer_config: Mapping[str, Any]) -> None:
        self._c = container
        self._grace = unassigned_grace(consumer_config)
        self.restart()

    def restart(self) -> None:
        """The container has just lost its last partition (or started without one)."""
        self._since = time.monotonic()
        self._warn_at = self._since + self._grace

    def maybe_warn(self, now: float) -> None:
        if now < self._warn_at:
            return
        self._warn_at = now + 300.0  # then every five minutes
        c = self._c
        topics = c.spec.topics
        down_for = c.brokers.down_for(now)
        if down_for is not None:  # the real cause, not the group's arithmetic
            log.warning(
                "listener %s has had no partition of %s for %.0fs: no broker of %s has answered for %.0fs",
                c.name,
                ",".join(topics),
                now - self._since,
                c.brokers.bootstrap_servers,
                down_for,
            )
            return
        log.warning(
            "listener %s has had no partition of %s for %.0fs (group %r). %s",
            c.name,
            ",".join(topics),
            now - self._since,
            c.group_id,
            no_partition_hint(self._partition_counts(topics), c.spec.concurrency),
        )

    def _partition_counts(self, topics: tuple[str, ...]) -> dict[str, int | None]:
        """Each topic's partition count from the cluster's metadata, None where it cannot be had."""
        consumer = self._c.consumer
        counts: dict[str, int | None] = dict.fromkeys(topics)
        if consumer is None:
            return counts
        for topic in topics:
            try:
                meta = consumer.list_topics(topic, timeout=5.0).topics.get(topic)
            except Exception:  # noqa: BLE001 - the warning goes out without the number
                continue
            if meta is not None and meta.error is None and meta.partitions:
                counts[topic] = len(meta.partitions)
        return counts


def no_partition_hint(partitions: Mapping[str, int | None], consumers_here: int) -> str:
    """Why a consumer gets no partition, the usual cause first, with the numbers known.

    ``partitions``: each topic's partition count (None: unknown);
    ``consumers_here``: this process's consumers for the listener (its concurrency).
    """
    here = f"this process alone runs {consumers_here} consumer{'s' if consumers_here != 1 else ''} for the listener"
    known = {topic: n for topic, n in partitions.items() if n is not None}
    if known and len(known) == len(partitions):
        total = sum(known.values())
        counted = ", ".join(f"{topic} has {n} partition{'s' if n != 1 else ''}" for topic, n in known.items())
        usual = f"Most likely the group has more consumers than partitions: {counted}, and {here}"
        if consumers_here > total:
            usual += f" (concurrency={consumers_here} > {total} partition{'s' if total != 1 else ''})"
        else:
            usual += "; members of the group in other processes count too"
    else:
        usual = (
            f"Most likely the group has more consumers than the topic has partitions ({here}; "
            "members of the group in other processes count too)"
        )
    return (
        f"{usual}. Less often: another live process using the same instance id; or, on the embedded broker, its "
        "group coordinator waiting for a member that died (docs/BROKERS.md: restart it under its instance id)."
    )


def blocked_producer(producers: Iterable[TransactionalProducer | None]) -> TransactionalProducer | None:
    """Of a container's ``producers``, the one whose bounded call its thread is blocked in, if any."""
    return next((p for p in producers if p is not None and p.blocked_in is not None), None)
