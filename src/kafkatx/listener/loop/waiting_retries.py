"""``retry="topics"``: records fetched from a retry partition before they are due wait in memory, not in Kafka.

A retry topic holds records of one delay in the order they failed, so a
partition's records come due in offset order. Of what a poll brings, each
retry partition's records from its first one not yet due on wait here, and
the partition is paused on the retry consumer (its position is already past
them): nothing of it is fetched twice. Each feed poll hands on the waiting
records that have come due, in offset order, and resumes a partition once
none of it waits. A record arriving for a partition some of whose records
wait (fetched before the pause took effect) waits behind them.

Sought back by the container (a transaction that handled some of them aborted,
a rewind), a partition's waiting records are dropped: it fetches them again
from there. Revoked, they are dropped: its next owner reads them from the
committed offset.

Before, the partition was sought back to its first record not due and paused
until that record was due: every poll fetched the records behind it again, and
a resumed partition's first fetch came up to a second late, which made a retry
about half a back-off late on average (measured under load: 0.2-0.6 s median
past the due time at the fetch).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable

from confluent_kafka import Consumer, TopicPartition

from kafkatx.client.offsets import TP
from kafkatx.client.partitions import quietly
from kafkatx.record import ConsumedMessage
from kafkatx.retry_topics.headers import due_ms_of

__all__ = ["WaitingRetries"]

log = logging.getLogger("kafkatx.container")


class WaitingRetries:
    """The records of retry partitions fetched before they were due, per partition, in offset order."""

    def __init__(self) -> None:
        self._waiting: dict[TP, deque[tuple[int, ConsumedMessage]]] = {}
        #: Where each partition with waiting records goes on from: past the last of them.
        self._next: dict[TP, int] = {}

    def __contains__(self, tp: object) -> bool:
        return tp in self._waiting

    def __len__(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def sort(self, consumer: Consumer, records: Iterable[ConsumedMessage], now_ms: int) -> list[ConsumedMessage]:
        """Of ``records`` (one poll's, of retry partitions), those to hand on now: each partition's records up to
        its first one not due at ``now_ms``; that one and the rest of its partition wait (the partition paused)."""
        due: list[ConsumedMessage] = []
        newly: list[TP] = []
        waiting = self._waiting
        for msg in records:
            tp = (msg.topic(), msg.partition())
            queue = waiting.get(tp)
            if queue is None:
                due_ms = due_ms_of(msg.headers())
                if due_ms <= now_ms:
                    due.append(msg)
                    continue
                queue = waiting[tp] = deque()
                newly.append(tp)
                queue.append((due_ms, msg))
            else:
                queue.append((due_ms_of(msg.headers()), msg))
            self._next[tp] = msg.offset() + 1
        if newly:
            quietly(consumer.pause, newly)
        return due

    def release(
        self, consumer: Consumer, now_ms: int, sought: Callable[[TP, int], None] | None = None
    ) -> list[ConsumedMessage]:
        """The waiting records due at ``now_ms``, in offset order per partition; a partition none of whose records
        waits any more is resumed (it fetches what came after them; ``sought`` is told where from)."""
        if not self._waiting:
            return []
        out: list[ConsumedMessage] = []
        emptied: list[TP] = []
        for tp, queue in self._waiting.items():
            while queue and queue[0][0] <= now_ms:
                out.append(queue.popleft()[1])
            if not queue:
                emptied.append(tp)
        for tp in emptied:
            del self._waiting[tp]
        if emptied:
            quietly(consumer.resume, emptied)
            self._fetch_from_next(consumer, emptied, sought)
        return out

    def _fetch_from_next(self, consumer: Consumer, tps: list[TP], sought: Callable[[TP, int], None] | None) -> None:
        """Seek resumed ``tps`` past their last waiting record. Left to librdkafka, a partition paused with a fetch
        under way went on from where that fetch left off, and the record it had brought was never delivered (its
        position read -1001 after the resume); the partition was then paused as read to its end, that record
        unread."""
        for tp in tps:
            offset = self._next.pop(tp, None)
            if offset is not None:
                try:
                    consumer.seek(TopicPartition(tp[0], tp[1], offset))
                except Exception:
                    log.debug("seek of resumed retry partition %s failed (revoked?)", tp, exc_info=True)
                    continue
                if sought is not None:
                    sought(tp, offset)

    def drop(self, consumer: Consumer | None, tps: Iterable[TP]) -> list[TP]:
        """Forget the waiting records of ``tps`` (sought back, revoked); the partitions that had some are resumed
        on ``consumer`` (None: not resumed, e.g. being unassigned). Returns those partitions."""
        dropped = [tp for tp in tps if self._waiting.pop(tp, None) is not None]
        for tp in dropped:
            self._next.pop(tp, None)
        if dropped and consumer is not None:
            quietly(consumer.resume, dropped)
        return dropped

    def clear(self) -> None:
        self._waiting.clear()
        self._next.clear()
