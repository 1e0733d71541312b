"""Where does kafkatx spend its time per record? cProfile + CPU time of the processing thread.

    python bench/profile_hot_path.py                 # 100k records, 8 partitions
    python bench/profile_hot_path.py --rounds 5      # CPU-per-record comparison only, 5 rounds each
    python bench/profile_hot_path.py --shape keyed   # another return shape (see bench/workload.py SHAPES)
    PYTHONPATH=/tmp/patched/src python bench/profile_hot_path.py   # measure a patched copy

Two measurements on one broker and one preloaded input:

1. CPU time of the processing thread per record (``time.thread_time``), for
   the hand-written loop and for kafkatx, alternating, ``--rounds`` times
   each. Thread CPU time does not count waiting on the broker nor time
   stolen by other processes, so it shows per-record overhead even on a
   busy machine.
2. One kafkatx run under cProfile (profiling only the container thread),
   printing the functions by own time and the callees of ``RecordRunner._handle``
   (the per-record loop; see docs/ARCHITECTURE.md).

Every kafkatx run uses ``fencing="group"`` (one transaction per poll, as the
hand-written loop): ``fencing="auto"`` picks per-partition producers on the
embedded broker.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import preload, wait_for_quiet_broker  # noqa: E402


def raw_round(bs: str, src: str, out: str, n: int, shape: str = "bytes") -> tuple[float, float]:
    from confluent_kafka import Consumer, Producer
    from workers import raw_batch

    g = f"prof-raw-{uuid.uuid4().hex[:6]}"
    p = Producer({"bootstrap.servers": bs, "transactional.id": g, "linger.ms": 5, "delivery.report.only.error": True})
    p.init_transactions(30)
    c = Consumer(
        {
            "bootstrap.servers": bs,
            "group.id": g,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    c.subscribe([src])
    body = raw_batch(shape)
    done, cpu0, t0 = 0, None, 0.0
    while done < n:
        msgs = c.consume(1000, 0.1)
        if not msgs:
            continue
        if cpu0 is None:
            cpu0, t0 = time.thread_time(), time.perf_counter()
        p.begin_transaction()
        body(p.produce, out, msgs, lambda partition, offset: None, 1 << 62)
        p.send_offsets_to_transaction(c.position(c.assignment()), c.consumer_group_metadata(), 30)
        p.commit_transaction(30)
        done += len(msgs)
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - t0  # type: ignore[operator]
    c.close()
    return cpu, wall


class PoisonError(RuntimeError):
    pass


def kafkatx_round(
    bs: str,
    src: str,
    out: str,
    n: int,
    profiler: cProfile.Profile | None = None,
    scenario: str = "batch",
    dlt: str | None = None,
    shape: str = "bytes",
    tracing: float | None = None,
) -> tuple[float, float]:
    from workers import Tracker, kafkatx_handler, tracer_provider

    from kafkatx import App
    from kafkatx.events import TransactionCommitted
    from kafkatx.listener.loop.container import ListenerContainer

    g = f"prof-ktx-{uuid.uuid4().hex[:6]}"
    provider = tracer_provider(tracing) if tracing is not None else None
    app = App(g, bootstrap_servers=bs, instance_id="prof", tracing=provider or False)
    state: dict[str, Any] = {"cpu0": None, "t0": 0.0, "cpu1": 0.0, "t1": 0.0, "done": 0}
    finished = threading.Event()
    options: dict[str, Any] = {"fencing": "group", "max_batch_records": 1000}
    if scenario == "record":
        options["max_batch_records"] = 1
    elif scenario != "batch":
        retry = {"inplace": "in_place", "topics": "topics"}.get(scenario, "rollback")
        options.update(max_attempts=3, dlq=dlt, retry=retry)
    total = n + 2 * (n // 100) if scenario == "topics" else n  # each poison record read back twice

    if scenario == "topics":  # run 4t's handler: poison fails at attempts 1 and 2, succeeds at 3

        @app.listener(src, output=out, **options)
        def transient(record: Any) -> bytes:
            if state["cpu0"] is None:
                state["cpu0"], state["t0"] = time.thread_time(), time.perf_counter()
            value = record.value
            if value[10:16] == b"poison" and record.attempt < 3:
                raise PoisonError(value[:9].decode())
            return value.upper()  # type: ignore[no-any-return]

    elif scenario in ("rollback", "inplace"):

        @app.listener(src, output=out, **options)
        def upper(record: Any) -> bytes:
            if state["cpu0"] is None:
                state["cpu0"], state["t0"] = time.thread_time(), time.perf_counter()
            value = record.value
            if value[10:16] == b"poison":
                raise PoisonError(value[:9].decode())
            return value.upper()  # type: ignore[no-any-return]

    else:
        tracker = Tracker({"sample_every": 1 << 62})

        def start() -> None:  # the shape's handler calls it on its first record
            tracker.t_first = time.perf_counter()
            state.update(cpu0=time.thread_time(), t0=tracker.t_first)

        tracker.start = start  # type: ignore[method-assign]
        handler, shape_options = kafkatx_handler(shape, tracker, out)
        app.add_listener(handler, src, **options, **shape_options)

    @app.on(TransactionCommitted)
    def committed(ev: Any) -> None:
        state["done"] += ev.records
        if state["done"] >= total:
            state["cpu1"], state["t1"] = time.thread_time(), time.perf_counter()
            finished.set()

    original = ListenerContainer._poll_and_process
    if profiler is not None:

        def profiled(self: Any) -> None:
            profiler.enable()
            try:
                original(self)
            finally:
                profiler.disable()

        ListenerContainer._poll_and_process = profiled  # type: ignore[method-assign]
    try:
        app.start()
        if not finished.wait(300):
            raise SystemExit("kafkatx round timed out")
        app.stop()
        if provider is not None:
            provider.shutdown()
    finally:
        ListenerContainer._poll_and_process = original  # type: ignore[method-assign]
    return state["cpu1"] - state["cpu0"], state["t1"] - state["t0"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="CPU-per-record rounds of each runner")
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile run")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--thread-time", action="store_true", help="profile the container thread's CPU time (not wall time)"
    )
    ap.add_argument(
        "--shape", default="bytes", help="what the handler returns (bench/workload.py SHAPES; batch scenario)"
    )
    ap.add_argument(
        "--scenario",
        choices=["batch", "record", "rollback", "inplace", "topics"],
        default="batch",
        help="what to profile: clean batches, one transaction per record, 1%% poison on the rollback "
        "path, 1%% poison with retry='in_place', or run 4t's 1%% transient failures with retry='topics'",
    )
    ap.add_argument(
        "--tracing",
        type=float,
        default=None,
        help="trace this share of records (0.01: 1%%) with the SDK, spans dropped",
    )
    args = ap.parse_args()

    import kafkatx
    from kafkatx.local import LocalBroker
    from kafkatx.testing import create_topic, delete_topics

    print(f"# kafkatx from {Path(kafkatx.__file__).parent}")
    n = args.records
    with LocalBroker() as broker:
        bs = broker.bootstrap_servers
        src = create_topic(bs, "prof-in", args.partitions)
        poisoned = args.scenario in ("rollback", "inplace", "topics")
        preload(bs, src, n, args.partitions, 100, 100 if poisoned else 0)
        results: dict[str, list[tuple[float, float]]] = {"raw": [], "kafkatx": []}
        for i in range(args.rounds if args.scenario == "batch" else 0):
            for name in ("raw", "kafkatx"):
                out = create_topic(bs, f"prof-out-{name}-{i}", args.partitions)
                wait_for_quiet_broker(broker)
                if name == "raw":
                    results[name].append(raw_round(bs, src, out, n, args.shape))
                else:
                    results[name].append(kafkatx_round(bs, src, out, n, shape=args.shape, tracing=args.tracing))
                delete_topics(bs, [out])
        med = {}
        if results["raw"]:
            print(f"\nprocessing-thread CPU per record ({n:,} records, {args.rounds} rounds; median [min..max]):")
        for name, rows in results.items() if results["raw"] else ():
            us = [cpu / n * 1e6 for cpu, _ in rows]
            rates = [n / wall for _, wall in rows]
            med[name] = statistics.median(us)
            print(
                f"  {name:8s} {med[name]:6.2f} us/record [{min(us):.2f}..{max(us):.2f}]   "
                f"{statistics.median(rates):,.0f} rec/s [{min(rates):,.0f}..{max(rates):,.0f}]"
            )
        if med:
            print(f"  kafkatx overhead: {med['kafkatx'] - med['raw']:.2f} us/record of processing-thread CPU")
        if args.no_profile:
            return
        prof = cProfile.Profile(time.thread_time) if args.thread_time else cProfile.Profile()
        out = create_topic(bs, "prof-out-cprofile", args.partitions)
        dlt = create_topic(bs, "prof-dlt", args.partitions) if poisoned else None
        wait_for_quiet_broker(broker)
        cpu, wall = kafkatx_round(bs, src, out, n, prof, args.scenario, dlt, args.shape, args.tracing)
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime")
        print(
            f"\ncProfile of the container thread, scenario {args.scenario}, {n:,} records "
            f"({wall:.1f}s, thread CPU {cpu:.1f}s under the profiler), by own time:"
        )
        stats.print_stats(args.top)
        stats.sort_stats("cumulative")
        stats.print_callees("_handle")


if __name__ == "__main__":
    main()
