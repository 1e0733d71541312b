"""``retry="topics"`` seen from outside (issue 40): the records in retry and the oldest due time with
``ordering="none"`` too (rebuilt at assignment from the retry topics, never from memory), the retries handled, and
/readyz while records wait in retry."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
from confluent_kafka import Producer
from helpers import make_app
from test_health import get

from kafkatx import App, Record
from kafkatx.client.log import client_log
from kafkatx.events import Event, RecordsInRetry, RetryHandled, RetryPartitionFlowing, RetryPartitionStalled
from kafkatx.listener.loop import retry_stalls
from kafkatx.metrics import instrument
from kafkatx.retry_topics.headers import due_ms_of
from kafkatx.testing import KafkaTestKit, create_topic, running, unique_name, wait_for

TOPICS: dict[str, Any] = {"retry": "topics", "ordering": "none"}
QUIET = {"logger": client_log()}  # the raw producer's librdkafka lines through logging


class Transient(Exception):
    """A failure worth retrying."""


def test_records_in_retry_without_key_order_are_rebuilt_at_a_restart_with_their_oldest_due_time(
    kafka: KafkaTestKit,
) -> None:
    """The first App stops with every record in retry; the second, under the same group, counts them from the retry
    topics before it handles any, with the due time of the one due first, and tells each retry handled."""
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    values = [b"r-%d" % i for i in range(4)]
    kafka.produce(src, [{"key": b"k%d" % i, "value": v, "partition": i % 2} for i, v in enumerate(values)])

    def handler(record: Record) -> bytes:
        if record.attempt < 2:
            raise Transient("not yet")
        return b"done-" + (record.value or b"")

    first = make_app(kafka, name="retry-count")
    told: list[RecordsInRetry] = []
    first.on(RecordsInRetry)(told.append)
    first.listener(src, output=out, max_attempts=3, backoff=2.0, dlq=True, **TOPICS)(handler)
    with running(first):
        wait_for(lambda: told and told[-1].records == 4, 30, message="four records in retry, committed")
    hops = kafka.read(src + "-retry")
    assert len(hops) == 4
    oldest = min(due_ms_of(hop.headers) for hop in hops) / 1000.0
    assert [e.oldest_due for e in told if e.records == 4] == [oldest]
    assert (told[-1].records, told[-1].oldest_due) == (0, None), "its partitions revoked at the stop: none of its own"

    second = App(first.name, bootstrap_servers=kafka.bootstrap_servers, group_id=first.group_id, instance_id="other")
    metrics = instrument(second)
    seen: list[Event] = []
    second.on(RecordsInRetry)(seen.append)
    second.on(RetryHandled)(seen.append)
    at_first_retry: list[float | None] = []
    lock = threading.Lock()

    def retried(record: Record) -> bytes:
        with lock:
            if not at_first_retry:
                labels = {"app": second.name, "listener": listener}
                value = metrics.registry.get_sample_value("kafkatx_retry_oldest_due_timestamp_seconds", labels)
                at_first_retry.append(value)
        return handler(record)

    listener = "count"
    second.listener(src, name=listener, output=out, max_attempts=3, backoff=2.0, dlq=True, **TOPICS)(retried)
    with running(second):
        wait_for(lambda: len(kafka.read(out)) == 4, 60, message="four outputs")
        wait_for(lambda: _counts(seen)[-1:] == [(0, None)], 30, message="none left in retry")
    first_handled = next(i for i, e in enumerate(seen) if isinstance(e, RetryHandled))
    assert (4, oldest) in _counts(seen[:first_handled]), "rebuilt from the retry topics before any retry was handled"
    assert at_first_retry == [oldest], "the gauge said so before the first retry ran"
    handled = [e.record for e in seen if isinstance(e, RetryHandled) and e.record is not None]
    assert sorted((r.value, r.attempt, r.topic) for r in handled) == [(v, 2, src) for v in values]
    labels = {"app": second.name, "listener": listener}
    assert metrics.registry.get_sample_value("kafkatx_records_in_retry", labels) == 0
    assert metrics.registry.get_sample_value("kafkatx_retries_handled_total", labels) == 4
    assert metrics.registry.get_sample_value("kafkatx_retry_oldest_due_timestamp_seconds", labels) is None, (
        "no sample once none is in retry"
    )


def _counts(events: list[Event]) -> list[tuple[int, float | None]]:
    return [(e.records, e.oldest_due) for e in events if isinstance(e, RecordsInRetry)]


def test_a_listener_with_records_waiting_in_retry_stays_ready(kafka: KafkaTestKit) -> None:
    """Records due in 60 s wait in retry (their partition paused until due) for three times ``not_ready_after``:
    every /readyz answer meanwhile is 200, and a record produced meanwhile is handled: the listener processes."""
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    kafka.produce(src, [{"value": b"fails-%d" % p, "partition": p} for p in (0, 1)])
    app = make_app(kafka, name="retry-ready", health_port=0, not_ready_after=1.0)
    told: list[RecordsInRetry] = []
    app.on(RecordsInRetry)(told.append)

    @app.listener(src, name="orders", output=out, max_attempts=2, backoff=60.0, dlq=True, **TOPICS)
    def handle(record: Record) -> bytes:
        value = record.value or b""
        if value.startswith(b"fails"):
            raise Transient("later")
        return b"out-" + value

    with running(app):
        assert app.health_server is not None
        url = app.health_server.url + "/readyz"
        wait_for(lambda: told and told[-1].records == 2, 30, message="two records in retry")
        until = time.monotonic() + 3 * app.not_ready_after
        answers = []
        while time.monotonic() < until:
            answers.append(get(url))
        kafka.produce(src, [{"value": b"meanwhile", "partition": 0}])
        wait_for(lambda: [r.value for r in kafka.read(out)] == [b"out-meanwhile"], 30, message="handled meanwhile")
        status, body = get(url)
        assert told[-1].records == 2, "still waiting: due in a minute"
    assert answers and {a[0] for a in answers} == {200}, [a for a in answers if a[0] != 200][:1]
    assert status == 200 and body["listeners"][0].get("reasons", []) == [], body


def test_a_retry_partition_whose_due_record_is_not_consumed_is_reported_and_released(
    kafka: KafkaTestKit, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transaction left open on the retry topic holds read_committed readers below it: the hop written after it
    is committed and due, but the retry consumer cannot read it. The container says so (a warning, the event, the
    gauge, /readyz's body, ready all the same); once the transaction is aborted the record is handled and the
    partition reported flowing again."""
    monkeypatch.setattr(retry_stalls, "RETRY_STALL_CHECK_S", 0.5)  # look twice a second; due for 0.5 s is overdue
    src, out = kafka.topic(), kafka.topic()
    retry = src + "-retry"
    create_topic(kafka.bootstrap_servers, retry, 1)
    app = make_app(kafka, name="retry-stall", health_port=0)
    metrics = instrument(app)
    events: list[Event] = []
    app.on(RetryPartitionStalled)(events.append)
    app.on(RetryPartitionFlowing)(events.append)

    @app.listener(src, name="orders", output=out, retry="topics", max_attempts=3, backoff=0.1, dlq=True)
    def handle(record: Record) -> bytes:
        if record.value == b"slow" and record.attempt == 1:
            raise Transient("once")
        return b"out-" + (record.value or b"")

    stalled = {"app": app.name, "listener": "orders"}
    hanging = Producer({**QUIET, "bootstrap.servers": kafka.bootstrap_servers, "transactional.id": unique_name("open")})
    with caplog.at_level(logging.INFO, logger="kafkatx.container"), running(app):
        kafka.produce(src, [b"first"])
        wait_for(lambda: kafka.values(out) == [b"out-first"], 30, message="the listener runs (its keys rebuilt)")
        hanging.init_transactions(10)
        hanging.begin_transaction()
        hanging.produce(retry, b"never committed", partition=0)
        assert hanging.flush(10) == 0  # retry[0] offset 0: read_committed readers stop there
        kafka.produce(src, [b"slow", b"fine"])
        wait_for(lambda: kafka.values(out) == [b"out-first", b"out-fine"], 30, message="the partition went on")
        wait_for(lambda: events, 30, message="the retry partition reported stalled")
        [stall] = events
        assert isinstance(stall, RetryPartitionStalled)
        assert (stall.topic, stall.partition, stall.records) == (retry, 0, 1) and stall.due_for > 0.5
        assert metrics.registry.get_sample_value("kafkatx_retry_partitions_stalled", stalled) == 1
        status, body = get(app.health_server.url + "/readyz")  # type: ignore[union-attr]
        assert status == 200, "the listener processes its partitions: ready, and it says which retry partition waits"
        assert body["listeners"][0]["containers"][0]["stalled_retry_partitions"] == [f"{retry}[0]"]
        assert kafka.values(out) == [b"out-first", b"out-fine"], "the record in retry waits"

        hanging.abort_transaction(10)
        wait_for(lambda: b"out-slow" in kafka.values(out), 30, message="the due record consumed once released")
        wait_for(lambda: len(events) == 2, 30, message="the retry partition reported flowing again")
        assert metrics.registry.get_sample_value("kafkatx_retry_partitions_stalled", stalled) == 0
        assert (
            "stalled_retry_partitions"
            not in get(app.health_server.url + "/readyz")[1]["listeners"][0][  # type: ignore[union-attr]
                "containers"
            ][0]
        )
    assert isinstance(events[1], RetryPartitionFlowing) and (events[1].topic, events[1].partition) == (retry, 0)
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "retry partition" in r.getMessage()
    ]
    assert len(warnings) == 1 and f"{retry}[0] holds 1 record(s) in retry" in warnings[0], warnings
