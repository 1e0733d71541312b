"""What goes to a dead-letter topic, and what never does: clean cause chains, no loops, each record's own blame.

Found against Spring Kafka's expectations in issue 11 (items 11.1, 11.4, 11.8).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from helpers import PoisonError, make_app

from kafkatx import DeadLetterPublishingRecoverer, Record
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.events import RecordRecovered, RecoveryFailed
from kafkatx.rollback.classifier import cause_chain
from kafkatx.testing import KafkaTestKit, running, wait_for


class MateError(Exception):
    pass


def test_no_internal_exception_reaches_a_users_cause_chain_or_a_dead_letter_header(kafka: KafkaTestKit) -> None:
    """11.1: a dead-lettered record must not get kafkatx's internal failure signal as its __context__ (seen in
    kafka_dlt-exception-cause-fqcn). Since issue 39 the batch-mate before the poison record is never re-run."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"mate", b"poison"])
    app = make_app(kafka)
    calls: Counter[bytes] = Counter()
    recovered: list[BaseException] = []
    app.on(RecordRecovered)(lambda e: recovered.append(e.exception))

    @app.listener(src, output=out, max_attempts=1, dlq=True, backoff=0)
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
    assert set(dead) == {b"poison"} and calls[b"mate"] == 1, "the mate committed once, never re-run"
    assert dead[b"poison"].exception_fqcn == f"{PoisonError.__module__}.PoisonError"
    assert dead[b"poison"].exception_cause_fqcn in (None, f"{PoisonError.__module__}.PoisonError")
    assert "HandlerFailure" not in (dead[b"poison"].exception_stacktrace or "")
    for exc in recovered:
        assert all(not type(link).__module__.startswith("kafkatx") for link in cause_chain(exc)), list(cause_chain(exc))
    assert dead[b"poison"].attempts == 1


def test_a_fatal_record_is_never_republished_to_its_own_topic(kafka: KafkaTestKit) -> None:
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


def test_a_dead_letter_is_not_blamed_for_another_records_delivery(kafka: KafkaTestKit) -> None:
    """11.8: the recoverer checked every delivery error of the transaction, so a batch-mate's refused output
    failed the poison record's recovery. Now the dead-letter record's own delivery decides."""
    src, out = kafka.topic(), kafka.topic(config={"max.message.bytes": "2000"})
    kafka.produce(src, [b"big", b"poison"])
    app = make_app(kafka)
    recovery_failures: list[Any] = []
    app.on(RecoveryFailed)(recovery_failures.append)

    @app.listener(src, output=out, max_attempts=1, dlq=True, backoff=0)
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
