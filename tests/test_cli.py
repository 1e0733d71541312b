"""The ``kafkatx run`` command end to end: --local broker, signals, exit codes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kafkatx.testing import produce, read_topic, wait_for

ROOT = Path(__file__).resolve().parent.parent


def start(*args: str, cwd: Path = ROOT) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("KAFKATX_BOOTSTRAP_SERVERS", None)
    return subprocess.Popen([sys.executable, "-m", "kafkatx", "run", *args, "--no-status"], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def read_until(proc: subprocess.Popen[str], pattern: str, timeout: float = 60) -> re.Match[str]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"{pattern!r} not printed; output:\n{''.join(seen[-30:])}")


@pytest.mark.local_broker_only
def test_run_local_processes_records_and_stops_gracefully_on_sigterm() -> None:
    proc = start("examples.orders:app", "--local", "--instance-id", "cli-test")
    try:
        bootstrap = read_until(proc, r"embedded broker at (127\.0\.0\.1:\d+)").group(1)
        read_until(proc, r"assigned orders\[")
        produce(bootstrap, "orders", [(b"1", json.dumps({"id": 1, "qty": 2, "price": 3.5}).encode()),
                                      (b"2", json.dumps({"id": 2, "qty": 20, "price": 99.0}).encode())])  # fmt: skip
        enriched = wait_for(lambda: len(read_topic(bootstrap, "orders-enriched")) == 2 and
                            read_topic(bootstrap, "orders-enriched"), 30, message="the enriched orders")  # fmt: skip
        assert sorted(json.loads(r.value or b"{}")["total"] for r in enriched) == [7.0, 1980.0]
        audit = read_topic(bootstrap, "orders-audit")
        assert [json.loads(r.value or b"{}")["id"] for r in audit] == [2], "the send() target exists under --local"
        assert read_topic(bootstrap, "orders-dlt") == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.local_broker_only
def test_a_second_signal_forces_the_exit(tmp_path: Path) -> None:
    (tmp_path / "stuck_app.py").write_text(
        "import time\nfrom kafkatx import App\napp = App('stuck', create_topics=True)\n"
        "@app.listener('in', output='out', max_batch_ms=10)\n"
        "def h(r):\n    time.sleep(3600)\n"
    )
    proc = start("stuck_app:app", "--local", cwd=tmp_path)
    try:
        bootstrap = read_until(proc, r"embedded broker at (127\.0\.0\.1:\d+)").group(1)
        read_until(proc, r"assigned in\[")
        produce(bootstrap, "in", [b"x"])
        time.sleep(1.0)  # the handler is now stuck inside a transaction
        proc.send_signal(signal.SIGINT)
        read_until(proc, "stopping gracefully")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) != 0, "forced exit is not a clean exit"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_targets_exit_64_with_a_clear_message() -> None:
    for target, message in [("nosuchmodule:app", "cannot import module"), ("examples.orders:nope", "no attribute"),
                            ("examples.orders", "expected module:attribute"), ("json:dumps", "not a kafkatx.App"), ("json:JSONDecoder", "not a kafkatx.App")]:  # fmt: skip
        proc = start(target)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 64, out
        assert message in out, out


def test_missing_bootstrap_exits_78() -> None:
    proc = start("examples.orders:app")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 78, out
    assert "KAFKATX_BOOTSTRAP_SERVERS" in out


def test_run_local_gives_the_app_the_embedded_broker_client_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--local` starts noida-db, whose fetches can exceed librdkafka's default response limit:
    the App's clients must get LocalBroker.client_config, or a big backlog hangs the consumer."""
    from kafkatx import App
    from kafkatx.cli import main
    from kafkatx.local import LocalBroker

    (tmp_path / "local_cfg_app.py").write_text(
        "from kafkatx import App\napp = App('localcfg', config={'client.rack': 'r1'})\n"
        "@app.listener('in')\ndef handle(record):\n    return None\n"
    )
    monkeypatch.chdir(tmp_path)
    seen: list[dict[str, object]] = []
    monkeypatch.setattr(App, "run", lambda self, **kw: seen.append(self.consumer_config(self.listeners[0], "g", 0)))
    assert main(["run", "local_cfg_app:app", "--local", "--no-status"]) == 0
    assert len(seen) == 1
    assert all(seen[0][k] == v for k, v in LocalBroker.client_config.items())
    assert seen[0]["client.rack"] == "r1", "the App's own config is kept"


def test_a_misspelt_listener_option_is_one_line_and_exit_78(tmp_path: Path) -> None:
    (tmp_path / "typo_app.py").write_text(
        "from kafkatx import App\n"
        "app = App('typo', bootstrap_servers='127.0.0.1:9')\n"
        "@app.listener('orders', max_attempt=3)\n"
        "def handle(record):\n"
        "    return record.value\n"
    )
    proc = start("typo_app:app", cwd=tmp_path)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 78, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert "unknown option 'max_attempt'" in lines[0] and "did you mean 'max_attempts'?" in lines[0], out


def _one_line_app(tmp_path: Path, name: str, app_args: str) -> None:
    (tmp_path / f"{name}.py").write_text(
        "from kafkatx import App\n"
        f"app = App('{name}', {app_args})\n"
        "@app.listener('orders')\n"
        "def handle(record):\n"
        "    return record.value\n"
    )


def test_a_misspelt_librdkafka_property_is_one_line_and_exit_78(tmp_path: Path) -> None:
    _one_line_app(tmp_path, "typo_cfg", "bootstrap_servers='127.0.0.1:9', config={'lingr.ms': 5}")
    proc = start("typo_cfg:app", cwd=tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 78, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines == ['kafkatx run: configuration error: App config: No such configuration property: "lingr.ms"'], out


@pytest.mark.slow
def test_an_unreachable_broker_is_one_line_naming_the_address(tmp_path: Path) -> None:
    _one_line_app(tmp_path, "down", "bootstrap_servers='127.0.0.1:1'")
    proc = start("down:app", cwd=tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot reach Kafka at 127.0.0.1:1" in lines[0], out
    assert "%3|" not in out, "librdkafka's raw log lines go through logging (kafkatx.librdkafka, DEBUG)"


def test_the_readme_example_is_the_runnable_file_and_runs_under_local() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## In one screen", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    source = (ROOT / "examples" / "payments.py").read_text()
    assert source.split('"""', 2)[2].strip() == block.strip(), "README's one-screen example is examples/payments.py"
    proc = start("examples.payments:app", "--local", "--instance-id", "readme")
    try:
        bootstrap = read_until(proc, r"embedded broker at (127\.0\.0\.1:\d+)").group(1)
        read_until(proc, r"assigned payments\[")
        produce(bootstrap, "payments", [(b"p1", b'{"id": 1, "amount": 25}'), (b"p2", b'{"id": 2, "amount": -5}'),
                                        (b"p3", b"not json")])  # fmt: skip
        wait_for(lambda: len(read_topic(bootstrap, "payments-dlt")) == 2, 30, message="two dead letters")
        assert [json.loads(r.value or b"{}") for r in read_topic(bootstrap, "ledger")] == [{"id": 1, "debit": 25}]
        assert [(r.key, json.loads(r.value or b"{}")["id"]) for r in read_topic(bootstrap, "audit")] == [(b"p1", 1)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_topics_and_produce_put_records_into_a_topic(bootstrap_servers: str) -> None:
    topic = f"cli-{time.monotonic_ns()}"
    env = {**os.environ, "KAFKATX_BOOTSTRAP_SERVERS": bootstrap_servers}
    created = subprocess.run([sys.executable, "-m", "kafkatx", "topics", "create", topic, "--partitions", "2"],
                             env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert created.returncode == 0 and f"created {topic}" in created.stdout, created.stderr
    listed = subprocess.run([sys.executable, "-m", "kafkatx", "topics", "list"], env=env, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert f"{topic}\t2" in listed.stdout
    produced = subprocess.run([sys.executable, "-m", "kafkatx", "produce", topic, "--kv", "-H", "source=cli"],
                              input="k1\tv1\nk2\tv2\n", env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert produced.returncode == 0 and "produced 2 record(s)" in produced.stderr, produced.stderr
    records = sorted(read_topic(bootstrap_servers, topic), key=lambda r: r.key or b"")
    assert [(r.key, r.value, r.header("source")) for r in records] == [(b"k1", b"v1", b"cli"), (b"k2", b"v2", b"cli")]
