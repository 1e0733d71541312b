"""``retry="topics"``: the loop stage that feeds a container the records of its retry partitions.

The retry partitions of input partition ``(T, p)`` are ``(T + suffix, p)``
(a hop keeps the record's partition, :mod:`kafkatx.retry_topics`), and they
belong to whoever owns ``(T, p)``: the failure state of an input partition
stays with one container. The group's assignor cannot put them together (it
sees topics, not their pairing), so the retry topics are not subscribed: a
second consumer (the container's consumer config, the same ``group.id``,
read_committed, no auto commit) that never joins the group is assigned the
mirrored retry partitions when input partitions are assigned
(``incremental_assign`` from the group's committed offsets; earliest when none
is committed yet), and unassigned when they are revoked or lost.

Their offsets are committed by the container's transactions like the input
partitions' (a retry partition's commits go through the producer of its input
partition, see ``ListenerContainer._producer_for``). Every seek, pause and
resume of a retry partition reaches this consumer (the container routes them
by topic, in one place).

**The due-time gate.** A retry topic holds records of one delay, in the order
they failed, so a partition's head is always the record due first. Of what a
poll brings, each retry partition's records up to the first one not yet due
are handed on; that one and the rest of its partition wait in memory, the
partition paused, and each poll hands on those that came due
(:mod:`~kafkatx.listener.loop.waiting_retries`; a pause, never a sleep, and
never with a transaction open). A record is handed on at the first poll after
it is due: at most a poll's wait (``max_batch_ms``) late. Waking the poll for
each due time instead made the loop's turns, and so its transactions, small
while retries came due every few milliseconds (run 4t: 283 transactions
instead of 55 for 200,000 records, the main flow 0.31x run 2 instead of 0.41x).

**The records in retry** (:mod:`kafkatx.retry_topics.keys`: with ``ordering="key"`` the
keys in retry, with either ordering their count and earliest due time) are rebuilt
when input partitions are assigned, never carried in memory from an earlier
owner: their retry partitions are read from the committed offsets (fetched
with the input partitions', read_committed, so a previous owner's pending
commit is waited for) to their end, on a third consumer of the same group
that never commits, and every hop found is a record in retry. Until it is
read to the end the assignment callback does not return, so nothing of the
partition is handled before its keys are known. A count from the committed
offsets and the ends would not do: a transaction's commit marker takes an
offset too, and a committed offset can stay below one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Mapping
from typing import Any, cast

from confluent_kafka import OFFSET_BEGINNING, OFFSET_INVALID, Consumer, KafkaError, Message, TopicPartition

from kafkatx.client.offsets import TP
from kafkatx.client.partitions import partition_list, quietly
from kafkatx.errors import KafkaTxError
from kafkatx.listener.host import ContainerPositions
from kafkatx.listener.loop.drained import DrainedPartitions
from kafkatx.listener.loop.retry_stalls import RetryStalls
from kafkatx.listener.loop.waiting_retries import WaitingRetries
from kafkatx.record import ConsumedMessage
from kafkatx.retry_topics.headers import due_ms_of
from kafkatx.retry_topics.hops import RetryHops
from kafkatx.retry_topics.keys import Place

__all__ = ["RetryFeed", "feed_fetching", "first_offset", "nothing_past", "read_to_end"]

log = logging.getLogger("kafkatx.container")

#: Properties of the container's consumer config that the retry consumer leaves out: it never joins the group
#: (no static identity to claim), and the lag metrics read the container's consumer's statistics only.
_NOT_FOR_THE_FEED = ("group.instance.id", "stats_cb", "statistics.interval.ms")
#: The retry consumer's fetching once a fetch brought records: its next fetch waits until the container has polled
#: its queue and up to ``fetch.queue.backoff.ms`` more (librdkafka postpones a partition's fetch while the
#: consumer's queue holds ``queued.min.messages`` ops). At librdkafka's defaults it fetched on at once, and a broker
#: that answers an empty fetch at once (the embedded one) answered it in a loop until the due-time gate paused the
#: partition at the container's next poll: about one fetch per retry record read (run 4t: 36,000 fetches for 20,000
#: records, against 300 with these), each taking the broker's time from the main flow. librdkafka counts every op
#: in that queue, not only records: log lines (kafkatx's logger takes them through the queue) and statistics
#: (never given to this consumer) too. An op waiting holds fetching back until the container's next poll takes it,
#: which is harmless while they are rare, but ``debug`` logging makes them a stream that can hold fetching back
#: for good: with ``debug`` set, the retry consumer keeps librdkafka's defaults (:func:`feed_fetching`).
_FETCH_AFTER_POLL = {"queued.min.messages": 1, "fetch.queue.backoff.ms": 50}
#: How long rebuilding the records in retry of an assignment may go without progress (reading retry partitions to
#: their end: a large backlog takes as long as it takes, a read that stalls stops the container).
REBUILD_TIMEOUT_S = 30.0
#: How long the rebuild waits for a retry partition's first offset before leaving it to librdkafka.
_WATERMARK_TIMEOUT_S = 5.0
#: How long before a held retry partition's next record is due its hold ends: the fetch after a resume takes a
#: while, and a record fetched early waits in memory (its partition paused) for its time.
WAKE_EARLY_MS = 300


class RetryFeed:
    """The retry partitions mirrored from a container's assignment, on a consumer of their own."""

    def __init__(
        self, hops: RetryHops | None, consumer_config: dict[str, Any], name: str, stalls: RetryStalls | None = None
    ) -> None:
        """``hops`` None: a listener without retry topics, for which this feed holds nothing and opens nothing.
        ``stalls``: the check of retry partitions whose due records are not consumed, run on each poll."""
        self.hops = hops
        self.name = name
        self.stalls = stalls if stalls is not None else RetryStalls(hops, name, 0, lambda event: None)
        config = {k: v for k, v in consumer_config.items() if k not in _NOT_FOR_THE_FEED}
        config["auto.offset.reset"] = "earliest"  # no commit yet: every hop written so far is this owner's
        config["enable.auto.commit"] = False
        config.update(feed_fetching(config))
        self._config = config
        self.consumer: Consumer | None = None
        #: Key order: reads retry partitions to their end at assignment (rebuild), never commits.
        self._scanner: Consumer | None = None
        #: The retry partitions this feed holds now.
        self.assigned: set[TP] = set()
        #: Those of them read to their end, paused until a hop is written to them (drained.py).
        self._drained = DrainedPartitions()
        #: The records fetched before they were due, waiting in memory (waiting_retries.py).
        self._waiting = WaitingRetries()
        #: The retry partitions whose waiting records the last poll handed on: the container handles them.
        self._released: set[TP] = set()
        #: Per retry partition, the offset after the last record this consumer delivered (or where it was sought):
        #: where a partition whose position ran past undelivered records is fetched again from (:meth:`refetch`).
        self._delivered: dict[TP, int] = {}
        #: Retry partitions fetched again from their start: their records below this offset were delivered already.
        self._skip_below: dict[TP, int] = {}
        #: retry topic -> input topic
        self._origin = (
            {} if hops is None else {retry: topic for topic in hops.inputs for retry in hops.plan.topics(topic)}
        )

    def open(self) -> None:
        if self.hops is None:
            return
        self.consumer = Consumer(self._config)
        self._scanner = Consumer({**self._config, "enable.partition.eof": True})
        log.info(
            "listener %s: retry topics %s, fed by a consumer of their own", self.name, ", ".join(self._origin) or "none"
        )

    def close(self) -> None:
        consumers, self.consumer, self._scanner = (self.consumer, self._scanner), None, None
        self._drained.forget(self.assigned)
        self._waiting.clear()
        if self.hops is not None:
            self.hops.undelivered(self.assigned)
        self.assigned.clear()
        for consumer in consumers:
            if consumer is not None:
                try:
                    consumer.close()
                except Exception:
                    log.debug("closing a retry consumer failed", exc_info=True)

    def consumer_of(self, tp: TP, container_consumer: Consumer | None) -> Consumer | None:
        """The consumer that fetches ``tp``: this one for a retry partition, else the container's."""
        return self.consumer if self._origin and tp[0] in self._origin else container_consumer

    def sought(self, tp: TP, offset: int, held: bool = False) -> None:
        """The container sought ``tp`` to ``offset``: if it is a retry partition, what of it waits in memory is
        fetched again from there, and one paused as read to its end is fetched again; resumed now unless the
        container ``held`` it paused (then when its pause ends, :meth:`resume`)."""
        if tp in self.assigned:
            self._delivered[tp] = offset
            self._skip_below.pop(tp, None)
            self._drained.sought_to(tp, offset)
        consumer = None if held else self.consumer
        self._waiting.drop(consumer, (tp,))
        self._drained.fetch_again(consumer, (tp,))

    def input_of(self, tp: TP) -> TP:
        """The input partition a retry partition mirrors (``tp`` itself for an input partition)."""
        if not self._origin:
            return tp
        origin = self._origin.get(tp[0])
        return tp if origin is None else (origin, tp[1])

    def held(self, paused: Collection[TP]) -> list[TP]:
        """Of the container's ``paused`` partitions, the retry partitions whose records in the last poll must not be
        handled: those whose waiting records that poll handed on are left out (they came due in memory)."""
        origin, released = self._origin, self._released
        return [tp for tp in paused if tp[0] in origin and tp not in released]

    def inputs_of(self, paused: Collection[TP]) -> list[TP]:
        """Of the container's ``paused`` partitions, the input partitions (fetched by the container's consumer)."""
        origin = self._origin
        return [tp for tp in paused if tp[0] not in origin]

    def resume(self, tps: list[TP], container_consumer: Consumer) -> None:
        """Resume ``tps``, each on the consumer that fetches it (a pause's end)."""
        mine = [
            TopicPartition(t, p) for t, p in tps if self._origin and t in self._origin and (t, p) not in self._waiting
        ]
        theirs = [TopicPartition(t, p) for t, p in tps if not self._origin or t not in self._origin]
        self._drained.resumed((tp.topic, tp.partition) for tp in mine)  # resumed here, whatever paused them
        for consumer, some in ((container_consumer, theirs), (self.consumer, mine)):
            if consumer is not None and some:
                try:
                    consumer.resume(some)
                except Exception:
                    log.debug("resume of %s failed (revoked?)", some, exc_info=True)

    # -- the assignment, mirrored ------------------------------------------------------
    def assign(self, inputs: Iterable[TP]) -> list[TP]:
        """Input partitions ``inputs`` were assigned: take their retry partitions (from the committed offsets)."""
        consumer = self.consumer
        if consumer is None or self.hops is None:
            return []
        mirrored = [tp for tp in self.hops.mirrored(inputs) if tp not in self.assigned]
        if not mirrored:
            return []
        ends, starts = self._rebuild([tp for tp in inputs if tp[0] in self.hops.inputs], mirrored)
        # No offset given: librdkafka starts from the group's committed offset (auto.offset.reset when none),
        # read with require_stable under read_committed, so a previous owner's pending commit is waited for. One the
        # rebuild found ending at its committed offset starts there, paused until a hop is written to it: left
        # fetching, it was fetched in a loop until a poll found it at its end (drained.py).
        partitions = [TopicPartition(t, p, ends.get((t, p), OFFSET_INVALID)) for t, p in mirrored]
        consumer.incremental_assign(partitions)
        self.assigned.update(mirrored)
        self._drained.forget(mirrored)  # resumed below: a new assignment starts fetching
        try:  # librdkafka keeps a pause flag across unassign and assign: a new assignment starts unpaused
            consumer.resume(partitions)
        except Exception:
            log.debug("resume of newly assigned %s failed", mirrored, exc_info=True)
        self._drained.started(starts)
        self._drained.at_end(consumer, ends)
        log.info("listener %s assigned retry partitions %s", self.name, partition_list(mirrored))
        return mirrored

    def _rebuild(self, inputs: list[TP], mirrored: list[TP]) -> tuple[dict[TP, int], dict[TP, int]]:
        """The records in retry of ``inputs``, from their retry partitions ``mirrored`` read to the end. Returns
        those of ``mirrored`` whose end is their committed offset (or 0, none committed), each with its end: where
        fetching it would find the next hop written to it (none if the read failed); and where each of ``mirrored``
        starts (its committed offset, else its first offset; negative if not known)."""
        consumer, scanner, hops = self.consumer, self._scanner, self.hops
        assert consumer is not None and scanner is not None and hops is not None
        wanted = [TopicPartition(t, p) for t, p in [*inputs, *mirrored]]
        committed = {(c.topic, c.partition): c.offset for c in consumer.committed(wanted, REBUILD_TIMEOUT_S)}
        starts = [TopicPartition(t, p, first_offset(scanner, (t, p), committed.get((t, p), -1))) for t, p in mirrored]
        self._delivered.update(((tp.topic, tp.partition), tp.offset) for tp in starts)
        started = {(tp.topic, tp.partition): tp.offset for tp in starts}
        found: dict[TP, list[tuple[bytes | None, int, Place]]] = {tp: [] for tp in inputs}
        ends: dict[TP, int] = {}
        try:
            read = read_to_end(scanner, starts, self.name, ends)
        except KafkaTxError as stalled:
            if hops.keys is not None:  # key order depends on it
                raise KafkaTxError(
                    f"{stalled}; the container stops rather than let a record pass one of its key in retry"
                ) from stalled
            # ordering="none": only the count of records in retry depends on it; the records flow without it
            log.warning(
                "listener %s: %s; records in retry are not counted until the next assignment", self.name, stalled
            )
            return {}, started
        for msg in read:
            ends.pop((msg.topic(), msg.partition()), None)  # a record read (after its end was seen too): not paused
            hop = hops.hop_of(msg)
            if hop is not None:
                tp, key, offset = hop
                found.setdefault(tp, []).append((key, offset, Place(msg.topic(), due_ms_of(msg.headers()))))
        for tp, in_retry in found.items():
            hops.book.rebuilt(tp, in_retry)
        log.info(
            "listener %s: %d record(s) in retry on %s, rebuilt from the retry topics",
            self.name,
            sum(len(f) for f in found.values()),
            partition_list(inputs),
        )
        ends = nothing_past(starts, ends)
        self._delivered.update(ends)
        return ends, started

    def revoke(self, inputs: Iterable[TP]) -> list[TP]:
        """Input partitions ``inputs`` were revoked or lost: give up their retry partitions; returns them."""
        inputs = list(inputs)
        mirrored = [tp for tp in self.hops.mirrored(inputs) if tp in self.assigned] if self.hops is not None else []
        if not mirrored:
            return []
        if self.hops is not None:
            self.hops.book.forget(inputs)  # their next owner rebuilds them from the retry topics
            self.hops.undelivered(mirrored)
        self.assigned.difference_update(mirrored)
        self._drained.forget(mirrored)
        self._waiting.drop(None, mirrored)
        for tp in mirrored:
            self._delivered.pop(tp, None)
            self._skip_below.pop(tp, None)
        consumer = self.consumer
        if consumer is not None:
            try:
                consumer.incremental_unassign([TopicPartition(t, p) for t, p in mirrored])
            except Exception:
                log.debug("unassigning retry partitions %s failed", mirrored, exc_info=True)
        return mirrored

    # -- the stage ------------------------------------------------------------------
    def poll(self, max_records: int, positions: ContainerPositions) -> list[Message]:
        """What the retry partitions have that is due (errors too, for the container to report): the records
        waiting in memory that came due, then those of this poll up to each partition's first one not due, which
        waits in memory with the rest of its partition (``positions``: the container's)."""
        consumer, hops, waiting = self.consumer, self.hops, self._waiting
        self._released.clear()
        # retry partitions with due records not consumed (retry_stalls.py): fetched again, then reported
        self.stalls.maybe_run(time.monotonic(), lambda tp, start: self.refetch(tp, positions, start))
        if consumer is None or hops is None or not self.assigned:
            return []
        if hops.written:  # hops written since the last look: their partitions are fetched until read past them
            self._wake_when_due(consumer, positions)
        msgs = consumer.consume(max_records, 0)
        now_ms = int(time.time() * 1000)
        # fetched before the records of this poll: they go first
        released = waiting.release(consumer, now_ms, self._drained.sought_to)
        # Narrowed as in positions.records_to_handle: a Message without an error has a topic, partition, offset.
        records = cast("list[ConsumedMessage]", [m for m in msgs if m.error() is None])
        errors = [m for m in msgs if m.error() is not None] if len(records) != len(msgs) else None
        if records and self._skip_below:
            records = self._unseen(records)
        if records:
            delivered = self._delivered
            for record in records:
                delivered[(record.topic(), record.partition())] = record.offset() + 1
        due = waiting.sort(consumer, records, now_ms) if records else records
        # Those read to their end are paused before the container handles what this poll brought: left fetching
        # while it does, they would be fetched in a loop on a broker that answers an empty fetch at once. Those
        # whose records wait in memory are paused past them already, and resumed when none waits (a hop written
        # to one meanwhile is fetched then: drained.py's high watermark rule).
        ends = self._drained.pause_read_to_end(consumer, [tp for tp in self.assigned if tp not in waiting])
        held = positions.paused_until
        waking = {tp: due for tp, (_at, due) in ends.items() if tp not in held}  # a hold under way goes on
        if waking:  # at their end but for hops not seen yet: held until the first of those is due
            self._hold_until_due(consumer, positions, waking)
        self._drained.before_handling(consumer, self.assigned)
        if not msgs and not released:
            return msgs
        self._released.update((m.topic(), m.partition()) for m in released)
        hops.delivered(released)
        hops.delivered(due)
        handed = cast("list[Message]", [*released, *due])
        return handed if errors is None else errors + handed

    def _unseen(self, records: list[ConsumedMessage]) -> list[ConsumedMessage]:
        """``records`` but those a partition fetched again from its start had delivered already."""
        skip = self._skip_below
        unseen = []
        for record in records:
            tp = (record.topic(), record.partition())
            below = skip.get(tp)
            if below is not None:
                if record.offset() < below:
                    continue
                del skip[tp]
            unseen.append(record)
        return unseen

    def refetch(self, tp: TP, positions: ContainerPositions, from_start: bool = False) -> bool:
        """Fetch retry partition ``tp`` again from after the last record this consumer delivered of it: its due
        record was not consumed. True if it did; not while its records wait in memory or the container holds it.

        On the embedded broker a read_committed fetch that starts past the marker of a producer's aborted
        transaction skips that producer's later records, committed ones too (docs/BROKERS.md): the consumer's
        position runs past hops that were never delivered. It happens to a retry partition after a restart
        aborted its predecessor's open transaction holding a hop, and the same producer (same transactional id)
        wrote the next hops. A fetch from an offset before the marker sees it and delivers them: after the last
        record delivered, or, ``from_start``, from the partition's start (an older abort's marker; the records
        delivered already are left out). On Apache Kafka the fetch is only repeated (a transaction left open
        holds the partition all the same)."""
        consumer = self.consumer
        offset = self._delivered.get(tp)
        if consumer is None or offset is None or tp not in self.assigned:
            return False
        if tp in self._waiting or tp in positions.paused_until:
            return False
        try:
            consumer.seek(TopicPartition(tp[0], tp[1], OFFSET_BEGINNING if from_start else offset))
        except Exception:
            log.debug("refetch of retry partition %s failed (revoked?)", tp, exc_info=True)
            return False
        if from_start:
            self._skip_below[tp] = offset
        self._drained.sought_to(tp, 0 if from_start else offset)
        self._drained.fetch_again(consumer, (tp,))
        log.info(
            "listener %s: retry partition %s[%d]: its due record was not consumed; fetching it again from %s",
            self.name,
            tp[0],
            tp[1],
            f"its start (delivered up to offset {offset})" if from_start else f"offset {offset}",
        )
        return True

    def _wake_when_due(self, consumer: Consumer, positions: ContainerPositions) -> None:
        """The retry partitions hops were written to since the last look: one read to its end stays paused until
        the first hop written to it is due (the container's timed pause resumes it then; drained.py)."""
        hops = self.hops
        assert hops is not None
        sleeping = self._drained.written(consumer, hops.written, self.assigned)
        hops.written.clear()
        if sleeping:
            self._hold_until_due(consumer, positions, sleeping)

    def _hold_until_due(self, consumer: Consumer, positions: ContainerPositions, due: dict[TP, int]) -> None:
        """Hold each partition of ``due`` (at its end, or paused as read to it) paused by the container until its
        time (epoch ms), sought to where it is so that it is fetched as soon as the hold ends; one due already is
        fetched now."""
        now_ms = int(time.time() * 1000)
        at = {(p.topic, p.partition): p.offset for p in consumer.position([TopicPartition(*tp) for tp in due])}
        for tp, due_ms in due.items():
            wake_ms = due_ms - WAKE_EARLY_MS
            if wake_ms > now_ms:
                positions.pause(tp, (wake_ms - now_ms) / 1000.0)
            offset = at.get(tp, -1)
            offset = offset if offset >= 0 else self._drained.position_known(tp)
            if tp in positions.paused_until and offset >= 0 and _seek(consumer, tp, offset):
                self._drained.sought_to(tp, offset)
                self._drained.held_elsewhere(tp)
            else:  # due already, or not paused (revoked meanwhile): fetched now
                self._drained.fetch_again(consumer, (tp,))


def first_offset(scanner: Consumer, tp: TP, committed: int) -> int:
    """Where reading retry partition ``tp`` starts: its committed offset, else its first offset (asked now; if that
    fails, librdkafka's "beginning"). Left to librdkafka as the beginning, its lookup made each rebuild of an
    assignment take half a second longer, most of it fetching the partitions already at their end in a loop."""
    if committed >= 0:
        return committed
    try:
        low = scanner.get_watermark_offsets(TopicPartition(*tp), timeout=_WATERMARK_TIMEOUT_S)
    except Exception:
        log.debug("first offset of retry partition %s unknown", tp, exc_info=True)
        return OFFSET_BEGINNING
    return OFFSET_BEGINNING if low is None or low[0] < 0 else int(low[0])


def feed_fetching(config: dict[str, Any]) -> dict[str, Any]:
    """The fetch settings of a retry consumer of ``config``: fetch again only after a poll (see
    :data:`_FETCH_AFTER_POLL`, in place of the container's consumer's, which are for the input's flow) unless
    ``debug`` logging is on."""
    return {} if config.get("debug") else dict(_FETCH_AFTER_POLL)


def nothing_past(starts: Iterable[TopicPartition], ends: Mapping[TP, int]) -> dict[TP, int]:
    """Of the partitions read from ``starts`` to ``ends`` without a record, those with nothing at all between: each
    ends where it started (or at 0, read from its beginning). A retry partition is assigned there, paused.

    Not the others: what lies unread between is aborted records and transaction markers, and on the embedded broker
    a read_committed fetch that starts past an abort marker skips the same producer's later records
    (:meth:`RetryFeed.refetch`); fetched from the committed offset, the marker is seen."""
    begin = {(tp.topic, tp.partition): tp.offset for tp in starts}
    return {
        tp: end
        for tp, end in ends.items()
        if tp in begin and (end == begin[tp] or (begin[tp] == OFFSET_BEGINNING and end == 0))
    }


def read_to_end(
    scanner: Consumer, starts: list[TopicPartition], name: str, ends: dict[TP, int] | None = None
) -> list[ConsumedMessage]:
    """What ``starts``' partitions hold from their offsets to their end (read_committed: the last stable offset);
    :class:`~kafkatx.KafkaTxError` once :data:`REBUILD_TIMEOUT_S` passed without a record or an end reached.
    ``ends``, if given, gets each partition's end offset."""
    records: list[ConsumedMessage] = []
    if not starts:
        return records
    left = {(tp.topic, tp.partition) for tp in starts}
    scanner.assign(starts)
    quietly(scanner.resume, left)  # librdkafka keeps a pause flag across assignments: paused at an end before
    try:
        deadline = time.monotonic() + REBUILD_TIMEOUT_S
        while left:
            if time.monotonic() > deadline:
                raise KafkaTxError(
                    f"listener {name!r}: reading the retry partitions {partition_list(left)} to their end made no "
                    f"progress for {REBUILD_TIMEOUT_S:g}s, so the records in retry cannot be rebuilt"
                )
            # a short wait: consume() returns at its timeout unless 500 events came, and each partition's end is
            # only paused once seen here
            msgs = scanner.consume(500, 0.02)
            for msg in msgs:
                error = msg.error()
                if error is None:
                    records.append(cast("ConsumedMessage", msg))
                elif error.code() == KafkaError._PARTITION_EOF:
                    end = cast("ConsumedMessage", msg)  # an end of partition names its partition and offset
                    left.discard((end.topic(), end.partition()))
                    # read to its end: left fetching while the others are read, fetched in a loop on a broker that
                    # answers an empty fetch at once
                    quietly(scanner.pause, [(end.topic(), end.partition())])
                    if ends is not None:
                        ends[(end.topic(), end.partition())] = end.offset()
                else:
                    log.warning("listener %s: reading the retry partitions: %s", name, error)
            if msgs:
                deadline = time.monotonic() + REBUILD_TIMEOUT_S
    finally:
        scanner.unassign()
    return records


def _seek(consumer: Consumer, tp: TP, offset: int) -> bool:
    """Seek a paused ``tp`` to where it is: librdkafka then fetches it as soon as it is resumed (left as it is, a
    partition paused at its end was fetched up to a second after its resume). False if it failed (revoked?)."""
    try:
        consumer.seek(TopicPartition(tp[0], tp[1], offset))
    except Exception:
        log.debug("seek of retry partition %s failed", tp, exc_info=True)
        return False
    return True
