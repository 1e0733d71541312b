"""Retry partitions read to their end wait paused until a hop written to them is due.

A retry partition mostly holds nothing: records arrive there only as hops this
container writes (the owner of input partition ``(T, p)`` is the only writer
of its retry partitions), or were there when it was assigned. Fetching an
empty partition costs a fetch request per answer, and a broker that answers an
empty fetch at once (the embedded one: ``fetch.wait.max.ms`` is not honoured)
turns that into a busy loop of the client and the broker: about a third of a
core for one listener's retry partitions, taken from the main flow.

So a retry partition whose position reached its high watermark is paused. A
hop written to it is due a back-off later, and nothing before it is in the
partition: the feed hands the partition to the container's timed pause until
then (:meth:`DrainedPartitions.written`), so it is fetched once, when there
is something due to read, rather than fetched for the hop at once and paused
again at it by the due-time gate. A paused partition is also fetched again
when the container seeks it (a record handled from it is fetched again) or
resumes it, or when it is assigned again.

A hop the client has not seen yet is one written since the high watermark it
knows: the partition is read to its end only once the client has seen the
high watermark move past the mark taken before the hop was written. A
partition at its end with such hops waits for the first of them to be due the
same way (:meth:`DrainedPartitions.pause_read_to_end` returns it, the feed hands
it to the container's timed pause), and is fetched on while one is due already
(its transaction commits within the poll). Left fetching until it saw them,
a partition resumed for a due record was fetched in a loop between the feed's
polls (run 4t: about ten thousand empty fetches a second on the embedded
broker; docs/BENCHMARKS.md). The mark is taken at each feed poll, before
the container handles what it brought (:meth:`DrainedPartitions.before_handling`):
taken when the hop is looked at, after its transaction committed, it could
already include the hop (a fetching partition fetched it meanwhile), and the
partition, read to its end, was then fetched in a loop until the next hop.

librdkafka reports no position for a partition between a seek and the first
record it delivers after it, so every seek of a retry partition is told here
(:meth:`DrainedPartitions.sought_to`): its position is where it was sought until
a record is read. Counted as unknown, a partition resumed past its waiting
records could not be seen at its end, and was fetched in a loop until its next
hop came.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from confluent_kafka import Consumer, TopicPartition

from kafkatx.client.offsets import TP
from kafkatx.client.partitions import quietly, topic_partitions

__all__ = ["DrainedPartitions"]

log = logging.getLogger("kafkatx.container")


class DrainedPartitions:
    """The retry partitions a feed keeps paused because there is nothing in them to fetch (see the module)."""

    def __init__(self) -> None:
        #: Paused here: read to their end, nothing written to them since.
        self.paused: set[TP] = set()
        #: The hops written and not seen yet, per partition: (the high watermark the client knew before the hop was
        #: written, when the hop is due in epoch ms). Seen once the client knows a higher high watermark.
        self._unseen: dict[TP, list[tuple[int, int]]] = {}
        #: Where fetching starts for those with no record read since they were assigned or sought (librdkafka's
        #: position is unset until one is).
        self._start: dict[TP, int] = {}
        #: The high watermarks the client knew at the last feed poll: hops written after it land above them.
        self._high_before: dict[TP, int] = {}

    def pause_read_to_end(self, consumer: Consumer, assigned: Iterable[TP]) -> dict[TP, tuple[int, int]]:
        """Pause the partitions of ``assigned`` whose position reached their high watermark (as last fetched) and
        that have no hop the client has not seen. Returns those at their end but for such hops, each with its
        position and when the first of those hops is due (epoch ms): the caller holds each paused until then, or
        leaves it fetching if one is due already."""
        fetching = [tp for tp in assigned if tp not in self.paused]
        if not fetching:
            return {}
        positions = {(p.topic, p.partition): p.offset for p in consumer.position(topic_partitions(fetching))}
        unread = [tp for tp in fetching if positions.get(tp, -1) < 0 and tp not in self._start]
        if unread:  # assigned without a start told (:meth:`started`): from the first offset, once the client knows it
            self._start.update(_first_offsets(consumer, unread))
        ends, waking = [], {}
        for tp in fetching:
            position = positions.get(tp, -1)
            position = position if position >= 0 else self._start.get(tp, -1)
            high = _cached_high(consumer, tp)
            if not 0 <= high <= position:
                continue
            unseen = self._unseen.get(tp)
            if unseen:
                unseen = [hop for hop in unseen if hop[0] >= high]  # a higher high watermark seen: the hop was read
            if unseen:
                self._unseen[tp] = unseen
                waking[tp] = (position, min(due for _mark, due in unseen))
            else:
                self._unseen.pop(tp, None)
                ends.append(tp)
        if ends:
            quietly(consumer.pause, ends)
            self.paused.update(ends)
        return waking

    def started(self, starts: Mapping[TP, int]) -> None:
        """Newly assigned partitions start fetching at ``starts`` (each: its committed offset, else its first
        offset, as the rebuild at assignment asked them; a negative one, not known, is left out)."""
        self._start.update((tp, offset) for tp, offset in starts.items() if offset >= 0)

    def at_end(self, consumer: Consumer, ends: Mapping[TP, int]) -> None:
        """``ends``' partitions were just assigned at their end (each: its offset), read to it by the rebuild:
        paused here until a hop is written to them."""
        if ends:
            for tp, offset in ends.items():
                self.sought_to(tp, offset)
            quietly(consumer.pause, list(ends))
            self.paused.update(ends)

    def written(self, consumer: Consumer, due_ms: Mapping[TP, int], assigned: set[TP]) -> dict[TP, int]:
        """Hops were written to ``due_ms``' partitions (each: when the first of them is due, epoch ms): they are
        fetched until the client has read past them. Returns those paused here, which stay paused: the caller
        holds each until its hop is due (then :meth:`resumed`), or fetches it at once (:meth:`fetch_again`)."""
        sleeping = {}
        before = self._high_before
        for tp, due in due_ms.items():
            if tp in assigned:
                high = before[tp] if tp in before else _cached_high(consumer, tp)
                seen = _cached_high(consumer, tp)  # those below what the client knows now were read
                unseen = [hop for hop in self._unseen.get(tp, ()) if hop[0] >= seen]
                if not unseen or unseen[-1][0] != high:  # one per mark: the first written is due first
                    unseen.append((high, due))
                self._unseen[tp] = unseen
                if tp in self.paused:
                    sleeping[tp] = due
        return sleeping

    def before_handling(self, consumer: Consumer, assigned: Iterable[TP]) -> None:
        """Note the high watermarks the client knows now, before the container handles a poll: a hop it writes
        to one of ``assigned`` lands above its mark, so a high watermark past the mark means the hop was fetched."""
        self._high_before = {tp: _cached_high(consumer, tp) for tp in assigned}

    def sought_to(self, tp: TP, offset: int) -> None:
        """``tp`` was sought to ``offset`` (a logical offset such as the start: fetched from offset 0, as far as
        the read-to-end check goes): its position until a record of it is read."""
        self._start[tp] = max(offset, 0)

    def position_known(self, tp: TP) -> int:
        """Where ``tp`` was last sought or started, for a partition librdkafka gives no position (-1 if unknown)."""
        return self._start.get(tp, -1)

    def held_elsewhere(self, tp: TP) -> None:
        """``tp`` stays paused, now by the container's timed pause (which resumes it): no longer read to its end."""
        self.paused.discard(tp)

    def resumed(self, tps: Iterable[TP]) -> None:
        """``tps`` were resumed by whoever paused them: fetched until read past any hop written to them."""
        self.paused.difference_update(tps)

    def fetch_again(self, consumer: Consumer | None, tps: Iterable[TP]) -> None:
        """``tps`` must be fetched (sought, resumed, assigned again): those paused here are resumed."""
        wake = [tp for tp in tps if tp in self.paused]
        if wake:
            self.paused.difference_update(wake)
            if consumer is not None:
                quietly(consumer.resume, wake)

    def forget(self, tps: Iterable[TP]) -> None:
        """``tps`` are no longer assigned."""
        for tp in tps:
            self.paused.discard(tp)
            self._unseen.pop(tp, None)
            self._start.pop(tp, None)
            self._high_before.pop(tp, None)


def _first_offsets(consumer: Consumer, tps: list[TP]) -> dict[TP, int]:
    """The first offsets of ``tps`` as the client knows them (its cached low watermarks); those not known yet are
    left out, to be asked again at the next look (kept as unknown, an empty partition was never seen at its end and
    was fetched in a loop for the whole run)."""
    starts = {}
    for tp in tps:
        try:
            low = int(consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)[0])
        except Exception:
            continue
        if low >= 0:
            starts[tp] = low
    return starts


def _cached_high(consumer: Consumer, tp: TP) -> int:
    """The high watermark the client last fetched for ``tp`` (negative when it has none)."""
    try:
        offsets = consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)
    except Exception:
        return -1
    return -1 if offsets is None else int(offsets[1])
