"""Kafka error classification (KIP-1050): which class each client error belongs to.

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
  KIP-848's STALE_MEMBER_EPOCH, FENCED_MEMBER_EPOCH and GROUP_ID_NOT_FOUND say
  the same of the new group protocol: APPLICATION_RECOVERABLE too; its
  UNRELEASED_INSTANCE_ID and UNSUPPORTED_ASSIGNOR are INVALID_CONFIGURATION
  (two instances with one ``group.instance.id``; an assignor the group refuses).
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
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final, Literal

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.serialization import SerializationError

__all__ = [
    "ErrorClass",
    "ErrorPath",
    "CODE_CLASSES",
    "FENCING_CODES",
    "RECORD_REFUSAL_CODES",
    "classify",
    "is_fatal_for_producer",
    "kafka_error_of",
    "ABORT_OPERATION",
    "INIT_OPERATION",
    "CLUSTER_ID_OPERATION",
    "OUTBOX_SEQUENCE_OPERATION",
    "BEFORE_TRANSACTION_OPERATIONS",
]

#: Where an error was raised. Only INVALID_TXN_STATE depends on it, and
#: :func:`retry_call` uses it to decide what "retries ran out" means.
ErrorPath = Literal["transaction", "produce"]

#: Operation names :func:`retry_call` and :meth:`KafkaTxError.from_kafka` treat specially.
ABORT_OPERATION: Final = "abort_transaction"
INIT_OPERATION: Final = "init_transactions"
#: The cluster id ``app.transaction(database=...)`` checks its stored positions against, asked before it begins.
CLUSTER_ID_OPERATION: Final = "list_topics() (the cluster id database= checks its stored positions against)"
#: The sequence an ``app.transaction(database=...)`` outbox last committed in Kafka, asked before it begins.
OUTBOX_SEQUENCE_OPERATION: Final = "list_consumer_group_offsets() (the sequence the outbox last committed in Kafka)"
#: Calls made before any transaction is open: retries that ran out leave nothing to abort (RetriableError).
BEFORE_TRANSACTION_OPERATIONS: Final = frozenset({INIT_OPERATION, CLUSTER_ID_OPERATION, OUTBOX_SEQUENCE_OPERATION})


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
    # KIP-848 (the consumer group protocol, Kafka 4.0+; the default from 5.0): the same loss of group state,
    # as a transactional offset commit can report it under the new protocol.
    _E.STALE_MEMBER_EPOCH,
    _E.FENCED_MEMBER_EPOCH,
    _E.GROUP_ID_NOT_FOUND,
    _E.OUT_OF_ORDER_SEQUENCE_NUMBER,
    _E._FATAL,
    _E._STATE,
    _E._CONFLICT,
    _E._PREV_IN_PROGRESS,
)

#: The codes that mean "another producer now holds the transactional.id". ``_FATAL`` is not one of
#: them: librdkafka reports every fatal idempotence error through it, an OUT_OF_ORDER_SEQUENCE_NUMBER
#: after a broker lost its producer state as much as a fencing (see KafkaClientError.fenced).
FENCING_CODES: Final = frozenset({_E._FENCED, _E.PRODUCER_FENCED, _E.INVALID_PRODUCER_EPOCH})

#: The codes with which the broker refuses a produced record for what the record is, not for who sent it or
#: where: its size, its content, the topic's rules for records. They stay INVALID_CONFIGURATION in the table
#: (a client error with one of them, from anywhere else, stops the container), but when one comes back in a
#: delivery report of a transaction the producer raises :class:`~kafkatx.errors.OutputRefusedError` and the
#: input record that produced the refused output is failed, not the App (see kafkatx.listener.transaction.refused):
#:
#: * MSG_SIZE_TOO_LARGE (Java's RecordTooLargeException): larger than the topic's ``max.message.bytes``;
#: * RECORD_LIST_TOO_LARGE (RecordBatchTooLargeException): a batch larger than the topic's segment size, which
#:   a record of its own passes unless it alone is that large;
#: * INVALID_RECORD (InvalidRecordException): a record the broker validates and rejects, e.g. a null key on a
#:   compacted topic, or a broker-side record validation (a schema check) that refuses it;
#: * INVALID_TIMESTAMP (InvalidTimestampException): a timestamp outside the topic's allowed difference.
#:
#: Not among them, and still stopping the App: authorization (TOPIC_AUTHORIZATION_FAILED and the other
#: *_AUTHORIZATION_FAILED), a missing topic, UNSUPPORTED_FOR_MESSAGE_FORMAT (the topic's message format, the
#: same for every record) and CORRUPT_MESSAGE (a CRC error in transit: RETRIABLE, the record itself is fine).
RECORD_REFUSAL_CODES: Final = frozenset(
    {_E.MSG_SIZE_TOO_LARGE, _E.RECORD_LIST_TOO_LARGE, _E.INVALID_RECORD, _E.INVALID_TIMESTAMP}
)

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
    # KIP-848: another running member has this group.instance.id; the group refuses the assignor asked for.
    _E.UNRELEASED_INSTANCE_ID,
    _E.UNSUPPORTED_ASSIGNOR,
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


def kafka_error_of(error: object) -> KafkaError | None:
    """The KafkaError carried by ``error``, or None when it carries none."""
    if isinstance(error, KafkaError):
        return error
    error_attr = getattr(error, "error", None)
    if isinstance(error_attr, KafkaError) and isinstance(error, Exception) and not isinstance(error, KafkaException):
        return error_attr  # a kafkatx KafkaClientError
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
    used), a :class:`~kafkatx.errors.KafkaClientError` (its own ``error_class``, which already
    accounts for retries that ran out) or any other exception, which is a
    handler failure. ``path`` is ``"produce"`` for errors from ``produce()``
    and delivery reports, ``"transaction"`` for the transactional API calls.
    """
    error_class = getattr(error, "error_class", None)
    if isinstance(error_class, ErrorClass) and isinstance(error, Exception):
        return error_class  # a kafkatx KafkaClientError (errors.py builds on this module, not the reverse)
    if isinstance(error, KafkaError):
        return _classify_kafka_error(error, path)
    if isinstance(error, KafkaException):
        kafka_error = kafka_error_of(error)
        if kafka_error is not None:
            return _classify_kafka_error(kafka_error, path)
        if isinstance(error, SerializationError):  # raised by a (de)serializer with a plain message
            return ErrorClass.HANDLER_FAILURE
        return ErrorClass.APPLICATION_RECOVERABLE  # a KafkaException without a code: the KIP's default
    return ErrorClass.HANDLER_FAILURE


def is_fatal_for_producer(error: object, *, path: ErrorPath = "transaction") -> bool:
    """True when the producer cannot carry on: it must be recreated, or the container stopped."""
    return classify(error, path=path) in (ErrorClass.APPLICATION_RECOVERABLE, ErrorClass.INVALID_CONFIGURATION)
