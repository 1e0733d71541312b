"""A last stable offset that does not move on a topic the App writes (issue 42, item 13), on the embedded broker.

A raw transactional producer opens a transaction on the App's output topic and never ends it (the embedded broker
never expires it): the App keeps committing its outputs behind it, read_committed readers see none of them, and the
App's check reports the partition stuck (gauge, event, one warning), /readyz staying green; aborting the transaction
releases it. A healthy App reports 0 and no event. The check's interval and threshold are shortened through the
App's watch (``app.stable_offsets``), as its docstring allows.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from typing import Any

import pytest
from confluent_kafka import IsolationLevel, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from helpers import make_app

from kafkatx import App, Record
from kafkatx.client.log import client_log
from kafkatx.events import Event, LastStableOffsetReleased, LastStableOffsetStuck
from kafkatx.health.stable_offsets import KafkaWatermarks
from kafkatx.metrics import instrument
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for

pytestmark = pytest.mark.timeout(120)

GAUGE = "kafkatx_last_stable_offset_stuck_seconds"
QUIET = {"logger": client_log()}  # the raw clients' librdkafka lines through logging, not raw to stderr
INTERVAL, THRESHOLD = 0.2, 2.0


def readyz(app: App) -> tuple[int, Any]:
    assert app.health_server is not None
    try:
        with urllib.request.urlopen(app.health_server.url + "/readyz", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def gauge(app: App, metrics: Any, listener: str, topic: str, partition: int = 0) -> float | None:
    labels = {"app": app.name, "listener": listener, "topic": topic, "partition": str(partition)}
    value = metrics.registry.get_sample_value(GAUGE, labels)
    return None if value is None else float(value)


def watched_app(kafka: KafkaTestKit, src: str, out: str, events: list[Event]) -> App:
    app = make_app(kafka, name="lso", health_port=0)
    app.stable_offsets.interval, app.stable_offsets.threshold = INTERVAL, THRESHOLD
    app.on(LastStableOffsetStuck)(events.append)
    app.on(LastStableOffsetReleased)(events.append)

    @app.listener(src, output=out, name="enrich")
    def handle(record: Record) -> bytes:
        return (record.value or b"").upper()

    return app


def test_the_broker_gives_the_last_stable_offset_at_read_committed_and_the_watch_reads_it(kafka: KafkaTestKit) -> None:
    out = kafka.topic(partitions=2)
    kafka.produce(out, [{"value": b"before", "partition": 0}])
    hanging = Producer({**QUIET, "bootstrap.servers": kafka.bootstrap_servers, "transactional.id": unique_name("hang")})
    hanging.init_transactions(10)
    hanging.begin_transaction()
    hanging.produce(out, b"open", partition=0)
    assert hanging.flush(10) == 0
    kafka.produce(out, [{"value": b"after", "partition": 0}])
    admin = AdminClient({**QUIET, "bootstrap.servers": kafka.bootstrap_servers})
    tps = [TopicPartition(out, 0), TopicPartition(out, 1)]
    ends = {
        level: {
            tp.partition: f.result().offset
            for tp, f in admin.list_offsets(
                {tp: OffsetSpec.latest() for tp in tps}, isolation_level=level, request_timeout=10
            ).items()
        }
        for level in (IsolationLevel.READ_COMMITTED, IsolationLevel.READ_UNCOMMITTED)
    }
    assert ends[IsolationLevel.READ_COMMITTED] == {0: 1, 1: 0}, "the LSO: the open transaction's first offset"
    assert ends[IsolationLevel.READ_UNCOMMITTED] == {0: 3, 1: 0}, "the high watermark: every record written"
    source = KafkaWatermarks({"bootstrap.servers": kafka.bootstrap_servers})
    try:
        assert source.watermarks([out]) == {(out, 0): (1, 3), (out, 1): (0, 0)}
        hanging.abort_transaction(10)
        assert source.watermarks([out])[(out, 0)] == (4, 4), "aborted: the marker, and the LSO caught up"
    finally:
        source.close()


def test_a_transaction_left_open_on_the_output_topic_is_reported_and_released_once_aborted(
    kafka: KafkaTestKit, caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest
) -> None:
    src, out = kafka.topic(), kafka.topic()
    events: list[Event] = []
    app = watched_app(kafka, src, out, events)
    metrics = instrument(app)
    hanging = Producer(
        {**QUIET, "bootstrap.servers": kafka.bootstrap_servers, "transactional.id": unique_name("zombie")}
    )
    hanging.init_transactions(10)
    hanging.begin_transaction()
    hanging.produce(out, b"never committed")
    assert hanging.flush(10) == 0  # written at offset 0, in a transaction nobody ends

    with caplog.at_level(logging.INFO, logger="kafkatx.health"), running(app):
        kafka.produce(src, [b"a", b"b", b"c"])
        wait_for(lambda: kafka.caught_up(app.group_id, src), message="the App committed its outputs")
        assert kafka.values(out) == [], "held back: read_committed readers stop at the open transaction"
        wait_for(lambda: (gauge(app, metrics, "enrich", out) or 0) > 0, 30, message="the gauge above 0")
        wait_for(lambda: any(isinstance(e, LastStableOffsetStuck) for e in events), 10, message="the stuck event")
        [stuck] = [e for e in events if isinstance(e, LastStableOffsetStuck)]
        assert (stuck.listener, stuck.topic, stuck.partition, stuck.last_stable_offset) == ("enrich", out, 0, 0)
        assert stuck.high_watermark >= 4 and stuck.seconds > THRESHOLD  # the open record, the App's 3 and a marker
        status, body = readyz(app)
        assert status == 200, "a stuck output does not make the App not ready: it can still process"
        [entry] = body["last_stable_offset_stuck"]
        assert (entry["topic"], entry["partition"], entry["last_stable_offset"]) == (out, 0, 0)
        assert entry["listeners"] == ["enrich"] and entry["stuck_for"] >= THRESHOLD

        hanging.abort_transaction(10)
        wait_for(lambda: any(isinstance(e, LastStableOffsetReleased) for e in events), 30, message="released")
        wait_for(lambda: gauge(app, metrics, "enrich", out) == 0, 10, message="the gauge back to 0")
        assert "last_stable_offset_stuck" not in readyz(app)[1]
        assert kafka.values(out) == [b"A", b"B", b"C"]
    assert [type(e) for e in events] == [LastStableOffsetStuck, LastStableOffsetReleased], "one of each per episode"
    [release] = events[1:]
    assert release.topic == out and release.last_stable_offset > 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "kafkatx.health"]
    assert len(warnings) == 1, warnings
    assert f"{out}[0]" in warnings[0] and "last stable offset has stayed at 0" in warnings[0]
    assert "kafkatx transactions abort module:app" in warnings[0]
    assert f"kafka-transactions.sh --bootstrap-server {kafka.bootstrap_servers} abort --topic {out}" in warnings[0]
    # The embedded broker forgets open transactions across its restarts (docs/BROKERS.md): the warning says so there.
    embedded = not request.config.getoption("--kafka-bootstrap")
    assert ("restart the embedded broker once more" in warnings[0]) is embedded, warnings[0]
    assert gauge(app, metrics, "enrich", out) is None, "the series goes when the App stops"


def test_a_healthy_app_whose_outputs_flow_reports_zero_and_no_event(kafka: KafkaTestKit) -> None:
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    events: list[Event] = []
    app = watched_app(kafka, src, out, events)
    metrics = instrument(app)
    with running(app):
        watch = app.stable_offsets
        assert watch.running
        for n in range(5):  # outputs flow over several checks
            rounds = watch.rounds
            kafka.produce(src, [{"value": f"{n}-{i}".encode(), "partition": i % 2} for i in range(20)])
            wait_for(lambda: watch.rounds > rounds + 2, 10, message="checks while records flow")
        wait_for(lambda: kafka.caught_up(app.group_id, src), message="every output committed")
        idle_from = watch.rounds  # then idle past the threshold: an LSO at the high watermark is not stuck
        wait_for(lambda: watch.rounds > idle_from + 2 * THRESHOLD / INTERVAL, 20, message="checks past the threshold")
        assert [gauge(app, metrics, "enrich", out, p) for p in (0, 1)] == [0.0, 0.0]
        assert gauge(app, metrics, "enrich", f"{src}-dlt") is None, "no dead-letter topic declared: none watched"
        status, body = readyz(app)
        assert status == 200 and "last_stable_offset_stuck" not in body
    assert events == []
    assert len(kafka.values(out)) == 100
    assert not app.stable_offsets.running, "its thread ended with the App"
