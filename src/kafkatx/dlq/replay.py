"""``kafkatx dlq replay``: re-publish dead-lettered records exactly once.

Each batch of re-published records and the replay group's offsets on the
dead-letter topic commit in one Kafka transaction, under a transactional.id
derived from the group, so a crashed replay is fenced and its open
transaction aborted by the next run, which resumes after the last committed
batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from kafkatx.client.producer import TransactionalProducer
from kafkatx.dlq._reading import (
    QUIET,
    check_config,
    kafka_call,
    read_range,
    resolve_bootstrap_servers,
    tool_consumer,
    topic_partitions,
    watermarks,
    why,
)
from kafkatx.dlq.entries import (
    DeadLetterEntry,
    DlqToolError,
    EntryFilter,
    compile_filters,
    entry_from_message,
    matches_all,
)
from kafkatx.dlq.headers import ORIGINAL_TOPIC
from kafkatx.errors import KafkaClientError, UnknownTopicError
from kafkatx.outputs import PendingOutput
from kafkatx.record import Headers

__all__ = [
    "REPLAYED_FROM",
    "RecordHook",
    "ReplayResult",
    "default_replay_group",
    "replay_dlq",
    "replay_transactional_id",
    "replayed_headers",
]

log = logging.getLogger("kafkatx.dlq.tools")

#: Header added to every replayed record: ``<dlt topic>/<partition>@<offset>``
#: of the dead-letter record it came from (an earlier one is replaced).
REPLAYED_FROM = "kafkatx_replayed-from"

#: Headers a replay strips: the dead-letter provenance (Spring's and kafkatx's)
#: and Spring's non-blocking-retry bookkeeping, so the replayed record starts
#: afresh instead of looking like an exhausted retry.
_STRIPPED_PREFIXES = ("kafka_dlt-", "kafkatx_dlt-", "retry_topic-")


def default_replay_group(topic: str) -> str:
    """The replay group used when none is given: one cursor per dead-letter topic."""
    return f"kafkatx-dlq-replay.{topic}"


def replay_transactional_id(group: str) -> str:
    """Stable per group, so the next replay with the same group fences a crashed one and aborts its transaction."""
    return f"kafkatx-dlq-replay.{group}"


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
            self._counts[topic] = len(topic_partitions(self._client, self._servers, topic, what))
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
    force: bool = False,
) -> ReplayResult:
    """Re-publish dead-lettered records to their original topic (or ``to``), exactly once.

    Starts at the group's committed offsets on the DLT (the beginning if it
    has none) and stops at the end offsets taken at the start. Every batch of
    up to ``batch_size`` DLT records (replayed or skipped) is one transaction
    holding the re-published records and the group's new offsets, so after a
    crash the same call resumes after the last committed batch. Records that
    fail a filter are skipped, and the group moves past them too (offsets are
    a position, not a set: not committing them would replay the records after
    them again). Filters that match none of the records read are refused
    (a DlqToolError, the group left where it was: a misspelt value would
    otherwise move it past every record); ``force=True`` skips them all.
    ``limit`` stops after that many replayed records.
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
    checks = compile_filters(filters)
    cfg = check_config(config)
    group = group or default_replay_group(topic)

    consumer = tool_consumer(servers, group, cfg)
    producer: TransactionalProducer | None = None
    try:
        parts = topic_partitions(consumer, servers, topic)
        targets = _Targets(servers, consumer, to)
        if to is not None:
            targets.count(to)
        if not dry_run:
            producer = TransactionalProducer(
                {
                    **QUIET,
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
            kafka_call(producer.ensure, "start the replay transaction")
        run = _Replay(consumer, producer, topic, group, parts, targets, checks, on_record, dry_run, force)
        return run.run(batch_size, limit, progress, idle_timeout)
    finally:
        if producer is not None:
            producer.close()
        consumer.close()


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
        force: bool = False,
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
        #: Move the group past the records even when none matches the filters.
        self.force = force
        self.replayed = 0
        self.skipped = 0
        self.per_topic: dict[str, int] = {}
        self.transactions = 0

    def run(self, batch_size: int, limit: int | None, progress: bool, idle_timeout: float) -> ReplayResult:
        from tqdm import tqdm

        marks = watermarks(self.consumer, self.topic, self.partitions)
        committed = self._committed()
        starts = {p: max(committed.get(p, low), low) for p, (low, _high) in marks.items()}
        stops = {p: high for p, (_low, high) in marks.items()}
        positions = dict(committed)  # what the group has committed (or will have, in a dry run)
        done: dict[int, int] = {}  # positions handled in the open batch
        batch: list[PendingOutput] = []
        handled = 0  # records in the open batch, replayed or skipped
        total = sum(max(0, stops[p] - starts[p]) for p in starts)
        bar = tqdm(
            total=total, desc=f"replay {self.topic}", unit="rec", disable=not progress or total == 0, leave=False
        )
        try:
            events = read_range(self.consumer, self.topic, starts, stops, idle_timeout)
            for event in events:
                if event.message is None:
                    if event.offset > positions.get(event.partition, -1):
                        done[event.partition] = max(done.get(event.partition, -1), event.offset)
                    continue
                if limit is not None and self.replayed >= limit:
                    break
                entry = entry_from_message(event.message)
                if self.producer is not None and not self.producer.in_transaction:
                    kafka_call(self.producer.begin, "begin a replay transaction")
                self._handle(entry, batch)
                done[event.partition] = event.offset + 1
                bar.update(1)
                handled += 1
                if handled >= batch_size and (self.replayed or self.force):  # skipped only: held until a match
                    self._commit(batch, done, positions)
                    handled = 0
            if self.skipped and not self.replayed and not self.force and not self.dry_run:
                raise DlqToolError(self._nothing_matches())
            self._commit(batch, done, positions)
        except BaseException:
            if self.producer is not None and self.producer.in_transaction:
                try:
                    self.producer.abort()
                except KafkaClientError as exc:
                    log.warning("aborting the replay transaction failed (%s); the next run aborts it", why(exc))
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

    def _nothing_matches(self) -> str:
        return (
            f"no record of {self.topic!r} matches the filters ({self.skipped} record(s) read, none replayed); the "
            f"replay group {self.group!r} was left where it was rather than moved past them all. Check the filters "
            f"with `kafkatx dlq inspect {self.topic} --filter ...`, or pass --force (force=True) to skip them all"
        )

    def _committed(self) -> dict[int, int]:
        tps = [TopicPartition(self.topic, p) for p in self.partitions]
        got = kafka_call(lambda: self.consumer.committed(tps, timeout=15), f"read the offsets of group {self.group!r}")
        return {tp.partition: tp.offset for tp in got if tp.offset >= 0}

    def _handle(self, entry: DeadLetterEntry, batch: list[PendingOutput]) -> None:
        if not matches_all(entry, self.filters):
            self.skipped += 1
            if self.on_record is not None:
                self.on_record(entry, None)
            return
        target, partition = self.targets.resolve(entry)
        out = (target, entry.value, entry.key, replayed_headers(entry), partition)
        if self.producer is not None:
            try:
                self.producer.produce(out)
            except UnknownTopicError as exc:
                raise DlqToolError(f"cannot replay {entry.coordinates} to {target!r}: {exc}") from exc
            except (KafkaClientError, KafkaException) as exc:
                raise DlqToolError(
                    f"producing {entry.coordinates} to {target!r} failed: {why(exc)}; run again to resume"
                ) from exc
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
                kafka_call(self.producer.begin, "begin a replay transaction")
            try:
                if offsets:
                    self.producer.send_offsets(offsets, self.consumer.consumer_group_metadata())
                self.producer.commit()
            except (KafkaClientError, KafkaException) as exc:
                raise DlqToolError(
                    f"committing a replay batch of {len(batch)} record(s) from {self.topic!r} failed: {why(exc)}. "
                    f"Nothing of that batch was replayed; earlier batches were. Run the same replay again to resume."
                ) from exc
            self.transactions += 1
            log.debug("replay of %s committed %d record(s), offsets %s", self.topic, len(batch), moved)
        positions.update(moved)
        done.clear()
        batch.clear()
