"""Per-record Python cost of kafkatx's record runner for every handler return shape, without a broker.

    python bench/micro_hot_path.py                      # CPU time per record, every shape
    python bench/micro_hot_path.py --callgrind          # instructions per record (stable on a busy machine)
    python bench/micro_hot_path.py --shapes keyed,send --batch 1
    python bench/micro_hot_path.py --shapes typed       # value_type= (needs pydantic) against json.loads + validate
    PYTHONPATH=/tmp/patched/src python bench/micro_hot_path.py    # a patched copy

Builds ``--batch`` confluent-kafka Messages in memory (8 partitions, keyed,
100-byte values, in partition runs as a fetch returns them), then, for each
shape, runs the listener's runner (``RecordRunner``, on a
:class:`~kafkatx.TransactionUnit` of a ``fencing="group"`` container) on
them against a stub confluent-kafka Producer whose calls do nothing, and the
hand-written loop producing the same records against the same stub. The
difference is kafkatx's own per-record cost in the processing thread: what
``bench/run.py`` sees as fewer records/s once the client is CPU-bound.

``--callgrind`` re-runs this script under ``valgrind --tool=callgrind`` and
counts the instructions of each measured batch only (collection is switched
on inside ``builtin_sorted``, which the measured code never calls), so the
figures do not move with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _callgrind  # bench/_callgrind.py (this script's folder is on sys.path)

HERE = Path(__file__).resolve().parent
OUT = "micro-out"
HEADERS = {"source": b"bench"}
SHAPES = ["bytes", "keyed", "output", "generator", "send", "serializer", "typed", "typed_json"]
SHAPE_HELP = {
    "bytes": "return record.value.upper()",
    "keyed": "return (record.key, record.value.upper())",
    "output": "return Output(value.upper(), key=key, headers={...})",
    "generator": "yield (key, value.upper()); yield (key, value)",
    "send": "send(topic, value.upper(), key); return None",
    "serializer": "return {'v': ...} with serializer=json",
    "typed": "value_type=Order; return Invoice(...) (pydantic; by hand: json.loads + model_validate)",
    "typed_json": "the same; by hand: pydantic's own JSON both ways (model_validate_json, to_json)",
}


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def handlers(
    shape: str,
) -> tuple[Callable[[Any], Any], dict[str, Any], Callable[[Callable[..., Any], list[Any]], None]]:
    """(kafkatx handler, listener options, the hand-written loop body producing the same records)."""
    from kafkatx import Output, send

    if shape == "bytes":

        def handler(record: Any) -> Any:
            return record.value.upper()

        def raw(produce: Callable[..., Any], msgs: list[Any]) -> None:
            for m in msgs:
                produce(OUT, m.value().upper())

        return handler, {"output": OUT}, raw
    if shape == "keyed":

        def handler(record: Any) -> Any:
            return record.key, record.value.upper()

        def raw(produce: Callable[..., Any], msgs: list[Any]) -> None:
            for m in msgs:
                produce(OUT, m.value().upper(), m.key())

        return handler, {"output": OUT}, raw
    if shape == "output":

        def handler(record: Any) -> Any:
            return Output(record.value.upper(), key=record.key, headers=HEADERS)

        def raw(produce: Callable[..., Any], msgs: list[Any]) -> None:
            for m in msgs:
                produce(OUT, m.value().upper(), m.key(), headers=HEADERS)

        return handler, {"output": OUT}, raw
    if shape == "generator":

        def handler(record: Any) -> Iterator[Any]:
            key, value = record.key, record.value
            yield key, value.upper()
            yield key, value

        def raw(produce: Callable[..., Any], msgs: list[Any]) -> None:
            for m in msgs:
                key, value = m.key(), m.value()
                produce(OUT, value.upper(), key)
                produce(OUT, value, key)

        return handler, {"output": OUT}, raw
    if shape == "send":

        def handler(record: Any) -> Any:
            send(OUT, record.value.upper(), record.key)

        def raw(produce: Callable[..., Any], msgs: list[Any]) -> None:
            for m in msgs:
                produce(OUT, m.value().upper(), m.key())

        return handler, {"sends_to": [OUT]}, raw
    if shape == "serializer":

        def handler(record: Any) -> Any:
            return {"v": record.value.decode().upper(), "o": record.offset}

        def raw(produce: Callable[..., Any], msgs: list[Any]) -> None:
            for m in msgs:
                produce(OUT, _dumps({"v": m.value().decode().upper(), "o": m.offset()}))

        return handler, {"output": OUT, "serializer": _dumps}, raw
    if shape in ("typed", "typed_json"):
        return _typed_handlers(fastest=shape == "typed_json")
    raise SystemExit(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")


def _typed_handlers(
    fastest: bool,
) -> tuple[Callable[[Any], Any], dict[str, Any], Callable[[Callable[..., Any], list[Any]], None]]:
    """A ``value_type=`` listener returning a model, and the loop a user writes without it: the same models.

    ``fastest``: the hand-written loop uses pydantic's own JSON parser and encoder, as kafkatx does.
    """
    import pydantic
    import pydantic_core

    class Order(pydantic.BaseModel):
        id: int
        customer: str
        amount: float
        note: str

    class Invoice(pydantic.BaseModel):
        order: int
        total: float

    def handler(record: Any) -> Any:
        order = record.value
        return Invoice(order=order.id, total=order.amount * 1.2)

    def raw(produce: Callable[..., Any], msgs: list[Any]) -> None:
        validate, loads = Order.model_validate, json.loads
        for m in msgs:
            order = validate(loads(m.value()))
            produce(OUT, Invoice(order=order.id, total=order.amount * 1.2).model_dump_json().encode(), m.key())

    def fastest_raw(produce: Callable[..., Any], msgs: list[Any]) -> None:
        validate_json, to_json = Order.model_validate_json, pydantic_core.to_json
        for m in msgs:
            order = validate_json(m.value())
            produce(OUT, to_json(Invoice(order=order.id, total=order.amount * 1.2)), m.key())

    if fastest:
        return handler, {"output": OUT, "value_type": Order}, fastest_raw
    return handler, {"output": OUT, "value_type": Order}, raw


def inputs(shape: str, msgs: list[Any]) -> list[Any]:
    """The messages a shape reads: the typed shapes' values are JSON orders of about the same size."""
    if not shape.startswith("typed"):
        return msgs
    from confluent_kafka import Message

    return [
        Message(
            topic=m.topic(),
            partition=m.partition(),
            offset=m.offset(),
            key=m.key(),
            value=json.dumps(
                {"id": m.offset(), "customer": f"c-{m.offset() % 97}", "amount": m.offset() / 7, "note": "x" * 40}
            ).encode(),
        )
        for m in msgs
    ]


class StubProducer:
    """Stands in for confluent_kafka.Producer: every call returns at once."""

    def __init__(self, config: Any = None) -> None:
        pass

    def init_transactions(self, *args: Any) -> None:
        pass

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> StubMetadata:
        return StubMetadata(topic)

    def produce(self, *args: Any, **kwargs: Any) -> None:
        pass

    def begin_transaction(self, *args: Any) -> None:
        pass

    def send_offsets_to_transaction(self, *args: Any) -> None:
        pass

    def commit_transaction(self, *args: Any) -> None:
        pass

    def abort_transaction(self, *args: Any) -> None:
        pass

    def poll(self, *args: Any) -> int:
        return 0

    def flush(self, *args: Any) -> int:
        return 0


class StubConsumer:
    membership = b"stub-group-metadata"

    def consumer_group_metadata(self) -> bytes:
        return self.membership

    def position(self, tps: Any) -> Any:
        return tps

    def assignment(self) -> list[Any]:
        return []


def messages(n: int, partitions: int = 8) -> list[Any]:
    """``n`` keyed 100-byte records, record i on partition i % partitions, grouped by partition like a fetch."""
    from confluent_kafka import Message

    sys.path.insert(0, str(HERE))
    from run import make_key, make_value

    by_partition: list[list[Any]] = [[] for _ in range(partitions)]
    for i in range(n):
        p = i % partitions
        by_partition[p].append(
            Message(
                topic="micro-in",
                partition=p,
                offset=i // partitions,
                key=make_key(i),
                value=make_value(i, 100, 0, partitions),
            )
        )
    return [m for part in by_partition for m in part]


class StubMetadata:
    """What ``list_topics`` answers: every topic exists, with 8 partitions."""

    def __init__(self, topic: str | None) -> None:
        partitions = dict.fromkeys(range(8))
        self.topics = {topic: types.SimpleNamespace(error=None, partitions=partitions)} if topic else {}


def setup(shape: str) -> tuple[Callable[[list[Any]], None], Callable[[list[Any]], None]]:
    """(kafkatx batch, hand-written batch): each handles one list of messages in one (stub) transaction.

    kafkatx's side is built through public surfaces only: the listener's
    container (a ``ContainerHost``) with a stub consumer, the record runner
    made on it, and a ``TransactionalProducer`` whose confluent-kafka
    Producer is the stub (``kafkatx.client.producer.Producer`` replaced
    while it creates it, as a test's monkeypatch would).
    """
    import kafkatx.client.producer as producer_module
    from kafkatx import App
    from kafkatx.client.producer import TransactionalProducer
    from kafkatx.listener.loop.container import ListenerContainer
    from kafkatx.listener.runners.record_runner import RecordRunner
    from kafkatx.listener.transaction.unit import TransactionUnit

    handler, options, raw_body = handlers(shape)
    app = App("micro", bootstrap_servers="127.0.0.1:1", instance_id="micro")
    spec = app.add_listener(
        handler, "micro-in", name=f"micro-{shape}", fencing="group", max_batch_records=1000, **options
    )
    container = ListenerContainer(spec, app, 0, 0)
    container.consumer = StubConsumer()  # type: ignore[assignment]
    producer = TransactionalProducer(app.producer_config(spec, "micro-tx"), "micro-tx", retry_timeout=5.0)
    real_producer, producer_module.Producer = producer_module.Producer, StubProducer  # type: ignore[misc]
    try:
        producer.ensure()
    finally:
        producer_module.Producer = real_producer  # type: ignore[misc]
    if producer.partition_count(OUT) is None:
        raise SystemExit("the stub producer does not know the output topic")
    runner = RecordRunner(container, spec.processor)

    def kafkatx_batch(msgs: list[Any]) -> None:
        runner(TransactionUnit(container, producer, msgs))

    stub, consumer = StubProducer(), StubConsumer()

    def raw_batch(msgs: list[Any]) -> None:
        stub.begin_transaction()
        raw_body(stub.produce, msgs)
        stub.send_offsets_to_transaction(
            consumer.position(consumer.assignment()), consumer.consumer_group_metadata(), 30
        )
        stub.commit_transaction(30)

    return kafkatx_batch, raw_batch


def timed(shapes: list[str], msgs: list[Any], iterations: int, repeat: int) -> dict[str, dict[str, float]]:
    """Processing-thread CPU time per record (min of ``repeat`` timings of ``iterations`` batches)."""
    out: dict[str, dict[str, float]] = {}
    for shape in shapes:
        ktx, raw = setup(shape)
        row = {}
        shape_msgs = inputs(shape, msgs)
        for side, fn in (("raw", raw), ("kafkatx", ktx)):
            fn(shape_msgs)  # warm-up
            best = []
            for _ in range(repeat):
                t = time.thread_time()
                for _ in range(iterations):
                    fn(shape_msgs)
                best.append((time.thread_time() - t) / (iterations * len(msgs)) * 1e6)
            row[side] = min(best)
        out[shape] = row
    return out


def inner_callgrind(shapes: list[str], msgs: list[Any], iterations: int) -> None:
    """Under callgrind (bench/_callgrind.py): each shape's two sides, ``iterations`` batches each."""
    regions = []
    for shape in shapes:
        ktx, raw = setup(shape)
        shape_msgs = inputs(shape, msgs)
        for side, fn in (("raw", raw), ("kafkatx", ktx)):
            fn(shape_msgs)
            fn(shape_msgs)  # warm-up: caches, lazy imports, topic metadata

            def region(fn: Callable[[list[Any]], None] = fn, shape_msgs: list[Any] = shape_msgs) -> None:
                for _ in range(iterations):
                    fn(shape_msgs)

            regions.append(([shape, side], region))
    _callgrind.run_regions(regions)


def run_callgrind(args: argparse.Namespace, shapes: list[str]) -> dict[str, dict[str, float]]:
    inner = ["--shapes", ",".join(shapes), "--batch", str(args.batch), "--iterations", str(args.cg_iterations)]
    env = {**os.environ, "PYTHONMALLOC": "malloc"} if args.malloc else None
    out: dict[str, dict[str, float]] = {}
    per = args.cg_iterations * args.batch
    for (shape, side), total in _callgrind.measure(__file__, inner, env):
        out.setdefault(shape, {})[side] = total / per
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {','.join(SHAPES)}")
    ap.add_argument("--batch", type=int, default=1000, help="records per transaction")
    ap.add_argument("--iterations", type=int, default=100, help="batches per timing")
    ap.add_argument("--repeat", type=int, default=7, help="timings; the minimum is reported")
    ap.add_argument("--callgrind", action="store_true", help="count instructions per record under callgrind instead")
    ap.add_argument("--cg-iterations", type=int, default=5, help="batches per shape and side under callgrind")
    ap.add_argument("--malloc", action="store_true", help="with --callgrind: PYTHONMALLOC=malloc")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--inner-callgrind", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        handlers(s)  # validates the name
    if args.inner_callgrind:
        inner_callgrind(shapes, messages(args.batch), args.cg_iterations)
        return

    import kafkatx

    print(f"# kafkatx from {Path(kafkatx.__file__).parent}; {args.batch} records per transaction, stub producer")
    if args.callgrind:
        res = run_callgrind(args, shapes)
        unit, fmt = "instructions/record", "{:10,.0f}"
    else:
        res = timed(shapes, messages(args.batch), args.iterations, args.repeat)
        unit, fmt = "us/record (CPU, min)", "{:10.3f}"
    print(f"{'shape':11s} {'hand-written':>12s} {'kafkatx':>10s} {'overhead':>10s} {'ratio':>6s}   {unit}")
    for shape, row in res.items():
        raw, ktx = row["raw"], row["kafkatx"]
        print(
            f"{shape:11s} {fmt.format(raw):>12s} {fmt.format(ktx)} {fmt.format(ktx - raw)} {ktx / raw:6.2f}   {SHAPE_HELP[shape]}"
        )
    if args.json:
        args.json.write_text(json.dumps({"unit": unit, "batch": args.batch, "shapes": res}, indent=2) + "\n")


if __name__ == "__main__":
    main()
