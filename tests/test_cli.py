"""The ``kafkatx run`` command end to end: --local broker, signals, exit codes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers import client_threads, wait_for_client_threads_to_end
from process_helpers import read_until

from kafkatx.app.signals import SAME_REQUEST_WINDOW_S
from kafkatx.testing import produce, read_topic, wait_for

ROOT = Path(__file__).resolve().parent.parent


# `kafkatx` whose startup check waits 2 s for metadata (15 s by default): an address that refuses connections
# fails the same check with the same librdkafka error, 13 s sooner. test_cli's other unreachable-broker test
# shortens _METADATA_TIMEOUT for the same reason.
SHORT_METADATA_WAIT = textwrap.dedent(
    """
    import sys
    import kafkatx.app.startup
    from kafkatx.cli import main

    kafkatx.app.startup.STARTUP_METADATA_TIMEOUT_S = 2.0
    sys.exit(main(sys.argv[1:]))
    """
)


def start(*args: str, cwd: Path = ROOT, launcher: str | None = None) -> subprocess.Popen[str]:
    """`kafkatx run ARGS --no-status`; ``launcher``: Python code that runs the command instead of ``-m kafkatx``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("KAFKATX_BOOTSTRAP_SERVERS", None)
    program = ["-m", "kafkatx"] if launcher is None else ["-c", launcher]
    return subprocess.Popen(
        [sys.executable, *program, "run", *args, "--no-status"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.local_broker_only
def test_run_local_processes_records_and_stops_gracefully_on_sigterm() -> None:
    proc = start("examples.orders:app", "--local", "--instance-id", "cli-test")
    try:
        bootstrap = read_until(proc, r"embedded broker at (127\.0\.0\.1:\d+)").group(1)
        read_until(proc, r"assigned orders\[")
        produce(
            bootstrap,
            "orders",
            [
                (b"1", json.dumps({"id": 1, "qty": 2, "price": 3.5}).encode()),
                (b"2", json.dumps({"id": 2, "qty": 20, "price": 99.0}).encode()),
            ],
        )
        enriched = wait_for(
            lambda: len(read_topic(bootstrap, "orders-enriched")) == 2 and read_topic(bootstrap, "orders-enriched"),
            30,
            message="the enriched orders",
        )
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
        "def h(r):\n    print('handler: inside the transaction', flush=True)\n    time.sleep(3600)\n"
    )
    proc = start("stuck_app:app", "--local", cwd=tmp_path)
    try:
        bootstrap = read_until(proc, r"embedded broker at (127\.0\.0\.1:\d+)").group(1)
        read_until(proc, r"assigned in\[")
        produce(bootstrap, "in", [b"x"])
        read_until(proc, "handler: inside the transaction")  # stuck there from now on
        proc.send_signal(signal.SIGINT)
        read_until(proc, "stopping gracefully")
        first = time.monotonic()  # a signal within the window repeats the first request (test_stop_signals)
        wait_for(lambda: time.monotonic() - first > SAME_REQUEST_WINDOW_S, message="the same-request window passed")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) != 0, "forced exit is not a clean exit"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_targets_exit_64_with_a_clear_message() -> None:
    cases = [
        ("nosuchmodule:app", "cannot import module"),
        ("examples.orders:nope", "no attribute"),
        ("examples.orders", "expected module:attribute"),
        ("json:dumps", "not a kafkatx.App"),
        ("json:JSONDecoder", "not a kafkatx.App"),
    ]
    procs = [(start(target), message) for target, message in cases]  # started together: each is mostly imports
    for proc, message in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 64, out
        assert message in out, out


def test_missing_bootstrap_exits_78() -> None:
    proc = start("examples.orders:app")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 78, out
    assert "KAFKATX_BOOTSTRAP_SERVERS" in out
    assert "--bootstrap-servers HOST:PORT" in out and "--local" in out, "the hint speaks the command's options"
    assert "App(" not in out, out


def test_run_local_gives_the_app_the_embedded_broker_client_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
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
    assert lines[0].startswith("kafkatx run: configuration error: typo_app.py:3: "), "the line of the App to fix"


def _one_line_app(tmp_path: Path, name: str, app_args: str) -> None:
    (tmp_path / f"{name}.py").write_text(
        "from kafkatx import App\n"
        f"app = App('{name}', {app_args})\n"
        "@app.listener('orders')\n"
        "def handle(record):\n"
        "    return record.value\n"
    )


def test_a_misspelt_librdkafka_property_is_one_line_naming_the_line_and_the_closest_name(tmp_path: Path) -> None:
    _one_line_app(tmp_path, "typo_cfg", "bootstrap_servers='127.0.0.1:9', config={'lingr.ms': 5}")
    proc = start("typo_cfg:app", cwd=tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 78, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines == [
        "kafkatx run: configuration error: typo_cfg.py:2: App config: no such librdkafka property 'lingr.ms'; "
        "did you mean 'linger.ms'?"
    ], out


def test_a_misspelt_listener_librdkafka_property_names_the_listener_line(tmp_path: Path) -> None:
    (tmp_path / "typo_lcfg.py").write_text(
        "from kafkatx import App\n"
        "app = App('typo', bootstrap_servers='127.0.0.1:9')\n"
        "@app.listener('orders', consumer_config={'sesion.timeout.ms': 6000})\n"
        "def handle(record):\n"
        "    return record.value\n"
    )
    proc = start("typo_lcfg:app", cwd=tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 78, out
    assert out.strip() == (
        "kafkatx run: configuration error: typo_lcfg.py:3: listener 'handle' (topic orders) consumer_config: "
        "no such librdkafka property 'sesion.timeout.ms'; did you mean 'session.timeout.ms'?"
    ), out


@pytest.mark.slow
def test_an_unreachable_broker_is_one_line_naming_the_address(tmp_path: Path) -> None:
    _one_line_app(tmp_path, "down", "bootstrap_servers='127.0.0.1:1'")
    proc = start("down:app", cwd=tmp_path, launcher=SHORT_METADATA_WAIT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot reach Kafka at 127.0.0.1:1" in lines[0], out
    assert "no answer within 2 s" in lines[0], "the message names the wait it gave up after"
    assert "from the App's bootstrap_servers" in lines[0] and "--bootstrap-servers HOST:PORT" in lines[0], out
    assert "%3|" not in out, "librdkafka's raw log lines go through logging (kafkatx.librdkafka, DEBUG)"


def test_a_host_name_that_does_not_resolve_is_one_line_at_once(tmp_path: Path) -> None:
    _one_line_app(tmp_path, "nodns", "bootstrap_servers='no-such-kafka-host.invalid:9092'")
    started = time.monotonic()
    proc = start("nodns:app", cwd=tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot resolve host 'no-such-kafka-host.invalid'" in lines[0], out
    assert "from the App's bootstrap_servers" in lines[0] and "no answer within" not in lines[0], out
    assert time.monotonic() - started < 12, "said before list_topics' 15 s ran out"


def test_the_readme_example_is_the_runnable_file_and_runs_under_local() -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## In one screen", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    source = (ROOT / "examples" / "payments.py").read_text()
    assert source.split('"""', 2)[2].strip() == block.strip(), "README's one-screen example is examples/payments.py"
    proc = start("examples.payments:app", "--local", "--instance-id", "readme")
    try:
        bootstrap = read_until(proc, r"embedded broker at (127\.0\.0\.1:\d+)").group(1)
        read_until(proc, r"assigned payments\[")
        produce(
            bootstrap,
            "payments",
            [(b"p1", b'{"id": 1, "amount": 25}'), (b"p2", b'{"id": 2, "amount": -5}'), (b"p3", b"not json")],
        )
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
    created = subprocess.run(
        [sys.executable, "-m", "kafkatx", "topics", "create", topic, "--partitions", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert created.returncode == 0 and f"created {topic}" in created.stdout, created.stderr
    listed = subprocess.run(
        [sys.executable, "-m", "kafkatx", "topics", "list"], env=env, capture_output=True, text=True, timeout=60
    )
    assert f"{topic}\t2" in listed.stdout
    produced = subprocess.run(
        [sys.executable, "-m", "kafkatx", "produce", topic, "--kv", "-H", "source=cli"],
        input="k1\tv1\nk2\tv2\n",
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert produced.returncode == 0 and "produced 2 record(s)" in produced.stderr, produced.stderr
    records = sorted(read_topic(bootstrap_servers, topic), key=lambda r: r.key or b"")
    assert [(r.key, r.value, r.header("source")) for r in records] == [(b"k1", b"v1", b"cli"), (b"k2", b"v2", b"cli")]


def kafkatx(
    *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 60, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``kafkatx ARGS`` as a user types it, without $KAFKATX_BOOTSTRAP_SERVERS unless ``env`` sets it."""
    full = {k: v for k, v in os.environ.items() if k != "KAFKATX_BOOTSTRAP_SERVERS"}
    return subprocess.run(
        [sys.executable, "-m", "kafkatx", *args],
        cwd=cwd,
        env={**full, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        input=stdin,
    )


def test_version_and_help_are_plain_text() -> None:
    from kafkatx import __version__

    version = kafkatx("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"kafkatx {__version__}"
    top = kafkatx("--help").stdout
    assert "``" not in top and ":mod:" not in top, top
    assert all(command in top for command in ("broker", "run", "topics", "produce", "dlq"))
    run = " ".join(kafkatx("run", "--help").stdout.split())
    assert "replaces the App's bootstrap servers" in run and "missing topics are created" in run, run


def test_a_file_path_or_a_bare_module_gets_the_target_to_type(tmp_path: Path) -> None:
    (tmp_path / "myapp.py").write_text("from kafkatx import App\napp = App('myapp')\n")
    (tmp_path / "elsewhere").mkdir()
    cases = [
        (tmp_path, "myapp.py:app", "try myapp:app"),
        (tmp_path, "./myapp.py", "try myapp:app"),
        (tmp_path, "myapp", "try myapp:app"),
        (tmp_path / "elsewhere", "../myapp.py:app", f"try: cd {tmp_path.resolve()} && kafkatx run myapp:app"),
        (tmp_path / "elsewhere", str(tmp_path / "myapp.py"), f"try: cd {tmp_path.resolve()} && kafkatx run myapp:app"),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:  # run together: each is mostly imports
        results = list(pool.map(lambda case: kafkatx("run", case[1], cwd=case[0]), cases))
    for (_, target, hint), result in zip(cases, results, strict=True):
        assert result.returncode == 64, result.stderr
        assert result.stderr.count("\n") == 1 and hint in result.stderr, (target, result.stderr)


def test_a_misspelt_app_option_is_one_line_and_exit_78(tmp_path: Path) -> None:
    (tmp_path / "typo_app.py").write_text("from kafkatx import App\n\napp = App('typo', create_topic=True)\n")
    result = kafkatx("run", "typo_app:app", cwd=tmp_path)
    assert result.returncode == 78, result.stderr
    assert result.stderr.splitlines() == [
        "kafkatx run: configuration error: typo_app.py:3: App() got an unknown option 'create_topic'; "
        "did you mean 'create_topics'?"
    ], result.stderr


def test_an_error_in_the_apps_own_code_keeps_its_traceback(tmp_path: Path) -> None:
    (tmp_path / "buggy.py").write_text("def f(x):\n    return x\n\nf(y=1)\n")
    result = kafkatx("run", "buggy:app", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" in result.stderr and "buggy.py" in result.stderr, result.stderr


def test_a_missing_dependency_is_one_line_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kafkatx.cli import main
    from kafkatx.cli import run as _cli_run

    (tmp_path / "needs_dep.py").write_text("import kafkatx_test_not_installed.sub\n")
    (tmp_path / "needs_other.py").write_text("import another_test_not_installed\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(_cli_run._EXTRAS, "kafkatx_test_not_installed", "database")
    assert main(["run", "needs_dep:app"]) == 78
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "kafkatx run: needs_dep imports 'kafkatx_test_not_installed', which is not installed: "
        "pip install 'kafkatx[database]' (in a clone of kafkatx: pip install -e '.[database]')"
    ], err
    assert main(["run", "needs_other:app"]) == 78
    assert "pip install another_test_not_installed" in capsys.readouterr().err


def test_a_missing_topic_names_the_command_line_option(tmp_path: Path, bootstrap_servers: str) -> None:
    (tmp_path / "no_topic.py").write_text(
        "from kafkatx import App\napp = App('no-topic')\n"
        f"@app.listener('missing-{time.monotonic_ns()}')\ndef handle(record):\n    return None\n"
    )
    result = kafkatx("run", "no_topic:app", "--bootstrap-servers", bootstrap_servers, cwd=tmp_path)
    assert result.returncode == 78, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0] and "run with --create-topics" in lines[0], lines


def test_a_port_in_use_is_one_line_in_the_commands_own_words(tmp_path: Path) -> None:
    import socket

    (tmp_path / "tiny.py").write_text("from kafkatx import App\napp = App('tiny')\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        broker = kafkatx("broker", "--port", port, "--data-dir", str(tmp_path / "b"))
        run = kafkatx("run", "tiny:app", "--local", "--local-port", port, cwd=tmp_path)
    assert broker.returncode == 1 and broker.stderr.count("\n") == 1, broker.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in broker.stderr and "--port N" in broker.stderr
    assert "port=None" not in broker.stderr and "--local-port" not in broker.stderr, broker.stderr
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert "Pick another --local-port, or leave --local-port out" in run.stderr, run.stderr
    assert "port=None" not in run.stderr and "kafkatx broker" not in run.stderr, run.stderr


def test_workers_with_a_bad_target_say_so_once_and_start_nothing() -> None:
    started = time.monotonic()
    result = kafkatx("run", "nosuchmodule:app", "--workers", "2", "--local")
    assert result.returncode == 64, result.stderr
    assert result.stderr.splitlines() == [
        "kafkatx run: cannot import module 'nosuchmodule': No module named 'nosuchmodule'"
    ], result.stderr
    assert "embedded broker" not in result.stdout and "supervising" not in result.stdout
    assert time.monotonic() - started < 20, "no worker was started and restarted"


def test_v_shows_kafkatx_debug_lines_and_vv_librdkafkas_too_before_or_after_the_command(restore_logging: None) -> None:
    import logging

    from kafkatx.cli import main

    def levels() -> tuple[int, int]:
        return logging.getLogger("kafkatx.container").getEffectiveLevel(), logging.getLogger(
            "kafkatx.librdkafka"
        ).getEffectiveLevel()

    logging.getLogger("kafkatx").setLevel(logging.NOTSET)
    main(["topics", "create"])  # stops at once (no names to create), after configuring logging
    assert levels() == (logging.INFO, logging.INFO)
    main(["-v", "topics", "create"])
    assert levels() == (logging.DEBUG, logging.INFO), "-v: kafkatx's debug lines, not librdkafka's"
    main(["topics", "create", "-vv"])
    assert levels() == (logging.DEBUG, logging.DEBUG)


def test_topics_and_produce_with_the_broker_down_are_one_line_each(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    from kafkatx.cli import main
    from kafkatx.cli import topics as _cli_topics

    monkeypatch.setattr(_cli_topics, "_METADATA_TIMEOUT", 1.0)
    for argv in (["topics", "list"], ["topics", "create", "t"], ["produce", "t", "--value", "v"]):
        before = client_threads()
        assert main([*argv, "--bootstrap-servers", "127.0.0.1:1"]) == 1, argv
        wait_for_client_threads_to_end(before)  # all their threads could write is written
        out, err = capfd.readouterr()
        # A client another test left open may log here too (its own rdkafka#... name and address); only
        # raw lines about this command's address are this command's.
        lines = [line for line in err.splitlines() if not (line.startswith("%") and not _names_port_1(line))]
        assert not any(line.startswith("%") for line in lines) and "Traceback" not in err, err
        assert len(lines) == 1 and "cannot reach Kafka at 127.0.0.1:1" in lines[0], (argv, err)
        assert "produced" not in out + err


def _names_port_1(line: str) -> bool:
    return re.search(r"127\.0\.0\.1:1\b", line) is not None


def test_topics_and_produce_refuse_what_would_surprise(bootstrap_servers: str) -> None:
    env = {"KAFKATX_BOOTSTRAP_SERVERS": bootstrap_servers}
    topic = f"cli-missing-{time.monotonic_ns()}"
    produced = kafkatx("produce", topic, "--value", "v", env=env)
    assert produced.returncode == 1 and f"topic {topic!r} does not exist" in produced.stderr, produced.stderr
    assert f"kafkatx topics create {topic}" in produced.stderr
    assert topic not in kafkatx("topics", "list", env=env).stdout, "a misspelt topic is not created by producing to it"
    nothing = kafkatx("topics", "create", env=env)
    assert nothing.returncode == 2 and "name the topics to create" in nothing.stderr, nothing.stderr
    assert kafkatx("topics", "create", topic, env=env).returncode == 0
    again = kafkatx("topics", "create", topic, env=env)
    assert again.returncode == 1 and "already exists (1 partition(s))" in again.stderr, again.stderr


def test_the_tools_find_a_broker_on_the_default_port(
    kafka: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    """``kafkatx topics``, ``produce`` and ``dlq`` without --bootstrap-servers or the variable use 127.0.0.1:9092
    when something listens there (``kafkatx broker``); here the test broker plays its part."""
    import kafkatx.local
    from kafkatx.cli import main

    monkeypatch.delenv("KAFKATX_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.setattr(kafkatx.local, "DEFAULT_PORT", int(kafka.bootstrap_servers.rsplit(":", 1)[1]))
    topic = kafka.topic()
    assert main(["produce", topic, "--value", "v1"]) == 0
    assert main(["topics", "list"]) == 0
    assert f"{topic}\t1" in capsys.readouterr().out
    assert main(["dlq", "inspect", topic]) == 0
    assert "1 dead-lettered record(s)" in capsys.readouterr().out
    monkeypatch.setattr(kafkatx.local, "DEFAULT_PORT", 1)
    assert main(["dlq", "inspect", topic]) == 64
    assert "no bootstrap servers" in capsys.readouterr().err
