"""Prometheus metrics of a real App against the local broker, scraped over HTTP."""

from __future__ import annotations

import builtins
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kafkatx import App, InvalidConfigurationError, Record
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

    @app.listener(topic, output=out, max_attempts=2, dlq=True, name="orders")
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
        assert value(s, "kafkatx_transactions_committed_total", kind="after_rollback", **labels) >= 1
        assert value(s, "kafkatx_transactions_aborted_total", **labels) == 2
        assert value(s, "kafkatx_producer_recreations_total", **labels) == 0
        committed = value(s, "kafkatx_transactions_committed_total", **labels)
        assert value(s, "kafkatx_commit_latency_seconds_count", **labels) == committed
        assert value(s, "kafkatx_commit_latency_seconds_sum", **labels) > 0
        assert value(s, "kafkatx_assigned_partitions", **labels) == 2
        assert value(s, "kafkatx_containers_running", **labels) == 1
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


def test_lag_counts_records_not_yet_processed(kafka: KafkaTestKit) -> None:
    """While the handler is held back, lag shows the backlog; then it drains to 0."""
    import threading

    topic = kafka.topic()
    gate = threading.Event()
    app = App(unique_name("lag"), bootstrap_servers=kafka.bootstrap_servers, instance_id="l1")

    @app.listener(topic, max_batch_records=1, name="slow")
    def handle(record: Record) -> None:
        gate.wait(10)

    metrics = instrument(app, stats_interval_ms=100)
    kafka.produce(topic, [b"x"] * 20)
    with running(app):
        # The first record is in the handler, so at least 18 wait behind it.
        wait_for(lambda: (metrics.total_lag() or 0) >= 18, timeout=15, message="lag to show the backlog")
        gate.set()
        wait_for(lambda: metrics.total_lag() == 0, timeout=15, message="lag to drain to 0")
    text = metrics.exposition().decode()
    assert "kafkatx_records_processed_total" in text


def test_two_apps_in_one_process_get_separate_registries() -> None:
    a, b = App(unique_name("a"), bootstrap_servers="x:1"), App(unique_name("b"), bootstrap_servers="x:1")
    ma, mb = instrument(a), instrument(b)
    assert ma.registry is not mb.registry
    assert instrument(a) is ma  # idempotent: no double counting
    assert a.consumer_config_overrides["statistics.interval.ms"] == 5000
    assert callable(a.consumer_config_overrides["stats_cb"])


def test_users_stats_cb_and_interval_are_kept() -> None:
    seen: list[str] = []
    app = App(unique_name("a"), bootstrap_servers="x:1", consumer_config={"statistics.interval.ms": 60000, "stats_cb": seen.append})
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
