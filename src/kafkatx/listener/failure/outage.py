"""Dependency outages: a failure that is not the record's pauses the whole listener instead of costing attempts.

When a handler fails with one of the listener's ``outages`` exceptions
(:class:`~kafkatx.DependencyUnavailable`, ``ConnectionError`` by default,
looked for along the cause chain) or its ``database=`` cannot be reached, the
record did nothing wrong: counting attempts would dead-letter a whole stream
during a ten-minute outage. Instead:

- the transaction is aborted and the unit rewound, the record's ``attempt``
  untouched, the recoverer not called;
- every partition of every container of the listener is paused
  (:class:`ListenerOutage` is shared by them; each container's
  :class:`OutageHold` pauses its own consumer's partitions);
- after a back-off (the listener's first ``backoff`` delay, 0.5 s if it has
  none, doubling after each failed retry up to :data:`MAX_RETRY_DELAY`), the
  container that owns the waiting record resumes that record's partition
  alone and handles it again; the others stay paused;
- the first commit past that record ends the outage, and the whole listener
  resumes from where it stopped: nothing was committed past any record.

Operators hold a listener the same way (``app.pause(name)``), and a listener
with ``max_outage`` stops the App once an outage lasts longer than that.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from confluent_kafka import TopicPartition
from tenacity import RetryCallState, Retrying

from kafkatx.client.offsets import TP
from kafkatx.errors import DependencyUnavailable, OutageTooLongError
from kafkatx.events import Event, OutageEnded, OutageStarted
from kafkatx.listener.host import (
    ContainerFailureState,
    ContainerIdentity,
    ContainerLiveness,
    ContainerMembership,
    ContainerPositions,
)
from kafkatx.listener.transaction.positions import records_to_handle
from kafkatx.rollback.classifier import cause_chain

if TYPE_CHECKING:
    from confluent_kafka import Message

    from kafkatx.record import ConsumedMessage, Record
    from kafkatx.rollback.policy import FailurePolicy

__all__ = [
    "DEFAULT_OUTAGES",
    "MAX_RETRY_DELAY",
    "REMINDER_INTERVAL",
    "ListenerOutage",
    "OutageHold",
    "is_outage",
    "first_delay",
]

log = logging.getLogger("kafkatx.outage")

#: What a listener's ``outages`` option is by default: the failures that mean "a dependency is down".
DEFAULT_OUTAGES: tuple[type[BaseException], ...] = (ConnectionError,)
#: The longest wait between two retries of the record an outage stopped at (seconds), unless the listener's first
#: ``backoff`` delay is longer. A retry is one handler call for one record, a light probe: every 2 s does not
#: hammer a dependency that is down, and the listener is back within about 2 s of it returning (it was 30 s, and
#: an outage of a few minutes then ended up to half a minute late).
MAX_RETRY_DELAY = 2.0
#: The first wait when the listener has no ``backoff`` (seconds).
DEFAULT_FIRST_DELAY = 0.5
#: How often a lasting outage is logged again (seconds).
REMINDER_INTERVAL = 60.0
#: How long a container polls while its listener is held (seconds): a stop or the end of a wait is seen this fast.
_HELD_POLL_S = 0.2


def is_outage(exc: BaseException, outages: Iterable[type[BaseException]]) -> bool:
    """True if ``exc`` or anything on its cause chain says a dependency is down (not the record's failure)."""
    return _caused_by(exc, (DependencyUnavailable, *outages))


def _caused_by(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    """True if ``exc`` or anything on its cause chain is one of ``kinds``."""
    for link in cause_chain(exc):
        if isinstance(link, kinds):
            return True
    return False


def first_delay(policy: FailurePolicy) -> float:
    """The listener's first back-off delay (what its ``backoff`` gives a first retry), or 0.5 s without one."""
    wait = policy.wait
    if wait is None:
        return DEFAULT_FIRST_DELAY
    state = RetryCallState(retry_object=Retrying(), fn=None, args=(), kwargs={})
    state.attempt_number = 1
    delay = max(0.0, float(wait(state)))
    return delay if delay > 0 else DEFAULT_FIRST_DELAY


class ListenerOutage:
    """The outage state of one listener, shared by its containers (thread-safe).

    It implements :class:`~kafkatx.listener.host.ListenerGate`. It says which
    partitions a container may handle (:meth:`admits`): all of them normally;
    none while the listener is paused (an outage between two retries, or an
    operator's :meth:`pause`); the waiting record's partition alone, in the
    container that owns it, when its retry is due.
    """

    def __init__(
        self,
        listener: str,
        publish: Callable[[Event], None],
        *,
        outages: Iterable[type[BaseException]] = DEFAULT_OUTAGES,
        first_delay: float = DEFAULT_FIRST_DELAY,
        max_delay: float = MAX_RETRY_DELAY,
        max_outage: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.listener = listener
        self.outages = tuple(outages)
        #: What :meth:`matches` looks for on a failure's cause chain (asked of every failure).
        self._kinds: tuple[type[BaseException], ...] = (DependencyUnavailable, *self.outages)
        self.first_delay = first_delay
        self.max_delay = max(max_delay, first_delay)
        self.max_outage = max_outage
        self._publish = publish
        self._clock = clock
        self._lock = threading.Lock()
        #: True during an outage (read without the lock on the commit path: a stale answer costs a lock, no more).
        self.active = False
        self._since = 0.0
        self._retries = 0  # failed retries of the waiting record in this outage
        self._until = 0.0  # nothing is handled before this (time.monotonic())
        self._waiting: tuple[int, TP, int] | None = None  # (worker, partition, offset) of the record retried next
        self._cause: BaseException | None = None
        self._reminded = 0.0
        #: True while an operator holds the listener (:meth:`pause`); read without the lock by the loop's gate.
        self.paused = False
        self._operator_since = 0.0

    # -- what the containers ask --------------------------------------------------------
    def matches(self, exc: BaseException) -> bool:
        """True if ``exc`` means a dependency is down (see :func:`is_outage`)."""
        return _caused_by(exc, self._kinds)

    def report(self, worker: int, exc: BaseException, record: Record | None) -> float:
        """A dependency is down (``exc``) while ``record`` was handled: pause the listener. Returns the wait.

        The first report starts the outage; a report once the wait is over
        (the retry failed) doubles the wait, up to ``max_delay``; reports
        from containers that were handling records when it started do not.
        """
        now = self._clock()
        with self._lock:
            started = not self.active
            if started:
                self.active, self._since, self._retries, self._reminded = True, now, 0, now
                delay = self.first_delay
            elif now >= self._until:
                self._retries += 1
                delay = min(self.max_delay, self.first_delay * 2 ** min(self._retries, 30))
            else:
                delay = self._until - now
            if started or now >= self._until:
                self._until = now + delay
                if record is not None:
                    self._waiting = (worker, (record.topic, record.partition), record.offset)
            self._cause = exc
            retries = self._retries
        if started:
            log.warning(
                "listener %s: a dependency is unavailable (%s: %s)%s; pausing the whole listener and retrying "
                "in %.3gs (not counted against the record)",
                self.listener,
                type(exc).__name__,
                exc,
                f" while handling {record.coordinates}" if record is not None else "",
                delay,
            )
            self._publish(OutageStarted(self.listener, worker, record, exc, delay))
        else:
            log.debug(
                "listener %s: still unavailable (%d retries): %s; next retry in %.3gs",
                self.listener,
                retries,
                exc,
                delay,
            )
        return delay

    def committed(self, offsets: Mapping[TP, int]) -> None:
        """A transaction with records committed ``offsets``: the outage ends once it got past the waiting record.

        A commit before the wait was over is one that was under way when the
        outage started; it says nothing about the dependency.
        """
        if not self.active:
            return
        now = self._clock()
        with self._lock:
            if not self.active or now < self._until:
                return
            waiting = self._waiting
            if waiting is not None and offsets.get(waiting[1], -1) <= waiting[2]:
                return
            worker = waiting[0] if waiting is not None else 0
            seconds, retries = now - self._since, self._retries
            self.active, self._waiting, self._cause = False, None, None
        log.warning(
            "listener %s: the dependency is available again after %.1fs (%d failed retries); resuming",
            self.listener,
            seconds,
            retries,
        )
        self._publish(OutageEnded(self.listener, worker, seconds, retries))

    def admits(self, worker: int, assigned: Iterable[TP]) -> frozenset[TP] | None:
        """The partitions container ``worker`` may handle now: None for all, else only these (maybe none).

        Raises :class:`~kafkatx.OutageTooLongError` once an outage lasts
        longer than ``max_outage``.
        """
        now = self._clock()
        with self._lock:
            if self.paused:
                return frozenset()
            if not self.active:
                return None
            self._check_bound(now)
            self._remind(now)
            if now < self._until:
                return frozenset()
            waiting = self._waiting
            if waiting is None:  # nothing to retry in particular (or its owner lost it): every container retries
                return None
            if waiting[0] != worker:
                return frozenset()
            if waiting[1] not in set(assigned):  # the record's partition moved: let every container retry
                self._waiting = None
                return None
            return frozenset([waiting[1]])

    def _check_bound(self, now: float) -> None:
        bound = self.max_outage
        if bound is None or now - self._since <= bound:
            return
        cause = self._cause
        raise OutageTooLongError(
            f"listener {self.listener!r}: a dependency has been unavailable for {now - self._since:.0f}s, longer than "
            f"max_outage={bound:g}s (last error: {type(cause).__name__}: {cause}). Stopping the App; nothing was "
            "committed past the record that was waiting for it, which is delivered again on restart"
        )

    def _remind(self, now: float) -> None:
        if now - self._reminded < REMINDER_INTERVAL:
            return
        self._reminded = now
        cause = self._cause
        log.warning(
            "listener %s: still paused, a dependency has been unavailable for %.0fs (%d failed retries; last error: "
            "%s: %s); next retry in %.3gs",
            self.listener,
            now - self._since,
            self._retries,
            type(cause).__name__,
            cause,
            max(0.0, self._until - now),
        )

    # -- operators --------------------------------------------------------------------------
    def pause(self) -> None:
        """Hold every partition of the listener until :meth:`resume` (an operator's pause)."""
        with self._lock:
            was, self.paused = self.paused, True
            if not was:
                self._operator_since = self._clock()
        if not was:
            log.warning("listener %s paused by the operator", self.listener)

    def resume(self) -> None:
        """End an operator's :meth:`pause` (an outage, if one is under way, still holds the listener)."""
        with self._lock:
            was, self.paused = self.paused, False
        if was:
            log.warning("listener %s resumed by the operator", self.listener)

    def held_for(self) -> float | None:
        """Seconds the listener has been held (by an outage or an operator's pause), or None if it is not."""
        now = self._clock()
        with self._lock:
            since = [start for held, start in ((self.active, self._since), (self.paused, self._operator_since)) if held]
        return now - min(since) if since else None

    def reset(self) -> None:
        """Forget an outage of a previous run (the App starts again); an operator's pause stays."""
        with self._lock:
            self.active, self._waiting, self._cause, self._retries = False, None, None, 0

    @classmethod
    def for_listener(cls, spec: Any, publish: Callable[[Event], None]) -> ListenerOutage:
        """The outage state of the listener ``spec`` declares (its ``outages``, ``backoff`` and ``max_outage``)."""
        return cls(
            spec.name,
            publish,
            outages=spec.outages,
            first_delay=first_delay(spec.policy),
            max_outage=spec.max_outage,
        )


class HeldHost(
    ContainerIdentity, ContainerPositions, ContainerMembership, ContainerFailureState, ContainerLiveness, Protocol
):
    """What an outage hold uses of its container: its consumer, partitions and outage gate, and it notes its polls."""


class OutageHold:
    """One container's side of :class:`ListenerOutage`: pauses its consumer's partitions while the listener waits.

    The consumer keeps polling meanwhile (the group does not see a member
    that stopped), and records it had fetched before the pause are sought
    back, to come again once the listener resumes.
    """

    def __init__(self, host: HeldHost, consumer_error: Callable[[Message], None]) -> None:
        self._host = host
        self._paused: set[TP] = set()
        #: The main loop's reaction to a consumer error from a poll (raises what ends the container, logs the rest):
        #: an error librdkafka reports while the listener is held is reported once, and must not be lost.
        self._consumer_error = consumer_error

    def poll(self, handle: Callable[[list[ConsumedMessage]], None]) -> bool:
        """Poll on the container's behalf while the listener is held (``handle``: what it admits). True if it did."""
        host = self._host
        consumer = host.consumer
        admitted = host.outage.admits(host.worker, host.assigned)
        if consumer is None:
            return False
        if admitted is None:
            if self._paused:
                self._set_paused(set())
            return False
        self._set_paused(host.assigned - admitted)
        msgs = consumer.consume(host.spec.max_batch_records, _HELD_POLL_S)
        host.mark_polled()
        keep = records_to_handle(host, msgs, self._consumer_error, host.paused_until, admitted)  # as the main loop
        if keep:
            handle(keep)
        return True

    def _set_paused(self, wanted: set[TP]) -> None:
        host, consumer = self._host, self._host.consumer
        assert consumer is not None
        pause = wanted  # every time: a partition assigned again since comes back unpaused
        resume = {tp for tp in self._paused - wanted if tp in host.assigned and tp not in host.paused_until}
        self._paused = wanted
        try:
            if pause:
                consumer.pause([TopicPartition(*tp) for tp in sorted(pause)])
            if resume:
                consumer.resume([TopicPartition(*tp) for tp in sorted(resume)])
        except Exception:  # revoked meanwhile: a new assignment starts unpaused, and is paused again next poll
            log.debug("listener %s: pausing %s / resuming %s failed", host.name, pause, resume, exc_info=True)
