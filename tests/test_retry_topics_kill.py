"""``retry="topics"`` through a SIGKILL (issue 40): a worker killed while it handles a record taken from a retry
topic, with other records still waiting there, and started again under the same id, commits every output exactly
once; no record's attempt number ever goes back, and nothing is dead-lettered."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from process_helpers import read_until
from test_crash_counting import _command, run_worker

from kafkatx.testing import KafkaTestKit, unique_name

pytestmark = pytest.mark.slow

APP = textwrap.dedent(
    """
    import os, time
    from kafkatx import App, Record

    app = App(os.environ["APP_NAME"], consumer_config={
        "session.timeout.ms": 6000, "max.poll.interval.ms": 10000, "heartbeat.interval.ms": 500,
        "group.instance.id": os.environ["APP_NAME"] + "-w"})

    class Transient(Exception):
        pass

    @app.listener(os.environ["SRC"], output=os.environ["OUT"], retry="topics", ordering="none",
                  max_attempts=4, backoff=1.0, dlq=True)
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


@pytest.mark.timeout(240)
def test_a_sigkill_with_records_in_retry_then_a_restart_commits_each_output_once(
    kafka: KafkaTestKit, tmp_path: Path
) -> None:
    (tmp_path / "retry_app.py").write_text(APP)
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    name = unique_name("retry-kill")
    calls, mark = tmp_path / "calls.log", tmp_path / "stalled"
    env = {**os.environ, "APP_NAME": name, "SRC": src, "OUT": out, "CALLS": str(calls), "MARK": str(mark)}
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

    code, log = run_worker(
        tmp_path,
        env,
        kafka.bootstrap_servers,
        stop_when=lambda: len(kafka.read(out)) >= len(values) and kafka.caught_up(name, src),
        timeout=120,
        app="retry_app:app",
    )
    assert code == 0, log[-3000:]
    outputs = Counter(kafka.values(out))
    assert outputs == Counter(b"out-" + v.encode() for v in values), "every output exactly once"
    seen = _calls(calls)
    for value in values:
        attempts = seen[value]
        assert attempts == sorted(attempts), f"{value}: an attempt number went back: {attempts}"
        assert attempts[-1] == (3 if value.startswith("flaky") else 1), f"{value}: {attempts}"
    assert kafka.read(src + "-dlt") == []
