"""``map_records``: a kafkatx record handler applied to a streaming DataFrame, on the executors, with dead letters.

The handler contract is ``app.listener``'s: a :class:`~kafkatx.Record` in (``attempt`` counts its calls), None,
bytes, str, ``(key, value)``, :class:`~kafkatx.Output` or an iterable of those out, encoded by
:mod:`kafkatx.outputs`. A failed call is decided by the listener's own
:class:`~kafkatx.rollback.policy.FailurePolicy` (``max_attempts``, ``backoff``, ``not_retryable``): retried in
place after the back-off, or, once it still fails, turned into a dead-letter row (the input's bytes and Spring's
``kafka_dlt-*`` headers, from :func:`kafkatx.dlq.headers.dead_letter_headers`). So a record never fails the
query, and its dead letter travels in the same DataFrame as the outputs: the ``"kafkatx"`` sink commits both in
the batch's one transaction. A handler returning a type kafkatx cannot encode is a programming error, not a
record's failure: it fails the query (as it stops a listener's container).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from kafkatx.dlq.headers import dead_letter_headers
from kafkatx.dlq.publisher import DEFAULT_SUFFIX
from kafkatx.errors import InvalidConfigurationError
from kafkatx.events import Event
from kafkatx.outputs import PendingOutput, Serializer, collect_outputs, unproducible_stop
from kafkatx.record import Record
from kafkatx.recoverers import Recoverer
from kafkatx.rollback.classifier import ExceptionClassifier
from kafkatx.rollback.decision import decide_failure
from kafkatx.rollback.policy import Action, FailurePolicy
from kafkatx.rollback.tracker import FailureTracker

__all__ = ["OUTPUT_SCHEMA", "DeadLetterRows", "RecordMapper", "map_records"]

#: The rows map_records gives: the "kafkatx" sink's columns (each row names its topic).
OUTPUT_SCHEMA = "topic string, key binary, value binary, headers array<struct<key:string,value:binary>>, partition int"

_ARROW_SCHEMA = pa.schema(
    [
        ("topic", pa.string()),
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
        ("partition", pa.int32()),
    ]
)

#: The columns a record needs (Spark's Kafka source and the "kafkatx" source have them; timestamps optional).
_REQUIRED_COLUMNS = ("key", "value", "topic", "partition", "offset")

#: Spark's Kafka source timestampType column: 0 create time, 1 log-append time.
_TIMESTAMP_TYPES = {0: "CreateTime", 1: "LogAppendTime"}


@dataclass
class _Books:
    """What :func:`~kafkatx.rollback.decision.decide_failure` needs: the policy, names, and no events."""

    listener: str
    policy: FailurePolicy
    worker: int = 0
    tracker: FailureTracker = field(default_factory=FailureTracker)
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def stop_event(self) -> threading.Event:
        return self._stop  # never set: an executor's task has no container to stop

    def publish(self, event: Event) -> None:
        """Events have no subscriber on an executor; decide_failure's log lines are the record of it."""


class DeadLetterRows(Recoverer):
    """The recoverer of map_records: a failed record becomes a row for the sink, not a produce of its own.

    Its topic is ``dlq`` (a name) or ``<topic>-dlt``; its key, value and headers the input's, plus Spring's
    dead-letter headers.
    """

    def __init__(self, dlq: str | bool, group_id: str | None) -> None:
        self.topic = dlq if isinstance(dlq, str) else None
        self.group_id = group_id
        self.rows: list[PendingOutput] = []

    @property
    def name(self) -> str:
        return f"a dead-letter row to {self.topic or '<topic>' + DEFAULT_SUFFIX}"

    def recover(self, record: Record, exception: BaseException) -> None:
        headers = dead_letter_headers(record, exception, group_id=self.group_id, attempts=record.attempt)
        topic = self.topic or record.topic + DEFAULT_SUFFIX
        self.rows.append((topic, record.raw_value, record.raw_key, list(headers), None))

    def take(self) -> list[PendingOutput]:
        """The rows recovered since the last call."""
        rows, self.rows = self.rows, []
        return rows


@dataclass
class RecordMapper:
    """The per-task function of :func:`map_records` (pickled to the executors; the policy is built there)."""

    handler: Callable[[Record], Any]
    output: str | None
    dlq: str | bool
    max_attempts: int
    backoff: Any
    not_retryable: tuple[type[BaseException], ...]
    serializer: Serializer | None
    group_id: str | None
    name: str

    def policy(self) -> FailurePolicy:
        classifier = ExceptionClassifier(self.not_retryable)
        recoverer = DeadLetterRows(self.dlq, self.group_id) if self.dlq is not False else None
        return FailurePolicy(recoverer, max_attempts=self.max_attempts, backoff=self.backoff, classifier=classifier)

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        books = _Books(self.name, self.policy())
        for batch in batches:
            rows: list[PendingOutput] = []
            for record in _records(batch):
                rows.extend(self.handle(record, books))
            yield _to_batch(rows)

    def handle(self, record: Record, books: _Books) -> list[PendingOutput]:
        """One record's outputs, after retries in place; its dead letter (or nothing) when it still fails."""
        while True:
            outputs: list[PendingOutput] = []
            try:
                collect_outputs(self.handler(record), self.output, self.serializer, self.name, outputs)
                return outputs
            except Exception as exc:
                stop = unproducible_stop(self.name, exc)
                if stop is not None:
                    raise stop from exc
                verdict = decide_failure(books, record, exc, counted=True)
                if verdict.action is not Action.RETRY:
                    recoverer = books.policy.recoverer
                    recoverer.recover(record, exc)  # dlq=False: the listener's LoggingRecoverer logs and drops it
                    return recoverer.take() if isinstance(recoverer, DeadLetterRows) else []
                if verdict.delay:
                    time.sleep(verdict.delay)  # the back-off between two calls, as the listener's in-place retry
                record.attempt += 1


def _records(batch: pa.RecordBatch) -> Iterator[Record]:
    """The Records of a batch with the Kafka source's columns (``headers`` optional)."""
    columns = {name: batch.column(i) for i, name in enumerate(batch.schema.names)}
    stamps = columns.get("timestamp")
    millis = stamps.cast(pa.timestamp("us")).cast(pa.int64()).to_pylist() if stamps is not None else [None] * len(batch)
    types = columns["timestampType"].to_pylist() if "timestampType" in columns else [0] * len(batch)
    headers = columns["headers"].to_pylist() if "headers" in columns else [None] * len(batch)
    rows = zip(
        columns["topic"].to_pylist(),
        columns["partition"].to_pylist(),
        columns["offset"].to_pylist(),
        columns["key"].to_pylist(),
        columns["value"].to_pylist(),
        millis,
        types,
        headers,
        strict=True,
    )
    for topic, partition, offset, key, value, micros, ts_type, hdrs in rows:
        yield Record(
            topic=topic,
            partition=partition,
            offset=offset,
            key=key,
            value=value,
            headers=[(h["key"], h["value"]) for h in hdrs] if hdrs else [],
            timestamp=micros // 1000 if micros is not None else -1,
            timestamp_type=_TIMESTAMP_TYPES.get(ts_type, "CreateTime"),
        )


def _to_batch(rows: list[PendingOutput]) -> pa.RecordBatch:
    columns: dict[str, list[Any]] = {name: [] for name in _ARROW_SCHEMA.names}
    for topic, value, key, headers, partition in rows:
        columns["topic"].append(topic)
        columns["key"].append(key)
        columns["value"].append(value)
        columns["headers"].append([{"key": k, "value": v} for k, v in headers] if headers else None)
        columns["partition"].append(partition)
    return pa.RecordBatch.from_pydict(columns, schema=_ARROW_SCHEMA)


def map_records(
    df: Any,
    handler: Callable[[Record], Any],
    *,
    output: str | None = None,
    dlq: str | bool = True,
    max_attempts: int = 3,
    backoff: Any = None,
    not_retryable: Iterable[type[BaseException]] = (),
    serializer: Serializer | None = None,
    group_id: str | None = None,
) -> Any:
    """Apply ``handler`` to each record of ``df`` (the Kafka source's columns) on the executors.

    Returns a DataFrame with the ``"kafkatx"`` sink's columns (:data:`OUTPUT_SCHEMA`): the handler's outputs (to
    ``output`` unless an :class:`~kafkatx.Output` names its topic) and, for each record that still fails after
    ``max_attempts`` calls (or at once when not retryable), a dead-letter row for ``<topic>-dlt`` (``dlq=True``),
    the topic ``dlq`` names, or none (``dlq=False``: logged and dropped). ``group_id`` fills the dead letters'
    ``kafka_dlt-original-consumer-group`` header (a query has no consumer group of its own).
    """
    mapper = RecordMapper(
        handler=handler,
        output=output,
        dlq=dlq,
        max_attempts=max_attempts,
        backoff=backoff,
        not_retryable=tuple(not_retryable),
        serializer=serializer,
        group_id=group_id,
        name=getattr(handler, "__qualname__", repr(handler)),
    )
    mapper.policy()  # a bad max_attempts, back-off or exception list fails here, not in a task
    if isinstance(dlq, str) and not dlq:
        raise ValueError("dlq must be True, False or a topic name, got an empty string")
    missing = [c for c in _REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise InvalidConfigurationError(
            f"map_records needs the Kafka source's columns ({', '.join(_REQUIRED_COLUMNS)}; headers optional): "
            f"{', '.join(missing)} missing from {df.columns}"
        )
    return df.mapInArrow(mapper, OUTPUT_SCHEMA)
