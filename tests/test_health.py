"""Health probes against the local broker: /readyz after the assignment, not while stuck or paused past the bound,
/livez false once a container thread died; ``kafkatx run --health-port`` and the supervisor's one port (issue 33)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import confluent_kafka
import pytest

import kafkatx.producer as producer_module
from kafkatx import App, Record
from kafkatx.events import ContainerStarted, PartitionsAssigned
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for


def get(url: str) -> tuple[int | None, Any]:
    """Status and body of ``url`` (JSON when it is); ``(None, None)`` while nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except OSError:
        return None, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def make_app(kafka: KafkaTestKit, **options: Any) -> App:
    return App(unique_name("health"), bootstrap_servers=kafka.bootstrap_servers, instance_id="test", **options)


@pytest.mark.parametrize("rebalance", ["eager", "cooperative"])
def test_ready_only_after_the_assignment_and_metrics_on_the_same_port(kafka: KafkaTestKit, rebalance: Any) -> None:
    src = kafka.topic(partitions=2)
    app = make_app(kafka, health_port=0, rebalance=rebalance)
    polling = threading.Event()
    # ContainerStarted is published on the container's thread before its first poll: holding it there keeps the
    # group from assigning anything until the test has seen /readyz say "not yet".
    app.on(ContainerStarted)(lambda event: polling.wait(30))

    @app.listener(src, name="orders", concurrency=3)
    def handle(record: Record) -> None:
        pass

    with running(app):
        assert app.health_server is not None
        url = app.health_server.url
        assert get(url + "/livez")[0] == 200
        status, body = get(url + "/readyz")
        assert status == 503, body
        assert body["listeners"][0]["listener"] == "orders" and body["listeners"][0]["ready"] is False
        polling.set()

        def ready_with(partitions: list[int]) -> bool:
            status, body = get(url + "/readyz")
            return status == 200 and sorted(c["partitions"] for c in body["listeners"][0]["containers"]) == partitions

        # Three containers, two partitions: the one without a partition is ready too (or a rollout never ends).
        wait_for(lambda: ready_with([0, 1, 1]), 60, message="ready once every container has its assignment")
        status, metrics = get(url + "/metrics")
        assert status == 200 and "kafkatx_" in metrics
    assert app.health_server is None, "the endpoint stays open after the App stopped"


def test_not_ready_until_the_assigned_partitions_producers_are_ready(
    kafka: KafkaTestKit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fencing="partition": a partition's producer fences its previous owner (init_transactions) before the
    container can handle its records; /readyz says ready only after that (PartitionsAssigned is published then)."""
    src = kafka.topic(partitions=1)
    initialising, proceed = threading.Event(), threading.Event()

    class HeldInit(confluent_kafka.Producer):  # type: ignore[misc]
        def __init__(self, config: dict[str, Any]) -> None:
            super().__init__(config)
            self.partition_id = str(config.get("transactional.id", "")).endswith(f".{src}.0")

        def init_transactions(self, *args: Any) -> None:
            if self.partition_id and not proceed.is_set():
                initialising.set()
                proceed.wait(30)
            super().init_transactions(*args)

    monkeypatch.setattr(producer_module, "Producer", HeldInit)
    app = make_app(kafka, health_port=0)
    assigned: list[PartitionsAssigned] = []
    app.on(PartitionsAssigned)(assigned.append)

    @app.listener(src, name="orders", fencing="partition")
    def handle(record: Record) -> None:
        pass

    with running(app):
        assert app.health_server is not None
        url = app.health_server.url
        assert initialising.wait(60), "the partition's producer was never created"
        status, body = get(url + "/readyz")
        proceed.set()
        assert status == 503, body
        assert "producers" in body["listeners"][0]["containers"][0]["reason"]
        wait_for(lambda: get(url + "/readyz")[0] == 200, 60, message="ready once the producer is")
        assert assigned, "PartitionsAssigned was published by the time /readyz said ready"


def test_not_ready_while_a_handler_is_stuck_on_a_batch_past_the_bound_and_live_throughout(kafka: KafkaTestKit) -> None:
    src = kafka.topic()
    app = make_app(kafka, health_port=0, not_ready_after=1.0)
    entered, release = threading.Event(), threading.Event()

    @app.listener(src, name="slow")
    def handle(record: Record) -> None:
        entered.set()
        release.wait(60)

    with running(app):
        assert app.health_server is not None
        url = app.health_server.url
        wait_for(lambda: get(url + "/readyz")[0] == 200, 60, message="ready after the assignment")
        kafka.produce(src, [b"x"])
        wait_for(entered.is_set, 30, message="the handler took the record")
        body = wait_for(lambda: (lambda r: r[1] if r[0] == 503 else None)(get(url + "/readyz")), 10, message="503")
        assert "handling one batch" in body["listeners"][0]["reasons"][0]
        assert get(url + "/livez")[0] == 200, "a slow handler made the container not live"
        release.set()
        wait_for(lambda: get(url + "/readyz")[0] == 200, 30, message="ready again once the batch is done")


def test_not_ready_once_a_listener_is_paused_longer_than_the_bound(kafka: KafkaTestKit) -> None:
    src = kafka.topic()
    app = make_app(kafka, health_port=0, not_ready_after=1.0)

    @app.listener(src, name="orders")
    def handle(record: Record) -> None:
        pass

    with running(app):
        assert app.health_server is not None
        url = app.health_server.url
        wait_for(lambda: get(url + "/readyz")[0] == 200, 60, message="ready after the assignment")
        app.pause("orders")
        body = wait_for(lambda: (lambda r: r[1] if r[0] == 503 else None)(get(url + "/readyz")), 10, message="503")
        assert body["listeners"][0]["paused_for"] >= 1.0 and "paused for" in body["listeners"][0]["reasons"][0]
        app.resume("orders")
        wait_for(lambda: get(url + "/readyz")[0] == 200, 30, message="ready again after the resume")


def test_not_live_once_a_container_thread_died(kafka: KafkaTestKit) -> None:
    src = kafka.topic()
    app = make_app(kafka, health_port=0)

    @app.listener(src, name="fragile")
    def handle(record: Record) -> None:
        raise SystemExit(3)  # a BaseException: it ends the container's thread (and stops the App)

    app.start()
    try:
        assert app.health_server is not None
        url = app.health_server.url
        wait_for(lambda: get(url + "/livez")[0] == 200 and get(url + "/readyz")[0] == 200, 60, message="ready")
        kafka.produce(src, [b"x"])
        wait_for(lambda: not any(c.alive for c in app.containers), 30, message="the container thread ended")
        status, body = get(url + "/livez")
        assert status == 503, body
        assert body["listeners"][0]["containers"][0]["reason"] == "stopped by SystemExit: 3"
        assert get(url + "/readyz")[0] == 503
    finally:
        app.stop()
    assert isinstance(app.failure, SystemExit)


APP = textwrap.dedent(
    """
    import os
    import time
    from kafkatx import App

    app = App(os.environ["APP_NAME"], consumer_config={"session.timeout.ms": 6000, "heartbeat.interval.ms": 500})

    @app.listener(os.environ["SRC"], name="orders")
    def handle(record):
        while record.value == b"stuck" and not os.path.exists(os.environ["RELEASE"]):
            time.sleep(0.05)  # stuck on its batch until the test releases it
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_command(kafka: KafkaTestKit, tmp_path: Path, *args: str, src: str | None = None) -> subprocess.Popen[str]:
    (tmp_path / "health_app.py").write_text(APP)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "APP_NAME": unique_name("hrun"),
        "SRC": src or kafka.topic(partitions=2),
        "RELEASE": str(tmp_path / "release"),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "kafkatx", "run", "health_app:app", "--no-status", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return out


@contextmanager
def _output_shown_on_failure(proc: subprocess.Popen[str]) -> Iterator[None]:
    """A failing wait or assertion stops the command and prints what it wrote (shown with the failure): the
    supervisor's and its workers' lines say why they were not ready."""
    try:
        yield
    except BaseException:
        print(f"--- the command's output ---\n{stop(proc)}")
        raise


def test_kafkatx_run_serves_the_probes_on_the_port_it_is_given(kafka: KafkaTestKit, tmp_path: Path) -> None:
    port = free_port()
    proc = run_command(kafka, tmp_path, "--health-port", str(port), "--bootstrap-servers", kafka.bootstrap_servers)
    with _output_shown_on_failure(proc):
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: get(url + "/readyz")[0] == 200, 60, message="the run's App ready")
        assert get(url + "/livez")[0] == 200
    out = stop(proc)
    assert proc.returncode == 0, out
    assert f"health probes at http://127.0.0.1:{port}" in out


def test_kafkatx_run_not_ready_after_sets_the_bound_of_readyz(kafka: KafkaTestKit, tmp_path: Path) -> None:
    src = kafka.topic(partitions=2)
    port = free_port()
    args = ("--health-port", str(port), "--not-ready-after", "1.5", "--bootstrap-servers", kafka.bootstrap_servers)
    proc = run_command(kafka, tmp_path, *args, src=src)
    with _output_shown_on_failure(proc):
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: get(url + "/readyz")[0] == 200, 60, message="the run's App ready")
        kafka.produce(src, [b"stuck"])
        body = wait_for(lambda: (lambda r: r[1] if r[0] == 503 else None)(get(url + "/readyz")), 30, message="503")
        assert "longer than not_ready_after=1.5s" in json.dumps(body), body
        assert get(url + "/livez")[0] == 200, "a handler taking long is not dead"
        (tmp_path / "release").touch()
        wait_for(lambda: get(url + "/readyz")[0] == 200, 30, message="ready again once the batch is done")
    out = stop(proc)
    assert proc.returncode == 0, out


def test_kafkatx_run_refuses_a_bad_not_ready_after(kafka: KafkaTestKit, tmp_path: Path) -> None:
    proc = run_command(kafka, tmp_path, "--not-ready-after", "0", "--bootstrap-servers", kafka.bootstrap_servers)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 78, out
    assert "--not-ready-after: not_ready_after must be a positive number of seconds, got 0.0" in out


def test_a_health_port_in_use_ends_kafkatx_run_with_one_configuration_error(
    kafka: KafkaTestKit, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_command(kafka, tmp_path, "--health-port", str(port), "--bootstrap-servers", kafka.bootstrap_servers)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 78, out
    assert f"configuration error: cannot serve health probes on 127.0.0.1:{port}" in out


@pytest.mark.slow
def test_the_supervisor_serves_one_port_reporting_every_worker(kafka: KafkaTestKit, tmp_path: Path) -> None:
    port = free_port()
    proc = run_command(
        kafka,
        tmp_path,
        "--workers",
        "2",
        "--instance-id",
        "hsup",
        "--health-port",
        str(port),
        "--bootstrap-servers",
        kafka.bootstrap_servers,
    )
    with _output_shown_on_failure(proc):
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: get(url + "/readyz")[0] == 200, 90, message="both workers ready")
        status, body = get(url + "/readyz")
        assert [w["worker"] for w in body["workers"]] == ["hsup-0", "hsup-1"]
        assert all(w["health"]["listeners"][0]["listener"] == "orders" for w in body["workers"])
        status, body = get(url + "/livez")
        assert status == 200 and [w["process"] for w in body["workers"]] == ["running", "running"]
        killed = body["workers"][0]["pid"]
        os.kill(killed, signal.SIGKILL)
        body = wait_for(
            lambda: (lambda r: r[1] if r[0] == 503 else None)(get(url + "/readyz")), 30, message="not ready"
        )
        assert [w["ready"] for w in body["workers"]] == [False, True], body
        assert get(url + "/livez")[0] == 200, "a worker being restarted made the supervisor not live"
        wait_for(lambda: get(url + "/readyz")[0] == 200, 90, message="ready again after the restart")
        assert get(url + "/readyz")[1]["workers"][0]["pid"] != killed
    out = stop(proc)
    assert proc.returncode == 0, out


def test_the_supervisor_serves_every_workers_metrics_on_the_metrics_port_and_the_health_port(
    kafka: KafkaTestKit, tmp_path: Path
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    health, metrics = free_port(), free_port()
    args = ("--workers", "2", "--instance-id", "hm", "--health-port", str(health), "--metrics-port", str(metrics))
    proc = run_command(kafka, tmp_path, *args, "--bootstrap-servers", kafka.bootstrap_servers)
    with _output_shown_on_failure(proc):
        wait_for(lambda: get(f"http://127.0.0.1:{health}/readyz")[0] == 200, 90, message="both workers ready")
        for url in (f"http://127.0.0.1:{metrics}/metrics", f"http://127.0.0.1:{health}/metrics"):
            status, text = get(url)
            assert status == 200, (url, text)
            workers = {
                s.labels.get("worker")
                for family in text_string_to_metric_families(text)
                if family.name.startswith("kafkatx_")
                for s in family.samples
            }
            assert workers == {"hm-0", "hm-1"}, (url, text[:2000])
    out = stop(proc)
    assert proc.returncode == 0, out


def test_not_ready_while_no_broker_answers_and_ready_again_once_it_does(tmp_path: Path) -> None:
    """The cluster gone for longer than not_ready_after: /readyz is 503 and says so (not a stale 200), /livez stays
    200 (restarting the process would not bring the broker back), and /readyz is 200 again once it answers."""
    from kafkatx.local import LocalBroker

    broker = LocalBroker(data_dir=tmp_path / "broker").start()
    try:
        kit = KafkaTestKit(broker.bootstrap_servers)
        src = kit.topic(partitions=2)
        app = App(
            unique_name("down"),
            bootstrap_servers=broker.bootstrap_servers,
            instance_id="test",
            health_port=0,
            not_ready_after=2.0,
            config=dict(LocalBroker.client_config),
        )
        app.add_listener(lambda record: None, src, name="orders")
        with running(app):
            assert app.health_server is not None
            url = app.health_server.url
            wait_for(lambda: get(url + "/readyz")[0] == 200, 60, message="ready with the broker up")
            broker.kill()
            body = wait_for(
                lambda: (lambda r: r[1] if r[0] == 503 else None)(get(url + "/readyz")), 60, message="not ready"
            )
            reason = body["listeners"][0]["containers"][0]["reason"]
            assert f"no broker of {broker.bootstrap_servers} has answered for" in reason, body
            assert get(url + "/livez")[0] == 200
            assert _unreachable(get(url + "/metrics")[1]) == [1.0]
            broker.start()
            wait_for(lambda: get(url + "/readyz")[0] == 200, 60, message="ready again once the broker answers")
            assert _unreachable(get(url + "/metrics")[1]) == [0.0]
    finally:
        broker.stop()


def _unreachable(metrics: str) -> list[float]:
    """The values of kafkatx_cluster_unreachable in an exposition."""
    return [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("kafkatx_cluster_unr")]


def test_an_input_partition_held_below_an_open_transaction_is_reported_stalled_and_not_ready_until_it_fetches(
    kafka: KafkaTestKit, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crashed producer's transaction left open on an input topic holds read_committed readers below it: the
    records committed after it are there, and the listener fetches nothing. The container says so (a warning,
    /readyz 503 naming the partition) and, once the transaction is aborted, handles them and is ready again."""
    from kafkatx.client.log import client_log
    from kafkatx.listener.loop import health as loop_health

    monkeypatch.setattr(loop_health, "STALL_CHECK_S", 0.5)  # look twice a second
    src = kafka.topic()
    app = make_app(kafka, health_port=0)
    handled: list[bytes] = []

    @app.listener(src)
    def handle(record: Record) -> None:
        handled.append(record.value or b"")

    hanging = confluent_kafka.Producer(
        {"logger": client_log(), "bootstrap.servers": kafka.bootstrap_servers, "transactional.id": unique_name("open")}
    )
    with caplog.at_level(logging.INFO, logger="kafkatx.container"), running(app):
        kafka.produce(src, [b"first"])
        wait_for(lambda: handled == [b"first"], 30, message="the listener runs")
        hanging.init_transactions(10)
        hanging.begin_transaction()
        hanging.produce(src, b"never committed")
        assert hanging.flush(10) == 0  # src[0] offset 1: read_committed readers stop there
        kafka.produce(src, [b"after"])
        url = app.health_server.url + "/readyz"  # type: ignore[union-attr]
        wait_for(lambda: get(url)[0] == 503, 30, message="/readyz says the partition fetches nothing")
        reason = get(url)[1]["listeners"][0]["containers"][0]["reason"]
        assert f"{src}[0]" in reason and "fetch(es) nothing" in reason, reason
        assert "has fetched nothing from it" in caplog.text
        assert handled == [b"first"]

        hanging.abort_transaction(10)
        wait_for(lambda: handled == [b"first", b"after"], 30, message="the record after it, once it is aborted")
        wait_for(lambda: get(url)[0] == 200, 30, message="ready again")
        assert "is fetching again" in caplog.text
