"""``kafkatx transactions abort``: a transaction one of the App's transactional ids left open (its process died
mid-transaction; the embedded broker never expires it) holds read_committed readers back until the command
re-initialises that id and so aborts it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from confluent_kafka import Producer

from kafkatx import App
from kafkatx.app.open_transactions import app_transactional_ids
from kafkatx.testing import KafkaTestKit, unique_name

pytestmark = pytest.mark.timeout(120)

APP = textwrap.dedent(
    """
    import os
    from kafkatx import App, Record

    app = App(os.environ["APP_NAME"])

    @app.listener(os.environ["SRC"], output=os.environ["OUT"], fencing="partition")
    def handle(record: Record) -> bytes:
        return record.value or b""
    """
)


def test_the_command_aborts_what_a_partition_id_of_the_app_left_open(kafka: KafkaTestKit, tmp_path: Path) -> None:
    src, out, name = kafka.topic(partitions=2), kafka.topic(), unique_name("open")
    (tmp_path / "open_app.py").write_text(APP)
    app = App(name)
    txn_id = app.client_config.partition_transactional_id(app.group_id, src, 1)
    dead = Producer({"bootstrap.servers": kafka.bootstrap_servers, "transactional.id": txn_id})
    dead.init_transactions(10)
    dead.begin_transaction()
    dead.produce(out, b"never committed")
    assert dead.flush(10) == 0
    kafka.produce(out, [b"after it"])  # committed, but behind the open transaction: read_committed stops before
    assert kafka.values(out) == [], "the open transaction holds read_committed readers back"

    done = subprocess.run(
        [sys.executable, "-m", "kafkatx", "transactions", "abort", "open_app:app"]
        + ["--bootstrap-servers", kafka.bootstrap_servers],
        cwd=tmp_path,
        env={"APP_NAME": name, "SRC": src, "OUT": out, "PATH": "", "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"re-initialised {txn_id}" in done.stdout
    assert kafka.values(out) == [b"after it"], "aborted: the record after it is readable, the open one never is"


def test_every_id_the_app_may_use_is_listed() -> None:
    app = App("orders", instance_id="w1")
    app.add_listener(lambda record: None, "in", name="a", concurrency=2)
    app.add_listener(lambda record: None, "in2", name="b", group_id="other")
    ids = app_transactional_ids(app, {"in": 2, "in2": 1}, producers=2)
    assert ids == [
        "orders-orders-w1-0",
        "orders-orders-w1-1",
        "orders-orders.in.0",
        "orders-orders.in.1",
        "orders-other-w1-2",
        "orders-other.in2.0",
        "orders-w1-producer-1",
        "orders-w1-producer-2",
    ]


@pytest.mark.parametrize("producers", ["-3", "two"])
def test_a_producer_count_that_is_no_whole_number_is_refused(producers: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kafkatx", "transactions", "abort", "x:app", "--producers", producers],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"--producers: must be a whole number, 0 or more, got {producers!r}" in done.stderr
