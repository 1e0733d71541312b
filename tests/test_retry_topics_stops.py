"""``retry="topics"`` through every kind of stop (issue 40): a SIGKILL while a record from a retry topic is being
handled, a rebalance with records in retry, and ``--workers``. Each time every output commits exactly once, no
record's attempt number ever goes back, and nothing is dead-lettered."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from confluent_kafka import Consumer
from process_helpers import read_until
from test_crash_counting import _command, run_worker

from kafkatx import App, Record
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for

pytestmark = pytest.mark.slow

APP = textwrap.dedent(
    """
    import os, time
    from kafkatx import App, Record

    app = App(os.environ["APP_NAME"], consumer_config={
        "session.timeout.ms": 6000, "max.poll.interval.ms": 10000, "heartbeat.interval.ms": 500})

    class Transient(Exception):
        pass

    @app.listener(os.environ["SRC"], output=os.environ["OUT"], retry="topics", ordering=os.environ["ORDERING"],
                  max_attempts=4, backoff=float(os.environ.get("BACKOFF", "1.0")), dlq=True)
    def handle(record: Record) -> bytes:
        value = record.value or b""
        with open(os.environ["CALLS"], "a") as calls:
            calls.write(f"{value.decode()} {record.attempt}\\n")
        if value.startswith(b"flaky"):
            if value == b"flaky-10" and record.attempt == 2 and not os.path.exists(os.environ["MARK"]):
                open(os.environ["MARK"], "w").close()
                print("stalling in a retry", flush=True)
                time.sleep(120)  # SIGKILLed here: a hop's transaction open, other records waiting in retry
            if record.attempt < 3:
                raise Transient(f"attempt {record.attempt}")
        return b"out-" + value
    """
)


def _calls(path: Path) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = defaultdict(list)
    for line in path.read_text().splitlines():
        value, attempt = line.rsplit(" ", 1)
        seen[value].append(int(attempt))
    return seen


def _restart_until_done(kafka: KafkaTestKit, tmp_path: Path, env: dict[str, str], values: list[str]) -> None:
    """Start the App of ``env`` again, under the same id, until every input is committed: each output once, no
    attempt number gone back, each flaky record done at attempt 3, nothing dead-lettered."""
    name, src, out = env["APP_NAME"], env["SRC"], env["OUT"]
    code, log = run_worker(
        tmp_path,
        env,
        kafka.bootstrap_servers,
        stop_when=lambda: len(kafka.read(out)) >= len(values) and kafka.caught_up(name, src),
        timeout=120,
        app="retry_app:app",
    )
    assert code == 0, log[-3000:]
    assert Counter(kafka.values(out)) == Counter(b"out-" + v.encode() for v in values), "every output exactly once"
    _check_attempts(_calls(Path(env["CALLS"])), values)
    assert kafka.read(src + "-dlt") == []


@pytest.mark.timeout(240)
def test_a_sigkill_with_records_in_retry_then_a_restart_commits_each_output_once(
    kafka: KafkaTestKit, tmp_path: Path
) -> None:
    (tmp_path / "retry_app.py").write_text(APP)
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    name = unique_name("retry-kill")
    calls, mark = tmp_path / "calls.log", tmp_path / "stalled"
    env = {**os.environ, "APP_NAME": name, "SRC": src, "OUT": out, "CALLS": str(calls), "MARK": str(mark)}
    env["ORDERING"] = "none"  # key order through a SIGKILL: test_retry_key_order_crash.py
    env["PYTHONUNBUFFERED"] = "1"
    values = [f"flaky-{i}" if i % 5 == 0 else f"ok-{i}" for i in range(40)]
    kafka.produce(src, [{"value": v.encode(), "partition": i % 2} for i, v in enumerate(values)])

    proc = subprocess.Popen(
        _command(kafka.bootstrap_servers, "retry_app:app"),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        read_until(proc, "stalling in a retry", timeout=90)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    before = _calls(calls)
    assert before["flaky-10"] == [1, 2], before["flaky-10"]
    assert any(v.startswith("flaky") and before[v] == [1] for v in values), "killed with records still in retry"

    _restart_until_done(kafka, tmp_path, env, values)


@pytest.mark.timeout(240)
def test_a_sigkill_after_the_open_transaction_wrote_a_hop_then_a_restart_runs_every_retry(
    kafka: KafkaTestKit, tmp_path: Path
) -> None:
    """The dying transaction had written a hop (flaky-0's third attempt) when the process was killed. The restart
    aborts it, and the same producer (same transactional id) writes the next hops behind its ABORT marker. On the
    embedded broker a read_committed fetch that starts past that marker skips them (docs/BROKERS.md): the retry
    partition is fetched again, and every retry runs once."""
    from confluent_kafka import TopicPartition

    from kafkatx.retry_topics.headers import ATTEMPTS

    (tmp_path / "retry_app.py").write_text(APP)
    src, out = kafka.topic(partitions=1), kafka.topic(partitions=1)
    name = unique_name("retry-kill-hop")
    calls, mark = tmp_path / "calls.log", tmp_path / "stalled"
    env = {**os.environ, "APP_NAME": name, "SRC": src, "OUT": out, "CALLS": str(calls), "MARK": str(mark)}
    env.update(ORDERING="none", PYTHONUNBUFFERED="1", BACKOFF="0")  # one batch of retries: flaky-0 before flaky-10
    values = [f"flaky-{i}" if i % 5 == 0 else f"ok-{i}" for i in range(20)]
    kafka.produce(src, [{"value": v.encode(), "partition": 0} for v in values])

    proc = subprocess.Popen(
        _command(kafka.bootstrap_servers, "retry_app:app"),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    uncommitted = Consumer(
        {
            "bootstrap.servers": kafka.bootstrap_servers,
            "group.id": name + "-peek",
            "isolation.level": "read_uncommitted",
        }
    )
    try:
        read_until(proc, "stalling in a retry", timeout=90)
        uncommitted.assign([TopicPartition(src + "-retry", 0, 0)])

        def third_attempt_hop_written() -> bool:
            msgs = uncommitted.consume(100, 0.2)
            return any(dict(m.headers() or []).get(ATTEMPTS) == (3).to_bytes(4, "big") for m in msgs if not m.error())

        wait_for(third_attempt_hop_written, 30, message="flaky-0's next hop on the broker, in the open transaction")
    finally:
        uncommitted.close()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    before = _calls(calls)
    assert before["flaky-0"] == [1, 2] and before["flaky-10"] == [1, 2], before

    _restart_until_done(kafka, tmp_path, env, values)


class Transient(Exception):
    """A failure worth retrying."""


def _check_attempts(seen: dict[str, list[int]], values: list[str]) -> None:
    for value in values:
        attempts = seen[value]
        assert attempts == sorted(attempts), f"{value}: an attempt number went back: {attempts}"
        assert attempts[-1] == (3 if value.startswith("flaky") else 1), f"{value}: {attempts}"


@pytest.mark.timeout(180)
def test_a_rebalance_with_records_in_retry_moves_them_with_their_partitions_and_does_each_once(
    kafka: KafkaTestKit,
) -> None:
    """A second member joins while records wait in retry (their partitions move to it), then the first leaves."""
    src, out = kafka.topic(partitions=4), kafka.topic(partitions=4)
    values = [f"flaky-{i}" if i % 3 == 0 else f"ok-{i}" for i in range(80)]  # on every partition
    kafka.produce(src, [{"value": v.encode(), "partition": i % 4} for i, v in enumerate(values)])
    name = unique_name("retry-rebalance")
    seen: dict[str, list[int]] = defaultdict(list)
    retried_by: set[str] = set()  # the members that handled a record taken from a retry topic
    lock = threading.Lock()

    def member(instance: str) -> App:
        app = App(name, bootstrap_servers=kafka.bootstrap_servers, instance_id=instance)

        @app.listener(src, output=out, retry="topics", ordering="none", max_attempts=4, backoff=1.5, dlq=True)
        def handle(record: Record) -> bytes:
            value = (record.value or b"").decode()
            with lock:
                seen[value].append(record.attempt)
                if record.attempt > 1:
                    retried_by.add(instance)
            if value.startswith("flaky") and record.attempt < 3:
                raise Transient(f"attempt {record.attempt}")
            return b"out-" + value.encode()

        return app

    first, second = member("a"), member("b")
    with running(first):
        wait_for(lambda: len(kafka.read(src + "-retry")) >= 10, 30, message="records waiting in retry")
        with running(second):
            wait_for(lambda: "b" in retried_by, 30, message="the second member handles records from retry")
        # the first leaves too (a clean stop): the second left first here, so the first takes every partition back
        wait_for(lambda: len(kafka.read(out)) >= len(values), 60, message="every output")
        wait_for(lambda: kafka.caught_up(first.group_id, src), 30, message="every input offset committed")
    assert Counter(kafka.values(out)) == Counter(b"out-" + v.encode() for v in values), "every output exactly once"
    _check_attempts(seen, values)
    assert kafka.read(src + "-dlt") == []


@pytest.mark.timeout(180)
def test_under_workers_records_in_retry_are_handled_once_by_whichever_worker_owns_their_partition(
    kafka: KafkaTestKit, tmp_path: Path
) -> None:
    (tmp_path / "retry_app.py").write_text(APP)
    src, out = kafka.topic(partitions=4), kafka.topic(partitions=4)
    name = unique_name("retry-workers")
    calls = tmp_path / "calls.log"
    env = {**os.environ, "APP_NAME": name, "SRC": src, "OUT": out, "CALLS": str(calls), "PYTHONUNBUFFERED": "1"}
    env["MARK"], env["ORDERING"] = str(tmp_path / "no-stall"), "key"
    (tmp_path / "no-stall").touch()  # no call stalls here
    values = [f"flaky-{i}" if i % 5 == 0 else f"ok-{i}" for i in range(80)]
    kafka.produce(src, [{"value": v.encode(), "partition": i % 4} for i, v in enumerate(values)])
    command = [sys.executable, "-m", "kafkatx", "run", "retry_app:app", "--workers", "2", "--no-status"]
    command += ["--instance-id", "rw", "--bootstrap-servers", kafka.bootstrap_servers]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: len(kafka.read(out)) >= len(values), 90, message="every output")
        wait_for(lambda: kafka.caught_up(name, src), 30, message="every input offset committed")
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest[-3000:]
    assert Counter(kafka.values(out)) == Counter(b"out-" + v.encode() for v in values), "every output exactly once"
    _check_attempts(_calls(calls), values)
    assert kafka.read(src + "-dlt") == []


CRASH_APP = textwrap.dedent(
    """
    import os
    from kafkatx import App, Record

    app = App(os.environ["APP_NAME"], consumer_config={
        "session.timeout.ms": 6000, "max.poll.interval.ms": 10000, "heartbeat.interval.ms": 500})

    class Transient(Exception):
        pass

    @app.listener(os.environ["SRC"], output=os.environ["OUT"], retry="topics", max_attempts=3, backoff=0.2, dlq=True)
    def handle(record: Record) -> bytes:
        if record.value == b"deadly":
            if record.attempt == 1:
                raise Transient("the first call fails: the record goes to the retry topic")
            os._exit(17)  # read back from the retry topic, it kills the process: no exception, no cleanup
        return b"out-" + (record.value or b"")
    """
)


@pytest.mark.timeout(300)
def test_a_record_from_a_retry_topic_that_kills_the_process_is_dead_lettered_naming_its_input_record(
    kafka: KafkaTestKit, tmp_path: Path
) -> None:
    from kafkatx.dlq.headers import parse_dead_letter_headers

    (tmp_path / "crash_retry_app.py").write_text(CRASH_APP)
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    name = unique_name("retry-crash")
    env = {**os.environ, "APP_NAME": name, "SRC": src, "OUT": out, "PYTHONUNBUFFERED": "1"}
    values = [b"v%d" % i for i in range(20)]
    values[7] = b"deadly"  # partition 1, offset 3
    kafka.produce(src, [{"value": v, "key": b"k%d" % i, "partition": i % 2} for i, v in enumerate(values)])
    exits = []
    for _ in range(8):
        code, log = run_worker(
            tmp_path,
            env,
            kafka.bootstrap_servers,
            stop_when=lambda: kafka.caught_up(name, src) and len(kafka.read(src + "-dlt")) == 1,
            app="crash_retry_app:app",
        )
        exits.append(code)
        if code != 17:
            break
    assert exits[-1] == 0 and set(exits[:-1]) == {17}, exits
    assert Counter(kafka.values(out)) == Counter(b"out-" + v for v in values if v != b"deadly"), "the rest once"
    dead = kafka.read(src + "-dlt")
    assert [d.value for d in dead] == [b"deadly"] and dead[0].key == b"k7"
    info = parse_dead_letter_headers(dead[0].headers)
    assert (info.original_topic, info.original_partition, info.original_offset) == (src, 1, 3), info
    assert info.exception_fqcn == "kafkatx.errors.ProcessCrashedError"
    topics = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": name})
    try:
        assert src + "-retry-dlt" not in topics.list_topics(timeout=10).topics, "no dead letter of the retry topic"
    finally:
        topics.close()
    crashes = [int(n) for n in re.findall(r"-retry\[1\] died while handling offset 0 \((\d+) failed", log)]
    assert crashes == [3], f"the third crash of the record alone was counted before it was dead-lettered: {crashes}"


def test_two_groups_reading_one_topic_share_its_retry_topics_and_each_handles_only_its_own_hops(
    kafka: KafkaTestKit,
) -> None:
    """Two services (consumer groups) on one input topic, both with retry topics: the retry topics are named after
    the input topic, so both read every hop; each handles its own group's and lets the other's pass."""
    src = kafka.topic(partitions=2)
    outs = {"a": kafka.topic(partitions=2), "b": kafka.topic(partitions=2)}
    values = [b"flaky-%d" % i if i % 4 == 0 else b"ok-%d" % i for i in range(24)]
    kafka.produce(src, [{"value": v, "key": b"k%d" % i, "partition": i % 2} for i, v in enumerate(values)])
    apps = {}
    for service, out in outs.items():
        app = App(unique_name(f"svc-{service}"), bootstrap_servers=kafka.bootstrap_servers, instance_id=service)

        @app.listener(src, output=out, retry="topics", max_attempts=3, backoff=0.3, dlq=True)
        def handle(record: Record) -> bytes:
            if (record.value or b"").startswith(b"flaky") and record.attempt < 2:
                raise Transient("the first attempt fails")
            return b"out-" + (record.value or b"")

        apps[service] = app
    with running(apps["a"]), running(apps["b"]):
        for service, out in outs.items():
            wait_for(lambda out=out: len(kafka.read(out)) >= len(values), 60, message=f"every output of {service}")
        for service, app in apps.items():
            wait_for(lambda app=app: _own_hops_committed(kafka, app.group_id, src), 30, message=f"{service}'s hops")
    for service, out in outs.items():
        assert Counter(kafka.values(out)) == Counter(b"out-" + v for v in values), f"{service}: each output once"
    assert kafka.read(src + "-dlt") == []


def _own_hops_committed(kafka: KafkaTestKit, group: str, topic: str) -> bool:
    """Every hop ``group`` wrote to ``topic``'s retry topic consumed and committed by it (and so every hop of another
    group before them read too; one after its own last hop may wait unread: nothing of this group wakes it)."""
    from kafkatx.dlq.headers import parse_dead_letter_headers

    last: dict[int, int] = {}
    for hop in kafka.read(topic + "-retry"):
        if parse_dead_letter_headers(hop.headers).consumer_group == group:
            last[hop.partition] = hop.offset
    committed = kafka.committed(group, topic + "-retry")
    return bool(last) and all(committed.get(p, 0) > offset for p, offset in last.items())
