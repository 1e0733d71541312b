"""Handler return values and listener options: what is accepted, and the errors for the rest."""

from __future__ import annotations

import pytest

from kafkatx import App, InvalidConfigurationError, Output, OutputError
from kafkatx.outputs import PendingOutput, collect_outputs


def collect(result: object, topic: str | None = "out", serializer: object = None) -> list[PendingOutput]:
    into: list[PendingOutput] = []
    collect_outputs(result, topic, serializer, "l", into)  # type: ignore[arg-type]
    return into


def test_return_shapes() -> None:
    assert collect(None) == []
    assert collect(b"v") == [("out", b"v", None, None, None)]
    assert collect("é") == [("out", "é".encode(), None, None, None)]
    assert collect(("k", "v")) == [("out", b"v", b"k", None, None)]
    assert collect(Output("v", key=b"k", topic="x", headers={"a": "b"}, partition=2)) == [
        ("x", b"v", b"k", [("a", b"b")], 2)
    ]
    assert [p[1] for p in collect(iter([b"1", None, "2"]))] == [b"1", b"2"]
    assert collect({"a": 1}, serializer=lambda v: b"json") == [("out", b"json", None, None, None)]
    assert collect(Output(None, key=b"k")) == [("out", None, b"k", None, None)], "tombstones are allowed"


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (42, "unsupported int"),
        ({"a": 1}, "unsupported dict"),
        ([object()], "cannot encode the value of type object"),
        ((1, 2, 3), "tuple must be \\(key, value\\)"),
        (Output(b"v", partition=-1), "partition must be a non-negative int"),
        (Output(b"v", headers=[(1, b"x")]), "header names must be str"),
    ],
)
def test_unsupported_returns_name_the_problem(result: object, message: str) -> None:
    with pytest.raises(OutputError, match=message):
        collect(result)


def test_no_output_topic() -> None:
    with pytest.raises(OutputError, match="has no output topic"):
        collect(b"v", topic=None)
    assert collect(Output(b"v", topic="x"), topic=None)[0][0] == "x"


def test_serializer_must_return_bytes() -> None:
    with pytest.raises(OutputError, match="must return bytes"):
        collect({"a": 1}, serializer=lambda v: "not bytes")


@pytest.mark.parametrize(
    ("handler", "topics", "options", "message"),
    [
        ("not callable", ("in",), {}, "must be callable"),
        (len, (), {}, "at least one input topic"),
        (len, ("bad topic!",), {}, "not a valid Kafka topic name"),
        (len, ("in",), {"output": "in"}, "also an input topic"),
        (len, ("in",), {"max_attempts": 0}, "max_attempts must be an integer >= 1"),
        (len, ("in",), {"fencing": "uuid"}, "fencing must be"),
        (len, ("in",), {"retry": "never"}, "retry must be"),
        (len, ("in",), {"backoff": "1s"}, "backoff must be"),
        (len, ("in",), {"dlq": 3}, "dlq must be"),
        (len, ("in",), {"not_retryable": ("ValueError",)}, "exception types"),
        (len, ("in",), {"after_rollback": object()}, "AfterRollbackProcessor"),
        (len, ("in",), {"max_batch_records": 0}, "max_batch_records"),
        (len, ("in",), {"concurrency": -1}, "concurrency"),
    ],
)
def test_listener_options_are_validated(handler: object, topics: tuple[str, ...], options: dict, message: str) -> None:
    app = App("validation")
    with pytest.raises(InvalidConfigurationError, match=message):
        app.listener(*topics, **options)(handler)  # type: ignore[arg-type]


def test_app_settings_that_would_break_exactly_once_are_refused() -> None:
    with pytest.raises(InvalidConfigurationError, match="enable.auto.commit"):
        App("a", config={"enable.auto.commit": True})
    with pytest.raises(InvalidConfigurationError, match="read_committed"):
        App("a", consumer_config={"isolation.level": "read_uncommitted"})
    with pytest.raises(InvalidConfigurationError, match="transactional.id"):
        App("a", producer_config={"transactional.id": "x"})
    with pytest.raises(InvalidConfigurationError, match="non-empty"):
        App("")
    app = App("a", bootstrap_servers="x:1", transaction_timeout_ms=5000, producer_config={"message.timeout.ms": 9000})
    app.listener("in")(len)
    with pytest.raises(InvalidConfigurationError, match="message.timeout.ms"):
        app.producer_config(app.listeners[0], "id")
    with pytest.raises(InvalidConfigurationError, match="no listeners"):
        App("empty", bootstrap_servers="x:1").start()


def test_transactional_ids_follow_the_fencing_mode() -> None:
    app = App("orders", instance_id="pod-7")
    assert app.group_transactional_id("orders", 0) == "orders-orders-pod-7-0"
    assert app.partition_transactional_id("orders", "in", 3) == "orders-orders.in.3"
