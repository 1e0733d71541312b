"""Per-record Python cost of kafkatx's transaction loop, without the broker's noise.

    python bench/micro_hot_path.py
    PYTHONPATH=/tmp/patched/src python bench/micro_hot_path.py    # a patched copy

Consumes ``--batch`` real records once (confluent-kafka Message objects),
then runs ``ListenerContainer._transact`` on them many times against a stub
confluent-kafka Producer whose calls do nothing, and the hand-written loop's
body against the same stub. The difference is kafkatx's own per-record
overhead in the processing thread: what the broker-facing benchmark
(bench/run.py) sees as lower records/s once the client is CPU-bound.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


class StubProducer:
    """Stands in for confluent_kafka.Producer: every call returns at once."""

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


def fetch(bs: str, topic: str, n: int) -> list[Any]:
    from confluent_kafka import Consumer

    c = Consumer({"bootstrap.servers": bs, "group.id": f"micro-{uuid.uuid4().hex[:6]}", "auto.offset.reset": "earliest",
                  "enable.auto.commit": False, "isolation.level": "read_committed"})  # fmt: skip
    c.subscribe([topic])
    msgs: list[Any] = []
    deadline = time.monotonic() + 30
    while len(msgs) < n and time.monotonic() < deadline:
        msgs.extend(m for m in c.consume(n - len(msgs), 0.5) if m.error() is None)
    c.close()
    return msgs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--iterations", type=int, default=200, help="batches per timing")
    ap.add_argument("--repeat", type=int, default=7, help="timings; the minimum is reported")
    args = ap.parse_args()

    import kafkatx
    from kafkatx import App
    from kafkatx.listener.container import ListenerContainer
    from kafkatx.producer import TransactionalProducer
    from kafkatx.local import LocalBroker
    from kafkatx.testing import create_topic
    from run import preload

    print(f"# kafkatx from {Path(kafkatx.__file__).parent}")
    with LocalBroker() as broker:
        bs = broker.bootstrap_servers
        create_topic(bs, "micro-in", 8)
        create_topic(bs, "micro-out", 8)
        preload(bs, "micro-in", args.batch, 8, 100, 0)
        msgs = fetch(bs, "micro-in", args.batch)
        assert len(msgs) == args.batch, len(msgs)

        app = App("micro", bootstrap_servers=bs, instance_id="micro")

        def upper(record: Any) -> bytes:
            return record.value.upper()  # type: ignore[no-any-return]

        spec = app.add_listener(upper, "micro-in", output="micro-out")
        container = ListenerContainer(spec, app, 0, 0)
        container._consumer = StubConsumer()  # type: ignore[assignment]
        producer = TransactionalProducer(app.producer_config(spec, "micro-tx"), "micro-tx", retry_timeout=5.0)
        producer._producer = StubProducer()  # type: ignore[assignment]
        producer._known_topics["micro-out"] = 8
        container._group_producer = producer

        stub, consumer = StubProducer(), StubConsumer()

        def raw_batch(msgs: list[Any]) -> None:
            stub.begin_transaction()
            produce = stub.produce
            for m in msgs:
                produce("micro-out", m.value().upper())
            stub.send_offsets_to_transaction(consumer.position(consumer.assignment()), consumer.consumer_group_metadata(), 30)
            stub.commit_transaction(30)

        def timing(fn: Any) -> float:
            best = []
            for _ in range(args.repeat):
                t = time.thread_time()
                for _ in range(args.iterations):
                    fn(msgs)
                best.append((time.thread_time() - t) / (args.iterations * len(msgs)) * 1e6)
            return min(best)

        raw = timing(raw_batch)
        ktx = timing(lambda m: container._transact(m, producer))
        print(f"hand-written loop body:  {raw:.3f} us/record")
        print(f"kafkatx _transact:       {ktx:.3f} us/record")
        print(f"kafkatx overhead:        {ktx - raw:.3f} us/record ({args.batch}-record batches, stub producer, min of {args.repeat})")


if __name__ == "__main__":
    main()
