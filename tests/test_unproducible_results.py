"""A handler returning (or sending) a type kafkatx cannot encode is a programming error, not a record's failure.

Dead-lettering would send every record to the DLT; instead the container
stops with one line naming the listener, the type and the fix, commits
nothing for the record and dead-letters nothing, so a restart after the fix
handles it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import make_app

from kafkatx import App, InvalidConfigurationError, Output, Record, send
from kafkatx.testing import KafkaTestKit, running, wait_for


def _bad_result(kind: str) -> Any:
    if kind == "dict":
        return {"id": 1}
    if kind == "key-type":
        return (7, b"v")
    if kind == "header-value":
        return Output(b"x", headers={"h": 1.5})
    return (x for x in [b"partial", {1, 2}])  # "generator-item"


@pytest.mark.parametrize(
    ("kind", "retry", "in_flight", "message"),
    [
        ("dict", "rollback", 1, "returned an unsupported dict: return None, bytes, str"),
        ("dict", "in_place", 1, "returned an unsupported dict: return None, bytes, str"),
        ("dict", "rollback", 4, "returned an unsupported dict: return None, bytes, str"),
        ("dict", "in_place", 4, "returned an unsupported dict: return None, bytes, str"),
        ("key-type", "rollback", 1, "cannot encode the key of type int to bytes"),
        ("header-value", "rollback", 1, "cannot encode the header 'h' of type float to bytes: header values must be"),
        ("generator-item", "rollback", 1, "cannot encode the value of type set to bytes"),
    ],
)
def test_an_unproducible_return_stops_the_container_and_loses_nothing(
    kafka: KafkaTestKit, kind: str, retry: str, in_flight: int, message: str
) -> None:
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"good-1", b"bad", b"good-2"])
    app = make_app(kafka)
    calls: list[bytes] = []

    @app.listener(src, output=out, dlq=True, max_attempts=3, retry=retry, in_flight=in_flight)
    def enrich(record: Record) -> Any:
        calls.append(record.value or b"")
        return _bad_result(kind) if record.value == b"bad" else record.value

    with pytest.raises(InvalidConfigurationError) as stopped, running(app):
        wait_for(lambda: app.failure is not None, 30)
    text = str(stopped.value)
    assert "\n" not in text, "one line"
    assert f"listener {enrich.__qualname__!r}" in text
    assert message in text
    assert "restart after the fix" in text and "dead-lettered nothing" in text
    assert calls.count(b"bad") == 1, "not retried: the same return would fail again"
    assert kafka.committed(app.group_id, src).get(0, 0) <= 1, "the bad record was not committed"
    assert kafka.end_offsets(src + "-dlt") == {0: 0}, "nothing dead-lettered"

    fixed = App(app.name, bootstrap_servers=kafka.bootstrap_servers, instance_id="test")

    @fixed.listener(src, output=out, dlq=True, name=enrich.__qualname__, serializer=lambda v: json.dumps(v).encode())
    def enrich_fixed(record: Record) -> dict[str, str]:
        return {"value": (record.value or b"").decode()}

    with running(fixed):
        wait_for(lambda: kafka.committed(fixed.group_id, src) == {0: 3}, 30)
    assert b'{"value": "bad"}' in kafka.values(out), "a restart after the fix handles the record"
    assert kafka.end_offsets(src + "-dlt") == {0: 0}


def test_sending_an_unproducible_value_stops_the_container(kafka: KafkaTestKit) -> None:
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"bad"])
    app = make_app(kafka)

    @app.listener(src, sends_to=[out], dlq=True)
    def forward(record: Record) -> None:
        send(out, {"id": 1})

    with pytest.raises(InvalidConfigurationError, match="value of type dict .* serializer="), running(app):
        wait_for(lambda: app.failure is not None, 30)
    assert kafka.end_offsets(src + "-dlt") == {0: 0}
    assert kafka.committed(app.group_id, src).get(0, 0) == 0
