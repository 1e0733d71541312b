"""The transaction unit: what a runner needs to turn consumed records into one exactly-once commit.

A container splits each poll into units (the whole batch with
``fencing="group"``, each partition's slice with ``fencing="partition"``) and
hands each to its listener's runner as ``runner(unit)``. The record runner
(handler per record) and the Spark runner (one job per unit) are both
written on this interface only, and so can yours:

.. code-block:: python

    def run(unit: Unit) -> None:
        outputs = my_batch_job(unit.records())          # outside the transaction
        def work() -> None:
            for out in outputs:
                unit.produce(out)
            unit.send_offsets(unit.next_offsets())
        unit.transact(work)                            # begin, work, commit; KIP-1050 reactions

:meth:`TransactionUnit.transact` begins a transaction, runs ``work``, and
commits under the membership check (a consumer that left its group aborts
instead of committing: the zombie check). Kafka errors get their KIP-1050
reaction there: abortable, abort and run ``work`` again; application-
recoverable, replace the producer and rewind to the committed offsets. Any
other exception aborts the transaction and propagates, for the runner to
decide (usually: ask :attr:`TransactionUnit.policy`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from confluent_kafka import KafkaError, TopicPartition

from kafkatx.client.offsets import TP, next_offsets
from kafkatx.context import RecoveryContext, bind_recovery, bind_sink
from kafkatx.database.session import DatabaseUnavailableError
from kafkatx.errors import (
    ApplicationRecoverableError,
    GroupMembershipChanged,
    KafkaClientError,
    KafkaTxError,
    OutputRefusedError,
    RecoveryError,
    TransactionAbortableError,
)
from kafkatx.events import Event, TransactionAborted
from kafkatx.listener.host import HandlerFailure, ListenerGate, ListenerSettings, TransactionHost, UnitProducer
from kafkatx.listener.transaction.database_steps import DatabaseSteps
from kafkatx.listener.transaction.positions import rewind
from kafkatx.listener.transaction.refused import blame_refused_output
from kafkatx.outputs import PendingOutput
from kafkatx.record import ConsumedMessage, Record, message_records

if TYPE_CHECKING:
    import threading

    from kafkatx.client.producer import TransactionalProducer
    from kafkatx.recoverers import Recoverer
    from kafkatx.rollback.policy import FailurePolicy
    from kafkatx.rollback.tracker import FailureTracker

__all__ = ["CommitAhead", "TransactionUnit", "TP", "commit_offsets"]

log = logging.getLogger("kafkatx.container")

_KAFKA_REACTIONS = (TransactionAbortableError, ApplicationRecoverableError, GroupMembershipChanged)


class CommitAhead(Protocol):
    """What a unit's commit does meanwhile (:class:`~kafkatx.listener.loop.overlap.CommitOverlap`): handle what comes next."""

    def handle_next(self, committing: TransactionUnit) -> None:
        """Runs while ``committing``'s commit is under way on the producer's helper thread."""

    def drop(self) -> None:
        """The commit failed: what was handled meanwhile is given up (and fetched again)."""


class TransactionUnit(DatabaseSteps):
    """One slice of consumed records, the transactional producer that owns them, and the container's services.

    It implements :class:`~kafkatx.listener.host.Unit` (the interface runners are written on) over a
    :class:`~kafkatx.listener.host.TransactionHost` (the container's roles but liveness).

    Attributes: ``messages`` (the consumed ``confluent_kafka.ConsumedMessage``\\ s, in
    partition order), ``spec`` (the listener's declaration), ``policy`` (its
    :class:`~kafkatx.rollback.policy.FailurePolicy`), ``tracker`` (the
    container's failure counts), ``listener``, ``group_id``, ``worker``.
    """

    __slots__ = (
        "_c",
        "_producer",
        "messages",
        "spec",
        "policy",
        "tracker",
        "listener",
        "group_id",
        "worker",
        "_offsets",
        "_membership",
        "outputs",
        "_stored",
        "ahead",
        "during_commit",
    )

    def __init__(
        self,
        container: TransactionHost,
        producer: TransactionalProducer,
        messages: list[ConsumedMessage],
        ahead: CommitAhead | None = None,
        *,
        during_commit: Callable[[], None] | None = None,
    ) -> None:
        self._c = container
        self._producer = producer
        self.messages = messages
        self.spec: ListenerSettings = container.spec
        self.policy: FailurePolicy = container.spec.policy
        self.tracker: FailureTracker = container.tracker
        self.listener: str = container.name
        self.group_id: str = container.group_id
        self.worker: int = container.worker
        self._offsets: dict[TP, int] = {}
        self._membership: Any = None
        #: Records produced in the current transaction (for events and metrics).
        self.outputs = 0
        #: With ``database=``: partitions whose database work is already committed (see begin()).
        self._stored: dict[TP, tuple[int, int]] | None = None
        #: The overlapped commit: what handles the next records while this unit's transaction commits.
        self.ahead = ahead
        #: Other work for the wait of this unit's commits (listener/loop/partition_turns.py: other partitions' turns).
        self.during_commit = during_commit

    def with_messages(self, messages: list[ConsumedMessage]) -> TransactionUnit:
        """The same container and producer, over ``messages`` (e.g. the records left after a failure)."""
        if messages is self.messages:
            return self
        return TransactionUnit(self._c, self._producer, messages, during_commit=self.during_commit)

    # -- the container's state ------------------------------------------------
    @property
    def stopping(self) -> bool:
        """True once the container was asked to stop: give up what is not committed yet."""
        return self._c.stop_event.is_set()

    @property
    def stop_event(self) -> threading.Event:
        """The container's stop event, for tenacity's ``stop_when_event_set``."""
        return self._c.stop_event

    @property
    def producer(self) -> TransactionalProducer:
        """The transactional producer that owns this unit's offsets (for the record runner's hot path)."""
        return self._producer

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, waking early if the container stops. True if it is stopping."""
        if seconds <= 0:
            return self.stopping
        return self._c.stop_event.wait(seconds)

    def publish(self, event: Event) -> None:
        """Publish ``event`` to the App's subscribers."""
        self._c.publish(event)

    def records(self, messages: Sequence[ConsumedMessage] | None = None, spare: Sequence[Record] = ()) -> list[Record]:
        """The unit's messages as :class:`~kafkatx.Record`\\ s, each with its true next ``attempt`` (looked up only on
        the partitions that have a failing record: the others are at 1). ``spare``: an earlier batch's records,
        given up by the caller, refilled where nothing else holds them (:func:`~kafkatx.record.message_records`)."""
        records = message_records(self.messages if messages is None else messages, spare)
        failing = self.tracker.failing
        if failing:
            attempt = self.tracker.attempt
            for record in records:
                if (record.topic, record.partition) in failing:
                    record.attempt = attempt(record.topic, record.partition, record.offset)
        return records

    def next_offsets(self, messages: Sequence[ConsumedMessage] | None = None) -> dict[TP, int]:
        """The offsets to commit once ``messages`` (default: the whole unit) are done."""
        return next_offsets(self.messages if messages is None else messages)

    @property
    def assignment(self) -> set[TP]:
        """The partitions the container owns right now."""
        return set(self._c.assigned)

    @property
    def outage(self) -> ListenerGate:
        """The listener's outage state (a dependency that is down pauses the whole listener)."""
        return self._c.outage

    def partition_count(self, topic: str) -> int | None:
        """Partitions of ``topic`` from metadata (cached), or None if it does not exist."""
        return self._producer.partition_count(topic)

    # -- one transaction ------------------------------------------------------
    def transact(self, work: Callable[[], None], *, records: int | None = None, what: str = "batch") -> bool:
        """Begin, run ``work``, commit. True if it committed.

        ``work`` produces and calls :meth:`send_offsets`. On an abortable Kafka
        error the transaction is aborted and ``work`` runs again (at most
        ``max_abortable_retries`` times in a row, then the producer is
        replaced). On an application-recoverable error, or when the consumer
        left its group, the unit is rewound to the committed offsets and
        False is returned. An output the broker refused
        (:class:`~kafkatx.OutputRefusedError`) aborts the transaction and
        fails the input record that produced it, found by isolation (see
        :mod:`kafkatx.listener.transaction.refused`). Other Kafka errors (invalid configuration) are
        raised as they are: the container stops. Any other exception (a
        handler's) aborts the transaction and is raised again; if the abort
        itself failed (the producer was replaced and the unit rewound), False
        is returned instead.
        """
        count = len(self.messages) if records is None else records
        abortable = 0
        while True:
            outcome = self._attempt(work)
            if outcome is True or outcome is False:
                return outcome
            if isinstance(outcome, _KAFKA_REACTIONS):
                abortable = abortable + 1 if isinstance(outcome, TransactionAbortableError) else 0
                if self._react(outcome, abortable, f"abort and reprocess the {what}"):
                    continue
                return False
            return self._undo(outcome, count, what)

    def _attempt(self, work: Callable[[], None]) -> bool | BaseException:
        """Begin, ``work``, commit: True once committed, False if the database held the records' work already
        (it is produced from there instead), else what was raised, with the database rolled back. A Kafka
        error that stops the container (invalid configuration, retries that ran out) is raised."""
        database = self._c.database
        caught: BaseException
        try:
            self.begin()
            if self._stored:
                self.redeliver_stored(self._stored)
                return False
            work()
            self.commit()
            return True
        except (*_KAFKA_REACTIONS, DatabaseUnavailableError, OutputRefusedError) as exc:
            caught = exc
        except KafkaClientError:
            if database is not None:
                database.rollback()
            raise  # the container stops (and closes the producer)
        except BaseException as exc:
            caught = exc
        # Outside the except blocks: nothing raised from here on gets them as its __context__.
        if database is not None:
            if not isinstance(caught, (*_KAFKA_REACTIONS, DatabaseUnavailableError, OutputRefusedError, _Isolate)):
                caught = database.lost_connection(caught) or caught  # the server went away under the handler
            database.rollback()
        return caught

    def _undo(self, caught: BaseException, count: int, what: str) -> bool:
        """What ``work`` raised, undone: False once the unit was given back (an output refused and its record
        blamed, a database outage, a unit to isolate) or the abort failed; else the failure is raised."""
        if isinstance(caught, OutputRefusedError):
            self._c.reactions.note(caught, "abort; fail the input record that produced it")
            blamed = blame_refused_output(self, self._c.guard, caught, count)
            if blamed is None:
                return False
            raise blamed
        if isinstance(caught, _Isolate):
            self.isolate(caught.exc, count)
            return False
        if isinstance(caught, DatabaseUnavailableError):
            self.wait_for_database(caught, count)
            return False
        if not self.abort(count, f"{what} failed: {type(caught).__name__}"):
            return False
        raise caught

    def _react(
        self,
        exc: TransactionAbortableError | ApplicationRecoverableError | GroupMembershipChanged,
        abortable: int,
        action: str,
    ) -> bool:
        """The KIP-1050 reaction to ``exc`` raised in this unit's transaction. True: run the work again from memory.

        ``abortable`` counts the abortable errors of this unit in a row.
        """
        reactions = self._c.reactions
        if isinstance(exc, TransactionAbortableError):
            reactions.note(exc, action)
            if not self.abort(len(self.messages), f"abortable error: {exc}"):
                return False
            if abortable > self.spec.max_abortable_retries:
                reactions.recreate_producer(self._producer, exc, self.messages, escalated=True)
                return False
            return True
        if isinstance(exc, ApplicationRecoverableError):
            reactions.recreate_producer(self._producer, exc, self.messages)
            return False
        log.warning("%s", exc)
        if self.abort(len(self.messages), str(exc)):
            reactions.rewind_to_committed(self.messages)
        return False

    def begin(self) -> None:
        """Begin a transaction (what :meth:`transact` does first); with ``database=``, the database's too."""
        self._offsets = {}
        self._membership = None
        self.outputs = 0
        self._stored = None
        self._producer.begin()
        hops = self._c.retry_hops
        if hops is not None:  # a journal of what this transaction moves in and out of retry
            hops.book.began(self._producer)
        database = self._c.database
        if database is not None and self.messages:
            self._stored = database.begin(self._producer, self.messages)

    def produce(self, output: PendingOutput) -> None:
        """Produce one record in the open transaction (waits for queue space, classifies errors)."""
        self._producer.produce(output)
        self.outputs += 1

    def direct(self, topic: str) -> Callable[..., Any] | None:
        """confluent-kafka's own ``produce`` for ``topic``, for hot paths; see TransactionalProducer.direct."""
        return self._producer.direct(topic)

    def send_offsets(self, offsets: Mapping[TP, int], metadata: Mapping[TP, str] | None = None) -> None:
        """Send the next offsets to consume to the transaction, with the consumer's group metadata.

        ``metadata`` (per partition) is stored with the committed offset; by default kafkatx stores
        its own there (attempt counts and crash claims, see :mod:`kafkatx.rollback.durable`).
        """
        if not offsets:
            return
        membership = self._c.membership()
        claims = self._c.guard.metadata(offsets)
        meta = {**claims, **metadata} if claims is not None and metadata else (claims or metadata or {})
        self._producer.send_offsets(
            [
                TopicPartition(t, p, o, metadata=meta[(t, p)]) if (t, p) in meta else TopicPartition(t, p, o)
                for (t, p), o in offsets.items()
            ],
            membership,
        )
        self._offsets.update(offsets)
        self._membership = membership

    @property
    def sent_offsets(self) -> Mapping[TP, int]:
        """The offsets sent to the open transaction so far."""
        return self._offsets

    def commit(self) -> None:
        """Commit, unless the consumer left its group since the offsets were sent (GroupMembershipChanged).

        With :attr:`ahead`, the next records are handled while the commit is under way (their outputs held);
        if the commit fails, they are given up before the failure's reaction.
        """
        membership = self._membership
        database = self._c.database
        if database is not None and self.messages:
            # The offsets go to the transaction before the database commits, so that a producer fenced by now
            # fails here, with nothing committed anywhere (see docs/DATABASE.md).
            self._producer.flush_offsets()
            self._check_deliveries()
            try:
                database.commit(self._offsets, self._c.committed_offset)
            except KafkaTxError:
                raise  # DatabaseUnavailableError among them: transact() backs off
            except Exception as exc:
                # A constraint checked at commit (deferred): whose record is unknown in a unit of several, so
                # they are handled one per transaction to find it (see _isolate); a unit of one record fails
                # as for a handler's exception, and the failure policy decides (retry, or dead-letter it).
                if len(self.messages) > 1 and self._c.guard.enabled:
                    raise _Isolate(exc) from None
                first = self.records(self.messages[:1])[0]
                raise HandlerFailure(0, exc, first) from None
        guard = self._c.membership_guard(membership) if membership is not None else None
        ahead = self.ahead
        meanwhile = self.spec.while_committing  # e.g. tracing's deferred spans, made while the broker commits
        if self.during_commit is not None:
            meanwhile = self.during_commit if meanwhile is None else _in_turn(meanwhile, self.during_commit)
        if ahead is None or database is not None:
            self._producer.commit(guard=guard, meanwhile=meanwhile)
        else:
            handle_next = functools.partial(ahead.handle_next, self)
            try:
                self._producer.commit(
                    guard=guard, meanwhile=handle_next if meanwhile is None else _in_turn(meanwhile, handle_next)
                )
            except BaseException:
                ahead.drop()
                raise
        self._c.committed(self._offsets)
        hops = self._c.retry_hops
        if hops is not None:  # the records it took out of retry and put in, as committed
            hops.committed(self._producer, self._offsets)
        if self.messages:
            outage = self._c.outage
            if outage.active:  # records went through: the outage may be over
                outage.committed(self._offsets)

    def _check_deliveries(self) -> None:
        """With ``database=``: an output the broker refused fails the transaction before the database commits.

        Found later, at the Kafka commit, the database would already hold the records' rows and outbox, and
        the next transaction would produce the refused record from the outbox again, for ever.
        """
        producer = self._producer
        producer.wait_for_deliveries()
        failure = producer.transaction_failure()
        if isinstance(failure, OutputRefusedError):
            raise failure

    def abort(self, records: int, reason: str) -> bool:
        """Abort the open transaction. False if the abort failed (the producer was then replaced and the unit rewound)."""
        database = self._c.database
        if database is not None:
            database.rollback()
        try:
            self._producer.abort()
        except ApplicationRecoverableError as exc:
            self._c.reactions.recreate_producer(self._producer, exc, self.messages)
            return False
        self.publish(TransactionAborted(self.listener, self.worker, records, reason))
        log.debug("listener %s aborted a transaction of %d record(s): %s", self.listener, records, reason)
        return True

    def recover(self, recoverer: Recoverer, record: Record, exception: BaseException, *, confirm: bool = True) -> None:
        """Run ``recoverer`` inside the open transaction; raise :class:`~kafkatx.RecoveryError` if it fails.

        ``kafkatx.send()`` produces directly into the transaction meanwhile.
        With ``confirm=False`` (recovery inside the batch's own transaction)
        what the recoverer sends is held until it returns, so a recoverer
        that fails half-way leaves nothing in the transaction; its deliveries
        are not waited for: the batch's commit confirms them, and a failed
        dead letter fails that commit.
        """
        producer = self._producer
        if self._c.database is not None:
            self._c.database.source = (record.topic, record.partition)  # the dead letter is stored under its record
        sink = _DirectSink(self, self.spec.serializer, hold=not confirm)
        previous_sink = bind_sink(sink)
        previous_ctx = bind_recovery(
            RecoveryContext(
                self.listener,
                self.group_id,
                producer.partition_count,
                sink.deliver if confirm else sink.deliver_unconfirmed,
                producer.flush if confirm else list,
                self.policy.is_retryable,
            )
        )
        failure: Exception | None = None
        try:
            recoverer(record, exception)
        except KafkaClientError:
            raise
        except Exception as exc:
            failure = exc
        finally:
            bind_recovery(previous_ctx)
            bind_sink(previous_sink)
        if failure is not None:
            raise RecoveryError(record, failure, recoverer.name) from failure
        for output in sink.held:
            producer.produce(output)

    def replace_producer(self, exc: KafkaClientError) -> None:
        """Application-recoverable outside a transaction: discard the producer, rewind to the committed offsets."""
        self._c.reactions.recreate_producer(self._producer, exc, self.messages)

    # -- consumer positions ---------------------------------------------------------
    def seek(self, tp: TP, offset: int) -> None:
        """Fetch ``tp`` from ``offset`` next (ignored if the partition was revoked meanwhile)."""
        self._c.seek(tp, offset)

    def rewind(self, messages: Sequence[ConsumedMessage] | None = None) -> None:
        """Seek every partition of ``messages`` (default: the unit) back to its first record."""
        rewind(self._c, self.messages if messages is None else messages)

    def rewind_to_committed(self, messages: Sequence[ConsumedMessage] | None = None) -> None:
        """Seek the partitions of ``messages`` back to their committed offsets."""
        self._c.reactions.rewind_to_committed(self.messages if messages is None else messages)

    def defer(self, messages: list[ConsumedMessage], seconds: float) -> None:
        """Hold the partition of ``messages`` (one partition's records, in order) for ``seconds``, then handle
        them from memory: the back-off ends on time, without fetching them again. Dropped if the partition is
        revoked or sought back meanwhile (its records then come from the committed offset)."""
        self._c.defer(messages, seconds)

    def pause(self, tp: TP, seconds: float) -> None:
        """Hold ``tp`` for ``seconds`` while the consumer keeps polling (no rebalance; other partitions flow).

        The hold ends early if the partition is revoked: a pause never outlives the assignment it was made for.
        """
        self._c.pause(tp, seconds)


class _Isolate(Exception):
    """Internal: a unit's database commit failed for a reason none of its records can be blamed for alone."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(exc)
        self.exc = exc


class _DirectSink:
    """``send()`` target inside recoverers: produces straight into the unit's transaction."""

    __slots__ = ("_unit", "serializer", "_errors", "held", "_hold")

    def __init__(self, unit: UnitProducer, serializer: Any, *, hold: bool = False) -> None:
        self._unit, self.serializer = unit, serializer
        self._errors: list[str] = []
        #: With ``hold``: what was sent, produced once the recoverer returned (see TransactionUnit.recover).
        self.held: list[PendingOutput] = []
        self._hold = hold

    def add(self, output: PendingOutput) -> None:
        if self._hold:
            self.held.append(output)
        else:
            self._unit.producer.produce(output)  # not counted in the unit's outputs: recoveries have their own events

    def deliver(self, output: PendingOutput) -> str | None:
        """Produce ``output`` and wait for its own delivery; its error, or None."""
        errors: list[KafkaError] = []
        producer = self._unit.producer
        producer.produce(output, on_error=errors.append)
        undelivered = producer.wait_for_deliveries()
        if errors:
            own = errors[0]
            if own.code() in (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT):
                # Purged because another record of the transaction failed: that failure is the cause.
                cause = producer.transaction_failure(besides=own)
                if cause is not None:
                    raise cause
            return f"{output[0]}: {own.name()} {own.str()}"
        if undelivered:
            return f"not delivered yet: {undelivered} record(s) of the transaction still in flight"
        return None

    def deliver_unconfirmed(self, output: PendingOutput) -> str | None:
        self.add(output)
        return None


def commit_offsets(
    host: TransactionHost,
    offsets: Mapping[TP, int],
    *,
    what: str,
    metadata: Mapping[TP, str] | None = None,
    tolerate_errors: bool = False,
) -> bool:
    """Commit ``offsets`` with no records: one empty transaction per producer that owns some of them.

    For claims, their withdrawal and positions past transaction markers.
    True if every transaction committed. With ``tolerate_errors`` a Kafka
    client error of one producer is logged and the others still commit.
    """
    by_producer: dict[int, tuple[TransactionalProducer, dict[TP, int]]] = {}
    for tp, offset in offsets.items():
        producer = host.producer_for(tp)
        by_producer.setdefault(id(producer), (producer, {}))[1][tp] = offset
    committed = True
    for producer, own in by_producer.values():
        unit = TransactionUnit(host, producer, [])
        meta = {tp: metadata[tp] for tp in own if tp in metadata} if metadata else None
        try:
            if not unit.transact(functools.partial(unit.send_offsets, own, meta), records=0, what=what):
                committed = False
        except KafkaClientError as exc:
            if not tolerate_errors:
                raise
            log.debug("listener %s: %s of %s skipped: %s", host.name, what, own, exc)
            committed = False
    return committed


def _in_turn(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    """``first()`` then ``then()``: two pieces of work for the same commit's wait."""

    def both() -> None:
        first()
        then()

    return both
