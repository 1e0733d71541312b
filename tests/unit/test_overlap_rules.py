"""The overlapped commit's rules over a fake host (no broker): what is handled ahead is held, never produced,
and given up (sought back) on a failure, a seek of its partition or a budget cut of the committing batch."""

from __future__ import annotations

from typing import Any

from fakes import FakeHost, listener, messages

import kafkatx
from kafkatx import Record
from kafkatx.listener.host import HandlerFailure
from kafkatx.listener.overlap import CommitOverlap, overlap_of


def _setup(handler: Any, **options: Any) -> tuple[FakeHost, CommitOverlap]:
    host = FakeHost(listener(handler, **{"overlap_commit": True, **options}))
    return host, overlap_of(host, host._spec, host.crash_guard, host.error_reactions, host.runner())


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


def test_a_handler_failure_ahead_of_the_commit_is_held_for_the_runner_to_take_on() -> None:
    def handle(record: Record) -> bytes:
        if record.value == b"b1":
            raise ValueError("bad")
        return b"ok"

    host, overlap = _setup(handle)
    overlap._next = messages(b"b0", b"b1", start=2)
    overlap.handle_next(_committing(host))
    [held] = overlap.held
    assert isinstance(held.raised, HandlerFailure) and held.raised.index == 1, "as its transaction would raise it"
    assert host.seeks == [] and not host.tracker, "counted when the runner takes it on, after the commit"


def test_in_place_retries_and_recoveries_run_ahead_with_the_dead_letter_held() -> None:
    calls: list[bytes] = []

    def handle(record: Record) -> bytes:
        calls.append(record.value or b"")
        raise ValueError("bad")

    host, overlap = _setup(handle, retry="in_place", backoff=0, max_attempts=2, dlq="in-dlt")
    overlap._next = messages(b"b0", start=2)
    overlap.handle_next(_committing(host))
    assert calls == [b"b0", b"b0"]
    [held] = overlap.held
    assert held.raised is None and held.offsets == {("in", 0): 3}
    assert [o[0] for o in held.outputs] == ["in-dlt"], "the dead letter waits with the batch's outputs"


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
    assert _setup(lambda r: r.value, in_flight=4, overlap_commit=False)[1].ahead is None
    assert _setup(lambda r: r.value, overlap_commit=False)[1].ahead is None
    assert _setup(lambda r: r.value)[1].ahead is not None
    host = FakeHost(listener(lambda r: r.value))
    assert overlap_of(host, host._spec, host.crash_guard, host.error_reactions, host.runner()).ahead is None, "default"
