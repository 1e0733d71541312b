"""Prometheus metrics of a real App against the local broker, scraped over HTTP."""

from __future__ import annotations

import builtins
import io
import logging
import threading
import time
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kafkatx import App, InvalidConfigurationError, Record
from kafkatx.cli.status import StatusLine
from kafkatx.events import HandlerFailed, RecordRecovered, TransactionAborted, TransactionCommitted
from kafkatx.metrics import instrument, serve_metrics
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for

N = 10
BAD = b"5"


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """``{(sample name, labels): value}`` from a real HTTP scrape."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lbls), v in samples.items() if n == name and want <= lbls)


def present(samples: dict[Any, float], name: str) -> list[dict[str, str]]:
    return [dict(lbls) for (n, lbls), _ in samples.items() if n == name]


def test_counters_histogram_and_lag_of_a_failing_record(kafka: KafkaTestKit) -> None:
    topic = kafka.topic(partitions=2)
    out = kafka.topic()
    app = App(unique_name("metrics"), bootstrap_servers=kafka.bootstrap_servers, instance_id="m1", create_topics=True)

    @app.listener(topic, output=out, max_attempts=2, dlq=True, name="orders", backoff=0)
    def handle(record: Record) -> bytes:
        if record.value == BAD:
            raise ValueError("poison")
        return record.value or b""

    instrument(app, stats_interval_ms=200)  # lag refreshes fast enough for a test
    kafka.produce(topic, [{"value": str(i).encode(), "partition": i % 2} for i in range(N)])
    server = serve_metrics(app, 0)
    try:
        assert server.port > 0
        with running(app):
            wait_for(lambda: len(kafka.values(out)) == N - 1, message="the good records to be processed")
            wait_for(lambda: len(kafka.values(f"{topic}-dlt")) == 1, message="the poison record in the DLQ")
            labels = {"app": app.name, "listener": "orders"}

            def settled() -> Any:
                s = scrape(server.url)
                lags = present(s, "kafkatx_consumer_lag")
                done = value(s, "kafkatx_records_processed_total", **labels) == N
                return s if done and len(lags) == 2 and value(s, "kafkatx_consumer_lag") == 0 else None

            s = wait_for(settled, timeout=20, message="all records counted and lag 0 on both partitions")

        assert value(s, "kafkatx_records_processed_total", **labels) == N  # 9 handled + 1 recovered
        assert value(s, "kafkatx_outputs_produced_total", **labels) == N - 1
        assert value(s, "kafkatx_handler_failures_total", **labels) == 2  # attempts 1 and 2
        assert value(s, "kafkatx_record_retries_total", **labels) == 1
        assert value(s, "kafkatx_records_recovered_total", recoverer="DeadLetterPublishingRecoverer", **labels) == 1
        assert value(s, "kafkatx_recovery_failures_total", **labels) == 0
        assert value(s, "kafkatx_transactions_committed_total", kind="batch", **labels) > 0
        assert value(s, "kafkatx_transactions_aborted_total", **labels) == 0  # a handler failure aborts nothing
        assert value(s, "kafkatx_producer_recreations_total", **labels) == 0
        committed = value(s, "kafkatx_transactions_committed_total", **labels)
        assert value(s, "kafkatx_commit_latency_seconds_count", **labels) == committed
        assert value(s, "kafkatx_commit_latency_seconds_sum", **labels) > 0
        assert value(s, "kafkatx_assigned_partitions", **labels) == 2
        assert value(s, "kafkatx_containers_running", **labels) == 1
        assert abs(value(s, "kafkatx_last_commit_timestamp_seconds", **labels) - time.time()) < 60
        assert sorted(lbl["partition"] for lbl in present(s, "kafkatx_consumer_lag")) == ["0", "1"]
        assert {lbl["topic"] for lbl in present(s, "kafkatx_consumer_lag")} == {topic}

        after = scrape(server.url)  # stopped: nothing assigned, no stale lag series
        assert value(after, "kafkatx_containers_running", **labels) == 0
        assert value(after, "kafkatx_assigned_partitions", **labels) == 0
        assert present(after, "kafkatx_consumer_lag") == []
    finally:
        server.stop()
    with pytest.raises(OSError):
        scrape(server.url)  # the port is closed


def test_lag_shows_the_backlog_then_drains_to_zero(kafka: KafkaTestKit) -> None:
    topic = kafka.topic()
    app = App(unique_name("lag"), bootstrap_servers=kafka.bootstrap_servers, instance_id="l1")

    @app.listener(topic, max_batch_records=1, name="slow")
    def handle(record: Record) -> None:
        time.sleep(0.05)  # 40 records take 2 s: the consumer polls (and reports lag) in between

    metrics = instrument(app, stats_interval_ms=100)
    kafka.produce(topic, [b"x"] * 40)
    seen: list[int] = []

    def drained() -> bool:
        lag = metrics.total_lag()
        if lag is not None:
            seen.append(lag)
        return bool(seen) and lag == 0

    with running(app):
        wait_for(drained, timeout=20, message="lag to drain to 0")
    assert max(seen) >= 20, f"lag never showed the backlog: {seen}"
    families = text_string_to_metric_families(metrics.exposition().decode())
    samples = {(s.name, s.labels.get("listener")): s.value for f in families for s in f.samples}
    assert samples[("kafkatx_records_processed_total", "slow")] == 40


def test_lag_is_reported_for_a_listener_with_backoff_while_a_record_waits_and_after(kafka: KafkaTestKit) -> None:
    """A failure with backoff= pauses the partition and seeks, and librdkafka forgets the position until it next
    hands out a record of that partition (the held ones are handled from memory): the lag, gauge and status line,
    stayed unknown ("lag ?") for as long as the listener ran (issue 29). Now: the backlog behind the waiting
    record while it waits, then 0."""
    topic = kafka.topic()
    app = App(unique_name("lagbackoff"), bootstrap_servers=kafka.bootstrap_servers, instance_id="b1")
    attempts: list[int] = []

    @app.listener(topic, backoff=0.5, max_attempts=5, name="backing")
    def handle(record: Record) -> None:
        if record.offset == 0 and len(attempts) < 3:
            attempts.append(record.offset)
            raise ValueError("not yet")

    metrics = instrument(app, stats_interval_ms=100)
    line = StatusLine(app, stream=FakeTerminal(), interval=60).start()
    kafka.produce(topic, [b"x"] * 20)
    seen: list[int] = []

    def drained() -> bool:
        lag = metrics.total_lag()
        if lag is not None:
            seen.append(lag)
        return len(attempts) == 3 and lag == 0

    try:
        with running(app):
            wait_for(drained, timeout=20, message="lag reported and drained to 0")
            assert line.render().endswith("| lag 0"), line.render()
    finally:
        line.stop()
    assert max(seen) == 20, f"the backlog behind the waiting record: {seen}"


def test_two_apps_in_one_process_get_separate_registries() -> None:
    a, b = App(unique_name("a"), bootstrap_servers="x:1"), App(unique_name("b"), bootstrap_servers="x:1")
    ma, mb = instrument(a), instrument(b)
    assert ma.registry is not mb.registry
    assert instrument(a) is ma  # idempotent: no double counting
    assert a.consumer_config_overrides["statistics.interval.ms"] == 5000
    assert callable(a.consumer_config_overrides["stats_cb"])


def test_users_stats_cb_and_interval_are_kept() -> None:
    seen: list[str] = []
    user_config = {"statistics.interval.ms": 60000, "stats_cb": seen.append}
    app = App(unique_name("a"), bootstrap_servers="x:1", consumer_config=user_config)
    instrument(app)
    overrides = app.consumer_config_overrides
    assert overrides["statistics.interval.ms"] == 60000
    overrides["stats_cb"]('{"type": "consumer", "client_id": "c", "topics": {}}')
    overrides["stats_cb"]("not json")  # must not raise inside the consumer's poll
    assert seen == ['{"type": "consumer", "client_id": "c", "topics": {}}', "not json"]


def test_busy_port_is_a_clear_error() -> None:
    app = App(unique_name("a"), bootstrap_servers="x:1")
    server = serve_metrics(app, 0)
    try:
        other = App(unique_name("b"), bootstrap_servers="x:1")
        with pytest.raises(InvalidConfigurationError, match=rf"cannot serve metrics on 127.0.0.1:{server.port}"):
            serve_metrics(other, server.port)
    finally:
        server.stop()


def test_missing_prometheus_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_prometheus(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "prometheus_client" or name.startswith("prometheus_client."):
            raise ImportError("No module named 'prometheus_client'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    app = App(unique_name("a"), bootstrap_servers="x:1")
    with pytest.raises(InvalidConfigurationError, match=r"pip install 'kafkatx\[metrics\]'"):
        serve_metrics(app, 0)
    with pytest.raises(InvalidConfigurationError, match=r"pip install 'kafkatx\[metrics\]'"):
        instrument(app)


# -- the live status line (kafkatx run on a terminal) ------------------------------------


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_line_counts_rate_and_clears_on_stop() -> None:
    app = App(unique_name("st"), bootstrap_servers="x:1")
    tty = FakeTerminal()
    status = StatusLine(app, stream=tty, interval=60).start()
    try:
        status.render(now=100.0)
        app.events.publish(TransactionCommitted("l", 0, records=500, seconds=0.01))
        record = Record("t", 0, 7, None, b"x")
        app.events.publish(HandlerFailed("l", 0, record, ValueError("x"), 1))
        app.events.publish(TransactionAborted("l", 0, 1, "failed"))
        app.events.publish(RecordRecovered("l", 0, record, ValueError("x"), "DeadLetterPublishingRecoverer"))
        text = status.render(now=102.0)
    finally:
        status.stop()
    assert text == f"kafkatx {app.name} | 250 rec/s | processed 500 | failed 1 | dlq 1 | aborted 1 | lag ?"
    app.events.publish(TransactionCommitted("l", 0, records=5))
    assert status.processed == 500  # stopped: no longer counting


def test_status_line_live_on_a_terminal_shares_it_with_logging(
    kafka: KafkaTestKit, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A terminal wide enough for the whole line (it is cut to the width; pytest-xdist's workers set COLUMNS=80).
    monkeypatch.setenv("COLUMNS", "200")
    topic = kafka.topic()
    app = App(unique_name("st"), bootstrap_servers=kafka.bootstrap_servers, instance_id="s1")

    @app.listener(topic, name="live")
    def handle(record: Record) -> None:
        pass

    tty = FakeTerminal()
    handler = logging.StreamHandler(tty)
    logger = logging.getLogger(unique_name("status-test"))
    logger.addHandler(handler)
    kafka.produce(topic, [b"x"] * 7)
    status = StatusLine(app, stream=tty, interval=0.05).start()
    try:
        with running(app):
            wait_for(
                lambda: "processed 7 " in tty.getvalue() and "lag 0" in tty.getvalue(),
                timeout=20,
                message="the status line to show 7 processed and lag 0",
            )
            logger.warning("a log line")
    finally:
        status.stop()
        logger.removeHandler(handler)
    out = tty.getvalue()
    assert "\r\x1b[Ka log line\n" in out  # the status line was erased before the log line
    last_line = out.rsplit("\n", 1)[-1]
    assert last_line == "" or last_line.endswith("\r\x1b[K"), "no status text left on the terminal after stop"
    assert handler.stream is tty  # logging's stream restored


def test_status_line_does_nothing_without_a_terminal() -> None:
    app = App(unique_name("st"), bootstrap_servers="x:1")
    pipe = io.StringIO()
    status = StatusLine(app, stream=pipe, interval=0.01).start()
    assert "kafkatx-status" not in {t.name for t in threading.enumerate()}, "no thread to redraw a status line"
    status.stop()
    assert pipe.getvalue() == ""
    assert "stats_cb" not in app.consumer_config_overrides


def test_a_batch_listener_reports_the_same_metrics_and_probes_as_a_record_listener(kafka: KafkaTestKit) -> None:
    from kafkatx import RecordFailedError

    topic = kafka.topic(partitions=2)
    out = kafka.topic()
    app = App(unique_name("metrics-batch"), bootstrap_servers=kafka.bootstrap_servers, instance_id="mb", health_port=0)

    @app.batch_listener(topic, output=out, max_attempts=2, dlq=True, name="scores", backoff=0)
    def score(records: list[Record]) -> list[bytes]:
        for record in records:
            if record.value == BAD:
                raise RecordFailedError(record) from ValueError("poison")
        return [record.value or b"" for record in records]

    instrument(app, stats_interval_ms=200)
    kafka.produce(topic, [{"value": str(i).encode(), "partition": i % 2} for i in range(N)])
    server = serve_metrics(app, 0)
    try:
        with running(app):
            wait_for(lambda: len(kafka.values(out)) == N - 1, message="the good records to be processed")
            wait_for(lambda: len(kafka.values(f"{topic}-dlt")) == 1, message="the poison record in the DLQ")
            labels = {"app": app.name, "listener": "scores"}

            def settled() -> Any:
                s = scrape(server.url)
                done = value(s, "kafkatx_records_processed_total", **labels) == N
                return s if done and value(s, "kafkatx_consumer_lag") == 0 else None

            s = wait_for(settled, timeout=20, message="all records counted and lag 0")
            assert app.health_server is not None
            with urllib.request.urlopen(f"{app.health_server.url}/readyz", timeout=5) as ready:
                assert ready.status == 200
        assert value(s, "kafkatx_outputs_produced_total", **labels) == N - 1
        assert value(s, "kafkatx_records_recovered_total", recoverer="DeadLetterPublishingRecoverer", **labels) == 1
        assert value(s, "kafkatx_handler_failures_total", **labels) >= 1
        assert value(s, "kafkatx_transactions_committed_total", kind="batch", **labels) > 0
        assert value(s, "kafkatx_assigned_partitions", **labels) == 2
        assert value(s, "kafkatx_containers_running", **labels) == 1
        assert sorted(lbl["partition"] for lbl in present(s, "kafkatx_consumer_lag")) == ["0", "1"]
    finally:
        server.stop()
