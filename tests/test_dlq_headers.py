"""Dead-letter headers: Spring's names and binary encodings, and no growth on repeated hops."""

from __future__ import annotations

import struct

from kafkatx import Record
from kafkatx.dlq.headers import ATTEMPTS, dead_letter_headers, parse_dead_letter_headers


def failing() -> BaseException:
    try:
        try:
            raise KeyError("inner")
        except KeyError as e:
            raise ValueError("outer") from e
    except ValueError as exc:
        return exc


def test_headers_use_springs_encodings() -> None:
    record = Record("orders", 3, 2**40, b"k", b"v", [("trace", b"1")], 1_700_000_000_123, "CreateTime", 3)
    headers = dead_letter_headers(record, failing(), group_id="g1", attempts=3)
    h = dict(headers)
    assert headers[0] == ("trace", b"1"), "original headers come first and are kept"
    assert h["kafka_dlt-original-topic"] == b"orders"
    assert h["kafka_dlt-original-partition"] == struct.pack(">i", 3)
    assert h["kafka_dlt-original-offset"] == struct.pack(">q", 2**40)
    assert h["kafka_dlt-original-timestamp"] == struct.pack(">q", 1_700_000_000_123)
    assert h["kafka_dlt-original-timestamp-type"] == b"CreateTime"
    assert h["kafka_dlt-original-consumer-group"] == b"g1"
    assert h["kafka_dlt-exception-fqcn"] == b"builtins.ValueError"
    assert h["kafka_dlt-exception-cause-fqcn"] == b"builtins.KeyError"
    assert h["kafka_dlt-exception-message"] == b"outer; 'inner'"
    assert b"Traceback" in h["kafka_dlt-exception-stacktrace"]
    assert h[ATTEMPTS] == struct.pack(">i", 3)
    info = parse_dead_letter_headers(headers)
    assert (info.original_topic, info.original_partition, info.original_offset, info.attempts) == (
        "orders",
        3,
        2**40,
        3,
    )


def test_dead_lettering_again_does_not_grow_the_headers() -> None:
    first = Record("orders", 0, 1, None, b"v", [("app", b"x")])
    once = dead_letter_headers(first, ValueError("a" * 100), group_id="g", attempts=1)
    again = Record("orders-dlt", 0, 9, None, b"v", once)
    twice = dead_letter_headers(again, ValueError("b"), group_id="g", attempts=1)
    assert len(twice) == len(once)
    assert dict(twice)["kafka_dlt-original-topic"] == b"orders-dlt"
    assert dict(twice)["kafka_dlt-exception-message"] == b"b"
    history = dead_letter_headers(again, ValueError("b"), group_id="g", attempts=1, keep_history=True)
    assert [k for k, _ in history].count("kafka_dlt-original-topic") == 2


def test_stacktrace_is_capped() -> None:
    h = dict(
        dead_letter_headers(
            Record("t", 0, 0, None, None),
            ValueError("x" * 50_000),
            group_id=None,
            attempts=1,
            max_stacktrace_bytes=1000,
        )
    )
    assert len(h["kafka_dlt-exception-stacktrace"]) <= 1000
    assert "kafka_dlt-original-consumer-group" not in h


def test_parse_tolerates_foreign_or_missing_headers() -> None:
    info = parse_dead_letter_headers([("kafka_dlt-original-partition", b"\x00"), ("other", None)])  # type: ignore[list-item]
    assert info.original_partition is None and info.original_topic is None


def test_stacktrace_header_is_what_the_standard_formatter_writes() -> None:
    """format_stacktrace writes its own final lines (for speed): they must match the stdlib's."""
    import traceback

    from kafkatx.dlq.headers import format_stacktrace

    class Broken(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no str")

    def chained() -> None:
        try:
            {}["k"]
        except KeyError as exc:
            raise ValueError("bad order") from exc

    cases: list[BaseException] = []
    for make in (chained, lambda: (_ for _ in ()).throw(RuntimeError()), lambda: (_ for _ in ()).throw(Broken())):
        try:
            make()
        except Exception as exc:  # noqa: BLE001
            cases.append(exc)
    noted = TypeError("with a note")
    noted.add_note("first note")
    try:
        raise noted
    except TypeError as exc:
        cases.append(exc)

    def without_anchors(text: str) -> str:  # the stdlib's ~~^^ lines: left out on purpose (they cost a parse)
        return "".join(
            line for line in text.splitlines(keepends=True) if not (line.strip() and set(line.strip()) <= {"~", "^"})
        )

    for exc in cases:
        assert format_stacktrace(exc) == without_anchors("".join(traceback.format_exception(exc))), type(exc)
