"""Each handler-result shape's emit function, through a fake confluent-kafka produce (no broker).

A record either goes straight to ``produce`` or waits in the buffer for the
runner's buffered produce: these tests check which, and exactly what
(topic, key, value, headers, partition), including the fall-back to the
buffer when confluent-kafka refuses a record with BufferError.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from kafkatx import Output
from kafkatx.context import bind_sink, send
from kafkatx.errors import OutputError
from kafkatx.outputs import PendingOutput
from kafkatx.result_emitters import HeldOutputs, PartlyProducedError, ResultEmitters

OUT = "out"


class FakeProduce:
    """confluent-kafka's ``produce`` for existing topics: records each call; refuses the ones in ``refuse``."""

    def __init__(self, refuse: int = 0) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.refuse = refuse  # how many of the next calls raise BufferError

    def __call__(self, topic: str, value: Any, key: Any = None, partition: int = -1, headers: Any = None) -> None:
        value, key = as_produced(value), as_produced(key)
        if self.refuse:
            self.refuse -= 1
            raise BufferError("Local: Queue full")
        self.calls.append((topic, value, key, headers, partition))


def to_json(value: Any) -> bytes:
    return json.dumps(value).encode()


def as_produced(data: Any) -> bytes | None:
    """What confluent-kafka makes of a key or value: bytes and None as they are, str as UTF-8, anything else refused."""
    if data is None or isinstance(data, bytes):
        return data
    if isinstance(data, str):
        return data.encode()
    raise TypeError(f"a bytes-like object is required, not '{type(data).__name__}'")


def emitters(
    fake: FakeProduce,
    *,
    topics: tuple[str, ...] = (OUT, "other"),
    output: str | None = OUT,
    serializer: Any = None,
    waited: list[PendingOutput] | None = None,
) -> tuple[ResultEmitters, HeldOutputs]:
    """The emit functions over a fake confluent-kafka; ``waited`` gets what goes to the producer's waiting produce."""
    pending = HeldOutputs(serializer)
    made = ResultEmitters(
        output,
        serializer,
        "listener",
        pending,
        lambda topic: fake if topic in topics else None,
        (waited if waited is not None else []).append,
        kinds={},
    )
    return made, pending


def emit(made: ResultEmitters, result: Any) -> int:
    return made.emitter(type(result))(result)


def test_bytes_go_straight_to_the_output_topic() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake)
    assert emit(made, b"v") == 1
    assert fake.calls == [(OUT, b"v", None, None, -1)]
    assert pending == []


def test_bytes_are_buffered_when_confluent_kafka_refuses_them() -> None:
    fake = FakeProduce(refuse=1)
    made, pending = emitters(fake)
    assert emit(made, b"v") == 0
    assert fake.calls == []
    assert pending == [(OUT, b"v", None, None, None)]


def test_anything_after_a_buffered_record_is_buffered_too_keeping_the_order() -> None:
    fake = FakeProduce(refuse=1)
    made, pending = emitters(fake)
    emit(made, b"first")
    emit(made, (b"k", b"second"))
    assert fake.calls == []
    assert pending == [(OUT, b"first", None, None, None), (OUT, b"second", b"k", None, None)]


def test_a_key_value_pair() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake)
    assert emit(made, (b"k", b"v")) == 1
    assert emit(made, (None, None)) == 1
    assert fake.calls == [(OUT, b"v", b"k", None, -1), (OUT, None, None, None, -1)]
    assert pending == []


def test_a_pair_of_str_goes_straight_to_confluent_kafka_which_encodes_it_as_kafkatx_would() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake)
    assert emit(made, ("k", "v\u00e9")) == 1
    assert fake.calls == [(OUT, "v\u00e9".encode(), b"k", None, -1)]
    assert pending == []


def test_a_pair_confluent_kafka_refuses_is_encoded_into_the_buffer() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake, serializer=lambda v: json.dumps(v).encode())
    assert emit(made, (b"k", {"n": 1})) == 0
    assert emit(made, (b"k", b"after")) == 0  # something is buffered before it: buffered too, in order
    assert fake.calls == []
    assert pending == [
        (OUT, b'{"n": 1}', b"k", None, None),
        (OUT, b"after", b"k", None, None),
    ]


@pytest.mark.parametrize("shape", ["pair", "output", "generator", "send"])
def test_a_key_or_value_of_another_type_is_encoded_by_kafkatx_on_every_direct_path(shape: str) -> None:
    fake = FakeProduce()
    made, pending = emitters(fake, serializer=to_json)
    made.direct("other")
    value = {"n": 1}
    if shape == "pair":
        emit(made, (b"k", value))
    elif shape == "output":
        emit(made, Output(value, key=b"k", headers={"h": b"x"}))
    elif shape == "generator":
        emit(made, iter([(b"k", value)]))
    else:
        sink = Sink()
        sink.serializer = to_json
        previous = bind_sink(sink)
        try:
            send("other", value, b"k")
        finally:
            bind_sink(previous)
        pending = list(sink)
    produced = [(call[1], call[2]) for call in fake.calls]  # the fake takes only what confluent-kafka would
    held = [(value, key) for _, value, key, _, _ in pending]
    assert produced + held == [(b'{"n": 1}', b"k")]


def test_a_tuple_that_is_not_a_pair_fails_with_output_error() -> None:
    made, _ = emitters(FakeProduce())
    with pytest.raises(OutputError, match="must be \\(key, value\\)"):
        emit(made, (b"a", b"b", b"c"))


def test_an_output_with_str_named_headers_goes_straight_to_its_topic() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake)
    headers = {"h": b"1", "s": "text"}
    assert emit(made, Output(b"v", key=b"k", topic="other", headers=headers)) == 1
    assert emit(made, Output(b"w")) == 1
    assert fake.calls == [("other", b"v", b"k", headers, -1), (OUT, b"w", None, None, -1)]
    assert pending == []


def test_an_output_with_a_partition_or_header_pairs_is_buffered_encoded() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake)
    assert emit(made, Output(b"v", topic="other", partition=3)) == 0
    assert emit(made, Output("v", key="k", headers=[("h", "x")])) == 0
    assert fake.calls == []
    assert pending == [
        ("other", b"v", None, None, 3),
        (OUT, b"v", b"k", [("h", b"x")], None),
    ]


def test_a_refused_output_is_buffered_with_its_headers_encoded() -> None:
    fake = FakeProduce(refuse=1)
    made, pending = emitters(fake)
    assert emit(made, Output(b"v", key=b"k", headers={"h": "x", "n": None})) == 0
    assert pending == [(OUT, b"v", b"k", [("h", b"x"), ("n", None)], None)]


def test_an_output_with_a_bad_header_value_fails_with_output_error() -> None:
    class Refusing(FakeProduce):
        def __call__(self, *args: Any, **kwargs: Any) -> None:
            raise TypeError("header value must be str or bytes")

    made, _ = emitters(Refusing())
    with pytest.raises(OutputError, match="header 'h'") as caught:
        emit(made, Output(b"v", headers={"h": 1}))
    assert caught.value.__context__ is None  # raised after confluent-kafka's refusal, not while handling it


def test_an_output_to_a_missing_topic_is_buffered_for_the_producer_to_refuse() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake)
    assert emit(made, Output(b"v", topic="missing")) == 0
    assert pending == [("missing", b"v", None, None, None)]


def test_an_output_without_a_topic_needs_an_output_topic() -> None:
    made, _ = emitters(FakeProduce(), output=None)
    with pytest.raises(OutputError, match="without a topic"):
        emit(made, Output(b"v"))


def test_a_generators_bytes_and_pairs_go_out_in_one_pass_once_it_finished() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake)

    def items() -> Iterator[Any]:
        yield b"a"
        assert fake.calls == []  # nothing goes out while the generator runs
        yield b"k", b"b"

    assert emit(made, items()) == 2
    assert fake.calls == [(OUT, b"a", None, None, -1), (OUT, b"b", b"k", None, -1)]
    assert pending == []


def test_a_generator_that_fails_half_way_produces_nothing_not_even_what_it_sent() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake)

    def items() -> Iterator[Any]:
        yield b"a"
        send("other", b"sent")
        raise RuntimeError("the dependency failed")

    with pytest.raises(RuntimeError):
        emit(made, items())
    assert fake.calls == []


def test_what_a_generator_sends_keeps_its_place_among_its_items() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake)

    def items() -> Iterator[Any]:
        yield b"a"
        send("other", b"sent")
        yield b"b"

    previous = bind_sink(pending)
    try:
        produced = emit(made, items())
    finally:
        bind_sink(previous)
    assert produced == 3
    assert pending == []
    assert [call[:3] for call in fake.calls] == [(OUT, b"a", None), ("other", b"sent", None), (OUT, b"b", None)]


def test_a_generators_other_items_are_encoded_and_produced_in_order() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake)

    def items() -> Iterator[Any]:
        yield b"a"
        yield None
        yield b"k", b"b"
        yield Output(b"c", topic="other")

    assert emit(made, items()) == 3
    assert fake.calls == [(OUT, b"a", None, None, -1), (OUT, b"b", b"k", None, -1), ("other", b"c", None, None, -1)]
    assert pending == []


def test_what_a_handler_sent_before_its_iterable_goes_first() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake)
    pending.add(("other", b"sent", None, None, None))
    assert emit(made, [b"a", (b"k", b"b")]) == 0  # held behind what was sent
    assert made.flush() == 3
    assert [call[:3] for call in fake.calls] == [("other", b"sent", None), (OUT, b"a", None), (OUT, b"b", b"k")]


def test_an_item_kafkatx_cannot_encode_after_items_that_went_out_fails_as_partly_produced() -> None:
    """Those items are in the transaction: only an abort undoes them (as for an output the client refuses)."""
    fake = FakeProduce()
    made, _ = emitters(fake)
    with pytest.raises(PartlyProducedError):
        emit(made, [b"a", 3])
    first_fake = FakeProduce()
    made, _ = emitters(first_fake)
    with pytest.raises(OutputError, match="int"):
        emit(made, [3, b"a"])  # nothing went out: an ordinary failure of the record
    assert first_fake.calls == []


def test_an_item_confluent_kafka_refuses_half_way_and_the_rest_go_to_the_waiting_produce() -> None:
    """A full queue after the first item: the rest wait for space, in order, none lost or doubled."""
    calls: list[tuple[Any, ...]] = []

    def full_after_one(topic: str, value: Any, key: Any = None, partition: int = -1, headers: Any = None) -> None:
        if calls:
            raise BufferError("Local: Queue full")
        calls.append((topic, value, key))

    waited: list[PendingOutput] = []
    made, pending = emitters(FakeProduce(), waited=waited)
    made.directs[OUT] = full_after_one
    assert emit(made, [b"a", b"b", b"c"]) == 3
    assert calls == [(OUT, b"a", None)]
    assert waited == [(OUT, b"b", None, None, None), (OUT, b"c", None, None, None)]
    assert pending == []


def test_an_iterables_items_of_other_types_are_encoded_then_produced() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake)
    assert emit(made, ["a", ("k", b"b")]) == 2
    assert fake.calls == [(OUT, b"a", None, None, -1), (OUT, b"b", b"k", None, -1)]
    assert pending == []


def test_an_iterable_for_a_listener_without_a_direct_topic_is_held_encoded() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake, topics=("other",))
    assert emit(made, ["a", ("k", b"b")]) == 0
    assert pending == [(OUT, b"a", None, None, None), (OUT, b"b", b"k", None, None)]  # the runner flushes them


def test_the_serializer_encodes_anything_else() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake, serializer=lambda v: json.dumps(v).encode())
    assert emit(made, {"a": 1}) == 1
    assert fake.calls == [(OUT, b'{"a": 1}', None, None, -1)]
    assert pending == []


def test_a_failing_serializer_fails_with_output_error_chaining_its_error() -> None:
    def broken(value: Any) -> bytes:
        raise ValueError("no")

    made, _ = emitters(FakeProduce(), serializer=broken)
    with pytest.raises(OutputError, match="serializer failed to encode the value \\(dict\\): no") as caught:
        emit(made, {"a": 1})
    assert isinstance(caught.value.__cause__, ValueError)


def test_an_unsupported_result_fails_with_output_error() -> None:
    made, _ = emitters(FakeProduce())
    with pytest.raises(OutputError, match="unsupported dict"):
        emit(made, {"a": 1})


def test_str_is_encoded_and_buffered() -> None:
    fake = FakeProduce()
    made, pending = emitters(fake)
    assert emit(made, "v") == 0
    assert pending == [(OUT, b"v", None, None, None)]


def test_the_emit_function_is_chosen_once_per_type() -> None:
    made, _ = emitters(FakeProduce())
    pair, value = made.emitter(tuple), made.emitter(bytes)
    assert made.by_type == {tuple: pair, bytes: value}
    assert pair is not value


def test_buffered_outputs_are_produced_in_order_with_their_partition_and_headers() -> None:
    fake = FakeProduce(refuse=1)
    waited: list[PendingOutput] = []
    made, pending = emitters(fake, waited=waited)
    emit(made, b"a")  # refused: buffered
    emit(made, Output(b"b", topic="other", partition=2, headers=[("h", b"x")]))
    emit(made, Output(b"c", topic="missing"))
    assert made.flush() == 3
    assert fake.calls == [(OUT, b"a", None, None, -1), ("other", b"b", None, [("h", b"x")], 2)]
    assert waited == [("missing", b"c", None, None, None)]
    assert pending == []


def test_a_buffered_output_confluent_kafka_refuses_goes_to_the_waiting_produce() -> None:
    fake = FakeProduce(refuse=2)
    waited: list[PendingOutput] = []
    made, _ = emitters(fake, waited=waited)
    emit(made, b"a")  # refused once: buffered
    made.flush()  # refused again: the producer's produce waits for queue space
    assert fake.calls == []
    assert waited == [(OUT, b"a", None, None, None)]


class Sink(list[PendingOutput]):
    """What ``send()`` appends to: a record's buffer (a record's work is held until its handler returns)."""

    serializer = None
    add = list.append


def test_a_bytes_subclass_is_produced_as_its_bytes_on_every_path() -> None:
    class Payload(bytes):
        pass

    fake = FakeProduce()
    made, pending = emitters(fake, serializer=to_json)
    emit(made, Payload(b"alone"))  # returned as it is: encoded into the buffer
    emit(made, (Payload(b"k"), Payload(b"pair")))
    assert [(value, key) for _, value, key, _, _ in pending] == [(b"alone", None), (b"pair", b"k")]
    assert all(type(value) is bytes and type(key) in (bytes, type(None)) for _, value, key, _, _ in pending)
