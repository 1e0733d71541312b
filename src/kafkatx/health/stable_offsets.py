"""A last stable offset that does not move on a topic the App writes: a transaction left open holds readers back.

A read_committed consumer reads a partition up to its last stable offset (LSO): the first offset of the
earliest transaction still open there. One transaction left open (a producer that died mid-transaction on a
broker that never expires transactions, a zombie) stops every read_committed reader of the partition at it,
below the high watermark, while the App itself goes on committing behind it: downstream sees nothing more,
and nothing in the App fails.

So each App runs one background check (:class:`StableOffsetWatch`, a daemon thread with one AdminClient
made when it starts and dropped when it stops) over the partitions of the topics its listeners declare they
write (:func:`written_topics`). Every :data:`DEFAULT_INTERVAL_S` it reads each partition's LSO
(``list_offsets`` at read_committed) and high watermark (at read_uncommitted). A partition is *stuck*
(:class:`StuckRule`) when its LSO is below its high watermark and has not moved for longer than the App's
``transaction.timeout.ms`` plus :data:`STUCK_MARGIN_S`: a broker aborts a live transaction past its timeout
(within its abort-check interval, 10 s by default), so no transaction of a well-behaved producer of the App
stays open that long. What it reports: a gauge (``kafkatx_last_stable_offset_stuck_seconds``, through
:meth:`StableOffsetWatch.add_sink`), the events :class:`~kafkatx.events.LastStableOffsetStuck` and
:class:`~kafkatx.events.LastStableOffsetReleased`, one WARNING per stuck episode naming the way out, and
an entry in ``/readyz``'s body, which it never turns red (the App can still process).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

from kafkatx.client.brokers import is_embedded_broker
from kafkatx.client.offsets import TP
from kafkatx.dlq.publisher import DeadLetterPublishingRecoverer
from kafkatx.events import Event, LastStableOffsetReleased, LastStableOffsetStuck

if TYPE_CHECKING:
    from kafkatx.listener.spec import ListenerSpec

__all__ = [
    "DEFAULT_INTERVAL_S",
    "READ_TIMEOUT_S",
    "STOP_WAIT_S",
    "STUCK_MARGIN_S",
    "ClientSide",
    "KafkaWatermarks",
    "StableOffsetWatch",
    "StuckPartition",
    "StuckRule",
    "StuckSink",
    "Transition",
    "WatermarkSource",
    "stuck_message",
    "written_topics",
]

log = logging.getLogger("kafkatx.health")

#: Seconds between two checks: a few requests per check, and a stuck partition is reported within the threshold
#: plus two intervals (the LSO is first seen still up to one interval after it stopped, and checked once more).
DEFAULT_INTERVAL_S = 15.0
#: Seconds past the App's transaction timeout before a still LSO is stuck: the broker's periodic abort of timed-out
#: transactions (``transaction.abort.timed.out.transaction.cleanup.interval.ms``, 10 s by default) and its markers.
STUCK_MARGIN_S = 30.0
#: How long one check waits for the cluster's metadata, and for each list of offsets.
READ_TIMEOUT_S = 5.0
#: How long stopping waits for the thread (it ends at once between checks; the App's stop is not held longer).
STOP_WAIT_S = 1.0

#: ``(listener, topic, partition, seconds)``: the gauge's value after each check (0 unless stuck); None when the
#: series goes (the App stopped).
StuckSink = Callable[[str, str, int, "float | None"], None]


def written_topics(listeners: Iterable[ListenerSpec]) -> dict[str, tuple[str, ...]]:
    """The topics ``listeners`` declare they write, each with the names of the listeners that write it.

    A listener's ``output``, its ``sends_to`` topics and its dead-letter topic (``dlq="name"``, or
    ``<input topic>-dlt`` per input topic for ``dlq=True``). A topic reached by ``send()`` without being
    declared in ``sends_to``, and a dead-letter topic chosen per record by a function, are not known here.
    """
    writers: dict[str, list[str]] = {}
    for spec in listeners:
        topics = [spec.output, *spec.sends_to, spec.dlq_topic, *_per_input_dead_letter_topics(spec)]
        for topic in dict.fromkeys(t for t in topics if t):
            writers.setdefault(topic, []).append(spec.name)
    return {topic: tuple(names) for topic, names in writers.items()}


def _per_input_dead_letter_topics(spec: ListenerSpec) -> list[str]:
    recoverer = spec.policy.recoverer
    if isinstance(recoverer, DeadLetterPublishingRecoverer) and recoverer.topic is None:
        return [topic + recoverer.suffix for topic in spec.topics]
    return []


class Transition(NamedTuple):
    """A partition that became stuck, or was released, at one check."""

    kind: Literal["stuck", "released"]
    topic: str
    partition: int
    last_stable_offset: int
    high_watermark: int
    #: How long its LSO had been where it was (stuck: so far; released: until this check).
    seconds: float


@dataclass
class _Held:
    """A partition whose LSO is below its high watermark: where, and since when it has been seen there."""

    lso: int
    hw: int
    since: float
    stuck: bool = False


class StuckRule:
    """The rule, per partition: stuck once its LSO has stayed below the high watermark for over ``threshold`` s.

    Fed one observation per partition and check (:meth:`observe`); pure (the time is given), so it is
    tested without a broker. "Since" is the first check that saw the LSO where it is: a lower bound of
    how long it has been there (it stopped at most one interval before).
    """

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self._held: dict[TP, _Held] = {}

    def observe(self, tp: TP, lso: int, hw: int, now: float) -> Transition | None:
        """Take one reading of ``tp``; the transition it makes (stuck, or released), or None."""
        held = self._held.get(tp)
        if held is not None and (lso >= hw or lso != held.lso):  # caught up, or moved: whatever held it ended
            del self._held[tp]
            if held.stuck:
                self._note(tp, lso, hw, now)
                return Transition("released", *tp, lso, hw, now - held.since)
            held = None
        if held is None:
            self._note(tp, lso, hw, now)
            return None
        held.hw = hw
        if not held.stuck and now - held.since > self.threshold:
            held.stuck = True
            return Transition("stuck", *tp, lso, hw, now - held.since)
        return None

    def _note(self, tp: TP, lso: int, hw: int, now: float) -> None:
        if lso < hw:
            self._held[tp] = _Held(lso, hw, now)

    def stuck_for(self, tp: TP, now: float) -> float:
        """Seconds ``tp``'s LSO has not moved, if it is stuck; 0.0 if it is not."""
        held = self._held.get(tp)
        return max(0.0, now - held.since) if held is not None and held.stuck else 0.0

    def stuck(self) -> list[tuple[TP, int, int, float]]:
        """``(tp, lso, high watermark, since)`` of every stuck partition."""
        return [(tp, h.lso, h.hw, h.since) for tp, h in sorted(self._held.items()) if h.stuck]


@dataclass(frozen=True)
class StuckPartition:
    """A stuck partition as ``/readyz`` shows it."""

    topic: str
    partition: int
    last_stable_offset: int
    high_watermark: int
    #: Seconds its LSO has not moved (at least).
    seconds: float
    #: The listeners that write its topic.
    listeners: tuple[str, ...]

    def as_json(self) -> dict[str, Any]:
        """The entry of ``/readyz``'s ``last_stable_offset_stuck`` list."""
        return {
            "topic": self.topic,
            "partition": self.partition,
            "last_stable_offset": self.last_stable_offset,
            "high_watermark": self.high_watermark,
            "stuck_for": round(self.seconds, 1),
            "listeners": list(self.listeners),
        }


class WatermarkSource(Protocol):
    """Where a check reads its offsets: :class:`KafkaWatermarks`, or a test's fake."""

    def watermarks(self, topics: Sequence[str]) -> dict[TP, tuple[int, int]]:
        """``(last stable offset, high watermark)`` of each partition of ``topics`` that could be read."""
        ...

    def close(self) -> None:
        """Free the source's clients."""
        ...


class KafkaWatermarks:
    """Both ends of every partition of some topics, read with one AdminClient made once.

    ``list_offsets`` of the latest offset at read_committed is the LSO, at read_uncommitted the high
    watermark (``get_watermark_offsets`` on a read_committed consumer gives the same LSO, one partition per
    request); all partitions go in one request per isolation level, each wait bounded by ``timeout``.
    """

    def __init__(self, config: Mapping[str, Any], timeout: float = READ_TIMEOUT_S) -> None:
        from confluent_kafka.admin import AdminClient

        self._timeout = timeout
        self._admin: Any = AdminClient({**config, "log_level": 3})
        #: The cluster's id, from the last check's metadata (None before one answered).
        self.cluster_id: str | None = None

    def watermarks(self, topics: Sequence[str]) -> dict[TP, tuple[int, int]]:
        """``(last stable offset, high watermark)`` of each partition of ``topics`` that answered in time."""
        from confluent_kafka import IsolationLevel, TopicPartition
        from confluent_kafka.admin import OffsetSpec  # type: ignore[attr-defined]

        admin = self._admin
        if admin is None:
            return {}
        cluster = admin.list_topics(timeout=self._timeout)
        self.cluster_id = cluster.cluster_id
        metadata = cluster.topics
        tps = [
            TopicPartition(t, p)
            for t in topics
            if t in metadata and metadata[t].error is None
            for p in sorted(metadata[t].partitions)
        ]
        if not tps:
            return {}
        latest = OffsetSpec.latest()  # type: ignore[no-untyped-call]
        ends = {
            level: admin.list_offsets({tp: latest for tp in tps}, isolation_level=level, request_timeout=self._timeout)
            for level in (IsolationLevel.READ_COMMITTED, IsolationLevel.READ_UNCOMMITTED)
        }
        pending = [f for futures in ends.values() for f in futures.values()]
        concurrent.futures.wait(pending, timeout=self._timeout + 1.0)
        committed, uncommitted = ends[IsolationLevel.READ_COMMITTED], ends[IsolationLevel.READ_UNCOMMITTED]
        marks: dict[TP, tuple[int, int]] = {}
        for tp in tps:
            lso, hw = _offset(committed.get(tp)), _offset(uncommitted.get(tp))
            if lso is not None and hw is not None:
                marks[(tp.topic, tp.partition)] = (lso, hw)
        return marks

    def close(self) -> None:
        """Drop the AdminClient (confluent-kafka destroys its librdkafka handle, and threads, with the object)."""
        self._admin = None


def _offset(future: Any) -> int | None:
    """The offset a finished ``list_offsets`` future holds; None if it failed or is not done."""
    if future is None or not future.done() or future.exception() is not None:
        return None
    offset = int(future.result().offset)
    return offset if offset >= 0 else None


def stuck_message(
    t: Transition, listeners: Sequence[str], threshold: float, bootstrap_servers: str, *, embedded: bool = False
) -> str:
    """The WARNING of a partition that became stuck: where, for how long, and the ways out (``embedded``: the
    cluster is the embedded broker, where a restart of it can leave a transaction that neither way ends)."""
    where = f"--topic {t.topic} --partition {t.partition}"
    servers = bootstrap_servers or "HOST:PORT"
    return (
        f"{t.topic}[{t.partition}] (written by listener(s) {', '.join(listeners)}): its last stable offset has "
        f"stayed at {t.last_stable_offset} for {t.seconds:.0f}s, below its high watermark {t.high_watermark}, "
        f"longer than the App's transaction timeout plus a margin ({threshold:g}s): a transaction left open at "
        f"offset {t.last_stable_offset} (a producer that died mid-transaction, a zombie) holds every "
        "read_committed reader of the partition there, so downstream sees nothing after it. If it is one of "
        "this App's own transactional ids (a process of this App that died; with fencing='group' under its "
        "--instance-id), stop the App and run `kafkatx transactions abort module:app`; otherwise find and abort "
        f"it with Kafka's tool: `kafka-transactions.sh --bootstrap-server {servers} find-hanging {where}` "
        f"then `kafka-transactions.sh --bootstrap-server {servers} abort {where} --start-offset "
        f"{t.last_stable_offset}` (docs/OPERATIONS.md, 'A hanging transaction')"
        + (
            ". On the embedded broker, if it restarted since that transaction began, neither way ends it (it "
            "forgets open transactions across a restart and gives a re-initialised transactional id a new "
            "producer id): restart the embedded broker once more, which aborts every transaction left open as it "
            "starts (docs/BROKERS.md, 'A transaction open across a broker restart can hang')"
            if embedded
            else ""
        )
    )


SourceFactory = Callable[[Mapping[str, Any]], WatermarkSource]


def _tell(sinks: Sequence[StuckSink], listeners: str, topic: str, partition: int, seconds: float | None) -> None:
    """Give each sink the value; one that raises is logged and skipped (the check and the other sinks go on)."""
    for sink in sinks:
        try:
            sink(listeners, topic, partition, seconds)
        except Exception:
            log.exception("last stable offset sink %r failed", sink)


class ClientSide(Protocol):
    """What the check needs of an App's client configuration (:class:`kafkatx.app.config.ClientConfig`)."""

    @property
    def name(self) -> str: ...
    @property
    def transaction_timeout_ms(self) -> int: ...
    def base_config(self) -> dict[str, Any]: ...
    def resolved_bootstrap_servers(self) -> str: ...


class StableOffsetWatch:
    """An App's check of the last stable offsets of the topics it writes (see the module's docstring).

    The App makes one (``app.stable_offsets``), starts it after its containers and stops it with them.
    ``interval`` (seconds between checks) and ``threshold`` (seconds; None: the App's transaction timeout
    plus :data:`STUCK_MARGIN_S`, fixed at start) may be changed before the App starts (tests shorten them);
    ``source`` makes the source of offsets from the App's client configuration (a test's fake).
    """

    def __init__(
        self,
        publish: Callable[[Event], None],
        *,
        interval: float = DEFAULT_INTERVAL_S,
        threshold: float | None = None,
        source: SourceFactory = KafkaWatermarks,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.threshold = threshold
        self._publish = publish
        self._source = source
        self._clock = clock
        self._sinks: list[StuckSink] = []
        self._lock = threading.Lock()
        self._topics: dict[str, tuple[str, ...]] = {}
        self._rule = StuckRule(threshold if threshold is not None else STUCK_MARGIN_S)
        self._seen: set[TP] = set()
        self._bootstrap = ""
        self._cluster_id: str | None = None  # from the source, when it knows it (KafkaWatermarks does)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Checks completed since the last start.
        self.rounds = 0

    def add_sink(self, sink: StuckSink) -> None:
        """Call ``sink(listeners, topic, partition, seconds)`` for each partition after each check (the gauge)."""
        with self._lock:
            self._sinks.append(sink)

    @property
    def running(self) -> bool:
        """Whether its thread runs (it holds its client only then)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self, client: ClientSide, listeners: Iterable[ListenerSpec]) -> None:
        """Check the topics ``listeners`` write (:func:`written_topics`) every ``interval`` from a daemon thread,
        with a client of ``client``'s configuration. No topic to check: nothing started."""
        self.reset(written_topics(listeners), client.transaction_timeout_ms, client.resolved_bootstrap_servers())
        if not self._topics:
            return
        self._stop = threading.Event()
        config = {**client.base_config(), "client.id": f"{client.name}-stable-offsets"}
        self._thread = threading.Thread(
            target=self._run, args=(config, self._stop), name="kafkatx-stable-offsets", daemon=True
        )
        self._thread.start()

    def reset(self, topics: Mapping[str, tuple[str, ...]], transaction_timeout_ms: int, bootstrap: str = "") -> None:
        """Forget what earlier checks saw, and watch ``topics`` from now on (what :meth:`start` does first)."""
        threshold = self.threshold if self.threshold is not None else transaction_timeout_ms / 1000 + STUCK_MARGIN_S
        with self._lock:
            self._topics = dict(topics)
            self._rule = StuckRule(threshold)
            self._seen = set()
            self._bootstrap = bootstrap
            self.rounds = 0

    def stop(self, *, wait: bool = True) -> None:
        """End the thread, which frees its client as it ends; ``wait``: for up to :data:`STOP_WAIT_S` (between
        checks it ends at once; a check under way, against a cluster that does not answer, ends within its
        timeouts, and then frees the client by itself)."""
        self._stop.set()
        thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join(STOP_WAIT_S)

    def _run(self, config: dict[str, Any], stop: threading.Event) -> None:
        try:
            source = self._source(config)
        except Exception:  # noqa: BLE001 - a diagnosis must never disturb the App
            log.warning("the check of the topics' last stable offsets could not start", exc_info=True)
            return
        try:
            while not stop.is_set():
                try:
                    self.check(source)
                except Exception:  # noqa: BLE001 - the cluster may not answer now; the next check tries again
                    log.debug("last stable offset check failed", exc_info=True)
                if stop.wait(self.interval):
                    break
        finally:
            source.close()
            if self._thread is threading.current_thread():  # not a thread a restart has replaced meanwhile
                self._drop_series()

    def check(self, source: WatermarkSource, now: float | None = None) -> list[Transition]:
        """One check: read every partition, apply the rule, tell the sinks, report what changed."""
        with self._lock:
            topics = dict(self._topics)
        marks = source.watermarks(sorted(topics))
        self._cluster_id = getattr(source, "cluster_id", None) or self._cluster_id
        now = self._clock() if now is None else now
        transitions: list[Transition] = []
        values: list[tuple[str, str, int, float]] = []
        with self._lock:
            rule = self._rule
            for tp, (lso, hw) in sorted(marks.items()):
                self._seen.add(tp)
                transition = rule.observe(tp, lso, hw, now)
                if transition is not None:
                    transitions.append(transition)
                values.append((",".join(topics.get(tp[0], ())), *tp, rule.stuck_for(tp, now)))
            self.rounds += 1
            sinks = list(self._sinks)
        for t in transitions:
            self._report(t, topics.get(t.topic, ()), rule.threshold)
        for listeners, topic, partition, seconds in values:
            _tell(sinks, listeners, topic, partition, seconds)
        return transitions

    def _report(self, t: Transition, listeners: tuple[str, ...], threshold: float) -> None:
        label = ",".join(listeners)
        if t.kind == "stuck":
            embedded = is_embedded_broker(self._bootstrap, self._cluster_id)
            log.warning("%s", stuck_message(t, listeners, threshold, self._bootstrap, embedded=embedded))
            event: Event = LastStableOffsetStuck(
                label, 0, t.topic, t.partition, t.last_stable_offset, t.high_watermark, t.seconds
            )
        else:
            log.info(
                "%s[%d]: its last stable offset moved (now %d, high watermark %d) after %.0fs: released",
                t.topic,
                t.partition,
                t.last_stable_offset,
                t.high_watermark,
                t.seconds,
            )
            event = LastStableOffsetReleased(
                label, 0, t.topic, t.partition, t.last_stable_offset, t.high_watermark, t.seconds
            )
        self._publish(event)

    def _drop_series(self) -> None:
        """The thread ends: nothing is stuck any more as far as it knows, and every series it fed goes."""
        with self._lock:
            seen, self._seen = sorted(self._seen), set()
            self._rule = StuckRule(self._rule.threshold)
            sinks = list(self._sinks)
            topics = dict(self._topics)
        for topic, partition in seen:
            _tell(sinks, ",".join(topics.get(topic, ())), topic, partition, None)

    def stuck(self) -> list[StuckPartition]:
        """The partitions stuck now (for ``/readyz``'s body)."""
        now = self._clock()
        with self._lock:
            return [
                StuckPartition(tp[0], tp[1], lso, hw, max(0.0, now - since), self._topics.get(tp[0], ()))
                for tp, lso, hw, since in self._rule.stuck()
            ]
