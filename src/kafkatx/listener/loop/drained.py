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
resumes it, or when it is assigned again. After a hop, the partition is
paused again only once the client has seen the high watermark move past what
it knew before the hop was written: until then the hop may still be on its way,
and a pause would leave it unread. That mark is taken at each feed poll, before
the container handles what it brought (:meth:`DrainedPartitions.before_handling`):
taken when the hop is looked at, after its transaction committed, it could
already include the hop (a fetching partition fetched it meanwhile), and the
partition, read to its end, was then fetched in a loop until the next hop.
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
        #: Written to: the high watermark known then; paused again only once the client knows a higher one.
        self._written_at: dict[TP, int] = {}
        #: Where fetching starts for those with no record read yet (librdkafka's position is unset until one is).
        self._start: dict[TP, int] = {}
        #: The high watermarks the client knew at the last feed poll: hops written after it land above them.
        self._high_before: dict[TP, int] = {}

    def pause_read_to_end(self, consumer: Consumer, assigned: Iterable[TP]) -> None:
        """Pause the partitions of ``assigned`` whose position reached their high watermark (as last fetched)."""
        fetching = [tp for tp in assigned if tp not in self.paused]
        if not fetching:
            return
        positions = {(p.topic, p.partition): p.offset for p in consumer.position(topic_partitions(fetching))}
        unread = [tp for tp in fetching if positions.get(tp, -1) < 0 and tp not in self._start]
        if unread:
            self._start.update(_starts(consumer, unread))
        ends = []
        for tp in fetching:
            position = positions.get(tp, -1)
            position = position if position >= 0 else self._start.get(tp, -1)
            high = _cached_high(consumer, tp)
            if 0 <= high <= position and high > self._written_at.get(tp, -1):
                ends.append(tp)
        if ends:
            quietly(consumer.pause, ends)
            self.paused.update(ends)
            for tp in ends:
                self._written_at.pop(tp, None)

    def written(self, consumer: Consumer, due_ms: Mapping[TP, int], assigned: set[TP]) -> dict[TP, int]:
        """Hops were written to ``due_ms``' partitions (each: when the first of them is due, epoch ms): they are
        fetched until the client has read past them. Returns those paused here, which stay paused: the caller
        holds each until its hop is due (then :meth:`resumed`), or fetches it at once (:meth:`fetch_again`)."""
        sleeping = {}
        before = self._high_before
        for tp, due in due_ms.items():
            if tp in assigned:
                high = before[tp] if tp in before else _cached_high(consumer, tp)
                self._written_at[tp] = max(self._written_at.get(tp, -1), high)
                if tp in self.paused:
                    sleeping[tp] = due
        return sleeping

    def before_handling(self, consumer: Consumer, assigned: Iterable[TP]) -> None:
        """Note the high watermarks the client knows now, before the container handles a poll: a hop it writes
        to one of ``assigned`` lands above its mark, so a high watermark past the mark means the hop was fetched."""
        self._high_before = {tp: _cached_high(consumer, tp) for tp in assigned}

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
            self._written_at.pop(tp, None)
            self._start.pop(tp, None)
            self._high_before.pop(tp, None)


def _starts(consumer: Consumer, tps: list[TP]) -> dict[TP, int]:
    """Where fetching ``tps`` starts: the group's committed offset, else the partition's first (earliest)."""
    try:
        committed = consumer.committed(topic_partitions(tps), timeout=5)
    except Exception:
        log.debug("committed offsets of retry partitions %s unknown", tps, exc_info=True)
        return {}
    starts = {}
    for c in committed:
        tp = (c.topic, c.partition)
        if c.offset >= 0:
            starts[tp] = c.offset
        else:
            try:
                starts[tp] = int(consumer.get_watermark_offsets(c, cached=True)[0])
            except Exception:
                continue
    return starts


def _cached_high(consumer: Consumer, tp: TP) -> int:
    """The high watermark the client last fetched for ``tp`` (negative when it has none)."""
    try:
        offsets = consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)
    except Exception:
        return -1
    return -1 if offsets is None else int(offsets[1])
