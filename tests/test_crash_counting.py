"""Attempt counts that survive the process: a record that kills its worker is dead-lettered after max_attempts.

A handler that calls ``os._exit`` (as a segfaulting native library or the OOM
killer would end it) never raises, so no exception is ever counted. kafkatx
counts it through offset-commit metadata instead (kafkatx.rollback.durable):
the batch in flight is claimed with every commit, a claim still standing at
the next start means the process died, the claimed range is then bisected
(each half in one transaction, claimed alone), and once one record alone
kills the process it is counted, restart after restart. Everything outside
the claimed range runs in full batches.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition
from process_helpers import read_until

from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.rollback.durable import decode
from kafkatx.testing import KafkaTestKit, unique_name

pytestmark = pytest.mark.slow

APP = textwrap.dedent(
    """
    import os
    from kafkatx import App, Record

    # Static membership: the restarted worker takes its partitions back at once (the local broker's
    # coordinator can otherwise hold a dead member's partitions for minutes, see docs/BROKERS.md).
    app = App(os.environ["APP_NAME"], consumer_config={
        "session.timeout.ms": 6000, "max.poll.interval.ms": 10000, "heartbeat.interval.ms": 500,
        "group.instance.id": os.environ["APP_NAME"] + "-w"})

    @app.listener(os.environ["SRC"], output=os.environ["OUT"], max_batch_records=20, max_attempts=3, dlq=True, backoff=0)
    def handle(record: Record) -> bytes:
        if record.value == b"poison":
            os._exit(17)  # no exception, no cleanup: the process is simply gone
        return b"out-" + (record.value or b"")
    """
)


BATCH_APP = textwrap.dedent(
    """
    import os, time
    from kafkatx import App, Record
    from kafkatx.events import TransactionCommitted

    app = App(os.environ["APP_NAME"], consumer_config={
        "session.timeout.ms": 6000, "max.poll.interval.ms": 10000, "heartbeat.interval.ms": 500,
        "group.instance.id": os.environ["APP_NAME"] + "-w"})
    SLOW = float(os.environ.get("SLOW", "0"))

    @app.on(TransactionCommitted)
    def committed(event: TransactionCommitted) -> None:
        with open(os.environ["TXLOG"], "a") as f:
            f.write(f"{event.records}\\n")  # the size of each transaction that ran the handler

    @app.listener(os.environ["SRC"], output=os.environ["OUT"], max_batch_records=500)
    def handle(record: Record) -> bytes:
        if record.value == b"stall" and not os.path.exists(os.environ["MARK"]):
            open(os.environ["MARK"], "w").close()
            print("stalling inside a batch", flush=True)
            time.sleep(120)  # SIGKILLed here, with the batch in flight
        if SLOW:
            time.sleep(SLOW)
        return b"out-" + (record.value or b"")
    """
)


def _command(bootstrap: str, app: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kafkatx",
        "run",
        app,
        "--bootstrap-servers",
        bootstrap,
        "--instance-id",
        "w",
        "--no-status",
    ]


def run_worker(
    workdir: Path,
    env: dict[str, str],
    bootstrap: str,
    stop_when: object = None,
    timeout: float = 60,
    app: str = "crash_app:app",
) -> tuple[int, str]:
    log_path = workdir / f"w-{time.monotonic_ns()}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            _command(bootstrap, app),
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                if callable(stop_when) and stop_when():
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(30)
                    break
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return proc.returncode, log_path.read_text()


def committed_with_metadata(bootstrap: str, group: str, topic: str) -> dict[int, tuple[int, str]]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        found = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=10)
        return {tp.partition: (tp.offset, tp.metadata or "") for tp in found if tp.offset >= 0}
    finally:
        consumer.close()


@pytest.fixture
def setup(kafka: KafkaTestKit, tmp_path: Path) -> tuple[KafkaTestKit, Path, dict[str, str], str, str, str]:
    (tmp_path / "crash_app.py").write_text(APP)
    (tmp_path / "batch_app.py").write_text(BATCH_APP)
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    name = unique_name("crash")
    env = {**os.environ, "APP_NAME": name, "SRC": src, "OUT": out, "PYTHONUNBUFFERED": "1"}
    return kafka, tmp_path, env, name, src, out


@pytest.mark.timeout(300)
def test_a_record_that_kills_the_process_is_dead_lettered_after_max_attempts_crashes(setup: tuple) -> None:  # type: ignore[type-arg]
    kafka, workdir, env, name, src, out = setup
    values = [b"v%d" % i for i in range(60)]
    values[33] = b"poison"  # odd indexes go to partition 1: offset 16 of its 30 records
    kafka.produce(src, [{"value": v, "partition": i % 2} for i, v in enumerate(values)])
    exits, logs = [], []
    for _ in range(12):
        code, log = run_worker(workdir, env, kafka.bootstrap_servers, stop_when=lambda: kafka.caught_up(name, src))
        exits.append(code)
        logs.append(log)
        if code != 17:
            break
    # The first crash happens inside a batch: kafkatx cannot tell which record killed the process, so it counts
    # nothing and bisects the batch that was in flight; each later crash inside a half narrows the range, until
    # the poison alone kills the process 3 (max_attempts) times, counted, and the next start dead-letters it
    # without calling the handler.
    text = "".join(logs)
    ranges = [(int(a), int(b)) for a, b in re.findall(r"\[1\] died while handling offsets (\d+)\.\.(\d+)", text)]
    assert ranges and ranges[0][1] - ranges[0][0] + 1 == 20, f"the first claim names the batch in flight: {ranges}"
    assert all(a <= 16 <= b for a, b in ranges), f"every range searched holds the poison: {ranges}"
    assert all(a[0] <= b[0] and b[1] <= a[1] and b != a for a, b in zip(ranges, ranges[1:])), f"narrowing: {ranges}"
    assert len(ranges) <= math.ceil(math.log2(20)), f"about log2(batch) crashes to find it: {ranges}"
    counted = [int(n) for n in re.findall(r"\[1\] died while handling offset 16 \((\d+) failed", text)]
    assert counted == [1, 2, 3], "only the crashes with the poison alone in flight are counted against it"
    assert exits == [17] * (len(ranges) + 3) + [0], exits
    counts = Counter(kafka.values(out))
    assert counts == Counter(b"out-" + v for v in values if v != b"poison"), "every other record exactly once"
    dead = kafka.read(src + "-dlt")
    assert [d.value for d in dead] == [b"poison"]
    info = parse_dead_letter_headers(dead[0].headers)
    assert info.exception_fqcn == "kafkatx.errors.ProcessCrashedError"
    assert "died 3 time(s)" in (info.exception_message or "")
    assert info.original_partition == 1 and info.attempts == 3


def _kill_inside_a_batch(workdir: Path, env: dict[str, str], bootstrap: str) -> None:
    """Run the batch app until its handler stalls on the record b"stall", then SIGKILL it there."""
    proc = subprocess.Popen(
        _command(bootstrap, "batch_app:app"),
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        read_until(proc, "stalling inside a batch", timeout=60)
    finally:
        proc.kill()
        proc.wait(10)


def _batch_env(env: dict[str, str], workdir: Path, run: str, **extra: str) -> dict[str, str]:
    return {**env, "TXLOG": str(workdir / f"tx-{run}.log"), "MARK": str(workdir / "stalled"), **extra}


def _transaction_sizes(workdir: Path, run: str) -> list[int]:
    path = workdir / f"tx-{run}.log"
    return [int(n) for n in path.read_text().split()] if path.exists() else []


@pytest.mark.timeout(180)
def test_after_a_sigkill_mid_batch_only_the_batch_in_flight_is_bisected_and_the_rest_runs_in_full_batches(
    setup: tuple,  # type: ignore[type-arg]
) -> None:
    kafka, workdir, env, name, src, out = setup
    values = [b"v%d" % i for i in range(4000)]
    values[1200] = b"stall"  # partition 0 (even indexes), offset 600 of its 2,000 records
    kafka.produce(src, [{"value": v, "partition": i % 2} for i, v in enumerate(values)])
    _kill_inside_a_batch(workdir, _batch_env(env, workdir, "1"), kafka.bootstrap_servers)
    handled_before = sum(_transaction_sizes(workdir, "1"))
    assert handled_before < len(values) - 1000, "killed with most of the records still waiting"

    code, log = run_worker(
        workdir,
        _batch_env(env, workdir, "2"),
        kafka.bootstrap_servers,
        stop_when=lambda: kafka.caught_up(name, src),
        app="batch_app:app",
    )
    assert code == 0, log[-3000:]
    claims = [(int(a), int(b)) for a, b in re.findall(r"died while handling offsets (\d+)\.\.(\d+)", log)]
    assert claims and all(b - a + 1 == 500 for a, b in claims), f"each claim names a batch, no more: {claims}"
    sizes = _transaction_sizes(workdir, "2")
    # Each claimed batch costs about log2(500) + 1 transactions of halving sizes; everything after it runs in
    # full batches of up to 500 (a poll can come back short, hence the slack). One record per transaction over
    # max_batch_records would be 1,000 transactions here.
    searching = len(claims) * (math.ceil(math.log2(500)) + 1)
    assert len(sizes) <= searching + 3 * math.ceil(sum(sizes) / 500) + 4, sizes
    assert max(sizes) == 500, f"full-size transactions again: {sizes}"
    assert sum(s for s in sizes if s == 1) <= len(claims) * 4, f"a handful of one-record transactions: {sizes}"
    assert Counter(kafka.values(out)) == Counter(b"out-" + v for v in values), "every record exactly once"


@pytest.mark.timeout(180)
def test_a_clean_stop_in_the_middle_of_the_search_leaves_no_careful_mode_to_the_next_run(
    kafka: KafkaTestKit, tmp_path: Path
) -> None:
    (tmp_path / "batch_app.py").write_text(BATCH_APP)
    src, out = kafka.topic(partitions=1), kafka.topic(partitions=1)
    name = unique_name("crash")
    env = {**os.environ, "APP_NAME": name, "SRC": src, "OUT": out, "PYTHONUNBUFFERED": "1"}
    values = [b"v%d" % i for i in range(1500)]
    values[300] = b"stall"
    kafka.produce(src, [{"value": v} for v in values])
    _kill_inside_a_batch(tmp_path, _batch_env(env, tmp_path, "1"), kafka.bootstrap_servers)

    # The next run searches the batch that was in flight, slowly; it is stopped cleanly once the first half has
    # committed (the second half's line is printed after it), in the middle of the search.
    proc = subprocess.Popen(
        _command(kafka.bootstrap_servers, "batch_app:app"),
        cwd=tmp_path,
        env=_batch_env(env, tmp_path, "2", SLOW="0.01"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[str] = []
    try:
        read_until(proc, r"died while handling offsets", timeout=60, seen=seen)
        read_until(proc, r"in one transaction \(crash search\)", timeout=60, seen=seen)
        read_until(proc, r"in one transaction \(crash search\)", timeout=60, seen=seen)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    ((offset, metadata),) = committed_with_metadata(kafka.bootstrap_servers, name, src).values()
    state = decode(metadata, offset)
    assert state is not None and not state.inflight and state.inflight_until is None, metadata
    assert offset < len(values), "stopped before the end"

    code, log = run_worker(
        tmp_path,
        _batch_env(env, tmp_path, "3"),
        kafka.bootstrap_servers,
        stop_when=lambda: kafka.caught_up(name, src),
        app="batch_app:app",
    )
    assert code == 0
    assert "died while handling" not in log and "crash search" not in log, "no careful handling carried over"
    assert max(_transaction_sizes(tmp_path, "3")) == 500
    assert Counter(kafka.values(out)) == Counter(b"out-" + v for v in values), "every record exactly once"


@pytest.mark.timeout(120)
def test_a_clean_stop_withdraws_its_claim_and_the_next_start_batches_at_once(setup: tuple) -> None:  # type: ignore[type-arg]
    kafka, workdir, env, name, src, out = setup
    kafka.produce(src, [{"value": b"a%d" % i, "partition": i % 2} for i in range(40)])
    code, _ = run_worker(workdir, env, kafka.bootstrap_servers, stop_when=lambda: kafka.caught_up(name, src))
    assert code == 0
    committed = committed_with_metadata(kafka.bootstrap_servers, name, src)
    assert committed, "offsets were committed"
    for partition, (offset, metadata) in committed.items():
        state = decode(metadata, offset)
        assert state is not None and not state.inflight, (
            f"partition {partition}: the claim was withdrawn ({metadata!r})"
        )
    kafka.produce(src, [{"value": b"b%d" % i, "partition": i % 2} for i in range(40)])
    code, log = run_worker(workdir, env, kafka.bootstrap_servers, stop_when=lambda: kafka.caught_up(name, src))
    assert code == 0
    assert "died while handling" not in log, "a clean stop is not a crash"
    assert len(kafka.values(out)) == 80


@pytest.mark.timeout(180)
def test_a_clean_stop_after_a_crash_while_idle_withdraws_the_claim_it_found(setup: tuple) -> None:  # type: ignore[type-arg]
    """Killed while idle, the worker leaves its last claim standing; the next start reports it, and its clean stop
    must withdraw it even though that start handled nothing: the start after that is no crash recovery."""
    kafka, workdir, env, name, src, out = setup
    kafka.produce(src, [{"value": b"a%d" % i, "partition": i % 2} for i in range(20)])
    idle = subprocess.Popen(_command(kafka.bootstrap_servers, "crash_app:app"), cwd=workdir, env=env)
    try:
        deadline = time.monotonic() + 60
        while not kafka.caught_up(name, src) and idle.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kafka.caught_up(name, src), "the first run handled everything"
    finally:
        idle.kill()  # SIGKILL while idle: its claims stand
        idle.wait(10)
    proc = subprocess.Popen(
        _command(kafka.bootstrap_servers, "crash_app:app"),
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        read_until(proc, r"died while handling offsets", timeout=60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    for partition, (offset, metadata) in committed_with_metadata(kafka.bootstrap_servers, name, src).items():
        state = decode(metadata, offset)
        assert state is not None and not state.inflight, f"partition {partition}: claim withdrawn ({metadata!r})"
    kafka.produce(src, [{"value": b"b%d" % i, "partition": i % 2} for i in range(20)])
    code, log = run_worker(workdir, env, kafka.bootstrap_servers, stop_when=lambda: kafka.caught_up(name, src))
    assert code == 0
    assert "died while handling" not in log and "crash search" not in log, log[-3000:]
    expected = [b"out-%s%d" % (run, i) for run in (b"a", b"b") for i in range(20)]
    assert Counter(kafka.values(out)) == Counter(expected), "every record exactly once"
