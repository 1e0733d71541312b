"""Where each transaction's wall time goes: the hand-written loop (run 1) beside kafkatx (run 2b).

    python bench/phases.py                 # 100,000 records, 6 alternating pairs, bytes shape
    python bench/phases.py --records 200000 --pairs 4

Starts the embedded broker, preloads the input once, then runs the
hand-written EOS loop and kafkatx (``max_batch_records=1000``,
``fencing="group"``) alternately, each in its own process. Each process
times every call it makes into confluent-kafka's Consumer and Producer that
is not per record (consume, begin/commit, send_offsets, assignment,
position...) through a subclass, and reports, per call, how often it ran in
the processing window, its median and its total. The per-record loop's own
time is what remains.

It answers what ``bench/run.py`` cannot: why the hand-written loop's rate
moves by a third between repetitions while its CPU per record does not.
Calls that librdkafka serves on its main thread (``consumer.assignment()``,
``begin_transaction()``) usually take ~0.03 ms, and in some processes ~1 ms
each (the thread waits to be scheduled on a busy 2-core machine); the loop
makes one of each per transaction. kafkatx sends the offsets it tracked
itself and does not call ``assignment()``. See docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
perf = time.perf_counter
Calls = dict[str, list[tuple[float, float]]]  # call name -> (started at, seconds)

PRODUCER_CALLS = (
    "begin_transaction",
    "send_offsets_to_transaction",
    "commit_transaction",
    "abort_transaction",
    "flush",
)
CONSUMER_CALLS = ("consume", "poll", "position", "assignment", "consumer_group_metadata", "seek", "pause", "resume")


def timed_clients(calls: Calls) -> tuple[type, type]:
    """confluent-kafka's Producer and Consumer, timing the calls above (``produce`` itself is not wrapped)."""
    from confluent_kafka import Consumer, Producer

    def timed(name: str, method: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            started = perf()
            try:
                return method(self, *args, **kwargs)
            finally:
                calls[name].append((started, perf() - started))

        return call

    producer = type("TimedProducer", (Producer,), {n: timed(n, getattr(Producer, n)) for n in PRODUCER_CALLS})
    consumer = type("TimedConsumer", (Consumer,), {n: timed(n, getattr(Consumer, n)) for n in CONSUMER_CALLS})
    return producer, consumer


def report(calls: Calls, n: int, first: float, last: float) -> dict[str, Any]:
    window = last - first
    out: dict[str, Any] = {"records_per_s": n / window, "window_s": window, "calls": {}}
    for name, timings in sorted(calls.items()):
        inside = [s for (t, s) in timings if first - 0.001 <= t <= last]
        if inside:
            out["calls"][name] = {
                "n": len(inside),
                "median_ms": statistics.median(inside) * 1e3,
                "total_s": sum(inside),
            }
    return out


def hand_written(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run 1's loop (bench/workers.py run_raw, bytes shape), without latency sampling."""
    calls: Calls = defaultdict(list)
    producer_cls, consumer_cls = timed_clients(calls)
    producer = producer_cls(
        {
            "bootstrap.servers": cfg["bootstrap"],
            "transactional.id": cfg["group"] + "-txn",
            "linger.ms": 5,
            "delivery.report.only.error": True,
        }
    )
    producer.init_transactions(30)
    consumer = consumer_cls(
        {
            "bootstrap.servers": cfg["bootstrap"],
            "group.id": cfg["group"],
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            **cfg["client_config"],
        }
    )
    consumer.subscribe([cfg["input"]])
    produce, out, n = producer.produce, cfg["output"], cfg["records"]
    done, first = 0, 0.0
    while done < n:
        msgs = consumer.consume(1000, 0.1)
        if not msgs:
            continue
        if not first:
            first = perf()
        producer.begin_transaction()
        for m in msgs:
            produce(out, m.value().upper())
        producer.send_offsets_to_transaction(
            consumer.position(consumer.assignment()), consumer.consumer_group_metadata(), 30
        )
        producer.commit_transaction(30)
        done += len(msgs)
    last = perf()
    consumer.close()
    return report(calls, n, first, last)


def with_kafkatx(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run 2b (bench/workers.py run_kafkatx, bytes shape), without latency sampling."""
    calls: Calls = defaultdict(list)
    producer_cls, consumer_cls = timed_clients(calls)
    import kafkatx.listener.loop.container
    import kafkatx.producer

    kafkatx.producer.Producer = producer_cls  # type: ignore[attr-defined,misc]
    kafkatx.listener.loop.container.Consumer = consumer_cls  # type: ignore[attr-defined,misc]
    from kafkatx import App
    from kafkatx.events import TransactionCommitted

    n = cfg["records"]
    times = {"first": 0.0, "last": 0.0}
    committed = [0]
    finished = threading.Event()
    app = App(
        cfg["group"], bootstrap_servers=cfg["bootstrap"], instance_id="bench", consumer_config=cfg["client_config"]
    )

    def handler(record: Any) -> Any:
        if not times["first"]:
            times["first"] = perf()
        return record.value.upper()

    app.add_listener(handler, cfg["input"], name="bench", output=cfg["output"], fencing="group", max_batch_records=1000)

    @app.on(TransactionCommitted)
    def _committed(event: Any) -> None:
        committed[0] += event.records
        if committed[0] >= n:
            times["last"] = perf()
            finished.set()

    app.start()
    try:
        if not finished.wait(cfg["timeout"]):
            raise SystemExit(f"timed out with {committed[0]}/{n} records committed")
    finally:
        app.stop(timeout=30)
    return report(calls, n, times["first"], times["last"])


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] in ("hand-written", "kafkatx"):  # one run, in its own process
        cfg = json.loads(sys.argv[2])
        result = (hand_written if sys.argv[1] == "hand-written" else with_kafkatx)(cfg)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--pairs", type=int, default=6, help="alternating (hand-written, kafkatx) pairs")
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args()
    sys.path.insert(0, str(HERE.parent / "src"))
    sys.path.insert(0, str(HERE))
    from run import byte_compile, preload  # same input as bench/run.py

    from kafkatx.local import LocalBroker
    from kafkatx.testing import create_topic

    byte_compile([HERE.parent / "src"])
    rows = []
    with LocalBroker() as broker:
        bs = broker.bootstrap_servers
        topic = create_topic(bs, "phases-in", args.partitions)
        preload(bs, topic, args.records, args.partitions, 100, 0)
        for pair in range(args.pairs):
            for kind in ("hand-written", "kafkatx"):
                cfg = {
                    "bootstrap": bs,
                    "input": topic,
                    "output": create_topic(bs, f"phases-out-{pair}-{kind}", args.partitions),
                    "group": f"phases-{pair}-{kind}-{uuid.uuid4().hex[:6]}",
                    "records": args.records,
                    "timeout": args.timeout,
                    "client_config": dict(LocalBroker.client_config),
                }
                proc = subprocess.run(
                    [sys.executable, __file__, kind, json.dumps(cfg)],
                    capture_output=True,
                    text=True,
                    check=False,
                    timeout=args.timeout + 60,
                )
                lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                if not lines:
                    print(f"{kind} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                    return 1
                result = json.loads(lines[-1][len("RESULT ") :])
                rows.append((pair, kind, result))
                calls = result["calls"]
                shown = "  ".join(
                    f"{name} {c['median_ms']:.3f} ms x{c['n']} = {c['total_s'] * 1e3:.0f} ms"
                    for name, c in calls.items()
                    if name != "poll"
                )
                print(
                    f"pair {pair + 1} {kind:>12}: {result['records_per_s'] / 1e3:5.0f}k rec/s in {result['window_s']:.3f} s; {shown}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
