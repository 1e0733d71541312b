"""spring-kafka's own test expectations, translated to kafkatx where nothing else covers them.

Each test names the Spring test it translates (``DefaultAfterRollbackProcessorTests``,
``FailedRecordTrackerTests``, ``DeadLetterPublishingRecovererTests``,
``TransactionalContainerTests``, and the Spring Cloud Stream rollback post, seed 002).
The pure counting logic is checked on kafkatx's own tracker and policy (the ones the
after-rollback processor asks); everything about transactions, offsets and the
dead-letter topic runs on the local broker.

Spring's ``FixedBackOff(0, n)`` is ``max_attempts=n + 1`` here; Spring's
``ListenerExecutionFailedException`` (the container's wrapper around what the
listener threw) has no kafkatx counterpart: the handler's own exception is what
kafkatx counts, classifies and dead-letters.
"""

from __future__ import annotations

import struct
from collections import Counter
from typing import Any

import pytest
import tenacity
from confluent_kafka import Producer
from helpers import PoisonError, make_app

from kafkatx import (
    CompositeRecoverer,
    DeadLetterPublishingRecoverer,
    DeserializationError,
    Record,
    RecoveryExhaustedError,
    send,
)
from kafkatx.dlq.headers import dead_letter_headers, parse_dead_letter_headers
from kafkatx.events import (
    HandlerFailed,
    RecordRecovered,
    RecoveryFailed,
    TransactionAborted,
    TransactionCommitted,
)
from kafkatx.rollback.policy import Action, FailurePolicy
from kafkatx.rollback.tracker import FailureTracker
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for


class ServiceError(Exception):
    """What a handler raises for a downstream outage, chained to whatever the client library raised."""


def rec(topic: str = "foo", partition: int = 0, offset: int = 0) -> Record:
    return Record(topic, partition, offset, b"bar", b"baz")


class Tracking:
    """Spring's ``FailedRecordTracker.skip(record, exception)`` on kafkatx's tracker and policy.

    True when the record is recovered (the recoverer ran), False when it is to be retried:
    the same two calls the after-rollback processor makes (count, then decide).
    """

    def __init__(self, max_attempts: int, **policy: Any) -> None:
        self.tracker = FailureTracker()
        self.recovered: list[Record] = []
        self.policy = FailurePolicy(lambda r, e: self.recovered.append(r), max_attempts=max_attempts, **policy)

    def skip(self, record: Record, exc: BaseException) -> bool:
        state = self.tracker.record_failure(record, exc)
        if self.policy.decide(state.failures, exc).action is Action.RECOVER:
            self.policy.recoverer(record, exc)
            self.tracker.committed({(record.topic, record.partition): record.offset + 1})  # recovered: offset commits
            return True
        return False

    def delivery_attempt(self, record: Record) -> int:
        return self.tracker.attempt(record.topic, record.partition, record.offset)


# -- FailedRecordTrackerTests (pure counting logic) -----------------------------------------------


def test_tracker_no_retries() -> None:
    """testNoRetries: FixedBackOff(0, 0) recovers at the first failure."""
    t = Tracking(max_attempts=1)
    assert t.skip(rec(), RuntimeError()) is True
    assert t.recovered == [rec()]


def test_tracker_three_retries() -> None:
    """testThreeRetries: FixedBackOff(0, 3) is four deliveries, recovered at the fourth failure."""
    t = Tracking(max_attempts=4)
    assert [t.skip(rec(), RuntimeError()) for _ in range(4)] == [False, False, False, True]
    assert len(t.recovered) == 1


def test_tracker_another_record_has_its_own_count() -> None:
    """testSuccessAfterFailure: another topic, partition or offset is another record."""
    t = Tracking(max_attempts=2)
    assert t.skip(rec("foo", 0, 0), RuntimeError()) is False
    assert t.skip(rec("bar", 0, 0), RuntimeError()) is False
    assert t.skip(rec("bar", 1, 0), RuntimeError()) is False
    assert t.skip(rec("bar", 1, 1), RuntimeError()) is False
    assert t.skip(rec("bar", 1, 1), RuntimeError()) is True
    assert t.recovered == [rec("bar", 1, 1)]


def test_tracker_interleaved_partitions() -> None:
    """testDifferentOrder: two partitions failing in turn are counted apart, both recovered at their third."""
    t = Tracking(max_attempts=3)
    one, two = rec("foo", 0, 0), rec("foo", 1, 0)
    assert [t.skip(r, RuntimeError()) for r in (one, two, one, two, one, two)] == [False] * 4 + [True, True]
    assert t.recovered == [one, two]


def test_tracker_a_partition_that_commits_leaves_the_others_counting() -> None:
    """clearThreadStateForLeavesOtherPartitionsIntact: partition 1 succeeding does not reset partition 0."""
    t = Tracking(max_attempts=3)
    p0, p1 = rec("topic", 0, 0), rec("topic", 1, 0)
    assert t.skip(p0, RuntimeError()) is False
    assert t.skip(p1, RuntimeError()) is False
    t.tracker.committed({("topic", 1): 1})  # partition 1's record succeeded: its offset committed
    assert t.delivery_attempt(p1) == 1
    assert t.skip(p0, RuntimeError()) is False
    assert t.skip(p0, RuntimeError()) is True
    assert t.recovered == [p0]


@pytest.mark.parametrize("reset", [True, False])
def test_tracker_exception_changes(reset: bool) -> None:
    """exceptionChanges(reset): 2, 3, then 2 again when the class changes (4 without the reset)."""
    t = Tracking(max_attempts=10)
    t.tracker.reset_on_exception_change = reset
    record = rec()
    t.skip(record, ValueError())
    assert t.delivery_attempt(record) == 2
    t.skip(record, ValueError("again"))
    assert t.delivery_attempt(record) == 3
    t.skip(record, KeyError())
    assert t.delivery_attempt(record) == (2 if reset else 4)


def test_tracker_exception_change_looks_at_the_handlers_exception_not_its_causes() -> None:
    """Spring compares what the listener threw (findRootCause only unwraps the container's own
    ListenerExecutionFailedException and TimestampedException), never the causes the listener chained:
    a ServiceError is a ServiceError whatever low-level error it was raised from."""
    t = Tracking(max_attempts=10)
    record = rec()
    causes = [ConnectionResetError("reset"), TimeoutError("timed out"), ConnectionRefusedError("refused")]
    for n, cause in enumerate(causes, start=1):
        exc = ServiceError("downstream unavailable")
        exc.__cause__ = cause
        t.skip(record, exc)
        assert t.delivery_attempt(record) == n + 1, f"failure {n} counted against the same kind"
    implicit = ServiceError("raised while handling another error")
    implicit.__context__ = KeyError("cache miss")
    t.skip(record, implicit)
    assert t.delivery_attempt(record) == 5, "an implicit __context__ is not what the handler raised either"
    t.skip(record, PoisonError())
    assert t.delivery_attempt(record) == 2, "another class that is not a ServiceError resets, as in Spring"


def test_back_off_can_depend_on_the_exception() -> None:
    """multiBackOffs / exceptionChangesWithTimestampedException: the back-off is chosen per exception
    (tenacity: a wait strategy sees the failed outcome), and a not-retryable exception after a retryable
    one is recovered at once."""

    def by_exception(state: tenacity.RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome is not None else None
        return 2.0 if isinstance(exc, ConnectionError) else 0.25

    t = Tracking(max_attempts=5, backoff=by_exception)
    assert t.policy.decide(1, ConnectionError()).delay == 2.0
    assert t.policy.decide(1, ValueError()).delay == 0.25
    record = rec()
    assert t.skip(record, ValueError("retryable")) is False
    assert t.skip(record, DeserializationError("not retryable")) is True
    assert t.recovered == [record]


# -- DeadLetterPublishingRecovererTests (header layout) ----------------------------------------------


def test_a_dead_letter_of_a_record_without_headers_has_springs_ten_headers_and_the_attempts() -> None:
    """headerBitsTurnedOffOneByOne (first record) / allOriginalHeaders: a record without headers, dead-lettered
    with a group, gets Spring's ten headers, once each, then kafkatx's attempt count."""
    headers = dead_letter_headers(Record("foo", 0, 0, b"bar", None), RuntimeError(), group_id="group", attempts=1)
    assert [name for name, _value in headers] == [
        "kafka_dlt-original-topic",
        "kafka_dlt-original-partition",
        "kafka_dlt-original-offset",
        "kafka_dlt-original-timestamp",
        "kafka_dlt-original-timestamp-type",
        "kafka_dlt-original-consumer-group",
        "kafka_dlt-exception-fqcn",
        "kafka_dlt-exception-cause-fqcn",
        "kafka_dlt-exception-message",
        "kafka_dlt-exception-stacktrace",
        "kafkatx_dlt-attempts",
    ]


# -- DefaultAfterRollbackProcessorTests / TransactionalContainerTests (local broker) -------------------


def test_seed_002_one_new_transaction_after_each_rollback_and_the_dead_letter_commits_with_the_offset(
    kafka: KafkaTestKit,
) -> None:
    """Seed 002 (max attempts 2) and testConsumeAndProduceTransactionRollback: Spring aborts each failed
    attempt's sends, then recovers the record and commits its offset in a new transaction. kafkatx drops a failed
    attempt's sends before they reach the producer and, with backoff=0, retries and recovers inside the one
    transaction that commits the offset: no reader, not even read_uncommitted, sees the failed attempts."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"poison"])
    app = make_app(kafka)
    transactions: list[str] = []
    app.on(TransactionAborted)(lambda e: transactions.append("abort"))
    app.on(TransactionCommitted)(lambda e: transactions.append(e.kind))
    recovered: list[RecordRecovered] = []
    app.on(RecordRecovered)(recovered.append)
    attempts: list[int] = []

    @app.listener(src, output=out, max_attempts=2, dlq=True, backoff=0)
    def handle(record: Record) -> bytes:
        attempts.append(record.attempt)
        send(out, b"sent-in-attempt-%d" % record.attempt)
        raise PoisonError("always")

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="the record committed")
    assert attempts == [1, 2]
    assert transactions == ["batch"], transactions
    assert len(recovered) == 1
    assert kafka.values(out) == [], "read_committed sees nothing of the failed attempts"
    assert kafka.values(out, isolation="read_uncommitted") == [], "nor does read_uncommitted: nothing was sent"
    assert [d.value for d in kafka.read(src + "-dlt")] == [b"poison"]
    assert kafka.committed(app.group_id, src) == {0: 1}


def test_a_failed_record_on_one_partition_with_unprocessed_records_on_another(kafka: KafkaTestKit) -> None:
    """testClassifier: a retryable failure seeks every partition of the unprocessed records back (nothing is
    lost or handled twice); a not-retryable exception after it recovers the record at once; a recovery that
    fails keeps the record, and the offset is sent once, when the recovery succeeds."""
    src, out = kafka.topic(partitions=2), kafka.topic()
    dlt = src + "-dlt"
    kafka.produce(
        src, [{"value": b"foo-0", "partition": 0}] + [{"value": b"bar-%d" % i, "partition": 1} for i in range(3)]
    )
    app = make_app(kafka)
    calls: Counter[bytes] = Counter()
    recovery_calls: list[int] = []
    recovery_failures: list[RecoveryFailed] = []
    app.on(RecoveryFailed)(recovery_failures.append)

    def fails_once(record: Record, exc: BaseException) -> None:
        recovery_calls.append(record.attempt)
        if len(recovery_calls) == 1:
            raise OSError("test recoverer failure")

    @app.listener(
        src,
        output=out,
        max_attempts=10,
        backoff=0,  # Spring's default back-off: retries at once
        max_batch_ms=500,
        recovery_backoff=0.1,
        dlq=CompositeRecoverer(DeadLetterPublishingRecoverer(), fails_once),
    )
    def handle(record: Record) -> bytes:
        value = record.value or b""
        calls[value] += 1
        if value == b"foo-0":
            if record.attempt == 1:
                raise RuntimeError("illegal state")
            raise DeserializationError("intended")
        return value

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    assert calls[b"foo-0"] == 2, "retried once, then not retryable: recovered at its second delivery"
    # The class changed (RuntimeError, then DeserializationError): the count restarted at 1, as Spring's
    # tracker starts a new FailedRecord; the recoverer and the header get the count the decision used.
    assert recovery_calls == [1, 1], "recovery failed once and was retried, without calling the handler again"
    assert len(recovery_failures) == 1
    assert Counter(kafka.values(out)) == Counter([b"bar-0", b"bar-1", b"bar-2"]), "the other partition's, once each"
    dead = kafka.read(dlt)
    assert [d.value for d in dead] == [b"foo-0"], "the failed recovery's dead letter was dropped with it"
    info = parse_dead_letter_headers(dead[0].headers)
    assert (info.exception_fqcn, info.attempts) == ("kafkatx.errors.DeserializationError", 1)
    assert len(kafka.read(dlt, isolation="read_uncommitted")) == 1, "what a failed recoverer sent never left"
    assert kafka.committed(app.group_id, src) == {0: 1, 1: 3}


def test_the_dead_letter_topic_with_fewer_partitions_lets_the_producer_choose(kafka: KafkaTestKit) -> None:
    """testTxNoTx (verifyPartition): the dead letter goes to the source partition when the dead-letter topic
    has it, else the producer picks a partition (Spring sends with partition=null)."""
    src = kafka.topic(partitions=3)
    kafka.topic(name=src + "-dlt", partitions=2)
    kafka.produce(src, [{"key": b"k1", "value": b"p1", "partition": 1}, {"key": b"k2", "value": b"p2", "partition": 2}])
    app = make_app(kafka)

    @app.listener(src, max_attempts=1, dlq=True, backoff=0)
    def handle(record: Record) -> None:
        raise PoisonError(str(record.value))

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="both recovered")
    dead = {d.value: d for d in kafka.read(src + "-dlt")}
    assert set(dead) == {b"p1", b"p2"}
    assert dead[b"p1"].partition == 1, "same partition as the source"
    assert parse_dead_letter_headers(dead[b"p2"].headers).original_partition == 2
    assert dead[b"p2"].key == b"k2"
    assert kafka.committed(app.group_id, src) == {1: 1, 2: 1}


def test_a_tombstone_is_dead_lettered_as_a_tombstone(kafka: KafkaTestKit) -> None:
    """tombstoneWithMultiTemplates / allOriginalHeaders: a record with a null value is dead-lettered with a
    null value (not empty bytes), its key, and all the original-* headers."""
    src = kafka.topic()
    kafka.produce(src, [{"key": b"gone", "value": None}])
    app = make_app(kafka)

    @app.listener(src, max_attempts=1, dlq=True, backoff=0)
    def handle(record: Record) -> None:
        raise PoisonError("cannot delete")

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="recovered")
    [dead] = kafka.read(src + "-dlt")
    assert (dead.key, dead.value) == (b"gone", None)
    assert dead.header("kafka_dlt-original-topic") == src.encode()
    assert dead.header("kafka_dlt-original-partition") == struct.pack(">i", 0)
    assert dead.header("kafka_dlt-original-offset") == struct.pack(">q", 0)
    assert dead.header("kafka_dlt-original-timestamp") is not None
    assert dead.header("kafka_dlt-original-timestamp-type") == b"CreateTime"


class _Flaky(Exception):
    pass


@pytest.mark.parametrize("skip_same_topic_fatal", [True, False])
def test_routing_back_to_the_source_topic(kafka: KafkaTestKit, skip_same_topic_fatal: bool) -> None:
    """noCircularRoutingIfFatal / doNotSkipCircularFatalIfSet: a not-retryable record routed to its own topic
    is skipped unless skip_same_topic_fatal=False; a retryable one whose attempts ran out is republished."""
    src = kafka.topic()
    kafka.produce(src, [b"fatal", b"retryable"])
    app = make_app(kafka)
    calls: list[tuple[bytes, bool]] = []

    @app.listener(
        src,
        max_attempts=2,
        not_retryable=(PoisonError,),
        dlq=DeadLetterPublishingRecoverer(topic=lambda r, e: r.topic, skip_same_topic_fatal=skip_same_topic_fatal),
        backoff=0,
    )
    def handle(record: Record) -> None:
        republished = record.header("kafka_dlt-original-offset") is not None
        calls.append((record.value or b"", republished))
        if republished:
            return  # the copy is handled
        if record.value == b"fatal":
            raise PoisonError("never valid")
        raise _Flaky("exhausted")

    copies_expected = 1 if skip_same_topic_fatal else 2
    with running(app):
        wait_for(
            lambda: sum(r for _v, r in calls) == copies_expected and kafka.caught_up(app.group_id, src),
            30,
            message=f"{copies_expected} republished copies handled, all committed",
        )
    copies = [r.value for r in kafka.read(src) if r.header("kafka_dlt-original-offset") is not None]
    if skip_same_topic_fatal:
        assert copies == [b"retryable"]
        assert calls == [(b"fatal", False), (b"retryable", False), (b"retryable", False), (b"retryable", True)]
    else:
        assert copies == [b"fatal", b"retryable"]
        assert Counter(calls) == Counter(
            {(b"fatal", False): 1, (b"retryable", False): 2, (b"fatal", True): 1, (b"retryable", True): 1}
        )


def test_extra_headers_are_appended_in_order_and_the_partition_can_be_chosen(kafka: KafkaTestKit) -> None:
    """addHeaderFunctionsProcessedInOrder / setHeadersFunction, and a destination resolver's partition: extra
    headers follow Spring's, in order, a repeated name kept twice; the resolver's partition is used."""
    src = kafka.topic()
    dlt = kafka.topic(partitions=2)
    kafka.produce(src, [{"value": b"v", "headers": [("orig", b"x")]}])
    app = make_app(kafka)

    def extra(record: Record, exc: BaseException) -> list[tuple[str, bytes]]:
        return [("foo", b"one"), ("bar", b"two"), ("foo", type(exc).__name__.encode())]

    @app.listener(
        src, max_attempts=1, dlq=DeadLetterPublishingRecoverer(dlt, partition=lambda r, e: 1, headers=extra), backoff=0
    )
    def handle(record: Record) -> None:
        raise PoisonError("p")

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="recovered")
    [dead] = kafka.read(dlt)
    assert dead.partition == 1
    names = [name for name, _value in dead.headers]
    assert names[0] == "orig" and names[-4:] == ["kafkatx_dlt-attempts", "foo", "bar", "foo"], names
    assert [v for k, v in dead.headers if k == "foo"] == [b"one", b"PoisonError"]
    assert dead.header("bar") == b"two"


def test_a_destination_resolver_that_returns_nothing_never_skips_the_record(kafka: KafkaTestKit) -> None:
    """throwIfNoDestinationReturned: Spring skips the record (debug log) unless told to throw; kafkatx never
    skips silently: the recovery fails with a message naming the resolver, and the record is kept."""
    src = kafka.topic()
    kafka.produce(src, [b"ok", b"poison"])
    app = make_app(kafka)
    failures: list[RecoveryFailed] = []
    app.on(RecoveryFailed)(failures.append)

    @app.listener(
        src,
        max_attempts=1,
        max_recovery_failures=2,
        recovery_backoff=0.05,
        dlq=DeadLetterPublishingRecoverer(topic=lambda r, e: None),
    )  # type: ignore[arg-type,return-value]
    def handle(record: Record) -> None:
        if record.value == b"poison":
            raise PoisonError("p")

    app.start()
    assert app.wait(30), "the container stops by itself"
    assert isinstance(app.failure, RecoveryExhaustedError)
    assert [str(f.recovery_error) for f in failures] == [
        f"the dead-letter topic resolver returned None for {src}/0@1; a record is never skipped silently"
    ] * 2
    assert kafka.committed(app.group_id, src) == {0: 1}, "ok committed, poison kept for the next start"


@pytest.mark.parametrize("retry", ["rollback", "in_place"])
def test_alternating_causes_still_reach_max_attempts(kafka: KafkaTestKit, retry: str) -> None:
    """exceptionChanges on the broker: a handler that raises the same ServiceError from a different low-level
    error each time is dead-lettered after max_attempts, as Spring does; comparing the causes reset the count
    at every failure, so the record was retried for as long as its causes kept changing."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"x"])
    app = make_app(kafka)
    attempts: list[int] = []
    lows: list[type[BaseException]] = [ConnectionResetError, TimeoutError] * 3

    # outages=(): a ConnectionResetError on the cause chain would otherwise be an outage (no attempt counted).
    @app.listener(src, output=out, max_attempts=3, dlq=True, retry=retry, outages=(), backoff=0)  # type: ignore[arg-type]
    def handle(record: Record) -> bytes:
        attempts.append(record.attempt)
        if len(attempts) <= len(lows):
            try:
                raise lows[len(attempts) - 1]("low-level")
            except OSError as low:
                raise ServiceError("downstream unavailable") from low
        return b"handled at call %d" % len(attempts)

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="committed")
    assert attempts == [1, 2, 3]
    assert kafka.values(out) == []
    [dead] = kafka.read(src + "-dlt")
    info = parse_dead_letter_headers(dead.headers)
    assert (info.exception_fqcn, info.attempts) == (f"{__name__}.ServiceError", 3)


# -- transaction markers (testRollbackRecord, testFixTxOffsets*, testFixLag*) ------------------------


def produce_in_one_transaction(kafka: KafkaTestKit, topic: str, values: list[bytes]) -> None:
    producer = Producer(
        {"bootstrap.servers": kafka.bootstrap_servers, "transactional.id": unique_name("input"), "log_level": 3}
    )
    producer.init_transactions(15)
    producer.begin_transaction()
    for value in values:
        producer.produce(topic, value, partition=0)
    producer.commit_transaction(15)


@pytest.mark.parametrize("batch", [1, 3])
def test_committed_offsets_reach_past_the_commit_marker(kafka: KafkaTestKit, batch: int) -> None:
    """testFixTxOffsetsWithEmptyPollAdvance (max.poll.records=1) and testFixLagWhenMaxPollEqualsTxBatchSize
    (3): three records written in one transaction (offsets 0-2, the marker at 3): the group commits 4."""
    src, out = kafka.topic(), kafka.topic()
    app = make_app(kafka)

    @app.listener(src, output=out, max_batch_records=batch)
    def handle(record: Record) -> bytes | None:
        return record.value

    with running(app):
        produce_in_one_transaction(kafka, src, [b"msg1", b"msg2", b"msg3"])
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: 4}, 30, message="offset 4 committed")
    assert kafka.end_offsets(src) == {0: 4}
    assert kafka.values(out) == [b"msg1", b"msg2", b"msg3"]


def test_a_record_that_fails_once_commits_past_the_marker_and_nothing_else(kafka: KafkaTestKit) -> None:
    """testRollbackRecord: the first delivery fails, the second succeeds; the group commits 2 (past the
    marker) on partition 0, nothing on the empty partition 1, and the output is there once."""
    src, out = kafka.topic(partitions=2), kafka.topic()
    app = make_app(kafka)
    attempts: list[int] = []

    @app.listener(src, output=out, backoff=0)  # Spring's default back-off: the retry at once
    def handle(record: Record) -> bytes | None:
        attempts.append(record.attempt)
        if record.attempt == 1:
            raise RuntimeError("fail")
        return b"bar"

    with running(app):
        produce_in_one_transaction(kafka, src, [b"foo"])
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: 2}, 30, message="offset 2 committed")
    assert attempts == [1, 2]
    assert kafka.values(out) == [b"bar"]
    assert kafka.committed(app.group_id, src) == {0: 2}, "partition 1 has no committed offset"


def test_max_failures_recover_the_original_record_once_and_the_next_one_is_handled(kafka: KafkaTestKit) -> None:
    """testMaxFailures: the recoverer is called once with the original record after max_attempts, its original
    headers travel to the dead letter, and the next record is handled; HandlerFailed is published once per
    failed attempt with that attempt's number."""
    src = kafka.topic()
    kafka.produce(src, [{"value": b"foo", "headers": [("baz", b"qux")]}, {"value": b"bar"}])
    app = make_app(kafka)
    failed: list[tuple[bytes, int]] = []
    app.on(HandlerFailed)(lambda e: failed.append(((e.record.value if e.record else None) or b"", e.attempt)))
    data: list[bytes] = []

    @app.listener(src, max_attempts=3, dlq=True, backoff=0)
    def handle(record: Record) -> None:
        data.append(record.value or b"")
        if record.offset == 0:
            raise RuntimeError("fail for max failures")

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    assert failed == [(b"foo", 1), (b"foo", 2), (b"foo", 3)]
    assert data[-1] == b"bar" and data.count(b"bar") == 1
    [dead] = kafka.read(src + "-dlt")
    assert dead.value == b"foo" and dead.header("baz") == b"qux"
    info = parse_dead_letter_headers(dead.headers)
    assert (info.exception_fqcn, info.exception_cause_fqcn) == ("builtins.RuntimeError", "builtins.RuntimeError")
    assert info.exception_message == "fail for max failures"
    assert "fail for max failures" in (info.exception_stacktrace or "")
    assert (info.original_topic, info.original_partition, info.original_offset) == (src, 0, 0)
    assert info.consumer_group == app.group_id
    assert kafka.committed(app.group_id, src) == {0: 2}
