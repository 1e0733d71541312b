"""Failure paths checked against Spring Kafka's expectations (issue 11) and the bounce-test findings (issue 17).

Each test names the item it covers; each failed on the code before the one
failure policy (rollback/policy.py) and the per-record tracker.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from typing import Any

import pytest
from confluent_kafka import Consumer
from helpers import PoisonError, make_app

from kafkatx import DeadLetterPublishingRecoverer, DefaultAfterRollbackProcessor, Record
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.events import HandlerFailed, PartitionsAssigned, RecordRecovered, RecoveryFailed
from kafkatx.rollback.classifier import cause_chain
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for


class MateError(Exception):
    pass


class BaseFailure(Exception):
    pass


class SubFailure(BaseFailure):
    pass


def test_11_1_no_internal_exception_reaches_a_users_cause_chain_or_a_dead_letter_header(kafka: KafkaTestKit) -> None:
    """11.1: a batch-mate that fails while it is re-run in the after-rollback transaction must not get
    kafkatx's internal failure signal as its __context__ (seen in kafka_dlt-exception-cause-fqcn)."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"mate", b"poison"])
    app = make_app(kafka)
    calls: Counter[bytes] = Counter()
    recovered: list[BaseException] = []
    app.on(RecordRecovered)(lambda e: recovered.append(e.exception))

    @app.listener(src, output=out, max_attempts=1, dlq=True)
    def handle(record: Record) -> bytes:
        value = record.value or b""
        calls[value] += 1
        if value == b"poison":
            raise PoisonError("poison")
        if calls[value] > 1:  # the mate succeeds once, then fails whenever it is re-run
            raise MateError("mate fails when re-run")
        return value

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    dead = {d.value: parse_dead_letter_headers(d.headers) for d in kafka.read(src + "-dlt")}
    assert set(dead) == {b"mate", b"poison"}
    assert dead[b"mate"].exception_fqcn == f"{__name__}.MateError"
    assert dead[b"mate"].exception_cause_fqcn in (None, f"{__name__}.MateError"), dead[b"mate"].exception_cause_fqcn
    assert "poison" not in (dead[b"mate"].exception_message or ""), "another record's failure leaked into the message"
    assert "HandlerFailure" not in (dead[b"mate"].exception_stacktrace or "")
    for exc in recovered:
        assert all(not type(link).__module__.startswith("kafkatx") for link in cause_chain(exc)), list(cause_chain(exc))
    assert dead[b"mate"].attempts == 1


def test_11_2_the_attempt_a_handler_sees_is_the_attempt_the_decision_uses(kafka: KafkaTestKit) -> None:
    """11.2 / 17.1: every failure is counted against the attempt number the handler was given,
    batch-mates re-run in the after-rollback transaction included."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"x", b"p"])
    app = make_app(kafka)
    calls: Counter[bytes] = Counter()
    seen: dict[tuple[bytes, int], int] = {}  # (value, call number) -> the attempt the handler was given
    failed: list[tuple[bytes, int]] = []
    app.on(HandlerFailed)(lambda e: failed.append((e.record.value or b"", e.attempt)))

    @app.listener(src, output=out, max_attempts=3, dlq=True)
    def handle(record: Record) -> bytes:
        value = record.value or b""
        calls[value] += 1
        seen[(value, calls[value])] = record.attempt
        if value == b"p" or (value == b"x" and calls[value] in (1, 2, 4)):
            raise PoisonError(f"{value!r} call {calls[value]}")
        return value

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    handler_attempts = [seen[(v, n)] for v, n in sorted(seen) if (v == b"x" and n in (1, 2, 4)) or v == b"p"]
    assert sorted(handler_attempts) == sorted(a for _v, a in failed), (seen, failed)
    dead = {d.value: parse_dead_letter_headers(d.headers).attempts for d in kafka.read(src + "-dlt")}
    assert dead[b"p"] == 3
    x_attempts = [seen[(b"x", n)] for n in range(1, calls[b"x"] + 1)]
    expected, failures_since_success = [], 0
    for n in range(1, calls[b"x"] + 1):
        expected.append(failures_since_success + 1)
        failures_since_success = failures_since_success + 1 if n in (1, 2, 4) else 0
    assert x_attempts == expected, "a success ends the count (issue 28): its next failure is attempt 1 again"
    if b"x" in dead:
        assert dead[b"x"] == max(x_attempts), "dead-lettered at the attempt the handler was told"


def test_17_1_a_record_that_fails_once_beside_a_poison_record_sees_1_then_2_and_commits(kafka: KafkaTestKit) -> None:
    """17.1: attempt numbers did go 1, 2, 1, 2, 1, 3 on replay, and the record was dead-lettered.

    Since issue 28 a success ends the count: the re-run after its success is attempt 1 again."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"flaky", b"poison"])
    app = make_app(kafka)
    flaky: list[int] = []

    @app.listener(src, output=out, max_attempts=3, dlq=True)
    def handle(record: Record) -> bytes:
        if record.value == b"poison":
            raise PoisonError("always")
        flaky.append(record.attempt)
        if len(flaky) == 1:
            raise MateError("only the first delivery fails")
        return b"ok"

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    assert flaky == [1, 2, 1], "failed at 1, succeeded at 2, re-run beside the poison record as a new episode"
    assert kafka.values(out) == [b"ok"], "committed once"
    assert [d.value for d in kafka.read(src + "-dlt")] == [b"poison"]


def test_11_3_a_more_general_exception_keeps_counting_as_in_spring(kafka: KafkaTestKit) -> None:
    """11.3: Spring resets the count only when the previous root cause is not an instance of the new one's class."""
    src = kafka.topic()
    kafka.produce(src, [b"p"])
    app = make_app(kafka)
    raises = [SubFailure, BaseFailure, BaseFailure, BaseFailure, BaseFailure]
    calls: list[int] = []

    @app.listener(src, max_attempts=3, dlq=True)
    def handle(record: Record) -> None:
        calls.append(record.attempt)
        raise raises[len(calls) - 1]("x")

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    assert calls == [1, 2, 3], "SubFailure then BaseFailure: the same kind, so three attempts"


def test_11_4_a_fatal_record_is_never_republished_to_its_own_topic(kafka: KafkaTestKit) -> None:
    """11.4: a dlq resolver that returns the source topic must not loop a not-retryable record."""
    src = kafka.topic()
    kafka.produce(src, [b"bad"])
    app = make_app(kafka)
    calls: list[bytes | None] = []

    @app.listener(src, dlq=DeadLetterPublishingRecoverer(topic=lambda r, e: r.topic), not_retryable=(ValueError,))
    def handle(record: Record) -> None:
        calls.append(record.value)
        if record.value == b"bad":
            raise ValueError("never valid")

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="committed")
        # A copy of "bad" republished to its own topic would sit before this marker, and be handled before it.
        kafka.produce(src, [b"marker"])
        wait_for(lambda: b"marker" in calls and kafka.caught_up(app.group_id, src), 30, message="marker committed")
    assert calls == [b"bad", b"marker"], "the bad record was handled once, not republished and handled again"
    assert kafka.end_offsets(src) == {0: 2}, "the topic grew by the marker only"


@pytest.mark.parametrize("retry", ["in_place", "rollback"])
def test_11_5_stopping_during_a_back_off_decides_nothing(kafka: KafkaTestKit, retry: str) -> None:
    """11.5: with a long back-off, stopping after attempt 1 must not call the recoverer (a rolling deploy
    would dead-letter records that failed once)."""
    src = kafka.topic()
    kafka.produce(src, [b"a", b"x"])
    app = make_app(kafka)
    failed = threading.Event()
    recovered: list[Any] = []
    app.on(RecordRecovered)(recovered.append)

    @app.listener(src, max_attempts=2, backoff=30, dlq=True, retry=retry)  # type: ignore[arg-type]
    def handle(record: Record) -> None:
        if record.value == b"x":
            failed.set()
            raise TimeoutError("down")

    app.start()
    try:
        assert failed.wait(20)
        wait_for(lambda: app.containers[0].alive, 5)
    finally:
        app.stop(timeout=15)
    assert recovered == []
    assert kafka.read(src + "-dlt") == []
    assert kafka.committed(app.group_id, src).get(0, 0) <= 1, "x was not committed"


def test_11_6_in_place_retries_follow_the_after_rollback_processor(kafka: KafkaTestKit) -> None:
    """11.6: retry="in_place" ignored after_rollback= (its max_attempts, recoverer, and its DLT at startup)."""
    src, dlt = kafka.topic(), unique_name("custom-dlt")
    kafka.produce(src, [b"p"])
    app = make_app(kafka)
    calls: list[int] = []
    processor = DefaultAfterRollbackProcessor(DeadLetterPublishingRecoverer(dlt), max_attempts=2)

    @app.listener(src, retry="in_place", after_rollback=processor)
    def handle(record: Record) -> None:
        calls.append(record.attempt)
        raise PoisonError("p")

    with running(app):
        assert dlt in kafka_topics(kafka), "the processor's dead-letter topic is created at startup"
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="committed")
    assert calls == [1, 2], "the processor's max_attempts"
    assert [d.value for d in kafka.read(dlt)] == [b"p"], "the processor's recoverer"


def kafka_topics(kafka: KafkaTestKit) -> set[str]:
    from confluent_kafka.admin import AdminClient

    return set(AdminClient({"bootstrap.servers": kafka.bootstrap_servers}).list_topics(timeout=10).topics)


def test_11_8_a_dead_letter_is_not_blamed_for_another_records_delivery(kafka: KafkaTestKit) -> None:
    """11.8: the recoverer checked every delivery error of the transaction, so a batch-mate's refused output
    failed the poison record's recovery. Now the dead-letter record's own delivery decides."""
    src, out = kafka.topic(), kafka.topic(config={"max.message.bytes": "2000"})
    kafka.produce(src, [b"big", b"poison"])
    app = make_app(kafka)
    recovery_failures: list[Any] = []
    app.on(RecoveryFailed)(recovery_failures.append)

    @app.listener(src, output=out, max_attempts=1, dlq=True)
    def handle(record: Record) -> bytes:
        if record.value == b"poison":
            raise PoisonError("p")
        return b"x" * 10_000  # refused by the broker: larger than the topic's max.message.bytes

    app.start()
    try:
        wait_for(lambda: app.failure is not None or kafka.caught_up(app.group_id, src), 30, message="an outcome")
    finally:
        app.stop(timeout=15)
    assert recovery_failures == [], [str(e.recovery_error) for e in recovery_failures]
    # Issue 28 part 2: the refused output is its input record's failure (no longer a stop of the App).
    assert app.failure is None, app.failure
    dead = {d.value: parse_dead_letter_headers(d.headers) for d in kafka.read(src + "-dlt")}
    assert sorted(dead) == [b"big", b"poison"]
    assert dead[b"big"].exception_fqcn == "kafkatx.errors.OutputRefusedError"
    assert "MSG_SIZE_TOO_LARGE" in (dead[b"big"].exception_message or "")
    assert dead[b"poison"].exception_fqcn is not None and dead[b"poison"].exception_fqcn.endswith("PoisonError")


def test_17_2_a_pause_ends_with_the_assignment_it_was_made_for(kafka: KafkaTestKit) -> None:
    """17.2: librdkafka keeps a partition paused across revoke and re-assign; a back-off pause did then
    outlive a rebalance and the partition was never fetched again."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"flaky"])
    app = make_app(kafka, consumer_config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500})
    attempts: list[int] = []
    assigned: list[Any] = []
    app.on(PartitionsAssigned)(assigned.append)

    @app.listener(src, output=out, backoff=120)
    def handle(record: Record) -> bytes:
        attempts.append(record.attempt)
        if record.attempt == 1:
            raise TimeoutError("first delivery fails; the partition is held for 120 s")
        return record.value or b""

    with running(app):
        wait_for(lambda: attempts == [1], 20, message="the first failure")
        wait_for(lambda: app.containers[0]._paused_until, 10, message="the back-off pause")
        before = len(assigned)
        other = Consumer(
            {
                "bootstrap.servers": kafka.bootstrap_servers,
                "group.id": app.group_id,
                "enable.auto.commit": False,
                "session.timeout.ms": 6000,
            }
        )
        other.subscribe([src])
        deadline = time.monotonic() + 30
        while len(assigned) == before and time.monotonic() < deadline:
            other.poll(0.2)  # joining makes the group rebalance: kafkatx's partition is revoked
        other.close()  # leaving rebalances again: the partition comes back
        wait_for(lambda: kafka.values(out) == [b"flaky"], 40, message="the record handled after the rebalance")
    assert attempts[:2] == [1, 2]


def test_11_concurrency_two_containers_retry_and_dead_letter_independently(kafka: KafkaTestKit) -> None:
    """Concurrency >= 2: each container counts its own records; poison is dead-lettered once, the rest once."""
    src, out = kafka.topic(partitions=4), kafka.topic()
    records = [{"value": b"p%d" % i if i % 25 == 0 else b"v%d" % i, "partition": i % 4} for i in range(200)]
    kafka.produce(src, records)
    app = make_app(kafka)
    attempts: dict[bytes, list[int]] = defaultdict(list)
    threads: set[str] = set()

    @app.listener(src, output=out, concurrency=2, max_attempts=2, dlq=True)
    def handle(record: Record) -> bytes:
        threads.add(threading.current_thread().name)
        value = record.value or b""
        if value.startswith(b"p"):
            attempts[value].append(record.attempt)
            raise PoisonError(value.decode())
        return value

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")
    poison = sorted(r["value"] for r in records if r["value"].startswith(b"p"))  # type: ignore[union-attr]
    assert sorted(d.value for d in kafka.read(src + "-dlt")) == poison
    assert all(a == [1, 2] for a in attempts.values()), attempts
    assert Counter(kafka.values(out)) == Counter(r["value"] for r in records if not r["value"].startswith(b"p"))  # type: ignore[union-attr]
