"""Retry partitions read to their end wait paused until a hop written to them is due (listener/loop/drained.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from kafkatx.listener.loop.drained import DrainedPartitions
from kafkatx.listener.loop.retry_feed import first_offset, nothing_past

R0, R1 = ("t-retry", 0), ("t-retry", 1)


class FakeConsumer:
    """What DrainedPartitions reads of a consumer: positions, cached watermarks, pause/resume (no request: no
    committed offsets asked per poll; the rebuild at assignment tells where each partition starts)."""

    def __init__(self) -> None:
        self.positions: dict[tuple[str, int], int] = {}
        self.high: dict[tuple[str, int], int] = {}
        #: The cached low watermarks (0 unless set; -1001: none fetched yet).
        self.low: dict[tuple[str, int], int] = {}
        self.paused: set[tuple[str, int]] = set()
        self.requests = 0

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return [
            TopicPartition(p.topic, p.partition, self.positions.get((p.topic, p.partition), -1001)) for p in partitions
        ]

    def get_watermark_offsets(self, partition: TopicPartition, cached: bool = False) -> tuple[int, int]:
        assert cached, "only what the client already knows: no request per poll"
        tp = (partition.topic, partition.partition)
        return self.low.get(tp, 0), self.high.get(tp, -1001)

    def committed(self, partitions: list[TopicPartition], timeout: float = -1) -> list[TopicPartition]:
        """A request to the group coordinator, from the container's thread: counted, so that a test can say none."""
        self.requests += 1
        return [TopicPartition(p.topic, p.partition, -1001) for p in partitions]

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused.update((p.topic, p.partition) for p in partitions)

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.paused.difference_update((p.topic, p.partition) for p in partitions)

    def seek(self, partition: TopicPartition) -> None:
        self.positions[(partition.topic, partition.partition)] = partition.offset


def _setup() -> tuple[DrainedPartitions, FakeConsumer, Consumer]:
    fake = FakeConsumer()
    return DrainedPartitions(), fake, cast(Consumer, fake)


def test_a_partition_read_to_its_end_is_paused_and_one_with_records_left_is_not() -> None:
    drained, fake, consumer = _setup()
    fake.positions, fake.high = {R0: 5, R1: 3}, {R0: 5, R1: 7}
    drained.pause_read_to_end(consumer, {R0, R1})
    assert fake.paused == {R0} and drained.paused == {R0}


def test_a_partition_nothing_was_read_from_counts_from_where_the_rebuild_started_it_or_its_first_offset() -> None:
    drained, fake, consumer = _setup()
    fake.high = {R0: 4, R1: 4}
    # R0: the rebuild told its committed offset; R1: not told, fetched from its first offset (0), 4 records left
    drained.started({R0: 4, R1: OFFSET_BEGINNING})
    drained.pause_read_to_end(consumer, {R0, R1})
    assert fake.paused == {R0}
    drained.pause_read_to_end(consumer, {R0, R1})
    assert fake.paused == {R0}, "still unread: R1 keeps fetching"
    assert fake.requests == 0, "no committed offsets asked of the broker from the container's thread while it polls"


def test_a_partition_with_nothing_committed_is_paused_at_its_end_once_itsfirst_offset_is_known() -> None:
    """Its first look came before any fetch answered (no low watermark cached yet): the start is looked up again at
    the next look, not taken as unknown for good (the feed then fetched the empty partition in a loop all run)."""
    drained, fake, consumer = _setup()
    fake.low, fake.high = {R0: -1001}, {R0: -1001}
    drained.pause_read_to_end(consumer, {R0})
    assert fake.paused == set()
    fake.low, fake.high = {R0: 0}, {R0: 0}  # the first fetch answered: an empty partition
    drained.pause_read_to_end(consumer, {R0})
    assert fake.paused == {R0}


def test_a_partition_the_client_knows_nothing_of_yet_keeps_fetching() -> None:
    drained, fake, consumer = _setup()
    fake.positions = {R0: 5}  # no fetch answered yet: no high watermark known
    drained.pause_read_to_end(consumer, {R0})
    assert fake.paused == set()


def test_a_hop_written_wakes_the_partition_and_it_is_paused_again_only_past_the_new_high_watermark() -> None:
    drained, fake, consumer = _setup()
    fake.positions, fake.high = {R0: 5}, {R0: 5}
    drained.pause_read_to_end(consumer, {R0})
    assert drained.written(consumer, {R0: 1_000}, {R0}) == {R0: 1_000}, "paused here: the caller holds it until due"
    assert fake.paused == {R0}, "not fetched before the hop is due"
    drained.held_elsewhere(R0)
    drained.pause_read_to_end(consumer, {R0})
    fake.resume([TopicPartition(*R0)])  # the hop is due: the container's timed pause ends
    drained.resumed([R0])
    drained.pause_read_to_end(consumer, {R0})
    assert fake.paused == set(), "the client has not seen the hop yet (its high watermark is still 5): no pause"
    fake.high[R0] = 7  # the hop and its commit marker fetched
    drained.pause_read_to_end(consumer, {R0})
    assert fake.paused == set(), "the hop is not read yet"
    fake.positions[R0] = 7
    drained.pause_read_to_end(consumer, {R0})
    assert fake.paused == {R0}


def test_a_hop_written_to_a_partition_still_fetching_holds_off_its_pause_too() -> None:
    drained, fake, consumer = _setup()
    fake.positions, fake.high = {R0: 5}, {R0: 5}
    assert drained.written(consumer, {R0: 1_000}, {R0}) == {}  # written before the read-to-end check ran
    drained.pause_read_to_end(consumer, {R0})
    assert fake.paused == set()


def test_a_fetching_partition_that_read_its_hop_before_the_hop_was_looked_at_is_paused_at_its_end() -> None:
    """The mark a hop must pass is the high watermark before the container handled the poll that wrote it. Taken
    when the hop is looked at (the next poll, its transaction committed), it already held the hop whenever the
    partition, fetching, read it meanwhile: read to its end, it was then fetched in a loop until another hop."""
    drained, fake, consumer = _setup()
    fake.positions, fake.high = {R0: 5}, {R0: 7}  # fetching, two records left
    drained.pause_read_to_end(consumer, {R0})
    drained.before_handling(consumer, {R0})  # then the container handles the poll; a hop is written to R0
    fake.positions, fake.high = {R0: 9}, {R0: 9}  # committed; the client fetched it and everything before it
    assert drained.written(consumer, {R0: 1_000}, {R0}) == {}
    drained.pause_read_to_end(consumer, {R0})
    assert fake.paused == {R0}, "read past its hop: paused, not fetched in a loop"


def test_a_seek_or_a_resume_fetches_a_paused_partition_again_and_unassigned_ones_are_forgotten() -> None:
    drained, fake, consumer = _setup()
    fake.positions, fake.high = {R0: 5, R1: 5}, {R0: 5, R1: 5}
    drained.pause_read_to_end(consumer, {R0, R1})
    drained.fetch_again(consumer, [R0])  # the container sought R0: a record of it is handled again
    assert fake.paused == {R1} and drained.paused == {R1}
    drained.forget([R1])
    assert drained.paused == set()
    assert drained.written(consumer, {R1: 1_000}, set()) == {}  # not assigned here: nothing to do
    assert fake.paused == {R1}


def test_a_poll_that_brings_records_of_one_retry_partition_pauses_another_read_to_its_end() -> None:
    """Before the container handles what a poll brought (a transaction's worth of work), the retry partitions read
    to their end are paused: left fetching meanwhile, a broker that answers an empty fetch at once keeps the client
    fetching them in a loop the whole time."""
    from confluent_kafka import Message

    from kafkatx.listener.loop.retry_feed import RetryFeed
    from kafkatx.retry_topics import RetryTopicPlan
    from kafkatx.retry_topics.hops import RetryHops
    from kafkatx.rollback.policy import FailurePolicy

    hops = RetryHops(RetryTopicPlan(FailurePolicy(max_attempts=2, backoff=1.0)), ["t"], "grp", clock=lambda: 0.0)
    feed = RetryFeed(hops, {"group.id": "grp"}, "listener")

    class Polled(FakeConsumer):
        def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
            return [Message(topic="t-retry", partition=1, offset=2, key=b"k", value=b"v", headers=[])]

    fake = Polled()
    feed.consumer, feed.assigned = cast(Consumer, fake), {R0, R1}
    fake.positions, fake.high = {R0: 5, R1: 3}, {R0: 5, R1: 7}
    positions = SimpleNamespace(seek=lambda tp, offset: None, pause=lambda tp, seconds: None, paused_until={})
    polled = feed.poll(100, cast(Any, positions))
    assert len(polled) == 1, "the record brought is handed on"
    assert fake.paused == {R0}, "the other partition, read to its end, waits paused meanwhile"


def test_a_poll_that_brings_an_error_hands_it_on_before_the_records() -> None:
    """The container reports a client error before it handles anything of the poll."""
    from confluent_kafka import KafkaError, Message

    from kafkatx.listener.loop.retry_feed import RetryFeed
    from kafkatx.retry_topics import RetryTopicPlan
    from kafkatx.retry_topics.hops import RetryHops
    from kafkatx.rollback.policy import FailurePolicy

    hops = RetryHops(RetryTopicPlan(FailurePolicy(max_attempts=2, backoff=1.0)), ["t"], "grp", clock=lambda: 0.0)
    feed = RetryFeed(hops, {"group.id": "grp"}, "listener")
    error = Message(topic="t-retry", partition=0, error=KafkaError(KafkaError._TRANSPORT))

    class Polled(FakeConsumer):
        def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
            return [Message(topic="t-retry", partition=1, offset=2, key=b"k", value=b"v", headers=[]), error]

    fake = Polled()
    feed.consumer, feed.assigned = cast(Consumer, fake), {R0, R1}
    fake.positions, fake.high = {R0: 0, R1: 3}, {R0: 5, R1: 7}
    positions = SimpleNamespace(seek=lambda tp, offset: None, pause=lambda tp, seconds: None, paused_until={})
    polled = feed.poll(100, cast(Any, positions))
    assert [m.error() is not None for m in polled] == [True, False]


def _feed_with_a_drained_partition(now_ms: int) -> tuple[Any, FakeConsumer, dict[tuple[str, int], float]]:
    from confluent_kafka import Message

    from kafkatx.listener.loop.retry_feed import RetryFeed
    from kafkatx.retry_topics import RetryTopicPlan
    from kafkatx.retry_topics.hops import RetryHops
    from kafkatx.rollback.policy import FailurePolicy

    hops = RetryHops(RetryTopicPlan(FailurePolicy(max_attempts=2, backoff=1.0)), ["t"], "grp", clock=lambda: 0.0)
    feed = RetryFeed(hops, {"group.id": "grp"}, "listener")

    class Polled(FakeConsumer):
        def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
            return []

    fake = Polled()
    feed.consumer, feed.assigned = cast(Consumer, fake), {R0}
    fake.positions, fake.high = {R0: 5}, {R0: 5}
    paused_until: dict[tuple[str, int], float] = {}
    positions = SimpleNamespace(
        seek=lambda tp, offset: None,
        pause=lambda tp, seconds: paused_until.__setitem__(tp, seconds),
        paused_until=paused_until,
    )
    feed.poll(100, cast(Any, positions))
    assert fake.paused == {R0}, "read to its end: paused"
    return feed, fake, paused_until


def test_a_hop_written_to_a_partition_read_to_its_end_is_fetched_shortly_before_it_is_due() -> None:
    """Fetched at once, the hop would only be found not due and paused again by the gate: the client and the broker
    would fetch the partition for nothing for a back-off's worth of polls."""
    import time

    from kafkatx.listener.loop.retry_feed import WAKE_EARLY_MS

    feed, fake, paused_until = _feed_with_a_drained_partition(0)
    due = int(time.time() * 1000) + 1_000
    feed.hops.written[R0] = due
    feed.poll(100, cast(Any, SimpleNamespace(seek=None, pause=paused_until.__setitem__, paused_until=paused_until)))
    assert fake.paused == {R0}, "still paused: the hop is not due"
    assert 0.5 < paused_until[R0] <= 1.0 - WAKE_EARLY_MS / 1000, (
        "held by the container's timed pause until shortly before the hop is due"
    )
    feed.resume([R0], cast(Consumer, FakeConsumer()))  # the timed pause ends
    assert fake.paused == set()
    fake.positions[R0] = 5
    feed.poll(100, cast(Any, SimpleNamespace(seek=None, pause=paused_until.__setitem__, paused_until={})))
    assert fake.paused == set(), "fetched until the client has seen the hop (high watermark past 5)"


def test_a_hop_due_already_wakes_its_partition_at_once() -> None:
    feed, fake, paused_until = _feed_with_a_drained_partition(0)
    feed.hops.written[R0] = 0  # backoff=0, or a commit slower than the back-off
    feed.poll(100, cast(Any, SimpleNamespace(seek=None, pause=paused_until.__setitem__, paused_until=paused_until)))
    assert fake.paused == set() and R0 not in paused_until


def test_a_retry_partition_sought_while_the_container_holds_it_paused_stays_paused() -> None:
    """Its waiting records are dropped (fetched again from the offset sought), but it is resumed only when the
    container's hold ends: resumed at the seek, it would fetch during the hold, and each record fetched would be
    sought back again."""
    import time

    feed, fake, paused_until = _feed_with_a_drained_partition(0)
    fake.positions[R0] = 5
    waiting_record = _hop_message(R0, 6, due_ms=int(time.time() * 1000) + 60_000)
    feed._waiting.sort(cast(Consumer, fake), [waiting_record], int(time.time() * 1000))
    assert R0 in feed._waiting and fake.paused == {R0}
    feed.sought(R0, 6, held=True)
    assert R0 not in feed._waiting and fake.paused == {R0}, "dropped, still paused: the hold goes on"
    feed.resume([R0], cast(Consumer, FakeConsumer()))  # the hold ends
    assert fake.paused == set()
    feed._waiting.sort(cast(Consumer, fake), [waiting_record], int(time.time() * 1000))
    feed.sought(R0, 6)
    assert R0 not in feed._waiting and fake.paused == set(), "not held: fetched again at once"


def _hop_message(tp: tuple[str, int], offset: int, due_ms: int) -> Any:
    from confluent_kafka import Message

    from kafkatx.retry_topics.headers import BACKOFF_TIMESTAMP

    return Message(
        topic=tp[0],
        partition=tp[1],
        offset=offset,
        key=b"k",
        value=b"v",
        headers=[(BACKOFF_TIMESTAMP, due_ms.to_bytes(8, "big"))],
    )


def test_a_retry_partition_whose_position_ran_past_undelivered_records_is_fetched_again_after_the_last_delivered() -> (
    None
):
    """The embedded broker can make a read_committed consumer skip records it never delivered (a fetch that starts
    past the marker of the same producer's aborted transaction): refetch() seeks back to after the last record it
    delivered, not to where the consumer's position ran; nothing delivered is fetched twice."""
    import time

    feed, fake, paused_until = _feed_with_a_drained_partition(0)
    positions = cast(Any, SimpleNamespace(paused_until=paused_until))
    now_ms = int(time.time() * 1000)

    class Delivering(FakeConsumer):
        batch: list[Any] = []

        def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Any]:
            batch, self.batch = self.batch, []
            return batch

    fake2 = Delivering()
    fake2.positions, fake2.high = {R0: 0}, {R0: 13}
    feed.consumer = cast(Consumer, fake2)
    fake2.batch = [_hop_message(R0, offset, due_ms=now_ms - 1) for offset in (0, 1, 2, 3)]
    assert len(feed.poll(100, positions)) == 4
    fake2.positions[R0] = 13  # the broker made it skip 7..12
    assert feed.refetch(R0, positions) and fake2.positions[R0] == 4, "after the last record it delivered"
    assert R0 not in fake2.paused

    feed.sought(R0, 9)  # the container sought it (a rewind): fetched from there
    fake2.positions[R0] = 13
    assert feed.refetch(R0, positions) and fake2.positions[R0] == 9

    fake2.positions[R0] = 13
    assert feed.refetch(R0, positions, from_start=True) and fake2.positions[R0] == -2, "from its start"
    fake2.batch = [_hop_message(R0, offset, due_ms=now_ms - 1) for offset in (0, 1, 9, 10)]
    assert [m.offset() for m in feed.poll(100, positions)] == [9, 10], "what it delivered already is left out"
    fake2.batch = [_hop_message(R0, 3, due_ms=now_ms - 1)]  # sought back by the container later: delivered again
    feed.sought(R0, 3)
    assert [m.offset() for m in feed.poll(100, positions)] == [3]

    paused_until[R0] = time.monotonic() + 60  # the container holds it: its hold's end fetches it
    assert not feed.refetch(R0, positions)
    del paused_until[R0]
    fake2.batch = [_hop_message(R0, 20, due_ms=now_ms + 60_000)]  # fetched before due: it waits in memory
    feed.poll(100, positions)
    assert R0 in feed._waiting and not feed.refetch(R0, positions), "its records wait in memory: not refetched"
    assert not feed.refetch(("t-retry", 7), positions), "not a partition of this feed"


def test_a_due_record_not_consumed_has_its_partition_fetched_again_then_from_its_start_then_is_reported_stalled() -> (
    None
):
    from kafkatx.listener.loop import retry_stalls
    from kafkatx.listener.loop.retry_stalls import REFETCH_AFTER_S, RETRY_STALL_CHECK_S, RetryStalls

    heads = {R0: (1_000, ("t", 0), 5, 2)}  # due at 1 s (epoch ms), input t[0]@5, 2 records in retry
    hops = SimpleNamespace(book=SimpleNamespace(heads=lambda: heads))
    clock = [1.0]
    events: list[Any] = []
    stalls = RetryStalls(cast(Any, hops), "listener", 0, events.append, clock=lambda: clock[0])
    refetched: list[tuple[tuple[str, int], bool]] = []

    def refetch(tp: tuple[str, int], from_start: bool) -> bool:
        refetched.append((tp, from_start))
        return True

    stalls.run(100.0, refetch)  # first seen
    stalls.run(100.0 + REFETCH_AFTER_S - 0.1, refetch)
    assert refetched == [], "not yet: the same record for less than REFETCH_AFTER_S"
    clock[0] = 1.0 + RETRY_STALL_CHECK_S
    stalls.run(100.0 + REFETCH_AFTER_S, refetch)
    stalls.run(100.0 + REFETCH_AFTER_S + 1, refetch)
    assert refetched == [(R0, False)], "once, after the last record delivered"
    stalls.run(100.0 + 2 * REFETCH_AFTER_S, refetch)
    stalls.run(100.0 + 3 * REFETCH_AFTER_S, refetch)
    assert refetched == [(R0, False), (R0, True)], "then once from the partition's start, and no more"
    assert events == [] and stalls.stalled == {}
    clock[0] = 1.0 + 2 * RETRY_STALL_CHECK_S
    stalls.run(100.0 + RETRY_STALL_CHECK_S, refetch)
    assert stalls.stalled and len(events) == 1 and len(refetched) == 2
    heads[R0] = (2_000, ("t", 0), 6, 1)  # consumed: the next record heads it
    stalls.run(100.0 + RETRY_STALL_CHECK_S + 1, refetch)
    assert stalls.stalled == {} and len(events) == 2, "reported flowing again"
    assert retry_stalls._interval() == min(REFETCH_AFTER_S, RETRY_STALL_CHECK_S)


def test_the_paused_partitions_are_split_by_the_consumer_that_fetches_them() -> None:
    """A poll's input records are checked against the paused input partitions only, and the retry records against
    the paused retry partitions only (less those whose waiting records the poll handed on): a retry partition held
    paused for its next due time, as one mostly is, must not make the container look at every input record."""
    from kafkatx.listener.loop.retry_feed import RetryFeed
    from kafkatx.retry_topics import RetryTopicPlan
    from kafkatx.retry_topics.hops import RetryHops
    from kafkatx.rollback.policy import FailurePolicy

    hops = RetryHops(RetryTopicPlan(FailurePolicy(max_attempts=2, backoff=1.0)), ["t"], "grp", clock=lambda: 0.0)
    feed = RetryFeed(hops, {"group.id": "grp"}, "listener")
    feed._released.add(R1)
    paused = {("t", 0): 1.0, R0: 2.0, R1: 3.0}
    assert feed.inputs_of(paused) == [("t", 0)]
    assert feed.held(paused) == [R0], "R1's waiting records came due: what the poll brought of it is handled"
    assert feed.inputs_of({R0: 1.0}) == [], "only retry partitions paused: the input records need no look"


def test_a_partition_at_its_end_with_a_hop_not_seen_yet_is_returned_to_wait_for_the_hop_to_be_due() -> None:
    """Left fetching until the client saw the hop, a partition at its end was fetched in a loop until the hop's
    transaction committed and was read (a broker that answers an empty fetch at once): the caller holds it instead."""
    drained, fake, consumer = _setup()
    fake.positions, fake.high = {R0: 5}, {R0: 7}  # fetching, two records left
    drained.pause_read_to_end(consumer, {R0})
    drained.before_handling(consumer, {R0})
    fake.positions[R0] = 7  # read to the end; a hop due at 9_000 was written meanwhile
    assert drained.written(consumer, {R0: 9_000}, {R0}) == {}, "not paused here: fetching"
    assert drained.pause_read_to_end(consumer, {R0}) == {R0: (7, 9_000)}, "its position, and when its hop is due"
    assert fake.paused == set() and drained.paused == set(), "the caller holds it, not the read-to-end pause"
    fake.positions, fake.high = {R0: 9}, {R0: 9}  # the hop and its commit marker read
    assert drained.pause_read_to_end(consumer, {R0}) == {}
    assert fake.paused == {R0}, "read past its hop: paused as read to its end"


def test_a_partition_sought_counts_from_where_it_was_sought_until_a_record_of_it_is_read() -> None:
    """librdkafka gives no position between a seek and the next record delivered: a partition whose waiting
    records were all handed on, sought past them to its end, was not seen at its end and was fetched in a loop."""
    import time

    feed, fake, paused_until = _feed_with_a_drained_partition(0)

    class Seeking(FakeConsumer):
        def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Any]:
            return []

        def seek(self, partition: TopicPartition) -> None:
            self.positions.pop((partition.topic, partition.partition), None)  # unset until a record is read

    seeking = Seeking()
    seeking.positions, seeking.high = {R0: 6}, {R0: 8}
    feed.consumer = cast(Consumer, seeking)
    feed._drained.fetch_again(seeking, [R0])
    due_ms = int(time.time() * 1000)  # due now: sorted a second before, it waited; the poll below hands it on
    feed._waiting.sort(cast(Consumer, seeking), [_hop_message(R0, 6, due_ms=due_ms)], due_ms - 1_000)
    assert seeking.paused == {R0}, "its record waits in memory, the partition paused past it"
    seeking.high[R0] = 7
    positions = cast(Any, SimpleNamespace(paused_until={}, pause=lambda tp, seconds: None))
    assert [m.offset() for m in feed.poll(100, positions)] == [6]
    assert R0 not in seeking.positions, "sought past the record it handed on: librdkafka gives no position"
    assert seeking.paused == {R0}, "paused as read to its end: sought to 7, the high watermark"


def test_hops_written_while_the_client_learns_nothing_new_are_kept_as_one_mark() -> None:
    """A partition held paused for a long back-off learns no high watermark while a hop is written to it every
    transaction: what waits for the client to see them stays one entry (the first hop, due first)."""
    drained, fake, consumer = _setup()
    fake.positions, fake.high = {R0: 5}, {R0: 5}
    for due in range(1_000, 101_000, 1_000):
        drained.written(consumer, {R0: due}, {R0})
    assert drained.pause_read_to_end(consumer, {R0}) == {R0: (5, 1_000)}
    assert len(drained._unseen[R0]) == 1
    fake.high[R0] = 9  # fetched: the client knows a higher high watermark
    drained.written(consumer, {R0: 200_000}, {R0})
    assert drained._unseen[R0] == [(9, 200_000)], "those seen are let go"


def test_a_retry_partition_is_assigned_at_its_end_only_when_nothing_lies_past_its_committed_offset() -> None:
    """The read at assignment found no record: a partition ending where it was read from (or never written, read
    from its beginning) starts at its end, paused; one with aborted records or transaction markers past its
    committed offset is fetched from there (the embedded broker skips records after an abort marker it did not
    fetch)."""
    starts = [
        TopicPartition("t-retry", 0, 7),  # committed 7, ends at 7: nothing past it
        TopicPartition("t-retry", 1, 7),  # committed 7, ends at 9: an aborted hop and its marker, or a marker
        TopicPartition("t-retry", 2, OFFSET_BEGINNING),  # nothing committed, never written
        TopicPartition("t-retry", 3, OFFSET_BEGINNING),  # nothing committed, an aborted hop and its marker
    ]
    ends = {("t-retry", 0): 7, ("t-retry", 1): 9, ("t-retry", 2): 0, ("t-retry", 3): 2}
    assert nothing_past(starts, ends) == {("t-retry", 0): 7, ("t-retry", 2): 0}


def test_the_rebuild_reads_a_retry_partition_from_its_committed_offset_else_from_itsfirst_offset_asked() -> None:
    """Left to librdkafka as "the beginning", the lookup made every rebuild of an assignment half a second longer;
    if the first offset cannot be asked, librdkafka's beginning it is."""

    class Scanner:
        def __init__(self, answer: Any) -> None:
            self.answer = answer

        def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
            if isinstance(self.answer, Exception):
                raise self.answer
            return cast("tuple[int, int]", self.answer)

    first = first_offset
    assert first(cast(Any, Scanner((3, 10))), ("t-retry", 0), 7) == 7, "committed: from there"
    assert first(cast(Any, Scanner((3, 10))), ("t-retry", 0), -1001) == 3, "none committed: its first offset"
    assert first(cast(Any, Scanner(RuntimeError("timed out"))), ("t-retry", 0), -1001) == OFFSET_BEGINNING
