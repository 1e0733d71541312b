"""A listener's declaration: its handler, topics and options, validated up front.

Everything a user can get wrong is checked when the decorator runs, so a bad
option fails at import time with a message naming it, not at 3 a.m.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from tenacity.wait import wait_base

from kafkatx.errors import InvalidConfigurationError
from kafkatx.listener.outputs import Serializer
from kafkatx.recoverers import LoggingRecoverer, Recoverer, as_recoverer
from kafkatx.rollback.backoff import as_wait
from kafkatx.rollback.classifier import ExceptionClassifier

__all__ = ["ListenerSpec", "Fencing", "RetryMode", "validate_topic"]

Fencing = Literal["group", "partition"]
RetryMode = Literal["rollback", "in_place"]
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


def validate_topic(name: Any, what: str) -> str:
    if not isinstance(name, str) or not _TOPIC.match(name) or name in (".", ".."):
        raise InvalidConfigurationError(
            f"{what} {name!r} is not a valid Kafka topic name (1-249 characters of letters, digits, '.', '_', '-')"
        )
    return name


def _positive_int(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidConfigurationError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(slots=True)
class ListenerSpec:
    """Everything the container needs to run one listener."""

    name: str
    handler: Callable[..., Any]
    topics: tuple[str, ...]
    output: str | None = None
    kind: Literal["record", "batch"] = "record"
    max_batch_records: int = 5000
    max_batch_ms: int = 100
    max_transaction_ms: int | None = None
    fencing: Fencing = "group"
    concurrency: int = 1
    max_attempts: int = 3
    backoff: wait_base | None = None
    recoverer: Recoverer = field(default_factory=LoggingRecoverer)
    dlq_topic: str | None = None
    classifier: ExceptionClassifier = field(default_factory=ExceptionClassifier)
    after_rollback: Any = None
    max_recovery_failures: int | None = None
    recovery_backoff: wait_base | None = None
    retry: RetryMode = "rollback"
    serializer: Serializer | None = None
    group_id: str | None = None
    consumer_config: dict[str, Any] = field(default_factory=dict)
    producer_config: dict[str, Any] = field(default_factory=dict)
    max_abortable_retries: int = 5
    idle_event_interval: float | None = None
    options: dict[str, Any] = field(default_factory=dict)


def build_spec(
    handler: Any,
    topics: Iterable[str],
    *,
    name: str | None = None,
    output: str | None = None,
    kind: Literal["record", "batch"] = "record",
    max_batch_records: int = 5000,
    max_batch_ms: int = 100,
    max_transaction_ms: int | None = None,
    fencing: str = "group",
    concurrency: int = 1,
    max_attempts: int = 3,
    backoff: Any = None,
    dlq: Any = False,
    not_retryable: Iterable[type[BaseException]] = (),
    retryable: Iterable[type[BaseException]] = (),
    default_not_retryable: bool = True,
    after_rollback: Any = None,
    max_recovery_failures: int | None = None,
    recovery_backoff: Any = None,
    retry: str = "rollback",
    serializer: Serializer | None = None,
    group_id: str | None = None,
    consumer_config: dict[str, Any] | None = None,
    producer_config: dict[str, Any] | None = None,
    max_abortable_retries: int = 5,
    idle_event_interval: float | None = None,
    options: dict[str, Any] | None = None,
) -> ListenerSpec:
    """Validate listener options and build a :class:`ListenerSpec`."""
    import tenacity

    if not callable(handler):
        raise InvalidConfigurationError(
            f"a listener handler must be callable (a function taking a Record), got {type(handler).__name__} {handler!r}"
        )
    topics = tuple(topics)
    if not topics:
        raise InvalidConfigurationError("a listener needs at least one input topic")
    for t in topics:
        validate_topic(t, "input topic")
    if len(set(topics)) != len(topics):
        raise InvalidConfigurationError(f"input topics listed twice: {topics}")
    if output is not None:
        validate_topic(output, "output topic")
        if output in topics:
            raise InvalidConfigurationError(f"output topic {output!r} is also an input topic of the same listener (a loop)")
    if fencing not in ("group", "partition"):
        raise InvalidConfigurationError(f"fencing must be 'group' (KIP-447) or 'partition' (KIP-98), got {fencing!r}")
    if retry not in ("rollback", "in_place"):
        raise InvalidConfigurationError(f"retry must be 'rollback' or 'in_place', got {retry!r}")
    if max_recovery_failures is not None:
        _positive_int(max_recovery_failures, "max_recovery_failures")
    if idle_event_interval is not None and (
        isinstance(idle_event_interval, bool) or not isinstance(idle_event_interval, (int, float)) or idle_event_interval <= 0
    ):
        raise InvalidConfigurationError(f"idle_event_interval must be a number of seconds > 0, got {idle_event_interval!r}")
    if max_transaction_ms is not None:
        _positive_int(max_transaction_ms, "max_transaction_ms")
    if serializer is not None and not callable(serializer):
        raise InvalidConfigurationError(f"serializer must be callable, got {serializer!r}")
    if max_batch_ms < 0 or isinstance(max_batch_ms, bool) or not isinstance(max_batch_ms, int):
        raise InvalidConfigurationError(f"max_batch_ms must be an integer >= 0, got {max_batch_ms!r}")
    try:
        wait = as_wait(backoff)
        rwait = as_wait(recovery_backoff) if recovery_backoff is not None else tenacity.wait_exponential(multiplier=0.5, max=30)
        classifier = ExceptionClassifier(not_retryable, retryable=retryable, include_defaults=default_not_retryable)
    except (TypeError, ValueError) as exc:
        raise InvalidConfigurationError(str(exc)) from exc

    dlq_topic: str | None = None
    recoverer: Recoverer
    if dlq is False or dlq is None:
        recoverer = LoggingRecoverer()
    elif dlq is True or isinstance(dlq, str):
        from kafkatx.dlq.publisher import DeadLetterPublishingRecoverer

        if isinstance(dlq, str):
            dlq_topic = validate_topic(dlq, "dead-letter topic")
            if dlq_topic in topics:
                raise InvalidConfigurationError(f"dead-letter topic {dlq!r} is also an input topic")
        recoverer = DeadLetterPublishingRecoverer(dlq_topic)
    elif callable(dlq):
        recoverer = as_recoverer(dlq)
    else:
        raise InvalidConfigurationError(
            f"dlq must be False, True (<topic>-dlt), a topic name, or a recoverer (record, exception) -> None; got {dlq!r}"
        )
    if after_rollback is not None and not callable(getattr(after_rollback, "process", None)):
        raise InvalidConfigurationError(
            f"after_rollback must be an AfterRollbackProcessor (an object with process(context)), got {after_rollback!r}"
        )
    return ListenerSpec(
        name=name or getattr(handler, "__qualname__", None) or type(handler).__name__,
        handler=handler,
        topics=topics,
        output=output,
        kind=kind,
        max_batch_records=_positive_int(max_batch_records, "max_batch_records"),
        max_batch_ms=max_batch_ms,
        max_transaction_ms=max_transaction_ms,
        fencing=fencing,  # type: ignore[arg-type]
        concurrency=_positive_int(concurrency, "concurrency"),
        max_attempts=_positive_int(max_attempts, "max_attempts"),
        backoff=wait,
        recoverer=recoverer,
        dlq_topic=dlq_topic,
        classifier=classifier,
        after_rollback=after_rollback,
        max_recovery_failures=max_recovery_failures,
        recovery_backoff=rwait,
        retry=retry,  # type: ignore[arg-type]
        serializer=serializer,
        group_id=group_id,
        consumer_config=dict(consumer_config or {}),
        producer_config=dict(producer_config or {}),
        max_abortable_retries=_positive_int(max_abortable_retries, "max_abortable_retries", 0),
        idle_event_interval=float(idle_event_interval) if idle_event_interval is not None else None,
        options=dict(options or {}),
    )
