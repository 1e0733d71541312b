"""The events API (Spring's container events): real Apps against the local broker."""

from __future__ import annotations

import logging
import threading
import time
from typing import TypeVar

import pytest
from helpers import PoisonError, make_app

from kafkatx import App, Record, RecoveryExhaustedError
from kafkatx.events import (
    ContainerIdle,
    ContainerStarted,
    ContainerStopped,
    Event,
    HandlerFailed,
    PartitionsAssigned,
    PartitionsRevoked,
    RecordRecovered,
    RecordRetryScheduled,
    RecoveryFailed,
    TransactionAborted,
    TransactionCommitted,
)
from kafkatx.testing import KafkaTestKit, running, wait_for

E = TypeVar("E", bound=Event)


class Recorder:
    """Collects every event an App publishes, from any container thread."""

    def __init__(self, app: App) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()
        app.on(Event)(self._add)

    def _add(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def of(self, kind: type[E]) -> list[E]:
        with self._lock:
            return [e for e in self.events if type(e) is kind]

    def index(self, kind: type[Event]) -> int:
        with self._lock:
            return next(i for i, e in enumerate(self.events) if type(e) is kind)

    def committed_records(self) -> int:
        return sum(e.records for e in self.of(TransactionCommitted))


def test_lifecycle_events_in_order_with_payloads(kafka: KafkaTestKit) -> None:
    topic = kafka.topic(partitions=2)
    app = make_app(kafka)
    rec = Recorder(app)

    @app.listener(topic, name="lifecycle")
    def handle(record: Record) -> None:
        pass

    kafka.produce(topic, [{"value": b"v", "partition": p} for p in (0, 1, 1)])
    with running(app):
        wait_for(lambda: rec.committed_records() == 3, message="3 records committed")

    everything = {(topic, 0), (topic, 1)}
    (started,) = rec.of(ContainerStarted)
    assert (started.listener, started.worker, started.topics) == ("lifecycle", 0, (topic,))
    assert set().union(*(e.partitions for e in rec.of(PartitionsAssigned))) == everything
    revoked = rec.of(PartitionsRevoked)
    assert set().union(*(e.partitions for e in revoked)) == everything
    assert not any(e.lost for e in revoked)
    (stopped,) = rec.of(ContainerStopped)
    assert (stopped.listener, stopped.reason, stopped.error) == ("lifecycle", "normal", None)
    assert all(e.seconds > 0 and e.kind == "batch" for e in rec.of(TransactionCommitted))
    order = [rec.index(k) for k in (ContainerStarted, PartitionsAssigned, TransactionCommitted, PartitionsRevoked)]
    assert order == sorted(order)
    assert type(rec.events[-1]) is ContainerStopped
    assert rec.of(HandlerFailed) == [] and rec.of(TransactionAborted) == []


def test_failure_retry_and_recovery_events_carry_the_record_and_exception(kafka: KafkaTestKit) -> None:
    topic = kafka.topic()
    app = make_app(kafka, create_topics=True)
    rec = Recorder(app)
    raised: list[PoisonError] = []

    @app.listener(topic, max_attempts=2, dlq=True, name="orders", backoff=0)
    def handle(record: Record) -> None:
        if record.value == b"bad":
            raised.append(PoisonError(f"cannot handle offset {record.offset}"))
            raise raised[-1]

    kafka.produce(topic, [b"ok", b"bad", b"ok"])
    with running(app):
        wait_for(lambda: rec.of(RecordRecovered) and rec.committed_records() == 3, message="the bad record recovered")

    failed = rec.of(HandlerFailed)
    assert [(e.record.offset, e.attempt) for e in failed if e.record] == [(1, 1), (1, 2)]
    assert [e.exception for e in failed] == raised
    (retry,) = rec.of(RecordRetryScheduled)
    assert retry.record is not None and (retry.record.offset, retry.attempt) == (1, 2)
    (recovered,) = rec.of(RecordRecovered)
    assert recovered.listener == "orders"
    assert recovered.record is not None
    assert (recovered.record.topic, recovered.record.partition, recovered.record.offset) == (topic, 0, 1)
    assert recovered.record.value == b"bad"
    assert recovered.exception is raised[-1]
    assert recovered.recoverer == "DeadLetterPublishingRecoverer"
    assert rec.of(TransactionAborted) == [], "a handler failure aborts nothing"
    assert kafka.values(f"{topic}-dlt") == [b"bad"]


def test_recovery_failed_then_recovered(kafka: KafkaTestKit) -> None:
    topic = kafka.topic()
    app = make_app(kafka)
    rec = Recorder(app)
    dlq_down = ConnectionError("dead-letter store unreachable")
    recovered_values: list[bytes | None] = []

    def recoverer(record: Record, exc: BaseException) -> None:
        if not rec.of(RecoveryFailed):
            raise dlq_down
        recovered_values.append(record.value)

    @app.listener(topic, max_attempts=1, dlq=recoverer, recovery_backoff=0.1, name="flaky-dlq")
    def handle(record: Record) -> None:
        raise PoisonError("always")

    kafka.produce(topic, [b"bad"])
    with running(app):
        wait_for(lambda: rec.of(RecordRecovered), message="recovery to succeed the second time")

    (failure,) = rec.of(RecoveryFailed)
    assert failure.record is not None and (failure.record.offset, failure.record.value) == (0, b"bad")
    assert isinstance(failure.exception, PoisonError)
    assert failure.recovery_error is dlq_down
    assert failure.failures == 1
    assert rec.index(RecoveryFailed) < rec.index(RecordRecovered)
    assert recovered_values == [b"bad"]
    assert kafka.committed(app.group_id, topic) == {0: 1}


def test_stopped_with_reason_error_when_recovery_keeps_failing(kafka: KafkaTestKit) -> None:
    topic = kafka.topic()
    app = make_app(kafka)
    rec = Recorder(app)

    def broken(record: Record, exc: BaseException) -> None:
        raise ConnectionError("down")

    @app.listener(topic, max_attempts=1, dlq=broken, max_recovery_failures=1, name="doomed", backoff=0)
    def handle(record: Record) -> None:
        raise PoisonError("always")

    kafka.produce(topic, [b"bad"])
    app.start()
    try:
        assert app.wait(30), "the container should stop by itself"
    finally:
        app.stop()
    (stopped,) = rec.of(ContainerStopped)
    assert stopped.reason == "error"
    assert isinstance(stopped.error, RecoveryExhaustedError)
    assert stopped.error is app.failure
    assert rec.of(RecordRecovered) == []
    assert kafka.committed(app.group_id, topic).get(0, 0) == 0  # nothing skipped (a claim commits the start offset)


def test_a_raising_callback_does_not_break_processing(kafka: KafkaTestKit, caplog: pytest.LogCaptureFixture) -> None:
    topic = kafka.topic()
    out = kafka.topic()
    app = make_app(kafka)

    @app.on(TransactionCommitted)
    def explode(event: TransactionCommitted) -> None:
        raise RuntimeError("bug in a metrics callback")

    rec = Recorder(app)  # subscribed after the raising one: still called

    @app.listener(topic, output=out, name="sturdy")
    def handle(record: Record) -> bytes:
        return (record.value or b"").upper()

    kafka.produce(topic, [b"a", b"b", b"c"])
    with caplog.at_level(logging.ERROR, logger="kafkatx.events"), running(app):
        wait_for(lambda: rec.committed_records() == 3, message="all records committed")
    assert kafka.values(out) == [b"A", b"B", b"C"]
    assert kafka.committed(app.group_id, topic) == {0: 3}
    assert rec.of(ContainerStopped)[0].reason == "normal"
    assert any(
        r.name == "kafkatx.events" and r.exc_info and str(r.exc_info[1]) == "bug in a metrics callback"
        for r in caplog.records
    ), "the callback's failure should be logged"


def test_idle_event_after_the_interval_without_records(kafka: KafkaTestKit) -> None:
    topic = kafka.topic()
    app = make_app(kafka)
    rec = Recorder(app)

    @app.listener(topic, name="quiet", idle_event_interval=0.3)
    def handle(record: Record) -> None:
        pass

    with running(app):
        wait_for(lambda: len(rec.of(ContainerIdle)) >= 2, timeout=10, message="two idle events")
        kafka.produce(topic, [b"wake"])
        wait_for(lambda: rec.committed_records() == 1, message="the record")
        handled_by = time.monotonic()
        seen = len(rec.of(ContainerIdle))
        wait_for(lambda: len(rec.of(ContainerIdle)) > seen, timeout=10, message="idle again")
        # A record arrived: the idle clock restarted then. Without the restart it would count the >= 0.6 s of
        # the two idle events before as well.
        assert rec.of(ContainerIdle)[seen].idle_seconds < time.monotonic() - handled_by + 0.3
    idle = rec.of(ContainerIdle)
    assert idle[0].listener == "quiet"
    assert all(e.idle_seconds >= 0.3 for e in idle)
    assert idle[1].idle_seconds > idle[0].idle_seconds  # repeated while idle, with the total idle time
    assert rec.index(ContainerIdle) > rec.index(ContainerStarted)
