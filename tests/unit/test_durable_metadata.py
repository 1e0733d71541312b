"""The offset-commit metadata that carries attempt counts and crash claims (pure logic, no broker)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from confluent_kafka import TopicPartition

from kafkatx.listener.failure.crash_guard import CrashGuard
from kafkatx.rollback.durable import PartitionState, decode, encode, encode_inflight, process_token
from kafkatx.rollback.tracker import FailureTracker


@pytest.mark.parametrize(
    "state",
    [
        PartitionState(0),
        PartitionState(42, failures=2),
        PartitionState(42, inflight=True),
        PartitionState(7, failures=1, inflight=True, careful_until=19),
        PartitionState(7, failures=1, inflight=True, careful_until=19, owner="0123abcd"),
    ],
)
def test_a_state_survives_the_round_trip_through_its_metadata(state: PartitionState) -> None:
    assert decode(encode(state), state.offset) == state


@pytest.mark.parametrize("offset", [0, 1, 123_456_789_012])
def test_the_usual_claim_is_written_exactly_as_the_general_encoding_writes_it(offset: int) -> None:
    assert encode_inflight(offset, "f00d") == encode(PartitionState(offset, inflight=True, owner="f00d"))
    assert decode(encode_inflight(offset, "f00d"), offset) == PartitionState(offset, inflight=True, owner="f00d")


def test_metadata_about_another_offset_or_from_someone_else_says_nothing() -> None:
    claim = encode_inflight(10, "f00d")
    assert decode(claim, 11) is None, "a claim is about the offset it was committed with"
    assert decode("written by another tool", 10) is None
    assert decode("kafkatx:{not json", 10) is None
    assert decode(None, 10) is None


def _guard() -> tuple[CrashGuard, FailureTracker]:
    tracker = FailureTracker()
    spec = SimpleNamespace(count_crashes=True, max_batch_records=500)
    container = SimpleNamespace(spec=spec, name="copy", tracker=tracker, consumer=None)
    return CrashGuard(container), tracker  # type: ignore[arg-type]


def test_a_claim_this_process_wrote_is_no_crash_when_its_partition_comes_back() -> None:
    """A partition lost (a rebalance, a broker restart) and assigned again to the same live process comes back
    with that process's own in-flight claim: nothing crashed, so no careful mode and nothing counted."""
    guard, tracker = _guard()
    claim = guard.metadata({("t", 0): 40})
    assert claim is not None and decode(claim[("t", 0)], 40) == PartitionState(40, inflight=True, owner=process_token())
    guard.restore([TopicPartition("t", 0, 40, metadata=claim[("t", 0)])])
    assert dict(guard.careful) == {} and tracker.state_at("t", 0, 40) is None


def test_a_claim_another_process_left_means_it_died_while_handling() -> None:
    guard, tracker = _guard()
    batch = encode(PartitionState(40, inflight=True, owner="deadbeef0000"))
    careful = encode(PartitionState(7, failures=1, inflight=True, careful_until=9, owner="deadbeef0000"))
    guard.restore([TopicPartition("t", 0, 40, metadata=batch), TopicPartition("t", 1, 7, metadata=careful)])
    assert dict(guard.careful) == {("t", 0): 540, ("t", 1): 9}, "a batch in flight: its records one by one"
    state = tracker.state_at("t", 1, 7)
    assert state is not None and state.failures == 2, "the one record in flight died once more"


def test_the_first_batch_claim_finds_each_unclaimed_partitions_first_offset_in_any_batch_order() -> None:
    from confluent_kafka import Message

    from kafkatx.listener.failure.crash_guard import first_unclaimed

    def m(topic: str, partition: int, offset: int) -> Message:
        return Message(topic=topic, partition=partition, offset=offset)

    batch = [
        m("a", 0, 5),
        m("a", 0, 6),
        m("b", 0, 9),
        m("b", 0, 10),  # same partition number, another topic: a new run
        m("a", 1, 3),
        m("a", 0, 7),
        m("a", 2, 1),
        m("a", 2, 2),  # a partition's records in two runs
    ]
    unclaimed = {("a", 0), ("b", 0), ("a", 1), ("c", 0)}
    assert first_unclaimed(batch, unclaimed, careful={("a", 1): 10}) == {("a", 0): 5, ("b", 0): 9}
    assert first_unclaimed(batch, unclaimed, careful={}) == {("a", 0): 5, ("b", 0): 9, ("a", 1): 3}
    assert first_unclaimed(batch, set(), careful={}) == {}
    assert first_unclaimed([m("a", 2, 1), m("a", 0, 4), m("a", 2, 0)], {("a", 2)}, {}) == {("a", 2): 1}
