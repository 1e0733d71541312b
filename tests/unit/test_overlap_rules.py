"""The overlapped commit's rules over a fake host (no broker): what is handled ahead is held, never produced,
and given up (sought back) on a failure, a seek of its partition or a budget cut of the committing batch."""

from __future__ import annotations

from typing import Any

from fakes import FakeHost, listener, messages

import kafkatx
from kafkatx import Record
from kafkatx.events import HandlerFailed
from kafkatx.listener.loop.overlap import CommitOverlap, overlap_of


def _overlap(handler: Any, **options: Any) -> tuple[FakeHost, CommitOverlap | None]:
    host = FakeHost(listener(handler, **{"overlap_commit": True, **options}))
    return host, overlap_of(host, host._spec, host.crash_guard, host.error_reactions, host.runner())


def _setup(handler: Any, **options: Any) -> tuple[FakeHost, CommitOverlap]:
    host, overlap = _overlap(handler, **options)
    assert overlap is not None
    return host, overlap


def _committing(host: FakeHost, count: int = 2) -> Any:
    unit = host.unit(messages(*(b"a%d" % i for i in range(count))))
    unit.begin()
    unit.send_offsets(unit.next_offsets())  # all of it: not cut short by its time budget
    return unit


def test_the_next_slice_is_handled_with_its_outputs_and_sends_held_not_produced() -> None:
    def handle(record: Record) -> bytes:
        kafkatx.send("side", b"sent-" + (record.value or b""))
        return b"out-" + (record.value or b"")

    host, overlap = _setup(handle)
    overlap._next = messages(b"b0", b"b1", start=2)
    committing = _committing(host)
    before = list(host.producer.calls)
    overlap.handle_next(committing)
    assert host.producer.calls == before, "nothing reaches the producer while its transaction commits"
    [held] = overlap.held
    assert [(o[0], o[1]) for o in held.outputs] == [
        ("side", b"sent-b0"),  # in the order the handler made them: send() during the call, then its result
        ("out", b"out-b0"),
        ("side", b"sent-b1"),
        ("out", b"out-b1"),
    ]
    assert held.offsets == {("in", 0): 4}


def test_a_handler_failure_ahead_ends_the_held_batch_before_the_failed_record() -> None:
    """The records before the failed one are held (and commit next); it and what follows are fetched again, and
    its failure is counted in a transaction of its own, once the commit before it returned."""

    def handle(record: Record) -> bytes:
        if record.value == b"b1":
            raise ValueError("bad")
        return b"ok-" + (record.value or b"")

    host, overlap = _setup(handle, backoff=0, max_attempts=1, dlq="in-dlt")
    overlap._next = messages(b"b0", b"b1", b"b2", start=2)
    overlap.handle_next(_committing(host))
    [held] = overlap.held
    assert held.raised is None and [m.offset() for m in held.messages] == [2]
    assert [(o[0], o[1]) for o in held.outputs] == [("out", b"ok-b0")] and held.offsets == {("in", 0): 3}
    assert host.seeks == [(("in", 0), 3)], "the failed record and what follows are fetched again"
    assert not host.tracker and host.events_of(HandlerFailed) == [], "not counted ahead of the commit"

    host.consumer = None  # (nothing to poll during the held batch's own commit)
    assert overlap.commit_held()
    assert host.producer.committed_values == [b"ok-b0"] and host.producer.committed_offsets == {("in", 0): 3}
    host.runner()(host.unit(messages(b"b1", b"b2", start=3)))  # fetched again: it fails in its own transaction
    assert [(e.record.offset, e.attempt) for e in host.events_of(HandlerFailed)] == [(3, 1)]
    assert host.producer.committed[-1].produced == [("in-dlt", b"b1"), ("out", b"ok-b2")]
    assert host.producer.committed_offsets == {("in", 0): 5}


def test_in_place_failures_ahead_are_left_for_their_own_transaction_too() -> None:
    """retry="in_place" ahead of a commit: no retry and no dead letter ahead; the record is fetched again."""
    calls: list[tuple[bytes, int]] = []

    def handle(record: Record) -> bytes:
        calls.append((record.value or b"", record.attempt))
        raise ValueError("bad")

    host, overlap = _setup(handle, retry="in_place", backoff=0, max_attempts=2, dlq="in-dlt")
    overlap._next = messages(b"b0", start=2)
    overlap.handle_next(_committing(host))
    assert calls == [(b"b0", 1)] and overlap.held == []
    assert host.seeks == [(("in", 0), 2)] and not host.tracker
    host.runner()(host.unit(messages(b"b0", start=2)))  # fetched again: retried and recovered in place
    assert calls == [(b"b0", 1), (b"b0", 1), (b"b0", 2)], "attempt 1 again: the failure ahead was not counted"
    assert host.producer.committed[-1].produced == [("in-dlt", b"b0")]
    assert host.producer.committed_offsets == {("in", 0): 3}


def test_a_seek_of_a_held_partition_or_a_failed_commit_gives_the_held_work_up() -> None:
    host, overlap = _setup(lambda r: r.value)
    overlap._next = messages(b"b0", start=2)
    overlap.handle_next(_committing(host))
    assert overlap.held
    overlap.touched(("in", 1))
    assert overlap.held, "another partition's seek leaves it"
    overlap.touched(("in", 0))
    assert overlap.held == [] and host.seeks == [(("in", 0), 2)]
    overlap._next = messages(b"b0", start=2)
    overlap.handle_next(_committing(host))
    overlap.drop()  # what TransactionUnit.commit does when the commit fails
    assert overlap.held == [] and host.seeks[-1] == (("in", 0), 2)


def test_nothing_is_handled_ahead_of_a_batch_cut_short_or_while_a_record_is_failing() -> None:
    host, overlap = _setup(lambda r: r.value)
    cut = host.unit(messages(b"a0", b"a1"))
    cut.begin()
    cut.send_offsets({("in", 0): 1})  # its time budget ran out after a0: a1 is fetched again next
    overlap._next = messages(b"b0", start=2)
    overlap.handle_next(cut)
    assert overlap.held == []
    record = host.unit(messages(b"x")).records()[0]
    host.tracker.record_failure(record, ValueError("x"))
    overlap._next = messages(b"b0", start=2)
    overlap.handle_next(_committing(host))
    assert overlap.held == []


def test_it_is_off_with_in_flight_above_one_and_with_overlap_commit_false() -> None:
    """Off, a listener's loop has no overlapped commit at all (no stage that returns early)."""
    assert _overlap(lambda r: r.value, in_flight=4, overlap_commit=False)[1] is None
    assert _overlap(lambda r: r.value, overlap_commit=False)[1] is None
    assert _overlap(lambda r: r.value)[1] is not None
    host = FakeHost(listener(lambda r: r.value))
    assert overlap_of(host, host._spec, host.crash_guard, host.error_reactions, host.runner()) is None, "default"
