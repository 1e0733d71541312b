"""The earliest due time of the records in retry, kept as they join and leave (no scan per commit).

A commit moves a few records in or out of retry while thousands may wait there,
so the earliest due time is a heap of due times with a count each: a due time
whose count fell to zero is dropped from the heap's top when it is asked for.
"""

from __future__ import annotations

import heapq

__all__ = ["DueTimes"]


class DueTimes:
    """A multiset of due times (epoch ms) that answers its smallest."""

    __slots__ = ("_counts", "_heap")

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._heap: list[int] = []

    def add(self, due_ms: int) -> None:
        count = self._counts.get(due_ms, 0)
        if count == 0:
            heapq.heappush(self._heap, due_ms)
        self._counts[due_ms] = count + 1

    def remove(self, due_ms: int) -> None:
        count = self._counts.get(due_ms, 0)
        if count <= 1:
            self._counts.pop(due_ms, None)
        else:
            self._counts[due_ms] = count - 1

    def earliest(self) -> int | None:
        """The smallest due time held; None when none is."""
        heap, counts = self._heap, self._counts
        while heap and heap[0] not in counts:
            heapq.heappop(heap)
        return heap[0] if heap else None
