"""On a broker that answers an empty fetch at once, input partitions read to their end wait paused a moment.

Apache Kafka holds a fetch that finds nothing new for up to ``fetch.wait.max.ms``
(500 ms by default) and answers it as soon as a record arrives. The embedded
broker answers it at once, whatever the consumer asked, so a consumer at the end
of its partitions fetches in a loop: about 40,000 fetches a second for one idle
partition (measured with librdkafka's statistics), the broker's thread and
librdkafka's each busy. A listener at its end burned that much CPU on the
developer's machine for nothing; and while the last of a backlog was handled,
the partitions done first fetched in that loop beside it (run 4t: ~67,000
fetches, 8,986 in run 4t0, docs/BENCHMARKS.md).

So, on such a broker only, after each poll the container looks at the input
partitions its consumer fetches: one whose position reached its high watermark
(as last fetched) is paused for :data:`QUIET_HOLD_S`. When the hold ends, its
high watermark is asked of the broker, the partition still paused: one request
instead of thousands of fetches. Unchanged, the partition is held again; moved,
it is resumed, and the broker asked once more: a consumer whose partitions are
all paused lets librdkafka's broker thread sleep, and it fetched a resumed
partition only ~0.85 s after the pause (measured); a request to the broker wakes
it, and the fetch follows within a millisecond. (Resumed before being asked,
the partitions were fetched in a loop while the others were asked: ~30,000
fetches in run 4t.) Its position is past every record fetched, so
nothing is held back but what arrives meanwhile, which waits at most a hold.
Looked at right after the poll, a partition the poll read to its end is paused
before the container handles what it brought, not fetched in a loop meanwhile.

A partition the container holds for a reason of its own (a back-off,
``paused_until``) is not looked at, and one held here that another pause takes
over is left to it. A new assignment starts unpaused (the container resumes
it), so a partition revoked while held here is only forgotten. If the broker
does not answer the request, the partitions are left fetching and nothing is
held for :data:`QUIET_OFF_AFTER_FAILURE_S` (the container's outage handling
needs its thread more). The retry partitions have their own rule (drained.py).
Not with ``overlap_commit=True``: the records it handles during a commit are
polled there, where a hold would not end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Protocol

from confluent_kafka import Consumer, TopicPartition

from kafkatx.client.offsets import TP
from kafkatx.client.partitions import quietly

__all__ = ["QUIET_HOLD_S", "QuietPartitions"]

log = logging.getLogger("kafkatx.container")

#: How long an input partition at its end waits paused before its high watermark is asked again: what a record
#: produced to it meanwhile may wait, on the embedded broker only (Apache Kafka holds the fetch instead).
QUIET_HOLD_S = 0.05
#: How long the broker may take to tell a held partition's high watermark (it is local).
QUIET_ASK_TIMEOUT_S = 0.5
#: After the broker did not answer that, how long nothing is held.
QUIET_OFF_AFTER_FAILURE_S = 5.0
#: How long a partition is held at most before it is fetched once anyway. Asked of a read_committed consumer, the
#: broker tells the last stable offset, and a paused partition's high watermark is not fetched: a partition held
#: below a crashed producer's open transaction would never show the records waiting behind it (the stall check of
#: listener/loop/health.py looks for them, and /readyz reports them).
QUIET_REFRESH_S = 1.0


class QuietHost(Protocol):
    """What the check needs of its container."""

    consumer: Consumer | None
    assigned: set[TP]

    @property
    def paused_until(self) -> Mapping[TP, float]:
        """The partitions the container holds for reasons of its own."""

    def committed_offset(self, tp: TP) -> int | None:
        """The next offset of ``tp`` the container committed last, if any."""


class QuietPartitions:
    """The input partitions of one container held paused here because they are at their end (see the module)."""

    def __init__(self, host: QuietHost, clock: Callable[[], float] = time.monotonic) -> None:
        self._host = host
        self._clock = clock
        #: Paused here, and until when (``time.monotonic()``).
        self.held: dict[TP, float] = {}
        #: Until when nothing is held (the broker did not answer).
        self._off_until = 0.0
        #: Since when each held partition has been held without a fetch.
        self._since: dict[TP, float] = {}
        #: The high watermarks the broker told for partitions resumed because they moved: at their end only once
        #: the position reached them (the client's own, from its last fetch, may not have moved yet).
        self._told: dict[TP, int] = {}

    def after_poll(self) -> None:
        """A poll returned: ask again about the partitions whose hold ended, hold those read to their end."""
        host = self._host
        consumer = host.consumer
        if consumer is None or not host.assigned:
            self.held.clear()
            self._told.clear()
            self._since.clear()
            return
        now = self._clock()
        resumed: Collection[TP] = ()
        if self.held and min(self.held.values()) <= now:
            resumed = self._hold_ended(consumer, now)
        if now < self._off_until:
            return
        paused, held = host.paused_until, self.held
        # (those just resumed are looked at after the poll that fetches them)
        fetching = [tp for tp in host.assigned if tp not in held and tp not in paused and tp not in resumed]
        if fetching:
            ends = _at_end(consumer, fetching, host.committed_offset, self._told)
            if ends:
                self._hold(consumer, ends, now)

    @property
    def next_due(self) -> float | None:
        """When the first hold ends (``time.monotonic()``), for the poll not to wait past it; None if none."""
        return min(self.held.values()) if self.held else None

    def wake_by(self, other: float | None) -> float | None:
        """The earlier of ``other`` (a ``time.monotonic()`` or None) and :attr:`next_due`."""
        due = self.next_due
        return other if due is None or (other is not None and other <= due) else due

    def _hold(self, consumer: Consumer, tps: list[TP], now: float) -> None:
        quietly(consumer.pause, tps)
        for tp in tps:
            self._told.pop(tp, None)
            self._since.setdefault(tp, now)
        until = now + QUIET_HOLD_S
        self.held.update((tp, until) for tp in tps)

    def _hold_ended(self, consumer: Consumer, now: float) -> list[TP]:
        """The partitions whose hold ended: their high watermarks asked while still paused (resumed first, each
        would be fetched in a loop while the others are asked); those unchanged held again, those moved resumed,
        and those held :data:`QUIET_REFRESH_S` without a fetch resumed for one. Returns those resumed."""
        host = self._host
        assigned, paused, since = host.assigned, host.paused_until, self._since
        ended = [tp for tp, until in self.held.items() if until <= now]
        if not ended:
            return []
        for tp in ended:
            del self.held[tp]
        # revoked: the next assignment starts unpaused; held by the container: its pause resumes it
        due = [tp for tp in ended if tp in assigned and tp not in paused]
        for tp in ended:
            if tp not in due:
                since.pop(tp, None)
        if not due:
            return []
        if now < self._off_until:
            self._resume(consumer, due)
            return due
        resume: list[TP] = []
        for tp in due:
            high = self._ask(consumer, tp)
            if high is None:
                self._resume(consumer, due)
                return due
            if high < 0 or high > _start(consumer, tp, host.committed_offset, high):
                self._told[tp] = high
                resume.append(tp)
            elif now - since.get(tp, now) >= QUIET_REFRESH_S:
                resume.append(tp)
        until = now + QUIET_HOLD_S
        self.held.update((tp, until) for tp in due if tp not in resume)  # still paused
        if resume:
            self._resume(consumer, resume)
            # A consumer whose partitions were all paused lets librdkafka's broker thread sleep: it would fetch them
            # ~0.85 s later. A request to the broker wakes it, and the fetch follows within a millisecond.
            self._ask(consumer, resume[0])
        return resume

    def _resume(self, consumer: Consumer, tps: list[TP]) -> None:
        for tp in tps:
            self._since.pop(tp, None)
        quietly(consumer.resume, tps)

    def _ask(self, consumer: Consumer, tp: TP) -> int | None:
        """``tp``'s high watermark, asked of the broker; None if it did not answer (then nothing is held for a
        while)."""
        try:
            return int(consumer.get_watermark_offsets(TopicPartition(*tp), QUIET_ASK_TIMEOUT_S, cached=False)[1])
        except Exception:
            log.debug("high watermark of %s not known: partitions at their end are fetched", tp, exc_info=True)
            self._off_until = self._clock() + QUIET_OFF_AFTER_FAILURE_S
            return None


def _start(consumer: Consumer, tp: TP, committed: Callable[[TP], int | None], high: int) -> int:
    """Where the consumer fetches ``tp`` from (-1 if it cannot tell): its position; librdkafka reports none for a
    partition it delivered no record of since it was assigned (or sought), whose start is then the offset
    ``committed`` says, or, for a partition that holds nothing (its first offset is ``high``), wherever it is."""
    try:
        position = consumer.position([TopicPartition(*tp)])[0].offset
    except Exception:
        return -1
    if position >= 0:
        return int(position)
    known = committed(tp)
    if known is not None:
        return known
    try:
        low = consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)[0]
    except Exception:
        return -1
    return high if low == high else -1


def _at_end(consumer: Consumer, tps: list[TP], committed: Callable[[TP], int | None], told: dict[TP, int]) -> list[TP]:
    """Those of ``tps`` whose start (:func:`_start`) reached their high watermark as the client last fetched it, or
    as the broker ``told`` it since, if higher (the one told is forgotten once reached)."""
    ends = []
    for tp in tps:
        try:
            high = consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)[1]
        except Exception:
            continue
        if told:
            high = max(high, told.get(tp, -1))
        if 0 <= high <= _start(consumer, tp, committed, high):
            ends.append(tp)
    return ends
