"""Batch listeners and a process that dies (issue 41): a batch that kills the process is found by the crash search
(listener/failure/crash_guard.py, as for record listeners), and a SIGKILL in the middle of poison isolation loses
and doubles nothing. Real processes (``kafkatx run``) against the local broker, killed for real. The same
one-record transactions find the record whose output the broker refused at commit (in process)."""

from __future__ import annotations

import os
import re
import signal
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from test_crash_counting import run_worker

from kafkatx import App, Record
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.testing import KafkaTestKit, unique_name, wait_for

pytestmark = pytest.mark.slow

_HEADER = """
import os, signal
from kafkatx import App, Record

# Static membership: the restarted worker takes its partitions back at once (see test_crash_counting.py).
app = App(os.environ["APP_NAME"], consumer_config={
    "session.timeout.ms": 6000, "max.poll.interval.ms": 10000, "heartbeat.interval.ms": 500,
    "group.instance.id": os.environ["APP_NAME"] + "-w"})
"""

KILLER_APP = _HEADER + textwrap.dedent(
    """
    @app.batch_listener(os.environ["SRC"], output=os.environ["OUT"], max_batch_records=20, max_batch_ms=500,
                        max_attempts=3, dlq=True, backoff=0)
    def handle(records: list[Record]) -> list[bytes]:
        if any(r.value == b"poison" for r in records):
            os._exit(17)  # no exception, no cleanup: the process is simply gone
        return [b"out-" + (r.value or b"") for r in records]
    """
)

ISOLATION_APP = _HEADER + textwrap.dedent(
    """
    failed = []

    @app.batch_listener(os.environ["SRC"], output=os.environ["OUT"], max_batch_records=40, max_batch_ms=500,
                        max_attempts=2, dlq=True, backoff=0)
    def handle(records: list[Record]) -> list[bytes]:
        if any(r.value == b"bad" for r in records):
            failed.append(len(records))
            raise ValueError("bad record in the batch")
        if failed and not os.path.exists(os.environ["MARK"]):  # a run of the search by halves that passes
            open(os.environ["MARK"], "w").close()
            print("killed during isolation", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return [b"out-" + (r.value or b"") for r in records]
    """
)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "killer_app.py").write_text(KILLER_APP)
    (tmp_path / "isolation_app.py").write_text(ISOLATION_APP)
    return tmp_path


def _env(name: str, src: str, out: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "APP_NAME": name, "SRC": src, "OUT": out, "PYTHONUNBUFFERED": "1", **extra}


@pytest.mark.timeout(300)
def test_a_batch_that_kills_the_process_is_searched_and_only_its_killer_dead_lettered(
    kafka: KafkaTestKit, workdir: Path
) -> None:
    """The batch in flight is claimed; each restart runs halves of it, one transaction each, until the record
    alone kills the process max_attempts times; the next start dead-letters it without calling the handler."""
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    name = unique_name("bcrash")
    values = [b"v%d" % i for i in range(60)]
    values[33] = b"poison"  # partition 1, offset 16
    kafka.produce(src, [{"value": v, "partition": i % 2} for i, v in enumerate(values)])
    env = _env(name, src, out)
    exits, logs = [], []
    for _ in range(14):
        code, log = run_worker(
            workdir, env, kafka.bootstrap_servers, stop_when=lambda: kafka.caught_up(name, src), app="killer_app:app"
        )
        exits.append(code)
        logs.append(log)
        if code != 17:
            break
    text = "".join(logs)
    ranges = [(int(a), int(b)) for a, b in re.findall(r"\[1\] died while handling offsets (\d+)\.\.(\d+)", text)]
    assert ranges and all(a <= 16 <= b for a, b in ranges), f"every range searched holds the killer: {ranges}"
    counted = [int(n) for n in re.findall(r"\[1\] died while handling offset 16 \((\d+) failed", text)]
    assert counted == [1, 2, 3], "only the crashes with the killer alone in flight are counted against it"
    assert exits[-1] == 0 and set(exits[:-1]) == {17}, exits
    assert Counter(kafka.values(out)) == Counter(b"out-" + v for v in values if v != b"poison"), "others once"
    dead = kafka.read(src + "-dlt")
    assert [d.value for d in dead] == [b"poison"]
    info = parse_dead_letter_headers(dead[0].headers)
    assert info.exception_fqcn == "kafkatx.errors.ProcessCrashedError" and info.attempts == 3


@pytest.mark.timeout(240)
def test_a_sigkill_during_poison_isolation_then_a_restart_loses_and_doubles_nothing(
    kafka: KafkaTestKit, workdir: Path
) -> None:
    """The handler fails on a batch holding b"bad", is retried, and the search by halves starts; the process is
    SIGKILLed in its first run that passes. Restarted under the same id, nothing of the killed transaction
    was committed: every good record's output is there once (read uncommitted too: no probe's), and the bad
    record is dead-lettered once, for its own error."""
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    name = unique_name("biso")
    values = [b"v%d" % i for i in range(80)]
    values[41] = b"bad"
    kafka.produce(src, [{"value": v, "partition": i % 2} for i, v in enumerate(values)])
    env = _env(name, src, out, MARK=str(workdir / "killed"))
    code, first = run_worker(workdir, env, kafka.bootstrap_servers, app="isolation_app:app")
    assert code == -signal.SIGKILL and "killed during isolation" in first, (code, first[-3000:])
    code, second = run_worker(
        workdir, env, kafka.bootstrap_servers, stop_when=lambda: kafka.caught_up(name, src), app="isolation_app:app"
    )
    assert code == 0, second[-3000:]
    good = [v for v in values if v != b"bad"]
    assert Counter(kafka.values(out, isolation="read_uncommitted")) == Counter(b"out-" + v for v in good)
    dead = kafka.read(src + "-dlt")
    assert [d.value for d in dead] == [b"bad"]
    assert parse_dead_letter_headers(dead[0].headers).exception_fqcn == "builtins.ValueError"


def test_an_output_the_broker_refuses_dead_letters_only_the_record_whose_call_made_it(kafka: KafkaTestKit) -> None:
    """The broker refuses the batch's commit (an output too large for its topic), which does not say whose it
    is: the batch is run again one record per transaction (the crash guard's careful mode), and the record whose
    output is refused is dead-lettered; the others' outputs commit once, and the app goes on."""
    src, out = kafka.topic(partitions=2), kafka.topic(config={"max.message.bytes": "2000"})
    values = [b"r%02d" % i for i in range(30)]
    kafka.produce(src, [(v, v) for v in values])
    app = App(unique_name("brefused"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")

    @app.batch_listener(src, output=out, dlq=True, max_attempts=3, backoff=0, max_batch_records=30, max_batch_ms=500)
    def handle(records: list[Record]) -> list[bytes]:
        return [b"x" * 10_000 if r.value == b"r07" else b"out-" + (r.value or b"") for r in records]

    app.start()
    try:
        wait_for(lambda: app.failure is not None or kafka.caught_up(app.group_id, src), 60, message="caught up")
        assert app.failure is None, app.failure
    finally:
        app.stop(timeout=15)
    assert Counter(kafka.values(out)) == Counter(b"out-" + v for v in values if v != b"r07")
    dead = kafka.read(src + "-dlt")
    assert [d.value for d in dead] == [b"r07"]
    assert parse_dead_letter_headers(dead[0].headers).exception_fqcn == "kafkatx.errors.OutputRefusedError"
