"""Finding the record that killed the process by bisection over the range its claim names (no broker).

The first tests run the rule itself (:mod:`kafkatx.rollback.bisection`): given a claimed range and
which records pass or crash, which ranges are handled next. The others run the crash guard over a
fake host, "killing" the process with an exception no code catches and "restarting" it with a new
host that reads back what the dead one committed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import TopicPartition
from fakes import FakeHost, FakeProducer, listener, messages

import kafkatx.listener.failure.crash_guard as crash_guard
from kafkatx.errors import ProcessCrashedError
from kafkatx.record import ConsumedMessage, Record
from kafkatx.rollback.bisection import Suspects, after_commit, claimed_suspects
from kafkatx.rollback.durable import PartitionState, decode, encode, encode_inflight

TP = ("in", 0)


# -- the rule ----------------------------------------------------------------------------------
def _search(start: int, end: int, poison: int | None, batch: int = 10_000) -> tuple[list[tuple[int, int]], int, bool]:
    """Handle the claimed range ``[start, end)`` part by part until the poison is blamed or the range is done.

    Returns the parts handled (``[first, end)`` each), the restarts it took, and whether the poison was blamed.
    """
    suspects, blamed = claimed_suspects(start, end, None, batch)
    committed, parts, restarts = start, [], 0
    while not blamed:
        part_end = suspects.next_end(committed)
        parts.append((committed, part_end))
        if poison is not None and committed <= poison < part_end:  # the process dies: its claim names the part
            suspects, blamed = claimed_suspects(committed, part_end, None, batch)
            restarts += 1
            continue
        committed = part_end  # the part passed and committed
        left = after_commit(suspects, committed)
        if left is None:
            return parts, restarts, False
        suspects = left
    return parts, restarts, committed <= (poison if poison is not None else -1) < suspects.end


@pytest.mark.parametrize("size", [1, 2, 3, 7, 20, 500])
def test_the_record_that_kills_the_process_is_blamed_within_log2_restarts_wherever_it_is(size: int) -> None:
    for poison in range(100, 100 + size):
        parts, restarts, blamed = _search(100, 100 + size, poison)
        assert blamed, f"poison at {poison} of [100, {100 + size}) found"
        assert restarts <= math.ceil(math.log2(size)), (poison, restarts)
        assert all(100 <= first < end <= 100 + size for first, end in parts), "nothing outside the claim"


def test_each_part_is_the_first_half_of_what_is_still_suspect() -> None:
    parts, restarts, blamed = _search(0, 16, poison=13)
    assert parts == [(0, 8), (8, 12), (12, 14), (12, 13), (13, 14)]
    assert restarts == 2 and blamed, "a crash narrows the range to [12, 14); the next, 13 alone in flight, blames it"
    parts, restarts, blamed = _search(0, 16, poison=0)
    assert parts == [(0, 8), (0, 4), (0, 2), (0, 1)] and restarts == 4 and blamed


def test_a_crash_that_was_no_records_fault_costs_log2_transactions_covering_the_claim_once() -> None:
    parts, restarts, blamed = _search(40, 540, poison=None)
    assert restarts == 0 and not blamed
    assert len(parts) <= math.ceil(math.log2(500)) + 1
    assert [p[0] for p in parts[1:]] == [p[1] for p in parts[:-1]] and parts[0][0] == 40 and parts[-1][1] == 540
    assert all(a[1] - a[0] >= b[1] - b[0] for a, b in zip(parts, parts[1:])), "halves shrink"


def test_what_a_claim_names() -> None:
    assert claimed_suspects(40, None, None, 500) == (Suspects(540), False), "the usual claim: a batch"
    assert claimed_suspects(40, 60, None, 500) == (Suspects(60), False), "a half, while searching"
    assert claimed_suspects(40, 41, 41, 500) == (Suspects(41), True), "one record: its crash"
    assert claimed_suspects(7, None, 9, 500) == (Suspects(9, halving=False), True), "an earlier version's careful mode"
    assert claimed_suspects(40, None, None, 1) == (Suspects(41), True), "batches of one record: its crash"
    assert Suspects(9, halving=False).next_end(7) == 8, "one record at a time, not halves"


def test_a_claim_of_several_records_reads_as_a_batch_claim_to_a_version_before_inflight_until() -> None:
    half = encode(PartitionState(40, 0, True, None, "f00d", 290))
    single = encode(PartitionState(41, 1, True, 42, "f00d", 42))
    assert decode(half, 40) == PartitionState(40, 0, True, None, "f00d", 290)
    assert '"careful_until"' not in half, "an earlier version reads it as a batch in flight: nobody blamed"
    assert '"careful_until":42' in single, "an earlier version blames the one record too"
    assert encode_inflight(40, "f00d") == encode(PartitionState(40, inflight=True, owner="f00d"))


# -- the crash guard over a fake host ----------------------------------------------------------
class Killed(BaseException):
    """The process is gone: nothing in kafkatx catches it, as nothing runs after os._exit."""


class Worker:
    """A process of one container over partition ("in", 0): polls batches from the committed offset."""

    def __init__(self, spec: Any, log: list[ConsumedMessage], committed: TopicPartition | None) -> None:
        self.spec, self.log = spec, log
        self.host = FakeHost(spec, FakeProducer())  # a new process: a new owner token (see the fixture)
        self.host.crash_guard.restore([committed] if committed is not None else [])
        self.position = committed.offset if committed is not None else 0

    def run(self) -> bool:
        """Handle the log to its end. False if the process was killed."""
        runner, guard, batch_size = self.host.runner(), self.host.crash_guard, self.spec.max_batch_records
        while self.position < len(self.log):
            batch = self.log[self.position : self.position + batch_size]
            try:
                rest = guard.run_careful(batch, runner)
                if rest:
                    runner(self.host.unit(rest))
            except Killed:
                return False
            self.position = self.host.committed_offsets[TP]
        return True

    def last_commit(self) -> TopicPartition | None:
        found = [t for t in self.host.producer.committed if TP in t.offsets]
        if not found:
            return None
        return TopicPartition(*TP, found[-1].offsets[TP], metadata=found[-1].metadata.get(TP))

    def handled_batches(self) -> list[list[bytes | None]]:
        """The records of each committed transaction that ran the handler."""
        return [[v for _, v in t.produced] for t in self.host.producer.committed if t.produced]


@pytest.fixture(autouse=True)
def one_token_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = iter(range(1_000))
    monkeypatch.setattr(crash_guard, "process_token", lambda: f"worker{next(tokens)}")


def _killing(poison: set[bytes], calls: Counter[bytes]) -> Callable[[Record], bytes]:
    def handle(record: Record) -> bytes:
        value = record.value or b""
        calls[value] += 1
        if value in poison:
            raise Killed
        return value

    return handle


def _run_until_done(spec: Any, log: list[ConsumedMessage], restarts: int = 20) -> tuple[list[Worker], int]:
    workers, committed, crashes = [], None, 0
    for _ in range(restarts):
        worker = Worker(spec, log, committed)
        workers.append(worker)
        if worker.run():
            return workers, crashes
        crashes += 1
        committed = worker.last_commit() or committed
    raise AssertionError("never finished")


def test_after_a_crash_only_the_claimed_batch_is_searched_and_the_rest_runs_in_full_batches() -> None:
    calls: Counter[bytes] = Counter()
    values = [b"r%d" % i for i in range(200)]
    spec = listener(_killing(set(), calls), max_batch_records=20)
    log = messages(*values)
    first = Worker(spec, log, None)
    runner = first.host.runner()
    runner(first.host.unit(log[:20]))  # one batch commits, claiming the next
    dead = first.last_commit()
    assert dead is not None and decode(dead.metadata, 20) == PartitionState(20, inflight=True, owner="worker0")
    # The process dies inside [20, 40) (a force-kill: no record's fault). The next one searches [20, 40) only.
    second = Worker(spec, log, dead)
    assert dict(second.host.crash_guard.careful) == {TP: 40}
    assert second.run()
    sizes = [len(b) for b in second.handled_batches()]
    assert sizes[:6] == [10, 5, 2, 1, 1, 1], "halves of what is left of the claimed batch, as they pass"
    assert sizes[6:] == [20] * 8, "beyond the claimed batch: full batches at once"
    assert not second.host.crash_guard.careful


def test_a_record_that_kills_every_time_is_blamed_and_dead_lettered_after_max_attempts_crashes() -> None:
    calls: Counter[bytes] = Counter()
    dead: list[tuple[int, str, int]] = []
    values = [b"r%d" % i for i in range(100)]
    spec = listener(
        _killing({b"r37"}, calls),
        max_batch_records=16,
        max_attempts=3,
        dlq=lambda r, e: dead.append((r.offset, type(e).__name__, r.attempt)),
    )
    workers, crashes = _run_until_done(spec, messages(*values))
    # 1 crash in a batch [32, 48), <= log2(16) narrowing it down to 37, then 3 counted: dead-lettered unhandled.
    assert 1 + 3 <= crashes <= 1 + 4 + 3 - 1, crashes
    assert calls[b"r37"] == crashes
    assert dead == [(37, ProcessCrashedError.__name__, 3)]
    committed = Counter(v for w in workers for batch in w.handled_batches() for v in batch)
    assert committed == Counter(v for v in values if v != b"r37"), "every other record committed exactly once"
    last = workers[-1].handled_batches()
    assert all(len(b) == 16 for b in last[1:-1]), "the worker that dead-lettered it runs full batches after it"


def test_a_clean_stop_ends_the_search_and_the_next_run_batches_at_once() -> None:
    calls: Counter[bytes] = Counter()
    spec = listener(_killing(set(), calls), max_batch_records=20)
    log = messages(*[b"r%d" % i for i in range(30)])
    claim = TopicPartition(*TP, 0, metadata=encode(PartitionState(0, inflight=True, owner="gone")))
    worker = Worker(spec, log, claim)
    assert dict(worker.host.crash_guard.careful) == {TP: 20}
    assert worker.host.crash_guard.run_careful(log[:10], worker.host.runner()) == []  # the first half, committed
    assert dict(worker.host.crash_guard.careful) == {TP: 20}, "still searching [10, 20)"
    worker.host.fake_consumer.committed_offsets[TP] = 10
    worker.host.crash_guard.release([TP])  # a clean stop
    assert not worker.host.crash_guard.careful
    released = worker.last_commit()
    assert released is not None and decode(released.metadata, 10) == PartitionState(10), "no claim, no range"
    after = Worker(spec, log, released)
    assert not after.host.crash_guard.careful and after.run()
    assert [len(b) for b in after.handled_batches()] == [20], "no careful handling carried into the next run"


def test_a_revoke_before_anything_committed_drops_the_search_and_leaves_the_dead_claim_standing() -> None:
    spec = listener(_killing(set(), Counter()), max_batch_records=20)
    claim = TopicPartition(*TP, 0, metadata=encode(PartitionState(0, inflight=True, owner="gone")))
    worker = Worker(spec, messages(*[b"r%d" % i for i in range(30)]), claim)
    worker.host.crash_guard.release([TP])
    assert not worker.host.crash_guard.careful, "the partition is not ours any more: no search kept for it"
    assert worker.last_commit() is None, "nothing of the dead claim was handled: it still stands for the next owner"
