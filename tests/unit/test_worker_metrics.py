"""The supervisor's one scrape: the workers' expositions merged, a family once, each sample labelled by worker."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kafkatx.health.worker_metrics import merge_expositions

W0 = """# HELP kafkatx_records_total Records handled.
# TYPE kafkatx_records_total counter
kafkatx_records_total{listener="orders"} 3.0
# HELP kafkatx_lag Records behind.
# TYPE kafkatx_lag gauge
kafkatx_lag{listener="orders",partition="0"} 7.0
"""
W1 = """# HELP kafkatx_records_total Records handled.
# TYPE kafkatx_records_total counter
kafkatx_records_total{listener="orders"} 5.0
"""


def test_each_family_comes_once_with_every_workers_samples_labelled() -> None:
    merged = merge_expositions([("w-0", W0), ("w-1", W1)]).decode()
    assert merged.count("# TYPE kafkatx_records_total counter") == 1
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    records = families["kafkatx_records"]
    assert records.type == "counter"
    assert sorted((s.labels["worker"], s.value) for s in records.samples if s.name.endswith("_total")) == [
        ("w-0", 3.0),
        ("w-1", 5.0),
    ]
    assert [(s.labels["worker"], s.labels["partition"]) for s in families["kafkatx_lag"].samples] == [("w-0", "0")]


def test_no_worker_answering_is_an_empty_scrape() -> None:
    assert merge_expositions([]) == b""
