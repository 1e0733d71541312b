"""``ordering="key"`` with retry topics, the pure rules (no broker): which record follows its key's head, where to,
and how the keys in retry follow what the transactions commit (never what they only tried)."""

from __future__ import annotations

from typing import Any, cast

import pytest
from confluent_kafka import KafkaError, Message, TopicPartition

from kafkatx.context import bind_sink
from kafkatx.errors import KafkaTxError
from kafkatx.listener.loop import retry_feed
from kafkatx.listener.loop.retry_feed import read_to_end
from kafkatx.outputs import PendingOutput
from kafkatx.record import ConsumedMessage, Record
from kafkatx.retry_topics import RetryTopicPlan, hop_headers, parse_hop
from kafkatx.retry_topics.hops import RetryHops
from kafkatx.retry_topics.keys import Place, RetryKeys
from kafkatx.rollback.policy import FailurePolicy

A, B = object(), object()  # two transactional producers


def _hops() -> RetryHops:
    plan = RetryTopicPlan(FailurePolicy(max_attempts=3, backoff=1.0))
    return RetryHops(plan, ["orders"], "grp", clock=lambda: 1000.0, key_order=True)


def _keys(hops: RetryHops) -> RetryKeys:
    assert hops.keys is not None
    return hops.keys


def _input(offset: int, key: bytes | None, partition: int = 0) -> Record:
    return Record("orders", partition, offset, key, b"v%d" % offset, [], 5)


def _read_back(original: Record, retry_offset: int, *, exc: BaseException | None = None, due: int = 0) -> Message:
    """``original``'s hop as the retry consumer hands it over."""
    headers = hop_headers(original, exc, group_id="grp", next_attempt=2 if exc else 1, due_ms=due)
    return Message(
        topic="orders-retry",
        partition=original.partition,
        offset=retry_offset,
        key=original.key,
        value=original.value,
        headers=headers,
    )


def _as_record(msg: Message) -> Record:
    return Record(msg.topic() or "", msg.partition() or 0, msg.offset() or 0, msg.key(), msg.value(), msg.headers())


class _Sink(list[PendingOutput]):
    serializer = None
    add = list.append


def _run(handler: Any, hops: RetryHops, record: Record) -> tuple[Any, list[PendingOutput]]:
    sink = _Sink()
    previous = bind_sink(sink)
    try:
        return hops.viewing(handler)(record), list(sink)
    finally:
        bind_sink(previous)


def test_a_key_without_a_record_in_retry_runs_and_a_record_without_a_key_never_follows() -> None:
    hops = _hops()
    keys = _keys(hops)
    keys.began(A)
    assert hops.hop(_input(0, b"k"), TimeoutError("t"), 1, 1.0) is not None  # k's first record hops
    assert hops.hop(_input(1, None), TimeoutError("t"), 1, 1.0) is not None  # so does a record without a key
    assert keys.ahead(_input(2, b"other")) is None
    assert keys.ahead(_input(3, None)) is None, "no key, no key order"
    assert keys.ahead(_input(4, b"k", partition=1)) is None, "key order is per input partition"
    assert keys.ahead(_input(5, b"k")) == Place("orders-retry", 1_001_000), "behind k's head, due when it is"


def test_a_follower_is_sent_behind_its_head_in_the_transaction_with_its_attempt_unchanged_and_no_failure() -> None:
    hops = _hops()
    keys = _keys(hops)
    keys.began(A)
    hops.hop(_input(0, b"k"), TimeoutError("t"), 1, 1.0)
    called: list[Record] = []
    result, sent = _run(called.append, hops, _input(3, b"k"))
    assert result is None and called == [], "the handler is not called for a follower"
    [(topic, value, key, headers, partition)] = sent
    assert (topic, value, key, partition) == ("orders-retry", b"v3", b"k", 0)
    back = parse_hop(Record(topic, 0, 0, key, value, headers or []))
    assert back is not None and back.record.attempt == 1 and back.due_ms == 1_001_000
    assert (back.record.topic, back.record.offset) == ("orders", 3)
    assert not any(name.startswith("kafka_dlt-exception") for name, _ in headers or []), "no failure to name"
    _run(called.append, hops, _input(4, b"j"))
    assert [r.offset for r in called] == [4], "another key runs"


def test_the_keys_in_retry_are_what_committed_an_aborted_transactions_hops_are_dropped() -> None:
    hops = _hops()
    keys = _keys(hops)
    keys.began(A)
    hops.hop(_input(0, b"k"), TimeoutError("t"), 1, 1.0)
    keys.began(A)  # the transaction was aborted: the same producer begins again
    assert keys.ahead(_input(1, b"k")) is None and keys.in_retry() == 0
    hops.hop(_input(0, b"k"), TimeoutError("t"), 1, 1.0)
    keys.committed(A, {("orders", 0): 1}, [], hops.hop_of)
    keys.began(A)
    assert keys.ahead(_input(1, b"k")) is not None and keys.keys_in_retry(("orders", 0)) == {b"k": [0]}


def test_a_head_read_back_runs_and_releases_its_followers_once_its_retry_offset_commits() -> None:
    hops = _hops()
    keys = _keys(hops)
    keys.rebuilt(("orders", 0), [(b"k", 0, Place("orders-retry", 5)), (b"k", 3, Place("orders-retry", 5))])
    head, follower = _read_back(_input(0, b"k"), 10, exc=TimeoutError("t")), _read_back(_input(3, b"k"), 11)
    keys.began(A)
    called: list[Record] = []
    _run(called.append, hops, _as_record(follower))
    assert called == [], "read before its head: it follows again"
    _run(called.append, hops, _as_record(head))
    assert [(r.offset, r.attempt) for r in called] == [(0, 2)], "the head runs at its own attempt"
    _run(called.append, hops, _as_record(follower))
    assert [r.offset for r in called] == [0, 3], "after its head, in the same transaction, the follower runs"
    consumed = cast("list[ConsumedMessage]", [head, follower])
    keys.committed(A, {("orders-retry", 0): 11}, consumed, hops.hop_of)  # the follower's offset did not commit
    assert keys.keys_in_retry(("orders", 0)) == {b"k": [3]}
    keys.began(A)
    keys.committed(A, {("orders-retry", 0): 12}, consumed[1:], hops.hop_of)
    assert keys.in_retry() == 0


def test_a_commit_of_input_partitions_only_leaves_the_retry_records_it_did_not_commit_in_retry() -> None:
    hops = _hops()
    keys = _keys(hops)
    keys.rebuilt(("orders", 0), [(b"k", 0, Place("orders-retry", 5))])
    head = _read_back(_input(0, b"k"), 10, exc=TimeoutError("t"))
    consumed = cast("list[ConsumedMessage]", [head])
    keys.began(A)
    keys.committed(A, {("orders", 0): 7}, consumed, hops.hop_of)  # the retry partition's offset is not in it
    assert keys.keys_in_retry(("orders", 0)) == {b"k": [0]}, "not committed: still in retry"
    keys.began(A)
    keys.committed(A, {("orders", 0): 8, ("orders-retry", 0): 11}, consumed, hops.hop_of)
    assert keys.in_retry() == 0


def test_a_follow_of_a_record_whose_work_the_commit_left_out_is_not_in_retry_after_it() -> None:
    """Handled concurrently, a record past a failed one may pass the gate (and follow) before the failure cuts the
    transaction short; its work is discarded and it is handled again. Its follow counts only if the commit
    covers the record: otherwise its key would keep an entry no hop stands for, and its later records would
    follow that entry for ever."""
    hops = _hops()
    keys = _keys(hops)
    keys.rebuilt(("orders", 0), [(b"k", 0, Place("orders-retry", 5))])
    keys.began(A)
    assert hops.admit(_input(4, b"k")) != _input(4, b"k"), "it follows k's head"
    keys.committed(A, {("orders", 0): 3}, [], hops.hop_of)  # the transaction was cut before offset 4
    assert keys.keys_in_retry(("orders", 0)) == {b"k": [0]}, "only the head is in retry"
    keys.began(A)
    [follow] = hops.admit(_input(4, b"k"))  # type: ignore[misc]  # handled again: it follows again
    assert follow[0] == "orders-retry"
    keys.committed(A, {("orders", 0): 5}, [], hops.hop_of)
    assert keys.keys_in_retry(("orders", 0)) == {b"k": [0, 4]}


def test_a_head_that_hops_again_keeps_its_followers_behind_it_in_its_new_level() -> None:
    plan = RetryTopicPlan(FailurePolicy(max_attempts=4, backoff=lambda state: float(state.attempt_number)))
    hops = RetryHops(plan, ["orders"], "grp", clock=lambda: 1000.0, key_order=True)
    keys = _keys(hops)
    assert plan.topics("orders") == ("orders-retry-1000", "orders-retry-2000", "orders-retry-3000")
    keys.rebuilt(("orders", 0), [(b"k", 0, Place("orders-retry-1000", 5)), (b"k", 3, Place("orders-retry-1000", 5))])
    keys.began(A)
    head = _input(0, b"k")
    keys.consumed(head)  # read back, it failed again: its second retry waits 2 s in the next level
    hops.hop(head, TimeoutError("t"), 2, 2.0)
    assert keys.ahead(_input(3, b"k")) == Place("orders-retry-2000", 1_002_000), "the follower moves behind it"
    assert keys.ahead(_input(7, b"k")) == Place("orders-retry-2000", 1_002_000), "and so does a new record"


def test_a_dead_lettered_head_releases_its_followers() -> None:
    hops = _hops()
    keys = _keys(hops)
    keys.rebuilt(("orders", 0), [(b"k", 0, Place("orders-retry", 5))])
    keys.began(A)
    keys.consumed(_input(0, b"k"))  # read back and dead-lettered: no hop follows
    assert keys.ahead(_input(3, b"k")) is None


def test_each_producers_transaction_keeps_its_own_journal() -> None:
    """``fencing="partition"``: B's transaction may begin while A's commits; each commit applies its own hops."""
    hops = _hops()
    keys = _keys(hops)
    keys.began(A)
    hops.hop(_input(0, b"k", partition=0), TimeoutError("t"), 1, 1.0)
    keys.began(B)
    hops.hop(_input(0, b"k", partition=1), TimeoutError("t"), 1, 1.0)
    keys.committed(A, {("orders", 0): 1}, [], hops.hop_of)
    assert keys.keys_in_retry(("orders", 0)) == {b"k": [0]} and keys.keys_in_retry(("orders", 1)) == {}
    keys.committed(B, {("orders", 1): 1}, [], hops.hop_of)
    assert keys.keys_in_retry(("orders", 1)) == {b"k": [0]}


def test_rebuilt_and_forgotten_by_input_partition() -> None:
    keys = _keys(_hops())
    keys.rebuilt(("orders", 0), [(b"k", 4, Place("orders-retry", 1)), (None, 5, Place("orders-retry", 1))])
    keys.rebuilt(("orders", 1), [(b"j", 2, Place("orders-retry", 1))])
    assert keys.in_retry() == 3, "a record without a key is in retry too (counted, never followed)"
    assert keys.ahead(_input(9, None)) is None
    keys.forget([("orders", 0)])
    assert keys.keys_in_retry(("orders", 0)) == {} and keys.in_retry(("orders", 1)) == 1
    keys.rebuilt(("orders", 1), [])
    assert keys.in_retry() == 0


# -- the rebuild's read to the end ---------------------------------------------------------------------------
class _Scanner:
    """A consumer whose partitions hold ``batches`` (each a consume() answer), then nothing."""

    def __init__(self, *batches: list[Message]) -> None:
        self.batches = list(batches)
        self.assigned: list[Any] = []
        #: as librdkafka's: kept across assignments
        self.paused: set[tuple[str, int]] = set()

    def assign(self, partitions: list[Any]) -> None:
        self.assigned = partitions

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused.update((tp.topic, tp.partition) for tp in partitions)

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.paused.difference_update((tp.topic, tp.partition) for tp in partitions)

    def unassign(self) -> None:
        self.assigned = []

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        return self.batches.pop(0) if self.batches else []


def _eof(partition: int) -> Message:
    return Message(topic="orders-retry", partition=partition, error=KafkaError(KafkaError._PARTITION_EOF))


def test_the_rebuild_reads_every_retry_partition_to_its_end() -> None:
    hop = _read_back(_input(4, b"k"), 0)
    scanner = _Scanner([hop], [_eof(0)], [_eof(1)])
    starts = [TopicPartition("orders-retry", 0, 0), TopicPartition("orders-retry", 1, 7)]
    assert read_to_end(cast(Any, scanner), starts, "orders") == [hop]
    assert scanner.assigned == [] and scanner.batches == [], "both ends reached, the partitions given back"


def test_a_retry_partition_read_to_its_end_is_paused_while_the_others_are_read_and_fetched_again_next_time() -> None:
    """On a broker that answers an empty fetch at once, a partition left fetching at its end is fetched in a loop
    while the rebuild waits for the others; librdkafka keeps the pause across assignments, so the next rebuild
    resumes what it assigns."""
    scanner = _Scanner([_eof(0)], [], [_eof(1)])
    starts = [TopicPartition("orders-retry", 0, 0), TopicPartition("orders-retry", 1, 7)]
    ends: dict[tuple[str, int], int] = {}
    paused_while_waiting: list[set[tuple[str, int]]] = []
    consume = scanner.consume

    def watched(num_messages: int, timeout: float) -> list[Message]:
        paused_while_waiting.append(set(scanner.paused))
        return consume(num_messages, timeout)

    scanner.consume = watched  # type: ignore[method-assign]
    read_to_end(cast(Any, scanner), starts, "orders", ends)
    assert paused_while_waiting[1:] == [{("orders-retry", 0)}] * 2, "paused at its end while partition 1 was read"
    assert set(ends) == {("orders-retry", 0), ("orders-retry", 1)}
    paused_while_waiting.clear()
    scanner.batches = [[_eof(0)]]
    read_to_end(cast(Any, scanner), starts[:1], "orders")
    assert ("orders-retry", 0) not in paused_while_waiting[0], "assigned again: fetched again"


def test_a_rebuild_that_makes_no_progress_stops_the_container_rather_than_lose_key_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(retry_feed, "REBUILD_TIMEOUT_S", 0.05)
    scanner = _Scanner([_eof(0)])  # partition 1 never reaches its end
    starts = [TopicPartition("orders-retry", 0, 0), TopicPartition("orders-retry", 1, 0)]
    with pytest.raises(KafkaTxError, match=r"orders-retry\[1\].*no progress.*cannot be rebuilt"):
        read_to_end(cast(Any, scanner), starts, "orders")
    assert scanner.assigned == [], "given back all the same"


def test_the_gate_looks_a_key_up_only_while_it_has_records_in_retry_or_hops_in_an_open_transaction() -> None:
    """``maybe`` (what the gate asks first, per record) holds a key exactly while a record of it is in retry
    (committed) or was sent to a retry topic in an open transaction; an aborted transaction's hops leave it."""
    hops = _hops()
    keys = _keys(hops)
    keys.began(A)
    hops.hop(_input(0, b"k"), TimeoutError("t"), 1, 1.0)
    assert keys.maybe == {b"k": 1}, "written in the open transaction: the records after it follow"
    keys.began(A)  # aborted: begun again
    assert keys.maybe == {}
    hops.hop(_input(0, b"k"), TimeoutError("t"), 1, 1.0)
    hops.hop(_input(1, None), TimeoutError("t"), 1, 1.0)  # keyless: counted, never followed
    keys.committed(A, {("orders", 0): 2}, [], hops.hop_of)
    assert keys.maybe == {b"k": 1} and keys.in_retry() == 2
    keys.rebuilt(("orders", 1), [(b"k", 0, Place("orders-retry", 5))])
    assert keys.maybe == {b"k": 2}, "one count per input partition holding the key"
    keys.forget([("orders", 1)])
    head = _read_back(_input(0, b"k"), 10, exc=TimeoutError("t"))
    keys.began(A)
    keys.committed(A, {("orders-retry", 0): 11}, cast("list[ConsumedMessage]", [head]), hops.hop_of)
    assert keys.maybe == {} and keys.in_retry() == 1, "its head consumed: the key has nothing in retry"
    called: list[Record] = []
    keys.began(A)
    _run(called.append, hops, _input(5, b"k"))
    assert [r.offset for r in called] == [5]


def test_each_retry_partitions_record_due_first_is_what_the_stall_check_compares() -> None:
    plan = RetryTopicPlan(FailurePolicy(max_attempts=4, backoff=lambda state: float(state.attempt_number)))
    hops = RetryHops(plan, ["orders"], "grp", clock=lambda: 1000.0, key_order=True)
    keys = _keys(hops)
    keys.rebuilt(
        ("orders", 0),
        [(b"k", 7, Place("orders-retry-1000", 9)), (b"j", 3, Place("orders-retry-1000", 5))],
    )
    keys.rebuilt(("orders", 1), [(None, 4, Place("orders-retry-2000", 8))])
    assert keys.heads() == {
        ("orders-retry-1000", 0): (5, ("orders", 0), 3, 2),
        ("orders-retry-2000", 1): (8, ("orders", 1), 4, 1),
    }


def test_records_written_to_the_retry_topics_again_without_being_handled_are_said_in_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A key whose record in retry fails again before its followers are read back sends them through the retry
    topics once more: with few keys per partition, most of the flow, many times over (docs/RETRY_TOPICS.md, "A key
    that never drains"). Nothing else shows it, so it is said, naming the key, at most every few minutes."""
    from kafkatx.retry_topics import hops as hops_module

    now = [1000.0]
    plan = RetryTopicPlan(FailurePolicy(max_attempts=3, backoff=1.0))
    hops = RetryHops(plan, ["orders"], "grp", clock=lambda: now[0], key_order=True, listener="copier")
    keys = _keys(hops)
    followers = range(1, 2 * hops_module.REWRITES_WARNED + 1)
    keys.rebuilt(
        ("orders", 0),
        [(b"hot", 0, Place("orders-retry", 5))] + [(b"hot", o, Place("orders-retry", 5)) for o in followers],
    )
    keys.began(A)
    called: list[Record] = []
    with caplog.at_level("WARNING", logger="kafkatx.container"):
        for offset in followers:  # read back while their head is still in retry: each follows it again
            _run(called.append, hops, _as_record(_read_back(_input(offset, b"hot"), 100 + offset)))
        _run(called.append, hops, _as_record(_read_back(_input(5_000, b"cold"), 5_000)))  # its own head: it runs
    assert [r.key for r in called] == [b"cold"]
    [warning] = [r for r in caplog.records if "followed their key's record in retry again" in r.getMessage()]
    assert "copier" in warning.getMessage() and "b'hot'" in warning.getMessage()
    assert f"{hops_module.REWRITES_WARNED} record(s)" in warning.getMessage(), "once, not at every rewrite after it"
    caplog.clear()
    now[0] += hops_module.REWRITE_WARNING_EVERY_S
    with caplog.at_level("WARNING", logger="kafkatx.container"):
        _run(called.append, hops, _as_record(_read_back(_input(1, b"hot"), 900)))
    assert any("followed their key's record in retry again" in r.getMessage() for r in caplog.records), "said again"
