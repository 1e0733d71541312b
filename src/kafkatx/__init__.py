"""kafkatx: transactional Kafka listener containers for Python.

Handlers declared with ``@app.listener`` run inside Kafka transactions: their
outputs and the consumed offsets commit atomically, failures roll back and go
through an after-rollback processor (attempts, back-off, dead-letter topic).
"""

from kafkatx._version import __version__
from kafkatx.app import App, Transaction
from kafkatx.context import send
from kafkatx.database import DatabaseUnavailableError, db
from kafkatx.dlq.publisher import DeadLetterPublishingRecoverer
from kafkatx.errors import (
    ApplicationRecoverableError,
    ClusterUnreachableError,
    ContainerError,
    DeadLetterPublishError,
    DecodeError,
    DependencyUnavailable,
    DeserializationError,
    FencedTooOftenError,
    GroupMembershipChanged,
    InvalidConfigurationError,
    KafkaClientError,
    KafkaTxError,
    NotInTransactionError,
    OutageTooLongError,
    OutputError,
    OutputRefusedError,
    ProcessCrashedError,
    RecordFailedError,
    RecordRejectedError,
    RecoveryError,
    RecoveryExhaustedError,
    RetriableError,
    StuckCallError,
    TransactionAbortableError,
    UnknownTopicError,
    UnproducibleTypeError,
)
from kafkatx.errors.classification import ErrorClass, classify
from kafkatx.health import HealthServer, serve_health
from kafkatx.listener.host import Unit
from kafkatx.listener.transaction.unit import TransactionUnit
from kafkatx.record import Output, Record
from kafkatx.recoverers import CompositeRecoverer, LoggingRecoverer, Recoverer
from kafkatx.rollback.classifier import ExceptionClassifier
from kafkatx.rollback.policy import FailurePolicy
from kafkatx.rollback.processor import AfterRollbackProcessor, DefaultAfterRollbackProcessor, RollbackContext

__all__ = [
    "AfterRollbackProcessor",
    "App",
    "ApplicationRecoverableError",
    "ClusterUnreachableError",
    "CompositeRecoverer",
    "ContainerError",
    "DatabaseUnavailableError",
    "DeadLetterPublishError",
    "DeadLetterPublishingRecoverer",
    "DecodeError",
    "DefaultAfterRollbackProcessor",
    "DependencyUnavailable",
    "DeserializationError",
    "ErrorClass",
    "ExceptionClassifier",
    "FailurePolicy",
    "FencedTooOftenError",
    "GroupMembershipChanged",
    "HealthServer",
    "InvalidConfigurationError",
    "OutputRefusedError",
    "KafkaClientError",
    "KafkaTxError",
    "LoggingRecoverer",
    "NotInTransactionError",
    "OutageTooLongError",
    "Output",
    "OutputError",
    "ProcessCrashedError",
    "Record",
    "RecordFailedError",
    "RecordRejectedError",
    "Recoverer",
    "RecoveryError",
    "RecoveryExhaustedError",
    "RetriableError",
    "RollbackContext",
    "StuckCallError",
    "Transaction",
    "TransactionAbortableError",
    "TransactionUnit",
    "Unit",
    "UnknownTopicError",
    "UnproducibleTypeError",
    "__version__",
    "classify",
    "db",
    "send",
    "serve_health",
]
