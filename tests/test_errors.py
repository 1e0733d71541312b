"""Unit tests for kafkatx.errors: KIP-1050 classification, typed errors, retry_call. No broker needed."""

from __future__ import annotations

import pickle
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.error import ValueDeserializationError, ValueSerializationError
from confluent_kafka.serialization import SerializationError

from kafkatx.classification import CODE_CLASSES, ErrorClass, classify, is_fatal_for_producer
from kafkatx.client.retry import retry_call
from kafkatx.errors import (
    ApplicationRecoverableError,
    InvalidConfigurationError,
    KafkaClientError,
    KafkaTxError,
    RetriableError,
    TransactionAbortableError,
)

R = ErrorClass.RETRIABLE
RR = ErrorClass.REFRESH_RETRIABLE
AB = ErrorClass.ABORTABLE
AR = ErrorClass.APPLICATION_RECOVERABLE
IC = ErrorClass.INVALID_CONFIGURATION
HF = ErrorClass.HANDLER_FAILURE

# Written out independently of the module's table, so that a change there has to be made here too.
EXPECTED: dict[str, ErrorClass] = {
    # retriable
    "_TIMED_OUT": R,
    "REQUEST_TIMED_OUT": R,
    "_TIMED_OUT_QUEUE": R,
    "NOT_ENOUGH_REPLICAS": R,
    "NOT_ENOUGH_REPLICAS_AFTER_APPEND": R,
    "INVALID_MSG": R,  # Kafka's CORRUPT_MESSAGE
    "CONCURRENT_TRANSACTIONS": R,
    "COORDINATOR_LOAD_IN_PROGRESS": R,
    "_TRANSPORT": R,
    "_ALL_BROKERS_DOWN": R,
    "UNKNOWN_LEADER_EPOCH": R,
    "UNSTABLE_OFFSET_COMMIT": R,
    # refresh metadata, then retry
    "UNKNOWN_TOPIC_OR_PART": RR,
    "_UNKNOWN_PARTITION": RR,
    "NOT_LEADER_FOR_PARTITION": RR,
    "LEADER_NOT_AVAILABLE": RR,
    "REPLICA_NOT_AVAILABLE": RR,
    "FENCED_LEADER_EPOCH": RR,
    "KAFKA_STORAGE_ERROR": RR,
    "UNKNOWN_TOPIC_ID": RR,
    "INCONSISTENT_TOPIC_ID": RR,
    "NETWORK_EXCEPTION": RR,
    "NOT_COORDINATOR": RR,
    "COORDINATOR_NOT_AVAILABLE": RR,
    # abortable
    "TRANSACTION_ABORTABLE": AB,
    "_INCONSISTENT": AB,
    "_MSG_TIMED_OUT": AB,
    "_PURGE_QUEUE": AB,
    "_PURGE_INFLIGHT": AB,
    "UNKNOWN_PRODUCER_ID": AB,
    # application recoverable
    "_FENCED": AR,
    "PRODUCER_FENCED": AR,
    "INVALID_PRODUCER_EPOCH": AR,
    "INVALID_PRODUCER_ID_MAPPING": AR,
    "FENCED_INSTANCE_ID": AR,
    "UNKNOWN_MEMBER_ID": AR,
    "ILLEGAL_GENERATION": AR,
    "STALE_MEMBER_EPOCH": AR,  # KIP-848
    "FENCED_MEMBER_EPOCH": AR,  # KIP-848
    "GROUP_ID_NOT_FOUND": AR,  # KIP-848
    "OUT_OF_ORDER_SEQUENCE_NUMBER": AR,
    "_FATAL": AR,
    "_STATE": AR,
    "_CONFLICT": AR,
    "_PREV_IN_PROGRESS": AR,
    # invalid configuration
    "SASL_AUTHENTICATION_FAILED": IC,
    "_AUTHENTICATION": IC,
    "UNSUPPORTED_SASL_MECHANISM": IC,
    "ILLEGAL_SASL_STATE": IC,
    "_SSL": IC,
    "TOPIC_AUTHORIZATION_FAILED": IC,
    "GROUP_AUTHORIZATION_FAILED": IC,
    "CLUSTER_AUTHORIZATION_FAILED": IC,
    "TRANSACTIONAL_ID_AUTHORIZATION_FAILED": IC,
    "UNSUPPORTED_VERSION": IC,
    "_UNSUPPORTED_FEATURE": IC,
    "UNSUPPORTED_FOR_MESSAGE_FORMAT": IC,
    "INVALID_RECORD": IC,
    "INVALID_REQUIRED_ACKS": IC,
    "MSG_SIZE_TOO_LARGE": IC,
    "RECORD_LIST_TOO_LARGE": IC,
    "TOPIC_EXCEPTION": IC,
    "INVALID_TRANSACTION_TIMEOUT": IC,
    "UNRELEASED_INSTANCE_ID": IC,  # KIP-848
    "UNSUPPORTED_ASSIGNOR": IC,  # KIP-848
    "INVALID_REPLICATION_FACTOR": IC,
    "_INVALID_ARG": IC,
    "_UNKNOWN_TOPIC": IC,
    # the record's data is at fault
    "_KEY_SERIALIZATION": HF,
    "_VALUE_SERIALIZATION": HF,
    "_KEY_DESERIALIZATION": HF,
    "_VALUE_DESERIALIZATION": HF,
}

EXCEPTION_TYPES: dict[ErrorClass, type[KafkaClientError]] = {
    R: RetriableError,
    RR: RetriableError,
    AB: TransactionAbortableError,
    AR: ApplicationRecoverableError,
    IC: InvalidConfigurationError,
}

TYPED = (RetriableError, TransactionAbortableError, ApplicationRecoverableError, InvalidConfigurationError)


def code(name: str) -> int:
    return getattr(KafkaError, name)


def kafka_exc(name: str, reason: str | None = None, **flags: bool) -> KafkaException:
    return KafkaException(KafkaError(code(name), reason, **flags) if reason else KafkaError(code(name), **flags))


# --- classify ---------------------------------------------------------------------------------


def test_every_expected_code_name_exists_in_confluent_kafka() -> None:
    missing = [name for name in [*EXPECTED, "INVALID_TXN_STATE"] if not hasattr(KafkaError, name)]
    assert missing == []


def test_module_table_matches_the_expected_table_exactly() -> None:
    by_name = {KafkaError(c).name(): cls for c, cls in CODE_CLASSES.items()}
    assert by_name == EXPECTED


@pytest.mark.parametrize(("name", "expected"), sorted(EXPECTED.items()))
def test_classify_kafka_error(name: str, expected: ErrorClass) -> None:
    assert classify(KafkaError(code(name))) is expected


@pytest.mark.parametrize(("name", "expected"), sorted(EXPECTED.items()))
def test_classify_kafka_exception(name: str, expected: ErrorClass) -> None:
    assert classify(KafkaException(KafkaError(code(name), "reason"))) is expected


@pytest.mark.parametrize(("name", "expected"), sorted(EXPECTED.items()))
def test_classify_kafkatx_error(name: str, expected: ErrorClass) -> None:
    wrapped = KafkaTxError.from_kafka(KafkaException(KafkaError(code(name))), operation="commit_transaction")
    assert classify(wrapped) is expected


@pytest.mark.parametrize("wrap", [lambda e: e, KafkaException], ids=["KafkaError", "KafkaException"])
def test_invalid_txn_state_depends_on_the_path(wrap: Callable[[KafkaError], object]) -> None:
    err = wrap(KafkaError(KafkaError.INVALID_TXN_STATE))
    assert classify(err, path="produce") is AB
    assert classify(err, path="transaction") is AR
    assert classify(err) is AR  # the default path is the transactional API


def test_path_does_not_change_other_codes() -> None:
    for name, expected in EXPECTED.items():
        assert classify(KafkaError(code(name)), path="produce") is expected, name


@pytest.mark.parametrize("unknown", [KafkaError(31337), KafkaError(KafkaError.REBALANCE_IN_PROGRESS)])
def test_unknown_code_without_flags_is_application_recoverable(unknown: KafkaError) -> None:
    assert classify(unknown) is AR
    assert classify(KafkaException(unknown)) is AR


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"fatal": True}, AR),
        ({"txn_requires_abort": True}, AB),
        ({"retriable": True}, R),
        ({"fatal": True, "retriable": True}, AR),
        ({"fatal": True, "txn_requires_abort": True}, AR),
        ({"txn_requires_abort": True, "retriable": True}, AB),
        ({}, AR),
    ],
)
def test_unlisted_code_falls_back_to_librdkafka_flags(flags: dict[str, bool], expected: ErrorClass) -> None:
    err = KafkaError(KafkaError.REBALANCE_IN_PROGRESS, "rebalancing", **flags)
    assert classify(err) is expected
    assert classify(KafkaException(err)) is expected


@pytest.mark.parametrize(
    ("name", "flags", "expected"),
    [
        # flags escalate: librdkafka's state machine has already moved on
        ("CONCURRENT_TRANSACTIONS", {"txn_requires_abort": True}, AB),
        ("NOT_COORDINATOR", {"txn_requires_abort": True}, AB),
        ("_TIMED_OUT", {"fatal": True}, AR),
        ("_INCONSISTENT", {"fatal": True}, AR),
        # flags never lower the table's class
        ("_TIMED_OUT", {"retriable": True}, R),
        ("_INCONSISTENT", {"retriable": True}, AB),
        ("_PREV_IN_PROGRESS", {"retriable": True}, AR),
        ("ILLEGAL_GENERATION", {"txn_requires_abort": True}, AR),
        ("INVALID_PRODUCER_ID_MAPPING", {"txn_requires_abort": True}, AR),
        # invalid configuration is final, whatever librdkafka says
        ("TOPIC_AUTHORIZATION_FAILED", {"txn_requires_abort": True}, IC),
        ("GROUP_AUTHORIZATION_FAILED", {"txn_requires_abort": True}, IC),
        ("MSG_SIZE_TOO_LARGE", {"txn_requires_abort": True}, IC),
        ("TRANSACTIONAL_ID_AUTHORIZATION_FAILED", {"fatal": True}, IC),
        # serialization errors stay with the handler
        ("_VALUE_SERIALIZATION", {"fatal": True}, HF),
    ],
)
def test_table_codes_with_flags(name: str, flags: dict[str, bool], expected: ErrorClass) -> None:
    assert classify(KafkaError(code(name), "reason", **flags)) is expected


def test_fatal_flag_escalates_invalid_txn_state_on_the_produce_path() -> None:
    err = KafkaError(KafkaError.INVALID_TXN_STATE, "fatal", fatal=True)
    assert classify(err, path="produce") is AR


@pytest.mark.parametrize(
    "exc",
    [ValueError("bad payload"), RuntimeError("boom"), KeyError("k"), TimeoutError("handler's own timeout")],
)
def test_non_kafka_exception_is_a_handler_failure(exc: Exception) -> None:
    assert classify(exc) is HF


def test_non_kafka_exception_is_not_unwrapped_through_its_cause() -> None:
    try:
        try:
            raise kafka_exc("_FENCED", "fenced", fatal=True)
        except KafkaException as inner:
            raise RuntimeError("handler wrapped it") from inner
    except RuntimeError as outer:
        assert classify(outer) is HF


@pytest.mark.parametrize(
    "exc",
    [
        ValueSerializationError(ValueError("cannot encode")),
        ValueDeserializationError(ValueError("cannot decode")),
        SerializationError("a serializer's own message"),
    ],
)
def test_serialization_errors_are_handler_failures(exc: KafkaException) -> None:
    assert classify(exc) is HF


@pytest.mark.parametrize("exc", [KafkaException(), KafkaException("no KafkaError inside")])
def test_kafka_exception_without_kafka_error_is_application_recoverable(exc: KafkaException) -> None:
    assert classify(exc) is AR


def test_kafka_exception_carrying_an_int_code() -> None:
    assert classify(KafkaException(KafkaError.NOT_COORDINATOR)) is RR


def test_classify_kafkatx_error_uses_its_own_class() -> None:
    # A timed-out commit whose retries ran out carries a retriable code but is abortable.
    exhausted = TransactionAbortableError(
        "ran out", error=KafkaError(KafkaError._TIMED_OUT), operation="commit_transaction"
    )
    assert classify(exhausted) is AB
    assert classify(InvalidConfigurationError("max_attempts must be >= 1, got 0")) is IC
    produced = KafkaTxError.from_kafka(KafkaError(KafkaError.INVALID_TXN_STATE), path="produce")
    assert classify(produced, path="transaction") is AB


@pytest.mark.parametrize(
    ("error", "fatal"),
    [
        (KafkaError(KafkaError._FENCED), True),
        (KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), True),
        (KafkaError(KafkaError._TIMED_OUT), False),
        (KafkaError(KafkaError.NOT_COORDINATOR), False),
        (KafkaError(KafkaError.TRANSACTION_ABORTABLE), False),
        (ValueError("handler"), False),
        (KafkaError(KafkaError.REBALANCE_IN_PROGRESS, "x", fatal=True), True),
    ],
)
def test_is_fatal_for_producer(error: object, fatal: bool) -> None:
    assert is_fatal_for_producer(error) is fatal


def test_is_fatal_for_producer_respects_the_path() -> None:
    err = KafkaError(KafkaError.INVALID_TXN_STATE)
    assert is_fatal_for_producer(err, path="transaction") is True
    assert is_fatal_for_producer(err, path="produce") is False


# --- typed errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "expected"), sorted((n, c) for n, c in EXPECTED.items() if c is not HF))
def test_from_kafka_picks_the_subclass_and_carries_the_error(name: str, expected: ErrorClass) -> None:
    original = KafkaException(KafkaError(code(name), "broker said no"))
    err = KafkaTxError.from_kafka(original, operation="send_offsets_to_transaction")
    assert type(err) is EXCEPTION_TYPES[expected]
    assert err.error_class is expected
    assert err.error is not None and err.error.code() == code(name)
    assert err.code == code(name) and err.code_name == name
    assert err.operation == "send_offsets_to_transaction"
    assert name in str(err)
    assert "send_offsets_to_transaction" in str(err)
    assert "broker said no" in str(err)
    assert err.__cause__ is original


def test_from_kafka_accepts_a_bare_kafka_error() -> None:
    error = KafkaError(KafkaError._FENCED, "fenced by a newer instance", fatal=True)
    err = KafkaTxError.from_kafka(error)
    assert isinstance(err, ApplicationRecoverableError)
    assert err.error is error
    assert err.operation is None
    assert err.__cause__ is None
    assert str(err).startswith("_FENCED: ")
    assert "transactional.id" in str(err)


def test_from_kafka_uses_the_path() -> None:
    error = KafkaError(KafkaError.INVALID_TXN_STATE)
    assert isinstance(KafkaTxError.from_kafka(error, path="produce"), TransactionAbortableError)
    assert isinstance(KafkaTxError.from_kafka(error, path="transaction"), ApplicationRecoverableError)


def test_from_kafka_returns_a_kafkatx_error_unchanged() -> None:
    original = InvalidConfigurationError("bad setting")
    assert KafkaTxError.from_kafka(original, operation="anything") is original


def test_abortable_error_during_abort_is_application_recoverable() -> None:
    err = KafkaTxError.from_kafka(kafka_exc("TRANSACTION_ABORTABLE"), operation="abort_transaction")
    assert type(err) is ApplicationRecoverableError
    assert err.error_class is AR
    assert err.code_name == "TRANSACTION_ABORTABLE"
    # other operations keep it abortable
    assert (
        type(KafkaTxError.from_kafka(kafka_exc("TRANSACTION_ABORTABLE"), operation="commit_transaction"))
        is TransactionAbortableError
    )


def test_from_kafka_on_a_handler_failure_gives_a_plain_kafkatx_error() -> None:
    boom = ValueError("boom")
    err = KafkaTxError.from_kafka(boom, operation="handle")
    assert type(err) is KafkaClientError
    assert not isinstance(err, TYPED)
    assert err.error_class is HF
    assert err.error is None
    assert err.__cause__ is boom
    assert "ValueError" in str(err) and "boom" in str(err) and "handle" in str(err)


@pytest.mark.parametrize(
    ("name", "operation", "needles"),
    [
        ("MSG_SIZE_TOO_LARGE", "produce", ["message.max.bytes", "max.message.bytes"]),
        ("UNSUPPORTED_VERSION", "init_transactions", ["broker version"]),
        ("_UNSUPPORTED_FEATURE", "send_offsets_to_transaction", ["broker version"]),
        ("TOPIC_AUTHORIZATION_FAILED", "commit_transaction", ["ACL", "WRITE"]),
        ("GROUP_AUTHORIZATION_FAILED", "send_offsets_to_transaction", ["ACL", "READ", "group"]),
        ("TRANSACTIONAL_ID_AUTHORIZATION_FAILED", "init_transactions", ["ACL", "TransactionalId"]),
        ("CLUSTER_AUTHORIZATION_FAILED", "init_transactions", ["IDEMPOTENT_WRITE"]),
        ("SASL_AUTHENTICATION_FAILED", "init_transactions", ["sasl.mechanism"]),
        ("INVALID_TRANSACTION_TIMEOUT", "init_transactions", ["transaction.timeout.ms", "transaction.max.timeout.ms"]),
        ("INVALID_REQUIRED_ACKS", "produce", ["acks=all"]),
        ("_UNKNOWN_TOPIC", "produce", ["does not exist"]),
        ("_FENCED", "commit_transaction", ["transactional.id"]),
    ],
)
def test_messages_say_what_to_check(name: str, operation: str, needles: list[str]) -> None:
    message = str(KafkaTxError.from_kafka(KafkaError(code(name)), operation=operation))
    assert message.startswith(f"{name} in {operation}: ")
    for needle in needles:
        assert needle in message


def test_invalid_configuration_error_with_just_a_message() -> None:
    err = InvalidConfigurationError("max_attempts must be >= 1, got 0")
    assert str(err) == "max_attempts must be >= 1, got 0"
    assert err.error is None and err.operation is None and err.code is None and err.code_name is None
    assert err.error_class is IC
    assert isinstance(err, KafkaTxError)


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (RetriableError, R),
        (TransactionAbortableError, AB),
        (ApplicationRecoverableError, AR),
        (InvalidConfigurationError, IC),
    ],
)
def test_each_subclass_has_its_default_class(cls: type[KafkaClientError], expected: ErrorClass) -> None:
    err = cls(operation="commit_transaction")
    assert issubclass(cls, KafkaTxError)
    assert err.error_class is expected
    assert "commit_transaction" in str(err)


def test_kafkatx_errors_survive_pickling() -> None:
    err = KafkaTxError.from_kafka(kafka_exc("_FENCED", "fenced", fatal=True), operation="commit_transaction")
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is ApplicationRecoverableError
    assert str(copy) == str(err)
    assert copy.error_class is AR and copy.operation == "commit_transaction"
    assert copy.error is not None and copy.error.code() == KafkaError._FENCED and copy.error.fatal()


# --- retry_call -------------------------------------------------------------------------------


class FakeTime:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


class Flaky:
    """Raises the given exceptions in turn, then returns ``result``."""

    def __init__(self, *failures: BaseException, result: object = "ok") -> None:
        self.failures = list(failures)
        self.result = result
        self.calls = 0

    def __call__(self) -> object:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return self.result


class Always:
    """Raises a fresh copy of one Kafka error on every call."""

    def __init__(self, name: str, reason: str = "still failing", **flags: bool) -> None:
        self.name, self.reason, self.flags = name, reason, flags
        self.calls = 0
        self.raised: list[KafkaException] = []

    def __call__(self) -> object:
        self.calls += 1
        exc = kafka_exc(self.name, self.reason, **self.flags)
        self.raised.append(exc)
        raise exc


def timed_out() -> KafkaException:
    return kafka_exc("_TIMED_OUT", "Timed out waiting for operation to finish, retry call to resume", retriable=True)


def test_retry_call_returns_at_once_when_fn_succeeds() -> None:
    t = FakeTime()
    fn = Flaky(result=42)
    assert retry_call(fn, operation="commit_transaction", timeout=10, sleep=t.sleep, clock=t.clock) == 42
    assert fn.calls == 1 and t.sleeps == []


def test_retry_call_succeeds_after_retriable_failures() -> None:
    t = FakeTime()
    fn = Flaky(timed_out(), timed_out(), timed_out(), result="committed")
    seen: list[tuple[ErrorClass, int, int]] = []
    result = retry_call(
        fn,
        operation="commit_transaction",
        timeout=10,
        sleep=t.sleep,
        clock=t.clock,
        on_retry=lambda cls, err, attempt: seen.append((cls, err.code(), attempt)),
    )
    assert result == "committed"
    assert fn.calls == 4
    assert len(t.sleeps) == 3
    assert seen == [(R, KafkaError._TIMED_OUT, 1), (R, KafkaError._TIMED_OUT, 2), (R, KafkaError._TIMED_OUT, 3)]


def test_retry_call_backoff_grows_from_about_50ms_and_is_capped() -> None:
    t = FakeTime()
    with pytest.raises(TransactionAbortableError):
        retry_call(Always("_TIMED_OUT"), operation="commit_transaction", timeout=30, sleep=t.sleep, clock=t.clock)
    assert 0.05 <= t.sleeps[0] <= 0.1
    assert t.sleeps[1] >= 0.1 and t.sleeps[2] >= 0.2  # exponential
    assert max(t.sleeps) <= 1.05  # cap plus jitter
    assert len(set(t.sleeps[6:-1])) > 1  # jitter: capped waits are not all equal


def test_retry_call_refreshes_metadata_before_retrying_refresh_retriable_errors() -> None:
    t = FakeTime()
    events: list[str] = []
    fn = Flaky(kafka_exc("NOT_COORDINATOR"), kafka_exc("UNKNOWN_TOPIC_OR_PART"), result="ok")

    def tracked() -> object:
        events.append("call")
        return fn()

    result = retry_call(
        tracked,
        operation="send_offsets_to_transaction",
        timeout=10,
        refresh=lambda: events.append("refresh"),
        on_retry=lambda cls, err, attempt: events.append(f"on_retry:{cls.name}"),
        sleep=lambda s: (events.append("sleep"), t.sleep(s)),
        clock=t.clock,
    )
    assert result == "ok"
    assert events == [
        "call",
        "refresh",
        "on_retry:REFRESH_RETRIABLE",
        "sleep",
        "call",
        "refresh",
        "on_retry:REFRESH_RETRIABLE",
        "sleep",
        "call",
    ]


def test_retry_call_does_not_refresh_for_plain_retriable_errors() -> None:
    t = FakeTime()
    refreshes: list[None] = []
    fn = Flaky(kafka_exc("CONCURRENT_TRANSACTIONS"), kafka_exc("_TRANSPORT"))
    retry_call(
        fn,
        operation="commit_transaction",
        timeout=10,
        refresh=lambda: refreshes.append(None),
        sleep=t.sleep,
        clock=t.clock,
    )
    assert fn.calls == 3
    assert refreshes == []


def test_a_failing_refresh_does_not_stop_the_retries() -> None:
    t = FakeTime()

    def broken_refresh() -> None:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT))

    fn = Flaky(kafka_exc("LEADER_NOT_AVAILABLE"), result="ok")
    assert (
        retry_call(
            fn, operation="produce", path="produce", timeout=10, refresh=broken_refresh, sleep=t.sleep, clock=t.clock
        )
        == "ok"
    )
    assert fn.calls == 2


def test_exhausted_retries_in_a_transaction_become_abortable() -> None:
    t = FakeTime()
    fn = Always("_TIMED_OUT", "Timed out waiting for operation to finish, retry call to resume", retriable=True)
    with pytest.raises(TransactionAbortableError) as info:
        retry_call(fn, operation="commit_transaction", timeout=5, sleep=t.sleep, clock=t.clock)
    err = info.value
    assert err.error_class is AB
    assert err.operation == "commit_transaction"
    assert err.error is not None and err.error.code() == KafkaError._TIMED_OUT
    assert err.__cause__ is fn.raised[-1]
    assert "_TIMED_OUT" in str(err) and "commit_transaction" in str(err)
    assert fn.calls > 3
    # the waits stop at the deadline
    assert t.now - 1000.0 == pytest.approx(5.0)
    assert sum(t.sleeps) <= 5.0 + 1e-9


@pytest.mark.parametrize(("path", "operation"), [("produce", "flush"), ("transaction", "init_transactions")])
def test_exhausted_retries_outside_a_transaction_are_retriable_errors(path: str, operation: str) -> None:
    t = FakeTime()
    fn = Always("NOT_COORDINATOR")
    with pytest.raises(RetriableError) as info:
        retry_call(fn, operation=operation, path=path, timeout=3, sleep=t.sleep, clock=t.clock)  # type: ignore[arg-type]
    assert not isinstance(info.value, TransactionAbortableError)
    assert info.value.error_class is RR
    assert info.value.__cause__ is fn.raised[-1]
    assert fn.calls > 1


def test_exhausted_retries_of_abort_transaction_are_application_recoverable() -> None:
    t = FakeTime()
    with pytest.raises(ApplicationRecoverableError) as info:
        retry_call(Always("_TIMED_OUT"), operation="abort_transaction", timeout=2, sleep=t.sleep, clock=t.clock)
    assert info.value.error_class is AR


def test_zero_timeout_means_a_single_attempt() -> None:
    t = FakeTime()
    fn = Always("REQUEST_TIMED_OUT")
    with pytest.raises(TransactionAbortableError):
        retry_call(fn, operation="commit_transaction", timeout=0, sleep=t.sleep, clock=t.clock)
    assert fn.calls == 1 and t.sleeps == []


def test_negative_timeout_is_rejected() -> None:
    with pytest.raises(InvalidConfigurationError, match="timeout"):
        retry_call(lambda: None, operation="commit_transaction", timeout=-1)


def test_fatal_error_raises_application_recoverable_after_one_call() -> None:
    t = FakeTime()
    fn = Always("_FENCED", "fenced by a newer instance", fatal=True)
    with pytest.raises(ApplicationRecoverableError) as info:
        retry_call(fn, operation="commit_transaction", timeout=10, sleep=t.sleep, clock=t.clock)
    assert fn.calls == 1 and t.sleeps == []
    assert info.value.code_name == "_FENCED"
    assert info.value.operation == "commit_transaction"
    assert info.value.__cause__ is fn.raised[0]


def test_authorization_error_raises_invalid_configuration_after_one_call() -> None:
    t = FakeTime()
    fn = Always("TOPIC_AUTHORIZATION_FAILED", "Topic authorization failed", txn_requires_abort=True)
    with pytest.raises(InvalidConfigurationError) as info:
        retry_call(fn, operation="commit_transaction", timeout=10, sleep=t.sleep, clock=t.clock)
    assert fn.calls == 1
    assert "TOPIC_AUTHORIZATION_FAILED" in str(info.value) and "ACL" in str(info.value)


def test_abortable_error_raises_at_once() -> None:
    t = FakeTime()
    fn = Always("_INCONSISTENT", "1 message(s) failed delivery", txn_requires_abort=True)
    with pytest.raises(TransactionAbortableError):
        retry_call(fn, operation="commit_transaction", timeout=10, sleep=t.sleep, clock=t.clock)
    assert fn.calls == 1


def test_retriable_code_flagged_abortable_is_not_retried() -> None:
    t = FakeTime()
    fn = Always("CONCURRENT_TRANSACTIONS", "gave up", txn_requires_abort=True)
    with pytest.raises(TransactionAbortableError):
        retry_call(fn, operation="send_offsets_to_transaction", timeout=10, sleep=t.sleep, clock=t.clock)
    assert fn.calls == 1


def test_abortable_error_from_abort_transaction_is_application_recoverable() -> None:
    t = FakeTime()
    fn = Always("TRANSACTION_ABORTABLE")
    with pytest.raises(ApplicationRecoverableError):
        retry_call(fn, operation="abort_transaction", timeout=10, sleep=t.sleep, clock=t.clock)
    assert fn.calls == 1


def test_invalid_txn_state_follows_the_path_in_retry_call() -> None:
    t = FakeTime()
    with pytest.raises(TransactionAbortableError):
        retry_call(
            Always("INVALID_TXN_STATE"), operation="produce", path="produce", timeout=10, sleep=t.sleep, clock=t.clock
        )
    with pytest.raises(ApplicationRecoverableError):
        retry_call(
            Always("INVALID_TXN_STATE"), operation="commit_transaction", timeout=10, sleep=t.sleep, clock=t.clock
        )


@pytest.mark.parametrize(
    "exc",
    [ValueError("handler bug"), ValueSerializationError(ValueError("cannot encode"))],
    ids=["ValueError", "ValueSerializationError"],
)
def test_handler_failures_propagate_unchanged(exc: Exception) -> None:
    t = FakeTime()
    fn = Flaky(exc)
    with pytest.raises(type(exc)) as info:
        retry_call(fn, operation="produce", timeout=10, sleep=t.sleep, clock=t.clock)
    assert info.value is exc
    assert fn.calls == 1 and t.sleeps == []


def test_retry_call_with_the_real_clock_stops_near_the_deadline() -> None:
    fn = Always("_TRANSPORT")
    started = time.monotonic()
    with pytest.raises(RetriableError):
        retry_call(fn, operation="flush", path="produce", timeout=0.2)
    elapsed = time.monotonic() - started
    assert 0.2 <= elapsed < 0.6
    assert fn.calls >= 2


# --- docs -------------------------------------------------------------------------------------


def test_errors_doc_names_every_classified_code() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "ERRORS.md").read_text(encoding="utf-8")
    names = {KafkaError(c).name() for c in CODE_CLASSES} | {"INVALID_TXN_STATE"}
    missing = sorted(n for n in names if not re.search(rf"`{re.escape(n)}`", doc))
    assert missing == []


def test_a_first_failure_made_elsewhere_is_replayed_as_attempt_one() -> None:
    # The producer sends the offsets and commits in one call on its helper thread; when that fails, the call
    # that failed continues in its own retry loop, as if its first attempt had been made there.
    t = FakeTime()
    fn = Flaky()
    first = kafka_exc("COORDINATOR_LOAD_IN_PROGRESS", retriable=True)
    assert (
        retry_call(
            fn, operation="send_offsets_to_transaction", timeout=10, sleep=t.sleep, clock=t.clock, first_failure=first
        )
        == "ok"
    )
    assert fn.calls == 1 and len(t.sleeps) == 1, (
        "one back-off, then one more call: the replayed attempt was not repeated"
    )
    fenced = kafka_exc("_FENCED", "fenced by a newer instance", fatal=True)
    with pytest.raises(ApplicationRecoverableError) as info:
        retry_call(
            Flaky(), operation="commit_transaction", timeout=10, sleep=t.sleep, clock=t.clock, first_failure=fenced
        )
    assert info.value.operation == "commit_transaction" and info.value.__cause__ is fenced
