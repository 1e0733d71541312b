"""database=: the handler's database work and its Kafka records commit as one unit, exactly once on both sides.

Against the local broker and a real PostgreSQL server (the ``postgres``
fixture), and SQLite; the crash between the two commits is a real SIGKILL.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from database_helpers import restart_until_caught_up, table_rows
from helpers import POISON_FQCN, PoisonError

from kafkatx import App, InvalidConfigurationError, NotInTransactionError, Record, db, send
from kafkatx.database._store import decode_records, encode_records
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.events import RecordRecovered
from kafkatx.outputs import PendingOutput
from kafkatx.rollback.classifier import ExceptionClassifier
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for
from kafkatx.testing.postgres import LocalPostgres


def _fresh_table(engine: sa.Engine, name: str, unique: bool = False) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
        constraint = " UNIQUE" if unique else ""
        conn.execute(sa.text(f"CREATE TABLE {name} (k VARCHAR(64){constraint}, v VARCHAR(64))"))


@pytest.mark.parametrize("fencing", ["auto", "group"])
def test_rows_and_events_exactly_once_with_poison_records_dead_lettered_without_rows(
    kafka: KafkaTestKit, pg_engine: sa.Engine, fencing: str
) -> None:
    """The issue's acceptance run: 10,000 records, 1% poison, a row and an event per good record, once each."""
    src, out = kafka.topic(partitions=4), kafka.topic(partitions=4)
    table = unique_name("people").replace("-", "_")
    _fresh_table(pg_engine, table)
    values = [f"p{i}" for i in range(10_000)]
    poison = {v for i, v in enumerate(values) if i % 100 == 37}
    kafka.produce(src, [(v.encode(), v.encode()) for v in values])
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")

    @app.listener(src, output=out, database=pg_engine, max_attempts=2, dlq=True, fencing=fencing)
    def save(record: Record) -> tuple[bytes | None, bytes]:
        name = record.value.decode()  # type: ignore[union-attr]
        db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'saved')"), {"k": name})
        if name in poison:
            raise PoisonError(name)  # after the insert: the row must roll back with the Kafka transaction
        return record.key, b"saved:" + name.encode()

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 180, message="all 10,000 records committed")
    rows = table_rows(pg_engine, table)
    good = set(values) - poison
    assert set(rows) == good, (len(rows), len(good))
    assert max(rows.values()) == 1, "a row was written twice"
    events = Counter(kafka.values(out))
    assert set(events) == {b"saved:" + v.encode() for v in good}
    assert max(events.values()) == 1, "an event was produced twice"
    dead = kafka.read(src + "-dlt")
    assert sorted(d.value for d in dead) == sorted(v.encode() for v in poison)  # type: ignore[type-var]
    assert all(parse_dead_letter_headers(d.headers).exception_fqcn == POISON_FQCN for d in dead)


@pytest.mark.parametrize("how", ["sqlite-url", "sqlite3-factory", "psycopg-factory"])
def test_sqlite_and_db_api_rows_and_events_exactly_once(
    kafka: KafkaTestKit, tmp_path: Path, how: str, postgres: LocalPostgres
) -> None:
    """The local default, SQLite, through SQLAlchemy or as a plain sqlite3 connection factory; and a plain
    psycopg connection factory on PostgreSQL (its own parameter style)."""
    import psycopg

    path = tmp_path / "app.db"
    if how == "psycopg-factory":
        table = unique_name("people").replace("-", "_")
        with psycopg.connect(postgres.dsn, autocommit=True) as pg:
            pg.execute(f"CREATE TABLE {table} (k TEXT, v TEXT)")
        database: Any = lambda: psycopg.connect(postgres.dsn)  # noqa: E731
    else:
        table = "people"
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE people (k TEXT, v TEXT)")
        database = f"sqlite:///{path}" if how == "sqlite-url" else (lambda: sqlite3.connect(path))
    src, out = kafka.topic(partitions=2), kafka.topic()
    kafka.produce(src, [f"s{i}".encode() for i in range(500)])
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")

    @app.listener(src, output=out, database=database, max_attempts=1, dlq=True)
    def save(record: Record) -> bytes:
        name = record.value.decode()  # type: ignore[union-attr]
        conn = db()
        if how == "sqlite-url":
            conn.execute(sa.text("INSERT INTO people VALUES (:k, 'x')"), {"k": name})
        elif how == "psycopg-factory":
            conn.execute(f"INSERT INTO {table} VALUES (%s, 'x')", (name,))
        else:
            conn.execute("INSERT INTO people VALUES (?, 'x')", (name,))
        if name.endswith("7"):
            raise PoisonError(name)
        return name.encode()

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")
    if how == "psycopg-factory":
        with psycopg.connect(postgres.dsn) as pg:
            rows = Counter(r[0] for r in pg.execute(f"SELECT k FROM {table}"))
    else:
        with sqlite3.connect(path) as conn:
            rows = Counter(r[0] for r in conn.execute("SELECT k FROM people"))
    good = {f"s{i}" for i in range(500) if not f"s{i}".endswith("7")}
    assert set(rows) == good and max(rows.values()) == 1
    assert Counter(kafka.values(out)) == Counter(v.encode() for v in good)
    assert len(kafka.read(src + "-dlt")) == 50


_CRASHING_APP = """
import logging, sys, sqlalchemy as sa
from kafkatx import App, Record, db
src, out, table, url, bootstrap = sys.argv[1:6]
logging.basicConfig(level=logging.WARNING)
app = App("dbcrash", bootstrap_servers=bootstrap, instance_id="crashy", group_id=sys.argv[6])
engine = sa.create_engine(url)

@app.listener(src, output=out, database=engine, max_batch_records=300, fencing=sys.argv[7])
def save(record: Record) -> bytes:
    db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": record.value.decode()})
    return b"event:" + record.value

app.run()
"""


@pytest.mark.parametrize("fencing", ["partition", "group"])  # one partition per unit, or a poll's partitions together
def test_a_crash_between_the_database_commit_and_the_kafka_commit_repeats_nothing(
    kafka: KafkaTestKit, pg_engine: sa.Engine, postgres: LocalPostgres, tmp_path: Path, fencing: str
) -> None:
    """SIGKILL right after a database commit, before its Kafka commit; restart under the same instance id:
    the stored records are produced instead of calling the handler again, so rows and events are exactly once."""
    src, out = kafka.topic(partitions=3), kafka.topic()
    table = unique_name("crash").replace("-", "_")
    _fresh_table(pg_engine, table)  # no unique constraint: a repeated insert would show as a duplicate row
    values = [f"c{i}" for i in range(2000)]
    kafka.produce(src, [{"value": v.encode(), "partition": i % 3} for i, v in enumerate(values)])  # mixed polls
    script = tmp_path / "crashing_app.py"
    script.write_text(textwrap.dedent(_CRASHING_APP))
    group = unique_name("dbcrash")
    args = [sys.executable, str(script), src, out, table, postgres.url, kafka.bootstrap_servers, group, fencing]
    env = {**os.environ, "KAFKATX_TEST_CRASH_AFTER_DB_COMMITS": "3"}
    first = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    rows_at_crash = sum(table_rows(pg_engine, table).values())
    assert rows_at_crash > 0, "the database committed before the crash"
    committed = sum(max(0, o) for o in kafka.committed(group, src).values())
    assert committed < rows_at_crash, "the crash came before the Kafka commit of the last database commit"
    with pg_engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT kpartition, records FROM kafkatx_outbox WHERE group_id = :g"), {"g": group}
        ).all()
    stored = [(p, out.value or b"") for p, data in rows for out in decode_records(bytes(data))]
    assert stored and all(int(v.split(b"c")[1]) % 3 == p for p, v in stored), "outputs stored under their input"
    if fencing == "group":
        assert len({p for p, _ in stored}) > 1, "the crashed unit spanned several partitions"

    output = restart_until_caught_up(args, kafka, group, src, 90)
    assert "already committed in the database but not in Kafka" in output, output[-3000:]
    rows = table_rows(pg_engine, table)
    assert set(rows) == set(values) and max(rows.values()) == 1, "a row was written twice (or lost)"
    events = Counter(kafka.values(out))
    assert set(events) == {b"event:" + v.encode() for v in values} and max(events.values()) == 1


def test_a_constraint_violation_is_not_retried_and_dead_lettered_with_a_clear_cause(
    kafka: KafkaTestKit, pg_engine: sa.Engine
) -> None:
    src, out = kafka.topic(), kafka.topic()
    table = unique_name("uniq").replace("-", "_")
    _fresh_table(pg_engine, table, unique=True)
    kafka.produce(src, [b"a", b"b", b"a", b"c"])
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")
    recovered: list[RecordRecovered] = []
    app.on(RecordRecovered)(recovered.append)

    @app.listener(src, output=out, database=pg_engine, max_attempts=5, dlq=True)
    def save(record: Record) -> bytes:
        db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": record.value.decode()})  # type: ignore[union-attr]
        return record.value  # type: ignore[return-value]

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")
    assert table_rows(pg_engine, table) == Counter({"a": 1, "b": 1, "c": 1})
    assert sorted(kafka.values(out)) == [b"a", b"b", b"c"]  # type: ignore[type-var]
    [dead] = kafka.read(src + "-dlt")
    headers = parse_dead_letter_headers(dead.headers)
    assert dead.value == b"a" and headers.original_offset == 2
    assert headers.exception_fqcn == "sqlalchemy.exc.IntegrityError"
    assert "unique" in (headers.exception_message or "").lower()
    assert [r.record.attempt for r in recovered] == [1], "a constraint violation is not retried"


def test_the_database_going_down_loses_nothing_and_counts_against_no_record(
    kafka: KafkaTestKit, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = LocalPostgres(tmp_path / "pg").start()
    engine = sa.create_engine(server.url, pool_pre_ping=True)
    try:
        table = "outage"
        _fresh_table(engine, table)
        src, out = kafka.topic(), kafka.topic()
        app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")
        recovered: list[RecordRecovered] = []
        app.on(RecordRecovered)(recovered.append)

        @app.listener(src, output=out, database=engine, max_attempts=2, dlq=True)
        def save(record: Record) -> bytes:
            db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": record.value.decode()})  # type: ignore[union-attr]
            return record.value  # type: ignore[return-value]

        with running(app):
            kafka.produce(src, [f"before{i}".encode() for i in range(50)])
            wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="the first records committed")
            server.stop()
            kafka.produce(src, [f"during{i}".encode() for i in range(50)])
            wait_for(lambda: "retrying in" in caplog.text, 30, message="kafkatx noticed the database is down")
            assert not kafka.caught_up(app.group_id, src)
            server.start()
            wait_for(lambda: kafka.caught_up(app.group_id, src), 90, message="everything committed after the outage")
        expected = {f"before{i}" for i in range(50)} | {f"during{i}" for i in range(50)}
        rows = table_rows(engine, table)
        assert set(rows) == expected and max(rows.values()) == 1
        assert Counter(kafka.values(out)) == Counter(v.encode() for v in expected)
        assert recovered == [], "an outage dead-lettered records"
        assert "the database (SQLAlchemy engine postgresql+psycopg://" in caplog.text
    finally:
        engine.dispose()
        server.stop()


def test_a_producer_initiated_transaction_commits_or_rolls_back_both(kafka: KafkaTestKit, pg_engine: sa.Engine) -> None:
    out = kafka.topic()
    table = unique_name("ptx").replace("-", "_")
    _fresh_table(pg_engine, table)
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")
    with app.transaction(database=pg_engine):
        db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES ('kept', 'x')"))
        send(out, b"kept")
    with pytest.raises(PoisonError), app.transaction(database=pg_engine):
        db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES ('dropped', 'x')"))
        send(out, b"dropped")
        raise PoisonError("no")
    assert table_rows(pg_engine, table) == Counter({"kept": 1})
    assert kafka.values(out) == [b"kept"]


def test_database_declaration_errors_name_the_problem(kafka: KafkaTestKit) -> None:
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers)
    with pytest.raises(InvalidConfigurationError, match='retry="in_place"'):
        app.listener("t1", database="sqlite://", retry="in_place")(lambda r: None)
    with pytest.raises(InvalidConfigurationError, match="database= must be a SQLAlchemy engine"):
        app.listener("t1", database=42)(lambda r: None)
    with pytest.raises(InvalidConfigurationError, match="not a usable database URL"):
        app.listener("t1", database="nosuchdb://x")(lambda r: None)
    with pytest.raises(NotInTransactionError, match="database="):
        db()


def test_a_handler_cannot_commit_kafkatxs_database_transaction(kafka: KafkaTestKit, tmp_path: Path) -> None:
    path = tmp_path / "c.db"
    src = kafka.topic()
    kafka.produce(src, [b"x"])
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")
    errors: list[BaseException] = []
    app.on(RecordRecovered)(lambda e: errors.append(e.exception))

    @app.listener(src, database=lambda: sqlite3.connect(path), max_attempts=1)
    def save(record: Record) -> None:
        db().commit()

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="committed")
    assert len(errors) == 1 and "commits together with the Kafka transaction" in str(errors[0])


def test_database_errors_are_classified_like_spring_classifies_data_access_errors() -> None:
    classifier = ExceptionClassifier()
    assert not classifier.is_retryable(sqlite3.IntegrityError("UNIQUE constraint failed"))
    assert not classifier.is_retryable(sqlite3.ProgrammingError("no such table"))
    assert classifier.is_retryable(sqlite3.OperationalError("database is locked"))
    wrapped = sa.exc.IntegrityError("INSERT", {}, sqlite3.IntegrityError("dup"))
    assert not classifier.is_retryable(wrapped)
    assert ExceptionClassifier(retryable=[sqlite3.IntegrityError]).is_retryable(sqlite3.IntegrityError("x"))
    assert ExceptionClassifier(include_defaults=False).is_retryable(sqlite3.IntegrityError("x"))


def test_two_owners_of_a_partition_cannot_both_commit_its_database_work(postgres: LocalPostgres) -> None:
    """The position row is locked for the unit: a zombie that wakes up after the new owner committed sees the
    records as done (and produces the stored records instead of running the handler)."""
    from kafkatx.database._backend import backend_for
    from kafkatx.database._store import Store

    engine = sa.create_engine(postgres.url)
    backend = backend_for(engine)
    group = unique_name("zombie")
    store = Store(backend, group)
    new_owner, zombie = backend.connect(), backend.connect()
    try:
        backend.begin(new_owner)
        store.create_tables(new_owner)
        backend.commit(new_owner)
        backend.begin(new_owner)
        assert store.lock_position(new_owner, ("t", 0)) == -1
        seen: list[int] = []
        backend.begin(zombie)
        waiter = threading.Thread(target=lambda: seen.append(store.lock_position(zombie, ("t", 0))))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive(), "the second owner waits for the first's unit"
        store.advance(new_owner, ("t", 0), 10, [PendingOutput("out", b"v", b"k", [("h", b"1")], None)])
        backend.commit(new_owner)
        waiter.join(10)
        assert seen == [10], "the second owner sees the first's committed position"
        assert store.outputs_between(zombie, ("t", 0), 0, 10) == [PendingOutput("out", b"v", b"k", [("h", b"1")], None)]
        backend.rollback(zombie)
    finally:
        backend.close(new_owner)
        backend.close(zombie)
        engine.dispose()


def test_the_outbox_keeps_every_field_of_a_record() -> None:
    outputs = [
        PendingOutput("out", b"value", None, None, None),
        PendingOutput("ütf-topic", None, b"", [("h", b"\x00\xff"), ("none", None)], 3),  # type: ignore[list-item]
        PendingOutput("x", b"", b"key", [], None),
    ]
    assert decode_records(encode_records(outputs)) == outputs
    assert decode_records(encode_records([])) == []


_PRODUCING_APP = """
import logging, sys, sqlalchemy as sa
from kafkatx import App, db, send
out, table, url, bootstrap, first, last = sys.argv[1:7]
logging.basicConfig(level=logging.WARNING)
app = App("dbproducer", bootstrap_servers=bootstrap, instance_id="writer")
engine = sa.create_engine(url)
for i in range(int(first), int(last)):
    with app.transaction(database=engine):
        db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": f"u{i}"})
        send(out, f"u{i}-a".encode())
        send(out, f"u{i}-b".encode())
"""


def test_a_producer_initiated_unit_killed_between_its_commits_is_finished_by_the_next_one(
    kafka: KafkaTestKit, pg_engine: sa.Engine, postgres: LocalPostgres, tmp_path: Path
) -> None:
    """app.transaction(database=...): SIGKILL after the database commit of the third unit; the restarted
    process's first unit produces the third unit's stored records before its own, so rows and records are
    exactly once."""
    out = kafka.topic()
    table = unique_name("ptxcrash").replace("-", "_")
    _fresh_table(pg_engine, table)
    script = tmp_path / "producing_app.py"
    script.write_text(textwrap.dedent(_PRODUCING_APP))
    base = [sys.executable, str(script), out, table, postgres.url, kafka.bootstrap_servers]
    env = {**os.environ, "KAFKATX_TEST_CRASH_AFTER_DB_COMMITS": "3"}
    first = subprocess.run([*base, "0", "5"], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert sum(table_rows(pg_engine, table).values()) == 3
    assert sorted(kafka.values(out)) == [b"u0-a", b"u0-b", b"u1-a", b"u1-b"]  # type: ignore[type-var]
    second = subprocess.run([*base, "3", "5"], env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "committed in the database but not in Kafka" in second.stderr
    rows = table_rows(pg_engine, table)
    assert set(rows) == {f"u{i}" for i in range(5)} and max(rows.values()) == 1
    assert kafka.values(out) == [f"u{i}-{x}".encode() for i in range(5) for x in "ab"], "exactly once, in order"


def test_a_recoverer_writes_to_the_database_in_the_recovery_transaction(kafka: KafkaTestKit, tmp_path: Path) -> None:
    path = tmp_path / "r.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE done (k TEXT)")
        conn.execute("CREATE TABLE failed (k TEXT, why TEXT)")
    src = kafka.topic()
    kafka.produce(src, [b"ok1", b"bad", b"ok2"])
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")

    def park(record: Record, exc: BaseException) -> None:
        db().execute(sa.text("INSERT INTO failed VALUES (:k, :why)"), {"k": record.value.decode(), "why": str(exc)})  # type: ignore[union-attr]

    @app.listener(src, database=f"sqlite:///{path}", max_attempts=2, dlq=park)
    def save(record: Record) -> None:
        db().execute(sa.text("INSERT INTO done VALUES (:k)"), {"k": record.value.decode()})  # type: ignore[union-attr]
        if record.value == b"bad":
            raise PoisonError("bad record")

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="committed")
    with sqlite3.connect(path) as conn:
        assert sorted(r[0] for r in conn.execute("SELECT k FROM done")) == ["ok1", "ok2"]
        assert list(conn.execute("SELECT k, why FROM failed")) == [("bad", "bad record")]
