"""A Schema Registry serializer names its subject after the topic each record goes to, and its part (key or value).

With confluent-kafka's default TopicNameStrategy the subject is ``<topic>-value``
or ``<topic>-key``: a record sent to another topic than the listener's
``output`` must be registered (and framed with a schema id) under that topic's
subject. Checked through the record runner and confluent-kafka's ``mock://``
registry, whose subjects show which topic each encoding was made for.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fakes import FakeHost, FakeProducer, listener, messages

from kafkatx import Output, Record, send

json_schema = pytest.importorskip("confluent_kafka.schema_registry.json_schema")

SCHEMA = json.dumps({"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]})


def _registry(name: str) -> Any:
    from confluent_kafka.schema_registry import SchemaRegistryClient

    return SchemaRegistryClient.new_client({"url": f"mock://{name}"})


def _run(handler: Any, registry: Any, **options: Any) -> FakeProducer:
    spec = listener(handler, serializer=json_schema.JSONSerializer(SCHEMA, registry), **options)
    host = FakeHost(spec, FakeProducer())
    host.runner()(host.unit(messages(b"1")))
    return host.producer


def test_send_to_another_topic_registers_that_topics_subjects() -> None:
    registry = _registry("unit-subjects-send")

    def handle(record: Record) -> dict[str, int]:
        send("audit", {"id": 2}, key={"id": 3})
        return {"id": 1}

    producer = _run(handle, registry)
    assert sorted(registry.get_subjects()) == ["audit-key", "audit-value", "out-value"]
    assert len(producer.committed_values) == 2


def test_returned_outputs_are_encoded_for_their_own_topic_and_part() -> None:
    registry = _registry("unit-subjects-return")

    def handle(record: Record) -> Iterator[Any]:
        yield Output({"id": 1}, topic="billing")
        yield Output({"id": 2}, key={"id": 3})  # the listener's output topic
        yield {"id": 4}, {"id": 5}  # (key, value) for the output topic

    producer = _run(handle, registry)
    assert sorted(registry.get_subjects()) == ["billing-value", "out-key", "out-value"]
    assert len(producer.committed_values) == 3


def test_a_listener_without_output_may_send_with_a_registry_serializer() -> None:
    registry = _registry("unit-subjects-no-output")

    def handle(record: Record) -> None:
        send("audit", {"id": 2})

    spec = listener(handle, output=None, serializer=json_schema.JSONSerializer(SCHEMA, registry))
    host = FakeHost(spec, FakeProducer())
    host.runner()(host.unit(messages(b"1")))
    assert registry.get_subjects() == ["audit-value"]
    assert len(host.producer.committed_values) == 1
