"""DeadLetterPublishingRecoverer: park a failed record on a dead-letter topic, atomically.

It runs inside the after-rollback transaction, so the dead-letter record and
the failed record's offset commit together or not at all. A send that fails
fails the recovery (the record is kept and recovery retried): it is never
swallowed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from kafkatx._suggest import closest_topic
from kafkatx.dlq.headers import dead_letter_headers
from kafkatx.errors import DeadLetterPublishError, InvalidConfigurationError
from kafkatx.outputs import encode_headers
from kafkatx.record import Headers, Record
from kafkatx.recoverers import Recoverer, current_recovery
from kafkatx.tracing import with_trace

__all__ = ["DeadLetterPublishingRecoverer", "DeadLetterPublishError", "DeadLetterTrace", "DEFAULT_SUFFIX"]

log = logging.getLogger("kafkatx.dlq")

DEFAULT_SUFFIX = "-dlt"  # Spring for Apache Kafka's suffix since 3.3 (it was ".DLT" before)

TopicResolver = Callable[[Record, BaseException], str]
PartitionResolver = Callable[[Record, BaseException], int | None]
HeadersFunction = Callable[[Record, BaseException], Headers | Mapping[str, bytes] | None]
#: The trace headers of a record's last attempt, by consumer group (None: no trace): what a traced App hands
#: the publisher in its setup context (``dead_letter_trace``), so that the dead letter continues the trace.
DeadLetterTrace = Callable[[str, Record], list[tuple[str, bytes]] | None]


class DeadLetterPublishingRecoverer(Recoverer):
    """Publishes a failed record to ``<topic>-dlt`` with Spring-compatible headers.

    - ``topic``: a fixed topic name, a function ``(record, exc) -> name``, or
      None for ``<original topic><suffix>``.
    - ``partition``: a fixed partition, a function, or None: the original
      partition when the dead-letter topic has that many, else the producer
      picks.
    - ``headers``: extra headers, a mapping or a function ``(record, exc)``.
    - Key, value and original headers are copied as raw bytes. Earlier
      exception headers are stripped so repeated dead-lettering does not grow
      the record; ``keep_header_history=True`` keeps earlier
      ``kafka_dlt-original-*`` headers as a hop history.
    - ``create_topics``: create missing dead-letter topics at startup with the
      source topic's partition count (if False, or if creation is refused,
      startup fails with a clear error).
    - ``skip_same_topic_fatal`` (default True, as Spring's
      ``skipSameTopicFatalExceptions``): a record whose failure is not
      retryable and whose destination is the topic it came from is not
      republished there (it would fail again, forever); it is logged at
      ERROR and its offset committed. Set it to False to republish anyway.
    - The dead-letter record's own delivery is confirmed before the offset
      commits: a failure to publish it fails the recovery (the record is
      kept and recovery retried), and never blames another record.
    """

    def __init__(
        self,
        topic: str | TopicResolver | None = None,
        partition: int | PartitionResolver | None = None,
        headers: Mapping[str, bytes | str] | HeadersFunction | None = None,
        *,
        suffix: str = DEFAULT_SUFFIX,
        keep_header_history: bool = False,
        max_stacktrace_bytes: int = 16_384,
        create_topics: bool = True,
        skip_same_topic_fatal: bool = True,
    ) -> None:
        if topic is not None and not (isinstance(topic, str) or callable(topic)):
            raise TypeError(f"topic must be a name, a function (record, exception) -> name, or None; got {topic!r}")
        if partition is not None and not (isinstance(partition, int) or callable(partition)):
            raise TypeError(f"partition must be an int, a function, or None; got {partition!r}")
        if not suffix:
            raise ValueError("suffix must not be empty")
        self.topic = topic
        self.partition = partition
        self.headers = headers
        self.suffix = suffix
        self.keep_header_history = keep_header_history
        self.max_stacktrace_bytes = max_stacktrace_bytes
        self.create_topics = create_topics
        self.skip_same_topic_fatal = skip_same_topic_fatal
        #: The App's tracing, handed over in :meth:`setup` (None: tracing off, or not run by an App).
        self.dead_letter_trace: DeadLetterTrace | None = None

    def destination(self, record: Record, exception: BaseException) -> str:
        """The dead-letter topic for ``record``: the fixed topic, the resolver's, or ``<topic><suffix>``."""
        if self.topic is None:
            return record.topic + self.suffix
        if isinstance(self.topic, str):
            return self.topic
        topic = self.topic(record, exception)
        if not isinstance(topic, str) or not topic:
            # Spring skips the record when its resolver returns null; kafkatx never skips one silently:
            # the recovery fails, and the record is kept.
            raise DeadLetterPublishError(
                f"the dead-letter topic resolver returned {topic!r} for {record.coordinates}; "
                "a record is never skipped silently"
            )
        return topic

    def setup(self, context: Any) -> None:
        """Take the App's tracing (``dead_letter_trace``, None with tracing off); check (and create if allowed)
        the dead-letter topic of each input topic."""
        self.dead_letter_trace = getattr(context, "dead_letter_trace", None)
        if callable(self.topic) and not isinstance(self.topic, str):
            return  # dynamic destinations are checked when used
        for source in context.input_topics:
            target = self.topic if isinstance(self.topic, str) else source + self.suffix
            if context.partitions(target) is not None:
                continue
            if not self.create_topics:
                names = getattr(context, "topic_names", None)  # a misspelt name is the likeliest reason
                hint = closest_topic(target, names()) if callable(names) else ""
                raise InvalidConfigurationError(
                    f"dead-letter topic {target!r} for {source!r} does not exist{hint} and create_topics=False; "
                    "create it"
                )
            context.create_topic(target, context.partitions(source) or 1, why=f"dead-letter topic for {source!r}")

    def recover(self, record: Record, exception: BaseException) -> None:
        """Publish ``record`` with Spring's headers inside the recovery transaction; raise if it is not delivered."""
        ctx = current_recovery()
        if ctx is None:
            raise RuntimeError("DeadLetterPublishingRecoverer must run inside a kafkatx recovery transaction")
        topic = self.destination(record, exception)
        if topic == record.topic and self.skip_same_topic_fatal and not ctx.is_retryable(exception):
            log.error(
                "not dead-lettering %s back to its own topic %r: %s: %s is not retryable, so it would fail again "
                "forever; the record is skipped (its offset committed). Pass skip_same_topic_fatal=False to "
                "republish it anyway.",
                record.coordinates,
                topic,
                type(exception).__name__,
                exception,
                extra={"topic": record.topic, "partition": record.partition, "offset": record.offset},
            )
            return
        count = ctx.partition_count(topic)
        if count is None:
            raise DeadLetterPublishError(f"dead-letter topic {topic!r} does not exist (or is not readable)")
        if self.partition is None:
            partition = record.partition if record.partition < count else None
        elif isinstance(self.partition, int):
            partition = self.partition
        else:
            partition = self.partition(record, exception)
        if partition is not None and not 0 <= partition < count:
            partition = None
        headers = dead_letter_headers(
            record,
            exception,
            group_id=ctx.group_id,
            attempts=record.attempt,
            keep_history=self.keep_header_history,
            max_stacktrace_bytes=self.max_stacktrace_bytes,
        )
        extra = self.headers(record, exception) if callable(self.headers) else self.headers
        if extra:
            items = extra.items() if isinstance(extra, Mapping) else extra
            headers += [(k, v.encode() if isinstance(v, str) else v) for k, v in items]
        trace = self.dead_letter_trace(ctx.group_id, record) if self.dead_letter_trace is not None else None
        if trace is not None:  # tracing on: the dead letter continues the trace of the record's last attempt
            headers = with_trace(headers, trace)
        # The bytes as consumed: a typed listener's record carries decoded objects in key and value.
        value = record.value if record.raw_value is None else record.raw_value
        key = record.key if record.raw_key is None else record.raw_key
        error = ctx.deliver((topic, value, key, encode_headers(headers), partition))
        if error is not None:
            raise DeadLetterPublishError(
                f"dead-letter publication of {record.coordinates} to {topic!r} failed: {error}"
            )
        log.info(
            "dead-lettered %s to %s after %d attempt(s): %s: %s",
            record.coordinates,
            topic,
            record.attempt,
            type(exception).__name__,
            exception,
            extra={
                "topic": record.topic,
                "partition": record.partition,
                "offset": record.offset,
                "attempt": record.attempt,
            },
        )
