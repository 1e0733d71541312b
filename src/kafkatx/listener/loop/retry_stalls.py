"""``retry="topics"``: a retry partition whose records are due but not consumed is said so.

A record in retry is due at the time its hop's header names; the retry feed
resumes its partition then, so a due record is normally consumed within a
poll. When it is not (a transaction left open on the retry topic holds
read_committed readers below it; the partition is not fetched), nothing else
shows it: the input partitions flow, the listener is ready, and the records in
retry (with key order, their keys' later records too) wait past their back-off.

The container looks at each retry partition's record due first, from the
records in retry as committed (:meth:`~kafkatx.retry_topics.keys.RetryKeys.heads`,
no client call), every :data:`REFETCH_AFTER_S` (or :data:`RETRY_STALL_CHECK_S`
if shorter), and notes since when it has been the same record. The same record,
due and not consumed for :data:`REFETCH_AFTER_S`, has its partition fetched
again from after the last record delivered of it, and still not consumed
after twice that, from the partition's start (the embedded broker can make a
consumer's position run past records it never delivered: ``RetryFeed.refetch``). Not consumed for :data:`RETRY_STALL_CHECK_S`, it is
said once: a warning, a :class:`~kafkatx.events.RetryPartitionStalled` event
(the ``kafkatx_retry_partitions_stalled`` gauge), and
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

__all__ = ["REFETCH_AFTER_S", "RETRY_STALL_CHECK_S", "Refetch", "RetryStalls"]

log = logging.getLogger("kafkatx.container")

#: Fetch a retry partition again: ``(tp, from_start) -> done``.
Refetch = Callable[[TP, bool], bool]
#: How long a due record may wait unconsumed before it is reported stalled.
RETRY_STALL_CHECK_S = 30.0
#: How long a due record may wait unconsumed before its partition is fetched again (once per record).
REFETCH_AFTER_S = 5.0


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
        self._next = time.monotonic() + _interval()
        #: retry TP -> ((due ms, input TP, input offset) of its record due first, since when (monotonic seconds)).
        self._heads: dict[TP, tuple[tuple[int, TP, int], float]] = {}
        #: The heads whose partition was fetched again for them, and how many times (at most twice).
        self._refetched: dict[tuple[int, TP, int], int] = {}
        #: Retry partitions reported stalled -> when (monotonic seconds).
        self.stalled: dict[TP, float] = {}

    def maybe_run(self, now: float, refetch: Refetch | None = None) -> None:
        """Look, if a look's interval has passed since the last one (``now``: monotonic seconds); ``refetch``
        fetches a retry partition again (from its start if asked; False if it did not)."""
        if self._hops is None or now < self._next:
            return
        self._next = now + _interval()
        self.run(now, refetch)

    def run(self, now: float, refetch: Refetch | None = None) -> None:
        assert self._hops is not None
        heads = self._hops.book.heads()
        now_ms = int(self._clock() * 1000)
        previous, self._heads = self._heads, {}
        for tp, (due_ms, input_tp, offset, _records) in heads.items():
            head = (due_ms, input_tp, offset)
            seen = previous.get(tp)
            self._heads[tp] = (head, seen[1] if seen is not None and seen[0] == head else now)
        for tp in [tp for tp in self.stalled if self._heads.get(tp, (None,))[0] != previous.get(tp, (None,))[0]]:
            self._flowing(tp, now)
        current = {head for head, _since in self._heads.values()}
        self._refetched = {head: n for head, n in self._refetched.items() if head in current}
        for tp, (due_ms, _input, _offset, records) in heads.items():
            head, since = self._heads[tp]
            unconsumed = min(now - since, (now_ms - due_ms) / 1000.0)  # due, and the same record, for this long
            times = self._refetched.get(head, 0)
            if refetch is not None and times < 2 and unconsumed >= REFETCH_AFTER_S * (times + 1):
                if refetch(tp, times == 1):  # again after the last record delivered, then from the start
                    self._refetched[head] = times + 1
            if tp in self.stalled or unconsumed < RETRY_STALL_CHECK_S:
                continue
            due_for = (now_ms - due_ms) / 1000.0
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


def _interval() -> float:
    """How often to look: often enough for both rules (read at each look, so that tests can shorten them)."""
    return min(REFETCH_AFTER_S, RETRY_STALL_CHECK_S)
