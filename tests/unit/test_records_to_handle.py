"""What of a poll is handled (no broker): the records of paused partitions are left out and sought back, per run of
one partition's records, whatever the topics' partition numbers."""

from __future__ import annotations

from fakes import message

from kafkatx.listener.transaction.positions import records_to_handle


class _Seeks:
    def __init__(self) -> None:
        self.seeks: list[tuple[tuple[str, int], int]] = []

    def seek(self, tp: tuple[str, int], offset: int) -> None:
        self.seeks.append((tp, offset))


def test_the_records_of_paused_partitions_are_left_out_and_sought_back_to_their_first() -> None:
    polled = [
        message(0, topic="in", partition=0),
        message(1, topic="in", partition=0),
        message(5, topic="in-retry", partition=0),  # the same partition number on another topic: another run
        message(6, topic="in-retry", partition=0),
        message(3, topic="in", partition=1),
        message(7, topic="in-retry", partition=1),
    ]
    host = _Seeks()
    kept = records_to_handle(host, list(polled), lambda m: None, {("in-retry", 0), ("in", 1)})  # type: ignore[arg-type]
    assert [(m.topic(), m.partition(), m.offset()) for m in kept] == [("in", 0, 0), ("in", 0, 1), ("in-retry", 1, 7)]
    assert sorted(host.seeks) == [(("in", 1), 3), (("in-retry", 0), 5)]
    admitted = records_to_handle(host, list(polled), lambda m: None, set(), admitted={("in", 0)})  # type: ignore[arg-type]
    assert [m.offset() for m in admitted] == [0, 1]
