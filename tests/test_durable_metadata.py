"""The offset-commit metadata that carries attempt counts and crash claims (pure logic, no broker)."""

from __future__ import annotations

import pytest

from kafkatx.rollback.durable import PartitionState, decode, encode, encode_inflight


@pytest.mark.parametrize(
    "state",
    [
        PartitionState(0),
        PartitionState(42, failures=2),
        PartitionState(42, inflight=True),
        PartitionState(7, failures=1, inflight=True, careful_until=19),
    ],
)
def test_a_state_survives_the_round_trip_through_its_metadata(state: PartitionState) -> None:
    assert decode(encode(state), state.offset) == state


@pytest.mark.parametrize("offset", [0, 1, 123_456_789_012])
def test_the_usual_claim_is_written_exactly_as_the_general_encoding_writes_it(offset: int) -> None:
    assert encode_inflight(offset) == encode(PartitionState(offset, inflight=True))
    assert decode(encode_inflight(offset), offset) == PartitionState(offset, inflight=True)


def test_metadata_about_another_offset_or_from_someone_else_says_nothing() -> None:
    claim = encode_inflight(10)
    assert decode(claim, 11) is None, "a claim is about the offset it was committed with"
    assert decode("written by another tool", 10) is None
    assert decode("kafkatx:{not json", 10) is None
    assert decode(None, 10) is None
