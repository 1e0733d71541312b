"""Retrying retriable Kafka errors inside kafkatx, so that handlers never see them (KIP-1050)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Final, Generic, TypeVar

from confluent_kafka import KafkaError, KafkaException
from tenacity import RetryCallState, Retrying, retry_if_exception, wait_exponential, wait_random

from kafkatx.errors import CLASS_EXCEPTIONS, InvalidConfigurationError, KafkaClientError, KafkaTxError, RetriableError
from kafkatx.errors.classification import (
    ABORT_OPERATION,
    BEFORE_TRANSACTION_OPERATIONS,
    ErrorClass,
    ErrorPath,
    classify,
    kafka_error_of,
)
from kafkatx.errors.hints import label

__all__ = ["retry_call"]

log = logging.getLogger("kafkatx.errors")

T = TypeVar("T")

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
    first_failure: KafkaException | None = None,
    where: str | None = None,
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
    and for ``init_transactions`` and the other calls of BEFORE_TRANSACTION_OPERATIONS (no transaction to abort yet), it is
    :class:`RetriableError`. Other Kafka errors raise their typed
    :class:`~kafkatx.errors.KafkaClientError` at once; for ``abort_transaction`` an abortable
    error is raised as :class:`ApplicationRecoverableError`. The kafkatx
    error is chained from the last Kafka exception. Handler failures (any
    non-Kafka exception, and (de)serialization errors) propagate unchanged.

    ``where`` (e.g. the producer's transactional.id and bootstrap servers)
    goes into the message of retries that ran out: at startup, it is what
    tells a user which cluster did not answer.

    ``sleep`` and ``clock`` are injectable so that tests need not wait.
    ``first_failure`` is how a first attempt made elsewhere failed (the
    producer's combined offsets-and-commit call): it is replayed as attempt 1
    instead of calling ``fn``.
    """
    if timeout < 0:
        raise InvalidConfigurationError(f"retry timeout for {operation} must be >= 0 seconds, got {timeout}")
    deadline = clock() + timeout
    if first_failure is None:
        try:
            return fn()  # the common case, without the retry machinery below (~10 us per call)
        except KafkaException as exc:
            first_failure = exc  # replayed as attempt 1 below: classification, callbacks and backoff unchanged
    attempts = _Attempts(fn, first_failure)
    retrying = Retrying(
        retry=retry_if_exception(lambda exc: isinstance(exc, KafkaException) and classify(exc, path=path).retriable),
        stop=lambda _state: clock() >= deadline,
        wait=lambda state: max(0.0, min(_BACKOFF(state), deadline - clock())),
        sleep=sleep,
        before_sleep=functools.partial(
            _before_retry, operation=operation, path=path, refresh=refresh, on_retry=on_retry
        ),
        reraise=True,
    )
    try:
        return retrying(attempts)
    except KafkaException as exc:
        error_class = classify(exc, path=path)
        if error_class is ErrorClass.HANDLER_FAILURE:
            raise
        if not error_class.retriable:
            raise KafkaTxError.from_kafka(exc, operation=operation, path=path) from exc
        raise _exhausted(exc, operation, path, timeout, attempts.count, where) from exc


class _Attempts(Generic[T]):
    """``fn`` as tenacity calls it, counting the attempts; a first attempt that failed elsewhere is replayed."""

    def __init__(self, fn: Callable[[], T], first_failure: KafkaException | None) -> None:
        self._fn, self._first_failure = fn, first_failure
        self.count = 0

    def __call__(self) -> T:
        self.count += 1
        if self._first_failure is not None:
            failure, self._first_failure = self._first_failure, None
            raise failure
        return self._fn()


def _before_retry(
    retry_state: RetryCallState,
    *,
    operation: str,
    path: ErrorPath,
    refresh: Callable[[], None] | None,
    on_retry: Callable[[ErrorClass, KafkaError, int], None] | None,
) -> None:
    """Between two attempts: log the failure, refresh metadata if the error class asks for it, tell ``on_retry``."""
    exc = retry_state.outcome.exception() if retry_state.outcome is not None else None
    error_class = classify(exc, path=path)
    kafka_error = kafka_error_of(exc)
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


def _exhausted(
    exc: KafkaException, operation: str, path: ErrorPath, timeout: float, attempts: int, where: str | None = None
) -> KafkaClientError:
    """The error for a retriable Kafka error whose retries ran out."""
    kafka_error = kafka_error_of(exc)
    name = kafka_error.name() if kafka_error is not None else type(exc).__name__
    reason = kafka_error.str() if kafka_error is not None else str(exc)
    summary = (
        f"{operation}{f' ({where})' if where else ''} still failed with {name} ({reason}) "
        f"after {attempts} attempt(s) in {timeout:g} s."
    )
    check = (
        "Check broker availability and the transaction coordinator's logs; kafkatx retries a call for half "
        "the App's transaction_timeout_ms."
    )
    if path == "transaction" and operation not in BEFORE_TRANSACTION_OPERATIONS:
        if operation == ABORT_OPERATION:
            error_class = ErrorClass.APPLICATION_RECOVERABLE
            why = "An abort that cannot complete leaves the producer unusable."
        else:
            error_class = ErrorClass.ABORTABLE
            why = "The transaction cannot wait any longer, so it must be aborted (KIP-1050)."
        cls: type[KafkaClientError] = CLASS_EXCEPTIONS[error_class]
        return cls(
            f"{summary} {why} {check} [{label(error_class)}: {error_class.reaction}]",
            error=kafka_error,
            operation=operation,
        )
    return RetriableError(
        f"{summary} {check}",
        error=kafka_error,
        error_class=classify(exc, path=path),
        operation=operation,
    )
