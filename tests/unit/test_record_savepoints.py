"""DatabaseSession.attributing: each record's handler runs in a savepoint of its own (no broker).

A record whose handler raises loses its own statements and nothing else: the rows of the records before it
in the unit stay in the database transaction and commit with it. On SQLite (a sqlite3 connection factory, and
SQLAlchemy: as it comes, and with SQLAlchemy's recipe for pysqlite's transactions) and on PostgreSQL (psycopg,
and SQLAlchemy over psycopg; the ``postgres`` fixture's server). Under SQLAlchemy the record's savepoint is a
NestedTransaction whose statements kafkatx runs on the DB-API connection's cursor (SQLAlchemy would compile them
for every record).
"""

from __future__ import annotations

import sqlite3
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import sqlalchemy as sa
from confluent_kafka import Message

from kafkatx import DatabaseUnavailableError, db
from kafkatx.client.identity import LogIdentity
from kafkatx.database.backend import ABORTED_BY_HANDLER, ENDED_BY_HANDLER
from kafkatx.database.session import DatabaseSession
from kafkatx.record import ConsumedMessage
from kafkatx.testing import unique_name

TOPIC = "in"


@dataclass
class _Record:
    """What the wrapper reads of a record: its partition (the handlers below read its value)."""

    value: str
    offset: int
    topic: str = TOPIC
    partition: int = 0


class _Database:
    """One way of giving kafkatx a database: what ``database=`` gets, and how the test reads the rows back."""

    def __init__(self, kind: str, database: Any, raw: Callable[[], Any], dialect: str) -> None:
        self.kind, self.database, self.raw, self.dialect = kind, database, raw, dialect
        self.table = unique_name("t").replace("-", "_")
        self.run_admin(f"CREATE TABLE {self.table} (k VARCHAR(64) UNIQUE, v VARCHAR(64))")

    def run_admin(self, sql: str) -> list[tuple[Any, ...]]:
        conn = self.raw()
        try:
            cur = conn.cursor()
            cur.execute(sql)
            rows = [tuple(r) for r in cur.fetchall()] if cur.description is not None else []
            conn.commit()
            return rows
        finally:
            conn.close()

    def rows(self) -> list[str]:
        return sorted(str(r[0]) for r in self.run_admin(f"SELECT k FROM {self.table}"))


def _sqlalchemy_begins_sqlite_transactions(engine: sa.Engine) -> None:
    """SQLAlchemy's recipe for pysqlite (its SQLite dialect's documentation, "Serializable isolation /
    Savepoints / Transactional DDL"): the driver's own BEGIN before a write is turned off, SQLAlchemy emits BEGIN."""

    @sa.event.listens_for(engine, "connect")
    def no_driver_begin(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None

    @sa.event.listens_for(engine, "begin")
    def begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN")


@pytest.fixture(params=["sqlite3", "sqlalchemy-sqlite", "sqlalchemy-sqlite-begin", "psycopg", "sqlalchemy-postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[_Database]:
    kind: str = request.param
    engine: sa.Engine | None = None
    if "sqlite" in kind:
        path = tmp_path / "app.db"
        raw: Callable[[], Any] = lambda: sqlite3.connect(path)  # noqa: E731
        dialect = "sqlite"
    else:
        import psycopg

        postgres = request.getfixturevalue("postgres")
        raw, dialect = (lambda: psycopg.connect(postgres.dsn)), "postgresql"
    if kind in ("sqlite3", "psycopg"):  # a connection factory
        given: Any = raw
    else:
        url = f"sqlite:///{tmp_path / 'app.db'}" if dialect == "sqlite" else postgres.url
        given = engine = sa.create_engine(url)
        if kind == "sqlalchemy-sqlite-begin":
            _sqlalchemy_begins_sqlite_transactions(engine)
    try:
        yield _Database(kind, given, raw, dialect)
    finally:
        if engine is not None:
            engine.dispose()


def _session(database: _Database) -> DatabaseSession:
    session = DatabaseSession(database.database, unique_name("group"), "save")
    session._logs[TOPIC] = LogIdentity("cluster", None)  # no broker to ask
    return session


def _begin(session: DatabaseSession, count: int = 3) -> None:
    producer = cast(Any, SimpleNamespace(recorder=None))
    messages = [cast(ConsumedMessage, Message(topic=TOPIC, partition=0, offset=i)) for i in range(count)]
    assert session.begin(producer, messages) == {}


def _commit(session: DatabaseSession, count: int = 3) -> None:
    session.commit({(TOPIC, 0): count}, lambda tp: None)


def _sql(sql: str) -> None:
    """Run ``sql`` on the unit's connection, whatever it is (a SQLAlchemy Connection or a DB-API one)."""
    handle = db()
    if isinstance(handle, sa.Connection):
        handle.execute(sa.text(sql))
    else:
        cur = handle.cursor()
        try:
            cur.execute(sql)
        finally:
            cur.close()


def _insert_sql(database: _Database, key: str) -> str:
    return f"INSERT INTO {database.table} (k, v) VALUES ('{key}', 'x')"


def _insert(database: _Database, key: str) -> None:
    _sql(_insert_sql(database, key))


class Poison(Exception):
    pass


def _run(handle: Callable[[Any], Any], *records: _Record) -> list[str]:
    """Call the wrapped handler for each record, as the runner does; what each did: "ok" or its exception."""
    outcomes = []
    for record in records:
        try:
            handle(record)
            outcomes.append("ok")
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            outcomes.append(f"{type(exc).__name__}: {exc}")
    return outcomes


def _records(*values: str) -> list[_Record]:
    return [_Record(v, i) for i, v in enumerate(values)]


def test_a_failed_record_leaves_no_row_and_the_records_before_it_commit_theirs(database: _Database) -> None:
    def save(record: _Record) -> None:
        _insert(database, record.value)
        _insert(database, record.value + "-2")
        if record.value == "bad":
            raise Poison("after its inserts")

    session = _session(database)
    handle = session.attributing(save)
    try:
        _begin(session)
        assert _run(handle, *_records("a", "bad", "c")) == ["ok", "Poison: after its inserts", "ok"]
        _commit(session)
    finally:
        session.close()
    assert database.rows() == ["a", "a-2", "c", "c-2"]


def test_each_call_of_an_immediate_retry_gets_a_savepoint_of_its_own(database: _Database) -> None:
    calls: list[int] = []

    def save(record: _Record) -> None:
        calls.append(record.offset)
        _insert(database, f"{record.value}-{len(calls)}")
        if len(calls) < 3:
            raise Poison("fails twice")

    session = _session(database)
    handle = session.attributing(save)
    try:
        _begin(session, 1)
        record = _Record("r", 0)
        assert _run(handle, record, record, record) == ["Poison: fails twice", "Poison: fails twice", "ok"]
        _commit(session, 1)
    finally:
        session.close()
    assert database.rows() == ["r-3"]


def test_a_handlers_own_savepoints_nest_inside_the_records(database: _Database) -> None:
    """SQLAlchemy's db().begin_nested(), psycopg's db().transaction(), SQLite's SAVEPOINT: rolled back alone,
    kept alone, and rolled back with the record's when the record fails."""
    sqlalchemy = database.kind.startswith("sqlalchemy")

    def inner(key: str, fail: bool) -> None:
        handle = db()
        try:
            if sqlalchemy:
                with handle.begin_nested():
                    _insert(database, key)
                    if fail:
                        raise Poison("inner")
            elif database.kind == "psycopg":
                with handle.transaction():
                    _insert(database, key)
                    if fail:
                        raise Poison("inner")
            else:
                _sql("SAVEPOINT mine")
                _insert(database, key)
                if fail:
                    _sql("ROLLBACK TO SAVEPOINT mine")
                _sql("RELEASE SAVEPOINT mine")
        except Poison:
            pass

    def save(record: _Record) -> None:
        inner(record.value + "-undone", fail=True)
        inner(record.value + "-kept", fail=False)
        _insert(database, record.value)
        if record.value == "bad":
            raise Poison("after its own savepoints")

    session = _session(database)
    handle = session.attributing(save)
    try:
        _begin(session)
        assert _run(handle, *_records("a", "bad", "c")) == ["ok", "Poison: after its own savepoints", "ok"]
        _commit(session)
    finally:
        session.close()
    assert database.rows() == ["a", "a-kept", "c", "c-kept"]


def test_a_generator_handler_runs_inside_the_savepoint(database: _Database) -> None:
    def save(record: _Record) -> Iterator[bytes]:
        _insert(database, record.value)
        yield b"first"
        if record.value == "bad":
            raise Poison("while yielding")
        yield b"second"

    session = _session(database)
    handle = session.attributing(save)
    try:
        _begin(session)
        assert handle(_Record("a", 0)) == [b"first", b"second"]
        assert _run(handle, _Record("bad", 1)) == ["Poison: while yielding"]
        _commit(session)
    finally:
        session.close()
    assert database.rows() == ["a"]


def test_without_an_open_unit_the_handler_is_called_as_it_is(database: _Database) -> None:
    session = _session(database)
    seen: list[str] = []

    def save(record: _Record) -> str:
        seen.append(record.value)
        return "result"

    handle = session.attributing(save)
    assert handle(_Record("a", 0)) == "result" and seen == ["a"]
    assert session.source == (TOPIC, 0)


def _postgres_only(database: _Database) -> None:
    if database.dialect != "postgresql":
        pytest.skip("PostgreSQL aborts the transaction on a failed statement; SQLite does not")


def test_a_failed_statement_in_a_failing_handler_does_not_poison_the_unit(database: _Database) -> None:
    """PostgreSQL puts the transaction in the failed state on an error; the rollback to the record's savepoint
    repairs it: the records before and after commit. (Under SQLAlchemy the statement fails inside a savepoint
    of the handler's own, left open: kafkatx rolls that back first, through SQLAlchemy.)"""
    _postgres_only(database)
    database.run_admin(f"INSERT INTO {database.table} (k, v) VALUES ('dup', 'earlier')")

    def save(record: _Record) -> None:
        _insert(database, record.value + "-first")
        if isinstance(db(), sa.Connection):
            db().begin_nested()
        _insert(database, record.value)  # "dup": a unique violation, raised through the handler

    session = _session(database)
    handle = session.attributing(save)
    try:
        _begin(session)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # SQLAlchemy warns if a savepoint ends before those inside it
            outcomes = _run(handle, *_records("a", "dup", "c"))
        assert outcomes[0] == outcomes[2] == "ok"
        assert outcomes[1].startswith(("UniqueViolation: ", "IntegrityError: ")), outcomes[1]
        _commit(session)
    finally:
        session.close()
    assert database.rows() == ["a", "a-first", "c", "c-first", "dup"]


def test_a_handler_that_swallows_a_failed_statement_fails_alone_and_the_unit_commits(database: _Database) -> None:
    _postgres_only(database)
    database.run_admin(f"INSERT INTO {database.table} (k, v) VALUES ('dup', 'earlier')")

    def save(record: _Record) -> None:
        _insert(database, record.value + "-first")
        try:
            _insert(database, record.value)
        except Exception:  # noqa: BLE001 - "already there": but PostgreSQL has aborted the transaction
            pass

    session = _session(database)
    handle = session.attributing(save)
    try:
        _begin(session)
        assert _run(handle, *_records("a", "dup", "c")) == ["ok", f"RuntimeError: {ABORTED_BY_HANDLER}", "ok"]
        _commit(session)
    finally:
        session.close()
    assert database.rows() == ["a", "a-first", "c", "c-first", "dup"]


def test_a_connection_lost_under_the_handler_raises_the_handlers_error_and_is_an_outage(database: _Database) -> None:
    _postgres_only(database)

    def save(record: _Record) -> None:
        handle = db()
        raw: Any = handle.connection.dbapi_connection if isinstance(handle, sa.Connection) else handle
        database.run_admin(f"SELECT pg_terminate_backend({raw.info.backend_pid})")
        _insert(database, record.value)

    session = _session(database)
    handle = session.attributing(save)
    try:
        _begin(session, 1)
        with pytest.raises(Exception) as caught:
            handle(_Record("a", 0))
        # the handler's own error (psycopg's AdminShutdown, through SQLAlchemy or not), not the rollback's
        assert "terminating connection due to administrator command" in str(caught.value), caught.value
        assert isinstance(session.lost_connection(caught.value), DatabaseUnavailableError)
    finally:
        session.close()
    assert database.rows() == []


def _sqlalchemy_only(database: _Database) -> None:
    if not database.kind.startswith("sqlalchemy"):
        pytest.skip("SQLAlchemy's own transaction objects")


def test_a_handler_that_ends_kafkatxs_transaction_is_named_not_masked(database: _Database) -> None:
    _sqlalchemy_only(database)

    def save(record: _Record) -> None:
        _insert(database, record.value)
        if record.value == "ends":
            db().get_transaction().rollback()

    session = _session(database)
    handle = session.attributing(save)
    try:
        _begin(session)
        assert _run(handle, *_records("a", "ends")) == ["ok", f"RuntimeError: {ENDED_BY_HANDLER}"]
        with pytest.raises(RuntimeError, match="ended kafkatx's database transaction"):
            _commit(session)
    finally:
        session.close()
    assert database.rows() == []


def test_an_orm_session_joins_with_a_savepoint_of_its_own(database: _Database) -> None:
    """Session(db()) inside the record's savepoint: its rollback() undoes its own work only, its commit() keeps it,
    and one left open (like a db().begin_nested() never ended) is ended with the record's savepoint, through
    SQLAlchemy, so that its view of the connection stays the database's."""
    _sqlalchemy_only(database)
    from sqlalchemy.orm import Session

    left_open: list[Session] = []

    def save(record: _Record) -> None:
        insert = sa.text(f"INSERT INTO {database.table} (k, v) VALUES (:k, 'x')")
        with Session(db()) as session:
            session.execute(insert, {"k": record.value + "-rolled-back"})
            session.rollback()
            session.execute(insert, {"k": record.value})
            session.commit()
        session = Session(db())  # never committed nor closed: its savepoint is inside the record's
        session.execute(insert, {"k": record.value + "-open"})
        left_open.append(session)
        db().begin_nested()  # and one of the handler's own, never ended either
        _insert(database, record.value + "-nested")
        if record.value == "bad":
            raise Poison("after its session's commit")

    session = _session(database)
    handle = session.attributing(save)
    try:
        _begin(session)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # SQLAlchemy warns if a savepoint ends before those inside it
            assert _run(handle, *_records("a", "bad", "c")) == ["ok", "Poison: after its session's commit", "ok"]
            assert db().get_nested_transaction() is None
            _commit(session)
    finally:
        session.close()
    assert database.rows() == ["a", "a-nested", "a-open", "c", "c-nested", "c-open"]


def test_an_orm_flush_that_breaks_a_constraint_fails_its_record_alone(database: _Database) -> None:
    """The ORM's most common failure: Session(db()).commit() whose flush breaks a unique constraint. SQLAlchemy
    rolls back the session's transaction: its savepoint (kafkatx's record's is a NestedTransaction, which the
    Session sees), not kafkatx's transaction. The record fails, its batch-mates commit."""
    _sqlalchemy_only(database)
    from sqlalchemy.orm import Session, registry

    database.run_admin(f"INSERT INTO {database.table} (k, v) VALUES ('dup', 'earlier')")
    mapper = registry()
    table = sa.Table(
        database.table, mapper.metadata, sa.Column("k", sa.String(64), primary_key=True), sa.Column("v", sa.String(64))
    )

    class Row:
        def __init__(self, k: str) -> None:
            self.k, self.v = k, "x"

    mapper.map_imperatively(Row, table)

    def save(record: _Record) -> None:
        with Session(db()) as session:
            session.add(Row(record.value + "-first"))
            session.flush()
            session.add(Row(record.value))  # "dup": a unique violation at the commit's flush
            session.commit()

    session = _session(database)
    handle = session.attributing(save)
    try:
        _begin(session)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            outcomes = _run(handle, *_records("a", "dup", "c"))
        assert outcomes[0] == outcomes[2] == "ok", outcomes
        assert outcomes[1].startswith("IntegrityError: "), outcomes[1]
        _commit(session)
    finally:
        session.close()
    assert database.rows() == ["a", "a-first", "c", "c-first", "dup"]


@pytest.mark.parametrize("then", ["raises", "returns"])
def test_a_savepoint_the_handler_released_itself_keeps_the_unit_from_committing(database: _Database, then: str) -> None:
    """The handler released kafkatx's savepoint with SQL of its own: if it then raises, its rows cannot be taken
    out of the transaction (the handler's own error is what the call raises); if it returns, kafkatx's release
    fails (that error is the record's). Either way the transaction does not commit."""

    def save(record: _Record) -> None:
        _insert(database, record.value)
        if record.value == "bad":
            _sql("RELEASE SAVEPOINT kafkatx_record")
            if then == "raises":
                raise Poison("after releasing kafkatx's savepoint")

    session = _session(database)
    handle = session.attributing(save)
    try:
        _begin(session)
        outcomes = _run(handle, *_records("a", "bad"))
        if then == "raises":
            assert outcomes == ["ok", "Poison: after releasing kafkatx's savepoint"]
            expected = "could not roll a failed record's database work back to its savepoint"
        else:
            assert outcomes[0] == "ok"
            # the driver's error (wrapped by SQLAlchemy under SQLAlchemy, as for its own statements)
            assert "no such savepoint: kafkatx_record" in outcomes[1] or (
                'savepoint "kafkatx_record" does not exist' in outcomes[1]
            ), outcomes[1]
            expected = "could not release a record's savepoint"
        with pytest.raises(RuntimeError, match=expected):
            _commit(session)
    finally:
        session.close()
    assert database.rows() == []


def test_a_unit_rolled_back_after_its_records_leaves_no_row(database: _Database) -> None:
    """Releasing a record's savepoint commits nothing (it would on SQLite if the savepoint had begun the
    transaction: kafkatx's transaction is open in the database before the first record's savepoint)."""
    session = _session(database)
    handle = session.attributing(lambda record: _insert(database, record.value))
    try:
        _begin(session)
        assert _run(handle, *_records("a", "b")) == ["ok", "ok"]
        assert database.rows() == []  # another connection sees nothing yet
        session.rollback()  # the Kafka side failed, say
    finally:
        session.close()
    assert database.rows() == []


def test_a_connection_lost_between_records_fails_the_savepoint_as_an_outage(database: _Database) -> None:
    """The server dropped the connection while no statement ran: the record's SAVEPOINT is the first to know
    (under SQLAlchemy too, though SQLAlchemy does not run it: kafkatx invalidates the Connection as it would)."""
    _postgres_only(database)
    calls: list[str] = []
    session = _session(database)
    handle = session.attributing(lambda record: calls.append(record.value))
    try:
        _begin(session, 1)
        conn = session._conn
        raw: Any = conn.connection.dbapi_connection if isinstance(conn, sa.Connection) else conn
        database.run_admin(f"SELECT pg_terminate_backend({raw.info.backend_pid})")
        with pytest.raises(Exception) as caught:
            handle(_Record("a", 0))
        assert calls == []
        assert isinstance(session.lost_connection(caught.value), DatabaseUnavailableError)
    finally:
        session.close()


def _trace(conn: Any, statements: list[str]) -> Any:
    """Record the statements ``conn`` (sqlite3 or psycopg) runs: sqlite3's trace, or a psycopg cursor factory."""
    if isinstance(conn, sqlite3.Connection):
        conn.set_trace_callback(statements.append)
        return conn
    import psycopg

    class Traced(psycopg.Cursor[Any]):
        def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            statements.append(str(query))
            return super().execute(query, *args, **kwargs)

    conn.cursor_factory = Traced
    return conn


def test_a_record_costs_one_savepoint_and_one_release(database: _Database) -> None:
    """On the happy path: the handler's statements, plus SAVEPOINT and RELEASE, nothing else, as the driver sees
    them. Under SQLAlchemy these two do not go through SQLAlchemy's execution (which compiles them anew for every
    record): its before_cursor_execute event sees the handler's statements only."""
    statements: list[str] = []
    through_sqlalchemy: list[str] = []
    if isinstance(database.database, sa.Engine):
        sa.event.listen(database.database, "connect", lambda dbapi_conn, record: _trace(dbapi_conn, statements))
        sa.event.listen(database.database, "before_cursor_execute", lambda *args: through_sqlalchemy.append(args[2]))
    else:
        raw = database.raw
        database = _Database(database.kind, lambda: _trace(raw(), statements), raw, database.dialect)
    session = _session(database)
    handle = session.attributing(lambda record: _insert(database, record.value))
    try:
        _begin(session)
        statements.clear()
        through_sqlalchemy.clear()
        _run(handle, *_records("a", "b"))
        per_record = ["SAVEPOINT kafkatx_record", "{insert}", "RELEASE SAVEPOINT kafkatx_record"]
        assert statements == [s.format(insert=_insert_sql(database, v)) for v in "ab" for s in per_record]
        if isinstance(database.database, sa.Engine):
            assert through_sqlalchemy == [_insert_sql(database, v) for v in "ab"]
        _commit(session)
    finally:
        session.close()
    assert database.rows() == ["a", "b"]


def test_sqlalchemys_savepoint_events_still_fire(database: _Database) -> None:
    """kafkatx runs the savepoint statements on the DB-API cursor, but SQLAlchemy's savepoint events are emitted
    as SQLAlchemy emits them, for the record's savepoint and for the handler's own."""
    _sqlalchemy_only(database)
    events: list[str] = []
    engine = database.database
    sa.event.listen(engine, "savepoint", lambda conn, name: events.append(f"savepoint {name}"))
    sa.event.listen(engine, "release_savepoint", lambda conn, name, ctx: events.append(f"release {name}"))
    sa.event.listen(engine, "rollback_savepoint", lambda conn, name, ctx: events.append(f"rollback {name}"))

    def save(record: _Record) -> None:
        with db().begin_nested():
            _insert(database, record.value)
        if record.value == "bad":
            raise Poison("after its own savepoint")

    session = _session(database)
    handle = session.attributing(save)
    try:
        _begin(session, 2)
        assert _run(handle, *_records("a", "bad")) == ["ok", "Poison: after its own savepoint"]
        _commit(session, 2)
    finally:
        session.close()
    assert events == [
        "savepoint None",  # (SQLAlchemy names it after the event)
        "savepoint None",
        "release sa_savepoint_1",
        "release kafkatx_record",
        "savepoint None",
        "savepoint None",
        "release sa_savepoint_2",
        "rollback kafkatx_record",
    ]
    assert database.rows() == ["a"]
