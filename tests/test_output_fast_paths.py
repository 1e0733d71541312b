"""The record runner's direct paths to confluent-kafka produce exactly what the documented return shapes say.

Bytes, ``(key, value)`` of bytes, an ``Output`` of bytes with ``str`` ->
``bytes`` headers, generator items and ``send()`` skip kafkatx's general
encoding; these tests pin what reaches the topic (topic, key, value,
headers, order), and that a failing handler leaves nothing of its attempt
committed whether its outputs were produced as they came (``retry="rollback"``)
or buffered (``retry="in_place"``).
"""

from __future__ import annotations

import json

import pytest
from helpers import make_app

from kafkatx import Output, Record, send
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.testing import KafkaTestKit, running, wait_for


def test_direct_shapes_produce_the_documented_records_in_order(kafka: KafkaTestKit) -> None:
    src, out, other = kafka.topic(), kafka.topic(), kafka.topic()
    kinds = [
        "bytes",
        "pair",
        "tombstone",
        "no-key",
        "output",
        "output-str-headers",
        "output-other",
        "output-partition",
        "output-pairs",
        "generator",
        "list",
        "send-then-return",
        "serialized",
    ]
    kafka.produce(src, [(b"k-" + k.encode(), k.encode()) for k in kinds])
    app = make_app(kafka)

    @app.listener(src, output=out, serializer=lambda v: json.dumps(v).encode(), sends_to=[other], fencing="group")
    def handler(record: Record) -> object:
        kind, key = (record.value or b"").decode(), record.key
        if kind == "bytes":
            return b"bytes"
        if kind == "pair":
            return key, b"pair"
        if kind == "tombstone":
            return key, None
        if kind == "no-key":
            return None, b"no-key"
        if kind == "output":
            return Output(b"output", key=key, headers={"h1": b"1", "h2": b"2"})
        if kind == "output-str-headers":  # str values UTF-8 encoded, None kept: as kafkatx's own encoding does
            return Output(b"output-str-headers", key=key, headers={"s": "\u00e9t\u00e9", "n": None, "b": b"b"})
        if kind == "output-other":
            return Output(b"output-other", topic=other, headers={"h": b"x"})
        if kind == "output-partition":
            return Output(b"output-partition", key=key, partition=0, headers=[("h", "str")])
        if kind == "output-pairs":
            return Output(b"output-pairs", key=key, headers=[("p", b"1"), ("p", "2")])
        if kind == "generator":
            return ((key, b"gen-%d" % i) if i % 2 else b"gen-%d" % i for i in range(4))
        if kind == "list":
            return [None, (key, b"list-1"), b"list-2"]
        if kind == "send-then-return":
            send(other, b"sent", key)
            send(out, b"sent-first", key)
            return key, b"returned-after"
        return {"kind": kind}

    with running(app):
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: len(kinds)}, 30)
    main = [(r.key, r.value, r.headers or []) for r in kafka.read(out)]
    assert main == [
        (None, b"bytes", []),
        (b"k-pair", b"pair", []),
        (b"k-tombstone", None, []),
        (None, b"no-key", []),
        (b"k-output", b"output", [("h1", b"1"), ("h2", b"2")]),
        (b"k-output-str-headers", b"output-str-headers", [("s", "\u00e9t\u00e9".encode()), ("n", None), ("b", b"b")]),
        (b"k-output-partition", b"output-partition", [("h", b"str")]),
        (b"k-output-pairs", b"output-pairs", [("p", b"1"), ("p", b"2")]),
        (None, b"gen-0", []),
        (b"k-generator", b"gen-1", []),
        (None, b"gen-2", []),
        (b"k-generator", b"gen-3", []),
        (b"k-list", b"list-1", []),
        (None, b"list-2", []),
        (b"k-send-then-return", b"sent-first", []),
        (b"k-send-then-return", b"returned-after", []),
        (None, b'{"kind": "serialized"}', []),
    ]
    side = [(r.key, r.value, r.headers or []) for r in kafka.read(other)]
    assert side == [(None, b"output-other", [("h", b"x")]), (b"k-send-then-return", b"sent", [])]


@pytest.mark.parametrize("retry", ["rollback", "in_place"])
def test_a_handler_that_fails_midway_leaves_nothing_of_its_attempt_committed(kafka: KafkaTestKit, retry: str) -> None:
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"before", b"flaky", b"after"])
    app = make_app(kafka)

    @app.listener(src, output=out, retry=retry, max_attempts=3, fencing="group", backoff=0)  # type: ignore[arg-type]
    def handler(record: Record) -> object:
        value = record.value or b""
        send(out, value + b"-sent")
        yield value + b"-1"
        if value == b"flaky" and record.attempt == 1:
            raise RuntimeError("first attempt fails after its first outputs")
        yield value + b"-2"

    with running(app):
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: 3}, 30)
    assert kafka.values(out) == [
        b"before-sent",
        b"before-1",
        b"before-2",
        b"flaky-sent",
        b"flaky-1",
        b"flaky-2",
        b"after-sent",
        b"after-1",
        b"after-2",
    ]
    uncommitted = kafka.values(out, isolation="read_uncommitted")
    assert uncommitted.count(b"flaky-1") == uncommitted.count(b"flaky-sent") == 1, (
        "the failed attempt's outputs were held until it returned, and never produced"
    )


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("header-name", "header names must be str"),
        ("header-pair-name", "header names must be str"),
        ("triple", "tuple must be (key, value)"),
        # A value, key or header of a type kafkatx cannot encode stops the container instead:
        # tests/test_unproducible_results.py
    ],
)
def test_bad_outputs_on_the_direct_paths_fail_their_record_with_a_clear_error(
    kafka: KafkaTestKit, bad: str, message: str
) -> None:
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"good-1", bad.encode(), b"good-2"])
    app = make_app(kafka)

    @app.listener(src, output=out, dlq=True, max_attempts=2, fencing="group", backoff=0)
    def handler(record: Record) -> object:
        value = record.value or b""
        if value == b"header-name":
            return Output(b"x", headers={1: b"x"})  # type: ignore[dict-item]
        if value == b"header-pair-name":
            return Output(b"x", headers=[(1, b"x")])  # type: ignore[list-item]
        if value == b"triple":
            return (b"k", b"v", b"extra")
        return value

    with running(app):
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: 3}, 30)
    assert kafka.values(out) == [b"good-1", b"good-2"], "nothing of the bad record was committed (not even 'partial')"
    (dead,) = kafka.read(src + "-dlt")
    info = parse_dead_letter_headers(dead.headers)
    assert info.exception_fqcn == "kafkatx.errors.OutputError"
    assert message in (info.exception_message or "")
    trace = info.exception_stacktrace or ""
    assert "During handling" not in trace and "expected header" not in trace, (
        "not chained to what confluent-kafka refused"
    )


def test_a_listener_serializer_failure_dead_letters_its_record_naming_the_serializer(kafka: KafkaTestKit) -> None:
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"good", b"raises", b"returns-str", b"bytearray"])
    app = make_app(kafka)

    def serializer(value: dict[str, str]) -> bytes:
        if value["v"] == "raises":
            raise ValueError("no encoding for this one")
        if value["v"] == "returns-str":
            return "not bytes"  # type: ignore[return-value]
        if value["v"] == "bytearray":
            return bytearray(b"copied")  # type: ignore[return-value]
        return json.dumps(value).encode()

    @app.listener(src, output=out, serializer=serializer, dlq=True, max_attempts=2, fencing="group", backoff=0)
    def handler(record: Record) -> object:
        return {"v": (record.value or b"").decode()}

    with running(app):
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: 4}, 30)
    assert kafka.values(out) == [b'{"v": "good"}', b"copied"]
    dead = {r.value: parse_dead_letter_headers(r.headers) for r in kafka.read(src + "-dlt")}
    assert set(dead) == {b"raises", b"returns-str"}
    raised, wrong = dead[b"raises"], dead[b"returns-str"]
    assert raised.exception_fqcn == wrong.exception_fqcn == "kafkatx.errors.OutputError"
    assert (raised.exception_message or "").startswith("the serializer failed to encode the value (dict): no encoding")
    assert raised.exception_cause_fqcn == "builtins.ValueError", "the serializer's own error is the cause"
    assert wrong.exception_message == "the serializer returned str for the value; it must return bytes"
    assert raised.attempts == wrong.attempts == 1, "an output the serializer cannot encode is not retried"


@pytest.mark.parametrize("retry", ["rollback", "in_place"])
def test_records_a_handler_keeps_stay_as_they_were_delivered(kafka: KafkaTestKit, retry: str) -> None:
    # The runner refills the Record object of the previous message when nothing else holds it (an allocation
    # less per record). Whatever keeps a record (a list, a generator's frame, a failure's traceback, an event)
    # must keep that record unchanged, and a handler's changes to one record must not leak into the next.
    src, out = kafka.topic(partitions=2), kafka.topic()
    sent = [
        {"key": b"k%d" % n, "value": b"v%d" % n, "partition": n % 2, "headers": [("n", b"%d" % n)]} for n in range(40)
    ]
    kafka.produce(src, sent)
    app = make_app(kafka)
    kept: list[tuple[Record, bool]] = []  # (record, whether that call failed)
    seen: list[tuple[int, bytes | None, bytes | None, int]] = []
    failed_once: set[int] = set()

    @app.listener(src, output=out, retry=retry, max_attempts=3, fencing="group", backoff=0)  # type: ignore[arg-type]
    def handler(record: Record) -> object:
        n = int(record.header("n") or b"")
        seen.append((n, record.key, record.value, record.attempt))
        fails = n % 7 == 0 and n not in failed_once
        if n % 5 == 0:
            kept.append((record, fails))
        if fails:
            failed_once.add(n)
            raise RuntimeError(f"the first attempt of record {n} fails")
        value = record.value
        record.value, record.key = b"changed by the handler", None  # a record is the handler's to change
        if n % 3 == 0:
            return (v for v in [value] if record is not None)  # the generator holds the record until drained
        return value

    with running(app):
        wait_for(lambda: sum(kafka.committed(app.group_id, src).values()) == 40, 30)
    assert sorted(kafka.values(out), key=lambda v: int((v or b"0")[1:])) == [b"v%d" % n for n in range(40)]
    assert all((k, v) == (b"k%d" % n, b"v%d" % n) for n, k, v, _ in seen), "each call saw its own key and value"
    assert {(n, a) for n, _, _, a in seen if n % 7 == 0} == {(n, a) for n in range(0, 40, 7) for a in (1, 2)}
    assert {int(r.header("n") or b"") for r, _ in kept} == set(range(0, 40, 5))
    for record, failed in kept:  # as its handler call left it
        n = int(record.header("n") or b"")
        assert (record.topic, record.partition, record.offset) == (src, n % 2, n // 2)
        if failed:  # before changing it (a re-run after a success is attempt 1 too: a success ends the count)
            assert (record.key, record.value) == (b"k%d" % n, b"v%d" % n)
        else:
            assert (record.key, record.value) == (None, b"changed by the handler")


def test_keys_and_values_confluent_kafka_does_not_take_as_they_are_are_encoded_by_kafkatx(kafka: KafkaTestKit) -> None:
    # The direct paths pass keys and values to confluent-kafka unchecked: it encodes str as UTF-8 (as kafkatx does)
    # and refuses the rest with TypeError, and kafkatx then encodes that record itself, here with the serializer.
    src, out, other = kafka.topic(), kafka.topic(), kafka.topic()
    kinds = ["pair-str", "pair-dict", "generator", "send", "output"]
    kafka.produce(src, [k.encode() for k in kinds])
    app = make_app(kafka)

    @app.listener(src, output=out, serializer=lambda v: json.dumps(v).encode(), sends_to=[other], fencing="group")
    def handler(record: Record) -> object:
        kind = (record.value or b"").decode()
        if kind == "pair-str":
            return "k\u00e9", "v\u00e9"
        if kind == "pair-dict":
            return b"k", {"n": 1}
        if kind == "generator":
            return iter([(b"k", {"n": 2}), (b"k", b"after")])  # the first is encoded: the second keeps its place
        if kind == "send":
            send(other, {"n": 3}, "k")
            return None
        return Output({"n": 4}, key=b"k", headers={"h": "x"})

    with running(app):
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: len(kinds)}, 30)
    assert [(r.key, r.value) for r in kafka.read(out)] == [
        ("k\u00e9".encode(), "v\u00e9".encode()),
        (b"k", b'{"n": 1}'),
        (b"k", b'{"n": 2}'),
        (b"k", b"after"),
        (b"k", b'{"n": 4}'),
    ]
    assert [(r.key, r.value) for r in kafka.read(other)] == [(b"k", b'{"n": 3}')]
    assert [r.headers for r in kafka.read(out)][-1] == [("h", b"x")]


@pytest.mark.parametrize("shape", ["pair", "output"])
def test_a_committed_transaction_leaves_no_garbage_for_the_collector(kafka: KafkaTestKit, shape: str) -> None:
    """A transaction's unit and records are freed when it ends, whatever its handler returns: held in a reference
    cycle (emit functions referring back to their owner) they waited for the garbage collector, a full batch of
    Messages at a time, and a busy listener paid for the collections."""
    import gc

    from kafkatx.events import TransactionCommitted

    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [(b"k", b"v%d" % i) for i in range(20)])
    app = make_app(kafka)
    committed: list[int] = []
    app.events.subscribe(TransactionCommitted, lambda event: committed.append(event.records))

    @app.listener(src, output=out, fencing="group")
    def handler(record: Record) -> object:
        return (record.key, record.value) if shape == "pair" else Output(record.value or b"", key=record.key)

    gc.collect()
    gc.disable()
    try:
        with running(app):
            wait_for(lambda: sum(committed) == 20, message="20 records committed")
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cyclic = [type(o).__name__ for o in gc.garbage if type(o).__name__ in ("TransactionUnit", "ResultEmitters")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cyclic == [], "a transaction's unit was left for the garbage collector"
