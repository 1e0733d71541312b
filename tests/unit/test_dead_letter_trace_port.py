"""The dead-letter publisher gets its App's tracing handed to it at setup, not from a registry of the process."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kafkatx import DeadLetterPublishingRecoverer, Record
from kafkatx.context import RecoveryContext, bind_recovery
from kafkatx.tracing import Tracing

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _failed_three_times() -> tuple[Tracing, Record]:
    """A Tracing in which a record's three attempts failed (its dead letter continues the last one)."""
    tracing = Tracing(TracerProvider())

    def failing(record: Record) -> None:
        raise ValueError("poison")

    spec = SimpleNamespace(name="l", handler=failing, output=None, serializer=None, is_async=False, concurrency=1)
    traced = tracing.wrap(spec, "port-group")
    for attempt in (1, 2, 3):
        with pytest.raises(ValueError):
            traced(Record("orders", 0, 7, None, b"v", [("traceparent", PARENT.encode())], attempt=attempt))
    return tracing, Record("orders", 0, 7, None, b"v", [("traceparent", PARENT.encode())], attempt=3)


def _dead_letter_headers(setup: Any, record: Record) -> dict[str, bytes]:
    """The headers of the dead letter a publisher set up with ``setup`` writes for ``record``."""
    publisher = DeadLetterPublishingRecoverer("orders-dlt")
    publisher.setup(setup)
    delivered: list[Any] = []

    def deliver(output: Any) -> None:
        delivered.append(output)

    previous = bind_recovery(RecoveryContext("l", "port-group", lambda topic: 1, deliver, list, lambda exc: True))
    try:
        publisher.recover(record, ValueError("poison"))
    finally:
        bind_recovery(previous)
    (output,) = delivered
    return dict(output[3])  # (topic, value, key, headers, partition)


def test_the_dead_letter_continues_the_trace_of_the_tracing_the_publisher_was_handed() -> None:
    tracing, record = _failed_three_times()
    other = _failed_three_times()  # another App's tracing in the same process (alive): not asked
    setup = SimpleNamespace(
        input_topics=("orders",), partitions=lambda topic: 1, dead_letter_trace=tracing.dead_letter_headers
    )
    headers = _dead_letter_headers(setup, record)
    expected = tracing.dead_letter_headers("port-group", record)
    assert expected is not None and headers["traceparent"] == dict(expected)["traceparent"]
    assert other[0].dead_letter_headers("port-group", record) != expected, (
        "the other tracing would have answered otherwise"
    )
    assert headers["traceparent"].split(b"-")[1] == PARENT.split("-")[1].encode(), "the record's trace"


def test_a_publisher_handed_no_tracing_writes_no_trace_header_whatever_else_runs_in_the_process() -> None:
    _, record = _failed_three_times()  # a Tracing that knows the record exists, but was not handed over
    setup = SimpleNamespace(input_topics=("orders",), partitions=lambda topic: 1)  # tracing off: no dead_letter_trace
    headers = _dead_letter_headers(setup, record)
    assert headers["traceparent"] == PARENT.encode(), "the record's own header, copied as consumed, unchanged"
    assert "kafka_dlt-exception-fqcn" in headers
