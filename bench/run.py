"""kafkatx throughput benchmark: every run on the same workload, one broker, one invocation.

    python bench/run.py                      # all runs, 200k x 100 B records, 8 partitions
    python bench/run.py --runs 1k,2k,1h,2h   # return shapes beside their hand-written twins
    python bench/run.py --quick              # small smoke run (1-2 minutes)
    python bench/run.py --runs 1,2 --repeat 3 --json /tmp/out.json

Starts the embedded broker (kafkatx.local.LocalBroker), preloads the input,
then runs each selected run in a fresh subprocess (bench/workers.py, or
bench/quix_worker.py inside bench/.venv-quix for run 5), so peak RSS is
per run. After each run the outputs are read back under read_committed and
checked: exactly the expected records, each once, and the dead-letter topic
holds exactly the poison records. See docs/BENCHMARKS.md for the
definitions and the latest figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from workload import expected_outputs, is_poison, make_key, make_value  # bench/ is sys.path[0]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
QUIX_VENV = HERE / ".venv-quix"
QUIX_VERSION = "3.28.1"

G = {"fencing": "group"}  # fencing="auto" picks per-partition producers on the embedded broker (it lacks KIP-447)
K = {**G, "max_batch_records": 1000}  # run 1's transaction size: the ratio to the twin is kafkatx's own cost
RUNS: dict[str, dict[str, Any]] = {
    "1": {"label": "hand-written EOS loop, <=1000 rec/txn (baseline)", "kind": "raw", "batch": 1000, "input": "main"},
    "2": {
        "label": "kafkatx, default batch transactions",
        "kind": "kafkatx",
        "options": G,
        "input": "main",
        "twin": "1",
    },
    "2b": {
        "label": "kafkatx, <=1000 rec/txn like run 1 (max_batch_records=1000)",
        "kind": "kafkatx",
        "options": K,
        "input": "main",
        "twin": "1",
    },
    "2t": {
        "label": "kafkatx defaults with tracing on (OpenTelemetry SDK, batch span processor, spans dropped)",
        "kind": "kafkatx",
        "options": G,
        "input": "main",
        "twin": "2",
        "tracing": True,
    },
    "2t1": {
        "label": "kafkatx defaults, tracing at 1% (ParentBased(TraceIdRatioBased(0.01)), the usual production setting)",
        "kind": "kafkatx",
        "options": G,
        "input": "main",
        "twin": "2",
        "tracing": 0.01,
    },
    "2o": {
        "label": "kafkatx defaults with overlap_commit=True (the next batch handled while a transaction commits)",
        "kind": "kafkatx",
        "options": {**G, "overlap_commit": True},
        "input": "main",
        "twin": "2",
    },
    "2v": {
        "label": "kafkatx batch listener at defaults, return [r.value.upper() for r in records]",
        "kind": "kafkatx",
        "listener": "batch",
        "options": G,
        "input": "main",
        "twin": "2",
    },
    "2n": {
        "label": "kafkatx record listener at defaults, value.upper() with numpy per record",
        "kind": "kafkatx",
        "options": G,
        "input": "main",
        "shape": "numpy",
        "twin": "2",
    },
    "2vn": {
        "label": "kafkatx batch listener at defaults, value.upper() with numpy over the batch's values at once",
        "kind": "kafkatx",
        "listener": "batch",
        "options": G,
        "input": "main",
        "shape": "numpy",
        "twin": "2n",
    },
    "1k": {
        "label": "hand-written, produce(out, value.upper(), key)",
        "kind": "raw",
        "batch": 1000,
        "input": "main",
        "shape": "keyed",
    },
    "2k": {
        "label": "kafkatx, return (record.key, value.upper())",
        "kind": "kafkatx",
        "options": K,
        "input": "main",
        "shape": "keyed",
        "twin": "1k",
    },
    "2kg": {
        "label": "kafkatx at defaults with fencing='group', return (record.key, value.upper())",
        "kind": "kafkatx",
        "options": G,
        "input": "main",
        "shape": "keyed",
        "twin": "1k",
    },
    "2kp": {
        "label": "kafkatx at defaults with fencing='partition' (a transaction per partition), return (key, value)",
        "kind": "kafkatx",
        "options": {"fencing": "partition"},
        "input": "main",
        "shape": "keyed",
        "twin": "1k",
    },
    "1h": {
        "label": "hand-written, produce(out, value.upper(), key, headers=h)",
        "kind": "raw",
        "batch": 1000,
        "input": "main",
        "shape": "output",
    },
    "2h": {
        "label": "kafkatx, return Output(value.upper(), key=key, headers=h)",
        "kind": "kafkatx",
        "options": K,
        "input": "main",
        "shape": "output",
        "twin": "1h",
    },
    "1g": {
        "label": "hand-written, two produce() per record",
        "kind": "raw",
        "batch": 1000,
        "input": "main",
        "shape": "generator",
    },
    "2g": {
        "label": "kafkatx, a generator yielding two (key, value)",
        "kind": "kafkatx",
        "options": K,
        "input": "main",
        "shape": "generator",
        "twin": "1g",
    },
    "1s": {
        "label": "hand-written, produce(out, value.upper(), key) (send twin)",
        "kind": "raw",
        "batch": 1000,
        "input": "main",
        "shape": "send",
    },
    "2s": {
        "label": "kafkatx, send(out, value.upper(), key)",
        "kind": "kafkatx",
        "options": K,
        "input": "main",
        "shape": "send",
        "twin": "1s",
    },
    "1j": {
        "label": "hand-written, produce(out, json.dumps(obj).encode())",
        "kind": "raw",
        "batch": 1000,
        "input": "main",
        "shape": "serializer",
    },
    "2j": {
        "label": "kafkatx, return obj with serializer=json",
        "kind": "kafkatx",
        "options": K,
        "input": "main",
        "shape": "serializer",
        "twin": "1j",
    },
    "3": {
        "label": "kafkatx, 1 txn per record (max_batch_records=1)",
        "kind": "kafkatx",
        "options": {**G, "max_batch_records": 1},
        "input": "small",
        "twin": "3b",
    },
    "3b": {"label": "hand-written loop, 1 txn per record", "kind": "raw", "batch": 1, "input": "small"},
    "4": {
        "label": "kafkatx, 1% poison, the default path (max_attempts=3, backoff=0, dlq)",
        "kind": "kafkatx",
        "options": {**G, "max_attempts": 3, "backoff": 0},
        "input": "main",
        "poison": True,
    },
    "4b": {
        "label": "kafkatx, 1% poison, retry='in_place' (max_attempts=3, backoff=0, dlq)",
        "kind": "kafkatx",
        "options": {**G, "max_attempts": 3, "retry": "in_place", "backoff": 0},
        "input": "main",
        "poison": True,
    },
    "4c": {
        "label": "kafkatx, 1% poison, a back-off held per partition (max_attempts=3, backoff=0.05, dlq)",
        "kind": "kafkatx",
        "options": {**G, "max_attempts": 3, "backoff": 0.05},
        "input": "main",
        "poison": True,
    },
    "4v": {
        "label": "kafkatx batch listener, 1% poison named with RecordFailedError (max_attempts=3, backoff=0, dlq)",
        "kind": "kafkatx",
        "listener": "batch",
        "options": {**G, "max_attempts": 3, "backoff": 0},
        "input": "main",
        "poison": True,
        "twin": "4",
    },
    # The same 1% of records fail, but only at attempts 1 and 2 (a dependency that needs three tries), at the
    # default back-off: each waits in a retry topic (1 s, twice) while its partition goes on. Its records/s is the
    # main flow's (every input offset committed), beside run 2; the retried records' delay is printed apart.
    "4t": {
        "label": "kafkatx, 1% failing at attempts 1-2, retry='topics' (default back-off, dlq)",
        "kind": "kafkatx",
        "options": {**G, "retry": "topics"},  # ordering="key", the default: each key's outputs in input order
        "input": "main",
        "transient": True,
        "dlq": True,
        "twin": "2",
    },
    # 4t's own baseline, as the issue states its goal ("the same run on clean data"): the same listener (retry topics,
    # key order, dlq, the retry feed), the same fresh input topic of its own, no record failing.
    "4t0": {
        "label": "as 4t on clean data (no record fails): 4t's own baseline",
        "kind": "kafkatx",
        "options": {**G, "retry": "topics"},
        "input": "main",
        "transient": True,
        "clean": True,
        "dlq": True,
        "twin": "2",
    },
    # quixstreams' to_topic() keeps each record's key: its output is the keyed shape's, and 1k its twin.
    "5": {
        "label": f"quixstreams {QUIX_VERSION}, exactly-once",
        "kind": "quix",
        "input": "main",
        "shape": "keyed",
        "twin": "1k",
    },
}
ORDER = [
    "1",
    "2",
    "2b",
    "2t",
    "2t1",
    "2o",
    "2v",
    "2n",
    "2vn",
    "1k",
    "2k",
    "2kg",
    "2kp",
    "1h",
    "2h",
    "1g",
    "2g",
    "1s",
    "2s",
    "1j",
    "2j",
    "3",
    "3b",
    "4",
    "4b",
    "4c",
    "4v",
    "4t0",
    "4t",
    "5",
]
SHAPE_RUNS = ["1k", "2k", "1h", "2h", "1g", "2g", "1s", "2s", "1j", "2j"]


# -- the input (records from workload.py) -------------------------------------
def preload(bootstrap: str, topic: str, n: int, partitions: int, size: int, poison_every: int) -> float:
    """Produce record i to partition i % partitions (so offset = i // partitions)."""
    from kafkatx.testing import produce

    started = time.perf_counter()
    produce(
        bootstrap,
        topic,
        (
            {"key": make_key(i), "value": make_value(i, size, poison_every, partitions), "partition": i % partitions}
            for i in range(n)
        ),
        config={"linger.ms": 20, "batch.num.messages": 10000, "enable.idempotence": True},
    )
    return time.perf_counter() - started


def warm_up(bootstrap: str, topic: str, n: int) -> float:
    """Read the input once before any run: the broker's first read of freshly written data is
    slower, and without this it would always fall on the first repetition of run 1."""
    from kafkatx.local import LocalBroker
    from kafkatx.testing import read_topic

    started = time.perf_counter()
    got = len(read_topic(bootstrap, topic, timeout=60, config=LocalBroker.client_config))
    if got != n:
        raise SystemExit(f"warm-up read {got:,} of {n:,} preloaded records")
    return time.perf_counter() - started


# -- keeping the machine quiet ---------------------------------------------------
def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet_broker(
    broker: Any, *, idle_share: float = 0.03, timeout: float = 60.0, others_max: float | None = None
) -> dict[str, float]:
    """Wait until the broker has finished its snapshots (noida writes kafka.json 1-2 s after
    each change, which costs CPU and stalls requests): its CPU use stays under ``idle_share``
    of a core for 1 s and the snapshot file is 2 s old. With ``others_max``, also wait until
    the rest of the machine uses less than that many cores. Gives up after ``timeout``
    seconds; returns what it saw last (``waited_s``, ``others_cores``)."""
    started = time.monotonic()
    snapshot = broker.data_dir / "kafka.json"
    tick = os.sysconf("SC_CLK_TCK")
    others = 0.0
    while time.monotonic() - started < timeout:
        try:
            busy0, _ = _machine_busy_jiffies()
            before = _cpu_seconds(broker.pid)
            mine0 = sum(os.times()[:2])
            time.sleep(1.0)
            busy = _cpu_seconds(broker.pid) - before
            others = max(0.0, (_machine_busy_jiffies()[0] - busy0) / tick - busy - (sum(os.times()[:2]) - mine0))
            age = time.time() - snapshot.stat().st_mtime if snapshot.exists() else 99.0
        except (OSError, TypeError, ValueError):
            break  # no /proc (not Linux): nothing to wait for
        if busy <= idle_share and age >= 2.0 and (others_max is None or others <= others_max):
            break
    return {"waited_s": time.monotonic() - started, "others_cores": others}


class SnapshotWatcher:
    """When the broker wrote its snapshot file (noida-db: all its data as JSON, 1-2 s after
    changes, hundreds of milliseconds of broker CPU with the input loaded). Repetitions whose
    processing window overlaps a write are marked, for reading the spread; they stay in the
    median (measured: they are not reliably the slow ones)."""

    WRITE_S = 0.5  # how long before its mtime a snapshot write may have started

    def __init__(self, path: Path) -> None:
        self.path = path
        self.writes: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="snapshot-watcher", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        last = None
        while not self._stop.wait(0.01):
            try:
                mtime = self.path.stat().st_mtime
            except OSError:
                continue
            if mtime != last:
                last = mtime
                self.writes.append(mtime)

    def during(self, window: list[float] | None) -> int:
        """Snapshot writes that overlapped ``window`` (wall-clock seconds)."""
        if not window:
            return 0
        start, end = window
        return sum(1 for t in self.writes if start <= t <= end + self.WRITE_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)


def _machine_busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


# -- one run -------------------------------------------------------------------
def _threads_named(pid: int, name: str) -> list[int]:
    """The ids of process ``pid``'s threads called ``name`` (Linux; none elsewhere)."""
    tids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() == name:
                    tids.append(int(tid))
    except OSError:
        pass
    return tids


def yield_broker_snapshots(pid: int) -> list[int]:
    """Lower the priority of the embedded broker's snapshot thread (nice 19), which writes all the broker holds as
    one JSON file every 1-2 s while anything changes (400-850 MB during runs 4t and 4t0, about a core while it
    writes): Apache Kafka has no such work, and where it fell on a run moved that run's figure by a third. It
    still runs whenever the measured process leaves a core; the broker's request threads keep their priority.
    Returns the threads lowered."""
    tids = _threads_named(pid, "autosave")
    for tid in tids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)
    return tids


#: The broker's snapshots in memory need room for a few of them (850 MB each during runs 4t and 4t0).
MEMORY_DATA_DIR_MIN_FREE = 8 << 30


def broker_data_dir(choice: str, stack: contextlib.ExitStack) -> tuple[str | None, str]:
    """Where the embedded broker keeps its data during the runs, and a note saying so. ``memory`` (the default):
    a directory on /dev/shm, removed at the end. noida-db writes everything it holds to its snapshot file 1-2 s
    after each change (400-850 MB during runs 4t and 4t0); on disk, the kernel's page cache and writeback of those
    files took system CPU from the runs: run 4t's main flow read 133k records/s there (median of 3) against 164k in
    memory (25), run 4t0 220-230k in both (docs/BENCHMARKS.md). Apache Kafka writes each record to its log once and does no such work. ``disk``: a
    temporary directory, as the broker's tests use; any other value: that directory."""
    if choice == "disk":
        return None, "the embedded broker's data in a temporary directory on disk (--broker-data-dir disk)"
    if choice != "memory":
        return choice, f"the embedded broker's data in {choice} (--broker-data-dir)"
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= MEMORY_DATA_DIR_MIN_FREE:
        path = stack.enter_context(tempfile.TemporaryDirectory(dir=shm, prefix="kafkatx-bench-broker-"))
        return path, "the embedded broker's data (its snapshots) in memory, on /dev/shm (--broker-data-dir disk: not)"
    return None, "the embedded broker's data on disk: /dev/shm is missing or has too little room (docs/BENCHMARKS.md)"


class LoadMeter:
    """CPU used during a run by everything except the run's process and the broker: the noise."""

    def __init__(self, broker_pid: int | None) -> None:
        self.broker_pid = broker_pid
        self.tick = os.sysconf("SC_CLK_TCK")
        try:
            self.busy0, _ = _machine_busy_jiffies()
            self.broker0 = _cpu_seconds(broker_pid) if broker_pid else 0.0
        except OSError:
            self.busy0 = -1
        self.self0 = sum(os.times()[:2])
        self.t0 = time.monotonic()

    def stop(self, child_cpu: float) -> dict[str, float]:
        wall = time.monotonic() - self.t0
        if self.busy0 < 0 or wall <= 0:
            return {}
        busy1, _ = _machine_busy_jiffies()
        broker = (_cpu_seconds(self.broker_pid) - self.broker0) if self.broker_pid else 0.0
        mine = sum(os.times()[:2]) - self.self0
        other = (busy1 - self.busy0) / self.tick - child_cpu - broker - mine
        return {"broker_cores": broker / wall, "other_cores": max(0.0, other) / wall}


def run_worker(
    cmd: list[str], log_path: Path, timeout: float, pythonpath: str | None = None
) -> tuple[dict[str, Any] | None, int, float, str, float]:
    """Start a run's process; return (result, exit code, peak RSS MiB and CPU seconds from wait4, error text)."""
    with open(log_path, "wb") as log:
        env = dict(os.environ)
        env["BENCH_SPAWNED_AT"] = repr(time.time())  # the worker measures its wall time from here
        if pythonpath:
            env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, cwd=ROOT, env=env)
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        out = b""
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                proc.kill()
                break
            if sel.select(min(remaining, 1.0)):
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                out += chunk
        sel.close()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        proc.stdout.close()
    # Fallback only: Linux keeps the forked parent's pre-exec peak in the child's ru_maxrss,
    # so the workers report their own VmHWM (used below when present).
    rss_mib = usage.ru_maxrss / 1024.0  # KiB on Linux
    cpu_s = usage.ru_utime + usage.ru_stime
    result = None
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    if result is not None and result.get("peak_rss_mib"):
        rss_mib = result["peak_rss_mib"]
    error = ""
    if result is None:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        error = f"exit code {proc.returncode}; log {log_path}:\n    " + "\n    ".join(tail)
    return result, proc.returncode, rss_mib, error, cpu_s


def verify(
    bootstrap: str, run: dict[str, Any], out_topic: str, dlt_topic: str | None, n: int, args: Any
) -> dict[str, Any]:
    """Read outputs under read_committed: every expected record (key, value, headers) exactly once, DLT == poison records."""
    from collections import Counter

    from kafkatx.local import LocalBroker
    from kafkatx.testing import read_topic

    loaded = args.poison_every if run["input"] == "main" and not run.get("clean") else 0  # how the input was preloaded
    poison_every = loaded if run.get("poison") else 0
    parts, shape = args.partitions, run.get("shape", "bytes")
    expected: Counter[tuple[Any, ...]] = Counter()
    for i in range(n):
        if not is_poison(i, poison_every, parts):
            for key, value, headers in expected_outputs(
                shape, make_key(i), make_value(i, args.size, loaded, parts), i // parts
            ):
                expected[(key, value, tuple(headers or ()))] += 1
    outputs = read_topic(bootstrap, out_topic, timeout=120, config=LocalBroker.client_config)
    untraced = 0
    if run.get("tracing"):  # each output carries its record's trace: checked, then set aside for the comparison
        untraced = sum(1 for r in outputs if not any(k == "traceparent" for k, _ in r.headers or ()))
        outputs = [replace(r, headers=[(k, v) for k, v in r.headers or () if k != "traceparent"]) for r in outputs]
    got: Counter[tuple[Any, ...]] = Counter((r.key, r.value, tuple(r.headers or ())) for r in outputs)
    check: dict[str, Any] = {
        "outputs": sum(got.values()),
        "outputs_expected": sum(expected.values()),
        "outputs_distinct": len(got),
        "outputs_ok": got == expected,
    }
    ok = check["outputs_ok"]
    if run.get("tracing"):
        check["untraced_outputs"] = untraced
        ok = ok and (untraced == 0 or run["tracing"] is not True)  # sampled out at a ratio: no trace to carry
    if dlt_topic is not None:
        poison = {make_value(i, args.size, loaded, parts) for i in range(n) if is_poison(i, poison_every, parts)}
        dlt = [r.value for r in read_topic(bootstrap, dlt_topic, timeout=60, config=LocalBroker.client_config)]
        check.update(dlt=len(dlt), dlt_expected=len(poison), dlt_ok=len(dlt) == len(poison) and set(dlt) == poison)
        ok = ok and check["dlt_ok"]
    check["ok"] = ok
    return check


# -- quixstreams venv ------------------------------------------------------------
def ensure_quix_venv() -> tuple[Path | None, str]:
    """Create bench/.venv-quix with quixstreams on first use; (python, note)."""
    python = QUIX_VENV / "bin" / "python"
    probe = [str(python), "-c", "import quixstreams, confluent_kafka; print(quixstreams.__version__)"]
    if python.exists():
        r = subprocess.run(probe, capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() == QUIX_VERSION:
            return python, ""
    print(f"# creating {QUIX_VENV.relative_to(ROOT)} with quixstreams=={QUIX_VERSION} (first use only) ...", flush=True)
    base = getattr(sys, "_base_executable", None) or sys.executable
    r = subprocess.run([base, "-m", "venv", "--clear", str(QUIX_VENV)], capture_output=True, text=True)
    if r.returncode != 0 or not (QUIX_VENV / "bin" / "pip").exists():
        return None, f"run 5 skipped: could not create a virtualenv with pip ({(r.stderr or r.stdout).strip()[-200:]})"
    r = subprocess.run(
        [
            str(QUIX_VENV / "bin" / "pip"),
            "install",
            "--quiet",
            "--disable-pip-version-check",
            f"quixstreams=={QUIX_VERSION}",
        ],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        return (
            None,
            f"run 5 skipped: pip install quixstreams=={QUIX_VERSION} failed: {(r.stderr or r.stdout).strip()[-300:]}",
        )
    r = subprocess.run(probe, capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"run 5 skipped: quixstreams does not import in {QUIX_VENV}: {r.stderr.strip()[-300:]}"
    return python, ""


# -- machine ------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    import confluent_kafka

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    try:
        from importlib.metadata import version

        noida = version("noida-db")
        kafkatx = version("kafkatx")
    except Exception:
        noida = kafkatx = "?"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "os": platform.platform(),
        "python": platform.python_version(),
        "confluent_kafka": getattr(confluent_kafka, "__version__", None) or str(confluent_kafka.version()),
        "librdkafka": confluent_kafka.libversion()[0],
        "broker": f"noida-db {noida} (kafkatx.local.LocalBroker)",
        "kafkatx": kafkatx,
        "load_before": os.getloadavg()[0],
    }


# -- summary ------------------------------------------------------------------------
def summarize(reps: list[dict[str, Any]], busy_limit: float = 0.25) -> dict[str, Any]:
    """The median repetition by records/s, plus the spread.

    Repetitions during which other processes used more than ``busy_limit``
    cores are left out when at least one quiet repetition exists; if none
    does, the summary is marked ``disturbed``."""
    done = [r for r in reps if r.get("result")]
    if not done:
        return {}
    quiet = [r for r in done if r.get("other_cores", 0.0) <= busy_limit]
    ok = quiet or done
    rates = [r["result"]["records"] / r["result"]["processing_s"] for r in ok]
    med = statistics.median(rates)
    best = min(ok, key=lambda r: abs(r["result"]["records"] / r["result"]["processing_s"] - med))
    res = best["result"]
    s = {
        "records": res["records"],
        "records_per_s": med,
        "records_per_s_all": rates,
        "wall_records_per_s": statistics.median(r["result"]["records"] / r["result"]["wall_s"] for r in ok),
        "process_records_per_s": statistics.median(
            r["result"]["records"] / (r["result"].get("process_wall_s") or r["result"]["wall_s"]) for r in ok
        ),
        "process_records_per_s_all": [
            r["result"]["records"] / (r["result"].get("process_wall_s") or r["result"]["wall_s"]) for r in ok
        ],
        "cpu_us_per_record_all": [r["result"]["thread_cpu_s"] / r["result"]["records"] * 1e6 for r in ok],
        "processing_s": res["processing_s"],
        "wall_s": res["wall_s"],
        "startup_s": res["startup_s"],
        "latency_p50_ms": res["latency_p50_ms"],
        "latency_p99_ms": res["latency_p99_ms"],
        "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in ok),
        "cpu_us_per_record": statistics.median(r["result"]["thread_cpu_s"] / r["result"]["records"] * 1e6 for r in ok),
        "process_cpu_us_per_record": statistics.median(r["process_cpu_s"] / r["result"]["records"] * 1e6 for r in ok),
        # Every thread of the run's process (librdkafka's too) while it processed: on a machine the broker
        # shares, CPU any thread spends is CPU the broker does not get.
        "window_process_cpu_us_per_record": statistics.median(
            r["result"].get("process_cpu_s", float("nan")) / r["result"]["records"] * 1e6 for r in ok
        ),
        "broker_cores": statistics.median(r.get("broker_cores", float("nan")) for r in ok),
        "other_cores_max": max((r.get("other_cores", 0.0) for r in ok), default=0.0),
        "txns_committed": res["txns_committed"],
        "txns_aborted": res["txns_aborted"],
        "verified": all(r["check"].get("ok") for r in done) and len(done) == len(reps),
        "reps_used": len(ok),
        "reps_with_broker_snapshot": sum(1 for r in done if r.get("broker_snapshots")),
        "disturbed": not quiet,
    }
    for key in (
        "handler_failures",
        "handler_calls",
        "max_calls_per_good_record",
        "good_records_reprocessed",
        "extra_good_calls",
        "calls_per_poison_record",
        "quixstreams_commit_interval_s",
        "main_flow_records_per_s",
        "retried_after_s_median",
        "retried_after_s_max",
    ):
        if key in res:
            s[key] = res[key]
    flows = {r["rep"]: r["result"]["main_flow_records_per_s"] for r in ok if "main_flow_records_per_s" in r["result"]}
    if flows:
        # Each repetition's own main flow (by repetition number, to pair it with another run's same repetition), and
        # their median: the representative repetition above is the median one by the whole run's records/s.
        s["main_flow_records_per_s_by_rep"] = flows
        s["main_flow_records_per_s_median"] = statistics.median(flows.values())
    return s


def topics_of(bootstrap: str, topic: str) -> list[str]:
    """``topic`` and the retry topics named after it (``<topic>-retry...``)."""
    from confluent_kafka.admin import AdminClient

    names = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics
    return [name for name in names if name == topic or name.startswith(topic + "-retry")]


def paired_ratios(run: dict[str, Any], base: dict[str, Any]) -> list[float]:
    """``run``'s main flow over ``base``'s, repetition by repetition: runs alternate within a repetition, so a pair
    ran minutes apart under the same load, where the medians of the two runs may come from different hours' load."""
    mine, theirs = run.get("main_flow_records_per_s_by_rep", {}), base.get("main_flow_records_per_s_by_rep", {})
    return [mine[rep] / theirs[rep] for rep in sorted(mine) if rep in theirs and theirs[rep]]


def derive(summary: dict[str, dict[str, Any]], poisons: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Ratios, poison costs and target checks."""
    derived: dict[str, Any] = {}
    rate = {k: v["records_per_s"] for k, v in summary.items() if v}
    if "1" in rate:
        for k in rate:
            derived.setdefault(k, {})["ratio_vs_1"] = rate[k] / rate["1"]
    if "3" in rate and "3b" in rate:
        derived.setdefault("3", {})["ratio_vs_3b"] = rate["3"] / rate["3b"]
    for k in rate:
        twin = RUNS[k].get("twin")
        if twin in rate:
            d = derived.setdefault(k, {})
            d["ratio_vs_twin"] = rate[k] / rate[twin]
            d["process_ratio_vs_twin"] = summary[k]["process_records_per_s"] / summary[twin]["process_records_per_s"]
            d["cpu_ratio_vs_twin"] = summary[k]["cpu_us_per_record"] / summary[twin]["cpu_us_per_record"]
    for k in rate:
        if k.endswith("'") and k[:-1] in rate:
            d = derived.setdefault(k, {})
            d["ratio_vs_base"] = rate[k] / rate[k[:-1]]
            base_cpu, cpu = summary[k[:-1]].get("cpu_us_per_record"), summary[k].get("cpu_us_per_record")
            if base_cpu and cpu:
                d["cpu_us_per_record_delta"] = cpu - base_cpu
    if "3'" in rate and "3b" in rate:
        derived.setdefault("3'", {})["ratio_vs_3b"] = rate["3'"] / rate["3b"]
    if "4b'" in rate and "2'" in rate:
        derived.setdefault("4b'", {})["ratio_vs_2"] = rate["4b'"] / rate["2'"]
    for k in ("4", "4b", "4c", "4v"):
        if k in rate and "2" in rate and poisons:
            s, base = summary[k], summary["2"]
            extra_s = s["processing_s"] - s["records"] / rate["2"]
            txns = s["txns_committed"] + s["txns_aborted"]
            base_txns = (base["txns_committed"] + base["txns_aborted"]) * s["records"] / base["records"]
            d = derived.setdefault(k, {})
            d["ratio_vs_2"] = rate[k] / rate["2"]
            d["poison_records"] = poisons
            d["extra_ms_per_poison"] = extra_s * 1000.0 / poisons
            d["extra_txns_per_poison"] = (txns - base_txns) / poisons
            d["aborted_txns_per_poison"] = s["txns_aborted"] / poisons
            if s.get("handler_failures"):
                d["good_reruns_per_failure"] = s.get("extra_good_calls", 0) / s["handler_failures"]
    targets: list[dict[str, Any]] = []

    def target(name: str, value: float | None, goal: float, text: str) -> None:
        if value is not None:
            targets.append({"target": name, "value": value, "goal": goal, "met": value >= goal, "text": text})

    target("run 2 / run 1", derived.get("2", {}).get("ratio_vs_1"), 0.9, "kafkatx batch >= 0.9 x hand-written loop")
    for k in ("2b", "2k", "2h", "2g", "2s", "2j"):
        target(
            f"run {k} / run {RUNS[k]['twin']}",
            derived.get(k, {}).get("ratio_vs_twin"),
            0.95,
            f"{RUNS[k]['label']} >= 0.95 x its hand-written twin",
        )
    target("run 2t1 / run 2", derived.get("2t1", {}).get("ratio_vs_twin"), 0.85, "tracing at 1% costs <= 15% of run 2")
    target("run 2v / run 2", derived.get("2v", {}).get("ratio_vs_twin"), 1.0, "batch listener >= 1.0 x record listener")
    target(
        "run 3 / run 3b", derived.get("3", {}).get("ratio_vs_3b"), 0.9, "kafkatx per-record txn >= 0.9 x hand-written"
    )
    target(
        "run 4 / run 2", derived.get("4", {}).get("ratio_vs_2"), 0.5, "1% poison at backoff=0 >= 0.5 x clean batch run"
    )
    target("run 4b / run 2", derived.get("4b", {}).get("ratio_vs_2"), 0.6, "in-place retry >= 0.6 x clean batch run")
    clean_4t = summary.get("4t0", {}).get("main_flow_records_per_s_median")
    if summary.get("4t") and clean_4t:
        target(
            "run 4t main flow / run 4t0",
            summary["4t"].get("main_flow_records_per_s_median", 0.0) / clean_4t,
            0.7,
            "1% transient failures through retry topics: the main flow >= 0.7 x the same run on clean data "
            "(medians of the repetitions' main flows)",
        )
        pairs = paired_ratios(summary["4t"], summary["4t0"])
        derived.setdefault("4t", {})["main_flow_vs_4t0_by_rep"] = pairs
        if pairs:
            target(
                "run 4t main flow / run 4t0, paired",
                statistics.median(pairs),
                0.7,
                "the same goal, as the median of each repetition's ratio to run 4t0's repetition beside it",
            )
    if summary.get("4t") and "2" in rate:
        target(
            "run 4t main flow / run 2",
            summary["4t"].get("main_flow_records_per_s_median", 0.0) / rate["2"],
            0.7,
            "1% transient failures through retry topics: the main flow >= 0.7 x run 2 (defaults, clean)",
        )
    if "4" in summary and summary["4"]:
        mx = summary["4"].get("max_calls_per_good_record")
        if mx is not None:
            targets.append(
                {
                    "target": "run 4 good records handled once",
                    "value": mx,
                    "goal": 1,
                    "met": mx <= 1,
                    "text": "no good record is handled twice: a failure undoes its own record's work only",
                }
            )
        if "4" in derived and "extra_txns_per_poison" in derived["4"]:
            v = derived["4"]["extra_txns_per_poison"]
            targets.append(
                {
                    "target": "run 4 txns per poison",
                    "value": v,
                    "goal": 6.0,
                    "met": v <= 6.5,
                    "text": "rollback path: ~2 transactions (abort + after-rollback commit) per failed attempt, 3 attempts",
                }
            )
    return derived, targets


def fmt(v: Any, spec: str = ".0f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def table(summary: dict[str, dict[str, Any]], derived: dict[str, Any], order: list[str], markdown: bool = False) -> str:
    head = [
        "run",
        "what",
        "records",
        "rec/s",
        "vs 1",
        "vs twin",
        "wall rec/s",
        "from start rec/s",
        "p50 ms",
        "p99 ms",
        "peak RSS MiB",
        "CPU us/rec",
        "txns ok/abort",
        "exactly-once",
    ]
    rows = []
    for k in order:
        s = summary.get(k)
        if not s:
            rows.append([k, RUNS[k]["label"], "-", "failed/skipped", "", "", "", "", "", "", "", "", "", "no"])
            continue
        d = derived.get(k, {})
        rows.append(
            [
                k,
                RUNS[k]["label"],
                f"{s['records']:,}",
                f"{s['records_per_s']:,.0f}" + ("*" if s.get("disturbed") else ""),
                fmt(d.get("ratio_vs_1"), ".3f"),
                fmt(d.get("ratio_vs_twin"), ".3f"),
                f"{s['wall_records_per_s']:,.0f}",
                f"{s['process_records_per_s']:,.0f}",
                fmt(s["latency_p50_ms"], ".1f"),
                fmt(s["latency_p99_ms"], ".1f"),
                f"{s['peak_rss_mib']:.0f}",
                f"{s['cpu_us_per_record']:.1f}",
                f"{s['txns_committed']:,}/{s['txns_aborted']:,}",
                "yes" if s["verified"] else "NO",
            ]
        )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    right = set(range(2, 13))

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _median_range(values: list[float], spec: str) -> str:
    """``median (min-max)`` of the repetitions, for the Markdown tables."""
    if not values:
        return "-"
    med = format(statistics.median(values), spec)
    return med if len(values) == 1 else f"{med} ({format(min(values), spec)}-{format(max(values), spec)})"


def twin_table(summary: dict[str, dict[str, Any]], order: list[str]) -> str:
    """Markdown: every run beside its twin, medians with their range, as docs/BENCHMARKS.md shows them."""
    lines = [
        "| run | twin | k rec/s, run | k rec/s, twin | ratio | thread CPU us/rec, run | thread CPU us/rec, twin "
        "| thread CPU ratio | exactly-once |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in order:
        twin = RUNS[k.rstrip("'")].get("twin")
        s, t = summary.get(k), summary.get(twin or "")
        if not s or not t:
            continue
        rates = [r / 1000 for r in s["records_per_s_all"]]
        twin_rates = [r / 1000 for r in t["records_per_s_all"]]
        lines.append(
            f"| {k} | {twin} | {_median_range(rates, '.0f')}{'*' if s.get('disturbed') else ''} "
            f"| {_median_range(twin_rates, '.0f')}{'*' if t.get('disturbed') else ''} "
            f"| {s['records_per_s'] / t['records_per_s']:.2f} "
            f"| {_median_range(s['cpu_us_per_record_all'], '.2f')} | {_median_range(t['cpu_us_per_record_all'], '.2f')} "
            f"| {s['cpu_us_per_record'] / t['cpu_us_per_record']:.2f} | {'yes' if s['verified'] else 'NO'} |"
        )
    return "\n".join(lines)


def details(summary: dict[str, dict[str, Any]], derived: dict[str, Any]) -> list[str]:
    out = []
    for k, d in derived.items():
        if "ratio_vs_twin" in d:
            twin = RUNS[k]["twin"]
            spread = "/".join(f"{r / 1000:.0f}" for r in summary[k]["records_per_s_all"])
            twin_spread = "/".join(f"{r / 1000:.0f}" for r in summary[twin]["records_per_s_all"])
            out.append(
                f"run {k} vs {twin}: records/s x{d['ratio_vs_twin']:.3f} (k rec/s {spread} vs {twin_spread}), "
                f"from process start x{d['process_ratio_vs_twin']:.3f}, processing-thread CPU per record "
                f"x{d['cpu_ratio_vs_twin']:.2f} ({summary[k]['cpu_us_per_record']:.2f} vs "
                f"{summary[twin]['cpu_us_per_record']:.2f} us), whole-process CPU per record "
                f"{summary[k]['window_process_cpu_us_per_record']:.2f} vs {summary[twin]['window_process_cpu_us_per_record']:.2f} us, "
                f"broker {summary[k]['broker_cores']:.2f} vs {summary[twin]['broker_cores']:.2f} cores"
            )
    for k in ("3",):
        if "ratio_vs_3b" in derived.get(k, {}):
            out.append(f"run 3 vs 3b: {derived[k]['ratio_vs_3b']:.3f}")
    for k in ("4", "4b", "4c", "4v"):
        d, s = derived.get(k, {}), summary.get(k) or {}
        if "extra_ms_per_poison" in d:
            out.append(
                f"run {k}: {d['poison_records']} poison records; extra {d['extra_ms_per_poison']:.2f} ms and "
                f"{d['extra_txns_per_poison']:.2f} transactions ({d['aborted_txns_per_poison']:.2f} aborted) per poison record "
                f"vs run 2; {s.get('handler_calls', 0) / max(1, s.get('records', 1)):.3f} handler calls per record, "
                f"{s.get('calls_per_poison_record', 0):.1f} per poison record; "
                f"good records re-run: {s.get('good_records_reprocessed', 0):,} "
                f"({d.get('good_reruns_per_failure', 0):.1f} per handler failure), max handler calls per good record "
                f"{s.get('max_calls_per_good_record', '-')}; vs run 2 {d['ratio_vs_2']:.3f}"
            )
    for k, d in derived.items():
        if "ratio_vs_base" in d:
            extra = f", 4b'/2' {d['ratio_vs_2']:.3f}" if "ratio_vs_2" in d else ""
            extra += f", 3'/3b {d['ratio_vs_3b']:.3f}" if "ratio_vs_3b" in d else ""
            out.append(
                f"run {k} vs {k[:-1]}: records/s x{d['ratio_vs_base']:.3f}, processing-thread CPU "
                f"{d.get('cpu_us_per_record_delta', 0):+.2f} us/record{extra}"
            )
    s4t = summary.get("4t") or {}
    if s4t.get("main_flow_records_per_s_median"):
        flow = s4t["main_flow_records_per_s_median"]
        against = [f"x{flow / summary['2']['records_per_s']:.3f} run 2"] if summary.get("2") else []
        if summary.get("4t0", {}).get("main_flow_records_per_s_median"):
            pairs = derived.get("4t", {}).get("main_flow_vs_4t0_by_rep", [])
            against.append(
                f"x{flow / summary['4t0']['main_flow_records_per_s_median']:.3f} run 4t0; by repetition "
                + ", ".join(f"{p:.2f}" for p in pairs)
            )
        out.append(
            f"run 4t: main flow {flow:,.0f} rec/s (median of {len(s4t['main_flow_records_per_s_by_rep'])}; "
            + "; ".join(against)
            + "); the retried records "
            f"succeeded {s4t.get('retried_after_s_median') or 0:.2f} s (median), {s4t.get('retried_after_s_max') or 0:.2f} s "
            "(max) after their first failure (two back-offs of 1 s)"
        )
    if summary.get("5", {}).get("quixstreams_commit_interval_s") is not None:
        out.append(f"run 5: quixstreams commit_interval = {summary['5']['quixstreams_commit_interval_s']} s")
    return out


# -- main ---------------------------------------------------------------------------
SHORT_RUNS = {"1", "2", "2b", "2t", "2t1", "2o", "2v", "2n", "2vn", "4b", "5", *SHAPE_RUNS}


def reps_of(run: str, args: argparse.Namespace) -> int:
    if args.repeat is not None:
        return int(args.repeat)
    return 5 if run.rstrip("'") in SHORT_RUNS and not args.quick else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--records", type=int, default=200_000, help="records for every run but 3, 3b (default 200000)")
    p.add_argument(
        "--small-records",
        type=int,
        default=5_000,
        help="records for the per-record-transaction runs 3, 3b (default 5000)",
    )
    p.add_argument("--partitions", type=int, default=8, help="partitions of every topic (default 8)")
    p.add_argument("--size", type=int, default=100, help="record value size in bytes (default 100)")
    p.add_argument("--runs", default=",".join(ORDER), help=f"comma-separated runs to do (default {','.join(ORDER)})")
    p.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="repetitions of each run, interleaved; the median is reported (default: 5 for the short "
        "runs 1, 2, 2b, the shape pairs, 4b and 5, whose ~1 s of processing a single broker snapshot "
        "stall can halve; 1 for 3, 3b, 4)",
    )
    p.add_argument("--json", type=Path, default=RESULTS / "latest.json", help="where to write the JSON results")
    p.add_argument("--quick", action="store_true", help="small smoke run: 4000 records, 200 for runs 3/3b")
    p.add_argument(
        "--poison-every", type=int, default=100, help="runs 4/4b: one poison record per N (default 100 = 1%%)"
    )
    p.add_argument(
        "--sample-every", type=int, default=10, help="latency sample: records whose offset is a multiple of N"
    )
    p.add_argument(
        "--quix-commit-interval",
        type=float,
        default=None,
        help="run 5: quixstreams commit_interval (default: its own, 5 s)",
    )
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown (for docs/BENCHMARKS.md)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-run timeout in seconds")
    p.add_argument(
        "--busy-limit",
        type=float,
        default=0.25,
        help="before each run, wait until other processes use at most this many cores (default 0.25)",
    )
    p.add_argument("--quiet-timeout", type=float, default=60.0, help="how long to wait for that (default 60 s)")
    p.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="put the broker behind a proxy that delays every request and response by this much each way, "
        "as a network does (e.g. 2); loading and checking the topics goes around it (default 0: loopback)",
    )
    p.add_argument(
        "--broker-data-dir",
        default="memory",
        help="where the embedded broker keeps its data: memory (default: on /dev/shm, so that writing its snapshot "
        "files does not take the machine's CPU from the runs; see broker_data_dir), disk (a temporary directory), or "
        "a path",
    )
    p.add_argument(
        "--no-yield-snapshots",
        dest="yield_snapshots",
        action="store_false",
        help="leave the embedded broker's snapshot thread at its priority (by default it runs at nice 19: see "
        "yield_broker_snapshots)",
    )
    p.add_argument(
        "--src",
        type=Path,
        default=None,
        help="benchmark the kafkatx package under this src dir (e.g. a patched copy) instead of the installed one",
    )
    p.add_argument(
        "--compare-src",
        type=Path,
        default=None,
        help="A/B: also do each kafkatx run (2, 3, 4, 4b) with the package under this src dir, interleaved; "
        "shown as 2', 3', ... with their ratio to the unprimed run",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.records, args.small_records = 4_000, 200
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown:
        p.error(f"unknown run(s) {unknown}; choose from {ORDER}")
    args.runs = [r for r in ORDER if r in args.runs]
    if args.compare_src is not None:  # each kafkatx run again, right after it, with the other package
        runs = []
        for k in args.runs:
            runs.append(k)
            if RUNS[k]["kind"] == "kafkatx":
                RUNS[k + "'"] = {**RUNS[k], "label": RUNS[k]["label"] + " [--compare-src]", "src": args.compare_src}
                runs.append(k + "'")
        args.runs = runs
    return args


def byte_compile(src_dirs: list[Path]) -> list[str]:
    """Write the bytecode of the kafkatx packages the runs import, as ``pip install`` does for a package.

    Python reads a module's bytecode from ``__pycache__`` when it is there, and writes it on first import
    unless ``PYTHONDONTWRITEBYTECODE`` is set (it is on some machines, this project's VMs among them, and in
    many container images). Without this, every kafkatx run of an editable checkout compiled kafkatx's
    sources at start (about 60 ms, twice ``import kafkatx`` itself), a cost a user's installed kafkatx does
    not have and the hand-written loop's client (installed by pip, bytecode included) never had.
    """
    import compileall

    done = []
    for src in src_dirs:
        pkg = src / "kafkatx"
        if pkg.is_dir() and compileall.compile_dir(str(pkg), quiet=1):
            done.append(str(pkg))
    return done


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))  # in case kafkatx is not installed editable
    from kafkatx.local import LocalBroker
    from kafkatx.testing import create_topic, delete_topics

    RESULTS.mkdir(parents=True, exist_ok=True)
    logs = RESULTS / "logs"
    logs.mkdir(exist_ok=True)
    notes: list[str] = []
    quix_python = None
    if "5" in args.runs:
        quix_python, note = ensure_quix_venv()
        if note:
            notes.append(note)
            print("# " + note, flush=True)
            args.runs = [r for r in args.runs if r != "5"]

    compiled = byte_compile(
        sorted({(ROOT / "src").resolve(), *(Path(d).resolve() for d in (args.src, args.compare_src) if d)})
    )
    notes.append(f"bytecode written before the runs (as pip does on install) for: {', '.join(compiled) or 'nothing'}")
    machine = machine_info()
    n_main, n_small, parts = args.records, args.small_records, args.partitions
    poisons = sum(1 for i in range(n_main) if is_poison(i, args.poison_every, args.partitions))
    started = time.perf_counter()
    reps: dict[str, list[dict[str, Any]]] = {k: [] for k in args.runs}
    state_dir = Path(tempfile.mkdtemp(prefix="kafkatx-bench-quix-state-"))
    broker_dirs = contextlib.ExitStack()
    data_dir, data_note = broker_data_dir(args.broker_data_dir, broker_dirs)
    notes.append(data_note)
    with broker_dirs, LocalBroker(data_dir=data_dir) as broker, contextlib.ExitStack() as network:
        bs = broker.bootstrap_servers
        runs_bs = bs  # what the measured runs connect to: the broker, or the delay proxy in front of it
        if args.delay_ms > 0:
            from kafka_proxy import KafkaProxy  # bench/ is sys.path[0]

            runs_bs = network.enter_context(KafkaProxy(broker.port, args.delay_ms / 1000.0)).bootstrap_servers
            notes.append(f"the runs reach the broker through a proxy adding {args.delay_ms:g} ms each way")
            print(f"# runs connect through a {args.delay_ms:g} ms-each-way proxy at {runs_bs}", flush=True)
        if args.yield_snapshots:
            notes.append("the embedded broker's snapshot thread ran at nice 19 (--no-yield-snapshots: at its own)")
        snapshots = SnapshotWatcher(broker.data_dir / "kafka.json")
        print(
            f"# broker {bs} (pid {broker.pid}); {n_main:,} records of {args.size} B, {parts} partitions; "
            f"runs {', '.join(f'{k} x{reps_of(k, args)}' for k in args.runs)}",
            flush=True,
        )
        inputs: dict[str, tuple[str, int]] = {}
        if any(RUNS[k]["input"] == "main" for k in args.runs):
            inputs["main"] = ("bench-in", n_main)
        # Runs with failures through retry topics read a copy of their own (below): the shared input is loaded only
        # for the others. Loaded and unread, it made the broker's snapshot of everything it holds a third bigger
        # during runs 4t and 4t0, and that snapshot's CPU is taken from the run (docs/BENCHMARKS.md).
        if any(RUNS[k]["input"] == "main" and not RUNS[k].get("transient") for k in args.runs):
            create_topic(bs, "bench-in", parts)
            loaded_s = preload(bs, "bench-in", n_main, parts, args.size, args.poison_every)
            w = warm_up(bs, "bench-in", n_main)
            print(f"# preloaded {n_main:,} records in {loaded_s:.1f}s; warm-up read in {w:.1f}s", flush=True)
        if any(RUNS[k]["input"] == "small" for k in args.runs):
            inputs["small"] = (create_topic(bs, "bench-in-small", parts), n_small)
            preload(bs, "bench-in-small", n_small, parts, args.size, 0)
        for rep in range(max(reps_of(k, args) for k in args.runs)):
            # Every other repetition runs in reverse order (A B, B A, ...): what drifts over an invocation (the
            # machine's other tenants, the broker's growing snapshot) does not always fall on the same run.
            for k in args.runs if rep % 2 == 0 else list(reversed(args.runs)):
                if rep >= reps_of(k, args):
                    continue
                run = RUNS[k]
                topic, n = inputs[run["input"]]
                tag = f"{k.replace(chr(39), 'p')}-{rep}"  # 2' -> 2p: topic names allow no quote
                out_topic = create_topic(bs, f"bench-out-{tag}", parts)
                dlt_topic = create_topic(bs, f"bench-dlt-{tag}", parts) if run.get("poison") or run.get("dlq") else None
                if run.get("transient"):  # its retry topics are named after its input: a copy of its own per rep
                    topic = create_topic(bs, f"bench-in-{tag}", parts)
                    preload(bs, topic, n, parts, args.size, 0 if run.get("clean") else args.poison_every)
                    warm_up(bs, topic, n)  # read once, as the shared input is (the broker's first read is slower)
                cfg: dict[str, Any] = {
                    "kind": run["kind"],
                    "bootstrap": runs_bs,
                    "input": topic,
                    "output": out_topic,
                    "group": f"bench-{tag}-{uuid.uuid4().hex[:6]}",
                    "records": n,
                    "partitions": parts,
                    "sample_every": args.sample_every,
                    "timeout": args.timeout,
                    "batch": run.get("batch", 1000),
                    "options": dict(run.get("options", {})),
                    "poison": bool(run.get("poison")),
                    "transient": bool(run.get("transient")),
                    "tracing": run.get("tracing") or False,  # True, or the ratio sampled
                    "poison_every": args.poison_every,
                    "shape": run.get("shape", "bytes"),
                    "listener": run.get("listener", "record"),  # "batch": @app.batch_listener
                    # every runner's consumers (workers.py does not import kafkatx for the hand-written loop)
                    "client_config": dict(LocalBroker.client_config),
                }
                if dlt_topic:
                    cfg["options"]["dlq"] = dlt_topic
                if run["kind"] == "quix":
                    cfg["state_dir"] = str(state_dir / tag)
                    cfg["commit_interval"] = args.quix_commit_interval
                    cmd = [str(quix_python), str(HERE / "quix_worker.py"), json.dumps(cfg)]
                else:
                    cmd = [sys.executable, str(HERE / "workers.py"), json.dumps(cfg)]
                src_dir = run.get("src") or args.src
                pythonpath = str(Path(src_dir).resolve()) if src_dir is not None and run["kind"] == "kafkatx" else None
                if args.yield_snapshots:
                    yield_broker_snapshots(broker.pid)
                quiet = wait_for_quiet_broker(broker, others_max=args.busy_limit, timeout=args.quiet_timeout)
                if quiet["others_cores"] > args.busy_limit:
                    print(
                        f"# machine busy: other processes use {quiet['others_cores']:.2f} cores "
                        f"(waited {quiet['waited_s']:.0f}s); measuring anyway, figures will be low",
                        flush=True,
                    )
                print(f"# run {k:>2} (rep {rep + 1}/{reps_of(k, args)}): {run['label']} ...", end="", flush=True)
                meter = LoadMeter(broker.pid)
                result, code, rss, error, cpu_s = run_worker(
                    cmd, logs / f"run-{tag}.log", args.timeout + 60, pythonpath
                )
                load = meter.stop(cpu_s)
                entry: dict[str, Any] = {
                    "rep": rep,
                    "result": result,
                    "exit_code": code,
                    "peak_rss_mib": rss,
                    "process_cpu_s": cpu_s,
                    **load,
                }
                if result is None:
                    entry["error"] = error
                    entry["check"] = {"ok": False}
                    print(f" FAILED\n  {error}", flush=True)
                else:
                    entry["broker_snapshots"] = snapshots.during(result.get("window"))
                    entry["check"] = verify(bs, run, out_topic, dlt_topic, n, args)
                    rate = result["records"] / result["processing_s"]
                    busy = load.get("other_cores", 0.0)
                    print(
                        f" {rate:,.0f} rec/s, {rss:.0f} MiB, exactly-once {'ok' if entry['check']['ok'] else 'FAILED'}"
                        + (f"  [machine busy: other processes used {busy:.2f} cores]" if busy > 0.15 else "")
                        + (f"  [broker snapshot x{entry['broker_snapshots']}]" if entry["broker_snapshots"] else ""),
                        flush=True,
                    )
                    if not entry["check"]["ok"]:
                        print(f"  check: {entry['check']}", flush=True)
                reps[k].append(entry)
                # The run's own topics go (its fresh input copy and retry topics too): the broker's data, and so the
                # snapshot it writes of all of it every few seconds, stays the same size from one run to the next.
                delete_topics(
                    bs,
                    [t for t in (out_topic, dlt_topic) if t] + (topics_of(bs, topic) if run.get("transient") else []),
                )
        snapshots.stop()
    shutil.rmtree(state_dir, ignore_errors=True)
    summary = {k: summarize(v, args.busy_limit) for k, v in reps.items()}
    derived, targets = derive(summary, poisons)
    order = [k for k in args.runs if k in summary]
    print()
    print(table(summary, derived, order))
    for line in details(summary, derived):
        print(line)
    if any(s.get("disturbed") for s in summary.values() if s):
        print(
            "* every repetition of this run had other processes using more than "
            f"{args.busy_limit} cores: its records/s, ratios and latencies are low; compare CPU us/rec instead"
        )
    for t in targets:
        print(
            f"target {t['target']}: {t['value']:.3f} (goal {t['goal']}) {'MET' if t['met'] else 'NOT MET'} - {t['text']}"
        )
    for note in notes:
        print("note: " + note)
    if args.markdown:
        print()
        print(table(summary, derived, order, markdown=True))
        print()
        print(twin_table(summary, order))
    doc = {
        "generated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if argv is None else " ".join(argv),
        "machine": machine,
        "config": {
            "records": n_main,
            "small_records": n_small,
            "partitions": parts,
            "size": args.size,
            "repeat": {k: reps_of(k, args) for k in args.runs},
            "poison_every": args.poison_every,
            "poison_records": poisons,
            "sample_every": args.sample_every,
            "runs": args.runs,
        },
        "runs": {
            k: {"label": RUNS[k]["label"], "summary": summary[k], "derived": derived.get(k, {}), "reps": reps[k]}
            for k in order
        },
        "targets": targets,
        "notes": notes,
        "elapsed_s": time.perf_counter() - started,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nJSON: {args.json}  (total {doc['elapsed_s']:.0f}s)")
    failed = [k for k in order if not summary.get(k) or not summary[k].get("verified")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
