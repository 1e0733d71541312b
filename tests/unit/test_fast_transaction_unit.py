"""TransactionUnit.transact over a fake host: commit, abort on a handler failure, KIP-1050 reactions (no broker)."""

from __future__ import annotations

import pytest
from fakes import FakeHost, listener, messages

from kafkatx.errors import ApplicationRecoverableError, FencedTooOftenError, TransactionAbortableError
from kafkatx.events import KafkaErrorHandled, ProducerRecreated, TransactionAborted
from kafkatx.listener.transaction.unit import commit_offsets


def _host(**options: object) -> FakeHost:
    return FakeHost(listener(lambda r: r.value, **options))


def test_transact_begins_runs_the_work_sends_the_offsets_and_commits() -> None:
    host = _host()
    unit = host.unit(messages(b"a", b"b"))

    def work() -> None:
        unit.produce(("out", b"A", None, None, None))
        unit.send_offsets(unit.next_offsets())

    assert unit.transact(work) is True
    assert host.producer.calls == ["begin", "produce", "send_offsets", "commit"]
    assert host.producer.committed_values == [b"A"]
    assert host.producer.committed_offsets == {("in", 0): 2}
    assert host.committed_offsets == {("in", 0): 2}, "the container learns what committed"


def test_a_failing_work_aborts_the_transaction_and_propagates() -> None:
    host = _host()
    unit = host.unit(messages(b"a"))

    def work() -> None:
        unit.produce(("out", b"A", None, None, None))
        raise ValueError("bad record")

    with pytest.raises(ValueError, match="bad record"):
        unit.transact(work)
    assert host.producer.calls[-1] == "abort" and host.producer.committed == []
    assert host.committed_offsets == {}
    assert [e.records for e in host.events_of(TransactionAborted)] == [1]


def test_an_abortable_error_aborts_and_runs_the_work_again() -> None:
    host = _host()
    unit = host.unit(messages(b"a"))
    host.producer.fail_on("commit", TransactionAbortableError("abortable", operation="commit_transaction"))
    runs = []

    def work() -> None:
        runs.append(1)
        unit.produce(("out", b"A", None, None, None))
        unit.send_offsets(unit.next_offsets())

    assert unit.transact(work) is True
    assert len(runs) == 2, "the work is redone from memory"
    assert [t.outcome for t in host.producer.transactions] == ["aborted", "committed"]
    assert host.producer.committed_values == [b"A"], "the aborted attempt's output is not committed"
    assert host.events_of(KafkaErrorHandled)[0].error_class == "ABORTABLE"


def test_abortable_errors_in_a_row_past_max_abortable_retries_replace_the_producer() -> None:
    host = _host(max_abortable_retries=1)
    unit = host.unit(messages(b"a", start=5))
    host.fake_consumer.committed_offsets[("in", 0)] = 5
    host.producer.fail_on("commit", TransactionAbortableError("abortable"), times=2)

    assert unit.transact(lambda: unit.send_offsets(unit.next_offsets())) is False
    assert host.producer.discarded == 1
    assert host.seeks == [(("in", 0), 5)], "rewound to the committed offset"


def test_an_application_recoverable_error_replaces_the_producer_and_rewinds_to_the_committed_offset() -> None:
    host = _host()
    host.fake_consumer.committed_offsets[("in", 0)] = 3
    unit = host.unit(messages(b"a", b"b", start=3))
    host.producer.fail_on("send_offsets", ApplicationRecoverableError("fenced", operation="send_offsets"))

    assert unit.transact(lambda: unit.send_offsets(unit.next_offsets())) is False
    assert host.producer.discarded == 1 and host.producer.committed == []
    assert host.seeks == [(("in", 0), 3)]
    assert [e.transactional_id for e in host.events_of(ProducerRecreated)] == ["fake-txn"]


def test_a_group_change_before_the_commit_aborts_and_rewinds_instead_of_committing() -> None:
    host = _host()
    host.fake_consumer.committed_offsets[("in", 0)] = 0
    host.member_changed = True
    unit = host.unit(messages(b"a"))

    assert unit.transact(lambda: unit.send_offsets(unit.next_offsets())) is False
    assert host.producer.committed == [] and host.producer.calls[-1] == "abort"
    assert host.seeks == [(("in", 0), 0)]


def test_too_many_producer_replacements_within_a_minute_stop_the_container() -> None:
    host = _host()
    host.max_producer_recreations = 1
    unit = host.unit(messages(b"a"))
    host.producer.fail_on("begin", ApplicationRecoverableError("fenced"), times=2)
    assert unit.transact(lambda: None) is False
    with pytest.raises(FencedTooOftenError, match="max_producer_recreations=1"):
        unit.transact(lambda: None)


def test_commit_offsets_commits_offsets_with_no_records_in_one_transaction_per_producer() -> None:
    host = _host()
    assert commit_offsets(host, {("in", 0): 7}, what="claim", metadata={("in", 0): "claimed"}) is True
    (txn,) = host.producer.committed
    assert (txn.produced, txn.offsets, txn.metadata) == ([], {("in", 0): 7}, {("in", 0): "claimed"})


def test_commit_offsets_says_when_a_transaction_did_not_commit() -> None:
    host = _host()
    host.producer.fail_on("begin", ApplicationRecoverableError("fenced"))
    assert commit_offsets(host, {("in", 0): 7}, what="claim") is False
