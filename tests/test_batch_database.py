"""database= on batch listeners (issue 41): one unit of work per transaction, a bulk insert committing with the
batch's outputs exactly once; a failed call's rows undone with it (the handler's savepoint), and the rows of an
isolation run kept only if its result is the one committed; a crash between the two commits replays the stored
outputs, stored under each call's first record's partition.

Against the local broker and a real PostgreSQL server (the ``postgres`` fixture); a crash is a real SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa
from database_helpers import fresh_table, restart_until_caught_up, table_rows
from helpers import PoisonError

import kafkatx
from kafkatx import App, InvalidConfigurationError, Record, db
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for
from kafkatx.testing.postgres import LocalPostgres


def _bulk_insert(table: str, records: list[Record]) -> None:
    """One statement for the batch: what a batch listener's database work is for."""
    rows = [{"k": (r.value or b"").decode()} for r in records]
    db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'saved')"), rows)


def test_a_bulk_insert_commits_with_the_outputs_and_isolation_keeps_no_probes_rows(
    kafka: KafkaTestKit, pg_engine: sa.Engine
) -> None:
    """1% poison in 3,000 records, the call failing after its bulk insert: the rows of failed calls and of the
    isolation runs whose result is not kept roll back; every good record has one row and one event, the poison
    none, and is dead-lettered."""
    src, out = kafka.topic(partitions=3), kafka.topic()
    table = unique_name("bulk").replace("-", "_")
    fresh_table(pg_engine, table)  # no unique constraint: a probe's row left behind shows as a duplicate
    values = [f"b{i}" for i in range(3000)]
    poison = {v for i, v in enumerate(values) if i % 100 == 37}
    kafka.produce(src, [{"value": v.encode(), "partition": i % 3} for i, v in enumerate(values)])
    app = App(unique_name("bdb"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")
    calls = 0

    @app.batch_listener(
        src, output=out, database=pg_engine, max_attempts=2, backoff=0, dlq=True, max_batch_records=500, fencing="group"
    )
    def save(records: list[Record]) -> list[bytes]:
        nonlocal calls
        calls += 1
        _bulk_insert(table, records)
        bad = [r for r in records if (r.value or b"").decode() in poison]
        if bad:
            raise PoisonError(f"{len(bad)} poison record(s)")  # after the insert: its rows must roll back
        return [b"saved:" + (r.value or b"") for r in records]

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 180, message="all 3,000 records committed")
    good = set(values) - poison
    rows = table_rows(pg_engine, table)
    assert calls > 2 * len(poison), f"the poison was isolated by runs over parts of batches ({calls} calls)"
    assert set(rows) == good and max(rows.values()) == 1, "a row of a failed or discarded run was kept (or lost)"
    events = Counter(kafka.values(out, isolation="read_uncommitted"))
    assert set(events) == {b"saved:" + v.encode() for v in good} and max(events.values()) == 1
    assert sorted(kafka.values(src + "-dlt")) == sorted(v.encode() for v in poison)


def test_a_named_failed_records_call_leaves_no_rows_and_its_batch_mates_rows_commit_once(
    kafka: KafkaTestKit, pg_engine: sa.Engine
) -> None:
    """RecordFailedError after the bulk insert: that call's rows roll back; the records before the named one are
    called again and commit their rows, the named one is retried and dead-lettered without a row."""
    src, out = kafka.topic(), kafka.topic()
    table = unique_name("named").replace("-", "_")
    fresh_table(pg_engine, table)
    kafka.produce(src, [{"value": b"n%d" % i} for i in range(60)])
    app = App(unique_name("bdb"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")

    @app.batch_listener(src, output=out, database=pg_engine, max_attempts=3, backoff=0, dlq=True, max_batch_records=60)
    def save(records: list[Record]) -> list[bytes]:
        _bulk_insert(table, records)
        for r in records:
            if r.value == b"n21":
                raise kafkatx.RecordFailedError(r) from PoisonError("n21")
        return [r.value or b"" for r in records]

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all records committed")
    good = {f"n{i}" for i in range(60) if i != 21}
    rows = table_rows(pg_engine, table)
    assert set(rows) == good and max(rows.values()) == 1
    assert Counter(kafka.values(out)) == Counter(v.encode() for v in good)
    assert kafka.values(src + "-dlt") == [b"n21"]


_CRASHING_BATCH_APP = """
import logging, sys, sqlalchemy as sa
from kafkatx import App, Record, db
src, out, table, url, bootstrap, group = sys.argv[1:7]
logging.basicConfig(level=logging.WARNING)
app = App("dbcrash", bootstrap_servers=bootstrap, instance_id="crashy", group_id=group)
engine = sa.create_engine(url)

@app.batch_listener(src, output=out, database=engine, max_batch_records=300, fencing="group")
def save(records: list[Record]) -> list[bytes]:
    rows = [{"k": r.value.decode()} for r in records]
    db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), rows)
    return [b"event:" + r.value for r in records]

app.run()
"""


def test_a_crash_between_the_database_and_the_kafka_commit_of_a_batch_repeats_nothing(
    kafka: KafkaTestKit, pg_engine: sa.Engine, postgres: LocalPostgres, tmp_path: Path
) -> None:
    """SIGKILL right after a batch's database commit, before its Kafka commit (batches spanning partitions); the
    restart under the same instance id produces the stored outputs instead of calling the handler again."""
    src, out = kafka.topic(partitions=3), kafka.topic()
    table = unique_name("bcrash").replace("-", "_")
    fresh_table(pg_engine, table)
    values = [f"c{i}" for i in range(2000)]
    kafka.produce(src, [{"value": v.encode(), "partition": i % 3} for i, v in enumerate(values)])
    script = tmp_path / "crashing_batch_app.py"
    script.write_text(textwrap.dedent(_CRASHING_BATCH_APP))
    group = unique_name("bdbcrash")
    args = [sys.executable, str(script), src, out, table, postgres.url, kafka.bootstrap_servers, group]
    env = {**os.environ, "KAFKATX_TEST_CRASH_AFTER_DB_COMMITS": "3"}
    first = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    rows_at_crash = sum(table_rows(pg_engine, table).values())
    committed = sum(max(0, o) for o in kafka.committed(group, src).values())
    assert committed < rows_at_crash, "the crash came before the Kafka commit of the last database commit"

    output = restart_until_caught_up(args, kafka, group, src, 90)
    assert "already committed in the database but not in Kafka" in output, output[-3000:]
    rows = table_rows(pg_engine, table)
    assert set(rows) == set(values) and max(rows.values()) == 1, "a row was written twice (or lost)"
    events = Counter(kafka.values(out))
    assert set(events) == {b"event:" + v.encode() for v in values} and max(events.values()) == 1


def test_an_async_batch_handler_with_a_database_is_refused(kafka: KafkaTestKit, tmp_path: Path) -> None:
    app = App(unique_name("bdb"), bootstrap_servers=kafka.bootstrap_servers)

    async def handle(records: list[Record]) -> None:
        return None

    with pytest.raises(InvalidConfigurationError, match="database= needs a def handler"):
        app.batch_listener("t1", database=f"sqlite:///{tmp_path / 'x.db'}")(handle)
    app.batch_listener("t1", database=f"sqlite:///{tmp_path / 'y.db'}")(lambda records: None)  # a def is fine
