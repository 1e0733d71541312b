"""``retry="topics"``: a retry partition whose records are due but not consumed is said so.

A record in retry is due at the time its hop's header names; the retry feed
resumes its partition then, so a due record is normally consumed within a
poll. When it is not (a transaction left open on the retry topic holds
read_committed readers below it; the partition is not fetched), nothing else
shows it: the input partitions flow, the listener is ready, and the records in
retry (with key order, their keys' later records too) wait past their back-off.

Every :data:`RETRY_STALL_CHECK_S` the container compares each retry
partition's record due first, from the records in retry as committed
(:meth:`~kafkatx.retry_topics.keys.RetryKeys.heads`, no client call), with the
one it saw at the last check: the same record, due for longer than the check
interval, was not consumed for a whole interval while due. It says so once:
a warning, a :class:`~kafkatx.events.RetryPartitionStalled` event (the
``kafkatx_retry_partitions_stalled`` gauge), and
:class:`~kafkatx.events.RetryPartitionFlowing` when that record is consumed.
``/readyz`` stays ready, as for a stuck last stable offset of a written topic:
the listener handles its partitions, and a restart would not release the
transaction that holds the retry topic (docs/RETRY_TOPICS.md, Readiness).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kafkatx.client.offsets import TP
from kafkatx.events import Event, RetryPartitionFlowing, RetryPartitionStalled
from kafkatx.retry_topics.hops import RetryHops

__all__ = ["RETRY_STALL_CHECK_S", "RetryStalls"]

log = logging.getLogger("kafkatx.container")

#: How often the retry partitions' due records are looked at, and how long a due record may wait unconsumed.
RETRY_STALL_CHECK_S = 30.0


class RetryStalls:
    """The retry partitions of one container whose due records are not consumed (see the module)."""

    def __init__(
        self,
        hops: RetryHops | None,
        name: str,
        worker: int,
        publish: Callable[[Event], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._hops, self._name, self._worker, self._publish, self._clock = hops, name, worker, publish, clock
        self._next = time.monotonic() + RETRY_STALL_CHECK_S
        #: retry TP -> (due ms, input TP, input offset) of its record due first, at the last check.
        self._heads: dict[TP, tuple[int, TP, int]] = {}
        #: Retry partitions reported stalled -> when (monotonic seconds).
        self.stalled: dict[TP, float] = {}

    def maybe_run(self, now: float) -> None:
        """Look, if a check interval has passed since the last look (``now``: monotonic seconds)."""
        if self._hops is None or now < self._next:
            return
        self._next = now + RETRY_STALL_CHECK_S
        self.run(now)

    def run(self, now: float) -> None:
        assert self._hops is not None
        heads = self._hops.book.heads()
        now_ms = int(self._clock() * 1000)
        previous, self._heads = self._heads, {tp: head[:3] for tp, head in heads.items()}
        for tp in [tp for tp in self.stalled if self._heads.get(tp) != previous.get(tp)]:
            self._flowing(tp, now)
        for tp, (due_ms, _input, _offset, records) in heads.items():
            due_for = (now_ms - due_ms) / 1000.0
            if tp in self.stalled or previous.get(tp) != self._heads[tp] or due_for <= RETRY_STALL_CHECK_S:
                continue
            self.stalled[tp] = now
            log.warning(
                "listener %s: retry partition %s[%d] holds %d record(s) in retry, the first due for %.0fs and not "
                "consumed for %.0fs: they wait past their back-off (with key order, so do their keys' later "
                "records). Possible causes: a transaction left open on %s (a crashed or foreign producer) holds "
                "read_committed readers below it (`kafkatx transactions abort` ends one the App's own ids left), or the "
                "partition is not fetched.",
                self._name,
                tp[0],
                tp[1],
                records,
                due_for,
                RETRY_STALL_CHECK_S,
                tp[0],
            )
            self._publish(RetryPartitionStalled(self._name, self._worker, tp[0], tp[1], records, due_for))

    def _flowing(self, tp: TP, now: float) -> None:
        since = self.stalled.pop(tp)
        log.info("listener %s: retry partition %s[%d] is consumed again", self._name, tp[0], tp[1])
        self._publish(RetryPartitionFlowing(self._name, self._worker, tp[0], tp[1], now - since))
