"""The overlapped commit: while transaction N commits, the records of N+1 are handled, their outputs held.

``commit_transaction`` waits for the broker for about half of a transaction's
wall time, and confluent-kafka releases the GIL while it waits (the call runs
on the producer's helper thread, :mod:`kafkatx.client.bounded`). So the
container thread does not wait: :meth:`CommitOverlap.handle_next` runs
meanwhile. It polls the next batch (until the commit returns or the batch is
full) and runs the handler over it through a :class:`_HoldingUnit`: what the
handler returns, what it ``send()``\\ s and the offsets are kept in memory
(a :class:`HeldBatch`), as ``retry="in_place"`` keeps a record's outputs;
nothing reaches the producer, whose transaction is still committing. At the
next turn of the loop the container hands the held batch to
:meth:`CommitOverlap.commit_held`: begin, produce what was held, send the
offsets, commit (handling the batch after it meanwhile).

A held batch is given up (its partitions sought back to its first records, so
they are fetched again and handled anew, as after an abort) when:

- the commit under way fails, in any way (fenced, abortable, the group changed,
  stuck): before that failure's own reaction runs, which then rewinds as today;
- a rebalance callback runs while the commit is under way: the callback first
  waits for the commit to return (so a revoke returns only once it has), then
  gives up what was handled meanwhile;
- anything seeks or pauses one of its partitions (a time budget cut short the
  committing batch, a back-off), or the container stops;

A handler that fails while its batch is handled ahead ends the held batch just
before that record: the records before it are held and commit as usual, and the
failed record and what follows are fetched again, to fail (and be counted and
decided about) in a transaction of their own. A failure that must abort (an
outage, a client error) is taken on by the record runner at the next turn, once
the commit before it returned, as if its transaction had failed.

Records are handled ahead only when nothing else is going on: no record is
failing, no partition is paused, no outage is on, and none of the records is
the crash guard's to hand over (a first claim, a search). Handlers run ahead of the commit of the batch before them, so a handler
whose side effects must not run before that commit (and ``database=``, whose
transaction is one with the Kafka one) must not use it. It is off unless a
listener asks for it (``overlap_commit=True``); docs/OVERLAP.md says why.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from kafkatx.client.offsets import TP
from kafkatx.errors import UnknownTopicError
from kafkatx.events import TransactionAborted, TransactionCommitted
from kafkatx.listener.failure.failed_record import Abandoned
from kafkatx.listener.host import (
    ContainerHost,
    HandlerFailure,
    RecordUnit,
    TransactionHost,
    UnitProducer,
    UnitTransaction,
)
from kafkatx.listener.runners.concurrent import InPlaceRecoveryFailed
from kafkatx.listener.runners.record_runner import RecordRunner
from kafkatx.listener.transaction.positions import rewind
from kafkatx.listener.transaction.unit import TransactionUnit
from kafkatx.outputs import PendingOutput, encode_headers
from kafkatx.record import ConsumedMessage
from kafkatx.result_emitters import produce_in_order

if TYPE_CHECKING:
    from confluent_kafka import Message

    from kafkatx.client.producer import TransactionalProducer
    from kafkatx.listener.failure.crash_guard import CrashGuard
    from kafkatx.listener.failure.reactions import KafkaErrorReactions
    from kafkatx.listener.spec import ListenerSpec

__all__ = ["CommitOverlap", "HeldBatch", "overlap_of"]

log = logging.getLogger("kafkatx.container")

#: ``runner.handle_ahead(unit, msgs)``: handles ``msgs`` into ``unit``; how many before the time budget ran out.
HandleAhead = Callable[[RecordUnit, Sequence[ConsumedMessage]], int]
#: The record runner's signals of a failed record (HandlerFailure, InPlaceRecoveryFailed, Abandoned).
_RUNNER_SIGNALS: tuple[type[BaseException], ...] = (HandlerFailure, InPlaceRecoveryFailed, Abandoned)


class HeldBatch:
    """Records handled while the transaction before them committed: their outputs and offsets, in memory.

    One transaction's worth: the whole batch with ``fencing="group"``, one partition's slice with ``"partition"``.
    ``raised``: a handler failed among them (the record runner's signal); the runner takes it from there as if
    their transaction had failed (after-rollback, in-place recovery), once the commit before them returned.
    """

    __slots__ = ("messages", "outputs", "offsets", "seconds", "raised")

    def __init__(
        self,
        messages: list[ConsumedMessage],
        outputs: list[PendingOutput],
        offsets: dict[TP, int],
        seconds: float,
        raised: BaseException | None = None,
    ) -> None:
        self.messages, self.outputs, self.offsets, self.seconds = messages, outputs, offsets, seconds
        self.raised = raised


class CommitOverlap:
    """One container's overlapped commit (see the module docstring). Runs on the container thread only.

    A container has one only where its listener overlaps commits (:func:`overlap_of`); it gives it to its units.
    """

    def __init__(
        self,
        host: ContainerHost,
        guard: CrashGuard,
        consumer_error: Callable[[Message], None],
        runner: RecordRunner,
    ) -> None:
        self._host, self._guard, self._consumer_error = host, guard, consumer_error
        self._runner = runner
        self._handle_ahead: HandleAhead = runner.handle_ahead
        #: What was handled ahead, one entry per transaction to commit (empty: nothing is held).
        self.held: list[HeldBatch] = []
        self._per_partition = host.spec.fencing == "partition"
        #: ``fencing="partition"``: the next partition's slice of the poll, handled during this one's commit.
        self._next: list[ConsumedMessage] | None = None
        self._taken: set[TP] = set()  # partitions whose slice of the poll was handled ahead (held, or given up)
        self._committing: TransactionUnit | None = None  # set while polling during a commit
        self._rebalanced = False
        self._errors: list[Message] = []  # consumer errors polled during a commit, reported at the next turn
        #: Batches handled while the one before them committed, and how many of them committed (for tests).
        self.handled_ahead = 0
        self.committed_ahead = 0

    # -- during the commit (TransactionUnit.commit's ``meanwhile``) --------------------------------------
    def handle_next(self, committing: TransactionUnit) -> None:
        """Poll and handle the next batch, holding its outputs, while ``committing`` commits."""
        if self.held or not self._may_handle_ahead() or _cut_short(committing):
            return
        following, self._next = self._next, None
        if following is not None:  # the poll's next partition: its records are at hand
            self._taken.add((following[0].topic(), following[0].partition()))
            self._hold(committing.producer, following)
            return
        self._committing, self._rebalanced = committing, False
        try:
            msgs = self._poll(committing.producer)
        finally:
            self._committing = None
        if self._rebalanced or self._host.stop_event.is_set() or self._guarded(msgs):
            self._rewind(msgs)
            return
        if msgs:
            self._hold(committing.producer, msgs)

    def _may_handle_ahead(self) -> bool:
        host = self._host
        return not (
            host.stop_event.is_set()
            or host.consumer is None
            or host.paused_until
            or host.outage.active
            or host.tracker
            or self._errors
        )

    def _guarded(self, msgs: Sequence[ConsumedMessage]) -> bool:
        """True if some of ``msgs`` are the crash guard's to hand over (a claim first, or a search a part at a time)."""
        guard = self._guard
        if not guard.unclaimed and not guard.careful:
            return False
        watched = guard.unclaimed | set(guard.careful)
        return any((m.topic(), m.partition()) in watched for m in msgs)

    def _poll(self, producer: TransactionalProducer) -> list[ConsumedMessage]:
        """What the consumer has now, and what arrives until the commit returns (at most a batch).

        The wait for a full batch ends when the commit returns (or passes its deadline, or a stop is asked for):
        polling costs nothing while it runs.
        """
        host = self._host
        consumer = host.consumer
        assert consumer is not None
        want = host.spec.max_batch_records
        polled = consumer.consume(want, 0)
        stop = host.stop_event
        while len(polled) < want and not self._rebalanced and not producer.commit_returned() and not stop.is_set():
            polled.extend(consumer.consume(want - len(polled), 0.002))
        host.mark_polled()
        if any(m.error() is not None for m in polled):
            self._errors.extend(m for m in polled if m.error() is not None)
            polled = [m for m in polled if m.error() is None]
        assigned = host.assigned
        return [m for m in cast("list[ConsumedMessage]", polled) if (m.topic(), m.partition()) in assigned]

    def _hold(self, producer: TransactionalProducer, msgs: list[ConsumedMessage]) -> None:
        """Handle ``msgs`` as the container would (one unit, or one per partition), holding their outputs."""
        parts: list[list[ConsumedMessage]] = [msgs]
        if self._per_partition:
            by_tp: dict[TP, list[ConsumedMessage]] = {}
            for msg in msgs:
                by_tp.setdefault((msg.topic(), msg.partition()), []).append(msg)
            parts = list(by_tp.values())
        held: list[HeldBatch] = []
        for i, part in enumerate(parts):
            started = time.perf_counter()
            unit = _HoldingUnit(self._host, producer, part)
            handled, raised = 0, None
            try:
                handled = self._handle_ahead(unit, part)
            except _RUNNER_SIGNALS as exc:  # a record failed: the runner takes it on from there, at the next turn
                raised = exc
            except Exception as exc:  # noqa: BLE001 - handled again the ordinary way
                log.debug("listener %s: handling ahead of a commit failed (%r)", unit.listener, exc)
            if self._host.stop_event.is_set():
                self._rewind(msgs)
                return
            if raised is not None:
                held.append(HeldBatch(part, [], {}, 0.0, raised))
                self._rewind([m for later in parts[i + 1 :] for m in later])
                break
            if handled:  # the time budget may have ended it early: the rest is fetched again
                held.append(HeldBatch(part[:handled], unit.held, unit.held_offsets, time.perf_counter() - started))
            if handled < len(part):
                self._rewind([*part[handled:], *(m for later in parts[i + 1 :] for m in later)])
                break
        self.held = held
        self.handled_ahead += bool(held)

    # -- what gives the held batch up -------------------------------------------------------------------
    def rebalancing(self) -> None:
        """A rebalance callback runs: let the commit under way finish first, then give up what was held."""
        committing = self._committing
        if committing is not None:
            self._rebalanced = True
            if committing.producer.wait_for_commit():
                self._host.committed(dict(committing.sent_offsets))  # its claims are withdrawn knowing it
        self.drop()

    def touched(self, tp: TP) -> None:
        """``tp`` is sought or paused: what was held of it (and with it) is no longer next."""
        if any(tp in held.offsets or _tp(held) == tp for held in self.held):
            self.drop()

    def drop(self) -> None:
        """Give the held batch up: its partitions are fetched again from its first records."""
        held, self.held = self.held, []
        if held:
            msgs = [msg for part in held for msg in part.messages]
            log.debug("listener %s: %d record(s) handled ahead are given up", self._host.name, len(msgs))
            self._rewind(msgs)

    def _rewind(self, msgs: Sequence[ConsumedMessage]) -> None:
        rewind(self._host, msgs)

    # -- the container's turns -------------------------------------------------------------------------
    def run_partitions(self, slices: list[list[ConsumedMessage]], runner: Callable[[TransactionUnit], None]) -> None:
        """``fencing="partition"``: one transaction per partition's slice of the poll, one after the other.

        Each commit handles the next slice meanwhile (the last one's, the next poll): it is then committed from
        what was held, or, given up, skipped here (its partition was sought back to it).
        """
        host = self._host
        self._taken.clear()
        try:
            for i, msgs in enumerate(slices):
                tp = (msgs[0].topic(), msgs[0].partition())
                if tp not in host.assigned:
                    continue
                self._next = slices[i + 1] if i + 1 < len(slices) else None
                if tp in self._taken:
                    if self.held and _tp(self.held[0]) == tp:
                        self.commit_held()
                    continue  # given up: fetched again from its first record
                runner(TransactionUnit(host, host.producer_for(tp), msgs, ahead=self))
        finally:
            self._next = None
            self._taken.clear()

    def commit_held(self) -> bool:
        """Commit the held batch, if any (False: there is none). Consumer errors polled meanwhile come first."""
        if self._errors:
            errors, self._errors = self._errors, []
            for msg in errors:
                self._consumer_error(msg)
        parts, self.held = self.held, []
        if not parts:
            return False
        if self._host.stop_event.is_set():
            self._rewind([msg for part in parts for msg in part.messages])
            return True
        for i, part in enumerate(parts, 1):
            if part.raised is not None:
                unit = TransactionUnit(self._host, self._host.producer_for(_tp(part)), part.messages)
                # As its transaction's abort would have said (nothing of it was produced), then as the runner goes on.
                reason = f"batch failed: {type(part.raised).__name__}"
                unit.publish(TransactionAborted(unit.listener, unit.worker, len(part.messages), reason))
                self._runner(unit, part.raised)
            else:
                self._commit_part(part, last=i == len(parts))
        return True

    def _commit_part(self, held: HeldBatch, *, last: bool) -> None:
        """One held transaction: begin, produce what was held, send the offsets, commit (the last one overlapped)."""
        host = self._host
        tp = _tp(held)
        if tp not in host.assigned:  # revoked meanwhile (then everything held was dropped; kept safe here too)
            return
        started = time.perf_counter()
        unit = TransactionUnit(host, host.producer_for(tp), held.messages, ahead=self if last else None)
        try:
            committed = unit.transact(functools.partial(_produce_held, unit, held), what="batch handled ahead")
        except HandlerFailure:  # the broker refused an output of a one-record batch: handled again, it fails there
            unit.rewind()
            return
        if committed:
            self.committed_ahead += 1
            seconds = held.seconds + time.perf_counter() - started
            unit.publish(TransactionCommitted(unit.listener, unit.worker, len(held.messages), unit.outputs, seconds))


def overlap_of(
    host: ContainerHost, spec: ListenerSpec, guard: CrashGuard, reactions: KafkaErrorReactions, runner: object
) -> CommitOverlap | None:
    """The container's overlapped commit, for a record listener that asks for it (``overlap_commit=True``) and
    handles one record at a time, with no ``database=``; None otherwise (the loop then has no such stage)."""
    if (
        spec.overlap_commit
        and host.database is None
        and isinstance(runner, RecordRunner)
        and runner.handles_one_at_a_time
    ):
        return CommitOverlap(host, guard, reactions.consumer_error, runner)
    return None


def _tp(held: HeldBatch) -> TP:
    """The partition of a held batch's first record (its only one with ``fencing="partition"``)."""
    first = held.messages[0]
    return (first.topic(), first.partition())


def _cut_short(unit: TransactionUnit) -> bool:
    """True if ``unit`` commits only some of its records (its time budget ran out): the rest are fetched again
    next, so what the consumer has now is not what comes after this commit."""
    msgs = unit.messages
    if not msgs:
        return True
    last = msgs[-1]
    return unit.sent_offsets.get((last.topic(), last.partition())) != last.offset() + 1


class HeldCommit(UnitTransaction, UnitProducer, Protocol):
    """What committing a held batch uses of its unit: the transaction's steps, and the producer's direct path."""


def _produce_held(unit: HeldCommit, held: HeldBatch) -> None:
    """The held batch's transaction: its outputs in order (straight to confluent-kafka when it takes them)."""
    produced = produce_in_order(held.outputs, unit.direct, unit.produce)
    unit.outputs += produced
    unit.send_offsets(held.offsets)


class _Hold:
    """Stands in for the producer while records are handled ahead: keeps what would be produced, in order.

    Only what the record runner uses while handling is here; anything else
    (a recoverer waiting for its delivery) raises, and the batch is handled
    again the ordinary way.
    """

    __slots__ = ("_producer", "outputs")

    def __init__(self, producer: TransactionalProducer, outputs: list[PendingOutput]) -> None:
        self._producer, self.outputs = producer, outputs

    def produce(self, out: PendingOutput, on_error: Any = None) -> None:
        topic = out[0]
        if not self._producer.knows_topic(topic):
            raise UnknownTopicError(
                f"output topic {topic!r} does not exist; create it first (kafkatx never auto-creates output topics)"
            )
        self.outputs.append(out)

    def direct(self, topic: str) -> Callable[..., None] | None:
        """Takes what confluent-kafka's ``produce`` would, for a topic that exists."""
        return self._held_produce if self._producer.knows_topic(topic) else None

    def _held_produce(
        self, topic: str, value: Any = None, key: Any = None, partition: int = -1, headers: Any = None
    ) -> None:
        value, key = _as_produced(value), _as_produced(key)
        if headers is None and partition == -1:  # the usual record
            self.outputs.append((topic, value, key, None, None))
            return
        encoded = None if headers is None else encode_headers(headers)
        self.outputs.append((topic, value, key, encoded, None if partition == -1 else partition))

    def partition_count(self, topic: str, *, refresh: bool = False) -> int | None:
        return self._producer.partition_count(topic, refresh=refresh)


def _as_produced(data: Any) -> bytes | None:
    """A key or value as ``produce`` takes it (kafkatx's :func:`encode` rule): bytes, None, a str as UTF-8.

    Anything else raises TypeError (an unencodable str ValueError), as ``produce`` does, so the emit function
    that offered it encodes it itself (the serializer, or an error naming the problem).
    """
    if data is None or type(data) is bytes:
        return data
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"a bytes-like object is required, not {type(data).__name__!r}")


class _HoldingUnit(TransactionUnit):
    """A unit handled ahead of a commit: outputs and offsets are held (:class:`_Hold`), any failure ends it."""

    __slots__ = ("held", "held_offsets")

    def __init__(self, host: TransactionHost, producer: TransactionalProducer, messages: list[ConsumedMessage]) -> None:
        self.held: list[PendingOutput] = []
        self.held_offsets: dict[TP, int] = {}
        # The hold has the producer methods the runner calls while handling (and no transactional ones).
        super().__init__(host, cast("TransactionalProducer", _Hold(producer, self.held)), messages)

    def send_offsets(self, offsets: Mapping[TP, int], metadata: Mapping[TP, str] | None = None) -> None:
        self.held_offsets.update(offsets)

    def transact(self, work: Callable[[], None], *, records: int | None = None, what: str = "batch") -> bool:
        raise RuntimeError("records handled ahead of a commit are not in a transaction")
