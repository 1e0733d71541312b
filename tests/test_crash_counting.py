"""Attempt counts that survive the process: a record that kills its worker is dead-lettered after max_attempts.

A handler that calls ``os._exit`` (as a segfaulting native library or the OOM
killer would end it) never raises, so no exception is ever counted. kafkatx
counts it through offset-commit metadata instead (kafkatx.rollback.durable):
the batch in flight is claimed with every commit, a claim still standing at
the next start means the process died, the partition is then handled one
record per transaction, and the record that kills the process again is
counted, restart after restart.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

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

    @app.listener(os.environ["SRC"], output=os.environ["OUT"], max_batch_records=20, max_attempts=3, dlq=True)
    def handle(record: Record) -> bytes:
        if record.value == b"poison":
            os._exit(17)  # no exception, no cleanup: the process is simply gone
        return b"out-" + (record.value or b"")
    """
)


def run_worker(
    workdir: Path, env: dict[str, str], bootstrap: str, stop_when: object = None, timeout: float = 60
) -> tuple[int, str]:
    log_path = workdir / f"w-{time.monotonic_ns()}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kafkatx",
                "run",
                "crash_app:app",
                "--bootstrap-servers",
                bootstrap,
                "--instance-id",
                "w",
                "--no-status",
            ],
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
    exits = []
    for _ in range(8):
        code, log = run_worker(workdir, env, kafka.bootstrap_servers, stop_when=lambda: kafka.caught_up(name, src))
        exits.append(code)
        if code != 17:
            break
    # The first crash happens inside a batch: kafkatx cannot tell which record killed the process, so it
    # counts nothing and handles the partition one record per transaction; the poison then kills the
    # process 3 (max_attempts) more times, counted, and the next start dead-letters it without calling the handler.
    assert exits == [17, 17, 17, 17, 0], exits
    counts = Counter(kafka.values(out))
    assert counts == Counter(b"out-" + v for v in values if v != b"poison"), "every other record exactly once"
    dead = kafka.read(src + "-dlt")
    assert [d.value for d in dead] == [b"poison"]
    info = parse_dead_letter_headers(dead[0].headers)
    assert info.exception_fqcn == "kafkatx.errors.ProcessCrashedError"
    assert "died 3 time(s)" in (info.exception_message or "")
    assert info.original_partition == 1 and info.attempts == 3


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
