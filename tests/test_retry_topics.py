"""``retry="topics"`` (issue 40, step 2): a failed record waits in a retry topic, written in the transaction that
commits its offset, and its partition goes on at once (``ordering="none"``, as Spring's retry topics; key order:
tests/test_retry_key_order.py)."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from typing import Any

import pytest
from helpers import POISON_FQCN, PoisonError, make_app
from tenacity import wait_exponential

from kafkatx import App, DeadLetterPublishingRecoverer, InvalidConfigurationError, Record
from kafkatx.dlq import replay_dlq
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.events import RecordRetryScheduled
from kafkatx.retry_topics.headers import ATTEMPTS
from kafkatx.testing import KafkaTestKit, running, wait_for

TOPICS: dict[str, Any] = {"retry": "topics", "ordering": "none"}


class Transient(Exception):
    """A failure worth retrying."""


def _hops_committed(kafka: KafkaTestKit, group: str, topic: str, suffix: str = "-retry") -> bool:
    """Every hop of ``topic``'s retry topic consumed and committed (a transaction marker may follow the last)."""
    last: dict[int, int] = {}
    for hop in kafka.read(topic + suffix):
        last[hop.partition] = hop.offset
    committed = kafka.committed(group, topic + suffix)
    return all(committed.get(p, 0) > offset for p, offset in last.items())


def _seen(calls: list[tuple[bytes, int, float]], value: bytes) -> list[int]:
    return [attempt for v, attempt, _ in calls if v == value]


@pytest.mark.parametrize("ordering", ["none", "key"])
def test_a_record_failing_twice_succeeds_at_attempt_3_through_the_retry_topics_and_the_partition_goes_on(
    kafka: KafkaTestKit, ordering: str
) -> None:
    """The records after it (other keys) pass it, with or without key order."""
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    kafka.produce(
        src,
        [
            {"key": b"k", "value": b"flaky", "partition": 1, "headers": [("trace", b"t-1")]},
            *({"key": b"k%d" % i, "value": b"ok-%d" % i, "partition": 1} for i in range(5)),
        ],
    )
    app = make_app(kafka)
    calls: list[tuple[bytes, int, float]] = []
    views: list[Record] = []

    @app.listener(src, output=out, max_attempts=3, backoff=1.0, dlq=True, **{**TOPICS, "ordering": ordering})
    def handle(record: Record) -> bytes:
        value = record.value or b""
        calls.append((value, record.attempt, time.monotonic()))
        if value == b"flaky":
            views.append(record)
            if record.attempt < 3:
                raise Transient(f"attempt {record.attempt}")
        return b"out-" + value

    with running(app):
        wait_for(lambda: _seen(calls, b"flaky") == [1, 2, 3], 30, message="flaky handled at attempt 3")
        wait_for(lambda: len(kafka.read(out)) == 6, 30, message="six outputs committed")
        wait_for(lambda: _hops_committed(kafka, app.group_id, src), 30, message="the retry topic committed")
    outputs = Counter(r.value for r in kafka.read(out))
    assert outputs == Counter([b"out-flaky", *(b"out-ok-%d" % i for i in range(5))]), "each output exactly once"
    assert [v.attempt for v in views] == [1, 2, 3]
    for view in views:  # the handler saw the original record every time, never the hop's own coordinates
        assert (view.topic, view.partition, view.offset, view.key) == (src, 1, 0, b"k")
        assert view.headers == [("trace", b"t-1")], view.headers  # kafkatx's retry headers hidden
    order = [v for v, _, _ in calls]
    assert order.index(b"ok-4") < order.index(b"flaky", 1), "the records after it were handled before its retry"
    hops = kafka.read(src + "-retry")
    assert [h.partition for h in hops] == [1, 1], "two hops, on the record's own partition"
    assert [int.from_bytes(h.header(ATTEMPTS) or b"", "big") for h in hops] == [2, 3]
    assert kafka.read(src + "-dlt") == []


def test_the_retry_comes_no_earlier_than_the_backoff_after_the_failure(kafka: KafkaTestKit) -> None:
    src = kafka.topic()
    kafka.produce(src, [b"once"])
    app = make_app(kafka)
    failed_at: list[float] = []
    called_at: dict[int, float] = {}

    @app.listener(src, max_attempts=2, backoff=1.5, dlq=True, **TOPICS)
    def handle(record: Record) -> None:
        called_at[record.attempt] = time.time()
        if record.attempt == 1:
            failed_at.append(time.time())
            raise Transient("the first call fails")

    scheduled: list[RecordRetryScheduled] = []
    app.on(RecordRetryScheduled)(scheduled.append)
    with running(app):
        wait_for(lambda: 2 in called_at, 30, message="the second attempt")
    assert called_at[2] - failed_at[0] >= 1.5, called_at[2] - failed_at[0]
    assert [(e.attempt, e.delay) for e in scheduled] == [(2, 1.5)], "the retry event names the next attempt and delay"


@pytest.mark.parametrize("ordering", ["none", "key"])
def test_a_record_due_later_does_not_delay_one_due_earlier(kafka: KafkaTestKit, ordering: str) -> None:
    """Exponential back-off (1 s, then 2 s): A's second failure waits 2 s in -retry-2000 while B's first retry,
    due 1 s after its failure in -retry-1000, is handled before it (keys a and b: key order holds back neither)."""
    src = kafka.topic()
    kafka.produce(src, [{"key": b"a", "value": b"A"}])
    app = make_app(kafka)
    calls: list[tuple[bytes, int, float]] = []

    @app.listener(
        src,
        max_attempts=3,
        backoff=wait_exponential(multiplier=1, max=10),
        dlq=True,
        **{**TOPICS, "ordering": ordering},
    )
    def handle(record: Record) -> None:
        value = record.value or b""
        calls.append((value, record.attempt, time.time()))
        if value == b"A" and record.attempt < 3 or value == b"B" and record.attempt < 2:
            raise Transient(f"{value!r} attempt {record.attempt}")

    with running(app):
        wait_for(lambda: _seen(calls, b"A") == [1, 2], 30, message="A's second attempt")
        kafka.produce(src, [{"key": b"b", "value": b"B"}])  # fails at once: due 1 s later, A 2 s after its own
        wait_for(lambda: _seen(calls, b"A") == [1, 2, 3] and _seen(calls, b"B") == [1, 2], 30, message="both done")
    order = [(v, a) for v, a, _ in calls]
    assert order.index((b"B", 2)) < order.index((b"A", 3)), order
    a2, a3 = (t for v, a, t in calls if v == b"A" and a in (2, 3))
    assert a3 - a2 >= 2.0, "A waited its 2 s level"
    assert [r.value for r in kafka.read(src + "-retry-2000")] == [b"A"]
    assert sorted(r.value or b"" for r in kafka.read(src + "-retry-1000")) == [b"A", b"B"]


def test_a_due_record_is_not_held_back_by_one_not_due_behind_it_in_its_retry_partition(kafka: KafkaTestKit) -> None:
    """A fails, then B 1.5 s later (keys a and b, one partition: one retry partition, one delay of 3 s). When A
    comes due, one fetch brings A (due) and B (due 1.5 s later): A is handled then, at about its back-off; B's due
    time gates B alone. (Before, A went back with B and ran only when B was due, a back-off late at worst.)"""
    src = kafka.topic()
    app = make_app(kafka)
    failed: dict[bytes, float] = {}
    retried: dict[bytes, float] = {}

    @app.listener(src, max_attempts=2, backoff=3.0, dlq=True, **TOPICS)
    def handle(record: Record) -> None:
        value = record.value or b""
        if record.attempt == 1:
            failed[value] = time.monotonic()
            raise Transient(f"{value!r} fails once")
        retried[value] = time.monotonic()

    with running(app):
        kafka.produce(src, [{"key": b"a", "value": b"A"}])
        wait_for(lambda: b"A" in failed, 30, message="A's first failure")
        threading.Event().wait(1.5)  # the scenario itself: B fails 1.5 s after A, so it is due 1.5 s after A
        kafka.produce(src, [{"key": b"b", "value": b"B"}])
        wait_for(lambda: len(retried) == 2, 30, message="both retried")
    a_waited, b_waited = retried[b"A"] - failed[b"A"], retried[b"B"] - failed[b"B"]
    assert 3.0 <= a_waited < 3.0 + 1.0, (
        f"A ran {a_waited:.2f}s after its failure (B was due {b_waited:.2f}s after its own)"
    )
    assert retried[b"A"] < failed[b"B"] + 3.0, "A ran before B was due"


def test_always_failing_is_dead_lettered_after_max_attempts_naming_the_original_and_not_retryable_at_once(
    kafka: KafkaTestKit,
) -> None:
    src = kafka.topic(partitions=2)
    kafka.produce(
        src,
        [
            {"value": b"ok-0", "partition": 1},
            {"value": b"always", "partition": 1, "headers": [("own", b"h")]},
            {"value": b"fatal", "partition": 0},
        ],
    )
    app = make_app(kafka)
    attempts: dict[bytes, list[int]] = defaultdict(list)

    @app.listener(src, max_attempts=3, backoff=0.3, dlq=True, not_retryable=(PoisonError,), **TOPICS)
    def handle(record: Record) -> None:
        value = record.value or b""
        attempts[value].append(record.attempt)
        if value == b"always":
            raise Transient("never works")
        if value == b"fatal":
            raise PoisonError("never valid")

    with running(app):
        wait_for(lambda: len(kafka.read(src + "-dlt")) == 2, 30, message="two dead letters")
        wait_for(lambda: _hops_committed(kafka, app.group_id, src), 30, message="the hops committed")
    assert attempts == {b"ok-0": [1], b"always": [1, 2, 3], b"fatal": [1]}
    dead = {d.value: (d, parse_dead_letter_headers(d.headers)) for d in kafka.read(src + "-dlt")}
    record, info = dead[b"always"]
    assert (info.original_topic, info.original_partition, info.original_offset) == (src, 1, 1)
    assert info.attempts == 3 and info.exception_message == "never works"
    assert record.header("own") == b"h" and record.header(ATTEMPTS) is None, "no hop header in the dead letter"
    _, info = dead[b"fatal"]
    assert (info.original_topic, info.original_partition, info.original_offset) == (src, 0, 0)
    assert info.exception_fqcn == POISON_FQCN and info.attempts == 1
    assert [h.value for h in kafka.read(src + "-retry")] == [b"always", b"always"], "no hop for the fatal record"


def test_a_tombstone_an_empty_key_and_an_empty_value_come_back_from_the_retry_topic_as_they_were(
    kafka: KafkaTestKit,
) -> None:
    """None and empty bytes are different records: a hop keeps each as it was (key order on, the default)."""
    src, out = kafka.topic(partitions=1), kafka.topic(partitions=1)
    kafka.produce(src, [{"key": b"k", "value": None}, {"key": b"", "value": b"v"}, {"key": None, "value": b""}])
    app = make_app(kafka)
    attempts: dict[tuple[bytes | None, bytes | None], list[int]] = defaultdict(list)

    @app.listener(src, output=out, max_attempts=3, backoff=0.3, dlq=True, retry="topics")
    def handle(record: Record) -> bytes:
        attempts[(record.key, record.value)].append(record.attempt)
        if record.attempt == 1:
            raise Transient("once")
        return b"%r/%r" % (record.key, record.value)

    with running(app):
        wait_for(lambda: len(kafka.read(out)) == 3, 30, message="three outputs")
        wait_for(lambda: _hops_committed(kafka, app.group_id, src), 30, message="the hops committed")
    assert attempts == {(b"k", None): [1, 2], (b"", b"v"): [1, 2], (None, b""): [1, 2]}
    assert sorted(kafka.values(out)) == sorted([b"b'k'/None", b"b''/b'v'", b"None/b''"])


def test_a_hop_its_retry_topic_refuses_dead_letters_its_record_saying_why_and_the_partition_goes_on(
    kafka: KafkaTestKit,
) -> None:
    """A record near its topic's size limit fails, and its hop (the record plus the hop's headers) is larger than the
    retry topic takes: the broker refuses it at the commit. The record is dead-lettered naming the refusal and the
    retry topic, the records around it are output once each, the retry topic holds nothing, and the App goes on."""
    src, out = kafka.topic(partitions=1), kafka.topic(partitions=1)
    kafka.topic(name=src + "-retry", config={"max.message.bytes": "3000"})
    kafka.topic(name=src + "-dlt")
    kafka.produce(src, [(b"a", b"ok-a"), (b"big", b"x" * 2500), (b"b", b"ok-b")])
    app = make_app(kafka)

    @app.listener(src, output=out, max_attempts=3, backoff=1.0, dlq=True, **TOPICS)
    def handle(record: Record) -> bytes:
        value = record.value or b""
        if value.startswith(b"x"):
            raise Transient("worth a retry, but its hop is too large for the retry topic")
        return b"out-" + value

    with running(app):
        wait_for(lambda: len(kafka.read(src + "-dlt")) == 1, 30, message="the big record dead-lettered")
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="the input committed")
        assert app.failure is None, app.failure
    assert Counter(kafka.values(out)) == Counter([b"out-ok-a", b"out-ok-b"]), "each other record's output once"
    (dead,) = kafka.read(src + "-dlt")
    info = parse_dead_letter_headers(dead.headers)
    assert dead.value == b"x" * 2500 and (info.original_topic, info.original_offset) == (src, 1)
    assert info.exception_fqcn == "kafkatx.errors.OutputRefusedError", info.exception_fqcn
    assert info.exception_message is not None and src + "-retry" in info.exception_message
    assert "MSG_SIZE_TOO_LARGE" in info.exception_message, info.exception_message
    assert kafka.read(src + "-retry") == [], "the refused hop never committed"


def test_a_record_dead_lettered_through_the_retry_topics_and_replayed_to_its_topic_runs_from_attempt_1_once(
    kafka: KafkaTestKit,
) -> None:
    """The operator's path after a fix: ``kafkatx dlq replay`` puts the dead letter back on its input topic, and
    the running listener handles it as a new record (attempt 1, not its old count, not a hop), its output once."""
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    kafka.produce(
        src,
        [
            {"key": b"a", "value": b"ok-0", "partition": 0},
            {"key": b"b", "value": b"broken", "partition": 1, "headers": [("own", b"h")]},
            {"key": b"b", "value": b"ok-1", "partition": 1},  # follows its key's record in retry (key order)
        ],
    )
    app = make_app(kafka)
    fixed = threading.Event()
    calls: list[tuple[bytes, int]] = []

    @app.listener(src, output=out, max_attempts=3, backoff=0.2, dlq=True, retry="topics", ordering="key")
    def handle(record: Record) -> bytes:
        calls.append((record.value or b"", record.attempt))
        if record.value == b"broken" and not fixed.is_set():
            raise Transient("not yet fixed")
        return b"out-" + (record.value or b"")

    with running(app):
        wait_for(lambda: len(kafka.read(src + "-dlt")) == 1, 30, message="the dead letter")
        wait_for(lambda: len(kafka.read(out)) == 2, 30, message="the other records' outputs")
        fixed.set()
        assert replay_dlq(kafka.bootstrap_servers, src + "-dlt").replayed == 1
        wait_for(lambda: len(kafka.read(out)) == 3, 30, message="the replayed record's output")
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="every input offset committed")
    assert Counter(kafka.values(out)) == Counter([b"out-ok-0", b"out-ok-1", b"out-broken"]), "each output once"
    assert [a for v, a in calls if v == b"broken"] == [1, 2, 3, 1], "replayed: a new record, from attempt 1"
    assert len(kafka.read(src + "-dlt")) == 1, "not dead-lettered again"
    replayed = [r for r in kafka.read(src) if r.value == b"broken"][-1]
    assert replayed.header("own") == b"h" and replayed.header(ATTEMPTS) is None, "no hop header on the input topic"


def test_a_restart_with_records_in_retry_does_each_exactly_once_and_attempts_never_go_back(
    kafka: KafkaTestKit,
) -> None:
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    values = [b"r-%d" % i for i in range(6)]
    kafka.produce(src, [{"value": v, "partition": i % 2} for i, v in enumerate(values)])
    first = make_app(kafka, name="retry-restart")
    seen: dict[bytes, list[int]] = defaultdict(list)
    lock = threading.Lock()

    def handler(record: Record) -> bytes:
        with lock:
            seen[record.value or b""].append(record.attempt)
        if record.attempt < 3:
            raise Transient("not yet")
        return b"done-" + (record.value or b"")

    first.listener(src, output=out, max_attempts=4, backoff=3.0, dlq=True, **TOPICS)(handler)
    with running(first):
        wait_for(lambda: kafka.caught_up(first.group_id, src), 30, message="every input offset committed")
        wait_for(lambda: len(kafka.read(src + "-retry")) == 6, 30, message="six hops committed")
    assert all(attempts == [1] for attempts in seen.values()), "stopped with every record in retry"
    second = App(first.name, bootstrap_servers=kafka.bootstrap_servers, group_id=first.group_id, instance_id="other")
    second.listener(src, output=out, max_attempts=4, backoff=3.0, dlq=True, **TOPICS)(handler)
    with running(second):
        wait_for(lambda: len(kafka.read(out)) == 6, 60, message="six outputs")
        wait_for(lambda: _hops_committed(kafka, second.group_id, src), 30, message="the hops committed")
    assert Counter(r.value for r in kafka.read(out)) == Counter(b"done-" + v for v in values), "each exactly once"
    assert {v: seen[v] for v in values} == {v: [1, 2, 3] for v in values}, "attempts never went back or repeated"
    assert kafka.read(src + "-dlt") == []


def test_declaration_errors(kafka: KafkaTestKit) -> None:
    app = make_app(kafka)
    with pytest.raises(InvalidConfigurationError, match="cannot keep partition order"):
        app.listener(kafka.topic(), retry="topics", ordering="partition")(lambda record: None)
    src = kafka.topic()
    kafka.topic(name=src + "-dlt")
    kafka.topic(name=src + "-retri")
    strict = make_app(kafka)
    strict.listener(src, dlq=DeadLetterPublishingRecoverer(create_topics=False), **TOPICS)(lambda record: None)
    with pytest.raises(InvalidConfigurationError, match=rf"retry topic '{src}-retry'.*did you mean '{src}-retri'"):
        strict.start()
    strict.stop(timeout=10)
