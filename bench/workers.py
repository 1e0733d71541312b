"""One benchmark run, in its own process: ``python bench/workers.py '<json config>'``.

``bench/run.py`` starts this script once per run, so each run's peak RSS is
its own, and reads the last stdout line (``RESULT {...}``). Runs:

- ``raw``      hand-written confluent-kafka EOS loop, consume(batch) per transaction (runs 1*, 3b)
- ``kafkatx``  kafkatx App + @app.listener, options from the config (runs 2*, 3, 4, 4b); with
  ``listener: "batch"``, @app.batch_listener (runs 2v, 2vn, 4v)

``shape`` says what each record becomes (see workload.SHAPES): the kafkatx handler
returns it in that shape, and the hand-written loop produces the same
records with confluent-kafka's ``produce`` directly (its twin).

Nothing here imports kafkatx unless the run uses it, so the baseline's RSS
is the client's alone. The quixstreams run (5) lives in ``quix_worker.py``
because it needs its own virtualenv.

Timing and latency (identical in every runner, see docs/BENCHMARKS.md):

- ``t0``: just before the clients are created (so ``t0 -> t_last`` includes
  producer init, group join and the first fetch: "wall").
- ``spawned_at`` (``BENCH_SPAWNED_AT``, set by bench/run.py just before it
  starts this process): ``spawned_at -> t_last`` also includes the
  interpreter's start and the imports: what a user waits for.
- ``t_first``: the first record is handed to the transform.
- ``t_last``: the commit_transaction that made the last output visible returned.
- Latency, sampled on every record whose offset is a multiple of
  ``sample_every``: from the first time the record is handed to the
  transform to the return of the commit_transaction that made its output
  (or dead-letter record) visible to read_committed consumers.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from workload import HEADERS, dumps_json, is_poison  # bench/ is sys.path[0]

perf = time.perf_counter
#: BENCH_CONSUMER_CONFIG (JSON): extra consumer properties for every runner, for experiments.
EXTRA_CONSUMER_CONFIG: dict[str, Any] = json.loads(os.environ.get("BENCH_CONSUMER_CONFIG") or "{}")


class Tracker:
    """Sampled handling-to-commit latency, transactions, handler calls."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.every = int(cfg["sample_every"])
        self.first: dict[tuple[int, int], float] = {}
        self.pending: list[tuple[int, int]] = []
        self.lat: list[float] = []
        self.committed_txns = 0
        self.aborted_txns = 0
        self.committed_records = 0
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.cpu_first = 0.0  # CPU time of the processing thread (contention-proof cost)
        self.cpu_last = 0.0
        self.proc_first = 0.0  # CPU time of the whole process (every thread, librdkafka's too)
        self.proc_last = 0.0
        self.threads_first: dict[str, float] = {}
        self.threads_last: dict[str, float] = {}
        self.records = int(cfg.get("records", 0))  # when reached, committed() takes the per-thread CPU

    def start(self) -> None:
        """Called on the processing thread when the first record is handed to the transform."""
        self.threads_first = thread_cpu()  # first: reading /proc is not the run's own CPU
        self.cpu_first = time.thread_time()
        self.proc_first = time.process_time()
        self.t_first = perf()

    def seen(self, partition: int, offset: int) -> None:
        key = (partition, offset)
        if key not in self.first:
            self.first[key] = perf()
        self.pending.append(key)

    def committed(self, records: int) -> None:
        now = perf()
        self.committed_txns += 1
        self.committed_records += records
        first = self.first
        for key in self.pending:
            t = first.pop(key, None)
            if t is not None:
                self.lat.append(now - t)
        self.pending.clear()
        self.t_last = now
        self.cpu_last = time.thread_time()
        self.proc_last = time.process_time()
        if self.records and self.committed_records >= self.records and not self.threads_last:
            self.threads_last = thread_cpu()

    def aborted(self) -> None:
        self.aborted_txns += 1
        self.pending.clear()  # those records are handled again; their first time is kept

    def result(self, t0: float, records: int) -> dict[str, Any]:
        lat = sorted(self.lat)

        def pct(q: float) -> float | None:
            if not lat:
                return None
            return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000.0

        assert self.t_first is not None and self.t_last is not None
        to_wall = time.time() - perf()  # the processing window in wall-clock time, for bench/run.py
        spawned = os.environ.get("BENCH_SPAWNED_AT")
        return {
            "window": [self.t_first + to_wall, self.t_last + to_wall],
            "process_wall_s": self.t_last + to_wall - float(spawned) if spawned else None,
            "records": records,
            "wall_s": self.t_last - t0,
            "startup_s": self.t_first - t0,
            "processing_s": self.t_last - self.t_first,
            "txns_committed": self.committed_txns,
            "txns_aborted": self.aborted_txns,
            "committed_records": self.committed_records,
            "latency_samples": len(lat),
            "latency_p50_ms": pct(0.50),
            "latency_p99_ms": pct(0.99),
            "latency_max_ms": lat[-1] * 1000.0 if lat else None,
            "thread_cpu_s": self.cpu_last - self.cpu_first,
            "process_cpu_s": self.proc_last - self.proc_first,
            # per thread (name/tid), from the first record to the last commit; 10 ms resolution
            "threads_cpu_s": {k: round(v - self.threads_first.get(k, 0.0), 3) for k, v in self.threads_last.items()},
        }


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each of this process's threads, by thread name (librdkafka names its own ``rdk:...``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = f"{stat[stat.index('(') + 1 : stat.rindex(')')]}/{task.name}"
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def peak_rss_mib() -> float | None:
    """This process's peak RSS (VmHWM), in MiB.

    Not getrusage()'s ru_maxrss: Linux carries the pre-exec high-water mark of
    the forked parent into the child's ru_maxrss, so a child of a big parent
    would report the parent's size."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def _consumer_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "bootstrap.servers": cfg["bootstrap"],
        "group.id": cfg["group"],
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        # noida-db sometimes ignores fetch.max.bytes; every runner gets the same raised limit
        # (quix_worker.py repeats it), so --records can go past 100 MB of input.
        **cfg["client_config"],
        **EXTRA_CONSUMER_CONFIG,
    }


def _producer_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "bootstrap.servers": cfg["bootstrap"],
        "transactional.id": cfg["group"] + "-txn",
        "linger.ms": 5,  # kafkatx's default, and librdkafka's
        "delivery.report.only.error": True,
    }


def raw_batch(shape: str) -> Any:
    """The hand-written loop's body for ``shape``: (produce, out, msgs, seen, every) -> None.

    Written out per shape, as someone would write the loop by hand: no
    dispatch per record."""

    def check(m: Any) -> None:
        raise SystemExit(f"consumer error: {m.error()}")

    if shape == "bytes":

        def body(produce: Any, out: str, msgs: list[Any], seen: Any, every: int) -> None:
            for m in msgs:
                if m.error() is not None:
                    check(m)
                o = m.offset()
                if o % every == 0:
                    seen(m.partition(), o)
                produce(out, m.value().upper())

    elif shape in ("keyed", "send"):

        def body(produce: Any, out: str, msgs: list[Any], seen: Any, every: int) -> None:
            for m in msgs:
                if m.error() is not None:
                    check(m)
                o = m.offset()
                if o % every == 0:
                    seen(m.partition(), o)
                produce(out, m.value().upper(), m.key())

    elif shape == "output":

        def body(produce: Any, out: str, msgs: list[Any], seen: Any, every: int) -> None:
            for m in msgs:
                if m.error() is not None:
                    check(m)
                o = m.offset()
                if o % every == 0:
                    seen(m.partition(), o)
                produce(out, m.value().upper(), m.key(), headers=HEADERS)

    elif shape == "generator":

        def body(produce: Any, out: str, msgs: list[Any], seen: Any, every: int) -> None:
            for m in msgs:
                if m.error() is not None:
                    check(m)
                o = m.offset()
                if o % every == 0:
                    seen(m.partition(), o)
                key, value = m.key(), m.value()
                produce(out, value.upper(), key)
                produce(out, value, key)

    elif shape == "serializer":

        def body(produce: Any, out: str, msgs: list[Any], seen: Any, every: int) -> None:
            for m in msgs:
                if m.error() is not None:
                    check(m)
                o = m.offset()
                if o % every == 0:
                    seen(m.partition(), o)
                produce(out, dumps_json({"v": m.value().decode().upper(), "o": o}))

    else:
        raise SystemExit(f"unknown shape {shape!r}")
    return body


def kafkatx_handler(shape: str, tr: Tracker, out: str) -> tuple[Any, dict[str, Any]]:
    """(handler, listener options) for ``shape``, sampling latency like the loop does."""
    from kafkatx import Output, send

    seen, every = tr.seen, tr.every
    if shape == "bytes":

        def handler(record: Any) -> Any:
            if tr.t_first is None:
                tr.start()
            o = record.offset
            if o % every == 0:
                seen(record.partition, o)
            return record.value.upper()

        return handler, {"output": out}
    if shape == "keyed":

        def handler(record: Any) -> Any:
            if tr.t_first is None:
                tr.start()
            o = record.offset
            if o % every == 0:
                seen(record.partition, o)
            return record.key, record.value.upper()

        return handler, {"output": out}
    if shape == "output":

        def handler(record: Any) -> Any:
            if tr.t_first is None:
                tr.start()
            o = record.offset
            if o % every == 0:
                seen(record.partition, o)
            return Output(record.value.upper(), key=record.key, headers=HEADERS)

        return handler, {"output": out}
    if shape == "generator":

        def handler(record: Any) -> Any:
            if tr.t_first is None:
                tr.start()
            o = record.offset
            if o % every == 0:
                seen(record.partition, o)
            key, value = record.key, record.value
            yield key, value.upper()
            yield key, value

        return handler, {"output": out}
    if shape == "send":

        def handler(record: Any) -> Any:
            if tr.t_first is None:
                tr.start()
            o = record.offset
            if o % every == 0:
                seen(record.partition, o)
            send(out, record.value.upper(), record.key)

        return handler, {"sends_to": [out]}
    if shape == "serializer":

        def handler(record: Any) -> Any:
            if tr.t_first is None:
                tr.start()
            o = record.offset
            if o % every == 0:
                seen(record.partition, o)
            return {"v": record.value.decode().upper(), "o": o}

        return handler, {"output": out, "serializer": dumps_json}
    if shape == "numpy":
        import numpy  # noqa: F401 - imported before the first record, as the batch run does

        def handler(record: Any) -> Any:
            if tr.t_first is None:
                tr.start()
            o = record.offset
            if o % every == 0:
                seen(record.partition, o)
            return numpy_upper(record.value)

        return handler, {"output": out}
    raise SystemExit(f"unknown shape {shape!r}")


def numpy_upper(value: bytes) -> bytes:
    """``value.upper()`` with numpy (ASCII a-z less 32), as a vectorized transform would write it for one record."""
    import numpy as np

    a = np.frombuffer(value, np.uint8)
    return (a ^ (((a - 97) < 26).astype(np.uint8) << 5)).tobytes()  # type: ignore[no-any-return]


def batch_handler(shape: str, tr: Tracker, out: str) -> tuple[Any, dict[str, Any]]:
    """(batch handler, listener options) for ``shape`` (bytes or numpy): the record handler's work, per batch."""
    seen, every = tr.seen, tr.every

    def sample(records: list[Any]) -> None:
        if tr.t_first is None:
            tr.start()
        for r in records:
            o = r.offset
            if o % every == 0:
                seen(r.partition, o)

    if shape == "bytes":

        def handler(records: list[Any]) -> Any:
            sample(records)
            return [r.value.upper() for r in records]

        return handler, {"output": out}
    if shape == "numpy":
        import numpy as np

        def handler(records: list[Any]) -> Any:
            sample(records)
            values = [r.value for r in records]
            a = np.frombuffer(b"".join(values), np.uint8)
            upper = (a ^ (((a - 97) < 26).astype(np.uint8) << 5)).tobytes()  # the whole batch in one pass
            ends = np.cumsum([len(v) for v in values]).tolist()
            return [upper[e - len(v) : e] for v, e in zip(values, ends)]

        return handler, {"output": out}
    raise SystemExit(f"no batch handler for shape {shape!r}")


def run_raw(cfg: dict[str, Any]) -> dict[str, Any]:
    """The hand-written EOS loop (runs 1 and 3b)."""
    from confluent_kafka import Consumer, Producer

    n, out, batch, every = cfg["records"], cfg["output"], cfg["batch"], cfg["sample_every"]
    tr = Tracker(cfg)
    seen = tr.seen
    body = raw_batch(cfg.get("shape", "bytes"))
    t0 = perf()
    producer = Producer(_producer_config(cfg))
    producer.init_transactions(30)
    consumer = Consumer(_consumer_config(cfg))
    consumer.subscribe([cfg["input"]])
    produce = producer.produce
    done = 0
    deadline = time.monotonic() + cfg["timeout"]
    try:
        while done < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out after {cfg['timeout']}s with {done}/{n} records committed")
            msgs = consumer.consume(batch, 0.1)
            if not msgs:
                continue
            if tr.t_first is None:
                tr.start()
            producer.begin_transaction()
            body(produce, out, msgs, seen, every)
            producer.send_offsets_to_transaction(
                consumer.position(consumer.assignment()), consumer.consumer_group_metadata(), 30
            )
            producer.commit_transaction(30)
            tr.committed(len(msgs))
            done += len(msgs)
    finally:
        consumer.close()
    return tr.result(t0, n)


class PoisonError(RuntimeError):
    """Raised by the handler for poison records (retryable, so max_attempts applies)."""


def tracer_provider(ratio: float | bool = True) -> Any:
    """An OpenTelemetry SDK provider as a service would run it (batch span processor), its spans dropped, not sent.

    ``ratio``: True samples every trace; a number, that share of root traces (``ParentBased(TraceIdRatioBased)``).
    """
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    class Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider(sampler=None if ratio is True else ParentBased(TraceIdRatioBased(float(ratio))))
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    return provider


class RetryTimes:
    """Run 4t's clock, from the handler's calls (the retry topics hold earlier repetitions' hops too, which other
    groups let pass: commit counts would include them). The main flow is done at the first commit after every
    input record's first call; the run at the first commit after every record succeeded."""

    def __init__(self, records: int) -> None:
        self.records = records
        self.first_calls = 0  # attempt 1 of each input record
        self.succeeded = 0
        self.first_failure: dict[int, float] = {}
        self.delays: list[float] = []  # per retried record: its first failure to its success
        self.main_done: float | None = None

    def committed(self) -> bool:
        if self.main_done is None and self.first_calls >= self.records:
            self.main_done = perf()
        return self.succeeded >= self.records

    def result(self, tr: Tracker, n: int) -> dict[str, Any]:
        assert tr.t_first is not None and self.main_done is not None
        delays = sorted(self.delays)
        return {
            "main_flow_records_per_s": n / (self.main_done - tr.t_first),
            "retried_after_s_median": delays[len(delays) // 2] if delays else None,
            "retried_after_s_max": delays[-1] if delays else None,
        }


def transient_handler(tr: Tracker, cfg: dict[str, Any], retries: RetryTimes) -> Any:
    """Run 4t's handler: the poison-marked records fail at attempts 1 and 2 and succeed at 3."""
    every, parts = cfg["sample_every"], cfg["partitions"]

    def handler(record: Any) -> bytes:
        if tr.t_first is None:
            tr.start()
        o, attempt, v = record.offset, record.attempt, record.value
        if attempt == 1:
            retries.first_calls += 1
            if o % every == 0:
                tr.seen(record.partition, o)
        if v[10:16] == b"poison":
            i = o * parts + record.partition
            if attempt == 1:
                retries.first_failure[i] = perf()
            if attempt < 3:
                raise PoisonError(f"transient failure of {v[:9].decode()} at attempt {attempt}")
            retries.delays.append(perf() - retries.first_failure.get(i, perf()))
        retries.succeeded += 1
        return v.upper()  # type: ignore[no-any-return]

    return handler


def run_kafkatx(cfg: dict[str, Any]) -> dict[str, Any]:
    """kafkatx: App + @app.listener (runs 2, 3, 4, 4b)."""
    import threading

    from kafkatx import App
    from kafkatx.events import HandlerFailed, TransactionAborted, TransactionCommitted

    n, every, parts = cfg["records"], cfg["sample_every"], cfg["partitions"]
    tr = Tracker(cfg)
    seen = tr.seen
    finished = threading.Event()
    debug = os.environ.get("BENCH_PRODUCER_DEBUG")  # e.g. "eos": librdkafka's transaction log, to stderr
    app = App(
        cfg["group"],
        bootstrap_servers=cfg["bootstrap"],
        instance_id="bench",
        consumer_config={**cfg["client_config"], **EXTRA_CONSUMER_CONFIG},
        producer_config={"debug": debug} if debug else None,
        tracing=tracer_provider(cfg["tracing"]) if cfg.get("tracing") else False,
    )
    options: dict[str, Any] = dict(cfg.get("options") or {})
    poison = bool(cfg.get("poison"))
    calls = bytearray(n) if poison else None
    failures = [0]

    batch = cfg.get("listener") == "batch"
    transient = bool(cfg.get("transient"))
    retries = RetryTimes(n)
    if poison and batch:
        from kafkatx import RecordFailedError

        def handler(records: list[Any]) -> list[bytes]:  # the poison handler below, over a batch
            if tr.t_first is None:
                tr.start()
            outs = []
            for record in records:
                o = record.offset
                if o % every == 0:
                    seen(record.partition, o)
                i = o * parts + record.partition
                if i < n:
                    calls[i] = min(255, calls[i] + 1)  # type: ignore[index]
                v = record.value
                if v[10:16] == b"poison":
                    raise RecordFailedError(record) from PoisonError(f"poison record {v[:9].decode()}")
                outs.append(v.upper())
            return outs

        options["output"] = cfg["output"]
    elif batch:
        handler, shape_options = batch_handler(cfg.get("shape", "bytes"), tr, cfg["output"])
        options.update(shape_options)
    elif transient:
        handler = transient_handler(tr, cfg, retries)
        options["output"] = cfg["output"]
    elif poison:

        def handler(record: Any) -> bytes:
            if tr.t_first is None:
                tr.start()
            o = record.offset
            if o % every == 0:
                seen(record.partition, o)
            i = o * parts + record.partition
            if i < n:
                calls[i] = min(255, calls[i] + 1)  # type: ignore[index]
            v = record.value
            if v[10:16] == b"poison":
                raise PoisonError(f"poison record {v[:9].decode()}")
            return v.upper()  # type: ignore[no-any-return]

        options["output"] = cfg["output"]
    else:
        handler, shape_options = kafkatx_handler(cfg.get("shape", "bytes"), tr, cfg["output"])
        options.update(shape_options)

    if batch:
        app.add_batch_listener(handler, cfg["input"], name="bench", **options)
    else:
        app.add_listener(handler, cfg["input"], name="bench", **options)

    @app.on(TransactionCommitted)
    def _committed(ev: Any) -> None:
        tr.committed(ev.records)
        if not transient:
            if tr.committed_records >= n:
                finished.set()
        elif retries.committed():
            finished.set()

    @app.on(TransactionAborted)
    def _aborted(ev: Any) -> None:
        tr.aborted()

    @app.on(HandlerFailed)
    def _failed(ev: Any) -> None:
        failures[0] += 1

    t0 = perf()
    app.start()
    try:
        ok = finished.wait(cfg["timeout"])
        if app.failure is not None:
            raise SystemExit(f"kafkatx failed: {app.failure!r}")
        if not ok:
            raise SystemExit(f"timed out after {cfg['timeout']}s with {tr.committed_records}/{n} records committed")
    finally:
        app.stop(timeout=30)
    res = tr.result(t0, n)
    res["fencing"] = app.listeners[0].fencing
    res["kafkatx_path"] = str(Path(sys.modules["kafkatx"].__file__ or "").parent)
    res["handler_failures"] = failures[0]
    if transient:
        res.update(retries.result(tr, n))
    if calls is not None:
        poison_idx = {i for i in range(n) if is_poison(i, cfg["poison_every"], parts)}
        nonpoison = [c for i, c in enumerate(calls) if i not in poison_idx]
        res["handler_calls"] = sum(calls)
        res["max_calls_per_good_record"] = max(nonpoison) if nonpoison else 0
        res["good_records_reprocessed"] = sum(1 for c in nonpoison if c > 1)
        res["extra_good_calls"] = sum(nonpoison) - len(nonpoison)
        res["calls_per_poison_record"] = sum(calls[i] for i in poison_idx) / len(poison_idx) if poison_idx else 0
    return res


def profile_the_container_thread(path: str) -> None:
    """cProfile each listener container's thread, its stats written to ``path`` (``BENCH_PROFILE=path``; the
    processing thread alone, so the figures are its own, not the broker's or librdkafka's)."""
    import cProfile

    from kafkatx.listener.loop.container import ListenerContainer

    main = ListenerContainer._main

    def profiled(self: Any) -> None:
        profiler = cProfile.Profile(time.thread_time)  # CPU: waiting on the broker is not the thread's cost
        profiler.enable()
        try:
            main(self)
        finally:
            profiler.disable()
            profiler.dump_stats(f"{path}.{self.name}")

    ListenerContainer._main = profiled  # type: ignore[method-assign]


def main() -> None:
    cfg = json.loads(sys.argv[1])
    level = os.environ.get("BENCH_LOG_LEVEL", "WARNING").upper()
    logging.basicConfig(
        level=level,
        format="%(asctime)s.%(msecs)03d %(threadName)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    kind = cfg["kind"]
    if kind == "raw":
        res = run_raw(cfg)
    elif kind == "kafkatx":
        if os.environ.get("BENCH_PROFILE"):
            profile_the_container_thread(os.environ["BENCH_PROFILE"])
        res = run_kafkatx(cfg)
    else:
        raise SystemExit(f"unknown run kind {kind!r}")
    res["peak_rss_mib"] = peak_rss_mib()
    sys.stdout.write("RESULT " + json.dumps(res) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
