"""``kafkatx run --workers N``: worker processes under a supervisor (issue 13, item 4)."""

from __future__ import annotations

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
from process_helpers import ChildOutput

from kafkatx.testing import KafkaTestKit, unique_name, wait_for

pytestmark = pytest.mark.slow

APP = textwrap.dedent(
    """
    import os
    from kafkatx import App

    if os.environ.get("BROKEN_AT_START"):
        raise RuntimeError("this worker cannot start")
    app = App(os.environ["APP_NAME"], consumer_config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500})

    @app.listener(os.environ["SRC"], output=os.environ["OUT"], max_batch_records=50,
                  max_attempts=int(os.environ.get("MAX_ATTEMPTS", "3")), dlq=os.environ.get("DLQ") == "1")
    def handle(record):
        if record.value == b"poison":
            os._exit(17)  # as a segfault or the OOM killer would end it: no exception, no cleanup
        return b"out-" + record.value
    """
)


# `kafkatx run` with the supervisor's first restart back-off at 0.1 s instead of 1 s (it doubles per counted
# crash: 1+2+4+8 s of a crash loop's 5 crashes were waits). What is asserted (which crashes are counted, the
# crash-loop limit of 5 within 60 s, the messages) does not depend on it; test_cli's unreachable-broker tests
# set _METADATA_TIMEOUT the same way.
FAST_RESTARTS = textwrap.dedent(
    """
    import sys
    import kafkatx.cli.supervisor
    from kafkatx.cli import main

    kafkatx.cli.supervisor._FIRST_BACKOFF_S = 0.1
    sys.exit(main(sys.argv[1:]))
    """
)


def supervisor(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    (tmp_path / "sup_app.py").write_text(APP)
    return subprocess.Popen(
        [sys.executable, "-c", FAST_RESTARTS, "run", "sup_app:app", "--no-status", *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_workers_share_the_partitions_and_a_killed_one_comes_back_under_its_id(
    kafka: KafkaTestKit, tmp_path: Path
) -> None:
    src, out = kafka.topic(partitions=4), kafka.topic(partitions=4)
    name = unique_name("sup")
    env = {"APP_NAME": name, "SRC": src, "OUT": out}
    proc = supervisor(
        tmp_path, env, "--workers", "2", "--instance-id", "sup", "--bootstrap-servers", kafka.bootstrap_servers
    )
    output = ChildOutput(proc)
    try:
        pids: dict[str, int] = {}
        assigned: set[str] = set()
        deadline = time.monotonic() + 60
        # Both workers own partitions before the records come: else a slow start leaves sup-0 without any, the
        # other worker copies everything, and sup-0 is killed before it made progress.
        while len(pids) < 2 or assigned != {"sup-0", "sup-1"}:
            line = output.next_line(deadline)
            if line is None:
                break
            m = re.search(r"worker (sup-\d) started \(pid (\d+)\)", line)
            if m:
                pids[m.group(1)] = int(m.group(2))
            m = re.search(r"\[(sup-\d)\] .* assigned \S+\[\d+\]", line)  # not "assigned nothing"
            if m:
                assigned.add(m.group(1))
        assert set(pids) == {"sup-0", "sup-1"} and assigned == {"sup-0", "sup-1"}, output.text()
        kafka.produce(src, [{"value": b"a%d" % i, "partition": i % 4} for i in range(400)])
        wait_for(lambda: kafka.caught_up(name, src), 60, message="the two workers caught up")
        os.kill(pids["sup-0"], signal.SIGKILL)
        kafka.produce(src, [{"value": b"b%d" % i, "partition": i % 4} for i in range(400)])
        wait_for(lambda: kafka.caught_up(name, src), 60, message="caught up again after the kill")
    finally:
        proc.send_signal(signal.SIGTERM)
        output.rest(timeout=60)
    assert proc.returncode == 0, output.text()
    # It had committed records before the kill: a crash after progress, restarted without counting.
    assert "worker sup-0 exited with code -9 after making progress; restarting it under the same id" in output.text()
    assert Counter(kafka.values(out)) == Counter(
        b"out-" + v for v in [b"a%d" % i for i in range(400)] + [b"b%d" % i for i in range(400)]
    ), "exactly once"


def test_a_crash_loop_ends_the_run_with_one_line(kafka: KafkaTestKit, tmp_path: Path) -> None:
    env = {"APP_NAME": unique_name("loop"), "SRC": kafka.topic(), "OUT": kafka.topic(), "BROKEN_AT_START": "1"}
    proc = supervisor(
        tmp_path, env, "--workers", "1", "--instance-id", "loop", "--bootstrap-servers", kafka.bootstrap_servers
    )
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 1, out
    assert "worker loop-0 crashed 5 times within 60s" in out and "giving up" in out


def test_a_configuration_error_is_not_restarted(kafka: KafkaTestKit, tmp_path: Path) -> None:
    env = {"APP_NAME": unique_name("cfg"), "SRC": kafka.topic(), "OUT": kafka.topic(), "MAX_ATTEMPTS": "0"}
    proc = supervisor(tmp_path, env, "--workers", "2", "--bootstrap-servers", kafka.bootstrap_servers)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 78, out
    assert "configuration error" in out and "not restarting" in out


@pytest.mark.timeout(180)
def test_a_record_that_kills_its_worker_is_dead_lettered_after_max_attempts_restarts(
    kafka: KafkaTestKit, tmp_path: Path
) -> None:
    """Issue 13: the supervisor restarts the worker the poison record kills, under its id; the crash guard counts
    the crashes with the committed offsets; after max_attempts counted crashes the record is dead-lettered and the
    partition moves on, before the supervisor's crash-loop limit (5 within 60 s) gives up."""
    from kafkatx.dlq.headers import parse_dead_letter_headers

    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    name = unique_name("poison")
    values = [b"v%d" % i for i in range(60)]
    values[33] = b"poison"  # partition 1, offset 16
    kafka.produce(src, [{"value": v, "partition": i % 2} for i, v in enumerate(values)])
    env = {"APP_NAME": name, "SRC": src, "OUT": out, "DLQ": "1"}
    proc = supervisor(
        tmp_path, env, "--workers", "1", "--instance-id", "poison", "--bootstrap-servers", kafka.bootstrap_servers
    )
    try:
        wait_for(lambda: kafka.caught_up(name, src), 120, interval=0.5, message="the poison record's offset committed")
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    # The search for the record narrows (about log2(max_batch_records=50) crashes), then max_attempts=3 crashes of
    # the record alone. Crashes after progress (the search narrowed, or the other partition committed records
    # before the crash) are restarted at once and not counted towards the crash-loop limit, which never hits.
    restarts = output.count("worker poison-0 exited with code 17")
    assert 1 + 3 <= restarts <= 1 + 7 + 3, output
    assert "after making progress" in output, output
    assert "giving up" not in output
    assert Counter(kafka.values(out)) == Counter(b"out-" + v for v in values if v != b"poison"), "the rest exactly once"
    dead = kafka.read(src + "-dlt")
    assert [d.value for d in dead] == [b"poison"]
    info = parse_dead_letter_headers(dead[0].headers)
    assert info.exception_fqcn == "kafkatx.errors.ProcessCrashedError" and info.attempts == 3


def test_under_workers_each_text_log_line_names_its_worker(kafka: KafkaTestKit, tmp_path: Path) -> None:
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    name = unique_name("sup-log")
    env = {"APP_NAME": name, "SRC": src, "OUT": out}
    proc = supervisor(
        tmp_path, env, "--workers", "2", "--instance-id", "wlog", "--bootstrap-servers", kafka.bootstrap_servers
    )
    started: set[str] = set()
    output = ChildOutput(proc)
    try:
        deadline = time.monotonic() + 60
        while started != {"wlog-0", "wlog-1"}:
            line = output.next_line(deadline)
            if line is None:
                break
            m = re.search(r" \[(wlog-\d)\] INFO +kafkatx\.app: app .* started", line)
            if m:
                started.add(m.group(1))
    finally:
        proc.send_signal(signal.SIGTERM)
        output.rest(timeout=60)
    assert started == {"wlog-0", "wlog-1"}, output.text()
    worker_lines = [line for line in output.lines if "kafkatx.container" in line]
    assert worker_lines and all(re.search(r" \[wlog-\d\] ", line) for line in worker_lines), "".join(worker_lines)
