"""Typed listeners on a real broker: records that cannot be decoded go to the dead-letter topic at attempt 1,
byte for byte, without reaching the handler; their batch-mates' outputs commit exactly once (issue 32)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from helpers import make_app

from kafkatx import App, Record
from kafkatx.cli import main
from kafkatx.dlq import inspect_dlq, replay_dlq
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for

pydantic = pytest.importorskip("pydantic")


class Order(pydantic.BaseModel):
    id: int
    amount: float


class Invoice(pydantic.BaseModel):
    order: int
    total: float


def _good(i: int) -> bytes:
    return json.dumps({"id": i, "amount": i / 10}).encode()


def test_json_listener_dead_letters_the_undecodable_at_attempt_1_and_the_rest_exactly_once(
    kafka: KafkaTestKit,
) -> None:
    src, out = kafka.topic(), kafka.topic()
    not_json = {i: b"not json #%d {" % i for i in (7, 250, 500, 751, 999)}
    invalid = {i: json.dumps({"id": i, "amount": "lots"}).encode() for i in (3, 123, 600, 777, 998)}
    bad = {**not_json, **invalid}
    values = [bad.get(i, _good(i)) for i in range(1000)]
    kafka.produce(src, values)
    app = make_app(kafka)
    handled: Counter[int] = Counter()

    @app.listener(src, output=out, value_type=Order, dlq=True, max_attempts=3, name="orders", backoff=0)
    def handle(record: Record) -> Invoice:
        order: Order = record.value
        handled[order.id] += 1
        return Invoice(order=order.id, total=order.amount * 2)

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all 1,000 committed")

    good_ids = set(range(1000)) - set(bad)
    assert not set(handled) & set(bad), "the handler was never called for an undecodable record"
    assert set(handled) == good_ids
    outputs = Counter(json.loads(v or b"")["order"] for v in kafka.values(out))
    assert set(outputs) == good_ids and set(outputs.values()) == {1}, "990 outputs, each exactly once"

    dead = kafka.read(src + "-dlt")
    assert sorted(d.value or b"" for d in dead) == sorted(bad.values()), "the 10 values, byte for byte"
    entries = {e.value: e for e in inspect_dlq(kafka.bootstrap_servers, src + "-dlt")}
    assert len(entries) == 10
    for i, raw in bad.items():
        info = entries[raw].info
        assert (info.attempts, info.original_offset) == (1, i)
        assert info.exception_fqcn == "kafkatx.errors.DecodeError"
        assert info.exception_cause_fqcn == "pydantic_core._pydantic_core.ValidationError"
        assert f"cannot decode the value of {src}/0@{i} as Order" in (info.exception_message or "")
        assert "DecodeError" in (info.exception_stacktrace or "")
        why = "amount: Input should be a valid number" if i in invalid else "Invalid JSON"
        assert why in (info.exception_message or ""), info.exception_message

    # The fix: amounts may be words. Replayed into the source topic, the invalid five now go through; the
    # five that are not JSON are dead-lettered again.
    class LenientOrder(pydantic.BaseModel):
        id: int
        amount: float | str

    fixed = App(app.name, bootstrap_servers=kafka.bootstrap_servers, instance_id="test")  # the same app, restarted
    again: list[int] = []

    @fixed.listener(src, output=out, value_type=LenientOrder, dlq=True, name="orders")
    def handle_fixed(record: Record) -> Invoice:
        again.append(record.value.id)
        return Invoice(order=record.value.id, total=0)

    result = replay_dlq(kafka.bootstrap_servers, src + "-dlt")
    assert result.replayed == 10
    with running(fixed):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="the replayed records committed")
    assert set(again) == set(invalid), "the handler sees the fixed five (re-run as batch-mates of the other five)"
    outputs = Counter(json.loads(v or b"")["order"] for v in kafka.values(out))
    assert set(outputs) == good_ids | set(invalid) and set(outputs.values()) == {1}
    assert len(kafka.read(src + "-dlt")) == 15


def test_an_avro_listener_with_the_mock_registry_dead_letters_unknown_schema_ids_and_bad_framing(
    kafka: KafkaTestKit,
) -> None:
    avro = pytest.importorskip("confluent_kafka.schema_registry.avro")
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.serialization import MessageField, SerializationContext

    registry = SchemaRegistryClient.new_client({"url": f"mock://{unique_name('registry')}"})  # one client, both sides
    order_schema = json.dumps(
        {
            "type": "record",
            "name": "Order",
            "fields": [{"name": "id", "type": "int"}, {"name": "amount", "type": "double"}],
        }
    )
    invoice_schema = json.dumps(
        {
            "type": "record",
            "name": "Invoice",
            "fields": [{"name": "order", "type": "int"}, {"name": "total", "type": "double"}],
        }
    )
    src, out = kafka.topic(), kafka.topic()
    encode = avro.AvroSerializer(registry, order_schema)
    good = [encode({"id": i, "amount": i / 4}, SerializationContext(src, MessageField.VALUE)) for i in range(20)]
    unknown_id = b"\x00\x00\x00\x03\xe7" + good[0][5:]  # framing of schema id 999, which the registry never saw
    bad_framing = b"\x07garbage"
    kafka.produce(src, [*good[:10], unknown_id, *good[10:15], bad_framing, *good[15:]])
    app = make_app(kafka)
    handled: list[int] = []

    @app.listener(
        src,
        output=out,
        deserializer=avro.AvroDeserializer(registry),
        value_type=Order,
        serializer=avro.AvroSerializer(registry, invoice_schema),
        dlq=True,
    )
    def handle(record: Record) -> Invoice:
        handled.append(record.value.id)
        return Invoice(order=record.value.id, total=record.value.amount * 2)

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")

    assert sorted(set(handled)) == list(range(20)), "batch-mates are re-run after a rollback; the bad two never"
    read_invoice = avro.AvroDeserializer(registry)
    invoices = [read_invoice(v, SerializationContext(out, MessageField.VALUE)) for v in kafka.values(out)]
    assert invoices == [{"order": i, "total": i / 2} for i in range(20)]
    dead = {e.value: e.info for e in inspect_dlq(kafka.bootstrap_servers, src + "-dlt")}
    assert set(dead) == {unknown_id, bad_framing}
    assert {info.attempts for info in dead.values()} == {1}
    assert {info.exception_fqcn for info in dead.values()} == {"kafkatx.errors.DecodeError"}
    assert "Schema Not Found" in (dead[unknown_id].exception_message or ""), dead[unknown_id].exception_message
    message = dead[bad_framing].exception_message or ""
    assert message.endswith("SerializationError: Invalid magic byte"), "the cause, quoted once"


def test_an_avro_serializer_registers_the_subject_of_the_topic_each_record_goes_to(kafka: KafkaTestKit) -> None:
    """TopicNameStrategy: ``<topic>-value``. A send() to another topic than the listener's output, and an Output
    with a topic of its own, are encoded for their topic; all of them decode with the registry's schema."""
    avro = pytest.importorskip("confluent_kafka.schema_registry.avro")
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.serialization import MessageField, SerializationContext

    from kafkatx import Output, send

    registry = SchemaRegistryClient.new_client({"url": f"mock://{unique_name('registry')}"})
    invoice_schema = json.dumps(
        {
            "type": "record",
            "name": "Invoice",
            "fields": [{"name": "order", "type": "int"}, {"name": "total", "type": "double"}],
        }
    )
    src, out, audit, billing = kafka.topic(), kafka.topic(), kafka.topic(), kafka.topic()
    kafka.produce(src, [_good(i) for i in range(5)])
    app = make_app(kafka)

    @app.listener(src, output=out, value_type=Order, serializer=avro.AvroSerializer(registry, invoice_schema))
    def handle(record: Record) -> list[Any]:
        invoice = Invoice(order=record.value.id, total=record.value.amount)
        send(audit, invoice)
        return [invoice, Output(invoice, topic=billing)]

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")

    assert sorted(registry.get_subjects()) == sorted(f"{t}-value" for t in (out, audit, billing))
    read = avro.AvroDeserializer(registry)
    for topic in (out, audit, billing):
        decoded = [read(v, SerializationContext(topic, MessageField.VALUE)) for v in kafka.values(topic)]
        assert sorted(d["order"] for d in decoded) == list(range(5)), topic


@pytest.mark.parametrize("retry", ["rollback", "in_place", "topics"])
def test_a_key_that_cannot_be_decoded_is_dead_lettered_with_its_key_and_value_as_consumed(
    kafka: KafkaTestKit, capsys: pytest.CaptureFixture[str], retry: str
) -> None:
    src, out = kafka.topic(), kafka.topic()
    records: list[Any] = [(b"%d" % i, _good(i)) for i in range(10)]
    records[4] = (b"four", _good(4))
    kafka.produce(src, records)
    app = make_app(kafka)
    keys: list[int] = []

    @app.listener(src, output=out, key_type=int, value_type=Order, dlq=True, retry=retry)
    def handle(record: Record) -> tuple[int, Invoice]:
        keys.append(record.key)
        return record.key, Invoice(order=record.value.id, total=0)

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")
    assert sorted(set(keys)) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert [r.key for r in kafka.read(out)] == [b"%d" % i for i in sorted(set(keys))], "int keys encoded as JSON"
    (dead,) = kafka.read(src + "-dlt")
    assert (dead.key, dead.value) == (b"four", _good(4))
    if retry == "topics":
        assert kafka.read(src + "-retry") == [], "not retryable: dead-lettered at once, no hop"
    (entry,) = inspect_dlq(kafka.bootstrap_servers, src + "-dlt")
    assert entry.info.attempts == 1
    assert f"cannot decode the key of {src}/0@4 as int" in (entry.info.exception_message or "")
    assert main(["dlq", "inspect", src + "-dlt", "--bootstrap-servers", kafka.bootstrap_servers]) == 0
    (row,) = capsys.readouterr().out.splitlines()[1:2]
    assert "DecodeError" in row and f"cannot decode the key of {src}/0@4" in row, row


def test_through_the_retry_topics_a_typed_record_comes_back_decoded_and_is_output_once(kafka: KafkaTestKit) -> None:
    """``retry="topics"``: the hop carries the bytes as consumed, and each attempt from the retry topic decodes them
    again (key and value typed, the raw bytes kept), so a retried record's output is what its first attempt's would
    have been."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [(b"%d" % i, _good(i)) for i in range(5)])
    app = make_app(kafka)
    seen: list[tuple[Any, Any, int, bytes | None]] = []

    @app.listener(src, output=out, key_type=int, value_type=Order, dlq=True, retry="topics", backoff=0.3)
    def handle(record: Record) -> tuple[int, Invoice]:
        seen.append((record.key, record.value, record.attempt, record.raw_value))
        if record.key == 2 and record.attempt < 3:
            raise TimeoutError("the invoicing service is slow")
        return record.key, Invoice(order=record.value.id, total=record.value.amount)

    with running(app):
        wait_for(lambda: len(kafka.read(out)) == 5, 30, message="five invoices")
    retried = [(key, value, attempt, raw) for key, value, attempt, raw in seen if key == 2]
    assert retried == [(2, Order(id=2, amount=0.2), attempt, _good(2)) for attempt in (1, 2, 3)], retried
    invoices = {int(r.key or b""): json.loads(r.value or b"") for r in kafka.read(out)}
    assert invoices == {i: {"order": i, "total": i / 10} for i in range(5)}, "each invoice once, typed both ways"
