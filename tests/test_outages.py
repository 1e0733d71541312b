"""Dependency outages against the local broker: no attempt burnt, nothing dead-lettered, the whole listener paused."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from kafkatx import App, OutageTooLongError, Record
from kafkatx.events import HandlerFailed, OutageEnded, OutageStarted, RecordRecovered
from kafkatx.metrics import instrument
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for


def make_app(kafka: KafkaTestKit) -> App:
    return App(unique_name("outage"), bootstrap_servers=kafka.bootstrap_servers, instance_id="test")


def test_an_outage_costs_no_attempt_dead_letters_nothing_and_pauses_every_container(kafka: KafkaTestKit) -> None:
    src, out = kafka.topic(partitions=2), kafka.topic()
    app = make_app(kafka)
    down = threading.Event()
    down.set()
    calls: list[tuple[int, bytes, int, bool]] = []  # (partition, value, attempt, the dependency was down)
    started: list[OutageStarted] = []
    ended: list[OutageEnded] = []
    failed: list[HandlerFailed] = []
    recovered: list[RecordRecovered] = []
    app.on(OutageStarted)(started.append)
    app.on(OutageEnded)(ended.append)
    app.on(HandlerFailed)(failed.append)
    app.on(RecordRecovered)(recovered.append)
    metrics = instrument(app)

    def metric(name: str) -> float | None:
        sample = metrics.registry.get_sample_value(name, {"app": app.name, "listener": "payments"})
        return None if sample is None else float(sample)

    @app.listener(src, output=out, concurrency=2, max_attempts=3, dlq=True, name="payments", backoff=0)
    def handle(record: Record) -> bytes:
        is_down = down.is_set()
        calls.append((record.partition, record.value or b"", record.attempt, is_down))
        if is_down:
            raise ConnectionError("payments API unreachable")
        return (record.value or b"").upper()

    def retries_of_the_first_record() -> int:
        return sum(1 for p, v, _, was_down in calls if (p, v, was_down) == (0, b"a0", True)) - 1

    first = [f"a{i}".encode() for i in range(5)]
    later = [f"b{i}".encode() for i in range(5)]
    with running(app):
        wait_for(lambda: all(len(c.assigned) == 1 for c in app.containers), 60, message="one partition each")
        kafka.produce(src, [{"value": v, "partition": 0} for v in first])
        wait_for(lambda: started, 30, message="the outage started")
        wait_for(lambda: retries_of_the_first_record() >= 1, 30, message="a first retry of the waiting record")
        # Every container of the listener is paused: records for the other container's partition wait too.
        kafka.produce(src, [{"value": v, "partition": 1} for v in later])
        wait_for(lambda: retries_of_the_first_record() >= 3, 30, message="the outage lasting a few seconds")
        assert [c for c in calls if c[0] == 1] == [], "the other container handled records during the outage"
        assert metric("kafkatx_listener_in_outage") == 1.0
        down.clear()
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="everything committed after the outage")
    assert Counter(kafka.values(out)) == Counter(v.upper() for v in first + later), "every output exactly once"
    assert failed == [] and recovered == [], "an outage counted against a record"
    assert {attempt for _, _, attempt, _ in calls} == {1}, "the handler saw attempt 1 throughout"
    assert all(p == 0 for p, _, _, was_down in calls if was_down), "only the waiting record's partition was retried"
    assert len(started) == 1 and len(ended) == 1, "one outage, one start and one end"
    assert started[0].listener == "payments" and started[0].record is not None and started[0].record.offset == 0
    assert ended[0].retries >= 3 and ended[0].seconds >= 3.0
    assert metric("kafkatx_listener_in_outage") == 0.0 and metric("kafkatx_outages_total") == 1.0


def test_an_operator_pauses_and_resumes_a_listener(kafka: KafkaTestKit) -> None:
    src, out = kafka.topic(), kafka.topic()
    app = make_app(kafka)
    handled: list[bytes] = []

    @app.listener(src, output=out, name="orders")
    def handle(record: Record) -> bytes:
        handled.append(record.value or b"")
        return record.value or b""

    with running(app):
        (container,) = app.containers
        wait_for(lambda: container.assigned, 60, message="the partition assigned")
        kafka.produce(src, [b"before"])
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="the first record committed")
        app.pause("orders")
        paused_at = time.monotonic()
        wait_for(lambda: container.polled_at > paused_at, 10, message="the poll under way at the pause returned")
        kafka.produce(src, [b"x", b"y", b"z"])
        produced_at = time.monotonic()
        wait_for(lambda: container.polled_at > produced_at + 1.5, 30, message="the paused consumer polling on")
        assert handled == [b"before"], "a paused listener handled records"
        app.resume("orders")
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="the rest committed after resume")
    assert handled == [b"before", b"x", b"y", b"z"]
    assert kafka.values(out) == [b"before", b"x", b"y", b"z"], "each output once, in order"


def test_an_outage_longer_than_max_outage_stops_the_app_with_a_clear_message(kafka: KafkaTestKit) -> None:
    src = kafka.topic()
    app = make_app(kafka)
    recovered: list[RecordRecovered] = []
    app.on(RecordRecovered)(recovered.append)

    @app.listener(src, max_attempts=1, dlq=True, max_outage=2.0, name="cache", backoff=0)
    def handle(record: Record) -> None:
        raise ConnectionError("cache cluster unreachable")

    kafka.produce(src, [b"x"])
    app.start()
    try:
        assert app.wait(60), "the App stopped by itself"
    finally:
        app.stop(timeout=30)
    failure = app.failure
    assert isinstance(failure, OutageTooLongError)
    assert "'cache'" in str(failure) and "max_outage=2s" in str(failure) and "cache cluster unreachable" in str(failure)
    assert recovered == [], "the record was not dead-lettered"
    assert kafka.committed(app.group_id, src) in ({}, {0: 0}), "nothing committed past the waiting record"


@pytest.mark.parametrize("in_flight", [1, 4])
def test_an_outage_under_retry_in_place_costs_no_attempt_either(kafka: KafkaTestKit, in_flight: int) -> None:
    """retry="in_place" retries a failed record inside the batch's transaction; an outage is not the record's
    failure there either: the listener pauses, no attempt is counted, nothing is dead-lettered."""
    src, out = kafka.topic(), kafka.topic()
    app = make_app(kafka)
    down = threading.Event()
    down.set()
    calls: list[tuple[bytes, int, bool]] = []
    failed: list[HandlerFailed] = []
    recovered: list[RecordRecovered] = []
    started: list[OutageStarted] = []
    app.on(HandlerFailed)(failed.append)
    app.on(RecordRecovered)(recovered.append)
    app.on(OutageStarted)(started.append)

    @app.listener(src, output=out, retry="in_place", max_attempts=2, dlq=True, in_flight=in_flight, backoff=0)
    def handle(record: Record) -> bytes:
        calls.append((record.value or b"", record.attempt, down.is_set()))
        if down.is_set():
            raise ConnectionError("cache unreachable")
        return (record.value or b"").upper()

    values = [b"x%d" % i for i in range(3)]
    with running(app):
        kafka.produce(src, values)
        wait_for(lambda: sum(1 for _, _, was_down in calls if was_down) >= 3, 30, message="retried during the outage")
        down.clear()
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="everything committed after the outage")
    assert Counter(kafka.values(out)) == Counter(v.upper() for v in values), "every output exactly once"
    assert failed == [] and recovered == [], "the outage was counted against the record"
    assert {attempt for _, attempt, _ in calls} == {1}, "the handler saw attempt 1 throughout"
    assert len(started) == 1
