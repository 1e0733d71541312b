"""An output the broker refuses is blamed on the input record that produced it (issue 28, part 2).

Against the embedded broker, which enforces a topic's ``max.message.bytes``
and refuses a null key on a compacted topic as Kafka does. The refused
record's input goes to the recoverer with the broker's error in its
dead-letter headers; every other record's output is committed exactly once;
the App keeps running and handles what comes next.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kafkatx import App, Output, OutputRefusedError, Record, db
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.events import ProducerRecreated, RecordRecovered
from kafkatx.testing import KafkaTestKit, unique_name, wait_for

pytestmark = pytest.mark.timeout(120)


def make_app(kafka: KafkaTestKit, **kwargs: Any) -> App:
    return App(unique_name("refused"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t", **kwargs)


def test_an_output_too_large_for_its_topic_dead_letters_its_input_and_the_app_goes_on(kafka: KafkaTestKit) -> None:
    src, out = kafka.topic(partitions=2), kafka.topic(config={"max.message.bytes": "2000"})
    values = [b"r%02d" % i for i in range(30)]
    big = {b"r07", b"r22"}
    kafka.produce(src, [(v, v) for v in values])  # keyed: spread over both partitions
    app = make_app(kafka)
    recovered: list[RecordRecovered] = []
    app.on(RecordRecovered)(recovered.append)
    recreated: list[ProducerRecreated] = []
    app.on(ProducerRecreated)(recreated.append)
    calls: Counter[bytes] = Counter()

    @app.listener(src, output=out, dlq=True, max_attempts=3, backoff=0)
    def handle(record: Record) -> bytes:
        value = record.value or b""
        calls[value] += 1
        return b"x" * 10_000 if value in big or value == b"late-big" else b"out-" + value

    app.start()
    try:
        wait_for(lambda: app.failure is not None or kafka.caught_up(app.group_id, src), 60, message="caught up")
        assert app.failure is None, app.failure
        kafka.produce(src, [(b"late", b"late"), (b"late-big", b"late-big")])  # the App is still running
        wait_for(lambda: app.failure is not None or kafka.caught_up(app.group_id, src), 60, message="caught up")
        assert app.failure is None, app.failure
    finally:
        app.stop(timeout=15)

    expected = sorted(b"out-" + v for v in [*values, b"late"] if v not in big)
    assert sorted(kafka.values(out)) == expected, "every other record's output, exactly once"
    dead = {d.value: parse_dead_letter_headers(d.headers) for d in kafka.read(src + "-dlt")}
    assert sorted(dead) == sorted([*big, b"late-big"]), "the inputs whose output was refused, once each"
    for value, info in dead.items():
        assert info.exception_fqcn == "kafkatx.errors.OutputRefusedError", (value, info.exception_fqcn)
        assert info.exception_message is not None and "MSG_SIZE_TOO_LARGE" in info.exception_message
        assert out in info.exception_message, info.exception_message
        assert info.attempts == 1, "not retryable by default: recovered at its first failure"
    assert {e.record.value for e in recovered} == dead.keys()
    assert all(isinstance(e.exception, OutputRefusedError) for e in recovered)
    assert recreated == [], "an abort is enough: the producer is not replaced"


def test_a_null_key_refused_by_a_compacted_topic_dead_letters_its_input(kafka: KafkaTestKit) -> None:
    src = kafka.topic(partitions=1)
    out = kafka.topic(partitions=1, config={"cleanup.policy": "compact"})
    kafka.produce(src, [(b"k1", b"v1"), (None, b"v2"), (b"k3", b"v3")])
    app = make_app(kafka)

    @app.listener(src, output=out, dlq=True)
    def handle(record: Record) -> Output:
        return Output(b"out-" + (record.value or b""), key=record.key)  # no key: refused on a compacted topic

    app.start()
    try:
        wait_for(lambda: app.failure is not None or kafka.caught_up(app.group_id, src), 60, message="caught up")
        assert app.failure is None, app.failure
    finally:
        app.stop(timeout=15)
    assert kafka.values(out) == [b"out-v1", b"out-v3"]
    dead = kafka.read(src + "-dlt")
    assert [d.value for d in dead] == [b"v2"]
    info = parse_dead_letter_headers(dead[0].headers)
    assert info.exception_message is not None and "INVALID_RECORD" in info.exception_message


def test_with_a_database_the_refused_records_rows_are_rolled_back_with_it(kafka: KafkaTestKit, tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE seen (v TEXT)")
    src, out = kafka.topic(partitions=1), kafka.topic(config={"max.message.bytes": "2000"})
    values = [b"d%02d" % i for i in range(12)]
    kafka.produce(src, values)
    app = make_app(kafka)

    @app.listener(src, output=out, database=lambda: sqlite3.connect(path), dlq=True)
    def save(record: Record) -> bytes:
        value = record.value or b""
        db().execute("INSERT INTO seen VALUES (?)", (value.decode(),))
        return b"x" * 10_000 if value == b"d05" else b"out-" + value

    app.start()
    try:
        wait_for(lambda: app.failure is not None or kafka.caught_up(app.group_id, src), 60, message="caught up")
        assert app.failure is None, app.failure
    finally:
        app.stop(timeout=15)
    with sqlite3.connect(path) as conn:
        rows = Counter(r[0] for r in conn.execute("SELECT v FROM seen"))
    good = [v for v in values if v != b"d05"]
    assert rows == Counter(v.decode() for v in good), "the refused record's rows are rolled back; the rest once"
    assert sorted(kafka.values(out)) == sorted(b"out-" + v for v in good)
    assert [d.value for d in kafka.read(src + "-dlt")] == [b"d05"]
