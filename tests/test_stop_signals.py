"""A stop signal delivered twice at once is one request (issue 42, item 4).

GNU ``timeout`` signals the process and then its group; systemd's ``KillMode=control-group`` signals a supervisor and
its ``--workers`` workers, which also get the signal the supervisor forwards. Each test runs the real ``kafkatx run``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from process_helpers import read_until

from kafkatx.app.signals import SAME_REQUEST_WINDOW_S, StopRequests
from kafkatx.testing import KafkaTestKit, unique_name, wait_for

pytestmark = pytest.mark.slow

APP = textwrap.dedent(
    """
    import atexit, os, signal, time
    from kafkatx import App

    app = App(os.environ["APP_NAME"], consumer_config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500})

    if os.environ.get("SIGNAL_AT_EXIT"):  # a copy of the stop signal that comes once app.run() has returned
        atexit.register(os.kill, os.getpid(), signal.SIGTERM)

    @app.listener(os.environ["SRC"], output=os.environ["OUT"])
    def handle(record):
        if record.value == b"slow":
            os.write(1, b"handling the slow record\\n")
            time.sleep(120)  # a batch that outlives the graceful stop
        return record.value
    """
)


def _kafkatx_run(kafka: KafkaTestKit, tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.Popen[str], str]:
    """``kafkatx run`` of APP in its own process group (as under ``timeout`` or systemd); and its input topic."""
    (tmp_path / "signalled_app.py").write_text(APP)
    source = kafka.topic(partitions=2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kafkatx", "run", "signalled_app:app", "--no-status"]
        + ["--bootstrap-servers", kafka.bootstrap_servers, *args],
        cwd=tmp_path,
        env={
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "APP_NAME": unique_name("sig"),
            "SRC": source,
            "OUT": kafka.topic(),
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return proc, source


def _rest(proc: subprocess.Popen[str], seen: list[str]) -> str:
    """Everything ``proc`` printed, once it has exited (killed if it did not within 60 s)."""
    try:
        rest, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate()
    return "".join(seen) + rest


def test_a_signal_forwarded_just_after_the_first_is_the_same_stop(kafka: KafkaTestKit, tmp_path: Path) -> None:
    proc, _ = _kafkatx_run(kafka, tmp_path)
    seen: list[str] = []
    read_until(proc, r"listener \S+ assigned", seen=seen)
    proc.send_signal(signal.SIGTERM)
    read_until(proc, r"SIGTERM received: stopping gracefully", seen=seen)
    proc.send_signal(signal.SIGTERM)  # a supervisor's forwarded copy: milliseconds after the group's
    output = _rest(proc, seen)
    assert proc.returncode == 0, output
    assert "forcing exit" not in output


def test_a_signal_to_the_process_and_its_group_under_workers_stops_them_gracefully(
    kafka: KafkaTestKit, tmp_path: Path
) -> None:
    proc, _ = _kafkatx_run(kafka, tmp_path, "--workers", "2", "--instance-id", "sig")
    seen: list[str] = []
    workers_assigned: set[str] = set()
    while workers_assigned != {"sig-0", "sig-1"}:  # each worker has its App running
        workers_assigned.add(read_until(proc, r"\[(sig-\d)\].*listener \S+ assigned", seen=seen).group(1))
    os.kill(proc.pid, signal.SIGTERM)  # what GNU timeout does: the process, then its whole group
    os.killpg(proc.pid, signal.SIGTERM)
    output = _rest(proc, seen)
    assert proc.returncode == 0, output
    assert "forcing exit" not in output and "exited with code" not in output, output


def test_a_later_second_signal_still_forces_the_exit(kafka: KafkaTestKit, tmp_path: Path) -> None:
    proc, source = _kafkatx_run(kafka, tmp_path)
    seen: list[str] = []
    read_until(proc, r"listener \S+ assigned", seen=seen)
    kafka.produce(source, [b"slow"])
    read_until(proc, r"handling the slow record", seen=seen)
    proc.send_signal(signal.SIGTERM)
    read_until(proc, r"SIGTERM received: stopping gracefully", seen=seen)
    first = time.monotonic()
    wait_for(lambda: time.monotonic() - first > SAME_REQUEST_WINDOW_S, message="the same-request window passed")
    assert proc.poll() is None, "still stopping: the slow record's batch holds it"
    proc.send_signal(signal.SIGTERM)
    output = _rest(proc, seen)
    assert proc.returncode == 143, output
    assert "second signal: forcing exit" in output


def test_a_signal_after_run_returned_does_not_kill_the_process(kafka: KafkaTestKit, tmp_path: Path) -> None:
    proc, _ = _kafkatx_run(kafka, tmp_path, SIGNAL_AT_EXIT="1")
    seen: list[str] = []
    read_until(proc, r"listener \S+ assigned", seen=seen)
    proc.send_signal(signal.SIGTERM)
    output = _rest(proc, seen)
    assert proc.returncode == 0, f"exit {proc.returncode} (-15: killed by the default handler)\n{output}"


def test_main_called_from_python_puts_the_callers_handlers_back(
    kafka: KafkaTestKit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_logging: None
) -> None:
    """The handlers kept for a late signal are the exiting process's; a program that called main() goes on."""
    from kafkatx.cli import main

    (tmp_path / "inprocess_app.py").write_text(APP)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, value in {"APP_NAME": unique_name("inproc"), "SRC": kafka.topic(), "OUT": kafka.topic()}.items():
        monkeypatch.setenv(name, value)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def stop_once_running() -> None:
        app = wait_for(lambda: getattr(sys.modules.get("inprocess_app"), "app", None), 60, message="the App")
        wait_for(lambda: app.containers and all(c.assigned for c in app.containers), 60, message="the assignment")
        app.stop(wait=False)

    stopper = threading.Thread(target=stop_once_running)
    stopper.start()
    try:
        assert main(["run", "inprocess_app:app", "--bootstrap-servers", kafka.bootstrap_servers, "--no-status"]) == 0
    finally:
        stopper.join()
        sys.modules.pop("inprocess_app", None)
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_signals_within_the_window_are_one_request_and_a_later_one_is_the_next() -> None:
    now = [100.0]
    requests = StopRequests(window=1.0, clock=lambda: now[0])
    assert requests.receive(signal.SIGTERM) == 1
    now[0] += 0.2
    assert requests.receive(signal.SIGINT) is None
    now[0] += 1.0
    assert requests.receive(signal.SIGINT) == 2
    assert (requests.count, requests.first_signal) == (2, signal.SIGTERM)
