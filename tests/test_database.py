"""database=: the handler's database work and its Kafka records commit as one unit, exactly once on both sides.

One database transaction per Kafka transaction, whatever toolkit the handler uses and however many containers
share the database; constraint violations dead-letter the record that caused them; declarations that cannot work
are refused. Several of these are holes found in review of issue 16, each a test that failed before its fix.
Crashes, outages and a partition's change of owner are in test_database_recovery.py.

Against the local broker and a real PostgreSQL server (the ``postgres`` fixture), and SQLite.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from database_helpers import fresh_table, new_table, table_rows
from helpers import POISON_FQCN, PoisonError

from kafkatx import App, InvalidConfigurationError, NotInTransactionError, Record, db, send
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.events import RecordRecovered, TransactionCommitted
from kafkatx.rollback.classifier import ExceptionClassifier
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for
from kafkatx.testing.postgres import LocalPostgres


@pytest.mark.parametrize(
    "records",
    [2_000, pytest.param(10_000, marks=[pytest.mark.slow, pytest.mark.long])],
    ids=lambda n: f"{n}records",
)
@pytest.mark.parametrize("fencing", ["auto", "group"])
def test_rows_and_events_exactly_once_with_poison_records_dead_lettered_without_rows(
    kafka: KafkaTestKit, pg_engine: sa.Engine, fencing: str, records: int
) -> None:
    """The issue's acceptance run: 1% poison, a row and an event per good record, once each. The default run
    has 2,000 records (20 poison records, 5 in each of the 4 partitions, several to a batch); the issue's
    10,000 (about 7 times as long) run with ``-m long``."""
    src, out = kafka.topic(partitions=4), kafka.topic(partitions=4)
    table = unique_name("people").replace("-", "_")
    fresh_table(pg_engine, table)
    values = [f"p{i}" for i in range(records)]
    poison = {v for i, v in enumerate(values) if i % 100 == 37}
    kafka.produce(src, [(v.encode(), v.encode()) for v in values])
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")

    @app.listener(src, output=out, database=pg_engine, max_attempts=2, dlq=True, fencing=fencing, backoff=0)
    def save(record: Record) -> tuple[bytes | None, bytes]:
        name = record.value.decode()  # type: ignore[union-attr]
        db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'saved')"), {"k": name})
        if name in poison:
            raise PoisonError(name)  # after the insert: the row must roll back with the Kafka transaction
        return record.key, b"saved:" + name.encode()

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 180, message=f"all {records} records committed")
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

    @app.listener(src, output=out, database=database, max_attempts=1, dlq=True, backoff=0)
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


def test_a_constraint_violation_is_not_retried_and_dead_lettered_with_a_clear_cause(
    kafka: KafkaTestKit, pg_engine: sa.Engine
) -> None:
    src, out = kafka.topic(), kafka.topic()
    table = unique_name("uniq").replace("-", "_")
    fresh_table(pg_engine, table, unique=True)
    kafka.produce(src, [b"a", b"b", b"a", b"c"])
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")
    recovered: list[RecordRecovered] = []
    app.on(RecordRecovered)(recovered.append)

    @app.listener(src, output=out, database=pg_engine, max_attempts=5, dlq=True, backoff=0)
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


def test_a_producer_initiated_transaction_commits_or_rolls_back_both(kafka: KafkaTestKit, pg_engine: sa.Engine) -> None:
    out = kafka.topic()
    table = unique_name("ptx").replace("-", "_")
    fresh_table(pg_engine, table)
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

    @app.listener(src, database=lambda: sqlite3.connect(path), max_attempts=1, backoff=0)
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

    @app.listener(src, database=f"sqlite:///{path}", max_attempts=2, dlq=park, backoff=0)
    def save(record: Record) -> None:
        db().execute(sa.text("INSERT INTO done VALUES (:k)"), {"k": record.value.decode()})  # type: ignore[union-attr]
        if record.value == b"bad":
            raise PoisonError("bad record")

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="committed")
    with sqlite3.connect(path) as conn:
        assert sorted(r[0] for r in conn.execute("SELECT k FROM done")) == ["ok1", "ok2"]
        assert list(conn.execute("SELECT k, why FROM failed")) == [("bad", "bad record")]


@pytest.mark.parametrize("fencing", ["group", "partition"])
def test_one_database_transaction_per_kafka_transaction(
    kafka: KafkaTestKit, postgres: LocalPostgres, fencing: str
) -> None:
    """Counted on both sides: SQLAlchemy's commit and rollback events on the listener's engine, and the
    Kafka transactions the container reports; a unit spans the poll's partitions with fencing="group"."""
    engine = sa.create_engine(postgres.url)
    commits: list[int] = []
    sa.event.listen(engine, "commit", lambda conn: commits.append(1))
    try:
        table = new_table(engine)
        commits.clear()
        src, out = kafka.topic(partitions=4), kafka.topic()
        kafka.produce(src, [{"value": f"b{i}".encode(), "partition": i % 4} for i in range(4000)])
        app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")
        kafka_commits: list[TransactionCommitted] = []
        app.on(TransactionCommitted)(kafka_commits.append)

        @app.listener(src, output=out, database=engine, fencing=fencing, max_batch_records=1000)
        def save(record: Record) -> bytes:
            db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": record.value.decode()})  # type: ignore[union-attr]
            return record.value  # type: ignore[return-value]

        with running(app):
            wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")
        units = [e for e in kafka_commits if e.records > 0]
        assert sum(e.records for e in units) == 4000
        # kafkatx creates its tables in one transaction of their own, then one per unit: no more, no less
        assert len(commits) == len(units) + 1, (len(commits), len(units))
        assert len(units) <= 4000 / 100, "batches stayed batches"
        if fencing == "group":
            assert len(units) < 4000 / 1000 * 4, "a unit spans the partitions of a poll"
        assert sum(table_rows(engine, table).values()) == 4000
    finally:
        engine.dispose()


@pytest.mark.parametrize("call", ["commit", "rollback"])
def test_a_sqlalchemy_handler_cannot_end_the_units_transaction(kafka: KafkaTestKit, tmp_path: Path, call: str) -> None:
    """``db().commit()`` is what SQLAlchemy 2 teaches ("commit as you go"); here it would commit the rows
    before the Kafka transaction (and without the position): refused, as on the DB-API path, and the
    record's rows are not committed."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'c.db'}")
    table = new_table(engine)
    src = kafka.topic()
    kafka.produce(src, [b"x", b"y"])
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")
    errors: list[BaseException] = []
    app.on(RecordRecovered)(lambda e: errors.append(e.exception))

    @app.listener(src, database=engine, max_attempts=1, dlq=lambda record, exc: None, backoff=0)
    def save(record: Record) -> None:
        db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": record.value.decode()})  # type: ignore[union-attr]
        if record.value == b"x":
            getattr(db(), call)()

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="committed")
    assert len(errors) == 1 and f"db().{call}() is not allowed" in str(errors[0])
    assert table_rows(engine, table) == Counter({"y": 1}), "the refused record left no row"
    engine.dispose()


def test_the_orm_session_on_db_commits_with_the_unit(kafka: KafkaTestKit, tmp_path: Path) -> None:
    """``Session(db())`` (the documented ORM use): its commit() flushes and leaves the transaction to kafkatx."""
    from sqlalchemy.orm import Session

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'orm.db'}")
    table = new_table(engine)
    src = kafka.topic()
    kafka.produce(src, [b"a", b"b", b"bad"])
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")

    @app.listener(src, database=engine, max_attempts=1, dlq=lambda record, exc: None, backoff=0)
    def save(record: Record) -> None:
        with Session(db()) as session:
            session.execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": record.value.decode()})  # type: ignore[union-attr]
            session.commit()
        if record.value == b"bad":
            raise PoisonError("after the session's commit: rolled back all the same")

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="committed")
    assert table_rows(engine, table) == Counter({"a": 1, "b": 1})
    engine.dispose()


@pytest.mark.parametrize("fencing", ["group", "partition"])
def test_a_deferred_constraint_violation_dead_letters_the_record_that_caused_it_only(
    kafka: KafkaTestKit, pg_engine: sa.Engine, fencing: str
) -> None:
    """A deferred unique constraint fails at the database commit of a unit of many records: which record
    caused it is unknown there, so the unit's records are handled one per transaction to find it. Its
    batch-mates are saved, only it is dead-lettered (not the unit's first record, which is innocent)."""
    table = new_table(pg_engine, "UNIQUE DEFERRABLE INITIALLY DEFERRED")
    with pg_engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {table} (k, v) VALUES ('taken', 'before')"))
    src, out = kafka.topic(), kafka.topic()
    values = [f"d{i}" for i in range(20)]
    values[12] = "taken"
    kafka.produce(src, [v.encode() for v in values])
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")

    @app.listener(
        src, output=out, database=pg_engine, max_attempts=3, dlq=True, fencing=fencing, max_batch_ms=500, backoff=0
    )
    def save(record: Record) -> bytes:
        db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": record.value.decode()})  # type: ignore[union-attr]
        return record.value  # type: ignore[return-value]

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")
    good = [v for v in values if v != "taken"]
    assert table_rows(pg_engine, table) == Counter(good + ["taken"])
    assert Counter(kafka.values(out)) == Counter(v.encode() for v in good)
    dead = kafka.read(src + "-dlt")
    assert [(d.value, parse_dead_letter_headers(d.headers).original_offset) for d in dead] == [(b"taken", 12)]
    assert parse_dead_letter_headers(dead[0].headers).exception_fqcn == "sqlalchemy.exc.IntegrityError"


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_concurrent_containers_share_the_database_exactly_once(
    kafka: KafkaTestKit, tmp_path: Path, postgres: LocalPostgres, database: str
) -> None:
    """concurrency=2: two containers (two connections) write the same database. SQLite serialises their
    units on its write lock (each unit takes it first); PostgreSQL locks one position row per partition."""
    url = f"sqlite:///{tmp_path / 'c.db'}" if database == "sqlite" else postgres.url
    engine = sa.create_engine(url)
    try:
        table = new_table(engine)
        src, out = kafka.topic(partitions=4), kafka.topic()
        kafka.produce(src, [{"value": f"c{i}".encode(), "partition": i % 4} for i in range(3000)])
        app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")
        recovered: list[RecordRecovered] = []
        app.on(RecordRecovered)(recovered.append)

        @app.listener(
            src, output=out, database=engine, concurrency=2, max_attempts=1, dlq=True, max_batch_records=200, backoff=0
        )
        def save(record: Record) -> bytes:
            db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": record.value.decode()})  # type: ignore[union-attr]
            return record.value  # type: ignore[return-value]

        with running(app):
            wait_for(lambda: kafka.caught_up(app.group_id, src), 120, message="all committed")
        expected = {f"c{i}" for i in range(3000)}
        rows = table_rows(engine, table)
        assert set(rows) == expected and max(rows.values()) == 1
        assert Counter(kafka.values(out)) == Counter(v.encode() for v in expected)
        assert recovered == []
    finally:
        engine.dispose()


def test_db_in_a_handler_of_a_listener_without_a_database_says_what_is_missing(kafka: KafkaTestKit) -> None:
    src = kafka.topic()
    kafka.produce(src, [b"x"])
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")
    errors: list[BaseException] = []
    app.on(RecordRecovered)(lambda e: errors.append(e.exception))

    @app.listener(src, max_attempts=1, dlq=lambda record, exc: None, backoff=0)
    def save(record: Record) -> None:
        db()

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="committed")
    [error] = errors
    assert type(error).__name__ == "NotInTransactionError"
    assert "listener declared with database=" in str(error) and "app.transaction(database=" in str(error)


def test_database_declarations_that_cannot_work_are_refused_when_declared(kafka: KafkaTestKit, tmp_path: Path) -> None:
    from sqlalchemy.orm import sessionmaker

    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers)
    with pytest.raises(InvalidConfigurationError, match="in-memory SQLite"):
        app.listener("t1", database="sqlite://")(lambda r: None)
    with pytest.raises(InvalidConfigurationError, match="in-memory SQLite"):
        app.listener("t1", database=sa.create_engine("sqlite:///:memory:"))(lambda r: None)
    with pytest.raises(InvalidConfigurationError, match=r"sessionmaker.*engine"):
        app.listener("t1", database=sessionmaker(sa.create_engine(f"sqlite:///{tmp_path / 'x.db'}")))(lambda r: None)
    sqlite_file = lambda: sqlite3.connect(tmp_path / "ok.db")  # noqa: E731
    app.listener("t2", database=sqlite_file)(lambda r: None)  # a factory is fine


def test_a_handler_that_swallows_a_database_error_gets_a_clear_failure_not_a_stopped_container(
    kafka: KafkaTestKit, pg_engine: sa.Engine
) -> None:
    """PostgreSQL aborts the whole transaction on an error: a handler that catches its IntegrityError and
    returns (the usual "ignore duplicates" idiom) leaves the unit's transaction unusable. That record fails
    with a message that says so and names the way out (a savepoint); its batch-mates commit; the container
    goes on (it used to stop, blaming kafkatx's table rights)."""
    table = new_table(pg_engine, "UNIQUE")
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"a", b"b", b"a", b"c"])
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")
    recovered: list[RecordRecovered] = []
    app.on(RecordRecovered)(recovered.append)

    @app.listener(src, output=out, database=pg_engine, max_attempts=1, dlq=True, backoff=0)
    def save(record: Record) -> bytes:
        try:
            db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": record.value.decode()})  # type: ignore[union-attr]
        except sa.exc.IntegrityError:
            pass  # "already saved": but PostgreSQL has aborted the transaction
        return record.value  # type: ignore[return-value]

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")
    assert table_rows(pg_engine, table) == Counter({"a": 1, "b": 1, "c": 1})
    assert sorted(kafka.values(out)) == [b"a", b"b", b"c"]  # type: ignore[type-var]
    assert [(r.record.offset, type(r.exception).__name__) for r in recovered] == [(2, "RuntimeError")]
    assert "begin_nested" in str(recovered[0].exception)


def test_a_savepoint_lets_a_handler_carry_on_after_a_database_error(kafka: KafkaTestKit, pg_engine: sa.Engine) -> None:
    """The way out the message names: db().begin_nested() around the statement that may fail."""
    table = new_table(pg_engine, "UNIQUE")
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"a", b"b", b"a", b"c"])
    app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")

    @app.listener(src, output=out, database=pg_engine, max_attempts=1, dlq=True, backoff=0)
    def save(record: Record) -> bytes:
        try:
            with db().begin_nested():
                db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": record.value.decode()})  # type: ignore[union-attr]
        except sa.exc.IntegrityError:
            return b"duplicate:" + record.value  # type: ignore[operator]
        return record.value  # type: ignore[return-value]

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")
    assert table_rows(pg_engine, table) == Counter({"a": 1, "b": 1, "c": 1})
    assert sorted(kafka.values(out)) == [b"a", b"b", b"c", b"duplicate:a"]  # type: ignore[type-var]
    assert kafka.read(src + "-dlt", timeout=2) == []


def test_sqlite_units_longer_than_its_busy_timeout_wait_for_each_other_instead_of_failing(
    kafka: KafkaTestKit, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SQLite has one write lock per database file, and a unit holds it from its start to its commit (the
    position is locked first). With concurrency=2 the second container waits for the first's unit; units of
    ~6 s (slow handlers: the default transaction budget is 10 s) outlast sqlite3's 5 s busy timeout, which used
    to end the wait as "database is locked", logged as an outage, with a growing back-off."""
    import time

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'slow.db'}")
    try:
        table = new_table(engine)
        src = kafka.topic(partitions=2)
        kafka.produce(src, [{"value": f"s{i}".encode(), "partition": i % 2} for i in range(80)])
        app = App(unique_name("db"), bootstrap_servers=kafka.bootstrap_servers, instance_id="t")

        @app.listener(src, database=engine, concurrency=2, fencing="partition", max_attempts=1, backoff=0)
        def save(record: Record) -> None:
            time.sleep(0.15)
            db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": record.value.decode()})  # type: ignore[union-attr]

        with running(app):
            wait_for(lambda: kafka.caught_up(app.group_id, src), 90, message="all committed")
        rows = table_rows(engine, table)
        assert set(rows) == {f"s{i}" for i in range(80)} and max(rows.values()) == 1
        assert "database is locked" not in caplog.text
    finally:
        engine.dispose()
