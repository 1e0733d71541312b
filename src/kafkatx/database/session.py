"""A container's database side: one database transaction per Kafka transaction, committed first.

Why this order and these tables (the argument in full is docs/DATABASE.md):
the database commits first, and with the handler's rows it stores the input
position reached and the Kafka records produced (the outbox). Kafka commits
second. If the process dies between the two, Kafka aborts and the input comes
back; the stored position says its database work is done, so the handler is
not called again: the stored records are produced and the offsets committed.
The position row is locked for the length of the unit, so a second owner of
the partition (a zombie) waits and then sees the work as done.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from types import GeneratorType
from typing import TYPE_CHECKING, Any

from kafkatx.client.identity import LogIdentity, log_identity, succeeds_shared_id
from kafkatx.client.offsets import TP, first_offsets
from kafkatx.database._store import OFFSETS_TABLE, OUTBOX_TABLE, Store, StoredPosition, reset_statements
from kafkatx.database.backend import Backend, backend_for, is_connection_error
from kafkatx.errors import ContainerError, InvalidConfigurationError, KafkaTxError
from kafkatx.outputs import PendingOutput

if TYPE_CHECKING:
    from kafkatx.client.producer import TransactionalProducer
    from kafkatx.record import ConsumedMessage

__all__ = ["DatabaseSession", "DatabaseUnavailableError", "adopts", "db", "bind_db", "log_mismatch"]

log = logging.getLogger("kafkatx.database")


#: Test hook: SIGKILL this process right after its Nth database commit (before the Kafka commit).
CRASH_AFTER_DB_COMMITS_ENV = "KAFKATX_TEST_CRASH_AFTER_DB_COMMITS"


class DatabaseUnavailableError(KafkaTxError):
    """The database could not be reached (or dropped the connection) while kafkatx used it.

    Not a failure of any record: nothing was committed on either side, the
    records are fetched again and kafkatx retries after a back-off.
    """


def log_mismatch(stored: StoredPosition, kafka: LogIdentity) -> str | None:
    """What a stored position was written for, if that is not this Kafka log; None if it is (or may be).

    A position is an offset in one log: another cluster's (a new temporary
    local broker, say) or an earlier topic's of the same name (deleted and
    created again) says nothing about this one, and trusting it skips records.
    Unknown identities (a row of an earlier kafkatx, a broker without topic
    ids) are not a mismatch: such a row adopts this log on first use.
    """
    if (
        stored.cluster_id
        and kafka.cluster_id
        and stored.cluster_id != kafka.cluster_id
        and not succeeds_shared_id(stored.cluster_id, kafka.cluster_id)
    ):
        return (
            f"another Kafka cluster (cluster id {stored.cluster_id}; this one is {kafka.cluster_id}): a new "
            "temporary local broker, or the database of another environment"
        )
    if stored.topic_id and kafka.topic_id and stored.topic_id != kafka.topic_id:
        return (
            f"an earlier topic of the same name (topic id {stored.topic_id}; this one is {kafka.topic_id}): "
            "the topic was deleted and created again"
        )
    return None


def adopts(stored: StoredPosition, kafka: LogIdentity) -> bool:
    """True if a position that is not a mismatch should be tied to ``kafka``'s log (see :func:`log_mismatch`).

    A row written without its log (an earlier kafkatx, a broker without
    topic ids) and a row written for noida-db's shared cluster id, now used
    with the id kafkatx gave that broker (:func:`succeeds_shared_id`).
    """
    return bool(
        (stored.cluster_id is None and kafka.cluster_id)
        or (stored.topic_id is None and kafka.topic_id)
        or succeeds_shared_id(stored.cluster_id, kafka.cluster_id)
    )


class _Bound(threading.local):
    handle: Any = None


_bound = _Bound()


def db() -> Any:
    """The database connection of the current unit of work, inside a handler of a ``database=`` listener.

    With a SQLAlchemy engine it is a ``sqlalchemy.Connection`` in a
    transaction (``Session(db())`` for the ORM); with a connection factory it
    is the DB-API connection (commit, rollback and close are kafkatx's). The
    transaction commits just before the Kafka transaction, and rolls back
    with it.
    """
    handle = _bound.handle
    if handle is None:
        from kafkatx.errors import NotInTransactionError

        raise NotInTransactionError(
            "kafkatx.db() is only available inside a handler of a listener declared with database=..., "
            "or inside 'with app.transaction(database=...)'"
        )
    return handle


def bind_db(handle: Any) -> Any:
    """Make ``handle`` what :func:`db` returns on this thread; return the previous one."""
    previous, _bound.handle = _bound.handle, handle
    return previous


class _Recorded(list[PendingOutput]):
    """The outputs of the open unit, each with the input partition whose record produced it (``sources``)."""

    __slots__ = ("sources", "_session")

    def __init__(self, session: DatabaseSession) -> None:
        super().__init__()
        self.sources: list[TP | None] = []
        self._session = session

    def append(self, out: PendingOutput) -> None:
        super().append(out)
        self.sources.append(self._session.source)


def _crash_after() -> int | None:
    value = os.environ.get(CRASH_AFTER_DB_COMMITS_ENV)
    return int(value) if value else None


class DatabaseSession:
    """The database half of a container's units of work (one connection, used by the container's thread)."""

    def __init__(self, database: Any, group_id: str, listener: str) -> None:
        self.backend: Backend = backend_for(database)
        self.store = Store(self.backend, group_id)
        self.listener = listener
        self._conn: Any = None
        self._txn: Any = None  # the backend's token for the open transaction (see Backend.unusable)
        self._tables_ready = False
        self._open = False
        self._producer: TransactionalProducer | None = None
        self._outputs = _Recorded(self)
        #: The input partition of the record being handled (or recovered): its outputs are stored under it.
        self.source: TP | None = None
        self._previous_handle: Any = None
        self.commits = 0
        self._crash_after = _crash_after()
        self._logs: dict[str, LogIdentity] = {}  # per input topic: the Kafka log this container reads
        self._spoiled: str | None = None  # why the open transaction must not commit (see _undo)

    def attributing(self, handler: Callable[[Any], Any], *, batch: bool = False) -> Callable[[Any], Any]:
        """``handler``, noting each record's partition first, so that the outputs it causes are stored under it;
        run in a savepoint of its own while a unit's transaction is open, so that its failure undoes only its
        record's database work (the records before it in the unit keep theirs); and checking after it that it
        left the transaction able to commit (see Backend.unusable).

        Per call: one savepoint and one release (a rollback to the savepoint if the handler raises). A handler
        that returns a generator has its body run here, inside the savepoint. With ``batch``, the handler takes
        a list of records (a batch listener's) and a call's outputs are stored under its first record's
        partition: if only the database commits, that partition's replay produces them all, and the others'
        replays commit their offsets (docs/DATABASE.md)."""
        backend = self.backend
        unusable, savepoint, release = backend.unusable, backend.savepoint, backend.release

        def handle(record: Any) -> Any:
            first = record[0] if batch else record
            self.source = (first.topic, first.partition)
            if not self._open:
                return handler(record)
            conn, txn = self._conn, self._txn
            point = savepoint(conn)  # fails if the connection is gone: lost_connection makes that an outage
            try:
                result = handler(record)
                if type(result) is GeneratorType:
                    result = list(result)
            except BaseException:
                self._undo(conn, point)
                raise
            problem = unusable(conn, txn)  # before the release: an ended transaction is named, not masked
            if problem is not None:
                self._undo(conn, point)  # a PostgreSQL transaction aborted by the handler is usable again
                raise RuntimeError(problem)
            try:
                release(conn, point)
            except Exception as exc:
                self._spoil(conn, exc, "release a record's savepoint")  # (the handler's own SQL released or ended it)
                raise
            return result

        handle.__wrapped__ = handler  # type: ignore[attr-defined]
        handle.__qualname__ = getattr(handler, "__qualname__", "handler")
        return handle

    def savepoint(self) -> Any:
        """Mark the open transaction's work so far (None outside a unit): a batch's isolation probe runs after one,
        its work undone by :meth:`roll_back_to` unless its result is the one kept."""
        return self.backend.savepoint(self._conn) if self._open else None

    def roll_back_to(self, point: Any) -> None:
        """Undo the work done since ``point`` (from :meth:`savepoint`) and forget it; the transaction goes on."""
        if self._open:
            self._undo(self._conn, point)

    def release(self, point: Any) -> None:
        """Keep the work done since ``point`` (from :meth:`savepoint`) and forget it."""
        if self._open:
            try:
                self.backend.release(self._conn, point)
            except Exception as exc:
                self._spoil(self._conn, exc, "release an isolation run's savepoint")
                raise

    def _undo(self, conn: Any, point: Any) -> None:
        """Roll a failed record's database work back to its savepoint; quietly, the record's failure goes on."""
        if self.backend.broken(conn):  # the server went away: nothing will commit, and the outage must show
            return
        try:
            self.backend.rollback_to(conn, point)
        except Exception as exc:
            log.debug("listener %s: the rollback to the record's savepoint failed", self.listener, exc_info=True)
            self._spoil(conn, exc, "roll a failed record's database work back to its savepoint")

    def _spoil(self, conn: Any, exc: Exception, doing: str) -> None:
        """A savepoint statement failed: unless the connection is gone (an outage: lost_connection says so, and
        nothing commits), the transaction may hold work of a failed record, so it must not commit."""
        if not self.backend.broken(conn):
            self._spoiled = (
                f"kafkatx could not {doing} ({type(exc).__name__}: {exc}); the unit's database "
                "transaction is not committed (did the handler release the savepoint, or end the transaction, "
                "with SQL of its own?)"
            )

    # -- connection --------------------------------------------------------------------------
    def _connection(self) -> Any:
        if self._conn is None:
            conn = self.backend.connect()
            if not self._tables_ready:
                self._create_tables(conn)
                self._tables_ready = True
            self._conn = conn
        return self._conn

    def _create_tables(self, conn: Any) -> None:
        """Create kafkatx's tables (or add an earlier version's missing columns), once more if a peer raced it."""
        for attempt in (1, 2):
            self.backend.begin(conn)
            try:
                added = self.store.create_tables(conn)
                self.backend.commit(conn)
            except Exception as exc:
                self.backend.rollback(conn)
                if attempt == 1 and not is_connection_error(exc):
                    continue  # another container created or altered them at the same moment: look again
                self.backend.close(conn)
                raise self._failed(exc, "created its tables") from exc
            if added:
                log.info(
                    "listener %s: added %s to %s (rows written before, by an earlier kafkatx, are tied to the "
                    "Kafka cluster and topic they are next used with)",
                    self.listener,
                    ", ".join(added),
                    OFFSETS_TABLE,
                )
            return

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        self._open, self._txn = False, None
        if conn is not None:
            self.backend.close(conn)

    def close(self) -> None:
        self.rollback()
        self._drop_connection()

    def _failed(self, exc: BaseException, doing: str) -> KafkaTxError:
        """kafkatx's own statement failed: the database is unreachable (retry), or its tables are unusable (stop)."""
        if is_connection_error(exc) or isinstance(exc, OSError):
            return self._unavailable(exc, doing)
        return ContainerError(
            f"listener {self.listener!r}: kafkatx's own statement failed while it {doing} in {self.backend.described} "
            f"(its tables {OFFSETS_TABLE} and {OUTBOX_TABLE} need CREATE, SELECT, INSERT, UPDATE and DELETE "
            f"rights): {type(exc).__name__}: {exc}"
        )

    def _unavailable(self, exc: BaseException, doing: str) -> DatabaseUnavailableError:
        self._drop_connection()
        return DatabaseUnavailableError(
            f"listener {self.listener!r}: the database ({self.backend.described}) failed while kafkatx {doing}: "
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        )

    # -- one unit of work --------------------------------------------------------------------
    def begin(self, producer: TransactionalProducer, messages: Sequence[ConsumedMessage]) -> dict[TP, tuple[int, int]]:
        """Open the database transaction of a unit; lock its partitions' positions.

        Returns the partitions whose records (from the first fetched, up to
        the stored position) already have their database work committed:
        ``{tp: (first fetched, stored position)}``. Raises
        :class:`DatabaseUnavailableError` if the database cannot be used.
        """
        self.rollback()
        first = first_offsets(messages)
        logs = {topic: self._log_of(producer, topic) for topic, _ in first}
        try:
            conn = self._connection()
            self._txn = self.backend.begin(conn)
            self._open = True
            done = {}
            for tp, offset in sorted(first.items()):  # one order for every owner: no lock-order deadlock
                position = self._lock_checked(conn, tp, logs[tp[0]])
                if position > offset:
                    done[tp] = (offset, position)
        except KafkaTxError:
            self.rollback()
            raise
        except Exception as exc:
            self.rollback()
            raise self._failed(exc, "began a transaction") from exc
        self._outputs = _Recorded(self)
        self.source = next(iter(first)) if len(first) == 1 else None
        self._producer = producer
        producer.recorder = self._outputs
        self._previous_handle = bind_db(self.backend.user_handle(conn))
        return done

    def _log_of(self, producer: TransactionalProducer, topic: str) -> LogIdentity:
        """The identity of ``topic``'s Kafka log (asked once per topic, before any database lock is taken)."""
        identity = self._logs.get(topic)
        if identity is None:  # Kafka not answering is a Kafka error (retried, then abortable), not the database's
            client = producer.ensure()
            identity = log_identity(client, producer.client_config, topic, retry_timeout=producer.retry_timeout)
            self._logs[topic] = identity
        return identity

    def _lock_checked(self, conn: Any, tp: TP, kafka: LogIdentity) -> int:
        """The partition's stored position, refused if it was written for another Kafka log (see log_mismatch)."""
        stored = self.store.lock(conn, tp, kafka.cluster_id, kafka.topic_id)
        problem = log_mismatch(stored, kafka)
        if problem is not None:
            raise InvalidConfigurationError(
                f"listener {self.listener!r}: the positions kafkatx keeps in the database for {tp[0]}[{tp[1]}] "
                f"(table {OFFSETS_TABLE}, group {self.store.group_id!r}, done up to offset {stored.next_offset}) "
                f"were written for {problem}. kafkatx stops rather than skip records or publish outputs stored "
                f"for that other log. To start this group's {tp[0]} afresh here, delete its rows: "
                f"{reset_statements(self.store.group_id, tp[0])} Or use the database that goes with this cluster "
                "(with --local: a database file per run, or keep the broker too with --local-data-dir DIR)"
            )
        if adopts(stored, kafka):
            self.store.adopt(conn, tp, kafka.cluster_id, kafka.topic_id)
        return stored.next_offset

    def lost_connection(self, failure: BaseException) -> DatabaseUnavailableError | None:
        """The outage behind a handler's (or recoverer's) ``failure``, if the unit's connection died under it.

        The server went away (a restart, a failover, an idle timeout, pg_terminate_backend): that is not the
        record's failure, so no attempt is counted; the unit is fetched again and done on a new connection.
        """
        conn = self._conn
        if conn is None or not self.backend.broken(conn):
            return None
        exc = getattr(failure, "exc", failure)  # a HandlerFailure carries the handler's own exception
        return self._unavailable(exc, "ran the handler")

    def stored_outputs(self, tp: TP, start: int, end: int) -> list[PendingOutput]:
        """The records committed units produced for ``tp``'s input in [start, end)."""
        return self.store.outputs_between(self._conn, tp, start, end)

    def commit(self, offsets: Mapping[TP, int], committed: Callable[[TP], int | None]) -> None:
        """Store the positions and outputs, then commit the database transaction (before Kafka's).

        ``committed`` gives the offsets Kafka is known to have committed, to
        drop the outbox rows behind them.
        """
        assert self._open, "no database transaction is open"
        conn = self._conn
        if self.backend.broken(conn):  # (a recoverer that swallowed the error: handlers are checked one by one)
            raise self._unavailable(ConnectionError("the connection was lost"), "committed")
        problem = self._spoiled or self.backend.unusable(conn, self._txn)
        if problem is not None:
            self.rollback()
            raise RuntimeError(problem)
        recorded = self._outputs
        by_source: dict[TP, list[PendingOutput]] = {}
        for out, source in zip(recorded, recorded.sources):
            if source is None or source not in offsets:
                self.rollback()
                raise ContainerError(
                    f"internal: an output of input partition {source} in a unit committing {sorted(offsets)}"
                )
            by_source.setdefault(source, []).append(out)
        try:
            for tp in sorted(offsets):
                self.store.advance(conn, tp, offsets[tp], by_source.get(tp, ()))
                known = committed(tp)
                if known is not None:
                    self.store.forget_before(conn, tp, known)
        except Exception as exc:
            self.rollback()
            raise self._failed(exc, "stored the input position and the outbox") from exc
        try:
            self.backend.commit(conn)
        except Exception as exc:
            self.rollback()
            if is_connection_error(exc) or isinstance(exc, OSError):
                raise self._unavailable(exc, "committed") from exc
            raise  # a deferred constraint, say: the unit's own failure (see TransactionUnit.commit)
        self._open, self._txn = False, None
        self._release()
        self.commits += 1
        if self._crash_after is not None and self.commits >= self._crash_after:
            log.warning(
                "test hook %s: killing this process between the database and the Kafka commit",
                CRASH_AFTER_DB_COMMITS_ENV,
            )
            os.kill(os.getpid(), signal.SIGKILL)

    def rollback(self) -> None:
        """Roll back the open database transaction, if any (quietly: a broken connection is dropped)."""
        if self._open:
            self._open, self._txn = False, None
            try:
                self.backend.rollback(self._conn)
            except Exception:
                log.debug("database rollback failed; dropping the connection", exc_info=True)
                self._drop_connection()
        self._release()

    def _release(self) -> None:
        if self._producer is not None:
            self._producer.recorder = None
            self._producer = None
            bind_db(self._previous_handle)
            self._previous_handle = None
        self._outputs = _Recorded(self)
        self.source = None
        self._spoiled = None
