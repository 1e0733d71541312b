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
    from kafkatx.rollback.policy import FailurePolicy
    from kafkatx.rollback.processor import AfterRollbackProcessor
    from kafkatx.rollback.tracker import FailureTracker

__all__ = [
    "ClaimKeeper",
    "ContainerHost",
    "HandlerFailure",
    "ListenerGate",
    "ListenerSettings",
    "ProducerReactions",
    "Runner",
    "RunnerFactory",
    "Unit",
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


class ListenerSettings(Protocol):
    """The parts of a listener's declaration (:class:`~kafkatx.listener.spec.ListenerSpec`) the helpers read.

    A Protocol rather than the spec itself: the spec holds the runner
    factory, which is typed on :class:`ContainerHost`, so this module cannot
    import the spec without an import circle.
    """

    # Read-only: the spec's Literal-typed fields (fencing, retry) fit a str property, not a str attribute.
    @property
    def name(self) -> str: ...
    @property
    def handler(self) -> Callable[..., Any]: ...
    @property
    def topics(self) -> tuple[str, ...]: ...
    @property
    def policy(self) -> FailurePolicy: ...
    @property
    def processor(self) -> AfterRollbackProcessor: ...
    @property
    def output(self) -> str | None: ...
    @property
    def serializer(self) -> Serializer | None: ...
    @property
    def retry(self) -> str: ...
    @property
    def fencing(self) -> str: ...
    @property
    def max_batch_records(self) -> int: ...
    @property
    def max_abortable_retries(self) -> int: ...
    @property
    def count_crashes(self) -> bool: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def ordering(self) -> str: ...
    @property
    def is_async(self) -> bool: ...
    @property
    def concurrency(self) -> int: ...
    @property
    def while_committing(self) -> Callable[[], None] | None: ...
    @property
    def untraced_roots(self) -> UntracedRoots | None: ...


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

    enabled: bool

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


class ContainerHost(Protocol):
    """The services of a listener container that its helpers use (the container implements it)."""

    name: str
    worker: int
    group_id: str
    tracker: FailureTracker
    stop_event: threading.Event
    consumer: Consumer | None
    #: Whether the cluster answers this container (listener/loop/brokers.py).
    brokers: BrokerWatch
    assigned: set[TP]
    database: DatabaseSession | None
    polled_at: float
    transaction_budget: float
    fence_hold: float

    @property
    def spec(self) -> ListenerSettings:
        """The listener's declaration."""

    @property
    def guard(self) -> ClaimKeeper:
        """The crash guard: claims written with every commit."""

    @property
    def outage(self) -> ListenerGate:
        """The listener's outage state, shared with its other containers."""

    @property
    def reactions(self) -> ProducerReactions:
        """The Kafka-error reactions (producer replacement, rewinds)."""

    @property
    def paused_until(self) -> Mapping[TP, float]:
        """The partitions kafkatx holds, and until when (``time.monotonic()``)."""

    @property
    def consumer_config(self) -> Mapping[str, Any]:
        """The librdkafka configuration of the consumer."""

    @property
    def max_producer_recreations(self) -> int:
        """How many producer replacements within a minute stop the container."""

    def publish(self, event: Event) -> None:
        """Publish ``event`` to the App's subscribers."""

    def seek(self, tp: TP, offset: int) -> None:
        """Fetch ``tp`` from ``offset`` next (ignored if the partition was revoked meanwhile)."""

    def pause(self, tp: TP, seconds: float) -> None:
        """Hold ``tp`` for ``seconds`` while the consumer keeps polling."""

    def defer(self, messages: list[ConsumedMessage], seconds: float) -> None:
        """Hold the partition of ``messages`` for ``seconds``, then handle them from memory."""

    def membership(self) -> Any:
        """The group metadata to send offsets with."""

    def membership_guard(self, membership: Any) -> Callable[[], None]:
        """A pre-commit check that this consumer is still the member that sent the offsets."""

    def committed(self, offsets: dict[TP, int]) -> None:
        """A transaction committed these next offsets."""

    def committed_offset(self, tp: TP) -> int | None:
        """The next offset of ``tp`` this container committed last, if any."""

    def producer_for(self, tp: TP) -> TransactionalProducer:
        """The transactional producer that commits ``tp``'s offsets."""


class Unit(Protocol):
    """The public interface of a transaction unit (docs/ARCHITECTURE.md), the one a runner is written on.

    :class:`~kafkatx.listener.transaction.unit.TransactionUnit` implements it.
    """

    messages: list[ConsumedMessage]
    policy: FailurePolicy
    tracker: FailureTracker
    listener: str
    group_id: str
    worker: int
    outputs: int

    def with_messages(self, messages: list[ConsumedMessage]) -> Unit:
        """The same container and producer, over ``messages``."""

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

    def publish(self, event: Event) -> None:
        """Publish ``event`` to the App's subscribers."""

    def records(self, messages: Sequence[ConsumedMessage] | None = None) -> list[Record]:
        """The unit's messages as Records, each with its true next ``attempt``."""

    def next_offsets(self, messages: Sequence[ConsumedMessage] | None = None) -> dict[TP, int]:
        """The offsets to commit once ``messages`` (default: the whole unit) are done."""

    def partition_count(self, topic: str) -> int | None:
        """Partitions of ``topic`` from metadata, or None if it does not exist."""

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

    def recover(self, recoverer: Recoverer, record: Record, exception: BaseException, *, confirm: bool = True) -> None:
        """Run ``recoverer`` inside the open transaction; RecoveryError if it fails."""

    def replace_producer(self, exc: KafkaClientError) -> None:
        """Discard the producer and rewind to the committed offsets."""

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


#: What a listener's runner is: called once per transaction unit.
Runner = Callable[[Unit], None]
#: What builds a container's runner (``ListenerSpec.runner``): called once per container as it starts.
RunnerFactory = Callable[[ContainerHost], Runner]
