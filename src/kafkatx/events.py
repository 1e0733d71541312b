"""Lifecycle events: what a container did, for callbacks, metrics and tests.

Subscribe with ``@app.on(EventType)`` (or ``app.on(Event)`` for all). Callbacks
run synchronously on the container's thread, so keep them short; an
exception in a callback is logged and never breaks processing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kafkatx.record import Record

__all__ = [
    "Event",
    "ClusterReachable",
    "ClusterUnreachable",
    "ContainerStarted",
    "ContainerStopped",
    "PartitionsAssigned",
    "PartitionsRevoked",
    "ContainerIdle",
    "TransactionCommitted",
    "TransactionAborted",
    "HandlerFailed",
    "RecordRetryScheduled",
    "RecordFollowed",
    "RecordsInRetry",
    "RetryHandled",
    "RetryPartitionStalled",
    "RetryPartitionFlowing",
    "RecordRecovered",
    "RecoveryFailed",
    "ProducerRecreated",
    "KafkaErrorHandled",
    "OutageStarted",
    "OutageEnded",
    "CrashSearchNarrowed",
    "LastStableOffsetStuck",
    "LastStableOffsetReleased",
    "EventBus",
]

log = logging.getLogger("kafkatx.events")


@dataclass(frozen=True, slots=True)
class Event:
    """Base of all events. ``listener`` names the listener, ``worker`` its thread index."""

    listener: str
    worker: int


@dataclass(frozen=True, slots=True)
class ContainerStarted(Event):
    topics: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ContainerStopped(Event):
    """``reason`` is ``"normal"``, ``"fenced"``, ``"error"`` or ``"config"``."""

    reason: str = "normal"
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class PartitionsAssigned(Event):
    partitions: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class PartitionsRevoked(Event):
    partitions: tuple[tuple[str, int], ...] = ()
    lost: bool = False


@dataclass(frozen=True, slots=True)
class ContainerIdle(Event):
    idle_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class TransactionCommitted(Event):
    records: int = 0
    outputs: int = 0
    seconds: float = 0.0
    kind: str = "batch"  # "batch", "after_rollback" or "producer"


@dataclass(frozen=True, slots=True)
class TransactionAborted(Event):
    records: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class HandlerFailed(Event):
    record: Record | None = None
    exception: BaseException | None = None
    attempt: int = 1


@dataclass(frozen=True, slots=True)
class RecordRetryScheduled(Event):
    record: Record | None = None
    attempt: int = 1
    delay: float = 0.0


@dataclass(frozen=True, slots=True)
class RecordFollowed(Event):
    """``retry="topics"`` with key order: ``record`` went to retry topic ``topic`` behind its key's record in
    retry, without being handled or spending an attempt."""

    record: Record | None = None
    topic: str = ""


@dataclass(frozen=True, slots=True)
class RecordsInRetry(Event):
    """``retry="topics"``: how many records of the container's partitions are in retry (written to a retry topic
    and not consumed from it, as committed), or when the one due first is due, changed: after a commit, an
    assignment, a revocation. ``oldest_due``: that due time, epoch seconds; None when none is in retry."""

    records: int = 0
    oldest_due: float | None = None


@dataclass(frozen=True, slots=True)
class RetryHandled(Event):
    """``retry="topics"``: ``record`` (the input record; ``attempt`` the one that worked), read back from a retry
    topic, was handled and its transaction committed."""

    record: Record | None = None


@dataclass(frozen=True, slots=True)
class RetryPartitionStalled(Event):
    """``retry="topics"``: retry partition ``topic[partition]`` of the container holds ``records`` record(s) in retry
    whose first one has been due for ``due_for`` seconds and was not consumed since the last check (a check
    interval ago): its records wait past their back-off (a transaction left open on the retry topic holds read_committed
    readers, or the partition is not fetched). Published once per stall; :class:`RetryPartitionFlowing` ends it."""

    topic: str = ""
    partition: int = 0
    records: int = 0
    due_for: float = 0.0


@dataclass(frozen=True, slots=True)
class RetryPartitionFlowing(Event):
    """A retry partition reported stalled (:class:`RetryPartitionStalled`) had its first due record consumed (or
    was revoked), ``stalled_for`` seconds after it was reported."""

    topic: str = ""
    partition: int = 0
    stalled_for: float = 0.0


@dataclass(frozen=True, slots=True)
class RecordRecovered(Event):
    record: Record | None = None
    exception: BaseException | None = None
    recoverer: str = ""


@dataclass(frozen=True, slots=True)
class RecoveryFailed(Event):
    record: Record | None = None
    exception: BaseException | None = None
    recovery_error: BaseException | None = None
    failures: int = 1


@dataclass(frozen=True, slots=True)
class ProducerRecreated(Event):
    """A producer was replaced after an application-recoverable error (e.g. fencing)."""

    transactional_id: str = ""
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class KafkaErrorHandled(Event):
    """A Kafka error was classified and handled (retried, aborted, recreated)."""

    operation: str = ""
    error_class: str = ""
    error: BaseException | None = None
    action: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class OutageStarted(Event):
    """A dependency is down (``exception``, while handling ``record``): the whole listener pauses.

    ``listener`` is the listener's name (not one worker's): every container
    of it is paused. ``retry_in`` is the wait before ``record`` is tried again.
    """

    record: Record | None = None
    exception: BaseException | None = None
    retry_in: float = 0.0


@dataclass(frozen=True, slots=True)
class OutageEnded(Event):
    """The record an outage stopped at was handled: the listener resumes after ``seconds`` (``retries`` failed)."""

    seconds: float = 0.0
    retries: int = 0


@dataclass(frozen=True, slots=True)
class ClusterUnreachable(Event):
    """No broker of the cluster (``bootstrap_servers``) answers the container (librdkafka: every broker down)."""

    bootstrap_servers: str = ""


@dataclass(frozen=True, slots=True)
class ClusterReachable(Event):
    """The cluster answers the container again, after ``seconds`` without an answer."""

    bootstrap_servers: str = ""
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class CrashSearchNarrowed(Event):
    """Looking for the record that killed the process: offsets ``start``..``end - 1`` of ``topic[partition]``
    are handled in one transaction, whose claim names only them (a crash inside narrows the search to them)."""

    topic: str = ""
    partition: int = 0
    start: int = 0
    end: int = 0


@dataclass(frozen=True, slots=True)
class LastStableOffsetStuck(Event):
    """A partition of a topic the App writes has a last stable offset that does not move: a transaction left open
    at ``last_stable_offset`` holds read_committed readers there, below ``high_watermark``, for ``seconds`` so far
    (longer than the App's transaction timeout plus a margin). ``listener`` names the listener(s) that write the
    topic (joined by ","), ``worker`` is 0; published from the App's check thread (kafkatx.health.stable_offsets)."""

    topic: str = ""
    partition: int = 0
    last_stable_offset: int = 0
    high_watermark: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class LastStableOffsetReleased(Event):
    """The last stable offset of a partition that was stuck (:class:`LastStableOffsetStuck`) moved again, to
    ``last_stable_offset``, after ``seconds`` (the open transaction ended)."""

    topic: str = ""
    partition: int = 0
    last_stable_offset: int = 0
    high_watermark: int = 0
    seconds: float = 0.0


E = TypeVar("E", bound=Event)


class EventBus:
    """Synchronous dispatch of events to subscribers, by event type (and its bases)."""

    def __init__(self) -> None:
        self._subs: dict[type[Event], list[Callable[[Any], None]]] = {}
        self._lock = threading.Lock()
        self._cache: dict[type[Event], tuple[Callable[[Any], None], ...]] = {}

    def subscribe(self, event_type: type[E], callback: Callable[[E], None]) -> None:
        if not (isinstance(event_type, type) and issubclass(event_type, Event)):
            raise TypeError(f"subscribe to an Event subclass, got {event_type!r}")
        if not callable(callback):
            raise TypeError(f"event callback must be callable, got {callback!r}")
        with self._lock:
            self._subs.setdefault(event_type, []).append(callback)
            self._cache = {}

    def wants(self, event_type: type[Event]) -> bool:
        return bool(self._targets(event_type))

    def _targets(self, event_type: type[Event]) -> tuple[Callable[[Any], None], ...]:
        targets = self._cache.get(event_type)
        if targets is None:
            with self._lock:
                targets = tuple(cb for t in event_type.__mro__ for cb in self._subs.get(t, ()))
                self._cache[event_type] = targets
        return targets

    def publish(self, event: Event) -> None:
        for callback in self._targets(type(event)):
            try:
                callback(event)
            except Exception:
                log.exception("event callback %r failed on %s", callback, type(event).__name__)
