"""A batch listener's poll (``app.batch_listener``, Spark): the batch filled for up to ``max_batch_ms``.

A batch listener pays per batch, not per record, so one ``consume()`` is not
enough: it polls again until the batch is full or ``max_batch_ms`` passed.
A record listener's loop has no such stage.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from confluent_kafka import Consumer, Message

from kafkatx.client.offsets import TP

if TYPE_CHECKING:
    from kafkatx.listener.spec import ListenerSpec

__all__ = ["BatchFill"]


class BatchFill:
    """Fills a poll's batch; told of the partitions revoked meanwhile (the container's revoke callback)."""

    def __init__(self, spec: ListenerSpec, stop_event: threading.Event, assigned: set[TP]) -> None:
        self._max_records, self._max_ms = spec.max_batch_records, spec.max_batch_ms
        self._stop_event, self._assigned = stop_event, assigned  # the container's: read only
        self._revoked: set[TP] = set()  # revoked during the last consume() of the fill

    def revoked(self, tps: Iterable[TP]) -> None:
        """A rebalance callback revoked (or lost) ``tps`` inside a ``consume()``."""
        self._revoked.update(tps)

    def __call__(self, consumer: Consumer, msgs: list[Message]) -> list[Message]:
        """``msgs`` (the first poll's records) and what comes until the batch is full or ``max_batch_ms`` passed.

        A partition revoked during the extra polls is fetched again from its
        committed offset if it comes back, so what was fetched of it before
        is dropped: a batch never holds the same offset twice.
        """
        want = self._max_records
        deadline = time.monotonic() + self._max_ms / 1000.0
        while len(msgs) < want and not self._stop_event.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._revoked.clear()
            more = consumer.consume(want - len(msgs), min(left, 0.5))
            if self._revoked:
                revoked = self._revoked
                msgs = [m for m in msgs if (m.topic(), m.partition()) not in revoked]
            if not more:
                break
            msgs.extend(more)
        assigned = self._assigned
        return [m for m in msgs if m.error() is not None or (m.topic(), m.partition()) in assigned]
