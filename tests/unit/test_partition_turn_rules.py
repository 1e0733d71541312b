"""Partition turns through fakes: each partition's slice commits in its own transaction, the next slices are
handled while a commit waits (up to a bound), and what stops the container waits for the commit under way."""

from __future__ import annotations

from typing import Any

import pytest
from fakes import FakeHost, FakeProducer, listener, messages

import kafkatx.listener.loop.partition_turns as turns_module
from kafkatx.client.offsets import TP
from kafkatx.errors import KafkaClientError
from kafkatx.listener.loop.partition_turns import PartitionTurns
from kafkatx.record import Record


class _PartitionHost(FakeHost):
    """A container with one producer per partition (``fencing="partition"``); ``log`` says what happened when."""

    def __init__(self, handler: Any, partitions: int) -> None:
        super().__init__(listener(handler))
        self.assigned = {("in", p) for p in range(partitions)}
        self.log: list[str] = []
        self.producers: dict[TP, FakeProducer] = {}
        for p in range(partitions):
            self.producers[("in", p)] = _LoggedProducer(self.log, p)

    def producer_for(self, tp: TP) -> Any:
        return self.producers[tp]


class _LoggedProducer(FakeProducer):
    def __init__(self, log: list[str], partition: int) -> None:
        super().__init__()
        self._log, self._partition = log, partition

    def commit(self, guard: Any = None, meanwhile: Any = None) -> None:
        self._log.append(f"commit {self._partition} starts")
        super().commit(guard, meanwhile)
        self._log.append(f"commit {self._partition} returns")


def _slices(partitions: int) -> list[list[Any]]:
    return [messages(b"v%d" % p, partition=p) for p in range(partitions)]


def test_the_next_partition_is_handled_and_committed_while_a_commit_waits() -> None:
    def handle(record: Record) -> bytes:
        host.log.append(f"handle {record.partition}")
        return b"out-" + (record.value or b"")

    host = _PartitionHost(handle, 3)
    PartitionTurns(host, host.runner()).run(_slices(3))
    assert host.log == [
        "handle 0",
        "commit 0 starts",
        "handle 1",
        "commit 1 starts",
        "handle 2",
        "commit 2 starts",
        "commit 2 returns",
        "commit 1 returns",
        "commit 0 returns",
    ]
    assert {p: host.producers[("in", p)].committed_values for p in range(3)} == {p: [b"out-v%d" % p] for p in range(3)}
    assert host.committed_offsets == {("in", p): 1 for p in range(3)}


def test_no_more_commits_than_the_bound_are_under_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turns_module, "MAX_COMMITS_UNDER_WAY", 2)

    def handle(record: Record) -> None:
        host.log.append(f"handle {record.partition}")

    host = _PartitionHost(handle, 3)
    PartitionTurns(host, host.runner()).run(_slices(3))
    assert host.log == [
        "handle 0",
        "commit 0 starts",
        "handle 1",
        "commit 1 starts",
        "commit 1 returns",  # two under way: partition 2 waits for the next turn of the loop
        "commit 0 returns",
        "handle 2",
        "commit 2 starts",
        "commit 2 returns",
    ]


def test_what_stops_the_container_during_a_commit_is_raised_after_it_and_starts_nothing_more() -> None:
    def handle(record: Record) -> None:
        host.log.append(f"handle {record.partition}")
        if record.partition == 1:
            raise KafkaClientError("the client's state failed")

    host = _PartitionHost(handle, 3)
    with pytest.raises(KafkaClientError, match="state failed"):
        PartitionTurns(host, host.runner()).run(_slices(3))
    assert host.log == ["handle 0", "commit 0 starts", "handle 1", "commit 0 returns"]
    assert host.committed_offsets == {("in", 0): 1}, "the commit under way completed; partition 2 never started"
    assert host.producers[("in", 1)].committed == [], "left to the container's stop, which closes its producer"
    assert host.producers[("in", 2)].transactions == []


def test_a_turn_taken_during_a_commit_leaves_the_committing_turn_s_cut_as_it_was() -> None:
    """Partition 0's transaction ends before a record failing with a back-off (a cut: its partition is held,
    the records from it kept for later); partition 1's turn, taken while that transaction commits, must not
    make partition 0's runner forget the cut (its records after the failed one would be neither handled nor
    fetched again)."""

    def handle(record: Record) -> bytes:
        if record.partition == 0 and record.offset == 1:
            raise ValueError("later")
        return b"out-" + (record.value or b"")

    host = _PartitionHost(handle, 2)
    slices = [messages(b"a", b"b", b"c", partition=0), messages(b"d", b"e", b"f", partition=1)]
    PartitionTurns(host, host.runner()).run(slices)
    assert host.producers[("in", 1)].committed_values == [b"out-d", b"out-e", b"out-f"]
    assert host.producers[("in", 0)].committed_values == [b"out-a"]
    assert host.committed_offsets == {("in", 0): 1, ("in", 1): 3}
    held, _ = host.deferred[("in", 0)]
    assert [m.value() for m in held] == [b"b", b"c"], "the failed record and the one after it wait for the back-off"
