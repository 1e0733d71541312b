"""Kafka error classification (KIP-1050) and the exceptions kafkatx raises.

librdkafka does not implement KIP-1050: it only marks each error with three
flags (``fatal()``, ``txn_requires_abort()``, ``retriable()``), and those
flags sometimes disagree with the KIP (for instance, a missing topic ACL is
flagged abortable, although aborting and retrying can never fix it). kafkatx
needs one answer per error, so :func:`classify` decides in this order:

1. A handler's own exception (anything that is not a Kafka error), and a
   (de)serialization error, is :attr:`ErrorClass.HANDLER_FAILURE`: the data or
   the code is at fault, so the after-rollback processor deals with it.
2. A code listed in the table below gets the KIP-1050 class (the Java client's
   exception hierarchy from Kafka 4.1 where the KIP itself is silent).
3. librdkafka's flags may *escalate* that class but never lower it: a
   ``fatal()`` error means this producer instance can never be used again,
   and ``txn_requires_abort()`` means librdkafka has already stopped retrying
   and put the transaction in its abortable state, so retrying the call is
   pointless. INVALID_CONFIGURATION is final: recreating a producer does not
   grant a missing ACL.
4. A code missing from the table falls back to the flags alone (fatal, then
   abortable, then retriable), and to APPLICATION_RECOVERABLE when no flag is
   set, the KIP's rule for unknown errors.

Codes where kafkatx deliberately differs from librdkafka's flags, or makes a
choice the KIP leaves open (docs/ERRORS.md explains each):

* TOPIC/GROUP_AUTHORIZATION_FAILED, MSG_SIZE_TOO_LARGE, RECORD_LIST_TOO_LARGE,
  UNSUPPORTED_FOR_MESSAGE_FORMAT, INVALID_RECORD: librdkafka flags them
  abortable when they fail a produce or offset-commit request; kafkatx says
  INVALID_CONFIGURATION (the KIP does so for the
  authorization, batch-size and record errors; MSG_SIZE_TOO_LARGE, Java's
  RecordTooLargeException, sits outside the KIP's hierarchy, and kafkatx
  treats it like its batch sibling because the fix is a size setting).
* ILLEGAL_GENERATION, UNKNOWN_MEMBER_ID, FENCED_INSTANCE_ID,
  INVALID_PRODUCER_ID_MAPPING: flagged abortable by librdkafka;
  APPLICATION_RECOVERABLE per the KIP (and KAFKA-18019 for the last one).
* UNKNOWN_PRODUCER_ID: outside the KIP; kafkatx follows librdkafka (KIP-360
  epoch bump, then abort): ABORTABLE.
* INVALID_TXN_STATE: librdkafka flags it fatal on the transaction API; the
  KIP makes it ABORTABLE on the produce path and APPLICATION_RECOVERABLE on
  the transaction path, so :func:`classify` takes a ``path`` argument.
* _MSG_TIMED_OUT, _PURGE_QUEUE, _PURGE_INFLIGHT: a record's delivery already
  failed, so the only way forward is to abort: ABORTABLE.
* _UNKNOWN_TOPIC: librdkafka reports it only after it has waited for the
  topic to appear in metadata (``topic.metadata.propagation.max.ms``), so a
  missing topic is a deployment error: INVALID_CONFIGURATION. The broker's
  UNKNOWN_TOPIC_OR_PART stays REFRESH_RETRIABLE as in the KIP.
* NETWORK_EXCEPTION is REFRESH_RETRIABLE and UNKNOWN_LEADER_EPOCH is
  RETRIABLE, following the Java hierarchy (NetworkException extends
  InvalidMetadataException; UnknownLeaderEpochException does not).
* _STATE, _CONFLICT, _PREV_IN_PROGRESS, _FATAL: illegal client states
  (Java's IllegalStateException), which the KIP makes APPLICATION_RECOVERABLE
  even though librdkafka flags some of them retriable.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Final, Literal, TypeVar

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.serialization import SerializationError
from tenacity import RetryCallState, Retrying, retry_if_exception, wait_exponential, wait_random

__all__ = [
    "ErrorClass",
    "ErrorPath",
    "CODE_CLASSES",
    "classify",
    "is_fatal_for_producer",
    "KafkaTxError",
    "RetriableError",
    "TransactionAbortableError",
    "ApplicationRecoverableError",
    "InvalidConfigurationError",
    "retry_call",
    "ABORT_OPERATION",
    "INIT_OPERATION",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Where an error was raised. Only INVALID_TXN_STATE depends on it, and
#: :func:`retry_call` uses it to decide what "retries ran out" means.
ErrorPath = Literal["transaction", "produce"]

#: Operation names :func:`retry_call` and :meth:`KafkaTxError.from_kafka` treat specially.
ABORT_OPERATION: Final = "abort_transaction"
INIT_OPERATION: Final = "init_transactions"


class ErrorClass(enum.Enum):
    """The KIP-1050 error classes, plus one for failures of the handler itself."""

    #: Retried inside kafkatx with backoff; never reaches the handler.
    RETRIABLE = "retriable"
    #: Like RETRIABLE, but kafkatx refreshes metadata before each retry.
    REFRESH_RETRIABLE = "refresh_retriable"
    #: kafkatx aborts the transaction, rewinds the consumer and reprocesses the batch.
    ABORTABLE = "abortable"
    #: kafkatx closes the producer, creates a new one with the same transactional.id and rewinds.
    APPLICATION_RECOVERABLE = "application_recoverable"
    #: kafkatx stops the container and names the setting or permission to fix.
    INVALID_CONFIGURATION = "invalid_configuration"
    #: The handler (or (de)serialization) failed: the after-rollback processor retries or dead-letters the record.
    HANDLER_FAILURE = "handler_failure"

    @property
    def retriable(self) -> bool:
        """True for the two classes kafkatx retries by itself."""
        return self in (ErrorClass.RETRIABLE, ErrorClass.REFRESH_RETRIABLE)

    @property
    def reaction(self) -> str:
        """What kafkatx does about an error of this class, for messages and logs."""
        return _REACTIONS[self]


_REACTIONS: Final[dict[ErrorClass, str]] = {
    ErrorClass.RETRIABLE: "kafkatx retries the call with backoff",
    ErrorClass.REFRESH_RETRIABLE: "kafkatx refreshes metadata and retries the call with backoff",
    ErrorClass.ABORTABLE: "kafkatx aborts the transaction and reprocesses the batch",
    ErrorClass.APPLICATION_RECOVERABLE: "kafkatx closes the producer, creates a new one and resumes from the committed offsets",
    ErrorClass.INVALID_CONFIGURATION: "kafkatx stops the container; fix the configuration or permissions and restart",
    ErrorClass.HANDLER_FAILURE: "the after-rollback processor retries or dead-letters the record",
}

# Escalation order used when librdkafka's flags are stronger than the table.
_SEVERITY: Final[dict[ErrorClass, int]] = {
    ErrorClass.RETRIABLE: 0,
    ErrorClass.REFRESH_RETRIABLE: 0,
    ErrorClass.ABORTABLE: 1,
    ErrorClass.APPLICATION_RECOVERABLE: 2,
}

_E = KafkaError

_RETRIABLE_CODES: Final = (
    _E._TIMED_OUT,  # client-side timeout; on a txn API call: "retry call to resume"
    _E._TIMED_OUT_QUEUE,  # librdkafka normalises it to _TIMED_OUT for txn calls
    _E.REQUEST_TIMED_OUT,
    _E.NOT_ENOUGH_REPLICAS,
    _E.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
    _E.INVALID_MSG,  # Kafka's CORRUPT_MESSAGE (code 2), Java's CorruptRecordException
    _E.CONCURRENT_TRANSACTIONS,
    _E.COORDINATOR_LOAD_IN_PROGRESS,
    _E._TRANSPORT,
    _E._ALL_BROKERS_DOWN,  # same cause as _TRANSPORT, for every broker at once
    _E.UNKNOWN_LEADER_EPOCH,  # Java: RetriableException, not InvalidMetadataException
    _E.UNSTABLE_OFFSET_COMMIT,  # committed offsets of a pending transaction; wait for it
)

_REFRESH_RETRIABLE_CODES: Final = (
    _E.UNKNOWN_TOPIC_OR_PART,
    _E._UNKNOWN_PARTITION,  # local view of the same condition
    _E.NOT_LEADER_FOR_PARTITION,  # Kafka's NOT_LEADER_OR_FOLLOWER
    _E.LEADER_NOT_AVAILABLE,
    _E.REPLICA_NOT_AVAILABLE,
    _E.FENCED_LEADER_EPOCH,
    _E.KAFKA_STORAGE_ERROR,
    _E.UNKNOWN_TOPIC_ID,
    _E.INCONSISTENT_TOPIC_ID,
    _E.NETWORK_EXCEPTION,  # Java: NetworkException extends InvalidMetadataException
    _E.NOT_COORDINATOR,
    _E.COORDINATOR_NOT_AVAILABLE,
)

_ABORTABLE_CODES: Final = (
    _E.TRANSACTION_ABORTABLE,
    _E._INCONSISTENT,  # commit_transaction: some records of the transaction failed delivery
    _E._MSG_TIMED_OUT,  # a record outlived message.timeout.ms; librdkafka has given up on it
    _E._PURGE_QUEUE,  # records purged because the transaction is being aborted
    _E._PURGE_INFLIGHT,
    _E.UNKNOWN_PRODUCER_ID,  # KIP-360: librdkafka bumps the epoch, the transaction must abort
)

_APPLICATION_RECOVERABLE_CODES: Final = (
    _E._FENCED,  # librdkafka's name for PRODUCER_FENCED / INVALID_PRODUCER_EPOCH
    _E.PRODUCER_FENCED,
    _E.INVALID_PRODUCER_EPOCH,
    _E.INVALID_PRODUCER_ID_MAPPING,
    _E.FENCED_INSTANCE_ID,
    _E.UNKNOWN_MEMBER_ID,
    _E.ILLEGAL_GENERATION,
    _E.OUT_OF_ORDER_SEQUENCE_NUMBER,
    _E._FATAL,
    _E._STATE,
    _E._CONFLICT,
    _E._PREV_IN_PROGRESS,
)

# The application-recoverable codes that mean "another producer now holds the transactional.id".
_FENCING_CODES: Final = frozenset({_E._FENCED, _E.PRODUCER_FENCED, _E.INVALID_PRODUCER_EPOCH, _E._FATAL})

_INVALID_CONFIGURATION_CODES: Final = (
    _E.SASL_AUTHENTICATION_FAILED,
    _E._AUTHENTICATION,
    _E.UNSUPPORTED_SASL_MECHANISM,
    _E.ILLEGAL_SASL_STATE,
    _E._SSL,
    _E.TOPIC_AUTHORIZATION_FAILED,
    _E.GROUP_AUTHORIZATION_FAILED,
    _E.CLUSTER_AUTHORIZATION_FAILED,
    _E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    _E.UNSUPPORTED_VERSION,
    _E._UNSUPPORTED_FEATURE,
    _E.UNSUPPORTED_FOR_MESSAGE_FORMAT,
    _E.INVALID_RECORD,
    _E.INVALID_REQUIRED_ACKS,
    _E.MSG_SIZE_TOO_LARGE,
    _E.RECORD_LIST_TOO_LARGE,
    _E.TOPIC_EXCEPTION,  # Kafka's INVALID_TOPIC_EXCEPTION
    _E.INVALID_TRANSACTION_TIMEOUT,
    _E.INVALID_REPLICATION_FACTOR,
    _E._INVALID_ARG,
    _E._UNKNOWN_TOPIC,
)

# Failures of the record's data, not of Kafka: the after-rollback processor can dead-letter them.
_HANDLER_FAILURE_CODES: Final = (
    _E._KEY_SERIALIZATION,
    _E._VALUE_SERIALIZATION,
    _E._KEY_DESERIALIZATION,
    _E._VALUE_DESERIALIZATION,
)


def _build_table() -> dict[int, ErrorClass]:
    table: dict[int, ErrorClass] = {}
    for codes, cls in (
        (_RETRIABLE_CODES, ErrorClass.RETRIABLE),
        (_REFRESH_RETRIABLE_CODES, ErrorClass.REFRESH_RETRIABLE),
        (_ABORTABLE_CODES, ErrorClass.ABORTABLE),
        (_APPLICATION_RECOVERABLE_CODES, ErrorClass.APPLICATION_RECOVERABLE),
        (_INVALID_CONFIGURATION_CODES, ErrorClass.INVALID_CONFIGURATION),
        (_HANDLER_FAILURE_CODES, ErrorClass.HANDLER_FAILURE),
    ):
        for code in codes:
            if code in table:  # a code in two groups would make the table order-dependent
                raise AssertionError(f"error code {code} is listed twice")
            table[code] = cls
    return table


#: The explicit code -> class table (INVALID_TXN_STATE is not in it: it depends on the path).
CODE_CLASSES: Final[Mapping[int, ErrorClass]] = MappingProxyType(_build_table())

_INVALID_TXN_STATE_CLASSES: Final[dict[str, ErrorClass]] = {
    "produce": ErrorClass.ABORTABLE,  # KIP-890 relies on this on the produce path
    "transaction": ErrorClass.APPLICATION_RECOVERABLE,
}


def _kafka_error_of(error: object) -> KafkaError | None:
    """The KafkaError carried by ``error``, or None when it carries none."""
    if isinstance(error, KafkaError):
        return error
    if isinstance(error, KafkaTxError):
        return error.error
    if isinstance(error, KafkaException) and error.args:
        first = error.args[0]
        if isinstance(first, KafkaError):
            return first
        if isinstance(first, int) and not isinstance(first, bool):
            return KafkaError(first)
    return None


def _flag_class(error: KafkaError) -> ErrorClass | None:
    """The class librdkafka's flags imply, strongest flag first (as librdkafka documents)."""
    if error.fatal():
        return ErrorClass.APPLICATION_RECOVERABLE
    if error.txn_requires_abort():
        return ErrorClass.ABORTABLE
    if error.retriable():
        return ErrorClass.RETRIABLE
    return None


def _classify_kafka_error(error: KafkaError, path: str) -> ErrorClass:
    code = error.code()
    if code == KafkaError.INVALID_TXN_STATE:
        if error.txn_requires_abort() and not error.fatal():
            # librdkafka reports a refused Produce through the next transactional call, flagged
            # abortable; from EndTxn, AddPartitionsToTxn etc. it is fatal. So it came from a produce.
            path = "produce"
        table_class: ErrorClass | None = _INVALID_TXN_STATE_CLASSES.get(path, ErrorClass.APPLICATION_RECOVERABLE)
    else:
        table_class = CODE_CLASSES.get(code)
    flag_class = _flag_class(error)
    if table_class is None:
        return flag_class or ErrorClass.APPLICATION_RECOVERABLE
    if flag_class is not None and table_class in _SEVERITY and _SEVERITY[flag_class] > _SEVERITY[table_class]:
        return flag_class
    return table_class


def classify(error: object, *, path: ErrorPath = "transaction") -> ErrorClass:
    """Which KIP-1050 class ``error`` belongs to, and so what kafkatx does about it.

    ``error`` may be a ``KafkaError``, a ``KafkaException`` (its KafkaError is
    used), a :class:`KafkaTxError` (its own ``error_class``, which already
    accounts for retries that ran out) or any other exception, which is a
    handler failure. ``path`` is ``"produce"`` for errors from ``produce()``
    and delivery reports, ``"transaction"`` for the transactional API calls.
    """
    if isinstance(error, KafkaTxError):
        return error.error_class
    if isinstance(error, KafkaError):
        return _classify_kafka_error(error, path)
    if isinstance(error, KafkaException):
        kafka_error = _kafka_error_of(error)
        if kafka_error is not None:
            return _classify_kafka_error(kafka_error, path)
        if isinstance(error, SerializationError):  # raised by a (de)serializer with a plain message
            return ErrorClass.HANDLER_FAILURE
        return ErrorClass.APPLICATION_RECOVERABLE  # a KafkaException without a code: the KIP's default
    return ErrorClass.HANDLER_FAILURE


def is_fatal_for_producer(error: object, *, path: ErrorPath = "transaction") -> bool:
    """True when the producer cannot carry on: it must be recreated, or the container stopped."""
    return classify(error, path=path) in (ErrorClass.APPLICATION_RECOVERABLE, ErrorClass.INVALID_CONFIGURATION)


# What to check, per code, so that an operator can fix the cause from the message alone.
_AUTHN_HINT = (
    "check security.protocol, sasl.mechanism and the credentials "
    "(sasl.username/sasl.password or the OAUTHBEARER settings)"
)
_FENCED_HINT = (
    "another producer with the same transactional.id has started (is the id unique per instance?), "
    "or this transaction outlived transaction.timeout.ms and the coordinator bumped the epoch"
)
_GROUP_HINT = (
    "the consumer lost its group membership (a rebalance, max.poll.interval.ms exceeded, "
    "or another member with the same group.instance.id)"
)
_VERSION_HINT = (
    "check the broker version: transactions need Kafka >= 0.11, and offsets sent with consumer group "
    "metadata (KIP-447) need >= 2.5; check api.version.request / broker.version.fallback too"
)
_HINTS: Final[dict[int, str]] = {
    _E.TOPIC_AUTHORIZATION_FAILED: (
        "check the topic ACLs: the principal needs WRITE on every output topic (and the DLT) "
        "and READ/DESCRIBE on the input topics"
    ),
    _E.GROUP_AUTHORIZATION_FAILED: (
        "check the group ACLs: the principal needs READ on the consumer group, "
        "which send_offsets_to_transaction uses"
    ),
    _E.CLUSTER_AUTHORIZATION_FAILED: (
        "check the cluster ACLs: brokers older than 2.8 require IDEMPOTENT_WRITE on the Cluster "
        "resource for idempotent and transactional producers"
    ),
    _E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: (
        "check the transactional-id ACLs: the principal needs WRITE and DESCRIBE on the TransactionalId "
        "resource (a PREFIXED ACL on the listener's transactional.id prefix)"
    ),
    _E.SASL_AUTHENTICATION_FAILED: _AUTHN_HINT,
    _E._AUTHENTICATION: _AUTHN_HINT,
    _E.UNSUPPORTED_SASL_MECHANISM: "check sasl.mechanism against the broker listener's sasl.enabled.mechanisms",
    _E.ILLEGAL_SASL_STATE: _AUTHN_HINT,
    _E._SSL: (
        "check security.protocol, ssl.ca.location, ssl.certificate.location/ssl.key.location, "
        "certificate validity and the broker host name (ssl.endpoint.identification.algorithm)"
    ),
    _E.UNSUPPORTED_VERSION: _VERSION_HINT,
    _E._UNSUPPORTED_FEATURE: _VERSION_HINT,
    _E.UNSUPPORTED_FOR_MESSAGE_FORMAT: (
        "the topic uses a message format older than v2 (Kafka 0.11); "
        "check the topic's message.format.version and the broker version"
    ),
    _E.MSG_SIZE_TOO_LARGE: (
        "a record is larger than a size limit: raise the producer's message.max.bytes and the topic's "
        "max.message.bytes (broker default: message.max.bytes), or make the record smaller"
    ),
    _E.RECORD_LIST_TOO_LARGE: (
        "a batch is larger than the topic's segment.bytes (broker log.segment.bytes); "
        "lower the producer's batch.size / message.max.bytes or raise segment.bytes"
    ),
    _E.INVALID_RECORD: (
        "the broker rejected a record: e.g. a compacted topic (cleanup.policy=compact) needs a non-null key, "
        "or a broker-side record validation policy failed"
    ),
    _E.INVALID_REQUIRED_ACKS: "transactional producers need acks=all; check the producer's acks setting",
    _E.TOPIC_EXCEPTION: "a topic name is invalid: use only letters, digits, '.', '_' and '-' (at most 249 characters)",
    _E.INVALID_TRANSACTION_TIMEOUT: (
        "transaction.timeout.ms is larger than the broker's transaction.max.timeout.ms (default 900000); "
        "lower it or raise the broker setting"
    ),
    _E.INVALID_REPLICATION_FACTOR: (
        "a topic's replication factor is larger than the number of brokers; "
        "check the replication factor of topics kafkatx creates (e.g. the DLT)"
    ),
    _E._INVALID_ARG: "an invalid argument or client setting reached confluent-kafka; check the producer/consumer configuration",
    _E._UNKNOWN_TOPIC: (
        "the topic does not exist: create it (or enable auto.create.topics.enable on the broker) "
        "and check the topic names in the listener configuration"
    ),
    _E._FENCED: _FENCED_HINT,
    _E.PRODUCER_FENCED: _FENCED_HINT,
    _E.INVALID_PRODUCER_EPOCH: _FENCED_HINT,
    _E.INVALID_PRODUCER_ID_MAPPING: (
        "the transaction coordinator no longer knows this transactional.id "
        "(it expired after transactional.id.expiration.ms without use)"
    ),
    _E.ILLEGAL_GENERATION: _GROUP_HINT,
    _E.UNKNOWN_MEMBER_ID: _GROUP_HINT,
    _E.FENCED_INSTANCE_ID: _GROUP_HINT,
    _E.OUT_OF_ORDER_SEQUENCE_NUMBER: (
        "the broker lost track of this producer's sequence numbers "
        "(for example after an unclean leader election); check the broker logs for data loss"
    ),
    _E._INCONSISTENT: "some records of the transaction failed delivery; their delivery reports say why",
    _E._MSG_TIMED_OUT: "a record was not delivered within message.timeout.ms; check broker availability",
    _E.UNKNOWN_PRODUCER_ID: (
        "the broker no longer has this producer's state (its records may have been deleted by retention)"
    ),
    _E.TRANSACTION_ABORTABLE: "the broker asked for the transaction to be aborted",
}


def _label(error_class: ErrorClass) -> str:
    return error_class.value.replace("_", " ")


def _sentence(text: str) -> str:
    text = text.strip()
    if not text:
        return text
    text = text[0].upper() + text[1:]
    return text if text.endswith((".", "?", "!")) else text + "."


def _describe(error: KafkaError | None, error_class: ErrorClass, operation: str | None) -> str:
    """The default message: code name, operation, librdkafka's reason, what to check, what kafkatx does."""
    where = f" in {operation}" if operation else ""
    tail = f"[{_label(error_class)}: {error_class.reaction}]"
    if error is None:
        return f"{_sentence(_label(error_class) + ' error' + where)} {tail}"
    parts = [_sentence(f"{error.name()}{where}: {error.str()}")]
    hint = _HINTS.get(error.code())
    if hint:
        parts.append(_sentence(hint))
    parts.append(tail)
    return " ".join(parts)


def _rebuild(
    cls: type[KafkaTxError],
    message: str,
    error: KafkaError | None,
    error_class: ErrorClass,
    operation: str | None,
) -> KafkaTxError:
    return cls(message, error=error, error_class=error_class, operation=operation)


class KafkaTxError(Exception):
    """Base of every error kafkatx raises about Kafka, so one ``except`` catches them all.

    ``error`` is the original ``KafkaError`` (None when kafkatx raises the
    error itself, e.g. for a bad setting), ``error_class`` its
    :class:`ErrorClass` and ``operation`` the call that failed, such as
    ``"commit_transaction"``. The message is built from all three when none
    is given.
    """

    default_error_class: ClassVar[ErrorClass] = ErrorClass.APPLICATION_RECOVERABLE

    def __init__(
        self,
        message: str | None = None,
        *,
        error: KafkaError | None = None,
        error_class: ErrorClass | None = None,
        operation: str | None = None,
    ) -> None:
        self.error: KafkaError | None = error
        self.error_class: ErrorClass = error_class if error_class is not None else type(self).default_error_class
        self.operation: str | None = operation
        self.message: str = message if message is not None else _describe(error, self.error_class, operation)
        super().__init__(self.message)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments do not survive the default exception pickling
        # (e.g. when an error crosses a process boundary).
        return (_rebuild, (type(self), self.message, self.error, self.error_class, self.operation))

    @property
    def code(self) -> int | None:
        """The Kafka error code, or None."""
        return self.error.code() if self.error is not None else None

    @property
    def code_name(self) -> str | None:
        """The Kafka error code's name (e.g. ``"_FENCED"``), or None."""
        return self.error.name() if self.error is not None else None

    @property
    def fenced(self) -> bool:
        """A newer producer took over this transactional.id (or the producer went fatal after it did)."""
        return self.code in _FENCING_CODES

    @classmethod
    def from_kafka(
        cls,
        error_or_exc: KafkaError | BaseException,
        *,
        operation: str | None = None,
        path: ErrorPath = "transaction",
    ) -> KafkaTxError:
        """The typed kafkatx error for a Kafka error, picked by :func:`classify`.

        A :class:`KafkaTxError` is returned unchanged. An abortable error from
        ``abort_transaction`` becomes :class:`ApplicationRecoverableError`:
        KIP-1050 makes it fatal to the producer, because aborting again could
        loop forever. A handler failure gives a plain :class:`KafkaTxError`
        whose ``error_class`` is HANDLER_FAILURE. When given an exception, the
        result's ``__cause__`` is set to it.
        """
        if isinstance(error_or_exc, KafkaTxError):
            return error_or_exc
        error_class = classify(error_or_exc, path=path)
        if error_class is ErrorClass.ABORTABLE and operation == ABORT_OPERATION:
            error_class = ErrorClass.APPLICATION_RECOVERABLE
        kafka_error = _kafka_error_of(error_or_exc)
        message: str | None = None
        if kafka_error is None and isinstance(error_or_exc, BaseException):
            where = f" in {operation}" if operation else ""
            message = f"{type(error_or_exc).__name__}{where}: {error_or_exc} [{_label(error_class)}: {error_class.reaction}]"
        result = _CLASS_EXCEPTIONS.get(error_class, KafkaTxError)(
            message, error=kafka_error, error_class=error_class, operation=operation
        )
        if isinstance(error_or_exc, BaseException):
            result.__cause__ = error_or_exc
        return result


class RetriableError(KafkaTxError):
    """Retries of a retriable error ran out outside a transaction (or one was surfaced as is)."""

    default_error_class: ClassVar[ErrorClass] = ErrorClass.RETRIABLE


class TransactionAbortableError(KafkaTxError):
    """The transaction must be aborted and its batch reprocessed; the producer stays usable."""

    default_error_class: ClassVar[ErrorClass] = ErrorClass.ABORTABLE


class ApplicationRecoverableError(KafkaTxError):
    """The producer is unusable (e.g. fenced) and must be closed and recreated."""

    default_error_class: ClassVar[ErrorClass] = ErrorClass.APPLICATION_RECOVERABLE


class InvalidConfigurationError(KafkaTxError):
    """A setting or permission is wrong; retrying cannot help, so the container stops.

    kafkatx also raises it for its own settings, with a message only:
    ``InvalidConfigurationError("max_attempts must be >= 1, got 0")``.
    """

    default_error_class: ClassVar[ErrorClass] = ErrorClass.INVALID_CONFIGURATION


_CLASS_EXCEPTIONS: Final[dict[ErrorClass, type[KafkaTxError]]] = {
    ErrorClass.RETRIABLE: RetriableError,
    ErrorClass.REFRESH_RETRIABLE: RetriableError,
    ErrorClass.ABORTABLE: TransactionAbortableError,
    ErrorClass.APPLICATION_RECOVERABLE: ApplicationRecoverableError,
    ErrorClass.INVALID_CONFIGURATION: InvalidConfigurationError,
}

# Backoff between retries: 50 ms doubling to a 1 s cap, plus up to 50 ms of
# jitter so that many producers retrying together do not stay in lockstep.
_BACKOFF: Final = wait_exponential(multiplier=0.05, min=0.05, max=1.0) + wait_random(0, 0.05)


def retry_call(
    fn: Callable[[], T],
    *,
    operation: str,
    timeout: float,
    path: ErrorPath = "transaction",
    refresh: Callable[[], None] | None = None,
    on_retry: Callable[[ErrorClass, KafkaError, int], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """Call ``fn()``, retrying retriable Kafka errors for up to ``timeout`` seconds.

    The KIP leaves retriable errors to the client, so the handler never sees
    them. Before each retry, ``refresh()`` runs if the error is
    REFRESH_RETRIABLE (a failing refresh is logged, not raised), then
    ``on_retry(class, kafka_error, attempt)``; then kafkatx waits with
    exponential backoff and jitter, never past the deadline.

    When the retries run out, on the ``"transaction"`` path the error becomes
    :class:`TransactionAbortableError` (KIP-1050: re-sending inside a
    transaction could duplicate records, so abort instead); on other paths,
    and for ``init_transactions`` (no transaction to abort yet), it is
    :class:`RetriableError`. Other Kafka errors raise their typed
    :class:`KafkaTxError` at once; for ``abort_transaction`` an abortable
    error is raised as :class:`ApplicationRecoverableError`. The kafkatx
    error is chained from the last Kafka exception. Handler failures (any
    non-Kafka exception, and (de)serialization errors) propagate unchanged.

    ``sleep`` and ``clock`` are injectable so that tests need not wait.
    """
    if timeout < 0:
        raise InvalidConfigurationError(f"retry timeout for {operation} must be >= 0 seconds, got {timeout}")
    deadline = clock() + timeout
    first_failure: KafkaException | None = None
    try:
        return fn()  # the common case, without the retry machinery below (~10 us per call)
    except KafkaException as exc:
        first_failure = exc  # replayed as attempt 1 below: classification, callbacks and backoff unchanged

    def should_retry(exc: BaseException) -> bool:
        return isinstance(exc, KafkaException) and classify(exc, path=path).retriable

    def stop(retry_state: RetryCallState) -> bool:
        return clock() >= deadline

    def wait(retry_state: RetryCallState) -> float:
        return max(0.0, min(_BACKOFF(retry_state), deadline - clock()))

    def before_sleep(retry_state: RetryCallState) -> None:
        exc = retry_state.outcome.exception() if retry_state.outcome is not None else None
        error_class = classify(exc, path=path)
        kafka_error = _kafka_error_of(exc)
        log.debug(
            "%s failed with %s (%s), attempt %d; retrying in %.3f s",
            operation,
            kafka_error.name() if kafka_error is not None else exc,
            error_class.value,
            retry_state.attempt_number,
            retry_state.next_action.sleep if retry_state.next_action is not None else 0.0,
        )
        if error_class is ErrorClass.REFRESH_RETRIABLE and refresh is not None:
            try:
                refresh()
            except Exception:  # a failed refresh must not end the retries; the next attempt will tell
                log.warning("metadata refresh before retrying %s failed", operation, exc_info=True)
        if on_retry is not None and kafka_error is not None:
            on_retry(error_class, kafka_error, retry_state.attempt_number)

    attempts = 0

    def attempt() -> T:
        nonlocal attempts, first_failure
        attempts += 1
        if first_failure is not None:
            failure, first_failure = first_failure, None
            raise failure
        return fn()

    retrying = Retrying(
        retry=retry_if_exception(should_retry),
        stop=stop,
        wait=wait,
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=True,
    )
    try:
        return retrying(attempt)
    except KafkaException as exc:
        error_class = classify(exc, path=path)
        if error_class is ErrorClass.HANDLER_FAILURE:
            raise
        if not error_class.retriable:
            raise KafkaTxError.from_kafka(exc, operation=operation, path=path) from exc
        raise _exhausted(exc, operation, path, timeout, attempts) from exc


def _exhausted(exc: KafkaException, operation: str, path: str, timeout: float, attempts: int) -> KafkaTxError:
    """The error for a retriable Kafka error whose retries ran out."""
    kafka_error = _kafka_error_of(exc)
    name = kafka_error.name() if kafka_error is not None else type(exc).__name__
    reason = kafka_error.str() if kafka_error is not None else str(exc)
    summary = f"{operation} still failed with {name} ({reason}) after {attempts} attempt(s) in {timeout:g} s."
    check = "Check broker availability and the transaction coordinator's logs, or raise transaction_retry_timeout."
    if path == "transaction" and operation != INIT_OPERATION:
        if operation == ABORT_OPERATION:
            error_class = ErrorClass.APPLICATION_RECOVERABLE
            why = "An abort that cannot complete leaves the producer unusable."
        else:
            error_class = ErrorClass.ABORTABLE
            why = "The transaction cannot wait any longer, so it must be aborted (KIP-1050)."
        cls: type[KafkaTxError] = _CLASS_EXCEPTIONS[error_class]
        return cls(
            f"{summary} {why} {check} [{_label(error_class)}: {error_class.reaction}]",
            error=kafka_error,
            operation=operation,
        )
    return RetriableError(
        f"{summary} {check}",
        error=kafka_error,
        error_class=classify(exc, path=path),
        operation=operation,
    )
