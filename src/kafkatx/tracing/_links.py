"""The span contexts of a failing record's earlier attempts, so that its next attempt's span links to them."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext

__all__ = ["AttemptLinks"]


class AttemptLinks:
    """The span contexts of each failing record's earlier attempts, in order, so that its next attempt links to them.

    Kept in memory, keyed by consumer group and record coordinates; a record's entry ends when it succeeds or is
    recovered. At most ``max_records`` records are remembered (the oldest is dropped first), so records of
    a revoked partition that never come back cannot grow it without bound.
    """

    def __init__(self, max_records: int = 10_000) -> None:
        self._earlier: OrderedDict[tuple[str, str, int, int], list[SpanContext]] = OrderedDict()
        #: The records with remembered attempts (read-only; its truth says whether any is failing, at C speed).
        self.records: Mapping[tuple[str, str, int, int], list[SpanContext]] = self._earlier
        self._lock = threading.Lock()
        self.max_records = max_records

    def earlier(self, key: tuple[str, str, int, int]) -> list[SpanContext]:
        """The contexts of the record's earlier attempts, oldest first (a copy)."""
        with self._lock:
            return list(self._earlier.get(key, ()))

    def failed(self, key: tuple[str, str, int, int], context: SpanContext) -> None:
        """An attempt of the record failed: its span is linked from the record's next attempts."""
        with self._lock:
            contexts = self._earlier.pop(key, [])
            contexts.append(context)
            self._earlier[key] = contexts
            while len(self._earlier) > self.max_records:
                self._earlier.popitem(last=False)

    def last(self, key: tuple[str, str, int, int]) -> SpanContext | None:
        """The context of the record's last failed attempt, if any is remembered."""
        with self._lock:
            contexts = self._earlier.get(key)
            return contexts[-1] if contexts else None

    def holds(self, key: tuple[str, str, int, int]) -> bool:
        """Whether an earlier attempt of the record is remembered (lock-free: a dict lookup)."""
        return key in self._earlier

    def done(self, key: tuple[str, str, int, int]) -> None:
        """The record succeeded or was dead-lettered: nothing more links to its attempts."""
        with self._lock:
            self._earlier.pop(key, None)

    def __len__(self) -> int:
        return len(self._earlier)
