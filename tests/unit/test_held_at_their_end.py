"""Input partitions read to their end wait paused a moment on a broker that answers an empty fetch at once.

The rule through a fake consumer (positions, cached high watermarks, pause and resume); the embedded broker's
side, the fetches it saves and what a record produced meanwhile waits, in tests/test_quiet_partitions.py.
"""

from __future__ import annotations

from collections.abc import Mapping

from confluent_kafka import TopicPartition

from kafkatx.client.offsets import TP
from kafkatx.listener.loop.quiet_partitions import (
    QUIET_HOLD_S,
    QUIET_OFF_AFTER_FAILURE_S,
    QUIET_REFRESH_S,
    QuietPartitions,
)

A, B = ("in", 0), ("in", 1)


class Consumer:
    """Positions and cached high watermarks set by the test; pauses and resumes recorded."""

    def __init__(self, positions: dict[TP, int], highs: dict[TP, int]) -> None:
        self.positions, self.highs = positions, highs
        self.lows: dict[TP, int] = {}
        self.broker_highs: dict[TP, int] = {}  # what the broker has, beyond the client's last fetch
        self.asked: list[TP] = []
        self.broker_down = False
        self.paused: set[TP] = set()
        self.resumed: list[TP] = []

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return [
            TopicPartition(p.topic, p.partition, self.positions.get((p.topic, p.partition), -1001)) for p in partitions
        ]

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float = -1, cached: bool = False) -> tuple[int, int]:
        tp_ = (tp.topic, tp.partition)
        if not cached:  # asked of the broker
            self.asked.append(tp_)
            if self.broker_down:
                raise RuntimeError("KafkaError{code=_TIMED_OUT}")
            return self.lows.get(tp_, 0), self.broker_highs.get(tp_, self.highs.get(tp_, -1001))
        return self.lows.get(tp_, 0), self.highs.get(tp_, -1001)

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused.update((p.topic, p.partition) for p in partitions)

    def resume(self, partitions: list[TopicPartition]) -> None:
        for p in partitions:
            self.paused.discard((p.topic, p.partition))
            self.resumed.append((p.topic, p.partition))


class Host:
    def __init__(self, consumer: Consumer) -> None:
        self.consumer: Consumer | None = consumer
        self.assigned: set[TP] = {A, B}
        self.held_by_container: dict[TP, float] = {}
        self.committed: dict[TP, int] = {}

    def committed_offset(self, tp: TP) -> int | None:
        return self.committed.get(tp)

    @property
    def paused_until(self) -> Mapping[TP, float]:
        return self.held_by_container


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stage(positions: dict[TP, int], highs: dict[TP, int]) -> tuple[QuietPartitions, Consumer, Host, Clock]:
    consumer, clock = Consumer(positions, highs), Clock()
    host = Host(consumer)
    return QuietPartitions(host, clock), consumer, host, clock  # type: ignore[arg-type]


def test_a_partition_the_poll_read_to_its_end_is_paused_and_the_others_keep_fetching() -> None:
    quiet, consumer, _host, _clock = stage({A: 50, B: 20}, {A: 50, B: 80})
    quiet.after_poll()
    assert consumer.paused == {A}
    assert quiet.next_due == 100.0 + QUIET_HOLD_S
    # the poll wakes at the hold's end, or at an earlier pause's of the container
    assert quiet.wake_by(None) == quiet.wake_by(200.0) == 100.0 + QUIET_HOLD_S and quiet.wake_by(100.0) == 100.0


def test_when_its_hold_ends_the_broker_is_asked_and_an_unchanged_partition_is_held_again() -> None:
    quiet, consumer, _host, clock = stage({A: 50, B: 20}, {A: 50, B: 80})
    quiet.after_poll()
    clock.now += QUIET_HOLD_S / 2
    quiet.after_poll()
    assert consumer.paused == {A} and consumer.asked == []  # not before its time, and no request meanwhile
    clock.now += QUIET_HOLD_S
    quiet.after_poll()
    # asked while still paused (resumed, it would be fetched in a loop while asked), and held again
    assert consumer.resumed == [] and consumer.asked == [A] and consumer.paused == {A}
    assert quiet.next_due == clock.now + QUIET_HOLD_S


def test_a_record_produced_during_the_hold_is_fetched_when_it_ends() -> None:
    quiet, consumer, _host, clock = stage({A: 50, B: 20}, {A: 50, B: 80})
    quiet.after_poll()
    consumer.broker_highs[A] = 51  # produced meanwhile: the client has not fetched it
    clock.now += QUIET_HOLD_S
    quiet.after_poll()
    assert consumer.paused == set()  # left fetching: the record comes with the next fetch
    # asked again once resumed: the request wakes librdkafka's broker thread, asleep while all it fetched was paused
    assert consumer.asked == [A, A]
    assert quiet.next_due is None
    quiet.after_poll()  # a poll before the client fetched it: its own high watermark is still 50
    assert consumer.paused == set()
    consumer.positions[A] = consumer.highs[A] = 51  # fetched and handled: at its end again
    quiet.after_poll()
    assert consumer.paused == {A}


def test_a_broker_that_does_not_answer_leaves_the_partitions_fetching_for_a_while() -> None:
    quiet, consumer, _host, clock = stage({A: 50, B: 80}, {A: 50, B: 80})
    quiet.after_poll()
    consumer.broker_down = True
    clock.now += QUIET_HOLD_S
    quiet.after_poll()
    assert consumer.paused == set() and len(consumer.asked) == 1  # one request failed: no more asked
    clock.now += QUIET_OFF_AFTER_FAILURE_S / 2
    quiet.after_poll()
    assert consumer.paused == set()
    consumer.broker_down = False
    clock.now += QUIET_OFF_AFTER_FAILURE_S
    quiet.after_poll()
    assert consumer.paused == {A, B}


def test_partitions_with_no_position_or_no_high_watermark_yet_are_left_fetching() -> None:
    quiet, consumer, _host, _clock = stage({A: -1001, B: 7}, {A: 5, B: -1001})
    quiet.after_poll()
    assert consumer.paused == set()


def test_with_no_record_read_since_assigned_the_start_is_the_committed_offset_or_an_empty_partition_at_its_end() -> (
    None
):
    """librdkafka reports no position until it delivers a record: a partition that holds nothing, or whose records
    this container committed, would be fetched in a loop for ever (the idle listener's usual state)."""
    quiet, consumer, host, _clock = stage({A: -1001, B: -1001}, {A: 7, B: 9})
    consumer.lows[A] = 7  # holds nothing (its records were deleted, or none was ever produced)
    host.committed[B] = 9
    quiet.after_poll()
    assert consumer.paused == {A, B}


def test_a_partition_the_container_holds_is_not_looked_at_and_a_hold_it_takes_over_is_left_to_it() -> None:
    quiet, consumer, host, clock = stage({A: 50, B: 80}, {A: 50, B: 80})
    host.held_by_container[B] = 999.0  # a back-off: the container pauses and resumes it
    quiet.after_poll()
    assert set(quiet.held) == {A}
    host.held_by_container[A] = 999.0  # a back-off taken while held here
    clock.now += 2 * QUIET_HOLD_S
    quiet.after_poll()
    assert consumer.resumed == []  # its own pause's end resumes it, not this hold's
    assert quiet.held == {}


def test_a_partition_revoked_while_held_is_forgotten_not_resumed() -> None:
    quiet, consumer, host, clock = stage({A: 50, B: 20}, {A: 50, B: 80})
    quiet.after_poll()
    host.assigned.discard(A)
    clock.now += 2 * QUIET_HOLD_S
    quiet.after_poll()
    assert consumer.resumed == [] and quiet.held == {}  # a new assignment starts unpaused (the container's rule)
    assert consumer.asked == []


def test_a_partition_held_a_while_is_fetched_once_anyway() -> None:
    """Asked of a read_committed consumer, the broker tells the last stable offset: a partition held below a crashed
    producer's open transaction would never fetch the high watermark that shows the records waiting behind it (the
    stall check and /readyz look for them)."""
    quiet, consumer, _host, clock = stage({A: 50, B: 20}, {A: 50, B: 80})
    quiet.after_poll()
    resumed_at = []
    for _ in range(int(QUIET_REFRESH_S / QUIET_HOLD_S) + 2):
        clock.now += QUIET_HOLD_S
        quiet.after_poll()
        if consumer.resumed:
            resumed_at.append(clock.now)
            break
    assert consumer.resumed == [A] and consumer.paused == set()
    assert resumed_at[0] - 100.0 >= QUIET_REFRESH_S
    consumer.highs[A] = 53  # that fetch saw records behind the position: left fetching for the stall check
    quiet.after_poll()
    assert consumer.paused == set()
