"""``retry="topics"``'s pure rules (no broker): what is refused at declaration, what a hop is, which record the
handler and the recoverer see, where a hop's count comes from, and the due-time gate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import tenacity
from test_failed_record import FakeScope

from kafkatx import App, DefaultAfterRollbackProcessor, InvalidConfigurationError, Record
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.events import HandlerFailed, RecordRecovered, RecordRetryScheduled
from kafkatx.listener.failure.failed_record import Hold, retry_recovery, settle_failure
from kafkatx.listener.loop.waiting_retries import WaitingRetries
from kafkatx.listener.spec import build_spec
from kafkatx.outputs import PendingOutput
from kafkatx.recoverers import Recoverer
from kafkatx.retry_topics import RetryTopicPlan, hop_headers, parse_hop
from kafkatx.retry_topics.hops import RetryHops
from kafkatx.retry_topics.keys import Place
from kafkatx.rollback.policy import FailurePolicy

TOPICS: dict[str, Any] = {"retry": "topics", "ordering": "none"}


def _handler(record: Record) -> None:
    return None


# -- the declaration ---------------------------------------------------------------------------------------
def test_retry_topics_keeps_key_order_by_default_and_refuses_partition_order_saying_why() -> None:
    with pytest.raises(InvalidConfigurationError, match=r'cannot keep partition order.*retry="rollback".*"key"'):
        build_spec(_handler, ["orders"], {"retry": "topics", "ordering": "partition"})
    keyed = build_spec(_handler, ["orders"], {"retry": "topics"})
    assert (keyed.retry, keyed.ordering) == ("topics", "key")
    assert RetryHops.of(keyed, "grp").keys is not None  # type: ignore[union-attr]
    loose = build_spec(_handler, ["orders"], TOPICS)
    assert RetryHops.of(loose, "grp").keys is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"after_rollback": DefaultAfterRollbackProcessor()}, "after_rollback"),
        ({"overlap_commit": True}, "overlap_commit"),
        ({"database": "sqlite://"}, "database="),
    ],
)
def test_what_retry_topics_cannot_go_with_yet_is_refused_by_option(options: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidConfigurationError, match=named):
        build_spec(_handler, ["orders"], {**TOPICS, **options})


def test_retry_topics_is_refused_on_spark_listeners() -> None:
    with pytest.raises(InvalidConfigurationError, match="record listeners"):
        build_spec(_handler, ["orders"], TOPICS, kind="batch", runner=lambda container: lambda unit: None)


def test_an_unknown_retry_mode_names_the_three() -> None:
    with pytest.raises(InvalidConfigurationError, match="'rollback', 'in_place' or 'topics'"):
        App("x").listener("orders", retry="topic")(_handler)  # type: ignore[arg-type]


# -- hops ----------------------------------------------------------------------------------------------------
def _hops(**options: Any) -> RetryHops:
    return RetryHops(RetryTopicPlan(FailurePolicy(**options)), ["orders"], "grp", clock=lambda: 1000.0)


def test_a_hop_goes_to_the_level_of_the_next_attempt_on_the_records_partition_with_raw_bytes() -> None:
    hops = _hops(max_attempts=3, backoff=tenacity.wait_exponential(multiplier=1, max=10))
    record = Record("orders", 2, 41, "decoded", {"v": 1}, [("own", b"h")], 5, raw_key=b"k", raw_value=b"v")
    topic, value, key, headers, partition = hops.hop(record, TimeoutError("t"), 2, 2.0) or ("", None, None, [], None)
    assert (topic, value, key, partition) == ("orders-retry-2000", b"v", b"k", 2)
    back = parse_hop(Record(topic, partition or 0, 0, key, value, headers or []))
    assert back is not None and back.due_ms == 1_002_000 and back.record.attempt == 3
    assert (back.record.topic, back.record.partition, back.record.offset, back.record.headers) == (
        "orders",
        2,
        41,
        [("own", b"h")],
    )
    assert hops.hop(record, TimeoutError("t"), 3, 4.0) is None, "no retry left after the last attempt"


def test_the_view_of_a_hop_is_its_input_record_and_of_an_input_record_itself() -> None:
    hops = _hops(max_attempts=3, backoff=1.0)
    original = Record("orders", 1, 9, b"k", b"v", [("own", b"h")], 5)
    headers = hop_headers(original, ValueError("x"), group_id="grp", next_attempt=2, due_ms=7)
    consumed = Record("orders-retry", 1, 0, b"k", b"v", headers)
    assert hops.view(original) is original
    view = hops.view(consumed)
    assert (view.topic, view.offset, view.attempt, view.headers) == ("orders", 9, 2, [("own", b"h")])
    assert hops.mirrored([("orders", 1), ("other", 0)]) == [("orders-retry", 1)]
    assert hops.view(Record("orders-retry", 0, 0, None, b"x")).topic == "orders-retry", "no hop headers: as is"


@dataclass
class HopScope(FakeScope):
    produced: list[PendingOutput] = field(default_factory=list)

    def produce(self, output: PendingOutput) -> None:
        self.produced.append(output)


def _consumed_hop(attempt: int) -> Record:
    original = Record("orders", 0, 7, b"k", b"v", [], 5)
    headers = hop_headers(original, TimeoutError("t"), group_id="grp", next_attempt=attempt, due_ms=1)
    return Record("orders-retry", 0, 3, b"k", b"v", headers)


def test_a_retry_is_a_hop_in_the_transaction_counted_from_the_header_not_the_tracker() -> None:
    dead: list[Record] = []
    scope = HopScope(FailurePolicy(lambda r, e: dead.append(r), max_attempts=4, backoff=0))
    hops = _hops(max_attempts=4, backoff=0)
    assert settle_failure(scope, _consumed_hop(2), TimeoutError("t"), hops=hops) is None, "no hold: the hop"
    assert [(o[0], o[4]) for o in scope.produced] == [("orders-retry", 0)], "backoff 0 hops too"
    assert not scope.tracker, "the tracker counts nothing: the attempt is in the header"
    assert [(e.attempt, e.record.topic) for e in scope.of(HandlerFailed)] == [(2, "orders")]
    assert [(e.attempt, e.delay) for e in scope.of(RecordRetryScheduled)] == [(3, 0.0)]
    assert settle_failure(scope, _consumed_hop(4), TimeoutError("t"), hops=hops) is None
    assert len(scope.produced) == 1 and [(r.topic, r.offset, r.attempt) for r in dead] == [("orders", 7, 4)]
    assert [e.record.topic for e in scope.of(RecordRecovered)] == ["orders"]


def test_a_failed_recovery_of_a_hop_holds_the_retry_partition_and_retries_it_on_the_input_view() -> None:
    calls: list[Record] = []

    class Flaky(Recoverer):
        name = "flaky"

        def __call__(self, record: Record, exception: BaseException) -> None:
            calls.append(record)
            if len(calls) == 1:
                raise RuntimeError("dlt down")

    scope = HopScope(FailurePolicy(Flaky(), max_attempts=2, backoff=0, recovery_backoff=0.5))
    hops = _hops(max_attempts=2, backoff=0)
    consumed = _consumed_hop(2)
    outcome = settle_failure(scope, consumed, TimeoutError("t"), hops=hops)
    assert isinstance(outcome, Hold) and (outcome.record.topic, outcome.record.offset) == ("orders-retry", 3)
    assert scope.tracker.state(consumed) is not None, "pending recovery kept at the consumed coordinates"
    assert retry_recovery(scope, consumed, hops) is None
    assert [(r.topic, r.offset) for r in calls] == [("orders", 7), ("orders", 7)], "the recoverer saw the original"


def test_a_dead_letter_through_hops_names_the_original_coordinates() -> None:
    from kafkatx.dlq.headers import dead_letter_headers

    hops = _hops(max_attempts=2, backoff=0)
    view = hops.view(_consumed_hop(2))
    info = parse_dead_letter_headers(dead_letter_headers(view, ValueError("x"), group_id="grp", attempts=2))
    assert (info.original_topic, info.original_partition, info.original_offset) == ("orders", 0, 7)


# -- the due-time gate -----------------------------------------------------------------------------------
class _Msg:
    def __init__(self, topic: str, partition: int, offset: int, due_ms: int | None) -> None:
        self._t, self._p, self._o = topic, partition, offset
        self._h = [] if due_ms is None else [("retry_topic-backoff-timestamp", due_ms.to_bytes(8, "big"))]

    def topic(self) -> str:
        return self._t

    def partition(self) -> int:
        return self._p

    def offset(self) -> int:
        return self._o

    def headers(self) -> list[tuple[str, bytes]]:
        return self._h


class _Pauses:
    """The retry consumer's pause and resume, as WaitingRetries calls them."""

    def __init__(self) -> None:
        self.paused: set[tuple[str, int]] = set()
        self.sought = []

    def pause(self, partitions: list[Any]) -> None:
        self.paused.update((p.topic, p.partition) for p in partitions)

    def resume(self, partitions: list[Any]) -> None:
        self.paused.difference_update((p.topic, p.partition) for p in partitions)

    def seek(self, partition: Any) -> None:
        self.sought.append((partition.topic, partition.partition, partition.offset))

    sought: list[tuple[str, int, int]]


def _offsets(msgs: list[Any]) -> list[tuple[str, int, int]]:
    return [(m.topic(), m.partition(), m.offset()) for m in msgs]


def test_the_gate_hands_on_each_retry_partitions_records_up_to_its_first_one_not_due_and_the_rest_wait_paused() -> None:
    waiting, consumer = WaitingRetries(), _Pauses()
    msgs = [_Msg("a-retry", 0, 5, 100), _Msg("a-retry", 0, 6, 300), _Msg("a-retry", 0, 7, 200)]
    msgs += [_Msg("a-retry", 1, 1, None), _Msg("a-retry-2000", 0, 3, 250)]
    due = waiting.sort(cast(Any, consumer), cast(Any, msgs), 150)
    assert _offsets(due) == [("a-retry", 0, 5), ("a-retry", 1, 1)]
    assert consumer.paused == {("a-retry", 0), ("a-retry-2000", 0)}, "paused past what waits: nothing fetched twice"
    assert waiting.release(cast(Any, consumer), 200) == [], "a-retry[0]'s head (due at 300) holds the one behind it"
    assert _offsets(waiting.release(cast(Any, consumer), 260)) == [("a-retry-2000", 0, 3)]
    assert consumer.paused == {("a-retry", 0)}, "none of a-retry-2000[0] waits: it fetches what came after"
    assert consumer.sought == [("a-retry-2000", 0, 4)], "from past its last waiting record, not where a fetch got to"
    late = waiting.sort(cast(Any, consumer), cast(Any, [_Msg("a-retry", 0, 8, 100)]), 260)  # fetched before the pause
    assert late == [], "a record of a partition some of whose records wait waits behind them, due or not"
    assert _offsets(waiting.release(cast(Any, consumer), 1000)) == [
        ("a-retry", 0, 6),
        ("a-retry", 0, 7),
        ("a-retry", 0, 8),
    ]
    assert consumer.paused == set() and len(waiting) == 0
    assert consumer.sought[-1] == ("a-retry", 0, 9)


def test_waiting_records_of_a_partition_sought_back_are_dropped_and_it_fetches_again() -> None:
    waiting, consumer = WaitingRetries(), _Pauses()
    waiting.sort(cast(Any, consumer), cast(Any, [_Msg("a-retry", 0, 6, 300), _Msg("a-retry", 1, 2, 300)]), 150)
    assert waiting.drop(cast(Any, consumer), [("a-retry", 0)]) == [("a-retry", 0)]
    assert consumer.paused == {("a-retry", 1)} and ("a-retry", 0) not in waiting
    assert waiting.drop(None, [("a-retry", 1)]) == [("a-retry", 1)], "revoked: dropped, left as it is"
    assert len(waiting) == 0


def test_a_record_read_back_is_parsed_once_for_its_failure_unless_its_handler_decoded_its_view() -> None:
    hops = _hops(max_attempts=3, backoff=1.0)
    consumed = _consumed_hop(2)
    seen = hops.arrived(consumed)
    assert seen is not None and (seen.topic, seen.offset, seen.attempt) == ("orders", 7, 2)
    assert hops.view(consumed) is seen, "the failure path gets the view the handler had"
    seen.key = "decoded"  # what a typed listener's decoding does to the record it hands the handler
    again = hops.view(consumed)
    assert again is not seen and (again.key, again.raw_key) == (b"k", b"k")
    no_attempt = [(k, v) for k, v in consumed.headers if k != "retry_topic-attempts"]
    other = Record("orders-retry", 0, 3, b"k", b"v", no_attempt)  # produced by hand, not a hop: handled as it is
    assert hops.arrived(other) is other
    foreign = hop_headers(Record("orders", 0, 7, b"k", b"v", [], 5), None, group_id="theirs", next_attempt=1, due_ms=1)
    assert hops.arrived(Record("orders-retry", 0, 4, b"k", b"v", foreign)) is None, "another group's hop passes"


def _read_back(output: PendingOutput | None, offset: int = 0) -> Record:
    """A hop as the retry consumer hands it over: its topic, partition, bytes and headers, at ``offset``."""
    assert output is not None
    topic, value, key, headers, partition = output
    return Record(topic, partition or 0, offset, key, value, list(headers or []))


def test_a_hop_read_back_by_the_container_that_wrote_it_is_its_input_view_as_parsing_its_headers_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The container remembers the input view of each hop it wrote (its first header names which): read back, the
    hop is not parsed, and the handler gets exactly what parsing gives another container (another process)."""
    writer = _hops(max_attempts=3, backoff=1.0)
    record = Record(
        "orders", 2, 41, b"k", b"v", [("own", b"h"), ("kafka_dlt-original-topic", b"x")], 5, "LogAppendTime"
    )
    hop = _read_back(writer.hop(record, TimeoutError("t"), 1, 1.0), 17)
    assert hop.headers[0][0] == "kafkatx_retry-hop" and len(hop.headers[0][1]) == 16
    parsed = _hops(max_attempts=3, backoff=1.0).arrived(hop)  # another process: from the headers
    assert parsed is not None
    assert (parsed.topic, parsed.partition, parsed.offset, parsed.attempt) == ("orders", 2, 41, 2)
    assert parsed.headers == [("own", b"h")], "kafkatx's and Spring's headers are hidden from the handler"

    def no_parsing(record: Record) -> None:
        raise AssertionError("a hop this container wrote was parsed")

    monkeypatch.setattr("kafkatx.retry_topics.hops.parse_hop", no_parsing)
    remembered = writer.arrived(hop)
    assert remembered is not None
    fields = ("topic", "partition", "offset", "key", "value", "headers", "timestamp", "timestamp_type", "attempt")
    assert [getattr(remembered, f) for f in fields] == [getattr(parsed, f) for f in fields]
    assert (remembered.raw_key, remembered.raw_value) == (b"k", b"v")
    assert writer.hop_of(cast(Any, _Message(hop))) == (("orders", 2), b"k", 41), "its commit finds its input record"
    monkeypatch.undo()
    again = writer.arrived(hop)  # read again (its transaction aborted, fetched again): parsed, the same view
    assert again is not None and [getattr(again, f) for f in fields] == [getattr(parsed, f) for f in fields]


def test_a_record_following_its_key_is_remembered_too_and_its_attempt_unchanged() -> None:
    from kafkatx.context import bind_sink

    writer = _hops(max_attempts=3, backoff=1.0)
    sent: list[PendingOutput] = []
    record = Record("orders", 0, 8, b"k", b"v", [], 5, attempt=2)
    previous = bind_sink(_Sink(sent))
    try:
        writer.follow(record, Place("orders-retry", 1_000))
    finally:
        bind_sink(previous)
    (output,) = sent
    seen = writer.arrived(_read_back(output))
    assert seen is not None and (seen.topic, seen.offset, seen.attempt, seen.headers) == ("orders", 8, 2, [])


@dataclass
class _Sink:
    """Where ``send()`` puts what a handler sends (the record's buffer in a container)."""

    sent: list[PendingOutput]
    serializer: Any = None

    def add(self, output: PendingOutput) -> None:
        self.sent.append(output)


@dataclass
class _Message:
    """What a commit reads of a consumed retry record."""

    record: Record

    def topic(self) -> str:
        return self.record.topic

    def partition(self) -> int:
        return self.record.partition

    def offset(self) -> int:
        return self.record.offset

    def key(self) -> bytes | None:
        return self.record.raw_key

    def headers(self) -> list[tuple[str, bytes]]:
        return self.record.headers
