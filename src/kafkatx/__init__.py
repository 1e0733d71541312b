"""kafkatx: transactional Kafka listener containers for Python.

Handlers declared with ``@app.listener`` run inside Kafka transactions: their
outputs and the consumed offsets commit atomically, failures roll back and go
through an after-rollback processor (attempts, back-off, dead-letter topic).
"""

from kafkatx._version import __version__
from kafkatx.app import App, Transaction
from kafkatx.dlq.publisher import DeadLetterPublishingRecoverer
from kafkatx.errors import (
    ApplicationRecoverableError,
    ErrorClass,
    InvalidConfigurationError,
    KafkaTxError,
    TransactionAbortableError,
    classify,
)
from kafkatx.listener.container import ContainerError, RecoveryExhaustedError
from kafkatx.listener.context import send
from kafkatx.listener.outputs import OutputError
from kafkatx.record import Output, Record
from kafkatx.recoverers import CompositeRecoverer, LoggingRecoverer, Recoverer
from kafkatx.rollback.classifier import DeserializationError
from kafkatx.rollback.processor import AfterRollbackProcessor, DefaultAfterRollbackProcessor, RollbackContext

__all__ = [
    "AfterRollbackProcessor",
    "App",
    "ApplicationRecoverableError",
    "CompositeRecoverer",
    "ContainerError",
    "DeadLetterPublishingRecoverer",
    "DefaultAfterRollbackProcessor",
    "DeserializationError",
    "ErrorClass",
    "InvalidConfigurationError",
    "KafkaTxError",
    "LoggingRecoverer",
    "Output",
    "OutputError",
    "Record",
    "Recoverer",
    "RecoveryExhaustedError",
    "RollbackContext",
    "Transaction",
    "TransactionAbortableError",
    "__version__",
    "classify",
    "send",
]
