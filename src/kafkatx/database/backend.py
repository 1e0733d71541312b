"""One interface over a SQLAlchemy engine and a plain DB-API connection factory.

kafkatx needs little from a database: a connection, a transaction on it,
a few statements of its own and commit/rollback. Users keep the toolkit they
already have: ``database=engine`` (SQLAlchemy 2), ``database="sqlite:///app.db"``
(a URL, through SQLAlchemy) or ``database=lambda: sqlite3.connect("app.db")``
(any DB-API 2 driver: sqlite3, psycopg, ...).

A listener's declaration and ``app.transaction()`` take their ``database=``
through it too, so it is not private to this package.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kafkatx.errors import InvalidConfigurationError
from kafkatx.errors.dbapi import is_connection_error

__all__ = ["Backend", "ManagedConnection", "backend_for", "is_connection_error"]

_NAMED = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


class Backend:
    """How kafkatx talks to one database. Subclasses: SQLAlchemy, DB-API."""

    #: "sqlite", "postgresql" or the dialect's own name (the DDL uses it for the binary column type).
    dialect: str = "generic"
    #: What ``database=`` was, for messages.
    described: str = ""

    def connect(self) -> Any:
        raise NotImplementedError

    def begin(self, conn: Any) -> Any:
        """Begin a transaction on ``conn``; a token for :meth:`still_open` (None if there is nothing to check)."""
        raise NotImplementedError

    def still_open(self, conn: Any, token: Any) -> bool:
        """False if the transaction ``begin`` returned ``token`` for was ended behind kafkatx's back."""
        return True

    def broken(self, conn: Any) -> bool:
        """True if ``conn`` lost its server (the driver or SQLAlchemy marked it closed or invalid)."""
        return False

    def unusable(self, conn: Any, token: Any) -> str | None:
        """Why the open transaction cannot commit any more because of what a handler did, or None.

        Checked after each handler call (no round trip: the driver's own state).
        """
        return None

    def savepoint(self, conn: Any) -> Any:
        """Mark a savepoint in the open transaction (one statement); a token for :meth:`release` or
        :meth:`rollback_to`. Each record's handler runs inside one, so that its failure undoes only its own work."""
        self.execute(conn, SAVEPOINT)
        return None

    def release(self, conn: Any, token: Any) -> None:
        """Keep the work done since the savepoint ``token`` in the transaction, and forget the savepoint."""
        self.execute(conn, RELEASE)

    def rollback_to(self, conn: Any, token: Any) -> None:
        """Undo the work done since the savepoint ``token`` and forget it. The transaction goes on (on
        PostgreSQL it is usable again after a failed statement). Raises if the connection is gone."""
        self.execute(conn, ROLLBACK_TO)
        self.execute(conn, RELEASE)

    def execute(self, conn: Any, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """Run ``sql`` (``:name`` placeholders); the rows, if it returns any."""
        raise NotImplementedError

    def executemany(self, conn: Any, sql: str, rows: Sequence[Mapping[str, Any]]) -> None:
        raise NotImplementedError

    def columns(self, conn: Any, table: str) -> list[str]:
        """The column names of ``table`` (portable: the description of a query that returns no row)."""
        raise NotImplementedError

    def commit(self, conn: Any) -> None:
        raise NotImplementedError

    def rollback(self, conn: Any) -> None:
        raise NotImplementedError

    def close(self, conn: Any) -> None:
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - a broken connection is being thrown away
            pass

    def user_handle(self, conn: Any) -> Any:
        """What ``kafkatx.db()`` returns to a handler."""
        return conn


class _SqlAlchemyBackend(Backend):
    def __init__(self, engine: Any) -> None:
        from sqlalchemy import text

        self._engine, self._text = engine, text
        self.dialect = engine.dialect.name
        self.described = f"SQLAlchemy engine {engine.url.render_as_string(hide_password=True)}"
        self._statements: dict[str, Any] = {}
        # SQLAlchemy emits the standard's savepoint statements for these (not MSSQL's SAVE TRANSACTION, say)
        self._cheap_savepoints = self.dialect in ("sqlite", "postgresql")

    def _stmt(self, sql: str) -> Any:
        stmt = self._statements.get(sql)
        if stmt is None:
            stmt = self._statements[sql] = self._text(sql)
        return stmt

    def connect(self) -> Any:
        conn = self._engine.connect()
        # The handler gets this very Connection (Session(db()) needs a real one), so its transaction-ending
        # methods are shadowed on the instance: db().commit() would commit the rows before the Kafka
        # transaction, without the input position. kafkatx calls the class's own methods below.
        for name in ("commit", "rollback", "close"):
            setattr(conn, name, functools.partial(_refuse, name))
        if self._cheap_savepoints:
            self._cheap_savepoints = _Savepoints.install(conn)
        if self.dialect == "sqlite":
            _wait_for_sqlite_lock(conn.connection.dbapi_connection)
        return conn

    def begin(self, conn: Any) -> Any:
        if conn.in_transaction():
            type(conn).rollback(conn)
        return conn.begin()

    def still_open(self, conn: Any, token: Any) -> bool:
        # db().get_transaction().rollback() ends kafkatx's transaction: the rows of the records handled before
        # it in the unit would be lost while their offsets commit. (Session(db()) joins with a savepoint of its
        # own, inside the record's: its rollback() undoes only that.)
        return token is None or bool(token.is_active)

    def broken(self, conn: Any) -> bool:
        return bool(conn.invalidated or conn.closed)

    def unusable(self, conn: Any, token: Any) -> str | None:
        if self.broken(conn):
            return LOST_UNDER_HANDLER
        if not self.still_open(conn, token):
            return ENDED_BY_HANDLER
        if self.dialect == "postgresql" and _pg_failed(conn.connection.dbapi_connection):
            return ABORTED_BY_HANDLER
        return None

    def savepoint(self, conn: Any) -> Any:
        # A NestedTransaction, so that SQLAlchemy's view of the connection is the database's (Session(db()) joins
        # with a savepoint of its own); its statements are cheap (see _Savepoints) on SQLite and PostgreSQL.
        cheap: _Savepoints | None = getattr(conn, _SAVEPOINTS, None)
        if cheap is None:
            return conn.begin_nested()
        cheap.name = RECORD_SAVEPOINT
        try:
            return conn.begin_nested()
        finally:
            cheap.name = None

    def release(self, conn: Any, token: Any) -> None:
        if token.is_active:  # else the handler ended it, or kafkatx's transaction (see unusable)
            _end_inner(conn, token, commit=True)
            token.commit()

    def rollback_to(self, conn: Any, token: Any) -> None:
        if token.is_active:
            _end_inner(conn, token, commit=False)
            token.rollback()
            cheap: _Savepoints | None = getattr(conn, _SAVEPOINTS, None)
            if cheap is not None and conn.in_transaction():  # and forget it, as the DB-API path does
                cheap.run(RELEASE)  # (SQLAlchemy leaves a savepoint rolled back to in place)

    def execute(self, conn: Any, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        result = conn.execute(self._stmt(sql), dict(params or {}))
        return [tuple(row) for row in result.fetchall()] if result.returns_rows else []

    def executemany(self, conn: Any, sql: str, rows: Sequence[Mapping[str, Any]]) -> None:
        if rows:
            conn.execute(self._stmt(sql), [dict(r) for r in rows])

    def columns(self, conn: Any, table: str) -> list[str]:
        return [str(name) for name in conn.execute(self._stmt(f"SELECT * FROM {table} WHERE 1 = 0")).keys()]

    def commit(self, conn: Any) -> None:
        type(conn).commit(conn)

    def rollback(self, conn: Any) -> None:
        type(conn).rollback(conn)

    def close(self, conn: Any) -> None:
        cheap: _Savepoints | None = getattr(conn, _SAVEPOINTS, None)
        if cheap is not None:
            cheap.uninstall()
        try:
            type(conn).close(conn)
        except Exception:  # noqa: BLE001 - a broken connection is being thrown away
            pass


#: The attribute of kafkatx's SQLAlchemy Connection that holds its _Savepoints.
_SAVEPOINTS = "_kafkatx_savepoints"
#: SQLAlchemy's Connection methods that emit the savepoint statements (private; the same from 1.4 to 2.1).
_SAVEPOINT_IMPLS = ("_savepoint_impl", "_release_savepoint_impl", "_rollback_to_savepoint_impl")


class _Savepoints:
    """The savepoint statements of kafkatx's SQLAlchemy Connection, run on the DB-API connection's own cursor.

    SQLAlchemy compiles SAVEPOINT and RELEASE anew for every begin_nested(): about 100 µs of CPU a record on
    SQLite, against 2 µs for the two statements on the cursor (exec_driver_sql: 16 µs), 6 µs for the whole
    NestedTransaction with them (its bookkeeping, and this). Shadowing the three methods of the Connection
    that emit them (on this Connection only, as its commit/rollback/close are) keeps SQLAlchemy's transaction
    objects: the record's savepoint is a NestedTransaction, so Session(db()) joins with a savepoint of its own
    and a failed flush rolls back only that, and the handler's own begin_nested() is as cheap. Errors are
    SQLAlchemy's as for its own statements: DBAPIError, and a lost connection invalidates the Connection.
    """

    __slots__ = ("_conn", "_seq", "_raw", "_cursor", "name")

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._seq = 0
        self._raw: Any = None
        self._cursor: Any = None
        #: The name of the next savepoint (kafkatx's record's); else sa_savepoint_N, as SQLAlchemy names them.
        self.name: str | None = None

    @classmethod
    def install(cls, conn: Any) -> bool:
        """Shadow ``conn``'s savepoint methods; False if this SQLAlchemy has none of those names."""
        if not all(callable(getattr(type(conn), name, None)) for name in _SAVEPOINT_IMPLS):
            return False
        cheap = cls(conn)
        setattr(conn, _SAVEPOINTS, cheap)
        for name, method in zip(_SAVEPOINT_IMPLS, (cheap.savepoint, cheap.release, cheap.rollback_to)):
            setattr(conn, name, method)
        return True

    def uninstall(self) -> None:
        conn, cursor = self._conn, self._cursor
        self._raw = self._cursor = None
        for name in (_SAVEPOINTS, *_SAVEPOINT_IMPLS):
            vars(conn).pop(name, None)
        if cursor is not None:
            _close_quietly(cursor)

    # Each emits SQLAlchemy's event for it first, as SQLAlchemy does (about 0.8 µs with no listener).

    def savepoint(self, name: str | None = None) -> str:
        conn = self._conn
        conn.dispatch.savepoint(conn, name)
        if name is None:
            name = self.name
            if name is None:
                self._seq += 1
                name = f"sa_savepoint_{self._seq}"
        self.run(SAVEPOINT if name == RECORD_SAVEPOINT else f"SAVEPOINT {name}")
        return name

    def release(self, name: str) -> None:
        conn = self._conn
        conn.dispatch.release_savepoint(conn, name, None)
        self.run(RELEASE if name == RECORD_SAVEPOINT else f"RELEASE SAVEPOINT {name}")

    def rollback_to(self, name: str) -> None:
        conn = self._conn
        conn.dispatch.rollback_savepoint(conn, name, None)
        if not (conn.closed or conn.invalidated):
            self.run(ROLLBACK_TO if name == RECORD_SAVEPOINT else f"ROLLBACK TO SAVEPOINT {name}")

    def run(self, sql: str) -> None:
        conn = self._conn
        raw = conn.connection.dbapi_connection
        cursor = self._cursor
        try:
            if cursor is None or self._raw is not raw:  # one cursor per connection (a new one: psycopg, 8 µs)
                self._raw, self._cursor = raw, (cursor := raw.cursor())
            cursor.execute(sql)
        except Exception as exc:
            self._raw = self._cursor = None
            if cursor is not None:
                _close_quietly(cursor)
            dialect = conn.dialect
            if not isinstance(exc, dialect.loaded_dbapi.Error):
                raise
            from sqlalchemy.exc import DBAPIError

            lost = bool(dialect.is_disconnect(exc, raw, cursor))
            if lost:
                conn.invalidate(exc)
            raise DBAPIError.instance(
                sql, None, exc, dialect.loaded_dbapi.Error, connection_invalidated=lost, dialect=dialect
            ) from exc


def _close_quietly(cursor: Any) -> None:
    try:
        cursor.close()
    except Exception:  # noqa: BLE001 - its connection may be gone
        pass


class _DbApiBackend(Backend):
    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._style: str | None = None
        self.described = f"connection factory {getattr(factory, '__qualname__', repr(factory))}"
        self._converted: dict[str, tuple[str, list[str]]] = {}

    def connect(self) -> Any:
        conn = self._factory()
        if not (hasattr(conn, "cursor") and hasattr(conn, "commit") and hasattr(conn, "rollback")):
            raise InvalidConfigurationError(
                f"database= factory {self.described} returned {type(conn).__name__}, not a DB-API connection "
                "(it needs cursor(), commit() and rollback())"
            )
        if self._style is None:
            root = type(conn).__module__.split(".")[0]
            module = sys.modules.get(root)
            self._style = getattr(module, "paramstyle", "qmark")
            self.dialect = {"sqlite3": "sqlite", "psycopg": "postgresql", "psycopg2": "postgresql"}.get(root, root)
            if root == "sqlite3":
                self._style = "named"
        if self.dialect == "sqlite" and getattr(conn, "isolation_level", "") is None:
            conn.isolation_level = ""  # autocommit mode would commit every statement on its own
        if self.dialect == "sqlite":
            _wait_for_sqlite_lock(conn)
        if getattr(conn, "autocommit", False) is True:
            conn.autocommit = False
        return conn

    def _convert(self, sql: str) -> tuple[str, list[str]]:
        converted = self._converted.get(sql)
        if converted is not None:
            return converted
        names: list[str] = []
        style = self._style or "named"

        def sub(m: re.Match[str]) -> str:
            names.append(m.group(1))
            return {
                "named": m.group(0),
                "pyformat": f"%({m.group(1)})s",
                "qmark": "?",
                "format": "%s",
                "numeric": f":{len(names)}",
            }[style]

        text = _NAMED.sub(sub, sql)
        if style in ("named", "pyformat"):
            names = []  # these take the parameters as a mapping
        converted = self._converted[sql] = (text, names)
        return converted

    def _args(self, names: list[str], params: Mapping[str, Any]) -> Any:
        return [params[n] for n in names] if names else dict(params)

    def begin(self, conn: Any) -> Any:
        conn.rollback()  # DB-API connections begin implicitly; make sure nothing earlier is pending
        return None

    def broken(self, conn: Any) -> bool:
        # psycopg 3: closed/broken (bool); psycopg2: closed (0 while open); sqlite3 has neither
        return bool(getattr(conn, "broken", False)) or getattr(conn, "closed", False) not in (False, 0, None)

    def unusable(self, conn: Any, token: Any) -> str | None:
        if self.broken(conn):
            return LOST_UNDER_HANDLER
        return ABORTED_BY_HANDLER if self.dialect == "postgresql" and _pg_failed(conn) else None

    def savepoint(self, conn: Any) -> Any:
        _run(conn, SAVEPOINT)
        return None

    def release(self, conn: Any, token: Any) -> None:
        _run(conn, RELEASE)

    def rollback_to(self, conn: Any, token: Any) -> None:
        _run(conn, ROLLBACK_TO)
        _run(conn, RELEASE)

    def execute(self, conn: Any, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        text, names = self._convert(sql)
        cur = conn.cursor()
        try:
            cur.execute(text, self._args(names, params or {}))
            return [tuple(r) for r in cur.fetchall()] if cur.description is not None else []
        finally:
            cur.close()

    def executemany(self, conn: Any, sql: str, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        text, names = self._convert(sql)
        cur = conn.cursor()
        try:
            cur.executemany(text, [self._args(names, r) for r in rows])
        finally:
            cur.close()

    def columns(self, conn: Any, table: str) -> list[str]:
        cur = conn.cursor()
        try:
            cur.execute(f"SELECT * FROM {table} WHERE 1 = 0")
            cur.fetchall()
            return [str(column[0]) for column in cur.description or ()]
        finally:
            cur.close()

    def commit(self, conn: Any) -> None:
        conn.commit()

    def rollback(self, conn: Any) -> None:
        conn.rollback()

    def user_handle(self, conn: Any) -> Any:
        return ManagedConnection(conn)


def _run(conn: Any, sql: str) -> None:
    """One statement without parameters or rows, on a DB-API connection."""
    cur = conn.cursor()
    try:
        cur.execute(sql)
    finally:
        cur.close()


def _end_inner(conn: Any, token: Any, commit: bool) -> None:
    """End the savepoints a handler began inside ``token`` and left open (a Session(db()) not closed, a
    db().begin_nested() not ended), innermost first, so that SQLAlchemy's view of the connection stays the
    database's."""
    inner = conn.get_nested_transaction()
    while inner is not None and inner is not token:
        if commit:
            inner.commit()
        else:
            inner.rollback()
        inner = conn.get_nested_transaction()


class ManagedConnection:
    """A DB-API connection whose transaction kafkatx owns: statements yes, commit/rollback/close no."""

    __slots__ = ("_conn",)

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def commit(self) -> None:
        _refuse("commit")

    def rollback(self) -> None:
        _refuse("rollback")

    def close(self) -> None:
        _refuse("close")


#: The savepoint each record's handler runs in (under SQLAlchemy too, on SQLite and PostgreSQL).
RECORD_SAVEPOINT = "kafkatx_record"
SAVEPOINT = "SAVEPOINT kafkatx_record"
RELEASE = "RELEASE SAVEPOINT kafkatx_record"
ROLLBACK_TO = "ROLLBACK TO SAVEPOINT kafkatx_record"

#: A handler ended kafkatx's transaction through SQLAlchemy (a rollback or commit of db().get_transaction()).
ENDED_BY_HANDLER = (
    "the handler ended kafkatx's database transaction (a rollback or commit of db().get_transaction()): the rows "
    "of the records before it in the unit would be lost while their offsets commit; raise an exception instead "
    "(kafkatx rolls the record's database work back to its savepoint)"
)
#: A handler caught a database error and went on, but PostgreSQL had aborted the transaction.
ABORTED_BY_HANDLER = (
    "a statement of the handler failed and the handler carried on, but PostgreSQL aborts the whole transaction "
    'on an error ("current transaction is aborted"), so nothing after it can run: the record\'s database '
    "work is rolled back to its savepoint and the record fails. To carry on after a statement that may fail, "
    "run it in a savepoint of its own: with db().begin_nested(): ... (SQLAlchemy), with db().transaction(): ... "
    "(psycopg)"
)
#: The connection died during a handler that caught the error and returned (an outage, see DatabaseSession).
LOST_UNDER_HANDLER = "the database connection was lost while the handler ran (it caught the error and returned)"
_PQTRANS_INERROR = 3  # libpq's PQtransactionStatus: in a failed transaction block


def _pg_failed(raw: Any) -> bool:
    """libpq says the transaction has failed (psycopg 3 or psycopg2; a local check, no round trip)."""
    info = getattr(raw, "info", None)
    status = getattr(info, "transaction_status", None)  # psycopg 3
    if status is None:
        get = getattr(raw, "get_transaction_status", None)  # psycopg2
        status = get() if callable(get) else None
    return status is not None and int(status) == _PQTRANS_INERROR


#: How long a unit waits for SQLite's write lock (held by another container's unit from its start to its commit,
#: so for up to max_transaction_ms, 10 s by default) before the wait counts as an outage. sqlite3's own: 5 s.
SQLITE_BUSY_TIMEOUT_MS = 60_000


def _wait_for_sqlite_lock(raw: Any) -> None:
    cur = raw.cursor()
    try:
        cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
    finally:
        cur.close()


def _refuse(what: str) -> None:
    raise RuntimeError(
        f"kafkatx.db().{what}() is not allowed: the database transaction commits together with the Kafka "
        "transaction (or rolls back with it); raise an exception to roll both back"
    )


def backend_for(database: Any) -> Backend:
    """The backend for a ``database=`` option; InvalidConfigurationError naming what is wrong."""
    if isinstance(database, Backend):
        return database
    if isinstance(database, str):
        try:
            from sqlalchemy import create_engine
        except ImportError:
            raise InvalidConfigurationError(
                f"database={database!r}: a URL needs SQLAlchemy (pip install 'kafkatx[database]'), "
                "or pass a connection factory such as lambda: sqlite3.connect('app.db')"
            ) from None
        try:
            engine = create_engine(database)
        except Exception as exc:
            raise InvalidConfigurationError(f"database={database!r} is not a usable database URL: {exc}") from exc
        _check_not_in_memory(engine)
        return _SqlAlchemyBackend(engine)
    module = type(database).__module__
    if module.startswith("sqlalchemy.ext.asyncio"):
        raise InvalidConfigurationError(
            f"database= got an asyncio {type(database).__name__}: handlers run on a thread, so kafkatx needs a "
            "synchronous engine (sqlalchemy.create_engine with a synchronous driver)"
        )
    if module.startswith("sqlalchemy.orm") and type(database).__name__ in ("sessionmaker", "scoped_session"):
        raise InvalidConfigurationError(
            f"database= got a {type(database).__name__}; pass its engine instead (database=engine) and use "
            "Session(db()) in the handler for the ORM: its commit() flushes into kafkatx's transaction"
        )
    if module.startswith("sqlalchemy") and hasattr(database, "dialect"):
        _check_not_in_memory(database)
        return _SqlAlchemyBackend(database)
    if callable(database):
        return _DbApiBackend(database)
    raise InvalidConfigurationError(
        f"database= must be a SQLAlchemy engine, a database URL, or a function returning a DB-API connection; "
        f"got {type(database).__name__} {database!r}"
    )


def _check_not_in_memory(engine: Any) -> None:
    url = engine.url
    if engine.dialect.name == "sqlite" and (
        url.database in (None, "", ":memory:") or url.query.get("mode") == "memory"
    ):
        raise InvalidConfigurationError(
            f"database={url.render_as_string(hide_password=True)!r} is an in-memory SQLite database: each "
            "connection (kafkatx's, yours) gets its own, and it is gone at exit together with the positions "
            "kafkatx keeps for exactly once; use a file (sqlite:///app.db)"
        )
