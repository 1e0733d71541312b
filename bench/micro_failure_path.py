"""The processing thread's cost of ``retry="topics"`` per failure, without a broker (run 4t's path, in memory).

    python bench/micro_failure_path.py                  # CPU time per failure (min of --repeat timings)
    python bench/micro_failure_path.py --callgrind      # instructions per failure (stable on a busy machine)
    python bench/micro_failure_path.py --profile        # cProfile of the 4t units, by own time
    PYTHONPATH=/tmp/patched/src python bench/micro_failure_path.py    # a patched copy

Run 4t's steady state, one transaction at a time: ``--batch`` keyed input records over 8 partitions of which 1%
fail (attempt 1, each hops to the retry topic), plus the retry records a poll brings beside them: as many read
back at attempt 2 (they fail again and hop) and as many at attempt 3 (they succeed). Each unit runs through the
listener's record runner on a ``fencing="group"`` container's :class:`~kafkatx.TransactionUnit`, against a stub
confluent-kafka Producer whose calls do nothing (as ``micro_hot_path.py`` does), the retry records built from the
hops the runner produced in the transaction before (their real headers, as a run reads back its own fresh hops).
Beside it, the same input records with no failure on a default listener (run 2's path) and on a ``retry="topics"``
listener with keys in retry (what key order costs the records that do not fail). The cost per failure is (4t unit - run 2 unit) / failures per unit: what the failures and the
retry records add to the processing thread, the figure docs/BENCHMARKS.md's run 4t divides the same way.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _callgrind  # noqa: E402
from micro_hot_path import StubConsumer, StubProducer  # noqa: E402

IN, OUT, PARTITIONS = "micro-in", "micro-out", 8


class PoisonError(Exception):
    """Run 4t's transient failure."""


def handler(record: Any) -> Any:
    """Run 4t's handler: the poison-marked records fail at attempts 1 and 2 and succeed at 3."""
    value = record.value
    if value[10:16] == b"poison" and record.attempt < 3:
        raise PoisonError(f"transient failure of {value[:9].decode()} at attempt {record.attempt}")
    return value.upper()


class CapturingProducer(StubProducer):
    """The stub, keeping what goes to a retry topic (the hops), to read back as a poll would."""

    hops: list[tuple[str, Any, Any, Any, int]] = []

    def produce(self, *args: Any, **kwargs: Any) -> None:
        topic = args[0] if args else kwargs.get("topic")
        if isinstance(topic, str) and topic.startswith(IN + "-retry"):
            value = kwargs.get("value", args[1] if len(args) > 1 else None)
            key = kwargs.get("key", args[2] if len(args) > 2 else None)
            partition = kwargs.get("partition", args[3] if len(args) > 3 else -1)
            self.hops.append((topic, value, key, kwargs.get("headers"), partition))


def input_messages(n: int, poison_every: int) -> list[Any]:
    """``n`` keyed 100-byte records, record i on partition i % 8, grouped by partition like a fetch."""
    from confluent_kafka import Message
    from run import make_key, make_value

    by_partition: list[list[Any]] = [[] for _ in range(PARTITIONS)]
    for i in range(n):
        p = i % PARTITIONS
        value = make_value(i, 100, poison_every, PARTITIONS)
        by_partition[p].append(Message(topic=IN, partition=p, offset=i // PARTITIONS, key=make_key(i), value=value))
    return [m for part in by_partition for m in part]


def read_back(hops: list[tuple[str, Any, Any, Any, int]], start: int) -> list[Any]:
    """The hops as a poll of their retry partitions hands them over (offsets from ``start``)."""
    from confluent_kafka import Message

    return [
        Message(topic=t, partition=p, offset=start + i, key=k, value=v, headers=h)
        for i, (t, v, k, h, p) in enumerate(hops)
    ]


def setup(options: dict[str, Any]) -> Callable[..., None]:
    """One transaction over a list of messages, on a listener declared with ``options`` (see micro_hot_path)."""
    import kafkatx.client.producer as producer_module
    from kafkatx import App
    from kafkatx.client.producer import TransactionalProducer
    from kafkatx.listener.loop.container import ListenerContainer
    from kafkatx.listener.runners.record_runner import RecordRunner
    from kafkatx.listener.transaction.unit import TransactionUnit

    app = App("micro", bootstrap_servers="127.0.0.1:1", instance_id="micro")
    name = "micro-" + "-".join(f"{k}-{v}" for k, v in options.items())
    spec = app.add_listener(handler, IN, name=name, fencing="group", max_batch_records=100_000, output=OUT, **options)
    container = ListenerContainer(spec, app, 0, 0)
    container.consumer = StubConsumer()  # type: ignore[assignment]
    container.assigned.update((IN, p) for p in range(PARTITIONS))
    producer = TransactionalProducer(app.producer_config(spec, "micro-tx"), "micro-tx", retry_timeout=5.0)
    real_producer, producer_module.Producer = producer_module.Producer, CapturingProducer  # type: ignore[misc]
    try:
        producer.ensure()
    finally:
        producer_module.Producer = real_producer  # type: ignore[misc]
    runner = RecordRunner(container, spec.processor)

    hops = container.retry_hops

    def one_transaction(msgs: list[Any], retries: list[Any] | None = None) -> None:
        """A transaction of ``msgs`` and then ``retries`` (retry records, delivered by the retry feed first)."""
        if retries:
            if hops is not None:
                hops.delivered(retries)
            msgs = msgs + retries
        runner(TransactionUnit(container, producer, msgs))

    return one_transaction


def workloads(batch: int) -> dict[str, tuple[Callable[[list[Any]], None], list[Any], int]]:
    """name -> (one transaction, its messages, failures in it)."""
    clean = input_messages(batch, 0)
    failing = input_messages(batch, 100)
    topics = setup({"retry": "topics"})
    CapturingProducer.hops.clear()
    topics(failing)  # attempt 1: each poison record hops (attempt 2 due)
    second = read_back(CapturingProducer.hops, 0)
    CapturingProducer.hops.clear()
    topics([], second)  # attempt 2 fails again: hops (attempt 3 due)
    third = read_back(CapturingProducer.hops, len(second))
    CapturingProducer.hops.clear()
    poisoned = len(second)
    retries = second + third

    def steady(msgs: list[Any]) -> None:
        """A transaction of ``msgs`` and the retry records read back from the hops the one before it wrote (as a
        run's are: its own fresh hops, which the container remembers, not the same records again)."""
        nonlocal retries
        topics(msgs, retries)
        hops = CapturingProducer.hops
        retries = read_back(hops[:poisoned], 0) + read_back(hops[poisoned:], poisoned)
        hops.clear()

    return {
        "2: no failure, retry='rollback'": (setup({}), clean, 0),
        "no failure, retry='topics', keys in retry": (topics, clean, 0),
        "4t: 1% fail (attempts 1, 2) + retries": (steady, failing, 2 * poisoned),
    }


def timed(batch: int, iterations: int, repeat: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, (fn, msgs, failures) in workloads(batch).items():
        fn(msgs)  # warm-up
        best = []
        for _ in range(repeat):
            t = time.thread_time()
            for _ in range(iterations):
                fn(msgs)
            best.append((time.thread_time() - t) / iterations * 1e6)
        out[name] = {"us_per_unit": min(best), "failures": failures}
    return out


def profiled(batch: int, iterations: int) -> None:
    fn, msgs, _ = workloads(batch)["4t: 1% fail (attempts 1, 2) + retries"]
    fn(msgs)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(iterations):
        fn(msgs)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(40)


def inner_callgrind(batch: int, iterations: int) -> None:
    """Under callgrind (bench/_callgrind.py): each workload, ``iterations`` transactions."""
    regions = []
    for name, (fn, msgs, failures) in workloads(batch).items():
        fn(msgs)
        fn(msgs)

        def region(fn: Callable[[list[Any]], None] = fn, msgs: list[Any] = msgs) -> None:
            for _ in range(iterations):
                fn(msgs)

        regions.append(([name, failures], region))
    _callgrind.run_regions(regions)


def run_callgrind(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    inner = ["--batch", str(args.batch), "--iterations", str(args.cg_iterations)]
    return {
        name: {"per_unit": total / args.cg_iterations, "failures": failures}
        for (name, failures), total in _callgrind.measure(__file__, inner)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=5000, help="input records per transaction (1%% of them fail)")
    ap.add_argument("--iterations", type=int, default=20, help="transactions per timing")
    ap.add_argument("--repeat", type=int, default=7, help="timings; the minimum is reported")
    ap.add_argument("--callgrind", action="store_true", help="count instructions instead (needs valgrind)")
    ap.add_argument("--cg-iterations", type=int, default=3, help="transactions per workload under callgrind")
    ap.add_argument("--profile", action="store_true", help="cProfile the 4t transactions instead")
    ap.add_argument("--inner-callgrind", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner_callgrind:
        inner_callgrind(args.batch, args.iterations)
        return
    if args.profile:
        profiled(args.batch, args.iterations)
        return

    import kafkatx

    print(f"# kafkatx from {Path(kafkatx.__file__).parent}; {args.batch} input records per transaction, stub producer")
    if args.callgrind:
        res = run_callgrind(args)
        key, unit, scale = "per_unit", "instructions", 1.0
    else:
        res = timed(args.batch, args.iterations, args.repeat)
        key, unit, scale = "us_per_unit", "us CPU", 1.0
    base = next(iter(res.values()))[key]
    for name, row in res.items():
        extra = row[key] - base
        per_failure = f"{extra / row['failures'] * scale:12,.1f} {unit}/failure" if row["failures"] else ""
        print(f"{name:45s} {row[key]:14,.0f} {unit}/txn  {extra / args.batch:10,.2f} extra/input record  {per_failure}")


if __name__ == "__main__":
    main()
