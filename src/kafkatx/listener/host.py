"""The ports of the listener package: what its helpers need from the container, and what a runner gets.

The container passes itself to its helpers (the transaction unit, the crash
guard, the Kafka-error reactions, the health checks), and a custom runner
receives transaction units. Each of them is typed against a Protocol here,
never against :class:`~kafkatx.listener.loop.container.ListenerContainer` or
:class:`~kafkatx.listener.transaction.unit.TransactionUnit`, so that:

- imports run one way (this module imports nothing of ``kafkatx.listener``);
- a helper uses only the container's public services (the list below is the
  whole of it), and a fake host can stand in for the container in a test
  without a broker.

The ports are cut by role, each small (at most 12 members, checked by
tests/test_architecture.py): the container's identity, positions,
membership, transactions, failure state and liveness; the unit's records,
books, container state, transaction, recovery and positions; the settings
each part reads. A helper is typed on the roles it uses (a Protocol of its
own inheriting them, where it needs several); :class:`ContainerHost`,
:class:`TransactionHost`, :class:`Unit` and :class:`ListenerSettings` are
such composites, declaring nothing themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kafkatx.client.offsets import TP

if TYPE_CHECKING:
    from confluent_kafka import Consumer

    from kafkatx.client.producer import TransactionalProducer
    from kafkatx.database.session import DatabaseSession
    from kafkatx.errors import KafkaClientError
    from kafkatx.events import Event
    from kafkatx.listener.loop.brokers import BrokerWatch
    from kafkatx.outputs import PendingOutput, Serializer
    from kafkatx.record import ConsumedMessage, Record
    from kafkatx.recoverers import Recoverer
    from kafkatx.retry_topics.hops import RetryHops
    from kafkatx.rollback.policy import FailurePolicy
    from kafkatx.rollback.processor import AfterRollbackProcessor
    from kafkatx.rollback.tracker import FailureTracker

__all__ = [
    "BatchSettings",
    "ClaimKeeper",
    "ContainerFailureState",
    "ContainerHost",
    "ContainerIdentity",
    "ContainerLiveness",
    "ContainerMembership",
    "ContainerPositions",
    "ContainerTransactions",
    "FailureSettings",
    "HandlerFailure",
    "HandlerSettings",
    "ListenerGate",
    "ListenerSettings",
    "ProducerReactions",
    "RecordUnit",
    "Runner",
    "RunnerFactory",
    "TracingHooks",
    "TransactionHost",
    "Unit",
    "UnitBooks",
    "UnitContainerState",
    "UnitPositions",
    "UnitProducer",
    "UnitRecords",
    "UnitRecovery",
    "UnitTransaction",
    "UntracedRoots",
]


class HandlerFailure(Exception):
    """Internal signal: the handler (or its outputs) failed for record ``index`` of a unit.

    It never reaches users: the record's own exception is ``exc``, raised
    and kept outside any ``except`` block of kafkatx, so its
    ``__context__`` chain is the handler's alone.
    """

    def __init__(self, index: int, exc: BaseException, record: Record) -> None:
        super().__init__(index, exc, record)
        self.index, self.exc, self.record = index, exc, record


# -- the settings each part reads (the spec implements them all) -----------------------------------------------
# Read-only: the spec's Literal-typed fields (fencing, retry) fit a str property, not a str attribute.


class HandlerSettings(Protocol):
    """The handler and what its results become: what runs records and encodes their outputs."""

    @property
    def name(self) -> str: ...
    @property
    def handler(self) -> Callable[..., Any]: ...
    @property
    def topics(self) -> tuple[str, ...]: ...
    @property
    def output(self) -> str | None: ...
    @property
    def serializer(self) -> Serializer | None: ...


class FailureSettings(Protocol):
    """What happens to a failed record or transaction: the policy, the processor, how retries and crashes go."""

    @property
    def policy(self) -> FailurePolicy: ...
    @property
    def processor(self) -> AfterRollbackProcessor: ...
    @property
    def retry(self) -> str: ...
    @property
    def max_abortable_retries(self) -> int: ...
    @property
    def count_crashes(self) -> bool: ...


class BatchSettings(Protocol):
    """How records are grouped and run: per poll, per transaction, concurrently, per container."""

    @property
    def fencing(self) -> str: ...
    @property
    def max_batch_records(self) -> int: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def ordering(self) -> str: ...
    @property
    def is_async(self) -> bool: ...
    @property
    def concurrency(self) -> int: ...


class TracingHooks(Protocol):
    """What tracing plugs into a listener (set by the App, not declared)."""

    @property
    def while_committing(self) -> Callable[[], None] | None: ...
    @property
    def untraced_roots(self) -> UntracedRoots | None: ...


class ListenerSettings(HandlerSettings, FailureSettings, BatchSettings, TracingHooks, Protocol):
    """The parts of a listener's declaration (:class:`~kafkatx.listener.spec.ListenerSpec`) the helpers read.

    A Protocol rather than the spec itself: the spec holds the runner
    factory, which is typed on :class:`ContainerHost`, so this module cannot
    import the spec without an import circle. It declares nothing of its own:
    a part that reads only some settings is typed on their roles.
    """


class UntracedRoots(Protocol):
    """Tracing's countdown of the root records (no headers) its sampler leaves out (:mod:`kafkatx.tracing`).

    The record runner calls :attr:`handler`, the listener's own, for them:
    each is spared the traced wrapper's call, most records at the usual 1%.
    The countdown is the runner's while it handles a unit: it takes it, and
    again after each call of the traced handler (which may have drawn the
    next one), and gives back what is left.
    """

    @property
    def handler(self) -> Callable[[Any], Any]: ...

    def take(self) -> int:
        """The root records to run untraced from here on (0 while some record is failing: the wrapper decides)."""

    def give_back(self, left: int) -> None:
        """What the runner did not use of its countdown."""


class ClaimKeeper(Protocol):
    """The crash guard's side of a commit (:class:`~kafkatx.listener.failure.crash_guard.CrashGuard`)."""

    @property
    def enabled(self) -> bool:
        """True if the listener counts crashes (``count_crashes``): claims are written, records can be isolated."""

    def metadata(self, offsets: Mapping[TP, int]) -> dict[TP, str] | None:
        """The offset-commit metadata of a transaction committing ``offsets`` (in-flight claims)."""

    def isolate(self, until: Mapping[TP, int]) -> None:
        """Handle the partitions' records before ``until`` one per transaction."""


class ProducerReactions(Protocol):
    """The Kafka-error reactions a unit asks for (:class:`~kafkatx.listener.failure.reactions.KafkaErrorReactions`)."""

    def note(self, exc: KafkaClientError, action: str) -> None:
        """Publish that ``exc`` was handled by ``action``."""

    def recreate_producer(
        self,
        producer: TransactionalProducer,
        exc: KafkaClientError,
        msgs: Sequence[ConsumedMessage],
        *,
        escalated: bool = False,
    ) -> None:
        """Discard ``producer`` and rewind ``msgs`` to the committed offsets."""

    def rewind_to_committed(self, msgs: Sequence[ConsumedMessage]) -> None:
        """Seek the partitions of ``msgs`` that are still owned to their committed offsets."""


class ListenerGate(Protocol):
    """The outage state shared by the containers of one listener (:class:`~kafkatx.listener.failure.outage.ListenerOutage`)."""

    @property
    def active(self) -> bool:
        """True while a dependency outage pauses the listener."""

    def matches(self, exc: BaseException) -> bool:
        """True if ``exc`` means a dependency is down (the listener's ``outages``), not that the record failed."""

    def report(self, worker: int, exc: BaseException, record: Record | None) -> float:
        """A dependency is down: pause every container of the listener. Returns the wait before the next retry."""

    def committed(self, offsets: Mapping[TP, int]) -> None:
        """A transaction with records committed ``offsets`` (the end of an outage, once past its record)."""

    def admits(self, worker: int, assigned: set[TP]) -> frozenset[TP] | None:
        """The partitions container ``worker`` may handle now: None for all of them."""


# -- the container's roles (the container implements them all) -------------------------------------------------
# Read-only properties where the container holds plain attributes: state is written only by its owner.


class ContainerIdentity(Protocol):
    """Who the container is, what its listener declared, where it says things, and whether it is asked to stop."""

    @property
    def name(self) -> str:
        """The listener's name (``name#worker`` with ``concurrency > 1``)."""

    @property
    def worker(self) -> int:
        """The container's index among its listener's containers."""

    @property
    def group_id(self) -> str:
        """The consumer group."""

    @property
    def spec(self) -> ListenerSettings:
        """The listener's declaration."""

    @property
    def stop_event(self) -> threading.Event:
        """Set once the container is asked to stop."""

    def publish(self, event: Event) -> None:
        """Publish ``event`` to the App's subscribers."""


class ContainerPositions(Protocol):
    """Which partitions the container owns, where it fetches them from, and what it committed of them."""

    @property
    def assigned(self) -> set[TP]:
        """The partitions the container owns right now (the container's own set: read, never changed)."""

    @property
    def paused_until(self) -> Mapping[TP, float]:
        """The partitions kafkatx holds, and until when (``time.monotonic()``)."""

    def seek(self, tp: TP, offset: int) -> None:
        """Fetch ``tp`` from ``offset`` next (ignored if the partition was revoked meanwhile)."""

    def pause(self, tp: TP, seconds: float) -> None:
        """Hold ``tp`` for ``seconds`` while the consumer keeps polling."""

    def defer(self, messages: list[ConsumedMessage], seconds: float) -> None:
        """Hold the partition of ``messages`` for ``seconds``, then handle them from memory."""

    def committed(self, offsets: dict[TP, int]) -> None:
        """A transaction committed these next offsets."""

    def committed_offset(self, tp: TP) -> int | None:
        """The next offset of ``tp`` this container committed last, if any."""

    def owns(self, tp: TP) -> bool:
        """True if the container owns ``tp``: an assigned partition, or (``retry="topics"``) a retry partition
        mirrored from one."""


class ContainerMembership(Protocol):
    """The consumer and its place in the group: what offsets are sent with, and checked against at commit."""

    @property
    def consumer(self) -> Consumer | None:
        """The consumer, once the container opened it (None before, and after it closed)."""

    @property
    def consumer_config(self) -> Mapping[str, Any]:
        """The librdkafka configuration of the consumer."""

    def membership(self) -> Any:
        """The group metadata to send offsets with."""

    def membership_guard(self, membership: Any) -> Callable[[], None]:
        """A pre-commit check that this consumer is still the member that sent the offsets."""


class ContainerTransactions(Protocol):
    """What a transaction is made with: the producers, the database transaction it carries, the Kafka-error
    reactions that outlive it, and their limits."""

    @property
    def database(self) -> DatabaseSession | None:
        """With ``database=``: the database transaction each Kafka transaction carries (committed first)."""

    @property
    def reactions(self) -> ProducerReactions:
        """The Kafka-error reactions (producer replacement, rewinds)."""

    @property
    def max_producer_recreations(self) -> int:
        """How many producer replacements within a minute stop the container."""

    @property
    def fence_hold(self) -> float:
        """Seconds a partition is held after its producer was fenced (``fencing="partition"``)."""

    def producer_for(self, tp: TP) -> TransactionalProducer:
        """The transactional producer that commits ``tp``'s offsets."""

    @property
    def retry_hops(self) -> RetryHops | None:
        """``retry="topics"``: the listener's retry topics (and, with key order, the keys in retry each
        transaction keeps up to date); None for any other listener."""


class ContainerFailureState(Protocol):
    """What the transactions answer to: the failure counts, the crash claims, the listener's outage gate."""

    @property
    def tracker(self) -> FailureTracker:
        """The container's failure counts."""

    @property
    def guard(self) -> ClaimKeeper:
        """The crash guard: claims written with every commit."""

    @property
    def outage(self) -> ListenerGate:
        """The listener's outage state, shared with its other containers."""


class ContainerLiveness(Protocol):
    """What /livez and the time limits are made of: when the consumer last polled, how long a transaction may
    take, whether the cluster answers."""

    @property
    def brokers(self) -> BrokerWatch:
        """Whether the cluster answers this container (listener/loop/brokers.py)."""

    @property
    def polled_at(self) -> float:
        """When (``time.monotonic()``) the consumer last returned from a poll."""

    @property
    def transaction_budget(self) -> float:
        """Seconds of handling after which a transaction takes no more records (``max_transaction_ms``)."""

    def mark_polled(self) -> None:
        """The consumer just returned from a poll made outside the main loop's (a held listener's, one made
        during a commit): :attr:`polled_at` is now."""


class TransactionHost(
    ContainerIdentity, ContainerPositions, ContainerMembership, ContainerTransactions, ContainerFailureState, Protocol
):
    """What a transaction unit needs of its container (every role but liveness), and so what builds units needs:
    :func:`~kafkatx.listener.transaction.unit.commit_offsets`, the crash guard, the idle stage, the partition turns."""


class ContainerHost(TransactionHost, ContainerLiveness, Protocol):
    """The services of a listener container, all its roles (the container implements it).

    What a runner factory (:data:`RunnerFactory`) is given, and what the helpers that poll on the container's
    behalf and build units use (the overlapped commit). Every other helper is typed on the roles it uses.
    """


# -- the unit's roles (TransactionUnit implements them all) ---------------------------------------------------


class UnitRecords(Protocol):
    """The unit's records, and the offsets that commit them."""

    messages: list[ConsumedMessage]

    def with_messages(self, messages: list[ConsumedMessage]) -> Unit:
        """The same container and producer, over ``messages``."""

    def records(self, messages: Sequence[ConsumedMessage] | None = None, spare: Sequence[Record] = ()) -> list[Record]:
        """The unit's messages as Records, each with its true next ``attempt`` (``spare``: records to refill that
        nothing else holds, given up by the caller)."""

    def next_offsets(self, messages: Sequence[ConsumedMessage] | None = None) -> dict[TP, int]:
        """The offsets to commit once ``messages`` (default: the whole unit) are done."""


class UnitBooks(Protocol):
    """Whose records they are, the failure policy and counts that decide about them, and the events said of them
    (with a stop event, what :func:`~kafkatx.rollback.decision.decide_failure` reads)."""

    listener: str
    group_id: str
    worker: int
    policy: FailurePolicy
    tracker: FailureTracker

    def publish(self, event: Event) -> None:
        """Publish ``event`` to the App's subscribers."""


class UnitContainerState(Protocol):
    """The container around the unit: whether it stops, what it owns, whether its listener is held."""

    @property
    def stopping(self) -> bool:
        """True once the container was asked to stop."""

    @property
    def stop_event(self) -> threading.Event:
        """The container's stop event."""

    @property
    def assignment(self) -> set[TP]:
        """The partitions the container owns right now."""

    @property
    def outage(self) -> ListenerGate:
        """The listener's outage state (a dependency that is down pauses the whole listener)."""

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, waking early if the container stops. True if it is stopping."""


class UnitTransaction(Protocol):
    """One transaction: ``transact``, or its steps one by one, and what they produced."""

    #: Records produced in the open transaction (a runner that produces around :meth:`produce` adds its own).
    outputs: int

    def transact(self, work: Callable[[], None], *, records: int | None = None, what: str = "batch") -> bool:
        """Begin, run ``work``, commit under the membership check. True if it committed."""

    def begin(self) -> None:
        """Begin a transaction."""

    def produce(self, output: PendingOutput) -> None:
        """Produce one record in the open transaction."""

    def send_offsets(self, offsets: Mapping[TP, int], metadata: Mapping[TP, str] | None = None) -> None:
        """Send the next offsets to consume to the transaction."""

    def commit(self) -> None:
        """Commit, unless the consumer left its group since the offsets were sent."""

    def abort(self, records: int, reason: str) -> bool:
        """Abort the open transaction. False if the abort failed (the unit was then rewound)."""

    def partition_count(self, topic: str) -> int | None:
        """Partitions of ``topic`` from metadata, or None if it does not exist."""


class UnitRecovery(Protocol):
    """What is done for a record or a producer that cannot go on as they are."""

    def recover(self, recoverer: Recoverer, record: Record, exception: BaseException, *, confirm: bool = True) -> None:
        """Run ``recoverer`` inside the open transaction; RecoveryError if it fails."""

    def replace_producer(self, exc: KafkaClientError) -> None:
        """Discard the producer and rewind to the committed offsets."""


class UnitPositions(Protocol):
    """Where the unit's partitions are fetched from next, and which wait."""

    def seek(self, tp: TP, offset: int) -> None:
        """Fetch ``tp`` from ``offset`` next."""

    def rewind(self, messages: Sequence[ConsumedMessage] | None = None) -> None:
        """Seek every partition of ``messages`` (default: the unit) back to its first record."""

    def rewind_to_committed(self, messages: Sequence[ConsumedMessage] | None = None) -> None:
        """Seek the partitions of ``messages`` back to their committed offsets."""

    def defer(self, messages: list[ConsumedMessage], seconds: float) -> None:
        """Hold the partition of ``messages`` for ``seconds``, then handle them from memory."""

    def pause(self, tp: TP, seconds: float) -> None:
        """Hold ``tp`` for ``seconds`` while the consumer keeps polling."""


class Unit(UnitRecords, UnitBooks, UnitContainerState, UnitTransaction, UnitRecovery, UnitPositions, Protocol):
    """The public interface of a transaction unit (docs/ARCHITECTURE.md), the one a runner is written on.

    :class:`~kafkatx.listener.transaction.unit.TransactionUnit` implements it. It declares nothing of its own:
    it is its roles together, and a helper that uses only some of them is typed on those.
    """


class UnitProducer(Protocol):
    """The unit's producer itself, for the record runner's hot path (not part of :class:`Unit`): outputs
    produced straight through confluent-kafka, and a record's buffered ones, which the runner counts itself."""

    @property
    def producer(self) -> TransactionalProducer:
        """The transactional producer that owns the unit's offsets."""

    def direct(self, topic: str) -> Callable[..., Any] | None:
        """confluent-kafka's own ``produce`` for ``topic`` (None: use :meth:`UnitTransaction.produce`)."""


class RecordUnit(Unit, UnitProducer, Protocol):
    """What the record runner (:mod:`kafkatx.listener.runners.record_runner`) runs: a unit and its producer."""

    def with_messages(self, messages: list[ConsumedMessage]) -> RecordUnit:
        """The same container and producer, over ``messages``."""


#: What a listener's runner is: called once per transaction unit (a unit and its producer; a runner written on the
#: unit alone, as the Spark runner is, is one too).
Runner = Callable[[RecordUnit], None]
#: What builds a container's runner (``ListenerSpec.runner``): called once per container as it starts.
RunnerFactory = Callable[[ContainerHost], Runner]
