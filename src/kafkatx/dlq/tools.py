"""Inspect and replay dead-letter topics (the library behind ``kafkatx dlq``).

Both read the dead-letter topic (DLT) ``read_committed`` and never join a
consumer group, so they can run next to the applications that write it.
:func:`replay_dlq` is exactly-once: each batch of re-published records and
the replay group's offsets on the DLT commit in one Kafka transaction, under
a transactional.id derived from the group, so a crashed replay is fenced and
its open transaction aborted by the next run, which resumes after the last
committed batch. docs/DLQ.md describes the commands and the policies.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from kafkatx.dlq.headers import ORIGINAL_TOPIC, DeadLetterInfo, parse_dead_letter_headers
from kafkatx.classification import FENCING_CODES
from kafkatx.errors import KafkaClientError
from kafkatx.outputs import PendingOutput
from kafkatx.errors import UnknownTopicError
from kafkatx.producer import TransactionalProducer
from kafkatx.record import ConsumedMessage, Headers

__all__ = [
    "DeadLetterEntry",
    "DlqFilter",
    "DlqToolError",
    "ENV_BOOTSTRAP",
    "FILTER_FIELDS",
    "REPLAYED_FROM",
    "ReplayResult",
    "default_replay_group",
    "inspect_dlq",
    "parse_filter",
    "replay_dlq",
    "replay_transactional_id",
    "replayed_headers",
    "resolve_bootstrap_servers",
]

log = logging.getLogger("kafkatx.dlq.tools")

ENV_BOOTSTRAP = "KAFKATX_BOOTSTRAP_SERVERS"

#: Header added to every replayed record: ``<dlt topic>/<partition>@<offset>``
#: of the dead-letter record it came from (an earlier one is replaced).
REPLAYED_FROM = "kafkatx_replayed-from"

#: Headers a replay strips: the dead-letter provenance (Spring's and kafkatx's)
#: and Spring's non-blocking-retry bookkeeping, so the replayed record starts
#: afresh instead of looking like an exhausted retry.
_STRIPPED_PREFIXES = ("kafka_dlt-", "kafkatx_dlt-", "retry_topic-")

_OFFSET_BEGINNING = -2
# Settings the tools own; a user override would break read_committed or exactly-once.
_OWNED = ("group.id", "enable.auto.commit", "isolation.level", "transactional.id", "enable.idempotence")


class _ClientLog:
    """librdkafka's own log lines, demoted to DEBUG: a tool's errors carry their cause, and a
    refused connection would otherwise print a line every few milliseconds (``-vv`` shows them)."""

    _log = logging.getLogger("kafkatx.dlq.librdkafka")

    def log(self, _level: int, msg: str, *args: Any) -> None:
        self._log.debug(msg, *args)


_QUIET = {"logger": _ClientLog()}


class DlqToolError(RuntimeError):
    """A dead-letter tool cannot go on: unknown topic, no bootstrap servers, a record with nowhere to go."""


# ---------------------------------------------------------------------------
# Entries
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeadLetterEntry:
    """One record of a dead-letter topic: its own coordinates plus what its headers say."""

    topic: str
    partition: int
    offset: int
    timestamp: int | None  # the DLT record's timestamp, ms since the epoch
    key: bytes | None
    value: bytes | None
    headers: Headers
    info: DeadLetterInfo
    #: Already replayed by the default replay group of the topic (``kafkatx dlq replay``): its offset is behind
    #: that group's committed offset.
    replayed: bool = False

    @property
    def coordinates(self) -> str:
        """``topic/partition@offset`` of the dead-letter record."""
        return f"{self.topic}/{self.partition}@{self.offset}"

    @property
    def original_coordinates(self) -> str | None:
        """``topic/partition@offset`` of the record that failed, if the headers say."""
        i = self.info
        if i.original_topic is None:
            return None
        return f"{i.original_topic}/{_dash(i.original_partition)}@{_dash(i.original_offset)}"

    def to_dict(self, *, stacktrace: bool = False) -> dict[str, Any]:
        """A JSON-ready view; times are ms since the epoch, key and value UTF-8 text."""
        i = self.info
        out: dict[str, Any] = {
            "dlt_topic": self.topic,
            "dlt_partition": self.partition,
            "dlt_offset": self.offset,
            "dlt_timestamp": self.timestamp,
            "original_topic": i.original_topic,
            "original_partition": i.original_partition,
            "original_offset": i.original_offset,
            "original_timestamp": i.original_timestamp,
            "consumer_group": i.consumer_group,
            "exception": i.exception_fqcn,
            "exception_cause": i.exception_cause_fqcn,
            "exception_message": i.exception_message,
            "attempts": i.attempts,
            "replayed": self.replayed,
            "key": _text(self.key),
            "value": _text(self.value),
        }
        if stacktrace:
            out["exception_stacktrace"] = i.exception_stacktrace
        return out


def _dash(v: object) -> str:
    return "-" if v is None else str(v)


def _text(data: bytes | None) -> str | None:
    # backslashreplace keeps undecodable bytes visible (and distinguishable) instead of dropping them
    return None if data is None else data.decode("utf-8", "backslashreplace")


def _entry(msg: ConsumedMessage) -> DeadLetterEntry:
    headers: Headers = [(k, v) for k, v in (msg.headers() or []) if v is not None]
    ts_type, ts = msg.timestamp()
    return DeadLetterEntry(
        topic=msg.topic(),
        partition=msg.partition(),
        offset=msg.offset(),
        timestamp=ts if ts_type != 0 and ts >= 0 else None,
        key=msg.key(),
        value=msg.value(),
        headers=headers,
        info=parse_dead_letter_headers(headers),
    )


# ---------------------------------------------------------------------------
# Filters
# ---------------------------------------------------------------------------

_TEXT_FIELDS = ("exception", "message", "topic", "key", "group")
_NUMBER_FIELDS = ("partition", "offset", "attempts")
#: Filter fields: what they look at in a dead-letter record.
FILTER_FIELDS: Mapping[str, str] = {
    "exception": "exception class (fully qualified) or its root cause's; '=' matches a substring",
    "message": "exception message; '=' matches a substring",
    "topic": "original topic; '=' matches exactly",
    "key": "record key as UTF-8; '=' matches exactly",
    "group": "consumer group that dead-lettered it; '=' matches exactly",
    "partition": "original partition: N or a range A..B (either end may be left out)",
    "offset": "original offset: N or a range A..B",
    "attempts": "failed deliveries before dead-lettering: N or a range A..B",
}
_FILTER_SYNTAX = re.compile(r"^\s*([A-Za-z_]+)\s*(!=|~=|=)(.*)$", re.S)
_NUMBER = re.compile(r"^\s*(\d+)\s*$")
_RANGE = re.compile(r"^\s*(\d+)?\s*\.\.\s*(\d+)?\s*$")


def _parse_range(value: str, what: str) -> tuple[int | None, int | None]:
    """``N`` -> (N, N); ``A..B``, ``A..``, ``..B`` -> inclusive bounds, None for an open end."""
    single = _NUMBER.match(value)
    if single:
        return int(single.group(1)), int(single.group(1))
    r = _RANGE.match(value)
    if r is None or r.group(1) is r.group(2) is None:
        raise ValueError(f"{what} takes an integer N or a range A..B, got {value!r}")
    return (None if r.group(1) is None else int(r.group(1))), (None if r.group(2) is None else int(r.group(2)))


def _filter_help() -> str:
    return "FIELD=VALUE, FIELD!=VALUE or FIELD~=REGEX with FIELD one of " + ", ".join(FILTER_FIELDS)


@dataclass(frozen=True)
class DlqFilter:
    """One ``FIELD=VALUE`` / ``FIELD!=VALUE`` / ``FIELD~=REGEX`` condition (build it with :func:`parse_filter`).

    A record whose header for FIELD is missing never matches ``=`` or ``~=``
    and always matches ``!=``.
    """

    field: str
    op: str
    value: str
    _pattern: re.Pattern[str] | None = None
    _range: tuple[int | None, int | None] | None = None

    def __str__(self) -> str:
        return f"{self.field}{self.op}{self.value}"

    def __call__(self, entry: DeadLetterEntry) -> bool:
        hit = self._test(entry)
        return not hit if self.op == "!=" else hit

    def _test(self, entry: DeadLetterEntry) -> bool:
        i = entry.info
        if self.field in _NUMBER_FIELDS:
            number = {"partition": i.original_partition, "offset": i.original_offset, "attempts": i.attempts}[self.field]
            if number is None:
                return False
            assert self._range is not None
            low, high = self._range
            return (low is None or number >= low) and (high is None or number <= high)
        texts = {
            "exception": [i.exception_fqcn, i.exception_cause_fqcn],
            "message": [i.exception_message],
            "topic": [i.original_topic],
            "key": [None if entry.key is None else entry.key.decode("utf-8", "replace")],
            "group": [i.consumer_group],
        }[self.field]
        present = [t for t in texts if t is not None]
        if self._pattern is not None:
            return any(self._pattern.search(t) for t in present)
        if self.field in ("exception", "message"):
            return any(self.value in t for t in present)
        return any(self.value == t for t in present)


def parse_filter(text: str) -> DlqFilter:
    """Parse ``FIELD=VALUE``, ``FIELD!=VALUE`` or ``FIELD~=REGEX``; a ValueError names what is wrong."""
    m = _FILTER_SYNTAX.match(text)
    if m is None:
        raise ValueError(f"bad filter {text!r}: expected {_filter_help()}")
    name, op, value = m.group(1).lower(), m.group(2), m.group(3)
    if name not in FILTER_FIELDS:
        raise ValueError(f"bad filter {text!r}: unknown field {name!r}; fields are {', '.join(FILTER_FIELDS)}")
    if value == "":
        raise ValueError(f"bad filter {text!r}: the value is empty")
    if op == "~=":
        if name in _NUMBER_FIELDS:
            raise ValueError(f"bad filter {text!r}: {name} is a number; use {name}=N or {name}=A..B")
        try:
            return DlqFilter(name, op, value, _pattern=re.compile(value))
        except re.error as exc:
            raise ValueError(f"bad filter {text!r}: invalid regular expression: {exc}") from None
    if name in _NUMBER_FIELDS:
        return DlqFilter(name, op, value, _range=_parse_range(value, f"bad filter {text!r}: {name}"))
    return DlqFilter(name, op, value)


EntryFilter = Callable[[DeadLetterEntry], bool]


def _filters(filters: Iterable[str | EntryFilter] | None) -> list[EntryFilter]:
    out: list[EntryFilter] = []
    for f in filters or ():
        if isinstance(f, str):
            try:
                out.append(parse_filter(f))
            except ValueError as exc:
                raise DlqToolError(str(exc)) from None
        elif callable(f):
            out.append(f)
        else:
            raise TypeError(f"a filter must be a 'FIELD=VALUE' string or a function (entry) -> bool, got {f!r}")
    return out


def _matches(entry: DeadLetterEntry, filters: Sequence[EntryFilter]) -> bool:
    return all(f(entry) for f in filters)


# ---------------------------------------------------------------------------
# Clients
# ---------------------------------------------------------------------------


def resolve_bootstrap_servers(bootstrap_servers: str | None) -> str:
    """The given servers, else ``$KAFKATX_BOOTSTRAP_SERVERS``, else a DlqToolError saying how to give them."""
    servers = bootstrap_servers or os.environ.get(ENV_BOOTSTRAP)
    if servers:
        return servers
    from kafkatx.local import DEFAULT_PORT, _port_in_use

    if _port_in_use(DEFAULT_PORT):  # `kafkatx broker` runs on its default port: use it
        return f"127.0.0.1:{DEFAULT_PORT}"
    raise DlqToolError(
        f"no bootstrap servers: pass --bootstrap-servers HOST:PORT or set ${ENV_BOOTSTRAP} "
        f"(nothing listens on 127.0.0.1:{DEFAULT_PORT}, the default port of `kafkatx broker`)"
    )


def default_replay_group(topic: str) -> str:
    """The replay group used when none is given: one cursor per dead-letter topic."""
    return f"kafkatx-dlq-replay.{topic}"


def replay_transactional_id(group: str) -> str:
    """Stable per group, so the next replay with the same group fences a crashed one and aborts its transaction."""
    return f"kafkatx-dlq-replay.{group}"


def _check_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    cfg = dict(config or {})
    owned = sorted(k for k in cfg if k in _OWNED)
    if owned:
        raise DlqToolError(f"the dead-letter tools set {', '.join(owned)} themselves; remove it from the client config")
    return cfg


def _group_offsets(servers: str, group: str, topic: str, partitions: Iterable[int], config: Mapping[str, Any]) -> dict[int, int]:
    """``group``'s committed offsets of ``topic`` (none for a group that never committed)."""
    consumer = _consumer(servers, group, config)
    try:
        got = _kafka(lambda: consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=15),
                     f"read the offsets of group {group!r}")  # fmt: skip
    finally:
        consumer.close()
    return {tp.partition: tp.offset for tp in got if tp.offset >= 0}


def _consumer(servers: str, group: str, config: Mapping[str, Any]) -> Consumer:
    return Consumer(
        {
            **_QUIET,
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 100,  # reach partition EOF quickly; the tools read bounded ranges
            **config,
            "bootstrap.servers": servers,
            "group.id": group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )


def _partitions(client: Any, servers: str, topic: str, what: str = "topic") -> list[int]:
    """The partitions of ``topic``; a DlqToolError if it does not exist or Kafka is unreachable."""
    try:
        meta = client.list_topics(topic, timeout=10).topics.get(topic)
    except KafkaException as exc:
        raise DlqToolError(
            f"cannot read metadata of {what} {topic!r} from {servers} (is the broker reachable?): {exc.args[0].str()}"
        ) from None
    if meta is None or meta.error is not None or not meta.partitions:
        reason = f" ({meta.error.str()})" if meta is not None and meta.error is not None else ""
        raise DlqToolError(f"{what} {topic!r} does not exist on {servers}{reason}")
    return sorted(meta.partitions)


def _watermarks(consumer: Consumer, topic: str, partitions: Iterable[int]) -> dict[int, tuple[int, int]]:
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False) for p in partitions
        }
    except KafkaException as exc:
        raise DlqToolError(f"cannot read the end offsets of {topic!r}: {exc.args[0].str()}") from None


class _Event(NamedTuple):
    """A record to handle (``message`` set), or the end of a partition with everything before ``offset`` handled."""

    partition: int
    offset: int
    message: ConsumedMessage | None


def _read(
    consumer: Consumer,
    topic: str,
    starts: Mapping[int, int],
    stops: Mapping[int, int],
    idle_timeout: float,
) -> Iterator[_Event]:
    """Records of ``topic`` from ``starts`` up to (not including) ``stops``, in offset order per partition.

    A partition ends at the first record at or past its stop offset (records
    that arrived after the stop offsets were taken are left alone), or at
    partition EOF, which read_committed reports at the last stable offset:
    so an open transaction on the DLT does not make the reader wait for it,
    and trailing transaction markers are passed over. Each partition's end is
    reported once, as an event without a message.
    """
    pending = {p for p in starts if starts[p] < stops[p]}
    for p in sorted(set(starts) - pending):
        yield _Event(p, starts[p], None)
    if not pending:
        return
    consumer.assign([TopicPartition(topic, p, starts[p] if starts[p] >= 0 else _OFFSET_BEGINNING) for p in sorted(pending)])
    last_progress = time.monotonic()
    while pending:
        batch = consumer.consume(500, 0.2)
        if batch:
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > idle_timeout:
            raise DlqToolError(
                f"no progress reading {topic!r} for {idle_timeout:g}s; partitions {sorted(pending)} "
                "did not reach their end (is the broker reachable?)"
            )
        for msg in batch:
            partition, offset = msg.partition(), msg.offset()
            if partition is None or offset is None or partition not in pending:
                continue
            p = partition
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(p)
                    consumer.pause([TopicPartition(topic, p)])
                    yield _Event(p, offset, None)
                elif err.fatal() or not (err.retriable() or err.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN)):
                    raise DlqToolError(f"reading {topic!r} partition {p} failed: {err.str()}")
                else:
                    log.debug("transient error reading %s[%d]: %s", topic, p, err.str())
                continue
            if offset >= stops[p]:
                pending.discard(p)
                consumer.pause([TopicPartition(topic, p)])
                yield _Event(p, offset, None)
                continue
            yield _Event(p, offset, cast(ConsumedMessage, msg))  # no error: a consumed record


# ---------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------


def inspect_dlq(
    bootstrap_servers: str | None,
    topic: str,
    *,
    filters: Iterable[str | EntryFilter] | None = None,
    limit: int | None = None,
    config: Mapping[str, Any] | None = None,
    idle_timeout: float = 30.0,
    replay_group: str | None = None,
) -> list[DeadLetterEntry]:
    """The dead-lettered records of ``topic`` that match every filter, ordered by (partition, offset).

    Reads read_committed from the beginning to the end offsets taken at the
    start; joins no group and commits nothing. ``limit`` keeps the first N
    matches. Works for DLTs written by Spring too (same headers). Entries
    behind the committed offsets of ``replay_group`` (default: the one
    ``kafkatx dlq replay`` uses) are marked ``replayed``.
    """
    servers = resolve_bootstrap_servers(bootstrap_servers)
    if limit is not None and limit < 0:
        raise DlqToolError(f"limit must be >= 0, got {limit}")
    checks = _filters(filters)
    cfg = _check_config(config)
    # a throwaway group id: librdkafka needs one, but assign() never joins and nothing is committed
    consumer = _consumer(servers, f"kafkatx-dlq-inspect-{uuid.uuid4().hex[:12]}", cfg)
    try:
        parts = _partitions(consumer, servers, topic)
        marks = _watermarks(consumer, topic, parts)
        starts = {p: low for p, (low, _high) in marks.items()}
        stops = {p: high for p, (_low, high) in marks.items()}
        replayed_up_to = _group_offsets(servers, replay_group or default_replay_group(topic), topic, parts, cfg)
        found: list[DeadLetterEntry] = []
        for event in _read(consumer, topic, starts, stops, idle_timeout):
            if event.message is not None:
                entry = _entry(event.message)
                if _matches(entry, checks):
                    if entry.offset < replayed_up_to.get(entry.partition, -1):
                        entry = dataclasses.replace(entry, replayed=True)
                    found.append(entry)
    finally:
        consumer.close()
    found.sort(key=lambda e: (e.partition, e.offset))
    return found if limit is None else found[:limit]


# ---------------------------------------------------------------------------
# replay
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayResult:
    """What a replay did (or, with ``dry_run``, would do)."""

    topic: str
    group: str
    replayed: int
    skipped: int
    per_topic: dict[str, int] = field(default_factory=dict)
    #: The group's committed offsets on the DLT after the run (in a dry run: where a real run would leave them).
    committed: dict[int, int] = field(default_factory=dict)
    dry_run: bool = False
    transactions: int = 0


#: Called for each record, inside its transaction: the entry and its target topic (None if filtered out).
RecordHook = Callable[[DeadLetterEntry, str | None], None]


def replayed_headers(entry: DeadLetterEntry) -> Headers:
    """The replayed record's headers: the original ones without dead-letter headers, plus :data:`REPLAYED_FROM`."""
    kept = [(k, v) for k, v in entry.headers if not k.startswith(_STRIPPED_PREFIXES) and k != REPLAYED_FROM]
    kept.append((REPLAYED_FROM, entry.coordinates.encode()))
    return kept


class _Targets:
    """Resolves and checks target topics once each, for clear errors before anything is produced."""

    def __init__(self, servers: str, client: Any, to: str | None) -> None:
        self._servers = servers
        self._client = client
        self._to = to
        self._counts: dict[str, int] = {}

    def count(self, topic: str, entry: DeadLetterEntry | None = None) -> int:
        if topic not in self._counts:
            what = "replay target topic" if entry is None else f"original topic of {entry.coordinates}"
            self._counts[topic] = len(_partitions(self._client, self._servers, topic, what))
        return self._counts[topic]

    def resolve(self, entry: DeadLetterEntry) -> tuple[str, int | None]:
        original = entry.info.original_topic
        topic = self._to or original
        if topic is None:
            raise DlqToolError(
                f"dead-letter record {entry.coordinates} has no {ORIGINAL_TOPIC} header, so its "
                "original topic is unknown: pass --to TOPIC (to=...), or leave it out with a filter such as topic~=."
            )
        count = self.count(topic, None if self._to else entry)
        # The original partition keeps the record next to its siblings (and works for Java's partitioner);
        # anywhere else the producer partitions by key.
        partition = entry.info.original_partition if topic == original else None
        if partition is not None and not 0 <= partition < count:
            partition = None
        return topic, partition


def replay_dlq(
    bootstrap_servers: str | None,
    topic: str,
    *,
    to: str | None = None,
    filters: Iterable[str | EntryFilter] | None = None,
    group: str | None = None,
    dry_run: bool = False,
    batch_size: int = 500,
    limit: int | None = None,
    config: Mapping[str, Any] | None = None,
    progress: bool = False,
    on_record: RecordHook | None = None,
    idle_timeout: float = 30.0,
    transaction_timeout_ms: int = 60_000,
) -> ReplayResult:
    """Re-publish dead-lettered records to their original topic (or ``to``), exactly once.

    Starts at the group's committed offsets on the DLT (the beginning if it
    has none) and stops at the end offsets taken at the start. Every batch of
    up to ``batch_size`` DLT records (replayed or skipped) is one transaction
    holding the re-published records and the group's new offsets, so after a
    crash the same call resumes after the last committed batch. Records that
    fail a filter are skipped, and the group moves past them too (offsets are
    a position, not a set: not committing them would replay the records after
    them again). ``limit`` stops after that many replayed records.
    ``dry_run`` reads from the same position and reports what would happen,
    producing and committing nothing. ``on_record`` is called for each record
    inside its transaction; an exception from it aborts the open batch.
    """
    servers = resolve_bootstrap_servers(bootstrap_servers)
    if batch_size < 1:
        raise DlqToolError(f"batch_size must be >= 1, got {batch_size}")
    if limit is not None and limit < 0:
        raise DlqToolError(f"limit must be >= 0, got {limit}")
    if to is not None and to == topic:
        raise DlqToolError(f"refusing to replay {topic!r} into itself")
    checks = _filters(filters)
    cfg = _check_config(config)
    group = group or default_replay_group(topic)

    consumer = _consumer(servers, group, cfg)
    producer: TransactionalProducer | None = None
    try:
        parts = _partitions(consumer, servers, topic)
        targets = _Targets(servers, consumer, to)
        if to is not None:
            targets.count(to)
        if not dry_run:
            producer = TransactionalProducer(
                {
                    **_QUIET,
                    "linger.ms": 5,
                    **cfg,
                    "bootstrap.servers": servers,
                    "transaction.timeout.ms": transaction_timeout_ms,
                    "enable.idempotence": True,
                },
                replay_transactional_id(group),
                retry_timeout=max(1.0, transaction_timeout_ms / 2000),
            )
            # First fence any earlier replay of this group (aborting its open transaction), then read the
            # group's offsets: they now include everything that replay committed and nothing it did not.
            _kafka(producer.ensure, "start the replay transaction")
        run = _Replay(consumer, producer, topic, group, parts, targets, checks, on_record, dry_run)
        return run.run(batch_size, limit, progress, idle_timeout)
    finally:
        if producer is not None:
            producer.close()
        consumer.close()




def _why(exc: BaseException) -> str:
    """The error's text, plus what fencing means here: another replay of the same group took over."""
    error = exc.error if isinstance(exc, KafkaClientError) else exc.args[0] if isinstance(exc, KafkaException) else None
    if not isinstance(error, KafkaError):
        return str(exc)
    # the KafkaError's own text: KafkaClientError's message describes what a listener container would do
    text = f"{error.name()}: {error.str()}"
    if error.code() in FENCING_CODES:
        text += " (another replay with the same group started and took over; only one can run at a time)"
    return text


def _kafka(fn: Callable[[], Any], what: str) -> Any:
    try:
        return fn()
    except (KafkaClientError, KafkaException) as exc:
        raise DlqToolError(f"cannot {what}: {_why(exc)}") from exc


class _Replay:
    """One replay run: reads events, groups them into transactions, keeps the counts."""

    def __init__(
        self,
        consumer: Consumer,
        producer: TransactionalProducer | None,
        topic: str,
        group: str,
        partitions: list[int],
        targets: _Targets,
        filters: Sequence[EntryFilter],
        on_record: RecordHook | None,
        dry_run: bool,
    ) -> None:
        self.consumer = consumer
        self.producer = producer
        self.topic = topic
        self.group = group
        self.partitions = partitions
        self.targets = targets
        self.filters = filters
        self.on_record = on_record
        self.dry_run = dry_run
        self.replayed = 0
        self.skipped = 0
        self.per_topic: dict[str, int] = {}
        self.transactions = 0

    def run(self, batch_size: int, limit: int | None, progress: bool, idle_timeout: float) -> ReplayResult:
        from tqdm import tqdm

        marks = _watermarks(self.consumer, self.topic, self.partitions)
        committed = self._committed()
        starts = {p: max(committed.get(p, low), low) for p, (low, _high) in marks.items()}
        stops = {p: high for p, (_low, high) in marks.items()}
        positions = dict(committed)  # what the group has committed (or will have, in a dry run)
        done: dict[int, int] = {}  # positions handled in the open batch
        batch: list[PendingOutput] = []
        handled = 0  # records in the open batch, replayed or skipped
        total = sum(max(0, stops[p] - starts[p]) for p in starts)
        bar = tqdm(total=total, desc=f"replay {self.topic}", unit="rec", disable=not progress or total == 0, leave=False)
        try:
            events = _read(self.consumer, self.topic, starts, stops, idle_timeout)
            for event in events:
                if event.message is None:
                    if event.offset > positions.get(event.partition, -1):
                        done[event.partition] = max(done.get(event.partition, -1), event.offset)
                    continue
                if limit is not None and self.replayed >= limit:
                    break
                entry = _entry(event.message)
                if self.producer is not None and not self.producer.in_transaction:
                    _kafka(self.producer.begin, "begin a replay transaction")
                self._handle(entry, batch)
                done[event.partition] = event.offset + 1
                bar.update(1)
                handled += 1
                if handled >= batch_size:
                    self._commit(batch, done, positions)
                    handled = 0
            self._commit(batch, done, positions)
        except BaseException:
            if self.producer is not None and self.producer.in_transaction:
                try:
                    self.producer.abort()
                except KafkaClientError as exc:
                    log.warning("aborting the replay transaction failed (%s); the next run aborts it", _why(exc))
            raise
        finally:
            bar.close()
        return ReplayResult(
            topic=self.topic,
            group=self.group,
            replayed=self.replayed,
            skipped=self.skipped,
            per_topic=dict(sorted(self.per_topic.items())),
            committed=dict(sorted(positions.items())),
            dry_run=self.dry_run,
            transactions=self.transactions,
        )

    def _committed(self) -> dict[int, int]:
        tps = [TopicPartition(self.topic, p) for p in self.partitions]
        got = _kafka(lambda: self.consumer.committed(tps, timeout=15), f"read the offsets of group {self.group!r}")
        return {tp.partition: tp.offset for tp in got if tp.offset >= 0}

    def _handle(self, entry: DeadLetterEntry, batch: list[PendingOutput]) -> None:
        if not _matches(entry, self.filters):
            self.skipped += 1
            if self.on_record is not None:
                self.on_record(entry, None)
            return
        target, partition = self.targets.resolve(entry)
        out = PendingOutput(target, entry.value, entry.key, replayed_headers(entry), partition)
        if self.producer is not None:
            try:
                self.producer.produce(out)
            except UnknownTopicError as exc:
                raise DlqToolError(f"cannot replay {entry.coordinates} to {target!r}: {exc}") from exc
            except (KafkaClientError, KafkaException) as exc:
                raise DlqToolError(f"producing {entry.coordinates} to {target!r} failed: {_why(exc)}; run again to resume") from exc
        batch.append(out)
        if self.on_record is not None:
            self.on_record(entry, target)
        self.replayed += 1
        self.per_topic[target] = self.per_topic.get(target, 0) + 1

    def _commit(self, batch: list[PendingOutput], done: dict[int, int], positions: dict[int, int]) -> None:
        """Commit the open batch with the group's new offsets (an offsets-only transaction if nothing was produced)."""
        moved = {p: o for p, o in done.items() if o > positions.get(p, -1)}
        if not moved and not batch:
            return
        if self.producer is not None:
            offsets = [TopicPartition(self.topic, p, o) for p, o in sorted(moved.items())]
            if not self.producer.in_transaction:
                _kafka(self.producer.begin, "begin a replay transaction")
            try:
                if offsets:
                    self.producer.send_offsets(offsets, self.consumer.consumer_group_metadata())
                self.producer.commit()
            except (KafkaClientError, KafkaException) as exc:
                raise DlqToolError(
                    f"committing a replay batch of {len(batch)} record(s) from {self.topic!r} failed: {_why(exc)}. "
                    f"Nothing of that batch was replayed; earlier batches were. Run the same replay again to resume."
                ) from exc
            self.transactions += 1
            log.debug("replay of %s committed %d record(s), offsets %s", self.topic, len(batch), moved)
        positions.update(moved)
        done.clear()
        batch.clear()
