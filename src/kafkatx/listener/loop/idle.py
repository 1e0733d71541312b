"""What a container does while no records arrive: a loop stage of its own.

- **Positions past transaction markers** (Spring's ``fixTxOffsets``, on by
  default here): a read_committed consumer skips commit markers and aborted
  records, so the committed offset of a partition that went quiet stays one
  (or more) short of its end and the lag never reaches zero. Once idle for
  :data:`IDLE_FIXUP_S`, the positions that moved past them are committed.
- **ContainerIdle** (Spring's ``idleEventInterval``): published every
  ``interval`` seconds while nothing arrives.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from confluent_kafka import TopicPartition

from kafkatx.client.offsets import TP
from kafkatx.events import ContainerIdle
from kafkatx.listener.transaction.unit import commit_offsets

if TYPE_CHECKING:
    from kafkatx.listener.host import TransactionHost

__all__ = ["IDLE_FIXUP_S", "IdleDuties"]

log = logging.getLogger("kafkatx.container")

IDLE_FIXUP_S = 0.5  # idle time before committing positions past transaction markers


class IdleDuties:
    """The idle stage of one container: run when a poll brought nothing, with when records were last handled."""

    def __init__(self, host: TransactionHost, interval: float | None) -> None:
        self._host, self._interval = host, interval
        self._last_idle_event = time.monotonic()
        #: The activity (``time.monotonic()``) up to which positions were checked: later activity may move them.
        self._checked_for = self._last_idle_event

    def run(self, last_activity: float) -> None:
        """A poll brought nothing, and records were last handled (or committed) at ``last_activity``: commit
        positions past markers once per idle spell, publish ContainerIdle when it is due."""
        now = time.monotonic()
        if last_activity > self._checked_for and now - last_activity > IDLE_FIXUP_S:
            self._checked_for = last_activity
            self._commit_positions_past_markers()
        interval = self._interval
        if interval is not None and now - max(self._last_idle_event, last_activity) >= interval:
            self._last_idle_event = now
            host = self._host
            host.publish(ContainerIdle(host.name, host.worker, now - last_activity))

    def _commit_positions_past_markers(self) -> None:
        host = self._host
        consumer, paused = host.consumer, host.paused_until
        if consumer is None:
            return
        committed = {tp: host.committed_offset(tp) for tp in host.assigned if tp not in paused}
        tps = [TopicPartition(*tp) for tp, offset in committed.items() if offset is not None]
        if not tps:
            return
        moved: dict[TP, int] = {}
        for position in consumer.position(tps):
            tp = (position.topic, position.partition)
            known = committed[tp]
            if known is not None and position.offset > known:
                moved[tp] = position.offset
        if moved and commit_offsets(host, moved, what="offset fix-up", tolerate_errors=True):
            log.debug("listener %s committed positions past transaction markers: %s", host.name, moved)
