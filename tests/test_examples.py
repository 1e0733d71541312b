"""Every example runs as its docstring says, under ``kafkatx run --local`` (issue 15, a new user's first hour)."""

from __future__ import annotations

import glob
import json
import math
import os
import re
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from process_helpers import read_until

from kafkatx.testing import produce, read_topic, wait_for

ROOT = Path(__file__).resolve().parent.parent


def _run_local(target: str, cwd: Path = ROOT) -> subprocess.Popen[str]:
    # The repository root for `examples.*`, its src/ (a worktree's own kafkatx), then any PYTHONPATH given.
    paths = [str(ROOT), str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(paths)}
    env.pop("KAFKATX_BOOTSTRAP_SERVERS", None)
    return subprocess.Popen(
        [sys.executable, "-m", "kafkatx", "run", target, "--local", "--no-status"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _stop(proc: subprocess.Popen[str], seen: list[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    text = "".join(seen) + out
    assert proc.returncode == 0, text
    assert "%3|" not in text and "%4|" not in text, "librdkafka's lines go through logging"
    return text


def test_every_example_app_is_run_under_local_by_the_suite() -> None:
    apps = sorted(p.stem for p in (ROOT / "examples").glob("*.py") if re.search(r"^app = App\(", p.read_text(), re.M))
    assert apps == [
        "batch_scores",
        "enrich_async",
        "orders",
        "payments",
        "people",
        "spark_wordcount",
        "typed_orders",
    ], apps
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for name in apps:
        assert re.search(rf"\"examples\.{name}:app\"[^\n]*\"--local\"|_run_local\(\"examples\.{name}:app\"", tests), (
            f"no test runs `kafkatx run examples.{name}:app --local`"
        )


def test_the_readme_demo_runs_and_checks_itself() -> None:
    """README's first command ends with `python examples/quickstart.py`."""
    env = {k: v for k, v in os.environ.items() if k != "KAFKATX_BOOTSTRAP_SERVERS"}
    result = subprocess.run(
        [sys.executable, "examples/quickstart.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=170
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exactly-once check: OK" in result.stdout and "3 dead-lettered records" in result.stdout, result.stdout
    assert "%3|" not in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.local_broker_only
def test_the_people_example_runs_under_local_and_leaves_no_database_behind(tmp_path: Path) -> None:
    """Its database stores how far each partition was processed: a file kept across runs of a temporary
    broker made the second run skip the new broker's records as done. The default is now temporary too."""
    pytest.importorskip("sqlalchemy")
    pattern = str(Path(tempfile.gettempdir()) / "kafkatx-people-*")
    before = set(glob.glob(pattern))
    proc, seen = _run_local("examples.people:app", cwd=tmp_path), []
    try:
        bootstrap = read_until(proc, r"embedded broker at (127\.0\.0\.1:\d+)", 120, seen).group(1)
        read_until(proc, r"assigned people-in\[", 120, seen)
        produce(bootstrap, "people-in", [(b"1", b'{"id": 1, "name": "Ada"}'), (b"2", b'{"id": 2}')])
        wait_for(
            lambda: len(read_topic(bootstrap, "people-in-dlt")) == 1, 60, message="the nameless person dead-lettered"
        )
        events = [json.loads(r.value or b"{}") for r in read_topic(bootstrap, "people-saved")]
        assert events == [{"event": "person-saved", "id": 1}]
        _stop(proc, seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert list(tmp_path.iterdir()) == [], "no people.db in the directory it was run from"
    assert set(glob.glob(pattern)) == before, "the temporary database is removed at exit"


def test_the_async_enrich_example_prices_orders_concurrently_in_order_per_customer() -> None:
    """README "Concurrency": an async def handler, 100 orders in flight, each customer's outputs in input order."""
    proc, seen = _run_local("examples.enrich_async:app"), []
    try:
        bootstrap = read_until(proc, r"embedded broker at (127\.0\.0\.1:\d+)", 120, seen).group(1)
        read_until(proc, r"assigned orders-in\[", 120, seen)
        orders = [(b"c%d" % (i % 20), json.dumps({"n": i, "sku": "apple", "qty": i}).encode()) for i in range(400)]
        produce(bootstrap, "orders-in", [*orders, (b"c0", b'{"n": 400, "sku": "kiwi", "qty": 1}')])
        wait_for(lambda: len(read_topic(bootstrap, "orders-priced")) >= 400, 120, message="400 orders priced")
        wait_for(lambda: len(read_topic(bootstrap, "orders-in-dlt")) == 1, 60, message="the kiwi order dead-lettered")
        priced = [(r.key, json.loads(r.value or b"{}")) for r in read_topic(bootstrap, "orders-priced")]
        assert sorted(o["n"] for _, o in priced) == list(range(400)), "each order priced exactly once"
        assert all(o["total"] == round(o["qty"] * 0.5, 2) for _, o in priced)
        for customer in {k for k, _ in priced}:
            numbers = [o["n"] for k, o in priced if k == customer]
            assert numbers == sorted(numbers), f"{customer!r}: outputs out of input order"
        _stop(proc, seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_batch_scores_example_scores_batches_and_dead_letters_the_named_reading() -> None:
    """docs/HANDLERS.md "Batch listeners": numpy over a batch; the reading named by RecordFailedError dead-lettered."""
    pytest.importorskip("numpy")
    proc, seen = _run_local("examples.batch_scores:app"), []
    readings = [(b"s%d" % (i % 7), json.dumps({"n": i, "temp": 15 + i % 20}).encode()) for i in range(300)]
    bad = [b'{"temp": "hot"}', b"not json"]
    try:
        bootstrap = read_until(proc, r"embedded broker at (127\.0\.0\.1:\d+)", 120, seen).group(1)
        read_until(proc, r"assigned readings\[", 120, seen)
        produce(bootstrap, "readings", [*readings[:150], (b"s1", bad[0]), *readings[150:], (b"s2", bad[1])])
        wait_for(lambda: len(read_topic(bootstrap, "reading-scores")) >= 300, 120, message="300 readings scored")
        wait_for(lambda: len(read_topic(bootstrap, "readings-dlt")) == 2, 60, message="the two bad ones dead-lettered")
        scores = read_topic(bootstrap, "reading-scores")
        assert len(scores) == 300, "each reading scored exactly once"
        assert sorted((r.key or b"") for r in scores) == sorted(k for k, _ in readings), "keys kept"
        for r in scores:
            out = json.loads(r.value or b"{}")
            assert abs(out["score"] - 1 / (1 + math.exp(-(out["temp"] - 25) / 4))) < 1e-4, out
        dead = read_topic(bootstrap, "readings-dlt")
        assert sorted(d.value or b"" for d in dead) == sorted(bad), "dead-lettered byte for byte"
        from kafkatx.dlq.headers import parse_dead_letter_headers

        infos = [parse_dead_letter_headers(d.headers) for d in dead]
        assert {i.attempts for i in infos} == {1}, "BadReading is not retryable: dead-lettered at once"
        _stop(proc, seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.local_broker_only
def test_the_typed_orders_example_runs_under_local() -> None:
    """JSON orders validated by a model, Avro invoices out; the two that cannot be read dead-lettered at once."""
    pytest.importorskip("pydantic")
    fastavro = pytest.importorskip("fastavro")
    pytest.importorskip("confluent_kafka.schema_registry.avro")
    proc, seen = _run_local("examples.typed_orders:app"), []
    bad = [b'{"id": 2, "qty": 0, "price": 1}', b"not json"]
    try:
        bootstrap = read_until(proc, r"embedded broker at (127\.0\.0\.1:\d+)", 120, seen).group(1)
        read_until(proc, r"assigned typed-orders\[", 120, seen)
        produce(bootstrap, "typed-orders", [b'{"id": 1, "qty": 2, "price": 3.5}', *bad])
        wait_for(lambda: len(read_topic(bootstrap, "typed-orders-dlt")) == 2, 60, message="two dead-lettered")
        wait_for(lambda: len(read_topic(bootstrap, "typed-invoices")) == 1, 60, message="one invoice")
        (out,) = read_topic(bootstrap, "typed-invoices")
        value = out.value or b""
        assert value[0] == 0, "Schema Registry wire format: magic byte, then the schema id"
        # By path: the repository root is on sys.path under `python -m pytest` only, not under `pytest`.
        typed_orders = runpy.run_path(str(ROOT / "examples" / "typed_orders.py"))
        schema = fastavro.parse_schema(json.loads(typed_orders["INVOICE_SCHEMA"]))
        import io

        assert fastavro.schemaless_reader(io.BytesIO(value[5:]), schema) == {"order": 1, "total": 7.0}
        dead = read_topic(bootstrap, "typed-orders-dlt")
        assert sorted(d.value or b"" for d in dead) == sorted(bad), "dead-lettered byte for byte"
        from kafkatx.dlq.headers import parse_dead_letter_headers

        infos = [parse_dead_letter_headers(d.headers) for d in dead]
        assert {i.attempts for i in infos} == {1}
        assert any("qty: Input should be greater than 0" in (i.exception_message or "") for i in infos), infos
        _stop(proc, seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.spark
@pytest.mark.slow
def test_the_spark_wordcount_example_runs_under_local() -> None:
    pytest.importorskip("pyspark")
    proc, seen = _run_local("examples.spark_wordcount:app"), []
    try:
        bootstrap = read_until(proc, r"embedded broker at (127\.0\.0\.1:\d+)", 120, seen).group(1)
        read_until(proc, r"assigned lines\[", 170, seen)
        produce(bootstrap, "lines", [b"the cat and the hat", b"The end"])

        def totals() -> dict[str, int]:
            counts: dict[str, int] = {}
            for r in read_topic(bootstrap, "word-counts"):
                counts[(r.key or b"").decode()] = counts.get((r.key or b"").decode(), 0) + int(r.value or b"0")
            return counts

        expected = {"the": 3, "cat": 1, "and": 1, "hat": 1, "end": 1}
        # The two lines may sit in different partitions, committed by different transactions: wait for both.
        wait_for(lambda: totals() == expected, 120, message=f"the word counts {expected}")
        # A marker into each of the 3 partitions: a line counted twice would be committed before the marker.
        produce(bootstrap, "lines", [{"value": b"marker", "partition": p} for p in range(3)])
        wait_for(lambda: totals().get("marker") == 3, 120, message="the markers counted")
        assert totals() == {**expected, "marker": 3}, "nothing counted twice"
        _stop(proc, seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(420)
def test_the_spark_streaming_example_commits_invoices_once_and_dead_letters_the_bad_orders() -> None:
    """examples/spark_streaming.py: a whole Structured Streaming pipeline through kafkatx, checking itself."""
    pytest.importorskip("pyspark")
    paths = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    env.pop("KAFKATX_BOOTSTRAP_SERVERS", None)
    result = subprocess.run(
        [sys.executable, "examples/spark_streaming.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "979 invoices, 21 dead-lettered records" in result.stdout, result.stdout
    assert "exactly-once check: OK" in result.stdout, result.stdout
