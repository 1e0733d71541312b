"""Every exception kafkatx raises, under one root.

::

    KafkaTxError                          catch-all: anything kafkatx raises
    ├── KafkaClientError                  a Kafka client call failed (KIP-1050 class in .error_class)
    │   ├── RetriableError                retries ran out outside a transaction
    │   │   └── ClusterUnreachableError   no broker answered at the bootstrap servers
    │   ├── TransactionAbortableError     abort the transaction, redo the batch
    │   ├── ApplicationRecoverableError   the producer is unusable: recreate it
    │   │   └── StuckCallError            a client call did not return in time
    │   ├── InvalidConfigurationError     a setting or permission is wrong: stop
    │   └── OutputRefusedError (TypeError) the broker refused an output record: its input record failed
    ├── GroupMembershipChanged            the consumer left its group mid-transaction
    ├── ContainerError                    a container stopped and could not go on safely
    │   ├── RecoveryExhaustedError        max_recovery_failures reached
    │   ├── FencedTooOftenError           the transactional.id is used elsewhere too
    │   └── OutageTooLongError            a dependency was down longer than max_outage
    ├── OutputError (TypeError)           a handler returned or sent something unproducible
    │   ├── UnproducibleTypeError         ... of a type it cannot encode: the container stops
    │   ├── UnknownTopicError             ... to a topic that does not exist
    │   └── RecordRejectedError           ... that the client refused (too large)
    ├── DeserializationError (ValueError) raise it when a record's bytes cannot be decoded
    │   └── DecodeError                   a typed listener could not decode a record: it goes to the recoverer
    ├── RecoveryError                     a recoverer failed; the record is kept
    ├── DeadLetterPublishError            the dead-letter record could not be written
    ├── ProcessCrashedError               a record killed the process max_attempts times (dead letters name it)
    ├── DatabaseUnavailableError          database= could not be reached (kafkatx.database)
    ├── DependencyUnavailable             raise it when a service the handler needs is down (an outage)
    └── NotInTransactionError             send() outside a handler or transaction

Which KIP-1050 class a Kafka error belongs to is decided in
:mod:`kafkatx.errors.classification`; the messages come from :mod:`kafkatx.errors.hints`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Final

from confluent_kafka import KafkaError

from kafkatx.errors.classification import (
    ABORT_OPERATION,
    FENCING_CODES,
    RECORD_REFUSAL_CODES,
    ErrorClass,
    ErrorPath,
    classify,
    kafka_error_of,
)
from kafkatx.errors.hints import describe, label

if TYPE_CHECKING:
    from kafkatx.record import Record

__all__ = [
    "RecordFailedError",
    "KafkaTxError",
    "KafkaClientError",
    "RetriableError",
    "ClusterUnreachableError",
    "TransactionAbortableError",
    "ApplicationRecoverableError",
    "StuckCallError",
    "InvalidConfigurationError",
    "OutputRefusedError",
    "GroupMembershipChanged",
    "ContainerError",
    "RecoveryExhaustedError",
    "FencedTooOftenError",
    "OutageTooLongError",
    "DependencyUnavailable",
    "OutputError",
    "UnproducibleTypeError",
    "UnknownTopicError",
    "RecordRejectedError",
    "DeserializationError",
    "DecodeError",
    "RecoveryError",
    "DeadLetterPublishError",
    "ProcessCrashedError",
    "NotInTransactionError",
]


class KafkaTxError(Exception):
    """Base of every exception kafkatx raises, so one ``except`` catches them all."""

    @classmethod
    def from_kafka(
        cls,
        error_or_exc: KafkaError | BaseException,
        *,
        operation: str | None = None,
        path: ErrorPath = "transaction",
    ) -> KafkaClientError:
        """The typed :class:`KafkaClientError` for a Kafka error, picked by :func:`~kafkatx.errors.classification.classify`.

        A :class:`KafkaClientError` is returned unchanged. An abortable error
        from ``abort_transaction`` becomes :class:`ApplicationRecoverableError`:
        KIP-1050 makes it fatal to the producer, because aborting again could
        loop forever. A handler failure gives a plain :class:`KafkaClientError`
        whose ``error_class`` is HANDLER_FAILURE. When given an exception, the
        result's ``__cause__`` is set to it.
        """
        if isinstance(error_or_exc, KafkaClientError):
            return error_or_exc
        error_class = classify(error_or_exc, path=path)
        if error_class is ErrorClass.ABORTABLE and operation == ABORT_OPERATION:
            error_class = ErrorClass.APPLICATION_RECOVERABLE
        kafka_error = kafka_error_of(error_or_exc)
        message: str | None = None
        if kafka_error is None and isinstance(error_or_exc, BaseException):
            where = f" in {operation}" if operation else ""
            message = (
                f"{type(error_or_exc).__name__}{where}: {error_or_exc} [{label(error_class)}: {error_class.reaction}]"
            )
        result = CLASS_EXCEPTIONS.get(error_class, KafkaClientError)(
            message, error=kafka_error, error_class=error_class, operation=operation
        )
        if isinstance(error_or_exc, BaseException):
            result.__cause__ = error_or_exc
        return result


def _rebuild(
    cls: type[KafkaClientError],
    message: str,
    error: KafkaError | None,
    error_class: ErrorClass,
    operation: str | None,
) -> KafkaClientError:
    return cls(message, error=error, error_class=error_class, operation=operation)


class KafkaClientError(KafkaTxError):
    """A Kafka client call failed. Its subclass tells what kafkatx does about it.

    ``error`` is the original ``KafkaError`` (None when kafkatx raises the
    error itself, e.g. for a bad setting), ``error_class`` its
    :class:`~kafkatx.errors.classification.ErrorClass` and ``operation`` the call
    that failed, such as ``"commit_transaction"``. The message is built from
    all three when none is given.
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
        self.message: str = message if message is not None else describe(error, self.error_class, operation)
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
        """A newer producer took over this transactional.id.

        The producer asks librdkafka for the cause of a bare ``_FATAL``
        (TransactionalProducer does, see ``_fatal_cause``). An
        OUT_OF_ORDER_SEQUENCE_NUMBER after a broker lost its producer state is
        fatal too, but no other process holds the id: it is not fencing, and
        the producer is simply recreated. A ``_FATAL`` whose cause stayed
        unknown counts as fencing: holding a partition for a few seconds
        costs little, committing beside a new owner costs duplicates.
        """
        code = self.code
        if code in FENCING_CODES:
            return True
        if code == KafkaError._FATAL and self.error is not None:
            return "sequence" not in self.error.str().lower()
        return False


class RetriableError(KafkaClientError):
    """Retries of a retriable error ran out outside a transaction (or one was surfaced as is)."""

    default_error_class: ClassVar[ErrorClass] = ErrorClass.RETRIABLE


class ClusterUnreachableError(RetriableError):
    """No broker answered at the bootstrap servers when the App started."""


class TransactionAbortableError(KafkaClientError):
    """The transaction must be aborted and its batch reprocessed; the producer stays usable."""

    default_error_class: ClassVar[ErrorClass] = ErrorClass.ABORTABLE


class ApplicationRecoverableError(KafkaClientError):
    """The producer is unusable (e.g. fenced) and must be closed and recreated."""

    default_error_class: ClassVar[ErrorClass] = ErrorClass.APPLICATION_RECOVERABLE


class StuckCallError(ApplicationRecoverableError):
    """A client call did not return within its deadline; the client is abandoned and replaced."""


class InvalidConfigurationError(KafkaClientError):
    """A setting or permission is wrong; retrying cannot help, so the container stops.

    kafkatx also raises it for its own settings, with a message only:
    ``InvalidConfigurationError("max_attempts must be >= 1, got 0")``.
    ``kafkatx run`` reports it in one line and exits with code 78.
    """

    default_error_class: ClassVar[ErrorClass] = ErrorClass.INVALID_CONFIGURATION


class OutputRefusedError(KafkaClientError, TypeError):
    """The broker refused a record a handler produced: too large for its topic, or invalid for it.

    Its ``code_name`` is one of
    :data:`~kafkatx.errors.classification.RECORD_REFUSAL_CODES` (e.g.
    ``MSG_SIZE_TOO_LARGE``); ``topic`` and ``partition`` say where the record
    was going. The input record that produced it is failed with this
    exception, through the listener's failure policy: not retryable by
    default (a TypeError, like :class:`OutputError`: the same output would be
    refused again), so it goes to the recoverer, and a dead letter names the
    broker's error. Its ``error_class`` is HANDLER_FAILURE.

    A KafkaClientError rather than an :class:`OutputError`: it arrives in a
    delivery report, after the handler that produced it has returned, so it
    must not be blamed on whichever record is being handled when it is seen.
    """

    default_error_class: ClassVar[ErrorClass] = ErrorClass.HANDLER_FAILURE

    def __init__(
        self,
        message: str | None = None,
        *,
        error: KafkaError | None = None,
        error_class: ErrorClass | None = None,
        operation: str | None = None,
        topic: str | None = None,
        partition: int | None = None,
    ) -> None:
        if message is None and error is not None:
            where = f"{topic}[{partition}]" if topic is not None else "an output topic"
            reason = describe(error, error_class or ErrorClass.HANDLER_FAILURE, operation)
            message = f"the broker refused an output record for {where}: {reason}"
        super().__init__(message, error=error, error_class=error_class, operation=operation)
        self.topic = topic
        self.partition = partition

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_refused, (self.message, self.error, self.operation, self.topic, self.partition))

    @staticmethod
    def is_refusal(error: KafkaError | None) -> bool:
        """True if ``error`` is the broker refusing one record for what it is (RECORD_REFUSAL_CODES)."""
        return error is not None and error.code() in RECORD_REFUSAL_CODES


def _rebuild_refused(
    message: str, error: KafkaError | None, operation: str | None, topic: str | None, partition: int | None
) -> OutputRefusedError:
    return OutputRefusedError(message, error=error, operation=operation, topic=topic, partition=partition)


CLASS_EXCEPTIONS: Final[dict[ErrorClass, type[KafkaClientError]]] = {
    ErrorClass.RETRIABLE: RetriableError,
    ErrorClass.REFRESH_RETRIABLE: RetriableError,
    ErrorClass.ABORTABLE: TransactionAbortableError,
    ErrorClass.APPLICATION_RECOVERABLE: ApplicationRecoverableError,
    ErrorClass.INVALID_CONFIGURATION: InvalidConfigurationError,
}


class GroupMembershipChanged(KafkaTxError):
    """The consumer left or rejoined its group while a transaction was open.

    Its partitions may already belong to another member, so committing would
    risk duplicates; the transaction is aborted instead (the zombie check).
    """


class ContainerError(KafkaTxError, RuntimeError):
    """A container stopped because it could not go on safely; the App stops with it."""


class RecoveryExhaustedError(ContainerError):
    """The recoverer failed ``max_recovery_failures`` times for one record (last-resort stop)."""


class FencedTooOftenError(ContainerError):
    """The producer kept being fenced: another process is probably using the same transactional.id."""


class OutageTooLongError(ContainerError):
    """A dependency stayed unavailable longer than the listener's ``max_outage``: the App stops."""


class DependencyUnavailable(KafkaTxError):
    """Raise it from a handler when a service the handler needs is down: an outage, not the record's failure.

    The record's ``attempt`` does not move and it never reaches the
    recoverer: the whole listener pauses and the record is handled again
    once the dependency answers (see the listener's ``outages`` option, for
    the exception types that mean the same without being raised as this).
    """


class RecordFailedError(KafkaTxError):
    """Raise it from a batch listener's handler to name the record that failed:
    ``raise kafkatx.RecordFailedError(record) from err`` (Spring's ``BatchListenerFailedException``).

    The records before it are handled again without it and commit; it goes
    through the failed-record procedure alone (counted, retried after the
    back-off with its own ``attempt``, then recovered), judged on ``err``, the
    cause; the records after it are handled afterwards (docs/BATCH.md).
    """

    def __init__(self, record: Any, message: str | None = None) -> None:
        where = getattr(record, "coordinates", None) or repr(record)
        super().__init__(message or f"the batch handler failed on {where}")
        self.record = record


class OutputError(KafkaTxError, TypeError):
    """A handler returned or sent something kafkatx cannot produce.

    It subclasses TypeError, so it is not retryable by default: retrying the
    same record would return the same bad value.
    """


class UnproducibleTypeError(OutputError):
    """A handler returned or sent a value of a type kafkatx cannot encode, and its listener has no serializer.

    A programming error, not the record's: every record would fail the same
    way, so the container stops (one line naming the listener, the type and
    the fix) instead of dead-lettering them all; the record is not committed,
    and a restart after the fix handles it. ``type_name`` is the type's name.
    """

    def __init__(self, message: str, type_name: str) -> None:
        super().__init__(message)
        self.type_name = type_name

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.type_name))


class UnknownTopicError(OutputError):
    """A record was sent to a topic that does not exist."""


class RecordRejectedError(OutputError):
    """The client refused an output record (too large, invalid); retrying cannot help."""


class DeserializationError(KafkaTxError, ValueError):
    """Raise it (or a subclass) when a record's bytes cannot be decoded.

    It is not retryable by default: the same bytes will not decode next time.
    """


class DecodeError(DeserializationError):
    """A typed listener (``value_type=``, ``deserializer=``...) could not decode a record's key or value.

    Never retried: the record goes to the listener's recoverer at its first
    delivery, its bytes untouched, and the handler is not called for it.
    ``part`` is ``"key"`` or ``"value"``; ``field`` the path of the field
    that failed validation when the validator names one (``"items.0.sku"``),
    else None. The decoder's own exception is the ``__cause__``.
    """

    def __init__(self, message: str, *, part: str = "value", field: str | None = None) -> None:
        super().__init__(message)
        self.part = part
        self.field = field

    def __reduce__(self) -> tuple[Any, ...]:
        return (_decode_error, (str(self), self.part, self.field))


def _decode_error(message: str, part: str, field: str | None) -> DecodeError:
    return DecodeError(message, part=part, field=field)


class RecoveryError(KafkaTxError):
    """A recoverer failed; the record is kept (not committed) and recovery is retried."""

    def __init__(self, record: Record, exception: BaseException, recoverer: str) -> None:
        super().__init__(
            f"recoverer {recoverer} failed for {record.coordinates}: {type(exception).__name__}: {exception}"
        )
        self.record = record
        self.exception = exception
        self.recoverer = recoverer

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.record, self.exception, self.recoverer))


class DeadLetterPublishError(KafkaTxError, RuntimeError):
    """The dead-letter record could not be written; the original record is kept."""


class ProcessCrashedError(KafkaTxError):
    """The process died while handling this record, ``crashes`` time(s): the exception a dead letter names
    when kafkatx recovers such a record without calling the handler again (see ``count_crashes``)."""

    def __init__(self, record: str, crashes: int) -> None:
        super().__init__(
            f"the process died {crashes} time(s) while handling {record} (a crash, os._exit, the OOM killer, "
            "a native library fault); kafkatx recovered it without calling the handler again"
        )
        self.crashes = crashes


class NotInTransactionError(KafkaTxError, RuntimeError):
    """``send()`` was called outside a handler and outside ``app.transaction()``."""
