"""A fake container host and a fake transactional producer: the listener's helpers without a broker.

:class:`FakeHost` implements :class:`kafkatx.listener.host.ContainerHost`
(every role of the container) the way the container does (seeks, pauses,
deferrals and commits are recorded instead of reaching a consumer);
:class:`FakeProducer` records every transactional call, keeps what committed
transactions produced and committed, and raises on demand.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from kafkatx.client.producer import TransactionalProducer
from kafkatx.database.session import DatabaseSession
from kafkatx.errors import GroupMembershipChanged
from kafkatx.events import Event
from kafkatx.listener.failure.crash_guard import CrashGuard
from kafkatx.listener.failure.outage import ListenerOutage
from kafkatx.listener.failure.reactions import KafkaErrorReactions
from kafkatx.listener.host import ClaimKeeper, ListenerSettings, ProducerReactions
from kafkatx.listener.loop.brokers import BrokerWatch
from kafkatx.listener.runners.record_runner import RecordRunner
from kafkatx.listener.spec import ListenerSpec, build_spec
from kafkatx.listener.transaction.unit import TransactionUnit
from kafkatx.outputs import PendingOutput
from kafkatx.record import ConsumedMessage
from kafkatx.retry_topics.hops import RetryHops
from kafkatx.rollback.tracker import FailureTracker

TP = tuple[str, int]  # (tests keep their own spelling: src defines it once, in kafkatx.client.offsets)


def message(offset: int, value: bytes | None = None, *, topic: str = "in", partition: int = 0) -> ConsumedMessage:
    """A consumed record as confluent-kafka hands it over."""
    msg = Message(topic=topic, partition=partition, offset=offset, key=None, value=value or b"v%d" % offset)
    return cast(ConsumedMessage, msg)


def messages(*values: bytes, topic: str = "in", partition: int = 0, start: int = 0) -> list[ConsumedMessage]:
    return [message(start + i, v, topic=topic, partition=partition) for i, v in enumerate(values)]


@dataclass
class Transaction:
    """One transaction as the producer saw it."""

    produced: list[tuple[str, bytes | None]] = field(default_factory=list)
    offsets: dict[TP, int] = field(default_factory=dict)
    metadata: dict[TP, str] = field(default_factory=dict)
    outcome: str = "open"  # "committed" or "aborted"


class FakeProducer(TransactionalProducer):
    """A transactional producer that talks to no broker (every call the unit makes, recorded).

    ``fail_on(call, exc)`` makes the next ``call`` ("begin", "produce", "send_offsets", "commit", "abort")
    raise ``exc``. ``fast=True`` offers the hot path's direct produce, as a producer with known topics does.
    """

    def __init__(self, *, fast: bool = False) -> None:  # no super().__init__(): nothing of librdkafka
        self.transactional_id = "fake-txn"
        self.retry_timeout = 0.0  # a Kafka call that fails retriably fails at once
        self.recorder: list[PendingOutput] | None = None
        self.in_transaction = False
        self.calls: list[str] = []
        self.transactions: list[Transaction] = []
        self.discarded = 0
        self._fast = fast
        self._failures: dict[str, list[BaseException]] = {}

    # -- what a test asks --------------------------------------------------------------
    def fail_on(self, call: str, exc: BaseException, times: int = 1) -> None:
        self._failures.setdefault(call, []).extend([exc] * times)

    @property
    def committed(self) -> list[Transaction]:
        return [t for t in self.transactions if t.outcome == "committed"]

    @property
    def committed_values(self) -> list[bytes | None]:
        return [value for t in self.committed for _, value in t.produced]

    @property
    def committed_offsets(self) -> dict[TP, int]:
        offsets: dict[TP, int] = {}
        for t in self.committed:
            offsets.update(t.offsets)
        return offsets

    def _step(self, name: str) -> None:
        self.calls.append(name)
        pending = self._failures.get(name)
        if pending:
            raise pending.pop(0)

    @property
    def _current(self) -> Transaction:
        assert self.in_transaction and self.transactions, "no transaction open"
        return self.transactions[-1]

    # -- the calls TransactionUnit makes -----------------------------------------------------
    def begin(self) -> None:
        self._step("begin")
        self.in_transaction = True
        self.transactions.append(Transaction())

    def produce(self, out: PendingOutput, on_error: Callable[[KafkaError], None] | None = None) -> None:
        self._step("produce")
        if self.recorder is not None:
            self.recorder.append(out)
        self._current.produced.append((out[0], out[1]))

    def direct(self, topic: str) -> Callable[..., Any] | None:
        if not self._fast or not self.in_transaction:
            return None

        def produce(topic: str, value: Any, key: Any = None, *args: Any, **kw: Any) -> None:
            # confluent-kafka takes bytes, str (as UTF-8) and None, and refuses the rest: kafkatx encodes those
            for data in (value, key):
                if data is not None and not isinstance(data, (bytes, str)):
                    raise TypeError(f"a bytes-like object is required, not '{type(data).__name__}'")
            self.calls.append("produce")
            self._current.produced.append((topic, value.encode() if isinstance(value, str) else value))

        return produce

    def send_offsets(self, offsets: list[TopicPartition], group_metadata: Any) -> None:
        self._step("send_offsets")
        txn = self._current
        for tp in offsets:
            txn.offsets[(tp.topic, tp.partition)] = tp.offset
            if tp.metadata:
                txn.metadata[(tp.topic, tp.partition)] = tp.metadata

    def flush_offsets(self) -> None:
        pass

    def commit(self, guard: Callable[[], None] | None = None, meanwhile: Callable[[], None] | None = None) -> None:
        self._step("commit")
        if guard is not None:
            guard()
        if meanwhile is not None:  # what the container does while the broker commits
            meanwhile()
        self._current.outcome = "committed"
        self.in_transaction = False

    def abort(self) -> None:
        self._step("abort")
        if self.in_transaction:
            self._current.outcome = "aborted"
        self.in_transaction = False

    def flush(self, timeout: float = 30.0) -> list[str]:
        return []

    def wait_for_deliveries(self, timeout: float = 30.0) -> int:
        return 0

    def transaction_failure(self, *, besides: KafkaError | None = None) -> Any:
        return None

    def partition_count(self, topic: str, *, refresh: bool = False) -> int | None:
        return 1

    def discard(self) -> None:
        self.calls.append("discard")
        self.discarded += 1
        self.in_transaction = False

    def ensure(self) -> Any:
        self.calls.append("ensure")
        return None

    def close(self) -> None:
        pass


class FakeConsumer:
    """The few consumer calls the helpers make: committed offsets as a test sets them."""

    def __init__(self) -> None:
        self.committed_offsets: dict[TP, int] = {}

    def committed(self, partitions: list[TopicPartition], timeout: float = 10) -> list[TopicPartition]:
        return [
            TopicPartition(p.topic, p.partition, self.committed_offsets.get((p.topic, p.partition), -1001))
            for p in partitions
        ]

    def get_watermark_offsets(self, tp: TopicPartition, cached: bool = False) -> tuple[int, int]:
        return (0, 1_000_000)


class FakeHost:
    """A listener container without threads, consumer or broker (implements ContainerHost: every role)."""

    def __init__(self, spec: ListenerSpec, producer: FakeProducer | None = None) -> None:
        self._spec = spec
        self.name = spec.name
        self.worker = 0
        self.group_id = "group"
        self.tracker = FailureTracker()
        self.stop_event = threading.Event()
        self.fake_consumer = FakeConsumer()
        self.consumer: Consumer | None = self.fake_consumer  # type: ignore[assignment]
        self.assigned: set[TP] = {(t, 0) for t in spec.topics}
        self.database: DatabaseSession | None = None
        self.polled_at = time.monotonic()  # just polled: the runner handles what is left from memory
        self.brokers = BrokerWatch(self.name, self.worker, "fake:9092", self.publish)
        self.transaction_budget = 3600.0
        self.fence_hold = 5.0
        self.max_producer_recreations = 10
        self.retry_hops = RetryHops.of(spec, self.group_id)
        self.producer = producer or FakeProducer()
        self.events: list[Event] = []
        self.seeks: list[tuple[TP, int]] = []
        self.pauses: dict[TP, float] = {}
        self.deferred: dict[TP, tuple[list[ConsumedMessage], float]] = {}
        self.committed_offsets: dict[TP, int] = {}
        self.member_changed = False
        self.crash_guard = CrashGuard(self)  # claims and counts in the commit metadata (spec.count_crashes)
        self.error_reactions = KafkaErrorReactions(self)  # (typed as itself: tests call its consumer_error too)
        self.outage = ListenerOutage.for_listener(spec, self.publish)  # (one container: the listener's own)

    @property
    def spec(self) -> ListenerSettings:
        return self._spec

    @property
    def guard(self) -> ClaimKeeper:
        return self.crash_guard

    @property
    def reactions(self) -> ProducerReactions:
        return self.error_reactions

    @property
    def paused_until(self) -> Mapping[TP, float]:
        return self.pauses

    @property
    def consumer_config(self) -> Mapping[str, Any]:
        return {"group.instance.id": "fake-instance"}

    def mark_polled(self) -> None:
        self.polled_at = time.monotonic()

    def publish(self, event: Event) -> None:
        self.events.append(event)

    def events_of(self, kind: type[Event]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    def seek(self, tp: TP, offset: int) -> None:
        self.seeks.append((tp, offset))

    def pause(self, tp: TP, seconds: float) -> None:
        if seconds > 0 and tp in self.assigned:
            self.pauses[tp] = seconds

    def defer(self, messages: list[ConsumedMessage], seconds: float) -> None:
        tp = (messages[0].topic(), messages[0].partition())
        self.pause(tp, seconds)
        self.deferred[tp] = (messages, seconds)

    def membership(self) -> Any:
        return b"member-1"

    def membership_guard(self, membership: Any) -> Callable[[], None]:
        def guard() -> None:
            if self.member_changed:
                raise GroupMembershipChanged("the group changed while the transaction was open")

        return guard

    def committed(self, offsets: dict[TP, int]) -> None:
        self.committed_offsets.update(offsets)
        self.crash_guard.committed(offsets)
        if self.tracker.failing:
            self.tracker.committed(offsets)

    def owns(self, tp: TP) -> bool:
        return tp in self.assigned

    def committed_offset(self, tp: TP) -> int | None:
        return self.committed_offsets.get(tp)

    def producer_for(self, tp: TP) -> TransactionalProducer:
        return self.producer

    # -- what the container does with them -------------------------------------------------
    def unit(self, msgs: list[ConsumedMessage]) -> TransactionUnit:
        return TransactionUnit(self, self.producer, msgs)

    def runner(self) -> RecordRunner:
        """The listener's record runner, as the container builds it."""
        return RecordRunner(self, self._spec.processor)


def listener(handler: Callable[..., Any], **options: Any) -> ListenerSpec:
    """A record listener's spec on topic "in" writing to "out" (``options`` as @app.listener takes them)."""
    return build_spec(handler, ["in"], {"output": "out", **options})
