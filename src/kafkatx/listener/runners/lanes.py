"""The ordering rule of records handled concurrently: which records wait for each other (a lane), and which may
start next (:class:`LaneSchedule`). Pure: no I/O, no clock."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence

from kafkatx.record import ConsumedMessage

__all__ = ["LaneSchedule", "lane_keys", "lanes_of"]


def lanes_of(
    msgs: Sequence[ConsumedMessage], ordering: str, topic_of: Callable[[str], str] | None = None
) -> list[Hashable]:
    """Each record's ordering lane: records of one lane are handled one at a time, in order.

    ``"key"``: its topic and key (a record without a key: its partition);
    ``"partition"``: its partition; ``"none"``: itself. ``topic_of``: the topic a record's lane is named by
    (with retry topics, a retry record's is its input topic: it and the records of its key take turns).
    """
    if topic_of is None:
        return lane_keys(((m.topic(), m.partition(), m.key()) for m in msgs), ordering)
    return lane_keys(((topic_of(m.topic()), m.partition(), m.key()) for m in msgs), ordering)


def lane_keys(coordinates: Iterable[tuple[str, int, bytes | None]], ordering: str) -> list[Hashable]:
    """The lanes of records given as ``(topic, partition, key)``."""
    if ordering == "none":
        return list(range(len(list(coordinates))))
    if ordering == "partition":
        return [(topic, partition) for topic, partition, _ in coordinates]
    return [(topic, partition) if key is None else (topic, key) for topic, partition, key in coordinates]


class LaneSchedule:
    """Which record may start next: the lowest index whose lane is free, at most ``in_flight`` at once.

    ``cut`` is the first index that may not start (the batch's end, a
    failed record, or the first record not started when time ran out);
    records before it in a busy lane still start once their lane frees up.
    """

    def __init__(self, lanes: Sequence[Hashable], in_flight: int) -> None:
        self._lane_of = lanes
        self._in_flight = in_flight
        self._queues: dict[Hashable, deque[int]] = {}
        for index, lane in enumerate(lanes):
            queue = self._queues.get(lane)
            if queue is None:
                queue = self._queues[lane] = deque()
            queue.append(index)
        self._ready = sorted(q[0] for q in self._queues.values())  # a sorted list is a heap
        self._started = bytearray(len(lanes))
        self._lowest_unstarted = 0
        self.running = 0
        self.cut = len(lanes)

    def take(self) -> int | None:
        """The next record to start, or None (all lanes busy, ``in_flight`` reached, or nothing left)."""
        ready = self._ready
        if self.running >= self._in_flight or not ready or ready[0] >= self.cut:
            return None
        index = heapq.heappop(ready)
        self.running += 1
        self._started[index] = 1
        return index

    def finished(self, index: int, *, hold_lane: bool = False) -> None:
        """Record ``index`` finished: the next record of its lane may start, unless ``hold_lane`` (then once
        :meth:`release` is called for it)."""
        self.running -= 1
        if not hold_lane:
            self.release(index)

    def release(self, index: int) -> None:
        """The lane of finished record ``index`` is free: its next record may start."""
        queue = self._queues[self._lane_of[index]]
        queue.popleft()
        if queue:
            heapq.heappush(self._ready, queue[0])

    def stop_at(self, index: int) -> None:
        """Start no record at or past ``index``."""
        self.cut = min(self.cut, index)

    def stop_starting(self) -> None:
        """Start no record that has not started yet (time is up, or the container stops)."""
        started, low = self._started, self._lowest_unstarted
        while low < len(started) and started[low]:
            low += 1
        self._lowest_unstarted = low
        self.stop_at(low)

    @property
    def idle(self) -> bool:
        """Nothing runs and nothing more may start: the batch is over."""
        return self.running == 0 and (not self._ready or self._ready[0] >= self.cut)
