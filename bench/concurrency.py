"""Handlers that wait on I/O: ``in_flight=100`` against ``in_flight=1`` (issue 30, docs/CONCURRENCY.md).

    python bench/concurrency.py                         # 10,000 records, 4 partitions, 1,000 keys, 20 ms waits
    python bench/concurrency.py --records 4000 --baseline-records 300

The handler waits ``--wait-ms`` per record (``asyncio.sleep`` in the async
handler, ``time.sleep`` in the plain one on the thread pool) and returns the
record's ``(key, value)``. Each run is an App in this process on the embedded
broker, in a fresh consumer group, timed from the first handler call to the
commit that made the last output visible; its outputs are read back
``read_committed`` and must hold every record exactly once, each key's in
input order. ``in_flight=1`` handles one record at a time whatever the
handler, so it is measured over ``--baseline-records`` records (its rate does
not depend on how many): at 20 ms a record, 10,000 would take over 3 minutes.
The one-key runs check that ordering holds: all records of one key wait for
each other, so ``in_flight=100`` gains nothing there.

``--transient PCT`` adds, per kind, the ``in_flight`` run with ``retry="topics"``
twice: on clean data, and with PCT% of the records failing at attempts 1-2
(the default back-off of 1 s, so each waits in the retry topics twice while
its partition goes on; its key's later records follow it). Each gives its
main flow (from the first handler call to the commit of every input
offset) and the time until the last retried record's output is visible.

    python bench/concurrency.py --kinds async --transient 1 --records 10000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kafkatx import App, Record  # noqa: E402
from kafkatx.events import TransactionCommitted  # noqa: E402
from kafkatx.local import LocalBroker  # noqa: E402
from kafkatx.testing import KafkaTestKit  # noqa: E402

PARTITIONS = 4


def _input(kit: KafkaTestKit, records: int, keys: int) -> str:
    """``records`` over ``keys`` keys; a value is ``<key>:<seq within key>``, so order per key can be checked."""
    src = kit.topic(partitions=PARTITIONS)
    seq: Counter[int] = Counter()
    batch = []
    for i in range(records):
        key = i % keys
        batch.append((b"k%d" % key, b"k%d:%d" % (key, seq[key])))
        seq[key] += 1
    kit.produce(src, batch)
    return src


def run_once(
    kit: KafkaTestKit,
    kind: str,
    in_flight: int,
    records: int,
    keys: int,
    wait: float,
    fencing: str = "auto",
    transient: float | None = None,
) -> float:
    """One App over a fresh input; returns records/s from the first handler call to the last commit. With
    ``transient`` (a percentage; 0: clean data), ``retry="topics"`` and that share of the records failing at
    attempts 1-2: returns the main flow's records/s (every input offset committed) and prints the rest."""
    src, out = _input(kit, records, keys), kit.topic(partitions=PARTITIONS)
    values = [b"k%d:%d" % (i % keys, i // keys) for i in range(records)]
    failing = {v for v in values if transient and zlib.crc32(v) % 10_000 < transient * 100}  # spread over the keys
    app = App(
        f"conc-{uuid.uuid4().hex[:8]}",
        bootstrap_servers=kit.bootstrap_servers,
        instance_id="bench",
        create_topics=transient is not None,  # the retry topics and the dead-letter topic
    )
    first: list[float] = []
    last_commit = [0.0]
    app.on(TransactionCommitted)(lambda e: last_commit.__setitem__(0, time.perf_counter()))
    options: dict[str, Any] = {"output": out, "in_flight": in_flight, "fencing": fencing}
    if transient is not None:
        options.update(retry="topics", dlq=True)
    if kind == "async":

        async def enrich(record: Record) -> tuple[bytes | None, bytes | None]:
            if not first:
                first.append(time.perf_counter())
            await asyncio.sleep(wait)
            if failing and record.attempt < 3 and record.value in failing:
                raise TimeoutError("a dependency timed out")
            return record.key, record.value

        app.add_listener(enrich, src, **options)
    else:

        def enrich_sync(record: Record) -> tuple[bytes | None, bytes | None]:
            if not first:
                first.append(time.perf_counter())
            time.sleep(wait)
            if failing and record.attempt < 3 and record.value in failing:
                raise TimeoutError("a dependency timed out")
            return record.key, record.value

        app.add_listener(enrich_sync, src, **options)
    app.start()
    try:
        while not kit.caught_up(app.group_id, src):
            if app.failure is not None:
                raise app.failure
            time.sleep(0.05)
        main_flow = time.perf_counter() - first[0]
        while transient and len(kit.values(out)) < records:  # the retried records' outputs
            if app.failure is not None:
                raise app.failure
            time.sleep(0.2)
    finally:
        app.stop(timeout=60)
    elapsed = last_commit[0] - first[0]
    _check(kit.values(out), records, keys)
    if transient is None:
        return records / elapsed
    print(
        f"  {kind:5}: in_flight={in_flight} retry='topics', {transient:g}% failing at attempts 1-2: main flow "
        f"{records / main_flow:7.1f} rec/s ({main_flow:.2f} s), last output at {elapsed:.2f} s"
    )
    return records / main_flow


def _check(values: list[bytes | None], records: int, keys: int) -> None:
    counts = Counter(values)
    assert len(values) == records and max(counts.values()) == 1, "every record exactly once"
    by_key: dict[bytes, list[int]] = defaultdict(list)
    for value in values:
        assert value is not None
        key, _, n = value.partition(b":")
        by_key[key].append(int(n))
    assert len(by_key) == min(keys, records)
    for key, numbers in by_key.items():
        assert numbers == list(range(len(numbers))), f"{key!r}: outputs out of input order"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=10_000, help="records of an in_flight=100 run")
    parser.add_argument("--baseline-records", type=int, default=500, help="records of an in_flight=1 run")
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--wait-ms", type=float, default=20.0)
    parser.add_argument("--in-flight", type=int, default=100)
    parser.add_argument("--kinds", default="async,sync")
    parser.add_argument("--transient", type=float, default=None, help="also retry='topics' with PCT%% failing")
    parser.add_argument(
        "--fencing", default="auto", help='"group": one transaction per poll (the embedded broker picks "partition")'
    )
    args = parser.parse_args()
    wait = args.wait_ms / 1000
    tmp = Path(tempfile.mkdtemp(prefix="kafkatx-concurrency-"))
    broker = LocalBroker(data_dir=tmp / "kafka").start()
    print(
        f"{args.wait_ms:g} ms per record, {PARTITIONS} partitions, fencing={args.fencing}, {os.cpu_count()} cores, "
        f"{threading.active_count()} threads at start; rec/s from the first handler call to the last commit"
    )
    try:
        kit = KafkaTestKit(broker.bootstrap_servers)
        for kind in args.kinds.split(","):
            one = run_once(kit, kind, 1, args.baseline_records, args.keys, wait, args.fencing)
            many = run_once(kit, kind, args.in_flight, args.records, args.keys, wait, args.fencing)
            one_key = run_once(kit, kind, args.in_flight, args.baseline_records, 1, wait, args.fencing)
            print(f"  {kind:5}: in_flight=1 {one:7.1f} rec/s ({args.baseline_records} records, {args.keys} keys)")
            print(
                f"  {kind:5}: in_flight={args.in_flight} {many:7.1f} rec/s ({args.records} records, {args.keys} keys)"
                f"  = {many / one:.1f}x"
            )
            print(
                f"  {kind:5}: in_flight={args.in_flight}, one key {one_key:7.1f} rec/s "
                f"({args.baseline_records} records) = {one_key / one:.2f}x, input order kept"
            )
            if args.transient is not None:
                clean = run_once(kit, kind, args.in_flight, args.records, args.keys, wait, args.fencing, 0.0)
                flaky = run_once(kit, kind, args.in_flight, args.records, args.keys, wait, args.fencing, args.transient)
                print(f"  {kind:5}: retry='topics' main flow with failures / on clean data = {flaky / clean:.2f}x")
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
