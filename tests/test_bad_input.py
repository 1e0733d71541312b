"""Bad input gets a clear error naming the problem; the record's transaction is aborted, nothing lost."""

from __future__ import annotations

import pytest
from helpers import make_app

from kafkatx import InvalidConfigurationError, Output, Record
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.events import TransactionAborted
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for


def test_missing_input_or_output_topic_fails_at_startup(kafka: KafkaTestKit) -> None:
    src = kafka.topic()
    app = make_app(kafka)
    app.listener(unique_name("missing-in"), output=src)(lambda r: r.value)
    with pytest.raises(InvalidConfigurationError, match="input topic of listener .* does not exist"):
        app.start()
    app2 = make_app(kafka)
    app2.listener(src, output=unique_name("missing-out"))(lambda r: r.value)
    with pytest.raises(InvalidConfigurationError, match="output topic of listener .* does not exist"):
        app2.start()


def test_create_topics_option_creates_missing_ones(kafka: KafkaTestKit) -> None:
    src, out = unique_name("auto-in"), unique_name("auto-out")
    app = make_app(kafka, create_topics=True, topic_partitions=3)
    app.listener(src, output=out, dlq=True)(lambda r: r.value)
    with running(app):
        assert len(kafka.end_offsets(src)) == 3 and len(kafka.end_offsets(out)) == 3
        assert len(kafka.end_offsets(src + "-dlt")) == 3, "the DLT gets the source topic's partition count"


def test_creating_a_topic_waits_until_it_is_listed_and_a_racing_creator_is_no_error(kafka: KafkaTestKit) -> None:
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    from kafkatx.client.topics import create_topic

    # Quiet, and no traceback keeps it alive: a client outliving the test logs into later tests' output.
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 2})
    name = unique_name("created")
    assert create_topic(admin, name, 2)
    assert len(kafka.end_offsets(name)) == 2, "listed with every partition once create_topic returns"
    # App startup: two Apps creating the same missing topic, the second finds it made.
    assert create_topic(admin, name, 2, exist_ok=True)
    code = None
    try:  # kafkatx topics create: an existing topic is an error
        create_topic(admin, name, 2)
    except KafkaException as exc:
        code = exc.args[0].code()
    del admin
    assert code == KafkaError.TOPIC_ALREADY_EXISTS


@pytest.mark.parametrize(
    ("bad", "fqcn", "message"),
    [
        ("unknown-topic", "kafkatx.errors.UnknownTopicError", "does not exist"),
        # A type kafkatx cannot encode stops the container instead: tests/test_unproducible_results.py
    ],
)
def test_bad_outputs_abort_the_record_and_dead_letter_it(
    kafka: KafkaTestKit, bad: str, fqcn: str, message: str
) -> None:
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"good-1", bad.encode(), b"good-2"])
    app = make_app(kafka)
    aborted: list[TransactionAborted] = []
    app.on(TransactionAborted)(aborted.append)
    calls: list[bytes] = []

    @app.listener(src, output=out, dlq=True, max_attempts=3)
    def handler(record: Record) -> object:
        calls.append(record.value or b"")
        if record.value == b"unknown-topic":
            return [b"partial", Output(b"x", topic=unique_name("nowhere"))]
        return record.value

    with running(app):
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: 3}, 30)
    assert kafka.values(out) == [b"good-1", b"good-2"], "nothing of the bad record was committed (not even 'partial')"
    assert aborted, "the record's transaction was aborted"
    assert calls.count(bad.encode()) == 1, "output errors are not retryable: the same return would fail again"
    (dead,) = kafka.read(src + "-dlt")
    info = parse_dead_letter_headers(dead.headers)
    assert info.exception_fqcn == fqcn
    assert message in (info.exception_message or "")
