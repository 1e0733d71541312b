"""database=: nothing lost or repeated when a unit is cut short: crashes between the two commits, the database
going away, a zombie fenced after its database commit, a new owner of a partition, the outbox left behind.

Several of these are holes found in review of issue 16, each a test that failed before its fix. Against the
local broker and a real PostgreSQL server (the ``postgres`` fixture), or SQLite files; a crash is a real SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient
from database_helpers import fresh_table, new_table, restart_until_caught_up, table_rows

from kafkatx import App, InvalidConfigurationError, Record, db, send
from kafkatx.database._store import decode_records, encode_records
from kafkatx.events import HandlerFailed, RecordRecovered
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for
from kafkatx.testing.postgres import LocalPostgres

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
    fresh_table(pg_engine, table)  # no unique constraint: a repeated insert would show as a duplicate row
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
    stored = [(p, out[1] or b"") for p, data in rows for out in decode_records(bytes(data))]
    assert stored and all(int(v.split(b"c")[1]) % 3 == p for p, v in stored), "outputs stored under their input"
    if fencing == "group":
        assert len({p for p, _ in stored}) > 1, "the crashed unit spanned several partitions"

    output = restart_until_caught_up(args, kafka, group, src, 90)
    assert "already committed in the database but not in Kafka" in output, output[-3000:]
    rows = table_rows(pg_engine, table)
    assert set(rows) == set(values) and max(rows.values()) == 1, "a row was written twice (or lost)"
    events = Counter(kafka.values(out))
    assert set(events) == {b"event:" + v.encode() for v in values} and max(events.values()) == 1


def test_the_database_going_down_loses_nothing_and_counts_against_no_record(
    kafka: KafkaTestKit, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = LocalPostgres(tmp_path / "pg").start()
    engine = sa.create_engine(server.url, pool_pre_ping=True)
    try:
        table = "outage"
        fresh_table(engine, table)
        src, out = kafka.topic(), kafka.topic()
        app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")
        recovered: list[RecordRecovered] = []
        app.on(RecordRecovered)(recovered.append)

        @app.listener(src, output=out, database=engine, max_attempts=2, dlq=True, backoff=0)
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


def test_two_owners_of_a_partition_cannot_both_commit_its_database_work(postgres: LocalPostgres) -> None:
    """The position row is locked for the unit: a zombie that wakes up after the new owner committed sees the
    records as done (and produces the stored records instead of running the handler)."""
    from kafkatx.database._store import Store
    from kafkatx.database.backend import backend_for

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
        store.advance(new_owner, ("t", 0), 10, [("out", b"v", b"k", [("h", b"1")], None)])
        backend.commit(new_owner)
        waiter.join(10)
        assert seen == [10], "the second owner sees the first's committed position"
        assert store.outputs_between(zombie, ("t", 0), 0, 10) == [("out", b"v", b"k", [("h", b"1")], None)]
        backend.rollback(zombie)
    finally:
        backend.close(new_owner)
        backend.close(zombie)
        engine.dispose()


def test_the_outbox_keeps_every_field_of_a_record() -> None:
    outputs = [
        ("out", b"value", None, None, None),
        ("ütf-topic", None, b"", [("h", b"\x00\xff"), ("none", None)], 3),  # type: ignore[list-item]
        ("x", b"", b"key", [], None),
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
    fresh_table(pg_engine, table)
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


def test_a_producer_initiated_unit_whose_database_commit_fails_leaves_no_kafka_transaction_open(
    kafka: KafkaTestKit, pg_engine: sa.Engine
) -> None:
    """A deferred constraint fails at the database commit: the block's exception is the database's, the
    Kafka transaction is aborted (nothing visible), and the next ``app.transaction`` of the thread works."""
    out = kafka.topic()
    table = new_table(pg_engine, "UNIQUE DEFERRABLE INITIALLY DEFERRED")
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")
    with pytest.raises(sa.exc.IntegrityError):
        with app.transaction(database=pg_engine):
            db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES ('dup', 'x'), ('dup', 'y')"))
            send(out, b"never")
    with app.transaction(database=pg_engine):
        db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES ('next', 'x')"))
        send(out, b"next")
    assert table_rows(pg_engine, table) == Counter({"next": 1})
    assert kafka.values(out) == [b"next"]


@pytest.mark.parametrize("how", ["engine", "psycopg-factory", "engine, error swallowed", "psycopg, error swallowed"])
def test_a_connection_killed_under_a_handler_is_an_outage_not_the_records_failure(
    kafka: KafkaTestKit, pg_engine: sa.Engine, postgres: LocalPostgres, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """The server ends the unit's connection while the handler uses it (a restart, a failover, an idle
    timeout, pg_terminate_backend): no attempt is counted, nothing is dead-lettered even with
    max_attempts=1; the unit is done again on a new connection, rows and events once."""
    import psycopg

    table = new_table(pg_engine)
    database: Any = pg_engine if how.startswith("engine") else (lambda: psycopg.connect(postgres.dsn))
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [f"r{i}".encode() for i in range(30)])
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")
    recovered: list[RecordRecovered] = []
    failed: list[HandlerFailed] = []
    app.on(RecordRecovered)(recovered.append)
    app.on(HandlerFailed)(failed.append)
    killed = threading.Event()

    def execute(sql: str, params: dict[str, Any]) -> Any:
        try:
            if how.startswith("engine"):
                return db().execute(sa.text(sql), params)
            return db().execute(sql.replace(":k", "%(k)s").replace(":pid", "%(pid)s"), params)
        except (sa.exc.OperationalError, psycopg.OperationalError):
            if "swallowed" not in how:
                raise
            return None  # a broad except in the handler: kafkatx sees the connection is gone all the same

    @app.listener(src, output=out, database=database, max_attempts=1, dlq=True, backoff=0)
    def save(record: Record) -> bytes:
        if record.value == (b"r29" if "swallowed" in how else b"r17") and not killed.is_set():  # (r29: the last)
            killed.set()
            pid = execute("SELECT pg_backend_pid()", {}).fetchone()[0]
            with pg_engine.connect() as other:
                other.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        execute(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')", {"k": record.value.decode()})  # type: ignore[union-attr]
        return record.value  # type: ignore[return-value]

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")
    assert killed.is_set()
    assert recovered == [] and failed == [], "an outage counted against a record"
    expected = {f"r{i}" for i in range(30)}
    rows = table_rows(pg_engine, table)
    assert set(rows) == expected and max(rows.values()) == 1
    assert Counter(kafka.values(out)) == Counter(v.encode() for v in expected)
    assert "retrying in" in caplog.text


def test_the_server_stopped_in_the_middle_of_a_unit_and_started_again(
    kafka: KafkaTestKit, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL stops while a handler is between two statements of a unit (and records keep arriving),
    then starts again: nothing lost, nothing twice, no attempt counted, no dead letter."""
    server = LocalPostgres(tmp_path / "pg").start()
    engine = sa.create_engine(server.url)
    try:
        table = new_table(engine)
        src, out = kafka.topic(partitions=2), kafka.topic()
        app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")
        recovered: list[RecordRecovered] = []
        failed: list[HandlerFailed] = []
        app.on(RecordRecovered)(recovered.append)
        app.on(HandlerFailed)(failed.append)
        stopped = threading.Event()

        @app.listener(src, output=out, database=engine, max_attempts=1, dlq=True, backoff=0)
        def save(record: Record) -> bytes:
            name = record.value.decode()  # type: ignore[union-attr]
            db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'first')"), {"k": name})
            if name == "m150" and not stopped.is_set():
                server.stop()  # between this record's two statements
                stopped.set()
            db().execute(sa.text(f"UPDATE {table} SET v = 'second' WHERE k = :k"), {"k": name})
            return record.value  # type: ignore[return-value]

        with running(app):
            kafka.produce(src, [f"m{i}".encode() for i in range(300)])
            wait_for(stopped.is_set, 60, message="the server stopped under a handler")
            kafka.produce(src, [f"m{i}".encode() for i in range(300, 400)])
            wait_for(lambda: "retrying in" in caplog.text, 30, message="kafkatx noticed the database is down")
            server.start()
            wait_for(lambda: kafka.caught_up(app.group_id, src), 120, message="everything committed after the outage")
        expected = {f"m{i}" for i in range(400)}
        rows = table_rows(engine, table)
        assert set(rows) == expected and max(rows.values()) == 1
        with engine.connect() as conn:
            assert conn.execute(sa.text(f"SELECT COUNT(*) FROM {table} WHERE v <> 'second'")).scalar() == 0
        assert Counter(kafka.values(out)) == Counter(v.encode() for v in expected)
        assert recovered == [] and failed == [], "an outage counted against a record"
    finally:
        engine.dispose()
        server.stop()


def test_the_outbox_keeps_only_what_kafka_has_not_been_seen_to_commit(
    kafka: KafkaTestKit, pg_engine: sa.Engine
) -> None:
    """Rows behind the offset this owner saw Kafka commit are deleted by the next unit of their partition:
    after many units, at most the last unit's row per partition is left, keyed by the committed offset."""
    table = new_table(pg_engine)
    src, out = kafka.topic(partitions=3), kafka.topic()
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")

    @app.listener(src, output=out, database=pg_engine, max_batch_records=50)
    def save(record: Record) -> bytes:
        db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": record.value.decode()})  # type: ignore[union-attr]
        return record.value  # type: ignore[return-value]

    with running(app):
        for batch in range(10):  # ten waves: ten or more units per partition
            kafka.produce(src, [{"value": f"o{batch}-{i}".encode(), "partition": i % 3} for i in range(150)])
            wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="the wave committed")
    committed = kafka.committed(app.group_id, src)
    with pg_engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT kpartition, next_offset FROM kafkatx_outbox WHERE group_id = :g"), {"g": app.group_id}
        ).all()
    per_partition = Counter(p for p, _ in rows)
    assert max(per_partition.values()) == 1, rows
    assert all(offset == committed[p] for p, offset in rows), (rows, committed)


_CRASHING_APP_WITH_DEAD_LETTERS = """
import logging, os, signal, sys, sqlalchemy as sa
from kafkatx import App, Record, db
from kafkatx.database.session import DatabaseSession
src, out, table, url, bootstrap, group, poison_file = sys.argv[1:8]
logging.basicConfig(level=logging.WARNING)

if os.environ.get("CRASH_AT_A_SPANNING_DEAD_LETTER"):
    # SIGKILL right after the first database commit of a transaction over several input partitions that
    # dead-letters a record (an after-rollback transaction: batch-mates replayed, the poison recovered)
    commit = DatabaseSession.commit
    def commit_then_die(self, offsets, committed):
        spanning = len(offsets) > 1 and any(o[0].endswith("-dlt") for o in self._outputs)
        commit(self, offsets, committed)
        if spanning:
            os.kill(os.getpid(), signal.SIGKILL)
    DatabaseSession.commit = commit_then_die

app = App("dbcrash", bootstrap_servers=bootstrap, instance_id="crashy", group_id=group)
engine = sa.create_engine(url)
unit = {"txn": None, "partitions": set()}

@app.listener(src, output=out, database=engine, max_batch_records=1000, max_batch_ms=2000, fencing="group",
              max_attempts=1, dlq=True, backoff=0)
def save(record: Record) -> bytes:
    name = record.value.decode()
    if db().get_transaction() is not unit["txn"]:
        unit["txn"], unit["partitions"] = db().get_transaction(), set()
    poison = open(poison_file).read() if os.path.exists(poison_file) else None
    if poison is None and unit["partitions"] - {record.partition}:
        # the poison: the first record of a unit that follows records of another partition in it, so that
        # its after-rollback transaction replays batch-mates of several partitions
        with open(poison_file, "w") as f:
            f.write(name)
        poison = name
    unit["partitions"].add(record.partition)
    db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": name})
    if name == poison:
        raise ValueError(f"poison {name}")
    return b"event:" + record.value

app.run()
"""


def test_a_crash_after_the_database_commit_of_a_unit_with_dead_letters_repeats_nothing(
    kafka: KafkaTestKit, pg_engine: sa.Engine, postgres: LocalPostgres, tmp_path: Path
) -> None:
    """fencing="group": a unit spans the partitions of a poll. A poison record that follows records of
    another partition in its unit fails; the after-rollback transaction replays those batch-mates and
    dead-letters it. SIGKILL right after that transaction's database commit: its events are stored under their
    own records' partitions and the dead letter under the poison's; the restarted process produces what is
    stored instead of calling the handler: rows, events and the dead letter exactly once."""
    src, out = kafka.topic(partitions=3), kafka.topic()
    table = new_table(pg_engine)
    values = [f"c{i}" for i in range(1200)]
    kafka.produce(src, [{"value": v.encode(), "partition": i % 3} for i, v in enumerate(values)])
    script = tmp_path / "crashing_app.py"
    script.write_text(textwrap.dedent(_CRASHING_APP_WITH_DEAD_LETTERS))
    group = unique_name("dbcrash")
    poison_file = tmp_path / "poison"
    args = [
        sys.executable,
        str(script),
        src,
        out,
        table,
        postgres.url,
        kafka.bootstrap_servers,
        group,
        str(poison_file),
    ]
    env = {**os.environ, "CRASH_AT_A_SPANNING_DEAD_LETTER": "1"}
    first = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    poison = poison_file.read_text()
    with pg_engine.connect() as conn:
        stored = conn.execute(
            sa.text("SELECT kpartition, next_offset, records FROM kafkatx_outbox WHERE group_id = :g"), {"g": group}
        ).all()
    outputs = [(p, o) for p, _, data in stored for o in decode_records(bytes(data))]
    [(p, letter)] = [(p, o) for p, o in outputs if o[0] == src + "-dlt"]
    _, value, _, _, partition = letter
    assert value == poison.encode() and int(poison[1:]) % 3 == p == partition, "under its record"
    events = [(p, o[1] or b"") for p, o in outputs if o[0] == out]
    assert events and len({p for p, _ in outputs}) > 1, "the crashed transaction spans partitions"
    assert all(int(v.split(b"c")[1]) % 3 == p for p, v in events), "each event under its record's partition"

    output = restart_until_caught_up(args, kafka, group, src, 120)
    assert "already committed in the database but not in Kafka" in output, output[-3000:]
    rows = table_rows(pg_engine, table)
    assert set(rows) == set(values) - {poison} and max(rows.values()) == 1
    assert Counter(kafka.values(out)) == Counter(b"event:" + v.encode() for v in values if v != poison)
    dead = kafka.read(src + "-dlt")
    assert [d.value for d in dead] == [poison.encode()], "the poison dead-lettered once"


@pytest.mark.parametrize("fencing", ["partition", "group"])
def test_a_zombie_fenced_after_its_database_commit_is_finished_by_the_new_owner_from_the_outbox(
    kafka: KafkaTestKit, pg_engine: sa.Engine, fencing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stalls between its database commit and its Kafka commit; B, the same instance restarted (same
    group.instance.id and transactional.id), takes the partitions over and fences A's producer. B finds the
    database ahead of Kafka and produces A's stored records instead of running the handler; A's late Kafka
    commit fails. Every record's handler ran once, rows and events exactly once."""
    from kafkatx.database.session import DatabaseSession

    table = new_table(pg_engine)
    src, out = kafka.topic(partitions=2), kafka.topic()
    values = [f"z{i}" for i in range(600)]
    kafka.produce(src, [{"value": v.encode(), "partition": i % 2} for i, v in enumerate(values)])
    group = unique_name("zombie")
    stalled, resume = threading.Event(), threading.Event()
    original = DatabaseSession.commit

    def commit_then_stall(self: DatabaseSession, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if threading.current_thread().name.startswith("kafkatx-") and not stalled.is_set() and self.listener == "a":
            stalled.set()
            resume.wait(60)  # the database has committed; the Kafka commit waits

    monkeypatch.setattr(DatabaseSession, "commit", commit_then_stall)
    calls: Counter[str] = Counter()

    def make(name: str) -> App:
        app = App(group, bootstrap_servers=kafka.bootstrap_servers, instance_id="same", group_id=group)

        @app.listener(
            src,
            output=out,
            database=pg_engine,
            fencing=fencing,
            max_batch_records=100,
            name=name,
            consumer_config={"group.instance.id": "same-member"},
        )
        def save(record: Record) -> bytes:
            calls[record.value.decode()] += 1  # type: ignore[union-attr]
            db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": record.value.decode()})  # type: ignore[union-attr]
            return record.value  # type: ignore[return-value]

        return app

    a, b = make("a"), make("b")
    a.start()
    try:
        wait_for(stalled.is_set, 60, message="A committed its first unit to the database")
        with running(b):
            wait_for(lambda: kafka.caught_up(group, src), 90, message="B committed everything")
            resume.set()  # A wakes up: its Kafka commit must not go through
            wait_for(lambda: not any(c.alive and c.assignment for c in a.containers), 60, message="A gave up")
    finally:
        resume.set()
        try:
            a.stop(timeout=30)
        except Exception:  # noqa: BLE001 - A was fenced: its container may well have stopped with an error
            pass
    rows = table_rows(pg_engine, table)
    assert set(rows) == set(values) and max(rows.values()) == 1
    assert Counter(kafka.values(out)) == Counter(v.encode() for v in values), "events exactly once"
    assert set(calls) == set(values) and max(calls.values()) == 1, "no handler ran twice"


@pytest.mark.parametrize("statements", ["one statement", "portable"])
def test_a_second_owner_reads_the_position_only_once_it_holds_the_lock(
    postgres: LocalPostgres, statements: str
) -> None:
    """The position is locked and read in one statement on PostgreSQL and SQLite (INSERT ... ON CONFLICT ...
    RETURNING); elsewhere (MySQL, ...) in separate statements, which must lock before they read: a SELECT
    before the lock returns the position as it was before the first owner's commit, and the zombie would
    run the handler again for records whose rows are committed."""
    from kafkatx.database._store import Store
    from kafkatx.database.backend import backend_for

    engine = sa.create_engine(postgres.url)
    backend = backend_for(engine)
    group = unique_name("lockread")
    store = Store(backend, group)
    store._returning = statements == "one statement"
    new_owner, zombie = backend.connect(), backend.connect()
    try:
        backend.begin(new_owner)
        store.create_tables(new_owner)
        assert store.lock_position(new_owner, ("t", 0)) == -1  # the row exists from an earlier unit
        store.advance(new_owner, ("t", 0), 5, [])
        backend.commit(new_owner)
        backend.begin(new_owner)
        assert store.lock_position(new_owner, ("t", 0)) == 5
        seen: list[int] = []
        backend.begin(zombie)
        waiter = threading.Thread(target=lambda: seen.append(store.lock_position(zombie, ("t", 0))))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive(), "the second owner waits for the first's unit"
        store.advance(new_owner, ("t", 0), 10, [])
        backend.commit(new_owner)
        waiter.join(10)
        assert seen == [10], "the second owner sees the first's committed position"
        backend.rollback(zombie)
    finally:
        backend.close(new_owner)
        backend.close(zombie)
        engine.dispose()


def test_a_database_from_another_cluster_or_an_earlier_topic_is_refused_not_trusted(
    kafka: KafkaTestKit, tmp_path: Path
) -> None:
    """The positions kafkatx keeps belong with the Kafka log they were written for. The topic deleted and
    created again (or a new cluster, a temporary local broker) starts at offset 0 while the database says
    the partition is done up to 10: trusting it would skip the new records without running the handler and
    publish the old unit's stored events. The container stops instead, saying what to delete."""
    from kafkatx.testing.helpers import delete_topics

    url = f"sqlite:///{tmp_path / 'kept.db'}"
    engine = sa.create_engine(url)
    table = new_table(engine)
    src = unique_name("recreated")
    group = unique_name("db")

    def app_with_records(values: list[bytes]) -> App:
        kafka.topic(name=src)
        kafka.produce(src, values)
        app = App(group, bootstrap_servers=kafka.bootstrap_servers, instance_id="t", static_membership=False)

        @app.listener(src, database=url)
        def save(record: Record) -> None:
            db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": record.value.decode()})  # type: ignore[union-attr]

        return app

    first = app_with_records([f"old{i}".encode() for i in range(10)])
    with running(first):
        wait_for(lambda: kafka.caught_up(group, src), 30, message="the first topic committed")
    delete_topics(kafka.bootstrap_servers, [src])
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 0})
    for future in admin.delete_consumer_groups([group], request_timeout=10).values():
        future.result(timeout=15)
    wait_for(lambda: src not in admin.list_topics(timeout=5).topics, 15, message="the topic deleted")  # noqa: F821 (read before the del below)
    del admin, future

    second = app_with_records([b"new0", b"new1", b"new2"])
    with pytest.raises(InvalidConfigurationError, match=r"kafkatx_offsets.*delete"):
        with running(second):
            wait_for(lambda: not any(c.alive for c in second.containers), 30, message="the container stopped")
    assert set(table_rows(engine, table)) == {f"old{i}" for i in range(10)}, "nothing of the new topic skipped as done"
    engine.dispose()
