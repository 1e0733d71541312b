"""Typed listeners over a fake host: a record that cannot be decoded goes to the recoverer at once, untouched."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from fakes import FakeHost, FakeProducer, listener, messages

from kafkatx import DecodeError, InvalidConfigurationError, Record
from kafkatx.events import HandlerFailed, RecordRecovered
from kafkatx.rollback.classifier import ExceptionClassifier
from kafkatx.serde import is_about_the_record

pydantic = pytest.importorskip("pydantic")


class Order(pydantic.BaseModel):
    id: int
    amount: float


@dataclasses.dataclass
class Invoice:
    order: int
    total: float


IN = ("in", 0)


def _recording(into: list[tuple[Record, BaseException]]) -> Any:
    return lambda record, exc: into.append((record, exc))


@pytest.mark.parametrize("retry", ["rollback", "in_place"])
def test_undecodable_records_are_recovered_at_attempt_1_and_never_reach_the_handler(retry: str) -> None:
    seen: list[Any] = []
    recovered: list[tuple[Record, BaseException]] = []

    def handle(record: Record) -> Invoice:
        seen.append(record.value)
        return Invoice(record.value.id, record.value.amount * 2)

    spec = listener(handle, value_type=Order, retry=retry, max_attempts=5, dlq=_recording(recovered))
    host = FakeHost(spec, FakeProducer())
    batch = messages(b'{"id": 1, "amount": 2}', b"not json", b'{"id": 3, "amount": "lots"}', b'{"id": 4, "amount": 1}')
    host.runner()(host.unit(batch))

    # Nothing is aborted: the record before the failed ones is handled once, and its output commits once.
    assert [o.id for o in seen] == [1, 4]
    assert all(isinstance(v, Order) for v in seen), "the handler saw only decoded records"
    assert [(r.offset, r.attempt) for r, _ in recovered] == [(1, 1), (2, 1)]
    assert [r.raw_value for r, _ in recovered] == [b"not json", b'{"id": 3, "amount": "lots"}']
    bad_json, bad_field = (exc for _, exc in recovered)
    assert isinstance(bad_json, DecodeError) and bad_json.field is None
    assert "cannot decode the value of in/0@1 as Order: Invalid JSON" in str(bad_json)
    assert isinstance(bad_field, DecodeError) and bad_field.field == "amount" and bad_field.part == "value"
    assert "amount" in str(bad_field) and "in/0@2" in str(bad_field)
    assert type(bad_field.__cause__).__name__ == "ValidationError"
    assert host.producer.committed_values == [b'{"order":1,"total":4.0}', b'{"order":4,"total":2.0}']
    assert host.producer.committed_offsets == {IN: 4}
    assert [e.attempt for e in host.events_of(HandlerFailed)] == [1, 1]
    assert len(host.events_of(RecordRecovered)) == 2


def test_a_key_that_fails_is_recovered_with_both_parts_as_consumed() -> None:
    recovered: list[tuple[Record, BaseException]] = []
    spec = listener(lambda r: None, key_type=int, value_type=Order, dlq=_recording(recovered))
    host = FakeHost(spec, FakeProducer())
    from confluent_kafka import Message

    msg = Message(topic="in", partition=0, offset=0, key=b"abc", value=b'{"id": 1, "amount": 2}')
    host.runner()(host.unit([msg]))  # type: ignore[list-item]
    ((record, exc),) = recovered
    assert isinstance(exc, DecodeError) and exc.part == "key"
    assert (record.key, record.value, record.raw_key, record.raw_value) == (
        b"abc",
        b'{"id": 1, "amount": 2}',
        b"abc",
        b'{"id": 1, "amount": 2}',
    )


def test_a_decode_error_is_never_retryable_whatever_the_lists_say() -> None:
    classifier = ExceptionClassifier(retryable=(ValueError, DecodeError), include_defaults=False)
    assert not classifier.is_retryable(DecodeError("x"))
    assert classifier.is_retryable(ValueError("x"))


def test_a_deserializer_and_a_type_compose_and_a_plain_deserializer_alone_works() -> None:
    got: list[Any] = []
    spec = listener(lambda r: got.append(r.value), deserializer=lambda b: {"id": int(b), "amount": 1}, value_type=Order)
    host = FakeHost(spec, FakeProducer())
    host.runner()(host.unit(messages(b"7")))
    assert got == [Order(id=7, amount=1)]
    spec = listener(lambda r: got.append(r.value), deserializer=bytes.decode)
    host = FakeHost(spec, FakeProducer())
    host.runner()(host.unit(messages(b"text")))
    assert got[-1] == "text"


def test_errors_that_are_not_the_records_fault_are_not_decode_errors() -> None:
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    assert not is_about_the_record(ConnectionError("registry down"))
    assert not is_about_the_record(SchemaRegistryError(503, 50301, "unavailable"))
    assert is_about_the_record(SchemaRegistryError(404, 40403, "Schema not found"))
    assert is_about_the_record(ValueError("bad bytes"))

    def flaky(raw: bytes) -> Any:
        raise ConnectionError("registry down")

    failures: list[BaseException] = []
    spec = listener(lambda r: None, deserializer=flaky, max_attempts=1, outages=(), dlq=lambda r, e: failures.append(e))
    host = FakeHost(spec, FakeProducer())
    host.runner()(host.unit(messages(b"x")))
    (failure,) = failures
    assert type(failure) is ConnectionError, "the registry being down is not the record being bad"


def test_a_registry_that_fails_pauses_the_listener_and_dead_letters_nothing() -> None:
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    from kafkatx.events import OutageStarted

    def unavailable(raw: bytes) -> Any:
        raise SchemaRegistryError(503, 50301, "unavailable")

    recovered: list[tuple[Record, BaseException]] = []
    host = FakeHost(listener(lambda r: None, deserializer=unavailable, dlq=_recording(recovered)), FakeProducer())
    host.runner()(host.unit(messages(b"x")))
    assert recovered == [] and host.producer.committed_offsets == {}
    (started,) = host.events_of(OutageStarted)
    assert "could not reach its service" in str(started.exception)


def test_a_tombstone_is_none_for_an_optional_type_and_undecodable_otherwise() -> None:
    from confluent_kafka import Message

    got: list[Any] = []
    recovered: list[tuple[Record, BaseException]] = []
    tombstone = Message(topic="in", partition=0, offset=0, key=b"k", value=None)
    host = FakeHost(listener(lambda r: got.append(r.value), value_type=Order | None), FakeProducer())
    host.runner()(host.unit([tombstone]))  # type: ignore[list-item]
    assert got == [None]
    host = FakeHost(listener(lambda r: got.append(r.value), value_type=Order, dlq=_recording(recovered)))
    host.runner()(host.unit([tombstone]))  # type: ignore[list-item]
    ((record, exc),) = recovered
    assert got == [None] and record.raw_value is None and isinstance(exc, DecodeError)


def test_typed_declarations_are_checked_when_declared() -> None:
    with pytest.raises(InvalidConfigurationError, match="deserializer must be callable"):
        listener(lambda r: None, deserializer=42)
    from kafkatx import App

    pytest.importorskip("pyspark")
    app = App("t", bootstrap_servers="127.0.0.1:1")
    with pytest.raises(InvalidConfigurationError, match="value_type.*Spark|binary columns"):
        app.spark_listener("in", value_type=Order)


def test_raw_bytes_survive_a_replace_and_a_record_built_by_hand_keeps_its_own() -> None:
    record = Record("t", 0, 1, b"k", b"v")
    assert (record.raw_key, record.raw_value) == (b"k", b"v")
    typed = dataclasses.replace(record, value=Order(id=1, amount=1))
    assert typed.raw_value == b"v" and typed == Record("t", 0, 1, b"k", Order(id=1, amount=1))


def test_str_means_utf8_text_and_other_types_json() -> None:
    got: list[Any] = []
    spec = listener(lambda r: got.append((r.key, r.value)), key_type=str, value_type=list[int])
    host = FakeHost(spec, FakeProducer())
    from confluent_kafka import Message

    host.runner()(host.unit([Message(topic="in", partition=0, offset=0, key=b"abc", value=b"[1, 2]")]))  # type: ignore[list-item]
    assert got == [("abc", [1, 2])]


def test_a_typed_listener_writes_models_as_json_returned_sent_or_in_an_output() -> None:
    from kafkatx import Output, send

    def handle(record: Record) -> Any:
        order = record.value
        send("out", Invoice(order.id, 1.0))
        return [Output(value=Invoice(order.id, 2.0)), Order(id=order.id, amount=3)]

    host = FakeHost(listener(handle, value_type=Order, sends_to=["out"]), FakeProducer())
    host.runner()(host.unit(messages(b'{"id": 9, "amount": 0}')))
    assert host.producer.committed_values == [
        b'{"order":9,"total":1.0}',
        b'{"order":9,"total":2.0}',
        b'{"id":9,"amount":3.0}',
    ]


def test_without_pydantic_value_type_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pydantic", None)  # import pydantic now raises ImportError
    with pytest.raises(InvalidConfigurationError, match=r"pip install 'kafkatx\[pydantic\]'"):
        listener(lambda r: None, value_type=Order)


def test_confluent_kafkas_json_schema_serdes_are_taken_as_they_are() -> None:
    json_schema = pytest.importorskip("confluent_kafka.schema_registry.json_schema")
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.serialization import MessageField, SerializationContext

    registry = SchemaRegistryClient.new_client({"url": "mock://unit-json-schema"})
    value = MessageField.VALUE
    schema = (
        '{"type": "object", "properties": {"id": {"type": "integer"}, "amount": {"type": "number"}},'
        ' "required": ["id", "amount"]}'
    )
    good = json_schema.JSONSerializer(schema, registry)({"id": 1, "amount": 2.5}, SerializationContext("in", value))
    off_schema = good[:5] + b'{"id": "one", "amount": 1}'  # the registry's framing, a body its schema refuses
    got: list[Any] = []
    recovered: list[tuple[Record, BaseException]] = []
    spec = listener(
        lambda r: got.append(r.value),
        deserializer=json_schema.JSONDeserializer(schema, schema_registry_client=registry),
        value_type=Order,
        dlq=_recording(recovered),
    )
    host = FakeHost(spec, FakeProducer())
    host.runner()(host.unit(messages(good, off_schema)))
    assert got == [Order(id=1, amount=2.5)], "handled once: the failed record after it aborts nothing"
    ((record, exc),) = recovered
    assert record.raw_value == off_schema and isinstance(exc, DecodeError)
    assert "'one' is not of type 'integer'" in str(exc)
    assert host.producer.committed_offsets == {IN: 2}


def test_confluent_kafkas_protobuf_serdes_are_taken_as_they_are() -> None:
    protobuf = pytest.importorskip("confluent_kafka.schema_registry.protobuf")
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.serialization import MessageField, SerializationContext
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name="unit_order.proto", package="unit", syntax="proto3")
    message_type = proto.message_type.add(name="Order")
    for number, (name, kind) in enumerate((("id", "TYPE_INT32"), ("amount", "TYPE_DOUBLE")), start=1):
        message_type.field.add(name=name, number=number, type=getattr(descriptor_pb2.FieldDescriptorProto, kind))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    order_class = message_factory.GetMessageClass(pool.FindMessageTypeByName("unit.Order"))
    registry = SchemaRegistryClient.new_client({"url": "mock://unit-protobuf"})
    conf = {"use.deprecated.format": False}
    context = SerializationContext("in", MessageField.VALUE)
    good = protobuf.ProtobufSerializer(order_class, registry, conf)(order_class(id=3, amount=1.5), context)
    corrupt = good[:6] + b"\xff\xff\xff"
    got: list[Any] = []
    recovered: list[tuple[Record, BaseException]] = []
    spec = listener(
        lambda r: got.append((r.value.id, r.value.amount)),
        deserializer=protobuf.ProtobufDeserializer(order_class, conf),
        dlq=_recording(recovered),
    )
    host = FakeHost(spec, FakeProducer())
    host.runner()(host.unit(messages(good, corrupt)))
    assert got == [(3, 1.5)], "handled once: the failed record after it aborts nothing"
    ((record, exc),) = recovered
    assert record.raw_value == corrupt and isinstance(exc, DecodeError) and "Wire format was corrupt" in str(exc)


def test_without_a_dead_letter_topic_an_undecodable_record_is_logged_and_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[int] = []
    host = FakeHost(listener(lambda r: seen.append(r.value.id) or b"ok", value_type=Order), FakeProducer())
    host.runner()(host.unit(messages(b'{"id": 1, "amount": 1}', b"{", b'{"id": 3, "amount": 1}')))
    assert sorted(set(seen)) == [1, 3]
    assert host.producer.committed_values == [b"ok", b"ok"] and host.producer.committed_offsets == {IN: 3}
    (line,) = [r.getMessage() for r in caplog.records if "giving up on" in r.getMessage()]
    assert "in/0@1 after 1 attempt(s): DecodeError: cannot decode the value of in/0@1 as Order" in line


def test_a_model_returned_by_an_untyped_listener_without_a_serializer_is_named_not_iterated() -> None:
    recovered: list[tuple[Record, BaseException]] = []
    host = FakeHost(listener(lambda r: Order(id=1, amount=1), dlq=_recording(recovered)), FakeProducer())
    with pytest.raises(InvalidConfigurationError, match="returned an unsupported Order"):
        host.runner()(host.unit(messages(b"x")))  # a programming error: the container stops (issue 29 item 4)
    assert recovered == [] and host.producer.committed_values == []
